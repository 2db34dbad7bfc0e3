//! Real faults, no switches in the code: a relay process killed with SIGKILL mid-batch, a
//! PostgreSQL server restarted (fast and immediate) under a running relay and writer, connections
//! cut by a TCP proxy, many concurrent writers racing on overlapping idempotency keys with
//! injected failures, and a burst of notifications while every worker is busy. One more test
//! shows that a relay whose database link stalls can still be stopped.
//!
//! Every wait is bounded (a wait that runs out is a failure) and no assertion depends on timing,
//! so a slow machine can only make these tests slower, and a fast one never makes them fail.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use futures::StreamExt;
use outbox_relay::embedded::{EmbeddedOptions, EmbeddedPostgres, StopMode};
use outbox_relay::{DeliveryError, Event, Handler, Outbox, RelayConfig};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::process::{Child, Command};
use tokio::sync::{Semaphore, watch};
use tokio_postgres::{Client, NoTls};

use crate::harness::{TestDb, server};
use crate::orders::{ORDERS_TABLE, PlaceOrder, TestError, place_order};
use crate::relay_support::{self as support, PATIENCE, config, listener_pid, listener_ready, recorder, relay_waiting};

const BIN: &str = env!("CARGO_BIN_EXE_outbox-relay");

/// How long the tests wait for things that take a while even on a quiet machine (a whole backlog
/// drained, a server restarted); only a hang should ever reach it.
const LONG_PATIENCE: Duration = Duration::from_secs(90);

/// Polls `check` every 20 ms until it is true; fails the test after `limit`.
async fn wait_until<F, Fut>(what: &str, limit: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    while !check().await {
        assert!(tokio::time::Instant::now() < deadline, "timed out after {limit:?} waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn connect(url: &str) -> Client {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await.expect("cannot connect");
    tokio::spawn(connection);
    client
}

async fn count(client: &Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).await.unwrap().get(0)
}

// ---------------------------------------------------------------------------------------------
// The orders write path shared by the writer tests: order, audit entry, receipt and event in one
// `execute`, with the idempotency key kept on the order too, so that every row can be traced to
// its key.
// ---------------------------------------------------------------------------------------------

/// Places the order of `key` (always the same request for a key, [`PlaceOrder::for_key`]); with
/// `fail_after_writes` the unit of work fails after all of its writes. Returns the order id and
/// whether the call was a replay.
async fn place(outbox: &Outbox, key: &str, fail_after_writes: bool) -> Result<(i64, bool), TestError> {
    let executed = place_order(outbox, key, &PlaceOrder::for_key(key), fail_after_writes).await?;
    Ok((executed.response.order_id, executed.replayed))
}

/// What the database holds for one idempotency key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct KeyRows {
    orders: i64,
    audit: i64,
    receipts: i64,
    events: i64,
    /// The order's id when there is exactly one order.
    order_id: Option<i64>,
}

impl KeyRows {
    fn all(&self, n: i64) -> bool {
        self.orders == n && self.audit == n && self.receipts == n && self.events == n
    }
}

async fn rows_by_key(client: &Client, keys: &[String]) -> HashMap<String, KeyRows> {
    let rows = client
        .query(
            "select k.key,
                    (select count(*) from orders o where o.key = k.key),
                    (select count(*) from outbox_relay.audit a where a.idempotency_key = k.key),
                    (select count(*) from outbox_relay.idempotency i where i.key = k.key),
                    (select count(*) from outbox_relay.outbox e where e.payload->>'key' = k.key),
                    (select min(o.id) from orders o where o.key = k.key)
               from unnest($1::text[]) as k(key)",
            &[&keys],
        )
        .await
        .unwrap();
    rows.iter()
        .map(|r| {
            let orders: i64 = r.get(1);
            let rows = KeyRows {
                orders,
                audit: r.get(2),
                receipts: r.get(3),
                events: r.get(4),
                order_id: if orders == 1 { r.get(5) } else { None },
            };
            (r.get(0), rows)
        })
        .collect()
}

/// Asserts that orders, audit entries, receipts and events match one to one: equal counts, and no
/// row of one kind without its partners (an event whose payload names a missing order, an audit
/// entry or receipt of another order, an order without its event...). Returns the common count.
async fn assert_no_orphans(client: &Client) -> i64 {
    let row = client
        .query_one(
            "select (select count(*) from orders),
                    (select count(*) from outbox_relay.audit),
                    (select count(*) from outbox_relay.idempotency),
                    (select count(*) from outbox_relay.outbox),
                    (select count(*) from outbox_relay.outbox e
                      where not exists (select 1 from orders o
                                         where o.id = (e.payload->>'order_id')::int8 and o.key = e.payload->>'key')),
                    (select count(*) from outbox_relay.audit a
                      where not exists (select 1 from orders o
                                         where o.id::text = a.entity_id and o.key = a.idempotency_key)),
                    (select count(*) from outbox_relay.idempotency i
                      where not exists (select 1 from orders o
                                         where o.key = i.key and (i.response->>'order_id')::int8 = o.id)),
                    (select count(*) from orders o
                      where not exists (select 1 from outbox_relay.outbox e where (e.payload->>'order_id')::int8 = o.id)
                         or not exists (select 1 from outbox_relay.audit a where a.entity_id = o.id::text)
                         or not exists (select 1 from outbox_relay.idempotency i where i.key = o.key)),
                    (select count(*) from (select key from orders group by key having count(*) > 1) d)",
            &[],
        )
        .await
        .unwrap();
    let [orders, audit, receipts, events, orphan_events, orphan_audit, orphan_receipts, incomplete_orders, dup_keys]: [i64;
        9] = std::array::from_fn(|i| row.get(i));
    assert_eq!(orphan_events, 0, "events whose payload names no order");
    assert_eq!(orphan_audit, 0, "audit entries without their order");
    assert_eq!(orphan_receipts, 0, "receipts without their order (or answering with another order)");
    assert_eq!(incomplete_orders, 0, "orders missing their event, audit entry or receipt");
    assert_eq!(dup_keys, 0, "keys with more than one order");
    assert_eq!((orders, audit, receipts), (events, events, events), "orders, audit entries, receipts and events");
    events
}

// ---------------------------------------------------------------------------------------------
// 1. The relay process killed with SIGKILL in the middle of its batches.
// ---------------------------------------------------------------------------------------------

/// An HTTP receiver that counts the requests per `Outbox-Event-Id` and takes ~30 ms per request.
#[derive(Clone, Default)]
struct SlowReceiver {
    seen: Arc<Mutex<HashMap<i64, usize>>>,
    requests: Arc<AtomicUsize>,
}

async fn slow_hook(State(receiver): State<SlowReceiver>, headers: HeaderMap) -> StatusCode {
    let Some(id) = headers.get("outbox-event-id").and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<i64>().ok())
    else {
        return StatusCode::BAD_REQUEST;
    };
    *receiver.seen.lock().unwrap().entry(id).or_default() += 1;
    receiver.requests.fetch_add(1, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(30)).await;
    StatusCode::OK
}

/// `outbox-relay run` as a child process, its stderr kept for the failure message.
struct RelayProcess {
    child: Child,
    log: Arc<Mutex<String>>,
}

impl RelayProcess {
    fn spawn(url: &str, args: &[&str]) -> RelayProcess {
        let mut child = Command::new(BIN)
            .arg("run")
            .args(args)
            .env("DATABASE_URL", url)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("cannot start outbox-relay run");
        let log = Arc::new(Mutex::new(String::new()));
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let sink = log.clone();
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                let mut log = sink.lock().unwrap();
                log.push_str(&line);
                log.push('\n');
            }
        });
        RelayProcess { child, log }
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    fn pid(&self) -> String {
        self.child.id().expect("still running").to_string()
    }

    /// Sends `signal` with kill(1) and waits for the process to end.
    async fn signal(mut self, signal: &str) -> std::process::ExitStatus {
        let sent = std::process::Command::new("kill").args([signal, &self.pid()]).status().unwrap();
        assert!(sent.success(), "kill {signal} failed");
        match tokio::time::timeout(PATIENCE, self.child.wait()).await {
            Ok(status) => status.unwrap(),
            Err(_) => panic!("outbox-relay run did not end after {signal}; its log:\n{}", self.log()),
        }
    }
}

/// Fault: `outbox-relay run` (2 workers, batches of 10, a 2 s lease) is killed with SIGKILL while
/// it delivers a backlog of 300 events to a slow HTTP receiver; a second process then finishes.
///
/// Proves: nothing is lost (every event reaches the receiver and every row ends processed), and
/// redelivery is confined to what was in flight: only events claimed but not yet recorded by the
/// killed process (at most `workers * batch_size` of them) arrive twice.
#[tokio::test]
async fn relay_killed_mid_batch_redelivers_only_what_was_in_flight() {
    const EVENTS: i64 = 300;
    const WORKERS: usize = 2;
    const BATCH_SIZE: usize = 10;
    let db = TestDb::new().await;
    let client = db.client().await;

    let receiver = SlowReceiver::default();
    let app = axum::Router::new().route("/hook", axum::routing::post(slow_hook)).with_state(receiver.clone());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    client
        .batch_execute(&format!(
            "insert into outbox_relay.outbox (topic, payload)
             select 'fault.kill', jsonb_build_object('n', g) from generate_series(1, {EVENTS}) g"
        ))
        .await
        .unwrap();

    let sink = format!("http://{addr}/hook");
    let (workers, batch_size) = (WORKERS.to_string(), BATCH_SIZE.to_string());
    let args = [
        "--sink",
        &sink,
        "--workers",
        &workers,
        "--batch-size",
        &batch_size,
        "--lease",
        "2s",
        "--poll-interval",
        "100ms",
    ];
    let first = RelayProcess::spawn(&db.url, &args);
    let requests = receiver.requests.clone();
    wait_until("the first relay delivered 50 events", PATIENCE, || {
        let n = requests.load(Ordering::SeqCst);
        async move { n >= 50 }
    })
    .await;
    let first_log = first.log.clone();
    let status = first.signal("-KILL").await;
    use std::os::unix::process::ExitStatusExt as _;
    assert_eq!(status.signal(), Some(9), "killed by SIGKILL: {status:?}");
    let received_at_kill = receiver.requests.load(Ordering::SeqCst);

    // What the killed process held: claimed (leased under its token) and not recorded.
    let in_flight: BTreeSet<i64> = client
        .query("select id from outbox_relay.outbox where processed_at is null and lease_token is not null", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let bound = WORKERS * BATCH_SIZE;
    assert!(in_flight.len() <= bound, "{} events in flight at the kill; at most {bound} can be", in_flight.len());

    let second = RelayProcess::spawn(&db.url, &args);
    wait_until("the second relay processed every event", LONG_PATIENCE, || async {
        count(&client, "select count(*) from outbox_relay.outbox where processed_at is null").await == 0
    })
    .await;
    let second_log = second.log.clone();
    let status = second.signal("-TERM").await;
    assert_eq!(status.code(), Some(0), "SIGTERM stops the relay cleanly; its log:\n{}", second_log.lock().unwrap());

    let seen = receiver.seen.lock().unwrap().clone();
    let ids: Vec<i64> =
        client.query("select id from outbox_relay.outbox", &[]).await.unwrap().iter().map(|r| r.get(0)).collect();
    assert_eq!(ids.len() as i64, EVENTS);
    let missing: Vec<i64> = ids.iter().copied().filter(|id| !seen.contains_key(id)).collect();
    assert!(missing.is_empty(), "never received: {missing:?}");
    assert_eq!(seen.len() as i64, EVENTS, "the receiver saw only ids of this outbox");
    let twice: BTreeSet<i64> = seen.iter().filter(|(_, n)| **n > 1).map(|(id, _)| *id).collect();
    eprintln!(
        "killed after {received_at_kill} requests; {} events in flight at the kill; {} received more than once \
         (bound: workers * batch_size = {bound}); {} requests in all",
        in_flight.len(),
        twice.len(),
        receiver.requests.load(Ordering::SeqCst)
    );
    assert!(seen.values().all(|n| *n <= 2), "no event arrives more than twice: {seen:?}");
    assert!(twice.len() <= bound, "{} events received twice; at most {bound} can be in flight", twice.len());
    assert!(
        twice.is_subset(&in_flight),
        "only events in flight at the kill arrive twice: {:?} were not in flight; first log:\n{}",
        twice.difference(&in_flight).collect::<Vec<_>>(),
        first_log.lock().unwrap()
    );
    assert_eq!(count(&client, "select count(*) from outbox_relay.outbox where processed_at is null").await, 0);
    assert_eq!(count(&client, "select count(*) from outbox_relay.dead_letters").await, 0);
}

// ---------------------------------------------------------------------------------------------
// 2. The database restarted (fast, then immediate) while a relay drains and a writer writes.
// ---------------------------------------------------------------------------------------------

/// What one `execute` call of the writer returned.
#[derive(Debug, Clone)]
enum Outcome {
    Placed(i64),
    Failed(String),
}

#[derive(Default)]
struct WriterLog {
    /// In call order: key, outcome.
    calls: Vec<(String, Outcome)>,
    placed: usize,
}

/// Restarts the private cluster from a blocking thread.
async fn restart(pg: &Arc<EmbeddedPostgres>, mode: StopMode) {
    let pg = pg.clone();
    tokio::task::spawn_blocking(move || pg.restart(mode)).await.unwrap().unwrap_or_else(|e| panic!("restart: {e}"));
}

/// Fault: a private PostgreSQL (never the shared test server) is restarted with `-m fast` and then
/// with `-m immediate` (a crash of every server process, then crash recovery) while an embedded
/// relay delivers and a writer places orders through `execute`, one unique key per call.
///
/// Writer policy: a call that fails is not retried during the run; its key is recorded as failed.
/// Afterwards each failed key is retried once with the same key and request, which is safe and
/// shows what the failure had been: a replay if it had committed (ack lost), a fresh order if not.
///
/// Proves: every call that returned Ok left its order, audit entry, receipt and event (committed
/// data survives both restarts); a failed call left all four or none; no orphans of any kind; the
/// relay recovers by itself (listener reconnects, workers claim again) and delivers every event in
/// the outbox, including those written after the restarts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_restarted_fast_and_immediate_while_relay_drains_and_writer_writes() {
    // Durable: with the default options synchronous_commit is off, and an immediate restart loses
    // the last commits that were acknowledged but not yet written out (seen in every run: keys
    // answered Ok just before the restart had nothing in the database, all four rows gone
    // together), which is the server's setting, not a fault of the library.
    let pg = tokio::task::spawn_blocking(|| EmbeddedPostgres::start(EmbeddedOptions { durable: true }))
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("cannot start a private PostgreSQL: {e}"));
    let pg = Arc::new(pg);
    connect(&pg.url()).await.batch_execute("create database shop").await.unwrap();
    let url = pg.url_for("shop");
    let outbox = Outbox::connect(&url).await.unwrap();
    outbox.migrate().await.unwrap();
    let admin = connect(&url).await;
    admin.batch_execute(ORDERS_TABLE).await.unwrap();
    drop(admin);

    let (handler, deliveries) = recorder();
    let relay_config = RelayConfig {
        poll_interval: Duration::from_millis(200),
        reconnect_max: Duration::from_millis(500),
        ..config()
    };
    let relay = support::start(&outbox, relay_config, handler);

    let log = Arc::new(Mutex::new(WriterLog::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (outbox, log, stop) = (outbox.clone(), log.clone(), stop.clone());
        tokio::spawn(async move {
            let mut n = 0;
            while !stop.load(Ordering::SeqCst) {
                n += 1;
                let key = format!("order-{n:05}");
                let outcome = match place(&outbox, &key, false).await {
                    Ok((order_id, replayed)) => {
                        assert!(!replayed, "a fresh key cannot replay");
                        Outcome::Placed(order_id)
                    }
                    Err(TestError::Outbox(e)) => Outcome::Failed(e.to_string()),
                    Err(TestError::Injected) => unreachable!(),
                };
                let failed = matches!(outcome, Outcome::Failed(_));
                {
                    let mut log = log.lock().unwrap();
                    log.placed += usize::from(!failed);
                    log.calls.push((key, outcome));
                }
                // Between failures (the server is restarting) the writer goes on at a gentle pace.
                tokio::time::sleep(Duration::from_millis(if failed { 20 } else { 2 })).await;
            }
        })
    };
    let placed = |log: &Arc<Mutex<WriterLog>>| log.lock().unwrap().placed;
    let wait_for_orders = |n: usize, what: &'static str| {
        let log = log.clone();
        async move {
            let target = placed(&log) + n;
            wait_until(what, LONG_PATIENCE, || {
                let now = placed(&log);
                async move { now >= target }
            })
            .await;
        }
    };

    wait_for_orders(40, "orders placed before the restarts").await;
    restart(&pg, StopMode::Fast).await;
    wait_for_orders(40, "orders placed after the fast restart").await;
    restart(&pg, StopMode::Immediate).await;
    let first_after_restarts = log.lock().unwrap().calls.len();
    wait_for_orders(40, "orders placed after the immediate restart").await;
    stop.store(true, Ordering::SeqCst);
    tokio::time::timeout(PATIENCE, writer).await.expect("the writer stops").unwrap();

    let calls = std::mem::take(&mut log.lock().unwrap().calls);
    let client = connect(&url).await;
    let keys: Vec<String> = calls.iter().map(|(k, _)| k.clone()).collect();
    let state = rows_by_key(&client, &keys).await;
    let mut failed = Vec::new();
    for (key, outcome) in &calls {
        let rows = state[key];
        match outcome {
            Outcome::Placed(order_id) => {
                assert!(rows.all(1), "{key} returned Ok (order {order_id}) but the database holds {rows:?}");
                assert_eq!(rows.order_id, Some(*order_id), "{key}: the order that was answered");
            }
            Outcome::Failed(error) => {
                assert!(rows.all(1) || rows.all(0), "{key} failed ({error}) and left a partial write: {rows:?}");
                failed.push((key.clone(), rows.all(1), error.clone()));
            }
        }
    }
    let committed_despite_error = failed.iter().filter(|(_, committed, _)| *committed).count();
    eprintln!(
        "{} calls: {} placed, {} failed around the restarts ({} of them had committed)",
        calls.len(),
        calls.len() - failed.len(),
        failed.len(),
        committed_despite_error
    );
    assert!(!failed.is_empty(), "the restarts broke at least one call");
    for (key, _, error) in failed.iter().take(3) {
        eprintln!("  e.g. {key}: {error}");
    }

    // Retrying a failed key with the same request tells what had happened to it.
    for (key, committed, _) in &failed {
        let (order_id, replayed) = match place(&outbox, key, false).await {
            Ok(placed) => placed,
            Err(e) => panic!("retrying {key}: {e:?}"),
        };
        assert_eq!(replayed, *committed, "{key}: a retry replays exactly when the failed call had committed");
        let rows = rows_by_key(&client, std::slice::from_ref(key)).await[key];
        assert!(rows.all(1), "{key} after its retry: {rows:?}");
        assert_eq!(rows.order_id, Some(order_id));
    }
    let orders = assert_no_orphans(&client).await;
    assert_eq!(orders as usize, calls.len(), "one order per key");

    // Every event in the outbox reaches the handler, those written after the restarts too.
    wait_until("every event delivered and marked processed", LONG_PATIENCE, || async {
        let pending = count(&client, "select count(*) from outbox_relay.outbox where processed_at is null").await;
        let delivered = deliveries.counts();
        let ids = client.query("select id from outbox_relay.outbox", &[]).await.unwrap();
        pending == 0 && ids.iter().all(|r| delivered.contains_key(&r.get::<_, i64>(0)))
    })
    .await;
    let late_keys: Vec<String> = calls[first_after_restarts..].iter().map(|(k, _)| k.clone()).collect();
    let late_ids: Vec<i64> = client
        .query("select id from outbox_relay.outbox where payload->>'key' = any($1)", &[&late_keys])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(late_ids.len() >= 40);
    let delivered = deliveries.counts();
    assert!(late_ids.iter().all(|id| delivered.contains_key(id)), "events written after the restarts are delivered");
    let metrics = relay.snapshot();
    eprintln!(
        "relay: {} deliveries of {} events, {} reconnects, {} claims",
        metrics.delivered, orders, metrics.reconnects, metrics.claims
    );
    assert!(metrics.reconnects >= 1, "the listener reconnected by itself: {metrics:?}");
    assert_eq!(count(&client, "select count(*) from outbox_relay.dead_letters").await, 0);

    relay.stop().await;
    outbox.pool().close();
    drop(client);
    drop(outbox);
    let pg = Arc::try_unwrap(pg).expect("the cluster is no longer shared");
    tokio::task::spawn_blocking(move || drop(pg)).await.unwrap();
}

// ---------------------------------------------------------------------------------------------
// 3. Connections cut by a TCP proxy between the relay and the server.
// ---------------------------------------------------------------------------------------------

/// What the proxy does with traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Link {
    /// Forwards both ways.
    Open,
    /// Closes every connection and closes each new one at once.
    Cut,
    /// Keeps every connection open but forwards nothing.
    Stalled,
}

/// Where the proxy connects to: the test server's TCP address or Unix socket.
#[derive(Debug, Clone)]
enum Upstream {
    Tcp(String, u16),
    Unix(std::path::PathBuf),
}

/// A TCP proxy on 127.0.0.1 that can cut or stall every connection it carries.
struct Proxy {
    port: u16,
    link: watch::Sender<Link>,
    refused: Arc<AtomicUsize>,
    accepted: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    async fn start(upstream: Upstream) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (link, state) = watch::channel(Link::Open);
        let (refused, accepted) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let task = {
            let (refused, accepted) = (refused.clone(), accepted.clone());
            tokio::spawn(async move {
                loop {
                    let Ok((client, _)) = listener.accept().await else { continue };
                    if *state.borrow() == Link::Cut {
                        refused.fetch_add(1, Ordering::SeqCst);
                        drop(client);
                        continue;
                    }
                    accepted.fetch_add(1, Ordering::SeqCst);
                    let (upstream, state) = (upstream.clone(), state.clone());
                    tokio::spawn(async move {
                        match upstream {
                            Upstream::Tcp(host, port) => {
                                if let Ok(server) = TcpStream::connect((host.as_str(), port)).await {
                                    pipe(client, server, state).await;
                                }
                            }
                            Upstream::Unix(path) => {
                                if let Ok(server) = tokio::net::UnixStream::connect(path).await {
                                    pipe(client, server, state).await;
                                }
                            }
                        }
                    });
                }
            })
        };
        Proxy { port, link, refused, accepted, task }
    }

    fn set(&self, link: Link) {
        self.link.send_replace(link);
    }

    fn refused(&self) -> usize {
        self.refused.load(Ordering::SeqCst)
    }

    /// A connection string for `database` through this proxy, with the test server's credentials.
    fn conninfo(&self, database: &str) -> String {
        let config = server().config_for(database);
        let quote = |s: &str| format!("'{}'", s.replace('\\', "\\\\").replace('\'', "\\'"));
        let mut info = format!("host=127.0.0.1 port={} dbname={}", self.port, quote(database));
        if let Some(user) = config.get_user() {
            info.push_str(&format!(" user={}", quote(user)));
        }
        if let Some(password) = config.get_password() {
            info.push_str(&format!(" password={}", quote(&String::from_utf8_lossy(password))));
        }
        info
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
        self.link.send_replace(Link::Cut);
    }
}

fn upstream(database: &str) -> Upstream {
    let config = server().config_for(database);
    let port = config.get_ports().first().copied().unwrap_or(5432);
    match &config.get_hosts()[0] {
        tokio_postgres::config::Host::Tcp(host) => Upstream::Tcp(host.clone(), port),
        tokio_postgres::config::Host::Unix(dir) => Upstream::Unix(dir.join(format!(".s.PGSQL.{port}"))),
    }
}

/// Copies both ways until either side closes or the link is cut; then both sockets are closed.
async fn pipe<S>(client: TcpStream, server: S, mut state: watch::Receiver<Link>)
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = tokio::io::split(server);
    tokio::select! {
        _ = forward(client_read, server_write, state.clone()) => {}
        _ = forward(server_read, client_write, state.clone()) => {}
        _ = state.wait_for(|link| *link == Link::Cut) => {}
    }
}

async fn forward(mut from: impl AsyncRead + Unpin, mut to: impl AsyncWrite + Unpin, mut state: watch::Receiver<Link>) {
    let mut buffer = vec![0u8; 16 * 1024];
    loop {
        if state.wait_for(|link| *link != Link::Stalled).await.is_err() {
            return;
        }
        let n = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if state.wait_for(|link| *link != Link::Stalled).await.is_err() {
            return;
        }
        if to.write_all(&buffer[..n]).await.is_err() {
            return;
        }
    }
}

async fn publish_direct(client: &Client, topic: &str, n: i32) -> i64 {
    client
        .query_one("select outbox_relay.publish($1, jsonb_build_object('n', $2::int))", &[&topic, &n])
        .await
        .unwrap()
        .get(0)
}

/// Fault: every connection between the relay and PostgreSQL goes through a TCP proxy that cuts
/// them all at once and then closes each new connection for a while (the relay's reconnection
/// attempts fail); meanwhile events are inserted directly. The fallback poll is an hour, so
/// nothing but the relay's own recovery can deliver them.
///
/// Proves: the relay notices the cut at once, keeps reconnecting while refused, and once the link
/// is back it listens again and catches up on the events committed while it was cut off (whose
/// notifications nobody received); a later event is delivered through NOTIFY as before.
#[tokio::test]
async fn connections_cut_by_a_proxy_are_noticed_and_the_relay_catches_up() {
    let db = TestDb::new().await;
    let proxy = Proxy::start(upstream(&db.name)).await;
    let outbox = Outbox::connect(&proxy.conninfo(&db.name)).await.unwrap();
    let (handler, mut deliveries) = recorder();
    let cfg =
        RelayConfig { poll_interval: Duration::from_secs(3600), reconnect_max: Duration::from_millis(500), ..config() };
    let relay = support::start(&outbox, cfg, handler);
    let direct = db.client().await;
    relay_waiting(&direct).await;
    let before = publish_direct(&direct, "fault.before", 0).await;
    assert_eq!(deliveries.next().await.event.id, before);
    // Recorded, so that the cut finds the relay idle rather than between a delivery and its record.
    wait_until("the first delivery recorded", PATIENCE, || {
        let delivered = relay.snapshot().delivered;
        async move { delivered == 1 }
    })
    .await;
    let through_proxy = proxy.accepted.load(Ordering::SeqCst);
    assert!(through_proxy >= 2, "the relay's listener and pool go through the proxy");

    proxy.set(Link::Cut);
    let cut_at = tokio::time::Instant::now();
    wait_until("the relay's listener connection closed", PATIENCE, || async { listener_pid(&direct).await.is_none() })
        .await;
    let mut during = BTreeSet::new();
    for n in 0..20 {
        during.insert(publish_direct(&direct, "fault.during_cut", n).await);
    }
    // The relay tries to reconnect and is refused, several times, before the link comes back.
    wait_until("refused reconnection attempts", PATIENCE, || {
        let refused = proxy.refused();
        async move { refused >= 3 }
    })
    .await;
    // Keep it cut for about 3 s in all, long enough for the reconnection backoff to reach its cap.
    tokio::time::sleep_until(cut_at + Duration::from_secs(3)).await;
    assert!(deliveries.is_empty(), "nothing can be delivered while the link is cut");
    proxy.set(Link::Open);

    let mut got = BTreeSet::new();
    while !during.is_subset(&got) {
        got.insert(deliveries.next().await.event.id);
    }
    assert_eq!(got, during, "exactly the events committed during the cut, each once");
    listener_ready(&direct).await;
    // The relay marks itself waiting again under its new listener backend.
    wait_until("the relay waiting under its new listener", PATIENCE, || async {
        let Some(pid) = listener_pid(&direct).await else { return false };
        direct
            .query_one("select exists (select 1 from outbox_relay.relays where waiting and listener_pid = $1)", &[&pid])
            .await
            .unwrap()
            .get(0)
    })
    .await;
    let after = publish_direct(&direct, "fault.after", 0).await;
    assert_eq!(deliveries.next().await.event.id, after);

    let metrics = relay.snapshot();
    eprintln!(
        "cut: {} connections refused while cut; relay reconnected {} time(s), {} claims",
        proxy.refused(),
        metrics.reconnects,
        metrics.claims
    );
    assert!(metrics.reconnects >= 1, "{metrics:?}");
    let counts = deliveries.counts();
    assert!(counts.values().all(|n| *n == 1), "nothing delivered twice: {counts:?}");
    relay.stop().await;
    outbox.pool().close();
}

/// Fault: the proxy stalls: every connection stays open and nothing is forwarded either way, as
/// with a frozen server or a hung pooler. Then the relay is asked to stop.
///
/// This is not the black hole of a dead network: the proxy's kernel still acknowledges data and
/// TCP keepalive probes, so neither keepalives nor `tcp_user_timeout` can tell (making a real
/// black hole needs packet filtering, which a test must not do to the machine). Measured by hand:
/// a relay behind a stalled link for 75 s neither reconnected nor claimed, and resumed as soon
/// as the link did.
///
/// Proves: `Relay::run` returns after shutdown even when the database does not answer: after
/// `shutdown_grace` the workers blocked on the stalled link are abandoned after a bound, as is the
/// removal of the relay's waiting mark (their events come back when their lease ends).
#[tokio::test]
async fn a_stalled_database_link_does_not_hold_up_the_relay_shutdown() {
    let db = TestDb::new().await;
    let proxy = Proxy::start(upstream(&db.name)).await;
    let outbox = Outbox::connect(&proxy.conninfo(&db.name)).await.unwrap();
    let (handler, mut deliveries) = recorder();
    let cfg =
        RelayConfig { poll_interval: Duration::from_millis(200), shutdown_grace: Duration::from_secs(1), ..config() };
    let relay = support::start(&outbox, cfg, handler);
    let direct = db.client().await;
    relay_waiting(&direct).await;
    let before = publish_direct(&direct, "fault.before", 0).await;
    assert_eq!(deliveries.next().await.event.id, before);
    proxy.set(Link::Stalled);
    // A few fallback polls: a worker's claim is now waiting on the stalled link.
    tokio::time::sleep(Duration::from_secs(1)).await;
    // Within PATIENCE (30 s); the relay's own bounds add up to about 10 s after the 1 s grace.
    relay.stop().await;
    outbox.pool().close();
}

// ---------------------------------------------------------------------------------------------
// 4. Concurrent writers, overlapping keys, injected failures.
// ---------------------------------------------------------------------------------------------

/// Fault: 8 tasks run 400 `execute` calls over 60 keys (so the same key is often in flight in
/// several tasks at once), each call failing on purpose after all of its writes one time in five
/// (and every call for 4 of the keys, so that some keys only ever fail). Every key always carries
/// the same request, so no call is refused as a reused key.
///
/// Proves: per key exactly one order, audit entry, receipt and event exist when any call for it
/// succeeded, and none when every call failed; exactly one call per key did the work and every
/// other success was a replay of the same order; totals match and nothing is orphaned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_path_under_concurrency_with_overlapping_keys_and_injected_failures() {
    const TASKS: usize = 8;
    const OPS_PER_TASK: usize = 50;
    const KEYS: usize = 60;
    // Every call for these keys fails: they must end with nothing at all.
    const DOOMED: usize = 4;
    let db = TestDb::new().await;
    let client = db.client().await;
    client.batch_execute(ORDERS_TABLE).await.unwrap();

    let tasks: Vec<_> = (0..TASKS)
        .map(|_| {
            let outbox = db.outbox.clone();
            tokio::spawn(async move {
                let mut results = Vec::new();
                for _ in 0..OPS_PER_TASK {
                    let k = rand::random_range(0..KEYS);
                    let key = format!("key-{k:02}");
                    let fail = k < DOOMED || rand::random::<f64>() < 0.2;
                    let result = match place(&outbox, &key, fail).await {
                        Ok(placed) => Some(placed),
                        Err(TestError::Injected) => None,
                        Err(TestError::Outbox(e)) => panic!("{key}: unexpected error {e}"),
                    };
                    results.push((key, fail, result));
                }
                results
            })
        })
        .collect();
    let mut by_key: BTreeMap<String, Vec<Option<(i64, bool)>>> = BTreeMap::new();
    for task in tasks {
        let results = tokio::time::timeout(LONG_PATIENCE, task).await.expect("writers finish").unwrap();
        for (key, _, result) in results {
            by_key.entry(key).or_default().push(result);
        }
    }

    let keys: Vec<String> = (0..KEYS).map(|k| format!("key-{k:02}")).collect();
    let state = rows_by_key(&client, &keys).await;
    let (mut placed_keys, mut failed_keys, mut replays) = (0, 0, 0);
    for key in &keys {
        let rows = state[key];
        let successes: Vec<(i64, bool)> = by_key.get(key).into_iter().flatten().flatten().copied().collect();
        if successes.is_empty() {
            assert!(rows.all(0), "{key}: every call failed (or none ran), yet the database holds {rows:?}");
            failed_keys += usize::from(by_key.contains_key(key));
            continue;
        }
        placed_keys += 1;
        assert!(rows.all(1), "{key}: exactly one order, audit entry, receipt and event: {rows:?}");
        let fresh = successes.iter().filter(|(_, replayed)| !replayed).count();
        assert_eq!(fresh, 1, "{key}: exactly one call did the work: {successes:?}");
        replays += successes.len() - 1;
        assert!(
            successes.iter().all(|(order_id, _)| Some(*order_id) == rows.order_id),
            "{key}: every success answers with the stored order {:?}: {successes:?}",
            rows.order_id
        );
    }
    let total = assert_no_orphans(&client).await;
    assert_eq!(total as usize, placed_keys);
    assert!(
        failed_keys >= 1 && placed_keys >= KEYS / 2,
        "both outcomes occurred: {failed_keys} failed, {placed_keys} placed"
    );
    let calls: usize = by_key.values().map(Vec::len).sum();
    let injected = by_key.values().flatten().filter(|r| r.is_none()).count();
    assert_eq!(calls, TASKS * OPS_PER_TASK);
    eprintln!(
        "{calls} calls over {} keys: {placed_keys} keys placed, {failed_keys} keys with only failed calls, \
         {injected} injected failures, {replays} replays",
        by_key.len()
    );
}

// ---------------------------------------------------------------------------------------------
// 5. A burst of notifications while every worker is busy.
// ---------------------------------------------------------------------------------------------

/// A handler that holds every delivery until the gate opens: the workers are busy for as long as
/// the test wants.
struct Gate(Arc<Semaphore>);

impl Handler for Gate {
    async fn handle(&self, _event: &Event) -> Result<(), DeliveryError> {
        let _permit = self.0.acquire().await.map_err(|_| DeliveryError::transient("gate closed"))?;
        Ok(())
    }
}

/// Samples `pg_notification_queue_usage()` on its own connection until stopped; returns the maximum.
fn sample_queue_usage(client: Client, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<(f64, usize)> {
    tokio::spawn(async move {
        let (mut max, mut samples) = (0f64, 0usize);
        loop {
            let usage: f64 = client.query_one("select pg_notification_queue_usage()", &[]).await.unwrap().get(0);
            max = max.max(usage);
            samples += 1;
            if stop.load(Ordering::SeqCst) {
                return (max, samples);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
}

/// Inserts `statements` statements of 5 events each, pipelined on 4 connections; every statement
/// is its own transaction, so each one sends a notification. Returns the largest queue usage
/// sampled during the burst and right after it.
async fn burst(db: &TestDb, statements: usize) -> (f64, usize) {
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = sample_queue_usage(db.client().await, stop.clone());
    let mut writers = Vec::new();
    for _ in 0..4 {
        let client = db.client().await;
        writers.push(tokio::spawn(async move {
            let insert = client
                .prepare(
                    "insert into outbox_relay.outbox (topic, payload)
                     select 'fault.burst', jsonb_build_object('n', g) from generate_series(1, 5) g",
                )
                .await
                .unwrap();
            let client = &client;
            let insert = &insert;
            futures::stream::iter(0..statements / 4)
                .map(|_| async move { client.execute(insert, &[]).await.unwrap() })
                .buffer_unordered(32)
                .for_each(|_| async {})
                .await;
        }));
    }
    for writer in writers {
        tokio::time::timeout(LONG_PATIENCE, writer).await.expect("the burst ends").unwrap();
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    stop.store(true, Ordering::SeqCst);
    tokio::time::timeout(PATIENCE, sampler).await.expect("sampler stops").unwrap()
}

/// Fault: a burst of 20,000 single-statement transactions (100,000 events, pipelined on 4
/// connections) while both workers of the relay are stuck in their deliveries; a row in
/// `outbox_relay.relays` that claims to be a waiting relay makes every statement notify. The same
/// burst is then repeated with a second listener that stops reading (it LISTENs, then stays in an
/// open transaction, so its backend takes none of its notifications), as the yardstick.
///
/// Proves: the relay's listener reads every notification while no worker is free (its wake-up
/// count reaches the number of statements), and the server's notification queue stays near empty
/// (one page of 1,048,576 in practice) while the same burst leaves ~78 pages behind for the
/// listener that stopped reading.
///
/// A client that merely stops reading its socket would not show in the queue at this volume: the
/// kernel's socket buffers (up to 4 MB of send buffer on loopback) take ~180,000 notifications of
/// 23 bytes before the server's backend blocks and holds the queue, which measured 100,000
/// notifications in 2.3 MB of socket queues and an unchanged usage of one page. The wake-up count
/// is what proves that this listener reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_listener_keeps_reading_under_a_burst_so_the_notification_queue_stays_empty() {
    const STATEMENTS: usize = 20_000;
    let db = TestDb::new().await;
    let gate = Arc::new(Semaphore::new(0));
    let cfg = RelayConfig { workers: 2, lease: Duration::from_secs(120), ..config() };
    let relay = support::start(&db.outbox, cfg, Gate(gate.clone()));
    let fake = db.client().await;
    listener_ready(&fake).await;
    // A waiting relay (this connection stays open), so that every insert notifies.
    fake.batch_execute(
        "insert into outbox_relay.relays (id, listener_pid, waiting) values (424242, pg_backend_pid(), true)",
    )
    .await
    .unwrap();
    // Both workers take a batch and hang in the handler.
    fake.batch_execute(
        "select outbox_relay.publish('fault.first', '{}'); select outbox_relay.publish('fault.second', '{}')",
    )
    .await
    .unwrap();
    wait_until("both workers busy", PATIENCE, || async {
        count(&fake, "select count(*) from outbox_relay.outbox where lease_token is not null").await >= 2
    })
    .await;

    let started = Instant::now();
    let woken_before = relay.snapshot().wakeups;
    let (ours, samples) = burst(&db, STATEMENTS).await;
    let burst_time = started.elapsed();
    wait_until("the relay's listener read every notification", LONG_PATIENCE, || {
        let woken = relay.snapshot().wakeups - woken_before;
        async move { woken >= STATEMENTS as u64 }
    })
    .await;
    let busy = count(&fake, "select count(*) from outbox_relay.outbox where processed_at is not null").await;
    assert_eq!(busy, 0, "the workers were held the whole time");

    // The same burst with a second listener that stops reading: it LISTENs, then sits in an open
    // transaction, and a backend in a transaction takes no notifications until it ends, so the
    // server keeps all of them for it.
    let stuck = db.client().await;
    stuck.batch_execute("listen outbox_relay").await.unwrap();
    stuck.batch_execute("begin; select 1").await.unwrap();
    let (theirs, _) = burst(&db, STATEMENTS).await;
    stuck.batch_execute("rollback").await.unwrap();
    drop(stuck);

    // In PostgreSQL 13 and later the usage is in queue pages of 8 kB out of 1,048,576 (8 GB).
    let pages = |usage: f64| usage * 1_048_576.0;
    eprintln!(
        "notification queue usage with {STATEMENTS} notifications in {burst_time:?}: max {ours:.3e} ({:.0} pages) \
         over {samples} samples while the relay's listener reads; max {theirs:.3e} ({:.0} pages) with a listener \
         that stopped reading",
        pages(ours),
        pages(theirs)
    );
    // The yardstick moved (a page holds 256 notifications: 20,000 of them fill 78 pages)...
    assert!(pages(theirs) >= 20.0, "a listener that stops reading holds the burst: {theirs}");
    // ...and a listener that reads never let half of that pile up, even on a busy machine (the
    // server frees the queue 4 pages at a time, so a few pages are normal).
    assert!(ours * 2.0 < theirs, "a listener that reads ({ours}) holds far less than one that does not ({theirs})");

    gate.add_permits(Semaphore::MAX_PERMITS / 2);
    relay.stop().await;
}
