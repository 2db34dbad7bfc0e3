//! Benchmarks of the outbox and its relay on a real PostgreSQL: `cargo bench --bench relay`.
//!
//! The server is the one `DATABASE_URL` names (its user must be allowed to create databases:
//! each group runs in a fresh `outbox_bench_<group>` database, dropped at the end), or else a
//! private embedded cluster with `fsync` on (see `pg_outbox_relay_bench`, which holds the measuring
//! code shared with `outbox-relay bench` and documents exactly what each figure covers).
//!
//! Groups:
//! - `latency/{floor,notify,notify_claim_first,in_process,poll_100ms}`: commit to handler, one
//!   event at a time; `floor` is no relay (a LISTEN client getting the same commit's
//!   notification), `notify_claim_first` the relay with its fast path off. Criterion reports the
//!   mean; the p50/p90/p99/max of all samples taken go to stderr.
//! - `throughput/{mark,delete}/w{1,2,4,8}/b{1,10,100,500}`: events per second drained from a
//!   pre-filled outbox (5,000 events per iteration; 500 with batch 1; 50,000 for the defaults and the loop). One iteration is one
//!   pre-fill plus one drain, and only the drain is timed. Ten iterations per combination, so
//!   this group takes most of the run. `throughput/defaults/{unkeyed,keyed_100}`: the relay's
//!   default settings; `throughput/claim_delete_loop/c4_b100`: the bare claim-and-delete loop
//!   the drain is compared with (`benches/claim_delete.pgbench`), on the same pre-fill.
//! - `write_path/*`: one business transaction on one connection, growing from the bare business
//!   insert to the full transaction with ten events (trigger in place, no relay running).
//! - `article/{plain_tables,sql_functions,rust_unit_of_work}/{1,4,16}`: the article's transaction
//!   (an order, its audit entry, its receipt and one keyed event) from 1, 4 and 16 concurrent
//!   writers, in transactions per second: on the article's own plain tables (the reference),
//!   through the SQL functions of the unit of work, and through `Outbox::execute` (what
//!   `outbox-relay bench --write-path-only` compares, there in alternating rounds).
//! - `notify_cost/{no_trigger,trigger,notify_every_commit}/{1,4,16}`: the full transaction from
//!   1, 4 and 16 concurrent writers, in transactions per second: without the trigger; with the
//!   trigger as shipped and no relay waiting (what writers pay under load); and with every commit
//!   sending `NOTIFY` (a relay waiting; what an always-notifying trigger costs). See
//!   `bench::NotifyMode`.
//!
//! - `trace_context/{untraced,in_traced_span_given,in_traced_span_captured}`: one
//!   `Outbox::publish` of a keyed event: outside any span; inside a request span that an
//!   OpenTelemetry layer traces, the event carrying a `traceparent` the writer gave (so nothing is
//!   captured: the subscriber's own cost); and the same with the context captured (a `create`
//!   span of its own, recorded with the event). The last two differ by what capturing adds. The
//!   tracer has no exporter, so no figure includes the shipping of spans.
//!
//! Nothing touches the database until a benchmark actually runs, so `-- --list` and filters
//! (`cargo bench --bench relay -- latency/notify`) only set up what they select. The whole suite
//! takes about eight minutes on a (busy) two-core machine, five of them in `throughput`.
//! `RUST_LOG=pg_outbox_relay=debug` shows the library's logs on stderr.

use std::cell::{OnceCell, RefCell};
use std::time::Duration;

use criterion::{BenchmarkGroup, BenchmarkId, Criterion, SamplingMode, Throughput, measurement::WallTime};
use pg_outbox_relay::{Outbox, RelayConfig};
use pg_outbox_relay_bench as bench;
use pg_outbox_relay_bench::{
    BenchDb, BoxError, DrainSetup, LatencyProbe, NotifyMode, Percentiles, WakePath, WriteTx, Writers,
};
use tokio::runtime::Runtime;

/// Events per throughput iteration, and with a batch size of 1 (one claim per event is slow).
const DRAIN_EVENTS: usize = 5_000;
const DRAIN_EVENTS_BATCH_1: usize = 500;
/// Events per iteration of the default settings and of the claim-and-delete loop: enough that
/// the relay's start-up (its connections are opened on first use) weighs little.
const DEFAULTS_DRAIN_EVENTS: usize = 50_000;
/// Events per iteration to the slow HTTP receiver.
const HTTP_EVENTS: usize = 1_500;

fn main() {
    // The library's logs, on stderr, only when asked for (RUST_LOG=pg_outbox_relay=debug).
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    let mut criterion = Criterion::default().configure_from_args();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("a tokio runtime");
    let env = Env { runtime, server: OnceCell::new(), databases: RefCell::new(Vec::new()) };

    latency(&mut criterion, &env);
    throughput(&mut criterion, &env);
    delivery(&mut criterion, &env);
    write_path(&mut criterion, &env);
    article(&mut criterion, &env);
    notify_cost(&mut criterion, &env);
    trace_context(&mut criterion, &env);

    criterion.final_summary();
    env.close();
}

/// The runtime, the server (started on first use) and the databases made so far.
struct Env {
    runtime: Runtime,
    server: OnceCell<BenchDb>,
    databases: RefCell<Vec<(&'static str, Outbox)>>,
}

impl Env {
    fn server(&self) -> &BenchDb {
        self.server.get_or_init(|| {
            let url = std::env::var("DATABASE_URL").ok();
            let server = ok(BenchDb::start(url.as_deref()), "starting the benchmark server");
            eprintln!("benchmarks run on the {}", server.describe());
            server
        })
    }

    /// The database of a group, created (fresh and migrated) on first use.
    fn database(&self, group: &'static str) -> Outbox {
        if let Some((_, outbox)) = self.databases.borrow().iter().find(|(name, _)| *name == group) {
            return outbox.clone();
        }
        let server = self.server();
        let (_, outbox) = ok(self.block_on(server.fresh_database(group)), "creating a benchmark database");
        self.databases.borrow_mut().push((group, outbox.clone()));
        outbox
    }

    fn block_on<F: Future>(&self, future: F) -> F::Output {
        self.runtime.block_on(future)
    }

    /// Closes the pools and, on an external server, drops the databases (an embedded cluster is
    /// deleted as a whole when the server is dropped).
    fn close(self) {
        let databases = self.databases.take();
        for (_, outbox) in &databases {
            outbox.pool().close();
        }
        if let Some(server) = self.server.get()
            && !server.is_embedded()
        {
            for (group, _) in &databases {
                if let Err(e) = self.runtime.block_on(server.drop_database(group)) {
                    eprintln!("warning: could not drop the benchmark database of {group}: {e}");
                }
            }
        }
    }
}

/// Unwraps a set-up step; a benchmark cannot go on without it.
fn ok<T>(result: Result<T, BoxError>, what: &str) -> T {
    result.unwrap_or_else(|e| panic!("{what}: {e}"))
}

fn latency(c: &mut Criterion, env: &Env) {
    let mut group = c.benchmark_group("latency");
    group.warm_up_time(Duration::from_secs(1));
    let paths = [
        ("floor", WakePath::Floor),
        ("notify", WakePath::Notify),
        ("notify_claim_first", WakePath::NotifyClaimFirst),
        ("in_process", WakePath::InProcess),
        ("poll_100ms", WakePath::Poll(Duration::from_millis(100))),
    ];
    for (name, path) in paths {
        match path {
            // ~100 ms per sample (the latency plus a random pause over the poll interval).
            WakePath::Poll(_) => {
                group.sample_size(10).sampling_mode(SamplingMode::Flat).measurement_time(Duration::from_secs(6))
            }
            WakePath::Floor | WakePath::Notify | WakePath::NotifyClaimFirst | WakePath::InProcess => {
                group.sample_size(20).sampling_mode(SamplingMode::Auto).measurement_time(Duration::from_secs(5))
            }
        };
        latency_function(&mut group, env, name, path);
    }
    group.finish();
}

fn latency_function(group: &mut BenchmarkGroup<'_, WallTime>, env: &Env, name: &str, path: WakePath) {
    let mut probe: Option<LatencyProbe> = None;
    let mut samples: Vec<Duration> = Vec::new();
    group.bench_function(name, |b| {
        let probe = probe.get_or_insert_with(|| {
            let outbox = env.database("latency");
            ok(env.block_on(LatencyProbe::start(&outbox, path)), "starting the latency probe")
        });
        b.iter_custom(|iters| {
            env.block_on(async {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let sample = ok(probe.sample().await, "taking a latency sample");
                    samples.push(sample);
                    total += sample;
                }
                total
            })
        });
    });
    if let Some(probe) = probe {
        ok(env.block_on(probe.stop()), "stopping the latency probe");
    }
    if let Some(p) = Percentiles::from_samples(&mut samples) {
        eprintln!(
            "latency/{name}: {} samples (warm-up included): p50 {:.3} ms, p90 {:.3} ms, p99 {:.3} ms, max {:.3} ms",
            samples.len(),
            ms(p.p50),
            ms(p.p90),
            ms(p.p99),
            ms(p.max)
        );
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn throughput(c: &mut Criterion, env: &Env) {
    let mut group = c.benchmark_group("throughput");
    // One iteration is a pre-fill and a drain (0.1 to 1 s): ten of them per combination.
    group
        .sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    for (retention_name, retention) in [("retained", RelayConfig::DEFAULT_RETENTION), ("removed", Duration::ZERO)] {
        for workers in [1, 2, 4, 8] {
            for batch_size in [1, 10, 100, 500] {
                let events = if batch_size == 1 { DRAIN_EVENTS_BATCH_1 } else { DRAIN_EVENTS };
                let setup = DrainSetup { events, workers, batch_size, retention, keys: None };
                group.throughput(Throughput::Elements(events as u64));
                let id = BenchmarkId::new(format!("{retention_name}/w{workers}"), format!("b{batch_size}"));
                group.bench_function(id, |b| {
                    let outbox = env.database("throughput");
                    b.iter_custom(|iters| {
                        env.block_on(async {
                            let mut total = Duration::ZERO;
                            for _ in 0..iters {
                                total += ok(bench::drain_time(&outbox, setup).await, "draining the outbox");
                            }
                            total
                        })
                    });
                });
            }
        }
    }
    // The reference: the bare claim-and-delete loop (benches/claim_delete.pgbench), 4 clients
    // and batches of 100, on the same pre-fill.
    let reference = bench::ClaimDeleteLoop { events: DEFAULTS_DRAIN_EVENTS, clients: 4, batch: 100 };
    group.throughput(Throughput::Elements(DEFAULTS_DRAIN_EVENTS as u64));
    group.bench_function(BenchmarkId::new("claim_delete_loop", "c4_b100"), |b| {
        let outbox = env.database("throughput");
        b.iter_custom(|iters| {
            env.block_on(async {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    total +=
                        ok(bench::claim_delete_time(&outbox, reference).await, "running the claim-and-delete loop");
                }
                total
            })
        });
    });
    // The default settings, the events without keys and over 100 keys (each key in order).
    for (name, keys) in [("unkeyed", None), ("keyed_100", Some(100))] {
        let setup = DrainSetup { keys, ..DrainSetup::defaults(DEFAULTS_DRAIN_EVENTS) };
        group.throughput(Throughput::Elements(setup.events as u64));
        group.bench_function(BenchmarkId::new("defaults", name), |b| {
            let outbox = env.database("throughput");
            b.iter_custom(|iters| {
                env.block_on(async {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        total += ok(bench::drain_time(&outbox, setup).await, "draining the outbox");
                    }
                    total
                })
            });
        });
    }
    group.finish();
}

/// Draining to destinations with the default settings: an HTTP receiver that answers in 20 ms,
/// the stdout sink's work (to /dev/null), NATS JetStream (skipped when no server answers).
fn delivery(c: &mut Criterion, env: &Env) {
    let mut group = c.benchmark_group("delivery");
    group
        .sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(5));
    fn drain<H: pg_outbox_relay::Handler + Clone>(
        b: &mut criterion::Bencher<'_>,
        env: &Env,
        setup: DrainSetup,
        sink: H,
    ) {
        let outbox = env.database("delivery");
        b.iter_custom(|iters| {
            env.block_on(async {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    total += ok(bench::drain_to(&outbox, setup, sink.clone()).await, "draining to a sink");
                }
                total
            })
        });
    }
    let http = DrainSetup::defaults(HTTP_EVENTS);
    group.throughput(Throughput::Elements(http.events as u64));
    group.bench_function("http_20ms", |b| {
        let receiver = ok(env.block_on(bench::Receiver::slow(Duration::from_millis(20))), "starting the receiver");
        drain(b, env, http, ok(receiver.sink(), "the HTTP sink"));
    });
    let sinks = DrainSetup::defaults(DRAIN_EVENTS);
    group.throughput(Throughput::Elements(sinks.events as u64));
    group.bench_function("stdout_devnull", |b| drain(b, env, sinks, bench::DevNullLines));
    let nats_url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    match env.block_on(bench::nats_sink(&nats_url, "OUTBOX_CRITERION")) {
        Ok(Ok(sink)) => {
            group.bench_function("nats_jetstream", |b| drain(b, env, sinks, sink.clone()));
        }
        Ok(Err(why)) => eprintln!("delivery/nats_jetstream skipped: {why}"),
        Err(e) => eprintln!("delivery/nats_jetstream skipped: {e}"),
    }
    group.finish();
}

fn write_path(c: &mut Criterion, env: &Env) {
    let mut group = c.benchmark_group("write_path");
    group.sample_size(20).warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(4));
    let shapes = [
        ("business_only", WriteTx::BARE),
        ("plus_audit", WriteTx::WITH_AUDIT),
        ("plus_receipt", WriteTx::WITH_RECEIPT),
        ("full_1_event", WriteTx::FULL),
        ("full_1_event_unkeyed", WriteTx::FULL_UNKEYED),
        ("full_10_events", WriteTx::full_with_events(10)),
    ];
    for (name, shape) in shapes {
        writers_function(&mut group, env, BenchmarkId::from_parameter(name), "write_path", 1, shape, |outbox| {
            ok(env.block_on(bench::reset_notify(outbox)), "restoring the trigger");
        });
    }
    group.finish();
}

/// A function of `group` timing `count` writers of `shape` over `iters` transactions in all.
/// They are connected at its first run, to the database of `database`, after `set_up` and with
/// the write-path tables emptied, and kept for its later iterations.
fn writers_function(
    group: &mut BenchmarkGroup<'_, WallTime>,
    env: &Env,
    id: BenchmarkId,
    database: &'static str,
    count: usize,
    shape: WriteTx,
    mut set_up: impl FnMut(&Outbox),
) {
    let mut writers: Option<Writers> = None;
    group.bench_function(id, |b| {
        let writers = writers.get_or_insert_with(|| {
            let outbox = env.database(database);
            set_up(&outbox);
            env.block_on(async {
                ok(bench::reset_write_tables(&outbox).await, "emptying the write-path tables");
                ok(Writers::connect(&outbox, count, shape).await, "connecting the writers")
            })
        });
        b.iter_custom(|iters| env.block_on(async { ok(writers.run_count(iters).await, "writing") }));
    });
}

fn article(c: &mut Criterion, env: &Env) {
    let mut group = c.benchmark_group("article");
    group
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .throughput(Throughput::Elements(1));
    for writer_count in [1, 4, 16] {
        for way in bench::Way::ALL {
            let id = BenchmarkId::new(way.name(), writer_count);
            writers_function(&mut group, env, id, "article", writer_count, WriteTx::article(way), |_| {});
        }
    }
    group.finish();
}

fn notify_cost(c: &mut Criterion, env: &Env) {
    let mut group = c.benchmark_group("notify_cost");
    group
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .throughput(Throughput::Elements(1));
    let mut touched = false;
    for writer_count in [1, 4, 16] {
        for mode in [NotifyMode::NoTrigger, NotifyMode::Trigger, NotifyMode::NotifyEveryCommit] {
            let id = BenchmarkId::new(mode.name(), writer_count);
            writers_function(&mut group, env, id, "notify_cost", writer_count, WriteTx::FULL, |outbox| {
                touched = true;
                ok(env.block_on(bench::set_notify_mode(outbox, mode)), "setting the trigger");
            });
        }
    }
    group.finish();
    if touched {
        let outbox = env.database("notify_cost");
        ok(env.block_on(bench::reset_notify(&outbox)), "restoring the trigger");
    }
}

fn trace_context(c: &mut Criterion, env: &Env) {
    use opentelemetry::trace::TracerProvider as _;
    use tracing_subscriber::layer::SubscriberExt as _;

    let mut group = c.benchmark_group("trace_context");
    group.sample_size(30).warm_up_time(Duration::from_secs(1)).measurement_time(Duration::from_secs(5));
    let event = pg_outbox_relay::NewEvent::new("bench.traced", serde_json::json!({"order": 1})).key("k");
    let given = event.clone().header("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
    group.bench_function("untraced", |b| {
        let outbox = env.database("trace_context");
        b.iter(|| env.block_on(outbox.publish(&event)).expect("publishing"));
    });
    // Each publish in a request span of its own, traced by an OpenTelemetry layer; the subscriber
    // and the span are on this thread, where `block_on` runs the publish.
    let traced = |b: &mut criterion::Bencher<'_>, event: &pg_outbox_relay::NewEvent| {
        let outbox = env.database("trace_context");
        let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
        let subscriber =
            tracing_subscriber::registry().with(tracing_opentelemetry::layer().with_tracer(provider.tracer("bench")));
        let _subscriber = tracing::subscriber::set_default(subscriber);
        b.iter(|| {
            let span = tracing::info_span!("POST /orders");
            let _entered = span.enter();
            env.block_on(outbox.publish(event)).expect("publishing")
        });
    };
    group.bench_function("in_traced_span_given", |b| traced(b, &given));
    group.bench_function("in_traced_span_captured", |b| traced(b, &event));
    group.finish();
}
