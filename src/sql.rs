//! Every statement the library runs, in one place, named noun first for what it does.
//! DDL lives in `migrations/`.

/// A duration as the microseconds the statements below multiply by `interval '1 microsecond'`.
pub(crate) fn micros(d: std::time::Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

/// Serializes migrations across processes: `pg_advisory_xact_lock(MIGRATION_LOCK_KEY)`.
/// The number is the first 8 bytes of sha256("outbox_relay.migrate").
pub(crate) const MIGRATION_LOCK_KEY: i64 = 0x6f75_7462_6f78_6d31;

pub(crate) const MIGRATION_LOCK: &str = "select pg_advisory_xact_lock($1)";

pub(crate) const MIGRATION_TABLE_CREATE: &str = "\
create schema if not exists outbox_relay;
create table if not exists outbox_relay.schema_migrations (
    version    integer primary key,
    name       text not null,
    checksum   text not null,
    applied_at timestamptz not null default now()
)";

pub(crate) const MIGRATION_LIST: &str =
    "select version, name, checksum from outbox_relay.schema_migrations order by version";

/// Which of the given `(table, privilege)` pairs the current role lacks, and the role's name.
pub(crate) const RELAY_PRIVILEGES: &str = "\
select coalesce(array_agg(p.privilege || ' on ' || p.tab) filter (where not has_table_privilege(p.tab, p.privilege)), '{}'),
       current_user::text
  from unnest($1::text[], $2::text[]) as p(tab, privilege)";

pub(crate) const MIGRATION_RECORD: &str =
    "insert into outbox_relay.schema_migrations (version, name, checksum) values ($1, $2, $3)";

pub(crate) const EVENT_INSERT: &str = "\
insert into outbox_relay.outbox (topic, key, payload, available_at)
values ($1, $2, $3, now() + $4::int8 * interval '1 microsecond')
returning id";

/// Inserts many events in one statement; the ids come back in input order.
pub(crate) const EVENT_INSERT_MANY: &str = "\
insert into outbox_relay.outbox (topic, key, payload, available_at)
select topic, key, payload, now() + delay * interval '1 microsecond'
  from unnest($1::text[], $2::text[], $3::jsonb[], $4::int8[]) with ordinality as e(topic, key, payload, delay, n)
 order by n
returning id";

pub(crate) const AUDIT_INSERT: &str = "\
insert into outbox_relay.audit (entity, entity_id, action, data, idempotency_key)
values ($1, $2, $3, $4, $5)
returning id";

/// Claims an idempotency key: returns a row when this transaction now owns the key. When another
/// transaction holds the key uncommitted, this waits for it to end.
pub(crate) const IDEMPOTENCY_CLAIM: &str = "\
insert into outbox_relay.idempotency (key, fingerprint) values ($1, $2)
on conflict (key) do nothing
returning key";

pub(crate) const IDEMPOTENCY_GET: &str = "select fingerprint, response from outbox_relay.idempotency where key = $1";

/// Fills in the response of the receipt this transaction claimed (migration 0003's function, so
/// that writers need no UPDATE on receipts).
pub(crate) const IDEMPOTENCY_STORE_RESPONSE: &str = "select outbox_relay.store_response($1, $2)";

/// Claims up to `$1` deliverable events for a lease of `$2` microseconds under token `$3`.
/// SKIP LOCKED lets many workers and processes claim side by side without waiting on each other.
/// The lease moves `available_at` forward, so an event whose worker died comes back when it ends;
/// `attempts` counts claims, so an event that crashes its worker still runs out of attempts.
/// `age_us` is the event's age at the claim on the server's clock (no clock skew).
///
/// No row may fail the statement, whoever wrote it: `attempts` stops short of the integer's end,
/// and `age_us` is null for a `created_at` outside 1970 to 9999 (such an event is dead-lettered).
pub(crate) const EVENT_CLAIM: &str = "\
with claimable as (
    select id from outbox_relay.outbox
     where processed_at is null and available_at <= now()
     order by available_at, id
     limit $1
       for update skip locked
)
update outbox_relay.outbox o
   set available_at = now() + $2::int8 * interval '1 microsecond',
       attempts = least(o.attempts, 2147483646) + 1,
       lease_token = $3
  from claimable c
 where o.id = c.id
returning o.id, o.topic, o.key, o.payload, o.created_at, o.attempts,
          case when o.created_at >= '1970-01-01 00:00:00+00' and o.created_at < '10000-01-01 00:00:00+00'
               then (extract(epoch from clock_timestamp() - o.created_at) * 1000000)::int8 end as age_us";

/// The earliest time a pending event becomes deliverable, for the relay's timer (an infinite
/// `available_at`, possible in rows older than migration 0003, is no moment to wake at).
pub(crate) const EVENT_NEXT_AVAILABLE: &str = "\
select (extract(epoch from min(available_at) - now()) * 1000000)::int8
  from outbox_relay.outbox where processed_at is null and isfinite(available_at)";

/// Records successful deliveries by keeping the rows with `processed_at`.
pub(crate) const EVENT_MARK_PROCESSED: &str = "\
update outbox_relay.outbox set processed_at = now(), lease_token = null, last_error = null
 where id = any($1) and lease_token = $2";

/// Records successful deliveries by deleting the rows.
pub(crate) const EVENT_DELETE_PROCESSED: &str =
    "delete from outbox_relay.outbox where id = any($1) and lease_token = $2";

/// Reschedules failed deliveries: per event a delay in microseconds and an error.
pub(crate) const EVENT_RESCHEDULE: &str = "\
update outbox_relay.outbox o
   set available_at = now() + f.delay_us * interval '1 microsecond', last_error = f.error, lease_token = null
  from unnest($1::int8[], $2::int8[], $3::text[]) as f(id, delay_us, error)
 where o.id = f.id and o.lease_token = $4";

/// Gives back claimed events that were never handed to the handler (shutdown): deliverable at
/// once, and the claim's attempt does not count.
pub(crate) const EVENT_RELEASE: &str = "\
update outbox_relay.outbox
   set available_at = now(), lease_token = null, attempts = greatest(attempts - 1, 0)
 where id = any($1) and lease_token = $2";

/// Moves events to the dead letters with their errors, keeping their ids.
pub(crate) const EVENT_BURY: &str = "\
with failed as (
    delete from outbox_relay.outbox o
     using unnest($1::int8[], $2::text[]) as f(id, error)
     where o.id = f.id and o.lease_token = $3
    returning o.id, o.topic, o.key, o.payload, o.created_at, o.attempts, f.error
)
insert into outbox_relay.dead_letters (id, topic, key, payload, created_at, attempts, last_error)
select id, topic, key, payload, created_at, attempts, error from failed
on conflict (id) do update
   set attempts = excluded.attempts, last_error = excluded.last_error, failed_at = now()";

/// Deletes up to `$2` events processed before `$1` microseconds ago; rows others are deleting are skipped.
pub(crate) const EVENT_DELETE_EXPIRED: &str = "\
delete from outbox_relay.outbox where id in (
    select id from outbox_relay.outbox
     where processed_at < now() - $1::int8 * interval '1 microsecond'
     order by id
     limit $2
       for update skip locked
)";

/// Deletes up to `$2` idempotency receipts older than `$1` microseconds.
pub(crate) const IDEMPOTENCY_DELETE_EXPIRED: &str = "\
delete from outbox_relay.idempotency where key in (
    select key from outbox_relay.idempotency
     where created_at < now() - $1::int8 * interval '1 microsecond'
     order by created_at
     limit $2
       for update skip locked
)";

/// Milliseconds from `$t` to now (null when `$t` is), for any timestamp a row may hold: clamped,
/// never an error.
macro_rules! age_ms {
    ($t:literal) => {
        concat!(
            "(case when ",
            $t,
            " is not null then ",
            "(least(greatest(extract(epoch from now()) - extract(epoch from ",
            $t,
            "), -9e12), 9e12) * 1000)::int8 end)"
        )
    };
}

/// The queue at a glance.
pub(crate) const QUEUE_STATS: &str = concat!(
    "select count(*) filter (where processed_at is null and available_at <= now()),
       count(*) filter (where processed_at is null and available_at > now() and lease_token is null),
       count(*) filter (where processed_at is null and available_at > now() and lease_token is not null),
       count(*) filter (where processed_at is not null),
       (select count(*) from outbox_relay.dead_letters),
       ",
    age_ms!("min(created_at) filter (where processed_at is null)"),
    ",
       ",
    age_ms!("min(available_at) filter (where processed_at is null and available_at <= now())"),
    ",
       coalesce(max(attempts) filter (where processed_at is null), 0),
       pg_notification_queue_usage()
  from outbox_relay.outbox"
);

/// The most common errors of pending events, with how many events have each, for `status`.
pub(crate) const EVENT_ERRORS_TOP: &str = "\
select last_error, count(*) from outbox_relay.outbox
 where processed_at is null and last_error is not null
 group by last_error order by count(*) desc, last_error limit $1";

/// The relays connected to this database: their listener connections, and whether each is
/// marked waiting for a notification.
pub(crate) const RELAYS_CONNECTED: &str = "\
select a.pid, coalesce(host(a.client_addr), 'local'), a.backend_start, coalesce(r.waiting, false)
  from pg_stat_activity a left join outbox_relay.relays r on r.listener_pid = a.pid
 where a.datname = current_database() and a.application_name = 'outbox-relay listener'
 order by a.backend_start";

pub(crate) const DEAD_LETTER_LIST: &str = "\
select id, topic, key, payload::text, created_at, attempts, last_error, failed_at
  from outbox_relay.dead_letters order by id limit $1";

/// Puts dead letters back into the outbox under their own ids, deliverable at once, attempts reset.
pub(crate) const DEAD_LETTER_RETRY: &str = "\
with revived as (
    delete from outbox_relay.dead_letters where id = any($1) or $2
    returning id, topic, key, payload, created_at
)
insert into outbox_relay.outbox (id, topic, key, payload, created_at)
select id, topic, key, payload, created_at from revived
returning id";

pub(crate) const DEAD_LETTER_PURGE: &str = "\
delete from outbox_relay.dead_letters where failed_at < now() - $1::int8 * interval '1 microsecond'";

/// Marks this relay as waiting: from the commit of this statement on, every insert notifies.
pub(crate) const RELAY_MARK_WAITING: &str = "\
insert into outbox_relay.relays (id, listener_pid, waiting) values ($1, $2, true)
on conflict (id) do update set waiting = true, listener_pid = excluded.listener_pid, updated_at = now()";

/// Marks this relay as busy: writers need not notify it.
pub(crate) const RELAY_MARK_BUSY: &str =
    "update outbox_relay.relays set waiting = false, updated_at = now() where id = $1";

pub(crate) const RELAY_REMOVE: &str = "delete from outbox_relay.relays where id = $1";

/// Removes relays whose listener backend is gone (crashed without removing themselves).
pub(crate) const RELAY_REMOVE_DEAD: &str = "\
delete from outbox_relay.relays where listener_pid not in (select pid from pg_stat_activity)";

/// The virtual transaction ids of every transaction open in this database now, but ours. Each
/// transaction holds a lock on its own virtual id from its start, before it has a real xid.
pub(crate) const TRANSACTIONS_OPEN: &str = "\
select coalesce(array_agg(l.virtualxid), '{}')
  from pg_locks l join pg_stat_activity a on a.pid = l.pid
 where l.locktype = 'virtualxid' and l.granted and l.pid <> pg_backend_pid() and a.datname = current_database()";

/// How many of the given virtual transactions are still open.
pub(crate) const TRANSACTIONS_STILL_OPEN: &str =
    "select count(*) from pg_locks where locktype = 'virtualxid' and virtualxid = any($1)";
