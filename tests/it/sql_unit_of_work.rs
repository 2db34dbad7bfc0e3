//! The unit of work in SQL (migration 0020): `outbox_relay.begin_request`, `audit`, `publish` and
//! `store_response` in the caller's own transaction, as a service in any language runs them,
//! under the writer role of `migrations/optional/least_privilege_roles.sql`.

use std::sync::Arc;

use serde_json::{Value, json};
use tokio::sync::Barrier;
use tokio_postgres::error::SqlState;

use crate::harness::TestDb;
use crate::orders::Counts;
use crate::privileges::ROLES_SQL;

/// The article's transaction through the SQL door: `Ok(response, replayed)`.
const PLACE_ORDER: &str = "
do $$
begin
  if outbox_relay.begin_request(current_setting('test.key'), current_setting('test.request')::jsonb) is null then
    insert into orders (customer) values (current_setting('test.request')::jsonb ->> 'customer');
    perform outbox_relay.audit('order', currval('orders_id_seq')::text, 'placed',
                               current_setting('test.request')::jsonb, current_setting('test.key'));
    perform outbox_relay.publish('order.placed', jsonb_build_object('order_id', currval('orders_id_seq')),
                                 currval('orders_id_seq')::text);
    perform outbox_relay.store_response(current_setting('test.key'), jsonb_build_object('order_id', currval('orders_id_seq')));
  end if;
end
$$";

/// A database with the roles file applied, an `orders` table, and a login role in
/// `outbox_writer` that may write orders; returns the writer's URL.
pub(crate) async fn writer_database(db: &TestDb) -> String {
    let admin = db.client().await;
    admin.batch_execute(ROLES_SQL).await.expect("applying the roles file");
    let writer = format!("{}_sql_writer", db.name);
    admin
        .batch_execute(&format!(
            "create role {writer} login in role outbox_writer;
             create table orders (id bigserial primary key, customer text not null, total numeric(12, 2) not null default 0);
             grant insert, select on orders to {writer};
             grant usage on sequence orders_id_seq to {writer};"
        ))
        .await
        .unwrap();
    db.url_as(&writer)
}

async fn connect(url: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(connection);
    client
}

/// Runs one request in its own transaction: the stored response and whether it was a replay.
async fn request(
    client: &tokio_postgres::Client,
    key: &str,
    request: &Value,
) -> Result<(Value, bool), tokio_postgres::Error> {
    client.batch_execute("begin").await?;
    let outcome = async {
        let replayed: Option<Value> =
            client.query_one("select outbox_relay.begin_request($1, $2)", &[&key, request]).await?.get(0);
        if let Some(response) = replayed {
            return Ok((response, true));
        }
        let id: i64 = client
            .query_one("insert into orders (customer) values ($1) returning id", &[&request["customer"].as_str()])
            .await?
            .get(0);
        client
            .execute("select outbox_relay.audit('order', $1, 'placed', $2, $3)", &[&id.to_string(), request, &key])
            .await?;
        client
            .execute(
                "select outbox_relay.publish('order.placed', $1, $2)",
                &[&json!({"order_id": id}), &id.to_string()],
            )
            .await?;
        let response = json!({"order_id": id});
        client.execute("select outbox_relay.store_response($1, $2)", &[&key, &response]).await?;
        Ok((response, false))
    }
    .await;
    match outcome {
        Ok(done) => {
            client.batch_execute("commit").await?;
            Ok(done)
        }
        Err(e) => {
            client.batch_execute("rollback").await?;
            Err(e)
        }
    }
}

/// Five sessions send one request with one key at the same moment: one does the work, four
/// wait for it and replay its response; one order, one event, one audit row, one receipt.
#[tokio::test]
async fn five_sessions_with_one_key_settle_to_one_fresh_and_four_replays() {
    let db = TestDb::new().await;
    let url = writer_database(&db).await;
    let body = json!({"customer": "ana", "total": 12.5});
    let start = Arc::new(Barrier::new(5));
    let mut sessions = Vec::new();
    for _ in 0..5 {
        let (url, body, start) = (url.clone(), body.clone(), Arc::clone(&start));
        sessions.push(tokio::spawn(async move {
            let client = connect(&url).await;
            start.wait().await;
            request(&client, "order-7f3c", &body).await.unwrap()
        }));
    }
    let mut outcomes = Vec::new();
    for session in sessions {
        outcomes.push(session.await.unwrap());
    }
    let fresh: Vec<_> = outcomes.iter().filter(|(_, replayed)| !replayed).collect();
    assert_eq!(fresh.len(), 1, "one fresh request: {outcomes:?}");
    let response = &fresh[0].0;
    assert!(outcomes.iter().all(|(r, _)| r == response), "every session got the same response: {outcomes:?}");
    let admin = db.client().await;
    assert_eq!(Counts::read(&admin).await, Counts::ONE_OF_EACH);
    let linked: Option<String> =
        admin.query_one("select idempotency_key from outbox_relay.audit", &[]).await.unwrap().get(0);
    assert_eq!(linked.as_deref(), Some("order-7f3c"));

    // A retry later replays too, its keys in another order (jsonb: one value, one request).
    let client = connect(&url).await;
    let retry: Value = serde_json::from_str(r#"{"total": 12.5, "customer": "ana"}"#).unwrap();
    let again = request(&client, "order-7f3c", &retry).await.unwrap();
    assert_eq!(again, (response.clone(), true));
    assert_eq!(Counts::read(&admin).await, Counts::ONE_OF_EACH);
}

/// The same five sessions in plain SQL (a `do` block, as psql or any driver sends it), for a
/// key reused with another request: refused with SQLSTATE OR001, naming the key, writing nothing.
#[tokio::test]
async fn a_key_reused_for_another_request_is_refused_and_writes_nothing() {
    let db = TestDb::new().await;
    let url = writer_database(&db).await;
    let client = connect(&url).await;
    client
        .batch_execute(&format!(
            "set test.key = 'order-1'; set test.request = '{{\"customer\": \"ana\"}}'; begin; {PLACE_ORDER}; commit"
        ))
        .await
        .unwrap();
    let admin = db.client().await;
    assert_eq!(Counts::read(&admin).await, Counts::ONE_OF_EACH);
    let refused = request(&client, "order-1", &json!({"customer": "bob"})).await.unwrap_err();
    let db_error = refused.as_db_error().expect("a database error");
    assert_eq!(db_error.code().code(), "OR001", "{db_error}");
    assert!(db_error.message().contains("idempotency key 'order-1' was already used for a different request"));
    assert!(db_error.hint().is_some_and(|h| h.contains("new key")));
    assert_eq!(Counts::read(&admin).await, Counts::ONE_OF_EACH, "nothing written by the refused request");

    // Bad input names the problem.
    for (sql, message, code) in [
        (
            "select outbox_relay.begin_request('', '{}')",
            "the idempotency key must not be empty",
            SqlState::INVALID_PARAMETER_VALUE,
        ),
        (
            "select outbox_relay.begin_request(E'a\\nb', '{}')",
            "control character at position 2",
            SqlState::INVALID_PARAMETER_VALUE,
        ),
        (
            "select outbox_relay.begin_request(repeat('k', 256), '{}')",
            "256 characters long; the limit is 255",
            SqlState::INVALID_PARAMETER_VALUE,
        ),
        (
            "select outbox_relay.begin_request('k', null)",
            "the request must not be null",
            SqlState::NULL_VALUE_NOT_ALLOWED,
        ),
        (
            "select outbox_relay.audit('order', '', 'placed', '{}')",
            "the audit entity id must not be empty",
            SqlState::INVALID_PARAMETER_VALUE,
        ),
        (
            "select outbox_relay.audit('order', '1', '', '{}')",
            "the audit action must not be empty",
            SqlState::INVALID_PARAMETER_VALUE,
        ),
        (
            "select outbox_relay.audit('order', '1', 'placed', null)",
            "data must not be null",
            SqlState::INVALID_PARAMETER_VALUE,
        ),
    ] {
        let e = client.query_one(sql, &[]).await.unwrap_err();
        let e = e.as_db_error().unwrap();
        assert!(e.message().contains(message), "{sql}: {}", e.message());
        assert_eq!(e.code(), &code, "{sql}");
    }
    // A response a replay could not tell from "fresh" is refused before the commit.
    client.batch_execute("begin").await.unwrap();
    let fresh: Option<Value> =
        client.query_one("select outbox_relay.begin_request('k-null', '{}')", &[]).await.unwrap().get(0);
    assert_eq!(fresh, None);
    let e = client.execute("select outbox_relay.store_response('k-null', 'null')", &[]).await.unwrap_err();
    assert!(e.as_db_error().unwrap().message().contains("must not be null: a replay could not tell it"), "{e}");
    client.batch_execute("rollback").await.unwrap();
}

/// A failure after every write (the business row, the audit row, the event, the response) rolls
/// all of it back, the key with it: the retry is fresh and does the work once.
#[tokio::test]
async fn a_failure_after_all_writes_leaves_nothing_and_the_retry_is_fresh() {
    let db = TestDb::new().await;
    let url = writer_database(&db).await;
    let client = connect(&url).await;
    let failed = client
        .batch_execute(&format!(
            "set test.key = 'order-2'; set test.request = '{{\"customer\": \"ana\"}}'; begin; {PLACE_ORDER};
             select 1 / 0; commit"
        ))
        .await
        .unwrap_err();
    assert_eq!(failed.code(), Some(&SqlState::DIVISION_BY_ZERO));
    client.batch_execute("rollback").await.unwrap();
    let admin = db.client().await;
    assert_eq!(Counts::read(&admin).await, Counts::NOTHING);
    let (response, replayed) = request(&client, "order-2", &json!({"customer": "ana"})).await.unwrap();
    assert!(!replayed);
    assert!(response["order_id"].is_i64());
    assert_eq!(Counts::read(&admin).await, Counts::ONE_OF_EACH);

    // A request whose work committed without storing a response cannot be replayed: said so.
    client.batch_execute("begin; select outbox_relay.begin_request('order-3', '{}'); commit").await.unwrap();
    let e = client.query_one("select outbox_relay.begin_request('order-3', '{}')", &[]).await.unwrap_err();
    assert!(e.as_db_error().unwrap().message().contains("committed without a response"), "{e}");
}
