//! Prometheus metrics (feature `prometheus`): the queue as the database holds it, the health
//! signals, and a relay's own counters, in the OpenMetrics text format, for any HTTP server to
//! serve.
//!
//! ```no_run
//! # #[cfg(feature = "prometheus")]
//! # async fn f(outbox: pg_outbox_relay::Outbox, relay_metrics: std::sync::Arc<pg_outbox_relay::RelayMetrics>) {
//! use std::sync::Arc;
//! use axum::{Router, extract::State, http::header, response::IntoResponse, routing::get};
//! use pg_outbox_relay::prometheus::{CONTENT_TYPE, Exporter};
//!
//! let exporter = Arc::new(Exporter::new(&outbox).with_relay(relay_metrics));
//! let app: Router = Router::new()
//!     .route("/metrics", get(|State(e): State<Arc<Exporter>>| async move {
//!         ([(header::CONTENT_TYPE, CONTENT_TYPE)], e.encode().await)
//!     }))
//!     .with_state(exporter);
//! # }
//! ```
//!
//! Every family, its type and meaning, is listed in docs/operations.md ("Metrics").
//! The relay's families, and the per-destination gauges of the queue, carry one label,
//! `destination`; no other family has labels: nothing in them grows with topics, keys or events.

use std::sync::Arc;

use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::{Registry, Unit};

use crate::outbox::Outbox;
use crate::queue::{DestinationStats, Health, QueueStats};
use crate::relay::{HistogramSnapshot, MetricsSnapshot, RelayMetrics};

/// The `Content-Type` of [`Exporter::encode`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Reads the metrics of an outbox and, when given, of the relay running on it.
#[derive(Debug, Clone)]
pub struct Exporter {
    outbox: Outbox,
    relays: Vec<(String, Arc<RelayMetrics>)>,
    counters: Vec<(String, String, u64)>,
}

impl Exporter {
    /// The metrics of the queue in `outbox`'s database.
    pub fn new(outbox: &Outbox) -> Self {
        Exporter { outbox: outbox.clone(), relays: Vec::new(), counters: Vec::new() }
    }

    /// Adds the counters of a relay with one destination ([`crate::Relay::metrics`]), labelled
    /// `destination="default"`.
    #[must_use]
    pub fn with_relay(self, metrics: Arc<RelayMetrics>) -> Self {
        self.with_destinations(vec![(crate::DEFAULT_DESTINATION.to_string(), metrics)])
    }

    /// Adds the counters of a relay's destinations ([`crate::Relay::destination_metrics`]), each
    /// labelled with its name.
    #[must_use]
    pub fn with_destinations(mut self, destinations: Vec<(String, Arc<RelayMetrics>)>) -> Self {
        self.relays = destinations;
        self
    }

    /// Adds a counter of the program's own, `name` without its `_total` (which the text adds),
    /// with its value now (the command's `outbox_relay_spans_dropped_total`, say).
    #[must_use]
    pub fn with_counter(mut self, name: &str, help: &str, value: u64) -> Self {
        self.counters.push((name.to_string(), help.to_string(), value));
        self
    }

    /// The metrics now, as OpenMetrics text. The queue's gauges come from the database (one
    /// statement that counts the outbox, one that reads the health signals); when it does not
    /// answer, `outbox_relay_database_up` is 0, those gauges are left out and the relay's
    /// counters are still there: a scrape never fails for an outage.
    pub async fn encode(&self) -> String {
        let read = async {
            let stats = self.outbox.queue_stats().await?;
            let health = self.outbox.health().await?;
            let pauses = self.outbox.pauses().await?;
            let destinations = self.outbox.destinations().await?;
            Ok::<_, crate::Error>((stats, health, pauses.len(), destinations))
        };
        let database = match tokio::time::timeout(std::time::Duration::from_secs(5), read).await {
            Ok(Ok(read)) => Some(read),
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "metrics: the database did not answer");
                None
            }
            Err(_) => None,
        };
        let relays: Vec<(String, MetricsSnapshot)> =
            self.relays.iter().map(|(name, m)| (name.clone(), m.snapshot())).collect();
        let mut registry = Registry::default();
        register(&mut registry, database.as_ref(), &relays);
        for (name, help, value) in &self.counters {
            registry.register(name, help, ConstCounter::new(*value));
        }
        let mut text = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &registry);
        text
    }
}

fn gauge(registry: &mut Registry, name: &str, help: &str, value: f64) {
    registry.register(name, help, ConstGauge::new(value));
}

fn gauge_in(registry: &mut Registry, name: &str, help: &str, unit: Unit, value: f64) {
    registry.register_with_unit(name, help, unit, ConstGauge::new(value));
}

/// What the database said in one scrape.
type Read = (QueueStats, Health, usize, Vec<DestinationStats>);

/// One family whose series are the destinations', labelled with their names.
#[derive(Debug)]
struct PerDestination<M> {
    series: Vec<(String, M)>,
    kind: MetricType,
}

impl<M: EncodeMetric> EncodeMetric for PerDestination<M> {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        for (name, metric) in &self.series {
            let labels = [("destination", name.as_str())];
            metric.encode(encoder.encode_family(&labels)?)?;
        }
        Ok(())
    }

    fn metric_type(&self) -> MetricType {
        self.kind
    }
}

fn gauges<T>(registry: &mut Registry, name: &str, help: &str, of: &[(String, T)], value: impl Fn(&T) -> f64) {
    let series = of.iter().map(|(d, t)| (d.clone(), ConstGauge::new(value(t)))).collect();
    registry.register(name, help, PerDestination { series, kind: MetricType::Gauge });
}

fn counters<T>(registry: &mut Registry, name: &str, help: &str, of: &[(String, T)], value: impl Fn(&T) -> u64) {
    let series = of.iter().map(|(d, t)| (d.clone(), ConstCounter::new(value(t)))).collect();
    registry.register(name, help, PerDestination { series, kind: MetricType::Counter });
}

fn histograms(
    registry: &mut Registry,
    name: &str,
    help: &str,
    of: &[(String, MetricsSnapshot)],
    value: impl Fn(&MetricsSnapshot) -> &HistogramSnapshot,
) {
    let series = of.iter().map(|(d, s)| (d.clone(), Histogram(value(s).clone()))).collect();
    registry.register_with_unit(name, help, Unit::Seconds, PerDestination { series, kind: MetricType::Histogram });
}

fn register(registry: &mut Registry, database: Option<&Read>, relay: &[(String, MetricsSnapshot)]) {
    gauge(
        registry,
        "outbox_relay_database_up",
        "1 when the database answered this scrape, else 0",
        f64::from(u8::from(database.is_some())),
    );
    if let Some((stats, health, pauses, destinations)) = database {
        register_database(registry, stats, health, *pauses);
        register_destinations(registry, destinations);
    }
    if !relay.is_empty() {
        register_relay(registry, relay);
    }
}

/// The outbox's figures and the server's health, as the database answered this scrape.
fn register_database(registry: &mut Registry, stats: &QueueStats, health: &Health, pauses: usize) {
    let seconds = |age: Option<std::time::Duration>| age.map_or(0.0, |age| age.as_secs_f64());
    gauge(
        registry,
        "outbox_relay_pending_events",
        "Events not yet delivered: ready, held by their key, delayed (a delay or a retry backoff) and in flight",
        (stats.pending + stats.held_by_key + stats.delayed + stats.in_flight) as f64,
    );
    gauge(
        registry,
        "outbox_relay_ready_events",
        "Pending events deliverable now: due, without a key or at the head of theirs",
        stats.pending as f64,
    );
    gauge(
        registry,
        "outbox_relay_held_by_key_events",
        "Due events waiting behind their key's head (in flight, delayed or in a retry's backoff)",
        stats.held_by_key as f64,
    );
    gauge(registry, "outbox_relay_delayed_events", "Pending events waiting for their time", stats.delayed as f64);
    gauge(registry, "outbox_relay_in_flight_events", "Events claimed under a lease", stats.in_flight as f64);
    gauge_in(
        registry,
        "outbox_relay_oldest_pending_age",
        "Age of the oldest undelivered event (0 when there is none)",
        Unit::Seconds,
        seconds(stats.oldest_pending_age),
    );
    gauge_in(
        registry,
        "outbox_relay_oldest_ready_age",
        "How long the longest-waiting deliverable event has been due: the relay's lag",
        Unit::Seconds,
        seconds(stats.oldest_ready_age),
    );
    gauge(registry, "outbox_relay_dead_letters", "Events in the dead letters", stats.dead_letters as f64);
    gauge(
        registry,
        "outbox_relay_notification_queue_usage_ratio",
        "Share of PostgreSQL's notification queue in use (NOTIFY fails at 1)",
        health.notification_queue_usage,
    );
    gauge_in(
        registry,
        "outbox_relay_oldest_transaction_age",
        "Age of the oldest open transaction on the server (holds vacuum back)",
        Unit::Seconds,
        seconds(health.oldest_transaction_age),
    );
    gauge(
        registry,
        "outbox_relay_xmin_horizon_age_transactions",
        "Age in transactions of the oldest snapshot held (sessions, replication slots, prepared transactions)",
        health.xmin_horizon_age.unwrap_or(0) as f64,
    );
    gauge(
        registry,
        "outbox_relay_outbox_dead_tuples",
        "Dead tuples in the outbox table, by PostgreSQL's statistics",
        health.outbox_dead_tuples as f64,
    );
    gauge(registry, "outbox_relay_pauses", "Pauses in place (the pause of every topic counts one)", pauses as f64);
    gauge(
        registry,
        "outbox_relay_unrouted_dead_letters",
        "Dead letters that no destination's pattern matched",
        stats.unrouted as f64,
    );
}

/// Each destination's figures, labelled with its name.
fn register_destinations(registry: &mut Registry, destinations: &[DestinationStats]) {
    let by_name: Vec<(String, &DestinationStats)> = destinations.iter().map(|d| (d.name.clone(), d)).collect();
    gauges(
        registry,
        "outbox_relay_destination_new_events",
        "Events a destination's pattern matches that its position has not reached",
        &by_name,
        |d| d.new as f64,
    );
    gauges(
        registry,
        "outbox_relay_destination_parked_events",
        "A destination's parked events: retries, delays, events behind their key, leases",
        &by_name,
        |d| (d.due + d.delayed + d.in_flight) as f64,
    );
    gauges(registry, "outbox_relay_destination_dead_letters", "A destination's dead letters", &by_name, |d| {
        d.dead_letters as f64
    });
    gauges(
        registry,
        "outbox_relay_destination_relays",
        "Relays connected now that deliver to a destination",
        &by_name,
        |d| d.relays as f64,
    );
    gauges(
        registry,
        "outbox_relay_destination_unserved_seconds",
        "How long no relay has served a registered destination (0 while one does)",
        &by_name,
        |d| d.unserved.map_or(0.0, |u| u.as_secs_f64()),
    );
    let expiring: Vec<(String, &DestinationStats)> =
        by_name.iter().filter(|(_, d)| d.expires_in.is_some()).map(|(name, d)| (name.clone(), *d)).collect();
    gauges(
        registry,
        "outbox_relay_destination_expires_in_seconds",
        "How long until a destination no relay serves expires (its waiting events then go to its dead letters)",
        &expiring,
        |d| d.expires_in.map_or(0.0, |e| e.as_secs_f64()),
    );
}

/// The figures of this process's relay, per destination.
fn register_relay(registry: &mut Registry, relay: &[(String, MetricsSnapshot)]) {
    counters(registry, "outbox_relay_events_delivered", "Events delivered (the handler succeeded)", relay, |r| {
        r.delivered
    });
    counters(registry, "outbox_relay_events_retried", "Failed deliveries rescheduled for a retry", relay, |r| {
        r.retried
    });
    counters(registry, "outbox_relay_events_dead_lettered", "Events moved to the dead letters", relay, |r| {
        r.dead_lettered
    });
    histograms(
        registry,
        "outbox_relay_delivery_latency",
        "From an event's commit (its created_at) to its successful delivery",
        relay,
        |r| &r.latency_seconds,
    );
    counters(registry, "outbox_relay_claims", "Claim statements run", relay, |r| r.claims);
    counters(
        registry,
        "outbox_relay_failed_claims",
        "Claims that failed; their events stay where they are and are claimed again",
        relay,
        |r| r.failed_claims,
    );
    counters(registry, "outbox_relay_events_claimed", "Events claimed", relay, |r| r.claimed_events);
    histograms(registry, "outbox_relay_claim_duration", "How long a claim statement took", relay, |r| &r.claim_seconds);
    counters(
        registry,
        "outbox_relay_fast_path_deliveries",
        "Events delivered from their notification, before any claim",
        relay,
        |r| r.fast_delivered,
    );
    counters(
        registry,
        "outbox_relay_batches_read_ahead",
        "Batches of new events claimed in the transaction of the batch before them, while it was delivered",
        relay,
        |r| r.read_ahead,
    );
    counters(registry, "outbox_relay_wakeups", "Wake-ups from NOTIFY or from commits in this process", relay, |r| {
        r.wakeups
    });
    counters(
        registry,
        "outbox_relay_listener_reconnects",
        "Times the listener connection was re-established",
        relay,
        |r| r.reconnects,
    );
    counters(
        registry,
        "outbox_relay_positions_rebased",
        "Times the claim positions were found taken in another cluster (a restored dump) and started afresh",
        relay,
        |r| r.positions_rebased,
    );
    gauges(
        registry,
        "outbox_relay_breaker_open",
        "1 while the outage breaker is open (the destination is taken to be down)",
        relay,
        |r| f64::from(u8::from(r.breaker_open)),
    );
    counters(registry, "outbox_relay_breaker_opens", "Times the outage breaker opened", relay, |r| r.breaker_opens);
    gauges(
        registry,
        "outbox_relay_delivery_limit",
        "Deliveries allowed at once: the concurrency limit learnt from the destination's answers, or the fixed one",
        relay,
        |r| r.delivery_limit as f64,
    );
    gauges(registry, "outbox_relay_deliveries_in_flight", "Deliveries in progress", relay, |r| {
        r.deliveries_in_flight as f64
    });
    gauges(registry, "outbox_relay_listening", "1 while the listener listens for notifications", relay, |r| {
        f64::from(u8::from(r.listening))
    });
    gauges(
        registry,
        "outbox_relay_paused",
        "1 while every topic is paused for the destination, as the relay last read the pauses",
        relay,
        |r| f64::from(u8::from(r.paused_all)),
    );
    gauges(registry, "outbox_relay_paused_topics", "Single topics paused, as the relay last read them", relay, |r| {
        r.paused_topics as f64
    });
}

/// A histogram as read, in the exposition.
#[derive(Debug)]
struct Histogram(HistogramSnapshot);

impl EncodeMetric for Histogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        encoder.encode_histogram::<NoLabelSet>(self.0.sum_seconds, self.0.count, &self.0.buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}
