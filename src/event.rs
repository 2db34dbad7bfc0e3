//! Events: what a writer adds to the outbox and what a relay hands to its handler.

use std::borrow::Cow;
use std::time::{Duration, SystemTime};

use serde::Serialize;
use serde_json::Value;

use crate::error::{Error, Result};
use crate::headers::Headers;
use crate::payload::Payload;

/// An event to add to the outbox.
///
/// ```
/// use pg_outbox_relay::NewEvent;
/// let event = NewEvent::new("order.placed", serde_json::json!({"order_id": 42})).key("42");
/// // JSON text as it is, every digit kept (a `Value` would round it to an f64):
/// let exact = NewEvent::from_json("invoice.issued", r#"{"total": 1234567890.123456789012345678901234567890}"#)?;
/// # Ok::<(), pg_outbox_relay::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
#[must_use]
pub struct NewEvent {
    pub(crate) topic: String,
    pub(crate) payload: Body,
    pub(crate) key: Option<String>,
    pub(crate) delay: Duration,
    pub(crate) headers: Headers,
}

impl NewEvent {
    /// The longest event key or idempotency key, in characters.
    pub const MAX_KEY_LEN: usize = 255;
    /// The longest topic, in characters.
    pub const MAX_TOPIC_LEN: usize = 255;
}

/// A new event's payload as the caller gave it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Body {
    /// A value, serialized (and its nesting checked first) when the event is published.
    Value(Value),
    /// JSON text, taken as it is.
    Json(Payload),
}

impl NewEvent {
    /// An event on `topic` with a JSON payload, deliverable at once.
    pub fn new(topic: impl Into<String>, payload: Value) -> Self {
        NewEvent::with_body(topic.into(), Body::Value(payload))
    }

    /// An event on `topic` with `payload`, no key, no delay and no headers.
    fn with_body(topic: String, payload: Body) -> Self {
        NewEvent { topic, payload, key: None, delay: Duration::ZERO, headers: Headers::new() }
    }

    /// An event whose payload is any serializable value, serialized straight to JSON text (a
    /// [`serde_json::value::RawValue`] inside it, e.g. an exact decimal, keeps its digits).
    pub fn from_serialize(topic: impl Into<String>, payload: &impl Serialize) -> Result<Self> {
        Ok(NewEvent::with_body(topic.into(), Body::Json(Payload::serialized(payload)?)))
    }

    /// An event whose payload is this JSON text, taken as it is: numbers keep every digit
    /// (`0.1000000000000000055511151231257827`, `1e400`), as through the SQL function. Fails
    /// when the text is not JSON.
    pub fn from_json(topic: impl Into<String>, json: impl Into<String>) -> Result<Self> {
        Ok(NewEvent::with_body(topic.into(), Body::Json(Payload::from_json(json)?)))
    }

    /// Sets the partition key consumers may use to keep related events together.
    pub fn key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }

    /// Delays delivery by `delay` after the commit's clock (PostgreSQL's `now()`).
    pub fn delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    /// Adds a header (replacing one of the same name in any case): metadata that travels beside
    /// the payload, e.g. a correlation id or a tenant, sent by every sink in its own way. The
    /// rules ([`Headers`]) are checked when the event is published: 1 to 64 letters, digits,
    /// `- _ .` for a name, printable ASCII for a value, no name the sinks set themselves.
    /// `traceparent` and `tracestate` carry W3C trace context; with the `opentelemetry` feature
    /// the current span's are added when the writer gives none.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.set(name.into(), value.into());
        self
    }

    /// The headers given so far.
    pub fn headers(&self) -> &Headers {
        &self.headers
    }

    /// The topic.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// Checks every field against the limits the database enforces too, and returns the
    /// payload's JSON text and the headers' JSON object to store (with the current span's trace
    /// context when the `opentelemetry` feature captures one).
    pub(crate) fn validate(&self) -> Result<Checked<'_>> {
        validate_topic(&self.topic)?;
        if let Some(key) = &self.key {
            validate_key("event key", key)?;
        }
        let what = format!("the payload of a {:?} event", self.topic);
        let payload = match &self.payload {
            Body::Value(value) => Cow::Owned(crate::payload::payload_of_value(&what, value)?),
            Body::Json(payload) => Cow::Borrowed(payload),
        };
        crate::payload::check_payload(&what, &payload)?;
        if self.delay > Duration::from_secs(100 * 365 * 24 * 3600) {
            return Err(Error::invalid_input(format!("delay {:?} is longer than 100 years", self.delay)));
        }
        let headers = crate::trace::with_current_context(&self.headers, &self.topic);
        headers.validate().map_err(|e| Error::invalid_input(format!("a {:?} event: {e}", self.topic)))?;
        Ok(Checked { payload, headers: headers.to_json() })
    }

    /// [`NewEvent::validate`] of each event, in order.
    pub(crate) fn validate_all(events: &[NewEvent]) -> Result<Vec<Checked<'_>>> {
        events.iter().map(NewEvent::validate).collect()
    }
}

/// What a checked event stores besides its topic, key and delay.
pub(crate) struct Checked<'a> {
    /// The payload's JSON text.
    pub(crate) payload: Cow<'a, Payload>,
    /// The headers' JSON object; `None` for none.
    pub(crate) headers: Option<String>,
}

/// An event as the relay hands it to a handler.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Event {
    /// The event's order in this database (a sequence): the same on every delivery, but a
    /// restore from a backup or a second database may number another event the same.
    pub id: i64,
    /// The event's identity for consumers: drawn at random when it is written, the same on
    /// every delivery, and unique across databases and restores. The sinks send it as the
    /// event's id (`webhook-id`, `ce-id`, `Nats-Msg-Id`, AMQP `message-id`); consumers drop
    /// duplicates by it ([`crate::inbox`]).
    pub uuid: uuid::Uuid,
    /// What happened, e.g. `order.placed`.
    pub topic: String,
    /// The partition key, if the writer gave one.
    pub key: Option<String>,
    /// The body: the JSON text as PostgreSQL stored it, sent on unchanged.
    pub payload: Payload,
    /// When the event was written (the writer's transaction clock).
    #[serde(serialize_with = "crate::timestamp::serialize")]
    pub created_at: SystemTime,
    /// Which delivery attempt this is, from 1.
    pub attempts: i32,
    /// The headers the writer gave (and the trace context), sent by every sink in its own way;
    /// left out of the event's JSON when there are none.
    #[serde(skip_serializing_if = "Headers::is_empty")]
    pub headers: Headers,
}

/// Checks a topic: 1 to 255 characters, letters, digits and `_ - : /` in words separated by
/// single dots (`order.placed`; not `order..placed`, `.order` or `order.`).
pub fn validate_topic(topic: &str) -> Result<()> {
    if topic.is_empty() {
        return Err(Error::invalid_input("topic must not be empty"));
    }
    let len = topic.chars().count();
    if len > NewEvent::MAX_TOPIC_LEN {
        return Err(Error::invalid_input(format!(
            "topic is {len} characters long; the limit is {max}",
            max = NewEvent::MAX_TOPIC_LEN
        )));
    }
    if let Some(c) = topic.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | ':' | '/'))) {
        return Err(Error::invalid_input(format!(
            "topic {topic:?} has the character {c:?}; a topic may hold letters, digits and . _ - : /"
        )));
    }
    if topic.split('.').any(str::is_empty) {
        return Err(Error::invalid_input(format!(
            "topic {topic:?} has an empty word: dots separate non-empty words, as in order.placed"
        )));
    }
    Ok(())
}

/// An audit entry: who changed what.
#[derive(Debug, Clone)]
pub struct AuditEntry<'a> {
    /// The kind of thing changed, e.g. `order`.
    pub entity: &'a str,
    /// Its id, as text.
    pub entity_id: String,
    /// What was done, e.g. `placed`.
    pub action: &'a str,
    /// Details (the request, the new state).
    pub data: serde_json::Value,
}

impl<'a> AuditEntry<'a> {
    /// An entry for `entity` `entity_id` and `action`, with `data` serialized to JSON.
    pub fn new(
        entity: &'a str,
        entity_id: impl ToString,
        action: &'a str,
        data: &impl Serialize,
    ) -> Result<AuditEntry<'a>> {
        Ok(AuditEntry { entity, entity_id: entity_id.to_string(), action, data: serde_json::to_value(data)? })
    }

    pub(crate) fn validate(&self) -> Result<()> {
        validate_key("audit entity", self.entity)?;
        validate_key("audit action", self.action)?;
        if self.entity_id.is_empty() {
            return Err(Error::invalid_input("audit entity id must not be empty"));
        }
        crate::payload::check_storable("the audit entry's data", &self.data)
    }
}

/// Checks a key (`what` names it in the message): 1 to 255 characters, no control characters.
pub(crate) fn validate_key(what: &str, key: &str) -> Result<()> {
    if key.is_empty() {
        return Err(Error::invalid_input(format!("{what} must not be empty")));
    }
    let len = key.chars().count();
    if len > NewEvent::MAX_KEY_LEN {
        return Err(Error::invalid_input(format!(
            "{what} is {len} characters long; the limit is {max}",
            max = NewEvent::MAX_KEY_LEN
        )));
    }
    if key.chars().any(char::is_control) {
        return Err(Error::invalid_input(format!("{what} {key:?} contains a control character")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topics_are_checked() {
        assert!(validate_topic("order.placed").is_ok());
        assert!(validate_topic("billing/invoice:v2_x-y").is_ok());
        assert!(validate_topic("").unwrap_err().to_string().contains("empty"));
        assert!(validate_topic(&"a".repeat(256)).unwrap_err().to_string().contains("limit is 255"));
        assert!(validate_topic(&"a".repeat(255)).is_ok());
        assert!(validate_topic("order placed").unwrap_err().to_string().contains("' '"));
        assert!(validate_topic("order.*").is_err());
        for empty_word in ["order..placed", ".order", "order.", "."] {
            let err = validate_topic(empty_word).unwrap_err();
            assert!(err.to_string().contains("empty word"), "{empty_word}: {err}");
        }
    }

    #[test]
    fn keys_are_checked() {
        assert!(validate_key("idempotency key", "abc-123").is_ok());
        assert!(
            validate_key("idempotency key", "").unwrap_err().to_string().contains("idempotency key must not be empty")
        );
        assert!(validate_key("k", &"é".repeat(255)).is_ok());
        assert!(validate_key("k", &"é".repeat(256)).unwrap_err().to_string().contains("256 characters"));
        assert!(validate_key("k", "a\nb").unwrap_err().is_invalid_input());
    }
}
