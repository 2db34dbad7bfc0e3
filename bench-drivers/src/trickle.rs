//! What a relay costs at a trickle: the CPU of an `outbox-relay run` process and of its
//! PostgreSQL backends while a writer commits events at a low, steady rate, and the latency from
//! each commit to the event's line on the relay's stdout.

use std::collections::HashMap;
use std::process::Stdio;
use std::time::{Duration, Instant};

use pg_outbox_relay::Outbox;
use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;
use tokio::sync::mpsc;

use super::cpu::process_cpu;
use super::latency::STATEMENT_TIMEOUT;
use super::{BoxError, db};

/// How long the relay gets to start and deliver a first event.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the last event may take to show up after the writer stopped.
const TAIL_TIMEOUT: Duration = Duration::from_secs(10);
/// Written before the measured window, so that connections and caches are warm.
const WARMUP: Duration = Duration::from_secs(1);

/// The rate and length of a trickle measurement.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Trickle {
    /// Events per second, one per transaction, evenly spaced.
    pub rate: f64,
    /// How long the measured window lasts.
    pub duration: Duration,
}

/// What a trickle measurement found.
#[derive(Debug, Clone)]
pub struct TrickleReport {
    /// Events committed in the window.
    pub events: usize,
    /// The window's length.
    pub elapsed: Duration,
    /// From just before each COMMIT to its event's line on the relay's stdout.
    pub latencies: Vec<Duration>,
    /// CPU time of the relay process in the window (`None` where `/proc` cannot tell).
    pub relay_cpu: Option<Duration>,
    /// CPU time of the relay's backends in the window (`None` when the server is not on this
    /// machine, or `/proc` cannot tell).
    pub backend_cpu: Option<Duration>,
}

impl TrickleReport {
    /// A CPU time as a share of one core over the window (0.04: 4 %).
    pub fn share(&self, cpu: Duration) -> f64 {
        cpu.as_secs_f64() / self.elapsed.as_secs_f64()
    }

    /// CPU time of the relay and its backends together, when both are known.
    pub fn relay_and_backends_cpu(&self) -> Option<Duration> {
        self.relay_cpu.zip(self.backend_cpu).map(|(relay, backends)| relay + backends)
    }
}

/// Starts `relay` (an `outbox-relay run --sink stdout` command for `outbox`'s database, with
/// stdout and stderr left to this function), writes events at `trickle.rate` from a separate
/// connection for a warm-up and then for `trickle.duration`, and measures. The outbox should be
/// empty; the relay is stopped with SIGTERM at the end.
pub async fn trickle(outbox: &Outbox, mut relay: Command, trickle: Trickle) -> Result<TrickleReport, BoxError> {
    if !(trickle.rate > 0.0 && trickle.rate <= 10_000.0) {
        return Err(
            format!("a trickle's rate is {}; it must be above 0 and at most 10000 events/s", trickle.rate).into()
        );
    }
    let (writer, writer_pid) = measuring_connection(outbox).await?;
    let publish = writer
        .prepare("select outbox_relay.publish('bench.trickle', $1::jsonb)")
        .await
        .map_err(db("preparing the publish statement"))?;
    let monitor = outbox.connection().await?;
    let own: Vec<i32> = vec![writer_pid, backend_pid(&monitor).await?];

    let mut child = relay.stdout(Stdio::piped()).stderr(Stdio::null()).kill_on_drop(true).spawn()?;
    let pid = child.id().ok_or("the relay exited at once")?;
    let mut lines = BufReader::new(child.stdout.take().ok_or("no stdout")?).lines();
    let (seen_tx, mut seen) = mpsc::unbounded_channel::<(i64, Instant)>();
    let reader = tokio::spawn(async move {
        while let Ok(Some(line)) = lines.next_line().await {
            let at = Instant::now();
            if let Some(id) = event_id(&line) {
                seen_tx.send((id, at)).ok();
            }
        }
    });

    // One event through first: the relay is up, listening and idle.
    let commit_one = async |n: u64| -> Result<(i64, Instant), BoxError> {
        writer.batch_execute("begin").await.map_err(db("starting a transaction"))?;
        let id: i64 = writer.query_one(&publish, &[&json!({"n": n})]).await.map_err(db("publishing"))?.get(0);
        let committing = Instant::now();
        writer.batch_execute("commit").await.map_err(db("committing"))?;
        Ok((id, committing))
    };
    let (first, _) = commit_one(0).await?;
    tokio::time::timeout(START_TIMEOUT, async {
        while let Some((id, _)) = seen.recv().await {
            if id == first {
                return;
            }
        }
    })
    .await
    .map_err(|_| "the relay delivered nothing within 30 s of starting")?;

    let interval = Duration::from_secs_f64(1.0 / trickle.rate);
    let mut committed: HashMap<i64, Instant> = HashMap::new();
    let mut n = 1;
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let warm_until = Instant::now() + WARMUP;
    while Instant::now() < warm_until {
        tick.tick().await;
        commit_one(n).await?;
        n += 1;
    }
    let relay_before = process_cpu(pid);
    let backends_before = backend_cpu(&monitor, &own).await?;
    let started = Instant::now();
    while started.elapsed() < trickle.duration {
        tick.tick().await;
        let (id, at) = commit_one(n).await?;
        committed.insert(id, at);
        n += 1;
    }
    let elapsed = started.elapsed();
    let relay_after = process_cpu(pid);
    let backends_after = backend_cpu(&monitor, &own).await?;

    let mut latencies = Vec::with_capacity(committed.len());
    let deadline = Instant::now() + TAIL_TIMEOUT;
    while latencies.len() < committed.len() {
        match tokio::time::timeout(deadline.saturating_duration_since(Instant::now()), seen.recv()).await {
            Ok(Some((id, at))) => {
                if let Some(committing) = committed.get(&id) {
                    latencies.push(at.saturating_duration_since(*committing));
                }
            }
            Ok(None) => return Err("the relay stopped during the trickle".into()),
            Err(_) => {
                return Err(
                    format!("{} of {} events reached the relay's stdout", latencies.len(), committed.len()).into()
                );
            }
        }
    }
    stop_child(&mut child, pid, &monitor).await?;
    reader.abort();

    Ok(TrickleReport {
        events: committed.len(),
        elapsed,
        latencies,
        relay_cpu: cpu_spent(relay_before, relay_after),
        backend_cpu: backend_cpu_spent(backends_before, backends_after),
    })
}

/// The CPU spent between two readings of one CPU time (`None` when either is unknown).
pub(super) fn cpu_spent(before: Option<Duration>, after: Option<Duration>) -> Option<Duration> {
    Some(after?.saturating_sub(before?))
}

/// The CPU the backends spent between two readings of [`backend_cpu`] (a backend that started in
/// between counts whole).
pub(super) fn backend_cpu_spent(
    before: Option<HashMap<i32, Duration>>,
    after: Option<HashMap<i32, Duration>>,
) -> Option<Duration> {
    let (before, after) = (before?, after?);
    Some(after.iter().map(|(pid, cpu)| cpu.saturating_sub(before.get(pid).copied().unwrap_or_default())).sum())
}

/// A connection of the measurement's own (a writer, a session that holds a transaction), with
/// the benchmarks' statement timeout, and its backend's pid (left out of the relay's CPU).
pub(super) async fn measuring_connection(outbox: &Outbox) -> Result<(tokio_postgres::Client, i32), BoxError> {
    let client = outbox.url().connect().await?;
    client
        .batch_execute(&format!("set statement_timeout = '{STATEMENT_TIMEOUT}'"))
        .await
        .map_err(db("configuring a connection of the measurement"))?;
    let pid = backend_pid(&client).await?;
    Ok((client, pid))
}

/// The pid of a connection's backend.
pub(super) async fn backend_pid(client: &tokio_postgres::Client) -> Result<i32, BoxError> {
    Ok(client.query_one("select pg_backend_pid()", &[]).await.map_err(db("reading a backend's pid"))?.get(0))
}

/// The event id of a line of `outbox-relay run --sink stdout`, if it is one.
pub(super) fn event_id(line: &str) -> Option<i64> {
    serde_json::from_str::<serde_json::Value>(line).ok()?["id"].as_i64()
}

/// Stops the relay with SIGTERM, so that it removes its row (a row left marked waiting would make
/// the next measurement's writers notify); kills it and removes the row when it does not stop.
pub(super) async fn stop_child(
    child: &mut tokio::process::Child,
    pid: u32,
    monitor: &tokio_postgres::Client,
) -> Result<(), BoxError> {
    let stopped = std::process::Command::new("kill").args(["-TERM", &pid.to_string()]).status();
    if !stopped.is_ok_and(|status| status.success()) || tokio::time::timeout(TAIL_TIMEOUT, child.wait()).await.is_err()
    {
        child.kill().await.ok();
        monitor
            .execute(
                "delete from outbox_relay.relays where listener_pid not in (select pid from pg_stat_activity)",
                &[],
            )
            .await
            .map_err(db("removing the stopped relay's row"))?;
    }
    Ok(())
}

/// CPU time of each client backend of this database but `own` (autovacuum workers are not
/// counted), or `None` when they are not processes of this machine (a remote server). A backend
/// that ended since it was listed is left out.
pub(super) async fn backend_cpu(
    monitor: &tokio_postgres::Client,
    own: &[i32],
) -> Result<Option<HashMap<i32, Duration>>, BoxError> {
    let mut pids: Vec<i32> = monitor
        .query(
            "select pid from pg_stat_activity
              where datname = current_database() and backend_type = 'client backend' and pid <> pg_backend_pid()",
            &[],
        )
        .await
        .map_err(db("listing the relay's backends"))?
        .iter()
        .map(|row| row.get(0))
        .collect();
    pids.retain(|pid| !own.contains(pid));
    let mut cpu = HashMap::new();
    let listed = pids.len();
    for pid in pids {
        match std::fs::read_to_string(format!("/proc/{pid}/comm")) {
            Ok(comm) if comm.trim() == "postgres" => {}
            Ok(_) => return Ok(None), // another process of this machine: the server is elsewhere
            Err(_) => continue,       // gone since it was listed, or not of this machine
        }
        if let Some(time) = process_cpu(u32::try_from(pid)?) {
            cpu.insert(pid, time);
        }
    }
    if cpu.is_empty() && listed > 0 {
        return Ok(None); // none of them is a process of this machine
    }
    Ok(Some(cpu))
}
