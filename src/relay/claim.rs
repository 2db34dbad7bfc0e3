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
use super::breaker::{Breaker, Change, Seen, Verdict};
use super::config::{Completion, RelayConfig};
use super::handler::{DeliveryError, Handler, Slots, panicked};
use super::idle::Idle;
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
    /// The bound on deliveries in progress, shared by every batch.
    pub(crate) slots: Slots,
    /// Whether the destination is down.
    pub(crate) breaker: Arc<Breaker>,
    /// Where the breaker's state is published (the relay's row).
    pub(crate) idle: Arc<Idle>,
}

/// A claimed batch, waiting to be delivered.
pub(crate) struct Batch {
    token: i64,
    claimed_at: Instant,
    /// Rows claimed, the unreadable ones included.
    pub(crate) count: usize,
    events: Vec<Event>,
    ages: Vec<Duration>,
    /// What is already decided: rows no handler can be given.
    outcomes: Outcomes,
    probe: bool,
}

/// What a claim is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Claim {
    /// Deliver a batch; when it comes back empty and `schedule_next` is set, set the timer to
    /// the earliest future event.
    Batch { schedule_next: bool },
    /// The open breaker's probe: one event.
    Probe,
}

/// What became of each claimed event.
#[derive(Default)]
struct Outcomes {
    delivered: Vec<i64>,
    latencies: Vec<Duration>,
    retry_ids: Vec<i64>,
    retry_delays: Vec<Duration>,
    retry_errors: Vec<String>,
    /// Retries whose attempt is given back: an outage's failures.
    uncounted_ids: Vec<i64>,
    uncounted_delays: Vec<Duration>,
    uncounted_errors: Vec<String>,
    bury_ids: Vec<i64>,
    bury_errors: Vec<String>,
    released: Vec<i64>,
    /// Why the events were released, when it is news (`None`: shutdown).
    released_why: Option<String>,
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

    fn retry_uncounted(&mut self, id: i64, delay: Duration, error: String) {
        self.uncounted_ids.push(id);
        self.uncounted_delays.push(delay);
        self.uncounted_errors.push(error);
    }
}

impl<H: Handler> Claimer<H> {
    /// Claims one batch and delivers it; returns how many events were claimed. While the
    /// breaker is open only a probe claims.
    pub(crate) async fn claim_and_deliver(&self, claim: Claim) -> Result<usize> {
        match self.claim(claim).await? {
            None => Ok(0),
            Some(batch) => {
                let count = batch.count;
                self.deliver_and_record(batch).await;
                Ok(count)
            }
        }
    }

    /// Claims one batch (`None`: nothing to claim, or the breaker is open and this is no probe).
    /// Rows no handler can be given are already set aside for the dead letters.
    pub(crate) async fn claim(&self, claim: Claim) -> Result<Option<Batch>> {
        let probe = claim == Claim::Probe;
        if !probe && self.breaker.is_open() {
            return Ok(None);
        }
        let config = &self.config;
        let token = rand::random::<i64>();
        let size = if probe { 1 } else { i64::try_from(config.batch_size).unwrap_or(i64::MAX) };
        let client = self.pool.client().await?;
        let claimed = sql::claim_events(&*client, size, config.lease, token, config.dead_letter_holds_key).await?;
        let claimed_at = Instant::now();
        self.metrics.claimed();
        if claimed.is_empty() {
            if probe {
                self.breaker.probe_found_nothing();
            }
            if claim == (Claim::Batch { schedule_next: true }) {
                // Woken for nothing deliverable yet: maybe a delayed event or a retry, written by
                // any process. Sleep until the earliest one rather than up to a poll interval past it.
                if let Some(due) = sql::next_due(&*client).await? {
                    self.timer.schedule(Instant::now() + due);
                }
            }
            return Ok(None);
        }
        drop(client);
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
        tracing::debug!(count, probe, "claimed events");
        let (events, ages) = events.into_iter().unzip();
        Ok(Some(Batch { token, claimed_at, count, events, ages, outcomes, probe }))
    }

    /// Delivers a claimed batch and records what became of it.
    pub(crate) async fn deliver_and_record(&self, batch: Batch) {
        let Batch { token, claimed_at, events, ages, mut outcomes, probe, .. } = batch;
        if !events.is_empty() {
            if !probe && self.breaker.is_open() {
                // Claimed while the breaker was opening: the outage covers it, nothing is tried.
                outcomes.released.extend(events.iter().map(|e| e.id));
            } else {
                match self.deliver(&events, claimed_at).await {
                    // Cut off at shutdown: the events go back, the attempt not counted.
                    None => outcomes.released.extend(events.iter().map(|e| e.id)),
                    Some(results) => self.judge(&events, &ages, claimed_at, results, probe, &mut outcomes).await,
                }
            }
        } else if probe {
            self.breaker.probe_found_nothing();
        }
        self.record(token, outcomes).await;
    }

    /// Hands `events` to the handler, bounded by the lease; `None` when the shutdown's abort cut
    /// it off.
    async fn deliver(&self, events: &[Event], claimed_at: Instant) -> Option<Vec<Result<(), DeliveryError>>> {
        let config = &self.config;
        // Deliveries must end well inside the lease, which runs from the claim, or another worker
        // may claim the same events.
        let deadline = claimed_at + config.lease.mul_f64(0.9);
        let delivery = AssertUnwindSafe(self.handler.handle_batch(events, &self.slots)).catch_unwind();
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
            _ = self.abort.cancelled() => return None,
        };
        if results.len() != events.len() {
            let message = format!("the handler returned {} results for {} events", results.len(), events.len());
            results.resize_with(events.len(), || Err(DeliveryError::transient(&message)));
        }
        Some(results)
    }

    /// Turns a batch's results into outcomes, asking the breaker whether the destination is down.
    async fn judge(
        &self,
        events: &[Event],
        ages: &[Duration],
        claimed_at: Instant,
        results: Vec<Result<(), DeliveryError>>,
        probe: bool,
        outcomes: &mut Outcomes,
    ) {
        let config = &self.config;
        let seen: Vec<Seen> = events
            .iter()
            .zip(&results)
            .map(|(event, result)| match result {
                Err(e) if !e.is_permanent() => Seen::Failed(event.id),
                _ => Seen::Answered,
            })
            .collect();
        let retry_after = results.iter().filter_map(|r| r.as_ref().err()?.requested_delay()).max();
        let (verdict, change) = self.breaker.observe(&seen, retry_after, probe);
        let first_failure = results.iter().find_map(|r| r.as_ref().err().filter(|e| !e.is_permanent()));
        if let Some(change) = change {
            self.announce(change, first_failure).await;
        }
        for ((event, age), result) in events.iter().zip(ages).zip(results) {
            match result {
                Ok(()) => {
                    outcomes.delivered.push(event.id);
                    outcomes.latencies.push(*age + claimed_at.elapsed());
                }
                Err(e) if e.is_permanent() => outcomes.bury(event.id, e.message().to_string()),
                Err(e) if verdict == Verdict::Open => {
                    let why = format!(
                        "the destination is down (outage breaker open); the attempt was not counted: {}",
                        e.message()
                    );
                    if probe {
                        // The next probe tries another event.
                        outcomes.retry_uncounted(event.id, self.breaker.probe_delay(), why);
                    } else {
                        outcomes.released.push(event.id);
                        outcomes.released_why.get_or_insert(why);
                    }
                }
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

    /// One warn line per change of the breaker, its state in the metrics and in the relay's row.
    async fn announce(&self, change: Change, failure: Option<&DeliveryError>) {
        let error = failure.map(|e| e.message().to_string()).unwrap_or_default();
        let open = match change {
            Change::Opened { failures, probe_in } => {
                tracing::warn!(
                    failures,
                    probe_in = %humantime::format_duration(probe_in),
                    error = %error,
                    "the destination looks down: {failures} distinct events failed in a row; the relay stops claiming, \
                     gives back what it holds without counting the attempt, and probes with one delivery at a time"
                );
                true
            }
            Change::Closed { after } => {
                let after = Duration::from_millis(u64::try_from(after.as_millis()).unwrap_or(u64::MAX));
                tracing::warn!(
                    down_for = %humantime::format_duration(after),
                    "the destination is back: a probe was delivered; the relay resumes"
                );
                false
            }
        };
        self.metrics.breaker(open);
        if let Err(e) = self.idle.publish_breaker(open).await {
            tracing::debug!(error = %e, "could not publish the breaker's state");
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
            writes.push(Box::pin(sql::reschedule_events(
                db,
                &o.retry_ids,
                &o.retry_delays,
                &o.retry_errors,
                token,
                true,
            )));
        }
        if !o.uncounted_ids.is_empty() {
            writes.push(Box::pin(sql::reschedule_events(
                db,
                &o.uncounted_ids,
                &o.uncounted_delays,
                &o.uncounted_errors,
                token,
                false,
            )));
        }
        if !o.bury_ids.is_empty() {
            writes.push(Box::pin(sql::bury_events(db, &o.bury_ids, &o.bury_errors, token)));
        }
        if !o.released.is_empty() {
            writes.push(Box::pin(sql::release_events(db, &o.released, token, o.released_why.as_deref())));
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
