//! Claiming a batch for a destination: new events (read by transaction snapshots above the
//! destination's position, under the lock that one transaction at a time holds: see migration
//! 0008) and parked ones (failed, delayed, paused, leased, behind their key: row-locked).
//!
//! A claim holds its events in one of two ways. *Held* (the default, `hold` above zero): the
//! claim's transaction stays open during the delivery, its locks are the lease, and the outcomes
//! (and the position it moved) commit with it (see `held.rs`). A delivery that outlives `hold`
//! turns the claim into a *lease* (`lease.rs`): the rows are parked with `available_at` moved
//! past the lease, the attempt counted and the claim's token, the transaction commits, and the
//! outcomes are recorded later by token. With `hold` zero every claim is leased at once, in a
//! transaction of its own (every event is then parked: the one mode whose cost per event depends
//! on vacuum again).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::breaker::Breaker;
use super::busy::Rate;
use super::config::RelayConfig;
use super::fast::{Busy, FastPath, Snapshot, Ticket};
use super::held::{Held, NewLock, READ_AHEAD, SharedNewLock};
use super::lease::Leases;
use super::metrics::RelayMetrics;
use super::outcome::{Outcome, Outcomes};
use super::pauses::Pauses;
use super::pool::RelayPool;
use super::timer::Timer;
use crate::error::Result;
use crate::event::Event;
use crate::sql;

/// What claiming a destination's batches needs.
pub(crate) struct Claims {
    pub(crate) pool: RelayPool,
    /// The destination, as registered.
    pub(crate) to: sql::Destination,
    pub(crate) config: RelayConfig,
    pub(crate) metrics: Arc<RelayMetrics>,
    /// Says whether parked events may be due, and is told of the next due one.
    pub(crate) timer: Arc<Timer>,
    /// While it is open only a probe claims.
    pub(crate) breaker: Arc<Breaker>,
    /// Told how many events each claim took.
    pub(crate) rate: Arc<Rate>,
    /// Where the next claim looks first.
    pub(crate) turns: Turns,
    /// The topics not to claim.
    pub(crate) pauses: Arc<Pauses>,
    /// The new events' lock: whether a transaction of this relay holds it, and whether a
    /// claim turned away by it wants the holder to claim again once done.
    pub(crate) new_lock: SharedNewLock,
    /// Held by the claim of new events in progress (see `claim`), and by the fast path while it
    /// takes a batch.
    pub(crate) new_gate: tokio::sync::Mutex<()>,
    /// The fast path: what it delivered, for the claims to record; what they took, for it.
    pub(crate) fast: Arc<FastPath>,
}

/// Where the next claim's walk over the parked keys goes on, and which kind of event takes its
/// batch first (they alternate, so that neither starves the other).
#[derive(Debug, Default)]
pub(crate) struct Turns {
    next: std::sync::atomic::AtomicU32,
    walk_after: std::sync::Mutex<String>,
}

impl Turns {
    /// The turn of the next claim of up to `batch_size` events; the walk takes twice as many
    /// keys as the claim may take heads, within bounds. `parked`: whether parked events may be
    /// due (see `Timer::parked_turn`).
    fn next(&self, config: &RelayConfig, paused: Arc<[String]>, new: bool, parked: bool, fast_owner: i32) -> sql::Turn {
        let n = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let walk_after = self.walk_after.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).clone();
        let walk_keys = i32::try_from(config.batch_size.saturating_mul(2).clamp(64, 20_000)).unwrap_or(20_000);
        let bytes = i64::try_from(config.batch_bytes).unwrap_or(i64::MAX);
        sql::Turn {
            new,
            parked,
            parked_first: n % 2 == 1,
            walk_after,
            walk_keys,
            paused,
            bytes,
            fast_owner,
            own_records: 0,
        }
    }

    /// Where the last walk over the parked keys ended: the next one goes on from there.
    fn walked(&self, end: Option<String>) {
        *self.walk_after.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = end.unwrap_or_default();
    }
}

/// How many claims in a row may only park events or move a position before the relay stops
/// for this turn (each is a transaction of its own; a long paused backlog takes several).
const CHANGED_CLAIMS_MAX: usize = 64;

/// A claimed batch, waiting to be delivered.
pub(crate) struct Batch {
    /// The claim's open transaction while the claim is held; `None` once it is leased.
    pub(crate) held: Option<Held>,
    /// The token a lease of this claim carries.
    pub(crate) token: i64,
    pub(crate) claimed_at: Instant,
    /// Rows claimed, the unreadable ones included.
    pub(crate) count: usize,
    /// The claim holds the new events' lock.
    pub(crate) held_new: bool,
    /// It took parked events with a key: once it is done, their keys' next parked events are
    /// their heads.
    pub(crate) parked_keyed: bool,
    /// More new events wait: the delta was cut short.
    pub(crate) more: bool,
    pub(crate) events: Vec<Event>,
    pub(crate) ages: Vec<Duration>,
    /// What is already decided: rows no handler can be given.
    pub(crate) outcomes: Outcomes,
    pub(crate) probe: bool,
    /// The ids claimed from the destination's parked events (the others are new events).
    pub(crate) parked: HashSet<i64>,
    /// The keys of its new events, which the fast path holds back until the batch is done.
    pub(crate) busy: Option<Busy>,
    /// Read ahead: the events whose outcome the fast path had decided (among `outcomes`), and
    /// whether each was delivered. The fast path keeps those outcomes until the batch is the
    /// transaction's ([`Claims::adopted`]): were the batch undone (the batch delivered before it
    /// leased, cut off, or the transaction ended), the claim that meets the events again records
    /// them instead of handing them over a second time.
    pub(crate) fast_decided: Vec<(i64, bool)>,
}

impl Batch {
    /// The id and attempt of every claimed event, the rows no handler can be given too (their
    /// outcome is recorded by a lease's token like the others').
    pub(crate) fn claimed(&self) -> Vec<(i64, i32)> {
        let readable = self.events.iter().map(|e| (e.id, e.attempts));
        readable.chain(self.outcomes.events.iter().map(|(id, attempt, _)| (*id, *attempt))).collect()
    }

    /// Takes out the events of `keys` (keys that wait now: an event of theirs in the batch
    /// delivered before this one failed or was given back, after this one was read ahead):
    /// their ids and attempts, to be parked behind them.
    pub(crate) fn behind(&mut self, keys: &[String]) -> Vec<(i64, i32)> {
        if keys.is_empty() {
            return Vec::new();
        }
        let keys: HashSet<&str> = keys.iter().map(String::as_str).collect();
        let mut behind = Vec::new();
        let mut ages = std::mem::take(&mut self.ages).into_iter();
        let (mut events, mut kept_ages) = (Vec::with_capacity(self.events.len()), Vec::with_capacity(ages.len()));
        for event in std::mem::take(&mut self.events) {
            let age = ages.next().unwrap_or_default();
            if event.key.as_deref().is_some_and(|key| keys.contains(key)) {
                behind.push((event.id, event.attempts));
            } else {
                events.push(event);
                kept_ages.push(age);
            }
        }
        (self.events, self.ages) = (events, kept_ages);
        behind
    }
}

/// What a claim is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Claim {
    /// Deliver a batch; when it comes back empty and `schedule_next` is set, set the timer to
    /// the earliest future event.
    Batch { schedule_next: bool },
    /// The open breaker's probe: one event.
    Probe,
}

/// What one claim statement took, in its transaction, and the keys of its new events the fast
/// path holds back.
type Taken = (Option<Held>, sql::Claimed, Instant, Option<Busy>);

impl Claims {
    /// Claims one batch (`None`: nothing to claim, or the breaker is open and this is no probe).
    /// Rows no handler can be given are already set aside for the dead letters. With `hold`
    /// zero the claim is leased at once.
    pub(crate) async fn claim(&self, claim: Claim, leases: &Leases) -> Result<Option<Batch>> {
        let probe = claim == Claim::Probe;
        if !probe && self.breaker.is_open() {
            return Ok(None);
        }
        if self.pauses.all() {
            if probe {
                self.breaker.probe_found_nothing();
            }
            return Ok(None);
        }
        // This relay's claims of new events take turns: two at once would race for the lock, and
        // the one turned away by the other's empty claim would leave events committed in between
        // to nobody (the gate is held until the claim's transaction is over or holds the lock for
        // its batch, which claims again when it is done).
        let gate = if NewLock::in_hand_or_wanted(&self.new_lock, self.config.poll_interval) {
            None
        } else {
            Some(self.new_gate.lock().await)
        };
        let taken = match self.take(probe, gate.is_some()).await {
            Ok(taken) => taken,
            Err(e) => {
                // Whatever it took goes back: nothing after it may go the fast way first.
                self.fast.disarm_for("a claim failed");
                return Err(e);
            }
        };
        let Some(taken) = taken else {
            if probe {
                self.breaker.probe_found_nothing();
            }
            return Ok(None);
        };
        let batch = self.batch(claim, taken, leases, false).await;
        drop(gate);
        if batch.is_err() {
            self.fast.disarm_for("a claim failed");
        }
        batch
    }

    /// Runs claim statements until one takes events, or finds nothing and changes nothing
    /// (`None`: there is nothing to look for). `gated`: this claim may take new events.
    async fn take(&self, probe: bool, gated: bool) -> Result<Option<Taken>> {
        let config = &self.config;
        let size = if probe { 1 } else { i64::try_from(config.batch_size).unwrap_or(i64::MAX) };
        let mut changed_claims = 0;
        loop {
            let (parked, news) = self.timer.parked_turn();
            // Taken by a batch in hand: it claims again once it is done. (A fast batch in delivery
            // claims once it is done too.)
            let new =
                gated && !NewLock::in_hand_or_wanted(&self.new_lock, config.poll_interval) && !self.fast.in_flight();
            if !new && !parked {
                return Ok(None);
            }
            let ticket = if new { self.fast.ticket() } else { None };
            let turn = self.turns.next(config, self.pauses.topics(), new, parked, self.fast.owner());
            tracing::trace!("claiming");
            let client = self.pool.client().await?;
            tracing::trace!("claiming: a connection in hand");
            let started = Instant::now();
            let holds = config.dead_letter_holds_key;
            let decided = |id| self.fast.decided(id);
            let claim = async |db: &deadpool_postgres::ClientWrapper| {
                sql::claim_events(db, &self.to, size, holds, &turn, &decided).await
            };
            let (mut held, mut claimed) = Held::begin(client, claim).await?;
            let claimed_at = Instant::now();
            let busy = self.handed(ticket, &mut claimed);
            if claimed.foreign_position {
                // Taken in another cluster (a restored dump): nothing was claimed on its word.
                held.rollback().await?;
                if super::rebase::rebase(&self.pool, std::slice::from_ref(&self.metrics)).await {
                    continue;
                }
                return Ok(None);
            }
            if claimed.unregistered {
                held.rollback().await?;
                self.register_again().await?;
                return Ok(None);
            }
            self.counted(&claimed, claimed_at - started);
            if claimed.parked_all {
                self.timer.parked_taken(news);
            }
            if let Some(end) = &claimed.walked_to {
                self.turns.walked(end.clone());
            }
            if claimed.rows.is_empty() && claimed.changed {
                // New events parked (delayed, paused, behind their key) or the position moved:
                // commit that, and look again.
                held.commit_after(async |_: &deadpool_postgres::ClientWrapper| Ok(())).await?;
                if claimed.parked_new {
                    self.timer.parked_may_be_due();
                }
                changed_claims += 1;
                if changed_claims < CHANGED_CLAIMS_MAX {
                    continue;
                }
                return Ok(Some((None, claimed, claimed_at, busy)));
            }
            if claimed.turned_away {
                NewLock::wanted(&self.new_lock);
            }
            if claimed.held_new && !claimed.rows.is_empty() {
                held.holds_new_lock(&self.new_lock);
            }
            return Ok(Some((Some(held), claimed, claimed_at, busy)));
        }
    }

    /// The new events a claim took are its own, not the fast path's: tells the fast path, and
    /// returns their keys, which it holds back until the batch is done.
    fn handed(&self, ticket: Option<Ticket>, claimed: &mut sql::Claimed) -> Option<Busy> {
        claimed.held_new.then(|| {
            let snapshot = claimed.snapshot.as_deref().and_then(Snapshot::parse);
            let handed = std::mem::take(&mut claimed.handed_keys);
            self.fast.claimed(ticket, snapshot, !claimed.more, handed, &claimed.parked_keys)
        })
    }

    /// Counts what a claim took, in `took`.
    fn counted(&self, claimed: &sql::Claimed, took: Duration) {
        self.metrics.claimed(claimed.rows.len(), took);
        if claimed.early > 0 {
            tracing::info!(
                events = claimed.early,
                "events delivered by a claim that never committed (its relay stopped in the middle of the delivery) \
                 are recorded as delivered, not sent again"
            );
        }
    }

    /// Claims the next batch of new events in `held`'s transaction, which holds their lock and
    /// whose batch is being delivered meanwhile (the claim's work on the server overlaps the
    /// delivery's). The claim runs inside the savepoint [`READ_AHEAD`]: until the batch is
    /// adopted (its predecessor done and recorded in the transaction), a commit of the
    /// transaction undoes it, so a lease of the batch in delivery never commits a position past
    /// events nobody delivered. `None`: nothing was taken (the position may have moved past
    /// events parked or not the destination's: the transaction commits that); the caller marks
    /// the transaction (`Held::set_read_ahead`) when it took a batch or failed. Only new events
    /// are read ahead; the parked ones are other claims' (they take turns on their own).
    /// `own_records`: the token of the transaction's records early that the claim need not read
    /// (see `Turn::own_records`), or 0.
    pub(crate) async fn read_ahead(&self, held: &Held, own_records: i64, leases: &Leases) -> Result<Option<Batch>> {
        let config = &self.config;
        let size = i64::try_from(config.batch_size).unwrap_or(i64::MAX);
        let turn =
            sql::Turn { own_records, ..self.turns.next(config, self.pauses.topics(), true, false, self.fast.owner()) };
        let started = Instant::now();
        let decided = |id| self.fast.decided(id);
        let db = held.db();
        let (savepoint, claimed) = futures::join!(
            db.batch_execute(READ_AHEAD),
            sql::claim_events(db, &self.to, size, config.dead_letter_holds_key, &turn, &decided)
        );
        savepoint.map_err(|e| crate::error::Error::database("reading a claim ahead", e))?;
        let mut claimed = claimed?;
        let claimed_at = Instant::now();
        if !claimed.held_new || claimed.foreign_position || claimed.unregistered {
            // Cannot be (the transaction holds the lock, and read the position before): such a
            // claim moves nothing; the next claim of a transaction of its own sees to it.
            return Ok(None);
        }
        let busy = self.handed(None, &mut claimed);
        self.counted(&claimed, claimed_at - started);
        let batch =
            self.batch(Claim::Batch { schedule_next: false }, (None, claimed, claimed_at, busy), leases, true).await?;
        if batch.is_some() {
            self.metrics.read_ahead();
        }
        Ok(batch)
    }

    /// A batch read ahead is the transaction's now (its savepoint released, its predecessor's
    /// outcomes written): the outcomes the fast path decided for its events (`fast_decided`)
    /// are recorded with it, no longer the fast path's.
    pub(crate) fn adopted(&self, fast_decided: Vec<(i64, bool)>) {
        self.metrics.fast_delivered(fast_decided.iter().filter(|(_, delivered)| *delivered).count());
        self.fast.forget_decided(fast_decided.into_iter().map(|(id, _)| id));
    }

    /// The destination was dropped while this relay served it (its position is gone, so no claim
    /// would ever take a new event): it is registered again, saying so.
    async fn register_again(&self) -> Result<()> {
        let registered = sql::reregister_destination(&mut self.pool.client().await?, &self.to).await?;
        if registered {
            tracing::error!(
                pattern = %self.to.pattern,
                "the destination was dropped (outbox-relay destinations drop) while this relay delivered to it; \
                 it is registered again and starts after what the other destinations have passed: events \
                 published while it was dropped may not reach it"
            );
        } else {
            tracing::warn!(
                lock = self.to.lock_id,
                "the destination has no position and could not be registered again under its lock number (another \
                 relay did, or another destination took the number): restart the relay if this goes on"
            );
        }
        Ok(())
    }

    /// The batch of what a claim took (`None` when it took nothing, its transaction then rolled
    /// back), its unreadable rows set aside for the dead letters. `read_ahead`: the claim runs in
    /// a savepoint that may be undone (`Batch::fast_decided`).
    async fn batch(
        &self,
        claim: Claim,
        (mut held, claimed, claimed_at, busy): Taken,
        leases: &Leases,
        read_ahead: bool,
    ) -> Result<Option<Batch>> {
        let probe = claim == Claim::Probe;
        let sql::Claimed { rows: claimed, next_due, more, held_new, parked_new, parked_keyed, decided, .. } = claimed;
        if parked_new {
            // Behind a key whose head may be done by the time this batch is.
            self.timer.parked_may_be_due();
        }
        if claim == (Claim::Batch { schedule_next: true })
            && let Some(due) = next_due
        {
            // A delayed event or a retry, written by any process, or a lease that ends: sleep
            // until the earliest rather than up to a poll interval past it.
            self.timer.schedule(claimed_at + due);
        }
        if claimed.is_empty() && decided.is_empty() {
            if probe {
                self.breaker.probe_found_nothing();
            }
            if let Some(held) = held {
                held.rollback().await?;
            }
            return Ok(None);
        }
        if let Some(claim) = &held {
            // Cached after the connection's first batch: the outcomes can then be pipelined
            // before the COMMIT.
            sql::prepare_outcomes(claim.db()).await?;
        }
        let count = claimed.len() + decided.len();
        self.rate.claimed(count);
        let mut outcomes = Outcomes::default();
        let mut fast_decided = Vec::new();
        for (id, attempt) in decided {
            // Delivered from its notification: recorded with this batch, not handed over.
            let taken = if read_ahead {
                self.fast.peek_decided(id).inspect(|(outcome, _)| {
                    fast_decided.push((id, matches!(outcome, Outcome::Delivered)));
                })
            } else {
                self.fast.take_decided(id).map(|decided| (decided.outcome, decided.latency))
            };
            let (outcome, latency) = taken.unwrap_or((Outcome::Released, None));
            if !read_ahead && matches!(outcome, Outcome::Delivered) {
                self.metrics.fast_delivered(1);
            }
            outcomes.events.push((id, attempt, outcome));
            outcomes.latencies.extend(latency);
        }
        let mut events: Vec<(Event, Duration)> = Vec::with_capacity(count);
        let parked: HashSet<i64> = claimed.iter().filter(|row| row.parked).map(|row| row.id).collect();
        for row in claimed {
            let key = row.key.clone();
            match read_event(row) {
                Ok(event) => events.push(event),
                // A row no handler can be given (written by hand, or before migration 0003) goes
                // to the dead letters at once, saying why; the rest of the batch goes on (and
                // its key's next events wait for the claims, the dead letter may hold them).
                Err((id, attempt, error)) => {
                    self.fast.batch_done(key, true);
                    outcomes.events.push((id, attempt, Outcome::Bury { error }));
                }
            }
        }
        events.sort_unstable_by_key(|(event, _)| event.id);
        let (events, ages) = events.into_iter().unzip();
        let token = rand::random::<i64>();
        let mut batch = Batch {
            held: None,
            token,
            claimed_at,
            count,
            held_new,
            parked_keyed,
            more,
            events,
            ages,
            outcomes,
            probe,
            parked,
            busy,
            fast_decided,
        };
        if leases.hold.is_zero()
            && let Some(claim) = held.take()
        {
            // Every claim leased at once: the new events' lock is free as soon as the lease
            // commits.
            leases.lease(claim, &batch.claimed(), &batch.parked, token, &[]).await;
        }
        tracing::debug!(count, probe, held = held.is_some(), "claimed events");
        batch.held = held;
        Ok(Some(batch))
    }
}

/// The event of a claimed row and its age, or the row's id, attempt and why no handler can be
/// given it.
fn read_event(row: sql::ClaimedRow) -> std::result::Result<(Event, Duration), (i64, i32, String)> {
    let payload = row
        .payload
        .map_err(|cause| (row.id, row.attempts, format!("the payload cannot be read as JSON by the relay: {cause}")))?;
    if crate::payload::too_deep_text(payload.get()) {
        // Written past both doors' checks: its event's JSON would be too deep for most parsers.
        let why = format!("the payload nests arrays and objects more than {} deep", crate::Payload::MAX_DEPTH);
        return Err((row.id, row.attempts, why));
    }
    let headers = row.headers.map_err(|why| (row.id, row.attempts, why))?;
    let Some(age) = row.age else {
        return Err((
            row.id,
            row.attempts,
            format!(
                "created_at {} is outside the years 1970 to 9999, which an event cannot carry",
                crate::timestamp::rfc3339_micros(row.created_at)
            ),
        ));
    };
    let event = Event {
        id: row.id,
        uuid: row.uuid,
        topic: row.topic,
        key: row.key,
        payload,
        created_at: row.created_at,
        attempts: row.attempts,
        headers,
    };
    Ok((event, age))
}
