//! What a JSON payload may be, checked the same way by the Rust API and by the SQL function
//! `outbox_relay.publish` (migration 0003), so that every accepted event can be delivered.
//!
//! - **Size**: the bytes of the payload's text as PostgreSQL prints the `jsonb`
//!   (`octet_length(payload::text)`: `{"a": 1, "b": [1, 2]}`, numbers in full), at most
//!   [`MAX_PAYLOAD_BYTES`]. The limit is 1 MiB less 8 KiB so that the event's envelope (id,
//!   topic, key, timestamps) and a broker's headers fit in 1 MiB, NATS' default `max_payload`.
//!   The relay's own JSON of a payload (compact, numbers as `f64` prints them) is never longer.
//! - **Nesting**: at most [`MAX_PAYLOAD_DEPTH`] arrays and objects inside each other, so the
//!   delivered envelope stays within serde_json's (and most parsers') recursion limit of 128.
//! - **Numbers** within the range of an `f64` (a Rust `Value` cannot hold others; SQL can
//!   write `1e999`, which no consumer using doubles could read).
//! - **No NUL** (`\u0000`) in any string or key: `jsonb` cannot store it.

use std::io;

use serde::Serialize;
use serde_json::Value;

use crate::error::{Error, Result};

/// The largest payload, in bytes of its text as PostgreSQL prints the `jsonb` (1 MiB − 8 KiB).
pub const MAX_PAYLOAD_BYTES: usize = (1 << 20) - 8 * 1024;
/// The most arrays and objects a payload may nest inside each other.
pub const MAX_PAYLOAD_DEPTH: usize = 100;

/// Checks an event payload against every rule of the module documentation; `what` names the
/// value in the message (e.g. `payload of an "order.placed" event`).
pub(crate) fn check_payload(what: &str, value: &Value) -> Result<()> {
    check_storable(what, value)?;
    let size = pg_text_len(value);
    if size > MAX_PAYLOAD_BYTES {
        return Err(Error::invalid_input(format!(
            "{what} is {size} bytes of JSON (as PostgreSQL prints it); the limit is {MAX_PAYLOAD_BYTES}"
        )));
    }
    Ok(())
}

/// Checks that `jsonb` can store a value and serde_json can read it back: nesting and NUL.
pub(crate) fn check_storable(what: &str, value: &Value) -> Result<()> {
    // Iterative, so that a value nested a million deep cannot overflow the stack here.
    let mut stack: Vec<(&Value, usize)> = vec![(value, 1)];
    while let Some((value, depth)) = stack.pop() {
        let children: Box<dyn Iterator<Item = &Value>> = match value {
            Value::String(s) => {
                check_no_nul(what, s)?;
                continue;
            }
            Value::Array(items) => Box::new(items.iter()),
            Value::Object(map) => {
                for key in map.keys() {
                    check_no_nul(what, key)?;
                }
                Box::new(map.values())
            }
            Value::Null | Value::Bool(_) | Value::Number(_) => continue,
        };
        if depth > MAX_PAYLOAD_DEPTH {
            return Err(Error::invalid_input(format!(
                "{what} nests arrays and objects more than {MAX_PAYLOAD_DEPTH} deep"
            )));
        }
        stack.extend(children.map(|child| (child, depth + 1)));
    }
    Ok(())
}

fn check_no_nul(what: &str, text: &str) -> Result<()> {
    if text.contains('\0') {
        return Err(Error::invalid_input(format!(
            "{what} contains a NUL character (\\u0000), which PostgreSQL's jsonb cannot store"
        )));
    }
    Ok(())
}

/// The length of `value`'s text as PostgreSQL prints it once stored as `jsonb`: `", "` and `": "`
/// between items, and each number as `numeric` prints what serde_json sent (`1.5e+300` becomes
/// 301 digits; `1e-7` becomes `0.0000001`; `-0.0` becomes `0.0`). Call it on a value that passed
/// [`check_storable`] (its depth is bounded).
pub(crate) fn pg_text_len(value: &Value) -> usize {
    let mut counter = Counter(0);
    let mut serializer = serde_json::Serializer::with_formatter(&mut counter, PgFormatter);
    // Writing to a counter cannot fail, and a `Value` always serializes.
    let _infallible = value.serialize(&mut serializer);
    counter.0
}

/// Counts bytes.
struct Counter(usize);

impl io::Write for Counter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0 += buf.len();
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// serde_json's compact output with jsonb's separators, and floats as `numeric` prints them.
struct PgFormatter;

impl serde_json::ser::Formatter for PgFormatter {
    fn begin_array_value<W: ?Sized + io::Write>(&mut self, writer: &mut W, first: bool) -> io::Result<()> {
        if first { Ok(()) } else { writer.write_all(b", ") }
    }

    fn begin_object_key<W: ?Sized + io::Write>(&mut self, writer: &mut W, first: bool) -> io::Result<()> {
        if first { Ok(()) } else { writer.write_all(b", ") }
    }

    fn begin_object_value<W: ?Sized + io::Write>(&mut self, writer: &mut W) -> io::Result<()> {
        writer.write_all(b": ")
    }

    fn write_f64<W: ?Sized + io::Write>(&mut self, writer: &mut W, value: f64) -> io::Result<()> {
        // What serde_json sends to PostgreSQL for this number, then what numeric makes of it.
        let sent = serde_json::Number::from_f64(value).map(|n| n.to_string()).unwrap_or_else(|| "null".into());
        let len = numeric_text_len(&sent);
        for _ in 0..len {
            writer.write_all(b"0")?;
        }
        Ok(())
    }
}

/// The length of PostgreSQL's `numeric` output for a decimal literal such as `-1.25e-3`:
/// numeric keeps the digits and a display scale of `max(0, fraction digits - exponent)`, then
/// prints the integer part (at least `0`), the point and the scale's digits, without exponent.
fn numeric_text_len(literal: &str) -> usize {
    let (negative, unsigned) = match literal.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, literal),
    };
    let (mantissa, exponent) = match unsigned.find(['e', 'E']) {
        Some(e) => (&unsigned[..e], unsigned[e + 1..].parse::<i64>().unwrap_or(0)),
        None => (unsigned, 0),
    };
    let (int_digits, frac_digits) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let digits = format!("{int_digits}{frac_digits}");
    let scale = i64::try_from(frac_digits.len()).unwrap_or(i64::MAX) - exponent;
    let (integer_len, scale) = if scale <= 0 {
        // All digits are integer digits, followed by -scale zeros.
        let significant = digits.trim_start_matches('0').len();
        (if significant == 0 { 1 } else { significant + scale.unsigned_abs() as usize }, 0)
    } else {
        let scale = scale as usize;
        let integer = digits.len().saturating_sub(scale);
        let integer = digits[..integer].trim_start_matches('0').len();
        (integer.max(1), scale)
    };
    let zero = digits.bytes().all(|b| b == b'0');
    let sign = usize::from(negative && !zero);
    sign + integer_len + if scale > 0 { 1 + scale } else { 0 }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn numeric_lengths_follow_postgres() {
        let cases = [
            ("0", "0"),
            ("12", "12"),
            ("-12", "-12"),
            ("0.1", "0.1"),
            ("100.0", "100.0"),
            ("-0.0", "0.0"),
            ("1e-7", "0.0000001"),
            ("1.25e-3", "0.00125"),
            ("1e+21", "1000000000000000000000"),
            ("1.5e+300", &format!("15{}", "0".repeat(299))),
            ("1.2345678901234567e+23", "123456789012345670000000"),
            ("-1.5e-2", "-0.015"),
        ];
        for (literal, printed) in cases {
            assert_eq!(numeric_text_len(literal), printed.len(), "{literal}");
        }
    }

    #[test]
    fn the_size_is_that_of_the_jsonb_text() {
        assert_eq!(pg_text_len(&json!({"a": 1, "b": [1, 2]})), r#"{"a": 1, "b": [1, 2]}"#.len());
        assert_eq!(pg_text_len(&json!([])), 2);
        assert_eq!(pg_text_len(&json!({"x": "a\"b\u{1}"})), r#"{"x": "a\"b\u0001"}"#.len());
        assert_eq!(pg_text_len(&json!(1e-7)), "0.0000001".len());
    }

    #[test]
    fn nesting_is_limited() {
        let mut value = json!(1);
        for _ in 0..MAX_PAYLOAD_DEPTH {
            value = json!([value]);
        }
        assert!(check_payload("p", &value).is_ok());
        let deeper = json!({"a": value});
        let err = check_payload("p", &deeper).unwrap_err();
        assert!(err.is_invalid_input() && err.to_string().contains("more than 100 deep"), "{err}");
        // a scalar or an empty container at the limit is fine; one more container is not
        let mut empty = json!([]);
        for _ in 1..MAX_PAYLOAD_DEPTH {
            empty = json!([empty]);
        }
        assert!(check_payload("p", &empty).is_ok());
        assert!(check_payload("p", &json!([empty])).is_err());
    }

    #[test]
    fn nul_characters_are_refused_in_strings_and_keys() {
        for value in [json!("a\u{0}b"), json!({"k\u{0}": 1}), json!([{"x": ["\u{0}"]}])] {
            let err = check_payload("payload", &value).unwrap_err();
            assert!(err.is_invalid_input() && err.to_string().contains("NUL"), "{err}");
        }
    }

    #[test]
    fn the_size_limit_is_exact() {
        let fits = json!("x".repeat(MAX_PAYLOAD_BYTES - 2));
        assert!(check_payload("p", &fits).is_ok());
        let over = json!("x".repeat(MAX_PAYLOAD_BYTES - 1));
        let err = check_payload("p", &over).unwrap_err();
        assert!(err.to_string().contains(&format!("the limit is {MAX_PAYLOAD_BYTES}")), "{err}");
    }
}
