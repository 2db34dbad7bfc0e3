//! The delivery engine: deliveries in progress at once, order per key across workers and
//! relays, the dead-letter policy of keys, and the outage breaker, against real PostgreSQL and a
//! real HTTP receiver that goes away.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use pg_outbox_relay::sink::HttpSink;
use pg_outbox_relay::{DeliveryError, Event, EventState, Handler, NewEvent, Outbox, RelayConfig, publish};
use serde_json::json;
use tokio::sync::Notify;

use crate::harness::TestDb;
use crate::relay_support::{self as support, PATIENCE, config, eventually, eventually_within};

/// One successful delivery: the event's id and key.
type Delivery = (i64, Option<String>);

/// Successful deliveries in the order they happened, shared by every relay of a test.
#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<Delivery>>>);

impl Log {
    fn push(&self, event: &Event) {
        self.0.lock().unwrap().push((event.id, event.key.clone()));
    }

    fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }

    /// Per key, the ids in delivery order.
    fn by_key(&self) -> BTreeMap<String, Vec<i64>> {
        let mut by_key: BTreeMap<String, Vec<i64>> = BTreeMap::new();
        for (id, key) in self.0.lock().unwrap().iter() {
            if let Some(key) = key {
                by_key.entry(key.clone()).or_default().push(*id);
            }
        }
        by_key
    }
}

/// Fails a share of deliveries transiently (at random), logs the rest.
struct Flaky {
    log: Log,
    failure_rate: f64,
}

impl Handler for Flaky {
    async fn handle(&self, event: &Event) -> Result<(), DeliveryError> {
        // Some latency, so that deliveries of many keys overlap.
        tokio::time::sleep(Duration::from_millis(rand::random_range(0..3))).await;
        if rand::random::<f64>() < self.failure_rate {
            return Err(DeliveryError::transient("flaky receiver"));
        }
        self.log.push(event);
        Ok(())
    }
}

async fn keyed_backlog(db: &TestDb, keys: i64, per_key: i64) -> BTreeMap<String, Vec<i64>> {
    let client = db.client().await;
    let rows = client
        .query(
            "insert into outbox_relay.outbox (topic, key, payload)
             select 'order.step', 'k' || (g % $1::int8), jsonb_build_object('n', g)
               from generate_series(0, $1::int8 * $2::int8 - 1) g
             order by g returning id, key",
            &[&keys, &per_key],
        )
        .await
        .unwrap();
    let mut expected: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for row in rows {
        expected.entry(row.get(1)).or_default().push(row.get(0));
    }
    expected
}

/// Two relays share 100 keys × 50 events while a fifth of the deliveries fail: per key the
/// successful deliveries arrive one at a time in id order, and every event arrives exactly once.
/// One relay holds its claims (the default), the other leases every claim (`hold` zero): the two
/// ways of owning a batch respect each other.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn per_key_order_holds_across_two_relays_under_failures() {
    let db = TestDb::new().await;
    let expected = keyed_backlog(&db, 100, 50).await;
    let log = Log::default();
    let relay_config = RelayConfig { max_attempts: 1000, poll_interval: Duration::from_millis(200), ..config() };
    let leasing = RelayConfig { hold: Duration::ZERO, ..relay_config.clone() };
    let second = Outbox::connect_with(db.database_url(), 8).await.unwrap();
    let relays = [
        support::start(&db.outbox, relay_config, Flaky { log: log.clone(), failure_rate: 0.2 }),
        support::start(&second, leasing, Flaky { log: log.clone(), failure_rate: 0.2 }),
    ];
    eventually_within("all 5,000 events delivered", Duration::from_secs(120), || async { log.len() >= 5000 }).await;
    for relay in relays {
        relay.stop().await;
    }
    assert_eq!(log.len(), 5000, "no event delivered twice");
    assert_eq!(log.by_key(), expected, "per key, the deliveries in id order, none lost");
    assert_eq!(db.outbox.queue_stats().await.unwrap().dead_letters, 0);
}

/// Fails every delivery of the key `stuck`, delivers the rest.
struct OneKeyStuck(Log);

impl Handler for OneKeyStuck {
    async fn handle(&self, event: &Event) -> Result<(), DeliveryError> {
        if event.key.as_deref() == Some("stuck") {
            return Err(DeliveryError::transient("this key's receiver is broken"));
        }
        self.0.push(event);
        Ok(())
    }
}

/// A key whose head keeps failing holds back only that key: every other key finishes.
#[tokio::test]
async fn a_failing_key_holds_back_only_itself() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "insert into outbox_relay.outbox (topic, key, payload)
             select 'order.step', case when g % 11 = 0 then 'stuck' else 'k' || (g % 11) end, '{}'
               from generate_series(0, 219) g order by g",
        )
        .await
        .unwrap();
    let log = Log::default();
    let relay = support::start(&db.outbox, RelayConfig { max_attempts: 1000, ..config() }, OneKeyStuck(log.clone()));
    eventually("the 200 events of the other keys delivered", || async { log.len() >= 200 }).await;
    // (A batch hands a key's events over in rounds and records them when it is done: the
    // delivered ones passed, nothing of theirs waiting for the destination.)
    eventually("their deliveries recorded", || async {
        let done =
            "select count(*) from outbox_relay.outbox where key <> 'stuck' and outbox_relay.passed_by_all(xid, id)";
        let waiting = "select count(*) from outbox_relay.parked where key <> 'stuck'";
        client.query_one(done, &[]).await.unwrap().get::<_, i64>(0) == 200
            && client.query_one(waiting, &[]).await.unwrap().get::<_, i64>(0) == 0
    })
    .await;
    let stuck: Vec<(i64, i32)> = client
        .query(
            "select id, attempts from outbox_relay.parked where destination = 'default' and key = 'stuck' order by id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    relay.stop().await;
    assert_eq!(stuck.len(), 20, "every event of the stuck key waits");
    assert!(stuck[0].1 >= 1, "its head was tried: {stuck:?}");
    assert!(stuck[1..].iter().all(|(_, attempts)| *attempts == 0), "the rest were never handed out: {stuck:?}");
    assert_eq!(log.len(), 200);
}

/// Two writers of one key interleave their transactions: the second waits for the first (the
/// key's lock), so the key's events commit, and are delivered, in id order. Without the lock
/// the second would commit first, and its later id would be delivered before the earlier one
/// became visible.
#[tokio::test]
async fn writers_of_one_key_serialize_and_their_events_arrive_in_commit_order() {
    let db = TestDb::new().await;
    let log = Log::default();
    let relay = support::start(&db.outbox, config(), Flaky { log: log.clone(), failure_rate: 0.0 });
    let mut first = db.client().await;
    let mut second = db.client().await;
    let watcher = db.client().await;

    let tx = first.transaction().await.unwrap();
    let a = publish(&tx, &NewEvent::new("account.debited", json!({"n": 1})).key("acct-1")).await.unwrap();
    // The second writer uses the SQL door, and commits as soon as it can.
    let writer = tokio::spawn(async move {
        let tx = second.transaction().await.unwrap();
        let id: i64 = tx
            .query_one("select outbox_relay.publish('account.credited', '{\"n\": 2}', 'acct-1')", &[])
            .await
            .unwrap()
            .get(0);
        tx.commit().await.unwrap();
        id
    });
    eventually("the second writer waits for the key's lock", || async {
        watcher
            .query_one("select exists (select 1 from pg_locks where locktype = 'advisory' and not granted)", &[])
            .await
            .unwrap()
            .get(0)
    })
    .await;
    assert!(!writer.is_finished(), "the second writer cannot commit before the first");
    tx.commit().await.unwrap();
    let b = writer.await.unwrap();
    eventually("both delivered", || async { log.len() >= 2 }).await;
    relay.stop().await;
    assert!(a < b);
    assert_eq!(log.by_key()["acct-1"], vec![a, b]);
}

/// Refuses the key `poison` for good, delivers the rest.
struct Poison(Log);

impl Handler for Poison {
    async fn handle(&self, event: &Event) -> Result<(), DeliveryError> {
        if event.payload.to_value().unwrap()["poison"] == json!(true) {
            return Err(DeliveryError::permanent("refused"));
        }
        self.0.push(event);
        Ok(())
    }
}

/// When the head of a key goes to the dead letters, the key's later events go on by default;
/// with `dead_letter_holds_key` they wait until the dead letter is retried (and then follow it)
/// or purged.
#[tokio::test]
async fn a_dead_lettered_head_releases_its_key_or_holds_it_by_setting() {
    for hold in [false, true] {
        let db = TestDb::new().await;
        let log = Log::default();
        let relay_config = RelayConfig { dead_letter_holds_key: hold, ..config() };
        let poison = db.outbox.publish(&NewEvent::new("t", json!({"poison": true})).key("k")).await.unwrap();
        let next = db.outbox.publish(&NewEvent::new("t", json!({"n": 2})).key("k")).await.unwrap();
        let other = db.outbox.publish(&NewEvent::new("t", json!({"n": 3})).key("other")).await.unwrap();
        let relay = support::start(&db.outbox, relay_config.clone(), Poison(log.clone()));
        eventually("the poison dead-lettered", || async { db.outbox.queue_stats().await.unwrap().dead_letters == 1 })
            .await;
        if hold {
            eventually("the other key delivered", || async { log.len() >= 1 }).await;
            // Held: a claim after the dead letter does not hand out the key's next event.
            db.outbox.publish(&NewEvent::new("t", json!({"n": 4})).key("other")).await.unwrap();
            eventually("a later event of another key delivered", || async { log.len() >= 2 }).await;
            assert!(!log.by_key().contains_key("k"), "held while its head is a dead letter");
            relay.stop().await;
            // Retried, the dead letter is the key's head again (its id is kept) and is delivered
            // first: this time the handler takes it.
            db.client().await.batch_execute("update outbox_relay.dead_letters set payload = '{}'").await.unwrap();
            assert_eq!(db.outbox.retry_dead_letters(&[poison]).await.unwrap(), vec![poison]);
            let relay = support::start(&db.outbox, relay_config, Poison(log.clone()));
            eventually("the key delivered in order", || async { log.by_key().get("k").is_some_and(|k| k.len() == 2) })
                .await;
            relay.stop().await;
            assert_eq!(log.by_key()["k"], vec![poison, next]);
        } else {
            eventually("the key's next event delivered", || async { log.len() >= 2 }).await;
            relay.stop().await;
            assert_eq!(log.by_key()["k"], vec![next]);
            assert_eq!(log.by_key()["other"], vec![other]);
        }
    }
}

/// Counts deliveries in progress; each waits until `limit` are in progress at once, so a bound
/// below `limit` would hang the test and one above it would show in `max`.
struct Crowd {
    in_flight: AtomicUsize,
    max: AtomicUsize,
    limit: usize,
    full: Notify,
    done: AtomicUsize,
}

impl Handler for Crowd {
    async fn handle(&self, _event: &Event) -> Result<(), DeliveryError> {
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max.fetch_max(now, Ordering::SeqCst);
        if now >= self.limit {
            self.full.notify_waiters();
        } else {
            let full = self.full.notified();
            if self.in_flight.load(Ordering::SeqCst) < self.limit {
                // Or the last batch, which may not fill the bound.
                let _ = tokio::time::timeout(Duration::from_millis(200), full).await;
            }
        }
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        self.done.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

/// A fixed `concurrency`: so many deliveries in progress at once, across all workers, and no
/// more.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn deliveries_in_progress_are_bounded_by_concurrency_across_workers() {
    let db = TestDb::new().await;
    db.client()
        .await
        .batch_execute("insert into outbox_relay.outbox (topic, payload) select 't', '{}' from generate_series(1, 400)")
        .await
        .unwrap();
    let crowd = Arc::new(Crowd {
        in_flight: AtomicUsize::new(0),
        max: AtomicUsize::new(0),
        limit: 8,
        full: Notify::new(),
        done: AtomicUsize::new(0),
    });
    let relay_config = RelayConfig { workers: 4, batch_size: 50, concurrency: 8, fixed_concurrency: true, ..config() };
    let relay = support::start(&db.outbox, relay_config, crowd.clone());
    eventually("all 400 delivered", || async { crowd.done.load(Ordering::SeqCst) >= 400 }).await;
    relay.stop().await;
    assert_eq!(crowd.max.load(Ordering::SeqCst), 8, "8 in progress at once, never more");
}

/// An HTTP receiver on a fixed port that can be taken away (connections refused) and brought
/// back; it counts what it received.
struct Receiver {
    addr: std::net::SocketAddr,
    received: Arc<Mutex<HashMap<i64, usize>>>,
    server: Option<tokio::task::JoinHandle<()>>,
}

impl Receiver {
    async fn start() -> Receiver {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut receiver = Receiver { addr, received: Arc::default(), server: None };
        receiver.serve(listener);
        receiver
    }

    fn serve(&mut self, listener: tokio::net::TcpListener) {
        let received = self.received.clone();
        let app = Router::new().route(
            "/hook",
            post(move |headers: HeaderMap| {
                let received = received.clone();
                async move {
                    let id = headers["outbox-event-id"].to_str().unwrap().parse::<i64>().unwrap();
                    *received.lock().unwrap().entry(id).or_default() += 1;
                    StatusCode::OK
                }
            }),
        );
        self.server = Some(tokio::spawn(async move { axum::serve(listener, app).await.unwrap() }));
    }

    /// Closes the port: connections are refused.
    async fn go_away(&mut self) {
        if let Some(server) = self.server.take() {
            server.abort();
            let _ = server.await;
        }
    }

    async fn come_back(&mut self) {
        let listener = tokio::net::TcpListener::bind(self.addr).await.expect("the receiver's port again");
        self.serve(listener);
    }

    fn count(&self) -> usize {
        self.received.lock().unwrap().len()
    }
}

/// The receiver refuses connections for 15 s under a backlog, with `max_attempts` 3 and
/// backoffs that would exhaust them in under a second: the breaker opens, nothing is
/// dead-lettered, the state shows, and everything is delivered once the receiver is back.
#[tokio::test]
async fn an_outage_of_the_destination_dead_letters_nothing() {
    let db = TestDb::new().await;
    let mut receiver = Receiver::start().await;
    receiver.go_away().await;
    db.client()
        .await
        .batch_execute(
            "insert into outbox_relay.outbox (topic, payload) select 'order.placed', '{}' from generate_series(1, 200)",
        )
        .await
        .unwrap();
    let sink = HttpSink::new(&format!("http://{}/hook", receiver.addr), Duration::from_secs(2)).unwrap();
    let relay_config = support::outage_config();
    let relay = support::start(&db.outbox, relay_config, sink);
    eventually("the breaker open", || async { relay.snapshot().breaker_open }).await;
    eventually("the breaker shown in the relay's row", || async {
        db.outbox.connected_relays().await.unwrap().iter().any(|r| r.breaker_open)
    })
    .await;
    tokio::time::sleep(Duration::from_secs(15)).await; // the outage itself, not a synchronization
    let stats = db.outbox.queue_stats().await.unwrap();
    assert_eq!(stats.dead_letters, 0, "nothing dead-lettered during the outage: {stats:?}");
    assert!(stats.max_attempts < 3, "the outage consumed no attempt: {stats:?}");
    receiver.come_back().await;
    // Delivered: the receiver has every event, and none waits for the destination any more.
    eventually_within("every event delivered", PATIENCE, || async {
        let stats = db.outbox.queue_stats().await.unwrap();
        receiver.count() == 200
            && stats.retained == 200
            && (stats.pending, stats.held_by_key, stats.delayed, stats.in_flight) == (0, 0, 0, 0)
    })
    .await;
    let snapshot = relay.snapshot();
    relay.stop().await;
    assert!(!snapshot.breaker_open && snapshot.breaker_opens >= 1, "{snapshot:?}");
    assert_eq!(receiver.count(), 200);
    assert_eq!(db.outbox.queue_stats().await.unwrap().dead_letters, 0);
}

/// Events waiting behind a key whose head is in a retry's backoff are not lag: the queue counts
/// them as held by their key, not ready, and the oldest ready age ignores them (no false "the
/// relays are behind" warning or alert while the relay is healthy).
#[tokio::test]
async fn events_behind_a_head_in_backoff_are_held_by_their_key_not_ready() {
    let db = TestDb::new().await;
    let failing = pg_outbox_relay::handler_fn(|event: Event| async move {
        if event.key.as_deref() == Some("stuck") {
            Err(DeliveryError::transient("503 from the receiver"))
        } else {
            Ok(())
        }
    });
    let cfg = RelayConfig {
        backoff_base: Duration::from_secs(3600),
        backoff_max: Duration::from_secs(3600),
        backoff_jitter: 0.0,
        ..config()
    };
    let events: Vec<NewEvent> = (0..50).map(|n| NewEvent::new("order.updated", json!({"n": n})).key("stuck")).collect();
    db.outbox.publish_all(&events).await.unwrap();
    let relay = support::start(&db.outbox, cfg, failing);
    let free = db.outbox.publish(&NewEvent::new("order.placed", json!({"free": true}))).await.unwrap();
    eventually("the head failed once and the free event was delivered", || async {
        let stats = db.outbox.queue_stats().await.unwrap();
        let found = db.outbox.look_up(Some(free), None, 1).await.unwrap();
        stats.delayed == 1 && stats.in_flight == 0 && found.len() == 1 && found[0].state == EventState::Delivered
    })
    .await;
    let stats = db.outbox.queue_stats().await.unwrap();
    assert_eq!(stats.pending, 0, "nothing is deliverable: {stats:?}");
    assert_eq!(stats.held_by_key, 49, "the head's followers wait for it: {stats:?}");
    assert_eq!(stats.oldest_ready_age, None, "no ready event, so no lag: {stats:?}");
    let prometheus = pg_outbox_relay::prometheus::Exporter::new(&db.outbox).encode().await;
    assert!(prometheus.contains("outbox_relay_ready_events 0"), "{prometheus}");
    assert!(prometheus.contains("outbox_relay_held_by_key_events 49"), "{prometheus}");
    assert!(prometheus.contains("outbox_relay_pending_events 50"), "{prometheus}");
    assert!(prometheus.contains("outbox_relay_oldest_ready_age_seconds 0"), "{prometheus}");
    relay.stop().await;
}

/// The events of a batch that fail together, with one delay (no jitter), come due together: the
/// statement that parks them reads the clock once, not once a row (rows written a moment apart,
/// by a server that stalled while it wrote them, came due apart and were claimed apart).
#[tokio::test]
async fn events_of_a_batch_that_fail_together_come_due_together() {
    let db = TestDb::new().await;
    let failing =
        pg_outbox_relay::handler_fn(|_: Event| async { Err(DeliveryError::transient("503 from the receiver")) });
    let cfg = RelayConfig {
        backoff_base: Duration::from_secs(3600),
        backoff_max: Duration::from_secs(3600),
        backoff_jitter: 0.0,
        // (one claim takes them all, and each one fails: no outage breaker gives them back)
        fast_path: false,
        breaker_threshold: 0,
        ..config()
    };
    let events: Vec<NewEvent> = (0..200).map(|n| NewEvent::new("order.updated", json!({"n": n}))).collect();
    db.outbox.publish_all(&events).await.unwrap();
    let relay = support::start(&db.outbox, cfg, failing);
    let client = db.client().await;
    eventually("every event failed once", || async {
        support::count(&client, "select count(*) from outbox_relay.parked where attempts = 1").await == 200
    })
    .await;
    relay.stop().await;
    let due = support::count(&client, "select count(distinct available_at) from outbox_relay.parked").await;
    assert_eq!(due, 1, "the 200 events failed in one batch with one delay: one due time");
}

/// Fails every event's first attempt, and holds each later one until the test lets it go.
struct FailThenHold {
    go: Arc<tokio::sync::Semaphore>,
}

impl Handler for FailThenHold {
    async fn handle(&self, event: &Event) -> Result<(), DeliveryError> {
        if event.attempts == 1 {
            return Err(DeliveryError::transient("503 from the receiver"));
        }
        drop(self.go.acquire().await.unwrap());
        Ok(())
    }
}

/// The parked events of one held claim whose delivery outlives `hold` are leased with one end:
/// the statements that lease them, and renew the lease while the delivery goes on, read the
/// clock once, not once a row (were the relay to die, they would come due together, for one
/// claim, not a moment apart).
#[tokio::test]
async fn the_events_of_one_lease_end_together() {
    let db = TestDb::new().await;
    let go = Arc::new(tokio::sync::Semaphore::new(0));
    let cfg = RelayConfig {
        backoff_base: Duration::from_millis(20),
        backoff_max: Duration::from_millis(20),
        backoff_jitter: 0.0,
        hold: Duration::from_millis(200),
        lease: Duration::from_secs(2),
        // (one claim takes them all, each fails once, and one claim takes them all again: one
        // worker, so that no second claim of parked events splits them)
        workers: 1,
        fast_path: false,
        breaker_threshold: 0,
        ..config()
    };
    let events: Vec<NewEvent> = (0..200).map(|n| NewEvent::new("order.updated", json!({"n": n}))).collect();
    db.outbox.publish_all(&events).await.unwrap();
    let relay = support::start(&db.outbox, cfg, FailThenHold { go: go.clone() });
    let client = db.client().await;
    eventually("the retries of the 200 events leased", || async {
        support::count(
            &client,
            "select count(*) from outbox_relay.parked where attempts = 2 and lease_token is not null",
        )
        .await
            == 200
    })
    .await;
    let ends = "select count(distinct available_at) from outbox_relay.parked";
    assert_eq!(support::count(&client, ends).await, 1, "one lease, one end");
    // Renewed while the delivery goes on (every half of the lease): still one end.
    let first_end: String =
        client.query_one("select min(available_at)::text from outbox_relay.parked", &[]).await.unwrap().get(0);
    eventually("the lease renewed", || async {
        let end: String =
            client.query_one("select min(available_at)::text from outbox_relay.parked", &[]).await.unwrap().get(0);
        end != first_end
    })
    .await;
    assert_eq!(support::count(&client, ends).await, 1, "one lease renewed, one end");
    go.add_permits(1000);
    eventually("every event delivered", || async { db.outbox.queue_stats().await.unwrap().pending == 0 }).await;
    relay.stop().await;
}

/// Fails a share of deliveries transiently and stalls on some events (past `hold`), logs the rest.
struct SlowAndFlaky {
    log: Log,
    failure_rate: f64,
    /// Events whose id is a multiple of this stall for `stall`.
    stall_every: i64,
    stall: Duration,
}

impl Handler for SlowAndFlaky {
    async fn handle(&self, event: &Event) -> Result<(), DeliveryError> {
        if event.id % self.stall_every == 0 && event.attempts == 1 {
            tokio::time::sleep(self.stall).await;
        }
        if rand::random::<f64>() < self.failure_rate {
            return Err(DeliveryError::transient("flaky receiver"));
        }
        self.log.push(event);
        Ok(())
    }
}

/// A backlog is drained batch after batch in one held transaction, each batch claimed while the
/// one before is delivered (read ahead): a delivery that fails after the next batch was read
/// ahead still holds its key's later events in that batch back, so per key the deliveries stay
/// in id order, every event arrives once and nothing is left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backlog_read_ahead_keeps_order_per_key_under_failures() {
    let db = TestDb::new().await;
    let expected = keyed_backlog(&db, 40, 50).await;
    let log = Log::default();
    let cfg = RelayConfig { max_attempts: 1000, batch_size: 25, ..config() };
    let relay = support::start(&db.outbox, cfg, Flaky { log: log.clone(), failure_rate: 0.1 });
    eventually_within("all 2,000 events delivered", Duration::from_secs(120), || async { log.len() >= 2000 }).await;
    let snapshot = relay.snapshot();
    relay.stop().await;
    each_once_in_key_order(&db, &snapshot, &log, &expected).await;
}

/// A backlog read ahead was delivered whole: every event of `expected` once, per key in id
/// order, nothing left pending or dead.
async fn each_once_in_key_order(
    db: &TestDb,
    snapshot: &pg_outbox_relay::MetricsSnapshot,
    log: &Log,
    expected: &BTreeMap<String, Vec<i64>>,
) {
    assert!(snapshot.read_ahead > 0, "batches were read ahead: {snapshot:?}");
    assert_eq!(log.len(), expected.values().map(Vec::len).sum::<usize>(), "no event delivered twice");
    assert_eq!(&log.by_key(), expected, "per key, the deliveries in id order, none lost");
    let stats = db.outbox.queue_stats().await.unwrap();
    assert_eq!((stats.pending, stats.dead_letters), (0, 0), "{stats:?}");
}

/// A delivery that outlives `hold` while the next batch was read ahead in its transaction: the
/// claim is leased, and the batch read ahead is undone with its savepoint (its events are new
/// again and claimed afresh, after the leased ones of their keys). Nothing is lost, nothing is
/// delivered twice, and per key the order holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claim_leased_while_a_batch_was_read_ahead_gives_that_batch_back() {
    let db = TestDb::new().await;
    let expected = keyed_backlog(&db, 30, 30).await;
    let log = Log::default();
    let cfg = RelayConfig { max_attempts: 1000, batch_size: 20, hold: Duration::from_millis(150), ..config() };
    let handler =
        SlowAndFlaky { log: log.clone(), failure_rate: 0.05, stall_every: 97, stall: Duration::from_millis(400) };
    let relay = support::start(&db.outbox, cfg, handler);
    eventually_within("all 900 events delivered", Duration::from_secs(120), || async { log.len() >= 900 }).await;
    let snapshot = relay.snapshot();
    relay.stop().await;
    each_once_in_key_order(&db, &snapshot, &log, &expected).await;
    let client = db.client().await;
    let early = client.query_one("select count(*) from outbox_relay.early_deliveries", &[]).await.unwrap();
    assert_eq!(early.get::<_, i64>(0), 0, "what was recorded early went with the commits and leases");
}

/// A delayed event met by a claim read ahead is parked there, in the transaction, where the
/// timer cannot see it: once the transaction commits, a claim reads its due time, and the event
/// is delivered when it is due (the fallback poll is an hour away), after everything else.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_delayed_event_met_by_a_claim_read_ahead_is_delivered_when_due() {
    let db = TestDb::new().await;
    let delay = Duration::from_millis(1500);
    let events: Vec<NewEvent> = (0..1000)
        .map(|n| {
            let event = NewEvent::new("order.step", json!({ "n": n }));
            if n == 600 { event.delay(delay) } else { event }
        })
        .collect();
    // (before the publishing transaction begins: its clock starts the delay)
    let publishing = std::time::Instant::now();
    let ids = db.outbox.publish_all(&events).await.unwrap();
    let log = Log::default();
    let cfg = RelayConfig { batch_size: 25, ..config() };
    let relay = support::start(&db.outbox, cfg, Flaky { log: log.clone(), failure_rate: 0.0 });
    eventually_within("the 999 events not delayed delivered", Duration::from_secs(60), || async { log.len() >= 999 })
        .await;
    eventually_within("the delayed event delivered once due", Duration::from_secs(20), || async { log.len() >= 1000 })
        .await;
    let elapsed = publishing.elapsed();
    let snapshot = relay.snapshot();
    relay.stop().await;
    assert!(snapshot.read_ahead > 0, "batches were read ahead: {snapshot:?}");
    assert!(elapsed >= delay, "not before it was due: {elapsed:?}");
    let order: Vec<i64> = log.0.lock().unwrap().iter().map(|(id, _)| *id).collect();
    assert_eq!(order.last(), Some(&ids[600]), "the delayed event came last");
    assert_eq!(log.len(), 1000, "no event delivered twice");
}

/// A parked event whose outbox row lies ahead of the destination's position (the copy a
/// delivery from its notification leaves when it outlives the hold, written here by hand, its
/// lease run out) is taken by the first claim of a backlog's transaction, delivered, and recorded
/// early beside it; the transaction's outcomes then remove the copy, and a claim read ahead
/// later meets the outbox row: only the transaction's own record says that the event was
/// delivered, and it is not sent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_parked_copy_ahead_of_the_position_delivered_while_reading_ahead_is_not_sent_again() {
    let db = TestDb::new().await;
    // Payloads of about 200 bytes: with `batch_bytes` 1 KiB a claim of new events takes five,
    // which leaves room in the batch for the parked copy, whichever kind of event claims first.
    let pad = "x".repeat(200);
    let events: Vec<NewEvent> = (0..100).map(|n| NewEvent::new("order.step", json!({ "n": n, "pad": pad }))).collect();
    let ids = db.outbox.publish_all(&events).await.unwrap();
    let copied = ids[40];
    let client = db.client().await;
    let written = client
        .execute(
            "insert into outbox_relay.parked
                    (destination, id, uuid, topic, key, payload, headers, created_at, available_at, attempts, lease_token)
             select 'default', o.id, o.uuid, o.topic, o.key, o.payload, o.headers, o.created_at,
                    now() - interval '1 second', 1, 7
               from outbox_relay.outbox o where o.id = $1",
            &[&copied],
        )
        .await
        .unwrap();
    assert_eq!(written, 1);
    let log = Log::default();
    let cfg = RelayConfig {
        // One worker: the copy is claimed with the backlog's first batch, in its transaction.
        workers: 1,
        fast_path: false,
        batch_size: 50,
        batch_bytes: 1024,
        record_every: Duration::from_millis(1),
        hold: Duration::from_secs(10),
        ..config()
    };
    let relay = support::start(&db.outbox, cfg, Flaky { log: log.clone(), failure_rate: 0.0 });
    eventually_within("the 100 events delivered", Duration::from_secs(60), || async { log.len() >= 100 }).await;
    // (time for a second delivery of the copied event to show)
    tokio::time::sleep(Duration::from_millis(500)).await;
    let snapshot = relay.snapshot();
    relay.stop().await;
    let order: Vec<i64> = log.0.lock().unwrap().iter().map(|(id, _)| *id).collect();
    let first = order.iter().position(|id| *id == copied).unwrap();
    assert!(first < 10, "the copy went with the first batch: {order:?}");
    assert!(snapshot.read_ahead > 0, "batches were read ahead: {snapshot:?}");
    assert_eq!(order.iter().filter(|id| **id == copied).count(), 1, "the copied event delivered once: {order:?}");
    assert_eq!(order.len(), 100, "no event delivered twice");
    assert_eq!(support::count(&client, "select count(*) from outbox_relay.parked").await, 0, "nothing waits");
}
