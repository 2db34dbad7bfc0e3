//! Counters a service can read while its relay runs.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// How many recent latencies are kept for percentiles.
const LATENCY_WINDOW: usize = 4096;

/// Percentiles of a set of durations (nearest-rank: the smallest sample with at least p % of the
/// samples at or below it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Percentiles {
    /// The median.
    pub p50: Duration,
    /// The 90th percentile.
    pub p90: Duration,
    /// The 99th percentile.
    pub p99: Duration,
    /// The largest sample.
    pub max: Duration,
}

impl Percentiles {
    /// Sorts `samples` and reads the percentiles; `None` when there are none.
    pub fn from_samples(samples: &mut [Duration]) -> Option<Percentiles> {
        samples.sort_unstable();
        let last = *samples.last()?;
        let rank = |p: usize| samples[(samples.len() * p).div_ceil(100).max(1) - 1];
        Some(Percentiles { p50: rank(50), p90: rank(90), p99: rank(99), max: last })
    }
}

/// Live counters of one relay; read them through [`crate::Relay::metrics`].
#[derive(Debug, Default)]
pub struct RelayMetrics {
    delivered: AtomicU64,
    retried: AtomicU64,
    dead_lettered: AtomicU64,
    claims: AtomicU64,
    wakeups: AtomicU64,
    reconnects: AtomicU64,
    breaker_open: AtomicBool,
    breaker_opens: AtomicU64,
    latencies_us: Mutex<VecDeque<u64>>,
}

/// A snapshot of [`RelayMetrics`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MetricsSnapshot {
    /// Events delivered (handler returned `Ok`) since the relay started.
    pub delivered: u64,
    /// Failed deliveries rescheduled for a retry.
    pub retried: u64,
    /// Events moved to the dead letters.
    pub dead_lettered: u64,
    /// Claim statements run.
    pub claims: u64,
    /// Wake-ups received from NOTIFY or from writers in this process.
    pub wakeups: u64,
    /// Times the listener connection was re-established.
    pub reconnects: u64,
    /// True while the outage breaker is open (the destination is taken to be down).
    pub breaker_open: bool,
    /// Times the outage breaker opened.
    pub breaker_opens: u64,
    /// Latency from an event's insert to its successful delivery, over recent events: p50.
    pub latency_p50: Option<Duration>,
    /// The same, p99.
    pub latency_p99: Option<Duration>,
}

impl RelayMetrics {
    pub(crate) fn delivered(&self, latencies: impl Iterator<Item = Duration>) {
        let mut window = self.latencies_us.lock().unwrap_or_else(|e| e.into_inner());
        let mut n = 0;
        for latency in latencies {
            n += 1;
            if window.len() == LATENCY_WINDOW {
                window.pop_front();
            }
            window.push_back(u64::try_from(latency.as_micros()).unwrap_or(u64::MAX));
        }
        self.delivered.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn retried(&self, n: usize) {
        self.retried.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub(crate) fn dead_lettered(&self, n: usize) {
        self.dead_lettered.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub(crate) fn claimed(&self) {
        self.claims.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn woken(&self) {
        self.wakeups.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn reconnected(&self) {
        self.reconnects.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn breaker(&self, open: bool) {
        if open && !self.breaker_open.swap(true, Ordering::Relaxed) {
            self.breaker_opens.fetch_add(1, Ordering::Relaxed);
        }
        if !open {
            self.breaker_open.store(false, Ordering::Relaxed);
        }
    }

    /// Reads every counter and the latency percentiles.
    pub fn snapshot(&self) -> MetricsSnapshot {
        let mut latencies: Vec<Duration> = self
            .latencies_us
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|us| Duration::from_micros(*us))
            .collect();
        let percentiles = Percentiles::from_samples(&mut latencies);
        MetricsSnapshot {
            delivered: self.delivered.load(Ordering::Relaxed),
            retried: self.retried.load(Ordering::Relaxed),
            dead_lettered: self.dead_lettered.load(Ordering::Relaxed),
            claims: self.claims.load(Ordering::Relaxed),
            wakeups: self.wakeups.load(Ordering::Relaxed),
            reconnects: self.reconnects.load(Ordering::Relaxed),
            breaker_open: self.breaker_open.load(Ordering::Relaxed),
            breaker_opens: self.breaker_opens.load(Ordering::Relaxed),
            latency_p50: percentiles.map(|p| p.p50),
            latency_p99: percentiles.map(|p| p.p99),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn percentiles_use_the_nearest_rank() {
        let mut samples: Vec<Duration> = (1..=100).rev().map(ms).collect();
        let p = Percentiles::from_samples(&mut samples).unwrap();
        assert_eq!(p, Percentiles { p50: ms(50), p90: ms(90), p99: ms(99), max: ms(100) });

        let mut one = vec![ms(7)];
        let p = Percentiles::from_samples(&mut one).unwrap();
        assert_eq!((p.p50, p.p99, p.max), (ms(7), ms(7), ms(7)));

        let mut ten: Vec<Duration> = (1..=10).map(ms).collect();
        let p = Percentiles::from_samples(&mut ten).unwrap();
        assert_eq!((p.p50, p.p90, p.p99), (ms(5), ms(9), ms(10)));

        assert_eq!(Percentiles::from_samples(&mut []), None);
    }

    #[test]
    fn the_snapshot_reads_percentiles_of_recent_latencies() {
        let metrics = RelayMetrics::default();
        assert_eq!(metrics.snapshot().latency_p50, None);
        metrics.delivered((1..=100).map(ms));
        let s = metrics.snapshot();
        assert_eq!((s.delivered, s.latency_p50, s.latency_p99), (100, Some(ms(50)), Some(ms(99))));
    }
}
