//! What the relay tells an operator while it runs: failed deliveries at `warn`, rate-limited, and
//! a summary of what it delivered.
//!
//! A sink that fails fails for every event, so logging each failure would bury the log (and an
//! operator) in identical lines. The first failure of a quiet spell is logged at once, with the
//! event, the error and when it will be retried; the ones that follow within [`WARN_EVERY`] are
//! counted, and when the window closes one line says how many there were and shows the last.
//! Every [`SUMMARY_EVERY`] in which something happened, one `info` line gives the counts.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::failure::DeliveryError;
use super::metrics::{MetricsSnapshot, RelayMetrics};
use crate::event::Event;

/// At most one `warn` line about failed deliveries per this interval.
pub(crate) const WARN_EVERY: Duration = Duration::from_secs(10);
/// How often the window is looked at.
const TICK: Duration = Duration::from_secs(1);
/// The interval of the `info` summary.
pub(crate) const SUMMARY_EVERY: Duration = Duration::from_secs(60);

/// Failed deliveries since the last `warn` line.
#[derive(Debug, Default)]
pub(crate) struct Reporter {
    state: Mutex<Window>,
}

#[derive(Debug, Default)]
struct Window {
    /// When the last `warn` line was written.
    warned_at: Option<Instant>,
    /// Failures not logged since then, and the last of them.
    suppressed: u64,
    last: Option<Failure>,
}

#[derive(Debug, Clone)]
struct Failure {
    id: i64,
    topic: String,
    attempt: i32,
    error: String,
    retry_in: Duration,
}

impl Reporter {
    /// A transient delivery failure of `event`, retried after `retry_in`.
    pub(crate) fn failed(&self, event: &Event, error: &DeliveryError, retry_in: Duration) {
        let failure = Failure {
            id: event.id,
            topic: event.topic.clone(),
            attempt: event.attempts,
            error: error.message().to_string(),
            retry_in,
        };
        let mut window = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if window.warned_at.is_some_and(|at| at.elapsed() < WARN_EVERY) {
            window.suppressed += 1;
            window.last = Some(failure);
            return;
        }
        window.warned_at = Some(Instant::now());
        drop(window);
        warn(&failure, 0);
    }

    /// Writes the line for counted failures at once (at shutdown).
    fn close_window_now(&self) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).warned_at = None;
        self.close_window();
    }

    /// Writes the line for the failures counted since the last one, if any.
    fn close_window(&self) {
        let mut window = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if window.suppressed == 0 || window.warned_at.is_some_and(|at| at.elapsed() < WARN_EVERY) {
            return;
        }
        let suppressed = std::mem::take(&mut window.suppressed);
        let last = window.last.take();
        window.warned_at = Some(Instant::now());
        drop(window);
        if let Some(last) = last {
            warn(&last, suppressed);
        }
    }
}

fn warn(failure: &Failure, more: u64) {
    let retry_in = humantime::format_duration(round_ms(failure.retry_in)).to_string();
    let message =
        if more > 1 { "deliveries are failing; this is the latest" } else { "delivery failed; it will be retried" };
    tracing::warn!(
        event = failure.id,
        topic = %crate::text::printable(&failure.topic),
        attempt = failure.attempt,
        error = %failure.error,
        retry_in = %retry_in,
        failures_since_last_warning = more,
        "{message}"
    );
}

fn round_ms(d: Duration) -> Duration {
    Duration::from_millis(u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The task that closes the failure window every [`WARN_EVERY`] and logs a summary every
/// [`SUMMARY_EVERY`] in which something happened.
pub(crate) struct Reports {
    pub(crate) reporter: Arc<Reporter>,
    pub(crate) metrics: Arc<RelayMetrics>,
}

impl Reports {
    /// Runs until `stop`.
    pub(crate) async fn run(self, stop: CancellationToken) {
        let Reports { reporter, metrics } = self;
        let mut last = metrics.snapshot();
        let mut summary_due = Instant::now() + SUMMARY_EVERY;
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(TICK) => {}
            }
            reporter.close_window();
            if Instant::now() >= summary_due {
                summary_due = Instant::now() + SUMMARY_EVERY;
                let now = metrics.snapshot();
                if now.delivered + now.retried + now.dead_lettered > last.delivered + last.retried + last.dead_lettered
                {
                    summary(&now, &last, "in the last minute");
                }
                last = now;
            }
        }
        reporter.close_window_now();
    }
}

/// One `info` line with what happened between `before` and `now`.
pub(crate) fn summary(now: &MetricsSnapshot, before: &MetricsSnapshot, period: &str) {
    tracing::info!(
        delivered = now.delivered - before.delivered,
        retried = now.retried - before.retried,
        dead_lettered = now.dead_lettered - before.dead_lettered,
        "relay activity {period}"
    );
}
