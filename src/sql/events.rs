//! Events: adding them, claiming them, recording what became of them, cleaning them up.

use std::borrow::Cow;
use std::collections::HashSet;
use std::time::{Duration, SystemTime};

use super::{Db, all, count, micros, one};
use crate::error::Result;
use crate::event::NewEvent;
use crate::payload::Payload;
use crate::publish::AuditEntry;

/// The class of the advisory locks that serialize the writers of one key (`'outb'` in ASCII);
/// see migration 0004.
pub(crate) const KEY_LOCK_CLASS: i32 = 0x6f75_7462;

/// The payload `$3` comes as JSON text, which the server parses into `jsonb` (as it would the
/// binary form: jsonb's wire format is its text).
pub(crate) const EVENT_INSERT: &str = "\
insert into outbox_relay.outbox (topic, key, payload, available_at)
values ($1, $2, $3::text::jsonb, now() + $4::int8 * interval '1 microsecond')
returning id";

/// A keyed event: the key's advisory lock is taken before the insert draws its id, so writers of
/// one key serialize and its events commit in id order (the lock's function scan runs first;
/// the id default is computed as each row is inserted).
pub(crate) const EVENT_INSERT_KEYED: &str = "\
insert into outbox_relay.outbox (topic, key, payload, available_at)
select $1, $2, $3::text::jsonb, now() + $4::int8 * interval '1 microsecond'
  from pg_advisory_xact_lock($5, hashtext($2))
returning id";

/// Adds one event (taking its key's lock first) with the payload its validation gave; returns
/// its id.
pub(crate) async fn insert_event(db: &impl Db, event: &NewEvent, payload: &Payload) -> Result<i64> {
    let payload = payload.get();
    let delay = micros(event.delay);
    let row = match &event.key {
        None => one(db, EVENT_INSERT, &[&event.topic, &event.key, &payload, &delay], "adding an event").await?,
        Some(_) => {
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 5] =
                [&event.topic, &event.key, &payload, &delay, &KEY_LOCK_CLASS];
            one(db, EVENT_INSERT_KEYED, &params, "adding an event").await?
        }
    };
    Ok(row.get(0))
}

/// Takes the advisory locks of the given keys, in one fixed order (so that two writers of the
/// same keys cannot deadlock), before a multi-row insert draws its ids.
pub(crate) const KEYS_LOCK: &str = "\
select count(*) from (
    select pg_advisory_xact_lock($1, h)::text from (select distinct hashtext(k) as h from unnest($2::text[]) as k) s
     order by h
) locked";

pub(crate) const EVENT_INSERT_MANY: &str = "\
insert into outbox_relay.outbox (topic, key, payload, available_at)
select topic, key, payload::jsonb, now() + delay * interval '1 microsecond'
  from unnest($1::text[], $2::text[], $3::text[], $4::int8[]) with ordinality as e(topic, key, payload, delay, n)
 order by n
returning id";

/// Adds many events in one statement, with the payloads their validation gave; returns their
/// ids in input order.
pub(crate) async fn insert_events(
    db: &impl Db,
    events: &[NewEvent],
    payloads: &[Cow<'_, Payload>],
) -> Result<Vec<i64>> {
    if events.is_empty() {
        return Ok(Vec::new());
    }
    let topics: Vec<&str> = events.iter().map(|e| e.topic.as_str()).collect();
    let keys: Vec<Option<&str>> = events.iter().map(|e| e.key.as_deref()).collect();
    let payloads: Vec<&str> = payloads.iter().map(|p| p.get()).collect();
    let delays: Vec<i64> = events.iter().map(|e| micros(e.delay)).collect();
    let keyed: Vec<&str> = keys.iter().flatten().copied().collect();
    if !keyed.is_empty() {
        all(db, KEYS_LOCK, &[&KEY_LOCK_CLASS, &keyed], "locking the events' keys").await?;
    }
    let rows = all(db, EVENT_INSERT_MANY, &[&topics, &keys, &payloads, &delays], "adding events").await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

pub(crate) const AUDIT_INSERT: &str = "\
insert into outbox_relay.audit (entity, entity_id, action, data, idempotency_key)
values ($1, $2, $3, $4, $5)
returning id";

/// Adds one audit entry, linked to an idempotency key when there is one; returns its id.
pub(crate) async fn insert_audit(db: &impl Db, entry: &AuditEntry<'_>, idempotency_key: Option<&str>) -> Result<i64> {
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 5] =
        [&entry.entity, &entry.entity_id, &entry.action, &entry.data, &idempotency_key];
    Ok(one(db, AUDIT_INSERT, &params, "adding an audit entry").await?.get(0))
}

// The claims: of new events (`claim_new.sql`), read by transaction snapshots above the
// position, so that no claim ever reads an entry of an event delivered before it and a held
// snapshot cannot slow it down; and of parked events (`claim_parked.sql`: failed, delayed,
// paused, leased, behind their key), from small indexes of their own. Each ends with a marker
// row (id null). Both run in the caller's READ COMMITTED transaction, which holds what they took
// until it ends: the new events by the advisory lock that only one transaction at a time holds,
// the parked ones by row locks.

const CLAIM_NEW: &str = include_str!("claim_new.sql");
const CLAIM_PARKED: &str = include_str!("claim_parked.sql");

/// A claimed event as the claim returns it.
pub(crate) struct ClaimedRow {
    pub(crate) id: i64,
    pub(crate) uuid: uuid::Uuid,
    pub(crate) topic: String,
    pub(crate) key: Option<String>,
    /// The payload's text, or why it cannot be read (text that is not UTF-8 or not JSON: jsonb
    /// never gives such, but no row is trusted to stop a claim).
    pub(crate) payload: std::result::Result<Payload, String>,
    pub(crate) created_at: SystemTime,
    pub(crate) attempts: i32,
    /// Its age at the claim; `None` for a `created_at` outside 1970 to 9999.
    pub(crate) age: Option<Duration>,
    /// It was claimed from the destination's parked events (else from the new ones).
    pub(crate) parked: bool,
}

fn claimed_row(row: &tokio_postgres::Row, id: i64, parked: bool) -> ClaimedRow {
    ClaimedRow {
        parked,
        id,
        uuid: row.get(7),
        topic: row.get(1),
        key: row.get(2),
        payload: row.try_get::<_, Payload>(3).map_err(|e| crate::error::chain(&e)),
        created_at: row.get(4),
        attempts: row.get(5),
        age: row.get::<_, Option<i64>>(6).map(|us| Duration::from_micros(us.max(0) as u64)),
    }
}

/// The destination a relay's claims are for, as the statements take it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Destination {
    /// Its name (`outbox_relay.destinations.name`).
    pub(crate) name: String,
    /// The second key of its new events' lock.
    pub(crate) lock_id: i32,
    /// Its pattern as a regular expression over the topic; `None` matches every topic.
    pub(crate) topic_regex: Option<String>,
}

/// What a claim looks at, and in which order.
#[derive(Debug, Clone)]
pub(crate) struct Turn {
    /// Whether to look for new events (not while another transaction of this relay holds their
    /// lock).
    pub(crate) new: bool,
    /// Whether parked events may be due: only then is their claim run.
    pub(crate) parked: bool,
    /// Parked events take the batch first, or the new events do (the relay alternates, so that
    /// neither starves the other).
    pub(crate) parked_first: bool,
    /// Where the walk over the parked keys goes on (after this key), and how many it walks.
    pub(crate) walk_after: String,
    pub(crate) walk_keys: i32,
    /// Topics not to claim (paused). A paused head holds its key's later events back.
    pub(crate) paused: std::sync::Arc<[String]>,
    /// Outbox rows every destination has passed are deleted (else marked processed).
    pub(crate) delete: bool,
}

/// What a claim found.
#[derive(Default)]
pub(crate) struct Claimed {
    pub(crate) rows: Vec<ClaimedRow>,
    /// How long until the next parked event is due, when one is due later.
    pub(crate) next_due: Option<Duration>,
    /// The claim parked new events or moved the position without returning an event: its
    /// transaction must commit, and there may be more to claim.
    pub(crate) changed: bool,
    /// The claim parked new events (they may be due at once: behind a key whose head is done).
    pub(crate) parked_new: bool,
    /// More new events wait: the delta was cut short.
    pub(crate) more: bool,
    /// The claim of parked events ran and took all it could: none other is due now but those
    /// that other claims hold.
    pub(crate) parked_all: bool,
    /// Where the walk over the parked keys ended, when the claim of parked events ran: the key
    /// to go on after when it walked as far as it may, `None` when it reached the last key (the
    /// next walk starts from the first). `None` outside: the next walk goes on where it was.
    pub(crate) walked_to: Option<Option<String>>,
    /// The claim of parked events took some with a key.
    pub(crate) parked_keyed: bool,
    /// The claim holds the new events' lock (until its transaction ends): a claim turned away
    /// meanwhile relies on this one's relay to claim again once it is done.
    pub(crate) held_new: bool,
    /// Another transaction held the new events' lock: this claim took none.
    pub(crate) turned_away: bool,
}

/// How many times a claim of new events reads the position at most. A read that another claim's
/// commit overtook is read again in the same transaction, which then holds the lock, so the
/// second read is not overtaken; the bound only keeps a surprise from looping.
const OVERTAKEN_MAX: usize = 4;

/// Claims up to `batch` deliverable events, looking as `turn` says; with `dead_letters_hold`, a
/// key with an earlier event in the dead letters is held. Runs inside the caller's READ
/// COMMITTED transaction, which holds the events until it ends. New events that cannot be
/// handed over now are parked in it, with every later new event of their key.
pub(crate) async fn claim_events(
    db: &impl Db,
    to: &Destination,
    batch: i64,
    dead_letters_hold: bool,
    turn: &Turn,
) -> Result<Claimed> {
    let mut claimed = Claimed::default();
    if turn.parked && turn.parked_first {
        claim_parked(db, to, batch, dead_letters_hold, turn, &mut claimed).await?;
    }
    let room = batch - claimed.rows.len() as i64;
    if turn.new && room > 0 {
        claim_new(db, to, room, dead_letters_hold, turn, &mut claimed).await?;
    }
    let room = batch - claimed.rows.len() as i64;
    if turn.parked && !turn.parked_first && room > 0 {
        claim_parked(db, to, room, dead_letters_hold, turn, &mut claimed).await?;
    }
    Ok(claimed)
}

async fn claim_new(
    db: &impl Db,
    to: &Destination,
    batch: i64,
    dead_letters_hold: bool,
    turn: &Turn,
    claimed: &mut Claimed,
) -> Result<()> {
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 6] =
        [&batch, &dead_letters_hold, &&*turn.paused, &to.name, &to.lock_id, &to.topic_regex];
    for _ in 0..OVERTAKEN_MAX {
        let rows = all(db, CLAIM_NEW, &params, "claiming new events").await?;
        let mut fresh = Vec::with_capacity(rows.len());
        let (mut moved, mut overtaken) = (false, false);
        for row in &rows {
            let Some(id) = row.get::<_, Option<i64>>(0) else {
                claimed.next_due =
                    row.get::<_, Option<i64>>(9).filter(|us| *us > 0).map(|us| Duration::from_micros(us as u64));
                claimed.held_new = row.get::<_, Option<bool>>(10).unwrap_or(false);
                moved = row.get::<_, Option<bool>>(11).unwrap_or(false);
                claimed.more = row.get::<_, Option<bool>>(12).unwrap_or(false);
                overtaken = row.get::<_, Option<bool>>(13).unwrap_or(false);
                continue;
            };
            fresh.push((claimed_row(row, id, false), row.get::<_, Option<bool>>(8).unwrap_or(false)));
        }
        claimed.turned_away = !claimed.held_new;
        if claimed.held_new && overtaken {
            continue; // another claim moved the position after this one read it: read it again
        }
        // A key whose event waits holds its later ones back too (they are in id order).
        let mut waiting_keys: HashSet<String> = HashSet::new();
        let mut park = Copies::default();
        for (row, ready) in fresh {
            let wait = match &row.key {
                None => !ready,
                Some(key) => {
                    if !ready {
                        waiting_keys.insert(key.clone());
                    }
                    waiting_keys.contains(key)
                }
            };
            if wait {
                park.push(row.id, Duration::ZERO, None, row.attempts - 1);
            } else {
                claimed.rows.push(row);
            }
        }
        if !park.ids.is_empty() {
            // A copy waits for this destination; the outbox row is done with once every
            // destination has passed it.
            park_new_events(db, &to.name, &park, None).await?;
            finish_new_events(db, &to.name, &park.ids, turn.delete).await?;
            claimed.parked_new = true;
        }
        // The position moved but the claim returns no event (all parked, or the end of a cut
        // delta): its transaction must commit, and there may be more.
        claimed.changed |= moved && claimed.rows.is_empty();
        return Ok(());
    }
    // Overtaken every time: other claims are moving the position; theirs will claim again.
    claimed.turned_away = true;
    Ok(())
}

async fn claim_parked(
    db: &impl Db,
    to: &Destination,
    limit: i64,
    dead_letters_hold: bool,
    turn: &Turn,
    claimed: &mut Claimed,
) -> Result<()> {
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 6] =
        [&limit, &dead_letters_hold, &turn.walk_after, &turn.walk_keys, &&*turn.paused, &to.name];
    let rows = all(db, CLAIM_PARKED, &params, "claiming parked events").await?;
    let before = claimed.rows.len();
    for row in &rows {
        let Some(id) = row.get::<_, Option<i64>>(0) else {
            claimed.walked_to = Some(row.get(8));
            continue;
        };
        let row = claimed_row(row, id, true);
        claimed.parked_keyed |= row.key.is_some();
        claimed.rows.push(row);
    }
    claimed.parked_all = ((claimed.rows.len() - before) as i64) < limit && claimed.walked_to == Some(None);
    Ok(())
}

// What became of claimed events. An event claimed from the new ones is, for this destination,
// passed by the position the claim moved: whatever its outcome, its outbox row is done with as
// far as this destination goes (`finish_new_events`), and what still waits for this destination
// is a copy in `parked` (`park_new_events`) or a dead letter (`bury_new_events`), written first.
// An event claimed from `parked` changes there. The statements on parked events take the claim's
// lease token, or null for a held claim (its locks already say the rows are this claim's);
// `attempts` are set as the relay counted them: the attempt just made, or one fewer where it is
// given back.

/// Per new event that waits for this destination: its id, how long from now it waits (at least
/// until its own `available_at`), its error and its attempts.
#[derive(Debug, Default)]
pub(crate) struct Copies {
    pub(crate) ids: Vec<i64>,
    pub(crate) delays: Vec<i64>,
    pub(crate) errors: Vec<Option<String>>,
    pub(crate) attempts: Vec<i32>,
}

impl Copies {
    pub(crate) fn push(&mut self, id: i64, delay: Duration, error: Option<String>, attempts: i32) {
        self.ids.push(id);
        self.delays.push(micros(delay));
        self.errors.push(error);
        self.attempts.push(attempts);
    }
}

const PARKED_COPY: &str = "\
insert into outbox_relay.parked (destination, id, uuid, topic, key, payload, created_at, available_at, attempts,
                                 last_error, lease_token)
select $1, o.id, o.uuid, o.topic, o.key, o.payload, o.created_at,
       greatest(o.available_at, now() + f.delay_us * interval '1 microsecond'), f.attempts, f.error, $6
  from unnest($2::int8[], $3::int8[], $4::text[], $5::int4[]) with ordinality as f(id, delay_us, error, attempts, n)
  join outbox_relay.outbox o on o.id = f.id
 order by f.n
on conflict (destination, id) do nothing";

/// Copies new events into the destination's parked events (under the lease `token`, if any).
pub(crate) async fn park_new_events(db: &impl Db, destination: &str, c: &Copies, token: Option<i64>) -> Result<u64> {
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 6] =
        [&destination, &c.ids, &c.delays, &c.errors, &c.attempts, &token];
    count(db, PARKED_COPY, &params, "parking events for a destination").await
}

const DEAD_LETTER_NEW: &str = "\
insert into outbox_relay.dead_letters (destination, id, uuid, topic, key, payload, created_at, attempts, last_error)
select $1, o.id, o.uuid, o.topic, o.key, o.payload, o.created_at, f.attempts, f.error
  from unnest($2::int8[], $3::text[], $4::int4[]) as f(id, error, attempts)
  join outbox_relay.outbox o on o.id = f.id
on conflict (destination, id) do update
   set attempts = excluded.attempts, last_error = excluded.last_error, failed_at = now()";

/// Copies new events into the dead letters of the destination, with their errors and attempts.
pub(crate) async fn bury_new_events(
    db: &impl Db,
    destination: &str,
    ids: &[i64],
    errors: &[String],
    attempts: &[i32],
) -> Result<u64> {
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] = [&destination, &ids, &errors, &attempts];
    count(db, DEAD_LETTER_NEW, &params, "moving events to the dead letters").await
}

/// Deletes (`$3`) or marks processed the outbox rows `$2` that every registered destination but
/// `$1` has passed: `$1`'s claim passed them in this transaction. A destination has passed an
/// event when its newest position's snapshot sees the event's transaction, or when it is in
/// the position's cut delta at or below `after_id`.
const OUTBOX_FINISH: &str = "\
with others as materialized (
    select p.since, p.snapshot, p.after_id
      from outbox_relay.destinations d cross join lateral (
        select q.since, q.snapshot, q.after_id from outbox_relay.positions q
         where q.destination = d.name order by q.n desc limit 1) p
     where d.name <> $1::text
),
done as materialized (
    select e.id from outbox_relay.outbox e
     where e.id = any($2::int8[]) and e.processed_at is null
       and not exists (
        select 1 from others p
         where not (pg_visible_in_snapshot(e.xid, case when p.after_id is null then p.snapshot else p.since end)
                    or (p.after_id is not null and e.id <= p.after_id and pg_visible_in_snapshot(e.xid, p.snapshot))))
),
deleted as (delete from outbox_relay.outbox where $3 and id in (select id from done) returning 1),
marked as (update outbox_relay.outbox set processed_at = now() where not $3 and id in (select id from done) returning 1)
select (select count(*) from deleted) + (select count(*) from marked)";

/// Deletes (`delete`) or marks processed the outbox rows `ids`, which `destination`'s claim has
/// passed in this transaction, where every other destination has passed them too (the janitor
/// does the rest); returns how many.
pub(crate) async fn finish_new_events(db: &impl Db, destination: &str, ids: &[i64], delete: bool) -> Result<u64> {
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] = [&destination, &ids, &delete];
    let finished: i64 = one(db, OUTBOX_FINISH, &params, "recording deliveries").await?.get(0);
    Ok(finished.max(0) as u64)
}

/// Turns held parked events into leased ones, counting the attempt, so that the transaction can
/// commit while their delivery goes on (held new events are copied with `park_new_events`).
const PARKED_LEASE_HELD: &str = "\
update outbox_relay.parked
   set available_at = now() + $3::int8 * interval '1 microsecond',
       attempts = least(attempts, 2147483646) + 1,
       lease_token = $4
 where destination = $1 and id = any($2)";

/// Leases the held parked events `ids` for `lease` under `token`.
pub(crate) async fn lease_held_parked(
    db: &impl Db,
    destination: &str,
    ids: &[i64],
    lease: Duration,
    token: i64,
) -> Result<u64> {
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] = [&destination, &ids, &micros(lease), &token];
    count(db, PARKED_LEASE_HELD, &params, "turning a held claim into a lease").await
}

const PARKED_RENEW_LEASE: &str = "\
update outbox_relay.parked set available_at = now() + $4::int8 * interval '1 microsecond'
 where destination = $1 and id = any($2) and lease_token = $3";

/// Extends the lease of the events `ids` still under `token` to `lease` from now (a delivery
/// that goes on); returns how many still carry the token.
pub(crate) async fn renew_lease(
    db: &impl Db,
    destination: &str,
    ids: &[i64],
    lease: Duration,
    token: i64,
) -> Result<u64> {
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] = [&destination, &ids, &token, &micros(lease)];
    count(db, PARKED_RENEW_LEASE, &params, "renewing a lease").await
}

const PARKED_DELIVERED: &str = "\
delete from outbox_relay.parked where destination = $1 and id = any($2) and ($3::int8 is null or lease_token = $3)";

/// Records the deliveries of parked events `ids`.
pub(crate) async fn complete_parked(db: &impl Db, destination: &str, ids: &[i64], token: Option<i64>) -> Result<u64> {
    count(db, PARKED_DELIVERED, &[&destination, &ids, &token], "recording deliveries").await
}

const PARKED_RESCHEDULE: &str = "\
update outbox_relay.parked o
   set available_at = now() + f.delay_us * interval '1 microsecond', last_error = coalesce(f.error, o.last_error),
       lease_token = null, attempts = f.attempts
  from unnest($2::int8[], $4::int8[], $5::text[], $6::int4[]) as f(id, delay_us, error, attempts)
 where o.destination = $1 and o.id = f.id and ($3::int8 is null or o.lease_token = $3)";

/// Reschedules parked events: per event a delay, an error (none keeps the last) and its
/// attempts. Failed deliveries and events given back alike.
pub(crate) async fn reschedule_parked(db: &impl Db, destination: &str, c: &Copies, token: Option<i64>) -> Result<u64> {
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 6] =
        [&destination, &c.ids, &token, &c.delays, &c.errors, &c.attempts];
    count(db, PARKED_RESCHEDULE, &params, "rescheduling parked events").await
}

const DEAD_LETTER_PARKED: &str = "\
with failed as (
    delete from outbox_relay.parked o
     using unnest($2::int8[], $4::text[], $5::int4[]) as f(id, error, attempts)
     where o.destination = $1 and o.id = f.id and ($3::int8 is null or o.lease_token = $3)
    returning o.id, o.uuid, o.topic, o.key, o.payload, o.created_at, f.attempts, f.error
)
insert into outbox_relay.dead_letters (destination, id, uuid, topic, key, payload, created_at, attempts, last_error)
select $1, id, uuid, topic, key, payload, created_at, attempts, error from failed
on conflict (destination, id) do update
   set attempts = excluded.attempts, last_error = excluded.last_error, failed_at = now()";

/// Moves parked events to the destination's dead letters with their errors and attempts.
pub(crate) async fn bury_parked(
    db: &impl Db,
    destination: &str,
    ids: &[i64],
    errors: &[String],
    attempts: &[i32],
    token: Option<i64>,
) -> Result<u64> {
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 5] = [&destination, &ids, &token, &errors, &attempts];
    count(db, DEAD_LETTER_PARKED, &params, "moving events to the dead letters").await
}

/// Prepares every statement that records outcomes or leases a held claim, so that they can be
/// pipelined before a COMMIT.
pub(crate) async fn prepare_outcomes(db: &impl Db) -> Result<()> {
    for sql in [
        PARKED_COPY,
        DEAD_LETTER_NEW,
        OUTBOX_FINISH,
        PARKED_LEASE_HELD,
        PARKED_DELIVERED,
        PARKED_RESCHEDULE,
        DEAD_LETTER_PARKED,
    ] {
        db.prepare(sql).await.map_err(|e| crate::error::Error::database("preparing the outcome statements", e))?;
    }
    Ok(())
}

const EVENT_DELETE_EXPIRED: &str = "\
delete from outbox_relay.outbox where id in (
    select id from outbox_relay.outbox
     where processed_at < now() - $1::int8 * interval '1 microsecond'
     order by id
     limit $2
       for update skip locked
)";

/// Deletes up to `batch` events processed more than `age` ago; rows others delete are skipped.
pub(crate) async fn delete_processed_events(db: &impl Db, age: Duration, batch: i64) -> Result<u64> {
    count(db, EVENT_DELETE_EXPIRED, &[&micros(age), &batch], "deleting old processed events").await
}

/// Every position but each destination's newest (the one that counts; a claim reads it from the
/// end of the index, so the dead rows this leaves are never on its path).
///
/// Only rows older than ten minutes go: a claim detects that another overtook its read of the
/// position by the next row's key, so that row must outlive any claim statement in flight.
const POSITIONS_PRUNE: &str = "\
delete from outbox_relay.positions p
 where p.at < now() - interval '10 minutes'
   and p.n < (select max(q.n) from outbox_relay.positions q where q.destination = p.destination)";

/// Deletes the old positions; returns how many.
pub(crate) async fn prune_positions(db: &impl Db) -> Result<u64> {
    count(db, POSITIONS_PRUNE, &[], "deleting old claim positions").await
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    /// Every `Seq Scan` of the outbox or the parked events in an EXPLAIN (FORMAT JSON) plan.
    fn outbox_seq_scans(plan: &Value, found: &mut Vec<String>) {
        match plan {
            Value::Object(node) => {
                if node.get("Node Type") == Some(&Value::from("Seq Scan"))
                    && (node.get("Relation Name") == Some(&Value::from("outbox"))
                        || node.get("Relation Name") == Some(&Value::from("parked")))
                {
                    found.push(plan.to_string());
                }
                node.values().for_each(|v| outbox_seq_scans(v, found));
            }
            Value::Array(items) => items.iter().for_each(|v| outbox_seq_scans(v, found)),
            _ => {}
        }
    }

    /// The relay runs its claims with generic plans (`plan_cache_mode = force_generic_plan`):
    /// with a backlog of new and of parked events, both claims, with no topic paused and with
    /// one, must read through their indexes, never the whole outbox (a bare `topic <> all($5)`
    /// once made the planner do just that, a hundred times slower). Checked without the relay's
    /// `enable_seqscan = off`, so that the plans stand on the statements alone.
    #[tokio::test]
    async fn every_claim_walks_the_indexes_with_generic_plans() {
        let db = pg_outbox_relay_testkit::harness::TestDb::new().await;
        let client = db.client().await;
        client
            .batch_execute(
                "insert into outbox_relay.outbox (topic, payload) select 'bench', '{}' from generate_series(1, 100000);
                 insert into outbox_relay.outbox (topic, key, payload) select 'bench', 'k' || (g % 100), '{}' from generate_series(1, 10000) g;
                 insert into outbox_relay.parked (destination, id, uuid, topic, payload, created_at)
                 select 'default', g, gen_random_uuid(), 'bench', '{}', now() from generate_series(1, 100000) g;
                 insert into outbox_relay.parked (destination, id, uuid, topic, key, payload, created_at)
                 select 'default', g, gen_random_uuid(), 'bench', 'k' || (g % 100), '{}', now() from generate_series(100001, 110000) g;
                 analyze outbox_relay.outbox;
                 analyze outbox_relay.parked;
                 set plan_cache_mode = force_generic_plan",
            )
            .await
            .unwrap();
        client.batch_execute(&format!("prepare claim_new as {CLAIM_NEW}")).await.unwrap();
        client.batch_execute(&format!("prepare claim_parked as {CLAIM_PARKED}")).await.unwrap();
        for paused in ["{}", "{mail.send}"] {
            for (name, args) in [
                ("claim_new", format!("500, false, '{paused}', 'default', 1, null")),
                ("claim_new", format!("500, false, '{paused}', 'mailer', 2, '^\\.mail(\\.[^.]+)*$'")),
                ("claim_parked", format!("500, false, '', 1000, '{paused}', 'default'")),
            ] {
                client.batch_execute("begin").await.unwrap();
                let row =
                    client.query_one(&format!("explain (format json) execute {name}({args})"), &[]).await.unwrap();
                client.batch_execute("rollback").await.unwrap();
                let plan: Value = row.get(0);
                let mut scans = Vec::new();
                outbox_seq_scans(&plan, &mut scans);
                assert!(scans.is_empty(), "{name} (paused {paused}) reads the whole outbox: {plan}");
            }
        }
    }
}
