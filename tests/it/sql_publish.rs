//! `outbox_relay.publish` from plain SQL, and the NOTIFY trigger.

use serde_json::{Value, json};
use tokio_postgres::error::SqlState;

use crate::harness::TestDb;
use crate::relay_support::listen;

/// The JSON of a notification that carries events, once its signature (HMAC-SHA256 under the key
/// in `outbox_relay.notification_key`, in hex, in front of it) is checked.
async fn signed(client: &tokio_postgres::Client, payload: &str) -> String {
    use hmac::{KeyInit, Mac};
    let key: Vec<u8> = client.query_one("select key from outbox_relay.notification_key", &[]).await.unwrap().get(0);
    let (signature, json) = payload.split_at(64);
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(&key).unwrap();
    mac.update(json.as_bytes());
    let expected: String = mac.finalize().into_bytes().iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(signature, expected, "the signature of {json}");
    json.to_string()
}

#[tokio::test]
async fn publish_from_plain_sql_commits_and_rolls_back_with_the_transaction() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.batch_execute("begin; select outbox_relay.publish('order.placed', '{\"n\": 1}'); rollback").await.unwrap();
    let count: i64 = client.query_one("select count(*) from outbox_relay.outbox", &[]).await.unwrap().get(0);
    assert_eq!(count, 0);

    client.batch_execute("begin").await.unwrap();
    let id: i64 = client
        .query_one("select outbox_relay.publish('order.placed', '{\"n\": 2}'::jsonb, key => '42')", &[])
        .await
        .unwrap()
        .get(0);
    client.batch_execute("commit").await.unwrap();
    let row =
        client.query_one("select topic, key, payload from outbox_relay.outbox where id = $1", &[&id]).await.unwrap();
    assert_eq!(row.get::<_, String>(0), "order.placed");
    assert_eq!(row.get::<_, Option<String>>(1).as_deref(), Some("42"));
    assert_eq!(row.get::<_, Value>(2), json!({"n": 2}));
}

#[tokio::test]
async fn publish_from_sql_validates_like_the_rust_api() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let cases = [
        ("select outbox_relay.publish('', '{}')", "topic must not be empty"),
        ("select outbox_relay.publish(repeat('t', 256), '{}')", "the limit is 255"),
        ("select outbox_relay.publish('order placed', '{}')", "has a character outside"),
        ("select outbox_relay.publish('t', null)", "payload must not be null"),
        ("select outbox_relay.publish('t', jsonb_build_object('x', repeat('x', 1048576)))", "the limit is 1040384"),
        ("select outbox_relay.publish('order..placed', '{}')", "has an empty word"),
        ("select outbox_relay.publish('order.', '{}')", "has an empty word"),
        ("select outbox_relay.publish('.order', '{}')", "has an empty word"),
        ("select outbox_relay.publish('t', (repeat('[', 101) || repeat(']', 101))::jsonb)", "more than 100 deep"),
        ("select outbox_relay.publish('t', '{}', '')", "key must not be empty (use null"),
        ("select outbox_relay.publish('t', '{}', repeat('k', 256))", "key is 256 characters long; the limit is 255"),
        ("select outbox_relay.publish('t', '{}', E'ab\\x1b[2Jc')", "key has a control character at position 3"),
        ("select outbox_relay.publish(E'a\\x1bb', '{}')", "topic 'a?b' has a character outside"),
    ];
    for (statement, needle) in cases {
        let err = client.batch_execute(statement).await.unwrap_err();
        let db_err = err.as_db_error().unwrap_or_else(|| panic!("{statement}: {err}"));
        assert_eq!(db_err.code(), &SqlState::INVALID_PARAMETER_VALUE, "{statement}");
        assert!(db_err.message().contains(needle), "{statement}: {}", db_err.message());
    }
    // invalid JSON, and the NaN and Infinity that JSON does not have
    for bad in ["'{not json'", "'NaN'", "'{\"x\": NaN}'", "'{\"x\": Infinity}'", "'[1, -Infinity]'"] {
        let err = client.batch_execute(&format!("select outbox_relay.publish('t', {bad})")).await.unwrap_err();
        assert_eq!(err.code(), Some(&SqlState::INVALID_TEXT_REPRESENTATION), "{bad}");
    }
    let count: i64 = client.query_one("select count(*) from outbox_relay.outbox", &[]).await.unwrap().get(0);
    assert_eq!(count, 0);
    // Any number jsonb holds is deliverable (the relay passes the text on): the largest double in
    // both spellings, and numbers beyond any double (`cli/tests/it/fidelity.rs` follows them).
    for number in ["1.7976931348623157e308", "1.7976931348623158e308", "1e999", "-2e308", "1e-400"] {
        client.query_one("select outbox_relay.publish('t', $1::text::jsonb)", &[&number]).await.unwrap();
    }
}

#[tokio::test]
async fn an_insert_notifies_listeners_once_per_statement_with_its_events_when_they_fit() {
    let db = TestDb::new().await;
    let (listener, mut rx) = listen(&db).await;
    // Writers notify only while a relay is marked waiting (migration 0002).
    listener
        .batch_execute("insert into outbox_relay.relays (id, listener_pid, waiting) values (1, pg_backend_pid(), true)")
        .await
        .unwrap();

    let writer = db.client().await;
    writer
        .batch_execute(
            "insert into outbox_relay.outbox (topic, payload) select 'bulk', to_jsonb(g) from generate_series(1, 100) g",
        )
        .await
        .unwrap();
    let xid = |payload: &str| serde_json::from_str::<serde_json::Value>(payload).unwrap()["x"].clone();
    let (channel, payload) = rx.recv().await.unwrap();
    assert_eq!(channel, "outbox_relay");
    let payload = signed(&writer, &payload).await;
    // More events than a notification carries (migration 0018): the relay claims them.
    assert!(payload.ends_with(r#","more":true}"#), "{payload}");
    // one statement, one notification: a second statement's notification is the next to arrive,
    // with its event (a transaction's earlier events are not sent again).
    writer
        .batch_execute(
            "begin; select outbox_relay.publish('marker', '{\"n\": 1.50}', 'k');
             select outbox_relay.publish('marker', '[2]'); commit",
        )
        .await
        .unwrap();
    let first = signed(&writer, &rx.recv().await.unwrap().1).await;
    let second = signed(&writer, &rx.recv().await.unwrap().1).await;
    assert_eq!(xid(&first), xid(&second), "one transaction");
    let events = |payload: &str| serde_json::from_str::<serde_json::Value>(payload).unwrap()["e"].clone();
    let (first, second) = (events(&first), events(&second));
    assert_eq!(first.as_array().unwrap().len(), 1);
    assert_eq!(second.as_array().unwrap().len(), 1);
    assert_eq!(first[0][2], "marker");
    assert_eq!(first[0][3], "k");
    assert_eq!(second[0][3], serde_json::Value::Null);
    assert_eq!(second[0][7], serde_json::json!([2]));
    listener.batch_execute("select 1").await.unwrap();
    assert!(rx.try_recv().is_err(), "no further notification");
    // An event too large for a notification comes without its payload.
    let big = format!("{{\"text\": \"{}\"}}", "x".repeat(9_000));
    writer.query_one("select outbox_relay.publish('big', $1::text::jsonb, 'k')", &[&big]).await.unwrap();
    let payload = rx.recv().await.unwrap().1;
    assert!(payload.len() < 8000);
    let payload = signed(&writer, &payload).await;
    assert_eq!(events(&payload)[0].as_array().unwrap().len(), 4, "id, uuid, topic, key: {payload}");
    // Events that do not fit in one notification together come in several, in id order.
    let text = "y".repeat(3_000);
    let ids: Vec<i64> = writer
        .query(
            "insert into outbox_relay.outbox (topic, payload) select 'wide', jsonb_build_object('n', g, 't', $1::text)
               from generate_series(1, 3) g returning id",
            &[&text],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    let mut carried = Vec::new();
    for _ in 0..2 {
        let payload = signed(&writer, &rx.recv().await.unwrap().1).await;
        for event in events(&payload).as_array().unwrap() {
            assert_eq!(event.as_array().unwrap().len(), 8, "whole: {event}");
            carried.push(event[0].as_i64().unwrap());
        }
    }
    assert_eq!(carried, ids, "two notifications, every event once, in order");
    listener.batch_execute("select 1").await.unwrap();
    assert!(rx.try_recv().is_err(), "no further notification");
    // Where roles that must not read events may LISTEN, the trigger can carry none.
    writer.batch_execute("update outbox_relay.notification_key set carry_events = false").await.unwrap();
    writer.query_one("select outbox_relay.publish('quiet', '{}', 'k')", &[]).await.unwrap();
    assert_eq!(rx.recv().await.unwrap().1, "", "an empty wake-up");
}

/// PL/pgSQL keeps a statement's plan for the session: the trigger must read a statement's events
/// by the xid index also in a session that first ran it while the outbox looked empty (a seq
/// scan planned then would read the whole table on every statement as it grew).
#[tokio::test]
async fn the_trigger_reads_a_statements_events_by_index_in_a_session_that_planned_it_on_an_empty_outbox() {
    let db = TestDb::new().await;
    let admin = db.client().await;
    admin.batch_execute("vacuum analyze outbox_relay.outbox").await.unwrap();
    admin
        .batch_execute("insert into outbox_relay.relays (id, listener_pid, waiting) values (1, 0, true)")
        .await
        .unwrap();
    let writer = db.client().await;
    writer.query_one("select outbox_relay.publish('first', '{}', 'k')", &[]).await.unwrap();
    admin
        .batch_execute(
            "insert into outbox_relay.outbox (topic, payload) select 'filler', to_jsonb(g) from generate_series(1, 20000) g",
        )
        .await
        .unwrap();
    writer.batch_execute("begin").await.unwrap();
    writer.query_one("select outbox_relay.publish('second', '{}', 'k')", &[]).await.unwrap();
    let scans: i64 = writer
        .query_one("select seq_scan from pg_stat_xact_user_tables where relid = 'outbox_relay.outbox'::regclass", &[])
        .await
        .unwrap()
        .get(0);
    writer.batch_execute("commit").await.unwrap();
    assert_eq!(scans, 0, "the statement's events were read without a seq scan of the outbox");
}

#[tokio::test]
async fn writers_do_not_notify_when_no_relay_is_waiting() {
    let db = TestDb::new().await;
    let (listener, mut rx) = listen(&db).await;
    listener
        .batch_execute(
            "insert into outbox_relay.relays (id, listener_pid, waiting) values (1, pg_backend_pid(), false)",
        )
        .await
        .unwrap();
    let writer = db.client().await;
    writer.batch_execute("select outbox_relay.publish('quiet', '{}')").await.unwrap();
    // The relay is busy: no notification. Then it waits: the next insert notifies.
    listener.batch_execute("update outbox_relay.relays set waiting = true").await.unwrap();
    writer.batch_execute("select outbox_relay.publish('loud', '{}')").await.unwrap();
    assert_eq!(rx.recv().await.unwrap().0, "outbox_relay");
    listener.batch_execute("select 1").await.unwrap();
    assert!(rx.try_recv().is_err(), "only the insert made while a relay waited notified");
}

/// One definition of the size limit on both doors: PostgreSQL's jsonb text of the payload,
/// separators and numbers (printed in full by numeric) included. A payload of exactly the limit
/// passes both, one byte more fails both.
#[tokio::test]
async fn both_doors_measure_the_payload_size_the_same_way() {
    use pg_outbox_relay::{NewEvent, Payload};
    let db = TestDb::new().await;
    let client = db.client().await;
    let payload = |padding: usize| {
        json!({"floats": [1.5e300, 1e-7, -0.0, 0.1, 1e21, 12345.678], "nested": {"a": [1, 2, {"b": null}]},
               "text": "é \" \\ \u{1}", "pad": "x".repeat(padding)})
    };
    let base: i32 = client.query_one("select octet_length($1::jsonb::text)", &[&payload(0)]).await.unwrap().get(0);
    let fits = Payload::MAX_BYTES - base as usize;
    let sql = "select outbox_relay.publish('t', $1::jsonb)";
    db.outbox.publish(&NewEvent::new("t", payload(fits))).await.expect("the Rust API takes exactly the limit");
    client.query_one(sql, &[&payload(fits)]).await.expect("the SQL function takes exactly the limit");
    let err = db.outbox.publish(&NewEvent::new("t", payload(fits + 1))).await.unwrap_err();
    assert!(err.is_invalid_input() && err.to_string().contains("is 1040385 bytes"), "{err}");
    let err = client.query_one(sql, &[&payload(fits + 1)]).await.unwrap_err();
    assert!(err.as_db_error().unwrap().message().contains("is 1040385 bytes"), "{err}");
}
