//! The held-snapshot stage of `outbox-relay bench`: how it is described, run, printed and
//! written as JSON. Each phase is reported whole and by its worst 10 s window (the highest p99),
//! so that an episode of a minute inside a phase of several shows.

use std::time::Duration;

use pg_outbox_relay_bench as bench;
use pg_outbox_relay_bench::{HeldReport, HeldSnapshot, Percentiles};
use serde_json::json;

use super::common::{
    BenchArgs, BenchError, format_ms, grouped, latencies, ms, percentiles_json, relay_command, relay_settings, rounded,
};

/// The shortest phase of `--held-long`: a hold of minutes is what showed the costs that grow
/// with it (issue 39: from 2.5 minutes on).
pub(super) const LONG_PHASE: Duration = Duration::from_secs(5 * 60);

/// How long each phase lasts: `--held-duration`, at least [`LONG_PHASE`] with `--held-long`.
pub(super) fn phase_length(args: &BenchArgs) -> Duration {
    if args.held_long { args.held_duration.max(LONG_PHASE) } else { args.held_duration }
}

pub(super) fn held_step(args: &BenchArgs) -> String {
    let phase = humantime::format_duration(phase_length(args));
    format!(
        "held snapshot: {} events/s, a key each, to an `outbox-relay run --sink stdout` process ({}), {phase} with nothing held, then {phase} with a transaction held open{}",
        args.held_rate,
        relay_settings(args),
        args.held_slot_span
            .map(|span| format!(", the outbox's slots {} each", humantime::format_duration(span)))
            .unwrap_or_default(),
    )
}

/// Runs the held-snapshot stage on an emptied outbox.
pub(super) async fn held_stage(args: &BenchArgs, outbox: &pg_outbox_relay::Outbox) -> Result<HeldReport, BenchError> {
    let db = outbox.connection().await?;
    for sql in ["truncate outbox_relay.outbox", "vacuum analyze outbox_relay.outbox"] {
        db.batch_execute(sql).await.map_err(|e| match e.as_db_error() {
            Some(e) => format!("{sql}: {}", e.message()),
            None => format!("{sql}: {e}"),
        })?;
    }
    let span_was: Option<i32> = match args.held_slot_span {
        Some(span) => {
            let was = db
                .query_one("select seconds from outbox_relay.slot_span", &[])
                .await
                .map_err(|e| format!("reading the outbox's slot span: {e}"))?
                .get(0);
            set_slot_span(&db, i32::try_from(span.as_secs()).unwrap_or(i32::MAX)).await?;
            Some(was)
        }
        None => None,
    };
    let held = bench::held_snapshot(
        outbox,
        relay_command(args, outbox)?,
        HeldSnapshot { rate: args.held_rate, phase: phase_length(args) },
    )
    .await;
    if let Some(was) = span_was {
        set_slot_span(&db, was).await?;
    }
    held
}

/// `outbox_relay.set_slot_span`: the span of the outbox's slots, in seconds, for the
/// transactions that start from now on.
async fn set_slot_span(db: &tokio_postgres::Client, seconds: i32) -> Result<(), BenchError> {
    db.execute("select outbox_relay.set_slot_span($1)", &[&seconds]).await.map_err(|e| {
        format!(
            "setting the outbox's slot span to {seconds} s: {}",
            e.as_db_error().map_or(e.to_string(), |d| d.message().to_string())
        )
    })?;
    Ok(())
}

/// A window's figures as JSON.
fn window_json(w: &bench::Window) -> serde_json::Value {
    json!({
        "from_seconds": rounded(w.from.as_secs_f64(), 1),
        "seconds": rounded(w.elapsed.as_secs_f64(), 3),
        "published_per_s": rounded(w.published as f64 / w.elapsed.as_secs_f64(), 1),
        "delivered_per_s": rounded(w.delivered as f64 / w.elapsed.as_secs_f64(), 1),
        "latency_ms": w.percentiles().as_ref().map(percentiles_json),
        "backlog_max": w.backlog_max,
        "relay_cpu_share": w.relay_cpu.map(|cpu| rounded(w.share(cpu), 4)),
        "machine_cpu_share": w.machine_cpu.map(|cpu| rounded(w.share(cpu), 4)),
    })
}

/// The held-snapshot stage's figures: each phase (whole, its worst window and every window), and
/// the ratios its goals are stated in, of the wholes and of the held phase's worst window
/// against the clear phase's whole.
pub(super) fn held_json(args: &BenchArgs, held: &HeldReport) -> serde_json::Value {
    let phase = |p: &bench::Phase| {
        let share = |cpu: Option<Duration>| cpu.map(|cpu| rounded(p.share(cpu), 4));
        json!({
            "seconds": rounded(p.elapsed.as_secs_f64(), 3),
            "published_per_s": rounded(p.per_second(p.published), 1),
            "delivered_per_s": rounded(p.per_second(p.delivered), 1),
            "latency_ms": latencies(p).as_ref().map(percentiles_json),
            "backlog_max": p.backlog_max,
            "backlog_end": p.backlog_end,
            "outbox_bytes": p.outbox_bytes,
            "relay_cpu_share": share(p.relay_cpu),
            "backend_cpu_share": share(p.backend_cpu),
            "relay_and_backends_cpu_share": share(p.relay_and_backends_cpu()),
            "machine_cpu_share": share(p.machine_cpu),
            "worst_window": p.worst_window().map(window_json),
            "windows": p.windows.iter().map(window_json).collect::<Vec<_>>(),
        })
    };
    let ratio = |held: Option<f64>, clear: Option<f64>| match (held, clear) {
        (Some(held), Some(clear)) if clear > 0.0 => Some(rounded(held / clear, 3)),
        _ => None,
    };
    let p50 = |p: &bench::Phase| latencies(p).map(|l| ms(l.p50));
    let p99 = |p: &bench::Phase| latencies(p).map(|l| ms(l.p99));
    let machine = |p: &bench::Phase| p.machine_cpu.map(|cpu| p.share(cpu));
    let worst = held.held.worst_window();
    let worst_p = worst.and_then(bench::Window::percentiles);
    json!({
        "held_rate": args.held_rate,
        "held_relay_args": args.relay_args,
        "held_slot_span_seconds": args.held_slot_span.map(|span| span.as_secs()),
        "held_writers": bench::HELD_WRITERS,
        "held_phase_seconds": phase_length(args).as_secs_f64(),
        "held_window_seconds": bench::HELD_WINDOW.as_secs_f64(),
        "held_clear": phase(&held.clear),
        "held_held": phase(&held.held),
        "held_p99_ratio": ratio(p99(&held.held), p99(&held.clear)),
        "held_machine_cpu_ratio": ratio(machine(&held.held), machine(&held.clear)),
        "held_worst_window_p50_ratio": ratio(worst_p.as_ref().map(|l| ms(l.p50)), p50(&held.clear)),
        "held_worst_window_p99_ratio": ratio(worst_p.as_ref().map(|l| ms(l.p99)), p99(&held.clear)),
        "held_worst_window_machine_cpu_ratio":
            ratio(worst.and_then(|w| w.machine_cpu.map(|cpu| w.share(cpu))), machine(&held.clear)),
        "held_backlog_max_seconds": rounded(held.held.backlog_max as f64 / args.held_rate, 3),
        "held_duplicates": held.duplicates,
    })
}

pub(super) fn print_held(args: &BenchArgs, held: &HeldReport) {
    out!(
        "{} events/s, a key each, from {} connections to an `outbox-relay run --sink stdout` process, {}, {} per phase:",
        args.held_rate,
        bench::HELD_WRITERS,
        relay_settings(args),
        humantime::format_duration(phase_length(args))
    );
    out!(
        "  {:<30}{:>12}{:>12}{:>11}{:>11}{:>10}{:>16}{:>10}",
        "phase",
        "published/s",
        "delivered/s",
        "p50",
        "p99",
        "backlog",
        "relay+backends",
        "machine"
    );
    let cell =
        |p: Option<&Percentiles>, f: fn(&Percentiles) -> Duration| p.map_or_else(|| "-".into(), |l| format_ms(f(l)));
    for (name, p) in [("nothing held", &held.clear), ("a transaction held", &held.held)] {
        let percent =
            |cpu: Option<Duration>| cpu.map_or_else(|| "?".to_string(), |cpu| format!("{:.0} %", p.share(cpu) * 100.0));
        let l = latencies(p);
        out!(
            "  {name:<30}{:>12}{:>12}{:>11}{:>11}{:>10}{:>16}{:>10}",
            grouped(p.per_second(p.published)),
            grouped(p.per_second(p.delivered)),
            cell(l.as_ref(), |l| l.p50),
            cell(l.as_ref(), |l| l.p99),
            format!("{}", p.backlog_max),
            percent(p.relay_and_backends_cpu()),
            percent(p.machine_cpu),
        );
        if let Some(w) = p.worst_window() {
            let percent = |cpu: Option<Duration>| {
                cpu.map_or_else(|| "?".to_string(), |cpu| format!("{:.0} %", w.share(cpu) * 100.0))
            };
            let l = w.percentiles();
            let name = format!("  worst {} s, from {} s", w.elapsed.as_secs(), w.from.as_secs());
            out!(
                "  {name:<30}{:>12}{:>12}{:>11}{:>11}{:>10}{:>16}{:>10}",
                grouped(w.published as f64 / w.elapsed.as_secs_f64()),
                grouped(w.delivered as f64 / w.elapsed.as_secs_f64()),
                cell(l.as_ref(), |l| l.p50),
                cell(l.as_ref(), |l| l.p99),
                format!("{}", w.backlog_max),
                format!("{} relay", percent(w.relay_cpu)),
                percent(w.machine_cpu),
            );
        }
    }
    out!(
        "  (backlog: the largest sampled; CPU as a share of one core; worst: the {} s window with the highest p99, \
         its CPU the relay's alone; events delivered twice: {})",
        bench::HELD_WINDOW.as_secs(),
        held.duplicates
    );
    out!(
        "  the outbox on disk at the end of each phase: {} with nothing held, {} with a transaction held (indexes and TOAST included)",
        format_bytes(held.clear.outbox_bytes),
        format_bytes(held.held.outbox_bytes)
    );
}

/// `bytes` in MB (or kB below one).
fn format_bytes(bytes: i64) -> String {
    if bytes < 1_000_000 { format!("{:.0} kB", bytes as f64 / 1e3) } else { format!("{:.1} MB", bytes as f64 / 1e6) }
}
