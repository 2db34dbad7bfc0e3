#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

mod admin;
mod connect;
mod conninfo;
mod destination;
mod error;
mod event;
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
mod wake;
mod work;

pub use connect::{DEFAULT_POOL_SIZE, DatabaseUrl, redact};
/// deadpool-postgres, whose [`Pool`](deadpool_postgres::Pool) [`Outbox::pool`] hands out.
pub use deadpool_postgres;
pub use error::{Error, ErrorKind, Result};
pub use event::{AuditEntry, Event, MAX_KEY_LEN, MAX_TOPIC_LEN, NewEvent, validate_topic};
pub use migrate::MigrationReport;
pub use outbox::{Connection, DEFAULT_OPERATION_TIMEOUT, Outbox};
pub use payload::{MAX_PAYLOAD_BYTES, MAX_PAYLOAD_DEPTH, Payload};
pub use publish::{audit, publish, publish_all};
pub use queue::{
    CleanupReport, ConnectedRelay, DEAD_TUPLES_WARNING, DeadLetter, DestinationStats, ErrorCount, FoundEvent, Health,
    NOTIFICATION_QUEUE_WARNING, OLD_TRANSACTION_WARNING, Pause, QueueStats, XMIN_AGE_WARNING,
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
    CLAIM_BUCKETS, Completion, DEFAULT_DESTINATION, DeliveryError, Handler, HandlerFn, HistogramSnapshot,
    LATENCY_BUCKETS, MetricsSnapshot, Percentiles, Relay, RelayConfig, RelayMetrics, Route, Slot, Slots, TopicPattern,
    handler_fn,
};
/// Defaults and bounds of [`RelayConfig`].
pub mod defaults {
    pub use crate::relay::config::{
        DEFAULT_BACKOFF_BASE, DEFAULT_BACKOFF_JITTER, DEFAULT_BACKOFF_MAX, DEFAULT_BATCH_SIZE,
        DEFAULT_BREAKER_PROBE_MAX, DEFAULT_BREAKER_PROBE_MIN, DEFAULT_BREAKER_THRESHOLD, DEFAULT_CONCURRENCY,
        DEFAULT_HOLD, DEFAULT_IDEMPOTENCY_RETENTION, DEFAULT_JANITOR_BATCH, DEFAULT_JANITOR_INTERVAL, DEFAULT_LEASE,
        DEFAULT_LINGER, DEFAULT_MAX_ATTEMPTS, DEFAULT_POLL_INTERVAL, DEFAULT_RECONNECT_MAX, DEFAULT_RETENTION,
        DEFAULT_SHUTDOWN_GRACE, DEFAULT_WORKERS, MAX_BACKOFF, MAX_BATCH_SIZE, MAX_BREAKER_PROBE, MAX_CONCURRENCY,
        MAX_HOLD, MAX_JANITOR_INTERVAL, MAX_LEASE, MAX_LINGER, MAX_POLL_INTERVAL, MAX_RATE_LIMIT, MAX_RECONNECT_MAX,
        MAX_RETENTION, MAX_SHUTDOWN_GRACE, MAX_WORKERS, MIN_BREAKER_PROBE, MIN_LEASE, MIN_POLL_INTERVAL,
        MIN_RECONNECT_MAX, check_range,
    };
}
