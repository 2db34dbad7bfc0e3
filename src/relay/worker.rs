//! A delivery worker's state machine: wait for work, drain the queue batch by batch, and when it
//! runs dry at a high rate linger (claiming every millisecond for a while) before marking the
//! relay waiting for NOTIFY (see `row.rs` for why). While the outage breaker is open it claims nothing and waits
//! for its turn to probe (see `breaker.rs`).

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::Handler;
use super::backoff::retry_delay;
use super::batch::Batches;
use super::breaker::Turn;
use super::claim::Claim;
use super::row::{LINGER_POLL, RelayRow};
use crate::error::Result;

/// How many of its claimed batches a worker has in delivery at most (it claims the next while
/// one fewer are).
const DELIVERING_PER_WORKER: usize = 2;

/// Longest pause after a failed claim (the database is down or restarting).
const ERROR_PAUSE_MAX: Duration = Duration::from_secs(5);

/// One worker and what it needs.
pub(crate) struct Worker<H> {
    pub(crate) batches: Arc<Batches<H>>,
    pub(crate) row: Arc<RelayRow>,
    /// "There may be events": wakes one waiting worker (or stores one wake-up).
    pub(crate) work: Arc<Notify>,
    /// Stop claiming; finish what is in hand.
    pub(crate) linger: Duration,
}

impl<H: Handler> Worker<H> {
    /// Claims and delivers until `stop`.
    pub(crate) async fn run(self, stop: CancellationToken) {
        let mut failures = 0u32;
        loop {
            if self.batches.breaker().is_open() {
                match self.batches.breaker().turn(&stop).await {
                    Turn::Stop => return,
                    Turn::Closed => {}
                    Turn::Probe => {
                        if let Err(e) = self.batches.claim_and_deliver(Claim::Probe).await {
                            self.batches.claims.metrics.claim_failed();
                            tracing::warn!(error = %e, "probing the destination failed to claim");
                            self.batches.breaker().probe_found_nothing();
                        }
                        continue;
                    }
                }
            } else {
                tokio::select! {
                    biased;
                    _ = stop.cancelled() => return,
                    _ = self.work.notified() => tracing::trace!("a worker woke"),
                }
            }
            if let Err(e) = self.drain(&stop).await {
                self.batches.claims.metrics.claim_failed();
                tracing::warn!(error = %e, "claiming events failed");
                failures += 1;
                if !self.pause_after_error(failures, &stop).await {
                    return;
                }
                self.work.notify_one(); // try again, this worker or another
                continue;
            }
            failures = 0;
            // Out of work. Unless the relay is already marked waiting, one worker lingers for it
            // and then marks it waiting for NOTIFY. Workers queue for that turn rather than skip
            // it: a worker that unmarked the relay while another was lingering must see to it
            // that someone lingers and marks again, or writers would stop notifying an idle relay.
            if !self.row.is_marked() && !self.batches.breaker().is_open() {
                let _turn = self.row.lingering.lock().await;
                if !self.row.is_marked() {
                    self.linger_then_wait(&stop).await;
                }
            }
        }
    }

    /// Claims until a claim comes back empty and no batch in delivery asks for another claim
    /// once it is done, or (while writers notify the relay) a short batch took everything: then
    /// the queue is drained, for now. (New events are claimed by one transaction at a time, so a
    /// batch that holds their lock claims again once it is done if new ones may wait; and a
    /// parked key's next event becomes claimable only once its head is done, which no
    /// notification says: see `Batches::deliver_and_record`.) The next batch is claimed while
    /// the last is being delivered, so the database's round trips overlap the destination's (parked
    /// events only, while the last batch holds the new events' lock); a worker has at most
    /// [`DELIVERING_PER_WORKER`] batches in delivery, and holds no more batches than that.
    async fn drain(&self, stop: &CancellationToken) -> Result<()> {
        let batch_size = self.batches.batch_size();
        let mut delivering = FuturesUnordered::new();
        let outcome = 'claiming: loop {
            if stop.is_cancelled() {
                break Ok(());
            }
            // Whether a batch that asks for another claim was done while this claim ran.
            let mut unblocked = false;
            let claim = self.batches.claim(Claim::Batch { schedule_next: true });
            tokio::pin!(claim);
            let claimed = loop {
                tokio::select! {
                    claimed = &mut claim => break claimed,
                    Some(again) = delivering.next(), if !delivering.is_empty() => unblocked |= again,
                }
            };
            let batch = match claimed {
                Ok(Some(batch)) => batch,
                Ok(None) if unblocked => continue,
                Ok(None) => {
                    while let Some(again) = delivering.next().await {
                        if again {
                            continue 'claiming;
                        }
                    }
                    break Ok(());
                }
                Err(e) => break Err(e),
            };
            let full = batch.count == batch_size;
            // A short batch whose delta was not cut short took everything claimable; while the
            // relay is marked waiting, whatever is committed later notifies it. So no claim is
            // needed until then, but one once the batch is done if it asks for one (see below):
            // a quiet service pays one claim per event.
            let more = batch.more;
            let took_all = !full && !more;
            delivering.push(self.batches.deliver_and_record(batch));
            if self.row.is_marked() && self.row.rate.is_busy() {
                // Busy: writers need not notify until this relay is idle again. (The batch is
                // delivered meanwhile.)
                let unmark = self.row.set(false);
                tokio::pin!(unmark);
                let unmarked = loop {
                    tokio::select! {
                        unmarked = &mut unmark => break unmarked,
                        Some(_) = delivering.next(), if !delivering.is_empty() => {}
                    }
                };
                if let Err(e) = unmarked {
                    break Err(e);
                }
            }
            if full || more {
                // More may be waiting: let an idle worker help (with parked events: the new ones
                // are this batch's until it is done) while this one claims again.
                self.work.notify_one();
            }
            if took_all && self.row.is_marked() {
                // A parked key's next event, or a new one that a claim turned away by this
                // batch's lock found, is claimable once the batch is done.
                let mut unblocked = false;
                while let Some(again) = delivering.next().await {
                    unblocked |= again;
                }
                if unblocked {
                    continue;
                }
                break Ok(());
            }
            while delivering.len() >= DELIVERING_PER_WORKER {
                delivering.next().await;
            }
        };
        while delivering.next().await.is_some() {}
        outcome
    }

    /// Waits a little after failed claims (the database is down or restarting); false when the
    /// relay is stopping.
    async fn pause_after_error(&self, failures: u32, stop: &CancellationToken) -> bool {
        let pause = retry_delay(failures, Duration::from_millis(50), ERROR_PAUSE_MAX, 0.5, rand::random());
        tokio::select! {
            _ = stop.cancelled() => false,
            _ = tokio::time::sleep(pause) => true,
        }
    }

    /// Lingers while work keeps coming at a high rate, then marks the relay waiting (the race
    /// closure follows in its own task). Returns when the relay is waiting, or stopping, or the listener is down
    /// and only the poll can help.
    async fn linger_then_wait(&self, stop: &CancellationToken) {
        let mut quiet_since = Instant::now();
        while quiet_since.elapsed() < self.linger && self.row.rate.is_busy() {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = self.work.notified() => {}
                _ = tokio::time::sleep(LINGER_POLL) => {}
            }
            match self.batches.claim_and_deliver(Claim::Batch { schedule_next: false }).await {
                Ok(0) => {}
                Ok(n) => {
                    quiet_since = Instant::now();
                    if n == self.batches.batch_size() {
                        // A backlog: let the other workers help.
                        self.work.notify_one();
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "claiming events failed while lingering");
                    return;
                }
            }
        }
        if stop.is_cancelled() || !self.row.listening() {
            return; // no listener to hear a NOTIFY: the fallback poll and the reconnect catch-up cover it
        }
        if let Err(e) = self.row.go_waiting().await {
            tracing::warn!(error = %e, "marking the relay waiting failed; the fallback poll covers it");
        }
    }
}
