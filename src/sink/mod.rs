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
/// The longest timeout a sink takes.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(3600);

/// Checks a sink timeout: more than zero, at most [`MAX_TIMEOUT`].
fn check_timeout(timeout: Duration) -> Result<()> {
    crate::relay::config::check_range(timeout, Duration::from_millis(1), MAX_TIMEOUT)
        .map_err(|why| Error::config(format!("the sink timeout {why}")))
}
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
            "unknown sink {}: expected stdout, http://host[:port]/path, https://..., or nats://host:port",
            describe_spec(spec)
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

    async fn handle_batch(&self, events: &[Event]) -> Vec<Result<(), DeliveryError>> {
        match self {
            Sink::Stdout(s) => s.handle_batch(events).await,
            Sink::Http(s) => s.handle_batch(events).await,
            Sink::Nats(s) => s.handle_batch(events).await,
        }
    }
}

impl Sink {
    /// The destination as it may be shown in logs: a URL's password and query values as `***`.
    pub fn describe(&self) -> String {
        match self {
            Sink::Stdout(_) => "stdout".to_string(),
            Sink::Http(s) => s.shown.clone(),
            Sink::Nats(s) => s.shown.clone(),
        }
    }
}

/// A sink spec as it may be shown: redacted when it is a URL; a spec that does not parse as one
/// is shown only when it cannot hold credentials (no `@`).
pub(crate) fn describe_spec(spec: &str) -> String {
    match url::Url::parse(spec) {
        Ok(url) => format!("{:?}", redact_url(&url)),
        Err(_) if spec.contains('@') => "(a sink URL that does not parse)".to_string(),
        Err(_) => format!("{spec:?}"),
    }
}

/// `url` with its password and every query value replaced by `***` (they may be tokens) and
/// without a fragment.
pub(crate) fn redact_url(url: &url::Url) -> String {
    let mut shown = url.clone();
    if shown.password().is_some() {
        let _cannot_fail_with_a_host = shown.set_password(Some("***"));
    }
    if shown.query().is_some() {
        let pairs: Vec<(String, String)> = url.query_pairs().map(|(k, _)| (k.into_owned(), "***".into())).collect();
        shown.query_pairs_mut().clear().extend_pairs(pairs);
    }
    shown.set_fragment(None);
    shown.to_string()
}

/// The JSON object every sink sends for an event.
pub(crate) fn event_json(event: &Event) -> Result<Vec<u8>, DeliveryError> {
    serde_json::to_vec(event).map_err(|e| DeliveryError::permanent(format!("cannot serialize event {}: {e}", event.id)))
}
