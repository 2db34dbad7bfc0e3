//! What the storage must do whatever its design (issue 20): deliver an event whose transaction
//! commits after later ids were delivered, never wait for an id a rolled-back transaction took,
//! and go on delivering, each event once, while another session holds a transaction (and its
//! snapshot) open for the whole run.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use pg_outbox_relay::{NewEvent, RelayConfig, publish};
use serde_json::json;

use crate::harness::TestDb;
use crate::relay_support::{self as support, Deliveries, RELAY_PLANNER_SETTINGS, config, count, eventually};

/// Takes deliveries until every id of `ids` has arrived; returns them in arrival order.
async fn until_delivered(deliveries: &mut Deliveries, ids: &[i64]) -> Vec<(i64, Option<String>)> {
    let mut missing: std::collections::HashSet<i64> = ids.iter().copied().collect();
    let mut arrived = Vec::new();
    while !missing.is_empty() {
        let delivered = deliveries.next().await;
        missing.remove(&delivered.event.id);
        arrived.push((delivered.event.id, delivered.event.key.clone()));
    }
    arrived
}

/// Commit order is not id order. Two transactions take ids first and commit last: one event
/// without a key, one with a key of its own. Fifty later events (both kinds) are delivered
/// meanwhile; a third transaction takes an id and rolls back. The two late events are delivered
/// once they commit (no claim position may pass over them), the rolled-back id holds nothing
/// up, and nothing arrives twice. Only the wake-up path runs: the fallback poll is an hour.
#[tokio::test]
async fn an_event_committed_after_later_ids_is_delivered() {
    let db = TestDb::new().await;
    let (recorder, mut deliveries) = support::recorder();
    let relay = support::start(&db.outbox, config(), recorder);
    let mut late = db.client().await;
    let mut late_keyed = db.client().await;
    let mut rolled_back = db.client().await;

    let late_tx = late.transaction().await.unwrap();
    let a = publish(&late_tx, &NewEvent::new("report.late", json!({"n": "a"}))).await.unwrap();
    let keyed_tx = late_keyed.transaction().await.unwrap();
    let b = publish(&keyed_tx, &NewEvent::new("report.late", json!({"n": "b"})).key("late-key")).await.unwrap();
    let gone_tx = rolled_back.transaction().await.unwrap();
    let gone = publish(&gone_tx, &NewEvent::new("report.gone", json!({"n": "gone"}))).await.unwrap();

    let later: Vec<NewEvent> = (0..50)
        .map(|n| {
            let event = NewEvent::new("order.placed", json!({"n": n}));
            if n % 2 == 0 { event.key(format!("order-{n}")) } else { event }
        })
        .collect();
    let later_ids = db.outbox.publish_all(&later).await.unwrap();
    assert!(later_ids.iter().all(|id| *id > a && *id > b && *id > gone), "the late events took the earlier ids");
    until_delivered(&mut deliveries, &later_ids).await;
    gone_tx.rollback().await.unwrap();
    let after_rollback = db.outbox.publish(&NewEvent::new("order.placed", json!({"n": 50}))).await.unwrap();
    until_delivered(&mut deliveries, &[after_rollback]).await;
    assert!(!deliveries.counts().contains_key(&a) && !deliveries.counts().contains_key(&b), "uncommitted");

    keyed_tx.commit().await.unwrap();
    late_tx.commit().await.unwrap();
    until_delivered(&mut deliveries, &[a, b]).await;
    // One more event through, so that anything delivered twice by then has arrived.
    let last = db.outbox.publish(&NewEvent::new("order.placed", json!({"n": 51}))).await.unwrap();
    until_delivered(&mut deliveries, &[last]).await;
    relay.stop().await;
    let counts = deliveries.counts();
    assert!(!counts.contains_key(&gone), "a rolled-back event is never delivered");
    assert_eq!(counts.len(), later_ids.len() + 4, "{counts:?}");
    assert!(counts.values().all(|n| *n == 1), "nothing delivered twice: {counts:?}");
}

/// A session holds a transaction open for the whole run (`begin; select txid_current();`, as a
/// report or `pg_dump` would), so vacuum can remove nothing the relay deletes; another holds one
/// that published an event at its start. Meanwhile 3,000 events, most with keys (200 keys) and
/// the rest without, are published in 30 rounds to a relay that deletes what it delivers.
/// Every event is delivered exactly once (nothing crashed), each key in id order, and the long
/// writer's event arrives once it commits.
#[tokio::test]
async fn delivery_goes_on_while_a_transaction_holds_its_snapshot() {
    let db = TestDb::new().await;
    let holder = db.client().await;
    holder.batch_execute("begin; select txid_current()").await.unwrap();
    let mut writer = db.client().await;
    let long_tx = writer.transaction().await.unwrap();
    let long = publish(&long_tx, &NewEvent::new("report.nightly", json!({}))).await.unwrap();

    let (recorder, mut deliveries) = support::recorder();
    let relay = support::start(&db.outbox, RelayConfig { retention: Duration::ZERO, ..config() }, recorder);
    let mut published = Vec::new();
    for round in 0..30 {
        let events: Vec<NewEvent> = (0..100)
            .map(|n| {
                let event = NewEvent::new("order.step", json!({"round": round, "n": n}));
                let g = round * 100 + n;
                if g % 5 == 4 { event } else { event.key(format!("order-{}", (g / 5) % 200)) }
            })
            .collect();
        published.extend(db.outbox.publish_all(&events).await.unwrap());
    }
    let arrived = until_delivered(&mut deliveries, &published).await;
    long_tx.commit().await.unwrap();
    until_delivered(&mut deliveries, &[long]).await;
    relay.stop().await;

    let holder_pid: i32 = holder.query_one("select pg_backend_pid()", &[]).await.unwrap().get(0);
    let held: bool = db
        .client()
        .await
        .query_one(
            "select backend_xid is not null and state = 'idle in transaction' from pg_stat_activity where pid = $1",
            &[&holder_pid],
        )
        .await
        .unwrap()
        .get(0);
    assert!(held, "the transaction was held open to the end");
    holder.batch_execute("rollback").await.unwrap();
    let counts: HashMap<i64, usize> = deliveries.counts();
    assert_eq!(counts.len(), published.len() + 1);
    assert!(counts.values().all(|n| *n == 1), "nothing delivered twice without a crash");
    let mut by_key: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for (id, key) in arrived {
        if let Some(key) = key {
            by_key.entry(key).or_default().push(id);
        }
    }
    assert_eq!(by_key.len(), 200);
    for (key, ids) in &by_key {
        assert!(ids.is_sorted(), "key {key} out of order: {ids:?}");
    }
    eventually("the delivered events are gone", || async { db.outbox.queue_stats().await.unwrap().pending == 0 }).await;
}

/// What `pg_dump` takes for the whole of its run (`ACCESS SHARE` on every table it dumps) stops
/// neither delivery nor the janitor: there is no rotation to wait for a stronger lock, and the
/// janitor's deletes (processed events, old positions) conflict with no lock a reader takes.
#[tokio::test]
async fn a_dump_in_progress_holds_up_neither_delivery_nor_the_janitor() {
    let db = TestDb::new().await;
    let dump = db.client().await;
    dump.batch_execute(
        "begin isolation level repeatable read;
         lock table outbox_relay.outbox, outbox_relay.positions, outbox_relay.dead_letters,
                    outbox_relay.idempotency, outbox_relay.parked, outbox_relay.destinations in access share mode",
    )
    .await
    .unwrap();
    let (recorder, mut deliveries) = support::recorder();
    let relay = support::start(&db.outbox, config(), recorder);
    let events: Vec<NewEvent> =
        (0..200).map(|n| NewEvent::new("order.step", json!({"n": n})).key(format!("order-{}", n % 20))).collect();
    let published = db.outbox.publish_all(&events).await.unwrap();
    until_delivered(&mut deliveries, &published).await;
    relay.stop().await;
    let cleaned = tokio::time::timeout(support::PATIENCE, db.outbox.cleanup(Duration::ZERO, Duration::ZERO, 50))
        .await
        .expect("the janitor did not wait for the dump's locks")
        .unwrap();
    assert_eq!(cleaned.events, 200, "every processed event deleted");
    let dump_pid: i32 = dump.query_one("select pg_backend_pid()", &[]).await.unwrap().get(0);
    let still: i64 = db
        .client()
        .await
        .query_one(
            "select count(*) from pg_locks where pid = $1 and granted and mode = 'AccessShareLock'
                and relation = 'outbox_relay.outbox'::regclass",
            &[&dump_pid],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(still, 1, "the dump still holds its lock on the outbox");
    dump.batch_execute("rollback").await.unwrap();
}

/// When `tests/fixtures/live_0007.sql` was written; its times are shifted by now() minus this.
const LIVE_0007_WRITTEN_AT: &str = "2026-12-01 20:42:45+00";

/// The migrations up to `upto`, as the releases of then applied and recorded them.
fn migrations_to(upto: i32) -> Vec<(i32, &'static str, &'static str)> {
    let all = [
        (1, "create_outbox_tables", include_str!("../../migrations/0001_create_outbox_tables.sql")),
        (2, "notify_only_waiting_relays", include_str!("../../migrations/0002_notify_only_waiting_relays.sql")),
        (3, "harden_rows_and_writer_path", include_str!("../../migrations/0003_harden_rows_and_writer_path.sql")),
        (4, "order_per_key_and_breaker", include_str!("../../migrations/0004_order_per_key_and_breaker.sql")),
        (5, "claim_paths", include_str!("../../migrations/0005_claim_paths.sql")),
        (6, "pauses", include_str!("../../migrations/0006_pauses.sql")),
        (7, "payloads_as_written", include_str!("../../migrations/0007_payloads_as_written.sql")),
        (8, "snapshot_reads", include_str!("../../migrations/0008_snapshot_reads.sql")),
        (9, "xid_is_the_inserters", include_str!("../../migrations/0009_xid_is_the_inserters.sql")),
        (10, "delivery_limit", include_str!("../../migrations/0010_delivery_limit.sql")),
        (11, "global_event_ids_and_inbox", include_str!("../../migrations/0011_global_event_ids_and_inbox.sql")),
        (12, "destinations", include_str!("../../migrations/0012_destinations.sql")),
        (13, "event_headers", include_str!("../../migrations/0013_event_headers.sql")),
        (14, "storage_edges", include_str!("../../migrations/0014_storage_edges.sql")),
        (15, "index_paths", include_str!("../../migrations/0015_index_paths.sql")),
        (16, "destination_expiry", include_str!("../../migrations/0016_destination_expiry.sql")),
        (17, "early_deliveries", include_str!("../../migrations/0017_early_deliveries.sql")),
        (18, "events_in_notifications", include_str!("../../migrations/0018_events_in_notifications.sql")),
        (19, "outbox_as_a_log", include_str!("../../migrations/0019_outbox_as_a_log.sql")),
        (20, "unit_of_work_in_sql", include_str!("../../migrations/0020_unit_of_work_in_sql.sql")),
        (21, "cheaper_write_path", include_str!("../../migrations/0021_cheaper_write_path.sql")),
        (22, "receipt_written_once", include_str!("../../migrations/0022_receipt_written_once.sql")),
        (23, "early_records_lz4", include_str!("../../migrations/0023_early_records_lz4.sql")),
    ];
    all.into_iter().filter(|(v, _, _)| *v <= upto).collect()
}

/// Brings `db`, an empty database, to migration `upto` as the releases of then did it.
async fn migrate_as_released(db: &TestDb, upto: i32) {
    use sha2::Digest;
    let client = db.client().await;
    client
        .batch_execute(
            "create schema outbox_relay;
             create table outbox_relay.schema_migrations (
                 version integer primary key, name text not null, checksum text not null,
                 applied_at timestamptz not null default now())",
        )
        .await
        .unwrap();
    for (version, name, sql) in migrations_to(upto) {
        client.batch_execute(sql).await.unwrap();
        let checksum: String = sha2::Sha256::digest(sql.as_bytes()).iter().map(|b| format!("{b:02x}")).collect();
        client
            .execute(
                "insert into outbox_relay.schema_migrations (version, name, checksum) values ($1, $2, $3)",
                &[&version, &name, &checksum],
            )
            .await
            .unwrap();
    }
}

/// Loads the live installation of `tests/fixtures/live_0007.sql` into `db`, an empty database
/// brought to migration 0007 as that release did it, its times shifted so that what was due
/// later is as far ahead as it was; then migrates it with this build.
async fn load_live_0007(db: &TestDb) {
    migrate_as_released(db, 7).await;
    let client = db.client().await;
    client.batch_execute(include_str!("../fixtures/live_0007.sql")).await.unwrap();
    let shift = format!("(now() - '{LIVE_0007_WRITTEN_AT}'::timestamptz)");
    client
        .batch_execute(&format!(
            "update outbox_relay.outbox set created_at = created_at + {shift}, available_at = available_at + {shift},
                    processed_at = processed_at + {shift};
             update outbox_relay.dead_letters set created_at = created_at + {shift}, failed_at = failed_at + {shift};
             update outbox_relay.idempotency set created_at = created_at + {shift};
             update outbox_relay.pauses set paused_at = paused_at + {shift};"
        ))
        .await
        .unwrap();
    let report = db.outbox.migrate().await.unwrap();
    assert_eq!(report.applied.first().map(|(v, _)| *v), Some(8), "{report:?}");
}

/// Migration 0011 on a live installation: every event and dead letter there gets a uuid of its
/// own, and the rows someone wrote into the old inbox (bigint ids) are kept beside the new one.
#[tokio::test]
async fn a_live_installation_gets_a_uuid_per_event_and_keeps_its_old_inbox_rows() {
    let db = TestDb::empty().await;
    load_live_0007(&db).await;
    let client = db.client().await;
    let uuids: Vec<pg_outbox_relay::Uuid> = client
        .query(
            "select uuid from outbox_relay.outbox
             union all select uuid from outbox_relay.parked
             union all select uuid from outbox_relay.dead_letters",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(uuids.len(), 19, "every event and dead letter of the fixture");
    assert_eq!(uuids.iter().collect::<std::collections::HashSet<_>>().len(), uuids.len(), "one uuid each");
    let old: Vec<(String, i64)> = client
        .query("select consumer, event_id from outbox_relay.inbox_0001 order by event_id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(old, vec![("erp".to_string(), 1), ("erp".to_string(), 2)]);
    let mut client = client;
    let tx = client.transaction().await.unwrap();
    let inbox = pg_outbox_relay::inbox::Inbox::new("erp").unwrap();
    assert_eq!(inbox.record(&tx, uuids[0]).await.unwrap(), pg_outbox_relay::inbox::Recorded::New);
    tx.commit().await.unwrap();
}

/// A live installation written by the 0007 release (`tests/fixtures/live_0007.sql`): delivered
/// events kept, a dead letter, retries in backoff, a follower held by its key, a delayed event,
/// a paused topic, a lease of a killed relay, and events never claimed. Every figure survives,
/// a relay delivers exactly what is due (after the pause is lifted, the paused event too) and
/// nothing that waits, a retried dead letter is delivered, and the receipts replay; all after
/// migrating the installation to this build's storage (migrations 0008 and 0012: what waits is
/// parked for the destination `default`, which the relay of `Relay::new` delivers to).
#[tokio::test]
async fn a_live_0007_installation_keeps_its_events_dead_letters_and_receipts() {
    let db = TestDb::empty().await;
    load_live_0007(&db).await;
    let stats = db.outbox.queue_stats().await.unwrap();
    // Ready: 15, 17, 18, 19; held by its key: 7; delayed: the retries 6 and 8 and the event 14;
    // leased: 16.
    assert_eq!(
        (stats.pending, stats.held_by_key, stats.delayed, stats.in_flight, stats.retained, stats.dead_letters),
        (4, 1, 3, 1, 9, 1),
        "{stats:?}"
    );
    let dead = db.outbox.dead_letters(10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!((dead[0].id, dead[0].key.as_deref(), dead[0].attempts), (5, Some("acct-7"), 1));
    assert_eq!(dead[0].destination, "default");
    assert!(dead[0].last_error.contains("answered 400"), "{}", dead[0].last_error);
    assert_eq!(db.outbox.pauses().await.unwrap().len(), 1);

    let (recorder, mut deliveries) = support::recorder();
    let relay = support::start(&db.outbox, config(), recorder);
    // Due now: the three never claimed. The paused one once resumed, the dead letter once retried.
    until_delivered(&mut deliveries, &[17, 18, 19]).await;
    assert!(db.outbox.resume(Some("report.daily")).await.unwrap());
    until_delivered(&mut deliveries, &[15]).await;
    assert_eq!(db.outbox.retry_dead_letters(&[5]).await.unwrap(), vec![5]);
    until_delivered(&mut deliveries, &[5]).await;
    let sentinel = db.outbox.publish(&NewEvent::new("order.placed", json!({"n": "last"}))).await.unwrap();
    until_delivered(&mut deliveries, &[sentinel]).await;
    relay.stop().await;
    let mut delivered: Vec<i64> = deliveries.counts().into_keys().collect();
    delivered.sort_unstable();
    assert_eq!(
        delivered,
        vec![5, 15, 17, 18, 19, sentinel],
        "what waits (retries, the held key, the delay, the lease) waits"
    );
    assert!(deliveries.counts().values().all(|n| *n == 1));

    // Still waiting, as they were: the retries (attempts and errors kept), the follower of mail-1,
    // the delayed event, the lease of the killed relay; all for the destination `default`, and no
    // outbox row left unpassed.
    let waiting = db
        .client()
        .await
        .query(
            "select id, attempts, last_error is not null, lease_token is not null from outbox_relay.parked
              where destination = 'default'
             union all
             select id, 0, false, false from outbox_relay.outbox where not outbox_relay.passed_by_all(xid, id)
             order by id",
            &[],
        )
        .await
        .unwrap();
    let waiting: Vec<(i64, i32, bool, bool)> =
        waiting.iter().map(|r| (r.get(0), r.get(1), r.get(2), r.get(3))).collect();
    assert_eq!(
        waiting,
        vec![
            (6, 1, true, false),
            (7, 0, false, false),
            (8, 1, true, false),
            (14, 0, false, false),
            (16, 1, false, true)
        ]
    );

    // The receipts replay their responses.
    let replay = db
        .outbox
        .execute("order-req-1", &json!({"customer": "Ada", "total": 42.5}), async |_| {
            Ok::<_, pg_outbox_relay::Error>(json!({"order_id": "never"}))
        })
        .await
        .unwrap();
    assert!(replay.replayed);
    assert_eq!(replay.response, json!({"order_id": 1}));
}

/// Index entries and table rows of the outbox read so far in the current transaction.
pub(crate) const OUTBOX_TUPLES_READ: &str = "\
select (pg_stat_get_xact_tuples_returned('outbox_relay.outbox'::regclass)
        + (select coalesce(sum(pg_stat_get_xact_tuples_returned(i.indexrelid)), 0)
             from pg_index i where i.indrelid = 'outbox_relay.outbox'::regclass))::int8";

/// The relay's claim of new events (`src/sql/events.rs` runs it).
const CLAIM: &str = include_str!("../../src/sql/claim_new.sql");

/// The claim's cost does not grow with what was delivered while a snapshot is held: 5,000
/// events (1,000 keys, a fifth without a key) are delivered and deleted while another session
/// holds a transaction open, so that vacuum can remove none of them; a claim of one new event
/// then reads a handful of the outbox's index entries and rows (PostgreSQL's own counters of the
/// claim's transaction), not the 5,000 dead ones. With generic plans, as the relay runs it.
#[tokio::test]
async fn a_claim_reads_no_entry_of_the_events_delivered_before() {
    let db = TestDb::new().await;
    let holder = db.client().await;
    holder.batch_execute("begin; select txid_current()").await.unwrap();
    let (recorder, mut deliveries) = support::recorder();
    // Every claim held to its end (a lease would park its events: churn per lease, which the
    // parked indexes hold; this test is about the new events' path).
    let relay_config = RelayConfig {
        retention: Duration::ZERO,
        hold: Duration::from_secs(60),
        lease: Duration::from_secs(300),
        ..config()
    };
    let relay = support::start(&db.outbox, relay_config, recorder);
    let mut published = Vec::new();
    for round in 0..10 {
        let events: Vec<NewEvent> = (0..500)
            .map(|n| {
                let event = NewEvent::new("order.step", json!({"round": round, "n": n}));
                if n % 5 == 4 { event } else { event.key(format!("order-{}", (round * 500 + n) % 1000)) }
            })
            .collect();
        published.extend(db.outbox.publish_all(&events).await.unwrap());
    }
    until_delivered(&mut deliveries, &published).await;
    let client = db.client().await;
    eventually("the delivered events deleted", || async {
        client.query_one("select count(*) from outbox_relay.outbox", &[]).await.unwrap().get::<_, i64>(0) == 0
    })
    .await;
    relay.stop().await;
    // The destination the relay delivered to, and the number of its new events' lock.
    let lock_id: i32 = client
        .query_one("select lock_id from outbox_relay.destinations where name = 'default'", &[])
        .await
        .unwrap()
        .get(0);

    // The relay's session settings (see `relay_pool`), and statistics taken while the outbox
    // looks empty: the trap a generic plan built from them would fall into (reading the whole
    // table, every dead row with it, on every claim) is what the settings close.
    client.batch_execute(&format!("analyze outbox_relay.outbox; {RELAY_PLANNER_SETTINGS}")).await.unwrap();
    // The relay's claim of new events, as it runs it.
    for (key, expect) in [(Some("order-7"), 1), (None, 1)] {
        let mut event = NewEvent::new("order.step", json!({"late": true}));
        if let Some(key) = key {
            event = event.key(key);
        }
        let id = db.outbox.publish(&event).await.unwrap();
        client.batch_execute("begin").await.unwrap();
        let before: i64 = client.query_one(OUTBOX_TUPLES_READ, &[]).await.unwrap().get(0);
        let paused: Vec<String> = Vec::new();
        let every_topic: Option<String> = None;
        let batch_bytes = RelayConfig::DEFAULT_BATCH_BYTES as i64;
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 9] =
            [&500i64, &false, &paused, &"default", &lock_id, &every_topic, &batch_bytes, &0i32, &0i64];
        let rows = client.query(CLAIM, &params).await.unwrap();
        let rows: Vec<_> = rows.into_iter().filter(|r| r.get::<_, Option<i64>>(0).is_some()).collect();
        let read: i64 = client.query_one(OUTBOX_TUPLES_READ, &[]).await.unwrap().get::<_, i64>(0) - before;
        let by_index: Vec<String> = client
            .query(
                "select format('%s %s', c.relname, pg_stat_get_xact_tuples_returned(c.oid)) from pg_class c
                  where c.relnamespace = 'outbox_relay'::regnamespace and c.relname like 'outbox%'",
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        client.batch_execute("commit").await.unwrap();
        let ids: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
        assert_eq!(ids, vec![id; expect], "key {key:?}");
        assert!(
            read < 50,
            "a claim of one event (key {key:?}) read {read} index entries and rows of the outbox: {by_index:?}"
        );
    }
    holder.batch_execute("rollback").await.unwrap();
}

/// When `tests/fixtures/live_0013.sql` was written; its times are shifted by now() minus this.
const LIVE_0013_WRITTEN_AT: &str = "2026-12-05 08:50:31+00";

/// Loads the live installation of `tests/fixtures/live_0013.sql` (two destinations) into `db`,
/// an empty database brought to migration 0013 as that release did it, its times shifted so
/// that what was due later is as far ahead as it was; then migrates it with this build.
async fn load_live_0013(db: &TestDb) {
    migrate_as_released(db, 13).await;
    let client = db.client().await;
    client.batch_execute(include_str!("../fixtures/live_0013.sql")).await.unwrap();
    let shift = format!("(now() - '{LIVE_0013_WRITTEN_AT}'::timestamptz)");
    client
        .batch_execute(&format!(
            "alter table outbox_relay.outbox disable trigger user;
             update outbox_relay.outbox set created_at = created_at + {shift}, available_at = available_at + {shift},
                    processed_at = processed_at + {shift};
             alter table outbox_relay.outbox enable trigger user;
             update outbox_relay.parked set created_at = created_at + {shift}, available_at = available_at + {shift},
                    parked_at = parked_at + {shift};
             update outbox_relay.dead_letters set created_at = created_at + {shift}, failed_at = failed_at + {shift};
             update outbox_relay.idempotency set created_at = created_at + {shift};
             update outbox_relay.pauses set paused_at = paused_at + {shift};
             update outbox_relay.positions set at = at + {shift};"
        ))
        .await
        .unwrap();
    let report = db.outbox.migrate().await.unwrap();
    assert_eq!(report.applied.first().map(|(v, _)| *v), Some(14), "{report:?}");
}

/// A live installation written by the 0013 release (`tests/fixtures/live_0013.sql`, two
/// destinations: erp takes every topic, mailer `mail.#`), migrated to the outbox as a log
/// (migration 0019). Every state survives, at each destination: delivered events are retained
/// and read as delivered, the dead letters, the retries in backoff, the follower held by its key,
/// the pauses (one destination's, every destination's), the delay, the lease of the killed relay;
/// the events never claimed go to the destinations whose patterns match, once; a lifted pause
/// and a retried dead letter deliver; and nothing that waits is sent.
#[tokio::test]
async fn a_live_0013_installation_keeps_each_destinations_state_as_a_log() {
    let db = TestDb::empty().await;
    load_live_0013(&db).await;
    let client = db.client().await;
    let retained = "select count(*) from outbox_relay.outbox where outbox_relay.passed_by_all(xid, id)";
    assert_eq!(count(&client, "select count(*) from outbox_relay.outbox").await, 19);
    let state = |id: i64| {
        let client = &client;
        async move {
            client
                .query(
                    "select destination, state, attempts from outbox_relay.event_state where id = $1 order by destination",
                    &[&id],
                )
                .await
                .unwrap()
                .iter()
                .map(|r| (r.get::<_, Option<String>>(0).unwrap_or_default(), r.get::<_, String>(1), r.get::<_, i32>(2)))
                .collect::<Vec<_>>()
        }
    };
    let s = |d: &str, st: &str, a: i32| (d.to_string(), st.to_string(), a);
    assert_eq!(state(3).await, [s("erp", "delivered", 1), s("mailer", "delivered", 1)]);
    assert_eq!(state(6).await, [s("erp", "delivered", 1), s("mailer", "dead", 1)]);
    assert_eq!(state(7).await, [s("erp", "delivered", 1), s("mailer", "retrying", 1)]);
    assert_eq!(state(8).await, [s("erp", "delivered", 1), s("mailer", "waiting", 0)]);
    assert_eq!(state(9).await, [s("erp", "retrying", 1)]);
    assert_eq!(state(10).await, [s("erp", "dead", 1)]);
    assert_eq!(state(15).await, [s("erp", "delayed", 0), s("mailer", "delayed", 0)]);
    assert_eq!(state(16).await, [s("erp", "delivered", 1), s("mailer", "in flight", 1)]);
    assert_eq!(state(18).await, [s("erp", "pending", 0), s("mailer", "pending", 0)]);
    assert_eq!(count(&client, retained).await, 16, "1 to 16: every destination passed them");

    let (erp, mut to_erp) = support::recorder();
    let (mailer, mut to_mailer) = support::recorder();
    let routes = vec![
        pg_outbox_relay::Route::new("erp", "#", erp.labelled("erp")).unwrap(),
        pg_outbox_relay::Route::new("mailer", "mail.#", mailer.labelled("mailer")).unwrap(),
    ];
    let relay = support::start_routes(&db.outbox, config(), routes);
    until_delivered(&mut to_erp, &[17, 18, 19]).await;
    until_delivered(&mut to_mailer, &[18]).await;
    assert!(db.outbox.resume(Some("report.daily")).await.unwrap());
    until_delivered(&mut to_erp, &[14]).await;
    assert!(db.outbox.resume_destination("mailer", Some("mail.digest")).await.unwrap());
    until_delivered(&mut to_mailer, &[13]).await;
    assert_eq!(db.outbox.retry_dead_letters(&[10]).await.unwrap(), vec![10]);
    until_delivered(&mut to_erp, &[10]).await;
    let sentinel = db.outbox.publish(&NewEvent::new("mail.send", json!({"n": "last"})).key("mail-9")).await.unwrap();
    until_delivered(&mut to_erp, &[sentinel]).await;
    until_delivered(&mut to_mailer, &[sentinel]).await;
    relay.stop().await;
    let delivered = |counts: std::collections::HashMap<i64, usize>| {
        assert!(counts.values().all(|n| *n == 1), "{counts:?}");
        let mut ids: Vec<i64> = counts.into_keys().collect();
        ids.sort_unstable();
        ids
    };
    assert_eq!(delivered(to_erp.counts()), [10, 14, 17, 18, 19, sentinel]);
    assert_eq!(delivered(to_mailer.counts()), [13, 18, sentinel], "what waits (7, 8, 15, 16) waits");
    assert_eq!(state(7).await, [s("erp", "delivered", 1), s("mailer", "retrying", 1)]);
    assert_eq!(state(16).await, [s("erp", "delivered", 1), s("mailer", "in flight", 1)]);
    assert_eq!(state(13).await, [s("erp", "delivered", 1), s("mailer", "delivered", 1)]);
    assert_eq!(state(10).await, [s("erp", "delivered", 1)]);
    assert_eq!(count(&client, "select count(*) from outbox_relay.dead_letters").await, 1, "the mailer's, of 6");
    assert_eq!(count(&client, "select count(*) from outbox_relay.idempotency").await, 2);
    assert_eq!(count(&client, "select count(*) from outbox_relay.audit").await, 2);
    assert_eq!(count(&client, "select count(*) from outbox_relay.inbox").await, 4);
    // Nothing the migration kept is lost to the retention: a row is removed only once every
    // destination passed it and it is an hour old.
    assert_eq!(count(&client, "select count(*) from outbox_relay.outbox where id <= 19").await, 19);
}

/// The claim's byte bound takes the same events whether it sums the sizes in one pass (every
/// candidate stored inline) or one event at a time (a payload in TOAST among them): the longest
/// prefix in id order, at most the batch, whose payloads count no more than the bound (a payload
/// stored inline counts its stored size, a larger one its text's length), but always the first.
/// Checked on both of the claim's paths: the delta of new transactions and a cut delta going on
/// from its last id. The events lie in all four leaves in turn (migration 0024), where the same
/// tuple ids recur: each event comes back with its own payload, read from its own leaf.
#[tokio::test]
async fn the_claims_byte_bound_takes_the_same_events_summed_at_once_or_one_by_one() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let every = pg_outbox_relay::TopicPattern::parse("#").unwrap();
    let bound = 2_000i64;
    // Inline payloads of different sizes; then the same with payloads in TOAST among them (one
    // of them larger than the bound on its own, taken alone when it comes first).
    for (name, toasted) in [("inline", false), ("toasted", true)] {
        db.outbox.add_destination(name, &every, None).await.unwrap();
        client
            .execute(
                "insert into outbox_relay.outbox (topic, slot, payload)
                 select 'bytes.counted', (g % 4)::int2, jsonb_build_object('n', g,
                        'pad', case when $1 and g % 7 = 3
                                    then (select string_agg(md5(g::text || '.' || i), '') from generate_series(1, 40 + 20 * (g % 3)) i)
                                    else repeat('x', (g * 37) % 300) end)
                   from generate_series(1, 120) g",
                &[&toasted],
            )
            .await
            .unwrap();
        let stored_large: i64 = client
            .query_one(
                "select count(*) from outbox_relay.outbox where pg_column_size(payload) >= 1024 and topic = 'bytes.counted'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(stored_large > 0, toasted, "{name}: payloads in TOAST");
        let lock_id: i32 = client
            .query_one("select lock_id from outbox_relay.destinations where name = $1", &[&name])
            .await
            .unwrap()
            .get(0);
        let written: std::collections::HashMap<i64, i64> = client
            .query("select id, (payload->>'n')::int8 from outbox_relay.outbox where topic = 'bytes.counted'", &[])
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        let mut claimed = Vec::new();
        let mut claims = 0;
        loop {
            // What the bound should take from what is left, in id order.
            let left: Vec<(i64, i64)> = client
                .query(
                    "select id, outbox_relay.payload_bytes(payload) from outbox_relay.outbox
                      where topic = 'bytes.counted' and id > $1 order by id",
                    &[&claimed.last().copied().unwrap_or(0i64)],
                )
                .await
                .unwrap()
                .iter()
                .map(|r| (r.get(0), r.get(1)))
                .collect();
            let mut expected = Vec::new();
            let mut upto = 0;
            for (id, bytes) in left.iter().take(500) {
                upto += bytes;
                if !expected.is_empty() && upto > bound {
                    break;
                }
                expected.push(*id);
            }
            let paused: Vec<String> = Vec::new();
            let every_topic: Option<String> = None;
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 9] =
                [&500i64, &false, &paused, &name, &lock_id, &every_topic, &bound, &0i32, &0i64];
            let rows = client.query(CLAIM, &params).await.unwrap();
            let ids: Vec<i64> = rows.iter().filter_map(|r| r.get::<_, Option<i64>>(0)).collect();
            assert_eq!(ids, expected, "{name}: claim {claims}");
            for row in rows.iter().filter(|r| r.get::<_, Option<i64>>(0).is_some()) {
                let (id, payload): (i64, serde_json::Value) = (row.get(0), row.get(3));
                assert_eq!(payload["n"].as_i64(), written.get(&id).copied(), "{name}: event {id}'s own payload");
            }
            if ids.is_empty() {
                break;
            }
            claimed.extend(ids);
            claims += 1;
        }
        assert_eq!(claimed.len(), 120, "{name}: every event claimed once");
        assert!(claims > 10, "{name}: {claims} claims (the bound cut them)");
        client.execute("delete from outbox_relay.outbox", &[]).await.unwrap();
    }
}

/// Migration 0024 on an installation at 0023 that someone adjusted by hand: a check its old rows
/// break, left NOT VALID; the notification trigger disabled; autovacuum settings on the outbox;
/// and a view of the service's own on it, which the migration refuses, naming it (the view would
/// go on reading the old table), and applies once the view is gone. The old rows are the leaf
/// `outbox_before`, delivered with a new event; the check stays NOT VALID, the trigger disabled,
/// the settings and `xid`'s statistics target on the new leaves.
#[tokio::test]
async fn a_0023_outbox_becomes_leaves_keeping_its_rows_checks_triggers_and_settings() {
    let db = TestDb::empty().await;
    migrate_as_released(&db, 23).await;
    let client = db.client().await;
    client
        .batch_execute(
            "insert into outbox_relay.outbox (topic, payload)
             select 'order.placed', jsonb_build_object('n', g) from generate_series(1, 50) g;
             alter table outbox_relay.outbox drop constraint outbox_created_at_valid;
             alter table outbox_relay.outbox add constraint outbox_created_at_valid
                 check (created_at >= '1970-01-01 00:00:00+00' and created_at < '10000-01-01 00:00:00+00') not valid;
             alter table outbox_relay.outbox disable trigger outbox_notify_relay;
             alter table outbox_relay.outbox set (autovacuum_vacuum_scale_factor = 0.01);
             create view public.orders_told as select id, topic from outbox_relay.outbox;",
        )
        .await
        .unwrap();
    let refused = db.outbox.migrate().await.unwrap_err();
    assert!(refused.to_string().contains("public.orders_told"), "{refused}");
    assert_eq!(count(&client, "select count(*) from outbox_relay.schema_migrations where version = 24").await, 0);
    client.batch_execute("drop view public.orders_told").await.unwrap();
    let report = db.outbox.migrate().await.unwrap();
    assert_eq!(report.applied, vec![(24, "outbox_in_leaves".to_string())]);

    assert_eq!(count(&client, "select count(*) from outbox_relay.outbox where slot = -1").await, 50);
    assert_eq!(count(&client, "select count(*) from outbox_relay.outbox_before").await, 50);
    let kept = [
        "select count(*) from pg_constraint where conrelid = 'outbox_relay.outbox'::regclass
          and conname = 'outbox_created_at_valid' and not convalidated",
        "select count(*) from pg_trigger where tgrelid = 'outbox_relay.outbox'::regclass
          and tgname = 'outbox_notify_relay' and tgenabled = 'D'",
        "select count(*) from pg_class where oid = 'outbox_relay.outbox_2'::regclass
          and 'autovacuum_vacuum_scale_factor=0.01' = any (reloptions)",
        "select count(*) from pg_attribute where attrelid = 'outbox_relay.outbox_1'::regclass
          and attname = 'xid' and attoptions @> '{n_distinct=-1}'",
    ];
    for sql in kept {
        assert_eq!(count(&client, sql).await, 1, "{sql}");
    }
    let new = db.outbox.publish(&NewEvent::new("order.placed", json!({"n": 51}))).await.unwrap();
    assert_eq!(
        count(&client, &format!("select count(*) from outbox_relay.outbox where id = {new} and slot between 0 and 3"))
            .await,
        1,
        "a new event goes into a slot's leaf"
    );
    // The trigger disabled: the relay finds the events by its poll.
    let (handler, mut deliveries) = support::recorder();
    let relay =
        support::start(&db.outbox, RelayConfig { poll_interval: Duration::from_millis(100), ..config() }, handler);
    let delivered = deliveries.take(51).await;
    let mut ids: Vec<i64> = delivered.iter().map(|d| d.event.id).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 51, "each event once");
    relay.stop().await;
}
