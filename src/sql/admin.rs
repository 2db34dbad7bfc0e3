//! What operators read and do: the queue at a glance, the errors events wait on, the relays,
//! and the dead letters.

use std::time::SystemTime;

use tokio_postgres::types::ToSql;

use super::{Db, all, count, micros, one};
use crate::dead_letters::DeadLetterFilter;
use crate::error::{Error, ErrorKind, Result};
use crate::queue::{ConnectedRelay, DeadLetter, ErrorCount, EventState, FoundEvent, Health, Pause, QueueStats};

/// The queue at a glance, over every destination. New events (in the outbox, not yet passed by
/// every destination: read through the `xid` index from the lowest xmin of the destinations'
/// positions, so the events kept for the retention below it are not read) count as ready, or
/// delayed; the rest of the outbox is *retained* (every destination has passed it: counted while
/// the table holds less than 100,000 rows, the planner's estimate of its rows beyond, so that a
/// status of an outbox retaining millions of events reads no more than its new ones); a destination's parked event is *ready* when it
/// is due and deliverable: without a key, or the head (lowest id) of its key there; a due event
/// behind its key's head (which is in flight, in a retry's backoff, or delayed) is *held by its
/// key*, not lag. One scan of the outbox and one of the parked events (`offset 0` keeps the
/// planner from copying the `ready` test, and the heads' aggregate with it, into every aggregate
/// that reads it).
const QUEUE_STATS: &str = "\
with heads as (
    select destination, min(id) as id from outbox_relay.parked where key is not null group by destination, key
),
low as (
    select coalesce(min(pg_snapshot_xmin(case when p.after_id is null then p.snapshot else p.since end)), '0'::xid8) as xid
      from (select name from outbox_relay.destinations
            union all select '' where not exists (select 1 from outbox_relay.destinations)) d cross join lateral (
        select q.since, q.snapshot, q.after_id from outbox_relay.positions q
         where q.destination = d.name order by q.n desc limit 1) p
),
n as (
    select count(*) filter (where available_at <= now()) as ready,
           count(*) filter (where available_at > now()) as delayed,
           greatest((select case when sum(greatest(c.reltuples, 0)) < 100000 then (select count(*) from outbox_relay.outbox)
                                 else sum(greatest(c.reltuples, 0))::int8 end
                       from pg_inherits i join pg_class c on c.oid = i.inhrelid
                      where i.inhparent = 'outbox_relay.outbox'::regclass) - count(*), 0) as processed,
           min(created_at) as oldest,
           min(available_at) filter (where available_at <= now()) as oldest_ready
      from outbox_relay.outbox e
     where e.xid >= (select l.xid from low l) and e.xid <> '0'::xid8 and not outbox_relay.passed_by_all(e.xid, e.id)
),
q as (
    select (select ready from n) + count(*) filter (where ready) as pending,
           count(*) filter (where due and not ready) as held_by_key,
           (select delayed from n) + count(*) filter (where available_at > now() and lease_token is null) as delayed,
           count(*) filter (where available_at > now() and lease_token is not null) as in_flight,
           (select processed from n) as processed,
           least((select oldest from n), min(created_at)) as oldest,
           least((select oldest_ready from n), min(available_at) filter (where ready)) as oldest_ready,
           coalesce(max(attempts), 0) as max_attempts
      from (select o.*, available_at <= now() as due,
                   available_at <= now() and (key is null or (destination, id) in (select destination, id from heads)) as ready
              from outbox_relay.parked o offset 0) o
)
select pending, held_by_key, delayed, in_flight, processed as retained,
       (select count(*) from outbox_relay.dead_letters) as dead_letters,
       (select count(*) from outbox_relay.dead_letters where destination = '') as unrouted,
       (case when oldest is not null then (least(greatest(extract(epoch from now()) - extract(epoch from oldest), -9e12), 9e12) * 1000)::int8 end) as oldest_pending_age_ms,
       (case when oldest_ready is not null then (least(greatest(extract(epoch from now()) - extract(epoch from oldest_ready), -9e12), 9e12) * 1000)::int8 end) as oldest_ready_age_ms,
       max_attempts,
       pg_notification_queue_usage() as notification_queue_usage
  from q";

/// Counts ready, held, delayed, in-flight, retained and dead events.
pub(crate) async fn queue_stats(db: &impl Db) -> Result<QueueStats> {
    let row = one(db, QUEUE_STATS, &[], "reading the queue's state").await?;
    Ok(QueueStats {
        pending: row.get("pending"),
        held_by_key: row.get("held_by_key"),
        delayed: row.get("delayed"),
        in_flight: row.get("in_flight"),
        retained: row.get("retained"),
        dead_letters: row.get("dead_letters"),
        unrouted: row.get("unrouted"),
        oldest_pending_age: crate::timestamp::millis(row.get("oldest_pending_age_ms")),
        oldest_ready_age: crate::timestamp::millis(row.get("oldest_ready_age_ms")),
        max_attempts: row.get("max_attempts"),
        notification_queue_usage: row.get("notification_queue_usage"),
    })
}

/// The most common errors of pending events, with how many events have each, for `status`.
const EVENT_ERRORS_TOP: &str = "\
select last_error as error, count(*) as events from outbox_relay.parked
 where last_error is not null
 group by last_error order by count(*) desc, last_error limit $1";

/// The `limit` most common errors of pending events.
pub(crate) async fn pending_errors(db: &impl Db, limit: i64) -> Result<Vec<ErrorCount>> {
    let rows = all(db, EVENT_ERRORS_TOP, &[&limit], "reading the errors of pending events").await?;
    Ok(rows.iter().map(|r| ErrorCount { error: r.get("error"), events: r.get("events") }).collect())
}

/// The relays connected to this database: their listener connections (`application_name`
/// `outbox-relay listener ID`, or without the id from a relay of before 0.1's connection names),
/// whether each is marked waiting for a notification, and how many connections its relay holds
/// (`outbox-relay ID` and `outbox-relay listener ID`).
const RELAYS_CONNECTED: &str = "\
with ours as (
    select pid, client_addr, backend_start,
           substring(application_name from '([0-9a-f]{8})$') as relay,
           application_name like 'outbox-relay listener%' as listener
      from pg_stat_activity
     where datname = current_database()
       and (application_name ~ '^outbox-relay (listener )?[0-9a-f]{8}$' or application_name = 'outbox-relay listener')
)
select a.pid as listener_pid, coalesce(host(a.client_addr), 'local') as client, a.backend_start as connected_at,
       coalesce(r.waiting, false) as waiting, coalesce(r.breaker, 'closed') = 'open' as breaker_open,
       r.breaker_since, r.delivery_limit, r.deliveries_in_flight, r.destination, a.relay,
       case when a.relay is not null then (select count(*) from ours o where o.relay = a.relay) end as relay_connections
  from ours a left join outbox_relay.relays r on r.listener_pid = a.pid
 where a.listener
 order by a.backend_start";

/// The relays connected to this database.
pub(crate) async fn connected_relays(db: &impl Db) -> Result<Vec<ConnectedRelay>> {
    let rows = all(db, RELAYS_CONNECTED, &[], "listing the connected relays").await?;
    Ok(rows
        .iter()
        .map(|r| ConnectedRelay {
            listener_pid: r.get("listener_pid"),
            client: r.get("client"),
            connected_at: r.get("connected_at"),
            waiting: r.get("waiting"),
            breaker_open: r.get("breaker_open"),
            breaker_since: r.get("breaker_since"),
            delivery_limit: r.get("delivery_limit"),
            deliveries_in_flight: r.get("deliveries_in_flight"),
            destination: r.get("destination"),
            relay: r.get("relay"),
            relay_connections: r.get("relay_connections"),
        })
        .collect())
}

/// The condition of a [`DeadLetterFilter`](crate::DeadLetterFilter) on the dead letters `d`:
/// `$1` the destination, `$2` a topic pattern's dotted regex, `$3` and `$4` failed from and
/// before, `$5` a substring of the last error (in any case), `$6` failed longer ago than so many
/// microseconds; a null one holds for every dead letter.
macro_rules! dead_letters_matching {
    () => {
        "($1::text is null or d.destination = $1)
   and ($2::text is null or ('.' || d.topic) ~ $2)
   and ($3::timestamptz is null or d.failed_at >= $3)
   and ($4::timestamptz is null or d.failed_at < $4)
   and ($5::text is null or strpos(lower(d.last_error), lower($5)) > 0)
   and ($6::int8 is null or d.failed_at < now() - $6 * interval '1 microsecond')"
    };
}

/// The dead letters of the first `$8` events past the id `$7` that the filter takes (every
/// destination's of each), oldest id first.
const DEAD_LETTER_LIST: &str = concat!(
    "select id, topic, key, payload, created_at, attempts, last_error, failed_at, destination
  from outbox_relay.dead_letters d
 where ",
    dead_letters_matching!(),
    "
   and d.id in (select distinct d.id from outbox_relay.dead_letters d
                 where ",
    dead_letters_matching!(),
    " and ($7::int8 is null or d.id > $7)
                 order by d.id limit $8)
 order by id, destination"
);

const DEAD_LETTER_COUNT: &str =
    concat!("select count(*) from outbox_relay.dead_letters d where ", dead_letters_matching!());

/// A filter's parameters, `$1` to `$6` of [`dead_letters_matching`].
struct Matching {
    destination: Option<String>,
    topic_regex: Option<String>,
    since: Option<SystemTime>,
    until: Option<SystemTime>,
    error: Option<String>,
    older_than: Option<i64>,
}

impl Matching {
    fn new(filter: &DeadLetterFilter) -> Matching {
        Matching {
            destination: filter.destination.clone(),
            topic_regex: filter.topic.as_ref().and_then(|t| t.dotted_regex()),
            since: filter.failed_since,
            until: filter.failed_before,
            error: filter.error.clone(),
            older_than: filter.failed_longer_ago.map(micros),
        }
    }

    fn params(&self) -> [&(dyn ToSql + Sync); 6] {
        [&self.destination, &self.topic_regex, &self.since, &self.until, &self.error, &self.older_than]
    }
}

/// The dead letters `filter` takes, of at most `limit` events past the id `after`, oldest id first.
pub(crate) async fn list_dead_letters(
    db: &impl Db,
    filter: &DeadLetterFilter,
    after: Option<i64>,
    limit: i64,
) -> Result<Vec<DeadLetter>> {
    let matching = Matching::new(filter);
    let mut params = matching.params().to_vec();
    params.extend([&after as &(dyn ToSql + Sync), &limit]);
    let rows = all(db, DEAD_LETTER_LIST, &params, "listing dead letters").await?;
    Ok(rows
        .iter()
        .map(|r| DeadLetter {
            id: r.get("id"),
            topic: r.get("topic"),
            key: r.get("key"),
            payload: r.get("payload"),
            created_at: r.get("created_at"),
            attempts: r.get("attempts"),
            last_error: r.get("last_error"),
            failed_at: r.get("failed_at"),
            destination: r.get("destination"),
        })
        .collect())
}

/// How many dead letters (one per event and destination) `filter` takes.
pub(crate) async fn count_dead_letters(db: &impl Db, filter: &DeadLetterFilter) -> Result<u64> {
    let matching = Matching::new(filter);
    let n: i64 = one(db, DEAD_LETTER_COUNT, &matching.params(), "counting dead letters").await?.get(0);
    Ok(u64::try_from(n).unwrap_or_default())
}

/// Puts dead letters back, under their own ids and uuids, deliverable at once, attempts reset:
/// into their destination's parked events, so that a revived event is claimed as its key's head
/// there (its id is older than the key's later events); one that no destination's pattern matched
/// (destination '') into the outbox, as a new event for every destination.
/// Without ids (`$7` null), those the filter `$1` to `$6` takes; otherwise those with the ids `$7`
/// (at every destination), all or none: when one of the ids is no dead letter's, nothing is
/// revived.
const DEAD_LETTER_RETRY: &str = concat!(
    "\
with wanted as (select distinct unnest($7::int8[]) as id),
revived as (
    delete from outbox_relay.dead_letters d
     where case when $7::int8[] is null then ",
    dead_letters_matching!(),
    "
                else d.id in (select id from wanted)
                     and (select count(distinct id) from outbox_relay.dead_letters where id in (select id from wanted))
                         = (select count(*) from wanted) end
    returning destination, id, uuid, topic, key, payload, headers, created_at
),
parked as (
    insert into outbox_relay.parked (destination, id, uuid, topic, key, payload, headers, created_at)
    select destination, id, uuid, topic, key, payload, headers, created_at from revived where destination <> ''
    on conflict (destination, id) do nothing
    returning id
),
-- A revived event is sent again, even where a claim that never committed had delivered it.
forgotten as (
    delete from outbox_relay.early_deliveries x using revived r where x.destination = r.destination and r.id = any(x.ids)
),
unrouted as (
    insert into outbox_relay.outbox (id, uuid, topic, key, payload, headers, created_at)
    select r.id, r.uuid, r.topic, r.key, r.payload, r.headers, r.created_at from revived r
     where r.destination = '' and not exists (select 1 from outbox_relay.outbox e where e.id = r.id)
    on conflict (id, slot) do nothing
    returning id
)
select r.id from revived r
 cross join (select count(*) from (select pg_notify('outbox_relay', 'parked') from parked limit 1) p) n(v)"
);

/// Which dead letters a retry or purge takes.
pub(crate) enum Which<'a> {
    /// Those with these ids, all or none of them.
    Ids(&'a [i64]),
    /// Those the filter takes.
    Matching(&'a DeadLetterFilter),
}

impl Which<'_> {
    fn params(&self) -> (Matching, Option<Vec<i64>>) {
        match self {
            Which::Ids(ids) => (Matching::new(&DeadLetterFilter::default()), Some(ids.to_vec())),
            Which::Matching(filter) => (Matching::new(filter), None),
        }
    }
}

/// Puts the dead letters `which` takes back into the outbox; returns the id of each (an event
/// dead at two destinations twice).
pub(crate) async fn retry_dead_letters(db: &impl Db, which: Which<'_>) -> Result<Vec<i64>> {
    let (matching, ids) = which.params();
    let mut params = matching.params().to_vec();
    params.push(&ids);
    let rows = all(db, DEAD_LETTER_RETRY, &params, "retrying dead letters").await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

const DEAD_LETTER_IDS: &str = "select distinct id from outbox_relay.dead_letters where id = any($1)";

/// Which of `ids` are dead letters.
pub(crate) async fn dead_letter_ids(db: &impl Db, ids: &[i64]) -> Result<Vec<i64>> {
    let rows = all(db, DEAD_LETTER_IDS, &[&ids], "looking dead letters up").await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

const DEAD_LETTER_PURGE: &str = concat!("delete from outbox_relay.dead_letters d where ", dead_letters_matching!());

/// Deletes the dead letters `filter` takes; returns how many.
pub(crate) async fn purge_dead_letters(db: &impl Db, filter: &DeadLetterFilter) -> Result<u64> {
    count(db, DEAD_LETTER_PURGE, &Matching::new(filter).params(), "purging dead letters").await
}

/// The dead letters `$1`, all or none (as in [`DEAD_LETTER_RETRY`]).
const DEAD_LETTER_PURGE_IDS: &str = "\
with wanted as (select distinct unnest($1::int8[]) as id)
delete from outbox_relay.dead_letters
 where id in (select id from wanted)
   and (select count(distinct id) from outbox_relay.dead_letters where id in (select id from wanted))
       = (select count(*) from wanted)
returning id";

/// Deletes the dead letters `ids`, all or none of them; returns the ids deleted.
pub(crate) async fn purge_dead_letters_by_id(db: &impl Db, ids: &[i64]) -> Result<Vec<i64>> {
    let rows = all(db, DEAD_LETTER_PURGE_IDS, &[&ids], "purging dead letters").await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// The payload of the notification a dead letter retry sends on the relays' channel: parked
/// events are due (the relays claim parked events only when something may have made one due).
pub(crate) const PARKED_DUE: &str = "parked";

/// The payload of the notification a pause or resume sends on the relays' channel (the
/// trigger's are empty): the listeners have the pauses re-read at once.
pub(crate) const PAUSES_CHANGED: &str = "pauses";

/// Pauses `topic` ('' for every topic) at `destination` ('' for every destination) and tells the
/// relays; 1 when it was not paused before.
const PAUSE_INSERT: &str = "\
with paused as (
    insert into outbox_relay.pauses (destination, topic) values ($2, $1) on conflict (destination, topic) do nothing
    returning 1
)
select (select count(*) from paused), pg_notify('outbox_relay', 'pauses')";

/// Pauses `topic` at `destination`, '' meaning every topic or every destination; true when it
/// was not paused before.
pub(crate) async fn pause(db: &impl Db, topic: &str, destination: &str) -> Result<bool> {
    Ok(one(db, PAUSE_INSERT, &[&topic, &destination], "pausing delivery").await?.get::<_, i64>(0) == 1)
}

const PAUSE_DELETE: &str = "\
with lifted as (delete from outbox_relay.pauses where topic = $1 and destination = $2 returning 1)
select (select count(*) from lifted), pg_notify('outbox_relay', 'pauses')";

/// Lifts the pause of `topic` at `destination` ('' for the pause of every topic or every
/// destination); true when there was one.
pub(crate) async fn resume(db: &impl Db, topic: &str, destination: &str) -> Result<bool> {
    Ok(one(db, PAUSE_DELETE, &[&topic, &destination], "resuming delivery").await?.get::<_, i64>(0) == 1)
}

const PAUSE_LIST: &str =
    "select topic, paused_at, paused_by, destination from outbox_relay.pauses order by destination, topic";

/// The pauses in place: of every destination first, and of every topic first.
pub(crate) async fn pauses(db: &impl Db) -> Result<Vec<Pause>> {
    let rows = all(db, PAUSE_LIST, &[], "reading the pauses").await?;
    Ok(rows
        .iter()
        .map(|r| {
            let topic: String = r.get("topic");
            let destination: String = r.get("destination");
            Pause {
                topic: (!topic.is_empty()).then_some(topic),
                destination: (!destination.is_empty()).then_some(destination),
                paused_at: r.get("paused_at"),
                paused_by: r.get("paused_by"),
            }
        })
        .collect())
}

/// What holds vacuum back and what it has left to do, and how full the notification queue is.
/// Sessions of other roles show their transaction start and xmin only to superusers and members
/// of pg_read_all_stats; for others they count as absent.
const HEALTH: &str = "\
select (select (extract(epoch from max(clock_timestamp() - xact_start)) * 1000)::int8
          from pg_stat_activity where xact_start is not null and pid <> pg_backend_pid()) as oldest_transaction_age_ms,
       greatest((select max(age(backend_xmin)) from pg_stat_activity where pid <> pg_backend_pid()),
                (select max(age(xmin)) from pg_replication_slots),
                (select max(age(transaction)) from pg_prepared_xacts))::int8 as xmin_horizon_age,
       (select coalesce(sum(t.n_dead_tup), 0)::int8 from pg_inherits i join pg_stat_all_tables t on t.relid = i.inhrelid
         where i.inhparent = 'outbox_relay.outbox'::regclass) as outbox_dead_tuples,
       (select coalesce(sum(t.n_live_tup), 0)::int8 from pg_inherits i join pg_stat_all_tables t on t.relid = i.inhrelid
         where i.inhparent = 'outbox_relay.outbox'::regclass) as outbox_live_tuples,
       pg_notification_queue_usage() as notification_queue_usage,
       (select sum(numbackends) from pg_stat_database)::int8 as connections,
       current_setting('max_connections')::int8 as max_connections";

/// The database's health as the outbox feels it.
pub(crate) async fn health(db: &impl Db) -> Result<Health> {
    let row = one(db, HEALTH, &[], "reading the database's health").await?;
    Ok(Health {
        oldest_transaction_age: crate::timestamp::millis(row.get("oldest_transaction_age_ms")),
        xmin_horizon_age: row.get("xmin_horizon_age"),
        outbox_dead_tuples: row.get::<_, Option<i64>>("outbox_dead_tuples").unwrap_or(0),
        outbox_live_tuples: row.get::<_, Option<i64>>("outbox_live_tuples").unwrap_or(0),
        notification_queue_usage: row.get("notification_queue_usage"),
        connections: row.get("connections"),
        max_connections: row.get("max_connections"),
    })
}

/// Events with this id or key: each retained event at each destination whose pattern matches it
/// (`outbox_relay.event_state`, migration 0019), and the copies waiting for a destination or
/// dead whose outbox row is gone (removed after its retention): the one with the id first, then
/// newest first.
const EVENT_LOOKUP: &str = "\
select * from (
  (select s.id, s.topic, s.key, e.payload, s.created_at, s.attempts, s.last_error, s.state,
          case when s.state = 'delivered' then s.delivered_at
               when s.state = 'dead' then s.failed_at
               when s.state in ('pending', 'unrouted') then e.available_at
               when isfinite(s.due_at) then s.due_at end as since,
          s.destination
     from outbox_relay.event_state s join outbox_relay.outbox e on e.id = s.id
    where s.id = $1 or s.key = $2
    order by coalesce(s.id = $1, false) desc, s.id desc limit $3)
  union all
  (select id, topic, key, payload, created_at, attempts, last_error,
          case when available_at > now() and lease_token is not null then 'in flight'
               when available_at > now() and last_error is not null then 'retrying'
               when available_at > now() then 'delayed' else 'waiting' end,
          case when isfinite(available_at) then available_at end, destination
     from outbox_relay.parked p where (id = $1 or key = $2)
      and not exists (select 1 from outbox_relay.outbox e where e.id = p.id and e.uuid = p.uuid)
    order by coalesce(id = $1, false) desc, id desc limit $3)
  union all
  (select id, topic, key, payload, created_at, attempts, last_error, 'dead', failed_at, destination
     from outbox_relay.dead_letters d where (id = $1 or key = $2)
      and not exists (select 1 from outbox_relay.outbox e where e.id = d.id and e.uuid = d.uuid
                         and exists (select 1 from outbox_relay.destinations x where x.name = d.destination))
    order by coalesce(id = $1, false) desc, id desc limit $3)
) found
order by coalesce(id = $1, false) desc, id desc, destination nulls first limit $3";

/// Up to `limit` events whose id is `id` or whose key is `key`, wherever they are.
pub(crate) async fn look_up(db: &impl Db, id: Option<i64>, key: Option<&str>, limit: i64) -> Result<Vec<FoundEvent>> {
    let rows = all(db, EVENT_LOOKUP, &[&id, &key, &limit], "looking events up").await?;
    rows.iter()
        .map(|r| {
            let state: &str = r.get("state");
            let state = EventState::from_sql(state).ok_or_else(|| {
                Error::new(ErrorKind::Database, format!("looking up an event: unknown state {state:?}"))
            })?;
            Ok(FoundEvent {
                id: r.get("id"),
                topic: r.get("topic"),
                key: r.get("key"),
                payload: r.get("payload"),
                created_at: r.get("created_at"),
                attempts: r.get("attempts"),
                last_error: r.get("last_error"),
                state,
                since: r.get("since"),
                destination: r.get("destination"),
            })
        })
        .collect()
}

/// Every registered destination with its pattern and what waits for it.
const DESTINATION_STATS: &str = concat!(
    "select d.name, d.pattern,
       (select count(*) from outbox_relay.outbox e where ",
    waiting_for_destination!(),
    ") as new,
       (select count(*) from outbox_relay.parked x where x.destination = d.name and x.available_at <= now()) as due,
       (select count(*) from outbox_relay.parked x
         where x.destination = d.name and x.available_at > now() and x.lease_token is null) as delayed,
       (select count(*) from outbox_relay.parked x
         where x.destination = d.name and x.available_at > now() and x.lease_token is not null) as in_flight,
       (select count(*) from outbox_relay.dead_letters x where x.destination = d.name) as dead_letters,
       (select coalesce(max(x.attempts), 0) from outbox_relay.parked x where x.destination = d.name) as max_attempts,
       (case when p.at is not null then (least(greatest(extract(epoch from now()) - extract(epoch from p.at), -9e12), 9e12) * 1000)::int8 end) as position_age_ms,
       exists (select 1 from outbox_relay.pauses s where s.destination in ('', d.name) and s.topic = '') as paused,
       s.relays, d.registered,
       (case when s.relays = 0 and d.served_at is not null
             then (greatest(extract(epoch from now() - d.served_at), 0) * 1000)::int8 end) as unserved_ms,
       (case when s.relays = 0 and d.expire_after is not null
             then (greatest(extract(epoch from d.served_at + d.expire_after - now()), 0) * 1000)::int8 end)
         as expires_in_ms
  from (select name, pattern, topic_regex, true as registered, served_at, expire_after from outbox_relay.destinations
        union all
        select distinct x.destination, '', null, false, null::timestamptz, null::interval from outbox_relay.parked x
         where not exists (select 1 from outbox_relay.destinations r where r.name = x.destination)) d
  cross join lateral (
        select count(*) as relays from outbox_relay.relays r join pg_stat_activity a on a.pid = r.listener_pid
         where r.destination = d.name and a.datname = current_database()) s
  left join lateral (
        select q.since, q.snapshot, q.after_id, q.at from outbox_relay.positions q
         where q.destination = d.name order by q.n desc limit 1) p on true
 order by d.name"
);

const DESTINATION_NAMES: &str = "select name from outbox_relay.destinations order by name";

/// The registered destinations' names, in order.
pub(crate) async fn destination_names(db: &impl Db) -> Result<Vec<String>> {
    Ok(all(db, DESTINATION_NAMES, &[], "reading the destinations' names").await?.iter().map(|r| r.get(0)).collect())
}

/// Every registered destination, by name.
pub(crate) async fn destination_stats(db: &impl Db) -> Result<Vec<crate::queue::DestinationStats>> {
    let rows = all(db, DESTINATION_STATS, &[], "reading the destinations").await?;
    Ok(rows
        .iter()
        .map(|r| crate::queue::DestinationStats {
            name: r.get("name"),
            pattern: r.get("pattern"),
            new: r.get("new"),
            due: r.get("due"),
            delayed: r.get("delayed"),
            in_flight: r.get("in_flight"),
            dead_letters: r.get("dead_letters"),
            max_attempts: r.get("max_attempts"),
            position_age: crate::timestamp::millis(r.get("position_age_ms")),
            paused: r.get("paused"),
            relays: r.get("relays"),
            registered: r.get("registered"),
            unserved: crate::timestamp::millis(r.get("unserved_ms")),
            expires_in: crate::timestamp::millis(r.get("expires_in_ms")),
        })
        .collect())
}
