//! One batch: claim it, hand it to the handler, record what became of each event.
//!
//! A claim takes new events (read by transaction snapshots above the position, under the lock
//! that one transaction at a time holds: see migration 0008) and parked ones (failed, delayed,
//! paused, leased, behind their key: row-locked), and holds them in one of two ways. *Held* (the
//! default, `hold` above zero): the claim's transaction stays open during the delivery, its locks
//! are the lease, and the outcomes (and the position it moved) commit with it (see `held.rs`). A
//! delivery that outlives `hold` turns the claim into a *lease*: the rows are parked with
//! `available_at` moved past the lease, the attempt counted and the claim's token, the
//! transaction commits, and the outcomes are recorded later by token. With `hold` zero every
//! claim is leased at once, in a transaction of its own (every event is then parked: the one mode
//! whose cost per event depends on vacuum again).

use std::collections::{HashMap, HashSet};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::RelayPool;
use super::backoff::retry_delay;
use super::breaker::{Breaker, Change, Seen, Verdict};
use super::config::{Completion, RelayConfig};
use super::handler::{DeliveryError, Handler, Slots, panicked};
use super::held::{Held, NewLock, SharedNewLock};
use super::idle::Idle;
use super::metrics::RelayMetrics;
use super::pauses::Pauses;
use super::report::Reporter;
use super::timer::Timer;
use crate::error::Result;
use crate::event::Event;
use crate::sql;

/// What claiming and delivering a batch needs.
pub(crate) struct Claimer<H> {
    pub(crate) pool: RelayPool,
    pub(crate) handler: H,
    pub(crate) config: RelayConfig,
    pub(crate) metrics: Arc<RelayMetrics>,
    /// Told of every retry this relay schedules and of the next due event.
    pub(crate) timer: Arc<Timer>,
    /// Told of every failed delivery, for the rate-limited warnings.
    pub(crate) reporter: Arc<Reporter>,
    /// Stop delivering now; release what is in hand (shutdown past its grace).
    pub(crate) abort: CancellationToken,
    /// The bound on deliveries in progress, shared by every batch.
    pub(crate) slots: Slots,
    /// Whether the destination is down.
    pub(crate) breaker: Arc<Breaker>,
    /// Where the breaker's state is published (the relay's row).
    pub(crate) idle: Arc<Idle>,
    /// Where the next claim looks first.
    pub(crate) turns: Turns,
    /// The topics not to claim.
    pub(crate) pauses: Arc<Pauses>,
    /// The new events' lock: whether a transaction of this relay holds it, and whether a
    /// claim turned away by it wants the holder to claim again once done.
    pub(crate) new_lock: SharedNewLock,
    /// "There may be events": wakes a waiting worker.
    pub(crate) work: Arc<tokio::sync::Notify>,
    /// Held by the claim of new events in progress (see `claim`).
    pub(crate) new_gate: tokio::sync::Mutex<()>,
    /// The destination this relay's claims are for.
    pub(crate) to: sql::Destination,
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
    fn next(&self, config: &RelayConfig, paused: Arc<[String]>, new: bool, parked: bool) -> sql::Turn {
        let n = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let walk_after = self.walk_after.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).clone();
        let walk_keys = i32::try_from(config.batch_size.saturating_mul(2).clamp(64, 20_000)).unwrap_or(20_000);
        let delete = config.completion == Completion::Delete;
        sql::Turn { new, parked, parked_first: n % 2 == 1, walk_after, walk_keys, paused, delete }
    }

    /// Where the last walk over the parked keys ended: the next one goes on from there.
    fn walked(&self, end: Option<String>) {
        *self.walk_after.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = end.unwrap_or_default();
    }
}

/// How many claims in a row may only park events or move a position before the relay stops
/// for this turn (each is a transaction of its own; a long paused backlog takes several).
const CHANGED_CLAIMS_MAX: usize = 64;

/// The rounds in which a batch (in id order) is handed over: indexes into `events`, per round
/// every event without a key (in the first) and the next event of each key.
fn rounds_by_key(events: &[Event]) -> Vec<Vec<usize>> {
    let mut seen: HashMap<&str, usize> = HashMap::new();
    let mut rounds: Vec<Vec<usize>> = vec![Vec::with_capacity(events.len())];
    for (i, event) in events.iter().enumerate() {
        let round = match &event.key {
            None => 0,
            Some(key) => {
                let n = seen.entry(key.as_str()).or_insert(0);
                *n += 1;
                *n - 1
            }
        };
        if rounds.len() <= round {
            rounds.resize_with(round + 1, Vec::new);
        }
        rounds[round].push(i);
    }
    rounds
}

/// A claimed batch, waiting to be delivered.
pub(crate) struct Batch {
    /// The claim's open transaction while the claim is held; `None` once it is leased.
    held: Option<Held>,
    /// The token a lease of this claim carries.
    token: i64,
    claimed_at: Instant,
    /// Rows claimed, the unreadable ones included.
    pub(crate) count: usize,
    /// The claim holds the new events' lock.
    held_new: bool,
    /// It took parked events with a key: once it is done, their keys' next parked events are
    /// their heads.
    parked_keyed: bool,
    /// More new events wait: the delta was cut short.
    pub(crate) more: bool,
    events: Vec<Event>,
    ages: Vec<Duration>,
    /// What is already decided: rows no handler can be given.
    outcomes: Outcomes,
    probe: bool,
    /// The ids claimed from the destination's parked events (the others are new events).
    parked: HashSet<i64>,
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

/// What became of one claimed event.
enum Outcome {
    Delivered,
    /// A transient failure, tried again after `delay`; `counted: false` gives the attempt back
    /// (an outage's failure is the destination's, not the event's).
    Retry {
        delay: Duration,
        error: String,
        counted: bool,
    },
    /// To the dead letters.
    Bury {
        error: String,
    },
    /// Given back untried (shutdown, an open breaker), the attempt not counted.
    Released,
}

/// What became of each claimed event: per event its id, the number of the attempt this claim
/// made, and the outcome.
#[derive(Default)]
struct Outcomes {
    events: Vec<(i64, i32, Outcome)>,
    /// Claim-to-delivery latencies of the delivered events.
    latencies: Vec<Duration>,
    /// Why the events were released, when it is news (`None`: shutdown).
    released_why: Option<String>,
}

impl Outcomes {
    /// Records a transient failure: a retry after backoff (or after the destination's
    /// `Retry-After`, within `backoff_max`), or the dead letters after the last allowed attempt.
    /// Returns the retry delay, if any.
    fn retry(&mut self, config: &RelayConfig, event: &Event, e: &DeliveryError) -> Option<Duration> {
        if event.attempts >= i32::try_from(config.max_attempts).unwrap_or(i32::MAX) {
            self.bury(event, format!("gave up after {} attempts: {}", event.attempts, e.message()));
            return None;
        }
        let attempt = u32::try_from(event.attempts).unwrap_or(1);
        let backoff =
            retry_delay(attempt, config.backoff_base, config.backoff_max, config.backoff_jitter, rand::random());
        let delay = e.requested_delay().map_or(backoff, |asked| backoff.max(asked.min(config.backoff_max)));
        self.push(event, Outcome::Retry { delay, error: e.message().to_string(), counted: true });
        Some(delay)
    }

    fn push(&mut self, event: &Event, outcome: Outcome) {
        self.events.push((event.id, event.attempts, outcome));
    }

    fn bury(&mut self, event: &Event, error: String) {
        self.push(event, Outcome::Bury { error });
    }

    fn release_all(&mut self, events: &[Event]) {
        self.events.extend(events.iter().map(|e| (e.id, e.attempts, Outcome::Released)));
    }

    fn count(&self, wanted: impl Fn(&Outcome) -> bool) -> usize {
        self.events.iter().filter(|(_, _, outcome)| wanted(outcome)).count()
    }
}

/// The outcomes as the statements take them. An event claimed from the new ones has passed the
/// destination's position: what still waits for the destination is copied into its parked events
/// or dead letters, and its outbox row is then finished (`new_ids`). An event claimed from the
/// parked ones changes there. Once a claim is leased all its events are parked ones.
#[derive(Default)]
struct Writes {
    /// Every event claimed from the new ones.
    new_ids: Vec<i64>,
    /// New events that wait: retries and events given back.
    new_waiting: sql::Copies,
    /// New events to the dead letters: ids, errors, attempts.
    new_buried: (Vec<i64>, Vec<String>, Vec<i32>),
    parked_delivered: Vec<i64>,
    /// Parked events that wait again: retries and events given back.
    parked_waiting: sql::Copies,
    parked_buried: (Vec<i64>, Vec<String>, Vec<i32>),
}

impl Writes {
    /// `parked`: the ids claimed from the parked events (all of them, once the claim is leased).
    fn of(outcomes: &Outcomes, parked: impl Fn(i64) -> bool) -> Writes {
        let mut w = Writes::default();
        let released_why = outcomes.released_why.clone();
        for (id, attempt, outcome) in &outcomes.events {
            let (id, attempt, given_back) = (*id, *attempt, (*attempt - 1).max(0));
            let parked = parked(id);
            if !parked {
                w.new_ids.push(id);
            }
            let (waiting, buried) = if parked {
                (&mut w.parked_waiting, &mut w.parked_buried)
            } else {
                (&mut w.new_waiting, &mut w.new_buried)
            };
            match outcome {
                Outcome::Delivered if parked => w.parked_delivered.push(id),
                Outcome::Delivered => {}
                Outcome::Retry { delay, error, counted } => {
                    waiting.push(id, *delay, Some(error.clone()), if *counted { attempt } else { given_back });
                }
                Outcome::Bury { error } => {
                    buried.0.push(id);
                    buried.1.push(error.clone());
                    buried.2.push(attempt);
                }
                Outcome::Released => waiting.push(id, Duration::ZERO, released_why.clone(), given_back),
            }
        }
        w
    }

    fn buried(&self) -> impl Iterator<Item = (&i64, &String)> {
        self.new_buried.0.iter().zip(&self.new_buried.1).chain(self.parked_buried.0.iter().zip(&self.parked_buried.1))
    }
}

impl<H: Handler> Claimer<H> {
    /// Claims one batch and delivers it; returns how many events were claimed. While the
    /// breaker is open only a probe claims.
    pub(crate) async fn claim_and_deliver(&self, claim: Claim) -> Result<usize> {
        match self.claim(claim).await? {
            None => Ok(0),
            Some(batch) => {
                let count = batch.count;
                self.deliver_and_record(batch).await;
                Ok(count)
            }
        }
    }

    /// Claims one batch (`None`: nothing to claim, or the breaker is open and this is no probe).
    /// Rows no handler can be given are already set aside for the dead letters.
    pub(crate) async fn claim(&self, claim: Claim) -> Result<Option<Batch>> {
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
        let config = &self.config;
        let token = rand::random::<i64>();
        let size = if probe { 1 } else { i64::try_from(config.batch_size).unwrap_or(i64::MAX) };
        let holds = config.dead_letter_holds_key;
        let mut changed_claims = 0;
        // This relay's claims of new events take turns: two at once would race for the lock, and
        // the one turned away by the other's empty claim would leave events committed in between
        // to nobody (the gate is held until the claim's transaction is over or holds the lock for
        // its batch, which claims again when it is done).
        let gate = if NewLock::in_hand_or_wanted(&self.new_lock, config.poll_interval) {
            None
        } else {
            Some(self.new_gate.lock().await)
        };
        let (mut held, claimed, claimed_at) = loop {
            let (parked, news) = self.timer.parked_turn();
            // Taken by a batch in hand: it claims again once it is done.
            let new = gate.is_some() && !NewLock::in_hand_or_wanted(&self.new_lock, config.poll_interval);
            if !new && !parked {
                if probe {
                    self.breaker.probe_found_nothing();
                }
                return Ok(None);
            }
            let turn = self.turns.next(config, self.pauses.topics(), new, parked);
            tracing::trace!("claiming");
            let client = self.pool.client().await?;
            tracing::trace!("claiming: a connection in hand");
            let started = Instant::now();
            let claim =
                async |db: &deadpool_postgres::ClientWrapper| sql::claim_events(db, &self.to, size, holds, &turn).await;
            let (held, claimed) = Held::begin(client, claim).await?;
            let claimed_at = Instant::now();
            self.metrics.claimed(claimed.rows.len(), claimed_at - started);
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
                break (None, claimed, claimed_at);
            }
            if claimed.turned_away {
                NewLock::wanted(&self.new_lock);
            }
            let mut held = held;
            if claimed.held_new && !claimed.rows.is_empty() {
                held.holds_new_lock(&self.new_lock);
            }
            break (Some(held), claimed, claimed_at);
        };
        let sql::Claimed { rows: claimed, next_due, more, held_new, parked_new, parked_keyed, .. } = claimed;
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
        if claimed.is_empty() {
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
        let count = claimed.len();
        self.idle.rate.claimed(count);
        let mut outcomes = Outcomes::default();
        let mut events: Vec<(Event, Duration)> = Vec::with_capacity(count);
        let parked: HashSet<i64> = claimed.iter().filter(|row| row.parked).map(|row| row.id).collect();
        for row in claimed {
            match read_event(row) {
                Ok(event) => events.push(event),
                // A row no handler can be given (written by hand, or before migration 0003) goes
                // to the dead letters at once, saying why; the rest of the batch goes on.
                Err((id, attempt, error)) => outcomes.events.push((id, attempt, Outcome::Bury { error })),
            }
        }
        events.sort_unstable_by_key(|(event, _)| event.id);
        if config.effective_hold().is_zero()
            && let Some(claim) = held.take()
        {
            // Every claim leased at once: the new events' lock is free as soon as the lease
            // commits.
            let mut ids: Vec<(i64, i32)> = events.iter().map(|(event, _)| (event.id, event.attempts)).collect();
            ids.extend(outcomes.events.iter().map(|(id, attempt, _)| (*id, *attempt)));
            self.lease(claim, &ids, &parked, token).await;
        }
        tracing::debug!(count, probe, held = held.is_some(), "claimed events");
        let (events, ages) = events.into_iter().unzip();
        Ok(Some(Batch {
            held,
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
        }))
    }

    /// Delivers a claimed batch and records what became of it. A held claim whose delivery
    /// outlives `hold` is leased meanwhile. Returns whether the worker should claim again now
    /// (see the end of this function).
    pub(crate) async fn deliver_and_record(&self, batch: Batch) -> bool {
        let Batch {
            mut held,
            token,
            claimed_at,
            held_new,
            parked_keyed,
            events,
            ages,
            mut outcomes,
            probe,
            parked,
            ..
        } = batch;
        if !events.is_empty() {
            if !probe && self.breaker.is_open() {
                // Claimed while the breaker was opening: the outage covers it, nothing is tried.
                outcomes.release_all(&events);
            } else {
                let delivery = self.deliver(&events);
                tokio::pin!(delivery);
                // The rows no handler can be given too: their outcome is recorded by a lease's
                // token like the others'.
                let claimed: Vec<(i64, i32)> = events
                    .iter()
                    .map(|e| (e.id, e.attempts))
                    .chain(outcomes.events.iter().map(|(id, attempt, _)| (*id, *attempt)))
                    .collect();
                let results = self.while_delivering(delivery, &mut held, &claimed, &parked, token, claimed_at).await;
                match results {
                    // Cut off at shutdown: the events go back, the attempt not counted.
                    None => outcomes.release_all(&events),
                    Some(results) => self.judge(&events, &ages, claimed_at, results, probe, &mut outcomes).await,
                }
            }
        } else if probe {
            self.breaker.probe_found_nothing();
        }
        let released = outcomes.count(|outcome| matches!(outcome, Outcome::Released)) > 0;
        // A leased batch's events were parked: later events of their keys, claimed meanwhile,
        // were parked behind them, and wait for a claim of parked events once these are done.
        let leased_keyed = held.is_none() && events.iter().any(|event| event.key.is_some());
        self.record(held, token, outcomes, &parked).await;
        if parked_keyed || released || leased_keyed {
            // A parked key's next event is its head now, or events were given back, due at once.
            self.timer.parked_may_be_due();
        }
        // Claim again now if parked events may be due, or if this batch held the new events'
        // lock and new events may wait: a claim of this relay was turned away by the lock
        // meanwhile, or the relay is busy (not marked waiting: writers do not notify it). A
        // relay marked waiting hears every commit, so a turned-away claim of its own says so.
        parked_keyed
            || released
            || leased_keyed
            || (held_new && (!self.idle.is_marked() || NewLock::take_wanted(&self.new_lock)))
    }

    /// Waits for `delivery`, keeping its events this claim's for as long as it runs: a held
    /// claim is turned into a lease once it outlives `hold`, and the lease is renewed every half
    /// lease, so that no claim takes events whose requests may still succeed (a delivery's time
    /// limit is the handler's own, the HTTP sink's timeout say, never the lease).
    async fn while_delivering<F: std::future::Future + Unpin>(
        &self,
        mut delivery: F,
        held: &mut Option<Held>,
        claimed: &[(i64, i32)],
        parked: &HashSet<i64>,
        token: i64,
        claimed_at: Instant,
    ) -> F::Output {
        let renew_every = self.config.lease / 2;
        // With `hold` zero the claim was leased when it was claimed.
        let mut next = claimed_at + if held.is_some() { self.config.effective_hold() } else { renew_every };
        let mut leased = held.is_none();
        let ids: Vec<i64> = claimed.iter().map(|(id, _)| *id).collect();
        loop {
            tokio::select! {
                done = &mut delivery => return done,
                () = tokio::time::sleep_until(next) => {
                    match held.take() {
                        Some(claim) => leased = self.lease(claim, claimed, parked, token).await,
                        None if leased => leased = self.renew(&ids, token).await,
                        None => {}
                    }
                    next = Instant::now() + renew_every;
                }
            }
        }
    }

    /// Extends the lease of a delivery still running; returns whether the lease is still this
    /// claim's (a failed renewal is tried again at the next turn).
    async fn renew(&self, ids: &[i64], token: i64) -> bool {
        let renewed =
            async { sql::renew_lease(&*self.pool.client().await?, &self.to.name, ids, self.config.lease, token).await };
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
    /// (their outbox rows then finished, as far as this destination goes). Returns whether the
    /// lease was written.
    async fn lease(&self, held: Held, claimed: &[(i64, i32)], parked: &HashSet<i64>, token: i64) -> bool {
        let lease = self.config.lease;
        let had_new_lock = held.has_new_lock();
        let delete = self.config.completion == Completion::Delete;
        let to = self.to.name.as_str();
        let ids: Vec<i64> = claimed.iter().map(|(id, _)| *id).collect();
        let (was_parked, new): (Vec<i64>, Vec<i64>) = ids.iter().partition(|id| parked.contains(id));
        let mut copies = sql::Copies::default();
        for (id, attempt) in claimed.iter().filter(|(id, _)| !parked.contains(id)) {
            // The attempt is counted, as the parked events' lease counts it.
            copies.push(*id, lease, None, *attempt);
        }
        let leased = held.commit_after(async |db: &deadpool_postgres::ClientWrapper| {
            let mut writes: Vec<BoxFuture<'_, Result<u64>>> = Vec::new();
            if !was_parked.is_empty() {
                writes.push(Box::pin(sql::lease_held_parked(db, to, &was_parked, lease, token)));
            }
            if !new.is_empty() {
                writes.push(Box::pin(sql::park_new_events(db, to, &copies, Some(token))));
                writes.push(Box::pin(sql::finish_new_events(db, to, &new, delete)));
            }
            futures::future::try_join_all(writes).await.map(drop)
        });
        match leased.await {
            Ok(_) => {
                tracing::debug!(events = ids.len(), hold = ?self.config.effective_hold(), "a delivery outlived the hold; its claim is leased");
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

    /// Hands `events` to the handler in rounds, so that the handler never has two events of one
    /// key at once. The first round has every event without a key and the first of each key;
    /// each next round the next event of every key whose last one was delivered. An event left
    /// untried (behind a failure of its key) has no result. `None` when the shutdown's abort cut
    /// the delivery off.
    async fn deliver(&self, events: &[Event]) -> Option<Vec<Option<Result<(), DeliveryError>>>> {
        tracing::trace!(events = events.len(), "delivering");
        let rounds = rounds_by_key(events);
        let run = async {
            let mut results = vec![None; events.len()];
            let mut failed_keys: HashSet<&str> = HashSet::new();
            for round in &rounds {
                let now: Vec<usize> = round
                    .iter()
                    .copied()
                    .filter(|&i| events[i].key.as_deref().is_none_or(|key| !failed_keys.contains(key)))
                    .collect();
                if now.is_empty() {
                    break;
                }
                let delivered = if now.len() == events.len() {
                    self.hand_over(events).await
                } else {
                    let part: Vec<Event> = now.iter().map(|&i| events[i].clone()).collect();
                    self.hand_over(&part).await
                };
                for (&i, result) in now.iter().zip(delivered) {
                    if let (Err(_), Some(key)) = (&result, &events[i].key) {
                        failed_keys.insert(key.as_str());
                    }
                    results[i] = Some(result);
                }
            }
            results
        };
        tokio::select! {
            results = run => Some(results),
            _ = self.abort.cancelled() => None,
        }
    }

    /// One call of the handler: one result per event, a panic failing them all.
    async fn hand_over(&self, events: &[Event]) -> Vec<Result<(), DeliveryError>> {
        let delivery = AssertUnwindSafe(self.handler.handle_batch(events, &self.slots)).catch_unwind();
        let mut results = match delivery.await {
            Ok(results) => results,
            Err(panic) => {
                let error = panicked(&*panic);
                events.iter().map(|_| Err(error.clone())).collect()
            }
        };
        if results.len() != events.len() {
            let message = format!("the handler returned {} results for {} events", results.len(), events.len());
            results.resize_with(events.len(), || Err(DeliveryError::transient(&message)));
        }
        results
    }

    /// Turns a batch's results into outcomes, asking the breaker whether the destination is down.
    async fn judge(
        &self,
        events: &[Event],
        ages: &[Duration],
        claimed_at: Instant,
        results: Vec<Option<Result<(), DeliveryError>>>,
        probe: bool,
        outcomes: &mut Outcomes,
    ) {
        let config = &self.config;
        let seen: Vec<Seen> = events
            .iter()
            .zip(&results)
            .filter_map(|(event, result)| match result.as_ref()? {
                Err(e) if e.may_be_an_outage() => Some(Seen::Failed(event.id)),
                _ => Some(Seen::Answered),
            })
            .collect();
        let errors = || results.iter().flatten().filter_map(|r| r.as_ref().err());
        let retry_after = errors().filter_map(DeliveryError::requested_delay).max();
        // Every transient failure a refused connection: nobody listens there now.
        let refused = {
            let mut transient = errors().filter(|e| !e.is_permanent()).peekable();
            transient.peek().is_some() && transient.all(DeliveryError::is_refused)
        };
        let (verdict, change) = self.breaker.observe(&seen, retry_after, refused, probe);
        let first_failure = errors().find(|e| !e.is_permanent());
        if let Some(change) = change {
            self.announce(change, first_failure).await;
        }
        for ((event, age), result) in events.iter().zip(ages).zip(results) {
            let Some(result) = result else {
                // Behind an event of its key that was not delivered: it waits for it, untried.
                outcomes.push(event, Outcome::Released);
                continue;
            };
            match result {
                Ok(()) => {
                    outcomes.push(event, Outcome::Delivered);
                    outcomes.latencies.push(*age + claimed_at.elapsed());
                }
                Err(e) if e.is_permanent() => outcomes.bury(event, e.message().to_string()),
                Err(e) if verdict == Verdict::Open => {
                    let why = format!(
                        "the destination is down (outage breaker open); the attempt was not counted: {}",
                        e.message()
                    );
                    if probe {
                        // The next probe tries another event.
                        let delay = self.breaker.probe_delay();
                        outcomes.push(event, Outcome::Retry { delay, error: why, counted: false });
                    } else {
                        outcomes.push(event, Outcome::Released);
                        outcomes.released_why.get_or_insert(why);
                    }
                }
                Err(e) => {
                    // The last allowed attempt goes to the dead letters, logged on their own.
                    if let Some(delay) = outcomes.retry(config, event, &e) {
                        self.timer.schedule(Instant::now() + delay);
                        self.reporter.failed(event, &e, delay);
                    }
                }
            }
        }
    }

    /// One warn line per change of the breaker, its state in the metrics and in the relay's row.
    async fn announce(&self, change: Change, failure: Option<&DeliveryError>) {
        let error = failure.map(|e| e.message().to_string()).unwrap_or_default();
        let open = match change {
            Change::Opened { failures, probe_in } => {
                tracing::warn!(
                    failures,
                    probe_in = %humantime::format_duration(probe_in),
                    error = %error,
                    "the destination looks down: {failures} distinct events failed in a row; the relay stops claiming, \
                     gives back what it holds without counting the attempt, and probes with one delivery at a time"
                );
                true
            }
            Change::Closed { after } => {
                let after = Duration::from_millis(u64::try_from(after.as_millis()).unwrap_or(u64::MAX));
                tracing::warn!(
                    down_for = %humantime::format_duration(after),
                    "the destination is back: a probe was delivered; the relay resumes"
                );
                false
            }
        };
        self.metrics.breaker(open);
        if let Err(e) = self.idle.publish_breaker(open).await {
            tracing::debug!(error = %e, "could not publish the breaker's state");
        }
    }

    /// Writes the outcomes of one batch: in the held claim's transaction, committing it, or
    /// by the lease's token (each statement only touches rows still holding it). A held claim's
    /// failure here ends its transaction, so its events are claimable again at once; a leased
    /// one's is retried a few times and then left to the lease. Either way the events are
    /// delivered again, which at-least-once delivery allows.
    async fn record(&self, held: Option<Held>, token: i64, outcomes: Outcomes, parked: &HashSet<i64>) {
        let leased = held.is_none();
        let writes = Writes::of(&outcomes, |id| leased || parked.contains(&id));
        let delete = self.config.completion == Completion::Delete;
        let to = self.to.name.as_str();
        match held {
            Some(held) => {
                let recorded = held.commit_after(async |db: &deadpool_postgres::ClientWrapper| {
                    write(db, to, delete, None, &writes).await
                });
                if let Err(e) = recorded.await {
                    tracing::error!(error = %e, events = outcomes.events.len(), "recording delivery outcomes failed; the claim's transaction ended, so its events are claimable again and will be delivered again");
                    return;
                }
            }
            None => {
                let mut tries = 0;
                loop {
                    tries += 1;
                    let written = async { write(&*self.pool.client().await?, to, delete, Some(token), &writes).await };
                    match written.await {
                        Ok(()) => break,
                        Err(e) if tries < 4 => {
                            tracing::warn!(error = %e, "recording delivery outcomes failed; trying again");
                            tokio::time::sleep(Duration::from_millis(100 * tries)).await;
                        }
                        Err(e) => {
                            tracing::error!(error = %e, events = outcomes.events.len(), "recording delivery outcomes failed; the events will be delivered again after their lease");
                            return;
                        }
                    }
                }
            }
        }
        self.metrics.retried(outcomes.count(|o| matches!(o, Outcome::Retry { counted: true, .. })));
        self.metrics.delivered(outcomes.latencies.into_iter());
        let (ids, errors): (Vec<i64>, Vec<String>) = writes.buried().map(|(id, e)| (*id, e.clone())).unzip();
        self.metrics.dead_lettered(ids.len());
        if !ids.is_empty() {
            log_buried(&ids, &errors);
        }
    }
}

/// How many ids and distinct errors one dead-letter warning names; the rest are counted.
const BURIED_SHOWN: usize = 10;

/// One warning for a batch's dead letters, of bounded length: the first ids, each distinct
/// error once with how many events it buried.
fn log_buried(ids: &[i64], errors: &[String]) {
    let mut distinct: Vec<(&str, usize)> = Vec::new();
    for error in errors {
        match distinct.iter_mut().find(|(e, _)| *e == error.as_str()) {
            Some((_, n)) => *n += 1,
            None => distinct.push((error.as_str(), 1)),
        }
    }
    let causes: Vec<String> = distinct.iter().take(BURIED_SHOWN).map(|(e, n)| format!("{n} x {e}")).collect();
    tracing::warn!(
        events = ids.len(),
        ids = %crate::text::some_ids(ids, BURIED_SHOWN),
        errors = %causes.join(" | "),
        "events moved to the dead letters"
    );
}

/// Runs the statements of one batch's outcomes for destination `to` on `db`, pipelined (one
/// round trip for all, run in order: the copies of new events before their rows are finished);
/// `token`: the lease's, or `None` for a held claim.
async fn write(
    db: &deadpool_postgres::ClientWrapper,
    to: &str,
    delete: bool,
    token: Option<i64>,
    w: &Writes,
) -> Result<()> {
    let mut writes: Vec<BoxFuture<'_, Result<u64>>> = Vec::new();
    if !w.new_waiting.ids.is_empty() {
        writes.push(Box::pin(sql::park_new_events(db, to, &w.new_waiting, None)));
    }
    if !w.new_buried.0.is_empty() {
        writes.push(Box::pin(sql::bury_new_events(db, to, &w.new_buried.0, &w.new_buried.1, &w.new_buried.2)));
    }
    if !w.new_ids.is_empty() {
        writes.push(Box::pin(sql::finish_new_events(db, to, &w.new_ids, delete)));
    }
    if !w.parked_delivered.is_empty() {
        writes.push(Box::pin(sql::complete_parked(db, to, &w.parked_delivered, token)));
    }
    if !w.parked_waiting.ids.is_empty() {
        writes.push(Box::pin(sql::reschedule_parked(db, to, &w.parked_waiting, token)));
    }
    if !w.parked_buried.0.is_empty() {
        let (ids, errors, attempts) = &w.parked_buried;
        writes.push(Box::pin(sql::bury_parked(db, to, ids, errors, attempts, token)));
    }
    futures::future::try_join_all(writes).await.map(drop)
}

/// The event of a claimed row and its age, or the row's id, attempt and why no handler can be
/// given it.
fn read_event(row: sql::ClaimedRow) -> std::result::Result<(Event, Duration), (i64, i32, String)> {
    let payload = row
        .payload
        .map_err(|cause| (row.id, row.attempts, format!("the payload cannot be read as JSON by the relay: {cause}")))?;
    if crate::payload::too_deep_text(payload.get()) {
        // Written past both doors' checks: its event's JSON would be too deep for most parsers.
        let why = format!("the payload nests arrays and objects more than {} deep", crate::MAX_PAYLOAD_DEPTH);
        return Err((row.id, row.attempts, why));
    }
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
    };
    Ok((event, age))
}
