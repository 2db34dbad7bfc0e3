//! Pauses: which topics no claim of this destination takes, as the `outbox_relay.pauses` table
//! says (a pause names a destination, or every one). A pause or
//! resume notifies the relays' channel, and the listener has them re-read at once; they are
//! re-read every [`REFRESH`] besides (a notification can be lost while the listener reconnects).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::metrics::RelayMetrics;
use super::pool::RelayPool;
use super::timer::Timer;
use crate::sql;

/// How often the pauses are re-read.
pub(crate) const REFRESH: Duration = Duration::from_millis(500);

/// The pauses as last read: every topic, or these. Until they are first read nothing is
/// claimed, so that a relay starting on a paused database delivers nothing it should not.
#[derive(Debug, Default)]
pub(crate) struct Pauses {
    read: AtomicBool,
    all: AtomicBool,
    topics: RwLock<Arc<[String]>>,
    /// Counts the reads (the fast path waits for a read after a pause was notified).
    reads: AtomicU64,
}

impl Pauses {
    /// Whether no claim may run: every topic is paused, or the pauses were never read yet.
    pub(crate) fn all(&self) -> bool {
        self.all.load(Ordering::Acquire) || !self.read.load(Ordering::Acquire)
    }

    /// The paused topics, for the claim.
    pub(crate) fn topics(&self) -> Arc<[String]> {
        self.topics.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// How many times the pauses were read.
    pub(crate) fn generation(&self) -> u64 {
        self.reads.load(Ordering::Acquire)
    }

    /// Takes what the table holds now and says what that changed.
    fn update(&self, all: bool, topics: Vec<String>) -> Update {
        let mut current = self.topics.write().unwrap_or_else(|e| e.into_inner());
        let resumed = current.iter().any(|t| !topics.contains(t));
        let topics_changed = **current != *topics;
        if topics_changed {
            *current = topics.into();
        }
        drop(current);
        let was_all = self.all.swap(all, Ordering::AcqRel);
        let first = !self.read.swap(true, Ordering::AcqRel);
        self.reads.fetch_add(1, Ordering::AcqRel);
        Update { first, changed: topics_changed || was_all != all, widened: (!all && (first || was_all)) || resumed }
    }
}

/// What one read of the pauses changed.
#[derive(Debug, PartialEq, Eq)]
struct Update {
    /// It was the first read.
    first: bool,
    /// The pauses differ from the last read.
    changed: bool,
    /// Claims may find more than before (the first read, or something resumed).
    widened: bool,
}

/// The task that re-reads the pauses every [`REFRESH`], logs each change and wakes the workers
/// when something is resumed. While the database does not answer the last pauses read stay.
pub(crate) struct Watcher {
    pub(crate) pauses: Arc<Pauses>,
    pub(crate) pool: RelayPool,
    /// The destination whose pauses count (and those of every destination).
    pub(crate) destination: String,
    pub(crate) work: Arc<Notify>,
    /// Told by the listener when an operator changed the pauses.
    pub(crate) changed: Arc<Notify>,
    pub(crate) metrics: Arc<RelayMetrics>,
    pub(crate) timer: Arc<Timer>,
}

impl Watcher {
    /// Runs until `stop`.
    pub(crate) async fn run(self, stop: CancellationToken) {
        let Watcher { pauses, pool, destination, work, changed, metrics, timer } = self;
        let mut notified = false;
        loop {
            let read = async { sql::pauses(&*pool.client().await?).await };
            match read.await {
                Ok(rows) => {
                    let rows: Vec<_> =
                        rows.into_iter().filter(|p| p.destination.as_ref().is_none_or(|d| *d == destination)).collect();
                    let all = rows.iter().any(|p| p.topic.is_none());
                    let topics: Vec<String> = rows.into_iter().filter_map(|p| p.topic).collect();
                    metrics.set_paused(all, topics.len());
                    let shown = (all, topics.join(", "));
                    let update = pauses.update(all, topics);
                    if update.first || update.changed {
                        match shown {
                            (true, _) => {
                                tracing::warn!("delivery to this destination is paused (outbox-relay resume lifts it)")
                            }
                            (false, topics) if !topics.is_empty() => {
                                tracing::warn!(topics = %topics, "delivery is paused for some topics (outbox-relay resume --topic T lifts a pause)")
                            }
                            _ if !update.first => tracing::info!("delivery resumed: no topic is paused"),
                            _ => {}
                        }
                    }
                    if update.widened {
                        // A resumed topic's events are parked (migration 0008).
                        timer.parked_may_be_due();
                        work.notify_waiters();
                        work.notify_one();
                    } else if notified {
                        // The fast path waits for this read (and a claim after it).
                        work.notify_one();
                    }
                }
                Err(e) => tracing::debug!(error = %e, "could not read the pauses; the last ones read stay"),
            }
            notified = tokio::select! {
                _ = stop.cancelled() => return,
                _ = changed.notified() => true,
                _ = tokio::time::sleep(REFRESH) => false,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resume_is_told_apart_from_a_pause() {
        let pauses = Pauses::default();
        assert!(pauses.all(), "nothing is claimed before the pauses are read");
        assert!(pauses.update(false, vec!["a".into()]).widened, "the first read lets claims run");
        assert!(!pauses.all());
        assert!(!pauses.update(false, vec!["a".into(), "b".into()]).widened, "a new pause resumes nothing");
        assert!(pauses.update(false, vec!["a".into()]).widened);
        assert_eq!(&*pauses.topics(), ["a".to_string()]);
        assert!(!pauses.update(true, vec!["a".into()]).widened);
        assert!(pauses.all());
        assert!(pauses.update(false, vec!["a".into()]).widened, "lifting the pause of every topic");
        assert!(pauses.update(false, vec![]).widened, "lifting the pause of one topic");
        let unchanged = pauses.update(false, vec![]);
        assert!(!unchanged.widened);
        assert!(!unchanged.changed && !unchanged.first, "a read that changes nothing is no change");
    }
}
