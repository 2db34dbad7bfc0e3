//! Ready-made destinations for the relay: standard output, an HTTP endpoint, NATS JetStream.
//!
//! Every sink sends the same JSON object per event, the [`Event`] serialized:
//! `{"id", "topic", "key", "payload", "created_at", "attempts"}`. The `id` is stable across
//! redeliveries: receivers use it to drop duplicates (the HTTP sink sends it in the
//! `Outbox-Event-Id` header, the NATS sink as `Nats-Msg-Id`, which JetStream deduplicates on).

mod http;
mod nats;
mod stdout;

use std::time::Duration;

pub use self::http::{ATTEMPT_HEADER, EVENT_ID_HEADER, HttpSink, TOPIC_HEADER};
pub use self::nats::NatsSink;
pub use self::stdout::StdoutSink;
use crate::error::{Error, Result};
use crate::event::Event;
use crate::relay::{DeliveryError, Handler};

/// Default timeout of one HTTP delivery.
pub const DEFAULT_HTTP_TIMEOUT: Duration = Duration::from_secs(10);
/// Default subject prefix of the NATS sink: events go to `<prefix>.<topic>`.
pub const DEFAULT_SUBJECT_PREFIX: &str = "outbox";

/// Settings of the sinks; each sink reads the ones that concern it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SinkOptions {
    /// Timeout of one HTTP request, and of connecting to NATS and waiting for its acknowledgement.
    /// Defaults to [`DEFAULT_HTTP_TIMEOUT`].
    pub timeout: Duration,
    /// NATS subject prefix. Defaults to [`DEFAULT_SUBJECT_PREFIX`].
    pub subject_prefix: String,
    /// Create (or reuse) a JetStream stream of this name capturing `<prefix>.>`. Streams are
    /// normally the operator's to create. Defaults to none.
    pub create_stream: Option<String>,
}

impl Default for SinkOptions {
    fn default() -> Self {
        SinkOptions {
            timeout: DEFAULT_HTTP_TIMEOUT,
            subject_prefix: DEFAULT_SUBJECT_PREFIX.into(),
            create_stream: None,
        }
    }
}

/// A destination chosen by a spec string: `stdout`, `http://...`, `https://...` or `nats://host:port`.
#[derive(Debug)]
pub enum Sink {
    /// One JSON line per event on standard output.
    Stdout(StdoutSink),
    /// A POST per event.
    Http(HttpSink),
    /// A JetStream publish per event, acknowledged.
    Nats(NatsSink),
}

impl Sink {
    /// Builds the sink a spec names; connects where the sink needs a connection, so an
    /// unreachable destination is reported here, not at the first event.
    pub async fn connect(spec: &str, options: &SinkOptions) -> Result<Sink> {
        if spec == "stdout" || spec == "-" {
            return Ok(Sink::Stdout(StdoutSink::new()));
        }
        if spec.starts_with("http://") || spec.starts_with("https://") {
            return Ok(Sink::Http(HttpSink::new(spec, options.timeout)?));
        }
        if spec.starts_with("nats://") {
            return Ok(Sink::Nats(NatsSink::connect(spec, options).await?));
        }
        Err(Error::config(format!(
            "unknown sink {spec:?}: expected stdout, http://host[:port]/path, https://..., or nats://host:port"
        )))
    }
}

impl Handler for Sink {
    async fn handle(&self, event: &Event) -> Result<(), DeliveryError> {
        match self {
            Sink::Stdout(s) => s.handle(event).await,
            Sink::Http(s) => s.handle(event).await,
            Sink::Nats(s) => s.handle(event).await,
        }
    }

    async fn flush(&self) -> Result<(), DeliveryError> {
        match self {
            Sink::Stdout(s) => s.flush().await,
            Sink::Http(s) => s.flush().await,
            Sink::Nats(s) => s.flush().await,
        }
    }
}

/// The JSON object every sink sends for an event.
pub(crate) fn event_json(event: &Event) -> Result<Vec<u8>, DeliveryError> {
    serde_json::to_vec(event).map_err(|e| DeliveryError::permanent(format!("cannot serialize event {}: {e}", event.id)))
}
