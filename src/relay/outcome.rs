//! What became of each event of a batch: the handler's results judged, with the outage
//! breaker's verdict, as delivered, tried again later, buried in the dead letters, or given
//! back untried.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::backoff::retry_delay;
use super::breaker::{Breaker, Change, Seen, Verdict};
use super::config::RelayConfig;
use super::failure::DeliveryError;
use super::metrics::RelayMetrics;
use super::report::Reporter;
use super::row::RelayRow;
use crate::event::Event;

/// What became of one claimed event.
#[derive(Clone)]
pub(crate) enum Outcome {
    Delivered,
    /// A transient failure, tried again after `delay`; `counted: false` gives the attempt back
    /// (an outage's failure is the destination's, not the event's).
    Retry {
        delay: Duration,
        error: String,
        counted: bool,
    },
    /// To the dead letters.
    Bury {
        error: String,
    },
    /// Given back untried (shutdown, an open breaker), the attempt not counted.
    Released,
}

/// What became of each claimed event: per event its id, the number of the attempt this claim
/// made, and the outcome.
#[derive(Default)]
pub(crate) struct Outcomes {
    pub(crate) events: Vec<(i64, i32, Outcome)>,
    /// Claim-to-delivery latencies of the delivered events.
    pub(crate) latencies: Vec<Duration>,
    /// Why the events were released, when it is news (`None`: shutdown).
    pub(crate) released_why: Option<String>,
}

/// The backoff before `event`'s next attempt after `e` (or the destination's `Retry-After`,
/// within `backoff_max`).
fn backoff(config: &RelayConfig, event: &Event, e: &DeliveryError) -> Duration {
    let attempt = u32::try_from(event.attempts).unwrap_or(1);
    let backoff = retry_delay(attempt, config.backoff_base, config.backoff_max, config.backoff_jitter, rand::random());
    e.requested_delay().map_or(backoff, |asked| backoff.max(asked.min(config.backoff_max)))
}

impl Outcomes {
    /// Records a transient failure: a retry after backoff (or after the destination's
    /// `Retry-After`, within `backoff_max`), or the dead letters after the last allowed attempt.
    /// Returns the retry delay, if any.
    fn retry(&mut self, config: &RelayConfig, event: &Event, e: &DeliveryError) -> Option<Duration> {
        if event.attempts >= i32::try_from(config.max_attempts).unwrap_or(i32::MAX) {
            self.bury(event, format!("gave up after {} attempts: {}", event.attempts, e.message()));
            return None;
        }
        let delay = backoff(config, event, e);
        self.push(event, Outcome::Retry { delay, error: e.message().to_string(), counted: true });
        Some(delay)
    }

    /// Records a failure in which the request never reached the destination: a retry after
    /// backoff (at least `breaker_probe_min`), the attempt given back. Returns the retry delay.
    fn unreached(&mut self, config: &RelayConfig, event: &Event, e: &DeliveryError) -> Duration {
        let delay = backoff(config, event, e).max(config.breaker_probe_min);
        let error = format!("the destination could not be reached; the attempt was not counted: {}", e.message());
        self.push(event, Outcome::Retry { delay, error, counted: false });
        delay
    }

    pub(crate) fn push(&mut self, event: &Event, outcome: Outcome) {
        self.events.push((event.id, event.attempts, outcome));
    }

    fn bury(&mut self, event: &Event, error: String) {
        self.push(event, Outcome::Bury { error });
    }

    pub(crate) fn release_all(&mut self, events: &[Event]) {
        self.release_all_but(events, &[]);
    }

    /// Gives `events` back but for those `delivered` already.
    pub(crate) fn release_all_but(&mut self, events: &[Event], delivered: &[i64]) {
        let delivered: std::collections::HashSet<i64> = delivered.iter().copied().collect();
        self.events.extend(events.iter().map(|e| {
            let outcome = if delivered.contains(&e.id) { Outcome::Delivered } else { Outcome::Released };
            (e.id, e.attempts, outcome)
        }));
    }

    pub(crate) fn count(&self, wanted: impl Fn(&Outcome) -> bool) -> usize {
        self.events.iter().filter(|(_, _, outcome)| wanted(outcome)).count()
    }
}

/// Judges a batch's results: asks the breaker whether the destination is down, announces a
/// change of its state, and schedules the retries.
pub(crate) struct Judge {
    /// The retry policy: `max_attempts` and the backoff.
    pub(crate) config: RelayConfig,
    pub(crate) breaker: Arc<Breaker>,
    /// Told of every failed delivery, for the rate-limited warnings.
    pub(crate) reporter: Arc<Reporter>,
    pub(crate) metrics: Arc<RelayMetrics>,
    /// Where the breaker's state is published: the relay's row.
    pub(crate) row: Arc<RelayRow>,
}

impl Judge {
    /// Turns a batch's results into outcomes (`None`: left untried behind a failure of its key).
    pub(crate) async fn judge(
        &self,
        events: &[Event],
        ages: &[Duration],
        claimed_at: Instant,
        results: Vec<Option<Result<(), DeliveryError>>>,
        probe: bool,
        outcomes: &mut Outcomes,
    ) {
        let verdict = self.verdict(events, &results, probe).await;
        for ((event, age), result) in events.iter().zip(ages).zip(results) {
            let Some(result) = result else {
                // Behind an event of its key that was not delivered: it waits for it, untried.
                outcomes.push(event, Outcome::Released);
                continue;
            };
            match result {
                Ok(()) => {
                    outcomes.push(event, Outcome::Delivered);
                    outcomes.latencies.push(*age + claimed_at.elapsed());
                }
                Err(e) if e.is_permanent() => outcomes.bury(event, e.message().to_string()),
                Err(e) if verdict == Verdict::Open => {
                    let why = format!(
                        "the destination is down (outage breaker open); the attempt was not counted: {}",
                        e.message()
                    );
                    if probe {
                        // The next probe tries another event.
                        let delay = self.breaker.probe_delay();
                        outcomes.push(event, Outcome::Retry { delay, error: why, counted: false });
                    } else {
                        outcomes.push(event, Outcome::Released);
                        outcomes.released_why.get_or_insert(why);
                    }
                }
                Err(e) if e.is_unreached() => {
                    let delay = outcomes.unreached(&self.config, event, &e);
                    self.reporter.failed(event, &e, delay);
                }
                Err(e) => {
                    // The last allowed attempt goes to the dead letters, logged on their own.
                    if let Some(delay) = outcomes.retry(&self.config, event, &e) {
                        self.reporter.failed(event, &e, delay);
                    }
                }
            }
        }
    }

    /// The breaker's verdict on the batch's results, a change of its state announced.
    async fn verdict(&self, events: &[Event], results: &[Option<Result<(), DeliveryError>>], probe: bool) -> Verdict {
        let seen: Vec<Seen> = events
            .iter()
            .zip(results)
            .filter_map(|(event, result)| match result.as_ref()? {
                Err(e) if e.is_unreached() => Some(Seen::Unreached(event.id)),
                Err(e) if e.may_be_an_outage() => Some(Seen::Failed(event.id)),
                _ => Some(Seen::Answered),
            })
            .collect();
        let errors = || results.iter().flatten().filter_map(|r| r.as_ref().err());
        let retry_after = errors().filter_map(DeliveryError::requested_delay).max();
        // Every transient failure a refused connection: nobody listens there now.
        let refused = {
            let mut transient = errors().filter(|e| !e.is_permanent()).peekable();
            transient.peek().is_some() && transient.all(DeliveryError::is_refused)
        };
        let (verdict, change) = self.breaker.observe(&seen, retry_after, refused, probe);
        if let Some(change) = change {
            self.announce(change, errors().find(|e| !e.is_permanent())).await;
        }
        verdict
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
        if let Err(e) = self.row.publish_breaker(open).await {
            tracing::debug!(error = %e, "could not publish the breaker's state");
        }
    }
}
