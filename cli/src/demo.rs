//! `outbox-relay demo`: the article's scenario end to end, with a report a person can read.
//!
//! Orders go through the idempotent write path; clients retry; a burst races on one key; a
//! failure is injected after every write; an embedded relay with two workers delivers to a
//! flaky "ERP" that fails some first attempts and refuses one order for good. The report shows
//! each check and whether it held.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Args;
use pg_outbox_relay::{
    AuditEntry, Begun, DatabaseUrl, DeliveryError, Event, Executed, Handler, NewEvent, Outbox, Percentiles, Relay,
    RelayConfig,
};
use pg_outbox_relay_cluster::{EmbeddedOptions, EmbeddedPostgres};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::sync::Notify;

use crate::outcome::CliError;

/// Options of the demo.
#[derive(Debug, Args)]
pub(crate) struct DemoArgs {
    /// How many orders to place.
    #[arg(long, default_value_t = 40, value_parser = clap::value_parser!(u32).range(6..=10_000))]
    orders: u32,
}

/// The customer whose orders the ERP refuses for good (a permanent failure: dead letter).
const REFUSED_CUSTOMER: &str = "Mallory";

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct PlaceOrder {
    customer: String,
    total: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct Placed {
    order_id: i64,
}

/// The failure injected after all four writes.
#[derive(Debug)]
enum DemoError {
    Outbox(pg_outbox_relay::Error),
    Injected,
}

impl std::error::Error for DemoError {}

impl From<pg_outbox_relay::Error> for DemoError {
    fn from(e: pg_outbox_relay::Error) -> Self {
        DemoError::Outbox(e)
    }
}

impl From<tokio_postgres::Error> for DemoError {
    fn from(e: tokio_postgres::Error) -> Self {
        DemoError::Outbox(e.into())
    }
}

impl std::fmt::Display for DemoError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DemoError::Outbox(e) => e.fmt(f),
            DemoError::Injected => f.write_str("injected failure after all writes"),
        }
    }
}

/// A flaky ERP: the first attempt of every third event fails (transient), and Mallory's orders
/// are refused (permanent). Records successful deliveries and their latency from commit.
struct FlakyErp {
    committed: Arc<Mutex<HashMap<i64, Instant>>>,
    delivered: Mutex<HashMap<i64, u32>>,
    latencies: Mutex<Vec<Duration>>,
    attempts: Mutex<HashMap<i64, i32>>,
    settled: Notify,
}

impl Handler for FlakyErp {
    async fn handle(&self, event: &Event) -> Result<(), DeliveryError> {
        self.attempts.lock().unwrap().insert(event.id, event.attempts);
        let order: serde_json::Value = event.payload.to_value().unwrap_or_default();
        if order["customer"] == REFUSED_CUSTOMER {
            self.settled.notify_one();
            return Err(DeliveryError::permanent("422 from the ERP: customer is blocked"));
        }
        if event.id % 3 == 0 && event.attempts == 1 {
            return Err(DeliveryError::transient("503 from the ERP: try again"));
        }
        let now = Instant::now();
        if event.attempts == 1
            && let Some(committed) = self.committed.lock().unwrap().get(&event.id)
        {
            self.latencies.lock().unwrap().push(now.saturating_duration_since(*committed));
        }
        *self.delivered.lock().unwrap().entry(event.id).or_default() += 1;
        self.settled.notify_one();
        Ok(())
    }
}

/// Waits (at most 10 s) until the embedded relay listens and is marked waiting, so that the
/// latency line is the running relay's: on a slow two-core machine its start (registration, the
/// listener, the first claim) took the first orders' p50 to 6 to 27 ms. A relay that is not
/// ready by then is waited for no longer: the orders go on, and their latency says so.
async fn until_the_relay_listens(outbox: &Outbox) {
    let waited = tokio::time::timeout(Duration::from_secs(10), async {
        while !matches!(outbox.connected_relays().await, Ok(relays) if relays.iter().any(|r| r.waiting)) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    if waited.is_err() {
        tracing::warn!("the embedded relay was not listening after 10 s; the orders are placed all the same");
    }
}

/// One line of the report.
struct Check {
    what: String,
    detail: String,
    ok: bool,
}

fn progress(step: usize, total: usize, text: &str) {
    eprintln!("[{step}/{total}] {text}");
}

pub(crate) async fn run(args: DemoArgs, database_url: Option<String>) -> Result<(), CliError> {
    const STEPS: usize = 7;
    let started = Instant::now();
    // A database of our own: the throwaway cluster, or a fresh database on the given server.
    let embedded;
    let (server_url, where_) = match database_url.filter(|u| !u.is_empty()) {
        Some(url) => (DatabaseUrl::parse(&url)?, "the server of DATABASE_URL".to_string()),
        None => {
            progress(1, STEPS, "no DATABASE_URL: starting a throwaway PostgreSQL (initdb + pg_ctl)");
            embedded = tokio::task::spawn_blocking(|| EmbeddedPostgres::start(EmbeddedOptions::default())).await??;
            let url = DatabaseUrl::parse(&embedded.url())?;
            (url, format!("a throwaway PostgreSQL on port {}", embedded.port()))
        }
    };
    progress(1, STEPS, &format!("creating a demo database on {where_}"));
    let database = format!("outbox_relay_demo_{}", std::process::id());
    let admin = server_url.connect().await?;
    admin.batch_execute(&format!("create database {database}")).await.map_err(|e| {
        format!("cannot create the demo database {database} on {server_url}: {}", pg_outbox_relay::Error::from(e))
    })?;
    let result = scenario(&args, &server_url, &database, STEPS).await;
    admin.batch_execute(&format!("drop database if exists {database} with (force)")).await.ok();
    let (checks, latency) = result?;

    out!();
    out!("outbox-relay demo: {} orders on {where_}, finished in {:.1?}", args.orders, started.elapsed());
    out!();
    let width = checks.iter().map(|c| c.what.len()).max().unwrap_or(0);
    for check in &checks {
        let mark = if check.ok { "PASS" } else { "FAIL" };
        out!("  {mark}  {:<width$}  {}", check.what, check.detail);
    }
    out!();
    out!("  commit-to-delivery latency (first attempts, NOTIFY/in-process wake): {latency}");
    let failed = checks.iter().filter(|c| !c.ok).count();
    if failed > 0 {
        return Err(format!("{failed} of {} checks failed", checks.len()).into());
    }
    out!("  all {} checks passed", checks.len());
    Ok(())
}

async fn scenario(
    args: &DemoArgs,
    server_url: &DatabaseUrl,
    database: &str,
    steps: usize,
) -> Result<(Vec<Check>, String), CliError> {
    let outbox = Outbox::connect_with(server_url.for_database(database), 16).await?;
    outbox.migrate().await?;
    let client = outbox.connection().await?;
    client
        .batch_execute(
            "create table orders (id bigserial primary key, customer text not null, total numeric(12, 2) not null,
                                  created_at timestamptz not null default now())",
        )
        .await?;

    progress(2, steps, "starting an embedded relay with 2 workers and a flaky ERP sink");
    let erp = Arc::new(FlakyErp {
        committed: Arc::default(),
        delivered: Mutex::default(),
        latencies: Mutex::default(),
        attempts: Mutex::default(),
        settled: Notify::new(),
    });
    let relay_config = RelayConfig {
        workers: 2,
        backoff_base: Duration::from_millis(50),
        backoff_max: Duration::from_millis(400),
        max_attempts: 5,
        // Delivered rows are kept for the retention (the default), so that the checks can count
        // them.
        ..RelayConfig::default()
    };
    let relay = Relay::new(&outbox, relay_config, erp.clone())?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let relay_task = tokio::spawn(relay.run(async move {
        stop_rx.await.ok();
    }));
    until_the_relay_listens(&outbox).await;

    let mut checks = Vec::new();
    let customers = ["Ana", "Bruno", "Carla", "Davi", "Elisa", "Fabio", "Gabi"];

    progress(3, steps, &format!("placing {} orders through the idempotent write path", args.orders));
    let mut placed = Vec::new();
    for n in 0..args.orders {
        // One order, the sixth, is for the customer the ERP refuses.
        let customer = if n == 5 { REFUSED_CUSTOMER } else { customers[n as usize % customers.len()] };
        let order = PlaceOrder { customer: customer.into(), total: 10.0 + n as f64 };
        let key = format!("checkout-{n:04}");
        let result = place(&outbox, &erp, &key, &order, false).await?;
        placed.push((key, order, result.response.order_id, result.replayed));
    }
    let counts = Counts::read(&client).await?;
    let n = i64::from(args.orders);
    checks.push(Check {
        what: "each order has its audit row, receipt and order.placed event".into(),
        detail: format!(
            "{} orders, {} audit rows, {} receipts, {} events",
            counts.orders, counts.audit, counts.receipts, counts.events
        ),
        ok: counts == Counts { orders: n, audit: n, receipts: n, events: n } && placed.iter().all(|p| !p.3),
    });

    progress(4, steps, "clients retry after a simulated timeout");
    let retries = placed.len().min(5);
    let mut same = 0;
    for (key, order, order_id, _) in placed.iter().take(retries) {
        let again = place(&outbox, &erp, key, order, false).await?;
        if again.replayed && again.response.order_id == *order_id {
            same += 1;
        }
    }
    let after_retries = Counts::read(&client).await?;
    checks.push(Check {
        what: "retries with the same key get the same order, marked as replays".into(),
        detail: format!("{same} of {retries} replayed with the same order id; nothing new written"),
        ok: same == retries && after_retries == counts,
    });

    let other = PlaceOrder { customer: "Eve".into(), total: 999.0 };
    let reused = place(&outbox, &erp, &placed[0].0, &other, false).await;
    checks.push(Check {
        what: "a key reused for another request is refused".into(),
        detail: match &reused {
            Err(DemoError::Outbox(e)) if e.is_key_reused() => "refused with KeyReused".into(),
            other => format!("unexpected: {:?}", other.as_ref().map(|r| r.response.order_id)),
        },
        ok: matches!(&reused, Err(DemoError::Outbox(e)) if e.is_key_reused()) && Counts::read(&client).await? == counts,
    });

    progress(5, steps, "a burst of 5 concurrent requests with one key");
    let burst_order = PlaceOrder { customer: "Helena".into(), total: 42.0 };
    let burst = futures::future::join_all((0..5).map(|_| {
        let outbox = outbox.clone();
        let erp = erp.clone();
        let order = burst_order.clone();
        tokio::spawn(async move { place(&outbox, &erp, "checkout-burst", &order, false).await })
    }))
    .await;
    let burst: Vec<_> = burst.into_iter().map(|r| r.map_err(|e| e.to_string())).collect::<Result<_, _>>()?;
    let burst: Vec<_> = burst.into_iter().collect::<Result<Vec<_>, _>>().map_err(|e| e.to_string())?;
    let burst_ids: std::collections::BTreeSet<i64> = burst.iter().map(|r| r.response.order_id).collect();
    let fresh = burst.iter().filter(|r| !r.replayed).count();
    let after_burst = Counts::read(&client).await?;
    checks.push(Check {
        what: "5 concurrent requests with one key make one order".into(),
        detail: format!("order ids {burst_ids:?}; {fresh} fresh, {} replays", 5 - fresh),
        ok: burst_ids.len() == 1 && fresh == 1 && after_burst.orders == counts.orders + 1,
    });

    progress(6, steps, "a failure injected after all four writes");
    let doomed =
        place(&outbox, &erp, "checkout-doomed", &PlaceOrder { customer: "Ivo".into(), total: 5.0 }, true).await;
    let after_failure = Counts::read(&client).await?;
    checks.push(Check {
        what: "a failure after all writes leaves nothing behind".into(),
        detail: format!(
            "{}; tables unchanged: {}",
            doomed.as_ref().err().map(ToString::to_string).unwrap_or_else(|| "no error?".into()),
            after_failure == after_burst
        ),
        ok: matches!(doomed, Err(DemoError::Injected)) && after_failure == after_burst,
    });

    progress(7, steps, "waiting for the relay to deliver every event");
    let expected_events = after_failure.events as usize;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let stats = outbox.queue_stats().await?;
        if stats.pending + stats.delayed + stats.in_flight == 0 || Instant::now() > deadline {
            break;
        }
        tokio::select! {
            _ = erp.settled.notified() => {}
            _ = tokio::time::sleep(Duration::from_millis(50)) => {}
        }
    }
    stop_tx.send(()).ok();
    relay_task.await??;

    let stats = outbox.queue_stats().await?;
    let dead = outbox.dead_letters(100).await?;
    let delivered = erp.delivered.lock().unwrap().clone();
    let twice = delivered.values().filter(|n| **n > 1).count();
    let refused_orders = placed.iter().filter(|p| p.1.customer == REFUSED_CUSTOMER).count();
    let attempts = erp.attempts.lock().unwrap().clone();
    let retried = attempts.values().filter(|a| **a > 1).count();
    checks.push(Check {
        what: "the relay delivered every event, retrying transient failures".into(),
        detail: format!(
            "{} delivered, {} of them after a retry; {} events retained (every destination passed them); nothing pending",
            delivered.len(),
            retried,
            stats.retained
        ),
        ok: delivered.len() + refused_orders == expected_events
            && stats.retained as usize == delivered.len() + dead.len()
            && stats.pending + stats.delayed + stats.in_flight == 0
            && retried > 0,
    });
    checks.push(Check {
        what: "refused events went to the dead letters".into(),
        detail: dead
            .first()
            .map(|d| {
                format!(
                    "{} dead letter(s); e.g. event {} after {} attempt(s): {}",
                    dead.len(),
                    d.id,
                    d.attempts,
                    d.last_error
                )
            })
            .unwrap_or_else(|| "none".into()),
        ok: dead.len() == refused_orders,
    });
    let final_counts = Counts::read(&client).await?;
    checks.push(Check {
        what: "nothing lost, nothing written or delivered twice".into(),
        detail: format!(
            "{} orders = {} audit = {} receipts = {} events = {} delivered + {} dead; {} delivered twice",
            final_counts.orders,
            final_counts.audit,
            final_counts.receipts,
            final_counts.events,
            delivered.len(),
            dead.len(),
            twice
        ),
        ok: final_counts.orders == final_counts.audit
            && final_counts.audit == final_counts.receipts
            && final_counts.receipts == final_counts.events
            && final_counts.events as usize == delivered.len() + dead.len()
            && twice == 0,
    });

    let mut latencies = erp.latencies.lock().unwrap().clone();
    let latency = match Percentiles::from_samples(&mut latencies) {
        Some(p) => format!("p50 {:.2?}, p99 {:.2?} over {} events", p.p50, p.p99, latencies.len()),
        None => "no samples".to_string(),
    };
    Ok((checks, latency))
}

/// The article's transaction: order, audit entry, event and receipt, under one key.
async fn place(
    outbox: &Outbox,
    erp: &FlakyErp,
    key: &str,
    order: &PlaceOrder,
    fail_after_writes: bool,
) -> Result<Executed<Placed>, DemoError> {
    let mut connection = outbox.connection().await?;
    let work = match connection.begin(key, order).await? {
        Begun::Replayed(replayed) => return Ok(Executed { response: replayed.response()?, replayed: true }),
        Begun::Fresh(work) => work,
    };
    let row = work
        .query_one(
            "insert into orders (customer, total) values ($1, $2::float8::numeric) returning id",
            &[&order.customer, &order.total],
        )
        .await?;
    let order_id: i64 = row.get(0);
    work.audit(&AuditEntry::new("order", order_id, "placed", order)?).await?;
    let event =
        NewEvent::new("order.placed", json!({"order_id": order_id, "customer": order.customer, "total": order.total}))
            .key(order_id.to_string());
    let event_id = work.publish(&event).await?;
    if fail_after_writes {
        return Err(DemoError::Injected); // dropping `work` rolls all four writes back
    }
    let placed = Placed { order_id };
    // Latency is measured from here: the last moment before the commit.
    erp.committed.lock().unwrap().insert(event_id, Instant::now());
    work.commit(&placed).await?;
    Ok(Executed { response: placed, replayed: false })
}

#[derive(Debug, PartialEq, Eq, Clone, Copy)]
struct Counts {
    orders: i64,
    audit: i64,
    receipts: i64,
    events: i64,
}

impl Counts {
    async fn read(client: &tokio_postgres::Client) -> Result<Counts, CliError> {
        let row = client
            .query_one(
                "select (select count(*) from orders), (select count(*) from outbox_relay.audit),
                        (select count(*) from outbox_relay.idempotency),
                        (select count(*) from outbox_relay.outbox)",
                &[],
            )
            .await?;
        Ok(Counts { orders: row.get(0), audit: row.get(1), receipts: row.get(2), events: row.get(3) })
    }
}
