//! Keeping a batch's events this claim's while they are delivered: a held claim is turned into
//! a lease once its delivery outlives `hold`, and the lease is renewed every half lease, so that
//! no other claim takes events whose requests may still succeed. (A delivery's time limit is the
//! handler's own, the HTTP sink's timeout say, never the lease.)

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::handler::Progress;
use super::held::Held;
use super::pool::RelayPool;
use crate::error::Result;
use crate::sql;

/// Runs `work` while `delivery` goes on (its requests are not held up by the database's round
/// trip): `work`'s output, and the delivery's, when it ended meanwhile. `work` is polled first,
/// so that its statements are on their way before the delivery's own work begins.
pub(crate) async fn beside<F: std::future::Future + Unpin, T>(
    delivery: &mut F,
    work: impl std::future::Future<Output = T>,
) -> (T, Option<F::Output>) {
    let work = std::pin::pin!(work);
    match futures::future::select(work, delivery).await {
        futures::future::Either::Left((output, _)) => (output, None),
        futures::future::Either::Right((done, work)) => (work.await, Some(done)),
    }
}

/// Whether what `whose` delivered so far (`events`) was recorded, logged either way (a failure
/// is tried again at the next turn).
fn written_so_far(written: Result<u64>, events: usize, whose: &str) -> bool {
    match written {
        Ok(_) => {
            tracing::trace!(events, "recorded what {whose} delivered so far");
            true
        }
        Err(e) => {
            tracing::debug!(error = %e, events, "recording what {whose} delivered so far failed; trying again");
            false
        }
    }
}

/// Leases a destination's claims and renews them.
pub(crate) struct Leases {
    pub(crate) pool: RelayPool,
    /// The destination's name.
    pub(crate) to: String,
    /// How long a lease lasts.
    pub(crate) lease: Duration,
    /// How long a claim is held before it is leased (zero: leased at once).
    pub(crate) hold: Duration,
    /// "There may be events": wakes a worker once a lease frees the new events' lock.
    pub(crate) work: Arc<Notify>,
    /// How often what a claim in delivery has delivered so far is recorded (zero: at its end).
    pub(crate) record_every: Duration,
}

impl Leases {
    /// Waits for `delivery`, keeping its events this claim's for as long as it runs, and records
    /// every `record_every` those of its events that `progress` says are delivered: while the
    /// claim is held, from another connection into `early_deliveries` (their ids then added to
    /// `early`, for the claim's commit to record); once it is leased, by the lease's token.
    /// `claimed`: the ids and attempts of every event of the claim, `parked`: those claimed from
    /// the parked events; `held_since`: when the held claim's transaction began (its first batch
    /// was claimed: later ones are read ahead in it); `record_at`: when what was delivered is
    /// recorded next (the transaction's timer, which goes on from batch to batch).
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn keep_while<F: std::future::Future + Unpin>(
        &self,
        mut delivery: F,
        held: &mut Option<Held>,
        claimed: &[(i64, i32)],
        parked: &HashSet<i64>,
        token: i64,
        (claimed_at, held_since): (Instant, Instant),
        record_at: &mut Instant,
        progress: &Progress,
        early: &mut Vec<i64>,
    ) -> F::Output {
        let renew_every = self.lease / 2;
        // With `hold` zero the claim was leased when it was claimed.
        let mut next = if held.is_some() { held_since + self.hold } else { claimed_at + renew_every };
        let mut leased = held.is_none();
        let mut ids: Vec<i64> = claimed.iter().map(|(id, _)| *id).collect();
        let recording = !self.record_every.is_zero();
        loop {
            tokio::select! {
                done = &mut delivery => return done,
                () = tokio::time::sleep_until(next) => {
                    match held.take() {
                        Some(claim) => {
                            leased = self.lease(claim, claimed, parked, token, early).await;
                            // Recorded by the lease: nothing more to renew, or to record at the end.
                            let recorded: HashSet<i64> = std::mem::take(early).into_iter().collect();
                            ids.retain(|id| !recorded.contains(id));
                        }
                        None if leased => leased = self.renew(&ids, token).await,
                        None => {}
                    }
                    next = Instant::now() + renew_every;
                }
                // A held claim's deliveries are written beside it, committed at once, and
                // recorded as delivered by its commit (or, after a crash, by the next claim);
                // leasing it to record them would cost the lease's writes, and a key's later
                // events their parking, for every delivery that outlives `record_every`. A claim
                // whose lease failed has no transaction left to record them in.
                () = tokio::time::sleep_until(*record_at), if recording && (held.is_some() || leased) => {
                    let delivered = self.due(record_at, progress);
                    if delivered.is_empty() {
                        continue;
                    }
                    let done = if held.is_some() {
                        beside(&mut delivery, self.record_beside(delivered, token, progress, early)).await.1
                    } else {
                        let (recorded, done) = beside(&mut delivery, self.record_delivered(&delivered, token)).await;
                        if recorded {
                            let delivered: HashSet<i64> = delivered.into_iter().collect();
                            ids.retain(|id| !delivered.contains(id));
                        } else {
                            // Still leased (renewed with the rest), tried again at the next turn.
                            progress.put_back(delivered);
                        }
                        done
                    };
                    if let Some(done) = done {
                        return done;
                    }
                }
            }
        }
    }

    /// Records `delivered`, events of a leased claim still in delivery, by the lease's token;
    /// returns whether it did.
    async fn record_delivered(&self, delivered: &[i64], token: i64) -> bool {
        let recorded =
            async { sql::complete_parked(&*self.pool.client().await?, &self.to, delivered, Some(token)).await };
        written_so_far(recorded.await, delivered.len(), "a claim in delivery")
    }

    /// What `progress` says was delivered and is not recorded yet, once `record_at` has passed
    /// (which is then set `record_every` on); nothing before, or when recording is off.
    pub(crate) fn due(&self, record_at: &mut Instant, progress: &Progress) -> Vec<i64> {
        let now = Instant::now();
        if self.record_every.is_zero() || now < *record_at {
            return Vec::new();
        }
        *record_at = now + self.record_every;
        progress.take()
    }

    /// Records `delivered`, events of a held transaction (`token`) delivered while it is still
    /// open, in `early_deliveries` from another connection: added to `early` (for the
    /// transaction's commit to forget) once recorded, given back to `progress` otherwise (the
    /// transaction goes on: tried again at the next turn).
    pub(crate) async fn record_beside(
        &self,
        delivered: Vec<i64>,
        token: i64,
        progress: &Progress,
        early: &mut Vec<i64>,
    ) {
        if delivered.is_empty() {
            return;
        }
        let recorded =
            async { sql::record_early_deliveries(&*self.pool.client().await?, &self.to, token, &delivered).await };
        if written_so_far(recorded.await, delivered.len(), "a held claim") {
            early.extend(delivered);
        } else {
            progress.put_back(delivered);
        }
    }

    /// Extends the lease of a delivery still running; returns whether the lease is still this
    /// claim's (a failed renewal is tried again at the next turn).
    pub(crate) async fn renew(&self, ids: &[i64], token: i64) -> bool {
        let renewed = async { sql::renew_lease(&*self.pool.client().await?, &self.to, ids, self.lease, token).await };
        match renewed.await {
            Ok(n) if n as usize == ids.len() => {
                tracing::debug!(events = ids.len(), "a delivery goes on; its lease is renewed");
                true
            }
            Ok(n) => {
                tracing::warn!(
                    events = ids.len(),
                    still_held = n,
                    "a delivery outlived its lease before the relay could renew it: another claim took some of its events, \
                     which will be delivered again"
                );
                n > 0
            }
            Err(e) => {
                tracing::warn!(error = %e, events = ids.len(), "renewing the lease of a delivery still running failed; trying again");
                true
            }
        }
    }

    /// Turns a held claim into a lease under `token` and commits it; the delivery goes on: the
    /// parked events are leased, the new ones copied into the parked events under the lease
    /// (their outbox rows then finished, as far as this destination goes). The events `early`
    /// recorded as delivered already are recorded so in the same transaction, not leased.
    /// Returns whether the lease was written.
    pub(crate) async fn lease(
        &self,
        held: Held,
        claimed: &[(i64, i32)],
        parked: &HashSet<i64>,
        token: i64,
        early: &[i64],
    ) -> bool {
        let (lease, to) = (self.lease, self.to.as_str());
        let had_new_lock = held.has_new_lock();
        let forget_early = !early.is_empty() || held.recorded_early();
        let done: HashSet<i64> = early.iter().copied().collect();
        let ids: Vec<i64> = claimed.iter().map(|(id, _)| *id).collect();
        let was_parked: Vec<i64> = ids.iter().copied().filter(|id| parked.contains(id)).collect();
        let (parked_done, was_parked): (Vec<i64>, Vec<i64>) = was_parked.into_iter().partition(|id| done.contains(id));
        let mut copies = sql::Copies::default();
        for (id, attempt) in claimed.iter().filter(|(id, _)| !parked.contains(id) && !done.contains(id)) {
            // The attempt is counted, as the parked events' lease counts it.
            copies.push(*id, lease, None, *attempt);
        }
        let leased = held.commit_after(async |db: &deadpool_postgres::ClientWrapper| {
            let mut writes: Vec<BoxFuture<'_, Result<u64>>> = Vec::new();
            if !was_parked.is_empty() {
                writes.push(Box::pin(sql::lease_held_parked(db, to, &was_parked, lease, token)));
            }
            if !copies.ids.is_empty() {
                writes.push(Box::pin(sql::park_new_events(db, to, &copies, Some(token))));
            }
            if !parked_done.is_empty() {
                writes.push(Box::pin(sql::complete_parked(db, to, &parked_done, None)));
            }
            if forget_early {
                writes.push(Box::pin(sql::forget_early_deliveries(db, to, token)));
            }
            futures::future::try_join_all(writes).await.map(drop)
        });
        match leased.await {
            Ok(_) => {
                tracing::debug!(events = ids.len(), hold = ?self.hold, "a delivery outlived the hold; its claim is leased");
                if had_new_lock {
                    // The new events' lock is free while this delivery goes on: another worker
                    // takes the new events committed meanwhile.
                    self.work.notify_one();
                }
                true
            }
            // The transaction is gone, and with it the claim: the events are claimable again,
            // and what this delivery achieves is not recorded (they are delivered again).
            Err(e) => {
                tracing::warn!(error = %e, events = ids.len(), "turning a held claim into a lease failed; its events will be delivered again");
                false
            }
        }
    }
}
