//! The fallback poll, and wake-ups at the earliest retry or delayed event the relay knows of.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// The moments wake-ups are owed (retries this relay scheduled, the next delayed event), shared
/// by the workers, who add them, and the timer task, which sleeps until the earliest. Every moment
/// is kept, not just the earliest: a wake-up that finds work does not look for the next one.
#[derive(Debug, Default)]
pub(crate) struct Timer {
    due: Mutex<BTreeSet<Instant>>,
    changed: Notify,
}

/// The most moments kept; past it the latest are dropped and the fallback poll (and the empty
/// claim's look-up of the next due event) covers them.
const MAX_PENDING: usize = 10_000;

impl Timer {
    /// Asks for a wake-up at `at`.
    pub(crate) fn schedule(&self, at: Instant) {
        let mut due = self.due.lock().unwrap_or_else(|e| e.into_inner());
        let earliest = due.first().is_none_or(|first| at < *first);
        due.insert(at);
        if due.len() > MAX_PENDING {
            due.pop_last();
        }
        if earliest {
            self.changed.notify_one();
        }
    }

    fn earliest(&self) -> Option<Instant> {
        self.due.lock().unwrap_or_else(|e| e.into_inner()).first().copied()
    }

    /// Forgets the moments that have come; true if there were any.
    fn take_passed(&self, now: Instant) -> bool {
        let mut due = self.due.lock().unwrap_or_else(|e| e.into_inner());
        let later = due.split_off(&(now + std::time::Duration::from_nanos(1)));
        let passed = !due.is_empty();
        *due = later;
        passed
    }
}

/// Wakes a worker every `interval` and whenever a scheduled moment comes, until `stop`.
pub(crate) async fn run(timer: Arc<Timer>, interval: Duration, work: Arc<Notify>, stop: CancellationToken) {
    let mut next_poll = Instant::now() + interval;
    loop {
        let deadline = timer.earliest().map_or(next_poll, |due| due.min(next_poll));
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = timer.changed.notified() => continue,
            _ = tokio::time::sleep_until(deadline) => {}
        }
        let now = Instant::now();
        timer.take_passed(now);
        work.notify_one();
        if next_poll <= now {
            next_poll = now + interval;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_moment_is_kept_until_it_passes() {
        let timer = Timer::default();
        let now = Instant::now();
        let ms = Duration::from_millis;
        timer.schedule(now + ms(30));
        timer.schedule(now + ms(10));
        timer.schedule(now + ms(20));
        assert_eq!(timer.earliest(), Some(now + ms(10)));
        assert!(timer.take_passed(now + ms(15)));
        assert_eq!(timer.earliest(), Some(now + ms(20)), "a later moment survives an earlier one firing");
        assert!(!timer.take_passed(now + ms(19)));
        assert!(timer.take_passed(now + ms(30)));
        assert_eq!(timer.earliest(), None);
    }
}
