//! NATS JetStream: one acknowledged publish per event, deduplicated by the event's uuid.

use async_nats::jetstream::context::{PublishAckFuture, PublishErrorKind};
use async_nats::jetstream::{self};
use async_nats::{ConnectErrorKind, HeaderMap};

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;

use super::{DEFAULT_HTTP_TIMEOUT, DEFAULT_SUBJECT_PREFIX, event_json};
use crate::error::{Error, ErrorKind, Result};
use crate::event::Event;
use crate::relay::{DeliveryError, Handler, Slots};

/// Publishes each event to JetStream on subject `<prefix>.<topic>`, with the event's uuid as
/// `Nats-Msg-Id` (and its id in this database as `Outbox-Event-Id`) so the stream drops a redelivered event inside its duplicate window, and waits
/// for the stream's acknowledgement before the event counts as delivered.
///
/// No acknowledgement (no stream captures the subject, a timeout, a lost connection) is a
/// transient failure: the event stays pending with a `last_error` that says why.
///
/// At most [`NATS_ACKS_IN_FLIGHT`] publishes await their acknowledgements at once, across every batch
/// the sink has in hand: a larger batch is published in windows of that many.
#[derive(Debug, Clone)]
pub struct NatsSink {
    jetstream: jetstream::Context,
    /// One permit for each publish awaiting its acknowledgement: a window takes all of its
    /// permits at once before its first publish (see [`NATS_ACKS_IN_FLIGHT`]).
    acks: Arc<Semaphore>,
    prefix: String,
    /// The server's URL as it may be shown.
    pub(super) shown: String,
}

/// Builds a [`NatsSink`]: `NatsSink::builder(url).subject_prefix("orders").connect().await`.
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `connect` is called"]
pub struct NatsSinkBuilder {
    url: String,
    timeout: Duration,
    subject_prefix: String,
    create_stream: Option<String>,
}

impl NatsSinkBuilder {
    /// How long connecting and each acknowledgement may take (1 ms to
    /// [`MAX_TIMEOUT`](super::MAX_TIMEOUT)). Defaults to 10 s.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The subject prefix: events go to `<prefix>.<topic>`. Defaults to
    /// [`DEFAULT_SUBJECT_PREFIX`].
    pub fn subject_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.subject_prefix = prefix.into();
        self
    }

    /// Creates (or reuses) a JetStream stream of this name capturing `<prefix>.>`. Streams are
    /// normally the operator's to create.
    pub fn create_stream(mut self, name: impl Into<String>) -> Self {
        self.create_stream = Some(name.into());
        self
    }

    /// Connects to the NATS server; creates the stream, if one is asked for.
    pub async fn connect(self) -> Result<NatsSink> {
        let NatsSinkBuilder { url, timeout, subject_prefix, create_stream } = self;
        validate_prefix(&subject_prefix)?;
        let shown = super::url::describe(&url);
        super::check_timeout(timeout)?;
        let client =
            async_nats::ConnectOptions::new().connection_timeout(timeout).connect(url.as_str()).await.map_err(|e| {
                // A refused login is the operator's to fix, not an outage to wait out.
                let kind = match e.kind() {
                    ConnectErrorKind::Authentication | ConnectErrorKind::AuthorizationViolation => {
                        ErrorKind::Permission
                    }
                    // A URL that does not parse, a TLS setup that cannot work: the spec is wrong.
                    ConnectErrorKind::ServerParse | ConnectErrorKind::Tls => ErrorKind::Config,
                    _ => ErrorKind::Connect,
                };
                Error::new(kind, format!("cannot connect to NATS at {shown}: {}", crate::error::chain(&e)))
            })?;
        // The client's own bound on acknowledgements in flight is the sink's, and an
        // acknowledgement it awaits alone (a delivery cut off) is given up after the timeout too.
        let jetstream = jetstream::ContextBuilder::new()
            .timeout(timeout)
            .ack_timeout(timeout)
            .max_ack_inflight(NATS_ACKS_IN_FLIGHT)
            .build(client);
        if let Some(name) = &create_stream {
            let subjects = format!("{subject_prefix}.>");
            jetstream
                .get_or_create_stream(jetstream::stream::Config {
                    name: name.clone(),
                    subjects: vec![subjects.clone()],
                    ..Default::default()
                })
                .await
                .map_err(|e| {
                    Error::new(
                        ErrorKind::Config,
                        format!("cannot create JetStream stream {name:?} for {subjects}: {e}"),
                    )
                })?;
        }
        Ok(NatsSink { jetstream, acks: Arc::new(Semaphore::new(NATS_ACKS_IN_FLIGHT)), prefix: subject_prefix, shown })
    }
}

impl NatsSink {
    /// A builder for a sink to the NATS server of `url` (`nats://host:port`).
    pub fn builder(url: &str) -> NatsSinkBuilder {
        NatsSinkBuilder {
            url: url.to_string(),
            timeout: DEFAULT_HTTP_TIMEOUT,
            subject_prefix: DEFAULT_SUBJECT_PREFIX.to_string(),
            create_stream: None,
        }
    }

    /// Connects to the NATS server of `url` with the defaults.
    pub async fn connect(url: &str) -> Result<Self> {
        NatsSink::builder(url).connect().await
    }

    fn subject(&self, event: &Event) -> String {
        format!("{}.{}", self.prefix, event.topic)
    }
}

/// A prefix is one or more NATS tokens: no spaces, no wildcards, no empty token.
fn validate_prefix(prefix: &str) -> Result<()> {
    let valid = !prefix.is_empty()
        && prefix.split('.').all(|token| !token.is_empty() && !token.contains([' ', '\t', '*', '>']));
    if valid {
        Ok(())
    } else {
        Err(Error::config(format!(
            "invalid subject prefix {prefix:?}: use dot-separated tokens without spaces or wildcards, e.g. outbox"
        )))
    }
}

impl NatsSink {
    /// Sends one event's publish without waiting for its acknowledgement.
    async fn send(&self, event: &Event) -> Result<(String, PublishAckFuture), DeliveryError> {
        let subject = self.subject(event);
        if subject.split('.').any(str::is_empty) {
            // Topics have no empty words since migration 0003; an older row may still.
            return Err(DeliveryError::permanent(format!(
                "topic {:?} cannot be a NATS subject: it has an empty word between dots",
                event.topic
            )));
        }
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", event.uuid.to_string().as_str());
        headers.insert("Outbox-Event-Id", event.id.to_string().as_str());
        headers.insert("Outbox-Topic", event.topic.as_str());
        for (name, value) in &event.headers {
            headers.insert(name, value);
        }
        let payload = event_json(event)?;
        match self.jetstream.publish_with_headers(subject.clone(), headers, payload.into()).await {
            Ok(ack) => Ok((subject, ack)),
            Err(e) => Err(publish_error(&subject, &e)),
        }
    }
}

/// What a failed publish or acknowledgement means for the event.
fn publish_error(subject: &str, e: &async_nats::jetstream::context::PublishError) -> DeliveryError {
    match e.kind() {
        PublishErrorKind::StreamNotFound => DeliveryError::transient(format!(
            "no JetStream stream captures subject {subject}: create one, or run with --create-stream NAME"
        ))
        .destination_answered(),
        PublishErrorKind::MaxPayloadExceeded => {
            DeliveryError::permanent(format!("event is larger than the NATS server accepts: {e}"))
        }
        _ => DeliveryError::transient(format!("publishing to {subject} failed: {e}")),
    }
}

impl Handler for NatsSink {
    async fn handle(&self, event: &Event) -> Result<(), DeliveryError> {
        self.publish_window(std::slice::from_ref(event)).await.pop().unwrap_or(Ok(()))
    }

    /// Publishes the whole batch, then awaits the acknowledgements together: one pipelined
    /// exchange, one slot (in windows of [`NATS_ACKS_IN_FLIGHT`] events, one after the other, for a
    /// larger batch).
    async fn handle_batch(&self, events: &[Event], slots: &Slots) -> Vec<Result<(), DeliveryError>> {
        let _slot = slots.take_for(events.len()).await;
        let mut results = Vec::with_capacity(events.len());
        for window in events.chunks(NATS_ACKS_IN_FLIGHT) {
            results.extend(self.publish_window(window).await);
        }
        results
    }
}

/// How many publishes a [`NatsSink`] has awaiting their acknowledgements at most. The NATS
/// client bounds them too (5,000 unless told otherwise) and makes a publish past its bound wait
/// for an acknowledgement to be awaited; a batch published whole before its acknowledgements
/// (larger than the bound, or several batches at once) would wait for itself for ever. So a
/// window takes its permits from the sink's own bound all at once, before its first publish.
pub const NATS_ACKS_IN_FLIGHT: usize = 5_000;

impl NatsSink {
    /// Publishes `window` (at most [`NATS_ACKS_IN_FLIGHT`] events), then awaits the acknowledgements
    /// together.
    async fn publish_window(&self, window: &[Event]) -> Vec<Result<(), DeliveryError>> {
        debug_assert!(window.len() <= NATS_ACKS_IN_FLIGHT, "a window the bound could never admit");
        let permits = u32::try_from(window.len()).unwrap_or(u32::MAX);
        let _permits = match self.acks.acquire_many(permits).await {
            Ok(permits) => permits,
            // The semaphore is never closed.
            Err(closed) => return window.iter().map(|_| Err(DeliveryError::transient(closed.to_string()))).collect(),
        };
        let mut sent = Vec::with_capacity(window.len());
        for event in window {
            sent.push(self.send(event).await);
        }
        let acks = sent.into_iter().map(|sent| async move {
            let (subject, ack) = sent?;
            ack.await.map(drop).map_err(|e| publish_error(&subject, &e))
        });
        futures::future::join_all(acks).await
    }
}

#[cfg(test)]
mod tests {
    use super::validate_prefix;

    #[test]
    fn prefixes_are_checked() {
        assert!(validate_prefix("outbox").is_ok());
        assert!(validate_prefix("shop.events").is_ok());
        for bad in ["", "a..b", "a b", "a.*", "a.>", "."] {
            assert!(validate_prefix(bad).is_err(), "{bad:?}");
        }
    }
}
