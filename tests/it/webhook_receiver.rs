//! The webhook receiver example (`examples/webhook_receiver`) on a database of its own, fed by a
//! relay's signed HTTP sink: every event given twice is committed once, a duplicate is answered
//! 200, and requests that do not verify write nothing.

use std::time::{Duration, SystemTime};

use axum::http::HeaderMap;
use pg_outbox_relay::NewEvent;
use pg_outbox_relay::sink::{HttpSink, SigningSecret};
use serde_json::{Value, json};

use crate::harness::TestDb;
use crate::relay_support::{self as support, PATIENCE, config, count, eventually};

#[path = "../../examples/webhook_receiver/app.rs"]
mod app;

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const OTHER_SECRET: &str = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD";

/// The receiver on `db`; returns its webhook URL.
async fn serve(db: &TestDb) -> String {
    app::setup(&db.outbox).await.expect("setting up the receiver");
    let receiver = app::Receiver::new(db.outbox.clone(), "erp", SECRET).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(axum::serve(listener, app::router(receiver)).into_future());
    format!("http://{address}/webhook")
}

#[tokio::test]
async fn every_event_delivered_twice_is_committed_once() {
    let (outbox_db, receiver_db) = (TestDb::new().await, TestDb::new().await);
    let url = serve(&receiver_db).await;
    let sink = HttpSink::builder(&url).signing_secret(SigningSecret::parse(SECRET).unwrap()).build().unwrap();
    let relay = support::start(&outbox_db.outbox, config(), sink);
    let events: Vec<NewEvent> = (0..60)
        .map(|n| NewEvent::new("order.placed", json!({"order_id": n})).key(format!("order-{}", n % 6)))
        .collect();
    outbox_db.outbox.publish_all(&events).await.unwrap();
    // Delivered: recorded so by the relay, every outbox row passed, nothing waiting for a retry.
    let nothing_waits = "select count(*) from outbox_relay.parked";
    eventually("the 60 events delivered", || async {
        relay.snapshot().delivered >= 60
            && count(
                &outbox_db.client().await,
                "select count(*) from outbox_relay.outbox where outbox_relay.passed_by_all(xid, id)",
            )
            .await
                == 60
            && count(&outbox_db.client().await, nothing_waits).await == 0
    })
    .await;

    // The same events again, under new ids and their old uuids: what a restore from a backup
    // taken before they were delivered brings back (or a second relay that sent them too).
    outbox_db
        .client()
        .await
        .execute(
            "insert into outbox_relay.outbox (uuid, topic, key, payload) \
             select uuid, topic, key, payload from outbox_relay.outbox order by id",
            &[],
        )
        .await
        .unwrap();
    eventually("the 60 redeliveries delivered", || async {
        relay.snapshot().delivered >= 120
            && count(
                &outbox_db.client().await,
                "select count(*) from outbox_relay.outbox where outbox_relay.passed_by_all(xid, id)",
            )
            .await
                == 120
            && count(&outbox_db.client().await, nothing_waits).await == 0
    })
    .await;
    let snapshot = relay.snapshot();
    relay.stop().await;

    assert_eq!(
        count(&receiver_db.client().await, "select count(*) from received_events").await,
        60,
        "each event written once"
    );
    assert_eq!(count(&receiver_db.client().await, "select count(distinct event_uuid) from received_events").await, 60);
    assert_eq!(
        count(&receiver_db.client().await, "select count(*) from outbox_relay.inbox where consumer = 'erp'").await,
        60
    );
    let matching = "select count(*) from received_events r where (r.payload ->> 'order_id')::int between 0 and 59";
    assert_eq!(count(&receiver_db.client().await, matching).await, 60, "the receiver wrote what the events said");
    // The duplicates were answered 200 at once: one attempt each, no retry, no dead letter.
    assert_eq!((snapshot.delivered, snapshot.retried, snapshot.dead_lettered), (120, 0, 0), "{snapshot:?}");
    assert_eq!(count(&outbox_db.client().await, nothing_waits).await, 0);
    assert_eq!(count(&outbox_db.client().await, "select count(*) from outbox_relay.dead_letters").await, 0);
}

/// A signed request as the relay would send it, by the specification's own crate.
fn signed(secret: &str, id: &str, at: SystemTime, body: &str) -> HeaderMap {
    let timestamp = at.duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs() as i64;
    let signature = standardwebhooks::Webhook::new(secret).unwrap().sign(id, timestamp, body.as_bytes()).unwrap();
    let mut headers = HeaderMap::new();
    headers.insert("webhook-id", id.parse().unwrap());
    headers.insert("webhook-timestamp", timestamp.to_string().parse().unwrap());
    headers.insert("webhook-signature", signature.parse().unwrap());
    headers.insert("content-type", "application/json".parse().unwrap());
    headers
}

#[tokio::test]
async fn racing_duplicates_are_answered_200_and_unverified_requests_write_nothing() {
    let db = TestDb::new().await;
    let url = serve(&db).await;
    // reqwest is built with `rustls-no-provider`: a process-wide provider must exist first.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let http = reqwest::Client::new();
    let post = |headers: HeaderMap, body: String| {
        let (http, url) = (http.clone(), url.clone());
        async move {
            let response = http.post(&url).headers(headers).body(body).timeout(PATIENCE).send().await.unwrap();
            (response.status().as_u16(), response.json::<Value>().await.unwrap())
        }
    };
    let id = "3f0c4a8e-7a51-4f0e-9a4f-1c2d3e4f5a6b";
    let body = json!({"id": 7, "uuid": id, "topic": "order.placed", "payload": {"order_id": 7}}).to_string();

    // Twenty copies of one delivery at once.
    let answers =
        futures::future::join_all((0..20).map(|_| post(signed(SECRET, id, SystemTime::now(), &body), body.clone())))
            .await;
    assert!(answers.iter().all(|(status, _)| *status == 200), "{answers:?}");
    let processed = answers.iter().filter(|(_, b)| b["status"] == "processed").count();
    let duplicates = answers.iter().filter(|(_, b)| b["status"] == "duplicate").count();
    assert_eq!((processed, duplicates), (1, 19), "{answers:?}");
    assert_eq!(count(&db.client().await, "select count(*) from received_events").await, 1);

    // Requests that do not verify: another secret, a changed body, a stale timestamp, none.
    let other = "9d8c7b6a-5f4e-4d3c-8b2a-1a0f9e8d7c6b";
    let other_body = body.replace(id, other);
    let stale = SystemTime::now() - Duration::from_secs(600);
    for (what, headers, sent) in [
        ("another secret", signed(OTHER_SECRET, other, SystemTime::now(), &other_body), other_body.clone()),
        ("a changed body", signed(SECRET, other, SystemTime::now(), &other_body), other_body.replace("7}", "8}")),
        ("a stale timestamp", signed(SECRET, other, stale, &other_body), other_body.clone()),
        ("no signature", HeaderMap::new(), other_body.clone()),
    ] {
        let (status, answer) = post(headers, sent).await;
        assert_eq!(status, 401, "{what}: {answer}");
    }
    // A verified body that is not an event: 400 (the relay dead-letters it).
    let (status, _) = post(signed(SECRET, other, SystemTime::now(), "[1]"), "[1]".into()).await;
    assert_eq!(status, 400);
    assert_eq!(count(&db.client().await, "select count(*) from received_events").await, 1, "nothing more written");
    assert_eq!(count(&db.client().await, "select count(*) from outbox_relay.inbox").await, 1, "nothing more recorded");
}

/// The example's own binary (built by `cargo test` with the other examples), run as a user runs
/// it: with its log redirected it writes no terminal colours, and SIGTERM (what `kill`, systemd
/// and container engines send) stops it gracefully with exit code 0, not 143.
#[tokio::test]
async fn the_binary_logs_plain_text_to_a_pipe_and_stops_cleanly_on_sigterm() {
    use tokio::io::AsyncBufReadExt;
    // target/<profile>/deps/it-<hash> -> target/<profile>/examples/webhook_receiver
    let test = std::env::current_exe().unwrap();
    let binary = test.parent().and_then(|deps| deps.parent()).unwrap().join("examples/webhook_receiver");
    // `cargo test` builds the examples; `cargo test --test it` alone does not (build them with
    // `cargo build --examples --all-features`, or this runs an older build).
    assert!(
        binary.is_file(),
        "{} is built by `cargo test` (or cargo build --examples --all-features)",
        binary.display()
    );
    let db = TestDb::new().await;
    let mut child = tokio::process::Command::new(&binary)
        .args(["--listen", "127.0.0.1:0"])
        .env("DATABASE_URL", &db.url)
        .env("WEBHOOK_SECRET", "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
        .env_remove("RUST_LOG")
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let listening = tokio::time::timeout(PATIENCE, async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if line.contains("webhook receiver listening") {
                return line;
            }
        }
        panic!("the receiver exited before listening")
    })
    .await
    .expect("the receiver listens");
    assert!(!listening.contains('\u{1b}'), "no terminal escapes in a redirected log: {listening:?}");
    let pid = child.id().unwrap();
    assert!(std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status().unwrap().success());
    let status = tokio::time::timeout(PATIENCE, child.wait()).await.expect("it stops").unwrap();
    assert_eq!(status.code(), Some(0), "{status:?}");
}
