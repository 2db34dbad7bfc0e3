//! Headers an event carries beside its payload: a writer's metadata (a correlation id, a
//! tenant, a content version) and W3C trace context (`traceparent`, `tracestate`). They are
//! stored with the event (`outbox_relay.outbox.headers`, checked there by
//! `outbox_relay.headers_problem`) and every sink sends them in its own way: HTTP headers, NATS
//! headers, AMQP headers, Kafka headers, CloudEvents extensions.
//!
//! The rules, the same in Rust and in the database (so a writer in any language gets them):
//! - a name is 1 to 64 letters, digits, `-`, `_` or `.`; names are unique regardless of case;
//! - a value is 1 to 1,024 characters of printable ASCII (space to `~`), neither starting nor
//!   ending with a space (HTTP would trim it), so it arrives unchanged through every sink;
//! - at most 32 headers, 8,192 bytes of names and values in all;
//! - the names the sinks set themselves are reserved: those beginning `outbox-`, `webhook-`,
//!   `ce-`, `ce_` or `nats-`, and the HTTP framing headers (`content-type`, `host`, ...);
//! - `traceparent` is a W3C trace context parent (`00-<32 hex>-<16 hex>-<2 hex>`, the ids not
//!   all zeros), `tracestate` comes only with it; both are written in lower case.

use serde::Serialize;
use serde::ser::SerializeMap;

use crate::error::{Error, Result};

/// An event's headers, in the order they were given (a stored event's in the order PostgreSQL
/// keeps a `jsonb` object's keys).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Headers(Vec<(String, String)>);

impl Headers {
    /// The W3C trace context header naming the span an event was published in.
    pub const TRACEPARENT: &'static str = "traceparent";
    /// The W3C trace context's vendor data, which comes only with [`Headers::TRACEPARENT`].
    pub const TRACESTATE: &'static str = "tracestate";
    /// The most headers an event may carry.
    pub const MAX_COUNT: usize = 32;
    /// The longest name, in characters.
    pub const MAX_NAME_LEN: usize = 64;
    /// The longest value, in characters.
    pub const MAX_VALUE_LEN: usize = 1024;
    /// The most bytes of names and values in all.
    pub const MAX_BYTES: usize = 8192;

    /// No headers.
    pub fn new() -> Self {
        Headers(Vec::new())
    }

    /// The value of `name` (any case), if present.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    /// The headers as (name, value) pairs.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.into_iter()
    }

    /// How many there are.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// There are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Sets `name` to `value`, replacing a header of that name in any case. Checked when the
    /// event is published.
    pub(crate) fn set(&mut self, name: String, value: String) {
        match self.0.iter_mut().find(|(n, _)| n.eq_ignore_ascii_case(&name)) {
            Some(entry) => *entry = (name, value),
            None => self.0.push((name, value)),
        }
    }

    /// The trace context the writer's span gave, if any.
    pub fn traceparent(&self) -> Option<&str> {
        self.get(Self::TRACEPARENT)
    }

    /// Checks every rule above; the error names the header and the rule.
    pub(crate) fn validate(&self) -> Result<()> {
        if self.0.len() > Self::MAX_COUNT {
            return Err(invalid(format!(
                "an event carries {} headers; the limit is {}",
                self.0.len(),
                Self::MAX_COUNT
            )));
        }
        let mut bytes = 0;
        for (i, (name, value)) in self.0.iter().enumerate() {
            check_name(name)?;
            if self.0[..i].iter().any(|(n, _)| n.eq_ignore_ascii_case(name)) {
                return Err(invalid(format!("header {name} is given twice (names are compared regardless of case)")));
            }
            check_value(name, value)?;
            bytes += name.len() + value.len();
        }
        if bytes > Self::MAX_BYTES {
            return Err(invalid(format!(
                "the headers are {bytes} bytes of names and values; the limit is {}",
                Self::MAX_BYTES
            )));
        }
        if let Some(parent) = self.get(Self::TRACEPARENT) {
            check_traceparent(parent)?;
        } else if self.get(Self::TRACESTATE).is_some() {
            return Err(invalid("header tracestate is given without traceparent"));
        }
        Ok(())
    }

    /// The JSON object stored in the `headers` column; `None` (SQL null) for no headers.
    pub(crate) fn to_json(&self) -> Option<String> {
        if self.0.is_empty() {
            return None;
        }
        Some(serde_json::to_string(self).expect("a map of strings serializes"))
    }

    /// The headers of a stored event (the column's JSON object), or why they cannot be sent.
    pub(crate) fn from_stored(stored: Option<serde_json::Value>) -> std::result::Result<Headers, String> {
        let Some(stored) = stored else { return Ok(Headers::new()) };
        let serde_json::Value::Object(map) = stored else {
            return Err("its headers are not a JSON object".to_string());
        };
        let mut headers = Headers(Vec::with_capacity(map.len()));
        for (name, value) in map {
            let serde_json::Value::String(value) = value else {
                return Err(format!("its header {} is not a string", crate::text::printable(&name)));
            };
            headers.0.push((name, value));
        }
        headers.validate().map_err(|e| format!("its headers break the rules: {e}"))?;
        Ok(headers)
    }
}

impl Serialize for Headers {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (name, value) in &self.0 {
            map.serialize_entry(name, value)?;
        }
        map.end()
    }
}

impl<'a> IntoIterator for &'a Headers {
    type Item = (&'a str, &'a str);
    type IntoIter =
        std::iter::Map<std::slice::Iter<'a, (String, String)>, fn(&'a (String, String)) -> (&'a str, &'a str)>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.iter().map(|(n, v)| (n.as_str(), v.as_str()))
    }
}

fn invalid(message: impl Into<String>) -> Error {
    Error::invalid_input(message)
}

/// Header names the sinks set themselves, or that change how an HTTP request is framed or read.
const RESERVED: [&str; 13] = [
    "content-type",
    "content-length",
    "content-encoding",
    "transfer-encoding",
    "host",
    "connection",
    "keep-alive",
    "proxy-connection",
    "upgrade",
    "te",
    "trailer",
    "expect",
    "user-agent",
];

/// Prefixes of the names the sinks set themselves (`outbox-*`, Standard Webhooks' `webhook-*`,
/// CloudEvents' `ce-` and `ce_`, NATS' `Nats-*`).
const RESERVED_PREFIXES: [&str; 5] = ["outbox-", "webhook-", "ce-", "ce_", "nats-"];

/// Whether no one but the sinks may set the header `name` (any case): an event's headers and
/// a destination's fixed HTTP headers alike.
pub(crate) fn is_reserved(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    RESERVED.contains(&lower.as_str()) || RESERVED_PREFIXES.iter().any(|p| lower.starts_with(p))
}

fn check_name(name: &str) -> Result<()> {
    let shown = crate::text::printable(name);
    if name.is_empty() || name.len() > Headers::MAX_NAME_LEN {
        return Err(invalid(format!(
            "header name {shown} is {} characters long; a name is 1 to {}",
            name.chars().count(),
            Headers::MAX_NAME_LEN
        )));
    }
    if let Some(c) = name.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))) {
        return Err(invalid(format!(
            "header name {shown} has the character {c:?}; a name may hold letters, digits, - _ and ."
        )));
    }
    let lower = name.to_ascii_lowercase();
    if is_reserved(name) {
        return Err(invalid(format!(
            "header {name} is reserved: the sinks set it themselves, or it changes how a request is read"
        )));
    }
    if (lower == Headers::TRACEPARENT || lower == Headers::TRACESTATE) && name != lower {
        return Err(invalid(format!("header {name} must be written in lower case, as {lower}")));
    }
    Ok(())
}

fn check_value(name: &str, value: &str) -> Result<()> {
    if value.is_empty() {
        return Err(invalid(format!("header {name} has an empty value; leave the header out instead")));
    }
    if value.len() > Headers::MAX_VALUE_LEN {
        return Err(invalid(format!(
            "header {name} has a value of {} bytes; the limit is {}",
            value.len(),
            Headers::MAX_VALUE_LEN
        )));
    }
    if let Some(at) = value.find(|c: char| !(' '..='~').contains(&c)) {
        return Err(invalid(format!(
            "header {name} has a character that is not printable ASCII (a line break, a control character or non-ASCII text) at byte {at}; percent-encode such text"
        )));
    }
    if value.starts_with(' ') || value.ends_with(' ') {
        return Err(invalid(format!(
            "header {name} has a value that starts or ends with a space, which HTTP would drop"
        )));
    }
    Ok(())
}

/// A W3C trace context `traceparent`: version, trace id, parent id and flags in lower-case hex,
/// neither id all zeros; version 00 has exactly these four fields, a later one may have more.
fn check_traceparent(value: &str) -> Result<()> {
    let wrong = |why: &str| {
        invalid(format!(
            "header traceparent {value:?} is no W3C trace context ({why}; expected 00-<32 hex digits>-<16 hex digits>-<2 hex digits>)"
        ))
    };
    let fields: Vec<&str> = value.split('-').collect();
    let hex = |s: &str, len: usize| s.len() == len && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    if fields.len() < 4 || !hex(fields[0], 2) || !hex(fields[1], 32) || !hex(fields[2], 16) || !hex(fields[3], 2) {
        return Err(wrong("the fields are not lower-case hex of the right lengths"));
    }
    if fields[0] == "ff" {
        return Err(wrong("version ff is invalid"));
    }
    if fields[0] == "00" && fields.len() != 4 {
        return Err(wrong("version 00 has four fields"));
    }
    if fields[1].bytes().all(|b| b == b'0') || fields[2].bytes().all(|b| b == b'0') {
        return Err(wrong("an id of all zeros is invalid"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> Headers {
        let mut h = Headers::new();
        for (n, v) in pairs {
            h.0.push((n.to_string(), v.to_string()));
        }
        h
    }

    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn good_headers_pass() {
        let h = headers(&[
            ("x-correlation-id", "abc 123"),
            ("tenant", "acme"),
            ("traceparent", PARENT),
            ("tracestate", "k=v"),
        ]);
        h.validate().unwrap();
        assert_eq!(h.get("Tenant"), Some("acme"));
        assert_eq!(h.traceparent(), Some(PARENT));
        assert_eq!(
            h.to_json().unwrap(),
            format!(r#"{{"x-correlation-id":"abc 123","tenant":"acme","traceparent":"{PARENT}","tracestate":"k=v"}}"#)
        );
        assert_eq!(Headers::new().to_json(), None);
    }

    #[test]
    fn bad_headers_are_refused_with_the_rule() {
        let long_value = "v".repeat(1025);
        let many: Vec<(String, String)> = (0..33).map(|i| (format!("h{i}"), "v".to_string())).collect();
        let cases: Vec<(Headers, &str)> = vec![
            (headers(&[("", "v")]), "1 to 64"),
            (headers(&[(&"n".repeat(65), "v")]), "1 to 64"),
            (headers(&[("bad name", "v")]), "' '"),
            (headers(&[("bad:name", "v")]), "':'"),
            (headers(&[("Content-Type", "text/plain")]), "reserved"),
            (headers(&[("outbox-topic", "x")]), "reserved"),
            (headers(&[("webhook-id", "x")]), "reserved"),
            (headers(&[("ce-type", "x")]), "reserved"),
            (headers(&[("Nats-Msg-Id", "x")]), "reserved"),
            (headers(&[("a", "1"), ("A", "2")]), "given twice"),
            (headers(&[("a", "")]), "empty value"),
            (headers(&[("a", &long_value)]), "1025 bytes"),
            (headers(&[("a", "x\r\nInjected: yes")]), "printable ASCII"),
            (headers(&[("a", "x\u{0}")]), "printable ASCII"),
            (headers(&[("a", "café")]), "printable ASCII"),
            (headers(&[("a", " padded")]), "space"),
            (headers(&[("traceparent", "00-abc-def-01")]), "W3C"),
            (headers(&[("traceparent", "00-00000000000000000000000000000000-00f067aa0ba902b7-01")]), "all zeros"),
            (headers(&[("traceparent", "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")]), "version ff"),
            (headers(&[("traceparent", "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01")]), "lower-case hex"),
            (headers(&[("TraceParent", PARENT)]), "lower case"),
            (headers(&[("tracestate", "k=v")]), "without traceparent"),
        ];
        for (h, expected) in cases {
            let err = h.validate().unwrap_err();
            assert!(err.is_invalid_input(), "{h:?}");
            assert!(err.to_string().contains(expected), "{h:?}: {err}");
        }
        let h = Headers(many);
        assert!(h.validate().unwrap_err().to_string().contains("33 headers"));
        let big: Vec<(String, String)> = (0..9).map(|i| (format!("h{i}"), "v".repeat(1000))).collect();
        assert!(Headers(big).validate().unwrap_err().to_string().contains("limit is 8192"));
    }

    #[test]
    fn set_replaces_a_name_in_any_case() {
        let mut h = Headers::new();
        h.set("Tenant".into(), "a".into());
        h.set("tenant".into(), "b".into());
        assert_eq!(h.len(), 1);
        assert_eq!(h.get("TENANT"), Some("b"));
    }

    #[test]
    fn stored_headers_are_read_back_or_refused() {
        assert_eq!(Headers::from_stored(None).unwrap(), Headers::new());
        let h = Headers::from_stored(Some(serde_json::json!({"tenant": "acme"}))).unwrap();
        assert_eq!(h.get("tenant"), Some("acme"));
        assert!(Headers::from_stored(Some(serde_json::json!(["x"]))).unwrap_err().contains("not a JSON object"));
        assert!(Headers::from_stored(Some(serde_json::json!({"n": 1}))).unwrap_err().contains("not a string"));
        assert!(Headers::from_stored(Some(serde_json::json!({"n": "a\nb"}))).unwrap_err().contains("printable"));
    }
}
