//! Ids are identities only within one life of the outbox: a parked copy or a dead letter keeps
//! its event's id after the outbox row is gone, and a new event with the same id is another
//! event.

use std::time::Duration;

use pg_outbox_relay::{DeliveryError, NewEvent, RelayConfig, handler_fn};
use serde_json::json;

use crate::harness::TestDb;
use crate::relay_support::{Running, config, count, eventually};

/// Refuses every event of the topic `refused` for good, takes the rest.
fn refusing() -> impl pg_outbox_relay::Handler + Clone {
    handler_fn(|event: pg_outbox_relay::Event| async move {
        if event.topic == "refused" { Err(DeliveryError::permanent("refused by the test")) } else { Ok(()) }
    })
}

/// Delivered rows deleted, so that their ids are free in the outbox.
fn quick() -> RelayConfig {
    RelayConfig { poll_interval: Duration::from_millis(100), retention: Duration::ZERO, ..config() }
}

/// What the parked events and dead letters hold: (id, uuid text) each, in id order.
async fn kept(client: &tokio_postgres::Client, table: &str) -> Vec<(i64, String)> {
    client
        .query(&format!("select id, uuid::text from outbox_relay.{table} order by id"), &[])
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect()
}

/// Until `parked` parked events and `dead` dead letters are kept.
async fn kept_until(client: &tokio_postgres::Client, parked: i64, dead: i64) {
    eventually("the parked events and dead letters kept", || async {
        count(client, "select count(*) from outbox_relay.parked").await == parked
            && count(client, "select count(*) from outbox_relay.dead_letters").await == dead
    })
    .await;
}

/// A relay that refuses the topic `refused`, one event parked (delayed an hour) and one
/// dead-lettered: the relay, their ids, and what the parked events and dead letters hold.
async fn one_parked_one_buried(db: &TestDb) -> (Running, i64, i64, Vec<(i64, String)>, Vec<(i64, String)>) {
    let client = db.client().await;
    let relay = crate::relay_support::start(&db.outbox, quick(), refusing());
    let later = NewEvent::new("order.later", json!({"n": 1})).delay(Duration::from_secs(3600));
    let waiting = db.outbox.publish(&later).await.unwrap();
    let refused = db.outbox.publish(&NewEvent::new("refused", json!({"n": 2}))).await.unwrap();
    kept_until(&client, 1, 1).await;
    eventually("their outbox rows removed (a retention of 0)", || async {
        count(&client, "select count(*) from outbox_relay.outbox").await == 0
    })
    .await;
    let (parked, dead) = (kept(&client, "parked").await, kept(&client, "dead_letters").await);
    assert_eq!((parked[0].0, dead[0].0), (waiting, refused));
    (relay, waiting, refused, parked, dead)
}

/// One event parked (delayed an hour) and one dead-lettered; then
/// `truncate outbox_relay.outbox restart identity`. The next events get ids past both, so a new
/// delayed event is parked beside the old one and a new refused event gets a dead letter of its
/// own: nothing merged, nothing dropped.
#[tokio::test]
async fn a_truncate_restarting_the_ids_keeps_them_past_the_parked_events_and_dead_letters() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let (relay, _, refused, parked_before, dead_before) = one_parked_one_buried(&db).await;

    client.batch_execute("truncate outbox_relay.outbox restart identity").await.unwrap();
    let later = db
        .outbox
        .publish(&NewEvent::new("order.later", json!({"n": 3})).delay(Duration::from_secs(3600)))
        .await
        .unwrap();
    let refused_again = db.outbox.publish(&NewEvent::new("refused", json!({"n": 4}))).await.unwrap();
    assert!(later > refused && refused_again > refused, "ids past the kept ones: {later}, {refused_again}");
    kept_until(&client, 2, 2).await;
    relay.stop().await;
    let parked = kept(&client, "parked").await;
    let dead = kept(&client, "dead_letters").await;
    assert_eq!(parked[0], parked_before[0], "the old parked event is untouched");
    assert_eq!(dead[0], dead_before[0], "the old dead letter is untouched");
    assert_eq!((parked[1].0, dead[1].0), (later, refused_again));
}

/// Ids written by hand that an older parked event and an older dead letter still carry: the
/// relay refuses to merge them (its claims fail, saying so) and keeps the new events in the
/// outbox; the old ones are untouched. Once the operator gives the new events fresh ids, both
/// reach their places.
#[tokio::test]
async fn events_given_an_old_events_id_by_hand_are_refused_and_kept() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let (relay, waiting, refused, parked_before, dead_before) = one_parked_one_buried(&db).await;

    // The delayed one must be parked (under the parked event's id); the refused one buried
    // (under the dead letter's id).
    for insert in [
        format!("insert into outbox_relay.outbox (id, topic, payload) values ({refused}, 'refused', '{{\"n\": 4}}')"),
        format!(
            "insert into outbox_relay.outbox (id, topic, payload, available_at)
             values ({waiting}, 'order.later', '{{\"n\": 3}}', now() + interval '1 hour')"
        ),
    ] {
        client.batch_execute(&insert).await.unwrap();
        // A claim that parks it fails; a delivery whose outcome cannot be recorded is claimed again.
        let tries = |m: pg_outbox_relay::MetricsSnapshot| m.claims + m.failed_claims;
        let before = tries(relay.snapshot());
        eventually("several claims met the reused id", || async { tries(relay.snapshot()) >= before + 4 }).await;
    }
    assert_eq!(kept(&client, "parked").await, parked_before, "the old parked event is untouched");
    assert_eq!(kept(&client, "dead_letters").await, dead_before, "the old dead letter is untouched");
    let in_outbox = "select count(*) from outbox_relay.outbox where not outbox_relay.passed_by_all(xid, id)";
    let rows = client
        .query("select id, topic, outbox_relay.passed_by_all(xid, id) from outbox_relay.outbox", &[])
        .await
        .unwrap();
    let rows: Vec<(i64, String, bool)> = rows.iter().map(|r| (r.get(0), r.get(1), r.get(2))).collect();
    assert_eq!(count(&client, in_outbox).await, 2, "the new events are kept: {rows:?}");

    // The operator's way out: the new events under fresh ids.
    client
        .batch_execute(&format!(
            "update outbox_relay.outbox set id = nextval('outbox_relay.outbox_id_seq'), xid = pg_current_xact_id()
              where id in ({waiting}, {refused}) and not outbox_relay.passed_by_all(xid, id)"
        ))
        .await
        .unwrap();
    kept_until(&client, 2, 2).await;
    relay.stop().await;
}
