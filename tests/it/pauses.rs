//! Pause and resume: kept in the database, seen by every relay within about a second, surviving
//! restarts; paused events stay pending and are charged nothing.

use std::time::Duration;

use pg_outbox_relay::{ErrorKind, NewEvent};
use serde_json::json;

use crate::harness::TestDb;
use crate::relay_support::{self as support, config, eventually, recorder};

/// The attempts charged to the event `id` at the destination `default`, and whether it still
/// waits for it: a copy parked for it, or an outbox row that no claim has passed yet (neither
/// once it is delivered or dead-lettered).
async fn attempts(db: &TestDb, id: i64) -> (i32, bool) {
    let row = db
        .client()
        .await
        .query_one(
            "select coalesce(p.attempts, 0), p.id is not null or not outbox_relay.passed_by_all(o.xid, o.id)
               from outbox_relay.outbox o
               full join (select * from outbox_relay.parked where destination = 'default') p on p.id = o.id
              where coalesce(o.id, p.id) = $1",
            &[&id],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

#[tokio::test]
async fn a_paused_topic_waits_across_a_relay_restart_and_goes_on_when_resumed() {
    let db = TestDb::new().await;
    assert!(db.outbox.pause(Some("mail.send")).await.unwrap());
    assert!(!db.outbox.pause(Some("mail.send")).await.unwrap(), "a second pause changes nothing");
    let pauses = db.outbox.pauses().await.unwrap();
    assert_eq!(pauses.len(), 1);
    assert_eq!(pauses[0].topic.as_deref(), Some("mail.send"));

    let (handler, mut deliveries) = recorder();
    let relay = support::start(&db.outbox, config(), handler.clone());
    eventually("the relay reads the pause", || async { relay.snapshot().paused_topics == 1 }).await;
    let paused = db.outbox.publish(&NewEvent::new("mail.send", json!({"to": "ana"}))).await.unwrap();
    // Later ids of another topic: had the paused event been claimable, a claim in id order would
    // have taken it first.
    let other = db.outbox.publish(&NewEvent::new("erp.sync", json!({}))).await.unwrap();
    assert_eq!(deliveries.next().await.event.id, other);
    relay.stop().await;
    assert_eq!(attempts(&db, paused).await, (0, true), "paused: pending, no attempt charged");

    // A new relay process reads the same pause from the database.
    let relay = support::start(&db.outbox, config(), handler);
    eventually("the new relay reads the pause", || async { relay.snapshot().paused_topics == 1 }).await;
    let other = db.outbox.publish(&NewEvent::new("erp.sync", json!({}))).await.unwrap();
    assert_eq!(deliveries.next().await.event.id, other);
    assert_eq!(attempts(&db, paused).await, (0, true));

    assert!(db.outbox.resume(Some("mail.send")).await.unwrap());
    assert!(!db.outbox.resume(Some("mail.send")).await.unwrap(), "nothing left to resume");
    let delivered = deliveries.next().await;
    assert_eq!((delivered.event.id, delivered.event.attempts), (paused, 1), "delivered on its first attempt");
    relay.stop().await;
    assert!(db.outbox.pauses().await.unwrap().is_empty());
}

#[tokio::test]
async fn a_pause_of_every_topic_stops_all_claims_until_it_is_lifted() {
    let db = TestDb::new().await;
    let (handler, mut deliveries) = recorder();
    let relay = support::start(&db.outbox, config(), handler);
    support::relay_waiting(&db.client().await).await;
    assert!(db.outbox.pause(None).await.unwrap());
    // A topic's own pause stays when the pause of every topic is lifted.
    assert!(db.outbox.pause(Some("kept.paused")).await.unwrap());
    eventually("the relay reads the pauses", || async {
        let s = relay.snapshot();
        s.paused_all && s.paused_topics == 1
    })
    .await;
    // A claim that began before the pauses were read (the pause's own notification wakes the
    // relay) may still be finishing: let it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let claims = relay.snapshot().claims;
    let wakeups = relay.snapshot().wakeups;
    let first = db.outbox.publish(&NewEvent::new("order.placed", json!({}))).await.unwrap();
    let kept = db.outbox.publish(&NewEvent::new("kept.paused", json!({}))).await.unwrap();
    eventually("the commit wakes the relay", || async { relay.snapshot().wakeups > wakeups }).await;
    // What a wrongly claimed event would need to arrive (no timing is asserted).
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(deliveries.is_empty(), "nothing is delivered while every topic is paused");
    assert_eq!(relay.snapshot().claims, claims, "no claim runs while every topic is paused");
    assert_eq!(attempts(&db, first).await, (0, true));

    assert!(db.outbox.resume(None).await.unwrap());
    let delivered = deliveries.next().await;
    assert_eq!((delivered.event.id, delivered.event.attempts), (first, 1));
    let left = db.outbox.pauses().await.unwrap();
    assert_eq!(left.iter().map(|p| p.topic.clone()).collect::<Vec<_>>(), vec![Some("kept.paused".to_string())]);
    let after = db.outbox.publish(&NewEvent::new("order.placed", json!({}))).await.unwrap();
    assert_eq!(deliveries.next().await.event.id, after);
    assert_eq!(attempts(&db, kept).await, (0, true), "its own pause holds it");
    relay.stop().await;
}

#[tokio::test]
async fn a_paused_head_holds_its_key_and_no_other() {
    let db = TestDb::new().await;
    let (handler, mut deliveries) = recorder();
    db.outbox.pause(Some("invoice.issue")).await.unwrap();
    let relay = support::start(&db.outbox, config(), handler);
    eventually("the relay reads the pause", || async { relay.snapshot().paused_topics == 1 }).await;
    let head = db.outbox.publish(&NewEvent::new("invoice.issue", json!({})).key("customer-1")).await.unwrap();
    let behind = db.outbox.publish(&NewEvent::new("invoice.mail", json!({})).key("customer-1")).await.unwrap();
    let other_key = db.outbox.publish(&NewEvent::new("invoice.mail", json!({})).key("customer-2")).await.unwrap();
    assert_eq!(deliveries.next().await.event.id, other_key);
    assert_eq!(attempts(&db, behind).await, (0, true), "order per key: it waits behind its paused head");
    db.outbox.resume(Some("invoice.issue")).await.unwrap();
    let order: Vec<i64> = deliveries.take(2).await.iter().map(|d| d.event.id).collect();
    assert_eq!(order, vec![head, behind]);
    relay.stop().await;
}

#[tokio::test]
async fn a_topic_that_no_event_could_have_is_refused() {
    let db = TestDb::new().await;
    for topic in ["", "has space", "a\u{0}b"] {
        let e = db.outbox.pause(Some(topic)).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "{topic:?}: {e}");
    }
    for topic in ["", "a\u{0}b"] {
        let e = db.outbox.resume(Some(topic)).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "{topic:?}: {e}");
    }
    assert!(db.outbox.pauses().await.unwrap().is_empty());
    // A pause written by hand, of a topic no event could have, can still be lifted.
    db.client().await.batch_execute("insert into outbox_relay.pauses (topic) values ('bad topic')").await.unwrap();
    assert!(db.outbox.resume(Some("bad topic")).await.unwrap());
}
