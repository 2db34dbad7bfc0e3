//! Destinations: registering them, finishing what every destination has passed, and dropping one
//! (migration 0012).

use super::{Db, all as all_rows, count, one};
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

/// One destination to register: its name, its pattern, and the pattern as a regular expression
/// over the topic (`None` for every topic).
pub(crate) struct ToRegister<'a> {
    pub(crate) name: &'a str,
    pub(crate) pattern: &'a str,
    pub(crate) topic_regex: Option<&'a str>,
}

/// Registers the destinations `all`, or finds them and sets their patterns, in one transaction:
/// the new ones start at one same position (so that none of a relay's destinations misses what
/// another of them claims first).
pub(crate) async fn register_destinations(
    client: &mut deadpool_postgres::Object,
    all: &[ToRegister<'_>],
) -> Result<Vec<Registered>> {
    let fail = |e| crate::error::Error::database("registering the destinations", e);
    let tx = client.transaction().await.map_err(fail)?;
    count(&tx, DESTINATIONS_LOCK, &[], "registering the destinations").await?;
    let mut registered = Vec::with_capacity(all.len());
    let mut waited = false;
    for to in all {
        let found = all_rows(&tx, DESTINATION_GET, &[&to.name], "registering a destination").await?;
        let (lock_id, pattern_was, new) = match found.first() {
            Some(row) => {
                let was: String = row.get(1);
                let changed = was != to.pattern;
                if changed {
                    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] =
                        [&to.name, &to.pattern, &to.topic_regex];
                    count(&tx, DESTINATION_SET_PATTERN, &params, "registering a destination").await?;
                }
                (row.get(3), changed.then_some(was), false)
            }
            None => {
                if !waited {
                    one(&tx, DESTINATIONS_WAIT_FOR_CLAIMS, &[], "registering a destination").await?;
                    waited = true;
                }
                let params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] = [&to.name, &to.pattern, &to.topic_regex];
                (one(&tx, DESTINATION_INSERT, &params, "registering a destination").await?.get(0), None, true)
            }
        };
        registered.push(Registered {
            destination: Destination {
                name: to.name.to_string(),
                lock_id,
                topic_regex: to.topic_regex.map(str::to_string),
            },
            pattern_was,
            new,
        });
    }
    tx.commit().await.map_err(fail)?;
    Ok(registered)
}

/// Finishes the outbox rows that every registered destination has passed: deletes them (`$3`)
/// or marks them processed, from the transaction `$1` on (where the last sweep ended), at most
/// `$2`. A destination has passed an event when its newest position's snapshot sees the event's
/// transaction, or the event is in the position's cut delta at or below `after_id` (as in
/// `OUTBOX_FINISH`). Below the horizon (the oldest transaction some position's snapshot does not
/// see as ended) every row is passed; from there to the lowest xmax, each row is tested. A row
/// that no destination's pattern matches goes to the dead letters of the destination '' instead,
/// saying so. Returns how many rows it finished, how many of those went to the dead letters, and
/// where the next sweep starts: the horizon, or, after a full batch, the last row it took if that
/// is lower (no row it left behind is skipped).
const OUTBOX_SWEEP: &str = "\
with newest as materialized (
    select p.since, p.snapshot, p.after_id
      from outbox_relay.destinations d cross join lateral (
        select q.since, q.snapshot, q.after_id from outbox_relay.positions q
         where q.destination = d.name order by q.n desc limit 1) p
),
horizon as materialized (
    select min(pg_snapshot_xmin(case when after_id is null then snapshot else since end)) as h,
           min(pg_snapshot_xmax(snapshot)) as top
      from newest
),
gone as materialized (
    select e.id, e.xid, e.uuid, e.topic, e.key, e.payload, e.created_at, e.attempts
      from outbox_relay.outbox e, horizon h
     where e.xid >= $1::text::xid8 and e.xid < h.top and e.processed_at is null
       and not exists (
        select 1 from newest p
         where not (pg_visible_in_snapshot(e.xid, case when p.after_id is null then p.snapshot else p.since end)
                    or (p.after_id is not null and e.id <= p.after_id and pg_visible_in_snapshot(e.xid, p.snapshot))))
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
       case when (select count(*) from gone) >= $2 then least((select max(xid) from gone), (select h from horizon))
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
