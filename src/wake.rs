//! The in-process wake-up: a writer in the same process tells the relay about a commit directly,
//! with no database round trip and no task in between: the commit's own task wakes a worker.

use std::sync::{Arc, Mutex, Weak};

/// The relays of this process that run on an [`crate::Outbox`] (or a clone of it), to be woken
/// after each commit that added events.
#[derive(Default)]
pub(crate) struct Wakeup {
    relays: Mutex<Vec<Weak<dyn Wake>>>,
}

impl std::fmt::Debug for Wakeup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let relays = self.relays.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).len();
        f.debug_struct("Wakeup").field("relays", &relays).finish()
    }
}

/// What a running relay is woken through after a commit.
pub(crate) trait Wake: Send + Sync {
    /// A commit added events; must not block.
    fn wake(&self);
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
                relay.wake();
                true
            }
            None => false, // that relay has stopped
        });
    }

    /// Wakes `relay` after each commit from now on, for as long as it is alive.
    pub(crate) fn register(&self, relay: &Arc<dyn Wake>) {
        self.relays.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).push(Arc::downgrade(relay));
    }
}
