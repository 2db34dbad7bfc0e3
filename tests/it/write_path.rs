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

/// The receipt is written and the transaction committed in one round trip: when the receipt's
/// insert fails on the server, the COMMIT that follows it rolls back, nothing is written, and
/// the connection goes on serving the next unit of work (no transaction left open, no stray
/// ROLLBACK answered out of turn).
#[tokio::test]
async fn a_receipt_the_server_refuses_to_store_rolls_back_everything() {
    let db = setup().await;
    let one_connection = Outbox::connect_with(db.database_url(), 1).await.unwrap();
    place_order(&one_connection, "earlier", &ana(), false).await.unwrap();
    let before = counts(&db).await;
    // A receipt of the same key written inside the work (the test's role owns the table) makes
    // the final insert fail on the server, after every business write.
    let err = one_connection
        .execute("key-1", &json!({"customer": "ana"}), async |work| {
            let insert = work
                .prepare_cached("insert into orders (key, customer, total) values ($1, $2, 1) returning id")
                .await?;
            let id: i64 = work.query_one(&insert, &[&"key-1", &"ana"]).await.unwrap().get(0);
            work.publish(&NewEvent::new("order.placed", json!({"order_id": id}))).await?;
            work.execute(
                "insert into outbox_relay.idempotency (key, fingerprint, response) values ('key-1', '\\x00', '{}')",
                &[],
            )
            .await
            .unwrap();
            Ok::<_, pg_outbox_relay::Error>(json!({"order_id": id}))
        })
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Database, "{err}");
    assert_eq!(err.code(), Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION), "{err}");
    assert!(err.to_string().contains("idempotency key \"key-1\" was taken while this request ran"), "{err}");
    assert_eq!(counts(&db).await, before, "nothing committed");

    // The same (only) connection: the key is free and the work runs and commits.
    let retry = place_order(&one_connection, "key-1", &ana(), false).await.unwrap();
    assert!(!retry.replayed);
    assert_eq!(counts(&db).await.orders, before.orders + 1);
    let again = place_order(&one_connection, "key-1", &ana(), false).await.unwrap();
    assert!(again.replayed);
    assert_eq!(again.response.order_id, retry.response.order_id);
}

/// The fingerprint the Rust doors give `request` (SHA-256 of its JSON), computed by the server.
const FINGERPRINT: &str = "sha256(convert_to($2, 'UTF8'))";

/// An order placed under `key` through `Outbox::execute`, paused inside its work after the
/// order's insert (the key's lock held, no receipt written yet) until the sender is used; and
/// the pid of its backend.
async fn paused_order(
    db: &TestDb,
    key: &'static str,
) -> (tokio::task::JoinHandle<Result<Executed<Placed>, pg_outbox_relay::Error>>, tokio::sync::oneshot::Sender<()>, i32)
{
    let (started_tx, started) = tokio::sync::oneshot::channel();
    let (go_on, go_on_rx) = tokio::sync::oneshot::channel::<()>();
    let outbox = db.outbox.clone();
    let running = tokio::spawn(async move {
        outbox
            .execute(key, &ana(), async |work| {
                let id: i64 = work
                    .query_one("insert into orders (key, customer, total) values ($1, 'ana', 1) returning id", &[&key])
                    .await?
                    .get(0);
                started_tx.send(work.query_one("select pg_backend_pid()", &[]).await?.get::<_, i32>(0)).unwrap();
                go_on_rx.await.unwrap();
                Ok::<_, pg_outbox_relay::Error>(Placed { order_id: id })
            })
            .await
    });
    let pid = started.await.unwrap();
    (running, go_on, pid)
}

/// Waits until the server says that a backend is blocked by the one with `pid` (a minute at
/// most: a backend that is never blocked fails the test).
async fn until_blocked_by(db: &TestDb, pid: i32) {
    let c = db.client().await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        assert!(std::time::Instant::now() < deadline, "no backend was blocked by {pid} within a minute");
        let blocked: i64 = c
            .query_one("select count(*) from pg_stat_activity where $1 = any(pg_blocking_pids(pid))", &[&pid])
            .await
            .unwrap()
            .get(0);
        if blocked > 0 {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// A request of a key that is running makes a second one wait on the key's lock; when the
/// first commits, the second reads its receipt (in a statement after the wait) and replays it.
/// Also at REPEATABLE READ as the database's default: the unit of work runs at READ COMMITTED.
#[tokio::test]
async fn a_request_waits_for_the_running_one_of_its_key_and_replays_its_answer() {
    let db = setup().await;
    for (key, isolation) in [("key-1", "read committed"), ("key-2", "repeatable read")] {
        db.client()
            .await
            .batch_execute(&format!("alter database \"{}\" set default_transaction_isolation = '{isolation}'", db.name))
            .await
            .unwrap();
        let outbox = Outbox::connect_with(db.database_url(), 4).await.unwrap();
        let (running, go_on, pid) = paused_order(&db, key).await;
        let waiting = tokio::spawn(async move { place_order(&outbox, key, &ana(), false).await });
        until_blocked_by(&db, pid).await;
        assert!(!waiting.is_finished());
        go_on.send(()).unwrap();
        let first = running.await.unwrap().unwrap();
        let second = waiting.await.unwrap().unwrap();
        assert!(!first.replayed, "{isolation}");
        assert!(second.replayed, "{isolation}");
        assert_eq!(second.response.order_id, first.response.order_id, "{isolation}");
    }
    assert_eq!(counts(&db).await.orders, 2);
}

/// A work that ends its transaction itself (a COMMIT run through the `Work`'s transaction) has
/// no receipt written by a later `commit`: the error says so, and a retry is fresh, as it was
/// when the response was stored with a claim made in that transaction.
#[tokio::test]
async fn a_work_that_commits_by_itself_gets_an_error_and_no_receipt() {
    let db = setup().await;
    let err = db
        .outbox
        .execute("key-1", &ana(), async |work| {
            work.batch_execute("insert into orders (key, customer, total) values ('key-1', 'ana', 1); commit").await?;
            Ok::<_, pg_outbox_relay::Error>(Placed { order_id: 1 })
        })
        .await
        .unwrap_err();
    assert!(err.to_string().contains("ended before the work's commit"), "{err}");
    assert_eq!(counts(&db).await, Counts { orders: 1, ..Counts::NOTHING }, "the work's own COMMIT committed its order");
    let retry = place_order(&db.outbox, "key-1", &ana(), false).await.unwrap();
    assert!(!retry.replayed);
}

/// The SQL door takes the key's lock as the Rust doors do: `begin_request` for a key whose
/// request is still running through `Outbox::execute` waits for it, then is refused, naming the
/// door that took the key.
#[tokio::test]
async fn the_sql_door_waits_for_a_running_request_of_the_rust_door() {
    let db = setup().await;
    let (running, go_on, rust_pid) = paused_order(&db, "key-1").await;
    let client = db.client().await;
    let sql_door = tokio::spawn(async move {
        client.batch_execute("begin").await.unwrap();
        let answer =
            client.query_one("select outbox_relay.begin_request('key-1', '{\"customer\": \"ana\"}')", &[]).await;
        drop(client.batch_execute("rollback").await);
        answer
    });
    until_blocked_by(&db, rust_pid).await;
    assert!(!sql_door.is_finished());
    go_on.send(()).unwrap();
    let placed = running.await.unwrap().unwrap();
    assert!(!placed.replayed);
    let refused = sql_door.await.unwrap().unwrap_err();
    let refused = refused.as_db_error().unwrap();
    assert_eq!(refused.code().code(), "OR001");
    assert!(refused.message().contains("was claimed through the Rust API"), "{}", refused.message());
    assert_eq!(counts(&db).await, Counts { audit: 0, events: 0, ..Counts::ONE_OF_EACH });
}

/// A request that does not take the key's lock (this library before migration 0022, which
/// claimed a key with its receipt and filled the response in at the end) takes the
/// key while a request of this version runs: the later receipt's insert meets it, everything of
/// the later request rolls back, and its retry replays the first one's answer.
#[tokio::test]
async fn a_key_taken_meanwhile_without_the_lock_rolls_the_request_back_and_its_retry_replays() {
    let db = setup().await;
    let (running, go_on, _) = paused_order(&db, "key-1").await;
    // The earlier version's request, as it ran: claim, work, response, commit. Nothing waits.
    let request = serde_json::to_string(&ana()).unwrap();
    let c = db.client().await;
    c.batch_execute("begin").await.unwrap();
    c.execute(
        &format!("insert into outbox_relay.idempotency (key, fingerprint) values ($1, {FINGERPRINT})"),
        &[&"key-1", &request],
    )
    .await
    .unwrap();
    c.execute("select outbox_relay.store_response('key-1', '{\"order_id\": 999}')", &[]).await.unwrap();
    c.batch_execute("commit").await.unwrap();

    go_on.send(()).unwrap();
    let err = running.await.unwrap().unwrap_err();
    assert_eq!(err.code(), Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION), "{err}");
    assert!(err.to_string().contains("a retry replays that request's answer"), "{err}");
    assert_eq!(counts(&db).await.orders, 0, "the later request's order rolled back");
    let retry = place_order(&db.outbox, "key-1", &ana(), false).await.unwrap();
    assert!(retry.replayed);
    assert_eq!(retry.response.order_id, 999);
}

/// A key claimed and still held uncommitted by a request that does not take the key's lock: a
/// request of this version runs its work, then waits at its receipt's insert until the other
/// ends; when it rolls back, this one commits.
#[tokio::test]
async fn a_key_held_without_the_lock_is_waited_for_at_the_receipt() {
    let db = setup().await;
    let request = serde_json::to_string(&ana()).unwrap();
    let older = db.client().await;
    older.batch_execute("begin").await.unwrap();
    older
        .execute(
            &format!("insert into outbox_relay.idempotency (key, fingerprint) values ($1, {FINGERPRINT})"),
            &[&"key-1", &request],
        )
        .await
        .unwrap();
    let older_pid: i32 = older.query_one("select pg_backend_pid()", &[]).await.unwrap().get(0);
    let outbox = db.outbox.clone();
    let running = tokio::spawn(async move { place_order(&outbox, "key-1", &ana(), false).await });
    until_blocked_by(&db, older_pid).await;
    assert!(!running.is_finished());
    older.batch_execute("rollback").await.unwrap();
    let placed = running.await.unwrap().unwrap();
    assert!(!placed.replayed);
    assert_eq!(counts(&db).await, Counts::ONE_OF_EACH);
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
