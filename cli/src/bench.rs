//! `outbox-relay bench`: a quick measurement of delivery latency, drain throughput and write
//! throughput on a real server (the measuring code is `outbox_relay::bench`, shared with
//! `cargo bench`, whose criterion suite goes further).

use std::time::Duration;

use outbox_relay::Completion;
use outbox_relay::defaults::{MAX_BATCH_SIZE, MAX_WORKERS};
use outbox_relay_testkit::bench::{self, BenchDb, DrainSetup, NotifyMode, Percentiles, ServerInfo, WakePath};
use serde_json::json;

/// The command's failure: printed as one line by the caller.
type BenchError = Box<dyn std::error::Error + Send + Sync>;

/// Poll interval of the poll-only latency measurement.
const POLL_INTERVAL: Duration = Duration::from_millis(100);
/// Concurrent writers of the write-throughput measurement.
const WRITERS: usize = 16;
/// Steps, for the progress lines.
const STEPS: usize = 10;
/// Keys of the keyed drain (each delivered in order).
const KEYS: usize = 100;
/// The HTTP receiver's latency.
const RECEIVER_LATENCY: Duration = Duration::from_millis(20);
/// Events delivered to the slow HTTP receiver (at most; no more than --events).
const HTTP_EVENTS: usize = 3000;
/// Rounds of the alternating stdout and NATS drains.
const SINK_ROUNDS: usize = 3;

/// Measure commit-to-handler latency, relay drain throughput and write throughput.
///
/// Uses the server of --database-url / DATABASE_URL (its user must be allowed to create
/// databases: the run uses a fresh database `outbox_bench_cli` and drops it at the end), or else a
/// private embedded PostgreSQL with fsync on. Results go to stdout, progress to stderr.
#[derive(Debug, clap::Args)]
pub(crate) struct BenchArgs {
    /// Print exactly one JSON object on stdout instead of a table.
    #[arg(long)]
    json: bool,
    /// Events pre-filled and drained by the throughput measurement.
    #[arg(long, default_value_t = 20000)]
    events: usize,
    /// Relay workers of the throughput measurement.
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// Events per claim in the throughput measurement.
    #[arg(long, default_value_t = 100)]
    batch_size: usize,
    /// Latency samples per wake-up path (a quarter of them, at least one, for the 100 ms poll).
    #[arg(long, default_value_t = 200)]
    samples: usize,
    /// How long each write-throughput measurement runs.
    #[arg(long, value_name = "DUR", value_parser = crate::duration_in(crate::MILLISECOND, Duration::from_secs(3600)), allow_hyphen_values = true, default_value = "3s")]
    write_duration: Duration,
    /// NATS server for the JetStream drain (skipped, with a note, when none answers).
    #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222", value_name = "URL")]
    nats_url: String,
}

impl BenchArgs {
    fn validate(&self) -> Result<(), BenchError> {
        if self.events == 0 {
            return Err("--events must be at least 1".into());
        }
        if self.samples == 0 {
            return Err("--samples must be at least 1".into());
        }
        if self.workers == 0 || self.workers > MAX_WORKERS {
            return Err(format!("--workers is {}; it must be 1 to {MAX_WORKERS}", self.workers).into());
        }
        if self.batch_size == 0 || self.batch_size > MAX_BATCH_SIZE {
            return Err(format!("--batch-size is {}; it must be 1 to {MAX_BATCH_SIZE}", self.batch_size).into());
        }
        Ok(())
    }

    fn poll_samples(&self) -> usize {
        (self.samples / 4).max(1)
    }
}

/// What one run measured.
struct Report {
    server: String,
    embedded: bool,
    info: ServerInfo,
    cores: usize,
    notify: Percentiles,
    in_process: Percentiles,
    poll: Percentiles,
    throughput: f64,
    keyed_throughput: f64,
    http_throughput: f64,
    stdout_throughput: f64,
    /// The JetStream drain, or why it was skipped.
    nats_throughput: Result<f64, String>,
    tps_trigger: f64,
    tps_notify_every_commit: f64,
    tps_no_trigger: f64,
}

/// Runs the measurements on the server `database_url` names, or on an embedded durable cluster.
pub(crate) async fn run(args: BenchArgs, database_url: Option<String>) -> Result<(), BenchError> {
    args.validate()?;
    let url = database_url.filter(|u| !u.is_empty());
    if url.is_none() {
        eprintln!("starting an embedded PostgreSQL (durable: fsync on)...");
    }
    let server = tokio::task::spawn_blocking(move || BenchDb::start(url.as_deref())).await??;
    let measured = measure(&args, &server).await;
    if !server.is_embedded()
        && let Err(e) = server.drop_database(DATABASE).await
    {
        eprintln!("warning: could not drop the benchmark database: {e}");
    }
    // Stopping an embedded cluster blocks for a moment.
    tokio::task::spawn_blocking(move || drop(server)).await?;
    let report = measured?;
    if args.json {
        println!("{}", to_json(&args, &report));
    } else {
        print_table(&args, &report);
    }
    Ok(())
}

/// The name hint of the run's database (`outbox_bench_cli`).
const DATABASE: &str = "cli";

async fn measure(args: &BenchArgs, server: &BenchDb) -> Result<Report, BenchError> {
    let (_, outbox) = server.fresh_database(DATABASE).await?;
    let info = bench::server_info(&outbox).await?;
    eprintln!("measuring on the {}, PostgreSQL {}", server.describe(), info.version);

    let mut step = 0;
    let mut progress = |what: String| {
        step += 1;
        eprintln!("[{step}/{STEPS}] {what}...");
    };
    let latency = async |path: WakePath, samples: usize| -> Result<Percentiles, BenchError> {
        let mut taken = bench::latency(&outbox, path, samples).await?;
        Percentiles::from_samples(&mut taken).ok_or_else(|| "no latency samples were taken".into())
    };

    progress(format!("latency (NOTIFY), {} samples", args.samples));
    let notify = latency(WakePath::Notify, args.samples).await?;
    progress(format!("latency (in-process), {} samples", args.samples));
    let in_process = latency(WakePath::InProcess, args.samples).await?;
    let poll = WakePath::Poll(POLL_INTERVAL);
    progress(format!("latency ({poll}), {} samples", args.poll_samples()));
    let poll = latency(poll, args.poll_samples()).await?;

    let setup = DrainSetup {
        events: args.events,
        workers: args.workers,
        batch_size: args.batch_size,
        completion: Completion::MarkProcessed,
        keys: None,
    };
    progress(format!("drain throughput: {} events, {} workers, batch {}", args.events, args.workers, args.batch_size));
    let throughput = bench::drain_throughput(&outbox, setup).await?;
    progress(format!("drain throughput, the events over {KEYS} keys (each key in order)"));
    let keyed_throughput = bench::drain_throughput(&outbox, DrainSetup { keys: Some(KEYS), ..setup }).await?;

    let http = DrainSetup::defaults(args.events.min(HTTP_EVENTS));
    progress(format!(
        "{} events to an HTTP receiver that answers in {}, default settings",
        http.events,
        humantime::format_duration(RECEIVER_LATENCY)
    ));
    let receiver = bench::SlowReceiver::start(RECEIVER_LATENCY).await?;
    let http_throughput = rate(http.events, bench::drain_to(&outbox, http, receiver.sink()?).await?);
    drop(receiver);
    // Alternately, so that the machine's drift hits both alike; the medians are compared.
    let sinks = DrainSetup::defaults(args.events);
    progress(format!(
        "{} events to the stdout sink's work (to /dev/null) and to NATS JetStream at {}, alternately, {SINK_ROUNDS} rounds",
        sinks.events, args.nats_url
    ));
    let nats = bench::nats_sink(&args.nats_url, "OUTBOX_BENCH").await?;
    if let Err(why) = &nats {
        eprintln!("  NATS skipped: {why}");
    }
    let (mut stdout_rates, mut nats_rates) = (Vec::new(), Vec::new());
    for _ in 0..SINK_ROUNDS {
        stdout_rates.push(rate(sinks.events, bench::drain_to(&outbox, sinks, bench::DevNullLines).await?));
        if let Ok(sink) = &nats {
            nats_rates.push(rate(sinks.events, bench::drain_to(&outbox, sinks, sink.clone()).await?));
        }
    }
    let stdout_throughput = median(&mut stdout_rates);
    let nats_throughput = nats.map(|_| median(&mut nats_rates));

    let seconds = args.write_duration.as_secs_f64();
    progress(format!("write throughput, the trigger as shipped (no relay waiting): {WRITERS} writers, {seconds} s"));
    let tps_trigger = bench::write_tps(&outbox, WRITERS, args.write_duration, NotifyMode::Trigger).await?;
    progress(format!("write throughput, every commit sending NOTIFY: {WRITERS} writers, {seconds} s"));
    let tps_notify_every_commit =
        bench::write_tps(&outbox, WRITERS, args.write_duration, NotifyMode::NotifyEveryCommit).await?;
    progress(format!("write throughput, trigger dropped: {WRITERS} writers, {seconds} s"));
    let tps_no_trigger = bench::write_tps(&outbox, WRITERS, args.write_duration, NotifyMode::NoTrigger).await?;
    outbox.pool().close();

    Ok(Report {
        server: server.describe(),
        embedded: server.is_embedded(),
        info,
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        notify,
        in_process,
        poll,
        throughput,
        keyed_throughput,
        http_throughput,
        stdout_throughput,
        nats_throughput,
        tps_trigger,
        tps_notify_every_commit,
        tps_no_trigger,
    })
}

/// The median of rates (the lower middle of an even count).
fn median(rates: &mut [f64]) -> f64 {
    rates.sort_by(f64::total_cmp);
    rates.get(rates.len().saturating_sub(1) / 2).copied().unwrap_or(0.0)
}

fn rate(events: usize, elapsed: Duration) -> f64 {
    events as f64 / elapsed.as_secs_f64()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn percentiles_json(p: &Percentiles) -> serde_json::Value {
    let millis = |d: Duration| rounded(ms(d), 3);
    json!({"p50": millis(p.p50), "p90": millis(p.p90), "p99": millis(p.p99), "max": millis(p.max)})
}

/// `value` rounded to `decimals` places, so the JSON shows no binary noise (`0.9248100000000001`).
fn rounded(value: f64, decimals: i32) -> f64 {
    let scale = 10f64.powi(decimals);
    (value * scale).round() / scale
}

fn to_json(args: &BenchArgs, r: &Report) -> serde_json::Value {
    json!({
        "latency_notify_ms": percentiles_json(&r.notify),
        "latency_inprocess_ms": percentiles_json(&r.in_process),
        "latency_poll_ms": percentiles_json(&r.poll),
        "throughput_events_per_s": rounded(r.throughput, 1),
        "throughput_keyed_events_per_s": rounded(r.keyed_throughput, 1),
        "throughput_keys": KEYS,
        "http_20ms_events_per_s": rounded(r.http_throughput, 1),
        "stdout_events_per_s": rounded(r.stdout_throughput, 1),
        "nats_events_per_s": r.nats_throughput.as_ref().ok().map(|v| rounded(*v, 1)),
        "nats_share_of_stdout": r.nats_throughput.as_ref().ok().map(|v| rounded(v / r.stdout_throughput, 3)),
        "write_tps_trigger": rounded(r.tps_trigger, 1),
        "write_tps_no_trigger": rounded(r.tps_no_trigger, 1),
        "write_tps_notify_every_commit": rounded(r.tps_notify_every_commit, 1),
        "events": args.events,
        "workers": args.workers,
        "batch_size": args.batch_size,
        "completion": "mark_processed",
        "latency_samples": args.samples,
        "latency_poll_samples": args.poll_samples(),
        "poll_interval_ms": ms(POLL_INTERVAL),
        "write_writers": WRITERS,
        "write_seconds": args.write_duration.as_secs_f64(),
        "cores": r.cores,
        "server": if r.embedded { "embedded" } else { "external" },
        "fsync": r.info.fsync,
        "synchronous_commit": r.info.synchronous_commit,
        "postgres_version": r.info.version,
    })
}

fn print_table(args: &BenchArgs, r: &Report) {
    println!("outbox-relay bench on the {}", r.server);
    println!(
        "PostgreSQL {}, fsync {}, synchronous_commit {}, {} cores",
        r.info.version, r.info.fsync, r.info.synchronous_commit, r.cores
    );
    println!();
    println!(
        "{:<28}{:>8}{:>11}{:>11}{:>11}{:>11}",
        "latency, commit to handler", "samples", "p50", "p90", "p99", "max"
    );
    let rows = [
        ("NOTIFY", args.samples, &r.notify),
        ("in-process", args.samples, &r.in_process),
        ("poll 100ms", args.poll_samples(), &r.poll),
    ];
    for (name, samples, p) in rows {
        println!(
            "  {name:<26}{samples:>8}{:>11}{:>11}{:>11}{:>11}",
            format_ms(p.p50),
            format_ms(p.p90),
            format_ms(p.p99),
            format_ms(p.max)
        );
    }
    println!();
    println!(
        "drain throughput ({} events, {} workers, batch {}, mark processed): {} events/s",
        args.events,
        args.workers,
        args.batch_size,
        grouped(r.throughput)
    );
    println!(
        "drain throughput, the same over {KEYS} keys (each key in order):         {} events/s",
        grouped(r.keyed_throughput)
    );
    println!();
    println!("delivery, default settings (workers, batch, concurrency):");
    println!(
        "  {:<44}{:>12} events/s",
        format!("to an HTTP receiver answering in {}", humantime::format_duration(RECEIVER_LATENCY)),
        grouped(r.http_throughput)
    );
    println!(
        "  {:<44}{:>12} events/s (median of {SINK_ROUNDS})",
        "to the stdout sink's work (/dev/null)",
        grouped(r.stdout_throughput)
    );
    match &r.nats_throughput {
        Ok(nats) => println!(
            "  {:<44}{:>12} events/s (median of {SINK_ROUNDS}; {:.0} % of stdout)",
            "to NATS JetStream",
            grouped(*nats),
            nats / r.stdout_throughput * 100.0
        ),
        Err(why) => println!("  {:<44}{:>12} ({why})", "to NATS JetStream", "skipped"),
    }
    println!();
    println!("write throughput ({WRITERS} writers, full transaction, {} s each):", args.write_duration.as_secs_f64());
    println!("  {:<40}{:>12} tx/s", "trigger as shipped (relay busy/lingering)", grouped(r.tps_trigger));
    println!("  {:<40}{:>12} tx/s", "NOTIFY on every commit (relay waiting)", grouped(r.tps_notify_every_commit));
    println!("  {:<40}{:>12} tx/s", "trigger dropped", grouped(r.tps_no_trigger));
    if r.tps_no_trigger > 0.0 {
        let cost = |tps: f64| (1.0 - tps / r.tps_no_trigger) * 100.0;
        println!(
            "  the trigger costs {:.1} % of the write throughput under load; notifying every commit would cost {:.1} %",
            cost(r.tps_trigger),
            cost(r.tps_notify_every_commit)
        );
    }
}

fn format_ms(d: Duration) -> String {
    format!("{:.2} ms", ms(d))
}

/// A rate rounded to a whole number, with thousands separators: `12,345`.
fn grouped(value: f64) -> String {
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
