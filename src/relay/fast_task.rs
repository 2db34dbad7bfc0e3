//! The fast path's task (see `fast.rs`): takes the events the listener queued, hands them to the
//! handler, judges the results as a claim's, then claims so that the outcomes are recorded (and
//! whatever the notifications did not carry is delivered): within `RECORD_LINGER` of the first
//! delivery it has not recorded, so that at a trickle one claim records several deliveries.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::batch::Batches;
use super::claim::Claim;
use super::fast::{FastPath, WAITING_KEYS_MAX};
use super::handler::{Handler, Progress};
use super::held::NewLock;
use super::lease::beside;
use super::outcome::{Outcome, Outcomes};
use super::pool::RelayPool;
use crate::event::Event;
use crate::sql;

/// How soon a failed read of the keys that wait is tried again.
const KEYS_RETRY: Duration = Duration::from_secs(1);
/// How long the task sleeps with nothing to do and no word.
const IDLE: Duration = Duration::from_secs(3600);
/// The least time a delivery from notifications runs before it is leased, whatever the hold: it
/// holds no transaction open, so a zero hold (which leases every claim at once) is no reason to
/// write a lease for every one.
const FAST_HOLD_MIN: Duration = Duration::from_millis(100);
/// How soon a lease that could not be written is tried again.
const LEASE_RETRY: Duration = Duration::from_secs(1);
/// How long after a delivery from notifications the claim that records it may wait for more to
/// record with it, once no notification waits. At 40 events a second, one claim a quarter of a
/// second records ten: the claim (its statement, its position, its commit) was most of what a
/// trickle cost the relay and its backends, one per event (a relay and its backends at 40 events
/// a second, `benches/storage/trickle_cpu.sh`: 2.44 to 2.89 % of a core with a tenth of a
/// second, 1.94 to 2.14 % with a quarter). A relay killed meanwhile sends those deliveries again
/// (at least once), as it does what was in flight; a relay that stops records them first.
const RECORD_LINGER: Duration = Duration::from_millis(250);
/// At a stop, how often the claim that records what is left is tried, and how far apart.
const STOP_RECORD_TRIES: u32 = 40;
const STOP_RECORD_RETRY: Duration = Duration::from_millis(25);

/// The fast path's task and what it needs.
pub(crate) struct FastTask<H> {
    pub(crate) batches: Arc<Batches<H>>,
    pub(crate) pool: RelayPool,
    /// The destination's name.
    pub(crate) to: String,
    /// Dead letters hold their keys (`dead_letter_holds_key`).
    pub(crate) dead_letters_hold: bool,
    /// Wakes a worker to claim.
    pub(crate) work: Arc<Notify>,
}

impl<H: Handler> FastTask<H> {
    /// Runs until `stop`; then has what it delivered recorded, so that a restart does not send
    /// it again.
    pub(crate) async fn run(self, stop: CancellationToken) {
        let fast = self.batches.claims.fast.clone();
        // Since the first delivery not recorded yet.
        let mut unrecorded_since: Option<Instant> = None;
        loop {
            let wait = match unrecorded_since {
                Some(since) => RECORD_LINGER.saturating_sub(since.elapsed()),
                None if fast.keys_wanted() => KEYS_RETRY,
                None => IDLE,
            };
            tokio::select! {
                biased;
                _ = stop.cancelled() => break,
                _ = fast.ready.notified() => {}
                _ = tokio::time::sleep(wait) => {}
            }
            if fast.keys_wanted() {
                self.read_keys(&fast).await;
            }
            // Events heard of while a batch was delivered go next, before the claim that
            // records them all: at least every `record_every` while they keep coming (so that a
            // relay killed then sends again only what it delivered since), else once
            // `RECORD_LINGER` has passed with none waiting.
            while !stop.is_cancelled() && self.deliver_one(&fast).await {
                let since = *unrecorded_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= self.batches.leases.record_every && fast.queued() {
                    self.record(&fast).await;
                    unrecorded_since = None;
                }
            }
            if unrecorded_since.is_some_and(|since| since.elapsed() >= RECORD_LINGER) {
                self.record(&fast).await;
                unrecorded_since = None;
            }
        }
        // Recorded before the relay stops, so that a restart does not send it again. A claim of
        // a worker may hold the new events a moment (this claim is then turned away, and the
        // workers are stopping): try again, for at most about a second.
        let mut tries = 0;
        while (unrecorded_since.take().is_some() || fast.undecided_left()) && tries < STOP_RECORD_TRIES {
            if tries > 0 {
                tokio::time::sleep(STOP_RECORD_RETRY).await;
            }
            self.record(&fast).await;
            tries += 1;
        }
    }

    /// Reads the keys that wait (parked, held), which the fast path keeps from then on.
    async fn read_keys(&self, fast: &FastPath) {
        let read = async {
            sql::waiting_keys(&*self.pool.client().await?, &self.to, self.dead_letters_hold, WAITING_KEYS_MAX).await
        };
        match read.await {
            Ok(keys) => {
                if keys.is_none() {
                    tracing::info!(
                        max = WAITING_KEYS_MAX,
                        "more keys than this have events that wait; events with a key are claimed before they are delivered"
                    );
                }
                fast.keys_read(keys);
            }
            Err(e) => tracing::debug!(error = %e, "could not read the keys that wait; trying again"),
        }
    }

    /// Delivers one fast batch; false when there was none to take.
    async fn deliver_one(&self, fast: &FastPath) -> bool {
        let batches = &self.batches;
        let taken = {
            // Claims of new events and the fast path take turns; and none while a batch of this
            // relay's new events is uncommitted (it is woken when it is done).
            let _gate = batches.claims.new_gate.lock().await;
            if NewLock::held(&batches.claims.new_lock) {
                return false;
            }
            fast.take(batches.batch_size(), batches.breaker().is_open())
        };
        if taken.is_empty() {
            return false;
        }
        let (events, ages): (Vec<Event>, Vec<Duration>) = taken.into_iter().unzip();
        tracing::trace!(events = events.len(), "delivering from notifications");
        let started = Instant::now();
        let token = rand::random::<i64>();
        let progress = Arc::<Progress>::default();
        let (results, leased) = {
            let delivery = batches.delivery.deliver(&events, &progress);
            tokio::pin!(delivery);
            self.keep(&mut delivery, &events, token, &progress, fast).await
        };
        if leased {
            let mut outcomes = Outcomes::default();
            match results {
                // Cut off at shutdown: given back, due at once.
                None => outcomes.release_all(&events),
                Some(results) => batches.judge.judge(&events, &ages, started, results, false, &mut outcomes).await,
            }
            let delivered = outcomes.count(|outcome| matches!(outcome, Outcome::Delivered));
            let ids: HashSet<i64> = events.iter().map(|event| event.id).collect();
            batches.settle(None, token, &events, outcomes, &ids, false).await;
            batches.recorder.metrics.fast_delivered(delivered);
            fast.leased_done();
            return true;
        }
        let decided = match results {
            // Cut off at shutdown: nothing decided; a claim delivers them again.
            None => None,
            Some(results) => {
                let mut outcomes = Outcomes::default();
                batches.judge.judge(&events, &ages, started, results, false, &mut outcomes).await;
                let elapsed = started.elapsed();
                let mut by_id: HashMap<i64, Outcome> =
                    outcomes.events.into_iter().map(|(id, _, outcome)| (id, outcome)).collect();
                let decided = events.into_iter().zip(ages).filter_map(|(event, age)| {
                    let outcome = by_id.remove(&event.id)?;
                    let latency = matches!(outcome, Outcome::Delivered).then_some(age + elapsed);
                    Some((event, outcome, latency))
                });
                Some(decided.collect())
            }
        };
        fast.delivered(decided);
        true
    }

    /// Waits for a fast batch's `delivery`. One that outlives the hold is leased, as a claim's is
    /// (`lease.rs`): its events are copied into the parked ones under a lease of `token`, so that
    /// claims of new events go on meanwhile (and hold the events' keys' later ones back behind
    /// the copies); then the lease is renewed and what is delivered so far recorded by the token
    /// as a leased claim's (`Leases::keep_while`). Returns the delivery's results and whether
    /// it was leased.
    async fn keep<F: std::future::Future + Unpin>(
        &self,
        delivery: &mut F,
        events: &[Event],
        token: i64,
        progress: &Progress,
        fast: &FastPath,
    ) -> (F::Output, bool) {
        let leases = &self.batches.leases;
        let mut copies = sql::Copies::default();
        for event in events {
            copies.push(event.id, leases.lease, None, event.attempts);
        }
        let mut wait = leases.hold.max(FAST_HOLD_MIN);
        loop {
            tokio::select! {
                done = &mut *delivery => return (done, false),
                () = tokio::time::sleep(wait) => {}
            }
            let lease =
                async { sql::park_new_events(&*self.pool.client().await?, &self.to, &copies, Some(token)).await };
            let (leased, done) = beside(&mut *delivery, lease).await;
            match leased {
                Ok(_) => break,
                Err(e) => {
                    tracing::warn!(error = %e, events = events.len(), retry_in = ?LEASE_RETRY, "leasing a delivery from notifications that outlived the hold failed; new events wait meanwhile");
                    if let Some(done) = done {
                        return (done, false);
                    }
                    wait = LEASE_RETRY;
                }
            }
        }
        tracing::debug!(events = events.len(), "a delivery from notifications outlived the hold; it is leased");
        fast.lease_flight(events);
        let claimed: Vec<(i64, i32)> = events.iter().map(|event| (event.id, event.attempts)).collect();
        let parked: HashSet<i64> = claimed.iter().map(|(id, _)| *id).collect();
        let (mut no_claim, mut early, now) = (None, Vec::new(), Instant::now());
        let mut record_at = now + leases.record_every;
        let done = leases
            .keep_while(
                &mut *delivery,
                &mut no_claim,
                &claimed,
                &parked,
                token,
                (now, now),
                &mut record_at,
                progress,
                &mut early,
            )
            .await;
        (done, true)
    }

    /// Claims, so that what the fast path decided is recorded; leaves it to a worker when this
    /// claim could not (another claim of this relay holds the new events). At a rate at which
    /// notifying costs writers more than it brings (`busy.rs`), marks the relay busy, as a worker
    /// that claims does: writers stop notifying, and the workers claim, linger and mark the relay
    /// waiting again once the rate drops.
    async fn record(&self, fast: &FastPath) {
        if let Err(e) = self.batches.claim_and_deliver(Claim::Batch { schedule_next: true }).await {
            tracing::warn!(error = %e, "claiming to record what was delivered from notifications failed");
        }
        let row = &self.batches.row;
        if row.is_marked() && row.rate.is_busy() {
            if let Err(e) = row.set(false).await {
                tracing::warn!(error = %e, "marking the relay busy failed");
            }
            self.work.notify_one();
        } else if fast.undecided_left() {
            self.work.notify_one();
        }
    }
}
