//! The queue as an operator sees it: counts, the errors events wait on, the relays, the dead
//! letters. [`crate::Outbox`]'s operating methods return these.

use std::time::{Duration, SystemTime};

use crate::payload::Payload;
use serde::Serialize;

/// The state of the queue.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct QueueStats {
    /// Pending events deliverable now (ready): due, and without a key or at the head of theirs.
    pub pending: i64,
    /// Due events held behind their key's head, which is in flight, delayed or waiting for a
    /// retry: they wait for it, not for a relay (no lag).
    pub held_by_key: i64,
    /// Pending events waiting for their time (a delay or a retry backoff).
    pub delayed: i64,
    /// Events claimed by a relay whose lease has not ended.
    pub in_flight: i64,
    /// Events every destination has passed, kept for the relays' retention (for replay and
    /// `outbox_relay.event_state`): counted up to 100,000 rows in the outbox, the planner's
    /// estimate beyond.
    pub retained: i64,
    /// Events in the dead letters.
    pub dead_letters: i64,
    /// Dead letters that no destination's pattern matched (destination `""`): events no route
    /// takes. Add a route and retry them.
    pub unrouted: i64,
    /// Age of the oldest undelivered event (delayed ones included). In JSON, in milliseconds
    /// (`oldest_pending_age_ms`).
    #[serde(rename = "oldest_pending_age_ms", serialize_with = "crate::timestamp::serialize_millis")]
    pub oldest_pending_age: Option<Duration>,
    /// How long the longest-waiting ready event has been due (since its `available_at`:
    /// its commit, or the end of its delay or retry backoff): the relay's lag. In JSON, in
    /// milliseconds (`oldest_ready_age_ms`).
    #[serde(rename = "oldest_ready_age_ms", serialize_with = "crate::timestamp::serialize_millis")]
    pub oldest_ready_age: Option<Duration>,
    /// The most attempts any undelivered event has had.
    pub max_attempts: i32,
    /// Share of PostgreSQL's notification queue in use (0 to 1); it grows when a listener stops
    /// reading, and NOTIFY fails when it is full.
    pub notification_queue_usage: f64,
}

/// An error that pending events failed with, and how many of them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ErrorCount {
    /// The `last_error` text.
    pub error: String,
    /// How many pending events have it.
    pub events: i64,
}

/// A relay connected to the database, as its listener connection shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
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
    /// Its concurrency limit: the deliveries it may have in flight at once (learnt from its
    /// destination, or fixed), as it last published it (at most a second old while it changes;
    /// `None` until it first did).
    pub delivery_limit: Option<i32>,
    /// The deliveries it had in flight then.
    pub deliveries_in_flight: Option<i32>,
    /// The destination it delivers to (a relay process with several routes connects once per
    /// destination); `None` until it first wrote its row.
    pub destination: Option<String>,
    /// The id of the relay it belongs to (its log lines' `relay`): the listeners of one relay
    /// (one process, most often) share it. `None` for a relay of a version that did not name
    /// its connections.
    pub relay: Option<String>,
    /// The PostgreSQL connections that relay holds now (its pool's and its listeners').
    pub relay_connections: Option<i64>,
}

/// One destination as the database sees it: its pattern, and what waits for it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct DestinationStats {
    /// Its name.
    pub name: String,
    /// Its topic pattern.
    pub pattern: String,
    /// Events it has not reached yet (its pattern matches them, its position is before them).
    pub new: i64,
    /// Its parked events that are due (retries whose backoff ended, events behind their key,
    /// events given back).
    pub due: i64,
    /// Its parked events due later (backoff, delay).
    pub delayed: i64,
    /// Its parked events in a lease (a delivery that outlived its claim's hold).
    pub in_flight: i64,
    /// Its dead letters.
    pub dead_letters: i64,
    /// The most attempts one of its parked events has had.
    pub max_attempts: i32,
    /// How long ago its position last moved (it moves with every claim that finds new events,
    /// whether or not they match). In JSON, in milliseconds (`position_age_ms`).
    #[serde(rename = "position_age_ms", serialize_with = "crate::timestamp::serialize_millis")]
    pub position_age: Option<Duration>,
    /// Whether its delivery is paused (the destination, or every destination).
    pub paused: bool,
    /// How many relays connected now deliver to it.
    pub relays: i64,
    /// Whether it is registered: false for a name that only parked events carry (the migration's
    /// `default` when no relay delivers to it under that name, a retried dead letter of a dropped
    /// destination); its pattern is then empty and its events wait until a relay registers it or
    /// it is dropped.
    pub registered: bool,
    /// How long no relay has served it: `None` while a connected relay delivers to it (and for a
    /// name no relay registered). In JSON, in milliseconds (`unserved_ms`).
    #[serde(rename = "unserved_ms", serialize_with = "crate::timestamp::serialize_millis")]
    pub unserved: Option<Duration>,
    /// How long until it expires if no relay serves it (`RelayConfig::destination_expiry`):
    /// `None` while a relay serves it or when it never expires. In JSON, in milliseconds
    /// (`expires_in_ms`).
    #[serde(rename = "expires_in_ms", serialize_with = "crate::timestamp::serialize_millis")]
    pub expires_in: Option<Duration>,
}

/// An event in the dead letters.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct DeadLetter {
    /// The event's id, kept from the outbox.
    pub id: i64,
    /// The destination that refused it; `""` when no destination's pattern matches its topic.
    pub destination: String,
    /// Its topic.
    pub topic: String,
    /// Its partition key.
    pub key: Option<String>,
    /// Its payload, as stored.
    pub payload: Payload,
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
#[non_exhaustive]
pub struct CleanupReport {
    /// Processed events deleted.
    pub events: u64,
    /// Idempotency receipts deleted.
    pub receipts: u64,
}

/// A pause of delivery (see [`crate::Outbox::pause`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Pause {
    /// The paused topic; `None` for the pause of every topic.
    pub topic: Option<String>,
    /// The paused destination; `None` for the pause of every destination.
    pub destination: Option<String>,
    /// When it was paused.
    #[serde(serialize_with = "crate::timestamp::serialize")]
    pub paused_at: SystemTime,
    /// The database role that paused it.
    pub paused_by: String,
}

/// What holds PostgreSQL back from keeping the outbox lean, and how full its notification queue
/// is. [`Health::warnings`] compares them with documented thresholds.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Health {
    /// Age of the oldest open transaction on the server (sessions of other roles count only
    /// when the role may see them: a superuser or pg_read_all_stats). In JSON, in milliseconds
    /// (`oldest_transaction_age_ms`).
    #[serde(rename = "oldest_transaction_age_ms", serialize_with = "crate::timestamp::serialize_millis")]
    pub oldest_transaction_age: Option<Duration>,
    /// Age in transactions of the xmin horizon (the oldest snapshot a session, a replication
    /// slot or a prepared transaction holds): vacuum removes no row deleted after it.
    pub xmin_horizon_age: Option<i64>,
    /// Dead tuples in the outbox table (PostgreSQL's statistics; vacuum removes them).
    pub outbox_dead_tuples: i64,
    /// Live tuples in the outbox table, by the same statistics.
    pub outbox_live_tuples: i64,
    /// Share of the notification queue in use (0 to 1).
    pub notification_queue_usage: f64,
    /// Backends connected to the server's databases now (`pg_stat_database.numbackends`, which
    /// every role may read: every role's sessions, and the autovacuum and parallel workers).
    pub connections: i64,
    /// The server's `max_connections`.
    pub max_connections: i64,
}

impl Health {
    /// Dead tuples in the outbox beyond this many, and more than live ones.
    pub const DEAD_TUPLES_WARNING: i64 = 1_000_000;
    /// A notification queue fuller than this share.
    pub const NOTIFICATION_QUEUE_WARNING: f64 = 0.5;
    /// An open transaction older than this holds vacuum back long enough to notice.
    pub const OLD_TRANSACTION_WARNING: std::time::Duration = std::time::Duration::from_secs(5 * 60);
    /// An xmin horizon older than this many transactions.
    pub const XMIN_AGE_WARNING: i64 = 100_000_000;
    /// Client connections past this share of `max_connections`.
    pub const CONNECTIONS_WARNING: f64 = 0.8;
}

impl Health {
    /// One line per signal past its threshold ([`Health::OLD_TRANSACTION_WARNING`],
    /// [`Health::XMIN_AGE_WARNING`], [`Health::DEAD_TUPLES_WARNING`], [`Health::NOTIFICATION_QUEUE_WARNING`],
    /// [`Health::CONNECTIONS_WARNING`]).
    pub fn warnings(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        if let Some(age) = self.oldest_transaction_age.filter(|age| *age >= Health::OLD_TRANSACTION_WARNING) {
            warnings.push(format!(
                "a transaction has been open for {}: vacuum cannot remove the outbox's dead rows meanwhile (see pg_stat_activity)",
                humantime::format_duration(Duration::from_secs(age.as_secs()))
            ));
        }
        if let Some(age) = self.xmin_horizon_age.filter(|age| *age >= Health::XMIN_AGE_WARNING) {
            warnings.push(format!(
                "the xmin horizon is {age} transactions old: a session, replication slot or prepared transaction holds vacuum back"
            ));
        }
        if self.outbox_dead_tuples >= Health::DEAD_TUPLES_WARNING && self.outbox_dead_tuples > self.outbox_live_tuples {
            warnings.push(format!(
                "the outbox table holds {} dead tuples ({} live): is autovacuum keeping up, or is something holding it back?",
                self.outbox_dead_tuples, self.outbox_live_tuples
            ));
        }
        if self.notification_queue_usage >= Health::NOTIFICATION_QUEUE_WARNING {
            warnings.push(format!(
                "the notification queue is {:.0}% full: a listening session is not reading (NOTIFY fails when it is full)",
                self.notification_queue_usage * 100.0
            ));
        }
        if self.max_connections > 0
            && self.connections as f64 >= Health::CONNECTIONS_WARNING * self.max_connections as f64
        {
            warnings.push(format!(
                "{} of the server's max_connections {} are in use: past it the server refuses new connections (SQLSTATE 53300, too many clients; relays retry, writers fail) (docs/operations.md, \"Connections\", says how many each relay opens; run --max-connections bounds them)",
                self.connections, self.max_connections
            ));
        }
        warnings
    }
}

/// What became of an event found by [`crate::Outbox::look_up`] at one destination (as
/// `outbox_relay.event_state` says it). Shown (and in JSON) as `pending`, `delivered`,
/// `waiting`, `delayed`, `retrying`, `in flight`, `dead` or `unrouted`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub enum EventState {
    /// In the outbox; the destination's position has not passed it yet.
    #[serde(rename = "pending")]
    Pending,
    /// Delivered to the destination (`since`: when the delivery was recorded).
    #[serde(rename = "delivered")]
    Delivered,
    /// Waiting for the destination, due now (behind its key, paused, or being claimed).
    #[serde(rename = "waiting")]
    Waiting,
    /// Waiting for the destination until its delay ends.
    #[serde(rename = "delayed")]
    Delayed,
    /// Waiting for the destination until its next attempt after a failure.
    #[serde(rename = "retrying")]
    Retrying,
    /// Claimed under a lease, its delivery in progress.
    #[serde(rename = "in flight")]
    InFlight,
    /// In the destination's dead letters.
    #[serde(rename = "dead")]
    Dead,
    /// In the outbox, and no destination's pattern matches its topic.
    #[serde(rename = "unrouted")]
    Unrouted,
}

impl EventState {
    /// The state as the database query names it.
    pub(crate) fn from_sql(text: &str) -> Option<EventState> {
        Some(match text {
            "pending" => EventState::Pending,
            "delivered" => EventState::Delivered,
            "waiting" => EventState::Waiting,
            "delayed" => EventState::Delayed,
            "retrying" => EventState::Retrying,
            "in flight" => EventState::InFlight,
            "dead" => EventState::Dead,
            "unrouted" => EventState::Unrouted,
            _ => return None,
        })
    }

    /// Its name, as shown.
    pub fn as_str(self) -> &'static str {
        match self {
            EventState::Pending => "pending",
            EventState::Delivered => "delivered",
            EventState::Waiting => "waiting",
            EventState::Delayed => "delayed",
            EventState::Retrying => "retrying",
            EventState::InFlight => "in flight",
            EventState::Dead => "dead",
            EventState::Unrouted => "unrouted",
        }
    }
}

impl std::fmt::Display for EventState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An event found by [`crate::Outbox::look_up`], wherever it is.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct FoundEvent {
    /// Its id.
    pub id: i64,
    /// Its topic.
    pub topic: String,
    /// Its key.
    pub key: Option<String>,
    /// Its payload, as stored.
    pub payload: Payload,
    /// When it was written.
    #[serde(serialize_with = "crate::timestamp::serialize")]
    pub created_at: SystemTime,
    /// Delivery attempts so far.
    pub attempts: i32,
    /// The error of its last failed attempt.
    pub last_error: Option<String>,
    /// What became of it at `destination`.
    pub state: EventState,
    /// The destination; `None` for an unrouted event, `Some("")` for a dead letter no
    /// destination's pattern matched.
    pub destination: Option<String>,
    /// When it was delivered (the delivery's record), is due (pending, waiting, delayed,
    /// retrying, in flight: its lease's end), or failed for good (dead); `None` for a time
    /// PostgreSQL calls infinite.
    #[serde(serialize_with = "crate::timestamp::serialize_option")]
    pub since: Option<SystemTime>,
}
