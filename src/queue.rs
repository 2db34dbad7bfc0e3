//! The queue as an operator sees it: counts, the errors events wait on, the relays, the dead
//! letters. [`crate::Outbox`]'s operating methods return these.

use std::time::SystemTime;

use serde::Serialize;
use serde_json::Value;

/// The state of the queue.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QueueStats {
    /// Pending events deliverable now.
    pub pending: i64,
    /// Pending events waiting for their time (a delay or a retry backoff).
    pub delayed: i64,
    /// Events claimed by a relay whose lease has not ended.
    pub in_flight: i64,
    /// Delivered events still kept (completion mode "mark processed").
    pub processed: i64,
    /// Events in the dead letters.
    pub dead_letters: i64,
    /// Age of the oldest undelivered event (delayed ones included), in milliseconds.
    pub oldest_pending_age_ms: Option<i64>,
    /// How long the longest-waiting deliverable event has been due (since its `available_at`:
    /// its commit, or the end of its delay or retry backoff), in milliseconds: the relay's lag.
    pub oldest_ready_age_ms: Option<i64>,
    /// The most attempts any undelivered event has had.
    pub max_attempts: i32,
    /// Share of PostgreSQL's notification queue in use (0 to 1); it grows when a listener stops
    /// reading, and NOTIFY fails when it is full.
    pub notification_queue_usage: f64,
}

/// An error that pending events failed with, and how many of them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ErrorCount {
    /// The `last_error` text.
    pub error: String,
    /// How many pending events have it.
    pub events: i64,
}

/// A relay connected to the database, as its listener connection shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ConnectedRelay {
    /// The PostgreSQL backend pid of its listener connection.
    pub listener_pid: i32,
    /// Where it connects from (`local` for a Unix socket).
    pub client: String,
    /// When its listener connected.
    #[serde(serialize_with = "crate::timestamp::serialize")]
    pub connected_at: SystemTime,
    /// Whether it waits for a notification (idle), rather than being busy or lingering.
    pub waiting: bool,
    /// Whether its outage breaker is open: it found its destination down, claims nothing, and
    /// probes with one delivery at a time.
    pub breaker_open: bool,
    /// When its breaker last changed state, if it ever did.
    #[serde(serialize_with = "crate::timestamp::serialize_option")]
    pub breaker_since: Option<SystemTime>,
}

/// An event in the dead letters.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeadLetter {
    /// The event's id, kept from the outbox.
    pub id: i64,
    /// Its topic.
    pub topic: String,
    /// Its partition key.
    pub key: Option<String>,
    /// Its payload. One that serde_json cannot hold (a number beyond f64, such as `1e999`) comes
    /// as a JSON string holding PostgreSQL's text of it.
    pub payload: Value,
    /// When it was written.
    #[serde(serialize_with = "crate::timestamp::serialize")]
    pub created_at: SystemTime,
    /// How many delivery attempts it had.
    pub attempts: i32,
    /// The error that buried it.
    pub last_error: String,
    /// When it was moved here.
    #[serde(serialize_with = "crate::timestamp::serialize")]
    pub failed_at: SystemTime,
}

/// What one cleanup pass removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct CleanupReport {
    /// Processed events deleted.
    pub events: u64,
    /// Idempotency receipts deleted.
    pub receipts: u64,
}
