//! Operating the outbox: the queue at a glance, dead letters, and cleanup.

use std::time::{Duration, SystemTime};

use crate::dead_letters::DeadLetterFilter;
use crate::error::{Error, Result};
use crate::outbox::Outbox;
use crate::queue::{
    CleanupReport, ConnectedRelay, DeadLetter, DestinationStats, ErrorCount, FoundEvent, Health, Pause, QueueStats,
};
use crate::relay::TopicPattern;
use crate::sql;

impl Outbox {
    /// Counts pending, delayed, in-flight, retained and dead events.
    pub async fn queue_stats(&self) -> Result<QueueStats> {
        self.bounded("counting the queue", async { sql::queue_stats(&*self.pooled().await?).await }).await
    }

    /// The `limit` most common errors of pending events (their `last_error`), most frequent first.
    pub async fn pending_errors(&self, limit: i64) -> Result<Vec<ErrorCount>> {
        self.bounded("reading the pending events' errors", async {
            sql::pending_errors(&*self.pooled().await?, limit).await
        })
        .await
    }

    /// The relays connected to this database (by their listener connections), oldest first.
    pub async fn connected_relays(&self) -> Result<Vec<ConnectedRelay>> {
        self.bounded("listing the relays", async { sql::connected_relays(&*self.pooled().await?).await }).await
    }

    /// Lists the dead letters of up to `limit` events (every destination's of each), oldest id
    /// first.
    pub async fn dead_letters(&self, limit: i64) -> Result<Vec<DeadLetter>> {
        self.find_dead_letters(&DeadLetterFilter::default(), None, limit).await
    }

    /// Lists the dead letters `filter` takes of at most `limit` events with an id above `after`
    /// (every destination's dead letter of each), oldest id first: the next page starts after the
    /// last id of this one.
    pub async fn find_dead_letters(
        &self,
        filter: &DeadLetterFilter,
        after: Option<i64>,
        limit: i64,
    ) -> Result<Vec<DeadLetter>> {
        filter.check()?;
        self.bounded("listing dead letters", async {
            sql::list_dead_letters(&*self.pooled().await?, filter, after, limit).await
        })
        .await
    }

    /// How many dead letters (one per event and destination) `filter` takes: what a retry or a
    /// purge with it would take now.
    pub async fn count_dead_letters(&self, filter: &DeadLetterFilter) -> Result<u64> {
        filter.check()?;
        self.bounded("counting dead letters", async { sql::count_dead_letters(&*self.pooled().await?, filter).await })
            .await
    }

    /// Puts the dead letters with these ids back into the outbox under the same ids, attempts
    /// reset, deliverable at once: all of them, or none when one of them is not a dead letter
    /// (an [`ErrorKind::InvalidInput`](crate::ErrorKind) error names the missing ids). Returns
    /// the ids revived.
    pub async fn retry_dead_letters(&self, ids: &[i64]) -> Result<Vec<i64>> {
        self.revive(sql::Which::Ids(ids)).await
    }

    /// Puts every dead letter back into the outbox. Returns their ids.
    pub async fn retry_all_dead_letters(&self) -> Result<Vec<i64>> {
        self.retry_dead_letters_matching(&DeadLetterFilter::default()).await
    }

    /// Puts the dead letters `filter` takes back into the outbox, as
    /// [`Outbox::retry_dead_letters`] does. Returns the id of each dead letter retried (an event
    /// dead at two destinations twice): as many as [`Outbox::count_dead_letters`] counted.
    pub async fn retry_dead_letters_matching(&self, filter: &DeadLetterFilter) -> Result<Vec<i64>> {
        filter.check()?;
        self.revive(sql::Which::Matching(filter)).await
    }

    async fn revive(&self, which: sql::Which<'_>) -> Result<Vec<i64>> {
        let revived = self
            .bounded("retrying dead letters", async {
                let db = self.pooled().await?;
                match which {
                    sql::Which::Ids(ids) => {
                        let revived = sql::retry_dead_letters(&*db, sql::Which::Ids(ids)).await?;
                        all_or_none(&*db, ids, revived, "retried").await
                    }
                    which => sql::retry_dead_letters(&*db, which).await,
                }
            })
            .await?;
        if !revived.is_empty() {
            self.wakeup().wake();
        }
        Ok(revived)
    }

    /// Deletes dead letters that failed more than `older_than` ago (zero: all). Returns how many.
    pub async fn purge_dead_letters(&self, older_than: Duration) -> Result<u64> {
        self.purge_dead_letters_matching(&DeadLetterFilter::default().failed_longer_ago(older_than)).await
    }

    /// Deletes the dead letters `filter` takes. Returns how many.
    pub async fn purge_dead_letters_matching(&self, filter: &DeadLetterFilter) -> Result<u64> {
        filter.check()?;
        self.bounded("purging dead letters", async { sql::purge_dead_letters(&*self.pooled().await?, filter).await })
            .await
    }

    /// Deletes the dead letters with these ids: all of them, or none when one of them is not a
    /// dead letter (as [`Outbox::retry_dead_letters`]). Returns the ids deleted.
    pub async fn purge_dead_letters_by_id(&self, ids: &[i64]) -> Result<Vec<i64>> {
        self.bounded("purging dead letters", async {
            let db = self.pooled().await?;
            let purged = sql::purge_dead_letters_by_id(&*db, ids).await?;
            all_or_none(&*db, ids, purged, "purged").await
        })
        .await
    }

    /// Answers when the database does: one `select 1` on a pooled connection.
    pub async fn ping(&self) -> Result<()> {
        self.bounded("asking whether it answers", async {
            sql::ping(&**self.pooled().await?, "asking the database whether it answers").await
        })
        .await
    }

    /// One janitor pass: removes the events every destination has passed that are older than
    /// `retention` (a relay's sweeper does so all the time) and idempotency receipts older than
    /// `idempotency_retention`, `batch` rows per statement so no lock is held long, and the claim
    /// positions no longer needed (kept for `retention`, thinned: `outbox_relay.event_state` reads
    /// them).
    pub async fn cleanup(
        &self,
        retention: Duration,
        idempotency_retention: Duration,
        batch: usize,
    ) -> Result<CleanupReport> {
        let db = self.bounded("connecting for a cleanup", self.pooled()).await?;
        cleanup(&*db, Some(retention), retention, idempotency_retention, batch, Some((self.timeout(), self.url())))
            .await
    }
}

/// One janitor pass on `db`, `batch` rows per statement: what [`Outbox::cleanup`] and the
/// relay's janitor run (`events`: the retention of events to remove them by, which the relay's
/// janitor leaves to its sweeper; `retention`: the positions').
pub(crate) async fn cleanup(
    db: &impl sql::Db,
    events: Option<Duration>,
    retention: Duration,
    idempotency_retention: Duration,
    batch: usize,
    bound: Option<(Duration, &crate::DatabaseUrl)>,
) -> Result<CleanupReport> {
    // Each statement within the bound, when there is one (the relay's janitor has none).
    async fn step<T>(
        bound: Option<(Duration, &crate::DatabaseUrl)>,
        doing: &str,
        work: impl Future<Output = Result<T>>,
    ) -> Result<T> {
        match bound {
            Some((timeout, url)) => crate::outbox::within(timeout, url, doing, work).await,
            None => work.await,
        }
    }
    let batch = i64::try_from(batch.max(1)).unwrap_or(i64::MAX);
    let mut report = CleanupReport::default();
    if let Some(events) = events {
        let mut from = sql::SweepFrom::default();
        loop {
            let swept =
                step(bound, "removing events every destination passed", sql::sweep_outbox(db, &from, batch, events))
                    .await?;
            report.events += swept.finished.max(0) as u64;
            match swept.next {
                Some(next) if swept.read >= batch && next.moved_from(&from) => from = next,
                _ => break,
            }
        }
    }
    step(bound, "deleting old claim positions", sql::prune_positions(db, retention)).await?;
    loop {
        let doing = "deleting old records of parked deliveries";
        let n = step(bound, doing, sql::delete_expired_parked_deliveries(db, retention, batch)).await?;
        if n < batch as u64 {
            break;
        }
    }
    loop {
        let n =
            step(bound, "deleting expired receipts", sql::delete_expired_receipts(db, idempotency_retention, batch))
                .await?;
        report.receipts += n;
        if n < batch as u64 {
            break;
        }
    }
    Ok(report)
}

impl Outbox {
    /// Pauses delivery of `topic` (`None`: of every topic) for every relay on this database and
    /// every destination, until [`Outbox::resume`]; relays see it within about a second (a batch
    /// already claimed is still delivered). Paused events wait and are charged no attempt. Kept
    /// in the database, so a restart does not lift it. Returns false when it was paused already.
    pub async fn pause(&self, topic: Option<&str>) -> Result<bool> {
        self.pause_destination("", topic).await
    }

    /// Pauses delivery of `topic` (`None`: of every topic) to the destination `destination`
    /// only ([`Outbox::pause`] for every destination); the others go on. Returns false when it
    /// was paused already.
    pub async fn pause_destination(&self, destination: &str, topic: Option<&str>) -> Result<bool> {
        let topic = pause_topic(topic)?;
        if !destination.is_empty() {
            crate::destination::validate_destination_name(destination)?;
        }
        self.bounded("pausing", async { sql::pause(&*self.pooled().await?, topic, destination).await }).await
    }

    /// Lifts the pause of `topic` (`None`: the pause of every topic; pauses of single topics
    /// stay) for every destination (pauses of single destinations stay). Returns false when there
    /// was none.
    pub async fn resume(&self, topic: Option<&str>) -> Result<bool> {
        self.resume_destination("", topic).await
    }

    /// Lifts the pause of `topic` (`None`: of every topic) at the destination `destination`.
    /// Returns false when there was none.
    pub async fn resume_destination(&self, destination: &str, topic: Option<&str>) -> Result<bool> {
        // Any row can be lifted, also one written by hand with a topic no event could have.
        let lifted = |what: &str, name: Option<&str>| match name {
            Some("") => Err(crate::error::Error::invalid_input(format!("{what} must not be empty"))),
            Some(t) if t.contains('\0') || t.chars().count() > crate::NewEvent::MAX_TOPIC_LEN => {
                Err(crate::error::Error::invalid_input(format!(
                    "no pause can have that {what} (a NUL, or longer than {} characters)",
                    crate::NewEvent::MAX_TOPIC_LEN
                )))
            }
            Some(t) => Ok(t.to_string()),
            None => Ok(String::new()),
        };
        let topic = lifted("topic", topic)?;
        let destination = lifted("destination", (!destination.is_empty()).then_some(destination))?;
        let resumed =
            self.bounded("resuming", async { sql::resume(&*self.pooled().await?, &topic, &destination).await }).await?;
        if resumed {
            self.wakeup().wake();
        }
        Ok(resumed)
    }

    /// Every destination registered on this database (by the relays that deliver to it), with
    /// what waits for it, by name.
    pub async fn destinations(&self) -> Result<Vec<DestinationStats>> {
        self.bounded("reading the destinations", async { sql::destination_stats(&*self.pooled().await?).await }).await
    }

    /// The names of the registered destinations, in order (without what waits for them:
    /// [`Outbox::destinations`] counts that).
    pub async fn destination_names(&self) -> Result<Vec<String>> {
        self.bounded("reading the destinations' names", async { sql::destination_names(&*self.pooled().await?).await })
            .await
    }

    /// Drops the destination `name`, which no relay delivers to any more: events stop waiting
    /// for it (what was parked for it goes to its dead letters, saying why), and its position no
    /// longer keeps events that every other destination has passed. Refused while a connected
    /// relay delivers to it (stop those relays first; a relay started later with a route of that
    /// name registers it anew, starting where the destination furthest behind is). Returns how
    /// many parked events went to the dead letters; an error when no destination has that name.
    pub async fn drop_destination(&self, name: &str) -> Result<u64> {
        crate::destination::validate_destination_name(name)?;
        let dropped = self
            .bounded("dropping a destination", async { sql::drop_destination(&mut self.pooled().await?, name).await })
            .await?;
        match dropped {
            sql::Dropped::Done(buried) => Ok(buried),
            sql::Dropped::Unknown => {
                Err(crate::error::Error::invalid_input(format!("no destination is named {name:?}")))
            }
            sql::Dropped::Served(pids) => Err(crate::error::Error::invalid_input(format!(
                "destination {name:?} is delivered to by {} connected relay(s) (listener pids {}): stop them first; nothing was dropped",
                pids.len(),
                pids.iter().map(i32::to_string).collect::<Vec<_>>().join(", ")
            ))),
        }
    }

    /// Sends the retained events of `destination` created from `since` to `until` (`None`: to
    /// now) again, those that `topics` matches (`None`: all), with their ids, uuids and payloads
    /// (a consumer's inbox drops what it has already): each is copied into the destination's
    /// parked events, due now, and delivered from there in order per key; a new event of a
    /// replayed key waits behind them. Only events the destination's position has passed are
    /// sent (the others are still to come), none already waiting for it, and none removed after
    /// the retention (`RelayConfig::retention`). The other destinations see nothing of it.
    /// Returns how many events were copied; an error names an unknown destination or a `since`
    /// not before `until`.
    pub async fn replay(
        &self,
        destination: &str,
        since: SystemTime,
        until: Option<SystemTime>,
        topics: Option<&TopicPattern>,
    ) -> Result<u64> {
        self.replay_or_count(destination, since, until, topics, false).await
    }

    /// How many events [`Outbox::replay`] would send with these arguments now (a replay rolled
    /// back).
    pub async fn replay_count(
        &self,
        destination: &str,
        since: SystemTime,
        until: Option<SystemTime>,
        topics: Option<&TopicPattern>,
    ) -> Result<u64> {
        self.replay_or_count(destination, since, until, topics, true).await
    }

    async fn replay_or_count(
        &self,
        destination: &str,
        since: SystemTime,
        until: Option<SystemTime>,
        topics: Option<&TopicPattern>,
        dry_run: bool,
    ) -> Result<u64> {
        crate::destination::validate_destination_name(destination)?;
        if let Some(until) = until
            && until <= since
        {
            return Err(Error::invalid_input(format!(
                "a replay's since ({}) must be before its until ({})",
                humantime::format_rfc3339_millis(since),
                humantime::format_rfc3339_millis(until)
            )));
        }
        let regex = topics.map(TopicPattern::dotted_regex);
        let copied = self
            .bounded("replaying events", async {
                let regex = regex.flatten();
                sql::replay_on(&mut self.pooled().await?, destination, since, until, regex.as_deref(), dry_run).await
            })
            .await
            .map_err(|e| {
                if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_OBJECT) {
                    Error::invalid_input(format!(
                        "no destination is named {destination:?} (`outbox-relay destinations list` shows them); nothing was replayed"
                    ))
                } else {
                    e
                }
            })?;
        if copied > 0 && !dry_run {
            self.wakeup().wake();
        }
        Ok(copied)
    }

    /// Registers the destination `name` with `pattern` before any relay serves it, starting
    /// where a relay would register it (after what every destination has passed), and with
    /// `since`, in the past: the retained events created from then on that it would have taken
    /// are replayed to it in the same transaction ([`Outbox::replay`]), so that it gets them in
    /// order per key before any newer one. Start a relay with a route of that name and pattern
    /// to deliver them. Returns how many events were replayed; an error when a destination of
    /// that name is registered already.
    pub async fn add_destination(&self, name: &str, pattern: &TopicPattern, since: Option<SystemTime>) -> Result<u64> {
        crate::destination::validate_destination_name(name)?;
        let regex = pattern.dotted_regex();
        let to = sql::ToRegister { name, pattern: pattern.as_str(), topic_regex: regex.as_deref() };
        let added = self
            .bounded("adding a destination", async {
                sql::add_destination(&mut self.pooled().await?, &to, since).await
            })
            .await?;
        match added {
            sql::Added::Done(replayed) => {
                if replayed > 0 {
                    self.wakeup().wake();
                }
                Ok(replayed)
            }
            sql::Added::Exists(was) => Err(Error::invalid_input(format!(
                "destination {name:?} is registered already (pattern {was}); `outbox-relay replay --destination {name} --since ...` sends its past again"
            ))),
        }
    }

    /// The pauses in place: of every destination first, and of every topic first.
    pub async fn pauses(&self) -> Result<Vec<Pause>> {
        self.bounded("listing the pauses", async { sql::pauses(&*self.pooled().await?).await }).await
    }

    /// The database's health signals: what holds vacuum back, the outbox's dead tuples, the
    /// notification queue.
    pub async fn health(&self) -> Result<Health> {
        self.bounded("reading the health signals", async { sql::health(&*self.pooled().await?).await }).await
    }

    /// Up to `limit` events with this id or this key, in the outbox or the dead letters, newest
    /// first.
    pub async fn look_up(&self, id: Option<i64>, key: Option<&str>, limit: i64) -> Result<Vec<FoundEvent>> {
        self.bounded("looking events up", async { sql::look_up(&*self.pooled().await?, id, key, limit).await }).await
    }
}

/// The ids an all-or-none action on `wanted` `done` (sorted), or the error naming the ids that
/// are not dead letters (`verb`: what would have been done to them).
async fn all_or_none(db: &impl sql::Db, wanted: &[i64], mut done: Vec<i64>, verb: &str) -> Result<Vec<i64>> {
    done.sort_unstable();
    done.dedup();
    let mut missing: Vec<i64> = wanted.iter().copied().filter(|id| done.binary_search(id).is_err()).collect();
    if missing.is_empty() {
        return Ok(done);
    }
    if done.is_empty() {
        let present = sql::dead_letter_ids(db, &missing).await?;
        missing.retain(|id| !present.contains(id));
    }
    missing.sort_unstable();
    missing.dedup();
    let plural = if missing.len() == 1 { "" } else { "s" };
    let nothing = if done.is_empty() {
        format!("nothing was {verb}")
    } else {
        format!("{} were {verb} (they changed meanwhile)", done.len())
    };
    let missing = crate::text::some_ids(&missing, 20);
    Err(crate::error::Error::invalid_input(format!("no dead letter with id{plural} {missing}: {nothing}")))
}

/// A topic to pause or resume as the table holds it: '' for every topic.
fn pause_topic(topic: Option<&str>) -> Result<&str> {
    match topic {
        Some(topic) => crate::event::validate_topic(topic).map(|()| topic),
        None => Ok(""),
    }
}
