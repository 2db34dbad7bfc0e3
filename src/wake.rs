//! The in-process wake-up: a writer in the same process tells the relay about a commit directly,
//! with no database round trip and no task in between: the commit's own task wakes a worker.

use std::sync::{Arc, Mutex, Weak};

use tokio::sync::Notify;

use crate::relay::RelayMetrics;

/// The relays of this process that run on an [`crate::Outbox`] (or a clone of it), to be woken
/// after each commit that added events.
#[derive(Debug, Default)]
pub(crate) struct Wakeup {
    relays: Mutex<Vec<Weak<WakeTarget>>>,
}

/// What a running relay is woken through: `work` stores one wake-up when no worker waits, so
/// none is lost while it is busy.
#[derive(Debug)]
pub(crate) struct WakeTarget {
    pub(crate) work: Arc<Notify>,
    pub(crate) metrics: Arc<RelayMetrics>,
}

impl Wakeup {
    pub(crate) fn new() -> Self {
        Wakeup::default()
    }

    /// Called after a commit that added events.
    pub(crate) fn wake(&self) {
        let mut relays = self.relays.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        relays.retain(|relay| match relay.upgrade() {
            Some(relay) => {
                relay.metrics.woken();
                relay.work.notify_one();
                true
            }
            None => false, // that relay has stopped
        });
    }

    /// Wakes `relay` after each commit from now on, for as long as it is alive.
    pub(crate) fn register(&self, relay: &Arc<WakeTarget>) {
        self.relays.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).push(Arc::downgrade(relay));
    }
}
