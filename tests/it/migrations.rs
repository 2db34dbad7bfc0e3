//! Migrations: applied once, recorded, safe to run concurrently.

use std::time::Duration;

use futures::future::join_all;

use crate::harness::TestDb;
use crate::relay_support::count;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn migrations_apply_once_even_when_run_concurrently() {
    let db = TestDb::empty().await;
    let runs = join_all((0..4).map(|_| db.outbox.migrate())).await;
    let reports: Vec<_> = runs.into_iter().map(|r| r.expect("a concurrent migration failed")).collect();
    let applied: usize = reports.iter().map(|r| r.applied.len()).sum();
    // numbered files only: migrations/optional/ holds SQL an operator applies by hand
    let files = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/migrations"))
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with(|c: char| c.is_ascii_digit()))
        .count();
    assert_eq!(applied, files, "exactly one run applies each migration: {reports:?}");
    assert!(reports.iter().any(|r| r.applied.iter().any(|(v, name)| *v == 1 && name == "create_outbox_tables")));

    let again = db.outbox.migrate().await.unwrap();
    assert!(again.applied.is_empty());
    assert_eq!(again.already_applied, files);

    let recorded: i64 =
        db.client().await.query_one("select count(*) from outbox_relay.schema_migrations", &[]).await.unwrap().get(0);
    assert_eq!(recorded, files as i64);
}

#[tokio::test]
async fn a_migration_edited_after_it_was_applied_is_refused() {
    let db = TestDb::new().await;
    db.client()
        .await
        .batch_execute("update outbox_relay.schema_migrations set checksum = 'edited' where version = 1")
        .await
        .unwrap();
    let err = db.outbox.migrate().await.unwrap_err();
    assert_eq!(err.kind(), pg_outbox_relay::ErrorKind::Migration);
    assert!(err.to_string().contains("was changed after it was applied"), "{err}");
}

#[tokio::test]
async fn the_library_lives_in_its_own_schema() {
    let db = TestDb::new().await;
    let rows = db
        .client()
        .await
        .query(
            "select table_schema, table_name from information_schema.tables
              where table_schema not in ('pg_catalog', 'information_schema') order by 2",
            &[],
        )
        .await
        .unwrap();
    let tables: Vec<(String, String)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert!(tables.iter().all(|(schema, _)| schema == "outbox_relay"), "{tables:?}");
    for name in ["outbox", "audit", "idempotency", "dead_letters", "inbox", "relays", "schema_migrations"] {
        assert!(tables.iter().any(|(_, t)| t == name), "missing {name}: {tables:?}");
    }
}

/// Migration 0013 replaces `outbox_relay.publish` with a four-argument function: whoever could
/// execute the old one can execute the new one, and where EXECUTE was taken from PUBLIC, it
/// stays taken. (Applied by hand over 0001 to 0012, as an installation of the previous version
/// is.)
#[tokio::test]
async fn the_new_publish_function_keeps_the_old_ones_privileges() {
    const BEFORE: [&str; 12] = [
        include_str!("../../migrations/0001_create_outbox_tables.sql"),
        include_str!("../../migrations/0002_notify_only_waiting_relays.sql"),
        include_str!("../../migrations/0003_harden_rows_and_writer_path.sql"),
        include_str!("../../migrations/0004_order_per_key_and_breaker.sql"),
        include_str!("../../migrations/0005_claim_paths.sql"),
        include_str!("../../migrations/0006_pauses.sql"),
        include_str!("../../migrations/0007_payloads_as_written.sql"),
        include_str!("../../migrations/0008_snapshot_reads.sql"),
        include_str!("../../migrations/0009_xid_is_the_inserters.sql"),
        include_str!("../../migrations/0010_delivery_limit.sql"),
        include_str!("../../migrations/0011_global_event_ids_and_inbox.sql"),
        include_str!("../../migrations/0012_destinations.sql"),
    ];
    let db = TestDb::empty().await;
    let client = db.client().await;
    for sql in BEFORE {
        client.batch_execute(sql).await.unwrap();
    }
    let writer = format!("outbox_writer_{}", rand::random::<u32>());
    let stranger = format!("stranger_{}", rand::random::<u32>());
    client
        .batch_execute(&format!(
            "create role {writer}; create role {stranger};
             insert into outbox_relay.outbox (topic, payload) values ('before.upgrade', '{{}}');
             revoke execute on function outbox_relay.publish(text, jsonb, text) from public;
             grant execute on function outbox_relay.publish(text, jsonb, text) to {writer};"
        ))
        .await
        .unwrap();
    client.batch_execute(include_str!("../../migrations/0013_event_headers.sql")).await.unwrap();
    let may = |role: &str| {
        let client = &client;
        let role = role.to_string();
        async move {
            client
                .query_one(
                    "select has_function_privilege($1, 'outbox_relay.publish(text, jsonb, text, jsonb)', 'execute')",
                    &[&role],
                )
                .await
                .unwrap()
                .get::<_, bool>(0)
        }
    };
    assert!(may(&writer).await, "the writer's grant moved to the new function");
    assert!(!may(&stranger).await, "PUBLIC's EXECUTE stays revoked");
    let old: i64 = client
        .query_one(
            "select count(*) from pg_proc where oid::regprocedure::text = 'outbox_relay.publish(text,jsonb,text)'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(old, 0, "the three-argument function is gone");
    // A call with three arguments, as before, still works; the row written before has no headers.
    client.query_one("select outbox_relay.publish('after.upgrade', '{}', 'k')", &[]).await.unwrap();
    let nulls = count(&client, "select count(*) from outbox_relay.outbox where headers is null").await;
    assert_eq!(nulls, 2);
    // The unit of work in SQL (0020) goes to whoever may publish, and to no one else.
    for sql in [
        include_str!("../../migrations/0014_storage_edges.sql"),
        include_str!("../../migrations/0015_index_paths.sql"),
        include_str!("../../migrations/0016_destination_expiry.sql"),
        include_str!("../../migrations/0017_early_deliveries.sql"),
        include_str!("../../migrations/0018_events_in_notifications.sql"),
        include_str!("../../migrations/0019_outbox_as_a_log.sql"),
        include_str!("../../migrations/0020_unit_of_work_in_sql.sql"),
    ] {
        client.batch_execute(sql).await.unwrap();
    }
    for function in ["outbox_relay.begin_request(text, jsonb)", "outbox_relay.audit(text, text, text, jsonb, text)"] {
        for (role, expected) in [(&writer, true), (&stranger, false)] {
            let may: bool = client
                .query_one("select has_function_privilege($1, $2, 'execute')", &[role, &function])
                .await
                .unwrap()
                .get(0);
            assert_eq!(may, expected, "{role} on {function}");
        }
    }
    client.batch_execute(&format!("drop owned by {writer}; drop role {writer}; drop role {stranger}")).await.unwrap();
}

/// Migration 0022 has the Rust doors write a receipt with its response: every role that could
/// insert a receipt's fingerprint (the roles file's writer of earlier versions inserted only
/// the key and the fingerprint) may now insert its response too, and no one else. (Applied by
/// hand over 0001 to 0021, as an installation of the previous version is.)
#[tokio::test]
async fn writers_of_receipts_may_write_their_responses_after_0022() {
    let db = TestDb::empty().await;
    let client = db.client().await;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|f| f.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "sql"))
        .collect();
    files.sort();
    let (before, after): (Vec<_>, Vec<_>) =
        files.into_iter().partition(|p| p.file_name().unwrap().to_str().unwrap() < "0022");
    assert_eq!(before.len(), 21);
    assert!(after[0].ends_with("0022_receipt_written_once.sql"), "{after:?}");
    for path in &before {
        client.batch_execute(&std::fs::read_to_string(path).unwrap()).await.unwrap();
    }
    let writer = format!("outbox_writer_{}", rand::random::<u32>());
    let stranger = format!("stranger_{}", rand::random::<u32>());
    client
        .batch_execute(&format!(
            "create role {writer}; create role {stranger};
             grant insert (key, fingerprint), select (key, fingerprint, response) on outbox_relay.idempotency to {writer};
             grant select (key) on outbox_relay.idempotency to {stranger};"
        ))
        .await
        .unwrap();
    client.batch_execute(&std::fs::read_to_string(&after[0]).unwrap()).await.unwrap();
    for (role, expected) in [(&writer, true), (&stranger, false)] {
        let may: bool = client
            .query_one("select has_column_privilege($1, 'outbox_relay.idempotency', 'response', 'insert')", &[role])
            .await
            .unwrap()
            .get(0);
        assert_eq!(may, expected, "{role}");
    }
    client
        .batch_execute(&format!("drop owned by {writer}, {stranger}; drop role {writer}; drop role {stranger}"))
        .await
        .unwrap();
}

/// Migration 0023: a record early's ids are compressed with lz4 (pglz took 1.6 ms of the
/// server's CPU for each 2,000 ids), on a server built with lz4; one without keeps pglz and
/// migrates all the same.
#[tokio::test]
async fn a_record_earlys_ids_are_compressed_with_lz4_where_the_server_has_it() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let has_lz4 = match client.batch_execute("create temporary table lz4_probe (a text compression lz4)").await {
        Ok(()) => true,
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::FEATURE_NOT_SUPPORTED) => false,
        Err(e) => panic!("probing for lz4: {e}"),
    };
    client
        .execute(
            "insert into outbox_relay.early_deliveries (destination, token, ids)
             values ('default', 7, array(select g from generate_series(1::int8, 2000) g))",
            &[],
        )
        .await
        .unwrap();
    let method: Option<String> = client
        .query_one("select pg_column_compression(ids) from outbox_relay.early_deliveries where token = 7", &[])
        .await
        .unwrap()
        .get(0);
    let expected = if has_lz4 { "lz4" } else { "pglz" };
    assert_eq!(method.as_deref(), Some(expected), "the ids of a record early of 2,000 events");
    // (the column's own setting, whatever the server's default_toast_compression)
    let column: i8 = client
        .query_one(
            "select attcompression from pg_attribute
              where attrelid = 'outbox_relay.early_deliveries'::regclass and attname = 'ids'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(column as u8, if has_lz4 { b'l' } else { 0 }, "early_deliveries.ids's compression");
}

/// A session that holds what `pg_dump` holds on `early_deliveries` (the table migration 0023
/// alters) in a transaction of its own, named `pg_dump`; 0023 made pending again.
async fn dump_holding_early_deliveries(db: &TestDb) -> tokio_postgres::Client {
    let client = db.client().await;
    client.batch_execute("delete from outbox_relay.schema_migrations where version = 23").await.unwrap();
    let dump = db.client().await;
    dump.batch_execute(
        "set application_name = 'pg_dump'; begin isolation level repeatable read;
         lock table outbox_relay.early_deliveries in access share mode",
    )
    .await
    .unwrap();
    dump
}

/// A migration that needs a table lock another session holds waits for it a moment at a time:
/// the claims' reads of that table meanwhile are never queued behind it for long (they were,
/// until the holder ended), and the migration applies once the lock is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_waiting_for_a_lock_lets_readers_of_the_table_by() {
    let db = TestDb::new().await;
    let dump = dump_holding_early_deliveries(&db).await;
    let outbox = db.outbox.clone();
    let migration = tokio::spawn(async move { outbox.migrate().await });
    let reader = db.client().await;
    reader.batch_execute("set statement_timeout = '3s'").await.unwrap();
    for _ in 0..8 {
        tokio::time::sleep(Duration::from_millis(250)).await;
        reader
            .query_one("select count(*) from outbox_relay.early_deliveries", &[])
            .await
            .expect("a reader queued behind the waiting migration for at most a moment");
    }
    assert!(!migration.is_finished(), "the migration waits while the lock is held");
    dump.batch_execute("commit").await.unwrap();
    let report = migration.await.unwrap().expect("applied once the lock is free");
    assert_eq!(report.applied, vec![(23, "early_records_lz4".to_string())]);
}

/// A migration that cannot take its locks within the outbox's operation timeout fails saying
/// which session holds them, and applies nothing; run again once that session ended, it applies.
#[tokio::test]
async fn a_migration_that_cannot_take_its_locks_in_time_names_who_holds_them() {
    let db = TestDb::new().await;
    let dump = dump_holding_early_deliveries(&db).await;
    let err = db.outbox.clone().with_timeout(Duration::from_secs(2)).migrate().await.unwrap_err();
    assert_eq!(err.kind(), pg_outbox_relay::ErrorKind::Migration, "{err}");
    let message = err.to_string();
    for words in ["within 2s", "(pg_dump, in a transaction for", "early_deliveries", "nothing was applied"] {
        assert!(message.contains(words), "{words:?} in {message}");
    }
    let client = db.client().await;
    assert_eq!(count(&client, "select count(*) from outbox_relay.schema_migrations where version = 23").await, 0);
    dump.batch_execute("commit").await.unwrap();
    let report = db.outbox.migrate().await.unwrap();
    assert_eq!(report.applied, vec![(23, "early_records_lz4".to_string())]);
}
