//! The migrations' own bookkeeping (the migrations themselves are the files of `migrations/`).

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

/// Takes the migration lock for the rest of `tx` and makes sure the bookkeeping table exists.
pub(crate) async fn lock_migrations(tx: &Transaction<'_>) -> Result<()> {
    tx.execute(MIGRATION_LOCK, &[&MIGRATION_LOCK_KEY]).await.map_err(fail("taking the lock"))?;
    tx.batch_execute(MIGRATION_TABLE_CREATE).await.map_err(fail("creating the migrations table"))
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
