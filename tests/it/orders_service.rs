//! The orders service example (`examples/orders_service`), served in-process on a free port and
//! driven over real HTTP.

use reqwest::header::CONTENT_TYPE;
use serde_json::{Value, json};
use tokio::sync::oneshot;

use crate::harness::TestDb;
use crate::orders::Counts;
use crate::relay_support::{PATIENCE, eventually};

#[path = "../../examples/orders_service/app.rs"]
mod app;

/// The service running on a test database.
struct Service {
    base: String,
    http: reqwest::Client,
}

/// One answer: status, the `Idempotent-Replayed` header, and the JSON body.
#[derive(Debug)]
struct Answer {
    status: u16,
    replayed_header: Option<String>,
    body: Value,
}

async fn serve(db: &TestDb) -> Service {
    app::setup(&db.outbox).await.expect("setting up the orders service");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(axum::serve(listener, app::router(db.outbox.clone())).into_future());
    Service { base: format!("http://{address}"), http: http_client() }
}

/// A plain-HTTP client. reqwest is built with `rustls-no-provider`, so a process-wide crypto
/// provider must exist before any client is built (an earlier install is kept).
fn http_client() -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::new()
}

impl Service {
    async fn post(&self, key: Option<&str>, body: &Value) -> Answer {
        let mut request = self.http.post(format!("{}/orders", self.base)).json(body);
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        answer(request).await
    }

    async fn get(&self, id: &str) -> Answer {
        answer(self.http.get(format!("{}/orders/{id}", self.base))).await
    }
}

async fn answer(request: reqwest::RequestBuilder) -> Answer {
    let response = request.send().await.expect("the service did not answer");
    let status = response.status().as_u16();
    let replayed_header = response.headers().get("idempotent-replayed").map(|v| v.to_str().unwrap().to_string());
    let is_json = response.headers().get(CONTENT_TYPE).is_some_and(|v| v.as_bytes() == b"application/json");
    let text = response.text().await.unwrap();
    assert!(is_json, "status {status}: not a JSON answer: {text}");
    Answer { status, replayed_header, body: serde_json::from_str(&text).unwrap() }
}

/// Asserts a JSON error answer with `status`, and returns its message.
fn error(answer: &Answer, status: u16) -> String {
    assert_eq!(answer.status, status, "{answer:?}");
    answer.body["error"].as_str().unwrap_or_else(|| panic!("no error message: {answer:?}")).to_string()
}

async fn counts(db: &TestDb) -> Counts {
    Counts::read(&db.client().await).await
}

const ONE_OF_EACH: Counts = Counts::ONE_OF_EACH;
const NOTHING: Counts = Counts::NOTHING;

fn ana() -> Value {
    json!({"customer": "ana", "total": 12.5})
}

fn order_id(answer: &Answer) -> i64 {
    answer.body["order_id"].as_i64().unwrap_or_else(|| panic!("no order_id: {answer:?}"))
}

#[tokio::test]
async fn post_creates_order_with_audit_receipt_and_event() {
    let db = TestDb::new().await;
    let service = serve(&db).await;

    let placed = service.post(Some("checkout-1"), &ana()).await;
    assert_eq!(placed.status, 201, "{placed:?}");
    assert_eq!(placed.body["replayed"], json!(false));
    assert_eq!(placed.replayed_header, None);
    let id = order_id(&placed);

    assert_eq!(counts(&db).await, ONE_OF_EACH);
    let client = db.client().await;
    let event = client.query_one("select topic, key, payload from outbox_relay.outbox", &[]).await.unwrap();
    assert_eq!(event.get::<_, String>(0), "order.placed");
    assert_eq!(event.get::<_, Option<String>>(1), Some(id.to_string()));
    assert_eq!(event.get::<_, Value>(2), json!({"order_id": id, "customer": "ana", "total": 12.5}));
    let order = client.query_one("select id, customer, total::float8 from orders", &[]).await.unwrap();
    assert_eq!((order.get::<_, i64>(0), order.get::<_, String>(1), order.get::<_, f64>(2)), (id, "ana".into(), 12.5));
}

#[tokio::test]
async fn same_key_and_body_replays_the_first_answer() {
    let db = TestDb::new().await;
    let service = serve(&db).await;
    let first = service.post(Some("checkout-1"), &ana()).await;
    assert_eq!(first.status, 201, "{first:?}");

    let again = service.post(Some("checkout-1"), &ana()).await;
    assert_eq!(again.status, 201, "{again:?}");
    assert_eq!(order_id(&again), order_id(&first));
    assert_eq!(again.body["replayed"], json!(true));
    assert_eq!(again.replayed_header.as_deref(), Some("true"));
    assert_eq!(counts(&db).await, ONE_OF_EACH);
}

#[tokio::test]
async fn same_key_with_another_body_is_refused() {
    let db = TestDb::new().await;
    let service = serve(&db).await;
    assert_eq!(service.post(Some("checkout-1"), &ana()).await.status, 201);

    let other = service.post(Some("checkout-1"), &json!({"customer": "ana", "total": 99})).await;
    let message = error(&other, 422);
    assert!(message.contains("checkout-1") && message.contains("different request"), "{message}");
    assert_eq!(counts(&db).await, ONE_OF_EACH);
}

#[tokio::test]
async fn bad_requests_get_json_errors_and_write_nothing() {
    let db = TestDb::new().await;
    let service = serve(&db).await;

    let message = error(&service.post(None, &ana()).await, 400);
    assert!(message.contains("Idempotency-Key"), "{message}");

    let malformed = service
        .http
        .post(format!("{}/orders", service.base))
        .header("Idempotency-Key", "k-malformed")
        .header(CONTENT_TYPE, "application/json")
        .body("{\"customer\": \"ana\", \"total\": ");
    error(&answer(malformed).await, 400);

    let not_json =
        service.http.post(format!("{}/orders", service.base)).header("Idempotency-Key", "k-text").body("ana 12.5");
    error(&answer(not_json).await, 400);

    let missing_field = service.post(Some("k-missing"), &json!({"customer": "ana"})).await;
    assert!(error(&missing_field, 400).contains("total"), "{missing_field:?}");

    let negative = service.post(Some("k-negative"), &json!({"customer": "ana", "total": -3})).await;
    assert!(error(&negative, 400).contains("total"), "{negative:?}");
    let zero = service.post(Some("k-zero"), &json!({"customer": "ana", "total": 0})).await;
    assert!(error(&zero, 400).contains("total"), "{zero:?}");
    let huge = service.post(Some("k-huge"), &json!({"customer": "ana", "total": 1e9})).await;
    assert!(error(&huge, 400).contains("total"), "{huge:?}");

    let blank = service.post(Some("k-blank"), &json!({"customer": "   ", "total": 1})).await;
    assert!(error(&blank, 400).contains("customer"), "{blank:?}");
    let long = service.post(Some("k-long"), &json!({"customer": "a".repeat(201), "total": 1})).await;
    assert!(error(&long, 400).contains("customer"), "{long:?}");

    let nul = service.post(Some("k-nul"), &json!({"customer": "a\u{0}b", "total": 1})).await;
    assert!(error(&nul, 400).contains("control characters"), "{nul:?}");
    let cents = service.post(Some("k-cents"), &json!({"customer": "ana", "total": 0.001})).await;
    assert!(error(&cents, 400).contains("two decimal places"), "{cents:?}");
    let twice = service
        .http
        .post(format!("{}/orders", service.base))
        .header("Idempotency-Key", "k-one")
        .header("Idempotency-Key", "k-two")
        .json(&ana());
    assert!(error(&answer(twice).await, 400).contains("more than once"));
    let wrong_method = service.http.delete(format!("{}/orders", service.base));
    assert!(error(&answer(wrong_method).await, 405).contains("method not allowed"));

    let message = error(&service.post(Some(""), &ana()).await, 400);
    assert!(message.contains("idempotency key"), "{message}");
    let message = error(&service.post(Some(&"k".repeat(256)), &ana()).await, 400);
    assert!(message.contains("idempotency key"), "{message}");

    assert_eq!(counts(&db).await, NOTHING);
}

#[tokio::test]
async fn concurrent_posts_with_one_key_make_one_order() {
    let db = TestDb::new().await;
    let service = std::sync::Arc::new(serve(&db).await);

    let tasks: Vec<_> = (0..5)
        .map(|_| {
            let service = service.clone();
            tokio::spawn(async move { service.post(Some("checkout-race"), &ana()).await })
        })
        .collect();
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.unwrap());
    }

    assert!(answers.iter().all(|a| a.status == 201), "{answers:?}");
    let first = order_id(&answers[0]);
    assert!(answers.iter().all(|a| order_id(a) == first), "{answers:?}");
    let fresh = answers.iter().filter(|a| a.body["replayed"] == json!(false)).count();
    assert_eq!(fresh, 1, "{answers:?}");
    assert_eq!(counts(&db).await, ONE_OF_EACH);
}

#[tokio::test]
async fn get_returns_the_order_or_a_json_error() {
    let db = TestDb::new().await;
    let service = serve(&db).await;
    let id = order_id(&service.post(Some("checkout-1"), &json!({"customer": "  bob ", "total": 7.25})).await);

    let order = service.get(&id.to_string()).await;
    assert_eq!(order.status, 200, "{order:?}");
    assert_eq!(order.body["order_id"], json!(id));
    assert_eq!(order.body["customer"], json!("bob"));
    assert_eq!(order.body["total"], json!(7.25));
    let created_at = order.body["created_at"].as_str().expect("created_at");
    humantime::parse_rfc3339(created_at).unwrap_or_else(|e| panic!("created_at {created_at:?}: {e}"));

    assert!(error(&service.get(&(id + 1000).to_string()).await, 404).contains("no order"));
    assert!(error(&service.get("abc").await, 400).contains("abc"));
}

#[tokio::test]
async fn embedded_relay_delivers_the_event() {
    let db = TestDb::new().await;
    let service = serve(&db).await;
    let (stop, stopped) = oneshot::channel::<()>();
    let handler = app::AppHandler::new(None, None).await.unwrap();
    let relay = app::spawn_relay(&db.outbox, handler, async move {
        stopped.await.ok();
    })
    .unwrap();

    let id = order_id(&service.post(Some("checkout-1"), &ana()).await);
    let client = db.client().await;
    // Delivered: `event_state` says so (the row is kept for the retention, as is the audit entry).
    eventually("the order.placed event is delivered", || async {
        let delivered: i64 = client
            .query_one(
                "select count(*) from outbox_relay.event_state
                  where topic = 'order.placed' and key = $1 and state = 'delivered'",
                &[&id.to_string()],
            )
            .await
            .unwrap()
            .get(0);
        delivered == 1
    })
    .await;
    let count = |sql: &'static str| async { client.query_one(sql, &[]).await.unwrap().get::<_, i64>(0) };
    assert_eq!(count("select count(*) from outbox_relay.dead_letters").await, 0);
    assert_eq!(count("select count(*) from outbox_relay.audit where entity = 'order'").await, 1);

    stop.send(()).unwrap();
    tokio::time::timeout(PATIENCE, relay)
        .await
        .expect("relay did not stop")
        .expect("relay task panicked")
        .expect("relay failed");
}

/// A signing secret exported for another command (guarantees.md's `export WEBHOOK_SECRET=…`)
/// does not stop the service delivering to a sink that is not HTTP; an HTTP sink takes it.
#[tokio::test]
async fn a_signing_secret_applies_to_an_http_sink_only() {
    let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    assert!(matches!(app::AppHandler::new(Some("stdout"), Some(secret)).await, Ok(app::AppHandler::Sink(_))));
    assert!(matches!(
        app::AppHandler::new(Some("HTTP://127.0.0.1:9/hook"), Some(secret)).await,
        Ok(app::AppHandler::Sink(_))
    ));
    assert!(app::AppHandler::new(Some("http://127.0.0.1:9/hook"), Some("not-a-secret")).await.is_err());
}
