//! The in-process wake-up: a writer in the same process tells the relay about a commit directly,
//! with no database round trip.

use tokio::sync::watch;

/// A counter of commits made through this process's [`crate::Outbox`]. A relay that subscribed
/// sees every increment it has not looked at yet, so a wake-up is never lost while it is busy.
#[derive(Debug)]
pub(crate) struct Wakeup {
    commits: watch::Sender<u64>,
}

impl Wakeup {
    pub(crate) fn new() -> Self {
        Wakeup { commits: watch::Sender::new(0) }
    }

    /// Called after a commit that added events.
    pub(crate) fn wake(&self) {
        self.commits.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// A receiver that resolves `changed()` after the next commit.
    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.commits.subscribe()
    }
}
