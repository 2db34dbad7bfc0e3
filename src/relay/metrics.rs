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
#[non_exhaustive]
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

/// Upper bounds of the delivery latency histogram's buckets, in seconds (commit to delivery:
/// from half a millisecond, where a relay at rest delivers, to the hours a backlog can take).
pub(crate) const LATENCY_BUCKETS: [f64; 18] =
    [0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 3600.0];
/// Upper bounds of the claim duration histogram's buckets, in seconds.
pub(crate) const CLAIM_BUCKETS: [f64; 12] =
    [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 2.0];

/// A histogram of durations with fixed buckets, lock-free.
#[derive(Debug)]
struct Histogram {
    bounds: &'static [f64],
    /// Per bucket (not cumulative), the last one past every bound.
    counts: Vec<AtomicU64>,
    sum_ns: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram { bounds, counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(), sum_ns: AtomicU64::new(0) }
    }

    fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let bucket = self.bounds.iter().position(|b| secs <= *b).unwrap_or(self.bounds.len());
        self.counts[bucket].fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    fn snapshot(&self) -> HistogramSnapshot {
        let buckets: Vec<(f64, u64)> = self
            .bounds
            .iter()
            .copied()
            .chain(std::iter::once(f64::INFINITY))
            .zip(&self.counts)
            .map(|(bound, n)| (bound, n.load(Ordering::Relaxed)))
            .collect();
        HistogramSnapshot {
            count: buckets.iter().map(|(_, n)| n).sum(),
            sum_seconds: self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9,
            buckets,
        }
    }
}

/// A histogram as read: per bucket (upper bound in seconds, the last infinite) its own count,
/// not cumulative.
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct HistogramSnapshot {
    /// Observations in all.
    pub count: u64,
    /// Their sum, in seconds.
    pub sum_seconds: f64,
    /// `(upper bound, observations in this bucket)`.
    pub buckets: Vec<(f64, u64)>,
}

/// Live counters of one relay; read them through [`crate::Relay::metrics`].
#[derive(Debug)]
pub struct RelayMetrics {
    running: AtomicBool,
    listening: AtomicBool,
    paused_all: AtomicBool,
    paused_topics: AtomicU64,
    claimed_events: AtomicU64,
    claim_seconds: Histogram,
    latency_seconds: Histogram,
    delivered: AtomicU64,
    retried: AtomicU64,
    dead_lettered: AtomicU64,
    claims: AtomicU64,
    failed_claims: AtomicU64,
    wakeups: AtomicU64,
    fast_delivered: AtomicU64,
    read_ahead: AtomicU64,
    fast_path_armed: AtomicBool,
    reconnects: AtomicU64,
    positions_rebased: AtomicU64,
    breaker_open: AtomicBool,
    breaker_opens: AtomicU64,
    delivery_limit: AtomicU64,
    deliveries_in_flight: AtomicU64,
    latencies_us: Mutex<VecDeque<u64>>,
}

impl Default for RelayMetrics {
    fn default() -> Self {
        RelayMetrics {
            running: AtomicBool::default(),
            listening: AtomicBool::default(),
            paused_all: AtomicBool::default(),
            paused_topics: AtomicU64::default(),
            claimed_events: AtomicU64::default(),
            claim_seconds: Histogram::new(&CLAIM_BUCKETS),
            latency_seconds: Histogram::new(&LATENCY_BUCKETS),
            delivered: AtomicU64::default(),
            retried: AtomicU64::default(),
            dead_lettered: AtomicU64::default(),
            claims: AtomicU64::default(),
            failed_claims: AtomicU64::default(),
            wakeups: AtomicU64::default(),
            fast_delivered: AtomicU64::default(),
            read_ahead: AtomicU64::default(),
            fast_path_armed: AtomicBool::default(),
            reconnects: AtomicU64::default(),
            positions_rebased: AtomicU64::default(),
            breaker_open: AtomicBool::default(),
            breaker_opens: AtomicU64::default(),
            delivery_limit: AtomicU64::default(),
            deliveries_in_flight: AtomicU64::default(),
            latencies_us: Mutex::default(),
        }
    }
}

/// A snapshot of [`RelayMetrics`].
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct MetricsSnapshot {
    /// Events delivered (handler returned `Ok`) since the relay started.
    pub delivered: u64,
    /// Failed deliveries rescheduled for a retry.
    pub retried: u64,
    /// Events moved to the dead letters.
    pub dead_lettered: u64,
    /// Claim statements run.
    pub claims: u64,
    /// Claims that failed (the database was unreachable, or refused what the claim would
    /// write): their events stay where they are, and are claimed again.
    pub failed_claims: u64,
    /// Wake-ups received from NOTIFY or from writers in this process.
    pub wakeups: u64,
    /// Events delivered from their notification, before any claim (the fast path); counted
    /// when the claim after them takes them to record.
    pub fast_delivered: u64,
    /// Batches of new events claimed ahead: in the transaction of the batch before them, while
    /// it was delivered (a backlog is drained so, one commit for several batches).
    pub read_ahead: u64,
    /// True while this relay delivers new events from their notifications (it owns the
    /// destination's fast path, hears of every commit, and its last claim armed it).
    pub fast_path_armed: bool,
    /// Times the listener connection was re-established.
    pub reconnects: u64,
    /// Times this relay found the claim positions taken in another cluster (a restored dump)
    /// and started them afresh.
    pub positions_rebased: u64,
    /// True while the outage breaker is open (the destination is taken to be down).
    pub breaker_open: bool,
    /// Times the outage breaker opened.
    pub breaker_opens: u64,
    /// Deliveries the relay allows at once now: the concurrency limit as learnt from the
    /// destination's answers (or the fixed one).
    pub delivery_limit: u64,
    /// Deliveries in progress now (slots taken).
    pub deliveries_in_flight: u64,
    /// Latency from an event's insert to its successful delivery, over recent events: p50.
    pub latency_p50: Option<Duration>,
    /// The same, p99.
    pub latency_p99: Option<Duration>,
    /// True from the start of [`crate::Relay::run`] until it returns.
    pub running: bool,
    /// True while the listener listens for notifications.
    pub listening: bool,
    /// Every topic is paused, as the relay last read the pauses.
    pub paused_all: bool,
    /// How many single topics are paused, as last read.
    pub paused_topics: u64,
    /// Events claimed (a claim of several counts each).
    pub claimed_events: u64,
    /// How long claim statements took, from the statement's start to its rows.
    pub claim_seconds: HistogramSnapshot,
    /// Commit to successful delivery (from the event's `created_at`, its transaction's clock).
    pub latency_seconds: HistogramSnapshot,
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
            self.latency_seconds.observe(latency);
        }
        self.delivered.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn retried(&self, n: usize) {
        self.retried.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub(crate) fn dead_lettered(&self, n: usize) {
        self.dead_lettered.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub(crate) fn claimed(&self, events: usize, took: Duration) {
        self.claims.fetch_add(1, Ordering::Relaxed);
        self.claimed_events.fetch_add(events as u64, Ordering::Relaxed);
        self.claim_seconds.observe(took);
    }

    pub(crate) fn claim_failed(&self) {
        self.failed_claims.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn set_running(&self, running: bool) {
        self.running.store(running, Ordering::Relaxed);
    }

    pub(crate) fn set_listening(&self, listening: bool) {
        self.listening.store(listening, Ordering::Relaxed);
    }

    pub(crate) fn set_paused(&self, all: bool, topics: usize) {
        self.paused_all.store(all, Ordering::Relaxed);
        self.paused_topics.store(topics as u64, Ordering::Relaxed);
    }

    pub(crate) fn fast_delivered(&self, n: usize) {
        self.fast_delivered.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub(crate) fn read_ahead(&self) {
        self.read_ahead.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn set_fast_path_armed(&self, armed: bool) {
        self.fast_path_armed.store(armed, Ordering::Relaxed);
    }

    pub(crate) fn woken(&self) {
        self.wakeups.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn reconnected(&self) {
        self.reconnects.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn positions_rebased(&self) {
        self.positions_rebased.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn breaker(&self, open: bool) {
        if open && !self.breaker_open.swap(true, Ordering::Relaxed) {
            self.breaker_opens.fetch_add(1, Ordering::Relaxed);
        }
        if !open {
            self.breaker_open.store(false, Ordering::Relaxed);
        }
    }

    /// The concurrency limit and the deliveries in flight, as last set.
    pub(crate) fn deliveries_now(&self) -> (u64, u64) {
        (self.delivery_limit.load(Ordering::Relaxed), self.deliveries_in_flight.load(Ordering::Relaxed))
    }

    pub(crate) fn deliveries(&self, limit: usize, in_flight: usize) {
        self.delivery_limit.store(limit as u64, Ordering::Relaxed);
        self.deliveries_in_flight.store(in_flight as u64, Ordering::Relaxed);
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
            failed_claims: self.failed_claims.load(Ordering::Relaxed),
            wakeups: self.wakeups.load(Ordering::Relaxed),
            fast_delivered: self.fast_delivered.load(Ordering::Relaxed),
            read_ahead: self.read_ahead.load(Ordering::Relaxed),
            fast_path_armed: self.fast_path_armed.load(Ordering::Relaxed),
            reconnects: self.reconnects.load(Ordering::Relaxed),
            positions_rebased: self.positions_rebased.load(Ordering::Relaxed),
            breaker_open: self.breaker_open.load(Ordering::Relaxed),
            breaker_opens: self.breaker_opens.load(Ordering::Relaxed),
            delivery_limit: self.delivery_limit.load(Ordering::Relaxed),
            deliveries_in_flight: self.deliveries_in_flight.load(Ordering::Relaxed),
            latency_p50: percentiles.map(|p| p.p50),
            latency_p99: percentiles.map(|p| p.p99),
            running: self.running.load(Ordering::Relaxed),
            listening: self.listening.load(Ordering::Relaxed),
            paused_all: self.paused_all.load(Ordering::Relaxed),
            paused_topics: self.paused_topics.load(Ordering::Relaxed),
            claimed_events: self.claimed_events.load(Ordering::Relaxed),
            claim_seconds: self.claim_seconds.snapshot(),
            latency_seconds: self.latency_seconds.snapshot(),
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

    #[test]
    fn the_histogram_puts_each_duration_in_the_first_bucket_it_fits() {
        let h = Histogram::new(&[0.001, 0.01]);
        for d in [Duration::from_micros(500), ms(1), ms(5), ms(10), ms(11), Duration::from_secs(99)] {
            h.observe(d);
        }
        let s = h.snapshot();
        assert_eq!(s.count, 6);
        assert_eq!(s.buckets, vec![(0.001, 2), (0.01, 2), (f64::INFINITY, 2)]);
        assert!((s.sum_seconds - 99.0275).abs() < 1e-9, "{}", s.sum_seconds);
    }
}
