//! The relay: delivers committed events to a [`Handler`], at least once, within milliseconds.
//!
//! # Structure
//! A running relay is a handful of tasks that talk through one [`tokio::sync::Notify`], "there may
//! be events", each given only what it needs:
//! - the **listener** (`listener.rs`) holds one dedicated connection that `LISTEN`s on the outbox
//!   trigger's channel and turns each notification into a wake-up. When its connection drops it
//!   reconnects with capped backoff, listens again, and *then* wakes the workers for a catch-up
//!   claim, since notifications sent while it was away are lost;
//! - commits made through the same process's [`Outbox`] wake a worker themselves, with no
//!   database round trip (`wake.rs`);
//! - the **timer** (`timer.rs`) wakes the workers every `poll_interval` (the fallback for lost
//!   hints) and at the earliest retry or delayed event it knows of;
//! - the **workers** (`worker.rs`) drain the queue batch by batch and, when it runs dry at a
//!   high rate, linger before they mark the relay waiting (`idle.rs`); each batch is claimed
//!   (new events by transaction snapshots under a lock one transaction holds at a time, parked
//!   ones with `FOR UPDATE SKIP LOCKED`: migration 0008), delivered while the claim's transaction
//!   holds it (or under a lease, past `hold`) and its outcomes recorded (`claim.rs`, `held.rs`);
//! - the **race closure** (`idle.rs`) waits for the transactions open at each waiting mark;
//! - the **janitor** (`janitor.rs`) deletes old processed events, old claim positions and
//!   idempotency receipts in small batches, and the **reporter** (`report.rs`) logs failures and summaries.
//!
//! Notifications are only hints: the table is the truth, so a lost notification costs at most
//! one poll interval, never an event.
//!
//! # Failure handling
//! A held claim ends with its transaction: a worker that dies gives its events back at once (the
//! position it moved rolls back with it). A leased claim parks its events with `available_at`
//! moved forward by `lease` and a fresh lease token; if the worker dies, they become claimable
//! again when the lease ends. Outcomes are recorded only
//! where the token still matches, so a stale worker never overwrites a newer attempt. A transient
//! failure reschedules with capped, jittered exponential backoff; a permanent failure, or the last
//! allowed attempt, moves the event to the dead letters.

mod backoff;
mod breaker;
mod claim;
pub(crate) mod config;
mod handler;
mod held;
mod idle;
mod janitor;
mod limit;
mod listener;
mod metrics;
mod pauses;
mod rate;
mod report;
mod timer;
mod worker;

use std::future::Future;
use std::sync::Arc;

use tokio::sync::Notify;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

pub use config::{Completion, RelayConfig};
pub use handler::{DeliveryError, Handler, HandlerFn, Slot, Slots, handler_fn};
pub use metrics::{CLAIM_BUCKETS, HistogramSnapshot, LATENCY_BUCKETS, MetricsSnapshot, Percentiles, RelayMetrics};

use crate::connect::{DatabaseUrl, pool_error};
use crate::error::{Error, ErrorKind, Result};
use crate::outbox::Outbox;
use crate::sql;

/// How long shutdown waits, after the grace period, for each remaining step (stuck workers, the
/// other tasks, removing the waiting mark) before it abandons it: `run` returns even when the
/// database link is stalled.
const STOP_BOUND: std::time::Duration = std::time::Duration::from_secs(3);

/// An embeddable relay: `Relay::new(&outbox, config, handler)?.run(shutdown).await`.
///
/// ```no_run
/// # async fn f() -> Result<(), outbox_relay::Error> {
/// use outbox_relay::{handler_fn, Event, Outbox, Relay, RelayConfig};
/// let outbox = Outbox::connect("postgres://app@localhost/shop").await?;
/// let relay = Relay::new(&outbox, RelayConfig::default(), handler_fn(|event: Event| async move {
///     println!("{} {}", event.topic, event.payload);
///     Ok(())
/// }))?;
/// relay.run(async { tokio::signal::ctrl_c().await.ok(); }).await?;
/// # Ok(()) }
/// ```
pub struct Relay<H: Handler> {
    outbox: Outbox,
    config: RelayConfig,
    handler: H,
    metrics: Arc<RelayMetrics>,
}

/// The relay's own connection pool (its sessions run with `synchronous_commit = off`), with
/// errors that name the server.
#[derive(Clone)]
pub(crate) struct RelayPool {
    pool: deadpool_postgres::Pool,
    url: DatabaseUrl,
}

impl std::fmt::Debug for RelayPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayPool").field("url", &self.url).finish_non_exhaustive()
    }
}

impl RelayPool {
    /// A connection, or an error naming the server.
    pub(crate) async fn client(&self) -> Result<deadpool_postgres::Object> {
        self.pool.get().await.map_err(|e| pool_error(&self.url, e))
    }
}

impl<H: Handler> Relay<H> {
    /// A relay for `outbox`'s database; the configuration is validated here.
    pub fn new(outbox: &Outbox, config: RelayConfig, handler: H) -> Result<Self> {
        config.validate()?;
        Ok(Relay { outbox: outbox.clone(), config, handler, metrics: Arc::default() })
    }

    /// Live counters, readable while the relay runs.
    pub fn metrics(&self) -> Arc<RelayMetrics> {
        self.metrics.clone()
    }

    /// Runs until `shutdown` resolves, then stops claiming, lets in-flight deliveries finish
    /// within `shutdown_grace` (after which they are cut off and their events released), closes
    /// the listener and returns.
    ///
    /// Database outages while running are not errors: the relay logs them and retries. Only a
    /// failure to start is returned: a pool that cannot be built, or a database that answers
    /// but cannot be relayed from (a migration of this version missing, a role without the
    /// privileges the relay needs), each with the reason.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<()> {
        let Relay { outbox, config, handler, metrics } = self;
        let url = outbox.url().clone();
        // Per worker: a held claim in delivery and the next claim (or two in delivery); and the
        // bookkeeping beside them (marks, the race closure, the janitor).
        let pool = RelayPool { pool: url.relay_pool(2 * config.workers + 3, config.lease)?, url: url.clone() };
        preflight(&pool, &config).await?;
        tracing::info_span!("relay", workers = config.workers).in_scope(|| {
            tracing::info!(
                database = %url,
                batch_size = config.batch_size,
                poll_interval = ?config.poll_interval,
                "relay starting"
            );
        });

        let stop = CancellationToken::new();
        let abort = CancellationToken::new();
        let work = Arc::new(Notify::new());
        // Commits through this process's Outbox wake a worker for as long as this lives.
        let woken_by_commits = Arc::new(crate::wake::WakeTarget { work: work.clone(), metrics: metrics.clone() });
        outbox.wakeup().register(&woken_by_commits);
        let timer = Arc::new(timer::Timer::default());
        // Parked events may be due at the start (retries, delays, what a stopped relay gave back).
        timer.parked_may_be_due();
        let reporter = Arc::new(report::Reporter::default());
        let idle = Arc::new(idle::Idle::new(pool.clone(), rand::random_range(1..i64::MAX)));
        let pauses = Arc::new(pauses::Pauses::default());
        let pauses_changed = Arc::new(Notify::new());
        metrics.set_running(true);
        let claimer = Arc::new(claim::Claimer {
            pool: pool.clone(),
            handler,
            config: config.clone(),
            metrics: metrics.clone(),
            timer: timer.clone(),
            reporter: reporter.clone(),
            abort: abort.clone(),
            slots: Slots::for_relay(&config, metrics.clone()),
            breaker: Arc::new(breaker::Breaker::new(
                config.breaker_threshold,
                config.breaker_probe_min,
                config.breaker_probe_max,
            )),
            idle: idle.clone(),
            turns: claim::Turns::default(),
            new_lock: Arc::default(),
            work: work.clone(),
            new_gate: tokio::sync::Mutex::new(()),
            pauses: pauses.clone(),
        });

        let mut services = JoinSet::new();
        let listener = listener::Listener {
            url: url.clone(),
            reconnect_max: config.reconnect_max,
            work: work.clone(),
            metrics: metrics.clone(),
            pauses_changed: pauses_changed.clone(),
            timer: timer.clone(),
            idle: idle.clone(),
            stop: stop.clone(),
        };
        services.spawn(listener.run().instrument(tracing::info_span!("listener")));
        services.spawn(
            timer::run(timer.clone(), config.poll_interval, work.clone(), stop.clone())
                .instrument(tracing::debug_span!("timer")),
        );
        services.spawn(
            idle::close_race(idle.clone(), work.clone(), stop.clone()).instrument(tracing::debug_span!("race_closure")),
        );
        services.spawn(
            pauses::run(
                pauses,
                pool.clone(),
                work.clone(),
                pauses_changed,
                metrics.clone(),
                timer.clone(),
                stop.clone(),
            )
            .instrument(tracing::info_span!("pauses")),
        );
        services.spawn(
            idle::publish_deliveries(idle.clone(), metrics.clone(), stop.clone())
                .instrument(tracing::debug_span!("limit_publisher")),
        );
        services.spawn(
            report::run(reporter.clone(), metrics.clone(), stop.clone()).instrument(tracing::info_span!("reporter")),
        );
        if !config.janitor_interval.is_zero() {
            let janitor = janitor::Janitor { pool: pool.clone(), config: config.clone(), stop: stop.clone() };
            services.spawn(janitor.run().instrument(tracing::info_span!("janitor")));
        }
        let mut workers = JoinSet::new();
        for n in 0..config.workers {
            let worker = worker::Worker {
                claimer: claimer.clone(),
                idle: idle.clone(),
                work: work.clone(),
                stop: stop.clone(),
                linger: config.linger,
            };
            workers.spawn(worker.run().instrument(tracing::info_span!("worker", n)));
        }
        // Whatever was committed before we started is there to claim.
        work.notify_one();

        shutdown.await;
        drop(woken_by_commits);
        tracing::info!("relay stopping: no new claims; in-flight deliveries finish");
        stop.cancel();
        work.notify_waiters();
        let drained = tokio::time::timeout(config.shutdown_grace, drain(&mut workers)).await;
        if drained.is_err() {
            tracing::warn!(grace = ?config.shutdown_grace, "deliveries still running after the grace period; cutting them off and releasing their events");
            abort.cancel();
            // A worker blocked in a database call on a stalled link does not see the abort: it is
            // abandoned after a bound, and its events come back when their lease ends.
            if tokio::time::timeout(STOP_BOUND, drain(&mut workers)).await.is_err() {
                tracing::warn!("workers stuck in database calls (a stalled link?); abandoning them");
                workers.abort_all();
                drain(&mut workers).await;
            }
        }
        if tokio::time::timeout(STOP_BOUND, drain(&mut services)).await.is_err() {
            services.abort_all();
            drain(&mut services).await;
        }
        // Writers need not notify a relay that is gone.
        if tokio::time::timeout(STOP_BOUND, idle.remove()).await.is_err() {
            tracing::warn!(
                "could not remove this relay's waiting mark; the janitor removes it once its listener is gone"
            );
        }
        pool.pool.close();
        metrics.set_running(false);
        report::summary(&metrics.snapshot(), &MetricsSnapshot::default(), "since it started");
        tracing::info!("relay stopped");
        Ok(())
    }
}

/// Refuses to start on a database that answers but cannot be relayed from. A database that does
/// not answer yet is no reason not to start: the relay's loops wait for it.
async fn preflight(pool: &RelayPool, config: &RelayConfig) -> Result<()> {
    let client = match pool.client().await {
        Ok(client) => client,
        Err(e) => {
            tracing::warn!(error = %e, "the database does not answer yet; the relay starts and keeps trying");
            return Ok(());
        }
    };
    crate::migrate::check_applied(&client).await?;
    let mut needed = vec![
        ("outbox_relay.outbox", "SELECT"),
        ("outbox_relay.outbox", "UPDATE"),
        ("outbox_relay.outbox", "DELETE"),
        ("outbox_relay.dead_letters", "INSERT"),
        ("outbox_relay.dead_letters", "UPDATE"),
        ("outbox_relay.relays", "SELECT"),
        ("outbox_relay.relays", "INSERT"),
        ("outbox_relay.relays", "UPDATE"),
        ("outbox_relay.relays", "DELETE"),
        ("outbox_relay.pauses", "SELECT"),
    ];
    if !config.janitor_interval.is_zero() {
        needed.extend([("outbox_relay.idempotency", "UPDATE"), ("outbox_relay.idempotency", "DELETE")]);
    }
    let (missing, role) = sql::missing_privileges(&*client, &needed).await?;
    if !missing.is_empty() {
        return Err(Error::new(
            ErrorKind::Permission,
            format!(
                "role {role:?} cannot relay: it lacks {} (grant it outbox_relayer, see migrations/optional/least_privilege_roles.sql)",
                missing.join(", ")
            ),
        ));
    }
    Ok(())
}

async fn drain(tasks: &mut JoinSet<()>) {
    while let Some(result) = tasks.join_next().await {
        if let Err(e) = result {
            tracing::error!(error = %e, "relay task failed");
        }
    }
}
