//! Counters a service can read while its relay runs.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// How many recent latencies are kept for percentiles.
const LATENCY_WINDOW: usize = 4096;

/// Live counters of one relay; read them through [`crate::Relay::metrics`].
#[derive(Debug, Default)]
pub struct RelayMetrics {
    delivered: AtomicU64,
    retried: AtomicU64,
    dead_lettered: AtomicU64,
    claims: AtomicU64,
    wakeups: AtomicU64,
    reconnects: AtomicU64,
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

    /// Reads every counter and the latency percentiles.
    pub fn snapshot(&self) -> MetricsSnapshot {
        let mut latencies: Vec<u64> =
            self.latencies_us.lock().unwrap_or_else(|e| e.into_inner()).iter().copied().collect();
        latencies.sort_unstable();
        let percentile = |p: f64| {
            (!latencies.is_empty()).then(|| {
                let i = ((latencies.len() - 1) as f64 * p).round() as usize;
                Duration::from_micros(latencies[i])
            })
        };
        MetricsSnapshot {
            delivered: self.delivered.load(Ordering::Relaxed),
            retried: self.retried.load(Ordering::Relaxed),
            dead_lettered: self.dead_lettered.load(Ordering::Relaxed),
            claims: self.claims.load(Ordering::Relaxed),
            wakeups: self.wakeups.load(Ordering::Relaxed),
            reconnects: self.reconnects.load(Ordering::Relaxed),
            latency_p50: percentile(0.5),
            latency_p99: percentile(0.99),
        }
    }
}
