//! Migrations: applied once, recorded, safe to run concurrently.

use futures::future::join_all;

use crate::harness::TestDb;

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
