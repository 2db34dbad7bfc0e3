//! What became of claimed events: copied into a destination's parked events or dead letters,
//! parked events completed, rescheduled, leased or buried.

use std::time::Duration;

use super::{Db, Replanned, count, micros, one};
use crate::error::Result;

// Every delay and lease below is counted from the statement's clock (`clock_timestamp()`), not
// from its transaction's start (`now()`): a held claim's transaction began when the claim did,
// and a lease written when its delivery outlives the hold must last its whole length from then.
// Each statement that writes due times reads the clock once (`(select clock_timestamp())`), not
// once a row: what it writes with one delay comes due together.

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

/// Copies new events into the destination's parked events. A parked event with the same id
/// and another uuid is another event (the outbox's ids were reused: a truncate, a sequence set
/// back, an id written by hand): nothing is merged, and the statement fails, naming them
/// (`outbox_relay.refuse_reused_ids`, migration 0014), so that the new event stays in the outbox.
/// The clock is read once for the statement (`(select clock_timestamp())`, not for each row): the
/// events of a batch that fail with one delay come due together, and one claim takes them, not
/// one claim each for rows written a moment apart by a server that stalled while it wrote them.
const PARKED_COPY: &str = "\
with f as (
    select * from unnest($2::int8[], $3::int8[], $4::text[], $5::int4[]) with ordinality as f(id, delay_us, error, attempts, n)
),
copied as (
    insert into outbox_relay.parked (destination, id, uuid, topic, key, payload, headers, created_at, available_at, attempts,
                                     last_error, lease_token)
    select $1, o.id, o.uuid, o.topic, o.key, o.payload, o.headers, o.created_at,
           greatest(o.available_at, (select clock_timestamp()) + f.delay_us * interval '1 microsecond'), f.attempts, f.error, $6
      from f join outbox_relay.outbox o on o.id = f.id
     order by f.n
    on conflict (destination, id) do nothing
    returning 1
)
select (select count(*) from copied) as copied, outbox_relay.refuse_reused_ids($1, 'the parked events', array(
           select o.id || ' (uuid ' || o.uuid || ', the parked one ' || p.uuid || ')'
             from f join outbox_relay.outbox o on o.id = f.id
             join outbox_relay.parked p on p.destination = $1 and p.id = o.id and p.uuid <> o.uuid
            order by o.id)) as checked";

/// Copies new events into the destination's parked events (under the lease `token`, if any).
/// Fails, changing nothing, when an older event parked for the destination has the id of one.
pub(crate) async fn park_new_events(db: &impl Db, destination: &str, c: &Copies, token: Option<i64>) -> Result<u64> {
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 6] =
        [&destination, &c.ids, &c.delays, &c.errors, &c.attempts, &token];
    let row = one(&Replanned(db), PARKED_COPY, &params, "parking events for a destination").await?;
    Ok(row.get::<_, i64>("copied").max(0) as u64)
}

/// Copies new events into the dead letters of the destination; a dead letter of the same
/// event (its uuid) is updated; one of another event with the same id fails the statement.
const DEAD_LETTER_NEW: &str = "\
with f as (
    select * from unnest($2::int8[], $3::text[], $4::int4[]) as f(id, error, attempts)
),
buried as (
    insert into outbox_relay.dead_letters (destination, id, uuid, topic, key, payload, headers, created_at, attempts, last_error)
    select $1, o.id, o.uuid, o.topic, o.key, o.payload, o.headers, o.created_at, f.attempts, f.error
      from f join outbox_relay.outbox o on o.id = f.id
    on conflict (destination, id) do update
       set attempts = excluded.attempts, last_error = excluded.last_error, failed_at = now()
     where dead_letters.uuid = excluded.uuid
    returning 1
)
select (select count(*) from buried) as buried, outbox_relay.refuse_reused_ids($1, 'the dead letters', array(
           select o.id || ' (uuid ' || o.uuid || ', the dead letter ' || d.uuid || ')'
             from f join outbox_relay.outbox o on o.id = f.id
             join outbox_relay.dead_letters d on d.destination = $1 and d.id = o.id and d.uuid <> o.uuid
            order by o.id)) as checked";

/// Copies new events into the dead letters of the destination, with their errors and attempts.
/// Fails, changing nothing, when another event's dead letter has the id of one.
pub(crate) async fn bury_new_events(
    db: &impl Db,
    destination: &str,
    ids: &[i64],
    errors: &[String],
    attempts: &[i32],
) -> Result<u64> {
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] = [&destination, &ids, &errors, &attempts];
    let row = one(&Replanned(db), DEAD_LETTER_NEW, &params, "moving events to the dead letters").await?;
    Ok(row.get::<_, i64>("buried").max(0) as u64)
}

/// Turns held parked events into leased ones, counting the attempt, so that the transaction can
/// commit while their delivery goes on (held new events are copied with `park_new_events`).
const PARKED_LEASE_HELD: &str = "\
update outbox_relay.parked
   set available_at = (select clock_timestamp()) + $3::int8 * interval '1 microsecond',
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
    count(&Replanned(db), PARKED_LEASE_HELD, &params, "turning a held claim into a lease").await
}

const PARKED_RENEW_LEASE: &str = "\
update outbox_relay.parked set available_at = (select clock_timestamp()) + $4::int8 * interval '1 microsecond'
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
    count(&Replanned(db), PARKED_RENEW_LEASE, &params, "renewing a lease").await
}

/// A delivered parked event's row goes; its attempts and the moment stay in `parked_deliveries`
/// for the retention (`outbox_relay.event_state` reads them). A held claim's row counts the
/// attempts before this one; a lease counted this one when it was written.
const PARKED_DELIVERED: &str = "\
with done as (
    delete from outbox_relay.parked where destination = $1 and id = any($2) and ($3::int8 is null or lease_token = $3)
    returning destination, id, uuid, attempts
),
kept as (
    insert into outbox_relay.parked_deliveries (destination, id, uuid, attempts)
    select destination, id, uuid,
           case when $3::int8 is null then least(attempts, 2147483646) + 1 else greatest(attempts, 1) end from done
    on conflict (destination, id) do update
       set uuid = excluded.uuid, attempts = excluded.attempts, delivered_at = excluded.delivered_at
)
select count(*) from done";

/// Records the deliveries of parked events `ids`.
pub(crate) async fn complete_parked(db: &impl Db, destination: &str, ids: &[i64], token: Option<i64>) -> Result<u64> {
    let delivered: i64 =
        one(&Replanned(db), PARKED_DELIVERED, &[&destination, &ids, &token], "recording deliveries").await?.get(0);
    Ok(delivered.max(0) as u64)
}

/// Records, from a connection of its own, events that a held claim has delivered while its
/// transaction is still open (migration 0017).
const EARLY_RECORD: &str = "insert into outbox_relay.early_deliveries (destination, token, ids) values ($1, $2, $3)";

/// Records `ids`, delivered to `destination` by the held claim `token` still in delivery, so
/// that a claim after a crash does not send them again.
pub(crate) async fn record_early_deliveries(db: &impl Db, destination: &str, token: i64, ids: &[i64]) -> Result<u64> {
    count(db, EARLY_RECORD, &[&destination, &token, &ids], "recording deliveries as they end").await
}

const EARLY_FORGET: &str = "delete from outbox_relay.early_deliveries where destination = $1 and token = $2";

/// Deletes the early records of the claim `token`, in the transaction that records its outcomes.
pub(crate) async fn forget_early_deliveries(db: &impl Db, destination: &str, token: i64) -> Result<u64> {
    count(db, EARLY_FORGET, &[&destination, &token], "recording deliveries").await
}

const EARLY_PASSED_GONE: &str =
    "delete from outbox_relay.early_deliveries where destination = $1 and ids <@ $2::int8[]";
const EARLY_PASSED_LEFT: &str = "\
update outbox_relay.early_deliveries set ids = array(select i from unnest(ids) i where i <> all($2::int8[]))
 where destination = $1 and ids && $2::int8[]";

/// Takes `ids`, recorded early by claims that never committed and now recorded as delivered by
/// this claim's transaction, out of their records (deleting those left empty).
pub(crate) async fn early_deliveries_passed(db: &impl Db, destination: &str, ids: &[i64]) -> Result<()> {
    count(db, EARLY_PASSED_GONE, &[&destination, &ids], "recording deliveries").await?;
    count(db, EARLY_PASSED_LEFT, &[&destination, &ids], "recording deliveries").await?;
    Ok(())
}

const PARKED_RESCHEDULE: &str = "\
update outbox_relay.parked o
   set available_at = (select clock_timestamp()) + f.delay_us * interval '1 microsecond', last_error = coalesce(f.error, o.last_error),
       lease_token = null, attempts = f.attempts
  from unnest($2::int8[], $4::int8[], $5::text[], $6::int4[]) as f(id, delay_us, error, attempts)
 where o.destination = $1 and o.id = f.id and ($3::int8 is null or o.lease_token = $3)";

/// Reschedules parked events: per event a delay, an error (none keeps the last) and its
/// attempts. Failed deliveries and events given back alike.
pub(crate) async fn reschedule_parked(db: &impl Db, destination: &str, c: &Copies, token: Option<i64>) -> Result<u64> {
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 6] =
        [&destination, &c.ids, &token, &c.delays, &c.errors, &c.attempts];
    count(&Replanned(db), PARKED_RESCHEDULE, &params, "rescheduling parked events").await
}

/// Moves parked events to the destination's dead letters; one whose id another event's dead
/// letter carries fails the statement (and stays parked).
const DEAD_LETTER_PARKED: &str = "\
with f as (
    select * from unnest($2::int8[], $4::text[], $5::int4[]) as f(id, error, attempts)
),
failed as (
    delete from outbox_relay.parked o
     using f
     where o.destination = $1 and o.id = f.id and ($3::int8 is null or o.lease_token = $3)
       and not exists (select 1 from outbox_relay.dead_letters d where d.destination = $1 and d.id = o.id and d.uuid <> o.uuid)
    returning o.id, o.uuid, o.topic, o.key, o.payload, o.headers, o.created_at, f.attempts, f.error
),
buried as (
    insert into outbox_relay.dead_letters (destination, id, uuid, topic, key, payload, headers, created_at, attempts, last_error)
    select $1, id, uuid, topic, key, payload, headers, created_at, attempts, error from failed
    on conflict (destination, id) do update
       set attempts = excluded.attempts, last_error = excluded.last_error, failed_at = now()
    returning 1
)
select (select count(*) from buried) as buried, outbox_relay.refuse_reused_ids($1, 'the dead letters', array(
           select o.id || ' (uuid ' || o.uuid || ', the dead letter ' || d.uuid || ')'
             from f join outbox_relay.parked o on o.destination = $1 and o.id = f.id
             join outbox_relay.dead_letters d on d.destination = $1 and d.id = o.id and d.uuid <> o.uuid
            order by o.id)) as checked";

/// Moves parked events to the destination's dead letters with their errors and attempts.
/// Fails, changing nothing, when another event's dead letter has the id of one.
pub(crate) async fn bury_parked(
    db: &impl Db,
    destination: &str,
    ids: &[i64],
    errors: &[String],
    attempts: &[i32],
    token: Option<i64>,
) -> Result<u64> {
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 5] = [&destination, &ids, &token, &errors, &attempts];
    let row = one(&Replanned(db), DEAD_LETTER_PARKED, &params, "moving events to the dead letters").await?;
    Ok(row.get::<_, i64>("buried").max(0) as u64)
}

/// Prepares every statement that records outcomes or leases a held claim, so that they can be
/// pipelined before a COMMIT.
pub(crate) async fn prepare_outcomes(db: &impl Db) -> Result<()> {
    for sql in [
        PARKED_COPY,
        DEAD_LETTER_NEW,
        PARKED_LEASE_HELD,
        PARKED_DELIVERED,
        PARKED_RESCHEDULE,
        DEAD_LETTER_PARKED,
        EARLY_FORGET,
    ] {
        db.prepare(sql).await.map_err(|e| crate::error::Error::database("preparing the outcome statements", e))?;
    }
    Ok(())
}
