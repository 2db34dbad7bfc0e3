//! Draining to real destinations: NATS JetStream, and the stdout sink's work aimed at
//! `/dev/null` (HTTP receivers are in `receivers`).

use pg_outbox_relay::sink::NatsSink;
use pg_outbox_relay::{DeliveryError, Event, Handler, Slots};
use std::io::Write;

use super::BoxError;

/// A NATS JetStream sink on a stream of its own (created, or purged when it exists), for a
/// drain measurement; `None` with the reason when no NATS server answers at `url`.
pub async fn nats_sink(url: &str, stream: &str) -> Result<Result<NatsSink, String>, BoxError> {
    match NatsSink::builder(url).subject_prefix(stream.to_lowercase()).create_stream(stream).connect().await {
        Ok(sink) => Ok(Ok(sink)),
        Err(e) if e.kind() == pg_outbox_relay::ErrorKind::Connect => Ok(Err(e.to_string())),
        Err(e) => Err(e.into()),
    }
}

/// The stdout sink's work (each event serialized to a JSON line, a batch written and flushed
/// as one piece on the blocking pool, one slot per batch), aimed at `/dev/null`: what draining
/// to stdout costs the relay, without a terminal or a pipe in the way.
#[derive(Debug, Default, Clone, Copy)]
pub struct DevNullLines;

impl Handler for DevNullLines {
    async fn handle(&self, event: &Event) -> Result<(), DeliveryError> {
        self.handle_batch(std::slice::from_ref(event), &Slots::new(1)).await.pop().unwrap_or(Ok(()))
    }

    async fn handle_batch(&self, events: &[Event], slots: &Slots) -> Vec<Result<(), DeliveryError>> {
        let _slot = slots.take_for(events.len()).await;
        let mut lines = Vec::new();
        for event in events {
            if let Ok(line) = serde_json::to_vec(event) {
                lines.extend_from_slice(&line);
                lines.push(b'\n');
            }
        }
        let written = tokio::task::spawn_blocking(move || {
            let mut null = std::fs::OpenOptions::new().write(true).open("/dev/null")?;
            null.write_all(&lines).and_then(|()| null.flush())
        })
        .await;
        let result = match written {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(DeliveryError::transient(e)),
            Err(e) => Err(DeliveryError::transient(e)),
        };
        events.iter().map(|_| result.clone()).collect()
    }
}
