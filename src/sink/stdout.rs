//! Standard output: one JSON object per line, written and flushed per batch.

use std::io::Write;
use std::sync::Mutex;

use super::event_json;
use crate::event::Event;
use crate::relay::{DeliveryError, Handler};

/// Prints each event as one JSON line. Lines are buffered and written with one flush per batch,
/// before the batch is recorded as delivered.
#[derive(Debug, Default)]
pub struct StdoutSink {
    buffer: Mutex<Vec<u8>>,
}

impl StdoutSink {
    /// A sink writing to this process's standard output.
    pub fn new() -> Self {
        StdoutSink::default()
    }
}

impl Handler for StdoutSink {
    async fn handle(&self, event: &Event) -> Result<(), DeliveryError> {
        let line = event_json(event)?;
        let mut buffer = self.buffer.lock().unwrap_or_else(|e| e.into_inner());
        buffer.extend_from_slice(&line);
        buffer.push(b'\n');
        Ok(())
    }

    async fn flush(&self) -> Result<(), DeliveryError> {
        let pending = std::mem::take(&mut *self.buffer.lock().unwrap_or_else(|e| e.into_inner()));
        if pending.is_empty() {
            return Ok(());
        }
        let mut out = std::io::stdout().lock();
        out.write_all(&pending)
            .and_then(|()| out.flush())
            .map_err(|e| DeliveryError::transient(format!("writing to stdout failed: {e}")))
    }
}
