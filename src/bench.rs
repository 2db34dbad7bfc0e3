//! Measurements of the outbox and its relay against a real PostgreSQL, shared by the criterion
//! benchmarks (`benches/relay.rs`, run by `cargo bench`) and the `outbox-relay bench` command.
//!
//! Not part of the stable API: it exists so that both front ends measure exactly the same thing.
//!
//! # The server
//!
//! [`BenchDb`] is the server to measure on: the one `DATABASE_URL` names, or else a private
//! embedded cluster ([`crate::embedded`]) started with [`EmbeddedOptions::durable`], so `fsync`
//! and `synchronous_commit` are on and every business commit waits for its WAL flush, as it does
//! for users. (The relay's own bookkeeping runs with `synchronous_commit = off`, as always.)
//! [`BenchDb::fresh_database`] creates (after dropping any leftover) a database
//! `outbox_bench_<hint>`, applies the migrations and returns an [`Outbox`] on it.
//!
//! Everything runs on one machine: the server, the writers and the relay share its cores, so the
//! figures are a lower bound for a setup with the database on its own host.
//!
//! # Delivery latency: [`latency`], [`LatencyProbe`]
//!
//! A relay (1 worker, janitor off) runs with a handler that notes `Instant::now()` and the event
//! id. Each sample writes **one** event and waits until the handler has seen it, one sample at a
//! time. A sample is the interval from the instant **just before the commit is sent** to the
//! instant **the handler starts** for that event. It therefore includes the commit itself (with
//! its WAL flush), the wake-up, the relay's claim statement and the hand-over to the handler; it
//! does not include recording the delivery afterwards. The paths ([`WakePath`]):
//!
//! - [`WakePath::Notify`]: the writer is a separate plain connection, not the [`Outbox`], that
//!   runs `begin; select outbox_relay.publish(..); commit`; the relay's fallback poll is 1 hour,
//!   so only the trigger's `NOTIFY` can wake it. The interval starts just before `COMMIT`.
//! - [`WakePath::InProcess`]: the trigger `outbox_notify_relay` is dropped for the measurement
//!   (and re-created afterwards) and the event is written with [`Outbox::publish`], so only the
//!   in-process wake-up can wake the relay (poll 1 hour). `publish` commits its insert in the same
//!   round trip (autocommit), so here the interval starts just before that statement is sent and
//!   also covers the insert and taking a pooled connection.
//! - [`WakePath::Poll`]: the trigger is dropped, the writer is a separate connection as for
//!   `Notify`, and the relay's `poll_interval` is the given duration: only the poll finds events.
//!
//! Each sample starts with the relay idle: it has made no claim for 5 ms and, where relays mark
//! themselves waiting (`outbox_relay.relays`, migration 0002: a relay that runs out of work keeps
//! claiming every millisecond for a short `linger`, and only then asks writers to notify it), has
//! marked itself. A sample written right after the previous delivery would otherwise be found by
//! that short polling and measure neither path. Then the probe pauses for a random time: 0 to
//! 2 ms for `Notify` and `InProcess`, 0 to one poll interval for `Poll`. The long pause matters:
//! a sample that waited for a poll tick ends right after the tick, so without it the next write
//! would always land just after a tick and wait a whole interval, and the figures would show the
//! worst case instead of the spread. With it, poll latencies spread evenly over the interval
//! (mean about half of it). Each probe first takes a few warm-up samples that are not reported.
//!
//! # Drain throughput: [`drain_throughput`], [`drain_time`]
//!
//! The outbox is truncated and pre-filled with N events in one
//! `insert .. select .. generate_series` (payload `{"n": i}`), then `VACUUM ANALYZE`d. The clock
//! starts just before a relay (the given workers, batch size and completion mode; janitor off;
//! a handler that only counts) is started, and stops once the handler has run for all N events
//! and the relay has recorded every delivery (its `delivered` counter reaches N, checked every
//! millisecond). So the interval includes the relay's start-up (its connections are opened
//! lazily: one per worker plus the listener), which is a few milliseconds. Result: N / interval.
//!
//! # Write path: [`Writers`], [`write_tps`]
//!
//! Each writer is a task with its own plain connection (not the pool) and prepared statements,
//! and runs business transactions ([`WriteTx`]) back to back. The full transaction, as a service
//! writes it:
//!
//! ```sql
//! begin;
//! insert into bench_orders (customer, total) values ($1, $2) returning id;       -- business row
//! insert into outbox_relay.audit (entity, entity_id, action, data, idempotency_key) .. ;
//! insert into outbox_relay.idempotency (key, fingerprint, response) values (..); -- receipt, unique key
//! insert into outbox_relay.outbox (topic, key, payload, available_at) .. ;       -- one event
//! commit;
//! ```
//!
//! [`write_tps`] runs `writers` such tasks for a duration and returns commits per second, with no
//! relay running, in one of three [`NotifyMode`]s: the trigger dropped; the trigger as shipped
//! with no relay waiting (what writers pay under load: a check, no `NOTIFY`); and every commit
//! sending `NOTIFY` (a placeholder relay marked waiting). The last shows the cost the shipped
//! trigger avoids: PostgreSQL
//! serialises the commits of notifying transactions on a database-wide lock held through the
//! commit (WAL flush included), so concurrent writers lose group commit.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::json;
use tokio::sync::{Notify, mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_postgres::Statement;

use crate::embedded::{EmbeddedOptions, EmbeddedPostgres};
use crate::error::Error;
use crate::{
    AuditEntry, Completion, DatabaseUrl, Event, NewEvent, Outbox, Relay, RelayConfig, RelayMetrics, handler_fn,
};

/// The error type of this module: any error, with a message that says what failed.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Every database [`BenchDb::fresh_database`] creates is named with this prefix.
pub const DATABASE_PREFIX: &str = "outbox_bench_";

/// Connections in the pool of the [`Outbox`] that [`BenchDb::fresh_database`] returns.
const POOL_SIZE: usize = 8;
/// Poll interval of the relay when only a wake-up may find an event.
const NO_POLL: Duration = Duration::from_secs(3600);
/// How long one latency sample may take beyond its poll interval.
const SAMPLE_TIMEOUT: Duration = Duration::from_secs(10);
/// Samples taken and discarded when a probe starts.
const WARMUP_SAMPLES: usize = 5;
/// Largest random pause between two latency samples on the wake-up paths.
const MAX_PAUSE: Duration = Duration::from_millis(2);
/// A drain may take this long, plus [`DRAIN_TIMEOUT_PER_EVENT`] per event.
const DRAIN_TIMEOUT_BASE: Duration = Duration::from_secs(60);
/// See [`DRAIN_TIMEOUT_BASE`].
const DRAIN_TIMEOUT_PER_EVENT: Duration = Duration::from_millis(5);
/// How long a stopping relay may take to return.
const RELAY_STOP_TIMEOUT: Duration = Duration::from_secs(30);
/// Statement timeout of the benchmark's own connections, so a stuck lock cannot hang a run.
const STATEMENT_TIMEOUT: &str = "30s";

const TOPIC: &str = "bench.event";
const CUSTOMER: &str = "bench-customer";
const TOTAL: f64 = 12.5;
/// The fingerprint stored with every receipt (a SHA-256 is 32 bytes; its value does not matter here).
const FINGERPRINT: [u8; 32] = [7; 32];

const TRIGGER_DROP: &str = "drop trigger if exists outbox_notify_relay on outbox_relay.outbox";
const TRIGGER_CREATE: &str = "\
drop trigger if exists outbox_notify_relay on outbox_relay.outbox;
create trigger outbox_notify_relay after insert on outbox_relay.outbox
    for each statement execute function outbox_relay.notify_relay()";
/// True when the schema has migration 0002's `outbox_relay.relays`: the trigger then notifies only
/// while some relay is marked waiting there.
const RELAYS_TABLE_EXISTS: &str = "select to_regclass('outbox_relay.relays') is not null";
const RELAY_WAITING: &str = "select exists (select 1 from outbox_relay.relays where waiting)";
/// A stand-in for an idle relay (real relays have positive ids), so that every insert notifies.
const PLACEHOLDER_MARK: &str = "\
insert into outbox_relay.relays (id, listener_pid, waiting) values (-1, pg_backend_pid(), true)
on conflict (id) do update set waiting = true";
const PLACEHOLDER_REMOVE: &str = "delete from outbox_relay.relays where id = -1";
/// How long a latency sample waits for the relay to be idle before it goes ahead anyway.
const IDLE_TIMEOUT: Duration = Duration::from_secs(2);
/// A relay that made no claim for this long (and is marked waiting, where relays mark themselves)
/// counts as idle.
const IDLE_QUIET: Duration = Duration::from_millis(5);
const PUBLISH_SQL: &str = "select outbox_relay.publish($1::text, $2::jsonb)";
const PREFILL_SQL: &str = "\
insert into outbox_relay.outbox (topic, payload)
select 'bench.drain', jsonb_build_object('n', g) from generate_series(1, $1::int8) as g";
const ORDERS_CREATE: &str = "\
create table if not exists public.bench_orders (
    id         bigserial primary key,
    customer   text not null,
    total      float8 not null,
    created_at timestamptz not null default now()
)";
const ORDERS_INSERT: &str = "insert into public.bench_orders (customer, total) values ($1, $2) returning id";
const RECEIPT_INSERT: &str = "insert into outbox_relay.idempotency (key, fingerprint, response) values ($1, $2, $3)";
const WRITE_TABLES_TRUNCATE: &str =
    "truncate public.bench_orders, outbox_relay.audit, outbox_relay.idempotency, outbox_relay.outbox";

/// Wraps a tokio-postgres error with what was being done (its own message says little).
fn db(context: &'static str) -> impl FnOnce(tokio_postgres::Error) -> Error {
    move |e| Error::database(context, e)
}

// ---------------------------------------------------------------------------------------------
// The server
// ---------------------------------------------------------------------------------------------

/// The server benchmarks run on: the one a database URL names, or an embedded durable cluster
/// that lives as long as this value (dropping it stops the cluster and deletes its files).
pub struct BenchDb {
    server: Server,
}

enum Server {
    External { url: String },
    Embedded(EmbeddedPostgres),
}

impl BenchDb {
    /// Uses the server `database_url` names (an empty string counts as none), or else starts an
    /// embedded cluster with `fsync` and `synchronous_commit` on.
    ///
    /// Blocking (starting a cluster takes a few seconds): call it before the runtime starts or
    /// through `tokio::task::spawn_blocking`.
    ///
    /// With a URL, its user must be allowed to create databases: [`BenchDb::fresh_database`]
    /// creates `outbox_bench_*` databases on that server, and the database the URL names is used
    /// only to run `CREATE DATABASE` and `DROP DATABASE`.
    ///
    /// # Errors
    /// An invalid URL, or an embedded cluster that could not be started (no PostgreSQL server
    /// binaries, no `postgres` user when running as root, ...).
    pub fn start(database_url: Option<&str>) -> Result<BenchDb, BoxError> {
        match database_url.filter(|url| !url.is_empty()) {
            Some(url) => {
                DatabaseUrl::parse(url)?;
                Ok(BenchDb { server: Server::External { url: url.to_string() } })
            }
            None => {
                let pg = EmbeddedPostgres::start(EmbeddedOptions { durable: true }).map_err(|e| {
                    format!(
                        "no database URL given (--database-url or DATABASE_URL), and the embedded \
                         PostgreSQL could not be started: {e}"
                    )
                })?;
                Ok(BenchDb { server: Server::Embedded(pg) })
            }
        }
    }

    /// True when this is the embedded cluster.
    pub fn is_embedded(&self) -> bool {
        matches!(self.server, Server::Embedded(_))
    }

    /// Where the benchmarks run, for reports (never with a password).
    pub fn describe(&self) -> String {
        match &self.server {
            Server::External { url } => format!("server {}", crate::redact(url)),
            Server::Embedded(pg) => {
                format!("embedded PostgreSQL at {}:{} (durable: fsync and synchronous_commit on)", pg.host(), pg.port())
            }
        }
    }

    /// Creates the database `outbox_bench_<hint>` (dropping a leftover of that name first, with
    /// its connections), applies the migrations, and returns its URL and an [`Outbox`] on it.
    ///
    /// The hint is reduced to lower-case letters, digits and `_`.
    pub async fn fresh_database(&self, name_hint: &str) -> Result<(String, Outbox), BoxError> {
        let name = database_name(name_hint);
        let admin = DatabaseUrl::parse(&self.admin_url())?.connect().await?;
        admin
            .batch_execute(&format!("drop database if exists \"{name}\" with (force)"))
            .await
            .map_err(db("dropping a leftover benchmark database"))?;
        admin
            .batch_execute(&format!("create database \"{name}\""))
            .await
            .map_err(db("creating a benchmark database"))?;
        let url = self.url_for(&name)?;
        let outbox = Outbox::connect_with(DatabaseUrl::parse(&url)?, POOL_SIZE).await?;
        outbox.migrate().await?;
        Ok((url, outbox))
    }

    /// Drops the database `outbox_bench_<hint>` if it exists, closing its connections.
    pub async fn drop_database(&self, name_hint: &str) -> Result<(), BoxError> {
        let name = database_name(name_hint);
        let admin = DatabaseUrl::parse(&self.admin_url())?.connect().await?;
        admin
            .batch_execute(&format!("drop database if exists \"{name}\" with (force)"))
            .await
            .map_err(db("dropping a benchmark database"))?;
        Ok(())
    }

    /// The URL `CREATE DATABASE` runs on.
    fn admin_url(&self) -> String {
        match &self.server {
            Server::External { url } => url.clone(),
            Server::Embedded(pg) => pg.url(),
        }
    }

    fn url_for(&self, database: &str) -> Result<String, BoxError> {
        match &self.server {
            Server::External { url } => with_database(url, database),
            Server::Embedded(pg) => Ok(pg.url_for(database)),
        }
    }
}

impl fmt::Debug for BenchDb {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BenchDb").field("server", &self.describe()).finish()
    }
}

/// `outbox_bench_<hint>`, the hint reduced to `[a-z0-9_]` and the whole to PostgreSQL's 63 bytes.
fn database_name(hint: &str) -> String {
    let mut clean: String =
        hint.chars().map(|c| c.to_ascii_lowercase()).map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
    if clean.is_empty() {
        clean.push_str("default");
    }
    clean.truncate(63 - DATABASE_PREFIX.len());
    format!("{DATABASE_PREFIX}{clean}")
}

/// The same connection string with another database: the path of a `postgres://` URL is
/// replaced (and a `dbname` query parameter removed); a `key=value` string gets `dbname=` appended,
/// which overrides an earlier one.
fn with_database(url: &str, database: &str) -> Result<String, BoxError> {
    let Some(scheme_len) = ["postgres://", "postgresql://"].iter().find(|s| url.starts_with(*s)).map(|s| s.len())
    else {
        if url.contains('=') {
            return Ok(format!("{url} dbname={database}"));
        }
        return Err(format!("cannot tell the database name in {}", crate::redact(url)).into());
    };
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let authority_end = base[scheme_len..].find('/').map_or(base.len(), |i| scheme_len + i);
    let query: Vec<&str> =
        query.into_iter().flat_map(|q| q.split('&')).filter(|p| !p.is_empty() && !p.starts_with("dbname=")).collect();
    let mut out = format!("{}/{database}", &base[..authority_end]);
    if !query.is_empty() {
        out.push('?');
        out.push_str(&query.join("&"));
    }
    Ok(out)
}

/// What the figures depend on: the server's version and its durability settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerInfo {
    /// `server_version`, e.g. `15.8 (Debian 15.8-0+deb12u1)`.
    pub version: String,
    /// `fsync`: `on` or `off`.
    pub fsync: String,
    /// `synchronous_commit` of a business transaction: `on`, `off`, `local`, ...
    pub synchronous_commit: String,
}

/// Reads [`ServerInfo`] through `outbox`'s pool.
pub async fn server_info(outbox: &Outbox) -> Result<ServerInfo, BoxError> {
    let client = outbox.client().await?;
    let row = client
        .query_one(
            "select current_setting('server_version'), current_setting('fsync'), \
             current_setting('synchronous_commit')",
            &[],
        )
        .await
        .map_err(db("reading the server settings"))?;
    Ok(ServerInfo { version: row.get(0), fsync: row.get(1), synchronous_commit: row.get(2) })
}

/// Creates (`true`) or drops (`false`) the trigger `outbox_notify_relay`, which sends the relay's
/// `NOTIFY` on inserts into the outbox. Takes a lock on the outbox table: do not call it while a
/// relay runs.
pub async fn set_notify_trigger(outbox: &Outbox, enabled: bool) -> Result<(), BoxError> {
    let client = outbox.client().await?;
    let sql = if enabled { TRIGGER_CREATE } else { TRIGGER_DROP };
    client.batch_execute(sql).await.map_err(db("changing the outbox trigger"))?;
    Ok(())
}

/// What the outbox trigger does during a write measurement (no relay runs then).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotifyMode {
    /// The trigger dropped: the floor.
    NoTrigger,
    /// The trigger as shipped, with no relay waiting: writers check `outbox_relay.relays` and do
    /// not notify. What writers pay under sustained load, when the relay lingers instead of
    /// waiting.
    Trigger,
    /// The trigger with a relay marked waiting (a placeholder, id -1): every commit sends
    /// `NOTIFY`. What writers pay while a relay is idle, and what a trigger that always notifies
    /// costs.
    NotifyEveryCommit,
}

impl NotifyMode {
    /// A short name for reports.
    pub fn name(self) -> &'static str {
        match self {
            NotifyMode::NoTrigger => "no_trigger",
            NotifyMode::Trigger => "trigger",
            NotifyMode::NotifyEveryCommit => "notify_every_commit",
        }
    }
}

/// Sets the trigger up for `mode`. [`reset_notify`] restores the normal state.
pub async fn set_notify_mode(outbox: &Outbox, mode: NotifyMode) -> Result<(), BoxError> {
    set_notify_trigger(outbox, mode != NotifyMode::NoTrigger).await?;
    if has_relays_table(outbox).await? {
        let client = outbox.client().await?;
        let sql = if mode == NotifyMode::NotifyEveryCommit { PLACEHOLDER_MARK } else { PLACEHOLDER_REMOVE };
        client.batch_execute(sql).await.map_err(db("marking the placeholder relay"))?;
    }
    Ok(())
}

/// Puts the trigger back and removes [`set_notify_mode`]'s placeholder relay.
pub async fn reset_notify(outbox: &Outbox) -> Result<(), BoxError> {
    set_notify_trigger(outbox, true).await?;
    if has_relays_table(outbox).await? {
        let client = outbox.client().await?;
        client.batch_execute(PLACEHOLDER_REMOVE).await.map_err(db("removing the placeholder relay"))?;
    }
    Ok(())
}

async fn has_relays_table(outbox: &Outbox) -> Result<bool, BoxError> {
    let client = outbox.client().await?;
    let row = client.query_one(RELAYS_TABLE_EXISTS, &[]).await.map_err(db("looking for outbox_relay.relays"))?;
    Ok(row.get(0))
}

// ---------------------------------------------------------------------------------------------
// Percentiles
// ---------------------------------------------------------------------------------------------

pub use crate::relay::Percentiles;

// ---------------------------------------------------------------------------------------------
// Latency
// ---------------------------------------------------------------------------------------------

/// How the relay learns of a new event in a latency measurement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WakePath {
    /// The outbox trigger's `NOTIFY`, from a writer on another connection.
    Notify,
    /// The in-process wake-up of an [`Outbox`] shared with the relay (trigger dropped).
    InProcess,
    /// Only the relay's fallback poll, at this interval (trigger dropped).
    Poll(Duration),
}

impl WakePath {
    fn poll_interval(self) -> Duration {
        match self {
            WakePath::Poll(interval) => interval,
            WakePath::Notify | WakePath::InProcess => NO_POLL,
        }
    }

    fn uses_trigger(self) -> bool {
        matches!(self, WakePath::Notify)
    }
}

impl fmt::Display for WakePath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WakePath::Notify => f.write_str("NOTIFY"),
            WakePath::InProcess => f.write_str("in-process"),
            WakePath::Poll(interval) => write!(f, "poll {}", humantime::format_duration(*interval)),
        }
    }
}

/// Takes `samples` latency samples on `path` (after a few discarded warm-up samples), one at a
/// time; see the [module documentation](self) for what one covers. The trigger is back in place
/// afterwards, also after an error.
pub async fn latency(outbox: &Outbox, path: WakePath, samples: usize) -> Result<Vec<Duration>, BoxError> {
    let mut probe = LatencyProbe::start(outbox, path).await?;
    let mut taken = Vec::with_capacity(samples);
    let mut result = Ok(());
    for _ in 0..samples {
        match probe.sample().await {
            Ok(sample) => taken.push(sample),
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    let stopped = probe.stop().await;
    result?;
    stopped?;
    Ok(taken)
}

/// A running latency measurement: a relay with a recording handler, and a writer. Take samples
/// with [`sample`](Self::sample), then [`stop`](Self::stop) it, which stops the relay and puts
/// the trigger back. Dropping it without `stop` stops the relay but leaves the trigger as the
/// path needed it.
pub struct LatencyProbe {
    path: WakePath,
    outbox: Outbox,
    /// The separate connection of the `Notify` and `Poll` paths, with its prepared publish.
    writer: Option<(tokio_postgres::Client, Statement)>,
    deliveries: mpsc::UnboundedReceiver<(i64, Instant)>,
    shutdown: Option<oneshot::Sender<()>>,
    relay: Option<JoinHandle<crate::Result<()>>>,
    /// Whether relays mark themselves waiting in `outbox_relay.relays` (migration 0002).
    relays_table: bool,
    metrics: Arc<RelayMetrics>,
    sequence: u64,
}

impl fmt::Debug for LatencyProbe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LatencyProbe")
            .field("path", &self.path)
            .field("samples", &self.sequence)
            .finish_non_exhaustive()
    }
}

impl LatencyProbe {
    /// Sets the trigger as `path` needs it, starts the relay and the writer, and takes a few
    /// warm-up samples.
    pub async fn start(outbox: &Outbox, path: WakePath) -> Result<LatencyProbe, BoxError> {
        reset_notify(outbox).await?;
        set_notify_trigger(outbox, path.uses_trigger()).await?;
        match LatencyProbe::start_relay(outbox, path).await {
            Ok(probe) => Ok(probe),
            Err(e) => {
                // Best effort: the error that stopped us is the one to report.
                reset_notify(outbox).await.ok();
                Err(e)
            }
        }
    }

    async fn start_relay(outbox: &Outbox, path: WakePath) -> Result<LatencyProbe, BoxError> {
        let relays_table = has_relays_table(outbox).await?;
        let writer = match path {
            WakePath::InProcess => None,
            WakePath::Notify | WakePath::Poll(_) => {
                let client = outbox.url().connect().await?;
                client
                    .batch_execute(&format!("set statement_timeout = '{STATEMENT_TIMEOUT}'"))
                    .await
                    .map_err(db("configuring the writer connection"))?;
                let publish = client.prepare(PUBLISH_SQL).await.map_err(db("preparing the publish statement"))?;
                Some((client, publish))
            }
        };
        let (sender, deliveries) = mpsc::unbounded_channel();
        let handler = handler_fn(move |event: Event| {
            let seen = Instant::now();
            // The receiver is gone only when the probe is; nothing to report to then.
            sender.send((event.id, seen)).ok();
            std::future::ready(Ok(()))
        });
        let config = RelayConfig {
            workers: 1,
            poll_interval: path.poll_interval(),
            janitor_interval: Duration::ZERO,
            ..RelayConfig::default()
        };
        let relay = Relay::new(outbox, config, handler)?;
        let metrics = relay.metrics();
        let (shutdown, stop) = oneshot::channel::<()>();
        let task = tokio::spawn(relay.run(async move {
            // A dropped sender stops the relay too.
            stop.await.ok();
        }));
        let mut probe = LatencyProbe {
            path,
            outbox: outbox.clone(),
            writer,
            deliveries,
            shutdown: Some(shutdown),
            relay: Some(task),
            relays_table,
            metrics: metrics.clone(),
            sequence: 0,
        };
        // Let the relay come up (its first claim ran, its listener and in-process bridge are
        // subscribed) before the first write, so no sample waits for a poll that never comes.
        let ready = Instant::now();
        while metrics.snapshot().claims == 0 {
            if ready.elapsed() > SAMPLE_TIMEOUT {
                return Err("the relay made no claim within 10 s of starting".into());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        for _ in 0..WARMUP_SAMPLES {
            probe.sample().await?;
        }
        Ok(probe)
    }

    /// Waits until the relay is idle, pauses for a random time (see the
    /// [module documentation](self)), writes one event and returns the time from just before its
    /// commit to the start of its delivery.
    pub async fn sample(&mut self) -> Result<Duration, BoxError> {
        self.wait_until_idle().await?;
        tokio::time::sleep(pause_before_sample(self.path)).await;
        self.sequence += 1;
        let payload = json!({"sample": self.sequence});
        let (id, committing) = match &mut self.writer {
            None => {
                let committing = Instant::now();
                let id = self.outbox.publish(&NewEvent::new(TOPIC, payload)).await?;
                (id, committing)
            }
            Some((client, publish)) => {
                let tx = client.transaction().await.map_err(db("starting a transaction"))?;
                let row = tx.query_one(&*publish, &[&TOPIC, &payload]).await.map_err(db("publishing an event"))?;
                let committing = Instant::now();
                tx.commit().await.map_err(db("committing"))?;
                (row.get::<_, i64>(0), committing)
            }
        };
        let timeout = SAMPLE_TIMEOUT + self.path.poll_interval().min(SAMPLE_TIMEOUT);
        let deadline = committing + timeout;
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(remaining, self.deliveries.recv()).await {
                Ok(Some((delivered, at))) if delivered == id => return Ok(at.saturating_duration_since(committing)),
                Ok(Some(_)) => continue, // an event of an earlier, timed-out sample
                Ok(None) => return Err("the relay stopped during a latency sample".into()),
                Err(_) => {
                    return Err(format!(
                        "event {id} was not delivered within {} on the {} path",
                        humantime::format_duration(timeout),
                        self.path
                    )
                    .into());
                }
            }
        }
    }

    /// Waits (at most [`IDLE_TIMEOUT`], then goes ahead) until the relay is idle: it has made no
    /// claim for [`IDLE_QUIET`] and, where relays mark themselves waiting (migration 0002), has
    /// marked itself. A relay that was just busy first keeps claiming every millisecond for a
    /// while and then closes the race of its mark with one more claim; a sample taken meanwhile
    /// would measure that, not the path.
    async fn wait_until_idle(&self) -> Result<(), BoxError> {
        let client = self.outbox.client().await?;
        let statement = match self.relays_table {
            true => Some(client.prepare_cached(RELAY_WAITING).await.map_err(db("preparing"))?),
            false => None,
        };
        let since = Instant::now();
        while since.elapsed() < IDLE_TIMEOUT {
            let marked = match &statement {
                Some(statement) => {
                    client.query_one(statement, &[]).await.map_err(db("reading the relay's waiting mark"))?.get(0)
                }
                None => true,
            };
            if marked {
                let claims = self.metrics.snapshot().claims;
                tokio::time::sleep(IDLE_QUIET).await;
                if self.metrics.snapshot().claims == claims {
                    return Ok(());
                }
            } else {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        Ok(())
    }

    /// Stops the relay and puts the trigger back.
    pub async fn stop(mut self) -> Result<(), BoxError> {
        let stopped = stop_relay(self.shutdown.take(), self.relay.take()).await;
        reset_notify(&self.outbox).await?;
        stopped
    }
}

/// A random pause before a latency sample: up to [`MAX_PAUSE`] on the wake-up paths, up to one
/// poll interval on the poll path (see the [module documentation](self)).
fn pause_before_sample(path: WakePath) -> Duration {
    let max = match path {
        WakePath::Poll(interval) => interval,
        WakePath::Notify | WakePath::InProcess => MAX_PAUSE,
    };
    let max_us = u64::try_from(max.as_micros()).unwrap_or(u64::MAX);
    if max_us == 0 { Duration::ZERO } else { Duration::from_micros(rand::random_range(0..max_us)) }
}

/// Signals a relay to stop and waits (bounded) for it to return.
async fn stop_relay(
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<crate::Result<()>>>,
) -> Result<(), BoxError> {
    if let Some(shutdown) = shutdown {
        shutdown.send(()).ok();
    }
    let Some(task) = task else { return Ok(()) };
    match tokio::time::timeout(RELAY_STOP_TIMEOUT, task).await {
        Ok(Ok(result)) => Ok(result?),
        Ok(Err(e)) => Err(format!("the relay task failed: {e}").into()),
        Err(_) => Err("the relay did not stop within 30 s".into()),
    }
}

// ---------------------------------------------------------------------------------------------
// Drain throughput
// ---------------------------------------------------------------------------------------------

/// How the relay is set up for a drain measurement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrainSetup {
    /// Events pre-filled and drained.
    pub events: usize,
    /// Relay workers.
    pub workers: usize,
    /// Events per claim.
    pub batch_size: usize,
    /// Mark delivered events processed, or delete them.
    pub completion: Completion,
}

/// Events per second a relay drains from a pre-filled outbox; see the
/// [module documentation](self).
pub async fn drain_throughput(
    outbox: &Outbox,
    events: usize,
    workers: usize,
    batch_size: usize,
    completion: Completion,
) -> Result<f64, BoxError> {
    let elapsed = drain_time(outbox, DrainSetup { events, workers, batch_size, completion }).await?;
    Ok(events as f64 / elapsed.as_secs_f64())
}

/// Truncates and pre-fills the outbox, then returns how long a relay took to deliver and record
/// every event (only the drain is timed); see the [module documentation](self).
pub async fn drain_time(outbox: &Outbox, setup: DrainSetup) -> Result<Duration, BoxError> {
    if setup.events == 0 {
        return Err("a drain needs at least one event".into());
    }
    let config = RelayConfig {
        workers: setup.workers,
        batch_size: setup.batch_size,
        completion: setup.completion,
        janitor_interval: Duration::ZERO,
        ..RelayConfig::default()
    };
    config.validate()?;
    prefill(outbox, setup.events).await?;

    let handled = Arc::new(AtomicUsize::new(0));
    let all_handled = Arc::new(Notify::new());
    let handler = {
        let (handled, all_handled, events) = (handled.clone(), all_handled.clone(), setup.events);
        handler_fn(move |_event: Event| {
            if handled.fetch_add(1, Ordering::Relaxed) + 1 == events {
                all_handled.notify_one();
            }
            std::future::ready(Ok(()))
        })
    };
    let relay = Relay::new(outbox, config, handler)?;
    let metrics = relay.metrics();
    let (shutdown, stop) = oneshot::channel::<()>();
    let events = setup.events as u64;

    let started = Instant::now();
    let task = tokio::spawn(relay.run(async move {
        stop.await.ok();
    }));
    let limit = DRAIN_TIMEOUT_BASE + DRAIN_TIMEOUT_PER_EVENT * u32::try_from(setup.events).unwrap_or(u32::MAX);
    let drained = tokio::time::timeout(limit, async {
        // Wait cheaply for the handler, then briefly for the last batch's outcome to be written.
        all_handled.notified().await;
        while metrics.snapshot().delivered < events {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
    let elapsed = started.elapsed();

    stop_relay(Some(shutdown), Some(task)).await?;
    if drained.is_err() {
        let snapshot = metrics.snapshot();
        return Err(format!(
            "the relay delivered {} of {events} events within {} ({} retried, {} dead-lettered)",
            snapshot.delivered,
            humantime::format_duration(limit),
            snapshot.retried,
            snapshot.dead_lettered
        )
        .into());
    }
    Ok(elapsed)
}

/// Empties the outbox and fills it with `events` deliverable events, then vacuums and analyzes it.
async fn prefill(outbox: &Outbox, events: usize) -> Result<(), BoxError> {
    let client = outbox.client().await?;
    client.batch_execute("truncate outbox_relay.outbox").await.map_err(db("truncating the outbox"))?;
    client.execute(PREFILL_SQL, &[&i64::try_from(events)?]).await.map_err(db("pre-filling the outbox"))?;
    client.batch_execute("vacuum analyze outbox_relay.outbox").await.map_err(db("vacuuming the outbox"))?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Write path
// ---------------------------------------------------------------------------------------------

/// What one business transaction of the write path writes, besides its `bench_orders` row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteTx {
    /// An `outbox_relay.audit` entry.
    pub audit: bool,
    /// An `outbox_relay.idempotency` receipt under a fresh key.
    pub receipt: bool,
    /// Events in `outbox_relay.outbox`: one is one `insert .. values`; more are one multi-row
    /// insert (`publish_all`'s statement).
    pub events: usize,
}

impl WriteTx {
    /// The business row alone.
    pub const BARE: WriteTx = WriteTx { audit: false, receipt: false, events: 0 };
    /// The business row and its audit entry.
    pub const WITH_AUDIT: WriteTx = WriteTx { audit: true, receipt: false, events: 0 };
    /// The business row, its audit entry and the idempotency receipt.
    pub const WITH_RECEIPT: WriteTx = WriteTx { audit: true, receipt: true, events: 0 };
    /// The full transaction: business row, audit entry, receipt and one event.
    pub const FULL: WriteTx = WriteTx { audit: true, receipt: true, events: 1 };

    /// The full transaction with `events` events.
    pub const fn full_with_events(events: usize) -> WriteTx {
        WriteTx { audit: true, receipt: true, events }
    }
}

/// Creates `bench_orders` if it is missing, empties it and the audit, receipt and outbox tables,
/// and runs a `CHECKPOINT` so that one due to earlier runs' WAL does not land in the next
/// measurement (skipped when the user may not: it needs superuser or `pg_checkpoint`).
pub async fn reset_write_tables(outbox: &Outbox) -> Result<(), BoxError> {
    let client = outbox.client().await?;
    client.batch_execute(ORDERS_CREATE).await.map_err(db("creating the bench_orders table"))?;
    client.batch_execute(WRITE_TABLES_TRUNCATE).await.map_err(db("truncating the write-path tables"))?;
    if let Err(e) = client.batch_execute("checkpoint").await {
        tracing::debug!(error = %e, "no checkpoint before the write measurement");
    }
    Ok(())
}

/// Commits per second of `writers` concurrent writers running the full transaction
/// ([`WriteTx::FULL`]) for `duration`, with the trigger in `mode`. The tables are emptied first,
/// no relay runs, and the trigger is back to normal afterwards.
pub async fn write_tps(outbox: &Outbox, writers: usize, duration: Duration, mode: NotifyMode) -> Result<f64, BoxError> {
    set_notify_mode(outbox, mode).await?;
    let measured = async {
        reset_write_tables(outbox).await?;
        let mut writers = Writers::connect(outbox, writers, WriteTx::FULL).await?;
        let (commits, elapsed) = writers.run_for(duration).await?;
        Ok::<_, BoxError>(commits as f64 / elapsed.as_secs_f64())
    }
    .await;
    let restored = reset_notify(outbox).await;
    let tps = measured?;
    restored?;
    Ok(tps)
}

/// Concurrent writers, each a task with its own connection and prepared statements, running one
/// kind of business transaction ([`WriteTx`]).
pub struct Writers {
    writers: Vec<Writer>,
    shape: WriteTx,
}

impl fmt::Debug for Writers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Writers")
            .field("writers", &self.writers.len())
            .field("shape", &self.shape)
            .finish_non_exhaustive()
    }
}

impl Writers {
    /// Opens `count` connections to `outbox`'s database and prepares their statements; creates
    /// `bench_orders` if it is missing.
    pub async fn connect(outbox: &Outbox, count: usize, shape: WriteTx) -> Result<Writers, BoxError> {
        if count == 0 {
            return Err("at least one writer is needed".into());
        }
        {
            let client = outbox.client().await?;
            client.batch_execute(ORDERS_CREATE).await.map_err(db("creating the bench_orders table"))?;
        }
        let run: u64 = rand::random();
        let connecting = (0..count).map(|n| Writer::connect(outbox, format!("bench-{run:016x}-{n}")));
        let writers = futures::future::try_join_all(connecting).await?;
        Ok(Writers { writers, shape })
    }

    /// How many writers there are.
    pub fn len(&self) -> usize {
        self.writers.len()
    }

    /// Always false: there is at least one writer.
    pub fn is_empty(&self) -> bool {
        self.writers.is_empty()
    }

    /// Runs `total` transactions, spread evenly over the writers, and returns the wall time.
    pub async fn run_count(&mut self, total: u64) -> Result<Duration, BoxError> {
        let n = self.writers.len() as u64;
        let started = Instant::now();
        self.run(|i| Quota::Count(total / n + u64::from((i as u64) < total % n))).await?;
        Ok(started.elapsed())
    }

    /// Runs transactions on every writer until `duration` has passed (each finishes the one it
    /// is in) and returns how many committed and the wall time until the last writer finished.
    pub async fn run_for(&mut self, duration: Duration) -> Result<(u64, Duration), BoxError> {
        let started = Instant::now();
        let deadline = started + duration;
        let commits = self.run(|_| Quota::Until(deadline)).await?;
        Ok((commits, started.elapsed()))
    }

    /// Runs every writer in its own task with its quota; returns the commits. A writer that
    /// failed is lost, and with it this value's use: the first error is returned.
    async fn run(&mut self, quota: impl Fn(usize) -> Quota) -> Result<u64, BoxError> {
        let shape = self.shape;
        let tasks: Vec<_> = std::mem::take(&mut self.writers)
            .into_iter()
            .enumerate()
            .map(|(i, mut writer)| {
                let quota = quota(i);
                tokio::spawn(async move {
                    let result = writer.run(shape, quota).await;
                    (writer, result)
                })
            })
            .collect();
        let mut commits = 0;
        let mut first_error: Option<BoxError> = None;
        for task in tasks {
            match task.await {
                Ok((writer, Ok(n))) => {
                    commits += n;
                    self.writers.push(writer);
                }
                Ok((_, Err(e))) => {
                    first_error.get_or_insert(e);
                }
                Err(e) => {
                    first_error.get_or_insert(format!("a writer task failed: {e}").into());
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(commits),
        }
    }
}

/// How long one writer runs.
#[derive(Clone, Copy)]
enum Quota {
    Count(u64),
    Until(Instant),
}

/// One writer's connection, statements and key sequence.
struct Writer {
    client: tokio_postgres::Client,
    statements: Statements,
    key_prefix: String,
    next_key: u64,
}

struct Statements {
    order: Statement,
    audit: Statement,
    receipt: Statement,
    event: Statement,
    events: Statement,
}

impl Writer {
    async fn connect(outbox: &Outbox, key_prefix: String) -> Result<Writer, BoxError> {
        let client = outbox.url().connect().await?;
        client
            .batch_execute(&format!("set statement_timeout = '{STATEMENT_TIMEOUT}'"))
            .await
            .map_err(db("configuring a writer connection"))?;
        let prepare = |sql: &'static str| client.prepare(sql);
        let (order, audit, receipt, event, events) = futures::try_join!(
            prepare(ORDERS_INSERT),
            prepare(crate::sql::AUDIT_INSERT),
            prepare(RECEIPT_INSERT),
            prepare(crate::sql::EVENT_INSERT),
            prepare(crate::sql::EVENT_INSERT_MANY),
        )
        .map_err(db("preparing the write-path statements"))?;
        let statements = Statements { order, audit, receipt, event, events };
        Ok(Writer { client, statements, key_prefix, next_key: 0 })
    }

    async fn run(&mut self, shape: WriteTx, quota: Quota) -> Result<u64, BoxError> {
        let mut commits = 0;
        loop {
            let more = match quota {
                Quota::Count(n) => commits < n,
                Quota::Until(deadline) => Instant::now() < deadline,
            };
            if !more {
                return Ok(commits);
            }
            self.transaction(shape).await?;
            commits += 1;
        }
    }

    /// One business transaction, statement by statement, as a service would run it.
    async fn transaction(&mut self, shape: WriteTx) -> Result<(), BoxError> {
        self.next_key += 1;
        let key = format!("{}-{}", self.key_prefix, self.next_key);
        let s = &self.statements;
        let tx = self.client.transaction().await.map_err(db("starting a transaction"))?;
        let row = tx.query_one(&s.order, &[&CUSTOMER, &TOTAL]).await.map_err(db("inserting the business row"))?;
        let order_id: i64 = row.get(0);
        if shape.audit {
            let entry = AuditEntry {
                entity: "order",
                entity_id: order_id.to_string(),
                action: "placed",
                data: json!({"customer": CUSTOMER, "total": TOTAL}),
            };
            let key = shape.receipt.then_some(key.as_str());
            crate::publish::insert_audit(&tx, &s.audit, &entry, key).await?;
        }
        if shape.receipt {
            let response = json!({"order_id": order_id});
            let fingerprint: &[u8] = &FINGERPRINT;
            tx.execute(&s.receipt, &[&key, &fingerprint, &response]).await.map_err(db("storing the receipt"))?;
        }
        let event =
            |n: usize| NewEvent::new("order.placed", json!({"order_id": order_id, "n": n})).key(order_id.to_string());
        match shape.events {
            0 => {}
            1 => {
                crate::publish::insert_event(&tx, &s.event, &event(0)).await?;
            }
            n => {
                let events: Vec<NewEvent> = (0..n).map(event).collect();
                crate::publish::insert_events(&tx, &s.events, &events).await?;
            }
        }
        tx.commit().await.map_err(db("committing"))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn database_names_are_safe_identifiers() {
        assert_eq!(database_name("latency"), "outbox_bench_latency");
        assert_eq!(database_name("Notify Cost!"), "outbox_bench_notify_cost_");
        assert_eq!(database_name(""), "outbox_bench_default");
        assert_eq!(database_name(&"x".repeat(100)).len(), 63);
        assert_eq!(database_name("é\"; drop"), "outbox_bench_____drop");
    }

    #[test]
    fn the_database_of_a_url_is_replaced() {
        let cases = [
            ("postgres://app:pw@db:5432/shop", "postgres://app:pw@db:5432/outbox_bench_x"),
            ("postgresql://app@db", "postgresql://app@db/outbox_bench_x"),
            ("postgres://app@db/shop?sslmode=disable", "postgres://app@db/outbox_bench_x?sslmode=disable"),
            (
                "postgres://app@db/?dbname=shop&application_name=a",
                "postgres://app@db/outbox_bench_x?application_name=a",
            ),
            (
                "postgres://app@%2Fvar%2Frun%2Fpostgresql/shop",
                "postgres://app@%2Fvar%2Frun%2Fpostgresql/outbox_bench_x",
            ),
            ("host=db user=app dbname=shop", "host=db user=app dbname=shop dbname=outbox_bench_x"),
        ];
        for (url, expected) in cases {
            assert_eq!(with_database(url, "outbox_bench_x").unwrap(), expected, "{url}");
        }
        assert!(with_database("nonsense", "x").is_err());
    }

    #[test]
    fn a_key_value_string_keeps_the_last_dbname() {
        let url = with_database("host=db user=app dbname=shop", "outbox_bench_x").unwrap();
        let config: tokio_postgres::Config = url.parse().unwrap();
        assert_eq!(config.get_dbname(), Some("outbox_bench_x"));
    }

    #[test]
    fn wake_paths_print_readably() {
        assert_eq!(WakePath::Notify.to_string(), "NOTIFY");
        assert_eq!(WakePath::InProcess.to_string(), "in-process");
        assert_eq!(WakePath::Poll(ms(100)).to_string(), "poll 100ms");
    }

    #[test]
    fn poll_pauses_spread_over_the_interval() {
        let poll = WakePath::Poll(ms(100));
        let pauses: Vec<Duration> = (0..200).map(|_| pause_before_sample(poll)).collect();
        assert!(pauses.iter().all(|p| *p < ms(100)));
        assert!(pauses.iter().any(|p| *p > ms(10)), "pauses should spread over the whole interval");
        assert!((0..100).all(|_| pause_before_sample(WakePath::Notify) < MAX_PAUSE));
        assert_eq!(pause_before_sample(WakePath::Poll(Duration::ZERO)), Duration::ZERO);
    }
}
