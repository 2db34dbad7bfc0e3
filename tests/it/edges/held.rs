//! A transaction held open for minutes (a report, a forgotten `psql` session) costs the relay
//! nothing that grows with the hold: the sweeper's cursor goes past it and owes it its rows.

use std::time::Duration;

use pg_outbox_relay::{NewEvent, RelayConfig};
use serde_json::json;

use super::until_delivered;
use crate::harness::TestDb;
use crate::relay_support::{self as support, RELAY_PLANNER_SETTINGS, config, count, eventually, recorder};
use crate::storage::OUTBOX_TUPLES_READ;

/// The sweeper's statement, as the relay runs it (`src/sql/destinations.rs`).
const SWEEP: &str = include_str!("../../../src/sql/sweep.sql");

/// The claim of new events (`src/sql/claim.rs`).
const CLAIM: &str = include_str!("../../../src/sql/claim_new.sql");

/// Where a sweep starts: (xid, id) and the transactions it owes.
type Cursor = (String, i64, Vec<String>);

/// One sweep of at most 1,000 rows from `from`, removing what every destination passed (a
/// retention of 0); returns where the next one starts.
async fn sweep(client: &tokio_postgres::Client, from: &Cursor) -> Cursor {
    let row = client.query_one(SWEEP, &[&from.0, &1000i64, &0i64, &from.1, &from.2]).await.unwrap();
    (row.get("next_xid"), row.get("next_id"), row.get("owed"))
}

/// Sweeps from the first row until the cursor stops moving; returns where it stopped.
async fn caught_up(client: &tokio_postgres::Client) -> Cursor {
    let mut from: Cursor = ("0".to_string(), 0, Vec::new());
    for _ in 0..20 {
        let next = sweep(client, &from).await;
        let moved = (&next.0, next.1) != (&from.0, from.1);
        from = next;
        if !moved {
            break;
        }
    }
    from
}

/// 3,000 events delivered and deleted while another session holds a transaction with an id
/// open: vacuum can remove none of them. Once the sweeps have caught up, a sweep reads a handful
/// of the outbox's rows and index entries. Its cursor used to stop at the oldest transaction
/// running, so that every sweep (one a second) read again every row deleted since the hold
/// began: 3,000 here, 57,000 buffers a sweep after 90 s at 800 events/s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_reads_no_row_deleted_under_a_held_transaction() {
    let db = TestDb::new().await;
    let holder = db.client().await;
    holder.batch_execute("begin; select txid_current()").await.unwrap();
    let (handler, mut deliveries) = recorder();
    let relay = support::start(&db.outbox, RelayConfig { retention: Duration::ZERO, ..config() }, handler);
    let mut ids = Vec::new();
    for round in 0..6 {
        let events: Vec<NewEvent> = (0..500)
            .map(|n| NewEvent::new("order.step", json!({"round": round, "n": n})).key(format!("k{n}")))
            .collect();
        ids.extend(db.outbox.publish_all(&events).await.unwrap());
    }
    until_delivered(&mut deliveries, &ids).await;
    let client = db.client().await;
    eventually("the delivered events removed", || async {
        count(&client, "select count(*) from outbox_relay.outbox").await == 0
    })
    .await;
    relay.stop().await;
    client.batch_execute("set plan_cache_mode = force_generic_plan; set enable_seqscan = off").await.unwrap();
    let from = caught_up(&client).await;
    client.batch_execute("begin").await.unwrap();
    let before: i64 = client.query_one(OUTBOX_TUPLES_READ, &[]).await.unwrap().get(0);
    sweep(&client, &from).await;
    let read = client.query_one(OUTBOX_TUPLES_READ, &[]).await.unwrap().get::<_, i64>(0) - before;
    client.batch_execute("commit").await.unwrap();
    assert!(read < 50, "a sweep after 3,000 events deleted under a held transaction read {read} rows and entries");
    holder.batch_execute("rollback").await.unwrap();
}

/// A writer's transaction is still open when the sweeper's cursor goes past its id: once it
/// commits, its event (which no destination's pattern matches, so that only the sweeper can
/// finish it) still reaches the dead letters of the destination '', and nothing of it stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_open_while_the_sweeper_passes_it_is_swept_once_it_commits() {
    let db = TestDb::new().await;
    let writer = db.client().await;
    writer
        .batch_execute(
            "begin; insert into outbox_relay.outbox (topic, payload) values ('nobody.listens', '{\"late\": true}')",
        )
        .await
        .unwrap();
    let (handler, mut deliveries) = recorder();
    let route = pg_outbox_relay::Route::new("orders", "order.#", handler).unwrap();
    let relay = support::start_routes(&db.outbox, RelayConfig { retention: Duration::ZERO, ..config() }, vec![route]);
    // Later transactions commit and are delivered while the writer's stays open; the sweeper
    // (once a second) goes past the writer's id meanwhile.
    for round in 0..3 {
        let id = db.outbox.publish(&NewEvent::new("order.placed", json!({"round": round}))).await.unwrap();
        until_delivered(&mut deliveries, &[id]).await;
        tokio::time::sleep(Duration::from_millis(1100)).await;
    }
    writer.batch_execute("commit").await.unwrap();
    let client = db.client().await;
    eventually("the late event in the dead letters of ''", || async {
        count(
            &client,
            "select count(*) from outbox_relay.dead_letters where destination = '' and topic = 'nobody.listens'",
        )
        .await
            == 1
    })
    .await;
    eventually("its outbox row finished", || async {
        count(
            &client,
            "select count(*) from outbox_relay.outbox where topic = 'nobody.listens' and not outbox_relay.passed_by_all(xid, id)",
        )
        .await
            == 0
    })
    .await;
    relay.stop().await;
}

/// The pages of the outbox and of its indexes read in this transaction (PostgreSQL's counters):
/// an index walked with a condition on its second column returns only the entries that match,
/// but reads every page.
const OUTBOX_PAGES_READ: &str = "\
select (pg_stat_get_xact_blocks_fetched('outbox_relay.outbox'::regclass)
        + (select coalesce(sum(pg_stat_get_xact_blocks_fetched(i.indexrelid)), 0)
             from pg_index i where i.indrelid = 'outbox_relay.outbox'::regclass))::int8";

/// Runs `sql` in a transaction of its own; returns its rows and how many pages of the outbox
/// and of its indexes it read.
async fn reading(
    client: &tokio_postgres::Client,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> (Vec<tokio_postgres::Row>, i64) {
    client.batch_execute("begin").await.unwrap();
    let before: i64 = client.query_one(OUTBOX_PAGES_READ, &[]).await.unwrap().get(0);
    let rows = client.query(sql, params).await.unwrap();
    let read = client.query_one(OUTBOX_PAGES_READ, &[]).await.unwrap().get::<_, i64>(0) - before;
    client.batch_execute("commit").await.unwrap();
    (rows, read)
}

/// Statistics taken while the outbox looked empty (an analyze between two bursts, or under a
/// held transaction that keeps every deleted row) say 0 rows over many pages, with the columns'
/// statistics of an earlier analyze, and every index looks free to walk. The statements that find events by id (recording a delivery, the
/// sweeper's finish) then chose the `(xid, id)` index with the id as a condition on its second
/// column, and walked every page of it, dead entries included: 388 pages for 100,000 rows here,
/// a table's worth after minutes at 800 events/s (0.2 to 0.9 s a statement, until the next
/// analyze). With the relay's
/// session settings and generic plans, as it runs them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statements_by_id_read_a_few_entries_after_the_outbox_was_analyzed_empty() {
    const DEAD: i64 = 100_000;
    let db = TestDb::new().await;
    let holder = db.client().await;
    holder.batch_execute("begin; select txid_current()").await.unwrap();
    // The destination `default`, registered by a relay, its position past every event.
    let (handler, mut deliveries) = recorder();
    let relay = support::start(&db.outbox, RelayConfig { retention: Duration::ZERO, ..config() }, handler);
    let first = db.outbox.publish(&NewEvent::new("order.placed", json!({"first": true}))).await.unwrap();
    until_delivered(&mut deliveries, &[first]).await;
    relay.stop().await;
    let client = db.client().await;
    let lock_id: i32 = client
        .query_one("select lock_id from outbox_relay.destinations where name = 'default'", &[])
        .await
        .unwrap()
        .get(0);
    client
        .batch_execute(&format!(
            "insert into outbox_relay.outbox (topic, payload) select 'order.old', '{{}}' from generate_series(1, {DEAD});
             analyze outbox_relay.outbox;
             delete from outbox_relay.outbox;
             analyze outbox_relay.outbox;
             {RELAY_PLANNER_SETTINGS}"
        ))
        .await
        .unwrap();
    let statistics: f32 = client
        .query_one("select reltuples from pg_class where oid = 'outbox_relay.outbox'::regclass", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(statistics, 0.0, "the outbox analyzed while empty");
    let paused: Vec<String> = Vec::new();
    let every_topic: Option<String> = None;
    let batch_bytes = RelayConfig::DEFAULT_BATCH_BYTES as i64;
    let claim: [&(dyn tokio_postgres::types::ToSql + Sync); 9] =
        [&500i64, &false, &paused, &"default", &lock_id, &every_topic, &batch_bytes, &0i32, &0i64];
    // The claims and the sweeper caught up: the position and the cursor past the dead rows (each
    // read once, as they pass them).
    let id = db.outbox.publish(&NewEvent::new("order.placed", json!({"n": 0}))).await.unwrap();
    assert!(id > 0);
    reading(&client, CLAIM, &claim).await;
    let from = caught_up(&client).await;
    let mut reads = Vec::new();
    // A claim, and the sweeper's removal of the event it passed.
    let id = db.outbox.publish(&NewEvent::new("order.placed", json!({"n": 1}))).await.unwrap();
    let (rows, read) = reading(&client, CLAIM, &claim).await;
    assert!(rows.iter().any(|r| r.get::<_, Option<i64>>(0) == Some(id)));
    reads.push(("claim", read));
    let (rows, read) = reading(&client, SWEEP, &[&from.0, &1000i64, &0i64, &from.1, &from.2]).await;
    assert_eq!(rows[0].get::<_, i64>("finished"), 1, "the sweeper removed the event");
    reads.push(("a sweep", read));
    holder.batch_execute("rollback").await.unwrap();
    assert!(
        reads.iter().all(|(_, read)| *read < 50),
        "after {DEAD} rows deleted under a held transaction and the outbox analyzed empty, the statements read \
         {reads:?} pages of the outbox and its indexes"
    );
}
