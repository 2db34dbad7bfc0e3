//! The relays' own rows: the waiting mark writers check, the race closure's view of open
//! transactions, the listener's LISTEN, and the privileges a relay needs.

use tokio_postgres::error::SqlState;

use super::{Db, all, count, one};
use crate::error::{Error, Result};

/// The channel the outbox trigger notifies (see `migrations/`).
const CHANNEL_LISTEN: &str = "listen outbox_relay";

/// The first key of the advisory lock a relay's listener holds, shared, for as long as its
/// connection lives, on each destination it serves (the second key is the destination's
/// `lock_id`): a drop of the destination is refused while any relay holds it, also after a
/// crash restart of the server emptied the unlogged table of relays.
pub(crate) const SERVING_LOCK: i32 = 1869901933;

/// Starts listening on the outbox channel on a dedicated connection, serving the destination
/// whose lock is `lock_id`; returns its backend pid.
pub(crate) async fn listen(client: &tokio_postgres::Client, lock_id: i32) -> Result<i32> {
    client.batch_execute(CHANNEL_LISTEN).await.map_err(|e| Error::database("starting to listen", e))?;
    client
        .execute("select pg_advisory_lock_shared($1::int4, $2::int4)", &[&SERVING_LOCK, &lock_id])
        .await
        .map_err(|e| Error::database("marking the destination served", e))?;
    let row = client
        .query_one("select pg_backend_pid()", &[])
        .await
        .map_err(|e| Error::database("reading the listener's backend pid", e))?;
    Ok(row.get(0))
}

/// Gives up the listener's mark on the destination it served, before its connection closes (a
/// drop right after a relay stops must not find the lock of a backend still on its way out).
pub(crate) async fn unserve(client: &tokio_postgres::Client, lock_id: i32) -> Result<()> {
    client
        .execute("select pg_advisory_unlock_shared($1::int4, $2::int4)", &[&SERVING_LOCK, &lock_id])
        .await
        .map(drop)
        .map_err(|e| Error::database("giving up the destination's served mark", e))
}

/// Takes the destination's fast path for the listener's session (`src/relay/fast.rs`): its
/// lock, the first key [`FAST_LOCK`], the second the destination's `lock_id`. False while another
/// relay's listener holds it, or another relay's claim of new events runs.
pub(crate) async fn take_fast_path(client: &tokio_postgres::Client, lock_id: i32) -> Result<bool> {
    let row = client
        .query_one("select pg_try_advisory_lock($1::int4, $2::int4)", &[&FAST_LOCK, &lock_id])
        .await
        .map_err(|e| Error::database("taking the destination's fast path", e))?;
    Ok(row.get(0))
}

/// Has the server end the listener's session once it has been idle (no statement from the relay)
/// for `after`, with PostgreSQL 14's `idle_session_timeout`: the fast-path lock it holds for its
/// session then goes with it when its relay freezes (SIGSTOP, a paused VM) and its connection stays
/// open, as a frozen relay's held claims go after the lease (`idle_in_transaction_session_timeout`).
/// A live listener sends a statement well within `after` (`src/relay/listener.rs`). False on a
/// server before 14, which has no such setting: a frozen owner would hold every new event back.
pub(crate) async fn end_session_when_idle(client: &tokio_postgres::Client, after: std::time::Duration) -> Result<bool> {
    let millis = after.as_millis().clamp(1, i32::MAX as u128).to_string();
    let row = client
        .query_one(
            "select case when current_setting('server_version_num')::int >= 140000
                         then set_config('idle_session_timeout', $1::text, false) end is not null",
            &[&millis],
        )
        .await
        .map_err(|e| Error::database("bounding the listener's idle time", e))?;
    Ok(row.get(0))
}

/// The key that signs the notifications carrying events (migration 0018), or why the fast path
/// cannot use them: the relay's role may not read it, or the trigger carries no events.
pub(crate) async fn notification_key(
    client: &tokio_postgres::Client,
) -> Result<std::result::Result<Vec<u8>, &'static str>> {
    let row = match client.query_opt("select key, carry_events from outbox_relay.notification_key", &[]).await {
        Ok(row) => row,
        Err(e) if e.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE) => {
            return Ok(Err(
                "the relay's role may not read outbox_relay.notification_key (grant select on it: migrations/optional/least_privilege_roles.sql)",
            ));
        }
        Err(e) => return Err(Error::database("reading the notifications' signing key", e)),
    };
    Ok(match row {
        Some(row) if row.get::<_, bool>(1) => Ok(row.get(0)),
        Some(_) => {
            Err("the trigger's notifications carry no events (outbox_relay.notification_key.carry_events is false)")
        }
        None => Err("outbox_relay.notification_key has no key (migration 0018 makes one)"),
    })
}

/// The first key of the lock whose holder owns a destination's fast path.
pub(crate) const FAST_LOCK: i32 = 1869901934;

const WAITING_KEYS: &str = "select coalesce(array_agg(k.key), '{}'), count(*) > $3::int8 from (
    (select distinct p.key from outbox_relay.parked p where p.destination = $1 and p.key is not null limit $3::int8 + 1)
    union
    (select distinct d.key from outbox_relay.dead_letters d
      where $2 and d.destination = $1 and d.key is not null limit $3::int8 + 1)
) k";

/// The keys with an event that waits for `destination`: parked, or (with `dead_letters_hold`) in
/// its dead letters; `None` when there are more than `max`.
pub(crate) async fn waiting_keys(
    db: &impl Db,
    destination: &str,
    dead_letters_hold: bool,
    max: i64,
) -> Result<Option<Vec<String>>> {
    let row = one(db, WAITING_KEYS, &[&destination, &dead_letters_hold, &max], "reading the keys that wait").await?;
    Ok((!row.get::<_, bool>(1)).then(|| row.get(0)))
}

/// A round trip (an empty query), to tell a live link from a stalled one; `doing` names it in
/// the error.
pub(crate) async fn ping(client: &tokio_postgres::Client, doing: &str) -> Result<()> {
    client.simple_query("").await.map(drop).map_err(|e| Error::database(doing, e))
}

const RELAY_MARK_WAITING: &str = "\
insert into outbox_relay.relays (id, listener_pid, waiting, destination) values ($1, $2, true, $3)
on conflict (id) do update set waiting = true, listener_pid = excluded.listener_pid, updated_at = now()";

/// Marks relay `id` (delivering to `destination`) waiting: from the commit of this statement on,
/// every insert notifies.
pub(crate) async fn mark_waiting(db: &impl Db, id: i64, listener_pid: i32, destination: &str) -> Result<()> {
    count(db, RELAY_MARK_WAITING, &[&id, &listener_pid, &destination], "marking the relay waiting").await.map(drop)
}

const RELAY_MARK_BUSY: &str = "update outbox_relay.relays set waiting = false, updated_at = now() where id = $1";

/// Marks relay `id` busy: writers need not notify it.
pub(crate) async fn mark_busy(db: &impl Db, id: i64) -> Result<()> {
    count(db, RELAY_MARK_BUSY, &[&id], "marking the relay busy").await.map(drop)
}

const RELAY_BREAKER: &str = "\
insert into outbox_relay.relays (id, listener_pid, waiting, breaker, breaker_since, destination)
values ($1, $2, false, $3, now(), $4)
on conflict (id) do update set breaker = excluded.breaker, breaker_since = now(), updated_at = now()";

/// Publishes relay `id`'s breaker state (`closed` or `open`), for `status`.
pub(crate) async fn set_breaker(db: &impl Db, id: i64, listener_pid: i32, open: bool, destination: &str) -> Result<()> {
    let state = if open { "open" } else { "closed" };
    count(db, RELAY_BREAKER, &[&id, &listener_pid, &state, &destination], "publishing the breaker's state")
        .await
        .map(drop)
}

const RELAY_DELIVERIES: &str = "\
insert into outbox_relay.relays (id, listener_pid, waiting, delivery_limit, deliveries_in_flight, destination)
values ($1, $2, false, $3, $4, $5)
on conflict (id) do update
   set delivery_limit = excluded.delivery_limit, deliveries_in_flight = excluded.deliveries_in_flight,
       updated_at = now()";

/// Publishes relay `id`'s concurrency limit and its deliveries in flight, for `status` (the
/// listener's pid only in a new row: the listener itself records a new one, and a pid read before
/// a reconnect must not overwrite it).
pub(crate) async fn set_deliveries(
    db: &impl Db,
    id: i64,
    listener_pid: i32,
    limit: i32,
    in_flight: i32,
    destination: &str,
) -> Result<()> {
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 5] =
        [&id, &listener_pid, &limit, &in_flight, &destination];
    count(db, RELAY_DELIVERIES, &params, "publishing the concurrency limit").await.map(drop)
}

const RELAY_LISTENER: &str = "update outbox_relay.relays set listener_pid = $2, updated_at = now() where id = $1";

/// Records the backend pid of relay `id`'s new listener connection in its row, if it has one.
pub(crate) async fn set_listener(db: &impl Db, id: i64, listener_pid: i32) -> Result<()> {
    count(db, RELAY_LISTENER, &[&id, &listener_pid], "recording the relay's listener").await.map(drop)
}

const RELAY_REMOVE: &str = "delete from outbox_relay.relays where id = $1";

/// Removes relay `id`'s row (it is stopping).
pub(crate) async fn remove_relay(db: &impl Db, id: i64) -> Result<()> {
    count(db, RELAY_REMOVE, &[&id], "removing the relay's mark").await.map(drop)
}

const RELAY_REMOVE_DEAD: &str = "\
delete from outbox_relay.relays where listener_pid not in (select pid from pg_stat_activity)";

/// Removes the rows of relays whose listener backend is gone (they crashed without removing
/// themselves); returns how many.
pub(crate) async fn remove_dead_relays(db: &impl Db) -> Result<u64> {
    count(db, RELAY_REMOVE_DEAD, &[], "removing the marks of dead relays").await
}

/// The virtual transaction ids of every transaction open in this database now, but ours. Each
/// transaction holds a lock on its own virtual id from its start, before it has a real xid.
const TRANSACTIONS_OPEN: &str = "\
select coalesce(array_agg(l.virtualxid), '{}')
  from pg_locks l join pg_stat_activity a on a.pid = l.pid
 where l.locktype = 'virtualxid' and l.granted and l.pid <> pg_backend_pid() and a.datname = current_database()";

/// The transactions open in this database now (but the caller's), by virtual id.
pub(crate) async fn open_transactions(db: &impl Db) -> Result<Vec<String>> {
    Ok(one(db, TRANSACTIONS_OPEN, &[], "listing open transactions").await?.get(0))
}

const TRANSACTIONS_STILL_OPEN: &str = "\
select coalesce(array_agg(virtualxid), '{}') from pg_locks where locktype = 'virtualxid' and virtualxid = any($1)";

/// Which of the given transactions are still open.
pub(crate) async fn still_open(db: &impl Db, open: &[String]) -> Result<Vec<String>> {
    Ok(one(db, TRANSACTIONS_STILL_OPEN, &[&open], "checking open transactions").await?.get(0))
}

/// Which of the given `(table, privilege)` pairs the current role lacks, and the role's name.
const PRIVILEGES_MISSING: &str = "\
select coalesce(array_agg(p.privilege || ' on ' || p.tab) filter (where not has_table_privilege(p.tab, p.privilege)), '{}')
         as missing,
       current_user::text as role
  from unnest($1::text[], $2::text[]) as p(tab, privilege)";

/// The privileges of `needed` (`(table, privilege)`) the current role lacks, as `PRIVILEGE on
/// table`, and the role's name.
pub(crate) async fn missing_privileges(db: &impl Db, needed: &[(&str, &str)]) -> Result<(Vec<String>, String)> {
    let (tables, privileges): (Vec<&str>, Vec<&str>) = needed.iter().copied().unzip();
    let row = one(db, PRIVILEGES_MISSING, &[&tables, &privileges], "checking the role's privileges").await?;
    Ok((row.get("missing"), row.get("role")))
}

const CURRENT_ROLE: &str = "select current_user::text";

/// The name of the role the connection runs as.
pub(crate) async fn current_role(db: &impl Db) -> Result<String> {
    let rows = all(db, CURRENT_ROLE, &[], "reading the current role").await?;
    Ok(rows.first().map(|r| r.get(0)).unwrap_or_default())
}

/// How many ids of the outbox's sequence each session takes at once.
const ID_SEQUENCE_CACHE: &str = "\
select s.seqcache from pg_sequence s where s.seqrelid = pg_get_serial_sequence('outbox_relay.outbox', 'id')::regclass";

/// The outbox's id sequence's cache (1 unless it was altered): above 1, sessions take ids in
/// blocks, and the ids of one key's events no longer follow the order they were written in.
pub(crate) async fn id_sequence_cache(db: &impl Db) -> Result<i64> {
    let rows = all(db, ID_SEQUENCE_CACHE, &[], "reading the outbox's id sequence").await?;
    Ok(rows.first().map_or(1, |row| row.get("seqcache")))
}
