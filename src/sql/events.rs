//! Events: adding them (and their audit rows), and cleaning up the finished ones.

use std::time::Duration;

use super::{Db, all, count, micros, one};
use crate::error::Result;
use crate::event::{AuditEntry, Checked, NewEvent};

/// The class of the advisory locks that serialize the writers of one key (`'outb'` in ASCII);
/// see migration 0004.
pub(crate) const KEY_LOCK_CLASS: i32 = 0x6f75_7462;

/// The payload `$3` comes as JSON text, which the server parses into `jsonb` (as it would the
/// binary form: jsonb's wire format is its text).
pub(crate) const EVENT_INSERT: &str = "\
insert into outbox_relay.outbox (topic, key, payload, available_at, headers)
values ($1, $2, $3::text::jsonb, now() + $4::int8 * interval '1 microsecond', $5::text::jsonb)
returning id";

/// A keyed event: the key's advisory lock is taken before the insert draws its id, so writers of
/// one key serialize and its events commit in id order (the lock's function scan runs first;
/// the id default is computed as each row is inserted).
pub(crate) const EVENT_INSERT_KEYED: &str = "\
insert into outbox_relay.outbox (topic, key, payload, available_at, headers)
select $1, $2, $3::text::jsonb, now() + $4::int8 * interval '1 microsecond', $5::text::jsonb
  from pg_advisory_xact_lock($6, hashtext($2))
returning id";

/// Adds one event (taking its key's lock first) with the payload and headers its validation
/// gave; returns its id.
pub(crate) async fn insert_event(db: &impl Db, event: &NewEvent, checked: &Checked<'_>) -> Result<i64> {
    let payload = checked.payload.get();
    let delay = micros(event.delay);
    let row = match &event.key {
        None => {
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 5] =
                [&event.topic, &event.key, &payload, &delay, &checked.headers];
            one(db, EVENT_INSERT, &params, "adding an event").await?
        }
        Some(_) => {
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 6] =
                [&event.topic, &event.key, &payload, &delay, &checked.headers, &KEY_LOCK_CLASS];
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
insert into outbox_relay.outbox (topic, key, payload, available_at, headers)
select topic, key, payload::jsonb, now() + delay * interval '1 microsecond', headers::jsonb
  from unnest($1::text[], $2::text[], $3::text[], $4::int8[], $5::text[])
       with ordinality as e(topic, key, payload, delay, headers, n)
 order by n
returning id";

/// The parameters of [`EVENT_INSERT_MANY`], one array per column (`$1` to `$5`), and the keys
/// [`KEYS_LOCK`] takes first: what tokio-postgres and sqlx both bind.
pub(crate) struct EventColumns<'a> {
    pub(crate) topics: Vec<&'a str>,
    pub(crate) keys: Vec<Option<&'a str>>,
    pub(crate) payloads: Vec<&'a str>,
    pub(crate) delays: Vec<i64>,
    pub(crate) headers: Vec<Option<&'a str>>,
    /// The keys of the keyed events, to lock before the insert.
    pub(crate) keyed: Vec<&'a str>,
}

impl<'a> EventColumns<'a> {
    /// The columns of `events`, with the payloads and headers their validation gave.
    pub(crate) fn new(events: &'a [NewEvent], checked: &'a [Checked<'_>]) -> Self {
        let keys: Vec<Option<&str>> = events.iter().map(|e| e.key.as_deref()).collect();
        EventColumns {
            topics: events.iter().map(|e| e.topic.as_str()).collect(),
            keyed: keys.iter().flatten().copied().collect(),
            keys,
            payloads: checked.iter().map(|c| c.payload.get()).collect(),
            delays: events.iter().map(|e| micros(e.delay)).collect(),
            headers: checked.iter().map(|c| c.headers.as_deref()).collect(),
        }
    }
}

/// Adds many events in one statement, with the payloads and headers their validation gave;
/// returns their ids in input order.
pub(crate) async fn insert_events(db: &impl Db, events: &[NewEvent], checked: &[Checked<'_>]) -> Result<Vec<i64>> {
    if events.is_empty() {
        return Ok(Vec::new());
    }
    let c = EventColumns::new(events, checked);
    if !c.keyed.is_empty() {
        all(db, KEYS_LOCK, &[&KEY_LOCK_CLASS, &c.keyed], "locking the events' keys").await?;
    }
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 5] =
        [&c.topics, &c.keys, &c.payloads, &c.delays, &c.headers];
    let rows = all(db, EVENT_INSERT_MANY, &params, "adding events").await?;
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

/// Claim positions no longer needed. Each destination's newest is the one that counts (a claim
/// reads it from the end of the index, so the dead rows this leaves are never on its path); the
/// others say when events were passed (`outbox_relay.event_state`), and are kept for the
/// retention (`$1` microseconds): all of them for ten minutes, then the first of each destination's
/// ten seconds (a delivery time read from them is exact for ten minutes, and at most ten seconds
/// late after). The sweeper reads the newest position older than the retention (src/sql/sweep.sql):
/// the first of its ten seconds stands for it.
///
/// Nothing younger than ten minutes goes: a claim detects that another overtook its read of the
/// position by the next row's key, so that row must outlive any claim statement in flight.
const POSITIONS_PRUNE: &str = "\
delete from outbox_relay.positions p
 where p.at < now() - interval '10 minutes'
   and p.n < (select max(q.n) from outbox_relay.positions q where q.destination = p.destination)
   and (p.at < now() - $1::int8 * interval '1 microsecond' - interval '10 minutes'
        or floor(extract(epoch from p.at) / 10) = floor(extract(epoch from (
               select q.at from outbox_relay.positions q
                where q.destination = p.destination and q.n < p.n order by q.destination, q.n desc limit 1)) / 10))";

/// Deletes the positions no longer needed with events kept for `retention`; returns how many.
pub(crate) async fn prune_positions(db: &impl Db, retention: Duration) -> Result<u64> {
    count(db, POSITIONS_PRUNE, &[&super::micros(retention)], "deleting old claim positions").await
}

/// Records of deliveries of parked events older than the retention (`$1` microseconds), at most
/// `$2` of them, oldest first.
const PARKED_DELIVERIES_EXPIRED: &str = "\
delete from outbox_relay.parked_deliveries where (destination, id) in (
    select destination, id from outbox_relay.parked_deliveries
     where delivered_at < now() - $1::int8 * interval '1 microsecond'
     order by delivered_at limit $2
       for update skip locked)";

/// Deletes up to `batch` records of parked deliveries older than `retention`; returns how many.
pub(crate) async fn delete_expired_parked_deliveries(db: &impl Db, retention: Duration, batch: i64) -> Result<u64> {
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&super::micros(retention), &batch];
    count(db, PARKED_DELIVERIES_EXPIRED, &params, "deleting old records of parked deliveries").await
}
