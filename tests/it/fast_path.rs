//! The fast path (issue 41, migration 0018): new events handed to the handler from their
//! notification, recorded by the claim after them, and every rule a claim keeps still kept:
//! order per key behind a parked event, pauses, delays, patterns, payloads too large for a
//! notification, a lost notification, two relays on one destination.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pg_outbox_relay::{DeliveryError, Event, Handler, NewEvent, RelayConfig, Route};
use serde_json::json;

use crate::harness::TestDb;
use crate::relay_support::{self as support, Running, config, eventually, recorder};

/// Waits until the relay delivers new events from their notifications.
async fn armed(relay: &Running) {
    eventually("the fast path is armed", || async { relay.snapshot().fast_path_armed }).await;
}

/// Publishes through SQL on a connection of its own: the notification is the only wake-up.
async fn publish_sql(client: &tokio_postgres::Client, topic: &str, payload: &str, key: Option<&str>) -> i64 {
    client
        .query_one("select outbox_relay.publish($1, $2::text::jsonb, $3)", &[&topic, &payload, &key])
        .await
        .unwrap()
        .get(0)
}

/// A login role of this test database's own in `group`, a role of
/// `migrations/optional/least_privilege_roles.sql` (applied first); roles are cluster-wide, so
/// [`drop_role`] it at the end.
async fn login_role(db: &TestDb, admin: &tokio_postgres::Client, suffix: &str, group: &str) -> String {
    admin.batch_execute(crate::privileges::ROLES_SQL).await.expect("applying the roles file");
    let role = format!("{}_{suffix}", db.name);
    admin.batch_execute(&format!("create role {role} login in role {group}")).await.unwrap();
    role
}

async fn drop_role(admin: &tokio_postgres::Client, role: &str) {
    admin.batch_execute(&format!("drop owned by {role}; drop role {role}")).await.ok();
}

/// Every delivered id once, and each key's ids in ascending order.
fn once_and_in_order(delivered: &[Event]) {
    let mut seen = HashSet::new();
    let mut last: HashMap<&str, i64> = HashMap::new();
    for event in delivered {
        assert!(seen.insert(event.id), "event {} delivered twice", event.id);
        if let Some(key) = &event.key {
            let before = last.insert(key, event.id);
            assert!(before.is_none_or(|b| b < event.id), "key {key}: {} after {before:?}", event.id);
        }
    }
}

#[tokio::test]
async fn events_go_from_their_notification_to_the_handler_and_are_recorded_once() {
    let db = TestDb::new().await;
    let (handler, mut deliveries) = recorder();
    let relay = support::start(&db.outbox, config(), handler);
    armed(&relay).await;
    let writer = db.client().await;
    let mut through_outbox = HashSet::new();
    for n in 0..30 {
        let key = format!("k{}", n % 3);
        if n % 2 == 0 {
            // Another connection: the notification wakes the relay.
            let payload = format!(r#"{{"n": {n}, "exact": 1.000000000000000000001}}"#);
            publish_sql(&writer, "order.placed", &payload, Some(&key)).await;
        } else {
            // This process's Outbox: its commit's notification, not its wake-up, brings it.
            let event = NewEvent::new("order.placed", json!({ "n": n })).key(key).header("trace", "t1");
            through_outbox.insert(db.outbox.publish(&event).await.unwrap());
        }
    }
    let delivered: Vec<Event> = deliveries.take(30).await.into_iter().map(|d| d.event).collect();
    once_and_in_order(&delivered);
    let stored: HashMap<i64, (String, uuid::Uuid)> = writer
        .query("select id, payload::text, uuid from outbox_relay.outbox", &[])
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), (row.get(1), row.get(2))))
        .collect();
    for event in &delivered {
        let (payload, uuid) = &stored[&event.id];
        assert_eq!(event.payload.get(), payload, "the payload as stored, every digit");
        assert_eq!(event.uuid, *uuid);
        assert_eq!(event.attempts, 1);
        if through_outbox.contains(&event.id) {
            assert_eq!(event.headers.get("trace"), Some("t1"));
        }
    }
    eventually("every event recorded delivered", || async {
        support::count(
            &writer,
            "select count(*) from outbox_relay.outbox where not outbox_relay.passed_by_all(xid, id)",
        )
        .await
            == 0
    })
    .await;
    // Each went one way: from its notification, or (heard of while the claim after a fast batch
    // ran, and read by it) by that claim.
    eventually("each counted once", || async {
        let s = relay.snapshot();
        s.fast_delivered + s.claimed_events == 30 && s.fast_delivered > 0
    })
    .await;
    assert_eq!(support::count(&writer, "select count(*) from outbox_relay.parked").await, 0);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(deliveries.is_empty(), "nothing delivered again");
    assert_eq!(relay.snapshot().delivered, 30);
    relay.stop().await;
}

/// Fails the first attempt of every event whose payload asks for it: at once (`"fail"`), or once
/// the test lets it go (`"stall"`: a slow receiver that finally answers 503).
#[derive(Clone)]
struct FailFirst {
    tried: Arc<Mutex<HashSet<i64>>>,
    inner: support::Recorder,
    /// The stalled events, in the order they came.
    stalled: Arc<Mutex<Vec<i64>>>,
    /// Lets a stalled event go, one per permit.
    go: Arc<tokio::sync::Semaphore>,
}

impl FailFirst {
    fn new(inner: support::Recorder) -> FailFirst {
        FailFirst {
            tried: Arc::default(),
            inner,
            stalled: Arc::default(),
            go: Arc::new(tokio::sync::Semaphore::new(0)),
        }
    }
}

impl Handler for FailFirst {
    async fn handle(&self, event: &Event) -> Result<(), DeliveryError> {
        let first = self.tried.lock().unwrap().insert(event.id);
        if first && event.payload.get().contains("stall") {
            self.stalled.lock().unwrap().push(event.id);
            drop(self.go.acquire().await.unwrap());
            return Err(DeliveryError::transient("the receiver answered late, and busy"));
        }
        if first && event.payload.get().contains("fail") {
            return Err(DeliveryError::transient("the receiver is busy"));
        }
        self.inner.handle(event).await
    }
}

/// Delivers and records every event; the first attempt of one whose payload says "slow" takes
/// `stall` first (a delivery that outlives the hold: its claim is leased).
#[derive(Clone)]
struct SlowFirst {
    tried: Arc<Mutex<HashSet<i64>>>,
    inner: support::Recorder,
    stall: Duration,
}

impl Handler for SlowFirst {
    async fn handle(&self, event: &Event) -> Result<(), DeliveryError> {
        let first = self.tried.lock().unwrap().insert(event.id);
        if first && event.payload.get().contains("slow") {
            tokio::time::sleep(self.stall).await;
        }
        self.inner.handle(event).await
    }
}

/// An event the fast path delivered, met by a batch read ahead behind an earlier event (of a
/// transaction that committed after it, too large for a notification) whose delivery outlives
/// the hold: the lease undoes the batch read ahead, and what the fast path decided stays with
/// the fast path, so the claim that meets the event again records it instead of handing it over
/// a second time. The test holds the destination's lock of new events meanwhile, so that no claim
/// records the fast delivery before the slow event commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_event_the_fast_path_delivered_is_not_sent_again_when_the_batch_read_ahead_with_it_is_undone() {
    let db = TestDb::new().await;
    let (inner, mut deliveries) = recorder();
    let handler = SlowFirst { tried: Arc::default(), inner, stall: Duration::from_millis(2500) };
    let cfg = RelayConfig {
        batch_size: 1,
        // (a claim reads ahead while its transaction is younger than half of this)
        hold: Duration::from_secs(1),
        poll_interval: Duration::from_millis(200),
        ..config()
    };
    let relay = support::start(&db.outbox, cfg, handler);
    armed(&relay).await;

    let blocker = db.client().await;
    let new_events_lock = |verb: &str| {
        // The lock of a destination's new events (src/sql/claim_new.sql), for the session.
        format!("select pg_advisory_{verb}(1869901932, lock_id) from outbox_relay.destinations where name = 'default'")
    };
    blocker.query_one(&new_events_lock("lock"), &[]).await.unwrap();
    let writer = db.client().await;
    let slow_writer = db.client().await;
    slow_writer.batch_execute("begin").await.unwrap();
    let slow_payload = format!(r#"{{"slow": "{}"}}"#, "x".repeat(9_000));
    let slow = publish_sql(&slow_writer, "order.slow", &slow_payload, None).await;
    let fast = publish_sql(&writer, "order.fast", "{}", None).await;
    assert!(slow < fast, "the slow event has the lower id");
    assert_eq!(deliveries.next().await.event.id, fast, "delivered from its notification");
    slow_writer.batch_execute("commit").await.unwrap();
    // The slow event's notification wakes a claim, which the test's lock turns away.
    tokio::time::sleep(Duration::from_millis(300)).await;
    blocker.query_one(&new_events_lock("unlock"), &[]).await.unwrap();

    // The claim takes the slow event, reads the fast one ahead, and is leased while the slow
    // one is delivered (past the hold).
    while deliveries.next().await.event.id != slow {}
    eventually("every event recorded", || async { db.outbox.queue_stats().await.unwrap().pending == 0 }).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let snapshot = relay.snapshot();
    relay.stop().await;
    assert_eq!(deliveries.counts(), HashMap::from([(slow, 1), (fast, 1)]), "each event delivered once");
    assert!(snapshot.read_ahead > 0, "the fast event was read ahead behind the slow one: {snapshot:?}");
    assert_eq!(snapshot.fast_delivered, 1, "{snapshot:?}");
}

#[tokio::test]
async fn a_key_whose_event_waits_for_a_retry_holds_its_next_event_back() {
    let db = TestDb::new().await;
    let (inner, mut deliveries) = recorder();
    let handler = FailFirst::new(inner);
    // A retry late enough to be seen waiting.
    let config = pg_outbox_relay::RelayConfig {
        backoff_base: Duration::from_millis(500),
        backoff_max: Duration::from_secs(1),
        ..config()
    };
    let relay = support::start(&db.outbox, config, handler);
    armed(&relay).await;
    let writer = db.client().await;
    let first = publish_sql(&writer, "order.placed", r#"{"fail": true}"#, Some("k")).await;
    eventually("the first event parked for its retry", || async {
        support::count(&writer, "select count(*) from outbox_relay.parked").await == 1
    })
    .await;
    // Its key's next event comes by notification while the first waits: it must not pass it.
    let second = publish_sql(&writer, "order.placed", "{}", Some("k")).await;
    let other = publish_sql(&writer, "order.placed", "{}", Some("other")).await;
    let delivered: Vec<i64> = deliveries.take(3).await.into_iter().map(|d| d.event.id).collect();
    let at = |id| delivered.iter().position(|d| *d == id).unwrap();
    assert!(at(first) < at(second), "order per key: {delivered:?}");
    assert!(delivered.contains(&other));
    eventually("all recorded", || async {
        support::count(
            &writer,
            "select count(*) from outbox_relay.outbox where not outbox_relay.passed_by_all(xid, id)",
        )
        .await
            == 0
            && support::count(&writer, "select count(*) from outbox_relay.parked").await == 0
    })
    .await;
    // The key waits no longer once its events are delivered. The relay learns it from the claim
    // of the key's next event (it does not know whether a claim of parked events took the key's
    // last one); the ones after go the fast way.
    // (A claim that a batch's end calls for may take one first: a few tries.)
    let before = relay.snapshot().fast_delivered;
    for _ in 0..5 {
        armed(&relay).await;
        publish_sql(&writer, "order.placed", "{}", Some("k")).await;
        deliveries.next().await;
        eventually("recorded", || async {
            support::count(
                &writer,
                "select count(*) from outbox_relay.outbox where not outbox_relay.passed_by_all(xid, id)",
            )
            .await
                == 0
        })
        .await;
        if relay.snapshot().fast_delivered > before {
            break;
        }
    }
    assert!(relay.snapshot().fast_delivered > before, "the key's events go the fast way again");
    relay.stop().await;
}

/// A delivery from a notification that outlives `hold` is leased, as a claim's is: the events
/// of other keys committed meanwhile are claimed and delivered while it goes on, its own key's
/// next event waits behind it, and its late failure is recorded by the lease's token and retried.
#[tokio::test]
async fn a_slow_delivery_from_a_notification_is_leased_and_holds_back_only_its_key() {
    let db = TestDb::new().await;
    let (inner, mut deliveries) = recorder();
    let handler = FailFirst::new(inner);
    let (stalled, go) = (handler.stalled.clone(), handler.go.clone());
    let config =
        pg_outbox_relay::RelayConfig { hold: Duration::from_millis(200), lease: Duration::from_secs(20), ..config() };
    let relay = support::start(&db.outbox, config, handler);
    armed(&relay).await;
    let writer = db.client().await;
    let (claims_before, claimed_before) = (relay.snapshot().claims, relay.snapshot().claimed_events);
    let slow = publish_sql(&writer, "order.placed", r#"{"stall": true}"#, Some("k1")).await;
    eventually("the slow event in the handler", || async { stalled.lock().unwrap().contains(&slow) }).await;
    eventually("the slow delivery leased", || async {
        support::count(&writer, "select count(*) from outbox_relay.parked where lease_token is not null").await == 1
    })
    .await;
    assert_eq!(relay.snapshot().claimed_events, claimed_before, "it went from its notification, not a claim");
    // The lease wakes a claim; the events below come after it (a claim that arms the fast path
    // then would leave them to a task busy with the slow delivery, and to the lease's end).
    eventually("a claim after the lease", || async { relay.snapshot().claims > claims_before }).await;
    let next_of_its_key = publish_sql(&writer, "order.placed", "{}", Some("k1")).await;
    let other = publish_sql(&writer, "order.placed", "{}", Some("k2")).await;
    let unkeyed = publish_sql(&writer, "order.placed", "{}", None).await;
    // Their notifications wake a claim: they do not wait for the lease's end (nor for a poll:
    // it never fires here).
    let early = tokio::time::timeout(Duration::from_secs(10), deliveries.take(2));
    let early = early.await.expect("delivered while the slow one goes on, long before its lease (20 s) ends");
    let mut early: Vec<i64> = early.into_iter().map(|d| d.event.id).collect();
    early.sort();
    assert_eq!(early, vec![other, unkeyed], "delivered while the slow one goes on");
    assert!(deliveries.is_empty(), "its key's next event waits behind it");
    // Its lease is renewed while it goes on (every half lease).
    let lease_ends =
        "select (extract(epoch from available_at) * 1000)::int8 from outbox_relay.parked where lease_token is not null";
    let first_end = support::count(&writer, lease_ends).await;
    eventually("the lease renewed", || async { support::count(&writer, lease_ends).await > first_end }).await;
    assert_eq!(stalled.lock().unwrap().len(), 1);
    go.add_permits(1);
    let late: Vec<i64> = deliveries.take(2).await.into_iter().map(|d| d.event.id).collect();
    assert_eq!(late, vec![slow, next_of_its_key], "retried, then its key's next event");
    eventually("all recorded", || async {
        support::count(
            &writer,
            "select count(*) from outbox_relay.outbox where not outbox_relay.passed_by_all(xid, id)",
        )
        .await
            == 0
            && support::count(&writer, "select count(*) from outbox_relay.parked").await == 0
    })
    .await;
    let counts = deliveries.counts();
    assert!(counts.values().all(|n| *n == 1), "each delivered once: {counts:?}");
    let snapshot = relay.snapshot();
    assert_eq!((snapshot.delivered, snapshot.retried, snapshot.dead_lettered), (4, 1, 0));
    relay.stop().await;
}

#[tokio::test]
async fn paused_delayed_unmatched_and_oversized_events_wait_for_a_claim() {
    let db = TestDb::new().await;
    let (handler, mut deliveries) = recorder();
    let routes = vec![Route::new("orders", "order.#", handler).unwrap()];
    let relay = support::start_routes(&db.outbox, config(), routes);
    armed(&relay).await;
    let writer = db.client().await;
    assert!(db.outbox.pause(Some("order.paused")).await.unwrap());
    eventually("the relay reads the pause", || async { relay.snapshot().paused_topics == 1 }).await;
    armed(&relay).await;

    let paused = publish_sql(&writer, "order.paused", "{}", Some("a")).await;
    let unmatched = publish_sql(&writer, "mail.sent", "{}", Some("b")).await;
    let big = format!(r#"{{"text": "{}"}}"#, "x".repeat(9_000));
    let oversized = publish_sql(&writer, "order.big", &big, Some("c")).await;
    let behind_oversized = publish_sql(&writer, "order.small", "{}", Some("c")).await;
    let delayed = db
        .outbox
        .publish(&NewEvent::new("order.later", json!({})).key("d").delay(Duration::from_millis(400)))
        .await
        .unwrap();
    let plain = publish_sql(&writer, "order.plain", "{}", Some("e")).await;

    let taken = deliveries.take(4).await;
    let delivered: Vec<Event> = taken.iter().map(|d| d.event.clone()).collect();
    once_and_in_order(&delivered);
    let ids: Vec<i64> = delivered.iter().map(|e| e.id).collect();
    for id in [oversized, behind_oversized, delayed, plain] {
        assert!(ids.contains(&id), "{id} delivered: {ids:?}");
    }
    assert!(!ids.contains(&paused) && !ids.contains(&unmatched));
    let big_one = delivered.iter().find(|e| e.id == oversized).unwrap();
    assert_eq!(big_one.payload.get(), big, "the whole payload, by the claim");
    let waited = taken.iter().find(|d| d.event.id == delayed).unwrap();
    let after = waited.at.duration_since(waited.event.created_at).unwrap();
    assert!(after >= Duration::from_millis(400), "delivered {after:?} after it was written");
    assert_eq!(waited.event.attempts, 1);
    assert!(relay.snapshot().fast_delivered <= 1, "only the plain event could go the fast way");

    assert!(db.outbox.resume(Some("order.paused")).await.unwrap());
    assert_eq!(deliveries.next().await.event.id, paused);
    relay.stop().await;
}

#[tokio::test]
async fn notifications_lost_with_the_listeners_connection_are_caught_by_a_claim() {
    let db = TestDb::new().await;
    let (handler, mut deliveries) = recorder();
    let relay = support::start(&db.outbox, config(), handler);
    armed(&relay).await;
    let writer = db.client().await;
    let admin = db.client().await;
    let mut ids = Vec::new();
    for n in 0..20 {
        if n == 5 {
            let killed: bool = admin
                .query_one(
                    "select bool_or(pg_terminate_backend(pid)) from pg_stat_activity
                      where application_name like 'outbox-relay listener%' and datname = current_database()",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            assert!(killed, "the listener's backend terminated");
        }
        ids.push(publish_sql(&writer, "order.placed", &format!(r#"{{"n": {n}}}"#), Some(&format!("k{}", n % 2))).await);
    }
    let delivered: Vec<Event> = deliveries.take(20).await.into_iter().map(|d| d.event).collect();
    once_and_in_order(&delivered);
    eventually("all recorded", || async {
        support::count(
            &writer,
            "select count(*) from outbox_relay.outbox where not outbox_relay.passed_by_all(xid, id)",
        )
        .await
            == 0
    })
    .await;
    // (The claims may deliver them all before the listener's end is noticed, on a busy machine.)
    eventually("the listener reconnected", || async { relay.snapshot().reconnects >= 1 }).await;
    // And the fast path comes back with the listener.
    armed(&relay).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(deliveries.is_empty(), "nothing delivered again");
    relay.stop().await;
}

#[tokio::test]
async fn one_relay_of_two_owns_the_fast_path_and_the_other_takes_it_when_it_dies() {
    let db = TestDb::new().await;
    let (handler, mut deliveries) = recorder();
    let first = support::start(&db.outbox, config(), handler.labelled("first"));
    armed(&first).await;
    // The second relay, started with the fast path off and then on: neither claims what the
    // owner delivers.
    let off = support::start(
        &db.outbox,
        pg_outbox_relay::RelayConfig { fast_path: false, ..config() },
        handler.labelled("off"),
    );
    let second = support::start(&db.outbox, config(), handler.labelled("second"));
    let writer = db.client().await;
    for n in 0..30 {
        publish_sql(&writer, "order.placed", &format!(r#"{{"n": {n}}}"#), Some(&format!("k{}", n % 3))).await;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let delivered = deliveries.take(30).await;
    let events: Vec<Event> = delivered.iter().map(|d| d.event.clone()).collect();
    once_and_in_order(&events);
    assert!(delivered.iter().all(|d| d.by == "first"), "only the owner takes new events");
    eventually("all recorded", || async {
        support::count(
            &writer,
            "select count(*) from outbox_relay.outbox where not outbox_relay.passed_by_all(xid, id)",
        )
        .await
            == 0
    })
    .await;
    assert!(!second.snapshot().fast_path_armed && !off.snapshot().fast_path_armed);

    // Everything the owner delivered is recorded: when it dies, nothing is sent again, and the
    // second relay takes the fast path over.
    first.crash().await;
    armed(&second).await;
    let mut later = Vec::new();
    for n in 0..10 {
        later.push(publish_sql(&writer, "order.placed", &format!(r#"{{"n": {n}}}"#), Some("k0")).await);
    }
    let delivered = deliveries.take(10).await;
    let events: Vec<Event> = delivered.iter().map(|d| d.event.clone()).collect();
    once_and_in_order(&events);
    assert_eq!(events.iter().map(|e| e.id).collect::<Vec<_>>(), later);
    assert!(delivered.iter().all(|d| d.by == "second"));
    eventually("the second relay delivered from notifications", || async { second.snapshot().fast_delivered > 0 })
        .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(deliveries.is_empty(), "nothing delivered twice");
    second.stop().await;
    off.stop().await;
}

/// Any role that may connect may NOTIFY on the outbox channel: an event it makes up, with no
/// signature or a wrong one, is never delivered (it only wakes a claim, which finds nothing), and
/// the relay goes on delivering what is committed.
#[tokio::test]
async fn a_notification_another_role_makes_up_delivers_nothing() {
    let db = TestDb::new().await;
    let (handler, mut deliveries) = recorder();
    let relay = support::start(&db.outbox, config(), handler);
    armed(&relay).await;
    let writer = db.client().await;
    let xid: String = writer.query_one("select pg_current_xact_id()::text", &[]).await.unwrap().get(0);
    let made_up = format!(
        r#"{{"x":"{}","e":[[1,"2e33a3d2-40f3-4828-a3ef-0c45964299e3","order.placed",null,null,0,false,{{"forged":true}}]]}}"#,
        xid.parse::<u64>().unwrap() + 1
    );
    for payload in [made_up.clone(), format!("{}{made_up}", "0".repeat(64))] {
        writer.query_one("select pg_notify('outbox_relay', $1)", &[&payload]).await.unwrap();
    }
    // The real event that takes id 1 arrives as stored.
    let id = publish_sql(&writer, "order.placed", r#"{"real": true}"#, None).await;
    assert_eq!(id, 1);
    let delivered = deliveries.next().await.event;
    assert_eq!((delivered.id, delivered.payload.get()), (1, r#"{"real": true}"#));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(deliveries.is_empty(), "nothing else delivered");
    armed(&relay).await;
    relay.stop().await;
}

/// A writer's role may insert events but not read them: the trigger reads them for the
/// notification with the migration owner's rights (`notify_events` is SECURITY DEFINER), so a
/// writer's publish succeeds while a relay waits, and its event comes by the fast path.
#[tokio::test]
async fn a_writers_role_publishes_while_a_relay_waits_and_its_event_comes_by_the_fast_path() {
    let db = TestDb::new().await;
    let admin = db.client().await;
    let writer_role = login_role(&db, &admin, "fast_writer", "outbox_writer").await;
    let (handler, mut deliveries) = recorder();
    let relay = support::start(&db.outbox, config(), handler);
    armed(&relay).await;
    let (writer, connection) = tokio_postgres::connect(&db.url_as(&writer_role), tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(connection);
    let id = publish_sql(&writer, "order.placed", r#"{"by": "writer"}"#, Some("k")).await;
    let err = writer.query("select payload from outbox_relay.outbox", &[]).await.unwrap_err();
    assert_eq!(err.code(), Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE), "{err}");
    assert_eq!(deliveries.next().await.event.id, id);
    eventually("delivered from its notification", || async { relay.snapshot().fast_delivered == 1 }).await;
    relay.stop().await;
    drop(writer);
    drop_role(&admin, &writer_role).await;
}

/// A relay whose role may not read the signing key does not take the fast path, neither at the
/// start nor at its retries each second; it claims new events and delivers them as before.
#[tokio::test]
async fn a_relay_that_may_not_read_the_signing_key_claims_first() {
    let db = TestDb::new().await;
    let admin = db.client().await;
    let role = login_role(&db, &admin, "keyless", "outbox_relayer").await;
    admin.batch_execute("revoke select on outbox_relay.notification_key from outbox_relayer").await.unwrap();
    let outbox = pg_outbox_relay::Outbox::connect(&db.url_as(&role)).await.unwrap();
    let (handler, mut deliveries) = recorder();
    let relay = support::start(&outbox, config(), handler);
    support::relay_waiting(&admin).await;
    // Past two of the listener's retries.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let id = publish_sql(&admin, "order.placed", r#"{"n": 1}"#, Some("k")).await;
    assert_eq!(deliveries.next().await.event.id, id);
    let snapshot = relay.snapshot();
    assert!(!snapshot.fast_path_armed && snapshot.fast_delivered == 0, "{snapshot:?}");
    relay.stop().await;
    drop(outbox);
    drop_role(&admin, &role).await;
}
