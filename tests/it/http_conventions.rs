//! The HTTP sink as receivers' own libraries read it: Standard Webhooks signatures verified by
//! the official `standardwebhooks` package, CloudEvents parsed by the official `cloudevents` SDK
//! (both from PyPI; `.ci/run` installs them, and the tests that need them are in `needs_python`), fixed headers, and bad options refused.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::post;
use pg_outbox_relay::sink::{EventFormat, HttpSink, SigningSecret};
use std::time::Duration;

use pg_outbox_relay::{ErrorKind, NewEvent, RelayConfig};
use serde_json::{Value, json};

use crate::harness::TestDb;
use crate::http_sink::serve;
use crate::relay_support::{self as support, config, eventually};
use crate::tools::{self, CLOUDEVENTS, PythonPackage, STANDARDWEBHOOKS};

/// Two secrets (the current and the next, as during a rotation) and one the sender never had.
const SECRET_A: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const SECRET_B: &str = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD";
const SECRET_OTHER: &str = "whsec_dGhpcyBpcyBub3QgdGhlIHNlbmRlcnMga2V5";

/// One request as the receiver got it.
#[derive(Debug, Clone)]
struct Received {
    headers: HashMap<String, String>,
    body: String,
}

/// A receiver that records every request; the first attempt of each event with the key `retry`
/// is answered 503 with `Retry-After: 1`, so that its second attempt comes a second later.
async fn receiver() -> (String, Arc<Mutex<Vec<Received>>>) {
    let seen: Arc<Mutex<Vec<Received>>> = Arc::default();
    let app = Router::new().route(
        "/hook",
        post({
            let seen = seen.clone();
            move |headers: HeaderMap, body: Bytes| async move {
                let headers: HashMap<String, String> = headers
                    .iter()
                    .map(|(k, v)| (k.as_str().to_string(), String::from_utf8_lossy(v.as_bytes()).into_owned()))
                    .collect();
                let body = String::from_utf8(body.to_vec()).unwrap();
                let first_of_retry = headers.get("outbox-attempt").map(String::as_str) == Some("1")
                    && (body.contains("\"retry\"")
                        || headers.get("ce-partitionkey").map(String::as_str) == Some("retry"));
                seen.lock().unwrap().push(Received { headers, body });
                if first_of_retry {
                    (StatusCode::SERVICE_UNAVAILABLE, [(header::RETRY_AFTER, "1")]).into_response()
                } else {
                    StatusCode::NO_CONTENT.into_response()
                }
            }
        }),
    );
    let addr = serve(app).await;
    (format!("http://{addr}/hook"), seen)
}

/// Runs `script`, which imports `package`, with the requests as JSON on stdin; returns what it
/// prints (JSON).
fn python(script: &str, package: PythonPackage, requests: &[Received], args: &[&str]) -> Value {
    let input: Vec<Value> = requests.iter().map(|r| json!({"headers": r.headers, "body": r.body})).collect();
    let output = tools::python(script, args, serde_json::to_string(&input).unwrap().as_bytes(), &[package]);
    assert!(output.status.success(), "the receiver's script failed: {}", String::from_utf8_lossy(&output.stderr));
    serde_json::from_slice(&output.stdout).unwrap()
}

/// For each request and each secret given: "ok", or the library's error.
const VERIFY: &str = r#"
import json, sys
from standardwebhooks.webhooks import Webhook
requests = json.load(sys.stdin)
out = []
for r in requests:
    row = []
    for secret in sys.argv[1:]:
        try:
            Webhook(secret).verify(r["body"].encode(), r["headers"])
            row.append("ok")
        except Exception as e:
            row.append(type(e).__name__ + ": " + str(e))
    out.append(row)
print(json.dumps(out))
"#;

/// Each request parsed by the CloudEvents SDK (binary or structured, as it detects).
const PARSE_CLOUDEVENT: &str = r#"
import json, sys
from cloudevents.core.bindings import http
requests = json.load(sys.stdin)
out = []
for r in requests:
    event = http.from_http_event(http.HTTPMessage(headers=r["headers"], body=r["body"].encode()))
    attributes = event.get_attributes()
    out.append({
        "specversion": event.get_specversion(),
        "id": event.get_id(),
        "type": event.get_type(),
        "source": event.get_source(),
        "time": event.get_time().isoformat() if event.get_time() else None,
        "partitionkey": attributes.get("partitionkey"),
        "datacontenttype": event.get_datacontenttype(),
        "data": event.get_data(),
    })
print(json.dumps(out))
"#;

#[tokio::test]
async fn fixed_headers_are_sent_and_bad_ones_refused_without_showing_their_values() {
    let db = TestDb::new().await;
    let (url, seen) = receiver().await;
    let sink =
        HttpSink::builder(&url).header("Authorization", "Bearer tok-123").header("X-Tenant", "acme").build().unwrap();
    assert!(!format!("{sink:?}").contains("tok-123"), "Debug hides header values: {sink:?}");
    let relay = support::start(&db.outbox, config(), sink);
    db.outbox.publish(&NewEvent::new("order.placed", json!({}))).await.unwrap();
    eventually("delivered", || async { seen.lock().unwrap().len() == 1 }).await;
    relay.stop().await;
    let request = seen.lock().unwrap()[0].clone();
    assert_eq!(request.headers["authorization"], "Bearer tok-123");
    assert_eq!(request.headers["x-tenant"], "acme");
    assert_eq!(request.headers["content-type"], "application/json", "raw stays the default");
    assert!(!request.headers.contains_key("webhook-signature"), "no secret, no signature");

    for (name, value, says) in [
        ("Content-Type", "text/plain", "set by the sink"),
        ("webhook-id", "x", "set by the sink"),
        ("ce-id", "x", "set by the sink"),
        ("Outbox-Event-Id", "x", "set by the sink"),
        ("Bad Name", "x", "no HTTP header name"),
        ("X-Token", "secret-value\r\nX-Evil: 1", "characters a header cannot"),
    ] {
        let e = HttpSink::builder(&url).header(name, value).build().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(e.to_string().contains(says), "{name}: {e}");
        assert!(!e.to_string().contains("secret-value"), "{e}");
    }
    let e = HttpSink::builder(&url).cloudevents_source("not a uri").build().unwrap_err();
    assert!(e.to_string().contains("URI-reference"), "{e}");
}

/// What the official Python libraries make of the requests: python3 with standardwebhooks and
/// cloudevents (`tools::python` names what is missing).
mod needs_python {
    use super::*;

    #[tokio::test]
    async fn every_request_verifies_with_the_official_standard_webhooks_library_through_a_rotation() {
        let db = TestDb::new().await;
        let (url, seen) = receiver().await;
        let sink = HttpSink::builder(&url)
            .signing_secret(SigningSecret::parse(SECRET_A).unwrap())
            .signing_secret(SigningSecret::parse(SECRET_B).unwrap())
            .build()
            .unwrap();
        // The retry at least a second later, so that its timestamp must differ.
        let backoff = RelayConfig {
            backoff_base: Duration::from_millis(1500),
            backoff_max: Duration::from_millis(1500),
            backoff_jitter: 0.0,
            ..config()
        };
        let relay = support::start(&db.outbox, backoff, sink);
        let plain = db.outbox.publish(&NewEvent::new("order.placed", json!({"n": 1}))).await.unwrap();
        let retried = db.outbox.publish(&NewEvent::new("order.placed", json!({"n": 2})).key("retry")).await.unwrap();
        eventually("three requests (one event retried)", || async { seen.lock().unwrap().len() == 3 }).await;
        relay.stop().await;
        let requests = seen.lock().unwrap().clone();

        let verdicts = python(VERIFY, STANDARDWEBHOOKS, &requests, &[SECRET_A, SECRET_B, SECRET_OTHER]);
        for (request, verdict) in requests.iter().zip(verdicts.as_array().unwrap()) {
            assert_eq!(verdict[0], "ok", "{verdict} {request:?}");
            assert_eq!(verdict[1], "ok", "{verdict} {request:?}");
            assert_ne!(verdict[2], "ok", "a secret the sender never had must not verify: {request:?}");
            assert_eq!(request.headers["webhook-signature"].split(' ').count(), 2, "one signature per secret");
        }
        // A changed body does not verify.
        // (requests[0] may be either event: change whichever `n` it carries)
        let mut tampered = requests[0].clone();
        tampered.body = tampered.body.replacen("\"n\": ", "\"n\": 9", 1);
        assert_ne!(tampered.body, requests[0].body, "the body was changed");
        assert_ne!(python(VERIFY, STANDARDWEBHOOKS, &[tampered], &[SECRET_A])[0][0], "ok");

        // webhook-id is the event's uuid (a fresh one per event), the same on every attempt.
        for request in &requests {
            let webhook_id = &request.headers["webhook-id"];
            assert_eq!(webhook_id, &request.headers["outbox-event-uuid"], "webhook-id is the event's uuid");
            assert!(pg_outbox_relay::Uuid::parse_str(webhook_id).is_ok(), "{webhook_id}");
        }
        let of = |id: i64| -> Vec<&Received> {
            requests.iter().filter(|r| r.headers["outbox-event-id"] == id.to_string()).collect()
        };
        let attempts = of(retried);
        assert_eq!(attempts.len(), 2, "the retried event came twice");
        assert_eq!(
            attempts[0].headers["webhook-id"], attempts[1].headers["webhook-id"],
            "the same webhook-id on both attempts"
        );
        assert_ne!(of(plain)[0].headers["webhook-id"], attempts[0].headers["webhook-id"], "one uuid per event");
        let stamp = |r: &Received| r.headers["webhook-timestamp"].parse::<u64>().unwrap();
        assert!(
            stamp(attempts[1]) > stamp(attempts[0]),
            "a fresh timestamp per attempt (the retry came a second later)"
        );
    }

    #[tokio::test]
    async fn the_cloudevents_sdk_parses_both_modes_with_id_type_time_key_and_data() {
        let db = TestDb::new().await;
        let key = "clé 7 \"quoted\" 100%";
        let payload = json!({"order": 7, "note": "ção ✓"});
        for format in [EventFormat::CloudEventsBinary, EventFormat::CloudEventsStructured] {
            let (url, seen) = receiver().await;
            let sink = HttpSink::builder(&url).format(format).cloudevents_source("urn:shop:orders").build().unwrap();
            let relay = support::start(&db.outbox, config(), sink);
            let keyed = db.outbox.publish(&NewEvent::new("order.placed", payload.clone()).key(key)).await.unwrap();
            let unkeyed = db.outbox.publish(&NewEvent::new("order.cancelled", json!([1, 2]))).await.unwrap();
            eventually("both delivered", || async { seen.lock().unwrap().len() == 2 }).await;
            relay.stop().await;
            let requests = seen.lock().unwrap().clone();
            let parsed = python(PARSE_CLOUDEVENT, CLOUDEVENTS, &requests, &[]);
            let by_id: HashMap<String, &Value> =
                parsed.as_array().unwrap().iter().map(|e| (e["id"].as_str().unwrap().to_string(), e)).collect();
            // The CloudEvent id is the event's uuid.
            let created: Vec<(i64, String, String)> = db
            .client()
            .await
            .query("select id, uuid::text, to_char(created_at at time zone 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US') from outbox_relay.outbox order by id", &[])
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect();
            let uuid_of = |id: i64| created.iter().find(|c| c.0 == id).unwrap().1.clone();
            let event = by_id[&uuid_of(keyed)];
            assert_eq!(event["specversion"], "1.0", "{format:?} {event}");
            assert_eq!(event["type"], "order.placed");
            assert_eq!(event["source"], "urn:shop:orders");
            assert_eq!(event["partitionkey"], key, "{format:?}: the key comes back as written");
            assert_eq!(event["data"], payload, "{format:?}");
            assert_eq!(event["datacontenttype"], "application/json");
            let time = event["time"].as_str().unwrap();
            let written = &created.iter().find(|c| c.0 == keyed).unwrap().2;
            assert!(time.starts_with(written.as_str()), "ce time {time} is created_at {written}");
            let other = by_id[&uuid_of(unkeyed)];
            assert_eq!(other["type"], "order.cancelled");
            assert_eq!(other["partitionkey"], Value::Null, "no key, no partitionkey");
            assert_eq!(other["data"], json!([1, 2]));
            let content_type = &requests[0].headers["content-type"];
            match format {
                EventFormat::CloudEventsBinary => {
                    assert_eq!(content_type, "application/json");
                    assert!(requests.iter().all(|r| r.headers.contains_key("ce-id")));
                }
                _ => {
                    assert!(content_type.starts_with("application/cloudevents+json"), "{content_type}");
                    assert!(requests.iter().all(|r| !r.headers.contains_key("ce-id")));
                }
            }
            db.client().await.batch_execute("delete from outbox_relay.outbox").await.unwrap();
        }
    }
}
