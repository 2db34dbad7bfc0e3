//! A delivery worker: claim a batch, deliver it with no transaction open, record the outcomes.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use tokio::time::Instant;
use tokio_postgres::types::ToSql;

use super::backoff::retry_delay;
use super::config::Completion;
use super::{Handler, Shared, idle};
use crate::error::{Error, Result};
use crate::event::Event;
use crate::sql::{self, micros};

/// Longest pause after a failed claim (the database is down or restarting).
const ERROR_PAUSE_MAX: Duration = Duration::from_secs(5);

pub(crate) async fn run<H: Handler>(shared: Arc<Shared<H>>, n: usize) {
    let span = tracing::debug_span!("worker", n);
    loop {
        tokio::select! {
            biased;
            _ = shared.stop.cancelled() => return,
            _ = shared.work.notified() => {}
        }
        if let Err(e) = drain(&shared).await {
            let _entered = span.enter();
            tracing::warn!(error = %e, "claiming events failed");
            drop(_entered);
            if !pause_after_error(&shared).await {
                return;
            }
            shared.work.notify_one(); // try again, this worker or another
            continue;
        }
        // Out of work. Unless the relay is already marked waiting, one worker lingers for it and
        // then marks it waiting for NOTIFY. Workers queue for that turn rather than skip it: a
        // worker that unmarked the relay while another was lingering must see to it that someone
        // lingers and marks again, or writers would stop notifying an idle relay.
        if !shared.idle.is_marked() {
            let _turn = shared.idle.lingering.lock().await;
            if !shared.idle.is_marked() {
                idle::linger(&shared).await;
            }
        }
    }
}

/// Claims until a claim comes back short: then the queue is drained, for now.
async fn drain<H: Handler>(shared: &Shared<H>) -> Result<()> {
    while !shared.stop.is_cancelled() {
        let claimed = claim_and_deliver(shared, true).await?;
        if claimed > 0 && shared.idle.is_marked() {
            // Busy: writers need not notify until this relay is idle again.
            shared.idle.set(shared, false).await?;
        }
        if claimed < shared.config.batch_size {
            break;
        }
        // More may be waiting: let an idle worker help while this one claims again.
        shared.work.notify_one();
    }
    Ok(())
}

/// Waits a little after a failed claim (the database is down or restarting); false when the relay
/// is stopping.
async fn pause_after_error<H: Handler>(shared: &Shared<H>) -> bool {
    let failures = shared.claim_failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
    let pause = retry_delay(failures, Duration::from_millis(50), ERROR_PAUSE_MAX, 0.5, rand::random());
    tokio::select! {
        _ = shared.stop.cancelled() => false,
        _ = tokio::time::sleep(pause) => true,
    }
}

/// What became of each claimed event.
#[derive(Default)]
struct Outcomes {
    delivered: Vec<i64>,
    latencies: Vec<Duration>,
    retry_ids: Vec<i64>,
    retry_delays_us: Vec<i64>,
    retry_errors: Vec<String>,
    bury_ids: Vec<i64>,
    bury_errors: Vec<String>,
    released: Vec<i64>,
}

impl Outcomes {
    /// Records a transient failure: a retry after backoff (or after the destination's
    /// `Retry-After`, within `backoff_max`), or the dead letters after the last allowed attempt.
    /// Returns the retry delay, if any.
    fn retry(&mut self, config: &super::RelayConfig, event: &Event, e: &super::DeliveryError) -> Option<Duration> {
        if event.attempts >= i32::try_from(config.max_attempts).unwrap_or(i32::MAX) {
            self.bury(event.id, format!("gave up after {} attempts: {}", event.attempts, e.message()));
            return None;
        }
        let attempt = u32::try_from(event.attempts).unwrap_or(1);
        let backoff =
            retry_delay(attempt, config.backoff_base, config.backoff_max, config.backoff_jitter, rand::random());
        let delay = e.requested_delay().map_or(backoff, |asked| backoff.max(asked.min(config.backoff_max)));
        self.retry_ids.push(event.id);
        self.retry_delays_us.push(micros(delay));
        self.retry_errors.push(e.message().to_string());
        Some(delay)
    }

    fn bury(&mut self, id: i64, reason: String) {
        self.bury_ids.push(id);
        self.bury_errors.push(reason);
    }
}

/// Claims one batch and delivers it; returns how many events were claimed. When the claim comes
/// back empty and `schedule_next` is set, the timer is set to the earliest future event.
pub(crate) async fn claim_and_deliver<H: Handler>(shared: &Shared<H>, schedule_next: bool) -> Result<usize> {
    let config = &shared.config;
    let token: i64 = rand::random();
    let batch = i64::try_from(config.batch_size).unwrap_or(i64::MAX);
    let claimed = {
        let client = shared.client().await?;
        let statement = client.prepare_cached(sql::EVENT_CLAIM).await.map_err(|e| Error::database("preparing", e))?;
        let claimed = client
            .query(&statement, &[&batch, &micros(config.lease), &token])
            .await
            .map_err(|e| Error::database("claiming events", e))?;
        shared.metrics.claimed();
        shared.claim_failures.store(0, std::sync::atomic::Ordering::Relaxed);
        if claimed.is_empty() && !schedule_next {
            return Ok(0);
        }
        if claimed.is_empty() {
            // Woken for nothing deliverable yet: maybe a delayed event or a retry, written by any
            // process. Sleep until the earliest one rather than up to a poll interval past it.
            let row = client
                .query_one(sql::EVENT_NEXT_AVAILABLE, &[])
                .await
                .map_err(|e| Error::database("reading the next due event", e))?;
            if let Some(us) = row.get::<_, Option<i64>>(0).filter(|us| *us > 0) {
                shared.timer.schedule(Instant::now() + Duration::from_micros(us as u64));
            }
            return Ok(0);
        }
        claimed
    };
    let claimed_at = Instant::now();
    let count = claimed.len();
    let mut outcomes = Outcomes::default();
    let mut events: Vec<(Event, Duration)> = Vec::with_capacity(count);
    for row in &claimed {
        match read_event(row) {
            Ok(event) => events.push(event),
            // A row no handler can be given (written by hand, or before migration 0003) goes to
            // the dead letters at once, saying why; the rest of the batch goes on.
            Err((id, reason)) => outcomes.bury(id, reason),
        }
    }
    events.sort_unstable_by_key(|(event, _)| event.id);
    tracing::debug!(count, "claimed events");
    let (events, ages): (Vec<Event>, Vec<Duration>) = events.into_iter().unzip();

    if !events.is_empty() {
        // Deliveries must end well inside the lease, or another worker may claim the same events.
        let deadline = claimed_at + config.lease.mul_f64(0.9);
        let delivery = AssertUnwindSafe(shared.handler.handle_batch(&events)).catch_unwind();
        let results = tokio::select! {
            results = delivery => match results {
                Ok(results) => Some(results),
                Err(panic) => {
                    let failure = super::handler::panicked(&*panic);
                    Some(events.iter().map(|_| Err(failure.clone())).collect())
                }
            },
            _ = tokio::time::sleep_until(deadline) => {
                let message = format!("delivery did not finish within 90% of the {:?} lease", config.lease);
                Some(events.iter().map(|_| Err(super::DeliveryError::transient(&message))).collect())
            }
            _ = shared.abort.cancelled() => None,
        };
        match results {
            // Cut off at shutdown: the events go back, the attempt not counted.
            None => outcomes.released.extend(events.iter().map(|e| e.id)),
            Some(mut results) => {
                if results.len() != events.len() {
                    let message = format!("the handler returned {} results for {} events", results.len(), events.len());
                    results.resize_with(events.len(), || Err(super::DeliveryError::transient(&message)));
                }
                for ((event, age), result) in events.iter().zip(&ages).zip(results) {
                    match result {
                        Ok(()) => {
                            outcomes.delivered.push(event.id);
                            outcomes.latencies.push(*age + claimed_at.elapsed());
                        }
                        Err(e) if e.is_permanent() => outcomes.bury(event.id, e.message().to_string()),
                        Err(e) => {
                            // The last allowed attempt goes to the dead letters, logged on their own.
                            if let Some(delay) = outcomes.retry(config, event, &e) {
                                shared.timer.schedule(Instant::now() + delay);
                                shared.reporter.failed(event, &e, delay);
                            }
                        }
                    }
                }
            }
        }
    }
    record(shared, token, outcomes).await;
    Ok(count)
}

/// The event of a claimed row and its age, or the row's id and why no handler can be given it.
fn read_event(row: &tokio_postgres::Row) -> std::result::Result<(Event, Duration), (i64, String)> {
    let id: i64 = row.get(0);
    // A payload PostgreSQL accepts but serde_json cannot hold (a number beyond f64, nesting past
    // its recursion limit) would fail every delivery.
    let payload = row
        .try_get::<_, serde_json::Value>(3)
        .map_err(|e| (id, format!("the payload cannot be read as JSON by the relay: {}", crate::error::chain(&e))))?;
    let created_at: std::time::SystemTime = row.get(4);
    let Some(age_us) = row.get::<_, Option<i64>>(6) else {
        return Err((
            id,
            format!(
                "created_at {} is outside the years 1970 to 9999, which an event cannot carry",
                crate::timestamp::rfc3339_micros(created_at)
            ),
        ));
    };
    let event = Event { id, topic: row.get(1), key: row.get(2), payload, created_at, attempts: row.get(5) };
    Ok((event, Duration::from_micros(age_us.max(0) as u64)))
}

/// Writes the outcomes of one batch. Each statement only touches rows still holding this
/// claim's token. A failure here is retried a few times and then left to the lease: the events
/// come back and are delivered again, which at-least-once delivery allows.
async fn record<H: Handler>(shared: &Shared<H>, token: i64, outcomes: Outcomes) {
    let mut tries = 0;
    loop {
        tries += 1;
        match write_outcomes(shared, token, &outcomes).await {
            Ok(()) => break,
            Err(e) if tries < 4 => {
                tracing::warn!(error = %e, "recording delivery outcomes failed; trying again");
                tokio::time::sleep(Duration::from_millis(100 * tries)).await;
            }
            Err(e) => {
                tracing::error!(error = %e, events = outcomes.delivered.len(), "recording delivery outcomes failed; the events will be delivered again after their lease");
                return;
            }
        }
    }
    shared.metrics.delivered(outcomes.latencies.into_iter());
    shared.metrics.retried(outcomes.retry_ids.len());
    shared.metrics.dead_lettered(outcomes.bury_ids.len());
    if !outcomes.bury_ids.is_empty() {
        tracing::warn!(ids = ?outcomes.bury_ids, errors = ?outcomes.bury_errors, "events moved to the dead letters");
    }
}

async fn write_outcomes<H: Handler>(shared: &Shared<H>, token: i64, o: &Outcomes) -> Result<()> {
    let client = shared.client().await?;
    let complete = match shared.config.completion {
        Completion::MarkProcessed => sql::EVENT_MARK_PROCESSED,
        Completion::Delete => sql::EVENT_DELETE_PROCESSED,
    };
    let mut statements: Vec<(&str, Vec<&(dyn ToSql + Sync)>)> = Vec::new();
    if !o.delivered.is_empty() {
        statements.push((complete, vec![&o.delivered, &token]));
    }
    if !o.retry_ids.is_empty() {
        statements.push((sql::EVENT_RESCHEDULE, vec![&o.retry_ids, &o.retry_delays_us, &o.retry_errors, &token]));
    }
    if !o.bury_ids.is_empty() {
        statements.push((sql::EVENT_BURY, vec![&o.bury_ids, &o.bury_errors, &token]));
    }
    if !o.released.is_empty() {
        statements.push((sql::EVENT_RELEASE, vec![&o.released, &token]));
    }
    // Independent statements on one connection are pipelined: one round trip for all of them.
    let runs = statements.iter().map(|(sql, params)| {
        let client = &client;
        async move {
            let statement = client.prepare_cached(sql).await?;
            client.execute(&statement, params).await
        }
    });
    for result in futures::future::join_all(runs).await {
        result.map_err(|e| Error::database("recording delivery outcomes", e))?;
    }
    Ok(())
}
