//! One batch: claim it, hand it to the handler with no transaction open, record what became of
//! each event.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::RelayPool;
use super::backoff::retry_delay;
use super::config::{Completion, RelayConfig};
use super::handler::{DeliveryError, Handler, panicked};
use super::metrics::RelayMetrics;
use super::report::Reporter;
use super::timer::Timer;
use crate::error::Result;
use crate::event::Event;
use crate::sql;

/// What claiming and delivering a batch needs.
pub(crate) struct Claimer<H> {
    pub(crate) pool: RelayPool,
    pub(crate) handler: H,
    pub(crate) config: RelayConfig,
    pub(crate) metrics: Arc<RelayMetrics>,
    /// Told of every retry this relay schedules and of the next due event.
    pub(crate) timer: Arc<Timer>,
    /// Told of every failed delivery, for the rate-limited warnings.
    pub(crate) reporter: Arc<Reporter>,
    /// Stop delivering now; release what is in hand (shutdown past its grace).
    pub(crate) abort: CancellationToken,
}

/// What became of each claimed event.
#[derive(Default)]
struct Outcomes {
    delivered: Vec<i64>,
    latencies: Vec<Duration>,
    retry_ids: Vec<i64>,
    retry_delays: Vec<Duration>,
    retry_errors: Vec<String>,
    bury_ids: Vec<i64>,
    bury_errors: Vec<String>,
    released: Vec<i64>,
}

impl Outcomes {
    /// Records a transient failure: a retry after backoff (or after the destination's
    /// `Retry-After`, within `backoff_max`), or the dead letters after the last allowed attempt.
    /// Returns the retry delay, if any.
    fn retry(&mut self, config: &RelayConfig, event: &Event, e: &DeliveryError) -> Option<Duration> {
        if event.attempts >= i32::try_from(config.max_attempts).unwrap_or(i32::MAX) {
            self.bury(event.id, format!("gave up after {} attempts: {}", event.attempts, e.message()));
            return None;
        }
        let attempt = u32::try_from(event.attempts).unwrap_or(1);
        let backoff =
            retry_delay(attempt, config.backoff_base, config.backoff_max, config.backoff_jitter, rand::random());
        let delay = e.requested_delay().map_or(backoff, |asked| backoff.max(asked.min(config.backoff_max)));
        self.retry_ids.push(event.id);
        self.retry_delays.push(delay);
        self.retry_errors.push(e.message().to_string());
        Some(delay)
    }

    fn bury(&mut self, id: i64, reason: String) {
        self.bury_ids.push(id);
        self.bury_errors.push(reason);
    }
}

impl<H: Handler> Claimer<H> {
    /// Claims one batch and delivers it; returns how many events were claimed. When the claim
    /// comes back empty and `schedule_next` is set, the timer is set to the earliest future event.
    pub(crate) async fn claim_and_deliver(&self, schedule_next: bool) -> Result<usize> {
        let config = &self.config;
        let token = rand::random::<i64>();
        let batch = i64::try_from(config.batch_size).unwrap_or(i64::MAX);
        let claimed = {
            let client = self.pool.client().await?;
            let claimed = sql::claim_events(&*client, batch, config.lease, token).await?;
            self.metrics.claimed();
            if claimed.is_empty() {
                if schedule_next {
                    // Woken for nothing deliverable yet: maybe a delayed event or a retry, written
                    // by any process. Sleep until the earliest one rather than up to a poll
                    // interval past it.
                    if let Some(due) = sql::next_due(&*client).await? {
                        self.timer.schedule(Instant::now() + due);
                    }
                }
                return Ok(0);
            }
            claimed
        };
        let claimed_at = Instant::now();
        let count = claimed.len();
        let mut outcomes = Outcomes::default();
        let mut events: Vec<(Event, Duration)> = Vec::with_capacity(count);
        for row in claimed {
            match read_event(row) {
                Ok(event) => events.push(event),
                // A row no handler can be given (written by hand, or before migration 0003) goes
                // to the dead letters at once, saying why; the rest of the batch goes on.
                Err((id, reason)) => outcomes.bury(id, reason),
            }
        }
        events.sort_unstable_by_key(|(event, _)| event.id);
        tracing::debug!(count, "claimed events");
        let (events, ages): (Vec<Event>, Vec<Duration>) = events.into_iter().unzip();
        if !events.is_empty() {
            self.deliver(&events, &ages, claimed_at, &mut outcomes).await;
        }
        self.record(token, outcomes).await;
        Ok(count)
    }

    /// Hands `events` to the handler, bounded by the lease and the shutdown's abort.
    async fn deliver(&self, events: &[Event], ages: &[Duration], claimed_at: Instant, outcomes: &mut Outcomes) {
        let config = &self.config;
        // Deliveries must end well inside the lease, or another worker may claim the same events.
        let deadline = claimed_at + config.lease.mul_f64(0.9);
        let delivery = AssertUnwindSafe(self.handler.handle_batch(events)).catch_unwind();
        let all_failed = |error: DeliveryError| events.iter().map(|_| Err(error.clone())).collect();
        let mut results: Vec<Result<(), DeliveryError>> = tokio::select! {
            results = delivery => match results {
                Ok(results) => results,
                Err(panic) => all_failed(panicked(&*panic)),
            },
            _ = tokio::time::sleep_until(deadline) => all_failed(DeliveryError::transient(format!(
                "delivery did not finish within 90% of the {:?} lease",
                config.lease
            ))),
            _ = self.abort.cancelled() => {
                // Cut off at shutdown: the events go back, the attempt not counted.
                outcomes.released.extend(events.iter().map(|e| e.id));
                return;
            }
        };
        if results.len() != events.len() {
            let message = format!("the handler returned {} results for {} events", results.len(), events.len());
            results.resize_with(events.len(), || Err(DeliveryError::transient(&message)));
        }
        for ((event, age), result) in events.iter().zip(ages).zip(results) {
            match result {
                Ok(()) => {
                    outcomes.delivered.push(event.id);
                    outcomes.latencies.push(*age + claimed_at.elapsed());
                }
                Err(e) if e.is_permanent() => outcomes.bury(event.id, e.message().to_string()),
                Err(e) => {
                    // The last allowed attempt goes to the dead letters, logged on their own.
                    if let Some(delay) = outcomes.retry(config, event, &e) {
                        self.timer.schedule(Instant::now() + delay);
                        self.reporter.failed(event, &e, delay);
                    }
                }
            }
        }
    }

    /// Writes the outcomes of one batch. Each statement only touches rows still holding this
    /// claim's token. A failure here is retried a few times and then left to the lease: the
    /// events come back and are delivered again, which at-least-once delivery allows.
    async fn record(&self, token: i64, outcomes: Outcomes) {
        let mut tries = 0;
        loop {
            tries += 1;
            match self.write_outcomes(token, &outcomes).await {
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
        self.metrics.delivered(outcomes.latencies.into_iter());
        self.metrics.retried(outcomes.retry_ids.len());
        self.metrics.dead_lettered(outcomes.bury_ids.len());
        if !outcomes.bury_ids.is_empty() {
            tracing::warn!(ids = ?outcomes.bury_ids, errors = ?outcomes.bury_errors, "events moved to the dead letters");
        }
    }

    async fn write_outcomes(&self, token: i64, o: &Outcomes) -> Result<()> {
        let client = self.pool.client().await?;
        let db = &*client;
        let delete = self.config.completion == Completion::Delete;
        // Independent statements on one connection are pipelined: one round trip for all of them.
        let mut writes: Vec<BoxFuture<'_, Result<u64>>> = Vec::new();
        if !o.delivered.is_empty() {
            writes.push(Box::pin(sql::complete_events(db, delete, &o.delivered, token)));
        }
        if !o.retry_ids.is_empty() {
            writes.push(Box::pin(sql::reschedule_events(db, &o.retry_ids, &o.retry_delays, &o.retry_errors, token)));
        }
        if !o.bury_ids.is_empty() {
            writes.push(Box::pin(sql::bury_events(db, &o.bury_ids, &o.bury_errors, token)));
        }
        if !o.released.is_empty() {
            writes.push(Box::pin(sql::release_events(db, &o.released, token)));
        }
        futures::future::try_join_all(writes).await.map(drop)
    }
}

/// The event of a claimed row and its age, or the row's id and why no handler can be given it.
fn read_event(row: sql::ClaimedRow) -> std::result::Result<(Event, Duration), (i64, String)> {
    let payload =
        row.payload.map_err(|cause| (row.id, format!("the payload cannot be read as JSON by the relay: {cause}")))?;
    let Some(age) = row.age else {
        return Err((
            row.id,
            format!(
                "created_at {} is outside the years 1970 to 9999, which an event cannot carry",
                crate::timestamp::rfc3339_micros(row.created_at)
            ),
        ));
    };
    let event = Event {
        id: row.id,
        topic: row.topic,
        key: row.key,
        payload,
        created_at: row.created_at,
        attempts: row.attempts,
    };
    Ok((event, age))
}
