//! A webhook receiver for the relay's HTTP sink, as a small axum service: the consumer's side
//! of at-least-once delivery.
//!
//! `POST /webhook` takes one event as the relay sends it (`--format raw`, signed with
//! `--signing-secret`):
//!
//! 1. The Standard Webhooks signature is verified with the official `standardwebhooks` crate
//!    (`webhook-id`, `webhook-timestamp` within five minutes, `webhook-signature`): an unsigned,
//!    tampered or stale request gets 401 and writes nothing.
//! 2. In one transaction, the event's uuid (`webhook-id`, which the signature covers) is recorded
//!    in the inbox ([`Inbox::record`]) and, only when it is new, the receiver's own write is made
//!    (a row in `received_events`). Both commit, or neither does.
//! 3. The answer is `200 {"status": "processed"}` for a new event and `200 {"status": "duplicate"}`
//!    for a redelivery, which writes nothing again: the relay must see success either way, or
//!    it would retry a delivery that already happened.
//!
//! A body that verifies but is not an event gets 400 (the relay dead-letters it: sending it again
//! would not help); a database failure gets 503 (the relay retries later). Details go to the
//! log, not to the sender.
//!
//! `main.rs` runs this as a program; `tests/it/webhook_receiver.rs` serves the same router
//! in-process.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use pg_outbox_relay::inbox::{Inbox, Recorded};
use pg_outbox_relay::{Outbox, Uuid};
use serde::Deserialize;
use serde_json::json;

/// The receiver's own table: what it did with each event (here, it keeps them).
const CREATE_RECEIVED: &str = "create table if not exists received_events (
    id          bigserial primary key,
    event_uuid  uuid not null,
    topic       text not null,
    payload     jsonb not null,
    received_at timestamptz not null default now()
)";

/// Applies the library's migrations (they create `outbox_relay.inbox`) and the receiver's table.
pub async fn setup(database: &Outbox) -> pg_outbox_relay::Result<()> {
    database.migrate().await?;
    database.connection().await?.batch_execute(CREATE_RECEIVED).await?;
    Ok(())
}

/// What the handler needs: the database, the inbox and the verifier of signatures.
pub struct Receiver {
    database: Outbox,
    inbox: Inbox,
    webhook: standardwebhooks::Webhook,
}

impl Receiver {
    /// A receiver recording events as `consumer` in the database's inbox, verifying signatures
    /// with `secret` (`whsec_...`, the relay's `--signing-secret`).
    pub fn new(database: Outbox, consumer: &str, secret: &str) -> Result<Self, String> {
        let inbox = Inbox::new(consumer).map_err(|e| e.to_string())?;
        let webhook = standardwebhooks::Webhook::new(secret)
            .map_err(|_| "the signing secret is not whsec_ followed by base64".to_string())?;
        Ok(Receiver { database, inbox, webhook })
    }
}

/// `POST /webhook`.
pub fn router(receiver: Receiver) -> Router {
    Router::new().route("/webhook", post(receive)).with_state(Arc::new(receiver))
}

/// The part of the relay's JSON the receiver uses.
#[derive(Deserialize)]
struct Delivered {
    topic: String,
    payload: serde_json::Value,
}

async fn receive(State(receiver): State<Arc<Receiver>>, headers: HeaderMap, body: Bytes) -> Response {
    if let Err(e) = receiver.webhook.verify(&body, &headers) {
        tracing::warn!("refused a request whose signature does not verify: {e}");
        return answer(StatusCode::UNAUTHORIZED, json!({"error": "the signature does not verify"}));
    }
    // The signature covers webhook-id, which the relay sets to the event's uuid.
    let Some(uuid) = headers.get("webhook-id").and_then(|v| v.to_str().ok()).and_then(|v| Uuid::parse_str(v).ok())
    else {
        return answer(StatusCode::BAD_REQUEST, json!({"error": "webhook-id is not an event uuid"}));
    };
    let event: Delivered = match serde_json::from_slice(&body) {
        Ok(event) => event,
        Err(e) => return answer(StatusCode::BAD_REQUEST, json!({"error": format!("the body is not an event: {e}")})),
    };
    match handle(&receiver, uuid, &event).await {
        Ok(Recorded::New) => answer(StatusCode::OK, json!({"status": "processed"})),
        Ok(Recorded::Duplicate) => answer(StatusCode::OK, json!({"status": "duplicate"})),
        Err(e) => {
            tracing::error!(event = %uuid, "cannot handle the event: {e}");
            answer(
                StatusCode::SERVICE_UNAVAILABLE,
                json!({"error": "the event could not be handled now; send it again"}),
            )
        }
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The inbox record and the receiver's write, in one transaction.
async fn handle(receiver: &Receiver, uuid: Uuid, event: &Delivered) -> Result<Recorded, BoxError> {
    let mut client = receiver.database.connection().await?;
    let tx = client.transaction().await?;
    let recorded = receiver.inbox.record(&tx, uuid).await?;
    if recorded == Recorded::New {
        tx.execute(
            "insert into received_events (event_uuid, topic, payload) values ($1, $2, $3)",
            &[&uuid, &event.topic, &event.payload],
        )
        .await?;
    }
    tx.commit().await?;
    Ok(recorded)
}

fn answer(status: StatusCode, body: serde_json::Value) -> Response {
    (status, Json(body)).into_response()
}
