//! Business writes and their events in one PostgreSQL transaction, delivered within milliseconds
//! of the commit.
//!
//! A service that saves an order and then tells another system can fail three ways: saved but
//! never told, told but not saved, saved twice. This crate removes all three with the PostgreSQL
//! the service already has: the business write, an audit entry, an idempotency receipt and the
//! events commit in one transaction (a [`Work`]); a request repeated with the same idempotency key
//! gets the first response back and writes nothing; and a [`Relay`] delivers the committed events
//! to a [`Handler`] at least once, woken by `NOTIFY` within milliseconds of the commit.
//!
//! # Example
//!
//! The write path: an order, its audit entry and its event, under an idempotency key.
//!
//! ```no_run
//! use pg_outbox_relay::{AuditEntry, Begun, NewEvent, Outbox};
//! use serde_json::{Value, json};
//!
//! async fn place_order(outbox: &Outbox, key: &str, request: &Value) -> Result<Value, pg_outbox_relay::Error> {
//!     let mut connection = outbox.connection().await?;
//!     let work = match connection.begin(key, request).await? {
//!         Begun::Replayed(replayed) => return Ok(replayed.into_json()),
//!         Begun::Fresh(work) => work,
//!     };
//!     let row = work
//!         .query_one(
//!             "insert into orders (customer, total) values ($1, $2) returning id",
//!             &[&request["customer"].as_str(), &request["total"].as_f64()],
//!         )
//!         .await?;
//!     let order_id: i64 = row.get(0);
//!     work.audit(&AuditEntry::new("order", order_id, "placed", request)?).await?;
//!     work.publish(&NewEvent::new("order.placed", json!({"order_id": order_id})).key(order_id.to_string())).await?;
//!     let response = json!({"order_id": order_id});
//!     work.commit(&response).await?;
//!     Ok(response)
//! }
//!
//! #[tokio::main]
//! async fn main() -> Result<(), pg_outbox_relay::Error> {
//!     let outbox = Outbox::connect("postgres://app@localhost/shop").await?;
//!     outbox.migrate().await?;
//!     let request = json!({"customer": "ana", "total": 12.5});
//!     let first = place_order(&outbox, "7f3c-checkout-1", &request).await?;
//!     let again = place_order(&outbox, "7f3c-checkout-1", &request).await?; // a retry: the same answer
//!     assert_eq!(first, again);
//!     Ok(())
//! }
//! ```
//!
//! An embedded relay, delivering to a handler of the service's own until Ctrl-C:
//!
//! ```no_run
//! use pg_outbox_relay::{DeliveryError, Event, Handler, Outbox, Relay, RelayConfig};
//!
//! struct Erp;
//!
//! impl Handler for Erp {
//!     async fn handle(&self, event: &Event) -> Result<(), DeliveryError> {
//!         // send event.payload somewhere; use event.uuid as the receiver's dedupe key
//!         match event.topic.as_str() {
//!             "order.placed" => Ok(()),
//!             other => Err(DeliveryError::permanent(format!("no route for {other}"))),
//!         }
//!     }
//! }
//!
//! #[tokio::main]
//! async fn main() -> Result<(), pg_outbox_relay::Error> {
//!     let outbox = Outbox::connect("postgres://app@localhost/shop").await?;
//!     let mut config = RelayConfig::default();
//!     config.workers = 4;
//!     let relay = Relay::new(&outbox, config, Erp)?;
//!     let metrics = relay.metrics(); // delivered, retried, dead-lettered, latency p50/p99
//!     relay.run(async { tokio::signal::ctrl_c().await.ok(); }).await?;
//!     println!("{:?}", metrics.snapshot());
//!     Ok(())
//! }
//! ```
//!
//! # Behavior
//!
//! - Everything the library owns lives in the schema `outbox_relay`. [`Outbox::migrate`] applies
//!   it (checksummed migrations under an advisory lock: safe to run again, and at once).
//! - A [`Work`] dropped before [`Work::commit`] leaves every table as it was. A concurrent
//!   duplicate waits for the first transaction, then replays its answer; a key reused for another
//!   request is refused with [`ErrorKind::KeyReused`]. [`publish`], [`publish_all`] and [`audit`]
//!   add to a transaction the caller owns; SQL has `outbox_relay.publish(topic, payload, key)`.
//! - Delivery is at least once. A relay that dies after the handler succeeded and before the
//!   outcome was recorded sends those events again; every event carries a stable [`Event::uuid`]
//!   by which the [`inbox`] drops duplicates in the consumer's own transaction.
//! - Events that share a key are handed over one at a time, in commit order, across workers and
//!   relays. Notifications are hints and the table is the truth: a fallback poll covers a lost
//!   one. The relay's listener needs a direct session, not a pooler in transaction mode.
//! - A transient failure is retried with capped, jittered backoff; a permanent one, or the last
//!   attempt, goes to the dead letters. A destination that stops answering opens an outage
//!   breaker: no attempt is charged and nothing is dead-lettered until it answers again.
//! - A [`Relay`] delivers to one [`Handler`], or with [`Relay::with_routes`] to every [`Route`]
//!   whose topic pattern matches, each destination with its own position, retries and breaker.
//! - Errors are one [`Error`], with [`Error::kind`] and the SQLSTATE in [`Error::code`].
//!
//! # Features
//!
//! None is on by default: a service that writes its own [`Handler`], or prints events with
//! [`sink::StdoutSink`], needs none of them.
//!
//! - `http`: the HTTP sink (`sink::HttpSink`), Standard Webhooks signatures and CloudEvents.
//! - `nats`: the NATS JetStream sink (`sink::NatsSink`).
//! - `amqp`: the RabbitMQ sink (`sink::AmqpSink`).
//! - `kafka`: the Kafka sink (`sink::KafkaSink`), on rdkafka (librdkafka built from its sources).
//! - `sqlx`: `publish`, `publish_all`, `audit` and the inbox on a sqlx 0.8 connection
//!   (`pg_outbox_relay::sqlx`).
//! - `prometheus`: the metrics in the OpenMetrics text format (`prometheus::Exporter`).
//! - `opentelemetry`: a publish inside a span traced by `tracing-opentelemetry` records the
//!   span's W3C trace context with the event ([`NewEvent::header`] `traceparent`), and the relay
//!   sends each such event in a `send` span that continues it (docs/tracing.md).
//!
//! # Where to read more
//!
//! The repository's `docs/` folder has a page per topic: `write-path.md` (units of work,
//! idempotency, fidelity, limits), `relay.md` (handlers, routes, order, the concurrency limit,
//! every setting), `design.md` (how the relay works inside), `guarantees.md` (what is promised,
//! under which faults, and the inbox), `operations.md` (metrics, probes, pausing, the console,
//! roles, TLS), `command.md` (the `outbox-relay` command, installed by `cargo install
//! pg-outbox-relay-cli`), `performance.md` and `storage.md`. `README.md` has the quick start,
//! `CHANGELOG.md` what changed.

#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

mod admin;
mod connect;
mod conninfo;
mod dead_letters;
mod destination;
mod error;
mod event;
mod headers;
pub mod inbox;
mod migrate;
mod outbox;
mod payload;
#[cfg(feature = "prometheus")]
pub mod prometheus;
mod publish;
mod queue;
mod relay;
pub mod sink;
mod sql;
#[cfg(feature = "sqlx")]
pub mod sqlx;
mod text;
mod timestamp;
mod tls;
mod trace;
mod wake;
mod work;

pub use connect::{DatabaseUrl, redact};
pub use dead_letters::DeadLetterFilter;
/// deadpool-postgres, whose [`Pool`](deadpool_postgres::Pool) [`Outbox::pool`] hands out.
pub use deadpool_postgres;
pub use error::{Error, ErrorKind, Result};
pub use event::{AuditEntry, Event, NewEvent, validate_topic};
pub use headers::Headers;
pub use migrate::MigrationReport;
pub use outbox::{Connection, Outbox};
pub use payload::Payload;
pub use publish::{audit, publish, publish_all};
pub use queue::{
    CleanupReport, ConnectedRelay, DeadLetter, DestinationStats, ErrorCount, EventState, FoundEvent, Health, Pause,
    QueueStats,
};
pub use text::printable;
/// The type of [`Event::uuid`].
pub use uuid::Uuid;
pub use work::{Begun, Executed, Replayed, Work};
/// RFC 3339 text (UTC, microseconds) of any time PostgreSQL can hold, such as
/// [`Event::created_at`]; unlike humantime's it does not panic before 1970 or after 9999.
pub fn rfc3339(t: std::time::SystemTime) -> String {
    timestamp::rfc3339_micros(t)
}
pub use relay::{
    DEFAULT_DESTINATION, DeliveryError, Handler, HandlerFn, HistogramSnapshot, MetricsSnapshot, Percentiles, Relay,
    RelayConfig, RelayMetrics, Route, Slot, Slots, TopicPattern, handler_fn,
};

/// The Rust examples of the README and of docs/ compiled as doctests (`no_run` where they need
/// a database), so that they keep up with the API.
#[cfg(doctest)]
mod docs_examples {
    #[doc = include_str!("../README.md")]
    struct Readme;
    #[doc = include_str!("../docs/write-path.md")]
    struct WritePath;
    #[doc = include_str!("../docs/relay.md")]
    struct RelayPage;
    #[doc = include_str!("../docs/guarantees.md")]
    struct Guarantees;
    #[doc = include_str!("../docs/operations.md")]
    struct Operations;
    #[doc = include_str!("../docs/tracing.md")]
    struct Tracing;
}
