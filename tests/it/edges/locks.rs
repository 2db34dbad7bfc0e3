//! Another session's row lock on an outbox row (`select ... for update`) holds up neither the
//! destination's other events nor its claims (which write no outbox row), and the sweeper skips
//! the row and removes it once the lock is gone.

use std::time::Duration;

use pg_outbox_relay::{NewEvent, RelayConfig};
use serde_json::json;

use super::until_delivered;
use crate::harness::TestDb;
use crate::relay_support::{self as support, config, count, eventually, recorder};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_locked_by_another_session_does_not_stall_its_destination() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let locked = db.outbox.publish(&NewEvent::new("order.placed", json!({"n": 1})).key("a")).await.unwrap();
    let mut locker = db.client().await;
    let lock = locker.transaction().await.unwrap();
    lock.execute("select 1 from outbox_relay.outbox where id = $1 for update", &[&locked]).await.unwrap();

    let (handler, mut deliveries) = recorder();
    let relay = support::start(&db.outbox, RelayConfig { retention: Duration::ZERO, ..config() }, handler);
    until_delivered(&mut deliveries, &[locked]).await;
    // Another key's events go on while the lock is held.
    for n in 0..3 {
        let next = db.outbox.publish(&NewEvent::new("order.placed", json!({"n": n})).key("b")).await.unwrap();
        until_delivered(&mut deliveries, &[next]).await;
    }
    eventually("the other rows removed", || async {
        count(&client, &format!("select count(*) from outbox_relay.outbox where id <> {locked}")).await == 0
    })
    .await;
    let present = format!("select count(*) from outbox_relay.outbox where id = {locked}");
    assert_eq!(count(&client, &present).await, 1, "the locked row waits for its lock");
    lock.commit().await.unwrap();
    eventually("the sweeper removes the row once it is free", || async { count(&client, &present).await == 0 }).await;
    relay.stop().await;
    assert!(deliveries.counts().values().all(|n| *n == 1), "nothing twice: {:?}", deliveries.counts());
}
