//! Operating the outbox: the queue at a glance, dead letters, and cleanup.

use std::time::{Duration, SystemTime};

use serde::Serialize;
use serde_json::Value;

use crate::error::{Error, Result};
use crate::outbox::Outbox;
use crate::sql::{self, micros};

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

impl Outbox {
    /// Counts pending, delayed, in-flight, processed and dead events.
    pub async fn queue_stats(&self) -> Result<QueueStats> {
        let client = self.client().await?;
        let row =
            client.query_one(sql::QUEUE_STATS, &[]).await.map_err(|e| Error::database("reading queue stats", e))?;
        Ok(QueueStats {
            pending: row.get(0),
            delayed: row.get(1),
            in_flight: row.get(2),
            processed: row.get(3),
            dead_letters: row.get(4),
            oldest_pending_age_ms: row.get(5),
            oldest_ready_age_ms: row.get(6),
            max_attempts: row.get(7),
            notification_queue_usage: row.get(8),
        })
    }

    /// The `limit` most common errors of pending events (their `last_error`), most frequent first.
    pub async fn pending_errors(&self, limit: i64) -> Result<Vec<ErrorCount>> {
        let client = self.client().await?;
        let rows = client
            .query(sql::EVENT_ERRORS_TOP, &[&limit])
            .await
            .map_err(|e| Error::database("reading the errors of pending events", e))?;
        Ok(rows.iter().map(|r| ErrorCount { error: r.get(0), events: r.get(1) }).collect())
    }

    /// The relays connected to this database (by their listener connections), oldest first.
    pub async fn connected_relays(&self) -> Result<Vec<ConnectedRelay>> {
        let client = self.client().await?;
        let rows = client
            .query(sql::RELAYS_CONNECTED, &[])
            .await
            .map_err(|e| Error::database("listing the connected relays", e))?;
        Ok(rows
            .iter()
            .map(|r| ConnectedRelay {
                listener_pid: r.get(0),
                client: r.get(1),
                connected_at: r.get(2),
                waiting: r.get(3),
            })
            .collect())
    }

    /// Lists up to `limit` dead letters, oldest id first.
    pub async fn dead_letters(&self, limit: i64) -> Result<Vec<DeadLetter>> {
        let client = self.client().await?;
        let rows = client
            .query(sql::DEAD_LETTER_LIST, &[&limit])
            .await
            .map_err(|e| Error::database("listing dead letters", e))?;
        Ok(rows
            .iter()
            .map(|r| DeadLetter {
                id: r.get(0),
                topic: r.get(1),
                key: r.get(2),
                payload: {
                    let text: String = r.get(3);
                    serde_json::from_str(&text).unwrap_or(Value::String(text))
                },
                created_at: r.get(4),
                attempts: r.get(5),
                last_error: r.get(6),
                failed_at: r.get(7),
            })
            .collect())
    }

    /// Puts the dead letters with these ids back into the outbox under the same ids, attempts
    /// reset, deliverable at once. Returns the ids that were found and revived.
    pub async fn retry_dead_letters(&self, ids: &[i64]) -> Result<Vec<i64>> {
        self.revive(ids, false).await
    }

    /// Puts every dead letter back into the outbox. Returns their ids.
    pub async fn retry_all_dead_letters(&self) -> Result<Vec<i64>> {
        self.revive(&[], true).await
    }

    async fn revive(&self, ids: &[i64], all: bool) -> Result<Vec<i64>> {
        let client = self.client().await?;
        let rows = client
            .query(sql::DEAD_LETTER_RETRY, &[&ids, &all])
            .await
            .map_err(|e| Error::database("retrying dead letters", e))?;
        if !rows.is_empty() {
            self.wakeup().wake();
        }
        let mut revived: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
        revived.sort_unstable();
        Ok(revived)
    }

    /// Deletes dead letters that failed more than `older_than` ago (zero: all). Returns how many.
    pub async fn purge_dead_letters(&self, older_than: Duration) -> Result<u64> {
        let client = self.client().await?;
        client
            .execute(sql::DEAD_LETTER_PURGE, &[&micros(older_than)])
            .await
            .map_err(|e| Error::database("purging dead letters", e))
    }

    /// One janitor pass: deletes processed events older than `retention` and idempotency receipts
    /// older than `idempotency_retention`, `batch` rows per statement so no lock is held long.
    pub async fn cleanup(
        &self,
        retention: Duration,
        idempotency_retention: Duration,
        batch: usize,
    ) -> Result<CleanupReport> {
        let client = self.client().await?;
        let batch = i64::try_from(batch.max(1)).unwrap_or(i64::MAX);
        let mut report = CleanupReport::default();
        for (statement, age, total) in [
            (sql::EVENT_DELETE_EXPIRED, retention, &mut report.events),
            (sql::IDEMPOTENCY_DELETE_EXPIRED, idempotency_retention, &mut report.receipts),
        ] {
            loop {
                let n = client
                    .execute(statement, &[&micros(age), &batch])
                    .await
                    .map_err(|e| Error::database("cleaning up", e))?;
                *total += n;
                if n < batch as u64 {
                    break;
                }
            }
        }
        Ok(report)
    }
}
