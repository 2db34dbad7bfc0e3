//! Destinations' names, which the relay, the operator's API and the command all check.

use crate::error::{Error, Result};

/// The longest destination name and pattern.
pub(crate) const MAX_DESTINATION_LEN: usize = 255;

/// Checks a destination's name: 1 to 255 characters, letters, digits and `. _ - : / * #`.
pub(crate) fn validate_destination_name(name: &str) -> Result<()> {
    if name.is_empty() || name.chars().count() > MAX_DESTINATION_LEN {
        return Err(Error::config(format!(
            "destination name {name:?}: it must be 1 to {MAX_DESTINATION_LEN} characters long"
        )));
    }
    if let Some(c) = name.chars().find(|c| !(c.is_ascii_alphanumeric() || "._-:/*#".contains(*c))) {
        return Err(Error::config(format!(
            "destination name {name:?}: {c:?} is not allowed (letters, digits and . _ - : / * # only)"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        validate_destination_name("erp").unwrap();
        validate_destination_name("order.#").unwrap();
        assert!(validate_destination_name("").is_err());
        assert!(validate_destination_name("a b").unwrap_err().to_string().contains("not allowed"));
        assert!(validate_destination_name(&"x".repeat(256)).is_err());
    }
}
