//! The fast path (issue 41, migration 0018): new events handed to the handler from their
//! notification, before any claim; the next claim records what became of them.
//!
//! Between a commit and the handler, a relay woken by NOTIFY used to claim first: a round trip
//! that was most of what it added to a plain LISTEN client's latency. The trigger now puts a
//! statement's events in its notification (when a relay waits), so the relay can deliver at once
//! and claim afterwards: the claim reads the same events in its delta and records the outcomes
//! the fast path decided instead of handing them over again (`Decided`). A claim read ahead
//! (`batch.rs`) leaves those outcomes here until its batch is the transaction's (its savepoint
//! released): undone with its savepoint (the batch before it was leased), it takes none of them
//! away, and the claim that meets the events again records them. At-least-once holds: an event
//! is recorded only after its delivery, and a relay that dies in between leaves it to be claimed
//! and delivered again.
//!
//! The fast path must keep every rule a claim keeps, from what it holds in memory:
//!
//! - **One relay per destination.** The relay whose listener holds the destination's fast-path
//!   lock (`sql::FAST_LOCK`, a session lock on the listener's connection) owns it, and claims the
//!   destination's new events alone: another relay's claim of new events also takes that lock
//!   (for its transaction), so it is turned away while an owner lives. When the owner dies its
//!   session ends and the lock with it; another relay's listener takes it (it tries every
//!   [`OWNERSHIP_RETRY`]). An owner's own claims check that its listener's backend still lives.
//! - **Nothing claimed is delivered again.** Each notification carries its transaction's id; the
//!   fast path drops the events of transactions its last claim's snapshot already sees.
//! - **Nothing committed is passed by.** Notifications come in commit order, and the fast path is
//!   *armed* only while it hears every commit: the relay is marked waiting and the race closure
//!   for that mark has ended (every transaction open at the mark is over), the listener has not
//!   lost its connection since, and a claim that began after that took its whole delta. That
//!   claim's snapshot is the *baseline*; every event committed later comes by notification.
//! - **Order per key, pauses, delays, patterns.** An event is delivered from its notification
//!   only if it matches the destination's pattern (else it is not the destination's: skipped),
//!   is not delayed, its topic is not paused, the breaker is closed, its payload came with it and
//!   can be handed over, and its key has no event that waits: none parked or held by a dead
//!   letter for this destination (read when the relay takes the fast path, then kept by this
//!   relay, which alone parks new events; anything else that may park one disarms and reloads),
//!   none in a batch of this relay still in delivery. Any event that cannot go this way
//!   *disarms* the fast path: it and everything after it wait for a claim, which arms it again.
//! - **Claims and the fast path take turns.** A fast batch is taken under the gate the claims of
//!   new events take, and not while a batch of this relay's new events is uncommitted; a claim
//!   does not look for new events while a fast batch is in delivery, unless that delivery
//!   outlived `hold` and was leased as a claim's is (`fast_task.rs`): its events copied into the
//!   parked ones under a lease, which holds their keys' later events back, and which a claim
//!   then passes (the copy stands for the event). The fast path is disarmed meanwhile: a
//!   notification wakes a worker to claim, as the fast task is busy.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use serde_json::value::RawValue;
use tokio::sync::Notify;

use super::metrics::RelayMetrics;
use super::outcome::Outcome;
use super::pauses::Pauses;
use super::route::TopicPattern;
use super::signed::{NotificationKey, Unsigned};
use crate::event::Event;
use crate::payload::Payload;
use crate::sql::Settled;

/// How often a listener that does not own its destination's fast path tries to take it.
pub(crate) const OWNERSHIP_RETRY: Duration = Duration::from_secs(1);

/// The most events waiting in memory for the fast path; past it they are left to a claim.
const QUEUE_MAX: usize = 10_000;

/// The most keys read as waiting (parked, held) when the fast path is taken: past it, events with
/// a key are left to claims (the unkeyed ones still go the fast way) until it is taken again.
pub(crate) const WAITING_KEYS_MAX: i64 = 100_000;

/// How often a notification with a wrong signature is logged at most.
const FORGED_LOG_EVERY: Duration = Duration::from_secs(60);

/// How long a decided outcome waits for a claim to record it before it is forgotten (a claim of
/// another relay took the event: the fast path was lost meanwhile).
const DECIDED_KEPT: Duration = Duration::from_secs(300);

/// A transaction snapshot as `pg_current_snapshot()` prints it: `xmin:xmax:xip,...`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Snapshot {
    xmin: u64,
    xmax: u64,
    xip: Vec<u64>,
}

impl Snapshot {
    pub(crate) fn parse(text: &str) -> Option<Snapshot> {
        let mut parts = text.splitn(3, ':');
        let xmin = parts.next()?.parse().ok()?;
        let xmax = parts.next()?.parse().ok()?;
        let xip = match parts.next()? {
            "" => Vec::new(),
            list => list.split(',').map(str::parse).collect::<Result<_, _>>().ok()?,
        };
        (xmin <= xmax).then_some(Snapshot { xmin, xmax, xip })
    }

    /// Whether transaction `xid` had committed (or ended) for this snapshot.
    pub(crate) fn sees(&self, xid: u64) -> bool {
        xid < self.xmin || (xid < self.xmax && !self.xip.contains(&xid))
    }
}

/// One notification of the outbox trigger, as migration 0018 writes it.
#[derive(Debug)]
pub(crate) struct Notified {
    /// The inserting transaction's id.
    pub(crate) xid: u64,
    pub(crate) events: Vec<Carried>,
    /// The statement inserted more events than a notification carries: a claim takes them.
    pub(crate) more: bool,
}

/// An event as its notification carries it.
#[derive(Debug)]
pub(crate) struct Carried {
    pub(crate) id: i64,
    pub(crate) uuid: uuid::Uuid,
    pub(crate) topic: String,
    pub(crate) key: Option<String>,
    /// The rest, unless the event was too large for a notification.
    pub(crate) whole: Option<Whole>,
}

#[derive(Debug)]
pub(crate) struct Whole {
    headers: Option<serde_json::Value>,
    created_us: i64,
    delayed: bool,
    payload: Payload,
}

#[derive(serde::Deserialize)]
struct Wire<'a> {
    x: &'a str,
    #[serde(default, borrow)]
    e: Vec<&'a RawValue>,
    #[serde(default)]
    more: bool,
}

impl Notified {
    /// Reads a notification's payload; `None` for anything else (a wake-up of an earlier
    /// version, which carries no events).
    pub(crate) fn parse(payload: &str) -> Option<Notified> {
        let wire: Wire = serde_json::from_str(payload).ok()?;
        let xid = wire.x.parse().ok()?;
        let events = wire.e.iter().map(|raw| Carried::parse(raw.get())).collect::<Option<Vec<_>>>()?;
        Some(Notified { xid, events, more: wire.more })
    }
}

impl Carried {
    fn parse(text: &str) -> Option<Carried> {
        let fields: Vec<&RawValue> = serde_json::from_str(text).ok()?;
        let field = |n: usize| fields.get(n).map(|raw| raw.get());
        let id = serde_json::from_str(field(0)?).ok()?;
        let uuid = serde_json::from_str::<&str>(field(1)?).ok()?.parse().ok()?;
        let topic = serde_json::from_str(field(2)?).ok()?;
        let key = serde_json::from_str(field(3)?).ok()?;
        let whole = match fields.len() {
            4 => None,
            8 => Some(Whole {
                headers: serde_json::from_str(field(4)?).ok()?,
                created_us: serde_json::from_str(field(5)?).ok()?,
                delayed: serde_json::from_str(field(6)?).ok()?,
                payload: Payload::from_json(field(7)?).ok()?,
            }),
            _ => return None,
        };
        Some(Carried { id, uuid, topic, key, whole })
    }

    /// The event to hand over, or why it cannot go the fast way.
    fn event(&self) -> Result<(Event, Duration), &'static str> {
        let whole = self.whole.as_ref().ok_or("its payload was too large for its notification")?;
        if whole.delayed {
            return Err("it is delayed");
        }
        if crate::payload::too_deep_text(whole.payload.get()) {
            return Err("its payload nests too deep");
        }
        let headers = crate::Headers::from_stored(whole.headers.clone()).map_err(|_| "its headers are invalid")?;
        let created_at = SystemTime::UNIX_EPOCH
            .checked_add(Duration::from_micros(u64::try_from(whole.created_us).map_err(|_| "its time is before 1970")?))
            .ok_or("its time is out of range")?;
        let age = SystemTime::now().duration_since(created_at).unwrap_or_default();
        let event = Event {
            id: self.id,
            uuid: self.uuid,
            topic: self.topic.clone(),
            key: self.key.clone(),
            payload: whole.payload.clone(),
            created_at,
            attempts: 1,
            headers,
        };
        Ok((event, age))
    }
}

/// What the fast path decided for an event, for the claim that records it.
pub(crate) struct Decided {
    pub(crate) outcome: Outcome,
    /// Commit-to-delivery latency of a delivered event, for the metrics once recorded.
    pub(crate) latency: Option<Duration>,
    at: Instant,
}

/// The keys of a batch of new events in delivery: the fast path holds their later events back
/// until it is dropped (the batch done, or given up).
pub(crate) struct Busy {
    fast: Arc<FastPath>,
    keys: Vec<String>,
}

impl Drop for Busy {
    fn drop(&mut self) {
        let mut state = self.fast.state();
        for key in &self.keys {
            if let Some(n) = state.busy.get_mut(key) {
                *n -= 1;
                if *n == 0 {
                    state.busy.remove(key);
                }
            }
        }
        drop(state);
        self.fast.ready.notify_one();
    }
}

/// A claim's word that it began while the fast path's conditions held (the epoch then).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ticket(u64);

#[derive(Default)]
struct State {
    /// The listener's backend pid while it holds the fast-path lock; 0 otherwise.
    owner: i32,
    /// Counts the disarms: a claim armed only if none came between its start and its end.
    epoch: u64,
    /// Every commit notifies this relay (marked waiting, race closed).
    complete: bool,
    /// The keys that wait were read since the fast path was taken.
    keys_read: bool,
    /// Events with a key may go the fast way (the waiting keys were within bound).
    keyed: bool,
    /// The pauses must be read again (a pause or resume was notified) past this generation.
    pauses_after: Option<u64>,
    /// Armed: the last draining claim's snapshot.
    baseline: Option<Snapshot>,
    /// Keys with an event that waits for this destination: parked, held by a dead letter.
    waiting: HashSet<String>,
    /// Keys of batches of new events in delivery, with how many batches.
    busy: HashMap<String, usize>,
    /// Events heard of, not yet delivered or left to a claim, in commit order.
    queue: VecDeque<(u64, Carried)>,
    /// A fast batch is in delivery.
    in_flight: bool,
    /// The fast batch in delivery was leased (it outlived the hold): claims go on meanwhile,
    /// and none arms the fast path until it is done.
    flight_leased: bool,
    /// Events of leased fast batches, by id: when their batch was leased, and whether a claim
    /// met them since. A claim passes an event with a copy in the parked events; this is for
    /// one whose copy is gone already (its delivery ended and was recorded by the lease's
    /// token before any claim passed its outbox row). Kept for [`DECIDED_KEPT`].
    leased: HashMap<i64, (Instant, bool)>,
    /// Outcomes decided, waiting for a claim to record them.
    decided: HashMap<i64, Decided>,
    /// The key the trigger signs notifications with, once the listener read it.
    key: Option<NotificationKey>,
    /// When a notification with a wrong signature was last logged, and how many came since.
    forged: (Option<Instant>, u64),
}

/// One destination's fast path in this relay.
#[derive(Debug)]
pub(crate) struct FastPath {
    state: Mutex<State>,
    /// On (the `fast_path` setting).
    enabled: bool,
    /// The destination's pattern.
    pattern: TopicPattern,
    pauses: Arc<Pauses>,
    /// Wakes the fast path's task: events queued, armed again, a batch of new events done.
    pub(crate) ready: Notify,
    /// Wakes a worker to claim.
    work: Arc<Notify>,
    /// Told whether it is armed.
    metrics: Arc<RelayMetrics>,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("owner", &self.owner)
            .field("epoch", &self.epoch)
            .field("armed", &self.baseline.is_some())
            .field("queued", &self.queue.len())
            .field("decided", &self.decided.len())
            .finish_non_exhaustive()
    }
}

impl FastPath {
    pub(crate) fn new(
        enabled: bool,
        pattern: TopicPattern,
        pauses: Arc<Pauses>,
        work: Arc<Notify>,
        metrics: Arc<RelayMetrics>,
    ) -> FastPath {
        FastPath { state: Mutex::default(), enabled, pattern, pauses, ready: Notify::new(), work, metrics }
    }

    /// Whether this relay takes the fast path at all (`RelayConfig::fast_path`, and a pattern it
    /// can match).
    pub(crate) fn enabled(&self) -> bool {
        self.enabled
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Disarms: whatever comes next waits for a claim, which arms again. Wakes a worker for it.
    fn disarm(&self, state: &mut State, why: &str) {
        state.epoch += 1;
        if state.baseline.take().is_some() {
            tracing::debug!(why, "the fast path waits for a claim");
            self.metrics.set_fast_path_armed(false);
            self.work.notify_one();
        }
    }

    /// Disarms from outside (a failed claim or record, a mark, a notification of a change).
    pub(crate) fn disarm_for(&self, why: &str) {
        let mut state = self.state();
        self.disarm(&mut state, why);
    }

    /// The listener holds the fast-path lock on its connection, whose backend is `pid`.
    pub(crate) fn owned(&self, pid: i32) {
        let mut state = self.state();
        self.disarm(&mut state, "the fast path was taken");
        state.owner = pid;
        state.keys_read = false;
        state.waiting.clear();
        drop(state);
        tracing::info!("this relay delivers the destination's new events from their notifications (fast path)");
        self.ready.notify_one();
    }

    /// The listener lost its connection or stopped, and with it the lock (if it held it) and the
    /// stream of notifications.
    pub(crate) fn listener_lost(&self, why: &str) {
        let mut state = self.state();
        self.disarm(&mut state, why);
        state.owner = 0;
        state.complete = false;
        state.queue.clear();
        // Read again on the next connection (an operator may have replaced it).
        state.key = None;
    }

    /// The listener's backend pid while it owns the fast path (claims of new events check it
    /// lives), 0 otherwise.
    pub(crate) fn owner(&self) -> i32 {
        self.state().owner
    }

    /// Whether every commit notifies this relay now (it is marked waiting and the race closure
    /// of that mark ended) or no longer (it marks itself busy, or the listener reconnected).
    pub(crate) fn complete(&self, complete: bool) {
        let mut state = self.state();
        if !complete {
            self.disarm(&mut state, "writers stop notifying this relay");
        }
        state.complete = complete;
    }

    /// The keys that wait, as read when the fast path was taken.
    pub(crate) fn keys_read(&self, keys: Option<Vec<String>>) {
        let mut state = self.state();
        state.keyed = keys.is_some();
        state.waiting.extend(keys.into_iter().flatten());
        state.keys_read = true;
        drop(state);
        self.work.notify_one(); // a claim arms it
    }

    /// Whether the keys that wait must be read (the fast path was taken, or something may have
    /// parked events this relay does not know of).
    pub(crate) fn keys_wanted(&self) -> bool {
        let state = self.state();
        self.enabled && state.owner != 0 && !state.keys_read
    }

    /// Something may have parked events this relay does not know of (a dead letter retried):
    /// the keys are read again.
    pub(crate) fn parked_elsewhere(&self) {
        let mut state = self.state();
        self.disarm(&mut state, "parked events changed");
        state.keys_read = false;
        drop(state);
        self.ready.notify_one();
    }

    /// A pause or resume was notified: nothing goes the fast way until the pauses are read again.
    pub(crate) fn pauses_changed(&self) {
        let mut state = self.state();
        self.disarm(&mut state, "the pauses changed");
        state.pauses_after = Some(self.pauses.generation());
    }

    /// The key that signs the notifications carrying events (read by the listener before it
    /// takes the fast path).
    pub(crate) fn has_key(&self) -> bool {
        self.state().key.is_some()
    }

    pub(crate) fn set_key(&self, key: NotificationKey) {
        self.state().key = Some(key);
    }

    /// A notification's payload: its events queued for the fast path when they are signed with
    /// the trigger's key and this relay owns it (`true` when it is armed and will deliver or
    /// claim them), else left to a claim (`false`: wake a worker). A notification whose events
    /// cannot be read from it disarms the fast path: they wait for a claim, and so must every
    /// event committed after them (an event of the same key must not overtake them). A wrong
    /// signature (another role's NOTIFY on the channel) is logged, at most once a minute.
    pub(crate) fn heard(&self, payload: &str) -> bool {
        let Some(key) = self.state().key.clone() else { return false };
        let why = match key.verify(payload) {
            Ok(json) => match Notified::parse(json) {
                Some(notified) => return self.notified(notified),
                None => "a signed notification that could not be read",
            },
            Err(Unsigned::Plain) => "a notification without its events",
            Err(Unsigned::Forged) => {
                self.forged();
                "a notification with a wrong signature"
            }
        };
        self.disarm_for(why);
        false
    }

    /// Logs a notification with a wrong signature, at most once a minute.
    fn forged(&self) {
        let mut state = self.state();
        state.forged.1 += 1;
        if state.forged.0.is_none_or(|at| at.elapsed() >= FORGED_LOG_EVERY) {
            let count = std::mem::take(&mut state.forged.1);
            state.forged.0 = Some(Instant::now());
            drop(state);
            tracing::warn!(
                count,
                "a notification on the outbox channel was not signed with the trigger's key (another role's NOTIFY, or the key in outbox_relay.notification_key changed): its events were not delivered from it; a claim reads what was committed"
            );
        }
    }

    /// A notification: queued for the fast path when this relay owns it (`true` when it is armed
    /// and will deliver or claim them), else left to a claim (`false`: wake a worker).
    fn notified(&self, notified: Notified) -> bool {
        if !self.enabled {
            return false;
        }
        let mut state = self.state();
        if state.owner == 0 {
            return false;
        }
        if notified.more || state.queue.len() + notified.events.len() > QUEUE_MAX {
            state.queue.clear();
            self.disarm(&mut state, "more events than the notifications carry");
            return false;
        }
        let xid = notified.xid;
        state.queue.extend(notified.events.into_iter().map(|event| (xid, event)));
        let armed = state.baseline.is_some();
        drop(state);
        if armed {
            self.ready.notify_one();
        }
        armed
    }

    /// Whether the fast path is armed: a commit of this process will be heard of by notification.
    pub(crate) fn armed(&self) -> bool {
        self.state().baseline.is_some()
    }

    /// A claim of new events begins (under the gate): its ticket, if the fast path's conditions
    /// hold, so that it may arm it.
    pub(crate) fn ticket(&self) -> Option<Ticket> {
        let state = self.state();
        let pauses_read = state.pauses_after.is_none_or(|after| self.pauses.generation() > after);
        (self.enabled && state.owner != 0 && state.complete && state.keys_read && pauses_read && !state.flight_leased)
            .then_some(Ticket(state.epoch))
    }

    /// Whether a fast batch is in delivery, not leased: claims do not look for new events
    /// meanwhile.
    pub(crate) fn in_flight(&self) -> bool {
        let state = self.state();
        state.in_flight && !state.flight_leased
    }

    /// The fast batch in delivery, `events`, outlived the hold and is leased: its events were
    /// copied into the parked ones under a lease, and wait there (with their keys' later events)
    /// for its end. Claims of new events go on (and pass them), and the fast path is disarmed
    /// until it is done: its task is busy, so notifications wake a worker to claim. Wakes one.
    pub(crate) fn lease_flight(&self, events: &[Event]) {
        let mut state = self.state();
        state.flight_leased = true;
        let now = Instant::now();
        state.leased.retain(|_, (at, _)| now.duration_since(*at) < DECIDED_KEPT);
        for event in events {
            state.leased.insert(event.id, (now, false));
            if let Some(key) = &event.key {
                state.waiting.insert(key.clone());
            }
        }
        self.disarm(&mut state, "a delivery from notifications outlived the hold");
        drop(state);
        self.work.notify_one();
    }

    /// The leased fast batch is done, its outcomes recorded by the lease's token (or not: the
    /// lease gives them back when it ends). Wakes a worker, whose claim arms the fast path again.
    pub(crate) fn leased_done(&self) {
        let mut state = self.state();
        state.in_flight = false;
        state.flight_leased = false;
        drop(state);
        self.work.notify_one();
    }

    /// What a claim of new events took: with `drained` its whole delta, to `snapshot`; `handed`
    /// the keys of the events it hands over (none of them waits now: the claim checked; they are
    /// busy until their batch is done), `parked` those of events it parked (they wait).
    pub(crate) fn claimed(
        self: &Arc<Self>,
        ticket: Option<Ticket>,
        snapshot: Option<Snapshot>,
        drained: bool,
        handed: Vec<String>,
        parked: &[String],
    ) -> Busy {
        let mut state = self.state();
        for key in &handed {
            state.waiting.remove(key);
            *state.busy.entry(key.clone()).or_default() += 1;
        }
        state.waiting.extend(parked.iter().cloned());
        match (ticket, snapshot) {
            (Some(Ticket(epoch)), Some(snapshot)) if drained && epoch == state.epoch => {
                let was_armed = state.baseline.replace(snapshot).is_some();
                self.metrics.set_fast_path_armed(true);
                drop(state);
                if !was_armed {
                    tracing::debug!("the fast path is armed");
                }
                self.ready.notify_one();
            }
            // A claim that took new events without arming: what it took must not go the fast
            // way too.
            _ => self.disarm(&mut state, "a claim took new events"),
        }
        Busy { fast: self.clone(), keys: handed }
    }

    /// A batch is done: the keys of `waiting` wait now (a retry, a dead letter, an event given
    /// back). `recorded`: its outcomes were written (if not, its events are claimable again, and
    /// nothing after them may go the fast way first).
    pub(crate) fn batch_done(&self, waiting: impl IntoIterator<Item = String>, recorded: bool) {
        let mut state = self.state();
        state.waiting.extend(waiting);
        if !recorded {
            self.disarm(&mut state, "a batch's outcomes could not be recorded");
        }
    }

    /// What the fast path settled for event `id`, if anything (for the claim, which records it,
    /// or passes a leased one, and holds its key's later events back unless it was delivered).
    pub(crate) fn decided(&self, id: i64) -> Option<Settled> {
        let mut state = self.state();
        if let Some(decided) = state.decided.get(&id) {
            return Some(match decided.outcome {
                Outcome::Delivered => Settled::Delivered,
                _ => Settled::Failed,
            });
        }
        let (_, met) = state.leased.get_mut(&id)?;
        *met = true;
        Some(Settled::Leased)
    }

    /// Takes event `id`'s decided outcome, for the claim that records it.
    pub(crate) fn take_decided(&self, id: i64) -> Option<Decided> {
        self.state().decided.remove(&id)
    }

    /// Event `id`'s decided outcome and latency, left in place: for a claim read ahead, which
    /// may be undone before its batch is recorded (`Claims::adopted` forgets them once it is the
    /// transaction's).
    pub(crate) fn peek_decided(&self, id: i64) -> Option<(Outcome, Option<Duration>)> {
        self.state().decided.get(&id).map(|d| (d.outcome.clone(), d.latency))
    }

    /// Forgets the decided outcomes of `ids`: a batch that holds them will record them.
    pub(crate) fn forget_decided(&self, ids: impl IntoIterator<Item = i64>) {
        let mut state = self.state();
        for id in ids {
            state.decided.remove(&id);
        }
    }

    /// Whether events wait in the queue.
    pub(crate) fn queued(&self) -> bool {
        !self.state().queue.is_empty()
    }

    /// Whether outcomes, or leased events, wait for a claim.
    pub(crate) fn undecided_left(&self) -> bool {
        let state = self.state();
        !state.decided.is_empty() || state.leased.values().any(|(_, met)| !met)
    }

    /// Takes the next fast batch (at most `max` events) from the queue, in commit order: drops
    /// what the baseline's claim took and what is not the destination's, and stops at the first
    /// event that cannot go the fast way, disarming. `breaker_open`: the destination looks down.
    /// Marks the batch in flight.
    pub(crate) fn take(&self, max: usize, breaker_open: bool) -> Vec<(Event, Duration)> {
        let mut state = self.state();
        let state = &mut *state;
        let mut batch = Vec::new();
        let paused = self.pauses.topics();
        while batch.len() < max {
            let Some(baseline) = &state.baseline else { break };
            let Some((xid, carried)) = state.queue.front() else { break };
            if baseline.sees(*xid) || state.decided.contains_key(&carried.id) {
                state.queue.pop_front(); // a claim took it
                continue;
            }
            if !self.pattern.matches(&carried.topic) {
                state.queue.pop_front(); // not this destination's
                continue;
            }
            let why = if breaker_open {
                Err("the destination looks down")
            } else if self.pauses.all() || paused.contains(&carried.topic) {
                Err("its topic is paused")
            } else {
                match &carried.key {
                    Some(_) if !state.keyed => Err("too many keys wait to keep in memory"),
                    Some(key) if state.waiting.contains(key) => Err("an earlier event of its key waits"),
                    Some(key) if state.busy.contains_key(key) => Err("an earlier event of its key is in delivery"),
                    _ => carried.event(),
                }
            };
            match why {
                Ok(event) => {
                    state.queue.pop_front();
                    batch.push(event);
                }
                Err(why) => {
                    tracing::trace!(id = carried.id, why, "an event waits for a claim");
                    self.disarm(state, why);
                    break;
                }
            }
        }
        state.in_flight = !batch.is_empty();
        batch
    }

    /// A fast batch is done: its outcomes wait for a claim (`None`: cut off at shutdown, nothing
    /// decided, the events are claimed again).
    pub(crate) fn delivered(&self, outcomes: Option<Vec<(Event, Outcome, Option<Duration>)>>) {
        let mut state = self.state();
        state.in_flight = false;
        let now = Instant::now();
        state.decided.retain(|_, d| now.duration_since(d.at) < DECIDED_KEPT);
        for (event, outcome, latency) in outcomes.into_iter().flatten() {
            if !matches!(outcome, Outcome::Delivered)
                && let Some(key) = &event.key
            {
                // It waits now (a retry, a dead letter): its key's later events wait behind it.
                state.waiting.insert(key.clone());
            }
            state.decided.insert(event.id, Decided { outcome, latency, at: now });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_sees_what_ended_before_it() {
        let s = Snapshot::parse("100:105:101,103").unwrap();
        assert!(s.sees(99));
        assert!(s.sees(100));
        assert!(!s.sees(101));
        assert!(s.sees(102));
        assert!(!s.sees(103));
        assert!(s.sees(104));
        assert!(!s.sees(105));
        assert!(!s.sees(200));
        assert_eq!(Snapshot::parse("7:7:"), Some(Snapshot { xmin: 7, xmax: 7, xip: vec![] }));
        assert_eq!(Snapshot::parse("8:7:"), None);
        assert_eq!(Snapshot::parse("7:x:"), None);
        assert_eq!(Snapshot::parse("7:9:8,"), None);
    }

    /// An armed fast path: owned, hearing every commit, keys read, a claim that drained.
    fn armed_path(key: &NotificationKey) -> Arc<FastPath> {
        let fast = Arc::new(FastPath::new(
            true,
            TopicPattern::parse("#").unwrap(),
            Arc::default(),
            Arc::new(Notify::new()),
            Arc::new(RelayMetrics::default()),
        ));
        fast.set_key(key.clone());
        fast.owned(42);
        fast.complete(true);
        fast.keys_read(Some(Vec::new()));
        let ticket = fast.ticket();
        drop(fast.claimed(ticket, Snapshot::parse("10:10:"), true, Vec::new(), &[]));
        assert!(fast.armed());
        fast
    }

    #[test]
    fn a_notification_whose_events_cannot_be_read_disarms_the_fast_path() {
        let key = NotificationKey::new(b"the trigger's key".to_vec());
        let event = |id: i64| {
            format!(r#"[{id},"2e33a3d2-40f3-4828-a3ef-0c45964299e3","order.placed","k",null,0,false,{{"n":{id}}}]"#)
        };
        let signed = |xid: u64, id: i64| key.sign(&format!(r#"{{"x":"{xid}","e":[{}]}}"#, event(id)));
        let fast = armed_path(&key);
        assert!(fast.heard(&signed(11, 1)), "a signed notification is taken");
        // An event committed with an empty wake-up (`carry_events` was off), or with a notification
        // another role made up, or unreadable: what comes after it must not go first.
        for unreadable in [String::new(), format!("{}{}", "0".repeat(64), &signed(12, 2)[64..]), key.sign("{}")] {
            let fast = armed_path(&key);
            assert!(!fast.heard(&unreadable), "{unreadable}");
            assert!(!fast.armed(), "disarmed by {unreadable:?}");
            assert!(!fast.heard(&signed(13, 3)), "the next event waits for a claim");
            assert!(fast.take(10, false).is_empty());
        }
    }

    #[test]
    fn notifications_are_read_as_the_trigger_writes_them() {
        let n = Notified::parse(
            r#"{"x":"906","e":[[1, "2e33a3d2-40f3-4828-a3ef-0c45964299e3", "order.placed", "k1", {"h": "v"}, 1796434733048876, false, {"a": 1.000000000000000000001, "b": [1, 2]}],[4, "f7a38eda-2e3f-4710-8f73-946c1698a0b1", "big", null]]}"#,
        )
        .unwrap();
        assert_eq!(n.xid, 906);
        assert!(!n.more);
        let (event, _) = n.events[0].event().unwrap();
        assert_eq!(event.payload.get(), r#"{"a": 1.000000000000000000001, "b": [1, 2]}"#);
        assert_eq!(event.key.as_deref(), Some("k1"));
        assert_eq!(event.headers.get("h"), Some("v"));
        assert_eq!(event.attempts, 1);
        assert!(n.events[1].event().is_err());
        assert_eq!(n.events[1].key, None);
        let more = Notified::parse(r#"{"x":"908","more":true}"#).unwrap();
        assert!(more.more && more.events.is_empty());
        assert!(Notified::parse("").is_none());
        assert!(Notified::parse("pauses").is_none());
        assert!(Notified::parse(r#"{"x":"1","e":[[1,"nope","t",null]]}"#).is_none());
    }
}
