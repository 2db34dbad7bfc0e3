//! The HTTP sink against real receivers that misbehave: redirects, endless error bodies,
//! `Retry-After`, credentials in the sink URL.

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use pg_outbox_relay::sink::HttpSink;
use pg_outbox_relay::{NewEvent, RelayConfig};
use serde_json::json;

use crate::harness::TestDb;
use crate::relay_support::{self as support, config, eventually, until};

/// Serves `app` on a free port of 127.0.0.1 and returns its address.
pub async fn serve(app: Router) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// The `last_error` of every event waiting for the destination `default`, once each has one.
async fn errors_of_pending(db: &TestDb, count: i64) -> Vec<String> {
    let client = db.client().await;
    let query = "select last_error from outbox_relay.parked
                  where destination = 'default' and last_error is not null order by id";
    eventually("every event failed once", || async { client.query(query, &[]).await.unwrap().len() as i64 == count })
        .await;
    client.query(query, &[]).await.unwrap().iter().map(|r| r.get(0)).collect()
}

/// 301, 302 and 303 would turn the POST into a GET without the body; 307 and 308 would send the
/// event wherever the receiver says. None is followed: the event stays pending, the error names
/// the Location, and the target of the redirect sees nothing.
#[tokio::test]
async fn redirects_are_never_followed_and_the_error_names_the_location() {
    let db = TestDb::new().await;
    let reached = Arc::new(Mutex::new(0u32));
    let app = Router::new()
        .route(
            "/hook/{code}",
            post(|axum::extract::Path(code): axum::extract::Path<u16>| async move {
                let status = StatusCode::from_u16(code).unwrap();
                (status, [(header::LOCATION, "/elsewhere?token=abc")]).into_response()
            }),
        )
        .route(
            "/elsewhere",
            post({
                let reached = reached.clone();
                move || async move {
                    *reached.lock().unwrap() += 1;
                    StatusCode::OK
                }
            })
            .get({
                let reached = reached.clone();
                move || async move {
                    *reached.lock().unwrap() += 1;
                    StatusCode::OK
                }
            }),
        );
    let addr = serve(app).await;
    let codes = [301u16, 302, 303, 307, 308];
    for code in codes {
        let sink = HttpSink::new(&format!("http://{addr}/hook/{code}"), Duration::from_secs(5)).unwrap();
        let relay_config = RelayConfig {
            workers: 1,
            backoff_base: Duration::from_secs(3600),
            backoff_max: Duration::from_secs(3600),
            ..config()
        };
        let relay = support::start(&db.outbox, relay_config, sink);
        db.outbox.publish(&NewEvent::new("order.placed", json!({"code": code}))).await.unwrap();
        let errors = errors_of_pending(&db, 1).await;
        assert_eq!(relay.snapshot().delivered, 0, "{code}: nothing delivered");
        relay.stop().await;
        let error = &errors[0];
        assert!(error.contains(&format!("answered {code}")), "{error}");
        assert!(error.contains("redirects are not followed"), "{error}");
        assert!(error.contains(&format!("Location http://{addr}/elsewhere?token=***")), "{error}");
        db.client()
            .await
            .batch_execute("delete from outbox_relay.parked; delete from outbox_relay.outbox")
            .await
            .unwrap();
    }
    assert_eq!(*reached.lock().unwrap(), 0, "the redirect's target must never be reached");
    let stats = db.outbox.queue_stats().await.unwrap();
    assert_eq!((stats.retained, stats.dead_letters), (0, 0));
}

/// A receiver answering 500 with a body that never ends: only a few KiB are read, so the attempt
/// ends at once (not at the timeout) and memory stays flat.
#[tokio::test]
async fn an_endless_error_body_is_read_only_a_little() {
    let db = TestDb::new().await;
    let app = Router::new().route(
        "/endless",
        post(|| async {
            let chunk = axum::body::Bytes::from(vec![b'x'; 64 * 1024]);
            let endless = futures::stream::repeat_with(move || Ok::<_, std::io::Error>(chunk.clone()));
            Response::builder().status(500).body(Body::from_stream(endless)).unwrap()
        }),
    );
    let addr = serve(app).await;
    // The timeout is far longer than the test's patience: only a bounded read can let the
    // attempts below happen in time.
    let sink = HttpSink::new(&format!("http://{addr}/endless"), Duration::from_secs(600)).unwrap();
    let relay_config = RelayConfig {
        workers: 1,
        backoff_base: Duration::from_millis(10),
        backoff_max: Duration::from_millis(20),
        max_attempts: 100,
        ..config()
    };
    let relay = support::start(&db.outbox, relay_config, sink);
    let id = db.outbox.publish(&NewEvent::new("order.placed", json!({}))).await.unwrap();
    let client = db.client().await;
    eventually("five failed attempts", || async {
        let attempts =
            "select coalesce(max(attempts), 0) from outbox_relay.parked where destination = 'default' and id = $1";
        let row = client.query_one(attempts, &[&id]).await.unwrap();
        row.get::<_, i32>(0) >= 5
    })
    .await;
    relay.stop().await;
    let error: String = client
        .query_one("select last_error from outbox_relay.parked where destination = 'default' and id = $1", &[&id])
        .await
        .unwrap()
        .get(0);
    assert!(error.contains("answered 500 Internal Server Error: xxxx"), "{error}");
    assert!(error.len() < 400, "the error keeps a snippet of the body, not the body: {} bytes", error.len());
}

/// A 429 or 503 with `Retry-After` is retried no sooner than it asks, though the backoff alone
/// would retry after milliseconds.
#[tokio::test]
async fn retry_after_is_honoured() {
    let db = TestDb::new().await;
    let answered_at = Arc::new(Mutex::new(None::<SystemTime>));
    let app = Router::new().route(
        "/busy",
        post({
            let answered_at = answered_at.clone();
            move || async move {
                *answered_at.lock().unwrap() = Some(SystemTime::now());
                (StatusCode::TOO_MANY_REQUESTS, [(header::RETRY_AFTER, "5")], "slow down")
            }
        }),
    );
    let addr = serve(app).await;
    let sink = HttpSink::new(&format!("http://{addr}/busy"), Duration::from_secs(5)).unwrap();
    let relay_config = RelayConfig {
        workers: 1,
        backoff_base: Duration::from_millis(10),
        backoff_max: Duration::from_secs(60),
        ..config()
    };
    let relay = support::start(&db.outbox, relay_config, sink);
    let id = db.outbox.publish(&NewEvent::new("order.placed", json!({}))).await.unwrap();
    errors_of_pending(&db, 1).await;
    relay.stop().await;
    let answered = answered_at.lock().unwrap().expect("the receiver was called");
    let row = db
        .client()
        .await
        .query_one(
            "select available_at, attempts, last_error from outbox_relay.parked where destination = 'default' and id = $1",
            &[&id],
        )
        .await
        .unwrap();
    let next: SystemTime = row.get(0);
    assert_eq!(row.get::<_, i32>(1), 1, "not retried yet");
    let waits = next.duration_since(answered).unwrap_or_default();
    assert!(waits >= Duration::from_millis(4900), "retried after {waits:?}, though the receiver asked for 5 s");
    assert!(row.get::<_, String>(2).contains("429"));
}

/// A sink URL's password and query values (tokens) never reach `last_error`, the dead letters
/// or the log: an answer (502) that sends the event to the dead letters, and a refused
/// connection, whose event waits with its error (it spends no attempt).
#[tokio::test]
async fn sink_credentials_are_never_shown() {
    let db = TestDb::new().await;
    let app = Router::new().route("/hook", post(|_: HeaderMap| async { StatusCode::BAD_GATEWAY }));
    let addr = serve(app).await;
    for sink_url in [
        format!("http://user:s3cret-pw@{addr}/hook?token=t0ken-value"),
        "http://user:s3cret-pw@127.0.0.1:1/hook?token=t0ken-value".to_string(),
    ] {
        let sink = HttpSink::new(&sink_url, Duration::from_secs(5)).unwrap();
        let relay = support::start(&db.outbox, RelayConfig { workers: 1, max_attempts: 1, ..config() }, sink);
        db.outbox.publish(&NewEvent::new("order.placed", json!({}))).await.unwrap();
        let error = until("the failure recorded", || async {
            let dead = db.outbox.dead_letters(10).await.unwrap();
            match dead.first() {
                Some(dead) => Some(dead.last_error.clone()),
                None => db.outbox.pending_errors(5).await.unwrap().into_iter().next().map(|e| e.error),
            }
        })
        .await;
        relay.stop().await;
        assert!(!error.contains("s3cret-pw") && !error.contains("t0ken-value"), "{error}");
        assert!(error.contains("user:***@") && error.contains("token=***"), "{error}");
        db.client()
            .await
            .batch_execute("delete from outbox_relay.dead_letters; delete from outbox_relay.parked")
            .await
            .unwrap();
    }
}

/// What the HTTP sink tells the adaptive limit and the breaker of each failure (issue 21): a
/// port nobody listens on is a refused connection (the breaker probes again at once); a
/// timeout, 429 and 503 are signs of overload; a 429 is an answer, which the breaker does not
/// count.
#[tokio::test]
async fn failures_say_whether_they_are_refusals_overload_or_answers() {
    use pg_outbox_relay::{Event, Handler, Payload};
    let event = Event {
        id: 1,
        uuid: pg_outbox_relay::Uuid::from_u128(1),
        topic: "t".into(),
        key: None,
        payload: Payload::from_json("{}").unwrap(),
        created_at: SystemTime::now(),
        attempts: 1,
        headers: Default::default(),
    };
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let refused = HttpSink::new(&format!("http://{closed}/"), Duration::from_secs(5)).unwrap().handle(&event).await;
    let refused = refused.unwrap_err();
    assert!(refused.is_refused() && !refused.is_overload() && refused.may_be_an_outage(), "{refused:?}");
    assert!(refused.is_unreached(), "a refused connection never reached the destination: {refused:?}");
    // A receiver that accepts the connection and closes it before any response: the request was
    // on its way (the event may be what the receiver cannot take), so the attempt counts.
    let closing = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let at = closing.local_addr().unwrap();
    let closer = tokio::spawn(async move {
        loop {
            if let Ok((connection, _)) = closing.accept().await {
                drop(connection);
            }
        }
    });
    let closed = HttpSink::new(&format!("http://{at}/"), Duration::from_secs(5)).unwrap().handle(&event).await;
    closer.abort();
    let closed = closed.unwrap_err();
    assert!(!closed.is_unreached() && !closed.is_refused() && closed.may_be_an_outage(), "{closed:?}");

    let addr = serve(
        Router::new()
            .route("/slow", post(|| async { std::future::pending::<()>().await }))
            .route("/429", post(|| async { StatusCode::TOO_MANY_REQUESTS }))
            .route("/503", post(|| async { StatusCode::SERVICE_UNAVAILABLE }))
            .route("/500", post(|| async { StatusCode::INTERNAL_SERVER_ERROR })),
    )
    .await;
    let fail = |path: &'static str| {
        let event = event.clone();
        async move {
            let sink = HttpSink::new(&format!("http://{addr}{path}"), Duration::from_millis(200)).unwrap();
            sink.handle(&event).await.unwrap_err()
        }
    };
    let slow = fail("/slow").await;
    assert!(slow.is_overload() && slow.may_be_an_outage() && !slow.is_refused(), "{slow:?}");
    assert!(!slow.is_unreached(), "a request that timed out once sent may have been taken: {slow:?}");
    let limited = fail("/429").await;
    assert!(limited.is_overload() && !limited.may_be_an_outage(), "{limited:?}");
    let unavailable = fail("/503").await;
    assert!(unavailable.is_overload() && unavailable.may_be_an_outage(), "{unavailable:?}");
    let broken = fail("/500").await;
    assert!(!broken.is_overload() && broken.may_be_an_outage() && !broken.is_refused(), "{broken:?}");
    assert!(!broken.is_unreached() && !unavailable.is_unreached() && !limited.is_unreached(), "answers");
}
