//! The fallback poll, and wake-ups at the earliest retry or delayed event the relay knows of.

use std::sync::{Arc, Mutex};

use tokio::sync::Notify;
use tokio::time::Instant;

use super::{Handler, Shared};

/// The earliest moment a wake-up is owed, shared by the workers (who learn of retries) and the
/// timer task (which sleeps until then).
#[derive(Debug, Default)]
pub(crate) struct Timer {
    next_due: Mutex<Option<Instant>>,
    changed: Notify,
}

impl Timer {
    /// Asks for a wake-up at `at`, unless an earlier one is already due.
    pub(crate) fn schedule(&self, at: Instant) {
        let mut next = self.next_due.lock().unwrap_or_else(|e| e.into_inner());
        if next.is_none_or(|due| at < due) {
            *next = Some(at);
            self.changed.notify_one();
        }
    }

    fn due(&self) -> Option<Instant> {
        *self.next_due.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn clear_if_passed(&self, now: Instant) {
        let mut next = self.next_due.lock().unwrap_or_else(|e| e.into_inner());
        if next.is_some_and(|due| due <= now) {
            *next = None;
        }
    }
}

/// Wakes a worker every poll interval and whenever a scheduled moment comes.
pub(crate) async fn run<H: Handler>(shared: Arc<Shared<H>>) {
    let timer = &shared.timer;
    let interval = shared.config.poll_interval;
    let mut next_poll = Instant::now() + interval;
    loop {
        let deadline = timer.due().map_or(next_poll, |due| due.min(next_poll));
        tokio::select! {
            _ = shared.stop.cancelled() => return,
            _ = timer.changed.notified() => continue,
            _ = tokio::time::sleep_until(deadline) => {}
        }
        let now = Instant::now();
        timer.clear_if_passed(now);
        shared.work.notify_one();
        if next_poll <= now {
            next_poll = now + interval;
        }
    }
}
