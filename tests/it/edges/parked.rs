//! Parked events drain a batch at a claim: behind each key's head the claim takes the key's next
//! parked events that are due, handed over after it in order, instead of one event of a key per
//! claim.

use pg_outbox_relay::NewEvent;
use serde_json::json;

use super::until_delivered;
use crate::harness::TestDb;
use crate::relay_support::{self as support, config, count, eventually, recorder};

/// 2,000 events of one key and 1,000 over 100 other keys wait behind a paused topic; once it is
/// resumed they are delivered in a few dozen claims (one event of a key per claim took 2,000),
/// every key in id order, each event once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keys_parked_events_drain_a_batch_at_a_claim() {
    let db = TestDb::new().await;
    let client = db.client().await;
    assert!(db.outbox.pause(Some("order.placed")).await.unwrap());
    let (handler, mut deliveries) = recorder();
    let relay = support::start(&db.outbox, config(), handler);
    let mut ids = Vec::new();
    for chunk in 0..6 {
        let events: Vec<NewEvent> = (0..500)
            .map(|n| {
                let key = if chunk < 4 { "hot".to_string() } else { format!("k{}", n % 100) };
                NewEvent::new("order.placed", json!({"chunk": chunk, "n": n})).key(key)
            })
            .collect();
        ids.extend(db.outbox.publish_all(&events).await.unwrap());
    }
    eventually("every event parked behind the pause", || async {
        count(&client, "select count(*) from outbox_relay.parked").await == 3000
    })
    .await;
    let before = relay.snapshot().claims;
    assert!(db.outbox.resume(Some("order.placed")).await.unwrap());
    let arrived = until_delivered(&mut deliveries, &ids).await;
    let claims = relay.snapshot().claims - before;
    relay.stop().await;
    assert!(claims <= 60, "{claims} claims for 3,000 parked events");
    let keys: std::collections::HashMap<i64, String> = client
        .query("select id, key from outbox_relay.outbox", &[])
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    let mut last: std::collections::HashMap<&str, i64> = std::collections::HashMap::new();
    for id in &arrived {
        let key = keys[id].as_str();
        let previous = last.insert(key, *id);
        assert!(previous.is_none_or(|p| p < *id), "key {key}: {id} after {previous:?}");
    }
    assert!(deliveries.counts().values().all(|n| *n == 1));
}

/// The index entries of `parked` read (every statement of the relay reads it through an index;
/// the test's own counts read the table alone): PostgreSQL's counters, once the relay's
/// connections (named `application_name`) have ended, which flushes them.
async fn parked_entries_read(client: &tokio_postgres::Client, application_name: &str) -> i64 {
    eventually("the relay's connections closed", || async {
        let open: i64 = client
            .query_one(
                "select count(*) from pg_stat_activity where datname = current_database() and application_name = $1",
                &[&application_name],
            )
            .await
            .unwrap()
            .get(0);
        open == 0
    })
    .await;
    client.batch_execute("select pg_stat_clear_snapshot()").await.unwrap();
    count(
        client,
        "select coalesce(sum(idx_tup_read), 0)::int8 from pg_stat_user_indexes
          where schemaname = 'outbox_relay' and relname = 'parked'",
    )
    .await
}

/// Parking a backlog and draining it read a bounded number of `parked`'s entries per event,
/// however large the backlog: the relay's statements over `parked` are planned at each run, for
/// the table as it is then. Kept statements were planned at their first run, on the empty table
/// (never analyzed; autovacuum is off for it here, as it may be late anywhere), and then read
/// every parked event of the destination for each one they looked up: 6,000 events behind a
/// paused topic took seconds a batch to park and to drain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parking_and_draining_read_a_few_entries_per_event() {
    const EVENTS: i64 = 6000;
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "alter table outbox_relay.parked set (autovacuum_enabled = off);
             set enable_indexscan = off; set enable_indexonlyscan = off; set enable_bitmapscan = off",
        )
        .await
        .unwrap();
    let name = "parked_entries";
    let separator = if db.url.contains('?') { '&' } else { '?' };
    let outbox =
        pg_outbox_relay::Outbox::connect(&format!("{}{separator}application_name={name}", db.url)).await.unwrap();
    assert!(db.outbox.pause(Some("order.placed")).await.unwrap());
    let (handler, mut deliveries) = recorder();
    let relay = support::start(&outbox, config(), handler);
    let mut ids = Vec::new();
    for chunk in 0..EVENTS / 500 {
        let events: Vec<NewEvent> = (0..500)
            .map(|n| NewEvent::new("order.placed", json!({"chunk": chunk, "n": n})).key(format!("k{n}")))
            .collect();
        ids.extend(db.outbox.publish_all(&events).await.unwrap());
    }
    eventually("every event parked behind the pause", || async {
        count(&client, "select count(*) from outbox_relay.parked").await == EVENTS
    })
    .await;
    assert!(db.outbox.resume(Some("order.placed")).await.unwrap());
    until_delivered(&mut deliveries, &ids).await;
    relay.stop().await;
    drop(outbox);
    let read = parked_entries_read(&client, name).await;
    let by_index: Vec<String> = client
        .query(
            "select format('%s %s', indexrelname, idx_tup_read) from pg_stat_user_indexes
              where schemaname = 'outbox_relay' and relname = 'parked' order by 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    eprintln!("parking and draining {EVENTS} events read {read} index entries of parked: {by_index:?}");
    assert!(
        read < EVENTS * 30,
        "parking and draining {EVENTS} events read {read} index entries of parked: {by_index:?}"
    );
    assert!(deliveries.counts().values().all(|n| *n == 1));
}
