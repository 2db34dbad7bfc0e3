//! Operating the outbox: the queue at a glance, dead letters, and cleanup.

use std::time::Duration;

use crate::error::Result;
use crate::outbox::Outbox;
use crate::queue::{CleanupReport, ConnectedRelay, DeadLetter, ErrorCount, FoundEvent, Health, Pause, QueueStats};
use crate::sql;

impl Outbox {
    /// Counts pending, delayed, in-flight, processed and dead events.
    pub async fn queue_stats(&self) -> Result<QueueStats> {
        sql::queue_stats(&*self.pooled().await?).await
    }

    /// The `limit` most common errors of pending events (their `last_error`), most frequent first.
    pub async fn pending_errors(&self, limit: i64) -> Result<Vec<ErrorCount>> {
        sql::pending_errors(&*self.pooled().await?, limit).await
    }

    /// The relays connected to this database (by their listener connections), oldest first.
    pub async fn connected_relays(&self) -> Result<Vec<ConnectedRelay>> {
        sql::connected_relays(&*self.pooled().await?).await
    }

    /// Lists up to `limit` dead letters, oldest id first.
    pub async fn dead_letters(&self, limit: i64) -> Result<Vec<DeadLetter>> {
        sql::list_dead_letters(&*self.pooled().await?, limit).await
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
        let mut revived = sql::retry_dead_letters(&*self.pooled().await?, ids, all).await?;
        if !revived.is_empty() {
            self.wakeup().wake();
        }
        revived.sort_unstable();
        Ok(revived)
    }

    /// Deletes dead letters that failed more than `older_than` ago (zero: all). Returns how many.
    pub async fn purge_dead_letters(&self, older_than: Duration) -> Result<u64> {
        sql::purge_dead_letters(&*self.pooled().await?, older_than).await
    }

    /// Deletes the dead letters with these ids. Returns the ids that were found and deleted.
    pub async fn purge_dead_letters_by_id(&self, ids: &[i64]) -> Result<Vec<i64>> {
        let mut purged = sql::purge_dead_letters_by_id(&*self.pooled().await?, ids).await?;
        purged.sort_unstable();
        Ok(purged)
    }

    /// Answers when the database does: one `select 1` on a pooled connection.
    pub async fn ping(&self) -> Result<()> {
        sql::ping(&**self.pooled().await?, "asking the database whether it answers").await
    }

    /// One janitor pass: deletes processed events older than `retention` and idempotency receipts
    /// older than `idempotency_retention`, `batch` rows per statement so no lock is held long.
    pub async fn cleanup(
        &self,
        retention: Duration,
        idempotency_retention: Duration,
        batch: usize,
    ) -> Result<CleanupReport> {
        cleanup(&*self.pooled().await?, retention, idempotency_retention, batch).await
    }
}

/// One janitor pass on `db`, `batch` rows per statement: what [`Outbox::cleanup`] and the
/// relay's janitor run.
pub(crate) async fn cleanup(
    db: &impl sql::Db,
    retention: Duration,
    idempotency_retention: Duration,
    batch: usize,
) -> Result<CleanupReport> {
    let batch = i64::try_from(batch.max(1)).unwrap_or(i64::MAX);
    let mut report = CleanupReport::default();
    loop {
        let n = sql::delete_processed_events(db, retention, batch).await?;
        report.events += n;
        if n < batch as u64 {
            break;
        }
    }
    loop {
        let n = sql::delete_expired_receipts(db, idempotency_retention, batch).await?;
        report.receipts += n;
        if n < batch as u64 {
            break;
        }
    }
    Ok(report)
}

impl Outbox {
    /// Pauses delivery of `topic` (`None`: of every topic) for every relay on this database,
    /// until [`Outbox::resume`]; relays see it within about a second (a batch already claimed
    /// is still delivered). Paused events stay pending and are charged no attempt. Kept in the
    /// database, so a restart does not lift it. Returns false when it was paused already.
    pub async fn pause(&self, topic: Option<&str>) -> Result<bool> {
        let topic = pause_topic(topic)?;
        sql::pause(&*self.pooled().await?, topic).await
    }

    /// Lifts the pause of `topic` (`None`: the pause of every topic; pauses of single topics
    /// stay). Returns false when there was none.
    pub async fn resume(&self, topic: Option<&str>) -> Result<bool> {
        // Any row can be lifted, also one written by hand with a topic no event could have.
        let topic = match topic {
            Some("") => return Err(crate::error::Error::invalid_input("topic must not be empty")),
            Some(t) if t.contains('\0') || t.chars().count() > crate::event::MAX_TOPIC_LEN => {
                return Err(crate::error::Error::invalid_input(format!(
                    "no pause can have that topic (a NUL, or longer than {} characters)",
                    crate::event::MAX_TOPIC_LEN
                )));
            }
            Some(t) => t,
            None => "",
        };
        let resumed = sql::resume(&*self.pooled().await?, topic).await?;
        if resumed {
            self.wakeup().wake();
        }
        Ok(resumed)
    }

    /// The pauses in place, the pause of every topic first.
    pub async fn pauses(&self) -> Result<Vec<Pause>> {
        sql::pauses(&*self.pooled().await?).await
    }

    /// The database's health signals: what holds vacuum back, the outbox's dead tuples, the
    /// notification queue.
    pub async fn health(&self) -> Result<Health> {
        sql::health(&*self.pooled().await?).await
    }

    /// Up to `limit` events with this id or this key, in the outbox or the dead letters, newest
    /// first.
    pub async fn look_up(&self, id: Option<i64>, key: Option<&str>, limit: i64) -> Result<Vec<FoundEvent>> {
        sql::look_up(&*self.pooled().await?, id, key, limit).await
    }
}

/// A topic to pause or resume as the table holds it: '' for every topic.
fn pause_topic(topic: Option<&str>) -> Result<&str> {
    match topic {
        Some(topic) => crate::event::validate_topic(topic).map(|()| topic),
        None => Ok(""),
    }
}
