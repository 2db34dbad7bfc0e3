//! Payloads: JSON text as PostgreSQL stores it, delivered as written, and what one may be.
//!
//! A payload travels as **text**: the relay reads the `jsonb` column's own text and every sink
//! sends that text, never a re-encoding of it, so numbers keep every digit
//! (`1.7976931348623157e308` arrives as the 309 digits PostgreSQL prints, `0.1` as `0.1`, a
//! 40-digit decimal whole). See [`Payload`].
//!
//! The rules, checked the same way by the Rust API and by the SQL function
//! `outbox_relay.publish` (migrations 0003 and 0007), so that every accepted event can be
//! delivered:
//! - **Size**: the bytes of the payload's text as PostgreSQL prints the `jsonb`
//!   (`octet_length(payload::text)`: `{"a": 1, "b": [1, 2]}`, numbers in full), at most
//!   [`Payload::MAX_BYTES`]. The limit is 1 MiB less 8 KiB so that the event's envelope (id,
//!   topic, key, timestamps) and a broker's headers fit in 1 MiB, NATS' default `max_payload`.
//! - **Nesting**: at most [`Payload::MAX_DEPTH`] arrays and objects inside each other, so the
//!   delivered envelope stays within serde_json's (and most parsers') recursion limit of 128.
//! - **No NUL** (`\u0000`) in any string or key: `jsonb` cannot store it.
//!
//! Any number `jsonb` takes is deliverable (PostgreSQL's `numeric`: `1e999` too); whether a
//! consumer can read it into a double is the consumer's business, not the outbox's.

use std::fmt;

use serde::Serialize;
use serde_json::Value;
use serde_json::value::RawValue;
use tokio_postgres::types::{FromSql, Type};

use crate::error::{Error, Result};

/// An event's payload: JSON text, exactly as PostgreSQL stored it.
///
/// What the relay hands to a handler is the `jsonb` column's own text (`{"a": 1, "b": [1, 2]}`:
/// PostgreSQL's spacing, keys in its order, numbers with every digit it keeps), and the sinks
/// send that text unchanged: in the event's JSON object it is the `payload` member, byte for
/// byte. Nothing goes through `f64`, so a consumer checking an amount or a signature over the
/// body sees the document that was written.
///
/// Read it with [`Payload::get`] (the text), [`Payload::parse`] (into your own type) or
/// [`Payload::to_value`].
///
/// ```
/// let payload = pg_outbox_relay::Payload::from_json(r#"{"amount": 12.50}"#).unwrap();
/// assert_eq!(payload.get(), r#"{"amount": 12.50}"#);
/// assert_eq!(payload.to_value().unwrap()["amount"], 12.5);
/// ```
#[derive(Clone)]
pub struct Payload(Box<RawValue>);

impl Payload {
    /// The largest payload, in bytes of its text as PostgreSQL prints the `jsonb` (1 MiB − 8 KiB).
    pub const MAX_BYTES: usize = (1 << 20) - 8 * 1024;
    /// The most arrays and objects a payload may nest inside each other.
    pub const MAX_DEPTH: usize = 100;
}

impl Payload {
    /// Takes JSON text as it is (after checking that it is JSON): a payload published this way
    /// keeps the digits of its numbers, which a [`serde_json::Value`] would round to `f64`.
    pub fn from_json(text: impl Into<String>) -> Result<Self> {
        RawValue::from_string(text.into())
            .map(Payload)
            .map_err(|e| Error::invalid_input(format!("the payload is not JSON: {e}")))
    }

    /// The JSON text of `value` as serde_json writes it (valid JSON: no second parse to check).
    pub(crate) fn serialized(value: &impl Serialize) -> Result<Self> {
        Ok(Payload(serde_json::value::to_raw_value(value)?))
    }

    /// The JSON text.
    pub fn get(&self) -> &str {
        self.0.get()
    }

    /// Reads the payload into `T`.
    pub fn parse<'a, T: serde::Deserialize<'a>>(&'a self) -> serde_json::Result<T> {
        serde_json::from_str(self.0.get())
    }

    /// Reads the payload into a [`serde_json::Value`]; numbers beyond `f64` fail, and long
    /// decimals are rounded to the nearest `f64`.
    pub fn to_value(&self) -> serde_json::Result<Value> {
        self.parse()
    }
}

impl fmt::Debug for Payload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Payload").field(&self.0.get()).finish()
    }
}

/// The JSON text.
impl fmt::Display for Payload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0.get())
    }
}

/// Two payloads are equal when their texts are.
impl PartialEq for Payload {
    fn eq(&self, other: &Self) -> bool {
        self.0.get() == other.0.get()
    }
}

impl Eq for Payload {}

/// Serialized as the JSON it holds, verbatim.
impl Serialize for Payload {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        self.0.serialize(serializer)
    }
}

/// Read from a `jsonb` or `json` column: the server's text of it, unchanged.
impl<'a> FromSql<'a> for Payload {
    fn from_sql(ty: &Type, raw: &'a [u8]) -> std::result::Result<Self, Box<dyn std::error::Error + Sync + Send>> {
        let text = if *ty == Type::JSONB {
            match raw.split_first() {
                Some((1, text)) => text,
                _ => return Err("unsupported jsonb encoding version".into()),
            }
        } else {
            raw
        };
        // One pass checks the UTF-8 and the JSON, and copies the text.
        Ok(Payload(serde_json::from_slice(text)?))
    }

    fn accepts(ty: &Type) -> bool {
        matches!(*ty, Type::JSONB | Type::JSON)
    }
}

/// Checks an event payload's text against every rule of the module documentation; `what` names
/// the value in the message (e.g. `payload of an "order.placed" event`).
pub(crate) fn check_payload(what: &str, payload: &Payload) -> Result<()> {
    let size = pg_text_len(what, payload.get())?;
    if size > Payload::MAX_BYTES {
        return Err(Error::invalid_input(format!(
            "{what} is {size} bytes of JSON (as PostgreSQL prints it); the limit is {max}",
            max = Payload::MAX_BYTES
        )));
    }
    Ok(())
}

/// The payload of a [`Value`]: its nesting and strings checked first (so that a value nested
/// a million deep is refused before a recursive serializer sees it), then its text.
pub(crate) fn payload_of_value(what: &str, value: &Value) -> Result<Payload> {
    check_storable(what, value)?;
    Payload::serialized(value)
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
        if depth > Payload::MAX_DEPTH {
            return Err(too_deep(what));
        }
        stack.extend(children.map(|child| (child, depth + 1)));
    }
    Ok(())
}

fn too_deep(what: &str) -> Error {
    Error::invalid_input(format!("{what} nests arrays and objects more than {max} deep", max = Payload::MAX_DEPTH))
}

fn check_no_nul(what: &str, text: &str) -> Result<()> {
    if text.contains('\0') {
        return Err(Error::invalid_input(format!(
            "{what} contains a NUL character (\\u0000), which PostgreSQL's jsonb cannot store"
        )));
    }
    Ok(())
}

/// Whether valid JSON `text` nests arrays and objects more than [`Payload::MAX_DEPTH`] deep (a
/// row written by hand past both doors): one pass over its bytes, strings skipped.
pub(crate) fn too_deep_text(text: &str) -> bool {
    let bytes = text.as_bytes();
    let (mut at, mut depth) = (0, 0usize);
    while let Some(&b) = bytes.get(at) {
        match b {
            b'[' | b'{' => {
                depth += 1;
                if depth > Payload::MAX_DEPTH {
                    return true;
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            b'"' => {
                at = string_end(bytes, at);
                continue;
            }
            _ => {}
        }
        at += 1;
    }
    false
}

/// The length of valid JSON `text` as PostgreSQL prints it once stored as `jsonb`: `", "` and
/// `": "` between items, no other white space, strings escaped as jsonb escapes them, and each
/// number as `numeric` prints it (`1.5e+300` becomes 301 digits; `1e-7` becomes `0.0000001`;
/// `-0.0` becomes `0.0`). Checks the nesting and NUL on the way. (Duplicate keys, which jsonb
/// keeps one of, count as written: the length is never under jsonb's.)
fn pg_text_len(what: &str, text: &str) -> Result<usize> {
    if too_deep_text(text) {
        return Err(too_deep(what));
    }
    let bytes = text.as_bytes();
    let (mut at, mut len) = (0, 0usize);
    while let Some(&b) = bytes.get(at) {
        match b {
            b' ' | b'\t' | b'\n' | b'\r' => at += 1,
            b'[' | b'{' | b']' | b'}' => {
                len += 1;
                at += 1;
            }
            b',' | b':' => {
                len += 2;
                at += 1;
            }
            b'"' => {
                let end = string_end(bytes, at);
                let decoded: String = serde_json::from_str(&text[at..end])?;
                check_no_nul(what, &decoded)?;
                len += jsonb_string_len(&decoded);
                at = end;
            }
            b't' | b'n' => {
                len += 4;
                at += 4;
            }
            b'f' => {
                len += 5;
                at += 5;
            }
            _ => {
                let end = at
                    + bytes[at..]
                        .iter()
                        .take_while(|b| matches!(b, b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E'))
                        .count();
                len = len.saturating_add(numeric_text_len(&text[at..end.max(at + 1)]));
                at = end.max(at + 1);
            }
        }
    }
    Ok(len)
}

/// Where the JSON string that starts at `start` (its opening quote) ends, past its closing quote.
fn string_end(bytes: &[u8], start: usize) -> usize {
    let mut at = start + 1;
    while let Some(&b) = bytes.get(at) {
        match b {
            b'\\' => at += 2,
            b'"' => return at + 1,
            _ => at += 1,
        }
    }
    bytes.len()
}

/// The length of a string as jsonb prints it: quoted, `"` and `\` and the controls escaped
/// (`\n` and its kin in two bytes, the others as `\u00XX`), everything else as UTF-8.
fn jsonb_string_len(text: &str) -> usize {
    2 + text
        .bytes()
        .map(|b| match b {
            b'"' | b'\\' | 0x08 | 0x0c | b'\n' | b'\r' | b'\t' => 2,
            0..0x20 => 6,
            _ => 1,
        })
        .sum::<usize>()
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

    /// Both doors: a value, and the same as JSON text.
    fn check(value: &Value) -> Result<()> {
        check_payload("p", &payload_of_value("p", value)?)?;
        check_payload("p", &Payload::from_json(value.to_string())?)
    }

    fn len(text: &str) -> usize {
        pg_text_len("p", text).unwrap()
    }

    #[test]
    fn the_size_is_that_of_the_jsonb_text() {
        assert_eq!(len(r#"{"a":1,"b":[1,2]}"#), r#"{"a": 1, "b": [1, 2]}"#.len());
        assert_eq!(len(" [ ] "), 2);
        assert_eq!(len(&json!({"x": "a\"b\u{1}"}).to_string()), r#"{"x": "a\"b\u0001"}"#.len());
        assert_eq!(len("1e-7"), "0.0000001".len());
        // escapes as jsonb prints them: \u00e9 is two bytes of UTF-8, \/ a slash, \n stays two
        assert_eq!(len(r#"["\u00e9\/\n\t\u001f", true, false, null]"#), r#"["é/\n\t\u001f", true, false, null]"#.len());
        assert_eq!(len(r#""\ud83d\ude00""#), "\"😀\"".len());
        assert_eq!(len("-0"), 1);
        assert_eq!(len("1E+3"), 4);
    }

    #[test]
    fn nesting_is_limited() {
        let mut value = json!(1);
        for _ in 0..Payload::MAX_DEPTH {
            value = json!([value]);
        }
        assert!(check(&value).is_ok());
        let deeper = json!({"a": value});
        let err = payload_of_value("p", &deeper).unwrap_err();
        assert!(err.is_invalid_input() && err.to_string().contains("more than 100 deep"), "{err}");
        let err = check_payload("p", &Payload::from_json(deeper.to_string()).unwrap()).unwrap_err();
        assert!(err.is_invalid_input() && err.to_string().contains("more than 100 deep"), "{err}");
        // a scalar or an empty container at the limit is fine; one more container is not
        let mut empty = json!([]);
        for _ in 1..Payload::MAX_DEPTH {
            empty = json!([empty]);
        }
        assert!(check(&empty).is_ok());
        assert!(payload_of_value("p", &json!([empty])).is_err());
        // brackets inside strings are not nesting
        assert!(check(&json!([["[[[[".repeat(100)]])).is_ok());
    }

    #[test]
    fn nul_characters_are_refused_in_strings_and_keys() {
        for value in [json!("a\u{0}b"), json!({"k\u{0}": 1}), json!([{"x": ["\u{0}"]}])] {
            let err = payload_of_value("payload", &value).unwrap_err();
            assert!(err.is_invalid_input() && err.to_string().contains("NUL"), "{err}");
            let err = check_payload("payload", &Payload::from_json(value.to_string()).unwrap()).unwrap_err();
            assert!(err.is_invalid_input() && err.to_string().contains("NUL"), "{err}");
        }
        // an escaped backslash before u0000 is no NUL
        assert!(check_payload("p", &Payload::from_json(r#""\\u0000""#).unwrap()).is_ok());
    }

    #[test]
    fn the_size_limit_is_exact() {
        let fits = json!("x".repeat(Payload::MAX_BYTES - 2));
        assert!(check(&fits).is_ok());
        let over = json!("x".repeat(Payload::MAX_BYTES - 1));
        let err = check(&over).unwrap_err();
        assert!(err.to_string().contains(&format!("the limit is {max}", max = Payload::MAX_BYTES)), "{err}");
    }

    #[test]
    fn text_that_is_not_json_is_refused() {
        for bad in ["", "{", "[1,]", "01", "nul"] {
            let err = Payload::from_json(bad).unwrap_err();
            assert!(err.is_invalid_input() && err.to_string().contains("not JSON"), "{bad}: {err}");
        }
    }

    #[test]
    fn a_payload_serializes_as_its_text() {
        let payload = Payload::from_json(r#"{"n": 1.7976931348623158e308, "d": 0.10}"#).unwrap();
        let envelope = serde_json::to_string(&[&payload]).unwrap();
        assert_eq!(envelope, r#"[{"n": 1.7976931348623158e308, "d": 0.10}]"#);
        assert_eq!(payload.to_string(), payload.get());
    }
}
