//! Payloads arrive as written: events published through SQL, the Rust API and sqlx, with the
//! numbers a double cannot hold exactly, reach stdout, HTTP (raw and both CloudEvents modes),
//! NATS and RabbitMQ with the payload's bytes equal to PostgreSQL's own text of the stored
//! `jsonb`, and nothing is dead-lettered. One test per kind of destination: stdout and HTTP need
//! nothing but PostgreSQL, NATS and RabbitMQ are in `needs_nats` and `needs_rabbitmq`.

use std::collections::HashMap;

use pg_outbox_relay::NewEvent;
use serde_json::json;
use serde_json::value::RawValue;

use crate::binary::{spawn_run, stdout, terminate_with_output};
use crate::cli::{nats, nats_url, stream_for, unique};
use crate::harness::TestDb;
use crate::relay_support::eventually;

/// JSON texts as a writer gives them, each a trap for a parser that reads numbers into `f64`.
const WRITTEN: &[&str] = &[
    r#"{"charge": 1.602176634e-19}"#,
    "1.7e100",
    "1.7e308",
    // the largest double, in its shortest spelling and in another one that rounds to it
    "1.7976931348623157e308",
    "1.7976931348623158e308",
    // beyond any double, and smaller than the smallest
    "[1e999, -1e999, 1e-400]",
    // 40 significant digits
    r#"{"amount": 1234567890123456789012345678901234567890, "rate": 0.1234567890123456789012345678901234567890}"#,
    "-0",
    "-0.0",
    r#"{"big": 18446744073709551616, "small": -9223372036854775809, "u64": 18446744073709551615}"#,
    r#"{"price": 0.10, "list": [1e-7, 5E+3, 2.50], "text": "\u00e9\ud83d\ude00 \"q\" \\ \/ \u001b[2J"}"#,
];

/// Publishes every text through the three doors, plus `f64` extremes as `Value`s, and returns
/// each event's id with PostgreSQL's text of its stored payload.
async fn publish_everything(db: &TestDb) -> HashMap<i64, String> {
    let client = db.client().await;
    let mut ids = Vec::new();
    for text in WRITTEN {
        let row = client.query_one("select outbox_relay.publish('fidelity.sql', $1::text::jsonb)", &[text]).await;
        ids.push(row.unwrap().get::<_, i64>(0));
        ids.push(db.outbox.publish(&NewEvent::from_json("fidelity.rust", *text).unwrap()).await.unwrap());
    }
    let mut conn: sqlx::PgConnection = sqlx::Connection::connect(&db.url).await.unwrap();
    for text in WRITTEN {
        let event = NewEvent::from_json("fidelity.sqlx", *text).unwrap().key("k");
        ids.push(pg_outbox_relay::sqlx::publish(&mut conn, &event).await.unwrap());
    }
    let values = json!({
        "charge": 1.602176634e-19, "max": f64::MAX, "min_positive": f64::MIN_POSITIVE, "subnormal": 5e-324,
        "minus_zero": -0.0, "u64": u64::MAX, "i64": i64::MIN, "tenth": 0.1,
    });
    let from_value = db.outbox.publish(&NewEvent::new("fidelity.value", values)).await.unwrap();
    ids.push(from_value);

    let stored: HashMap<i64, String> = client
        .query("select id, payload::text from outbox_relay.outbox where id = any($1)", &[&ids])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(stored.len(), ids.len(), "every event was accepted");
    // The Rust API sends a value's numbers in their shortest spelling, which PostgreSQL keeps.
    let value_text = &stored[&from_value];
    for digits in ["0.0000000000000000001602176634", "179769313486231570000", "\"tenth\": 0.1,", "-9223372036854775808"]
    {
        assert!(value_text.contains(digits), "{digits} in {value_text}");
    }
    // Every door stores what PostgreSQL makes of the text itself.
    for (n, text) in WRITTEN.iter().enumerate() {
        let own: String = client.query_one("select $1::text::jsonb::text", &[text]).await.unwrap().get(0);
        for id in [ids[2 * n], ids[2 * n + 1], ids[2 * WRITTEN.len() + n]] {
            assert_eq!(stored[&id], own, "event {id} of {text}");
        }
    }
    stored
}

/// Makes every event deliverable again (the runs keep delivered rows for the retention): a copy
/// of each parked for the destination, due now, as a retry is.
async fn redeliver(db: &TestDb) {
    let client = db.client().await;
    let parked = client
        .execute(
            "insert into outbox_relay.parked (destination, id, uuid, topic, key, payload, created_at)
             select 'default', id, uuid, topic, key, payload, created_at from outbox_relay.outbox",
            &[],
        )
        .await
        .unwrap();
    let events = client.query_one("select count(*) from outbox_relay.outbox", &[]).await.unwrap().get::<_, i64>(0);
    assert_eq!(parked as i64, events, "every event waits for the destination again");
}

/// Every event delivered: passed by the destination, nothing waiting for it, nothing dead.
async fn all_processed(db: &TestDb, count: usize) {
    eventually("every event delivered", || async {
        let stats = db.outbox.queue_stats().await.unwrap();
        assert_eq!(stats.dead_letters, 0, "nothing is dead-lettered");
        crate::cli::settled(db, count as i64).await
    })
    .await;
}

/// The event objects' payloads, by id, byte for byte as they were sent.
fn envelopes<'a>(bodies: impl IntoIterator<Item = &'a [u8]>) -> HashMap<i64, String> {
    #[derive(serde::Deserialize)]
    struct Envelope<'a> {
        id: i64,
        #[serde(borrow)]
        payload: &'a RawValue,
    }
    bodies
        .into_iter()
        .map(|body| {
            let envelope: Envelope = serde_json::from_slice(body).unwrap();
            (envelope.id, envelope.payload.get().to_string())
        })
        .collect()
}

fn assert_same(sink: &str, got: &HashMap<i64, String>, stored: &HashMap<i64, String>) {
    assert_eq!(got.len(), stored.len(), "{sink}: every event arrived");
    for (id, text) in stored {
        assert_eq!(got.get(id), Some(text), "{sink}: event {id}");
    }
}

#[tokio::test]
async fn payloads_reach_stdout_and_http_as_postgres_stored_them() {
    let db = TestDb::new().await;
    let stored = publish_everything(&db).await;

    // stdout: one event object per line
    let child = spawn_run(&db.url, &["--sink", "stdout"]);
    all_processed(&db, stored.len()).await;
    let output = terminate_with_output(child).await;
    let text = stdout(&output);
    assert_same("stdout", &envelopes(text.lines().map(str::as_bytes)), &stored);

    // HTTP, in its three formats
    let (url, seen) = crate::webhooks::receiver().await;
    for format in ["raw", "cloudevents", "cloudevents-structured"] {
        redeliver(&db).await;
        seen.lock().unwrap().clear();
        let child = spawn_run(&db.url, &["--sink", &url, "--format", format]);
        all_processed(&db, stored.len()).await;
        terminate_with_output(child).await;
        let requests = seen.lock().unwrap().clone();
        let got: HashMap<i64, String> = match format {
            "raw" => envelopes(requests.iter().map(|(_, body)| &body[..])),
            "cloudevents" => requests
                .iter()
                .map(|(headers, body)| {
                    let id = headers["outbox-event-id"].to_str().unwrap().parse().unwrap();
                    (id, String::from_utf8(body.to_vec()).unwrap())
                })
                .collect(),
            _ => requests
                .iter()
                .map(|(headers, body)| {
                    #[derive(serde::Deserialize)]
                    struct CloudEvent<'a> {
                        id: String,
                        #[serde(borrow)]
                        data: &'a RawValue,
                    }
                    let event: CloudEvent = serde_json::from_slice(body).unwrap();
                    assert_eq!(
                        event.id,
                        headers["outbox-event-uuid"].to_str().unwrap(),
                        "the CloudEvent id is the uuid"
                    );
                    (headers["outbox-event-id"].to_str().unwrap().parse().unwrap(), event.data.get().to_string())
                })
                .collect(),
        };
        assert_same(&format!("HTTP {format}"), &got, &stored);
    }
}

/// NATS JetStream: the test kit starts nats-server (or uses `NATS_URL`).
mod needs_nats {
    use super::*;

    #[tokio::test]
    async fn payloads_reach_nats_as_postgres_stored_them() {
        let db = TestDb::new().await;
        let stored = publish_everything(&db).await;
        let js = nats().await;
        let prefix = unique("fidelity");
        let stream = stream_for(&js, &prefix).await;
        let child = spawn_run(&db.url, &["--sink", &nats_url(), "--subject-prefix", &prefix]);
        all_processed(&db, stored.len()).await;
        terminate_with_output(child).await;
        let mut bodies = Vec::new();
        for seq in 1..=stored.len() as u64 {
            bodies.push(stream.get_raw_message(seq).await.unwrap().payload.to_vec());
        }
        assert_same("NATS", &envelopes(bodies.iter().map(Vec::as_slice)), &stored);
        js.delete_stream(&prefix).await.unwrap();
    }
}

/// RabbitMQ: `AMQP_URL` or the machine's broker.
mod needs_rabbitmq {
    use super::*;

    #[tokio::test]
    async fn payloads_reach_rabbitmq_as_postgres_stored_them() {
        let db = TestDb::new().await;
        let stored = publish_everything(&db).await;
        let exchange = format!("fidelity-{:016x}", rand::random::<u64>());
        let (_connection, mut consumer) = crate::amqp::bound_queue(&exchange).await;
        let amqp_url = crate::amqp::amqp_url();
        let child = spawn_run(&db.url, &["--sink", &amqp_url, "--exchange", &exchange]);
        let mut bodies = Vec::new();
        while bodies.len() < stored.len() {
            bodies.push(crate::amqp::next(&mut consumer).await.data);
        }
        all_processed(&db, stored.len()).await;
        terminate_with_output(child).await;
        assert_same("RabbitMQ", &envelopes(bodies.iter().map(Vec::as_slice)), &stored);
    }
}
