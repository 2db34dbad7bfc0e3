//! Destinations: registering them, finishing what every destination has passed, and dropping one
//! (migration 0012).

use super::{Db, all as all_rows, count, one};
use crate::error::Result;
use crate::sql::Destination;

/// Registrations take turns (a registration and the claims it waits for are all there is to it:
/// readers and claims are not held up).
pub(super) const DESTINATIONS_LOCK: &str = "lock table outbox_relay.destinations in share row exclusive mode";

const DESTINATION_GET: &str =
    "select name, pattern, topic_regex, lock_id from outbox_relay.destinations where name = $1";

/// What names the relay whose listener is the backend `$1`: its row, its application name and
/// its address.
const RELAY_DESCRIBED: &str = "\
select r.id as relay, a.application_name, coalesce(host(a.client_addr), 'a local socket') as client
  from pg_stat_activity a left join outbox_relay.relays r on r.listener_pid = a.pid
 where a.pid = $1";

/// Refuses a pattern change of `name` (registered with `was`) while a connected
/// relay serves it: the two relays' claims would move the destination's one position past the
/// events the other pattern wants, and those would be delivered nowhere.
async fn refuse_change_while_served(db: &impl Db, name: &str, was: &str, pattern: &str) -> Result<()> {
    let doing = "registering a destination";
    let pids: Vec<i32> = one(db, DESTINATION_RELAYS, &[&name], doing).await?.get(0);
    let Some(pid) = pids.first() else {
        return Ok(());
    };
    let described = all_rows(db, RELAY_DESCRIBED, &[pid], doing).await?;
    let Some(row) = described.first() else {
        return Ok(());
    };
    let relay = row.get::<_, Option<i64>>("relay").map_or(String::new(), |id| format!("relay {id}, "));
    let application = row.get::<_, Option<String>>("application_name").filter(|a| !a.is_empty());
    let application = application.map_or(String::new(), |a| format!("{a}, "));
    Err(crate::error::Error::config(format!(
        "destination {name} is served by a connected relay with the pattern {was} ({relay}{application}listener backend \
         pid {pid}, from {}), and this relay's route gives it the pattern {pattern}: the two relays' claims would move \
         the destination's one position past the events the other pattern wants, and those would be delivered \
         nowhere. Stop the relays that serve {name} first (SIGTERM), or give the changed route a new destination \
         name (see \"Changing a route\" in docs/operations.md); a relay whose host went away keeps its connection \
         until PostgreSQL notices, and `select pg_terminate_backend({pid})` ends it",
        row.get::<_, String>("client"),
    )))
}

const DESTINATION_SET_PATTERN: &str =
    "update outbox_relay.destinations set pattern = $2, topic_regex = $3 where name = $1";

/// Waits for every registered destination's new events' lock: a claim in progress moves a
/// position the new destination may start from.
pub(super) const DESTINATIONS_WAIT_FOR_CLAIMS: &str = "\
select count(pg_advisory_xact_lock(1869901932, lock_id)::text) from (
    select lock_id from outbox_relay.destinations order by lock_id
) d";

/// Where a destination registered now starts: at the newest position of the registered
/// destination that is furthest behind (no event it has not passed was removed), or at the
/// origin's when none is registered: the events it has not passed are still in the outbox. Then
/// the statement inserts the destination (`registered`, a CTE of its own, which records where it
/// `started`: the events that snapshot sees were never its own) and its position.
macro_rules! destination_insert {
    ($registered:literal) => {
        concat!(
            "with start as (
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
     order by pg_snapshot_xmax(case when after_id is null then snapshot else since end),
              pg_snapshot_xmin(case when after_id is null then snapshot else since end), after_id nulls first
     limit 1
),
registered as (",
            $registered,
            "
),
positioned as (
    insert into outbox_relay.positions (destination, n, since, snapshot, after_id)
    select r.name, coalesce((select max(q.n) + 1 from outbox_relay.positions q where q.destination = r.name), 0),
           f.since, f.snapshot, f.after_id
      from registered r, furthest_behind f
)
select lock_id from registered"
        )
    };
}

/// Registers a new destination.
const DESTINATION_INSERT: &str = destination_insert!(
    "insert into outbox_relay.destinations (name, pattern, topic_regex, started)
    select $1, $2, $3, (select case when f.after_id is null then f.snapshot else f.since end from furthest_behind f)
    returning name, lock_id"
);

/// Registers again, under its own lock number, a destination dropped while a relay served it.
const DESTINATION_REINSERT: &str = destination_insert!(
    "insert into outbox_relay.destinations (name, pattern, topic_regex, lock_id, started) overriding system value
    select $1, $2, $3, $4, (select case when f.after_id is null then f.snapshot else f.since end from furthest_behind f)
    on conflict do nothing
    returning name, lock_id"
);

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

/// Each registered destination's newest position, once per statement (a CTE named `newest`).
macro_rules! newest_positions {
    () => {
        "newest as materialized (
    select p.since, p.snapshot, p.after_id
      from outbox_relay.destinations d cross join lateral (
        select q.since, q.snapshot, q.after_id from outbox_relay.positions q
         where q.destination = d.name order by q.n desc limit 1) p
)"
    };
}

/// Whether every position of `newest` has passed the outbox row `e` (none of them another
/// cluster's, migration 0014), as `sweep.sql` tests it.
macro_rules! passed_by_newest {
    () => {
        "not exists (select 1 from newest p
                        where pg_snapshot_xmax(p.snapshot) > pg_snapshot_xmax(pg_current_snapshot())
                           or not outbox_relay.passed(e.xid, e.id, p.since, p.snapshot, p.after_id))"
    };
}

/// Whether the destination `d` takes the outbox row `e`: its pattern matches the topic, and its
/// starting position had not passed the event (a destination registered later never had it).
macro_rules! takes_event {
    () => {
        "(d.topic_regex is null or ('.' || e.topic) ~ d.topic_regex)
                          and (d.started is null or not pg_visible_in_snapshot(e.xid, d.started))"
    };
}

/// Before the destinations change (one added, a pattern changed, one dropped or expired): every
/// outbox row every destination has passed that no destination takes goes to the dead letters of
/// '' now, whatever its retention, and leaves the outbox: judged later, against the changed
/// destinations, it could be counted as one's that never saw it, and removed unsent. Reads every
/// retained row (a registration that changes something, a drop: rare); run under the
/// destinations' lock with their claims held off.
const BURY_UNROUTED: &str = concat!(
    "with ",
    newest_positions!(),
    ",
gone as materialized (
    select e.id, e.uuid, e.topic, e.key, e.payload, e.headers, e.created_at
      from outbox_relay.outbox e
     where exists (select 1 from outbox_relay.destinations)
       and not exists (select 1 from outbox_relay.destinations d where ",
    takes_event!(),
    ")
       and ",
    passed_by_newest!(),
    "
       for update of e skip locked
),
buried as (
    insert into outbox_relay.dead_letters (destination, id, uuid, topic, key, payload, headers, created_at, attempts, last_error)
    select '', g.id, g.uuid, g.topic, g.key, g.payload, g.headers, g.created_at, 0,
           'no destination''s pattern matches its topic (the destinations: '
           || (select string_agg(d.name || ' ' || d.pattern, ', ' order by d.name) from outbox_relay.destinations d)
           || ')'
      from gone g
    on conflict (destination, id) do update set failed_at = now(), last_error = excluded.last_error
     where dead_letters.uuid = excluded.uuid
    returning id
)
delete from outbox_relay.outbox where id = any (array(select id from buried))"
);

/// When a destination (`$1`) is dropped: the outbox rows every destination has passed that no
/// other destination takes were the dropped one's alone; they go now, rather than count as
/// unrouted when their retention ends.
const DESTINATION_FORGET_ITS_OWN: &str = concat!(
    "with ",
    newest_positions!(),
    "
delete from outbox_relay.outbox e
 where not exists (select 1 from outbox_relay.destinations d where d.name <> $1 and ",
    takes_event!(),
    ")
   and ",
    passed_by_newest!()
);

/// Buries the unrouted rows every destination has passed (`BURY_UNROUTED`); returns how many.
pub(crate) async fn bury_unrouted(db: &impl Db) -> Result<u64> {
    count(db, BURY_UNROUTED, &[], "burying the events no destination's pattern matches").await
}

/// How many rows one statement of the sweep that registration runs reads.
const REGISTRATION_SWEEP_BATCH: i64 = 10_000;

/// Registers the destinations `all`, or finds them and sets their patterns, in one transaction:
/// the new ones start at one same position (so that none of a relay's destinations misses what
/// another of them claims first). Before a destination is added or its pattern changes, with
/// every destination's claims held off, the rows all destinations have passed whose `retention`
/// is over are removed against the patterns they were passed under: a row no pattern matched
/// goes to the dead letters now, and is not counted as a new pattern's that never saw it.
pub(crate) async fn register_destinations(
    client: &mut deadpool_postgres::Object,
    all: &[ToRegister<'_>],
    retention: std::time::Duration,
    expiry: std::time::Duration,
) -> Result<Vec<Registered>> {
    let fail = |e| crate::error::Error::database("registering the destinations", e);
    let tx = client.transaction().await.map_err(fail)?;
    count(&tx, DESTINATIONS_LOCK, &[], "registering the destinations").await?;
    let mut found = Vec::with_capacity(all.len());
    for to in all {
        let row = all_rows(&tx, DESTINATION_GET, &[&to.name], "registering a destination").await?;
        found.push(row.first().map(|row| (row.get::<_, String>("pattern"), row.get::<_, i32>("lock_id"))));
    }
    for (to, found) in all.iter().zip(&found) {
        if let Some((was, _)) = found
            && was != to.pattern
        {
            refuse_change_while_served(&tx, to.name, was, to.pattern).await?;
        }
    }
    let changes = all.iter().zip(&found).any(|(to, found)| found.as_ref().is_none_or(|(was, _)| was != to.pattern));
    if changes {
        one(&tx, DESTINATIONS_WAIT_FOR_CLAIMS, &[], "registering a destination").await?;
        bury_unrouted(&tx).await?;
        let mut from = SweepFrom::default();
        loop {
            let swept = sweep_outbox(&tx, &from, REGISTRATION_SWEEP_BATCH, retention).await?;
            match swept.next {
                Some(next) if swept.read >= REGISTRATION_SWEEP_BATCH && next != from => from = next,
                _ => break,
            }
        }
    }
    let mut registered = Vec::with_capacity(all.len());
    for (to, found) in all.iter().zip(found) {
        let (lock_id, pattern_was, new) = match found {
            Some((was, lock_id)) => {
                let changed = was != to.pattern;
                if changed {
                    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] =
                        [&to.name, &to.pattern, &to.topic_regex];
                    count(&tx, DESTINATION_SET_PATTERN, &params, "registering a destination").await?;
                }
                (lock_id, changed.then_some(was), false)
            }
            None => {
                let params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] = [&to.name, &to.pattern, &to.topic_regex];
                (one(&tx, DESTINATION_INSERT, &params, "registering a destination").await?.get(0), None, true)
            }
        };
        registered.push(Registered {
            destination: Destination {
                name: to.name.to_string(),
                pattern: to.pattern.to_string(),
                lock_id,
                topic_regex: to.topic_regex.map(str::to_string),
            },
            pattern_was,
            new,
        });
    }
    let names: Vec<&str> = all.iter().map(|to| to.name).collect();
    let expiry = expiry.as_secs_f64();
    count(&tx, DESTINATIONS_SERVED_FROM_NOW, &[&names, &expiry], "registering the destinations").await?;
    tx.commit().await.map_err(fail)?;
    Ok(registered)
}

/// The destinations `$1` are served from now on, and expire after `$2` seconds without a relay
/// (0: never).
const DESTINATIONS_SERVED_FROM_NOW: &str = "\
update outbox_relay.destinations
   set served_at = now(), expire_after = case when $2::float8 > 0 then make_interval(secs => $2::float8) end
 where name = any($1::text[])";

/// Registers `to` again after it was dropped while this relay served it (`destinations drop`
/// right after a crash restart of the server, before the relay's listener was back): it starts
/// where a new destination would. Returns whether it was registered (false: registered already,
/// or its lock number was taken meanwhile).
pub(crate) async fn reregister_destination(client: &mut deadpool_postgres::Object, to: &Destination) -> Result<bool> {
    let doing = "registering a dropped destination again";
    let tx = client.transaction().await.map_err(|e| crate::error::Error::database(doing, e))?;
    count(&tx, DESTINATIONS_LOCK, &[], doing).await?;
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] = [&to.name, &to.pattern, &to.topic_regex, &to.lock_id];
    let registered = !all_rows(&tx, DESTINATION_REINSERT, &params, doing).await?.is_empty();
    tx.commit().await.map_err(|e| crate::error::Error::database(doing, e))?;
    Ok(registered)
}

/// Removes the outbox rows that every registered destination has passed and whose retention is
/// over (committed more than `$3` microseconds ago: the newest position taken before then sees
/// them). It reads at most `$2` rows in xid order from
/// the transaction `$1` on (where the last sweep ended), up to the lowest xmax of the positions'
/// snapshots and the xmax of the newest position taken before the retention's start (so it reads
/// no row the retention keeps), and removes those that every destination has passed (a
/// destination has passed an event when its newest position's snapshot sees the event's
/// transaction, or the event is in the position's cut delta at or below `after_id`:
/// `outbox_relay.passed`). A row that no destination's pattern matches goes to the dead letters of
/// the destination '' as it goes, saying so.
///
/// Returns how many rows it removed, how many of those went to the dead letters, how many it
/// read, how many it skipped because another session had them locked, and where the next sweep
/// starts, as (xid, id) from `($1, $4)` on, a total order (one transaction may have written more
/// rows than a batch): at the first row it read that it could not remove (some destination has
/// not passed it, its retention is not over, or it was locked), else past what it read. So a row
/// is read again only while it must stay, and then at most `$2` rows a sweep. With no destination
/// registered, the origin's position (where the first one will start, the last one's once it was
/// dropped) says what was passed, and no row is unrouted. Positions from another cluster
/// (migration 0014) pass nothing.
///
/// A transaction still running when the cursor passes its id (its rows cannot be seen yet) is
/// owed: the sweep returns it among `owed`, the next one reads its rows (`$5`, one probe each),
/// and it stays owed while it runs or while rows of it were read. The cursor used to stop at the
/// oldest transaction running instead; one held open for minutes (a report, a forgotten session)
/// then made every sweep read again every row deleted since it began, 57,000 buffers a sweep
/// after 90 s at 800 events/s, a number that grows with the hold.
const OUTBOX_SWEEP: &str = include_str!("sweep.sql");

/// What one sweep did.
pub(crate) struct Swept {
    /// Rows removed.
    pub(crate) finished: i64,
    /// Of those, rows no destination's pattern matches, now in the dead letters of ''.
    pub(crate) unrouted: i64,
    /// Rows it read: a full batch means more may wait.
    pub(crate) read: i64,
    /// Where the next sweep starts, when there is a horizon.
    pub(crate) next: Option<SweepFrom>,
    /// The positions were taken in another cluster: nothing was finished on their word.
    pub(crate) foreign_positions: bool,
    /// Rows every destination has passed that another session holds locked: left for later.
    pub(crate) locked: i64,
}

/// Where a sweep starts: the first outbox row at or after this transaction id and event id, and
/// the transactions below it whose rows it could not see when it passed them (`owed`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SweepFrom {
    pub(crate) xid: String,
    pub(crate) id: i64,
    pub(crate) owed: Vec<String>,
}

impl SweepFrom {
    /// Whether the cursor itself differs from `other`'s (what it owes aside).
    pub(crate) fn moved_from(&self, other: &SweepFrom) -> bool {
        (&self.xid, self.id) != (&other.xid, other.id)
    }
}

impl Default for SweepFrom {
    /// The first row.
    fn default() -> Self {
        SweepFrom { xid: "0".to_string(), id: 0, owed: Vec::new() }
    }
}

/// Removes up to `batch` outbox rows that every destination has passed and that are older than
/// `retention`, from `from` on.
pub(crate) async fn sweep_outbox(
    db: &impl Db,
    from: &SweepFrom,
    batch: i64,
    retention: std::time::Duration,
) -> Result<Swept> {
    let retention = super::micros(retention);
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 5] = [&from.xid, &batch, &retention, &from.id, &from.owed];
    let row = one(db, OUTBOX_SWEEP, &params, "removing events every destination passed").await?;
    let next = match (row.get::<_, Option<String>>("next_xid"), row.get::<_, Option<i64>>("next_id")) {
        (Some(xid), Some(id)) => Some(SweepFrom { xid, id, owed: row.get("owed") }),
        _ => None,
    };
    Ok(Swept {
        finished: row.get("finished"),
        unrouted: row.get("unrouted"),
        read: row.get("read"),
        next,
        foreign_positions: row.get("foreign_positions"),
        locked: row.get("locked"),
    })
}

/// The dead letters of a destination that is dropped: what waited for it is kept, saying why
/// (`$2`).
const DESTINATION_DROP_PARKED: &str = "\
with moved as (
    delete from outbox_relay.parked where destination = $1
    returning id, uuid, topic, key, payload, headers, created_at, attempts, last_error
)
insert into outbox_relay.dead_letters (destination, id, uuid, topic, key, payload, headers, created_at, attempts, last_error)
select $1, id, uuid, topic, key, payload, headers, created_at, attempts,
       $2::text || coalesce(' (last error: ' || last_error || ')', '')
  from moved
on conflict (destination, id) do nothing";

/// The dead letters of an expired destination's new events (those its pattern matches that its
/// position has not passed), saying why (`$2`): they would be finished once the other
/// destinations pass them, delivered nowhere.
const DESTINATION_BURY_NEW: &str = concat!(
    "insert into outbox_relay.dead_letters (destination, id, uuid, topic, key, payload, headers, created_at, attempts, last_error)
select d.name, e.id, e.uuid, e.topic, e.key, e.payload, e.headers, e.created_at, 0, $2::text
  from outbox_relay.destinations d
  cross join lateral (
        select q.since, q.snapshot, q.after_id from outbox_relay.positions q
         where q.destination = d.name order by q.n desc limit 1) p
  join outbox_relay.outbox e on ",
    waiting_for_destination!(),
    "
 where d.name = $1
on conflict (destination, id) do nothing"
);

/// Whether the destination `$1` is still expired (locked until the drop commits): no relay
/// served it for its `expire_after`; and that span, in seconds.
const DESTINATION_STILL_EXPIRED: &str = "\
select extract(epoch from expire_after)::float8 from outbox_relay.destinations
 where name = $1 and expire_after is not null and served_at < now() - expire_after
   for update";

/// Marks every destination a connected relay delivers to as served now.
const DESTINATIONS_SERVED_NOW: &str = "\
update outbox_relay.destinations d set served_at = now()
 where exists (select 1 from outbox_relay.relays r join pg_stat_activity a on a.pid = r.listener_pid
                where r.destination = d.name and a.datname = current_database())";

/// The destinations no relay has served for half their expiry or more: name, seconds since a
/// relay served it, seconds of its expiry.
const DESTINATIONS_AGING: &str = "\
select name, extract(epoch from now() - served_at)::float8, extract(epoch from expire_after)::float8
  from outbox_relay.destinations
 where expire_after is not null and served_at < now() - expire_after / 2
 order by name";

/// A destination no relay has served for half its expiry or more.
pub(crate) struct Aging {
    pub(crate) name: String,
    pub(crate) unserved: std::time::Duration,
    pub(crate) expiry: std::time::Duration,
}

/// Marks the destinations connected relays deliver to as served now; returns those no relay has
/// served for half their expiry or more.
pub(crate) async fn destinations_served(db: &impl Db) -> Result<Vec<Aging>> {
    count(db, DESTINATIONS_SERVED_NOW, &[], "marking the served destinations").await?;
    let rows = all_rows(db, DESTINATIONS_AGING, &[], "reading the destinations no relay serves").await?;
    let seconds = |s: f64| std::time::Duration::from_secs_f64(s.max(0.0));
    Ok(rows.iter().map(|r| Aging { name: r.get(0), unserved: seconds(r.get(1)), expiry: seconds(r.get(2)) }).collect())
}

const DESTINATION_DROP_POSITIONS: &str = "delete from outbox_relay.positions where destination = $1";

const DESTINATION_DROP_PAUSES: &str = "delete from outbox_relay.pauses where destination = $1";

/// The records of deliveries a claim that never committed made (its events are dead letters
/// now: a retry sends them again).
const DESTINATION_DROP_EARLY: &str = "delete from outbox_relay.early_deliveries where destination = $1";

const DESTINATION_DELETE: &str = "delete from outbox_relay.destinations where name = $1";

/// The relays connected now that deliver to the destination `$1`: their listeners' pids, from
/// their rows and from the lock each listener's connection holds on the destination (which a
/// crash restart of the server does not forget, as it does the unlogged rows, for longer than
/// the listener takes to reconnect).
const DESTINATION_RELAYS: &str = "\
select coalesce(array_agg(distinct s.pid order by s.pid), '{}') from (
    select r.listener_pid as pid
      from outbox_relay.relays r join pg_stat_activity a on a.pid = r.listener_pid
     where r.destination = $1 and a.datname = current_database()
    union all
    select l.pid from pg_locks l join outbox_relay.destinations d on d.name = $1
     where l.locktype = 'advisory' and l.database = (select oid from pg_database where datname = current_database())
       and l.classid = 1869901933::int4::oid and l.objid = d.lock_id::oid and l.objsubid = 2 and l.granted
) s";

/// Waits for the claim of the destination `$1` in progress, if any.
const DESTINATION_WAIT_FOR_CLAIM: &str =
    "select count(pg_advisory_xact_lock(1869901932, lock_id)::text) from outbox_relay.destinations where name = $1";

/// When the last destination goes, its position becomes the origin the next one starts from
/// (not the older origin, from which it would get every event kept since).
const ORIGIN_MOVE: &str = "\
insert into outbox_relay.positions (destination, n, since, snapshot, after_id)
select '', coalesce((select max(o.n) from outbox_relay.positions o where o.destination = ''), 0) + 1,
       p.since, p.snapshot, p.after_id
  from (select q.since, q.snapshot, q.after_id from outbox_relay.positions q
         where q.destination = $1 order by q.n desc limit 1) p
 where not exists (select 1 from outbox_relay.destinations d where d.name <> $1)";

/// What dropping a destination found.
pub(crate) enum Dropped {
    /// It was dropped; so many parked events went to its dead letters.
    Done(u64),
    /// No destination has that name.
    Unknown,
    /// Relays connected now deliver to it (their listeners' pids): nothing was done.
    Served(Vec<i32>),
}

/// Drops the destination `name`, unless a connected relay delivers to it: events no longer wait
/// for it (what was parked for it goes to its dead letters), and its position no longer holds the
/// outbox's rows back (the last destination's becomes the origin).
pub(crate) async fn drop_destination(client: &mut deadpool_postgres::Object, name: &str) -> Result<Dropped> {
    drop_or_expire(client, name, false).await
}

/// Drops the destination `name` if it is still expired and no connected relay delivers to it,
/// moving what waits for it (its parked events and the new events its position has not passed)
/// to its dead letters; `Unknown` when it is not (served again, or dropped meanwhile).
pub(crate) async fn expire_destination(client: &mut deadpool_postgres::Object, name: &str) -> Result<Dropped> {
    drop_or_expire(client, name, true).await
}

async fn drop_or_expire(client: &mut deadpool_postgres::Object, name: &str, expire: bool) -> Result<Dropped> {
    let doing = if expire { "expiring a destination" } else { "dropping a destination" };
    let tx = client.transaction().await.map_err(|e| crate::error::Error::database(doing, e))?;
    count(&tx, DESTINATIONS_LOCK, &[], doing).await?;
    let relays: Vec<i32> = one(&tx, DESTINATION_RELAYS, &[&name], doing).await?.get(0);
    if !relays.is_empty() {
        return Ok(Dropped::Served(relays));
    }
    let mut buried = 0;
    let why = if expire {
        let Some(row) = all_rows(&tx, DESTINATION_STILL_EXPIRED, &[&name], doing).await?.into_iter().next() else {
            return Ok(Dropped::Unknown);
        };
        let expiry = std::time::Duration::from_secs(row.get::<_, f64>(0).max(0.0) as u64);
        let why = format!(
            "the destination expired: no relay served it for {} (destination_expiry)",
            humantime::format_duration(expiry)
        );
        one(&tx, DESTINATION_WAIT_FOR_CLAIM, &[&name], doing).await?;
        buried += count(&tx, DESTINATION_BURY_NEW, &[&name, &why], doing).await?;
        format!("{why}; the event waited for it")
    } else {
        one(&tx, DESTINATION_WAIT_FOR_CLAIM, &[&name], doing).await?;
        "the destination was dropped while the event waited for it".to_string()
    };
    bury_unrouted(&tx).await?;
    count(&tx, DESTINATION_FORGET_ITS_OWN, &[&name], doing).await?;
    count(&tx, ORIGIN_MOVE, &[&name], doing).await?;
    let registered = count(&tx, DESTINATION_DELETE, &[&name], doing).await? > 0;
    // Parked events of a name no longer registered (a destination of the migration, a retried
    // dead letter of a dropped one) go too.
    buried += count(&tx, DESTINATION_DROP_PARKED, &[&name, &why], doing).await?;
    if !registered && buried == 0 {
        return Ok(Dropped::Unknown);
    }
    count(&tx, DESTINATION_DROP_POSITIONS, &[&name], doing).await?;
    count(&tx, DESTINATION_DROP_PAUSES, &[&name], doing).await?;
    count(&tx, DESTINATION_DROP_EARLY, &[&name], doing).await?;
    count(&tx, "delete from outbox_relay.parked_deliveries where destination = $1", &[&name], doing).await?;
    tx.commit().await.map_err(|e| crate::error::Error::database(doing, e))?;
    Ok(Dropped::Done(buried))
}

/// Sends retained events of the destination `$1` created in [`$2`, `$3`) again, those whose
/// topic `$4` matches (null: all): `outbox_relay.replay` (migration 0019) says how.
const REPLAY: &str = "select outbox_relay.replay($1, $2, $3, $4)";

/// Copies the retained events of `destination` created in [`since`, `until`) (whose topic
/// `topic_regex` matches, if any) into its parked events, to be delivered again; returns how many.
/// `dry_run`: in a transaction rolled back, to count them.
pub(crate) async fn replay_on(
    client: &mut deadpool_postgres::Object,
    destination: &str,
    since: std::time::SystemTime,
    until: Option<std::time::SystemTime>,
    topic_regex: Option<&str>,
    dry_run: bool,
) -> Result<u64> {
    let doing = "replaying events to a destination";
    let tx = client.transaction().await.map_err(|e| crate::error::Error::database(doing, e))?;
    let copied = replay(&tx, destination, since, until, topic_regex).await?;
    if dry_run { tx.rollback().await } else { tx.commit().await }
        .map_err(|e| crate::error::Error::database(doing, e))?;
    Ok(copied)
}

pub(crate) async fn replay(
    db: &impl Db,
    destination: &str,
    since: std::time::SystemTime,
    until: Option<std::time::SystemTime>,
    topic_regex: Option<&str>,
) -> Result<u64> {
    let until = until.map_or(tokio_postgres::types::Timestamp::PosInfinity, tokio_postgres::types::Timestamp::Value);
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] = [&destination, &since, &until, &topic_regex];
    let copied: i64 = one(db, REPLAY, &params, "replaying events to a destination").await?.get(0);
    Ok(copied.max(0) as u64)
}

/// What adding a destination did.
pub(crate) enum Added {
    /// It was registered; so many retained events were replayed to it.
    Done(u64),
    /// A destination of that name is registered already, with this pattern.
    Exists(String),
}

/// Registers the destination `to` ahead of any relay, where a relay would (at the position of
/// the destination furthest behind), and with `since`, replays to it in the same transaction the
/// retained events created from then on that its position has passed: so that it starts in the
/// past, its keys' replayed events before any new one.
pub(crate) async fn add_destination(
    client: &mut deadpool_postgres::Object,
    to: &ToRegister<'_>,
    since: Option<std::time::SystemTime>,
) -> Result<Added> {
    let doing = "adding a destination";
    let tx = client.transaction().await.map_err(|e| crate::error::Error::database(doing, e))?;
    count(&tx, DESTINATIONS_LOCK, &[], doing).await?;
    if let Some(row) = all_rows(&tx, DESTINATION_GET, &[&to.name], doing).await?.first() {
        return Ok(Added::Exists(row.get("pattern")));
    }
    one(&tx, DESTINATIONS_WAIT_FOR_CLAIMS, &[], doing).await?;
    bury_unrouted(&tx).await?;
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] = [&to.name, &to.pattern, &to.topic_regex];
    one(&tx, DESTINATION_INSERT, &params, doing).await?;
    // It expires as a relay's would if no relay ever serves it (a mistyped name must not keep
    // every event in the outbox for good); a relay that registers it sets its own expiry.
    let names = [to.name];
    let expiry = crate::RelayConfig::DEFAULT_DESTINATION_EXPIRY.as_secs_f64();
    count(&tx, DESTINATIONS_SERVED_FROM_NOW, &[&names.as_slice(), &expiry], doing).await?;
    let replayed = match since {
        Some(since) => replay(&tx, to.name, since, None, None).await?,
        None => 0,
    };
    tx.commit().await.map_err(|e| crate::error::Error::database(doing, e))?;
    Ok(Added::Done(replayed))
}
