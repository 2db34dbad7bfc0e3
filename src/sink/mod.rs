//! Ready-made destinations for the relay: standard output, and behind cargo features an HTTP
//! endpoint (`http`), NATS JetStream (`nats`), RabbitMQ (`amqp`) and Kafka (`kafka`).
//!
//! Every sink sends the same JSON object per event, the [`Event`] serialized:
//! `{"id", "uuid", "topic", "key", "payload", "created_at", "attempts"}`. Both ids are stable
//! across redeliveries; the `uuid` is also unique across databases and restores, and receivers
//! drop duplicates by it (the HTTP sink sends it as `Outbox-Event-Uuid` and, signed,
//! `webhook-id`; CloudEvents as `id`; the NATS sink as `Nats-Msg-Id`, which JetStream
//! deduplicates on; the AMQP sink as `message_id`; the Kafka sink as the header
//! `outbox-event-uuid`). The `id` is the event's order in its database (`Outbox-Event-Id`).

#[cfg(feature = "amqp")]
mod amqp;
#[cfg(any(feature = "http", feature = "kafka"))]
mod cloudevents;
#[cfg(feature = "http")]
mod conventions;
mod deferred;
#[cfg(feature = "http")]
mod http;
#[cfg(feature = "kafka")]
mod kafka;
#[cfg(feature = "nats")]
mod nats;
mod stdout;
#[cfg(any(feature = "http", feature = "nats", feature = "amqp"))]
mod url;

use std::time::Duration;

#[cfg(feature = "amqp")]
pub use self::amqp::{AmqpSink, AmqpSinkBuilder};
#[cfg(any(feature = "http", feature = "kafka"))]
pub use self::cloudevents::DEFAULT_CLOUDEVENTS_SOURCE;
#[cfg(feature = "http")]
pub use self::conventions::SigningSecret;
pub use self::deferred::{ConnectSink, Deferred};
#[cfg(feature = "http")]
pub use self::http::{ATTEMPT_HEADER, EVENT_ID_HEADER, EVENT_UUID_HEADER, HttpSink, HttpSinkBuilder, TOPIC_HEADER};
#[cfg(feature = "kafka")]
pub use self::kafka::{KAFKA_UUID_HEADER, KafkaSasl, KafkaSink, KafkaSinkBuilder, SaslMechanism};
#[cfg(feature = "nats")]
pub use self::nats::{NATS_ACKS_IN_FLIGHT, NatsSink, NatsSinkBuilder};
pub use self::stdout::StdoutSink;
use crate::error::{Error, Result};
use crate::event::Event;
use crate::relay::{DeliveryError, Handler, Slots};

/// Default timeout of one HTTP delivery.
pub const DEFAULT_HTTP_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest timeout a sink takes.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(3600);
/// Default subject prefix of the NATS sink: events go to `<prefix>.<topic>`.
pub const DEFAULT_SUBJECT_PREFIX: &str = "outbox";
/// The exchange the RabbitMQ sink publishes to when none is given.
pub const DEFAULT_EXCHANGE: &str = "outbox";
/// The Kafka topic an event goes to when no template is given: its own topic.
pub const DEFAULT_KAFKA_TOPIC: &str = "{topic}";

/// How the HTTP and the Kafka sink put an event into a request or a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EventFormat {
    /// The event's JSON object (`{"id", "uuid", "topic", "key", "payload", "created_at", "attempts"}`),
    /// `Content-Type: application/json`.
    #[default]
    Raw,
    /// CloudEvents binary mode: the attributes in `ce-*` headers (`ce-id` the event's uuid,
    /// `ce-type` the topic, `ce-source`, `ce-time` its `created_at`, `ce-partitionkey` its key),
    /// the body the payload, `Content-Type: application/json`.
    CloudEventsBinary,
    /// CloudEvents structured mode: one `application/cloudevents+json` object with the same
    /// attributes and the payload as `data`.
    CloudEventsStructured,
}

impl std::str::FromStr for EventFormat {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self> {
        match text {
            "raw" => Ok(EventFormat::Raw),
            "cloudevents" | "cloudevents-binary" => Ok(EventFormat::CloudEventsBinary),
            "cloudevents-structured" => Ok(EventFormat::CloudEventsStructured),
            other => Err(Error::config(format!(
                "unknown HTTP format {other:?}: expected raw, cloudevents or cloudevents-structured"
            ))),
        }
    }
}

/// A secret (a signing secret, a header's value): `Debug` shows nothing of it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps `text`.
    pub fn new(text: impl Into<String>) -> Self {
        Secret(text.into())
    }

    /// The text itself.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// A destination chosen by a spec string: `stdout`, `http://...`, `https://...`,
/// `nats://host:port`, `amqp://...` or `kafka://host:port[,host:port]`, as far as this build
/// has the sink (cargo features `http`, `nats`, `amqp`, `kafka`).
#[derive(Debug)]
#[non_exhaustive]
pub enum Sink {
    /// One JSON line per event on standard output.
    Stdout(StdoutSink),
    /// A POST per event.
    #[cfg(feature = "http")]
    Http(HttpSink),
    /// A JetStream publish per event, acknowledged.
    #[cfg(feature = "nats")]
    Nats(NatsSink),
    /// A RabbitMQ publish per event, confirmed.
    #[cfg(feature = "amqp")]
    Amqp(AmqpSink),
    /// A Kafka message per event, acknowledged by every in-sync replica.
    #[cfg(feature = "kafka")]
    Kafka(KafkaSink),
    /// A sink whose destination did not answer at start, connected at a later delivery.
    Deferred(Deferred),
}

impl Sink {
    /// Builds the sink a spec names, with each sink's defaults (its builder sets the rest:
    /// `HttpSink::builder`, `NatsSink::builder`, `AmqpSink::builder`, `KafkaSink::builder`); connects where the
    /// sink needs a connection, so an unreachable destination is reported here, not at the first
    /// event.
    pub async fn connect(spec: &str) -> Result<Sink> {
        let spec = &*lower_scheme(spec);
        let http = spec.starts_with("http://") || spec.starts_with("https://");
        if spec == "stdout" || spec == "-" {
            return Ok(Sink::Stdout(StdoutSink::new()));
        }
        if http {
            #[cfg(feature = "http")]
            return Ok(Sink::Http(HttpSink::new(spec, DEFAULT_HTTP_TIMEOUT)?));
            #[cfg(not(feature = "http"))]
            return Err(Error::config("this build has no HTTP sink: enable pg-outbox-relay's `http` feature"));
        }
        if spec.starts_with("nats://") {
            #[cfg(feature = "nats")]
            return Ok(Sink::Nats(NatsSink::connect(spec).await?));
            #[cfg(not(feature = "nats"))]
            return Err(Error::config("this build has no NATS sink: enable pg-outbox-relay's `nats` feature"));
        }
        if spec.starts_with("amqp://") || spec.starts_with("amqps://") {
            #[cfg(feature = "amqp")]
            return Ok(Sink::Amqp(AmqpSink::connect(spec).await?));
            #[cfg(not(feature = "amqp"))]
            return Err(Error::config("this build has no RabbitMQ sink: enable pg-outbox-relay's `amqp` feature"));
        }
        if spec.starts_with("kafka://") {
            #[cfg(feature = "kafka")]
            return Ok(Sink::Kafka(KafkaSink::connect(spec).await?));
            #[cfg(not(feature = "kafka"))]
            return Err(Error::config("this build has no Kafka sink: enable pg-outbox-relay's `kafka` feature"));
        }
        Err(Error::config(format!(
            "unknown sink {}: expected stdout, http://host[:port]/path, https://..., nats://host:port, amqp://user:pass@host:5672/vhost or kafka://host:port[,host:port]",
            describe_spec(spec)
        )))
    }

    /// The destination as it may be shown in logs: a URL's password and query values as `***`.
    pub fn describe(&self) -> String {
        match self {
            Sink::Stdout(_) => "stdout".to_string(),
            #[cfg(feature = "http")]
            Sink::Http(s) => s.shown.clone(),
            #[cfg(feature = "nats")]
            Sink::Nats(s) => s.shown.clone(),
            #[cfg(feature = "amqp")]
            Sink::Amqp(s) => s.shown.clone(),
            #[cfg(feature = "kafka")]
            Sink::Kafka(s) => s.shown.clone(),
            Sink::Deferred(s) => s.describe().to_string(),
        }
    }
}

impl Handler for Sink {
    async fn handle(&self, event: &Event) -> Result<(), DeliveryError> {
        match self {
            Sink::Stdout(s) => s.handle(event).await,
            #[cfg(feature = "http")]
            Sink::Http(s) => s.handle(event).await,
            #[cfg(feature = "nats")]
            Sink::Nats(s) => s.handle(event).await,
            #[cfg(feature = "amqp")]
            Sink::Amqp(s) => s.handle(event).await,
            #[cfg(feature = "kafka")]
            Sink::Kafka(s) => s.handle(event).await,
            Sink::Deferred(s) => s.handle(event).await,
        }
    }

    async fn handle_batch(&self, events: &[Event], slots: &Slots) -> Vec<Result<(), DeliveryError>> {
        match self {
            Sink::Stdout(s) => s.handle_batch(events, slots).await,
            #[cfg(feature = "http")]
            Sink::Http(s) => s.handle_batch(events, slots).await,
            #[cfg(feature = "nats")]
            Sink::Nats(s) => s.handle_batch(events, slots).await,
            #[cfg(feature = "amqp")]
            Sink::Amqp(s) => s.handle_batch(events, slots).await,
            #[cfg(feature = "kafka")]
            Sink::Kafka(s) => s.handle_batch(events, slots).await,
            Sink::Deferred(s) => s.handle_batch(events, slots).await,
        }
    }
}

/// A sink spec with its URL scheme in lower case: a scheme is matched whatever its case (RFC
/// 3986), so `NATS://host:4222` names the NATS sink as `nats://host:4222` does.
pub fn lower_scheme(spec: &str) -> std::borrow::Cow<'_, str> {
    match spec.split_once("://") {
        Some((scheme, rest)) if scheme.chars().any(|c| c.is_ascii_uppercase()) => {
            std::borrow::Cow::Owned(format!("{}://{rest}", scheme.to_ascii_lowercase()))
        }
        _ => std::borrow::Cow::Borrowed(spec),
    }
}

/// A sink spec as it may be shown, quoted: redacted when it is a URL; a spec that does not parse
/// as one is shown only when it cannot hold credentials (no `@`).
fn describe_spec(spec: &str) -> String {
    match shown_spec(spec) {
        Ok(shown) => format!("{shown:?}"),
        Err(placeholder) => placeholder,
    }
}

/// A sink spec as it may be shown (see [`describe_spec`]); `Err` with a placeholder when it cannot
/// be shown.
pub(crate) fn shown_spec(spec: &str) -> Result<String, String> {
    #[cfg(any(feature = "http", feature = "nats", feature = "amqp"))]
    if let Ok(url) = ::url::Url::parse(spec) {
        return Ok(url::redact(&url));
    }
    if spec.contains('@') {
        Err("(a sink spec with credentials that does not parse)".to_string())
    } else {
        Ok(spec.to_string())
    }
}

/// Checks a sink timeout: more than zero, at most [`MAX_TIMEOUT`].
#[cfg(any(feature = "http", feature = "nats", feature = "amqp", feature = "kafka"))]
fn check_timeout(timeout: Duration) -> Result<()> {
    crate::relay::config::check_range(timeout, Duration::from_millis(1), MAX_TIMEOUT)
        .map_err(|why| Error::config(format!("the sink timeout {why}")))
}

/// The JSON object every sink sends for an event.
pub(crate) fn event_json(event: &Event) -> Result<Vec<u8>, DeliveryError> {
    serde_json::to_vec(event).map_err(|e| DeliveryError::permanent(format!("cannot serialize event {}: {e}", event.id)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_sinks_scheme_is_matched_whatever_its_case() {
        // Nothing listens on port 1: the NATS sink is chosen and says it could not connect.
        let Err(err) = Sink::connect("NATS://127.0.0.1:1").await else { panic!("no NATS server listens on port 1") };
        let err = err.to_string();
        assert!(!err.contains("unknown sink"), "{err}");
        let Err(err) = Sink::connect("Ftp://files.example/x").await else { panic!("there is no FTP sink") };
        let err = err.to_string();
        assert!(err.contains("unknown sink \"ftp://files.example/x\""), "{err}");
        assert!(err.contains("kafka://host:port"), "{err}");
    }

    #[test]
    fn formats_parse() {
        assert_eq!("raw".parse::<EventFormat>().unwrap(), EventFormat::Raw);
        assert_eq!("cloudevents".parse::<EventFormat>().unwrap(), EventFormat::CloudEventsBinary);
        assert_eq!("cloudevents-structured".parse::<EventFormat>().unwrap(), EventFormat::CloudEventsStructured);
        assert!("xml".parse::<EventFormat>().is_err());
    }
}
