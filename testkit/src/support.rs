//! What relay tests share: a handler that records deliveries, a relay that runs in the
//! background until stopped, and waiting on a condition instead of sleeping.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use pg_outbox_relay::{
    DeliveryError, Event, Handler, MetricsSnapshot, Outbox, Relay, RelayConfig, RelayMetrics, Route,
};
use tokio::sync::{mpsc, oneshot};

/// A handler that records every delivery and sends it down a channel the test awaits.
#[derive(Clone)]
pub struct Recorder {
    seen: Arc<Mutex<HashMap<i64, usize>>>,
    tx: mpsc::UnboundedSender<Delivered>,
    label: &'static str,
}

/// One delivery as the recorder saw it.
#[derive(Debug, Clone)]
pub struct Delivered {
    /// The event delivered.
    pub event: Event,
    /// When.
    pub at: SystemTime,
    /// The recorder's label (which relay).
    pub by: &'static str,
}

/// The test's end of a [`Recorder`]: the deliveries, in the order they happened.
pub struct Deliveries {
    rx: mpsc::UnboundedReceiver<Delivered>,
    seen: Arc<Mutex<HashMap<i64, usize>>>,
}

/// A recorder and its deliveries.
pub fn recorder() -> (Recorder, Deliveries) {
    let (tx, rx) = mpsc::unbounded_channel();
    let seen = Arc::new(Mutex::new(HashMap::new()));
    (Recorder { seen: seen.clone(), tx, label: "relay" }, Deliveries { rx, seen })
}

impl Recorder {
    /// The same recorder, marking deliveries with another label.
    pub fn labelled(&self, label: &'static str) -> Recorder {
        Recorder { label, ..self.clone() }
    }
}

impl Handler for Recorder {
    async fn handle(&self, event: &Event) -> Result<(), DeliveryError> {
        *self.seen.lock().unwrap().entry(event.id).or_default() += 1;
        self.tx.send(Delivered { event: event.clone(), at: SystemTime::now(), by: self.label }).ok();
        Ok(())
    }
}

/// Waits at most this long for something that should happen at once; only a hang makes it fail.
pub const PATIENCE: Duration = Duration::from_secs(30);

impl Deliveries {
    /// The next delivery; fails the test if none comes within [`PATIENCE`].
    pub async fn next(&mut self) -> Delivered {
        tokio::time::timeout(PATIENCE, self.rx.recv())
            .await
            .expect("no delivery within the patience limit")
            .expect("recorder dropped")
    }

    /// The next `n` deliveries.
    pub async fn take(&mut self, n: usize) -> Vec<Delivered> {
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            out.push(self.next().await);
        }
        out
    }

    /// How often each event id was delivered so far.
    pub fn counts(&self) -> HashMap<i64, usize> {
        self.seen.lock().unwrap().clone()
    }

    /// True when nothing more is queued right now.
    pub fn is_empty(&mut self) -> bool {
        self.rx.try_recv().is_err()
    }
}

/// A relay running in a background task.
pub struct Running {
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<pg_outbox_relay::Result<()>>,
    /// Its live counters (of its first destination).
    pub metrics: Arc<RelayMetrics>,
    /// Every destination's live counters, by name.
    pub destinations: Vec<(String, Arc<RelayMetrics>)>,
}

/// Starts a relay in the background (`RUST_LOG` shows its logs).
pub fn start<H: Handler>(outbox: &Outbox, config: RelayConfig, handler: H) -> Running {
    let relay = Relay::new(outbox, config, handler).expect("valid relay config");
    run(relay)
}

/// Starts a relay with several destinations in the background.
pub fn start_routes<H: Handler>(outbox: &Outbox, config: RelayConfig, routes: Vec<Route<H>>) -> Running {
    let relay = Relay::with_routes(outbox, config, routes).expect("valid relay config");
    run(relay)
}

/// Runs a relay built by the test in the background.
pub fn run<H: Handler>(relay: Relay<H>) -> Running {
    // RUST_LOG=pg_outbox_relay=debug shows what the relay does in a failing test.
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_test_writer()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .try_init();
    }
    let metrics = relay.metrics();
    let destinations = relay.destination_metrics();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(relay.run(async move {
        stopped.await.ok();
    }));
    Running { stop: Some(stop), task, metrics, destinations }
}

impl Running {
    /// Signals shutdown and waits for `run` to return.
    pub async fn stop(mut self) {
        self.stop.take().unwrap().send(()).ok();
        tokio::time::timeout(PATIENCE, &mut self.task)
            .await
            .expect("relay did not stop")
            .expect("relay task panicked")
            .expect("relay returned an error");
    }

    /// Kills the relay as a crash would: its tasks are dropped mid-flight, nothing is recorded.
    pub async fn crash(self) {
        self.task.abort();
        let _ = self.task.await;
    }

    /// Its counters now.
    pub fn snapshot(&self) -> MetricsSnapshot {
        self.metrics.snapshot()
    }

    /// The counters of its destination `name` now.
    pub fn snapshot_of(&self, name: &str) -> MetricsSnapshot {
        let (_, metrics) = self.destinations.iter().find(|(n, _)| n == name).expect("a destination of this relay");
        metrics.snapshot()
    }
}

/// A config for tests: quick retries, no janitor, a fallback poll that never fires by default so
/// that a delivery proves the wake-up path, and delivered rows kept (the default retention) so
/// that tests can read what became of each event.
pub fn config() -> RelayConfig {
    RelayConfig {
        poll_interval: Duration::from_secs(3600),
        backoff_base: Duration::from_millis(20),
        backoff_max: Duration::from_millis(200),
        janitor_interval: Duration::ZERO,
        ..RelayConfig::default()
    }
}

/// [`config`] for an outage test: `max_attempts` 3 and backoffs that would spend them in well
/// under a second, so that only the outage breaker keeps events out of the dead letters; probes
/// every 200 ms to 1 s, a fallback poll every 200 ms.
pub fn outage_config() -> RelayConfig {
    RelayConfig {
        max_attempts: 3,
        backoff_base: Duration::from_millis(50),
        backoff_max: Duration::from_millis(100),
        breaker_probe_min: Duration::from_millis(200),
        breaker_probe_max: Duration::from_secs(1),
        poll_interval: Duration::from_millis(200),
        ..config()
    }
}

/// Polls `check` until it is true; for database state that no event announces. Fails the test
/// after [`PATIENCE`].
pub async fn eventually<F, Fut>(what: &str, check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    eventually_within(what, PATIENCE, check).await
}

/// [`eventually`], for what takes a while even on a quiet machine (a backlog drained, a server
/// restarted): fails the test after `limit`.
pub async fn eventually_within<F, Fut>(what: &str, limit: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    until_within(what, limit, || {
        let done = check();
        async move { done.await.then_some(()) }
    })
    .await
}

/// Polls `check` until it gives a value, and returns it; for a value that no event announces (a
/// page that shows, a counter that reaches a number). Fails the test after [`PATIENCE`].
pub async fn until<T, F, Fut>(what: &str, check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    until_within(what, PATIENCE, check).await
}

/// [`until`], failing the test after `limit`: the one polling loop of the kit.
pub async fn until_within<T, F, Fut>(what: &str, limit: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out after {limit:?} waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The planner settings of the relay's own sessions (`relay_pool` in src/connect.rs), for a test
/// that runs the relay's statements on a connection of its own: generic plans, no JIT, no
/// sequential or bitmap scan.
pub const RELAY_PLANNER_SETTINGS: &str =
    "set plan_cache_mode = force_generic_plan; set jit = off; set enable_seqscan = off; set enable_bitmapscan = off";

/// The one number `sql` selects (a `count(*)`, a `sum(…)::int8`), on `client`.
pub async fn count(client: &tokio_postgres::Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).await.unwrap_or_else(|e| panic!("{sql}: {e}")).get(0)
}

/// Opens on `session` what `pg_dump` holds for its whole run: a repeatable-read snapshot, and
/// ACCESS SHARE on the outbox (so on each of its leaves), until the caller commits.
pub async fn hold_as_pg_dump(session: &tokio_postgres::Client) {
    session
        .batch_execute(
            "begin isolation level repeatable read;
             lock table outbox_relay.outbox in access share mode;
             select count(*) from outbox_relay.outbox",
        )
        .await
        .unwrap();
}

/// How many sessions hold ACCESS SHARE on the outbox now (a dump's lock among them).
pub async fn outbox_share_locks(client: &tokio_postgres::Client) -> i64 {
    count(
        client,
        "select count(*) from pg_locks where relation = 'outbox_relay.outbox'::regclass and mode = 'AccessShareLock' and granted",
    )
    .await
}

/// A TCP port of 127.0.0.1 that nothing listens on right now (for a server a test starts).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free loopback port").port()
}

/// Waits until the relay's listener connection has issued LISTEN.
pub async fn listener_ready(client: &tokio_postgres::Client) {
    eventually("the relay's listener", || async { listener_pid(client).await.is_some() }).await;
}

/// The backend pid of the relay's listener connection.
pub async fn listener_pid(client: &tokio_postgres::Client) -> Option<i32> {
    client
        .query_opt(
            "select pid from pg_stat_activity
              where datname = current_database() and application_name like 'outbox-relay listener%'
                and query <> 'listen outbox_relay'",
            &[],
        )
        .await
        .unwrap()
        .map(|r| r.get(0))
}

/// Waits until a relay has marked itself waiting: from then on inserts notify it.
pub async fn relay_waiting(client: &tokio_postgres::Client) {
    eventually("a relay waiting for NOTIFY", || async {
        client.query_one("select exists (select 1 from outbox_relay.relays where waiting)", &[]).await.unwrap().get(0)
    })
    .await;
}

/// A connection that LISTENs on the outbox channel; each notification arrives on the receiver as
/// `(channel, payload)`. Notifications are read as they come, like the relay's listener does.
pub async fn listen(
    db: &crate::harness::TestDb,
) -> (tokio_postgres::Client, mpsc::UnboundedReceiver<(String, String)>) {
    use futures::StreamExt;
    use tokio_postgres::AsyncMessage;

    let (client, mut connection) = db.database_url().config().connect(tokio_postgres::NoTls).await.unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
    tokio::spawn(async move {
        while let Some(Ok(message)) = messages.next().await {
            if let AsyncMessage::Notification(n) = message {
                tx.send((n.channel().to_string(), n.payload().to_string())).ok();
            }
        }
    });
    client.batch_execute("listen outbox_relay").await.unwrap();
    (client, rx)
}

/// An event an [`HttpReceiver`] accepted: its id and key.
type Accepted = (i64, Option<String>);

/// A real HTTP receiver (axum on a loopback port) that records each event it accepts, and can go
/// away (its port refuses connections) and come back on the same port.
pub struct HttpReceiver {
    /// Where it listens.
    pub addr: std::net::SocketAddr,
    /// What it accepted, in order.
    accepted: Arc<Mutex<Vec<Accepted>>>,
    server: Option<tokio::task::JoinHandle<()>>,
}

impl HttpReceiver {
    /// Listens on a free loopback port, accepting every request.
    pub async fn start() -> HttpReceiver {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("a loopback port");
        let addr = listener.local_addr().expect("its address");
        let mut receiver = HttpReceiver { addr, accepted: Arc::default(), server: None };
        receiver.serve(listener);
        receiver
    }

    fn serve(&mut self, listener: tokio::net::TcpListener) {
        use axum::http::{HeaderMap, StatusCode};
        let accepted = self.accepted.clone();
        let app = axum::Router::new().route(
            "/hook",
            axum::routing::post(move |headers: HeaderMap, body: axum::body::Bytes| {
                let accepted = accepted.clone();
                async move {
                    let event: serde_json::Value = serde_json::from_slice(&body).expect("the event's JSON");
                    let id = headers["outbox-event-id"].to_str().unwrap().parse::<i64>().unwrap();
                    let key = event["key"].as_str().map(str::to_string);
                    accepted.lock().unwrap().push((id, key));
                    StatusCode::OK
                }
            }),
        );
        self.server = Some(tokio::spawn(async move { axum::serve(listener, app).await.expect("the receiver serves") }));
    }

    /// Its URL, for an HTTP sink.
    pub fn url(&self) -> String {
        format!("http://{}/hook", self.addr)
    }

    /// Closes the port: connections are refused until [`HttpReceiver::come_back`].
    pub async fn go_away(&mut self) {
        if let Some(server) = self.server.take() {
            server.abort();
            let _ = server.await;
        }
    }

    /// Listens again on the same port.
    pub async fn come_back(&mut self) {
        let listener = tokio::net::TcpListener::bind(self.addr).await.expect("the receiver's port again");
        self.serve(listener);
    }

    /// How many requests it accepted.
    pub fn accepted(&self) -> usize {
        self.accepted.lock().unwrap().len()
    }

    /// How many times it accepted each event id.
    pub fn counts(&self) -> HashMap<i64, usize> {
        let mut counts = HashMap::new();
        for (id, _) in self.accepted.lock().unwrap().iter() {
            *counts.entry(*id).or_default() += 1;
        }
        counts
    }

    /// Per key, the ids in the order it first accepted them.
    pub fn order_by_key(&self) -> HashMap<String, Vec<i64>> {
        let mut seen = std::collections::HashSet::new();
        let mut order: HashMap<String, Vec<i64>> = HashMap::new();
        for (id, key) in self.accepted.lock().unwrap().iter() {
            if let Some(key) = key
                && seen.insert(*id)
            {
                order.entry(key.clone()).or_default().push(*id);
            }
        }
        order
    }
}
