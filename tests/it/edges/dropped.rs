//! A destination dropped while a relay serves it: refused while the relay's listener is
//! connected, also when the unlogged table of relays is empty (as after a crash restart of the
//! server); and a relay whose destination is removed under it anyway says so and registers it
//! again, so that what is published next still reaches it.

use pg_outbox_relay::{NewEvent, Route};
use serde_json::json;

use super::until_delivered;
use crate::harness::TestDb;
use crate::relay_support::{self as support, config, count, eventually, recorder};

#[tokio::test]
async fn a_drop_is_refused_while_a_relay_listens_though_the_relays_table_was_emptied() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let (handler, mut deliveries) = recorder();
    let relay = support::start_routes(&db.outbox, config(), vec![Route::new("erp", "#", handler).unwrap()]);
    let first = db.outbox.publish(&NewEvent::new("order.placed", json!({}))).await.unwrap();
    until_delivered(&mut deliveries, &[first]).await;
    eventually("the listener serves erp", || async {
        client
            .query_one(
                "select count(*) from pg_locks where locktype = 'advisory' and classid = 1869901933 and granted
                    and database = (select oid from pg_database where datname = current_database())",
                &[],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
            == 1
    })
    .await;
    // What a crash restart of the server does to the relays' marks.
    client.batch_execute("delete from outbox_relay.relays").await.unwrap();
    let refused = db.outbox.drop_destination("erp").await.unwrap_err().to_string();
    assert!(refused.contains("connected relay") && refused.contains("nothing was dropped"), "{refused}");
    relay.stop().await;
    // Stopped, the relay no longer holds it.
    db.outbox.drop_destination("erp").await.unwrap();
}

#[tokio::test]
async fn a_relay_whose_destination_was_removed_under_it_registers_it_again() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let (handler, mut deliveries) = recorder();
    let relay = support::start_routes(&db.outbox, config(), vec![Route::new("erp", "order.#", handler).unwrap()]);
    let first = db.outbox.publish(&NewEvent::new("order.placed", json!({}))).await.unwrap();
    until_delivered(&mut deliveries, &[first]).await;
    eventually("the delivery recorded", || async {
        count(&client, "select count(*) from outbox_relay.outbox where outbox_relay.passed_by_all(xid, id)").await == 1
    })
    .await;
    // An operator's hand past every check.
    client
        .batch_execute(
            "delete from outbox_relay.positions where destination = 'erp';
             delete from outbox_relay.destinations where name = 'erp'",
        )
        .await
        .unwrap();
    let next = db.outbox.publish(&NewEvent::new("order.placed", json!({}))).await.unwrap();
    eventually("erp registered again with its pattern", || async {
        client
            .query_opt("select 1 from outbox_relay.destinations where name = 'erp' and pattern = 'order.#'", &[])
            .await
            .unwrap()
            .is_some()
    })
    .await;
    let after = db.outbox.publish(&NewEvent::new("order.placed", json!({}))).await.unwrap();
    let arrived = until_delivered(&mut deliveries, &[after]).await;
    relay.stop().await;
    // `next` was published while erp had no position: it reaches erp or is the one event lost to
    // the operator's hand. With no destination left, erp starts again from the origin: `first`,
    // kept for the retention, may come once more (at least once; its uuid lets a consumer drop
    // it). Nothing else comes twice.
    assert!(arrived.iter().all(|id| *id == first || *id == next || *id == after), "{arrived:?}");
    assert!(
        deliveries.counts().iter().all(|(id, n)| *n == 1 || (*id == first && *n == 2)),
        "{:?}",
        deliveries.counts()
    );
}
