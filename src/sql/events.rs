//! Events: adding them, claiming them, recording what became of them, cleaning them up.

use std::borrow::Cow;
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

// The claim. SKIP LOCKED lets many workers and processes claim side by side without waiting on
// each other: a row another claim holds (locked, or leased: its `available_at` moved past now)
// is passed over.
//
// Events without a key have no order: they are taken in (`available_at`, id) order from their
// own partial index, which holds nothing else.
//
// Events with a key are delivered one at a time per key, in id order: only a key's *head*, its
// pending event with the lowest id, may be claimed; the next becomes claimable once the head is
// done. Scanning pending rows for heads would pass over every event queued behind a head that
// is in flight or waiting for a retry, on every claim: with a backlog on few keys, nearly the
// whole table. So the claim *walks the keys* instead: from `$3` (where the relay's last walk
// ended), the next key of the pending-key index and its lowest pending id, one index probe per
// key, for up to `$4` keys. That costs the same whatever waits behind each head. A head is taken
// when it is due, not held by another claim and, with `$2` set, no earlier event of its key is in
// the dead letters. The walk's end comes back in one marker row (`walked_to`, `walked`), so that
// the next claim goes on from there and every key gets its turn.
//
// Events of the paused topics `$5` are not claimed; a key whose head is paused waits whole. The
// test is wrapped in coalesce() (topic is never null, so it means the same) because the relay's
// generic plans cannot see the array: `topic <> all($5)` bare is estimated to keep almost no
// row, and the planner then reads the whole table and sorts it instead of walking the index
// (measured: 50 ms per claim of 500 against 0.3 ms); a function's result is estimated to keep
// half, and the index scan stays.
//
// A batch of `$1`: the keyed heads and the unkeyed events share it, whichever comes first taking
// up to all of it (the relay alternates, so that neither kind starves the other).

/// The walk over the keys, and the claimable heads it found (locked), as CTEs.
macro_rules! keyed_heads {
    ($columns:expr, $limit:literal) => {
        concat!(
            "walk(key, id, n) as (
    (select e.key, e.id, 1 from outbox_relay.outbox e
      where e.processed_at is null and e.key is not null and e.key > $3
      order by e.key, e.id limit 1)
  union all
    (select next.key, next.id, w.n + 1 from walk w, lateral (
        select e.key, e.id from outbox_relay.outbox e
         where e.processed_at is null and e.key is not null and e.key > w.key
         order by e.key, e.id limit 1) next
      where w.n < $4)
),
keyed as (
    select ",
            $columns,
            " from outbox_relay.outbox o join walk w on o.id = w.id
     where o.processed_at is null and o.available_at <= now() and coalesce(o.topic <> all($5::text[]), true)
       and not ($2 and exists (select 1 from outbox_relay.dead_letters d where d.key = o.key and d.id < o.id))
     order by o.available_at, o.id
     limit ",
            $limit,
            "
       for update of o skip locked
)"
        )
    };
}

/// The due events without a key (locked), as a CTE.
macro_rules! unkeyed_events {
    ($columns:expr, $limit:literal) => {
        concat!(
            "unkeyed as (
    select ",
            $columns,
            " from outbox_relay.outbox o
     where o.processed_at is null and o.key is null and o.available_at <= now() and coalesce(o.topic <> all($5::text[]), true)
     order by o.available_at, o.id
     limit ",
            $limit,
            "
       for update of o skip locked
)"
        )
    };
}

/// Both CTEs, the keyed heads first (`true`) or the unkeyed events first.
macro_rules! claimable {
    ($columns:expr, true) => {
        concat!(
            "with recursive ",
            keyed_heads!($columns, "$1"),
            ",\n",
            unkeyed_events!($columns, "$1 - (select count(*) from keyed)")
        )
    };
    ($columns:expr, false) => {
        concat!(
            "with recursive ",
            unkeyed_events!($columns, "$1"),
            ",\n",
            keyed_heads!($columns, "$1 - (select count(*) from unkeyed)")
        )
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

/// The marker row that ends every claim's result (its id is null): where the walk over the keys
/// ended, and how long until the next pending event is due, when one is due later (a retry, a
/// delayed event, a lease that ends), for the relay's timer. (An infinite `available_at`,
/// possible in rows older than migration 0003, is no moment to wake at.)
macro_rules! walk_and_next_due {
    () => {
        "
union all
select null, null, null, null, null, null, null,
       (select key from walk order by n desc limit 1), (select count(*) from walk)::int4,
       (select (extract(epoch from min(available_at) - now()) * 1000000)::int8 from outbox_relay.outbox
         where processed_at is null and available_at > now() and isfinite(available_at))"
    };
}

/// The leased claim, a transaction of its own, under lease `$6` (microseconds) and token `$7`.
/// The lease moves `available_at` forward, so an event whose worker died comes back when it
/// ends; `attempts` counts claims, so an event that crashes its worker still runs out of
/// attempts.
macro_rules! leased_claim {
    ($keyed_first:tt) => {
        concat!(
            claimable!("o.id", $keyed_first),
            ",
leased as (
    update outbox_relay.outbox o
       set available_at = now() + $6::int8 * interval '1 microsecond',
           attempts = least(o.attempts, 2147483646) + 1,
           lease_token = $7
      from (select id from keyed union all select id from unkeyed) c
     where o.id = c.id
    returning ",
            claimed_columns!("o.attempts"),
            "
)
select *, null::text as walked_to, null::int4 as walked, null::int8 as next_due_us from leased",
            walk_and_next_due!()
        )
    };
}

/// The held claim, inside a transaction that stays open while the batch is delivered: its row
/// locks are the lease, so the claim writes nothing, and the outcomes are written in the same
/// transaction (the rows' one change is the completion). A worker that dies ends its session,
/// and its events are claimable at once.
macro_rules! held_claim {
    ($keyed_first:tt) => {
        concat!(
            claimable!(claimed_columns!("least(o.attempts, 2147483646) + 1"), $keyed_first),
            "
select *, null::text as walked_to, null::int4 as walked, null::int8 as next_due_us from keyed
union all
select *, null, null, null from unkeyed",
            walk_and_next_due!()
        )
    };
}

const EVENT_CLAIM_LEASED: [&str; 2] = [leased_claim!(false), leased_claim!(true)];
const EVENT_CLAIM_HELD: [&str; 2] = [held_claim!(false), held_claim!(true)];

/// A claimed event as the claim returns it.
pub(crate) struct ClaimedRow {
    pub(crate) id: i64,
    pub(crate) topic: String,
    pub(crate) key: Option<String>,
    /// The payload's text, or why it cannot be read (text that is not UTF-8 or not JSON: jsonb
    /// never gives such, but no row is trusted to stop a claim).
    pub(crate) payload: std::result::Result<Payload, String>,
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

/// Where a claim's walk over the keys starts and how far it goes.
#[derive(Debug, Clone)]
pub(crate) struct Walk {
    /// Keys after this one are walked ('' for the first key).
    pub(crate) after: String,
    /// At most this many keys.
    pub(crate) keys: i32,
    /// The keyed heads take the batch first, or the unkeyed events do.
    pub(crate) keyed_first: bool,
    /// Topics not to claim (paused). A paused head holds its key's later events back.
    pub(crate) paused: std::sync::Arc<[String]>,
}

/// What a claim found.
pub(crate) struct Claimed {
    pub(crate) rows: Vec<ClaimedRow>,
    /// Where the walk over the keys ended: the key to go on after, or `None` when it reached
    /// the last key (the next walk starts from the first).
    pub(crate) walked_to: Option<String>,
    /// How long until the next pending event is due, when one is due later.
    pub(crate) next_due: Option<Duration>,
}

/// Claims up to `batch` deliverable events, walking the keys as `walk` says; with
/// `dead_letters_hold`, a key with an earlier event in the dead letters is held.
pub(crate) async fn claim_events(
    db: &impl Db,
    batch: i64,
    dead_letters_hold: bool,
    walk: &Walk,
    hold: Hold,
) -> Result<Claimed> {
    let order = usize::from(walk.keyed_first);
    let rows = match hold {
        Hold::Lease(lease, token) => {
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 7] =
                [&batch, &dead_letters_hold, &walk.after, &walk.keys, &&*walk.paused, &micros(lease), &token];
            all(db, EVENT_CLAIM_LEASED[order], &params, "claiming events").await?
        }
        Hold::Locks => {
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 5] =
                [&batch, &dead_letters_hold, &walk.after, &walk.keys, &&*walk.paused];
            all(db, EVENT_CLAIM_HELD[order], &params, "claiming events").await?
        }
    };
    let mut claimed = Claimed { rows: Vec::with_capacity(rows.len()), walked_to: None, next_due: None };
    for row in &rows {
        if let Some(walked) = row.get::<_, Option<i32>>(8) {
            claimed.walked_to = if walked < walk.keys { None } else { row.get::<_, Option<String>>(7) };
            claimed.next_due =
                row.get::<_, Option<i64>>(9).filter(|us| *us > 0).map(|us| Duration::from_micros(us as u64));
            continue;
        }
        claimed.rows.push(ClaimedRow {
            id: row.get(0),
            topic: row.get(1),
            key: row.get(2),
            payload: row.try_get::<_, Payload>(3).map_err(|e| crate::error::chain(&e)),
            created_at: row.get(4),
            attempts: row.get(5),
            age: row.get::<_, Option<i64>>(6).map(|us| Duration::from_micros(us.max(0) as u64)),
        });
    }
    Ok(claimed)
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    /// Every `Seq Scan` of the outbox that filters pending rows (a claim's search) in an
    /// EXPLAIN (FORMAT JSON) plan. (The leased claim's UPDATE may hash-join its few ids against
    /// a small table read whole; that scan has no filter and is left to the planner.)
    fn outbox_seq_scans(plan: &Value, found: &mut Vec<String>) {
        match plan {
            Value::Object(node) => {
                if node.get("Node Type") == Some(&Value::from("Seq Scan"))
                    && node.get("Relation Name") == Some(&Value::from("outbox"))
                    && node.get("Filter").and_then(Value::as_str).is_some_and(|f| f.contains("processed_at"))
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
    /// with a backlog, every variant, with no topic paused and with one, must walk the pending
    /// indexes, never read the whole outbox (a bare `topic <> all($5)` once made the planner do
    /// just that, a hundred times slower).
    #[tokio::test]
    async fn every_claim_walks_the_indexes_with_generic_plans() {
        let db = outbox_relay_testkit::harness::TestDb::new().await;
        let client = db.client().await;
        client
            .batch_execute(
                "insert into outbox_relay.outbox (topic, payload) select 'bench', '{}' from generate_series(1, 200000);
                 insert into outbox_relay.outbox (topic, key, payload) select 'bench', 'k' || (g % 100), '{}' from generate_series(1, 20000) g;
                 analyze outbox_relay.outbox;
                 set plan_cache_mode = force_generic_plan",
            )
            .await
            .unwrap();
        let variants =
            EVENT_CLAIM_HELD.iter().map(|sql| (sql, false)).chain(EVENT_CLAIM_LEASED.iter().map(|sql| (sql, true)));
        for (n, (sql, leased)) in variants.enumerate() {
            client.batch_execute(&format!("prepare claim_{n} as {sql}")).await.unwrap();
            for paused in ["{}", "{mail.send}"] {
                let args = if leased {
                    format!("500, false, '', 1000, '{paused}', 30000000, 7")
                } else {
                    format!("500, false, '', 1000, '{paused}'")
                };
                let row =
                    client.query_one(&format!("explain (format json) execute claim_{n}({args})"), &[]).await.unwrap();
                let plan: Value = row.get(0);
                let mut scans = Vec::new();
                outbox_seq_scans(&plan, &mut scans);
                assert!(
                    scans.is_empty(),
                    "claim {n} (leased: {leased}, paused {paused}) reads the whole outbox: {plan}"
                );
            }
        }
    }
}
