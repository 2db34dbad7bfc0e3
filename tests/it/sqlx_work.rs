//! The unit of work through sqlx (`pg_outbox_relay::sqlx::{begin, execute, Work}`): the write
//! path's checks of `write_path.rs`, on a sqlx pool, and its keys shared with the other doors.

use futures::future::join_all;
use pg_outbox_relay::ErrorKind;
use serde_json::{Value, json};

use crate::harness::TestDb;
use crate::orders::{Counts, ORDERS_TABLE, PlaceOrder, TestError, assert_settled, place_order, place_order_sqlx};

async fn setup() -> (TestDb, sqlx::PgPool) {
    let db = TestDb::new().await;
    db.client().await.batch_execute(ORDERS_TABLE).await.unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(60).connect(&db.url).await.unwrap();
    (db, pool)
}

async fn counts(db: &TestDb) -> Counts {
    Counts::read(&db.client().await).await
}

fn ana() -> PlaceOrder {
    PlaceOrder::ana()
}

#[tokio::test]
async fn one_call_writes_order_audit_receipt_and_event_together_and_the_same_key_replays() {
    let (db, pool) = setup().await;
    let placed = place_order_sqlx(&pool, "key-1", &ana(), false).await.unwrap();
    assert!(!placed.replayed);
    assert_eq!(counts(&db).await, Counts::ONE_OF_EACH);
    let c = db.client().await;
    let id = placed.response.order_id;
    let audit = c.query_one("select entity_id, data, idempotency_key from outbox_relay.audit", &[]).await.unwrap();
    assert_eq!(audit.get::<_, String>(0), id.to_string());
    assert_eq!(audit.get::<_, Value>(1), json!({"customer": "ana", "total": 12.5}));
    assert_eq!(audit.get::<_, Option<String>>(2).as_deref(), Some("key-1"));
    let event = c.query_one("select topic, key, payload from outbox_relay.outbox", &[]).await.unwrap();
    assert_eq!(event.get::<_, String>(0), "order.placed");
    assert_eq!(event.get::<_, Option<String>>(1), Some(id.to_string()));
    assert_eq!(event.get::<_, Value>(2), json!({"order_id": id, "customer": "ana", "key": "key-1"}));

    for _ in 0..3 {
        let again = place_order_sqlx(&pool, "key-1", &ana(), false).await.unwrap();
        assert!(again.replayed);
        assert_eq!(again.response, placed.response);
    }
    assert_eq!(counts(&db).await, Counts::ONE_OF_EACH);
}

#[tokio::test]
async fn a_failure_after_all_writes_leaves_nothing_behind_and_the_retry_is_fresh() {
    let (db, pool) = setup().await;
    let err = place_order_sqlx(&pool, "key-1", &ana(), true).await.unwrap_err();
    assert!(matches!(err, TestError::Injected), "{err:?}");
    assert_eq!(counts(&db).await, Counts::NOTHING);
    let retry = place_order_sqlx(&pool, "key-1", &ana(), false).await.unwrap();
    assert!(!retry.replayed);
    assert_eq!(counts(&db).await, Counts::ONE_OF_EACH);
}

#[tokio::test]
async fn a_failure_at_commit_leaves_nothing_behind() {
    let (db, pool) = setup().await;
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
    let doomed = PlaceOrder { customer: "doomed".into(), total: 1.0 };
    match place_order_sqlx(&pool, "key-1", &doomed, false).await.unwrap_err() {
        TestError::Outbox(e) => {
            assert_eq!(e.kind(), ErrorKind::Database);
            assert!(e.to_string().contains("injected failure at commit"), "{e}");
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(counts(&db).await, Counts::NOTHING);
}

async fn race(n: usize) {
    let (db, pool) = setup().await;
    let calls = (0..n).map(|_| {
        let pool = pool.clone();
        tokio::spawn(async move { place_order_sqlx(&pool, "same-key", &ana(), false).await })
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

/// The error mapping of a key taken meanwhile (by a request that does not take the key's lock:
/// this library before migration 0022; `write_path.rs` races one for real): here the receipt is
/// written inside the work itself, so the work's receipt meets it at the commit, nothing of the
/// work is written, and the error says what happened.
#[tokio::test]
async fn a_receipt_met_at_the_commit_rolls_the_work_back() {
    let (db, pool) = setup().await;
    let err = pg_outbox_relay::sqlx::execute(&pool, "key-1", &ana(), async |work| {
        sqlx::query("insert into orders (key, customer, total) values ('key-1', 'ana', 1)")
            .execute(&mut **work)
            .await?;
        sqlx::query(
            "insert into outbox_relay.idempotency (key, fingerprint, response) values ('key-1', '\\x00', '{}')",
        )
        .execute(&mut **work)
        .await?;
        Ok::<_, TestError>(crate::orders::Placed { order_id: 1 })
    })
    .await
    .unwrap_err();
    match err {
        TestError::Outbox(e) => {
            assert_eq!(e.code(), Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION), "{e}");
            assert!(e.to_string().contains("idempotency key \"key-1\" was taken while this request ran"), "{e}");
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(counts(&db).await, Counts::NOTHING);
    let placed = place_order_sqlx(&pool, "key-1", &ana(), false).await.unwrap();
    assert!(!placed.replayed, "the key is free again");
}

/// The sqlx door runs in the caller's transaction: one at REPEATABLE READ (here the pool's
/// default) is refused before any work, since a request of the key that committed while this
/// one waited for the key's lock would not be seen.
#[tokio::test]
async fn a_transaction_not_at_read_committed_is_refused_before_the_work() {
    let (db, _) = setup().await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .after_connect(|conn, _| {
            Box::pin(async move {
                sqlx::query("set default_transaction_isolation = 'repeatable read'").execute(conn).await.map(drop)
            })
        })
        .connect(&db.url)
        .await
        .unwrap();
    match place_order_sqlx(&pool, "key-1", &ana(), false).await.unwrap_err() {
        TestError::Outbox(e) => {
            assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
            assert!(e.to_string().contains("needs READ COMMITTED, and its transaction is repeatable read"), "{e}");
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(counts(&db).await, Counts::NOTHING);
}

#[tokio::test]
async fn a_key_reused_for_another_request_is_refused_and_bad_input_is_named() {
    let (db, pool) = setup().await;
    place_order_sqlx(&pool, "key-1", &ana(), false).await.unwrap();
    let other = PlaceOrder { customer: "bruno".into(), total: 99.0 };
    match place_order_sqlx(&pool, "key-1", &other, false).await.unwrap_err() {
        TestError::Outbox(e) => {
            assert!(e.is_key_reused(), "{e:?}");
            assert!(e.to_string().contains("\"key-1\" was already used for a different request"), "{e}");
        }
        other => panic!("unexpected {other:?}"),
    }
    for (key, says) in [("", "must not be empty"), ("a\nb", "control character")] {
        match place_order_sqlx(&pool, key, &ana(), false).await.unwrap_err() {
            TestError::Outbox(e) => {
                assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
                assert!(e.to_string().contains(says), "{e}");
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(counts(&db).await, Counts::ONE_OF_EACH);
}

/// The two Rust doors fingerprint requests alike: a key taken through one replays through the
/// other. A key taken through the SQL door is refused by both, saying which door took it.
#[tokio::test]
async fn the_doors_share_keys_and_name_the_one_that_took_a_key() {
    let (db, pool) = setup().await;
    let first = place_order(&db.outbox, "key-tp", &ana(), false).await.unwrap();
    let through_sqlx = place_order_sqlx(&pool, "key-tp", &ana(), false).await.unwrap();
    assert!(through_sqlx.replayed);
    assert_eq!(through_sqlx.response, first.response);
    let first = place_order_sqlx(&pool, "key-sqlx", &ana(), false).await.unwrap();
    let through_tp = place_order(&db.outbox, "key-sqlx", &ana(), false).await.unwrap();
    assert!(through_tp.replayed);
    assert_eq!(through_tp.response, first.response);

    let c = db.client().await;
    c.batch_execute(
        "begin; select outbox_relay.begin_request('key-sql', '{\"customer\": \"ana\", \"total\": 12.5}');
         select outbox_relay.store_response('key-sql', '{\"order_id\": 1}'); commit",
    )
    .await
    .unwrap();
    for refused in [
        place_order(&db.outbox, "key-sql", &ana(), false).await.unwrap_err(),
        place_order_sqlx(&pool, "key-sql", &ana(), false).await.unwrap_err(),
    ] {
        match refused {
            TestError::Outbox(e) => {
                assert!(e.is_key_reused(), "{e:?}");
                assert!(e.to_string().contains("claimed through outbox_relay.begin_request (the SQL door)"), "{e}");
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    let e = c
        .query_one("select outbox_relay.begin_request('key-tp', '{\"customer\": \"ana\", \"total\": 12.5}')", &[])
        .await
        .unwrap_err();
    let e = e.as_db_error().unwrap();
    assert_eq!(e.code().code(), "OR001");
    assert!(e.message().contains("was claimed through the Rust API"), "{}", e.message());
}
