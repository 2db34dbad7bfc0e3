//! The consumers' inbox: recording an event handled, forgetting old records.

use std::time::Duration;

use super::{Db, all, count, micros};
use crate::error::Result;

/// Records `(consumer, event)`; a row comes back only when it was not there. A second
/// transaction recording the same pair waits for the first to end: it finds the row when the
/// first commits, and records it itself when the first rolls back.
pub(crate) const INBOX_RECORD: &str = "\
insert into outbox_relay.inbox (consumer, event_id) values ($1, $2)
on conflict (consumer, event_id) do nothing
returning true";

/// Whether `(consumer, event)` was new; the record commits or rolls back with the caller's
/// transaction.
pub(crate) async fn record_in_inbox(db: &impl Db, consumer: &str, event: uuid::Uuid) -> Result<bool> {
    Ok(!all(db, INBOX_RECORD, &[&consumer, &event], "recording an event in the inbox").await?.is_empty())
}

/// Deletes up to `$3` of a consumer's records older than `$2` microseconds, oldest first,
/// skipping rows another transaction holds (a consumer recording the same event right now).
pub(crate) const INBOX_PURGE: &str = "\
delete from outbox_relay.inbox i
 using (select event_id from outbox_relay.inbox
         where consumer = $1 and received_at < now() - $2::int8 * interval '1 microsecond'
         order by received_at
         limit $3
           for update skip locked) old
 where i.consumer = $1 and i.event_id = old.event_id";

/// Deletes one batch of old records; returns how many.
pub(crate) async fn purge_inbox_batch(db: &impl Db, consumer: &str, older_than: Duration, batch: i64) -> Result<u64> {
    count(db, INBOX_PURGE, &[&consumer, &micros(older_than), &batch], "deleting old inbox records").await
}
