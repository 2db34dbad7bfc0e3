//! Standard output: one JSON object per line, each batch written and flushed as one piece.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::Notify;

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

    /// Completes once a write found this process's standard output closed: a broken pipe, its
    /// reader gone (`outbox-relay run --sink stdout | consumer`, and the consumer died). A closed
    /// pipe never opens again, so every later batch would fail the same way, however long the
    /// relay went on: a program whose events go there may stop on this (the command does, with
    /// exit status 1) and be started again with a new reader. The events of the failed writes
    /// were not delivered and wait in the outbox; those written into the pipe before its reader
    /// left count as delivered, as with any pipe. The state is the process's (its standard
    /// output), and stays once set.
    pub async fn closed() {
        loop {
            // (made before the flag is read: a notification in between is not missed)
            let notified = CLOSING.notified();
            if Self::is_closed() {
                return;
            }
            notified.await;
        }
    }

    /// Whether a write found standard output closed (see [`StdoutSink::closed`]).
    pub fn is_closed() -> bool {
        CLOSED.load(Ordering::Acquire)
    }
}

/// Set once a write found standard output closed (its reader gone): see [`StdoutSink::closed`].
static CLOSED: AtomicBool = AtomicBool::new(false);
/// Wakes [`StdoutSink::closed`] when [`CLOSED`] is set.
static CLOSING: Notify = Notify::const_new();

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
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::BrokenPipe => {
                CLOSED.store(true, Ordering::Release);
                CLOSING.notify_waiters();
                format!("writing to stdout failed: it was closed, its reader is gone ({e})")
            }
            Ok(Err(e)) => format!("writing to stdout failed: {e}"),
            Err(e) => format!("writing to stdout failed: the writing task ended: {e}"),
        };
        results.into_iter().map(|result| result.and(Err(DeliveryError::transient(&failure)))).collect()
    }
}
