//! Destinations: registering them, finishing what every destination has passed, and dropping one
//! (migration 0012).

use super::{Db, all, count, one};
use crate::error::Result;
use crate::sql::Destination;

/// Registrations take turns (a registration and the claims it waits for are all there is to it:
/// readers and claims are not held up).
const DESTINATIONS_LOCK: &str = "lock table outbox_relay.destinations in share row exclusive mode";

const DESTINATION_GET: &str =
    "select name, pattern, topic_regex, lock_id from outbox_relay.destinations where name = $1";

const DESTINATION_SET_PATTERN: &str =
    "update outbox_relay.destinations set pattern = $2, topic_regex = $3 where name = $1";

/// Waits for every registered destination's new events' lock: a claim in progress may delete
/// events it passed that the new destination, starting from its position, would not see.
const DESTINATIONS_WAIT_FOR_CLAIMS: &str = "\
select count(pg_advisory_xact_lock(1869901932, lock_id)::text) from (
    select lock_id from outbox_relay.destinations order by lock_id
) d";

/// A new destination starts at the newest position of the registered destination that is
/// furthest behind (no event it has not passed was finished), or at the origin's when none is
/// registered: the events it has not passed are still in the outbox.
const DESTINATION_INSERT: &str = "\
with start as (
    select p.since, p.snapshot, p.after_id
      from outbox_relay.destinations d cross join lateral (
        select q.since, q.snapshot, q.after_id from outbox_relay.positions q
         where q.destination = d.name order by q.n desc limit 1) p
    union all
    select * from (
        select q.since, q.snapshot, q.after_id from outbox_relay.positions q
         where q.destination = '' and not exists (select 1 from outbox_relay.destinations)
         order by q.n desc limit 1) o
    union all
    select pg_current_snapshot(), pg_current_snapshot(), null::int8
     where not exists (select 1 from outbox_relay.positions)
),
furthest_behind as (
    select * from start
     order by pg_snapshot_xmin(case when after_id is null then snapshot else since end), after_id nulls first
     limit 1
),
registered as (
    insert into outbox_relay.destinations (name, pattern, topic_regex) values ($1, $2, $3)
    returning name, lock_id
),
positioned as (
    insert into outbox_relay.positions (destination, n, since, snapshot, after_id)
    select r.name, 0, f.since, f.snapshot, f.after_id from registered r, furthest_behind f
)
select lock_id from registered";

/// What registering found.
pub(crate) struct Registered {
    pub(crate) destination: Destination,
    /// The destination was registered before with this other pattern.
    pub(crate) pattern_was: Option<String>,
    /// It is new.
    pub(crate) new: bool,
}

/// Registers the destination `name` with `pattern` (as a regular expression over the topic:
/// `topic_regex`, `None` for every topic), or finds it and sets its pattern; in its own
/// transaction.
pub(crate) async fn register_destination(
    client: &mut deadpool_postgres::Object,
    name: &str,
    pattern: &str,
    topic_regex: Option<&str>,
) -> Result<Registered> {
    let tx = client.transaction().await.map_err(|e| crate::error::Error::database("registering a destination", e))?;
    count(&tx, DESTINATIONS_LOCK, &[], "registering a destination").await?;
    let found = all(&tx, DESTINATION_GET, &[&name], "registering a destination").await?;
    let registered = match found.first() {
        Some(row) => {
            let was: String = row.get(1);
            let changed = was != pattern;
            if changed {
                count(&tx, DESTINATION_SET_PATTERN, &[&name, &pattern, &topic_regex], "registering a destination")
                    .await?;
            }
            Registered {
                destination: Destination {
                    name: name.to_string(),
                    lock_id: row.get(3),
                    topic_regex: topic_regex.map(str::to_string),
                },
                pattern_was: changed.then_some(was),
                new: false,
            }
        }
        None => {
            one(&tx, DESTINATIONS_WAIT_FOR_CLAIMS, &[], "registering a destination").await?;
            let row =
                one(&tx, DESTINATION_INSERT, &[&name, &pattern, &topic_regex], "registering a destination").await?;
            Registered {
                destination: Destination {
                    name: name.to_string(),
                    lock_id: row.get(0),
                    topic_regex: topic_regex.map(str::to_string),
                },
                pattern_was: None,
                new: true,
            }
        }
    };
    tx.commit().await.map_err(|e| crate::error::Error::database("registering a destination", e))?;
    Ok(registered)
}

/// Finishes the outbox rows below the horizon, the oldest transaction that some destination's
/// position has not passed: deletes them (`$3`) or marks them processed, from the transaction
/// `$1` on (where the last sweep ended), at most `$2`. A row that no destination's pattern matches
/// goes to the dead letters of the destination '' instead, saying so. Returns how many rows it
/// finished, how many of those went to the dead letters, and where the next sweep starts.
const OUTBOX_SWEEP: &str = "\
with horizon as materialized (
    select min(pg_snapshot_xmin(case when p.after_id is null then p.snapshot else p.since end)) as h
      from outbox_relay.destinations d cross join lateral (
        select q.since, q.snapshot, q.after_id from outbox_relay.positions q
         where q.destination = d.name order by q.n desc limit 1) p
),
gone as materialized (
    select e.id, e.xid, e.uuid, e.topic, e.key, e.payload, e.created_at, e.attempts
      from outbox_relay.outbox e, horizon h
     where e.xid >= $1::text::xid8 and e.xid < h.h and e.processed_at is null
     order by e.xid limit $2
       for update of e skip locked
),
unrouted as materialized (
    insert into outbox_relay.dead_letters (destination, id, uuid, topic, key, payload, created_at, attempts, last_error)
    select '', g.id, g.uuid, g.topic, g.key, g.payload, g.created_at, g.attempts,
           'no destination''s pattern matches its topic (the destinations: '
           || (select string_agg(d.name || ' ' || d.pattern, ', ' order by d.name) from outbox_relay.destinations d)
           || ')'
      from gone g
     where not exists (select 1 from outbox_relay.destinations d where d.topic_regex is null or ('.' || g.topic) ~ d.topic_regex)
    on conflict (destination, id) do update set failed_at = now(), last_error = excluded.last_error
    returning id
),
deleted as (
    delete from outbox_relay.outbox
     where id in (select id from gone) and ($3 or id in (select id from unrouted))
    returning 1
),
marked as (
    update outbox_relay.outbox set processed_at = now()
     where not $3 and id in (select id from gone) and id not in (select id from unrouted)
    returning 1
)
select (select count(*) from gone), (select count(*) from unrouted),
       case when (select count(*) from gone) >= $2 then (select max(xid) from gone)
            else (select h from horizon) end::text";

/// What one sweep did.
pub(crate) struct Swept {
    pub(crate) finished: i64,
    pub(crate) unrouted: i64,
    /// Where the next sweep starts (a transaction id), when there is a horizon.
    pub(crate) next: Option<String>,
}

/// Finishes up to `batch` outbox rows that every destination has passed, from the transaction
/// `from` on ("0" at the start).
pub(crate) async fn sweep_outbox(db: &impl Db, from: &str, batch: i64, delete: bool) -> Result<Swept> {
    let row = one(db, OUTBOX_SWEEP, &[&from, &batch, &delete], "finishing events every destination passed").await?;
    Ok(Swept { finished: row.get(0), unrouted: row.get(1), next: row.get(2) })
}

/// The dead letters of a destination that is dropped: what waited for it is kept, saying why.
const DESTINATION_DROP_PARKED: &str = "\
with moved as (
    delete from outbox_relay.parked where destination = $1
    returning id, uuid, topic, key, payload, created_at, attempts, last_error
)
insert into outbox_relay.dead_letters (destination, id, uuid, topic, key, payload, created_at, attempts, last_error)
select $1, id, uuid, topic, key, payload, created_at, attempts,
       'the destination was dropped while the event waited for it' || coalesce(' (last error: ' || last_error || ')', '')
  from moved
on conflict (destination, id) do nothing";

const DESTINATION_DROP_POSITIONS: &str = "delete from outbox_relay.positions where destination = $1";

const DESTINATION_DROP_PAUSES: &str = "delete from outbox_relay.pauses where destination = $1";

const DESTINATION_DELETE: &str = "delete from outbox_relay.destinations where name = $1";

/// Drops the destination `name`: events no longer wait for it (what was parked for it goes to
/// its dead letters), and its position no longer holds the outbox's rows back. Returns whether
/// it was registered, and how many parked events went to the dead letters.
pub(crate) async fn drop_destination(client: &mut deadpool_postgres::Object, name: &str) -> Result<Option<u64>> {
    let tx = client.transaction().await.map_err(|e| crate::error::Error::database("dropping a destination", e))?;
    count(&tx, DESTINATIONS_LOCK, &[], "dropping a destination").await?;
    if count(&tx, DESTINATION_DELETE, &[&name], "dropping a destination").await? == 0 {
        return Ok(None);
    }
    let buried = count(&tx, DESTINATION_DROP_PARKED, &[&name], "dropping a destination").await?;
    count(&tx, DESTINATION_DROP_POSITIONS, &[&name], "dropping a destination").await?;
    count(&tx, DESTINATION_DROP_PAUSES, &[&name], "dropping a destination").await?;
    tx.commit().await.map_err(|e| crate::error::Error::database("dropping a destination", e))?;
    Ok(Some(buried))
}
