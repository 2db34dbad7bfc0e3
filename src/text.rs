//! Text from outside (a receiver's error body, a topic or key written by hand) as it may be shown
//! on a terminal or in a log.

use std::borrow::Cow;

/// `text` with every character that could act on a terminal or reorder what it shows written
/// out as `\u{..}`: the C0 and C1 controls and DEL (escape sequences, BEL, newlines), the bidi
/// controls (U+061C, U+200E, U+200F, U+202A to U+202E, U+2066 to U+2069) and the line and
/// paragraph separators (U+2028, U+2029). Everything else is kept; text with none of these
/// comes back borrowed.
///
/// The relay applies it to every [`DeliveryError`](crate::DeliveryError) message (so a
/// receiver's error body is safe in the logs, in `last_error`, in `status`), and the command
/// to what it prints.
///
/// ```
/// assert_eq!(pg_outbox_relay::printable("bad\u{1b}[2J \u{202e}gnp.exe"), "bad\\u{1b}[2J \\u{202e}gnp.exe");
/// ```
pub fn printable(text: &str) -> Cow<'_, str> {
    if !text.chars().any(unsafe_to_show) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if unsafe_to_show(c) {
            out.push_str(&format!("\\u{{{:x}}}", c as u32));
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// Up to `shown` of `ids`, comma-separated, and how many more there are: `1, 2, 3 and 7 more`.
pub(crate) fn some_ids(ids: &[i64], shown: usize) -> String {
    let listed: Vec<String> = ids.iter().take(shown).map(i64::to_string).collect();
    match ids.len().saturating_sub(shown) {
        0 => listed.join(", "),
        more => format!("{} and {more} more", listed.join(", ")),
    }
}

fn unsafe_to_show(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
        || matches!(c, '\u{2028}' | '\u{2029}')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controls_and_bidi_are_written_out() {
        assert!(matches!(printable("order.placed: 503 busy"), Cow::Borrowed(_)));
        assert_eq!(printable("a\u{7}b\u{9b}c\u{7f}"), "a\\u{7}b\\u{9b}c\\u{7f}");
        assert_eq!(printable("\u{1b}]0;pwned\u{7}"), "\\u{1b}]0;pwned\\u{7}");
        assert_eq!(printable("x\u{2066}y\u{2069}\u{200f}\u{2028}"), "x\\u{2066}y\\u{2069}\\u{200f}\\u{2028}");
        assert_eq!(printable("line\nnext\ttab"), "line\\u{a}next\\u{9}tab");
        assert_eq!(printable("ünïcödé 日本 😀"), "ünïcödé 日本 😀");
    }

    #[test]
    fn ids_are_listed_up_to_a_number() {
        assert_eq!(some_ids(&[1, 2, 3], 3), "1, 2, 3");
        assert_eq!(some_ids(&[1, 2, 3, 4, 5], 2), "1, 2 and 3 more");
        assert_eq!(some_ids(&[], 2), "");
    }
}
