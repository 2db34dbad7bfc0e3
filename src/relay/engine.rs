//! The delivery to one registered destination: its workers and the tasks beside them (the
//! listener, the timer, the race closure, the pauses' watcher, the limit's publisher, the
//! reporter), and their shutdown.

use std::sync::Arc;

use tokio::sync::Notify;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::config::RelayConfig;
use super::handler::{Handler, Slots};
use super::metrics::{MetricsSnapshot, RelayMetrics};
use super::pool::{RelayPool, STOP_BOUND, drain};
use super::{
    batch, breaker, claim, deliver, fast, fast_task, lease, listener, outcome, pauses, record, report, row, timer,
    worker,
};
use crate::outbox::Outbox;
use crate::sql;
use crate::wake::Wake;

/// The delivery to one registered destination: its workers, listener, timer, breaker, limits
/// and pauses.
pub(crate) struct Engine<H> {
    /// The destination as registered.
    pub(crate) to: sql::Destination,
    pub(crate) config: RelayConfig,
    pub(crate) handler: H,
    pub(crate) metrics: Arc<RelayMetrics>,
    pub(crate) pool: RelayPool,
    pub(crate) outbox: Outbox,
}

/// An engine as this process's commits wake it: `work` stores one wake-up when no worker
/// waits, so none is lost while it is busy.
struct WokenByCommits {
    work: Arc<Notify>,
    metrics: Arc<RelayMetrics>,
    /// While it is armed, the commit's notification brings its events to the fast path: a
    /// claim now would only race it. A claim follows a little later instead, for a commit that
    /// sent none (its writer turned notifications off, or the trigger was dropped).
    fast: Arc<fast::FastPath>,
    timer: Arc<timer::Timer>,
}

/// How long after an in-process commit, heard while the fast path is armed, a claim looks for
/// events its notification did not bring.
const UNHEARD_COMMIT_CLAIM: std::time::Duration = std::time::Duration::from_millis(20);

impl Wake for WokenByCommits {
    fn wake(&self) {
        if self.fast.armed() {
            self.timer.schedule(tokio::time::Instant::now() + UNHEARD_COMMIT_CLAIM);
            return;
        }
        self.metrics.woken();
        self.work.notify_one();
    }
}

/// What an engine's tasks share.
struct Shared {
    /// "There may be events": wakes one waiting worker (or stores one wake-up).
    work: Arc<Notify>,
    timer: Arc<timer::Timer>,
    reporter: Arc<report::Reporter>,
    /// The relay's row: its waiting mark, the breaker's state and the concurrency limit.
    row: Arc<row::RelayRow>,
    pauses: Arc<pauses::Pauses>,
    /// Cuts the deliveries in hand off (shutdown past its grace).
    abort: CancellationToken,
    /// The fast path: events delivered from their notifications.
    fast: Arc<fast::FastPath>,
}

impl<H: Handler> Engine<H> {
    /// Delivers to the destination until `stop`.
    pub(crate) async fn run(self, stop: CancellationToken) {
        let work = Arc::new(Notify::new());
        let pauses = Arc::<pauses::Pauses>::default();
        let pattern = super::TopicPattern::parse(&self.to.pattern);
        let fast_path = self.config.fast_path && pattern.is_ok();
        let pattern = pattern.unwrap_or_else(|_| super::TopicPattern::parse("#").expect("# is a pattern"));
        let fast =
            Arc::new(fast::FastPath::new(fast_path, pattern, pauses.clone(), work.clone(), self.metrics.clone()));
        let timer = Arc::new(timer::Timer::default());
        // Commits through this process's Outbox wake a worker for as long as this lives.
        let woken_by_commits: Arc<dyn Wake> = Arc::new(WokenByCommits {
            work: work.clone(),
            metrics: self.metrics.clone(),
            fast: fast.clone(),
            timer: timer.clone(),
        });
        self.outbox.wakeup().register(&woken_by_commits);
        // Parked events may be due at the start (retries, delays, what a stopped relay gave back).
        timer.parked_may_be_due();
        let shared = Shared {
            work,
            timer,
            reporter: Arc::default(),
            row: Arc::new(row::RelayRow::new(
                self.pool.clone(),
                rand::random_range(1..i64::MAX),
                self.to.name.clone(),
                {
                    let fast = fast.clone();
                    Box::new(move |hears| fast.complete(hears))
                },
            )),
            pauses,
            abort: CancellationToken::new(),
            fast,
        };
        self.metrics.set_running(true);
        let mut services = self.services(&shared, &stop);
        let (config, metrics) = (self.config.clone(), self.metrics.clone());
        let (pool, name) = (self.pool.clone(), self.to.name.clone());
        let batches = Arc::new(self.batches(&shared, &stop));
        let mut workers = JoinSet::new();
        let fast_task = fast_task::FastTask {
            batches: batches.clone(),
            pool,
            to: name,
            dead_letters_hold: config.dead_letter_holds_key,
            work: shared.work.clone(),
        };
        workers.spawn(fast_task.run(stop.clone()).instrument(tracing::info_span!("fast_path")));
        for n in 0..config.workers {
            let worker = worker::Worker {
                batches: batches.clone(),
                row: shared.row.clone(),
                work: shared.work.clone(),
                linger: config.linger,
            };
            workers.spawn(worker.run(stop.clone()).instrument(tracing::info_span!("worker", n)));
        }
        // Whatever was committed before we started is there to claim.
        shared.work.notify_one();

        stop.cancelled().await;
        drop(woken_by_commits);
        shared.work.notify_waiters();
        stop_workers(&mut workers, config.shutdown_grace, &shared.abort).await;
        if tokio::time::timeout(STOP_BOUND, drain(&mut services)).await.is_err() {
            services.abort_all();
            drain(&mut services).await;
        }
        // Writers need not notify a relay that is gone.
        if tokio::time::timeout(STOP_BOUND, shared.row.remove()).await.is_err() {
            tracing::warn!(
                "could not remove this relay's waiting mark; the janitor removes it once its listener is gone"
            );
        }
        metrics.set_running(false);
        report::summary(&metrics.snapshot(), &MetricsSnapshot::default(), "since it started");
    }

    /// Starts the tasks beside the workers: the listener, the timer, the race closure, the
    /// pauses' watcher, the limit's publisher and the reporter.
    fn services(&self, shared: &Shared, stop: &CancellationToken) -> JoinSet<()> {
        let (config, metrics) = (&self.config, &self.metrics);
        let pauses_changed = Arc::new(Notify::new());
        let mut services = JoinSet::new();
        let listener = listener::Listener {
            url: self.pool.url.clone(),
            application_name: format!("{} {}", listener::LISTENER_APPLICATION_NAME, self.pool.relay),
            reconnect_max: config.reconnect_max,
            work: shared.work.clone(),
            metrics: metrics.clone(),
            pauses_changed: pauses_changed.clone(),
            timer: shared.timer.clone(),
            row: shared.row.clone(),
            lock_id: self.to.lock_id,
            fast: shared.fast.clone(),
            lease: config.lease,
            told_no_fast: Default::default(),
        };
        services.spawn(listener.run(stop.clone()).instrument(tracing::info_span!("listener")));
        let poll =
            timer::Poll { timer: shared.timer.clone(), interval: config.poll_interval, work: shared.work.clone() };
        services.spawn(poll.run(stop.clone()).instrument(tracing::debug_span!("timer")));
        let race = row::RaceClosure {
            row: shared.row.clone(),
            work: shared.work.clone(),
            poll_interval: config.poll_interval,
        };
        services.spawn(race.run(stop.clone()).instrument(tracing::debug_span!("race_closure")));
        let pauses = pauses::Watcher {
            pauses: shared.pauses.clone(),
            pool: self.pool.clone(),
            destination: self.to.name.clone(),
            work: shared.work.clone(),
            changed: pauses_changed,
            metrics: metrics.clone(),
            timer: shared.timer.clone(),
        };
        services.spawn(pauses.run(stop.clone()).instrument(tracing::info_span!("pauses")));
        let limit = row::LimitPublisher { row: shared.row.clone(), metrics: metrics.clone() };
        services.spawn(limit.run(stop.clone()).instrument(tracing::debug_span!("limit_publisher")));
        let reports = report::Reports { reporter: shared.reporter.clone(), metrics: metrics.clone() };
        services.spawn(reports.run(stop.clone()).instrument(tracing::info_span!("reporter")));
        services
    }

    /// The parts that claim, deliver, judge and record the destination's batches.
    fn batches(self, shared: &Shared, stop: &CancellationToken) -> batch::Batches<H> {
        let Engine { to, config, handler, metrics, pool, .. } = self;
        let breaker = Arc::new(breaker::Breaker::new(
            config.breaker_threshold,
            config.breaker_probe_min,
            config.breaker_probe_max,
        ));
        let name = to.name.clone();
        batch::Batches {
            leases: lease::Leases {
                pool: pool.clone(),
                to: name.clone(),
                lease: config.lease,
                hold: config.effective_hold(),
                work: shared.work.clone(),
                record_every: config.record_every,
            },
            delivery: deliver::Delivery {
                handler,
                to: name.clone(),
                slots: Slots::for_relay(&config, metrics.clone()),
                abort: shared.abort.clone(),
            },
            judge: outcome::Judge {
                config: config.clone(),
                breaker: breaker.clone(),
                reporter: shared.reporter.clone(),
                metrics: metrics.clone(),
                row: shared.row.clone(),
            },
            recorder: record::Recorder { pool: pool.clone(), to: name, metrics: metrics.clone() },
            timer: shared.timer.clone(),
            row: shared.row.clone(),
            stop: stop.clone(),
            claims: claim::Claims {
                pool,
                to,
                config,
                metrics,
                timer: shared.timer.clone(),
                breaker,
                rate: shared.row.rate.clone(),
                turns: claim::Turns::default(),
                pauses: shared.pauses.clone(),
                new_lock: Arc::default(),
                new_gate: tokio::sync::Mutex::new(()),
                fast: shared.fast.clone(),
            },
        }
    }
}

/// Lets the workers finish what they hold within `grace`, then cuts their deliveries off
/// (`abort`) and, after a bound, abandons workers stuck in database calls.
async fn stop_workers(workers: &mut JoinSet<()>, grace: std::time::Duration, abort: &CancellationToken) {
    if tokio::time::timeout(grace, drain(workers)).await.is_ok() {
        return;
    }
    tracing::warn!(grace = ?grace, "deliveries still running after the grace period; cutting them off and releasing their events");
    abort.cancel();
    // A worker blocked in a database call on a stalled link does not see the abort: it is
    // abandoned after a bound, and its events come back when their lease ends.
    if tokio::time::timeout(STOP_BOUND, drain(workers)).await.is_err() {
        tracing::warn!("workers stuck in database calls (a stalled link?); abandoning them");
        workers.abort_all();
        drain(workers).await;
    }
}
