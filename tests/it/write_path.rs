//! The atomic, idempotent write path: the article's checks.

use futures::future::join_all;
use pg_outbox_relay::{ErrorKind, Executed, NewEvent, Outbox, Payload, publish, publish_all};
use serde_json::{Value, json};

use crate::harness::TestDb;
use crate::orders::{Counts, ORDERS_TABLE, PlaceOrder, Placed, TestError, assert_settled, place_order};

async fn setup() -> TestDb {
    let db = TestDb::new().await;
    db.client().await.batch_execute(ORDERS_TABLE).await.unwrap();
    db
}

fn ana() -> PlaceOrder {
    PlaceOrder::ana()
}

async fn counts(db: &TestDb) -> Counts {
    Counts::read(&db.client().await).await
}

#[tokio::test]
async fn one_call_writes_order_audit_receipt_and_event_together() {
    let db = setup().await;
    let placed = place_order(&db.outbox, "key-1", &ana(), false).await.unwrap();
    assert!(!placed.replayed);
    assert_eq!(counts(&db).await, Counts::ONE_OF_EACH);

    let c = db.client().await;
    let id = placed.response.order_id;
    let audit = c
        .query_one("select entity, entity_id, action, data, idempotency_key from outbox_relay.audit", &[])
        .await
        .unwrap();
    assert_eq!(audit.get::<_, String>(0), "order");
    assert_eq!(audit.get::<_, String>(1), id.to_string());
    assert_eq!(audit.get::<_, String>(2), "placed");
    assert_eq!(audit.get::<_, Value>(3), json!({"customer": "ana", "total": 12.5}));
    assert_eq!(audit.get::<_, Option<String>>(4).as_deref(), Some("key-1"));

    let event = c
        .query_one("select topic, key, payload, not outbox_relay.passed_by_all(xid, id) from outbox_relay.outbox", &[])
        .await
        .unwrap();
    assert_eq!(event.get::<_, String>(0), "order.placed");
    assert_eq!(event.get::<_, Option<String>>(1), Some(id.to_string()));
    assert_eq!(event.get::<_, Value>(2), json!({"order_id": id, "customer": "ana", "key": "key-1"}));
    assert!(event.get::<_, bool>(3), "no destination passed it yet");

    let receipt = c.query_one("select response from outbox_relay.idempotency where key = 'key-1'", &[]).await.unwrap();
    assert_eq!(receipt.get::<_, Value>(0), json!({"order_id": id}));
}

#[tokio::test]
async fn the_same_key_replays_the_first_response_and_writes_nothing() {
    let db = setup().await;
    let first = place_order(&db.outbox, "key-1", &ana(), false).await.unwrap();
    let before = counts(&db).await;
    for _ in 0..3 {
        let again = place_order(&db.outbox, "key-1", &ana(), false).await.unwrap();
        assert!(again.replayed);
        assert_eq!(again.response, first.response);
    }
    assert_eq!(counts(&db).await, before);
    // another key is another order
    let other = place_order(&db.outbox, "key-2", &ana(), false).await.unwrap();
    assert!(!other.replayed);
    assert_ne!(other.response, first.response);
}

#[tokio::test]
async fn a_failure_after_all_writes_leaves_nothing_behind() {
    let db = setup().await;
    place_order(&db.outbox, "earlier", &ana(), false).await.unwrap();
    let before = counts(&db).await;
    let err = place_order(&db.outbox, "key-1", &ana(), true).await.unwrap_err();
    assert!(matches!(err, TestError::Injected), "{err:?}");
    assert_eq!(counts(&db).await, before);
    // the key was not consumed: a retry does the work
    let retry = place_order(&db.outbox, "key-1", &ana(), false).await.unwrap();
    assert!(!retry.replayed);
    assert_eq!(counts(&db).await.orders, before.orders + 1);
}

#[tokio::test]
async fn a_failure_at_commit_leaves_nothing_behind() {
    let db = setup().await;
    // A deferred constraint trigger fails the COMMIT itself, after every write including the
    // stored response: the latest point a real failure can happen.
    db.client()
        .await
        .batch_execute(
            "create function fail_commit() returns trigger language plpgsql as $$
             begin raise exception 'injected failure at commit'; end $$;
             create constraint trigger fail_at_commit after insert on orders
                 deferrable initially deferred for each row
                 when (new.customer = 'doomed') execute function fail_commit();",
        )
        .await
        .unwrap();
    place_order(&db.outbox, "earlier", &ana(), false).await.unwrap();
    let before = counts(&db).await;
    let doomed = PlaceOrder { customer: "doomed".into(), total: 1.0 };
    let err = place_order(&db.outbox, "key-1", &doomed, false).await.unwrap_err();
    match err {
        TestError::Outbox(e) => {
            assert_eq!(e.kind(), ErrorKind::Database);
            assert!(e.to_string().contains("injected failure at commit"), "{e}");
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(counts(&db).await, before);
}

/// The response is stored and the transaction committed in one round trip: when the store
/// fails on the server, the COMMIT that follows it rolls back, nothing is written, and the
/// connection goes on serving the next unit of work (no transaction left open, no stray
/// ROLLBACK answered out of turn).
#[tokio::test]
async fn a_response_the_server_refuses_to_store_rolls_back_everything() {
    let db = setup().await;
    let one_connection = Outbox::connect_with(db.database_url(), 1).await.unwrap();
    place_order(&one_connection, "earlier", &ana(), false).await.unwrap();
    let before = counts(&db).await;
    // Deleting its own receipt inside the work (the test's role owns the table) leaves
    // `store_response` nothing to fill in: it fails on the server, after every business write.
    let err = one_connection
        .execute("key-1", &json!({"customer": "ana"}), async |work| {
            let insert = work
                .prepare_cached("insert into orders (key, customer, total) values ($1, $2, 1) returning id")
                .await?;
            let id: i64 = work.query_one(&insert, &[&"key-1", &"ana"]).await.unwrap().get(0);
            work.publish(&NewEvent::new("order.placed", json!({"order_id": id}))).await?;
            work.execute("delete from outbox_relay.idempotency where key = 'key-1'", &[]).await.unwrap();
            Ok::<_, pg_outbox_relay::Error>(json!({"order_id": id}))
        })
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Database, "{err}");
    assert!(err.to_string().contains("no receipt for key 'key-1' was created by this transaction"), "{err}");
    assert_eq!(counts(&db).await, before, "nothing committed");

    // The same (only) connection: the key is free and the work runs and commits.
    let retry = place_order(&one_connection, "key-1", &ana(), false).await.unwrap();
    assert!(!retry.replayed);
    assert_eq!(counts(&db).await.orders, before.orders + 1);
    let again = place_order(&one_connection, "key-1", &ana(), false).await.unwrap();
    assert!(again.replayed);
    assert_eq!(again.response.order_id, retry.response.order_id);
}

async fn race(n: usize) {
    let db = setup().await;
    // Real tasks on a multi-threaded runtime, each on its own pooled connection.
    let calls = (0..n).map(|_| {
        let outbox = db.outbox.clone();
        tokio::spawn(async move { place_order(&outbox, "same-key", &ana(), false).await })
    });
    let results: Vec<_> = join_all(calls).await.into_iter().map(|r| r.unwrap().unwrap()).collect();
    assert_settled(&results);
    assert_eq!(counts(&db).await, Counts::ONE_OF_EACH);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn five_concurrent_calls_with_one_key_make_one_order() {
    race(5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_concurrent_calls_with_one_key_make_one_order() {
    race(50).await;
}

#[tokio::test]
async fn a_key_reused_for_another_request_is_refused_and_writes_nothing() {
    let db = setup().await;
    place_order(&db.outbox, "key-1", &ana(), false).await.unwrap();
    let before = counts(&db).await;
    let other = PlaceOrder { customer: "bruno".into(), total: 99.0 };
    match place_order(&db.outbox, "key-1", &other, false).await.unwrap_err() {
        TestError::Outbox(e) => {
            assert!(e.is_key_reused(), "{e:?}");
            assert!(e.to_string().contains("\"key-1\""), "{e}");
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(counts(&db).await, before);
}

#[tokio::test]
async fn bad_input_is_refused_with_a_clear_error_and_writes_nothing() {
    let db = setup().await;
    let outbox = &db.outbox;
    let expect_invalid = |r: Result<Executed<Placed>, TestError>, needle: &str| match r {
        Err(TestError::Outbox(e)) => {
            assert!(e.is_invalid_input(), "{e:?}");
            assert!(e.to_string().contains(needle), "{e} should mention {needle}");
        }
        other => panic!("expected invalid input, got {other:?}"),
    };
    expect_invalid(place_order(outbox, "", &ana(), false).await, "idempotency key must not be empty");
    let long = "k".repeat(NewEvent::MAX_KEY_LEN + 1);
    expect_invalid(place_order(outbox, &long, &ana(), false).await, "the limit is 255");

    let request = json!({"n": 1});
    let with_event = |event: NewEvent| {
        outbox.execute("key-x", &request, async move |work| {
            work.publish(&event).await?;
            Ok::<_, TestError>(Placed { order_id: 0 })
        })
    };
    expect_invalid(with_event(NewEvent::new("", json!({}))).await, "topic must not be empty");
    expect_invalid(with_event(NewEvent::new("t".repeat(256), json!({}))).await, "limit is 255");
    expect_invalid(with_event(NewEvent::new("order placed", json!({}))).await, "character ' '");
    let huge = json!({"blob": "x".repeat(Payload::MAX_BYTES)});
    expect_invalid(with_event(NewEvent::new("big", huge.clone())).await, "limit is 1040384");
    expect_invalid(with_event(NewEvent::new("order..placed", json!({}))).await, "has an empty word");
    expect_invalid(with_event(NewEvent::new("t", json!({"name": "a\u{0}b"}))).await, "NUL character");
    expect_invalid(with_event(NewEvent::new("t", json!({})).key("")).await, "event key must not be empty");

    // the low-level API refuses the same, before sending anything
    let client = db.client().await;
    assert!(publish(&client, &NewEvent::new("big", huge)).await.unwrap_err().is_invalid_input());
    assert_eq!(counts(&db).await, Counts::NOTHING);
}

#[tokio::test]
async fn an_unreachable_database_gives_an_error_naming_host_and_port_without_the_password() {
    let err = Outbox::connect("postgres://app:hunter2@127.0.0.1:1/nowhere").await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Connect, "{err:?}");
    let text = format!("{err} {err:?}");
    assert!(text.contains("127.0.0.1:1"), "{text}");
    assert!(!text.contains("hunter2"), "{text}");
}

#[tokio::test]
async fn events_in_the_callers_own_transaction_commit_and_roll_back_with_it() {
    let db = setup().await;
    let mut client = db.client().await;

    let tx = client.transaction().await.unwrap();
    tx.execute("insert into orders (key, customer, total) values ('k', 'ana', 1)", &[]).await.unwrap();
    publish(&tx, &NewEvent::new("order.placed", json!({"n": 1}))).await.unwrap();
    let ids = publish_all(&tx, &[NewEvent::new("a", json!(1)), NewEvent::new("b", json!(2)).key("k")]).await.unwrap();
    assert_eq!(ids.len(), 2);
    assert!(ids[0] < ids[1], "ids come back in input order");
    tx.rollback().await.unwrap();
    assert_eq!(counts(&db).await, Counts::NOTHING);

    let tx = client.transaction().await.unwrap();
    let ids = publish_all(&tx, &[NewEvent::new("a", json!(1)), NewEvent::new("b", json!(2)).key("k")]).await.unwrap();
    tx.commit().await.unwrap();
    let rows = client.query("select id, topic, key from outbox_relay.outbox order by id", &[]).await.unwrap();
    let got: Vec<(i64, String, Option<String>)> = rows.iter().map(|r| (r.get(0), r.get(1), r.get(2))).collect();
    assert_eq!(got, vec![(ids[0], "a".into(), None), (ids[1], "b".into(), Some("k".into()))]);
}

#[tokio::test]
async fn a_delayed_event_gets_a_later_available_at() {
    let db = setup().await;
    let id =
        db.outbox.publish(&NewEvent::new("later", json!({})).delay(std::time::Duration::from_secs(60))).await.unwrap();
    // interval has no native Rust type: compare in SQL
    let ok: bool = db
        .client()
        .await
        .query_one(
            "select available_at - created_at between interval '59 s' and interval '61 s' from outbox_relay.outbox where id = $1",
            &[&id],
        )
        .await
        .unwrap()
        .get(0);
    assert!(ok);
}
