//! A held claim turned into a lease: the lease is counted from when it is written, not from the
//! claim's start, so that a delivery that outlives the hold keeps its events for a whole lease and
//! is renewed in time, whatever the hold.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pg_outbox_relay::{NewEvent, RelayConfig, handler_fn};
use serde_json::json;

use crate::harness::TestDb;
use crate::relay_support::{self as support, config, eventually_within};

/// Two relays on one destination, every delivery slower than the lease, the hold at half the
/// lease (the longest it may be): no event is delivered twice, though nothing crashed.
async fn slow_deliveries_under_two_relays(lease: Duration, hold: Duration, delivery: Duration, events: usize) {
    let db = TestDb::new().await;
    let seen: Arc<Mutex<HashMap<i64, usize>>> = Arc::default();
    let handler = {
        let seen = seen.clone();
        handler_fn(move |event: pg_outbox_relay::Event| {
            let seen = seen.clone();
            async move {
                tokio::time::sleep(delivery).await;
                *seen.lock().unwrap().entry(event.id).or_default() += 1;
                Ok(())
            }
        })
    };
    let cfg = RelayConfig { lease, hold, poll_interval: Duration::from_millis(50), ..config() };
    let relays = [support::start(&db.outbox, cfg.clone(), handler.clone()), support::start(&db.outbox, cfg, handler)];
    let batch: Vec<NewEvent> = (0..events).map(|n| NewEvent::new("order.placed", json!({"n": n}))).collect();
    db.outbox.publish_all(&batch).await.unwrap();
    eventually_within("every event delivered", crate::faults::LONG_PATIENCE, || async {
        seen.lock().unwrap().len() == events
    })
    .await;
    for relay in relays {
        relay.stop().await;
    }
    let seen = seen.lock().unwrap().clone();
    let twice: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "lease {lease:?}, hold {hold:?}: delivered twice without a crash: {twice:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_after_a_hold_of_half_of_it_lasts_its_whole_length() {
    slow_deliveries_under_two_relays(
        Duration::from_secs(1),
        Duration::from_millis(500),
        Duration::from_millis(1500),
        20,
    )
    .await;
}

/// A delivery that outlives its hold (2 s) is leased for the whole lease (4 s) from then: the
/// parked row's `available_at` lies about 4 s ahead when the lease is written, not 4 s after the
/// claim's start (2 s ahead), which left the first renewal at the lease's very end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_is_counted_from_when_the_hold_ends() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let go = Arc::new(tokio::sync::Notify::new());
    let handler = {
        let go = go.clone();
        handler_fn(move |_event: pg_outbox_relay::Event| {
            let go = go.clone();
            async move {
                go.notified().await;
                Ok(())
            }
        })
    };
    let (lease, hold) = (Duration::from_secs(4), Duration::from_secs(2));
    let relay = support::start(&db.outbox, RelayConfig { lease, hold, ..config() }, handler);
    db.outbox.publish(&NewEvent::new("order.placed", json!({}))).await.unwrap();
    let ahead = "select extract(epoch from available_at - clock_timestamp())::float8 from outbox_relay.parked
                  where lease_token is not null";
    let left: f64 = crate::relay_support::until("the claim leased", || async {
        client.query_opt(ahead, &[]).await.unwrap().map(|row| row.get::<_, f64>(0))
    })
    .await;
    assert!(left > 2.5, "the lease has {left} s left when it is written; it lasts {lease:?}");
    go.notify_waiters();
    go.notify_one();
    relay.stop().await;
}

/// A hold as long as the lease is refused at the start, naming both.
#[test]
fn a_hold_as_long_as_the_lease_is_refused() {
    let cfg = RelayConfig { lease: Duration::from_secs(1), hold: Duration::from_secs(1), ..config() };
    let err = cfg.validate().unwrap_err().to_string();
    assert!(err.contains("hold (1s) is not shorter than the lease (1s)"), "{err}");
}
