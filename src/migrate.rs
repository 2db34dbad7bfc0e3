//! Applies the SQL files of `migrations/` in order, each once, under an advisory lock.

use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::error::{Error, ErrorKind, Result};
use crate::sql;

/// One migration: a numbered plain SQL file from `migrations/`, compiled into the crate.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Migration {
    pub(crate) version: i32,
    pub(crate) name: &'static str,
    pub(crate) sql: &'static str,
}

/// All migrations, in the order they apply.
pub(crate) const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "create_outbox_tables",
        sql: include_str!("../migrations/0001_create_outbox_tables.sql"),
    },
    Migration {
        version: 2,
        name: "notify_only_waiting_relays",
        sql: include_str!("../migrations/0002_notify_only_waiting_relays.sql"),
    },
    Migration {
        version: 3,
        name: "harden_rows_and_writer_path",
        sql: include_str!("../migrations/0003_harden_rows_and_writer_path.sql"),
    },
    Migration {
        version: 4,
        name: "order_per_key_and_breaker",
        sql: include_str!("../migrations/0004_order_per_key_and_breaker.sql"),
    },
    Migration { version: 5, name: "claim_paths", sql: include_str!("../migrations/0005_claim_paths.sql") },
    Migration { version: 6, name: "pauses", sql: include_str!("../migrations/0006_pauses.sql") },
    Migration {
        version: 7,
        name: "payloads_as_written",
        sql: include_str!("../migrations/0007_payloads_as_written.sql"),
    },
    Migration { version: 8, name: "snapshot_reads", sql: include_str!("../migrations/0008_snapshot_reads.sql") },
    Migration {
        version: 9,
        name: "xid_is_the_inserters",
        sql: include_str!("../migrations/0009_xid_is_the_inserters.sql"),
    },
    Migration { version: 10, name: "delivery_limit", sql: include_str!("../migrations/0010_delivery_limit.sql") },
    Migration {
        version: 11,
        name: "global_event_ids_and_inbox",
        sql: include_str!("../migrations/0011_global_event_ids_and_inbox.sql"),
    },
    Migration { version: 12, name: "destinations", sql: include_str!("../migrations/0012_destinations.sql") },
    Migration { version: 13, name: "event_headers", sql: include_str!("../migrations/0013_event_headers.sql") },
    Migration { version: 14, name: "storage_edges", sql: include_str!("../migrations/0014_storage_edges.sql") },
    Migration { version: 15, name: "index_paths", sql: include_str!("../migrations/0015_index_paths.sql") },
    Migration {
        version: 16,
        name: "destination_expiry",
        sql: include_str!("../migrations/0016_destination_expiry.sql"),
    },
    Migration { version: 17, name: "early_deliveries", sql: include_str!("../migrations/0017_early_deliveries.sql") },
    Migration {
        version: 18,
        name: "events_in_notifications",
        sql: include_str!("../migrations/0018_events_in_notifications.sql"),
    },
    Migration { version: 19, name: "outbox_as_a_log", sql: include_str!("../migrations/0019_outbox_as_a_log.sql") },
    Migration {
        version: 20,
        name: "unit_of_work_in_sql",
        sql: include_str!("../migrations/0020_unit_of_work_in_sql.sql"),
    },
    Migration {
        version: 21,
        name: "cheaper_write_path",
        sql: include_str!("../migrations/0021_cheaper_write_path.sql"),
    },
    Migration {
        version: 22,
        name: "receipt_written_once",
        sql: include_str!("../migrations/0022_receipt_written_once.sql"),
    },
    Migration { version: 23, name: "early_records_lz4", sql: include_str!("../migrations/0023_early_records_lz4.sql") },
    Migration { version: 24, name: "outbox_in_leaves", sql: include_str!("../migrations/0024_outbox_in_leaves.sql") },
];

/// What a migration run did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct MigrationReport {
    /// Migrations applied by this run, as `(version, name)`, in order.
    pub applied: Vec<(i32, String)>,
    /// How many migrations were already in place.
    pub already_applied: usize,
}

impl Migration {
    fn checksum(&self) -> String {
        Sha256::digest(self.sql.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// How long an attempt's statements wait for a table lock at first (`lock_timeout`); each attempt
/// refused by a lock waits twice as long as the one before, up to [`LOCK_WAIT_MAX`]
/// ([`crate::Outbox::migrate`] runs the attempts).
pub(crate) const LOCK_WAIT_FIRST: Duration = Duration::from_millis(100);
pub(crate) const LOCK_WAIT_MAX: Duration = Duration::from_secs(2);

/// Between two attempts: the claims and writes that queued behind the last go first.
pub(crate) const LOCK_RETRY_PAUSE: Duration = Duration::from_millis(20);

/// One attempt at applying every pending migration, in one transaction, each table lock waited
/// for at most `wait`.
///
/// Safe when several processes migrate at once: they queue on a transaction-level advisory lock
/// taken before anything else, and each finds the others' work recorded. A migration that was
/// changed after it was applied is refused (its checksum differs).
pub(crate) async fn attempt(client: &mut tokio_postgres::Client, wait: Duration) -> Result<MigrationReport> {
    let tx = client.transaction().await.map_err(|e| {
        Error::new(ErrorKind::Migration, "migrations failed while starting a transaction").with_source(e)
    })?;
    sql::lock_migrations(&tx, wait).await?;
    let applied = sql::applied_migrations(&tx).await.map_err(|e| {
        Error::new(ErrorKind::Migration, "migrations failed while reading applied migrations").with_source(e)
    })?;
    check_known(&applied)?;
    let mut report = MigrationReport { applied: Vec::new(), already_applied: 0 };
    for migration in MIGRATIONS {
        let checksum = migration.checksum();
        if let Some(recorded) = applied.iter().find(|a| a.version == migration.version) {
            if recorded.checksum != checksum {
                return Err(Error::new(
                    ErrorKind::Migration,
                    format!(
                        "migration {} ({}) was changed after it was applied (checksum {} in the database, \
                         {checksum} in this build); add a new migration instead of editing an applied one",
                        migration.version, migration.name, recorded.checksum
                    ),
                ));
            }
            report.already_applied += 1;
            continue;
        }
        // Debug: what was applied is the report's to say (`outbox-relay migrate` prints it; at
        // info, each migration was shown twice, on stdout and in the log).
        tracing::debug!(version = migration.version, name = migration.name, "applying migration");
        sql::apply_migration(&tx, migration.version, migration.name, migration.sql, &checksum).await?;
        report.applied.push((migration.version, migration.name.to_string()));
    }
    tx.commit()
        .await
        .map_err(|e| Error::new(ErrorKind::Migration, "migrations failed while committing").with_source(e))?;
    Ok(report)
}

/// Refuses a database migrated by a newer version (a migration this build does not know).
fn check_known(applied: &[sql::AppliedMigration]) -> Result<()> {
    if let Some(unknown) = applied.iter().find(|a| MIGRATIONS.iter().all(|m| m.version != a.version)) {
        return Err(Error::new(
            ErrorKind::Migration,
            format!(
                "the database has migration {}, which this build does not know: it was migrated by a newer outbox-relay",
                unknown.version
            ),
        ));
    }
    Ok(())
}

/// Checks that the database has every migration of this build and none it does not know, with
/// an error that says what to do.
pub(crate) async fn check_applied(client: &tokio_postgres::Client) -> Result<()> {
    let applied = match sql::applied_migrations(client).await {
        Ok(applied) => applied,
        Err(e) => {
            use tokio_postgres::error::SqlState;
            let message = match e.code() {
                Some(code) if *code == SqlState::UNDEFINED_TABLE || *code == SqlState::INVALID_SCHEMA_NAME => {
                    "the outbox schema is missing in this database: run `outbox-relay migrate` (or Outbox::migrate) first"
                        .to_string()
                }
                Some(code) if *code == SqlState::INSUFFICIENT_PRIVILEGE => {
                    let role = sql::current_role(&sql::Unprepared(client)).await.unwrap_or_default();
                    format!(
                        "role {role:?} may not use the schema outbox_relay: grant it outbox_relayer or outbox_writer \
                         (migrations/optional/least_privilege_roles.sql)"
                    )
                }
                _ => return Err(Error::database("reading the applied migrations", e)),
            };
            return Err(Error::new(ErrorKind::Migration, message).with_source(e));
        }
    };
    let missing: Vec<String> = MIGRATIONS
        .iter()
        .filter(|m| applied.iter().all(|a| a.version != m.version))
        .map(|m| format!("{:04}_{}", m.version, m.name))
        .collect();
    if !missing.is_empty() {
        return Err(Error::new(
            ErrorKind::Migration,
            format!(
                "the database lacks migration{} {} of this outbox-relay: run `outbox-relay migrate` (or Outbox::migrate)",
                if missing.len() == 1 { "" } else { "s" },
                missing.join(", ")
            ),
        ));
    }
    check_known(&applied)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn migrations_are_numbered_in_order_and_match_their_files() {
        for (i, m) in MIGRATIONS.iter().enumerate() {
            assert_eq!(m.version as usize, i + 1);
            let file = format!("{}/migrations/{:04}_{}.sql", env!("CARGO_MANIFEST_DIR"), m.version, m.name);
            assert_eq!(std::fs::read_to_string(&file).unwrap(), m.sql, "{file}");
        }
    }
}
