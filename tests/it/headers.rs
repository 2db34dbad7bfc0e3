//! Headers with events (issue 25): given through the Rust API, sqlx and SQL, stored, carried
//! through the dead letters and back, handed to the handler unchanged; bad ones refused by every
//! door with the rule they break and nothing written, by the same rules in Rust and in SQL.

use pg_outbox_relay::{DeliveryError, Event, Handler, Headers, NewEvent, RelayConfig};
use serde_json::{Value, json};
use tokio_postgres::error::SqlState;

use crate::harness::TestDb;
use crate::relay_support::{PATIENCE, count, eventually, recorder, start};

const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

fn pairs(headers: &Headers) -> Vec<(String, String)> {
    let mut pairs: Vec<(String, String)> = headers.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect();
    pairs.sort();
    pairs
}

/// `event` with every header of the JSON object `headers`, through `NewEvent::header`.
fn with_headers(event: NewEvent, headers: &Value) -> NewEvent {
    headers.as_object().unwrap().iter().fold(event, |event, (name, value)| event.header(name, value.as_str().unwrap()))
}

fn expected(json: Value) -> Vec<(String, String)> {
    let mut pairs: Vec<(String, String)> =
        json.as_object().unwrap().iter().map(|(n, v)| (n.clone(), v.as_str().unwrap().to_string())).collect();
    pairs.sort();
    pairs
}

#[tokio::test]
async fn headers_from_every_door_reach_the_handler_unchanged() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let written = json!({
        "x-correlation-id": "c-42",
        "tenant": "acme",
        "Content-Version": "a \"quoted\" value; with=equals, commas and 100%",
        "traceparent": TRACEPARENT,
        "tracestate": "vendor=abc,other=x",
    });
    let sql_id: i64 = client
        .query_one("select outbox_relay.publish('h.sql', '{}', 'k', $1::text::jsonb)", &[&written.to_string()])
        .await
        .unwrap()
        .get(0);
    let rust = with_headers(NewEvent::new("h.rust", json!({})).key("k"), &written);
    let rust_id = db.outbox.publish(&rust).await.unwrap();
    let mut conn: sqlx::PgConnection = sqlx::Connection::connect(&db.url).await.unwrap();
    let sqlx_id = pg_outbox_relay::sqlx::publish(&mut conn, &rust.clone().header("x-door", "sqlx")).await.unwrap();
    let many = db
        .outbox
        .publish_all(&[NewEvent::new("h.many", json!({})).header("x-n", "1"), NewEvent::new("h.none", json!({}))])
        .await
        .unwrap();

    let (handler, mut deliveries) = recorder();
    let relay = start(&db.outbox, crate::relay_support::config(), handler);
    let mut got = std::collections::HashMap::new();
    for delivered in deliveries.take(5).await {
        got.insert(delivered.event.id, pairs(&delivered.event.headers));
    }
    relay.stop().await;
    assert_eq!(got[&sql_id], expected(written.clone()), "through SQL");
    assert_eq!(got[&rust_id], expected(written.clone()), "through the Rust API");
    let mut with_door = written.clone();
    with_door["x-door"] = json!("sqlx");
    assert_eq!(got[&sqlx_id], expected(with_door), "through sqlx");
    assert_eq!(got[&many[0]], expected(json!({"x-n": "1"})), "publish_all");
    assert_eq!(got[&many[1]], Vec::new(), "no headers");
    // Stored as a JSON object; none is SQL null, and `{}` through SQL too.
    let none: i64 =
        client.query_one("select outbox_relay.publish('h.sql', '{}', null, '{}')", &[]).await.unwrap().get(0);
    let nulls = count(
        &client,
        &format!("select count(*) from outbox_relay.outbox where headers is null and id in ({}, {none})", many[1]),
    )
    .await;
    assert_eq!(nulls, 2);
}

/// Fails every event with headers for good, once: they go to the dead letters, and come back
/// with their headers when retried.
#[derive(Clone)]
struct RefuseFirst(std::sync::Arc<std::sync::Mutex<Vec<Event>>>);

impl Handler for RefuseFirst {
    async fn handle(&self, event: &Event) -> Result<(), DeliveryError> {
        let mut seen = self.0.lock().unwrap();
        seen.push(event.clone());
        if seen.len() == 1 { Err(DeliveryError::permanent("refused once")) } else { Ok(()) }
    }
}

#[tokio::test]
async fn headers_survive_the_dead_letters_and_a_retry() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let id = db
        .outbox
        .publish(
            &NewEvent::new("h.dead", json!({})).key("k").header("tenant", "acme").header("traceparent", TRACEPARENT),
        )
        .await
        .unwrap();
    let seen = RefuseFirst(Default::default());
    let relay = start(&db.outbox, RelayConfig { max_attempts: 1, ..crate::relay_support::config() }, seen.clone());
    eventually("the event is dead-lettered", || async {
        count(&client, "select count(*) from outbox_relay.dead_letters").await == 1
    })
    .await;
    let stored: Value =
        client.query_one("select headers from outbox_relay.dead_letters where id = $1", &[&id]).await.unwrap().get(0);
    assert_eq!(stored, json!({"tenant": "acme", "traceparent": TRACEPARENT}));
    assert_eq!(db.outbox.retry_dead_letters(&[id]).await.unwrap(), vec![id]);
    eventually("the retried event is delivered", || async { seen.0.lock().unwrap().len() == 2 }).await;
    relay.stop().await;
    let seen = seen.0.lock().unwrap();
    assert_eq!(pairs(&seen[1].headers), pairs(&seen[0].headers));
    assert_eq!(seen[1].headers.get("tenant"), Some("acme"));
    assert_eq!(seen[1].attempts, 1, "a retry starts again");
    let _ = PATIENCE;
}

/// Each bad set of headers, with the words of the rule it breaks.
fn bad_headers() -> Vec<(Value, &'static str)> {
    let many: serde_json::Map<String, Value> = (0..33).map(|i| (format!("h{i}"), json!("v"))).collect();
    let big: serde_json::Map<String, Value> = (0..9).map(|i| (format!("h{i}"), json!("v".repeat(1000)))).collect();
    vec![
        (json!({"": "v"}), "1 to 64"),
        (json!({"n".repeat(65): "v"}), "1 to 64"),
        (json!({"bad name": "v"}), "letters, digits, - _ and ."),
        (json!({"bad:name": "v"}), "letters, digits, - _ and ."),
        (json!({"Content-Type": "text/plain"}), "reserved"),
        (json!({"outbox-topic": "x"}), "reserved"),
        (json!({"webhook-id": "x"}), "reserved"),
        (json!({"ce-type": "x"}), "reserved"),
        (json!({"Nats-Msg-Id": "x"}), "reserved"),
        (json!({"a": ""}), "empty value"),
        (json!({"a": "v".repeat(1025)}), "1025 bytes"),
        (json!({"a": "x\r\nInjected: yes"}), "printable ASCII"),
        (json!({"a": "café"}), "printable ASCII"),
        (json!({"a": " padded"}), "starts or ends with a space"),
        (json!({"traceparent": "00-abc-def-01"}), "no W3C trace context"),
        (json!({"traceparent": "00-00000000000000000000000000000000-00f067aa0ba902b7-01"}), "all zeros"),
        (json!({"traceparent": "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}), "version ff"),
        (json!({"TraceParent": TRACEPARENT}), "lower case"),
        (json!({"tracestate": "k=v"}), "without traceparent"),
        (Value::Object(many), "33 headers"),
        (Value::Object(big), "the limit is 8192"),
    ]
}

#[tokio::test]
async fn bad_headers_are_refused_by_every_door_and_nothing_is_written() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let mut conn: sqlx::PgConnection = sqlx::Connection::connect(&db.url).await.unwrap();
    for (headers, rule) in bad_headers() {
        let event = with_headers(NewEvent::new("h.bad", json!({})), &headers);
        let err = db.outbox.publish(&event).await.unwrap_err();
        assert!(err.is_invalid_input() && err.to_string().contains(rule), "Rust, {headers}: {err}");
        let batch = [NewEvent::new("h.good", json!({})), event.clone()];
        let err = db.outbox.publish_all(&batch).await.unwrap_err();
        assert!(err.to_string().contains(rule), "publish_all, {headers}: {err}");
        let err = pg_outbox_relay::sqlx::publish(&mut conn, &event).await.unwrap_err();
        assert!(err.to_string().contains(rule), "sqlx, {headers}: {err}");

        let err = client
            .query_one("select outbox_relay.publish('h.bad', '{}', null, $1::text::jsonb)", &[&headers.to_string()])
            .await
            .unwrap_err();
        let db_err = err.as_db_error().unwrap_or_else(|| panic!("SQL, {headers}: {err}"));
        assert_eq!(db_err.code(), &SqlState::INVALID_PARAMETER_VALUE, "SQL, {headers}");
        assert!(db_err.message().contains(rule), "SQL, {headers}: {}", db_err.message());

        // A row written by hand past the function meets the table's constraint.
        let err = client
            .execute(
                "insert into outbox_relay.outbox (topic, payload, headers) values ('h.bad', '{}', $1::text::jsonb)",
                &[&headers.to_string()],
            )
            .await
            .unwrap_err();
        assert_eq!(err.code(), Some(&SqlState::CHECK_VIOLATION), "by hand, {headers}");
    }
    for shape in ["[\"x\"]", "\"x\"", "{\"n\": 1}", "{\"n\": null}"] {
        let err = client
            .query_one("select outbox_relay.publish('h.bad', '{}', null, $1::text::jsonb)", &[&shape])
            .await
            .unwrap_err();
        assert_eq!(err.code(), Some(&SqlState::INVALID_PARAMETER_VALUE), "{shape}");
    }
    assert_eq!(count(&client, "select count(*) from outbox_relay.outbox").await, 0, "nothing was written");
}

/// The database's rules are the Rust API's: a row the database takes, Rust reads back (a relay
/// never refuses what a writer could store), checked on a good set at every limit.
#[tokio::test]
async fn headers_at_the_limits_pass_both_checks() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let mut at_limits: serde_json::Map<String, Value> =
        (0..7).map(|i| (format!("{i}{}", "n".repeat(63)), json!("~".repeat(1024)))).collect();
    at_limits.insert("traceparent".into(), json!("01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-future"));
    at_limits.insert("tracestate".into(), json!("a=b"));
    let headers = Value::Object(at_limits);
    let event = with_headers(NewEvent::new("h.limits", json!({})), &headers);
    db.outbox.publish(&event).await.unwrap();
    client
        .query_one("select outbox_relay.publish('h.limits', '{}', null, $1::text::jsonb)", &[&headers.to_string()])
        .await
        .unwrap();
    let (handler, mut deliveries) = recorder();
    let relay = start(&db.outbox, crate::relay_support::config(), handler);
    for delivered in deliveries.take(2).await {
        assert_eq!(pairs(&delivered.event.headers), expected(headers.clone()));
    }
    relay.stop().await;
}
