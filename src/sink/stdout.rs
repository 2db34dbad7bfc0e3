//! Standard output: one JSON object per line, each batch written and flushed as one piece.

use std::io::Write;

use super::event_json;
use crate::event::Event;
use crate::relay::{DeliveryError, Handler, Slots};

/// Prints each event as one JSON line.
///
/// A batch's lines are written and flushed together, on tokio's blocking pool (never on an async
/// worker thread), under the lock of standard output, and only that write's outcome decides the
/// batch's results: a failed write (a full disk, a closed pipe) fails exactly the events it
/// carried, which are retried, and never the lines of another batch.
#[derive(Debug, Default, Clone, Copy)]
pub struct StdoutSink;

impl StdoutSink {
    /// A sink writing to this process's standard output.
    pub fn new() -> Self {
        StdoutSink
    }
}

impl Handler for StdoutSink {
    async fn handle(&self, event: &Event) -> Result<(), DeliveryError> {
        self.write(std::slice::from_ref(event)).await.pop().unwrap_or(Ok(()))
    }

    /// One write for the batch: one slot.
    async fn handle_batch(&self, events: &[Event], slots: &Slots) -> Vec<Result<(), DeliveryError>> {
        let _slot = slots.take_for(events.len()).await;
        self.write(events).await
    }
}

impl StdoutSink {
    async fn write(&self, events: &[Event]) -> Vec<Result<(), DeliveryError>> {
        let mut lines = Vec::new();
        let mut results = Vec::with_capacity(events.len());
        for event in events {
            results.push(event_json(event).map(|line| {
                lines.extend_from_slice(&line);
                lines.push(b'\n');
            }));
        }
        if lines.is_empty() {
            return results;
        }
        let written = tokio::task::spawn_blocking(move || {
            let mut out = std::io::stdout().lock();
            out.write_all(&lines).and_then(|()| out.flush())
        })
        .await;
        let failure = match written {
            Ok(Ok(())) => return results,
            Ok(Err(e)) => format!("writing to stdout failed: {e}"),
            Err(e) => format!("writing to stdout failed: the writing task ended: {e}"),
        };
        results.into_iter().map(|result| result.and(Err(DeliveryError::transient(&failure)))).collect()
    }
}
