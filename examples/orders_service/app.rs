//! The orders service of the article, as a small HTTP API on axum.
//!
//! - `POST /orders` with `{"customer": "ana", "total": 12.5}` and an `Idempotency-Key` header
//!   places an order: the order row, an audit entry, the idempotency receipt and an `order.placed`
//!   event commit in one transaction ([`Outbox::execute`]). The answer is
//!   `201 {"order_id": N, "replayed": false}`. A retry with the same key and body writes nothing
//!   and gets the first answer back, Stripe-style: the same status 201 and `order_id`, with
//!   `"replayed": true` and the header `Idempotent-Replayed: true`. The same key with another body
//!   is refused with 422.
//! - `GET /orders/{id}` reads an order back.
//! - A relay in the same process delivers the events to an [`AppHandler`]: one log line per event,
//!   or one of the library's ready-made sinks.
//!
//! Every error is a JSON object `{"error": "..."}`: 400 for a bad request (body, idempotency key
//! or id), 404 for an unknown order, 422 for a reused key, 503 when the database is unreachable and
//! 500 for other database failures (details go to the log, not to the client).
//!
//! `main.rs` runs this as a program; `tests/it/orders_service.rs` serves the same router in-process.

use std::future::Future;
use std::time::SystemTime;

use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use pg_outbox_relay::sink::{HttpSink, SigningSecret, Sink};
use pg_outbox_relay::{
    AuditEntry, Begun, DeliveryError, ErrorKind, Event, Handler, NewEvent, Outbox, Relay, RelayConfig, Slots,
};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::task::JoinHandle;

/// The request header carrying the client's idempotency key.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// The response header marking a replayed answer.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";
/// The longest customer name, in characters.
pub const MAX_CUSTOMER_CHARS: usize = 200;
/// Order totals must be below this.
pub const MAX_TOTAL: f64 = 1e9;

const CREATE_ORDERS: &str = "create table if not exists orders (
    id bigserial primary key,
    customer text not null,
    total numeric(12, 2) not null,
    created_at timestamptz not null default now()
)";

/// Applies the library's migrations and creates the `orders` table when it is missing.
pub async fn setup(outbox: &Outbox) -> pg_outbox_relay::Result<()> {
    outbox.migrate().await?;
    outbox.connection().await?.batch_execute(CREATE_ORDERS).await?;
    Ok(())
}

/// The HTTP API: `POST /orders`, `GET /orders/{id}`.
pub fn router(outbox: Outbox) -> Router {
    Router::new()
        .route("/orders", post(place_order))
        .route("/orders/{id}", get(get_order))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such route") })
        .method_not_allowed_fallback(|| async {
            ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "method not allowed: POST /orders, GET /orders/{id}")
        })
        .with_state(outbox)
}

/// Where the embedded relay delivers events.
#[derive(Debug)]
pub enum AppHandler {
    /// Logs each event at info level.
    Log,
    /// Sends each event to a sink (`stdout`, `http://...`, `nats://...`); boxed, as it is large.
    Sink(Box<Sink>),
}

impl AppHandler {
    /// A sink for `spec` (connecting to it now; an HTTP sink signs with `signing_secret` when
    /// given), or the log when there is none.
    pub async fn new(sink: Option<&str>, signing_secret: Option<&str>) -> pg_outbox_relay::Result<AppHandler> {
        let http = |spec: &str| {
            let spec = pg_outbox_relay::sink::lower_scheme(spec);
            spec.starts_with("http://") || spec.starts_with("https://")
        };
        let sink = match (sink, signing_secret) {
            (None, _) => return Ok(AppHandler::Log),
            (Some(url), Some(secret)) if http(url) => {
                let secret = SigningSecret::parse(secret)?;
                Sink::Http(HttpSink::builder(url).signing_secret(secret).build()?)
            }
            (Some(spec), secret) => {
                if secret.is_some() {
                    // WEBHOOK_SECRET exported for another command (guarantees.md) must not stop
                    // this one from delivering to stdout or NATS.
                    tracing::info!("the signing secret applies to an HTTP sink only; not used for {spec}");
                }
                Sink::connect(spec).await?
            }
        };
        Ok(AppHandler::Sink(Box::new(sink)))
    }
}

impl Handler for AppHandler {
    async fn handle(&self, event: &Event) -> Result<(), DeliveryError> {
        match self {
            AppHandler::Log => {
                let key = event.key.as_deref().unwrap_or("");
                tracing::info!(id = event.id, topic = %event.topic, key, payload = %event.payload, "event delivered");
                Ok(())
            }
            AppHandler::Sink(sink) => sink.handle(event).await,
        }
    }

    async fn handle_batch(&self, events: &[Event], slots: &Slots) -> Vec<Result<(), DeliveryError>> {
        match self {
            AppHandler::Log => {
                let mut results = Vec::with_capacity(events.len());
                for event in events {
                    results.push(self.handle(event).await);
                }
                results
            }
            AppHandler::Sink(sink) => sink.handle_batch(events, slots).await,
        }
    }
}

/// Starts a relay (default configuration) in a task of its own; it stops when `shutdown`
/// resolves, after in-flight deliveries finish.
pub fn spawn_relay(
    outbox: &Outbox,
    handler: AppHandler,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> pg_outbox_relay::Result<JoinHandle<pg_outbox_relay::Result<()>>> {
    let relay = Relay::new(outbox, RelayConfig::default(), handler)?;
    Ok(tokio::spawn(relay.run(shutdown)))
}

/// The body of `POST /orders`. After validation the customer is trimmed; the validated request is
/// what the idempotency key's fingerprint covers.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PlaceOrder {
    /// Who ordered.
    pub customer: String,
    /// The amount, stored with two decimals.
    pub total: f64,
}

impl PlaceOrder {
    fn validated(self) -> Result<PlaceOrder, ApiError> {
        let customer = self.customer.trim();
        if customer.is_empty() {
            return Err(ApiError::bad_request("customer must not be empty"));
        }
        if customer.chars().any(char::is_control) {
            return Err(ApiError::bad_request("customer must not contain control characters"));
        }
        let chars = customer.chars().count();
        if chars > MAX_CUSTOMER_CHARS {
            return Err(ApiError::bad_request(format!(
                "customer is {chars} characters long; the limit is {MAX_CUSTOMER_CHARS}"
            )));
        }
        if !(self.total.is_finite() && self.total > 0.0 && self.total < MAX_TOTAL) {
            return Err(ApiError::bad_request(format!(
                "total must be greater than 0 and less than {MAX_TOTAL}, got {}",
                self.total
            )));
        }
        // The row keeps cents (numeric(12, 2)); a finer amount would be rounded there but not in
        // the event and the audit entry, so it is refused rather than stored three ways.
        if (self.total * 100.0).round() / 100.0 != self.total {
            return Err(ApiError::bad_request(format!(
                "total must have at most two decimal places (cents), got {}",
                self.total
            )));
        }
        Ok(PlaceOrder { customer: customer.to_string(), total: self.total })
    }
}

/// What a placed order's receipt stores, and so what a replay returns.
#[derive(Debug, Serialize, Deserialize)]
struct Placed {
    order_id: i64,
}

async fn place_order(
    State(outbox): State<Outbox>,
    headers: HeaderMap,
    body: Result<Json<PlaceOrder>, JsonRejection>,
) -> Result<Response, ApiError> {
    let key = idempotency_key(&headers)?;
    let Json(order) = body.map_err(|rejection| ApiError::bad_request(rejection.body_text()))?;
    let order = order.validated()?;

    let mut connection = outbox.connection().await?;
    let (order_id, replayed) = match connection.begin(key, &order).await? {
        Begun::Replayed(replayed) => (replayed.response::<Placed>()?.order_id, true),
        Begun::Fresh(work) => {
            let row = work
                .query_one(
                    "insert into orders (customer, total) values ($1, $2::float8::numeric) returning id",
                    &[&order.customer, &order.total],
                )
                .await
                .map_err(pg_outbox_relay::Error::from)?;
            let order_id: i64 = row.get(0);
            work.audit(&AuditEntry::new("order", order_id, "placed", &order)?).await?;
            let payload = json!({"order_id": order_id, "customer": order.customer, "total": order.total});
            work.publish(&NewEvent::new("order.placed", payload).key(order_id.to_string())).await?;
            work.commit(&Placed { order_id }).await?;
            (order_id, false)
        }
    };

    let mut response = (
        StatusCode::CREATED,
        [(header::LOCATION, format!("/orders/{order_id}"))],
        Json(json!({"order_id": order_id, "replayed": replayed})),
    )
        .into_response();
    if replayed {
        response.headers_mut().insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    }
    Ok(response)
}

/// The `Idempotency-Key` header, given once; the library checks its content (length, control
/// characters).
fn idempotency_key(headers: &HeaderMap) -> Result<&str, ApiError> {
    if headers.get_all(IDEMPOTENCY_KEY).iter().nth(1).is_some() {
        return Err(ApiError::bad_request("Idempotency-Key header given more than once: send exactly one key"));
    }
    let value = headers.get(IDEMPOTENCY_KEY).ok_or_else(|| {
        ApiError::bad_request(
            "missing Idempotency-Key header: send a unique key per order, and the same key on retries",
        )
    })?;
    std::str::from_utf8(value.as_bytes()).map_err(|_| ApiError::bad_request("Idempotency-Key header is not UTF-8"))
}

/// An order as `GET /orders/{id}` returns it.
#[derive(Debug, Serialize)]
struct Order {
    order_id: i64,
    customer: String,
    total: f64,
    created_at: String,
}

async fn get_order(State(outbox): State<Outbox>, Path(id): Path<String>) -> Result<Json<Order>, ApiError> {
    let order_id: i64 =
        id.parse().map_err(|_| ApiError::bad_request(format!("order id must be an integer, got {id:?}")))?;
    let client = outbox.connection().await?;
    let row = client
        .query_opt("select customer, total::float8, created_at from orders where id = $1", &[&order_id])
        .await
        .map_err(pg_outbox_relay::Error::from)?
        .ok_or_else(|| ApiError::new(StatusCode::NOT_FOUND, format!("no order {order_id}")))?;
    let created_at: SystemTime = row.get(2);
    Ok(Json(Order {
        order_id,
        customer: row.get(0),
        total: row.get(1),
        created_at: humantime::format_rfc3339_micros(created_at).to_string(),
    }))
}

/// An error answer: a status and `{"error": message}`.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into() }
    }

    fn bad_request(message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::BAD_REQUEST, message)
    }
}

impl From<pg_outbox_relay::Error> for ApiError {
    fn from(err: pg_outbox_relay::Error) -> Self {
        match err.kind() {
            ErrorKind::InvalidInput => ApiError::bad_request(err.to_string()),
            ErrorKind::KeyReused => ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, err.to_string()),
            ErrorKind::Connect => {
                tracing::warn!(error = %err, "database unreachable");
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the database is unreachable; try again later")
            }
            _ => {
                tracing::error!(error = %err, "request failed");
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal error; see the service's log")
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(json!({"error": self.message}))).into_response()
    }
}
