//! What the bench's stages share: its flags, its failure, and how its figures are computed and
//! shown.

use std::time::Duration;

use pg_outbox_relay::RelayConfig;
use pg_outbox_relay_bench as bench;
use pg_outbox_relay_bench::{Percentiles, ReceiverStage};
use serde_json::json;

/// The command's failure: printed as one line by the caller.
pub(crate) type BenchError = Box<dyn std::error::Error + Send + Sync>;

/// Rounds of the alternating measurements (relay and claim-and-delete loop, stdout and NATS, the
/// three write modes); their medians are compared.
pub(crate) const ROUNDS: usize = 3;

/// Measure commit-to-handler latency, relay drain throughput and write throughput.
///
/// Uses the server of --database-url / DATABASE_URL (its user must be allowed to create
/// databases: the run uses a fresh database `outbox_bench_cli` and drops it at the end), or else a
/// private embedded PostgreSQL with fsync on. Results go to stdout, progress to stderr.
#[derive(Debug, clap::Args)]
pub(crate) struct BenchArgs {
    /// Print exactly one JSON object on stdout instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
    /// Events pre-filled and drained by each throughput measurement.
    #[arg(long, default_value_t = 200_000)]
    pub(crate) events: usize,
    /// Relay workers of the drain (the same number of clients run a second claim-and-delete loop).
    #[arg(long, default_value_t = pg_outbox_relay::RelayConfig::DEFAULT_WORKERS)]
    pub(crate) workers: usize,
    /// Events per claim of the drain (and of the second claim-and-delete loop).
    #[arg(long, default_value_t = pg_outbox_relay::RelayConfig::DEFAULT_BATCH_SIZE)]
    pub(crate) batch_size: usize,
    /// Latency samples per wake-up path (a quarter of them, at least one, for the 100 ms poll).
    #[arg(long, default_value_t = 200)]
    pub(crate) samples: usize,
    /// How long each write-throughput measurement runs.
    #[arg(long, value_name = "DUR", value_parser = crate::values::duration_in(crate::values::MILLISECOND, Duration::from_secs(3600)), allow_hyphen_values = true, default_value = "3s")]
    pub(crate) write_duration: Duration,
    /// How long the trickle (40 events/s to an `outbox-relay run` process) is measured.
    #[arg(long, value_name = "DUR", value_parser = crate::values::duration_in(Duration::from_millis(100), Duration::from_secs(3600)), allow_hyphen_values = true, default_value = "10s")]
    pub(crate) trickle_duration: Duration,
    /// How long each phase of the held-snapshot stage lasts: events published at --held-rate with
    /// a key each to an `outbox-relay run --sink stdout` process, first with nothing held, then
    /// while another session holds a transaction (and its snapshot) open.
    #[arg(long, value_name = "DUR", value_parser = crate::values::duration_in(Duration::from_secs(1), Duration::from_secs(24 * 3600)), allow_hyphen_values = true, default_value = "20s")]
    pub(crate) held_duration: Duration,
    /// The span of the outbox's slots during the held-snapshot stage (`outbox_relay.set_slot_span`,
    /// migration 0024; the installation's own span is set back at the end): a leaf is truncated
    /// once the sweeper has emptied it and writers have moved on, so the outbox's disk under the
    /// hold is bounded by the relay's retention plus about two spans. Unset: the installation's.
    #[arg(long, value_name = "DUR", value_parser = crate::values::duration_in(Duration::from_secs(1), Duration::from_secs(86400)), allow_hyphen_values = true)]
    pub(crate) held_slot_span: Option<Duration>,
    /// Events per second of the held-snapshot stage.
    #[arg(long, value_name = "N", default_value_t = 800.0)]
    pub(crate) held_rate: f64,
    /// Run only the held-snapshot stage.
    #[arg(long)]
    pub(crate) held_only: bool,
    /// Phases of the held-snapshot stage of at least 5 minutes (a hold of minutes is what shows
    /// the costs that grow with it); each phase is also reported by its worst 10 s window.
    #[arg(long)]
    pub(crate) held_long: bool,
    /// Run only the HTTP receivers stage: a small receiver (one request at a time, listen
    /// backlog 5), one answering in 20 ms, one answering 429 past 200 requests/s, one opening 2 s
    /// late; the defaults against fixed limits.
    #[arg(long, conflicts_with = "held_only")]
    pub(crate) receivers_only: bool,
    /// Events per drain to the small and the rate-limited HTTP receivers (ten times as many to
    /// the one answering in 20 ms, at most 100 to the late one).
    #[arg(long, value_name = "N", default_value_t = 1000)]
    pub(crate) receiver_events: usize,
    /// NATS server for the JetStream drain (skipped, with a note, when none answers).
    #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222", value_name = "URL")]
    pub(crate) nats_url: String,
    /// RabbitMQ broker for the AMQP drain (skipped, with a note, when none answers); the bench
    /// declares an exchange and a queue `outbox_bench` there, and deletes the queue at the end.
    #[arg(
        long,
        env = "AMQP_URL",
        hide_env_values = true,
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f",
        value_name = "URL"
    )]
    pub(crate) amqp_url: String,
    /// Kafka cluster for the Kafka drain and a plain producer's rate (skipped, with a note, when
    /// none answers); the bench makes topics `outbox-bench-*` there and deletes them.
    #[arg(long, env = "KAFKA_URL", default_value = "kafka://127.0.0.1:9092", value_name = "URL")]
    pub(crate) kafka_url: String,
    /// Run only the delivery stage (stdout, two destinations, NATS, RabbitMQ, Kafka).
    #[arg(long, conflicts_with_all = ["held_only", "receivers_only"])]
    pub(crate) sinks_only: bool,
    /// Run only the latency stage, in alternating rounds: the floor (a LISTEN client getting the
    /// same commit's notification), NOTIFY (the fast path), NOTIFY with the fast path off, and
    /// in-process; each path's p50 and p99 (medians of the rounds) and its distance above the
    /// floor.
    #[arg(long, conflicts_with_all = ["held_only", "receivers_only", "sinks_only"])]
    pub(crate) latency_only: bool,
    /// Run only the drain stage, in alternating rounds: the relay, the bare claim-and-delete loop
    /// (4 clients, batch 100; and --workers clients, --batch-size), and the floor (one client
    /// reading the events in id order, --batch-size a read, one row written per batch and none
    /// per event).
    #[arg(long, conflicts_with_all = ["held_only", "receivers_only", "sinks_only", "latency_only"])]
    pub(crate) drain_only: bool,
    /// Run only the write-path stage: the article's transaction (order, audit entry, receipt,
    /// one keyed event) on its plain tables, through the SQL functions and through the Rust unit
    /// of work, with 1, 4 and 16 writers for --write-duration each, in alternating rounds.
    #[arg(long, conflicts_with_all = ["held_only", "receivers_only", "sinks_only", "latency_only", "drain_only"])]
    pub(crate) write_path_only: bool,
    /// An argument added to the `outbox-relay run --sink stdout` processes of the trickle and the
    /// held-snapshot stages (repeat it for several: `--relay-arg=--no-fast-path`), to measure a
    /// setting against the defaults.
    #[arg(long = "relay-arg", value_name = "ARG", allow_hyphen_values = true)]
    pub(crate) relay_args: Vec<String>,
}

impl BenchArgs {
    pub(crate) fn validate(&self) -> Result<(), BenchError> {
        if self.events == 0 {
            return Err("--events must be at least 1".into());
        }
        if self.samples == 0 {
            return Err("--samples must be at least 1".into());
        }
        if self.workers == 0 || self.workers > RelayConfig::MAX_WORKERS {
            return Err(format!("--workers is {}; it must be 1 to {}", self.workers, RelayConfig::MAX_WORKERS).into());
        }
        if self.batch_size == 0 || self.batch_size > RelayConfig::MAX_BATCH_SIZE {
            return Err(format!(
                "--batch-size is {}; it must be 1 to {}",
                self.batch_size,
                RelayConfig::MAX_BATCH_SIZE
            )
            .into());
        }
        if !(10..=1_000_000).contains(&self.receiver_events) {
            return Err(format!("--receiver-events is {}; it must be 10 to 1000000", self.receiver_events).into());
        }
        if !(self.held_rate >= 1.0 && self.held_rate <= 10_000.0) {
            return Err(format!("--held-rate is {}; it must be 1 to 10000 events/s", self.held_rate).into());
        }
        Ok(())
    }

    pub(crate) fn receiver_stage(&self) -> ReceiverStage {
        ReceiverStage::for_events(self.receiver_events)
    }

    pub(crate) fn poll_samples(&self) -> usize {
        (self.samples / 4).max(1)
    }
}

/// `outbox-relay run --sink stdout` for `outbox`'s database, with default settings and the
/// bench's `--relay-arg`s.
pub(crate) fn relay_command(
    args: &BenchArgs,
    outbox: &pg_outbox_relay::Outbox,
) -> Result<tokio::process::Command, BenchError> {
    let mut relay = tokio::process::Command::new(std::env::current_exe()?);
    relay
        .args(["run", "--sink", "stdout"])
        .args(&args.relay_args)
        .env("DATABASE_URL", outbox.url().to_connection_string())
        .env("RUST_LOG", "error");
    Ok(relay)
}

/// How the bench's `outbox-relay run` processes are set, for its progress lines and tables:
/// "default settings", or the defaults and the `--relay-arg`s.
pub(crate) fn relay_settings(args: &BenchArgs) -> String {
    if args.relay_args.is_empty() {
        "default settings".to_string()
    } else {
        format!("default settings and {}", args.relay_args.join(" "))
    }
}

/// The median of rates (the lower middle of an even count).
pub(crate) fn median(rates: &mut [f64]) -> f64 {
    rates.sort_by(f64::total_cmp);
    rates.get(rates.len().saturating_sub(1) / 2).copied().unwrap_or(0.0)
}

pub(crate) fn rate(events: usize, elapsed: Duration) -> f64 {
    events as f64 / elapsed.as_secs_f64()
}

pub(crate) fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

pub(crate) fn percentiles_json(p: &Percentiles) -> serde_json::Value {
    let millis = |d: Duration| rounded(ms(d), 3);
    json!({"p50": millis(p.p50), "p90": millis(p.p90), "p99": millis(p.p99), "max": millis(p.max)})
}

/// `value` rounded to `decimals` places, so the JSON shows no binary noise (`0.9248100000000001`).
pub(crate) fn rounded(value: f64, decimals: i32) -> f64 {
    let scale = 10f64.powi(decimals);
    (value * scale).round() / scale
}

pub(crate) fn latencies(p: &bench::Phase) -> Option<Percentiles> {
    Percentiles::from_samples(&mut p.latencies.clone())
}

pub(crate) fn format_ms(d: Duration) -> String {
    format!("{:.2} ms", ms(d))
}

/// A rate rounded to a whole number, with thousands separators: `12,345`.
pub(crate) fn grouped(value: f64) -> String {
    let digits = format!("{:.0}", value.max(0.0));
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_grouped_by_thousands() {
        assert_eq!(grouped(0.4), "0");
        assert_eq!(grouped(999.0), "999");
        assert_eq!(grouped(1234.6), "1,235");
        assert_eq!(grouped(1_234_567.0), "1,234,567");
        assert_eq!(grouped(-3.0), "0");
    }

    #[test]
    fn json_numbers_are_rounded() {
        assert_eq!(rounded(0.924_810_000_000_000_1, 3), 0.925);
        assert_eq!(rounded(25_817.134_376, 1), 25_817.1);
    }
}
