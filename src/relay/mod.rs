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
//!   high rate (`busy.rs`), linger before they mark the relay waiting in its row (`row.rs`);
//!   each batch (`batch.rs`) is claimed (`claim.rs`: new events by transaction snapshots under a
//!   lock one transaction holds at a time, parked ones with `FOR UPDATE SKIP LOCKED`: migration
//!   0008), delivered (`deliver.rs`) while the claim's transaction holds it (`held.rs`) or under
//!   a lease past `hold` (`lease.rs`), judged (`outcome.rs`) and recorded (`record.rs`);
//! - the **race closure** (`row.rs`) waits for the transactions open at each waiting mark;
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
mod batch;
mod breaker;
mod busy;
mod claim;
pub(crate) mod config;
mod deliver;
mod engine;
mod failure;
mod fast;
mod fast_task;
mod handler;
mod held;
mod janitor;
mod lease;
mod limit;
mod listener;
mod metrics;
mod outcome;
mod pauses;
mod pool;
mod rate;
mod rebase;
mod record;
mod report;
mod rotation;
mod route;
mod row;
mod signed;
mod sweeper;
mod timer;
#[cfg(feature = "opentelemetry")]
mod trace;
mod worker;

use std::future::Future;
use std::sync::Arc;

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

pub use config::RelayConfig;

/// The `application_name` of a relay's pooled connections, followed by the relay's id (its
/// listeners': [`listener::LISTENER_APPLICATION_NAME`] and the id), so that `status` counts relays and
/// their connections, and operators tell them apart in `pg_stat_activity`.
pub(crate) const POOL_APPLICATION_NAME: &str = "outbox-relay";
pub use failure::DeliveryError;
pub use handler::{Handler, HandlerFn, Slot, Slots, handler_fn};
pub use metrics::{HistogramSnapshot, MetricsSnapshot, Percentiles, RelayMetrics};

pub use route::{DEFAULT_DESTINATION, Route, TopicPattern};

use self::pool::{RelayPool, STOP_BOUND, drain};
use crate::error::{Error, ErrorKind, Result};
use crate::outbox::Outbox;
use crate::sql;

/// An embeddable relay: `Relay::new(&outbox, config, handler)?.run(shutdown).await`.
///
/// ```no_run
/// # async fn f() -> Result<(), pg_outbox_relay::Error> {
/// use pg_outbox_relay::{handler_fn, Event, Outbox, Relay, RelayConfig};
/// let outbox = Outbox::connect("postgres://app@localhost/shop").await?;
/// let relay = Relay::new(&outbox, RelayConfig::default(), handler_fn(|event: Event| async move {
///     println!("{} {}", event.topic, event.payload);
///     Ok(())
/// }))?;
/// relay.run(async { tokio::signal::ctrl_c().await.ok(); }).await?;
/// # Ok(()) }
/// ```
///
/// Several destinations, each with its own [`Route`]: every event goes to each destination whose
/// topic pattern matches it, and each destination is delivered to on its own (see [`Route`]).
///
/// ```no_run
/// # async fn f(erp: pg_outbox_relay::HandlerFn<fn(pg_outbox_relay::Event) -> std::future::Ready<Result<(), pg_outbox_relay::DeliveryError>>>,
/// #            mailer: pg_outbox_relay::HandlerFn<fn(pg_outbox_relay::Event) -> std::future::Ready<Result<(), pg_outbox_relay::DeliveryError>>>) -> Result<(), pg_outbox_relay::Error> {
/// use pg_outbox_relay::{Outbox, Relay, RelayConfig, Route};
/// let outbox = Outbox::connect("postgres://app@localhost/shop").await?;
/// let routes = vec![Route::new("erp", "order.#", erp)?, Route::new("mailer", "mail.*", mailer)?.rate_limit(Some(20.0))];
/// Relay::with_routes(&outbox, RelayConfig::default(), routes)?.run(std::future::pending()).await?;
/// # Ok(()) }
/// ```
pub struct Relay<H: Handler> {
    outbox: Outbox,
    config: RelayConfig,
    routes: Vec<Route<H>>,
    metrics: Vec<Arc<RelayMetrics>>,
}

impl<H: Handler> Relay<H> {
    /// A relay for `outbox`'s database that delivers every event to `handler` (one destination,
    /// named [`DEFAULT_DESTINATION`]); the configuration is validated here.
    pub fn new(outbox: &Outbox, config: RelayConfig, handler: H) -> Result<Self> {
        let route = Route::new(DEFAULT_DESTINATION, "#", handler)?;
        Relay::with_routes(outbox, config, vec![route])
    }

    /// A relay for `outbox`'s database that delivers each event to every route whose pattern
    /// matches its topic. The configuration, and each route's with its own settings, is
    /// validated here; two routes may not share a name.
    pub fn with_routes(outbox: &Outbox, config: RelayConfig, routes: Vec<Route<H>>) -> Result<Self> {
        config.validate()?;
        if routes.is_empty() {
            return Err(Error::config("a relay needs at least one route"));
        }
        for (n, route) in routes.iter().enumerate() {
            if routes[..n].iter().any(|other| other.name == route.name) {
                return Err(Error::config(format!(
                    "two routes are named {:?}: each destination needs a name of its own",
                    route.name
                )));
            }
            route.config(&config).validate().map_err(|e| Error::config(format!("route {:?}: {e}", route.name)))?;
        }
        // (within max_connections: fewer workers, or an error when not even one fits)
        let config = config.fitted(routes.len())?;
        let metrics = routes.iter().map(|_| Arc::default()).collect();
        Ok(Relay { outbox: outbox.clone(), config, routes, metrics })
    }

    /// The configuration it runs with: as given, but with fewer `workers` when
    /// [`RelayConfig::max_connections`] holds no more.
    pub fn config(&self) -> &RelayConfig {
        &self.config
    }

    /// Live counters of the first route (the only one of a relay built with [`Relay::new`]),
    /// readable while the relay runs.
    pub fn metrics(&self) -> Arc<RelayMetrics> {
        self.metrics[0].clone()
    }

    /// Live counters of every route, by destination name, in the routes' order.
    pub fn destination_metrics(&self) -> Vec<(String, Arc<RelayMetrics>)> {
        self.routes.iter().zip(&self.metrics).map(|(route, metrics)| (route.name.clone(), metrics.clone())).collect()
    }

    /// Runs until `shutdown` resolves, then stops claiming, lets in-flight deliveries finish
    /// within `shutdown_grace` (after which they are cut off and their events released), closes
    /// the listeners and returns.
    ///
    /// Database outages while running are not errors: the relay logs them and retries. Only a
    /// failure to start is returned: a pool that cannot be built, or a database that answers
    /// but cannot be relayed from (a migration of this version missing, a role without the
    /// privileges the relay needs), each with the reason.
    ///
    /// Every log line of the relay is in a span `relay` whose `id` (eight hex digits, chosen at
    /// random when it starts) tells two relays of one process apart, and, below it, a span
    /// `destination` with the destination's `name`.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<()> {
        let id = format!("{:08x}", rand::random::<u32>());
        let span = tracing::info_span!("relay", id = %id);
        self.serve(id.into(), shutdown).instrument(span).await
    }

    async fn serve(self, id: Arc<str>, shutdown: impl Future<Output = ()> + Send) -> Result<()> {
        let Relay { outbox, config, routes, metrics } = self;
        let url = outbox.url().clone();
        // (the listeners connect on their own, outside the pool)
        let connections = RelayConfig::connections_needed(routes.len(), config.workers) - routes.len();
        let named = format!("{POOL_APPLICATION_NAME} {id}");
        let pool = RelayPool { pool: url.relay_pool(connections, config.lease, &named)?, url: url.clone(), relay: id };
        preflight(&pool, &config).await?;
        tracing::info!(
            database = %url,
            workers = config.workers,
            batch_size = config.batch_size,
            poll_interval = ?config.poll_interval,
            destinations = %routes.iter().map(|r| format!("{} ({})", r.name, r.pattern)).collect::<Vec<_>>().join(", "),
            "relay starting"
        );
        let stop = CancellationToken::new();
        let mut services = JoinSet::new();
        if !config.janitor_interval.is_zero() {
            let janitor = janitor::Janitor { pool: pool.clone(), config: config.clone() };
            services.spawn(janitor.run(stop.clone()).instrument(tracing::info_span!("janitor")));
        }
        let sweeper = sweeper::Sweeper { pool: pool.clone(), config: config.clone(), metrics: metrics.clone() };
        services.spawn(sweeper.run(stop.clone()).instrument(tracing::info_span!("sweeper")));
        // Every destination registered before any claims: new ones start at one same position.
        let mut shutdown = std::pin::pin!(shutdown);
        let registered = tokio::select! {
            registered = register(&pool, &routes, &metrics, config.retention, config.destination_expiry) => Some(registered),
            () = &mut shutdown => None,
        };
        let registered = match registered.transpose() {
            Ok(registered) => registered,
            Err(e) => {
                stop.cancel();
                drain(&mut services).await;
                pool.pool.close();
                return Err(e);
            }
        };
        let Some(registered) = registered else {
            stop.cancel();
            drain(&mut services).await;
            pool.pool.close();
            tracing::info!("relay stopped before its destinations were registered");
            return Ok(());
        };
        let engines = routes.into_iter().zip(metrics).zip(registered).map(|((route, metrics), to)| {
            let span = tracing::info_span!("destination", name = %route.name);
            let engine = engine::Engine {
                config: route.config(&config),
                to,
                handler: route.handler,
                metrics,
                pool: pool.clone(),
                outbox: outbox.clone(),
            };
            engine.run(stop.clone()).instrument(span)
        });
        let engines = futures::future::join_all(engines);
        let stopping = async {
            shutdown.await;
            tracing::info!("relay stopping: no new claims; in-flight deliveries finish");
            stop.cancel();
        };
        futures::future::join(engines, stopping).await;
        if tokio::time::timeout(STOP_BOUND, drain(&mut services)).await.is_err() {
            services.abort_all();
            drain(&mut services).await;
        }
        pool.pool.close();
        tracing::info!("relay stopped");
        Ok(())
    }
}

/// Registers every route's destination, trying again with capped backoff while the database
/// does not answer. A destination that a connected relay serves with another pattern is an
/// error: the two relays' claims would move one position past the events each other's pattern
/// wants, and neither would deliver them.
async fn register<H>(
    pool: &RelayPool,
    routes: &[Route<H>],
    metrics: &[Arc<RelayMetrics>],
    retention: std::time::Duration,
    expiry: std::time::Duration,
) -> Result<Vec<sql::Destination>> {
    let regexes: Vec<Option<String>> = routes.iter().map(|r| r.pattern.dotted_regex()).collect();
    let all: Vec<sql::ToRegister<'_>> = routes
        .iter()
        .zip(&regexes)
        .map(|(r, regex)| sql::ToRegister { name: &r.name, pattern: r.pattern.as_str(), topic_regex: regex.as_deref() })
        .collect();
    let mut failures = 0;
    loop {
        let registered = async {
            // Positions from another cluster (a restored dump) are replaced before any claim.
            rebase::check(pool, metrics).await?;
            sql::register_destinations(&mut pool.client().await?, &all, retention, expiry).await
        };
        match registered.await {
            Ok(registered) => {
                for (r, route) in registered.iter().zip(routes) {
                    let _span = tracing::info_span!("destination", name = %route.name).entered();
                    if r.new {
                        tracing::info!(pattern = %route.pattern, "destination registered: it starts with the events no destination has passed yet");
                    }
                    if let Some(was) = &r.pattern_was {
                        tracing::warn!(pattern = %route.pattern, was = %was, "the destination's topic pattern changed");
                    }
                }
                return Ok(registered.into_iter().map(|r| r.destination).collect());
            }
            Err(e) if e.kind() == ErrorKind::Config => return Err(e),
            Err(e) => {
                failures += 1;
                let pause = backoff::retry_delay(
                    failures,
                    std::time::Duration::from_millis(100),
                    STOP_BOUND,
                    0.5,
                    rand::random(),
                );
                tracing::warn!(error = %e, retry_in = ?pause, "registering the destinations failed; trying again");
                tokio::time::sleep(pause).await;
            }
        }
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
    let cache = sql::id_sequence_cache(&*client).await?;
    if cache > 1 {
        // Writers of one key take turns (publish's lock), but each session takes its ids in
        // blocks: a later event of a key can have a lower id, and a claim hands a key's events
        // over in id order.
        tracing::error!(
            cache,
            "the outbox's id sequence hands out ids in blocks of {cache} per session, so the ids of one key's events \
             do not follow the order they were written in, and the relay delivers a key's events in id order: \
             set it back with `alter sequence outbox_relay.outbox_id_seq cache 1`"
        );
    }
    let mut needed =
        vec![("outbox_relay.outbox", "SELECT"), ("outbox_relay.outbox", "UPDATE"), ("outbox_relay.outbox", "DELETE")];
    // A claim reads each leaf by its name (migration 0024).
    needed.extend(sql::OUTBOX_LEAVES.iter().map(|&(_, leaf)| (leaf, "SELECT")));
    needed.extend([
        ("outbox_relay.dead_letters", "INSERT"),
        ("outbox_relay.dead_letters", "UPDATE"),
        ("outbox_relay.relays", "SELECT"),
        ("outbox_relay.relays", "INSERT"),
        ("outbox_relay.relays", "UPDATE"),
        ("outbox_relay.relays", "DELETE"),
        ("outbox_relay.pauses", "SELECT"),
        ("outbox_relay.parked", "SELECT"),
        ("outbox_relay.parked", "INSERT"),
        ("outbox_relay.parked", "UPDATE"),
        ("outbox_relay.parked", "DELETE"),
        ("outbox_relay.early_deliveries", "SELECT"),
        ("outbox_relay.early_deliveries", "INSERT"),
        ("outbox_relay.early_deliveries", "UPDATE"),
        ("outbox_relay.early_deliveries", "DELETE"),
        ("outbox_relay.destinations", "SELECT"),
        ("outbox_relay.destinations", "INSERT"),
        ("outbox_relay.destinations", "UPDATE"),
        ("outbox_relay.positions", "SELECT"),
        ("outbox_relay.positions", "INSERT"),
        ("outbox_relay.installation", "SELECT"),
        ("outbox_relay.installation", "UPDATE"),
    ]);
    if !config.janitor_interval.is_zero() {
        needed.extend([("outbox_relay.idempotency", "UPDATE"), ("outbox_relay.idempotency", "DELETE")]);
    }
    if !config.janitor_interval.is_zero() && !config.destination_expiry.is_zero() {
        // The janitor expires destinations as `destinations drop` drops them.
        needed.extend([
            ("outbox_relay.destinations", "DELETE"),
            ("outbox_relay.positions", "DELETE"),
            ("outbox_relay.pauses", "DELETE"),
        ]);
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
