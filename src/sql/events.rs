//! Events: adding them, claiming them, recording what became of them, cleaning them up.

use std::time::{Duration, SystemTime};

use serde_json::Value;

use super::{Db, all, count, micros, one};
use crate::error::Result;
use crate::event::NewEvent;
use crate::publish::AuditEntry;

/// The class of the advisory locks that serialize the writers of one key (`'outb'` in ASCII);
/// see migration 0004.
pub(crate) const KEY_LOCK_CLASS: i32 = 0x6f75_7462;

const EVENT_INSERT: &str = "\
insert into outbox_relay.outbox (topic, key, payload, available_at)
values ($1, $2, $3, now() + $4::int8 * interval '1 microsecond')
returning id";

/// A keyed event: the key's advisory lock is taken before the insert draws its id, so writers of
/// one key serialize and its events commit in id order (the lock's function scan runs first;
/// the id default is computed as each row is inserted).
const EVENT_INSERT_KEYED: &str = "\
insert into outbox_relay.outbox (topic, key, payload, available_at)
select $1, $2, $3, now() + $4::int8 * interval '1 microsecond'
  from pg_advisory_xact_lock($5, hashtext($2))
returning id";

/// Adds one event (taking its key's lock first); returns its id.
pub(crate) async fn insert_event(db: &impl Db, event: &NewEvent) -> Result<i64> {
    let delay = micros(event.delay);
    let row = match &event.key {
        None => one(db, EVENT_INSERT, &[&event.topic, &event.key, &event.payload, &delay], "adding an event").await?,
        Some(_) => {
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 5] =
                [&event.topic, &event.key, &event.payload, &delay, &KEY_LOCK_CLASS];
            one(db, EVENT_INSERT_KEYED, &params, "adding an event").await?
        }
    };
    Ok(row.get(0))
}

/// Takes the advisory locks of the given keys, in one fixed order (so that two writers of the
/// same keys cannot deadlock), before a multi-row insert draws its ids.
const KEYS_LOCK: &str = "\
select count(*) from (
    select pg_advisory_xact_lock($1, h)::text from (select distinct hashtext(k) as h from unnest($2::text[]) as k) s
     order by h
) locked";

const EVENT_INSERT_MANY: &str = "\
insert into outbox_relay.outbox (topic, key, payload, available_at)
select topic, key, payload, now() + delay * interval '1 microsecond'
  from unnest($1::text[], $2::text[], $3::jsonb[], $4::int8[]) with ordinality as e(topic, key, payload, delay, n)
 order by n
returning id";

/// Adds many events in one statement; returns their ids in input order.
pub(crate) async fn insert_events(db: &impl Db, events: &[NewEvent]) -> Result<Vec<i64>> {
    if events.is_empty() {
        return Ok(Vec::new());
    }
    let topics: Vec<&str> = events.iter().map(|e| e.topic.as_str()).collect();
    let keys: Vec<Option<&str>> = events.iter().map(|e| e.key.as_deref()).collect();
    let payloads: Vec<&Value> = events.iter().map(|e| &e.payload).collect();
    let delays: Vec<i64> = events.iter().map(|e| micros(e.delay)).collect();
    let keyed: Vec<&str> = keys.iter().flatten().copied().collect();
    if !keyed.is_empty() {
        all(db, KEYS_LOCK, &[&KEY_LOCK_CLASS, &keyed], "locking the events' keys").await?;
    }
    let rows = all(db, EVENT_INSERT_MANY, &[&topics, &keys, &payloads, &delays], "adding events").await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

const AUDIT_INSERT: &str = "\
insert into outbox_relay.audit (entity, entity_id, action, data, idempotency_key)
values ($1, $2, $3, $4, $5)
returning id";

/// Adds one audit entry, linked to an idempotency key when there is one; returns its id.
pub(crate) async fn insert_audit(db: &impl Db, entry: &AuditEntry<'_>, idempotency_key: Option<&str>) -> Result<i64> {
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 5] =
        [&entry.entity, &entry.entity_id, &entry.action, &entry.data, &idempotency_key];
    Ok(one(db, AUDIT_INSERT, &params, "adding an audit entry").await?.get(0))
}

/// Which rows a claim may take, in claim order, locked as taken. SKIP LOCKED lets many workers
/// and processes claim side by side without waiting on each other (a row another claim holds,
/// locked or leased, is passed over).
///
/// Order per key: a keyed event is claimed only when no earlier event of its key is unfinished
/// (pending, leased, held by another claim, or waiting for a retry: its row is there with
/// `processed_at` null), and, when `$2` is set, no earlier one of its key is in the dead
/// letters. So a claim holds at most one event per key, the key's head, and the next is
/// claimable once the head is done.
macro_rules! claimable {
    () => {
        " from outbox_relay.outbox o
     where o.processed_at is null and o.available_at <= now()
       and (o.key is null or (
            not exists (select 1 from outbox_relay.outbox e
                         where e.key = o.key and e.processed_at is null and e.id < o.id)
            and not ($2 and exists (select 1 from outbox_relay.dead_letters d where d.key = o.key and d.id < o.id))))
     order by o.available_at, o.id
     limit $1
       for update of o skip locked"
    };
}

/// What a claim returns of each row: `attempt` is the number of the attempt the claim starts
/// (it stops short of the integer's end, so no row can fail the statement), `age_us` the
/// event's age on the server's clock (no clock skew), null for a `created_at` outside 1970 to
/// 9999 (such an event is dead-lettered).
macro_rules! claimed_columns {
    ($attempt:literal) => {
        concat!(
            "o.id, o.topic, o.key, o.payload, o.created_at, ",
            $attempt,
            " as attempt,
          case when o.created_at >= '1970-01-01 00:00:00+00' and o.created_at < '10000-01-01 00:00:00+00'
               then (extract(epoch from clock_timestamp() - o.created_at) * 1000000)::int8 end as age_us"
        )
    };
}

/// The leased claim, a transaction of its own: claims up to `$1` events for a lease of `$3`
/// microseconds under token `$4`. The lease moves `available_at` forward, so an event whose
/// worker died comes back when it ends; `attempts` counts claims, so an event that crashes its
/// worker still runs out of attempts.
const EVENT_CLAIM_LEASED: &str = concat!(
    "with claimable as (select o.id",
    claimable!(),
    ")
update outbox_relay.outbox o
   set available_at = now() + $3::int8 * interval '1 microsecond',
       attempts = least(o.attempts, 2147483646) + 1,
       lease_token = $4
  from claimable c
 where o.id = c.id
returning ",
    claimed_columns!("o.attempts")
);

/// The held claim, inside a transaction that stays open while the batch is delivered: its row
/// locks are the lease, so the claim writes nothing, and the outcomes are written in the same
/// transaction (the rows' one change is the completion). A worker that dies ends its session,
/// and its events are claimable at once.
const EVENT_CLAIM_HELD: &str = concat!("select ", claimed_columns!("least(o.attempts, 2147483646) + 1"), claimable!());

/// A claimed event as the claim returns it.
pub(crate) struct ClaimedRow {
    pub(crate) id: i64,
    pub(crate) topic: String,
    pub(crate) key: Option<String>,
    /// The payload, or why serde_json cannot hold it (a number beyond f64, nesting past its limit).
    pub(crate) payload: std::result::Result<Value, String>,
    pub(crate) created_at: SystemTime,
    pub(crate) attempts: i32,
    /// Its age at the claim; `None` for a `created_at` outside 1970 to 9999.
    pub(crate) age: Option<Duration>,
}

/// How a claim holds its events.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Hold {
    /// By a lease of this length under this token, the claim committed.
    Lease(Duration, i64),
    /// By row locks, the claim's transaction open (the caller began it).
    Locks,
}

/// Claims up to `batch` deliverable events; with `dead_letters_hold`, a key with an earlier
/// event in the dead letters is held.
pub(crate) async fn claim_events(
    db: &impl Db,
    batch: i64,
    dead_letters_hold: bool,
    hold: Hold,
) -> Result<Vec<ClaimedRow>> {
    let rows = match hold {
        Hold::Lease(lease, token) => {
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] =
                [&batch, &dead_letters_hold, &micros(lease), &token];
            all(db, EVENT_CLAIM_LEASED, &params, "claiming events").await?
        }
        Hold::Locks => all(db, EVENT_CLAIM_HELD, &[&batch, &dead_letters_hold], "claiming events").await?,
    };
    Ok(rows
        .iter()
        .map(|row| ClaimedRow {
            id: row.get(0),
            topic: row.get(1),
            key: row.get(2),
            payload: row.try_get::<_, Value>(3).map_err(|e| crate::error::chain(&e)),
            created_at: row.get(4),
            attempts: row.get(5),
            age: row.get::<_, Option<i64>>(6).map(|us| Duration::from_micros(us.max(0) as u64)),
        })
        .collect())
}

/// Turns held events (locked by this transaction) into leased ones, counting the attempt, so
/// that the transaction can commit while their delivery goes on.
const EVENT_LEASE_HELD: &str = "\
update outbox_relay.outbox
   set available_at = now() + $2::int8 * interval '1 microsecond',
       attempts = least(attempts, 2147483646) + 1,
       lease_token = $3
 where id = any($1)";

/// Leases the held events `ids` for `lease` under `token`.
pub(crate) async fn lease_held_events(db: &impl Db, ids: &[i64], lease: Duration, token: i64) -> Result<u64> {
    count(db, EVENT_LEASE_HELD, &[&ids, &micros(lease), &token], "turning a held claim into a lease").await
}

/// The earliest time a pending event becomes deliverable, for the relay's timer (an infinite
/// `available_at`, possible in rows older than migration 0003, is no moment to wake at).
const EVENT_NEXT_AVAILABLE: &str = "\
select (extract(epoch from min(available_at) - now()) * 1000000)::int8
  from outbox_relay.outbox where processed_at is null and isfinite(available_at)";

/// How long until the next pending event is due, when one is due later (not now).
pub(crate) async fn next_due(db: &impl Db) -> Result<Option<Duration>> {
    let row = one(db, EVENT_NEXT_AVAILABLE, &[], "reading the next due event").await?;
    Ok(row.get::<_, Option<i64>>(0).filter(|us| *us > 0).map(|us| Duration::from_micros(us as u64)))
}

// The outcome statements take `$2`, the claim's token, or null for a held claim (its row locks
// already say the rows are this claim's). `attempts` are set as the relay counted them: the
// attempt just made, or one fewer where it is given back.

const EVENT_MARK_PROCESSED: &str = "\
update outbox_relay.outbox set processed_at = now(), lease_token = null, last_error = null,
       attempts = f.attempts
  from unnest($1::int8[], $3::int4[]) as f(id, attempts)
 where outbox.id = f.id and ($2::int8 is null or lease_token = $2)";

const EVENT_DELETE_PROCESSED: &str =
    "delete from outbox_relay.outbox where id = any($1) and ($2::int8 is null or lease_token = $2)";

/// Records the deliveries `ids` (their attempts `attempts`): marks the rows processed, or
/// deletes them.
pub(crate) async fn complete_events(
    db: &impl Db,
    delete: bool,
    ids: &[i64],
    attempts: &[i32],
    token: Option<i64>,
) -> Result<u64> {
    if delete {
        count(db, EVENT_DELETE_PROCESSED, &[&ids, &token], "recording deliveries").await
    } else {
        count(db, EVENT_MARK_PROCESSED, &[&ids, &token, &attempts], "recording deliveries").await
    }
}

const EVENT_RESCHEDULE: &str = "\
update outbox_relay.outbox o
   set available_at = now() + f.delay_us * interval '1 microsecond', last_error = f.error, lease_token = null,
       attempts = f.attempts
  from unnest($1::int8[], $3::int8[], $4::text[], $5::int4[]) as f(id, delay_us, error, attempts)
 where o.id = f.id and ($2::int8 is null or o.lease_token = $2)";

/// Reschedules failed deliveries: per event a delay, an error and its attempts.
pub(crate) async fn reschedule_events(
    db: &impl Db,
    ids: &[i64],
    delays: &[Duration],
    errors: &[String],
    attempts: &[i32],
    token: Option<i64>,
) -> Result<u64> {
    let delays: Vec<i64> = delays.iter().map(|d| micros(*d)).collect();
    count(db, EVENT_RESCHEDULE, &[&ids, &token, &delays, &errors, &attempts], "rescheduling failed deliveries").await
}

const EVENT_RELEASE: &str = "\
update outbox_relay.outbox o
   set available_at = now(), lease_token = null, attempts = f.attempts, last_error = coalesce($4, o.last_error)
  from unnest($1::int8[], $3::int4[]) as f(id, attempts)
 where o.id = f.id and ($2::int8 is null or o.lease_token = $2)";

/// Gives back claimed events that were not delivered (shutdown, an open breaker): deliverable
/// at once, with the attempts they had before the claim, and `why` as their `last_error` when
/// given.
pub(crate) async fn release_events(
    db: &impl Db,
    ids: &[i64],
    attempts: &[i32],
    token: Option<i64>,
    why: Option<&str>,
) -> Result<u64> {
    count(db, EVENT_RELEASE, &[&ids, &token, &attempts, &why], "releasing events").await
}

const EVENT_BURY: &str = "\
with failed as (
    delete from outbox_relay.outbox o
     using unnest($1::int8[], $3::text[], $4::int4[]) as f(id, error, attempts)
     where o.id = f.id and ($2::int8 is null or o.lease_token = $2)
    returning o.id, o.topic, o.key, o.payload, o.created_at, f.attempts, f.error
)
insert into outbox_relay.dead_letters (id, topic, key, payload, created_at, attempts, last_error)
select id, topic, key, payload, created_at, attempts, error from failed
on conflict (id) do update
   set attempts = excluded.attempts, last_error = excluded.last_error, failed_at = now()";

/// Prepares every statement that records outcomes or leases a held claim, so that they can be
/// pipelined before a COMMIT.
pub(crate) async fn prepare_outcomes(db: &impl Db) -> Result<()> {
    for sql in
        [EVENT_MARK_PROCESSED, EVENT_DELETE_PROCESSED, EVENT_RESCHEDULE, EVENT_RELEASE, EVENT_BURY, EVENT_LEASE_HELD]
    {
        db.prepare(sql).await.map_err(|e| crate::error::Error::database("preparing the outcome statements", e))?;
    }
    Ok(())
}

/// Moves events to the dead letters with their errors and attempts, keeping ids.
pub(crate) async fn bury_events(
    db: &impl Db,
    ids: &[i64],
    errors: &[String],
    attempts: &[i32],
    token: Option<i64>,
) -> Result<u64> {
    count(db, EVENT_BURY, &[&ids, &token, &errors, &attempts], "moving events to the dead letters").await
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
