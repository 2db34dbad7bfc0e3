//! The relay's settings, their defaults and their validation.

use std::time::Duration;

use crate::error::{Error, Result};

const DAY: Duration = Duration::from_secs(24 * 3600);

/// How the relay delivers: workers, batches, timing, retries and housekeeping.
#[derive(Debug, Clone, PartialEq)]
#[must_use]
pub struct RelayConfig {
    /// Concurrent delivery workers, each claiming its own batches (new events one transaction at
    /// a time: see `RelayConfig::DEFAULT_WORKERS`). Defaults to 2.
    pub workers: usize,
    /// Events one claim takes at most. Defaults to 500.
    pub batch_size: usize,
    /// Most bytes of payload one claim takes (its first event whatever its size), so that the
    /// relay's memory follows the batch and not the events' size: events of a megabyte are
    /// claimed a few at a time. Defaults to 8 MiB; 1 KiB to 1 GiB.
    pub batch_bytes: usize,
    /// Fallback poll for lost notifications. Defaults to 1 s.
    pub poll_interval: Duration,
    /// How long a claimed event belongs to its worker without word from it. A worker that dies
    /// gives its events back when the lease ends (a held claim's at once: its session ends); a
    /// delivery still running has its lease renewed every half lease, and is never cut off by
    /// it: its time limit is the handler's own (the HTTP sink's timeout), so a [`Handler`] of
    /// your own must bound its calls. Defaults to 30 s.
    ///
    /// [`Handler`]: crate::Handler
    pub lease: Duration,
    /// How long a claim's transaction may stay open while its batch is delivered, its row locks
    /// holding the events: then the claim writes nothing and the outcome commits with it, the
    /// fastest way through the database. While a backlog of new events waits, the transaction
    /// goes on from batch to batch (each claimed while the one before is delivered, up to 32,
    /// all committed together), claiming no next batch once it is half the hold old. A
    /// transaction held longer than the hold has its claim turned into a lease (the rows
    /// written, the transaction committed), so that no transaction stays open long; zero
    /// leases every claim at once. A delivery from a notification (the fast path) holds no
    /// transaction, but holds back the relay's claims of new events while it goes on:
    /// one that outlives the hold is leased the same way (with a zero hold, after
    /// `record_every`), so that the other keys' events go on. At most 60 s, and shorter than the
    /// lease; a hold longer than half the lease is cut to half the lease. Defaults to 1 s.
    pub hold: Duration,
    /// Delivery attempts before an event goes to the dead letters. Defaults to 12.
    pub max_attempts: u32,
    /// Delay before the first retry; it doubles with each attempt. Defaults to 1 s.
    pub backoff_base: Duration,
    /// Longest retry delay. Defaults to 1 h.
    pub backoff_max: Duration,
    /// Share (0 to 1) of each retry delay that is random, so failing events spread out.
    /// Defaults to 0.2.
    pub backoff_jitter: f64,
    /// How long events every destination has passed stay in the outbox, for
    /// [`Outbox::replay`](crate::Outbox::replay), a destination started in the past and
    /// `outbox_relay.event_state`: then the sweeper removes them in bulk, oldest first. Delivery
    /// itself never writes an outbox row (a destination's position is its record); zero removes
    /// events as soon as every destination has passed them (within a second or so). Counted
    /// from an event's commit (by the claims' clock: the first claim position taken more than
    /// the retention ago that sees it). Defaults to 1 h.
    pub retention: Duration,
    /// Idempotency receipts older than this are deleted by the janitor; a key may be reused after
    /// that. Defaults to 7 days.
    pub idempotency_retention: Duration,
    /// A destination of this relay that no relay then serves for this long expires: a janitor
    /// moves what waits for it to its dead letters and drops it, so that a route that is gone
    /// (a mistyped name, a test run) does not keep events in the outbox for good. Stored with the
    /// destination when it is registered (the last relay to register it sets it); warned of in
    /// the log, `status` and the metrics once half of it has passed. Zero: never. Defaults to 7
    /// days. Needs a janitor (`janitor_interval` not zero) in some relay.
    pub destination_expiry: Duration,
    /// How often the events of a claim that are delivered already are recorded, while the rest
    /// of it is still in delivery, so that a relay killed then sends again only what was in
    /// flight or finished in the last moments, not its whole claim (nor the earlier batches of
    /// its transaction, counted from its first claim): a held claim's, from another
    /// connection, beside its open transaction (migration 0017; its commit, or after a crash the
    /// next claim, records them delivered); a leased one's by its token. Zero: a claim is
    /// recorded once it is all delivered. Defaults to 20 ms. See docs/guarantees.md.
    pub record_every: Duration,
    /// Time between janitor passes; zero turns the janitor off. Defaults to 60 s.
    pub janitor_interval: Duration,
    /// Rows one janitor statement deletes at most, to keep locks short. Defaults to 1000.
    pub janitor_batch: usize,
    /// Time in-flight deliveries get to finish on shutdown before they are cut off and their
    /// events released. Defaults to 10 s.
    pub shutdown_grace: Duration,
    /// Longest wait between the listener's reconnection attempts. Defaults to 5 s.
    pub reconnect_max: Duration,
    /// The most PostgreSQL connections the relay opens: its pool and a listener per destination.
    /// A relay needs `destinations × (2 × workers + 3) + 3` (docs/operations.md, "Connections");
    /// with a bound below that, it runs fewer workers per destination, down to one (at least
    /// `5 × destinations + 3` connections: fewer is an error when it starts). Defaults to none.
    pub max_connections: Option<usize>,
    /// How long an idle relay keeps claiming every millisecond before it marks itself waiting and
    /// writers start to notify it. Under sustained load it never marks itself waiting, so writers
    /// pay nothing for NOTIFY. Defaults to 20 ms.
    pub linger: Duration,
    /// The most deliveries in progress at once, across all workers (each HTTP request, NATS
    /// batch or stdout write is one). Independent of `workers`, which only claim. The relay
    /// learns how many the destination takes, up to this (a delay-based limit that starts at a
    /// few and grows while answers come back as fast as with nothing queued; see "The
    /// concurrency limit" in docs/relay.md), unless `fixed_concurrency` is set. Defaults to 256.
    pub concurrency: usize,
    /// Keep `concurrency` as a fixed limit instead of learning one up to it. Defaults to false.
    pub fixed_concurrency: bool,
    /// At most this many events a second go to the destination, across all workers (a token
    /// bucket of a tenth of a second's events): each HTTP request is one, a batch written in
    /// one piece counts its events. A 429 cuts the rate in effect by a quarter (once a second at
    /// most), and it grows back by a tenth
    /// of this per second without one. `None` (the default): no rate limit. A `Retry-After` on
    /// a 429 or 503 pauses every delivery (up to a minute) either way.
    pub rate_limit: Option<f64>,
    /// When the head event of a key goes to the dead letters, hold the key's later events until
    /// the dead letter is retried or purged (instead of delivering them). Defaults to false.
    pub dead_letter_holds_key: bool,
    /// Distinct events failing transiently in a row that mean the destination is down: the
    /// breaker opens, the relay stops claiming, gives back what it holds without counting the
    /// attempt, and probes with one delivery at a time. Zero turns the breaker off. Defaults to 10.
    pub breaker_threshold: u32,
    /// The first wait before the open breaker's probe; doubles with each failed probe (a
    /// destination's `Retry-After` can make it longer), except after a refused connection
    /// (nobody listens there yet: the next probe follows as soon). Defaults to 250 ms.
    pub breaker_probe_min: Duration,
    /// The longest wait between probes. Defaults to 60 s.
    pub breaker_probe_max: Duration,
    /// Deliver new events from their notification, before any claim (the *fast path*: see
    /// "The fast path" in docs/design.md): one relay of a destination at a time does, the one
    /// that holds its fast-path lock, while writers notify it of every commit; the next claim
    /// records the outcomes. Off: every event is claimed before it is delivered (a round trip
    /// more between commit and handler). Defaults to true.
    pub fast_path: bool,
}

/// Defaults and bounds of the settings.
impl RelayConfig {
    /// Default number of concurrent delivery workers. New events are claimed by one transaction at
    /// a time; the other workers claim parked events meanwhile, and those claims pass over the rows
    /// other claims hold, so more concurrent claims cost more than they bring (measured with the
    /// 0007 storage: 2 x 500 drained about 1.6 times as fast as 4 x 100).
    pub const DEFAULT_WORKERS: usize = 2;
    /// Default number of events one claim takes.
    pub const DEFAULT_BATCH_SIZE: usize = 500;
    /// Default of `batch_bytes`: 8 MiB of payload a claim.
    pub const DEFAULT_BATCH_BYTES: usize = 8 << 20;
    /// The least `batch_bytes`.
    pub const MIN_BATCH_BYTES: usize = 1 << 10;
    /// The most `batch_bytes`.
    pub const MAX_BATCH_BYTES: usize = 1 << 30;
    /// Default interval of the fallback poll.
    pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_secs(1);
    /// Default lease of a claimed event.
    pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);
    /// Default number of delivery attempts before an event goes to the dead letters.
    pub const DEFAULT_MAX_ATTEMPTS: u32 = 12;
    /// Default first retry delay.
    pub const DEFAULT_BACKOFF_BASE: Duration = Duration::from_secs(1);
    /// Default longest retry delay.
    pub const DEFAULT_BACKOFF_MAX: Duration = Duration::from_secs(3600);
    /// Default share of a retry delay that is randomized.
    pub const DEFAULT_BACKOFF_JITTER: f64 = 0.2;
    /// Default time events every destination has passed are kept.
    pub const DEFAULT_RETENTION: Duration = Duration::from_secs(3600);
    /// Default time between recordings of a claim in delivery.
    pub const DEFAULT_RECORD_EVERY: Duration = Duration::from_millis(20);
    /// Default time without a relay after which a destination expires.
    pub const DEFAULT_DESTINATION_EXPIRY: Duration = Duration::from_secs(7 * 24 * 3600);
    /// Default age after which idempotency receipts are deleted.
    pub const DEFAULT_IDEMPOTENCY_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);
    /// Default interval between janitor passes.
    pub const DEFAULT_JANITOR_INTERVAL: Duration = Duration::from_secs(60);
    /// Default rows a janitor statement deletes at most.
    pub const DEFAULT_JANITOR_BATCH: usize = 1000;
    /// Default time in-flight deliveries get to finish on shutdown.
    pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
    /// Default quiet time before an idle relay asks writers to notify it.
    pub const DEFAULT_LINGER: Duration = Duration::from_millis(20);
    /// Default longest wait between reconnection attempts of the listener.
    pub const DEFAULT_RECONNECT_MAX: Duration = Duration::from_secs(5);
    /// Default longest time a claim's transaction stays open for its delivery.
    pub const DEFAULT_HOLD: Duration = Duration::from_secs(1);
    /// The longest `hold`: an open transaction holds back vacuum in the whole database.
    pub const MAX_HOLD: Duration = Duration::from_secs(60);
    /// Default number of deliveries in progress at once.
    pub const DEFAULT_CONCURRENCY: usize = 256;
    /// Default number of distinct events failing in a row that opens the outage breaker.
    pub const DEFAULT_BREAKER_THRESHOLD: u32 = 10;
    /// Default first wait before the open breaker's probe; it doubles with each failed probe.
    pub const DEFAULT_BREAKER_PROBE_MIN: Duration = Duration::from_millis(250);
    /// Default longest wait between probes of the open breaker.
    pub const DEFAULT_BREAKER_PROBE_MAX: Duration = Duration::from_secs(60);

    /// The largest batch one claim may take.
    pub const MAX_BATCH_SIZE: usize = 10_000;
    /// The most workers one relay may run.
    pub const MAX_WORKERS: usize = 256;
    /// The shortest lease.
    pub const MIN_LEASE: Duration = Duration::from_millis(100);
    /// The longest lease.
    pub const MAX_LEASE: Duration = DAY;
    /// The shortest fallback poll interval.
    pub const MIN_POLL_INTERVAL: Duration = Duration::from_millis(1);
    /// The longest fallback poll interval.
    pub const MAX_POLL_INTERVAL: Duration = DAY;
    /// The longest retry delay, and so the longest `backoff_base` and `backoff_max`: a longer one
    /// is a mistake, not a policy.
    pub const MAX_BACKOFF: Duration = Duration::from_secs(7 * 24 * 3600);
    /// The longest retention of events and receipts (and age for purging dead letters).
    /// 100 years of 365.25 days, as humantime reads `100y`.
    pub const MAX_RETENTION: Duration = Duration::from_secs(3_155_760_000);
    /// The longest interval between janitor passes.
    pub const MAX_JANITOR_INTERVAL: Duration = DAY;
    /// The longest shutdown grace period.
    pub const MAX_SHUTDOWN_GRACE: Duration = Duration::from_secs(3600);
    /// The shortest and longest wait between listener reconnection attempts.
    pub const MIN_RECONNECT_MAX: Duration = Duration::from_millis(10);
    /// See [`Self::MIN_RECONNECT_MAX`].
    pub const MAX_RECONNECT_MAX: Duration = Duration::from_secs(3600);
    /// The longest linger.
    pub const MAX_LINGER: Duration = Duration::from_secs(10);
    /// The most deliveries one relay may have in progress.
    pub const MAX_CONCURRENCY: usize = 10_000;
    /// The highest `rate_limit`, in events a second.
    pub const MAX_RATE_LIMIT: f64 = 1_000_000.0;
    /// The shortest wait between probes of an open breaker.
    pub const MIN_BREAKER_PROBE: Duration = Duration::from_millis(10);
    /// The longest wait between probes of an open breaker.
    pub const MAX_BREAKER_PROBE: Duration = Duration::from_secs(3600);
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            workers: RelayConfig::DEFAULT_WORKERS,
            batch_size: RelayConfig::DEFAULT_BATCH_SIZE,
            batch_bytes: RelayConfig::DEFAULT_BATCH_BYTES,
            poll_interval: RelayConfig::DEFAULT_POLL_INTERVAL,
            lease: RelayConfig::DEFAULT_LEASE,
            hold: RelayConfig::DEFAULT_HOLD,
            max_attempts: RelayConfig::DEFAULT_MAX_ATTEMPTS,
            backoff_base: RelayConfig::DEFAULT_BACKOFF_BASE,
            backoff_max: RelayConfig::DEFAULT_BACKOFF_MAX,
            backoff_jitter: RelayConfig::DEFAULT_BACKOFF_JITTER,
            retention: RelayConfig::DEFAULT_RETENTION,
            idempotency_retention: RelayConfig::DEFAULT_IDEMPOTENCY_RETENTION,
            destination_expiry: RelayConfig::DEFAULT_DESTINATION_EXPIRY,
            record_every: RelayConfig::DEFAULT_RECORD_EVERY,
            janitor_interval: RelayConfig::DEFAULT_JANITOR_INTERVAL,
            janitor_batch: RelayConfig::DEFAULT_JANITOR_BATCH,
            shutdown_grace: RelayConfig::DEFAULT_SHUTDOWN_GRACE,
            reconnect_max: RelayConfig::DEFAULT_RECONNECT_MAX,
            max_connections: None,
            linger: RelayConfig::DEFAULT_LINGER,
            concurrency: RelayConfig::DEFAULT_CONCURRENCY,
            fixed_concurrency: false,
            rate_limit: None,
            dead_letter_holds_key: false,
            breaker_threshold: RelayConfig::DEFAULT_BREAKER_THRESHOLD,
            breaker_probe_min: RelayConfig::DEFAULT_BREAKER_PROBE_MIN,
            breaker_probe_max: RelayConfig::DEFAULT_BREAKER_PROBE_MAX,
            fast_path: true,
        }
    }
}

impl RelayConfig {
    /// The PostgreSQL connections a relay with `destinations` and these `workers` opens at most:
    /// per destination a listener, and for each worker a held claim in delivery and the next
    /// claim (or two in delivery), and two for the bookkeeping beside them (recording outcomes,
    /// the race closure, registration); and three for the relay's janitor, sweeper and
    /// registration.
    pub fn connections_needed(destinations: usize, workers: usize) -> usize {
        destinations * (2 * workers + 3) + 3
    }

    /// This configuration with as many workers as fit `max_connections` with `destinations`;
    /// an error when not even one does.
    pub(crate) fn fitted(mut self, destinations: usize) -> Result<RelayConfig> {
        let Some(max) = self.max_connections else { return Ok(self) };
        let least = Self::connections_needed(destinations, 1);
        if max < least {
            return Err(Error::config(format!(
                "max_connections is {max}; a relay with {destinations} destinations needs at least {least} (5 per destination and 3), more with more workers"
            )));
        }
        let fits = (1..=self.workers).rev().find(|&w| Self::connections_needed(destinations, w) <= max).unwrap_or(1);
        if fits < self.workers {
            tracing::info!(
                workers = fits,
                asked = self.workers,
                max_connections = max,
                needed = Self::connections_needed(destinations, self.workers),
                "fewer workers per destination, to open at most max_connections connections (needed: what the workers asked for would open)"
            );
            self.workers = fits;
        }
        Ok(self)
    }

    /// The hold in effect: `hold`, at most half the lease.
    pub(crate) fn effective_hold(&self) -> Duration {
        self.hold.min(self.lease / 2)
    }

    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<()> {
        let bad = |field: &str, why: String| Err(Error::config(format!("invalid relay config: {field} {why}")));
        if self.workers == 0 || self.workers > RelayConfig::MAX_WORKERS {
            return bad("workers", format!("is {}; it must be 1 to {}", self.workers, Self::MAX_WORKERS));
        }
        if self.batch_size == 0 || self.batch_size > RelayConfig::MAX_BATCH_SIZE {
            return bad("batch_size", format!("is {}; it must be 1 to {}", self.batch_size, Self::MAX_BATCH_SIZE));
        }
        if !(RelayConfig::MIN_BATCH_BYTES..=RelayConfig::MAX_BATCH_BYTES).contains(&self.batch_bytes) {
            return bad(
                "batch_bytes",
                format!("is {}; it must be {} to {}", self.batch_bytes, Self::MIN_BATCH_BYTES, Self::MAX_BATCH_BYTES),
            );
        }
        let durations = [
            ("poll_interval", self.poll_interval, RelayConfig::MIN_POLL_INTERVAL, RelayConfig::MAX_POLL_INTERVAL),
            ("lease", self.lease, RelayConfig::MIN_LEASE, RelayConfig::MAX_LEASE),
            ("hold", self.hold, Duration::ZERO, RelayConfig::MAX_HOLD),
            ("backoff_base", self.backoff_base, Duration::from_millis(1), RelayConfig::MAX_BACKOFF),
            ("backoff_max", self.backoff_max, Duration::from_millis(1), RelayConfig::MAX_BACKOFF),
            ("retention", self.retention, Duration::ZERO, RelayConfig::MAX_RETENTION),
            ("idempotency_retention", self.idempotency_retention, Duration::ZERO, RelayConfig::MAX_RETENTION),
            ("destination_expiry", self.destination_expiry, Duration::ZERO, RelayConfig::MAX_RETENTION),
            ("record_every", self.record_every, Duration::ZERO, RelayConfig::MAX_HOLD),
            ("janitor_interval", self.janitor_interval, Duration::ZERO, RelayConfig::MAX_JANITOR_INTERVAL),
            ("shutdown_grace", self.shutdown_grace, Duration::ZERO, RelayConfig::MAX_SHUTDOWN_GRACE),
            ("reconnect_max", self.reconnect_max, RelayConfig::MIN_RECONNECT_MAX, RelayConfig::MAX_RECONNECT_MAX),
            ("linger", self.linger, Duration::ZERO, RelayConfig::MAX_LINGER),
            (
                "breaker_probe_min",
                self.breaker_probe_min,
                RelayConfig::MIN_BREAKER_PROBE,
                RelayConfig::MAX_BREAKER_PROBE,
            ),
            (
                "breaker_probe_max",
                self.breaker_probe_max,
                RelayConfig::MIN_BREAKER_PROBE,
                RelayConfig::MAX_BREAKER_PROBE,
            ),
        ];
        for (field, value, min, max) in durations {
            if let Err(why) = check_range(value, min, max) {
                return bad(field, why);
            }
        }
        if !self.hold.is_zero() && self.hold >= self.lease {
            return bad(
                "hold",
                format!(
                    "({}) is not shorter than the lease ({}): a claim whose delivery outlives the hold is leased, \
                     and the lease must outlast it; set a hold below half the lease",
                    humantime::format_duration(self.hold),
                    humantime::format_duration(self.lease)
                ),
            );
        }
        if let Some(rate) = self.rate_limit
            && !(rate.is_finite() && rate > 0.0 && rate <= RelayConfig::MAX_RATE_LIMIT)
        {
            return bad(
                "rate_limit",
                format!("is {rate} events a second; it must be above 0 and at most {}", Self::MAX_RATE_LIMIT),
            );
        }
        if self.concurrency == 0 || self.concurrency > RelayConfig::MAX_CONCURRENCY {
            return bad("concurrency", format!("is {}; it must be 1 to {}", self.concurrency, Self::MAX_CONCURRENCY));
        }
        if self.breaker_probe_max < self.breaker_probe_min {
            return bad(
                "breaker_probe_max",
                format!(
                    "({:?}) is shorter than breaker_probe_min ({:?})",
                    self.breaker_probe_max, self.breaker_probe_min
                ),
            );
        }
        if self.max_attempts == 0 {
            return bad("max_attempts", "is 0; it must be at least 1".into());
        }
        if self.backoff_max < self.backoff_base {
            return bad(
                "backoff_max",
                format!("({:?}) is shorter than backoff_base ({:?})", self.backoff_max, self.backoff_base),
            );
        }
        if !(0.0..=1.0).contains(&self.backoff_jitter) {
            return bad("backoff_jitter", format!("is {}; it must be between 0 and 1", self.backoff_jitter));
        }
        if self.janitor_batch == 0 {
            return bad("janitor_batch", "is 0; it must be at least 1".into());
        }
        Ok(())
    }
}

/// Checks that `value` lies in `min..=max`; the error says which way it is out, readably
/// (`is 10000years; it must be at most 100years`).
pub(crate) fn check_range(value: Duration, min: Duration, max: Duration) -> std::result::Result<(), String> {
    let show = |d: Duration| humantime::format_duration(d).to_string();
    if value < min {
        return Err(format!("is {}; it must be at least {}", show(value), show(min)));
    }
    if value > max {
        return Err(format!("is {}; it must be at most {}", show(value), show(max)));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn max_connections_fits_the_workers_or_names_the_least() {
        let bounded = RelayConfig { workers: 8, max_connections: Some(30), ..Default::default() };
        // two destinations: 2 × (2 × 5 + 3) + 3 = 29 fit in 30, six workers would need 33
        assert_eq!(bounded.clone().fitted(2).unwrap().workers, 5);
        assert_eq!(bounded.clone().fitted(1).unwrap().workers, 8);
        let e = RelayConfig { max_connections: Some(7), ..Default::default() }.fitted(1).unwrap_err();
        assert!(e.to_string().contains("max_connections is 7; a relay with 1 destinations needs at least 8"), "{e}");
        assert_eq!(RelayConfig::default().fitted(50).unwrap().workers, RelayConfig::DEFAULT_WORKERS);
    }

    use super::*;

    #[test]
    fn the_defaults_are_valid() {
        RelayConfig::default().validate().unwrap();
    }

    #[test]
    fn the_hold_is_at_most_half_the_lease() {
        let config =
            RelayConfig { lease: Duration::from_millis(500), hold: Duration::from_millis(400), ..Default::default() };
        config.validate().unwrap();
        assert_eq!(config.effective_hold(), Duration::from_millis(250));
        assert_eq!(RelayConfig::default().effective_hold(), RelayConfig::DEFAULT_HOLD);
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            (RelayConfig { workers: 0, ..Default::default() }, "workers is 0"),
            (RelayConfig { batch_size: 0, ..Default::default() }, "batch_size is 0"),
            (RelayConfig { batch_bytes: 100, ..Default::default() }, "batch_bytes is 100; it must be 1024 to"),
            (RelayConfig { lease: Duration::from_millis(1), ..Default::default() }, "lease is 1ms"),
            (RelayConfig { max_attempts: 0, ..Default::default() }, "max_attempts"),
            (RelayConfig { backoff_max: Duration::from_millis(1), ..Default::default() }, "backoff_max"),
            (RelayConfig { backoff_jitter: 1.5, ..Default::default() }, "backoff_jitter is 1.5"),
            (RelayConfig { poll_interval: Duration::ZERO, ..Default::default() }, "poll_interval is 0s"),
            (RelayConfig { poll_interval: Duration::from_secs(1 << 40), ..Default::default() }, "poll_interval is"),
            (RelayConfig { lease: Duration::from_secs(1 << 40), ..Default::default() }, "lease is"),
            (RelayConfig { retention: Duration::from_secs(1 << 40), ..Default::default() }, "at most 100years"),
            (
                RelayConfig { backoff_max: Duration::from_secs(30 * 86400), ..Default::default() },
                "backoff_max is 30days; it must be at most 7days",
            ),
            (RelayConfig { concurrency: 0, ..Default::default() }, "concurrency is 0"),
            (RelayConfig { rate_limit: Some(0.0), ..Default::default() }, "rate_limit is 0 events a second"),
            (RelayConfig { rate_limit: Some(f64::NAN), ..Default::default() }, "rate_limit is NaN"),
            (RelayConfig { rate_limit: Some(2e6), ..Default::default() }, "at most 1000000"),
            (
                RelayConfig { hold: Duration::from_secs(61), ..Default::default() },
                "hold is 1m 1s; it must be at most 1m",
            ),
            (RelayConfig { breaker_probe_max: Duration::from_millis(100), ..Default::default() }, "breaker_probe_max"),
            (
                RelayConfig { lease: Duration::from_secs(1), hold: Duration::from_secs(1), ..Default::default() },
                "hold (1s) is not shorter than the lease (1s)",
            ),
        ];
        for (config, needle) in cases {
            let err = config.validate().unwrap_err();
            assert!(err.to_string().contains(needle), "{err} should contain {needle}");
        }
    }
}
