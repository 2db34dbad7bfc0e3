//! The relay's row in `outbox_relay.relays`: its waiting mark, its listener, its breaker's state
//! and its concurrency limit; and going idle: linger, then mark the relay waiting so that writers
//! start notifying it.
//!
//! Writers notify only when some relay is marked waiting (migration 0002): NOTIFY makes every
//! commit take a global lock, which costs throughput under many concurrent writers. That cost
//! only shows at high commit rates (it is within noise at 1 and 4 writers), so the relay decides
//! by the rate at which it claims events (`busy.rs`):
//!
//! - Below `BUSY_RATE` it stays marked waiting while it works: every commit notifies it, which
//!   costs nothing measurable at that rate, and it claims only when notified. A quiet service
//!   pays a few statements per event and nothing in between.
//! - At or above it, the relay marks itself busy when it finds work, so writers stop notifying.
//!   When it runs out, one of its workers *lingers*, claiming every [`LINGER_POLL`], for
//!   `linger`; under sustained load it keeps finding work and writers never notify. After a quiet
//!   `linger` (or once the rate has dropped) the relay marks itself waiting again, and the next
//!   insert wakes it through NOTIFY.
//!
//! The race: a writer whose trigger ran just before the mark committed saw no waiting relay, and
//! commits later without notifying. So right after the mark commits the relay notes every
//! transaction open at that moment (by virtual transaction id, which a transaction holds from its
//! start, before it has a real xid), waits until all of them have ended, and claims once more.
//! Any statement that ran its trigger after the mark saw it and notifies.
//!
//! That wait can be long (a report running for minutes anywhere in the database), so it runs in
//! a task of its own ([`RaceClosure`]) and holds nothing: meanwhile the relay stays marked
//! waiting, writers notify it, and a worker that finds work, marks the relay busy and runs out
//! again can linger and mark it anew. A new mark's transactions join those waited for; each
//! time some of them have ended, a worker claims once more. The checks back off as the
//! transactions stay open, to one a poll interval for one open longer than that (a transaction
//! held for minutes cost a check every 250 ms before, and each new mark started the checks
//! again at a millisecond).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::{Mutex, Notify, watch};
use tokio_util::sync::CancellationToken;

use super::busy::Rate;
use super::metrics::RelayMetrics;
use super::pool::RelayPool;
use crate::error::Result;
use crate::sql;

/// How often a lingering worker claims.
pub(crate) const LINGER_POLL: Duration = Duration::from_millis(1);
/// How often the concurrency limit is published for `status` (when it changed).
const DELIVERIES_PUBLISH_EVERY: Duration = Duration::from_secs(1);

/// Told whether every commit notifies the relay from now on (the fast path's condition).
pub(crate) type HearsEveryCommit = Box<dyn Fn(bool) + Send + Sync>;

/// The relay's waiting mark, as last written to `outbox_relay.relays`, and what it needs to
/// write it.
pub(crate) struct RelayRow {
    pool: RelayPool,
    /// This relay's row in `outbox_relay.relays`.
    relay_id: i64,
    /// The destination it delivers to, in its row.
    destination: String,
    /// Backend pid of the listener connection while it listens; 0 while it does not.
    listener_pid: AtomicI32,
    /// Held by the one worker that lingers for the whole relay.
    pub(crate) lingering: Mutex<()>,
    /// What the database row says; written only under this lock, so marks never reorder.
    marked: Mutex<bool>,
    /// A lock-free copy of `marked`, for the hot path.
    marked_hint: AtomicBool,
    /// The virtual transaction ids open right after the latest mark, for [`RaceClosure`], with
    /// the mark's number.
    open_at_mark: watch::Sender<(u64, Vec<String>)>,
    /// Counts the waiting marks.
    marks: AtomicU64,
    /// Told whether every commit notifies the relay (marked waiting, the mark's race closed):
    /// the fast path's word.
    hears_every_commit: HearsEveryCommit,
    /// How fast the relay claims: whether it should linger and stop writers from notifying.
    pub(crate) rate: Arc<Rate>,
}

impl RelayRow {
    pub(crate) fn new(
        pool: RelayPool,
        relay_id: i64,
        destination: String,
        hears_every_commit: HearsEveryCommit,
    ) -> Self {
        RelayRow {
            pool,
            relay_id,
            destination,
            listener_pid: AtomicI32::new(0),
            lingering: Mutex::default(),
            marked: Mutex::default(),
            marked_hint: AtomicBool::default(),
            open_at_mark: watch::Sender::new((0, Vec::new())),
            marks: AtomicU64::new(0),
            hears_every_commit,
            rate: Arc::default(),
        }
    }

    /// True when the relay may be marked waiting (writers notify).
    pub(crate) fn is_marked(&self) -> bool {
        self.marked_hint.load(Ordering::Acquire)
    }

    /// True while the listener listens: only then can a NOTIFY wake the relay.
    pub(crate) fn listening(&self) -> bool {
        self.listener_pid.load(Ordering::Acquire) != 0
    }

    /// The listener listens on the connection with this backend pid (0: it does not listen).
    /// After a reconnect the database may have lost the mark (its table is unlogged, and a
    /// restarted server empties it), so the next `set(true)` writes it again.
    pub(crate) async fn listener_changed(&self, pid: i32) {
        let mut marked = self.marked.lock().await;
        *marked = false;
        self.marked_hint.store(false, Ordering::Release);
        (self.hears_every_commit)(false);
        self.listener_pid.store(pid, Ordering::Release);
        drop(marked);
        // A row written before (the breaker's state) names the listener `status` joins it by.
        let recorded = async { sql::set_listener(&*self.pool.client().await?, self.relay_id, pid).await };
        if let Err(e) = recorded.await {
            tracing::debug!(error = %e, "could not record the new listener in the relay's row");
        }
    }

    /// The listener stopped listening.
    pub(crate) fn listener_gone(&self) {
        self.listener_pid.store(0, Ordering::Release);
    }

    /// Writes the mark when it differs from what the database holds.
    pub(crate) async fn set(&self, waiting: bool) -> Result<()> {
        let mut marked = self.marked.lock().await;
        if *marked == waiting {
            return Ok(());
        }
        if !waiting {
            // Writers that see the mark stop notifying: the fast path no longer hears of every
            // commit.
            (self.hears_every_commit)(false);
        }
        let client = self.pool.client().await?;
        if waiting {
            sql::mark_waiting(&*client, self.relay_id, self.listener_pid.load(Ordering::Acquire), &self.destination)
                .await?;
        } else {
            sql::mark_busy(&*client, self.relay_id).await?;
        }
        *marked = waiting;
        self.marked_hint.store(waiting, Ordering::Release);
        Ok(())
    }

    /// Marks the relay waiting and hands the transactions open at that moment to [`RaceClosure`].
    pub(crate) async fn go_waiting(&self) -> Result<()> {
        self.set(true).await?;
        let open = sql::open_transactions(&*self.pool.client().await?).await?;
        let mark = self.marks.fetch_add(1, Ordering::AcqRel) + 1;
        self.open_at_mark.send_replace((mark, open));
        Ok(())
    }

    /// Every transaction open at mark `mark` (and at the marks before it) has ended: if the relay
    /// is still marked by it, every commit notifies it from now on.
    async fn race_closed(&self, mark: u64) {
        let marked = self.marked.lock().await;
        if *marked && self.marks.load(Ordering::Acquire) == mark {
            (self.hears_every_commit)(true);
        }
    }

    /// Publishes the breaker's state in the relay's row, for `status`.
    pub(crate) async fn publish_breaker(&self, open: bool) -> Result<()> {
        let client = self.pool.client().await?;
        sql::set_breaker(&*client, self.relay_id, self.listener_pid.load(Ordering::Acquire), open, &self.destination)
            .await
    }

    /// Publishes the concurrency limit and the deliveries in flight in the relay's row, for
    /// `status`.
    async fn publish_deliveries(&self, listener_pid: i32, limit: i32, in_flight: i32) -> Result<()> {
        let client = self.pool.client().await?;
        sql::set_deliveries(&*client, self.relay_id, listener_pid, limit, in_flight, &self.destination).await
    }

    /// Removes the relay's row (shutdown): writers need not notify a relay that is gone.
    pub(crate) async fn remove(&self) {
        if let Ok(client) = self.pool.client().await
            && let Err(e) = sql::remove_relay(&*client, self.relay_id).await
        {
            tracing::debug!(error = %e, "could not remove the relay's row; the janitor removes it once its listener is gone");
        }
    }
}

/// The task that writes the concurrency limit and the deliveries in flight to the relay's row
/// every [`DELIVERIES_PUBLISH_EVERY`] while either (or the listener) changed. Not while the
/// listener is down: `status` finds a relay by its listener, and the janitor removes a row whose
/// listener is gone.
pub(crate) struct LimitPublisher {
    pub(crate) row: Arc<RelayRow>,
    pub(crate) metrics: Arc<RelayMetrics>,
}

impl LimitPublisher {
    /// Runs until `stop`.
    pub(crate) async fn run(self, stop: CancellationToken) {
        let LimitPublisher { row, metrics } = self;
        let mut published = None;
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(DELIVERIES_PUBLISH_EVERY) => {}
            }
            let (limit, in_flight) = metrics.deliveries_now();
            let pid = row.listener_pid.load(Ordering::Acquire);
            let (Ok(limit @ 1..), Ok(in_flight)) = (i32::try_from(limit), i32::try_from(in_flight)) else { continue };
            let now = Some((pid, limit, in_flight));
            if pid == 0 || published == now {
                continue;
            }
            match row.publish_deliveries(pid, limit, in_flight).await {
                Ok(()) => published = now,
                Err(e) => {
                    tracing::debug!(error = %e, "could not publish the concurrency limit; trying again in a second")
                }
            }
        }
    }
}

/// The task that waits, for each mark, until every transaction open right after it has ended,
/// then wakes a worker for one more claim: what such a transaction committed may have notified
/// nobody.
pub(crate) struct RaceClosure {
    pub(crate) row: Arc<RelayRow>,
    pub(crate) work: Arc<Notify>,
    /// The slowest it checks: a transaction open for longer is checked once per poll, as
    /// often as the fallback poll would find what it committed anyway.
    pub(crate) poll_interval: Duration,
}

/// The transactions a race closure waits for, each with when it was first seen open.
#[derive(Debug, Default)]
struct Waiting(Vec<(String, Instant)>);

impl Waiting {
    /// Adds a mark's transactions; one already waited for keeps its age.
    fn add(&mut self, open: &[String], now: Instant) {
        for vxid in open {
            if !self.0.iter().any(|(known, _)| known == vxid) {
                self.0.push((vxid.clone(), now));
            }
        }
    }

    /// Keeps the transactions still open; returns whether any ended.
    fn keep(&mut self, still_open: &[String]) -> bool {
        let before = self.0.len();
        self.0.retain(|(vxid, _)| still_open.contains(vxid));
        self.0.len() < before
    }

    /// How long until the next check: as long as the youngest transaction has been open
    /// (checks back off as a transaction stays open, so that one held for minutes costs a check
    /// a poll, while the writers' transactions of a moment are seen to end within a
    /// millisecond or two), within `[LINGER_POLL, poll_interval]`.
    fn pause(&self, now: Instant, poll_interval: Duration) -> Duration {
        let youngest = self.0.iter().map(|(_, seen)| now.saturating_duration_since(*seen)).min();
        youngest.unwrap_or_default().clamp(LINGER_POLL, poll_interval.max(LINGER_POLL))
    }

    fn vxids(&self) -> Vec<String> {
        self.0.iter().map(|(vxid, _)| vxid.clone()).collect()
    }
}

impl RaceClosure {
    /// Runs until `stop`.
    pub(crate) async fn run(self, stop: CancellationToken) {
        let RaceClosure { row, work, poll_interval } = self;
        let mut marks = row.open_at_mark.subscribe();
        let mut waiting = Waiting::default();
        let mut mark = 0;
        loop {
            if waiting.0.is_empty() {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    changed = marks.changed() => if changed.is_err() { return },
                }
            } else {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(waiting.pause(Instant::now(), poll_interval)) => {}
                    // A newer mark: its transactions join those waited for.
                    changed = marks.changed() => if changed.is_err() { return },
                }
            }
            let (latest, fresh) = marks.borrow_and_update().clone();
            mark = mark.max(latest);
            waiting.add(&fresh, Instant::now());
            if waiting.0.is_empty() {
                // A mark with nothing open: what committed before it is in the next claim.
                row.race_closed(mark).await;
                work.notify_one();
                continue;
            }
            let still_open = async { sql::still_open(&*row.pool.client().await?, &waiting.vxids()).await };
            match still_open.await {
                Ok(open) => {
                    if waiting.keep(&open) {
                        // What the ended ones committed may have notified nobody.
                        if waiting.0.is_empty() {
                            row.race_closed(mark).await;
                        }
                        work.notify_one();
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "checking the transactions open at the waiting mark failed; claiming anyway");
                    waiting.0.clear();
                    work.notify_one();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A transaction held open is checked less and less often, down to once a poll, and a new
    /// mark that finds it again does not make it young; a mark's new transactions are checked
    /// at once.
    #[test]
    fn checks_back_off_with_the_youngest_transactions_age() {
        let poll = Duration::from_secs(1);
        let start = Instant::now();
        let mut waiting = Waiting::default();
        waiting.add(&["3/7".to_string()], start);
        assert_eq!(waiting.pause(start, poll), LINGER_POLL);
        assert_eq!(waiting.pause(start + Duration::from_millis(40), poll), Duration::from_millis(40));
        let later = start + Duration::from_secs(120);
        assert_eq!(waiting.pause(later, poll), poll);
        waiting.add(&["3/7".to_string()], later);
        assert_eq!(waiting.pause(later, poll), poll, "a new mark does not make a held transaction young");
        waiting.add(&["4/9".to_string()], later);
        assert_eq!(waiting.pause(later, poll), LINGER_POLL);
        assert!(waiting.keep(&["3/7".to_string()]));
        assert_eq!(waiting.pause(later, poll), poll);
        assert!(!waiting.keep(&["3/7".to_string()]));
        assert!(waiting.keep(&[]));
        assert!(waiting.0.is_empty());
    }
}
