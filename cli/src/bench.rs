//! `outbox-relay bench`: a quick measurement of delivery latency, drain throughput and write
//! throughput on a real server (the measuring code is the crate `pg-outbox-relay-bench`, shared with
//! `cargo bench`, whose criterion suite goes further).

mod common;
mod held;
mod sinks;

use std::time::Duration;

use pg_outbox_relay_bench as bench;
use pg_outbox_relay_bench::{
    BenchDb, ClaimDeleteLoop, DrainSetup, HeldReport, NotifyMode, Percentiles, ReadLoop, ReceiverKind, ReceiversReport,
    ServerInfo, Settings, Trickle, TrickleReport, WakePath,
};
use serde_json::json;

pub(crate) use self::common::BenchArgs;
use self::common::{
    BenchError, ROUNDS, format_ms, grouped, median, ms, percentiles_json, rate, relay_command, relay_settings, rounded,
};
use self::held::{held_json, held_stage, held_step, print_held};

/// Poll interval of the poll-only latency measurement.
const POLL_INTERVAL: Duration = Duration::from_millis(100);
/// Concurrent writers of the write-throughput measurement.
const WRITERS: usize = 16;
/// Steps, for the progress lines.
const STEPS: usize = 13;
/// Keys of the keyed drain (each delivered in order).
const KEYS: usize = 100;
/// Events per second of the trickle.
const TRICKLE_RATE: f64 = 40.0;
/// The reference the relay's drain must reach 90 % of: the claim-and-delete loop with 4 clients
/// and batches of 100 (`benches/claim_delete.pgbench`, `pgbench -c 4 -D batch=100`).
const REFERENCE_LOOP: (usize, usize) = (4, 100);

/// What one run measured.
struct Report {
    server: String,
    embedded: bool,
    info: ServerInfo,
    cores: usize,
    floor: Percentiles,
    notify: Percentiles,
    notify_claim_first: Percentiles,
    in_process: Percentiles,
    poll: Percentiles,
    drains: Drains,
    removed_drain: f64,
    keyed_drain: f64,
    receivers: ReceiversReport,
    sinks: sinks::SinksReport,
    trickle: TrickleReport,
    trickle_latency: Percentiles,
    /// Medians of the rounds.
    tps_trigger: f64,
    tps_notify_every_commit: f64,
    tps_no_trigger: f64,
    held: HeldReport,
}

/// Runs the measurements on the server `database_url` names, or on an embedded durable cluster.
pub(crate) async fn run(args: BenchArgs, database_url: Option<String>) -> Result<(), BenchError> {
    args.validate()?;
    let url = database_url.filter(|u| !u.is_empty());
    if url.is_none() {
        eprintln!("starting an embedded PostgreSQL (durable: fsync on)...");
    }
    let server = tokio::task::spawn_blocking(move || BenchDb::start(url.as_deref())).await??;
    let measured = if args.held_only {
        let stage = async |outbox: &pg_outbox_relay::Outbox| held_stage(&args, outbox).await;
        measure_only(&args, &server, held_step(&args), stage, |h| held_json(&args, h), |h| print_held(&args, h)).await
    } else if args.receivers_only {
        let stage = async |outbox: &pg_outbox_relay::Outbox| Ok(bench::receivers(outbox, args.receiver_stage()).await?);
        measure_only(&args, &server, receivers_step(&args), stage, receivers_json, print_receivers).await
    } else if args.sinks_only {
        let stage = async |outbox: &pg_outbox_relay::Outbox| sinks::stage(&args, outbox).await;
        measure_only(&args, &server, sinks::step(&args), stage, sinks::SinksReport::json, sinks::SinksReport::print)
            .await
    } else if args.write_path_only {
        let stage = async |outbox: &pg_outbox_relay::Outbox| article_rounds(&args, outbox).await;
        measure_only(&args, &server, article_step(&args), stage, article_json, print_article).await
    } else if args.drain_only {
        let stage = async |outbox: &pg_outbox_relay::Outbox| drain_rounds(&args, outbox).await;
        measure_only(&args, &server, drain_step(&args), stage, drains_json, |d| print_drains(&args, d)).await
    } else if args.latency_only {
        let step = format!("latency: {ROUNDS} alternating rounds of {} samples on each path", args.samples);
        let stage = async |outbox: &pg_outbox_relay::Outbox| latency_rounds(&args, outbox).await;
        measure_only(&args, &server, step, stage, latency_rounds_json, |r| print_latency_rounds(&args, r)).await
    } else {
        measure(&args, &server).await.map(|report| {
            if args.json {
                to_json(&args, &report)
            } else {
                print_table(&args, &report);
                serde_json::Value::Null
            }
        })
    };
    if !server.is_embedded()
        && let Err(e) = server.drop_database(database(&args)).await
    {
        eprintln!("warning: could not drop the benchmark database: {e}");
    }
    // Stopping an embedded cluster blocks for a moment.
    tokio::task::spawn_blocking(move || drop(server)).await?;
    let json = measured?;
    if args.json {
        out!("{json}");
    }
    Ok(())
}

/// One stage alone (`--held-only`, `--receivers-only`) on a fresh database: its JSON (with
/// `--json`) or its table, printed.
async fn measure_only<R>(
    args: &BenchArgs,
    server: &BenchDb,
    step: String,
    stage: impl AsyncFnOnce(&pg_outbox_relay::Outbox) -> Result<R, BenchError>,
    json: impl FnOnce(&R) -> serde_json::Value,
    print: impl FnOnce(&R),
) -> Result<serde_json::Value, BenchError> {
    let (_, outbox) = server.fresh_database(database(args)).await?;
    let info = bench::server_info(&outbox).await?;
    eprintln!("measuring on the {}, PostgreSQL {}", server.describe(), info.version);
    eprintln!("[1/1] {step}...");
    let measured = stage(&outbox).await?;
    outbox.pool().close();
    if args.json {
        Ok(merged([json(&measured), server_json(server.is_embedded(), &info)]))
    } else {
        print_server(&server.describe(), &info, None);
        print(&measured);
        Ok(serde_json::Value::Null)
    }
}

fn receivers_step(args: &BenchArgs) -> String {
    let stage = args.receiver_stage();
    format!(
        "HTTP receivers: {} events to a small one (one request at a time, listen backlog {}), fixed limits {:?} and then the defaults and the best of them alternately, {} rounds; {} events to one answering in {}, with and without {} keys, defaults and fixed {}; {} events to one answering 429 past {}/s; {} events to one opening {} late",
        stage.small_events,
        bench::SMALL_BACKLOG,
        bench::SMALL_SWEEP,
        stage.rounds,
        stage.slow_events,
        humantime::format_duration(bench::SLOW_LATENCY),
        stage.keys,
        pg_outbox_relay::RelayConfig::default().concurrency,
        stage.limited_events,
        bench::LIMITED_RATE,
        stage.late_events,
        humantime::format_duration(bench::LATE_BY),
    )
}

/// The name hint of the run's database (`outbox_bench_cli`).
const DATABASE: &str = "cli";

/// The database of a run: `outbox_bench_cli_held` for the held stage alone and
/// `outbox_bench_cli_receivers` for the receivers alone, so that they can run beside a full run on
/// one server.
fn database(args: &BenchArgs) -> &'static str {
    if args.held_only {
        "cli_held"
    } else if args.receivers_only {
        "cli_receivers"
    } else if args.sinks_only {
        "cli_sinks"
    } else if args.latency_only {
        "cli_latency"
    } else if args.drain_only {
        "cli_drain"
    } else if args.write_path_only {
        "cli_write_path"
    } else {
        DATABASE
    }
}

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

    progress(format!("latency floor (a LISTEN client, the same commits), {} samples", args.samples));
    let floor = latency(WakePath::Floor, args.samples).await?;
    progress(format!("latency (NOTIFY), {} samples", args.samples));
    let notify = latency(WakePath::Notify, args.samples).await?;
    progress(format!("latency (NOTIFY, the fast path off: claim first), {} samples", args.samples));
    let notify_claim_first = latency(WakePath::NotifyClaimFirst, args.samples).await?;
    progress(format!("latency (in-process), {} samples", args.samples));
    let in_process = latency(WakePath::InProcess, args.samples).await?;
    let poll = WakePath::Poll(POLL_INTERVAL);
    progress(format!("latency ({poll}), {} samples", args.poll_samples()));
    let poll = latency(poll, args.poll_samples()).await?;

    let setup = drain_setup(args);
    progress(drain_step(args));
    let drains = drain_rounds(args, &outbox).await?;
    progress("drain, delivered events removed as the drain goes (retention 0)".to_string());
    let removed_drain = bench::drain_throughput(&outbox, DrainSetup { retention: Duration::ZERO, ..setup }).await?;
    progress(format!("drain, the events over {KEYS} keys (each key in order)"));
    let keyed_drain = bench::drain_throughput(&outbox, DrainSetup { keys: Some(KEYS), ..setup }).await?;

    progress(receivers_step(args));
    let receivers = bench::receivers(&outbox, args.receiver_stage()).await?;
    progress(sinks::step(args));
    let sinks = sinks::stage(args, &outbox).await?;

    progress(format!(
        "a trickle: {TRICKLE_RATE} events/s for {} to an `outbox-relay run --sink stdout` process ({})",
        humantime::format_duration(args.trickle_duration),
        relay_settings(args)
    ));
    outbox.connection().await?.batch_execute("truncate outbox_relay.outbox").await?;
    let trickle = bench::trickle(
        &outbox,
        relay_command(args, &outbox)?,
        Trickle { rate: TRICKLE_RATE, duration: args.trickle_duration },
    )
    .await?;
    let trickle_latency =
        Percentiles::from_samples(&mut trickle.latencies.clone()).ok_or("the trickle delivered nothing")?;

    let seconds = args.write_duration.as_secs_f64();
    progress(format!(
        "write throughput, {WRITERS} writers, {seconds} s each: the trigger as shipped (no relay waiting), every commit sending NOTIFY, the trigger dropped; alternately, {ROUNDS} rounds"
    ));
    let (mut trigger, mut notify_all, mut none) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        trigger.push(bench::write_tps(&outbox, WRITERS, args.write_duration, NotifyMode::Trigger).await?);
        notify_all.push(bench::write_tps(&outbox, WRITERS, args.write_duration, NotifyMode::NotifyEveryCommit).await?);
        none.push(bench::write_tps(&outbox, WRITERS, args.write_duration, NotifyMode::NoTrigger).await?);
    }
    let (tps_trigger, tps_notify_every_commit, tps_no_trigger) =
        (median(&mut trigger), median(&mut notify_all), median(&mut none));
    progress(held_step(args));
    let held = held_stage(args, &outbox).await?;
    outbox.pool().close();

    Ok(Report {
        server: server.describe(),
        embedded: server.is_embedded(),
        info,
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        floor,
        notify,
        notify_claim_first,
        in_process,
        poll,
        drains,
        removed_drain,
        keyed_drain,
        receivers,
        sinks,
        trickle,
        trickle_latency,
        tps_trigger,
        tps_notify_every_commit,
        tps_no_trigger,
        held,
    })
}

/// The drain's figures: the relay and the loops it is compared with, medians of [`ROUNDS`]
/// alternating rounds.
struct Drains {
    /// The relay's drain with the given workers and batch.
    drain: f64,
    /// The claim-and-delete loop, [`REFERENCE_LOOP`]'s clients and batch.
    claim_delete: f64,
    /// The same loop with the drain's workers and batch size.
    claim_delete_alike: f64,
    /// The floor: one client reading the events in id order, the drain's batch size, one row
    /// written per batch and none per event ([`bench::ReadLoop`]).
    read_floor: f64,
}

/// The relay's drain setup: `args`' events, workers and batch, its defaults otherwise.
fn drain_setup(args: &BenchArgs) -> DrainSetup {
    DrainSetup {
        events: args.events,
        workers: args.workers,
        batch_size: args.batch_size,
        ..DrainSetup::defaults(args.events)
    }
}

fn drain_step(args: &BenchArgs) -> String {
    let (clients, batch) = REFERENCE_LOOP;
    format!(
        "drain: {} events, the relay ({} workers, batch {}, otherwise its defaults), the bare claim-and-delete loop ({clients} clients, batch {batch}; and {} clients, batch {}) and the floor (one client reading them, batch {}, no write per event), alternately, {ROUNDS} rounds",
        args.events, args.workers, args.batch_size, args.workers, args.batch_size, args.batch_size
    )
}

/// The drain and its references in alternating rounds.
async fn drain_rounds(args: &BenchArgs, outbox: &pg_outbox_relay::Outbox) -> Result<Drains, BenchError> {
    let setup = drain_setup(args);
    let (clients, batch) = REFERENCE_LOOP;
    let reference = ClaimDeleteLoop { events: args.events, clients, batch };
    let alike = ClaimDeleteLoop { events: args.events, clients: args.workers, batch: args.batch_size };
    let read = ReadLoop { events: args.events, batch: args.batch_size };
    let (mut drains, mut loops, mut alikes, mut reads) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        loops.push(rate(args.events, bench::claim_delete_time(outbox, reference).await?));
        drains.push(rate(args.events, bench::drain_time(outbox, setup).await?));
        reads.push(rate(args.events, bench::read_loop_time(outbox, read).await?));
        alikes.push(rate(args.events, bench::claim_delete_time(outbox, alike).await?));
    }
    Ok(Drains {
        drain: median(&mut drains),
        claim_delete: median(&mut loops),
        claim_delete_alike: median(&mut alikes),
        read_floor: median(&mut reads),
    })
}

fn drains_json(d: &Drains) -> serde_json::Value {
    json!({
        "drain_events_per_s": rounded(d.drain, 1),
        "claim_delete_loop_rows_per_s": rounded(d.claim_delete, 1),
        "claim_delete_loop_clients": REFERENCE_LOOP.0,
        "claim_delete_loop_batch": REFERENCE_LOOP.1,
        "drain_share_of_claim_delete_loop": rounded(d.drain / d.claim_delete, 3),
        "claim_delete_loop_alike_rows_per_s": rounded(d.claim_delete_alike, 1),
        "drain_share_of_claim_delete_loop_alike": rounded(d.drain / d.claim_delete_alike, 3),
        "read_floor_events_per_s": rounded(d.read_floor, 1),
        "drain_share_of_read_floor": rounded(d.drain / d.read_floor, 3),
        "read_floor_share_of_claim_delete_loop": rounded(d.read_floor / d.claim_delete, 3),
    })
}

fn print_drains(args: &BenchArgs, d: &Drains) {
    out!("drain of {} events, {} workers, batch {} (medians of {ROUNDS}):", args.events, args.workers, args.batch_size);
    out!("  {:<52}{:>10} events/s", "the relay (keeping delivered events: the default)", grouped(d.drain));
    let (clients, batch) = REFERENCE_LOOP;
    out!(
        "  {:<52}{:>10} rows/s",
        format!("the bare claim-and-delete loop, {clients} clients, batch {batch}"),
        grouped(d.claim_delete)
    );
    out!("  the relay drains at {:.0} % of that loop's rate", d.drain / d.claim_delete * 100.0);
    out!(
        "  {:<52}{:>10} rows/s",
        format!("the same loop, {} clients, batch {}", args.workers, args.batch_size),
        grouped(d.claim_delete_alike)
    );
    out!("  the relay drains at {:.0} % of that loop's rate", d.drain / d.claim_delete_alike * 100.0);
    out!(
        "  {:<52}{:>10} rows/s",
        format!("the floor: one client reading them, batch {}", args.batch_size),
        grouped(d.read_floor)
    );
    out!(
        "  the relay drains at {:.0} % of the floor; the floor is {:.0} % of the claim-and-delete loop",
        d.drain / d.read_floor * 100.0,
        d.read_floor / d.claim_delete * 100.0
    );
}

/// Writers of the write-path stage.
const ARTICLE_CLIENTS: [usize; 3] = [1, 4, 16];

/// The article's transaction three ways: commits a second by writers and way, medians of
/// [`ROUNDS`] alternating rounds, and the CPU each way spent per commit over its rounds.
struct ArticleReport {
    rows: Vec<ArticleRow>,
}

/// One number of writers: `[plain tables, SQL functions, Rust unit of work]`.
struct ArticleRow {
    writers: usize,
    tps: [f64; 3],
    cpu: [CommitCpu; 3],
}

/// CPU time per committed transaction, in microseconds: PostgreSQL's processes, this process
/// (the writers' client side), and the whole machine (both, and whatever else ran).
#[derive(Clone, Copy, Default)]
struct CommitCpu {
    postgres: f64,
    client: f64,
    machine: Option<f64>,
}

impl CommitCpu {
    fn of(runs: &[bench::ArticleRun]) -> CommitCpu {
        let mut profile = bench::CpuProfile::default();
        for run in runs {
            profile.add(&run.cpu);
        }
        let commits = runs.iter().map(|run| run.commits).sum::<u64>().max(1) as f64;
        let per_commit = |cpu: Duration| cpu.as_secs_f64() * 1e6 / commits;
        CommitCpu {
            postgres: per_commit(profile.of("postgres")),
            client: per_commit(profile.this_process),
            machine: profile.machine.map(per_commit),
        }
    }

    fn json(self) -> serde_json::Value {
        json!({
            "postgres_us": rounded(self.postgres, 1),
            "client_us": rounded(self.client, 1),
            "machine_us": self.machine.map(|m| rounded(m, 1)),
        })
    }
}

fn article_step(args: &BenchArgs) -> String {
    format!(
        "the article's transaction (order, audit entry, receipt, one keyed event) on its plain tables, through the SQL functions and through the Rust unit of work, {ARTICLE_CLIENTS:?} writers, {} each, alternately, {ROUNDS} rounds",
        humantime::format_duration(args.write_duration)
    )
}

async fn article_rounds(args: &BenchArgs, outbox: &pg_outbox_relay::Outbox) -> Result<ArticleReport, BenchError> {
    let mut rows = Vec::new();
    for writers in ARTICLE_CLIENTS {
        let mut runs: [Vec<bench::ArticleRun>; 3] = Default::default();
        for _ in 0..ROUNDS {
            for (i, way) in bench::Way::ALL.into_iter().enumerate() {
                runs[i].push(bench::article_run(outbox, way, writers, args.write_duration).await?);
            }
        }
        let tps = runs.each_ref().map(|runs| median(&mut runs.iter().map(|run| run.tps).collect::<Vec<_>>()));
        let cpu = runs.each_ref().map(|runs| CommitCpu::of(runs));
        rows.push(ArticleRow { writers, tps, cpu });
    }
    Ok(ArticleReport { rows })
}

fn article_json(r: &ArticleReport) -> serde_json::Value {
    let rows: Vec<serde_json::Value> = r
        .rows
        .iter()
        .map(|ArticleRow { writers, tps: [plain, sql, rust], cpu: [plain_cpu, sql_cpu, rust_cpu] }| {
            json!({
                "writers": writers,
                "plain_tables_tps": rounded(*plain, 1),
                "sql_functions_tps": rounded(*sql, 1),
                "rust_unit_of_work_tps": rounded(*rust, 1),
                "sql_functions_share_of_plain": rounded(sql / plain, 3),
                "rust_unit_of_work_share_of_plain": rounded(rust / plain, 3),
                "cpu_per_commit": {
                    "plain_tables": plain_cpu.json(),
                    "sql_functions": sql_cpu.json(),
                    "rust_unit_of_work": rust_cpu.json(),
                },
            })
        })
        .collect();
    json!({ "article_transaction": rows })
}

fn print_article(r: &ArticleReport) {
    out!("the article's transaction, commits a second (medians of {ROUNDS}):");
    out!("  {:>8}{:>14}{:>22}{:>22}", "writers", "plain tables", "SQL functions", "Rust unit of work");
    for ArticleRow { writers, tps: [plain, sql, rust], .. } in &r.rows {
        out!(
            "  {writers:>8}{:>14}{:>14} ({:>3.0} %){:>14} ({:>3.0} %)",
            grouped(*plain),
            grouped(*sql),
            sql / plain * 100.0,
            grouped(*rust),
            rust / plain * 100.0
        );
    }
    out!("CPU per commit, microseconds: PostgreSQL + this process (the whole machine):");
    out!("  {:>8}{:>22}{:>22}{:>22}", "writers", "plain tables", "SQL functions", "Rust unit of work");
    let cell = |c: &CommitCpu| {
        let machine = c.machine.map_or_else(|| "?".to_string(), |m| format!("{m:.0}"));
        format!("{:.0} + {:.0} ({machine})", c.postgres, c.client)
    };
    for ArticleRow { writers, cpu, .. } in &r.rows {
        out!("  {writers:>8}{:>22}{:>22}{:>22}", cell(&cpu[0]), cell(&cpu[1]), cell(&cpu[2]));
    }
}

/// The latency paths the latency stage measures, in the order of a round.
const LATENCY_PATHS: [WakePath; 4] =
    [WakePath::Floor, WakePath::Notify, WakePath::NotifyClaimFirst, WakePath::InProcess];

/// Each latency path's percentiles, one per round.
type LatencyRounds = Vec<(WakePath, Vec<Percentiles>)>;

/// [`LATENCY_PATHS`] in alternating rounds, `args.samples` each.
async fn latency_rounds(args: &BenchArgs, outbox: &pg_outbox_relay::Outbox) -> Result<LatencyRounds, BenchError> {
    let mut rounds: LatencyRounds = LATENCY_PATHS.iter().map(|path| (*path, Vec::new())).collect();
    for round in 0..ROUNDS {
        for (path, taken) in &mut rounds {
            eprintln!("  round {}/{ROUNDS}: {path}", round + 1);
            let mut samples = bench::latency(outbox, *path, args.samples).await?;
            taken.push(Percentiles::from_samples(&mut samples).ok_or("no latency samples were taken")?);
        }
    }
    Ok(rounds)
}

/// The median over rounds of one percentile.
fn median_of(rounds: &[Percentiles], pick: impl Fn(&Percentiles) -> Duration) -> Duration {
    let mut values: Vec<Duration> = rounds.iter().map(pick).collect();
    values.sort_unstable();
    values[values.len() / 2]
}

fn latency_rounds_json(rounds: &LatencyRounds) -> serde_json::Value {
    let floor = &rounds[0].1;
    let (floor_p50, floor_p99) = (median_of(floor, |p| p.p50), median_of(floor, |p| p.p99));
    let paths: Vec<serde_json::Value> = rounds
        .iter()
        .map(|(path, taken)| {
            let (p50, p99) = (median_of(taken, |p| p.p50), median_of(taken, |p| p.p99));
            json!({
                "path": path.to_string(),
                "p50_ms_rounds": taken.iter().map(|p| ms(p.p50)).collect::<Vec<_>>(),
                "p99_ms_rounds": taken.iter().map(|p| ms(p.p99)).collect::<Vec<_>>(),
                "p50_ms": ms(p50),
                "p99_ms": ms(p99),
                "p50_above_floor_ms": rounded(ms(p50) - ms(floor_p50), 3),
                "p99_above_floor_ms": rounded(ms(p99) - ms(floor_p99), 3),
            })
        })
        .collect();
    json!({ "latency_rounds": ROUNDS, "latency": paths })
}

fn print_latency_rounds(args: &BenchArgs, rounds: &LatencyRounds) {
    let floor = &rounds[0].1;
    let (floor_p50, floor_p99) = (median_of(floor, |p| p.p50), median_of(floor, |p| p.p99));
    out!(
        "latency, commit to handler: {} samples a path and round, medians of {ROUNDS} rounds (each round's in brackets)",
        args.samples
    );
    out!("{:<28}{:>30}{:>30}{:>26}", "", "p50", "p99", "above the floor p50/p99");
    for (path, taken) in rounds {
        let (p50, p99) = (median_of(taken, |p| p.p50), median_of(taken, |p| p.p99));
        let each = |pick: fn(&Percentiles) -> Duration| {
            taken.iter().map(|p| format!("{:.2}", ms(pick(p)))).collect::<Vec<_>>().join(" ")
        };
        let above = if *path == WakePath::Floor {
            String::new()
        } else {
            format!("+{} / +{}", format_ms(p50.saturating_sub(floor_p50)), format_ms(p99.saturating_sub(floor_p99)))
        };
        out!(
            "  {:<26}{:>30}{:>30}{above:>26}",
            path.to_string(),
            format!("{} [{}]", format_ms(p50), each(|p| p.p50)),
            format!("{} [{}]", format_ms(p99), each(|p| p.p99)),
        );
    }
}

/// How far a path's p50 and p99 lie above the floor's, in milliseconds.
fn above_floor_json(p: &Percentiles, floor: &Percentiles) -> serde_json::Value {
    let ms = |a: Duration, b: Duration| rounded((a.as_secs_f64() - b.as_secs_f64()) * 1000.0, 3);
    json!({ "p50": ms(p.p50, floor.p50), "p99": ms(p.p99, floor.p99) })
}

fn to_json(args: &BenchArgs, r: &Report) -> serde_json::Value {
    let share = |cpu: Option<Duration>| cpu.map(|cpu| rounded(r.trickle.share(cpu), 4));
    let total = r.trickle.relay_and_backends_cpu();
    let figures = json!({
        "latency_floor_ms": percentiles_json(&r.floor),
        "latency_notify_ms": percentiles_json(&r.notify),
        "latency_notify_claim_first_ms": percentiles_json(&r.notify_claim_first),
        "latency_inprocess_ms": percentiles_json(&r.in_process),
        "latency_notify_above_floor_ms": above_floor_json(&r.notify, &r.floor),
        "latency_inprocess_above_floor_ms": above_floor_json(&r.in_process, &r.floor),
        "latency_notify_claim_first_above_floor_ms": above_floor_json(&r.notify_claim_first, &r.floor),
        "latency_poll_ms": percentiles_json(&r.poll),
        "drain_retention_0_events_per_s": rounded(r.removed_drain, 1),
        "drain_keyed_events_per_s": rounded(r.keyed_drain, 1),
        "drain_keys": KEYS,
        "trickle_events_per_s": TRICKLE_RATE,
        "relay_args": args.relay_args,
        "trickle_seconds": rounded(r.trickle.elapsed.as_secs_f64(), 3),
        "trickle_events": r.trickle.events,
        "trickle_latency_ms": percentiles_json(&r.trickle_latency),
        "trickle_relay_cpu_share": share(r.trickle.relay_cpu),
        "trickle_backend_cpu_share": share(r.trickle.backend_cpu),
        "trickle_cpu_share": share(total),
        "write_tps_trigger": rounded(r.tps_trigger, 1),
        "write_tps_no_trigger": rounded(r.tps_no_trigger, 1),
        "write_tps_notify_every_commit": rounded(r.tps_notify_every_commit, 1),
        "write_trigger_share_of_no_trigger": rounded(r.tps_trigger / r.tps_no_trigger, 3),
    });
    // (two objects: one would be too deep for the json! macro)
    let settings = json!({
        "events": args.events,
        "workers": args.workers,
        "batch_size": args.batch_size,
        "retention": humantime::format_duration(pg_outbox_relay::RelayConfig::DEFAULT_RETENTION).to_string(),
        "rounds": ROUNDS,
        "latency_samples": args.samples,
        "latency_poll_samples": args.poll_samples(),
        "poll_interval_ms": ms(POLL_INTERVAL),
        "write_writers": WRITERS,
        "write_seconds": args.write_duration.as_secs_f64(),
        "cores": r.cores,
    });
    merged([
        figures,
        settings,
        server_json(r.embedded, &r.info),
        held_json(args, &r.held),
        drains_json(&r.drains),
        receivers_json(&r.receivers),
        r.sinks.json(),
    ])
}

/// The members of JSON objects in one object.
fn merged<const N: usize>(objects: [serde_json::Value; N]) -> serde_json::Value {
    let mut all = serde_json::Map::new();
    for object in objects {
        if let serde_json::Value::Object(members) = object {
            all.extend(members);
        }
    }
    serde_json::Value::Object(all)
}

/// The server a run measured on, as the JSON reports it.
fn server_json(embedded: bool, info: &ServerInfo) -> serde_json::Value {
    json!({
        "server": if embedded { "embedded" } else { "external" },
        "fsync": info.fsync,
        "synchronous_commit": info.synchronous_commit,
        "postgres_version": info.version,
    })
}

/// The table's first lines: the server a run measured on (and the machine's cores, when known).
fn print_server(server: &str, info: &ServerInfo, cores: Option<usize>) {
    out!("outbox-relay bench on the {server}");
    let cores = cores.map(|n| format!(", {n} cores")).unwrap_or_default();
    out!("PostgreSQL {}, fsync {}, synchronous_commit {}{cores}", info.version, info.fsync, info.synchronous_commit);
    out!();
}

fn print_table(args: &BenchArgs, r: &Report) {
    print_server(&r.server, &r.info, Some(r.cores));
    out!(
        "{:<28}{:>8}{:>11}{:>11}{:>11}{:>11}{:>22}",
        "latency, commit to handler",
        "samples",
        "p50",
        "p90",
        "p99",
        "max",
        "above the floor p50/p99"
    );
    let rows = [
        ("floor (a LISTEN client)", args.samples, &r.floor),
        ("NOTIFY", args.samples, &r.notify),
        ("NOTIFY, claim first", args.samples, &r.notify_claim_first),
        ("in-process", args.samples, &r.in_process),
        ("poll 100ms", args.poll_samples(), &r.poll),
    ];
    for (name, samples, p) in rows {
        let above = if std::ptr::eq(p, &r.floor) {
            String::new()
        } else {
            format!(
                "+{} / +{}",
                format_ms(p.p50.saturating_sub(r.floor.p50)),
                format_ms(p.p99.saturating_sub(r.floor.p99))
            )
        };
        out!(
            "  {name:<26}{samples:>8}{:>11}{:>11}{:>11}{:>11}{above:>22}",
            format_ms(p.p50),
            format_ms(p.p90),
            format_ms(p.p99),
            format_ms(p.max)
        );
    }
    out!();
    print_drains(args, &r.drains);
    out!("  {:<52}{:>10} events/s", "the relay, removing them as it goes (retention 0)", grouped(r.removed_drain));
    out!(
        "  {:<52}{:>10} events/s",
        format!("the relay, over {KEYS} keys, each in order (one run)"),
        grouped(r.keyed_drain)
    );
    out!();
    print_receivers(&r.receivers);
    out!();
    r.sinks.print();
    out!();
    let t = &r.trickle;
    out!(
        "a trickle: {TRICKLE_RATE} events/s for {:.1} s ({} events) to an `outbox-relay run` process, {}:",
        t.elapsed.as_secs_f64(),
        t.events,
        relay_settings(args)
    );
    let percent = |cpu: Option<Duration>| {
        cpu.map_or_else(|| "unknown".to_string(), |cpu| format!("{:.1} %", t.share(cpu) * 100.0))
    };
    out!(
        "  CPU, share of one core: the relay process {}, its PostgreSQL backends {}, together {}",
        percent(t.relay_cpu),
        percent(t.backend_cpu),
        percent(t.relay_and_backends_cpu())
    );
    out!(
        "  latency, commit to the event's line on the relay's stdout: p50 {}, p90 {}, p99 {}, max {}",
        format_ms(r.trickle_latency.p50),
        format_ms(r.trickle_latency.p90),
        format_ms(r.trickle_latency.p99),
        format_ms(r.trickle_latency.max)
    );
    out!();
    out!(
        "write throughput ({WRITERS} writers, full transaction, {} s each, medians of {ROUNDS}):",
        args.write_duration.as_secs_f64()
    );
    out!("  {:<40}{:>12} tx/s", "trigger as shipped (no relay waiting)", grouped(r.tps_trigger));
    out!("  {:<40}{:>12} tx/s", "NOTIFY on every commit (relay waiting)", grouped(r.tps_notify_every_commit));
    out!("  {:<40}{:>12} tx/s", "trigger dropped", grouped(r.tps_no_trigger));
    if r.tps_no_trigger > 0.0 {
        out!(
            "  with the trigger, writers keep {:.1} % of the trigger-less rate; notifying every commit would keep {:.1} %",
            r.tps_trigger / r.tps_no_trigger * 100.0,
            r.tps_notify_every_commit / r.tps_no_trigger * 100.0
        );
    }
    out!();
    print_held(args, &r.held);
}

/// What a row's receiver is, for the table and the JSON.
fn receiver_name(row: &bench::Row) -> String {
    let name = match row.receiver {
        ReceiverKind::Small => format!(
            "small (one at a time, backlog {}, {})",
            bench::SMALL_BACKLOG,
            humantime::format_duration(bench::SMALL_PACE)
        ),
        ReceiverKind::Slow => format!("answers in {}", humantime::format_duration(bench::SLOW_LATENCY)),
        ReceiverKind::RateLimited => format!("429 past {}/s", bench::LIMITED_RATE),
        ReceiverKind::Late => format!("opens {} late", humantime::format_duration(bench::LATE_BY)),
    };
    match row.keys {
        Some(keys) => format!("{name}, {keys} keys"),
        None => name,
    }
}

/// The defaults' time over the best fixed limit's at the small receiver (medians of the rounds).
fn small_ratio(r: &ReceiversReport) -> Option<f64> {
    let defaults = r.row(ReceiverKind::Small, Settings::Defaults, None)?;
    let best = r.row(ReceiverKind::Small, Settings::Fixed(r.small_best), None)?;
    Some(defaults.run.elapsed.as_secs_f64() / best.run.elapsed.as_secs_f64())
}

fn print_receivers(r: &ReceiversReport) {
    out!("HTTP receivers (fixed N: --fixed-concurrency --concurrency N; twice: events the receiver accepted again):");
    out!(
        "  {:<42}{:<24}{:>7}{:>10}{:>10}{:>7}{:>7}{:>9}{:>7}",
        "receiver",
        "settings",
        "events",
        "time",
        "events/s",
        "twice",
        "429s",
        "breaker",
        "limit"
    );
    for row in &r.rows {
        let settings = match row.rounds {
            1 => row.settings.to_string(),
            n => format!("{} (median of {n})", row.settings),
        };
        let run = &row.run;
        out!(
            "  {:<42}{settings:<24}{:>7}{:>10}{:>10}{:>7}{:>7}{:>9}{:>7}",
            receiver_name(row),
            grouped(row.events as f64),
            format!("{:.2} s", run.elapsed.as_secs_f64()),
            grouped(run.rate(row.events)),
            run.counts.redelivered,
            run.counts.too_many,
            run.metrics.breaker_opens,
            run.metrics.delivery_limit,
        );
    }
    out!("  (breaker: times the outage breaker opened; limit: the concurrency limit at the end)");
    if let Some(ratio) = small_ratio(r) {
        out!(
            "  at the small receiver the defaults take {ratio:.2}x the time of the best fixed limit ({}); goal: at most 1.25x",
            r.small_best
        );
    }
    out!(
        "  the late receiver had all its events {:.2} s after it opened; goal: within 1 s",
        r.late_after_opening.as_secs_f64()
    );
}

/// The receivers stage's figures.
fn receivers_json(r: &ReceiversReport) -> serde_json::Value {
    let rows: Vec<_> = r
        .rows
        .iter()
        .map(|row| {
            let settings = match row.settings {
                Settings::Defaults => json!({"settings": "defaults"}),
                Settings::Fixed(limit) => json!({"settings": "fixed", "concurrency": limit}),
                Settings::RateLimit(rate) => json!({"settings": "rate_limit", "rate_limit_per_s": rate}),
            };
            let run = &row.run;
            merged([
                json!({
                    "receiver": receiver_name(row),
                    "events": row.events,
                    "keys": row.keys,
                    "rounds": row.rounds,
                    "seconds": rounded(run.elapsed.as_secs_f64(), 3),
                    "events_per_s": rounded(run.rate(row.events), 1),
                    "redelivered": run.counts.redelivered,
                    "answered_429": run.counts.too_many,
                    "retried": run.metrics.retried,
                    "breaker_opens": run.metrics.breaker_opens,
                    "limit_at_end": run.metrics.delivery_limit,
                }),
                settings,
            ])
        })
        .collect();
    json!({
        "receivers": rows,
        "receivers_small_best_fixed": r.small_best,
        "receivers_small_defaults_over_best_fixed": small_ratio(r).map(|v| rounded(v, 3)),
        "receivers_late_after_opening_s": rounded(r.late_after_opening.as_secs_f64(), 3),
    })
}
