//! The fallback poll, and wake-ups at the earliest retry or delayed event the relay knows of.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
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
    /// Bumped whenever parked events may have become due (see `parked_turn`).
    parked_news: AtomicU64,
    /// `parked_news` as it was when a claim of parked events last took all it could.
    parked_seen: AtomicU64,
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

    /// Parked events may be due now: a moment came, the poll, a resume, an event parked or given
    /// back, a parked batch done (a key's next parked event is its head now).
    pub(crate) fn parked_may_be_due(&self) {
        self.parked_news.fetch_add(1, Ordering::AcqRel);
    }

    /// Whether the next claim looks at the parked events, and the news it acts on: only when
    /// something may have made one due since a claim of them last took all it could. (A parked
    /// event that another process makes due is found by the poll.)
    pub(crate) fn parked_turn(&self) -> (bool, u64) {
        let news = self.parked_news.load(Ordering::Acquire);
        (news != self.parked_seen.load(Ordering::Acquire), news)
    }

    /// A claim of parked events that began at `news` took all it could.
    pub(crate) fn parked_taken(&self, news: u64) {
        self.parked_seen.fetch_max(news, Ordering::AcqRel);
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

/// The task that wakes a worker every `interval` and whenever a scheduled moment comes.
pub(crate) struct Poll {
    pub(crate) timer: Arc<Timer>,
    pub(crate) interval: Duration,
    pub(crate) work: Arc<Notify>,
}

impl Poll {
    /// Runs until `stop`.
    pub(crate) async fn run(self, stop: CancellationToken) {
        let Poll { timer, interval, work } = self;
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
            timer.parked_may_be_due();
            work.notify_one();
            if next_poll <= now {
                next_poll = now + interval;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parked_events_are_looked_at_until_a_claim_that_began_after_the_news_took_all() {
        let timer = Timer::default();
        assert!(!timer.parked_turn().0, "nothing said yet");
        timer.parked_may_be_due();
        let (look, news) = timer.parked_turn();
        assert!(look);
        timer.parked_may_be_due(); // while that claim runs
        timer.parked_taken(news);
        let (look, news) = timer.parked_turn();
        assert!(look, "news that came during the claim is not lost");
        timer.parked_taken(news);
        assert!(!timer.parked_turn().0);
        timer.parked_taken(0); // a claim that began long ago and ended late changes nothing
        assert!(!timer.parked_turn().0);
        timer.parked_may_be_due();
        assert!(timer.parked_turn().0);
    }

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
