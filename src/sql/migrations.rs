//! The migrations' own bookkeeping (the migrations themselves are the files of `migrations/`).

use std::time::Duration;

use tokio_postgres::Transaction;

use crate::error::{Error, ErrorKind, Result};

/// Serializes migrations across processes: `pg_advisory_xact_lock(MIGRATION_LOCK_KEY)`.
/// The number is the first 8 bytes of sha256("outbox_relay.migrate").
const MIGRATION_LOCK_KEY: i64 = 0x6f75_7462_6f78_6d31;

const MIGRATION_LOCK: &str = "select pg_advisory_xact_lock($1)";

const MIGRATION_TABLE_CREATE: &str = "\
create schema if not exists outbox_relay;
create table if not exists outbox_relay.schema_migrations (
    version    integer primary key,
    name       text not null,
    checksum   text not null,
    applied_at timestamptz not null default now()
)";

const MIGRATION_LIST: &str = "select version, name, checksum from outbox_relay.schema_migrations order by version";

const MIGRATION_RECORD: &str =
    "insert into outbox_relay.schema_migrations (version, name, checksum) values ($1, $2, $3)";

/// A migration as the database recorded it.
pub(crate) struct AppliedMigration {
    pub(crate) version: i32,
    pub(crate) checksum: String,
}

fn fail(what: &str) -> impl FnOnce(tokio_postgres::Error) -> Error + '_ {
    move |e| Error::new(ErrorKind::Migration, format!("migrations failed while {what}")).with_source(e)
}

/// Takes the migration lock for the rest of `tx` (waiting for another migration as long as it
/// takes), then has every other lock of `tx` waited for at most `wait` (`lock_timeout`), and makes
/// sure the bookkeeping table exists.
pub(crate) async fn lock_migrations(tx: &Transaction<'_>, wait: Duration) -> Result<()> {
    tx.execute(MIGRATION_LOCK, &[&MIGRATION_LOCK_KEY]).await.map_err(fail("taking the lock"))?;
    let wait = format!("{}ms", wait.as_millis().max(1));
    tx.execute(LOCK_WAIT, &[&wait]).await.map_err(fail("setting lock_timeout"))?;
    tx.batch_execute(MIGRATION_TABLE_CREATE).await.map_err(fail("creating the migrations table"))
}

const LOCK_WAIT: &str = "select set_config('lock_timeout', $1, true)";

/// The sessions of this database holding locks on the schema's tables, the longest in a
/// transaction first (those whose age this role may not see before them), at most 3, for an
/// error: "pid 1234 (pg_dump, in a transaction for 47 s) holds outbox_relay's outbox, parked".
const LOCK_HOLDERS: &str = "\
select a.pid, coalesce(nullif(a.application_name, ''), a.usename::text, 'a session of another role') as who,
       extract(epoch from now() - a.xact_start)::int8 as secs,
       string_agg(distinct c.relname::text, ', ' order by c.relname::text) as tables
  from pg_locks l
  join pg_class c on c.oid = l.relation
  join pg_stat_activity a on a.pid = l.pid
 where l.granted and l.pid <> pg_backend_pid()
   and l.database = (select d.oid from pg_database d where d.datname = current_database())
   and c.relkind in ('r', 'p')
   and c.relnamespace = (select n.oid from pg_namespace n where n.nspname = 'outbox_relay')
 group by a.pid, who, secs
 order by secs desc nulls first
 limit 3";

/// Who holds locks on the schema's tables now ([`LOCK_HOLDERS`]), said in one line.
pub(crate) async fn lock_holders(client: &tokio_postgres::Client) -> Result<String> {
    let rows = client.query(LOCK_HOLDERS, &[]).await.map_err(|e| Error::database("reading who holds locks", e))?;
    if rows.is_empty() {
        return Ok("no other session holds a lock on the schema's tables now".to_string());
    }
    let holders: Vec<String> = rows
        .iter()
        .map(|r| {
            let (pid, who, secs, tables): (i32, String, Option<i64>, String) = (r.get(0), r.get(1), r.get(2), r.get(3));
            let age = secs.map_or("its transaction's age hidden from this role".to_string(), |secs| {
                format!("in a transaction for {secs} s")
            });
            format!("pid {pid} ({who}, {age}) holds outbox_relay's {tables}")
        })
        .collect();
    Ok(holders.join("; "))
}

/// Applies one migration's SQL and records it.
pub(crate) async fn apply_migration(
    tx: &Transaction<'_>,
    version: i32,
    name: &str,
    sql: &str,
    checksum: &str,
) -> Result<()> {
    tx.batch_execute(sql).await.map_err(fail(&format!("applying {version:04}_{name}")))?;
    tx.execute(MIGRATION_RECORD, &[&version, &name, &checksum]).await.map_err(fail("recording a migration"))?;
    Ok(())
}

/// The migrations applied so far; the raw error, so that the caller can tell a missing schema
/// from a missing privilege.
pub(crate) async fn applied_migrations(
    client: &impl tokio_postgres::GenericClient,
) -> std::result::Result<Vec<AppliedMigration>, tokio_postgres::Error> {
    let rows = client.query(MIGRATION_LIST, &[]).await?;
    Ok(rows.iter().map(|r| AppliedMigration { version: r.get("version"), checksum: r.get("checksum") }).collect())
}
