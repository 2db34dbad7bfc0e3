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
