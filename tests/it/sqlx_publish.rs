//! `pg_outbox_relay::sqlx`: events and audit entries in a sqlx 0.8 transaction the caller owns.

// `&mut *tx` is how sqlx's own documentation passes a transaction; the tests write it so.
#![allow(clippy::explicit_auto_deref)]

use pg_outbox_relay::{AuditEntry, ErrorKind, NewEvent};
use serde_json::json;

use crate::harness::TestDb;
use crate::relay_support::{self as support, config, count, recorder};

async fn pool(db: &TestDb) -> sqlx::PgPool {
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(2).connect(&db.url).await.unwrap();
    sqlx::query("create table if not exists orders (id bigserial primary key, total numeric not null)")
        .execute(&pool)
        .await
        .unwrap();
    pool
}

#[tokio::test]
async fn an_event_published_in_a_sqlx_transaction_exists_after_commit_and_is_delivered() {
    let db = TestDb::new().await;
    let pool = pool(&db).await;
    let (handler, mut deliveries) = recorder();
    let relay = support::start(&db.outbox, config(), handler);

    let mut tx = pool.begin().await.unwrap();
    let order: i64 =
        sqlx::query_scalar("insert into orders (total) values (12.5) returning id").fetch_one(&mut *tx).await.unwrap();
    let event = NewEvent::new("order.placed", json!({"order_id": order})).key(format!("order-{order}"));
    let id = pg_outbox_relay::sqlx::publish(&mut *tx, &event).await.unwrap();
    let entry = AuditEntry::new("order", order, "placed", &json!({"total": 12.5})).unwrap();
    let audit = pg_outbox_relay::sqlx::audit(&mut *tx, &entry).await.unwrap();
    assert_eq!(
        count(&db.client().await, "select count(*) from outbox_relay.outbox").await,
        0,
        "invisible before the commit"
    );
    tx.commit().await.unwrap();

    let delivered = deliveries.next().await;
    assert_eq!(delivered.event.id, id);
    assert_eq!(delivered.event.payload.to_value().unwrap(), json!({"order_id": order}));
    assert_eq!(delivered.event.key.as_deref(), Some(format!("order-{order}").as_str()));
    let row = db
        .client()
        .await
        .query_one("select entity_id, data from outbox_relay.audit where id = $1", &[&audit])
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), order.to_string());
    assert_eq!(row.get::<_, serde_json::Value>(1), json!({"total": 12.5}));
    relay.stop().await;
}

#[tokio::test]
async fn after_a_rollback_nothing_of_it_exists() {
    let db = TestDb::new().await;
    let pool = pool(&db).await;
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("insert into orders (total) values (3)").execute(&mut *tx).await.unwrap();
    pg_outbox_relay::sqlx::publish(&mut *tx, &NewEvent::new("order.placed", json!({}))).await.unwrap();
    let events =
        [NewEvent::new("a", json!(1)).key("k"), NewEvent::new("b", json!(2)), NewEvent::new("c", json!(3)).key("k")];
    let ids = pg_outbox_relay::sqlx::publish_all(&mut *tx, &events).await.unwrap();
    assert_eq!(ids.len(), 3);
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "ids in input order: {ids:?}");
    tx.rollback().await.unwrap();
    assert_eq!(count(&db.client().await, "select count(*) from orders").await, 0);
    assert_eq!(count(&db.client().await, "select count(*) from outbox_relay.outbox").await, 0);
}

#[tokio::test]
async fn bad_input_is_refused_like_the_tokio_postgres_functions_and_writes_nothing() {
    let db = TestDb::new().await;
    let pool = pool(&db).await;
    let mut conn = pool.acquire().await.unwrap();
    for event in [
        NewEvent::new("", json!({})),
        NewEvent::new("has space", json!({})),
        NewEvent::new("ok", json!({})).key(""),
        NewEvent::new("ok", json!({"big": "x".repeat(pg_outbox_relay::Payload::MAX_BYTES)})),
    ] {
        let ours = pg_outbox_relay::sqlx::publish(&mut conn, &event).await.unwrap_err();
        let theirs = pg_outbox_relay::publish(&db.client().await, &event).await.unwrap_err();
        assert_eq!(ours.kind(), ErrorKind::InvalidInput, "{ours}");
        assert_eq!(ours.to_string(), theirs.to_string(), "the same error through both doors");
        let all = pg_outbox_relay::sqlx::publish_all(&mut conn, &[NewEvent::new("fine", json!({})), event])
            .await
            .unwrap_err();
        assert_eq!(all.kind(), ErrorKind::InvalidInput);
    }
    assert_eq!(count(&db.client().await, "select count(*) from outbox_relay.outbox").await, 0);
    // A database error says what was being done.
    sqlx::query("revoke all on outbox_relay.outbox from public").execute(&mut *conn).await.unwrap();
    sqlx::query("create role sqlx_nobody login").execute(&mut *conn).await.ok();
    sqlx::query("set role sqlx_nobody").execute(&mut *conn).await.unwrap();
    let e = pg_outbox_relay::sqlx::publish(&mut conn, &NewEvent::new("ok", json!({}))).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Database);
    assert!(e.to_string().starts_with("adding an event"), "{e}");
    sqlx::query("reset role").execute(&mut *conn).await.unwrap();
}

/// A database error on the sqlx path keeps its SQLSTATE for `Error::code`, as on the
/// tokio-postgres path: here an event published in a transaction that a failed statement aborted.
#[tokio::test]
async fn a_database_error_through_sqlx_keeps_its_sqlstate() {
    let db = TestDb::new().await;
    let pool = pool(&db).await;
    let mut tx = pool.begin().await.unwrap();
    let refused = sqlx::query("select 1 / 0").execute(&mut *tx).await.unwrap_err();
    assert_eq!(refused.as_database_error().and_then(|e| e.code()).as_deref(), Some("22012"));
    let err = pg_outbox_relay::sqlx::publish(&mut *tx, &NewEvent::new("t", json!({}))).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Database);
    assert_eq!(err.code(), Some(&tokio_postgres::error::SqlState::IN_FAILED_SQL_TRANSACTION), "{err}");
    tx.rollback().await.unwrap();
    assert_eq!(count(&db.client().await, "select count(*) from outbox_relay.outbox").await, 0);
}
