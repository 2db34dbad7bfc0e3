//! Headers a writer gives in SQL (issue 25) arrive unchanged, each sink sending them its own way:
//! stdout in the event's JSON, HTTP as headers (and in CloudEvents as extension attributes where
//! the name is one), NATS and RabbitMQ as message headers. The trace context goes as the
//! transport's `traceparent` in every format, so a receiver's instrumentation joins the trace.

use std::collections::BTreeMap;

use axum::http::HeaderMap;
use serde_json::{Value, json};

use crate::binary::{spawn_run, stdout, terminate_with_output};
use crate::harness::TestDb;
use crate::relay_support::eventually;

const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

/// What the writer gives: a header that is a CloudEvents extension's name (`tenant`), one that
/// is not (`X-Correlation-Id`), a value with every kind of printable character, and the trace
/// context.
fn written() -> Value {
    json!({
        "X-Correlation-Id": "c-42",
        "tenant": "acme",
        "x-odd": "a \"quoted\" value; with=equals, commas, 100% and ~`!@#$^&*()[]{}|\\<>?/",
        "traceparent": TRACEPARENT,
        "tracestate": "vendor=abc,other=x",
    })
}

/// Publishes one event with the headers through SQL, and one without; returns their ids.
async fn publish(db: &TestDb) -> (i64, i64) {
    let client = db.client().await;
    let with: i64 = client
        .query_one(
            "select outbox_relay.publish('h.placed', '{\"n\": 1}', 'k', $1::text::jsonb)",
            &[&written().to_string()],
        )
        .await
        .unwrap()
        .get(0);
    let without: i64 =
        client.query_one("select outbox_relay.publish('h.placed', '{\"n\": 2}', 'k')", &[]).await.unwrap().get(0);
    (with, without)
}

async fn all_processed(db: &TestDb) {
    eventually("both events delivered", || async {
        let stats = db.outbox.queue_stats().await.unwrap();
        assert_eq!(stats.dead_letters, 0, "nothing is dead-lettered");
        crate::cli::settled(db, 2).await
    })
    .await;
}

/// Makes both events deliverable again, headers and all, as a retry does.
async fn redeliver(db: &TestDb) {
    db.client()
        .await
        .execute(
            "insert into outbox_relay.parked (destination, id, uuid, topic, key, payload, headers, created_at)
             select 'default', id, uuid, topic, key, payload, headers, created_at from outbox_relay.outbox",
            &[],
        )
        .await
        .unwrap();
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).map(|v| v.to_str().unwrap())
}

/// The CloudEvents HTTP binding's decoding of a `ce-` header's value.
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            out.push(u8::from_str_radix(&text[i + 1..i + 3], 16).unwrap());
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).unwrap()
}

#[tokio::test]
async fn headers_written_in_sql_reach_stdout_and_http_unchanged() {
    let db = TestDb::new().await;
    let (with, without) = publish(&db).await;
    let written = written();
    let written = written.as_object().unwrap();

    let child = spawn_run(&db.url, &["--sink", "stdout"]);
    all_processed(&db).await;
    let output = terminate_with_output(child).await;
    let lines: Vec<Value> = stdout(&output).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let line = |id: i64| lines.iter().find(|l| l["id"] == id).unwrap().clone();
    assert_eq!(&line(with)["headers"], &Value::Object(written.clone()), "stdout: in the event's JSON");
    assert!(line(without).get("headers").is_none(), "stdout: no headers, no member");

    let (url, seen) = crate::webhooks::receiver().await;
    for format in ["raw", "cloudevents", "cloudevents-structured"] {
        redeliver(&db).await;
        seen.lock().unwrap().clear();
        let child = spawn_run(&db.url, &["--sink", &url, "--format", format]);
        all_processed(&db).await;
        terminate_with_output(child).await;
        let requests = seen.lock().unwrap().clone();
        assert_eq!(requests.len(), 2, "{format}");
        let (headers, body) =
            requests.iter().find(|(h, _)| header(h, "outbox-event-id") == Some(&with.to_string())).unwrap();
        let (plain, _) =
            requests.iter().find(|(h, _)| header(h, "outbox-event-id") == Some(&without.to_string())).unwrap();
        assert!(plain.get("traceparent").is_none() && plain.get("tenant").is_none(), "{format}: none given, none sent");
        // The trace context and the headers no extension can stand for: plain HTTP headers.
        for name in ["X-Correlation-Id", "x-odd", "traceparent", "tracestate"] {
            assert_eq!(header(headers, name), written[name].as_str(), "{format}: {name}");
        }
        match format {
            "raw" => {
                assert_eq!(header(headers, "tenant"), Some("acme"));
                let event: Value = serde_json::from_slice(body).unwrap();
                assert_eq!(&event["headers"], &Value::Object(written.clone()), "raw: in the event's JSON too");
            }
            "cloudevents" => {
                assert_eq!(header(headers, "tenant"), None, "an extension's name goes as ce-");
                let extensions: BTreeMap<&str, String> = ["tenant", "traceparent", "tracestate"]
                    .into_iter()
                    .map(|n| (n, percent_decode(header(headers, &format!("ce-{n}")).unwrap())))
                    .collect();
                for (name, value) in extensions {
                    assert_eq!(value, written[name].as_str().unwrap(), "ce-{name}");
                }
                assert!(headers.get("ce-x-odd").is_none() && headers.get("ce-x-correlation-id").is_none());
            }
            _ => {
                let event: Value = serde_json::from_slice(body).unwrap();
                for name in ["tenant", "traceparent", "tracestate"] {
                    assert_eq!(event[name], written[name], "structured: the extension {name}");
                }
                assert!(event.get("x-odd").is_none(), "no extension has that name");
            }
        }
    }
}

/// NATS JetStream: the test kit starts nats-server (or uses `NATS_URL`).
mod needs_nats {
    use super::*;
    use crate::cli::{nats, nats_url, stream_for, unique};

    #[tokio::test]
    async fn headers_written_in_sql_reach_nats_unchanged() {
        let db = TestDb::new().await;
        let (with, _) = publish(&db).await;
        let js = nats().await;
        let prefix = unique("headers");
        let stream = stream_for(&js, &prefix).await;
        let child = spawn_run(&db.url, &["--sink", &nats_url(), "--subject-prefix", &prefix]);
        all_processed(&db).await;
        terminate_with_output(child).await;
        let mut found = 0;
        for seq in 1..=2 {
            let message = stream.get_raw_message(seq).await.unwrap();
            let headers = message.headers;
            if headers.get("Outbox-Event-Id").map(|v| v.as_str()) != Some(&with.to_string()) {
                assert!(headers.get("traceparent").is_none());
                continue;
            }
            found += 1;
            for (name, value) in written().as_object().unwrap() {
                assert_eq!(headers.get(name.as_str()).map(|v| v.as_str()), value.as_str(), "NATS: {name}");
            }
        }
        assert_eq!(found, 1);
        js.delete_stream(&prefix).await.unwrap();
    }
}

/// RabbitMQ: `AMQP_URL` or the machine's broker.
mod needs_rabbitmq {
    use lapin::types::AMQPValue;

    use super::*;

    #[tokio::test]
    async fn headers_written_in_sql_reach_rabbitmq_unchanged() {
        let db = TestDb::new().await;
        let (with, _) = publish(&db).await;
        let exchange = format!("headers-{:016x}", rand::random::<u64>());
        let (_connection, mut consumer) = crate::amqp::bound_queue(&exchange).await;
        let child = spawn_run(&db.url, &["--sink", &crate::amqp::amqp_url(), "--exchange", &exchange]);
        let mut found = 0;
        for _ in 0..2 {
            let delivery = crate::amqp::next(&mut consumer).await;
            let table = delivery.properties.headers().clone().unwrap();
            let table = table.inner();
            if crate::amqp::event_id(&delivery) != with {
                assert!(!table.contains_key("traceparent"));
                continue;
            }
            found += 1;
            for (name, value) in written().as_object().unwrap() {
                match table.get(name.as_str()) {
                    Some(AMQPValue::LongString(got)) => {
                        assert_eq!(got.to_string(), value.as_str().unwrap(), "RabbitMQ: {name}")
                    }
                    other => panic!("RabbitMQ: {name} is {other:?}"),
                }
            }
        }
        all_processed(&db).await;
        terminate_with_output(child).await;
        assert_eq!(found, 1);
    }
}
