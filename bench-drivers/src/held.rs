//! Delivery while a transaction elsewhere holds its snapshot: events published at a steady rate
//! with distinct keys to an `outbox-relay run --sink stdout` process, first with nothing held,
//! then with one session sitting in `begin; select txid_current();` (a report, `pg_dump`, a
//! forgotten `psql`). While that session is open, vacuum can remove no row version deleted or
//! updated after it began; a storage that lives on vacuum slows down phase after phase.
//!
//! Each phase reports what a user sees: events published and delivered per second, the latency
//! from each commit to the event's line on the relay's stdout, the backlog (published, not yet
//! on stdout) sampled every 100 ms, the relay's CPU and its backends' (from `/proc`), and the
//! whole machine's (`/proc/stat`, the writers and this process included).

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use pg_outbox_relay::Outbox;
use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;
use tokio::sync::Mutex;

use super::cpu::{machine_cpu, process_cpu};
use super::trickle::{
    backend_cpu, backend_cpu_spent, backend_pid, cpu_spent, event_id, measuring_connection, stop_child,
};
use super::{BoxError, db};

/// Connections that publish, each at an equal share of the rate.
pub const HELD_WRITERS: usize = 4;
/// How long the relay gets to deliver a first event.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the last events may take to show up once the writers stopped.
const TAIL_TIMEOUT: Duration = Duration::from_secs(120);
/// How often the backlog is sampled.
const SAMPLE_EVERY: Duration = Duration::from_millis(100);

/// How long each window of a phase lasts: a phase reports its worst window as well as its whole,
/// so that an episode of a minute inside a phase of ten shows.
pub const HELD_WINDOW: Duration = Duration::from_secs(10);

/// The rate and length of a held-snapshot measurement.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HeldSnapshot {
    /// Events per second, one per transaction, each with a key of its own.
    pub rate: f64,
    /// How long each phase lasts: first nothing held, then the snapshot held.
    pub phase: Duration,
}

/// One window of a phase ([`HELD_WINDOW`], the last one maybe shorter).
#[derive(Debug, Clone, Default)]
pub struct Window {
    /// From the phase's start to the window's start.
    pub from: Duration,
    /// The window's length.
    pub elapsed: Duration,
    /// Events committed in the window.
    pub published: usize,
    /// Event lines that reached the relay's stdout in the window (whenever committed).
    pub delivered: usize,
    /// From just before each COMMIT of the window to its event's line on stdout.
    pub latencies: Vec<Duration>,
    /// The largest backlog sampled in the window.
    pub backlog_max: usize,
    /// CPU time of the relay process in the window.
    pub relay_cpu: Option<Duration>,
    /// Busy CPU time of the whole machine in the window, all cores together.
    pub machine_cpu: Option<Duration>,
}

impl Window {
    /// The latencies' percentiles, when the window has any.
    pub fn percentiles(&self) -> Option<pg_outbox_relay::Percentiles> {
        pg_outbox_relay::Percentiles::from_samples(&mut self.latencies.clone())
    }

    /// A CPU time as a share of one core over the window.
    pub fn share(&self, cpu: Duration) -> f64 {
        cpu.as_secs_f64() / self.elapsed.as_secs_f64()
    }
}

/// What one phase found.
#[derive(Debug, Clone, Default)]
pub struct Phase {
    /// The phase's length.
    pub elapsed: Duration,
    /// Events committed in the phase.
    pub published: usize,
    /// Event lines that reached the relay's stdout in the phase (whenever committed).
    pub delivered: usize,
    /// From just before each COMMIT of the phase to its event's line on stdout.
    pub latencies: Vec<Duration>,
    /// The largest backlog sampled in the phase (published, not yet on stdout).
    pub backlog_max: usize,
    /// The last backlog sampled in the phase.
    pub backlog_end: usize,
    /// The outbox's size on disk at the phase's end, its indexes and TOAST included (bytes):
    /// what the relay's retention and vacuum leave of it.
    pub outbox_bytes: i64,
    /// CPU time of the relay process in the phase (`None` where `/proc` cannot tell).
    pub relay_cpu: Option<Duration>,
    /// CPU time of the relay's PostgreSQL backends in the phase (the writers' and the held
    /// session's excluded; `None` for a server on another machine).
    pub backend_cpu: Option<Duration>,
    /// Busy CPU time of the whole machine in the phase, all cores together.
    pub machine_cpu: Option<Duration>,
    /// The phase window by window, in order.
    pub windows: Vec<Window>,
}

impl Phase {
    /// The window whose p99 latency is the highest (the last, shorter one only when it is the
    /// only one).
    pub fn worst_window(&self) -> Option<&Window> {
        let full = self.windows.iter().filter(|w| w.elapsed >= HELD_WINDOW.mul_f64(0.9));
        let candidates: Vec<&Window> =
            if full.clone().next().is_some() { full.collect() } else { self.windows.iter().collect() };
        candidates.into_iter().max_by_key(|w| w.percentiles().map(|p| p.p99))
    }

    /// A CPU time as a share of one core over the phase (0.75: 75 %).
    pub fn share(&self, cpu: Duration) -> f64 {
        cpu.as_secs_f64() / self.elapsed.as_secs_f64()
    }

    /// CPU time of the relay and its backends together, when both are known.
    pub fn relay_and_backends_cpu(&self) -> Option<Duration> {
        self.relay_cpu.zip(self.backend_cpu).map(|(relay, backends)| relay + backends)
    }

    /// Events per second, of a count in this phase.
    pub fn per_second(&self, count: usize) -> f64 {
        count as f64 / self.elapsed.as_secs_f64()
    }
}

/// What the measurement found.
#[derive(Debug, Clone)]
pub struct HeldReport {
    /// The phase with nothing held.
    pub clear: Phase,
    /// The phase with the snapshot held.
    pub held: Phase,
    /// Events that reached stdout more than once (none should: nothing crashed).
    pub duplicates: usize,
}

/// A range of the committed events (their indexes in commit order).
type Committed = std::ops::Range<usize>;

/// Aborts the measurement's tasks when it ends early (an error): no writer goes on publishing
/// into a database the caller is about to drop.
#[derive(Default)]
struct Tasks(Vec<tokio::task::AbortHandle>);

impl Drop for Tasks {
    fn drop(&mut self) {
        self.0.iter().for_each(tokio::task::AbortHandle::abort);
    }
}

/// The counters the writers, the stdout reader and the sampler share.
#[derive(Default)]
struct Counters {
    published: AtomicUsize,
    delivered: AtomicUsize,
    /// The largest backlog since the last [`Counters::take_backlog_max`].
    backlog_max: AtomicUsize,
    backlog: AtomicUsize,
}

impl Counters {
    fn take_backlog_max(&self) -> usize {
        self.backlog_max.swap(self.backlog.load(Ordering::Relaxed), Ordering::Relaxed)
    }
}

/// Starts `relay` (an `outbox-relay run --sink stdout` command for `outbox`'s database), runs
/// both phases and measures. The outbox should be empty; the relay is stopped with SIGTERM at
/// the end.
pub async fn held_snapshot(outbox: &Outbox, mut relay: Command, setup: HeldSnapshot) -> Result<HeldReport, BoxError> {
    if !(setup.rate >= 1.0 && setup.rate <= 10_000.0) {
        return Err(format!("the rate is {}; it must be 1 to 10000 events/s", setup.rate).into());
    }
    let monitor = outbox.connection().await?;
    let mut own = vec![backend_pid(&monitor).await?];
    let mut writers = Vec::with_capacity(HELD_WRITERS);
    for _ in 0..HELD_WRITERS {
        let (writer, pid) = measuring_connection(outbox).await?;
        own.push(pid);
        writers.push(writer);
    }
    let (holder, holder_pid) = measuring_connection(outbox).await?;
    own.push(holder_pid);

    let mut child = relay.stdout(Stdio::piped()).stderr(Stdio::null()).kill_on_drop(true).spawn()?;
    let pid = child.id().ok_or("the relay exited at once")?;
    let counters = Arc::new(Counters::default());
    // Every delivered id with the instant its line arrived (a second arrival is a duplicate).
    let seen: Arc<Mutex<HashMap<i64, Instant>>> = Arc::default();
    let duplicates = Arc::new(AtomicUsize::new(0));
    let mut lines = BufReader::new(child.stdout.take().ok_or("no stdout")?).lines();
    let mut running = Tasks::default();
    let reader = tokio::spawn({
        let (seen, counters, duplicates) = (seen.clone(), counters.clone(), duplicates.clone());
        async move {
            while let Ok(Some(line)) = lines.next_line().await {
                let at = Instant::now();
                let Some(id) = event_id(&line) else {
                    continue;
                };
                match seen.lock().await.entry(id) {
                    std::collections::hash_map::Entry::Occupied(_) => {
                        duplicates.fetch_add(1, Ordering::Relaxed);
                    }
                    // The first arrival: its latency.
                    std::collections::hash_map::Entry::Vacant(first) => {
                        first.insert(at);
                        counters.delivered.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
    });

    running.0.push(reader.abort_handle());
    // Writers publish from the start; the relay must catch up at once.
    let committed: Arc<Mutex<Vec<(i64, Instant)>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::with_capacity(HELD_WRITERS);
    let period = Duration::from_secs_f64(HELD_WRITERS as f64 / setup.rate);
    for (w, writer) in writers.into_iter().enumerate() {
        let (counters, committed, stop) = (counters.clone(), committed.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let publish = writer
                .prepare("select outbox_relay.publish('bench.held', $1::jsonb, $2)")
                .await
                .map_err(db("preparing the publish statement"))?;
            tokio::time::sleep(period.mul_f64(w as f64 / HELD_WRITERS as f64)).await;
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut n = w as u64;
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                let key = format!("order-{n}");
                writer.batch_execute("begin").await.map_err(db("starting a transaction"))?;
                let id: i64 = writer
                    .query_one(&publish, &[&json!({"order": n, "total": 42.5}), &key])
                    .await
                    .map_err(db("publishing"))?
                    .get(0);
                let committing = Instant::now();
                writer.batch_execute("commit").await.map_err(db("committing"))?;
                committed.lock().await.push((id, committing));
                counters.published.fetch_add(1, Ordering::Relaxed);
                n += HELD_WRITERS as u64;
            }
            Ok::<_, BoxError>(())
        }));
        running.0.push(tasks.last().expect("just pushed").abort_handle());
    }
    let sampler = tokio::spawn({
        let counters = counters.clone();
        async move {
            let mut tick = tokio::time::interval(SAMPLE_EVERY);
            loop {
                tick.tick().await;
                let backlog = counters
                    .published
                    .load(Ordering::Relaxed)
                    .saturating_sub(counters.delivered.load(Ordering::Relaxed));
                counters.backlog.store(backlog, Ordering::Relaxed);
                counters.backlog_max.fetch_max(backlog, Ordering::Relaxed);
            }
        }
    });
    running.0.push(sampler.abort_handle());

    let started = Instant::now();
    while counters.delivered.load(Ordering::Relaxed) == 0 {
        if started.elapsed() > START_TIMEOUT {
            return Err(format!("the relay delivered nothing within {} s of starting", START_TIMEOUT.as_secs()).into());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // A second of warm-up, then the phases.
    tokio::time::sleep(Duration::from_secs(1)).await;
    // A phase: its figures, and the ranges of `committed` it and each of its windows cover.
    let phase = async || -> Result<(Phase, Committed, Vec<Committed>), BoxError> {
        let relay_before = process_cpu(pid);
        let backends_before = backend_cpu(&monitor, &own).await?;
        let machine_before = machine_cpu();
        let (published, delivered) =
            (counters.published.load(Ordering::Relaxed), counters.delivered.load(Ordering::Relaxed));
        counters.take_backlog_max();
        let began = Instant::now();
        let committed_from = committed.lock().await.len();
        let (mut windows, mut ranges) = (Vec::new(), Vec::new());
        let mut backlog_max = 0;
        while began.elapsed() < setup.phase {
            let from = began.elapsed();
            let (relay_at, machine_at) = (process_cpu(pid), machine_cpu());
            let (published_at, delivered_at) =
                (counters.published.load(Ordering::Relaxed), counters.delivered.load(Ordering::Relaxed));
            let committed_at = committed.lock().await.len();
            let started = Instant::now();
            tokio::time::sleep(HELD_WINDOW.min(setup.phase - from)).await;
            let window_backlog = counters.take_backlog_max();
            backlog_max = backlog_max.max(window_backlog);
            windows.push(Window {
                from,
                elapsed: started.elapsed(),
                published: counters.published.load(Ordering::Relaxed) - published_at,
                delivered: counters.delivered.load(Ordering::Relaxed) - delivered_at,
                latencies: Vec::new(),
                backlog_max: window_backlog,
                relay_cpu: cpu_spent(relay_at, process_cpu(pid)),
                machine_cpu: cpu_spent(machine_at, machine_cpu()),
            });
            ranges.push(committed_at..committed.lock().await.len());
        }
        let elapsed = began.elapsed();
        let relay_after = process_cpu(pid);
        let backends_after = backend_cpu(&monitor, &own).await?;
        let machine_after = machine_cpu();
        let committed_to = committed.lock().await.len();
        let outbox_bytes: i64 = monitor
            .query_one(
                // Its leaves' (migration 0024); a partitioned table has no storage of its own.
                "select coalesce(sum(pg_total_relation_size(i.inhrelid)), 0)::int8 from pg_inherits i
                  where i.inhparent = 'outbox_relay.outbox'::regclass",
                &[],
            )
            .await
            .map_err(db("reading the outbox's size"))?
            .get(0);
        let phase = Phase {
            elapsed,
            published: counters.published.load(Ordering::Relaxed) - published,
            delivered: counters.delivered.load(Ordering::Relaxed) - delivered,
            latencies: Vec::new(),
            backlog_max,
            backlog_end: counters.backlog.load(Ordering::Relaxed),
            outbox_bytes,
            relay_cpu: cpu_spent(relay_before, relay_after),
            backend_cpu: backend_cpu_spent(backends_before, backends_after),
            machine_cpu: cpu_spent(machine_before, machine_after),
            windows,
        };
        Ok((phase, committed_from..committed_to, ranges))
    };
    let (mut clear, clear_range, clear_windows) = phase().await?;
    holder
        .batch_execute("begin; select txid_current()")
        .await
        .map_err(db("opening the transaction that holds its snapshot"))?;
    let (mut held, held_range, held_windows) = phase().await?;
    holder.batch_execute("rollback").await.map_err(db("ending the held transaction"))?;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await??;
    }

    // Every committed event must reach stdout; then the latencies per phase.
    let committed = std::mem::take(&mut *committed.lock().await);
    let deadline = Instant::now() + TAIL_TIMEOUT;
    while counters.delivered.load(Ordering::Relaxed) < committed.len() {
        if Instant::now() > deadline {
            return Err(format!(
                "{} of {} events reached the relay's stdout within {} s of the writers stopping",
                counters.delivered.load(Ordering::Relaxed),
                committed.len(),
                TAIL_TIMEOUT.as_secs()
            )
            .into());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    sampler.abort();
    // Stopped before its output is read to the end, so that a line written on the way out (a
    // duplicate) is counted.
    stop_child(&mut child, pid, &monitor).await?;
    tokio::time::timeout(TAIL_TIMEOUT, reader)
        .await
        .map_err(|_| "the relay's stdout stayed open after it stopped")??;
    let seen = seen.lock().await;
    let latency = |range: std::ops::Range<usize>| -> Vec<Duration> {
        committed[range].iter().filter_map(|(id, at)| Some(seen.get(id)?.saturating_duration_since(*at))).collect()
    };
    for (phase, range, windows) in [(&mut clear, clear_range, clear_windows), (&mut held, held_range, held_windows)] {
        phase.latencies = latency(range);
        for (window, range) in phase.windows.iter_mut().zip(windows) {
            window.latencies = latency(range);
        }
    }
    Ok(HeldReport { clear, held, duplicates: duplicates.load(Ordering::Relaxed) })
}
