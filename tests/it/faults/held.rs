//! Fault: the server ends the session of a held claim (`pg_terminate_backend`) while its batch
//! is being delivered.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pg_outbox_relay::{Event, NewEvent, RelayConfig, handler_fn};
use serde_json::json;
use tokio::sync::{Semaphore, mpsc};

use crate::harness::TestDb;
use crate::relay_support::{self as support, config, count, eventually};

/// The claim's session ends mid-delivery: the server rolls the claim back, so its events are
/// claimable at once (the lease is an hour) and are delivered again; the first delivery's
/// outcome cannot be recorded (its transaction is gone), which the relay logs, and nothing is
/// lost. Those events arrive twice: at-least-once delivery.
#[tokio::test]
async fn a_terminated_session_gives_its_held_claim_back_at_once() {
    let db = TestDb::new().await;
    let client = db.client().await;
    // The first delivery of each event waits until the test lets it finish; a redelivery
    // succeeds at once.
    let gate = Arc::new(Semaphore::new(0));
    let seen: Arc<Mutex<HashMap<i64, usize>>> = Arc::default();
    let (started_tx, mut started) = mpsc::unbounded_channel::<i64>();
    let handler = {
        let (gate, seen) = (gate.clone(), seen.clone());
        handler_fn(move |event: Event| {
            let (gate, seen, started_tx) = (gate.clone(), seen.clone(), started_tx.clone());
            async move {
                let first = {
                    let mut seen = seen.lock().unwrap();
                    let n = seen.entry(event.id).or_default();
                    *n += 1;
                    *n == 1
                };
                if first {
                    started_tx.send(event.id).ok();
                    gate.acquire().await.expect("the gate stays open").forget();
                }
                Ok(())
            }
        })
    };
    let relay_config = RelayConfig {
        lease: Duration::from_secs(3600),
        hold: Duration::from_secs(60),
        poll_interval: Duration::from_millis(100),
        ..config()
    };
    let relay = support::start(&db.outbox, relay_config, handler);
    db.outbox.publish_all(&(0..3).map(|n| NewEvent::new("t", json!(n))).collect::<Vec<_>>()).await.unwrap();
    for _ in 0..3 {
        started.recv().await.expect("a first delivery started");
    }
    let holder: i32 = client
        .query_one(
            // (its row locks gave it a transaction id; an empty claim beside it has none)
            "select pid from pg_stat_activity
              where datname = current_database() and state = 'idle in transaction' and backend_xid is not null",
            &[],
        )
        .await
        .expect("one session holds the claim")
        .get(0);
    assert!(client.query_one("select pg_terminate_backend($1)", &[&holder]).await.unwrap().get::<_, bool>(0));

    eventually("the events delivered again and recorded", || async {
        count(&client, "select count(*) from outbox_relay.outbox where processed_at is not null").await == 3
    })
    .await;
    // The first deliveries finish now; their transaction is gone, so nothing of them is recorded.
    gate.add_permits(3);
    let snapshot = relay.snapshot();
    relay.stop().await;
    assert_eq!(snapshot.delivered, 3, "only the redeliveries recorded: {snapshot:?}");
    assert!(seen.lock().unwrap().values().all(|n| *n == 2), "each event twice: {seen:?}");
    assert_eq!(count(&client, "select count(*) from outbox_relay.outbox where processed_at is null").await, 0);
    assert_eq!(count(&client, "select count(*) from outbox_relay.dead_letters").await, 0);
}
