//! The relay: delivers committed events to a [`Handler`], at least once, within milliseconds.
//!
//! # Structure
//! A running relay is a handful of tasks that talk through one [`tokio::sync::Notify`], "there may
//! be events":
//! - the **listener** holds one dedicated connection that `LISTEN`s on the outbox trigger's
//!   channel and turns each notification into a wake-up. When its connection drops it reconnects
//!   with capped backoff, listens again, and *then* wakes the workers for a catch-up claim, since
//!   notifications sent while it was away are lost;
//! - the **bridge** turns commits made through the same process's [`Outbox`] into wake-ups, with
//!   no database round trip;
//! - the **timer** wakes the workers every `poll_interval` (the fallback for lost hints) and at
//!   the earliest retry or delayed event it knows of;
//! - the **workers** each claim a batch with `FOR UPDATE SKIP LOCKED`, deliver it with no
//!   transaction open (the claim is a lease), and record the outcomes. A worker whose claim came
//!   back full wakes another worker and claims again at once;
//! - the **janitor** deletes old processed events and idempotency receipts in small batches.
//!
//! Notifications are only hints: the table is the truth, so a lost notification costs at most
//! one poll interval, never an event.
//!
//! # Failure handling
//! A claim sets a lease (`available_at` moves forward by `lease`) and a fresh lease token. If the
//! worker dies, the event becomes claimable again when the lease ends. Outcomes are recorded only
//! where the token still matches, so a stale worker never overwrites a newer attempt. A transient
//! failure reschedules with capped, jittered exponential backoff; a permanent failure, or the last
//! allowed attempt, moves the event to the dead letters.

mod backoff;
pub(crate) mod config;
mod handler;
mod idle;
mod janitor;
mod listener;
mod metrics;
mod report;
mod timer;
mod worker;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicI32, AtomicU32};

use deadpool_postgres::Pool;
use tokio::sync::Notify;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

pub use config::{Completion, RelayConfig};
pub use handler::{DeliveryError, Handler, HandlerFn, handler_fn};
pub use metrics::{MetricsSnapshot, Percentiles, RelayMetrics};

use crate::error::Result;
use crate::outbox::Outbox;

/// How long shutdown waits, after the grace period, for each remaining step (stuck workers, the
/// other tasks, removing the waiting mark) before it abandons it: `run` returns even when the
/// database link is stalled.
const STOP_BOUND: std::time::Duration = std::time::Duration::from_secs(3);

/// The channel the outbox trigger notifies (see `migrations/`).
pub(crate) const CHANNEL: &str = "outbox_relay";

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

/// What the relay's tasks share.
pub(crate) struct Shared<H> {
    pub(crate) outbox: Outbox,
    pub(crate) config: RelayConfig,
    pub(crate) handler: H,
    /// The relay's own pool, with `synchronous_commit = off`.
    pub(crate) pool: Pool,
    /// "There may be events": wakes one waiting worker (or stores one wake-up).
    pub(crate) work: Notify,
    pub(crate) timer: timer::Timer,
    pub(crate) metrics: Arc<RelayMetrics>,
    /// Stop claiming; finish what is in hand.
    pub(crate) stop: CancellationToken,
    /// Stop delivering now; release what is in hand.
    pub(crate) abort: CancellationToken,
    /// This relay's row in `outbox_relay.relays`.
    pub(crate) relay_id: i64,
    /// Backend pid of the listener connection while it listens; 0 while it does not.
    pub(crate) listener_pid: AtomicI32,
    /// Whether writers are told to notify this relay.
    pub(crate) idle: idle::Idle,
    /// Claims that failed in a row, for the pause before the next one.
    pub(crate) claim_failures: AtomicU32,
    /// Failed deliveries, for the rate-limited warnings.
    pub(crate) reporter: Arc<report::Reporter>,
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
        let pool = self.outbox.url().relay_pool(self.config.workers + 2)?;
        preflight(&self.outbox, &pool, &self.config).await?;
        let shared = Arc::new(Shared {
            outbox: self.outbox,
            timer: timer::Timer::default(),
            config: self.config,
            handler: self.handler,
            pool,
            work: Notify::new(),
            metrics: self.metrics,
            stop: CancellationToken::new(),
            abort: CancellationToken::new(),
            relay_id: rand::random::<i64>().abs(),
            listener_pid: AtomicI32::new(0),
            idle: idle::Idle::default(),
            claim_failures: AtomicU32::new(0),
            reporter: Arc::default(),
        });
        let span = tracing::info_span!("relay", workers = shared.config.workers);
        let _entered = span.enter();
        tracing::info!(
            database = %shared.outbox.url(),
            batch_size = shared.config.batch_size,
            poll_interval = ?shared.config.poll_interval,
            "relay starting"
        );
        drop(_entered);

        let mut services = JoinSet::new();
        services.spawn(listener::run(shared.clone()));
        services.spawn(timer::run(shared.clone()));
        services.spawn(bridge(shared.clone()));
        services.spawn(idle::close_race(shared.clone()));
        services.spawn(report::run(shared.reporter.clone(), shared.metrics.clone(), shared.stop.clone()));
        if !shared.config.janitor_interval.is_zero() {
            services.spawn(janitor::run(shared.clone()));
        }
        let mut workers = JoinSet::new();
        for n in 0..shared.config.workers {
            workers.spawn(worker::run(shared.clone(), n));
        }
        // Whatever was committed before we started is there to claim.
        shared.work.notify_one();

        shutdown.await;
        tracing::info!("relay stopping: no new claims; in-flight deliveries finish");
        shared.stop.cancel();
        shared.work.notify_waiters();
        let drained = tokio::time::timeout(shared.config.shutdown_grace, drain(&mut workers)).await;
        if drained.is_err() {
            tracing::warn!(grace = ?shared.config.shutdown_grace, "deliveries still running after the grace period; cutting them off and releasing their events");
            shared.abort.cancel();
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
        let unmark = async {
            if let Ok(client) = shared.pool.get().await {
                // Writers need not notify a relay that is gone.
                let _ = client.execute(crate::sql::RELAY_REMOVE, &[&shared.relay_id]).await;
            }
        };
        if tokio::time::timeout(STOP_BOUND, unmark).await.is_err() {
            tracing::warn!(
                "could not remove this relay's waiting mark; the janitor removes it once its listener is gone"
            );
        }
        shared.pool.close();
        report::summary(&shared.metrics.snapshot(), &MetricsSnapshot::default(), "since it started");
        tracing::info!("relay stopped");
        Ok(())
    }
}

impl<H> Shared<H> {
    /// A connection from the relay's own pool, with an error that names the server.
    pub(crate) async fn client(&self) -> Result<deadpool_postgres::Object> {
        self.pool.get().await.map_err(|e| crate::connect::pool_error(self.outbox.url(), e))
    }
}

/// Refuses to start on a database that answers but cannot be relayed from. A database that does
/// not answer yet is no reason not to start: the relay's loops wait for it.
async fn preflight(outbox: &Outbox, pool: &Pool, config: &RelayConfig) -> Result<()> {
    let client = match pool.get().await {
        Ok(client) => client,
        Err(e) => {
            let e = crate::connect::pool_error(outbox.url(), e);
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
    ];
    if !config.janitor_interval.is_zero() {
        needed.extend([("outbox_relay.idempotency", "UPDATE"), ("outbox_relay.idempotency", "DELETE")]);
    }
    let (tables, privileges): (Vec<&str>, Vec<&str>) = needed.into_iter().unzip();
    let row = client
        .query_one(crate::sql::RELAY_PRIVILEGES, &[&tables, &privileges])
        .await
        .map_err(|e| crate::error::Error::database("checking the relay's privileges", e))?;
    let missing: Vec<String> = row.get(0);
    if !missing.is_empty() {
        let role: String = row.get(1);
        return Err(crate::error::Error::new(
            crate::error::ErrorKind::Permission,
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

/// Turns commits made through this process's [`Outbox`] into wake-ups.
async fn bridge<H: Handler>(shared: Arc<Shared<H>>) {
    let mut commits = shared.outbox.wakeup().subscribe();
    loop {
        tokio::select! {
            _ = shared.stop.cancelled() => return,
            changed = commits.changed() => {
                if changed.is_err() {
                    return;
                }
                shared.metrics.woken();
                shared.work.notify_one();
            }
        }
    }
}
