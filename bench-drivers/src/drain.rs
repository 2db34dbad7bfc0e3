//! Events per second a relay drains from a pre-filled outbox, to a no-op handler or to any
//! handler (a sink).

use std::time::{Duration, Instant};

use pg_outbox_relay::{
    DEFAULT_DESTINATION, Event, Handler, MetricsSnapshot, Outbox, Relay, RelayConfig, Route, handler_fn,
};
use tokio::sync::oneshot;

use super::cpu::{CpuProfile, CpuSample};
use super::latency::stop_relay;
use super::{BoxError, db};

/// A drain may take this long, plus [`DRAIN_TIMEOUT_PER_EVENT`] per event.
const DRAIN_TIMEOUT_BASE: Duration = Duration::from_secs(60);
/// See [`DRAIN_TIMEOUT_BASE`].
const DRAIN_TIMEOUT_PER_EVENT: Duration = Duration::from_millis(5);
/// Events without a key, or spread round-robin over `$2` keys (`null`: none).
const PREFILL_SQL: &str = "\
insert into outbox_relay.outbox (topic, key, payload)
select 'bench.drain', case when $2::int8 is null then null else 'k' || (g % $2::int8) end, jsonb_build_object('n', g)
  from generate_series(1, $1::int8) as g
 order by g";

/// How the relay is set up for a drain measurement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrainSetup {
    /// Events pre-filled and drained.
    pub events: usize,
    /// Relay workers.
    pub workers: usize,
    /// Events per claim.
    pub batch_size: usize,
    /// How long delivered events stay in the outbox (the relay's `retention`: its default keeps
    /// them through the drain; zero has the sweeper remove them as the drain goes).
    pub retention: Duration,
    /// The events spread round-robin over this many keys (each key delivered in order), or no
    /// key at all.
    pub keys: Option<usize>,
}

impl DrainSetup {
    /// `events` without keys, with the relay's default settings otherwise.
    pub fn defaults(events: usize) -> DrainSetup {
        let config = RelayConfig::default();
        DrainSetup {
            events,
            workers: config.workers,
            batch_size: config.batch_size,
            retention: config.retention,
            keys: None,
        }
    }

    /// The relay's configuration for it: its workers, batch size and retention, the janitor
    /// off, the defaults otherwise.
    pub fn config(&self) -> RelayConfig {
        RelayConfig {
            workers: self.workers,
            batch_size: self.batch_size,
            retention: self.retention,
            janitor_interval: Duration::ZERO,
            ..RelayConfig::default()
        }
    }
}

/// Events per second a relay drains from a pre-filled outbox to a no-op handler; see the
/// [module documentation](super).
pub async fn drain_throughput(outbox: &Outbox, setup: DrainSetup) -> Result<f64, BoxError> {
    let elapsed = drain_time(outbox, setup).await?;
    Ok(setup.events as f64 / elapsed.as_secs_f64())
}

/// Truncates and pre-fills the outbox, then returns how long a relay with a no-op handler took
/// to deliver and record every event (only the drain is timed); see the
/// [module documentation](super).
pub async fn drain_time(outbox: &Outbox, setup: DrainSetup) -> Result<Duration, BoxError> {
    drain_to(outbox, setup, handler_fn(|_event: Event| std::future::ready(Ok(())))).await
}

/// [`drain_time`] with `handler` as the destination (a sink).
pub async fn drain_to<H: Handler>(outbox: &Outbox, setup: DrainSetup, handler: H) -> Result<Duration, BoxError> {
    drain_with(outbox, setup, setup.config(), handler).await
}

/// [`drain_to`] with a relay configuration of one's own (`janitor_interval` should be zero).
pub async fn drain_with<H: Handler>(
    outbox: &Outbox,
    setup: DrainSetup,
    config: RelayConfig,
    handler: H,
) -> Result<Duration, BoxError> {
    Ok(drain_measured(outbox, setup, config, handler).await?.elapsed)
}

/// [`drain_to`] with one destination per name, each taking every event (pattern `#`) and
/// delivering to a clone of `handler`: done when every destination has recorded every event.
pub async fn drain_to_each<H: Handler + Clone>(
    outbox: &Outbox,
    setup: DrainSetup,
    names: &[&str],
    handler: H,
) -> Result<Duration, BoxError> {
    Ok(drain_each_measured(outbox, setup, names, handler).await?.elapsed)
}

/// [`drain_to_each`], with the drain's other figures.
pub async fn drain_each_measured<H: Handler + Clone>(
    outbox: &Outbox,
    setup: DrainSetup,
    names: &[&str],
    handler: H,
) -> Result<Drained, BoxError> {
    let routes = names.iter().map(|name| Route::new(*name, "#", handler.clone())).collect::<Result<Vec<_>, _>>()?;
    drain_routes(outbox, setup, setup.config(), routes).await
}

/// A drain's figures.
pub struct Drained {
    /// When the relay was started.
    pub started: Instant,
    /// From then to the last delivery recorded.
    pub elapsed: Duration,
    /// The relay's metrics at the end.
    pub metrics: MetricsSnapshot,
    /// Where the machine's CPU went meanwhile (this process runs the relay).
    pub cpu: CpuProfile,
}

/// [`drain_with`], returning when the relay started, its metrics at the end and where the CPU
/// went too.
pub async fn drain_measured<H: Handler>(
    outbox: &Outbox,
    setup: DrainSetup,
    config: RelayConfig,
    handler: H,
) -> Result<Drained, BoxError> {
    drain_routes(outbox, setup, config, vec![Route::new(DEFAULT_DESTINATION, "#", handler)?]).await
}

/// [`drain_measured`] with several destinations: done when each has recorded every event its
/// pattern matches (each must match every event); the metrics are the first destination's.
async fn drain_routes<H: Handler>(
    outbox: &Outbox,
    setup: DrainSetup,
    config: RelayConfig,
    routes: Vec<Route<H>>,
) -> Result<Drained, BoxError> {
    if setup.events == 0 {
        return Err("a drain needs at least one event".into());
    }
    config.validate()?;
    prefill(outbox, setup.events, setup.keys).await?;
    let relay = Relay::with_routes(outbox, config, routes)?;
    let metrics = relay.metrics();
    let all: Vec<_> = relay.destination_metrics().into_iter().map(|(_, m)| m).collect();
    let (shutdown, stop) = oneshot::channel::<()>();
    let events = setup.events as u64;

    let cpu = CpuSample::now();
    let started = Instant::now();
    let task = tokio::spawn(relay.run(async move {
        stop.await.ok();
    }));
    let limit = DRAIN_TIMEOUT_BASE + DRAIN_TIMEOUT_PER_EVENT * u32::try_from(setup.events).unwrap_or(u32::MAX);
    // Done when the relay has recorded every delivery (checked every millisecond).
    let drained = tokio::time::timeout(limit, async {
        while all.iter().any(|m| m.snapshot().delivered < events) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
    let elapsed = started.elapsed();
    let cpu = cpu.profile();

    stop_relay(Some(shutdown), Some(task)).await?;
    let snapshot = metrics.snapshot();
    if drained.is_err() {
        return Err(format!(
            "the relay delivered {} of {events} events within {} ({} retried, {} dead-lettered)",
            snapshot.delivered,
            humantime::format_duration(limit),
            snapshot.retried,
            snapshot.dead_lettered
        )
        .into());
    }
    Ok(Drained { started, elapsed, metrics: snapshot, cpu })
}

/// Empties the outbox and the destinations (each drain's relay registers its own, starting from
/// the origin: one left by another drain would keep the rows this one's claims finish), and
/// fills the outbox with `events` deliverable events (over `keys` keys, or none), then vacuums
/// and analyzes it.
async fn prefill(outbox: &Outbox, events: usize, keys: Option<usize>) -> Result<(), BoxError> {
    let client = outbox.connection().await?;
    client
        .batch_execute(
            "truncate outbox_relay.outbox, outbox_relay.parked;
             delete from outbox_relay.destinations;
             delete from outbox_relay.positions where destination <> ''",
        )
        .await
        .map_err(db("truncating the outbox"))?;
    let keys = keys.map(i64::try_from).transpose()?;
    client.execute(PREFILL_SQL, &[&i64::try_from(events)?, &keys]).await.map_err(db("pre-filling the outbox"))?;
    client.batch_execute("vacuum analyze outbox_relay.outbox").await.map_err(db("vacuuming the outbox"))?;
    Ok(())
}

/// The reference the relay's drain is compared with: the bare claim-and-delete loop of the
/// `pgbench` script in `benches/claim_delete.pgbench`, run the way `pgbench -c 4 -j 2 -D
/// batch=100` (simple protocol) runs it. Each of `clients` connections (plain sessions, the
/// server's `synchronous_commit`) loops over
///
/// ```text
/// BEGIN;
/// SELECT coalesce(array_agg(id), '{}') AS ids FROM (SELECT id FROM outbox_relay.outbox
///   WHERE available_at <= now() ORDER BY id LIMIT 100 FOR UPDATE SKIP LOCKED) c;
/// DELETE FROM outbox_relay.outbox WHERE id = ANY('<ids>'::bigint[]);
/// COMMIT;
/// ```
///
/// one statement per round trip, until its claim comes back empty. It delivers nothing and
/// keeps no order, counts no attempt and survives no crash: it is what the database can do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimDeleteLoop {
    /// Events pre-filled and deleted.
    pub events: usize,
    /// Concurrent connections.
    pub clients: usize,
    /// Rows per claim.
    pub batch: usize,
}

/// Truncates and pre-fills the outbox as the drain does, then returns how long `reference`'s
/// clients took to claim and delete every row (only the loop is timed).
pub async fn claim_delete_time(outbox: &Outbox, reference: ClaimDeleteLoop) -> Result<Duration, BoxError> {
    if reference.events == 0 || reference.clients == 0 || reference.batch == 0 {
        return Err("the claim-and-delete loop needs events, clients and a batch size".into());
    }
    prefill(outbox, reference.events, None).await?;
    let mut clients = Vec::with_capacity(reference.clients);
    for _ in 0..reference.clients {
        clients.push(outbox.url().connect().await?);
    }
    let claim = format!(
        "SELECT coalesce(array_agg(id), '{{}}') AS ids FROM (SELECT id FROM outbox_relay.outbox \
         WHERE available_at <= now() ORDER BY id LIMIT {} FOR UPDATE SKIP LOCKED) c",
        reference.batch
    );
    let started = Instant::now();
    let loops = clients.iter().map(|client| claim_delete_until_empty(client, &claim));
    let deleted: u64 = futures::future::try_join_all(loops).await?.into_iter().sum();
    let elapsed = started.elapsed();
    if deleted != reference.events as u64 {
        return Err(format!("the claim-and-delete loop deleted {deleted} of {} rows", reference.events).into());
    }
    Ok(elapsed)
}

/// One client of [`claim_delete_time`]; returns how many rows it deleted.
async fn claim_delete_until_empty(client: &tokio_postgres::Client, claim: &str) -> Result<u64, BoxError> {
    let mut deleted = 0;
    loop {
        client.batch_execute("BEGIN").await.map_err(db("BEGIN"))?;
        let ids = client
            .simple_query(claim)
            .await
            .map_err(db("claiming rows"))?
            .into_iter()
            .find_map(|message| match message {
                tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0).map(str::to_owned),
                _ => None,
            })
            .ok_or("the claim returned no row")?;
        if ids == "{}" {
            client.batch_execute("COMMIT").await.map_err(db("COMMIT"))?;
            return Ok(deleted);
        }
        let delete = format!("DELETE FROM outbox_relay.outbox WHERE id = ANY('{ids}'::bigint[])");
        let rows = client.simple_query(&delete).await.map_err(db("deleting rows"))?;
        deleted += rows
            .iter()
            .find_map(|message| match message {
                tokio_postgres::SimpleQueryMessage::CommandComplete(n) => Some(*n),
                _ => None,
            })
            .unwrap_or(0);
        client.batch_execute("COMMIT").await.map_err(db("COMMIT"))?;
    }
}

/// The floor of a drain: what reading the events costs with no write per event. One client
/// loops over
///
/// ```text
/// BEGIN;
/// SELECT id, topic, key, payload, created_at, uuid, headers FROM outbox_relay.outbox
///  WHERE id > $last ORDER BY id LIMIT $batch;   -- id, topic, key, time decoded; payload, uuid, headers as bytes
/// INSERT INTO <a scratch table> (n, after_id) VALUES ($n, $new_last);   -- one row per batch
/// COMMIT;
/// ```
///
/// in the relay's session settings (`synchronous_commit = off`, generic plans), until a read
/// comes back empty. One client, in id order, because a destination's new events are read in
/// order by one transaction at a time; it keeps no lock, checks no key and delivers nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadLoop {
    /// Events pre-filled and read.
    pub events: usize,
    /// Rows per read.
    pub batch: usize,
}

/// Truncates and pre-fills the outbox as the drain does, then returns how long [`ReadLoop`]
/// took to read every row (only the loop is timed).
pub async fn read_loop_time(outbox: &Outbox, reference: ReadLoop) -> Result<Duration, BoxError> {
    if reference.events == 0 || reference.batch == 0 {
        return Err("the read loop needs events and a batch size".into());
    }
    prefill(outbox, reference.events, None).await?;
    let mut client = outbox.url().connect().await?;
    client
        .batch_execute(
            "set synchronous_commit = off; set plan_cache_mode = force_generic_plan; set jit = off;
             create temporary table read_loop_positions (n int8 primary key, after_id int8 not null,
                                                         at timestamptz not null default now())",
        )
        .await
        .map_err(db("preparing the read loop"))?;
    let read = client
        .prepare(
            "select id, topic, key, payload, created_at, uuid, headers from outbox_relay.outbox
              where id > $1 order by id limit $2",
        )
        .await
        .map_err(db("preparing the read"))?;
    let record = client
        .prepare("insert into read_loop_positions (n, after_id) values ($1, $2)")
        .await
        .map_err(db("preparing the position's insert"))?;
    let batch = i64::try_from(reference.batch)?;
    let (mut last, mut n, mut read_rows) = (0i64, 0i64, 0usize);
    let started = Instant::now();
    loop {
        let tx = client.transaction().await.map_err(db("BEGIN"))?;
        let rows = tx.query(&read, &[&last, &batch]).await.map_err(db("reading events"))?;
        if rows.is_empty() {
            tx.commit().await.map_err(db("COMMIT"))?;
            break;
        }
        for row in &rows {
            let id: i64 = row.try_get(0)?;
            let _topic: String = row.try_get(1)?;
            let _key: Option<String> = row.try_get(2)?;
            let payload: Raw = row.try_get(3)?;
            let _created_at: std::time::SystemTime = row.try_get(4)?;
            let _uuid: Raw = row.try_get(5)?;
            let _headers: Option<Raw> = row.try_get(6)?;
            std::hint::black_box(payload.0.to_vec());
            last = last.max(id);
        }
        read_rows += rows.len();
        n += 1;
        tx.execute(&record, &[&n, &last]).await.map_err(db("recording the position"))?;
        tx.commit().await.map_err(db("COMMIT"))?;
    }
    let elapsed = started.elapsed();
    if read_rows != reference.events {
        return Err(format!("the read loop read {read_rows} of {} rows", reference.events).into());
    }
    Ok(elapsed)
}

/// A column's bytes as the server sent them (binary format), whatever its type.
struct Raw<'a>(&'a [u8]);

impl<'a> tokio_postgres::types::FromSql<'a> for Raw<'a> {
    fn from_sql(
        _: &tokio_postgres::types::Type,
        raw: &'a [u8],
    ) -> Result<Self, Box<dyn std::error::Error + Sync + Send>> {
        Ok(Raw(raw))
    }

    fn accepts(_: &tokio_postgres::types::Type) -> bool {
        true
    }
}
