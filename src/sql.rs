//! Every statement the library runs, in one place, named noun first for what it does.
//! DDL lives in `migrations/`.

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

pub(crate) const IDEMPOTENCY_STORE_RESPONSE: &str = "update outbox_relay.idempotency set response = $2 where key = $1";
