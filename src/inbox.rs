//! The consumer's side of at-least-once delivery: an inbox that drops redeliveries.
//!
//! The relay delivers every event at least once: after a crash, a lost acknowledgement or a
//! timeout it sends an event again. A consumer makes that harmless by recording each event's
//! [`uuid`](crate::Event::uuid) in `outbox_relay.inbox`, **in the same transaction as its own
//! writes**: either both commit, and a redelivery finds the record and writes nothing, or
//! neither does, and the redelivery is handled as the first delivery would have been.
//!
//! ```no_run
//! # async fn f(client: &mut tokio_postgres::Client, event: pg_outbox_relay::Uuid) -> Result<(), Box<dyn std::error::Error>> {
//! use pg_outbox_relay::inbox::{Inbox, Recorded};
//! let inbox = Inbox::new("billing")?;
//! let tx = client.transaction().await?;
//! if inbox.record(&tx, event).await? == Recorded::New {
//!     tx.execute("insert into invoices (order_id) values (42)", &[]).await?;
//! }
//! tx.commit().await?;
//! // Answer success in both cases: a duplicate was handled the first time.
//! # Ok(()) }
//! ```
//!
//! Two deliveries of one event that race are serialized by the record's primary key: the
//! second waits for the first transaction, and finds the record if it committed (or records
//! the event itself if it rolled back). The table lives in the consumer's database: run the
//! library's migrations there (`outbox-relay migrate`, or [`crate::Outbox::migrate`]).
//! sqlx users have the same in `pg_outbox_relay::sqlx::record_in_inbox` (feature `sqlx`).
//!
//! **Retention.** Records are kept until [`Inbox::purge`] deletes those older than a retention.
//! Keep it longer than any redelivery can come: a relay redelivers within seconds to minutes,
//! but an operator may retry a dead letter days later (`outbox-relay dead-letters retry`), and
//! an event whose record is gone is handled again.

use std::time::Duration;

use tokio_postgres::GenericClient;

use crate::error::{Error, Result};
use crate::sql::{self, Unprepared};

/// The shortest retention [`Inbox::purge`] takes: anything shorter would forget events that
/// an ordinary retry still redelivers.
pub const MIN_RETENTION: Duration = Duration::from_secs(60);

/// How many records one statement of [`Inbox::purge`] deletes.
pub const PURGE_BATCH: i64 = 10_000;

/// One consumer's inbox: the events it has handled, by uuid. Each consumer of the same events
/// (a billing service, a mailer) has its own name, so that each handles every event once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inbox {
    consumer: String,
}

/// Whether [`Inbox::record`] saw the event for the first time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "a duplicate must not be handled again"]
pub enum Recorded {
    /// The first delivery: handle it in the same transaction.
    New,
    /// Recorded before (a redelivery): write nothing, answer success.
    Duplicate,
}

impl Inbox {
    /// The inbox of `consumer`: 1 to 255 characters, no control characters.
    pub fn new(consumer: impl Into<String>) -> Result<Self> {
        let consumer = consumer.into();
        crate::event::validate_key("inbox consumer name", &consumer)?;
        Ok(Inbox { consumer })
    }

    /// The consumer's name.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// Records `event` in the caller's transaction and says whether it is new. Handle the
    /// event (its writes in the same transaction) only when it is [`Recorded::New`]; the
    /// record commits or rolls back with them.
    ///
    /// It takes a [`tokio_postgres::Transaction`] (a deadpool transaction derefs to one): a
    /// record committed on its own, before the handler's writes, would drop the redelivery of
    /// an event whose handling failed.
    pub async fn record(&self, tx: &tokio_postgres::Transaction<'_>, event: uuid::Uuid) -> Result<Recorded> {
        let new = sql::record_in_inbox(&Unprepared(tx), &self.consumer, event).await?;
        Ok(if new { Recorded::New } else { Recorded::Duplicate })
    }

    /// Deletes this consumer's records older than `retention` (at least [`MIN_RETENTION`]), in
    /// statements of [`PURGE_BATCH`] rows, and returns how many. On a client each statement
    /// commits on its own, so a large purge holds no lock for long; records another transaction
    /// holds at the moment are left for the next purge.
    pub async fn purge<C: GenericClient + Sync>(&self, client: &C, retention: Duration) -> Result<u64> {
        check_retention(retention)?;
        let mut deleted = 0;
        loop {
            let n = sql::purge_inbox_batch(&Unprepared(client), &self.consumer, retention, PURGE_BATCH).await?;
            deleted += n;
            if n < PURGE_BATCH as u64 {
                return Ok(deleted);
            }
        }
    }
}

/// Refuses a retention shorter than [`MIN_RETENTION`], as [`Inbox::purge`] does: a service
/// checks its configured retention with this at start.
pub fn check_retention(retention: Duration) -> Result<()> {
    if retention < MIN_RETENTION {
        return Err(Error::invalid_input(format!(
            "an inbox retention of {} is shorter than the minimum of {}: a redelivery after it would be handled again",
            humantime::format_duration(retention),
            humantime::format_duration(MIN_RETENTION)
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consumer_names_are_checked() {
        assert_eq!(Inbox::new("billing").unwrap().consumer(), "billing");
        for bad in ["", "a\nb"] {
            let e = Inbox::new(bad).unwrap_err();
            assert!(e.is_invalid_input() && e.to_string().contains("inbox consumer name"), "{e}");
        }
        assert!(Inbox::new("é".repeat(256)).unwrap_err().to_string().contains("256 characters"));
    }

    #[test]
    fn a_retention_below_the_minimum_is_refused() {
        let e = check_retention(Duration::from_secs(59)).unwrap_err().to_string();
        assert!(e.contains("59s") && e.contains("1m"), "{e}");
        assert!(check_retention(MIN_RETENTION).is_ok());
    }
}
