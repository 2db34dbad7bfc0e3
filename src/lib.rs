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

pub use connect::{DatabaseUrl, redact};
/// deadpool-postgres, whose [`Pool`](deadpool_postgres::Pool) [`Outbox::pool`] hands out.
pub use deadpool_postgres;
pub use error::{Error, ErrorKind, Result};
pub use event::{AuditEntry, Event, NewEvent, validate_topic};
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
    Completion, DEFAULT_DESTINATION, DeliveryError, Handler, HandlerFn, HistogramSnapshot, MetricsSnapshot,
    Percentiles, Relay, RelayConfig, RelayMetrics, Route, Slot, Slots, TopicPattern, handler_fn,
};
