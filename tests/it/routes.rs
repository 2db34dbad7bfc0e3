//! Several destinations in one relay (issue 22), against real PostgreSQL and real HTTP receivers:
//! each destination on its own (an outage, a pause, failures of one leave the others alone), an
//! event routed to two destinations reaches each once, order per key per destination, and an
//! event no pattern matches goes to the dead letters, never silently away.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pg_outbox_relay::sink::HttpSink;
use pg_outbox_relay::{DeliveryError, Event, Handler, RelayConfig, Route};
use tokio::time::Instant;

use crate::harness::TestDb;
use crate::relay_support::{
    self as support, HttpReceiver, PATIENCE, config, count, eventually, eventually_within, recorder,
};

/// Publishes `n` events of `topic`, keyed `<prefix>-<i % keys>`, in one transaction.
async fn publish(db: &TestDb, topic: &str, n: i64, keys: i64) {
    db.client()
        .await
        .execute(
            "select outbox_relay.publish($1, jsonb_build_object('n', g), 'k-' || (g % $3::int8)) from generate_series(1, $2::int8) g",
            &[&topic, &n, &keys],
        )
        .await
        .unwrap();
}

/// The mailer's receiver refuses connections for 15 s while orders and mails are written in
/// waves: each wave's orders reach the ERP during the outage, the mailer's breaker opens (and only
/// its own), nothing is dead-lettered although three attempts would run out in well under a
/// second, and once the mailer is back it gets every mail, once.
#[tokio::test]
async fn two_destinations_one_down_for_15s_the_other_flows_and_nothing_is_dead_lettered() {
    let db = TestDb::new().await;
    let erp = HttpReceiver::start().await;
    let mut mailer = HttpReceiver::start().await;
    mailer.go_away().await;
    let cfg = support::outage_config();
    let timeout = Duration::from_secs(2);
    let routes = vec![
        Route::new("erp", "order.#", HttpSink::new(&erp.url(), timeout).unwrap()).unwrap(),
        Route::new("mailer", "mail.*", HttpSink::new(&mailer.url(), timeout).unwrap()).unwrap(),
    ];
    let relay = support::start_routes(&db.outbox, cfg, routes);
    let outage = Instant::now();
    let mut waves: i64 = 0;
    while outage.elapsed() < Duration::from_secs(15) {
        publish(&db, "order.placed", 10, 5).await;
        // Ten keys: the breaker counts distinct events failing in a row, and a key's later
        // events wait behind its head.
        publish(&db, "mail.send", 10, 10).await;
        waves += 1;
        let wanted = 10 * waves as usize;
        eventually("this wave's orders at the ERP while the mailer is down", || async { erp.accepted() >= wanted })
            .await;
        tokio::time::sleep(Duration::from_secs(1)).await; // the waves' pace over the outage
    }
    assert!(waves >= 10, "the waves spread over the outage: {waves}");
    assert!(relay.snapshot_of("mailer").breaker_open, "{:?}", relay.snapshot_of("mailer"));
    let erp_side = relay.snapshot_of("erp");
    assert!(!erp_side.breaker_open && erp_side.breaker_opens == 0, "the ERP's breaker never opened: {erp_side:?}");
    assert_eq!(mailer.accepted(), 0);
    let stats = db.outbox.queue_stats().await.unwrap();
    assert_eq!(stats.dead_letters, 0, "nothing dead-lettered during the outage: {stats:?}");
    assert!(stats.max_attempts < 3, "the outage consumed no attempt: {stats:?}");
    let shown = db.outbox.destinations().await.unwrap();
    let mail = shown.iter().find(|d| d.name == "mailer").unwrap();
    assert_eq!(
        mail.new + mail.due + mail.delayed + mail.in_flight,
        10 * waves,
        "status shows the mails waiting: {mail:?}"
    );

    mailer.come_back().await;
    eventually_within("every mail delivered", PATIENCE, || async { mailer.counts().len() as i64 == 10 * waves }).await;
    relay.stop().await;
    assert!(erp.counts().values().all(|n| *n == 1), "each order reached the ERP once");
    assert!(mailer.counts().values().all(|n| *n == 1), "each mail reached the mailer once");
    assert_eq!(erp.counts().len() as i64, 10 * waves);
    assert_eq!(db.outbox.queue_stats().await.unwrap().dead_letters, 0);
    assert_eq!(count(&db.client().await, "select count(*) from outbox_relay.parked").await, 0);
}

/// One event whose topic two patterns match reaches both destinations once; another only the
/// one whose pattern matches it; then nothing is left (completion delete): the outbox rows are
/// finished once both destinations passed them, by a claim or by the sweeper.
#[tokio::test]
async fn an_event_routed_to_two_destinations_reaches_each_once_and_then_nothing_is_left() {
    let db = TestDb::new().await;
    let (erp, mut to_erp) = recorder();
    let (audit, mut to_audit) = recorder();
    let cfg = RelayConfig { retention: Duration::ZERO, ..config() };
    let routes = vec![
        Route::new("erp", "order.*", erp.labelled("erp")).unwrap(),
        Route::new("audit", "#", audit.labelled("audit")).unwrap(),
    ];
    let relay = support::start_routes(&db.outbox, cfg, routes);
    publish(&db, "order.placed", 1, 1).await;
    publish(&db, "user.created", 1, 1).await;
    let order = to_erp.next().await;
    assert_eq!(order.event.topic, "order.placed");
    let mut at_audit: Vec<String> = to_audit.take(2).await.into_iter().map(|d| d.event.topic).collect();
    at_audit.sort();
    assert_eq!(at_audit, ["order.placed", "user.created"]);
    eventually("both outbox rows finished", || async {
        count(&db.client().await, "select count(*) from outbox_relay.outbox").await == 0
    })
    .await;
    relay.stop().await;
    assert_eq!(to_erp.counts().values().copied().collect::<Vec<_>>(), [1], "the ERP got the order once");
    assert!(to_audit.counts().values().all(|n| *n == 1) && to_audit.counts().len() == 2);
    assert!(to_erp.is_empty() && to_audit.is_empty());
    assert_eq!(count(&db.client().await, "select count(*) from outbox_relay.parked").await, 0);
    assert_eq!(db.outbox.queue_stats().await.unwrap().dead_letters, 0);
}

/// A pause of one destination holds only its events, survives a restart of the relay (it lives
/// in the database), and once lifted every held event goes out, once.
#[tokio::test]
async fn a_paused_destination_stays_paused_across_a_restart_while_the_other_delivers() {
    let db = TestDb::new().await;
    let (erp, mut to_erp) = recorder();
    let (mailer, mut to_mailer) = recorder();
    let routes = |erp: &support::Recorder, mailer: &support::Recorder| {
        vec![
            Route::new("erp", "order.#", erp.clone()).unwrap(),
            Route::new("mailer", "mail.#", mailer.clone()).unwrap(),
        ]
    };
    assert!(db.outbox.pause_destination("mailer", None).await.unwrap());
    let relay = support::start_routes(&db.outbox, config(), routes(&erp, &mailer));
    publish(&db, "order.placed", 5, 5).await;
    publish(&db, "mail.send", 5, 5).await;
    to_erp.take(5).await;
    eventually("the ERP's position past the mails too", || async {
        let d = db.outbox.destinations().await.unwrap();
        let erp = d.iter().find(|d| d.name == "erp").unwrap();
        let mail = d.iter().find(|d| d.name == "mailer").unwrap();
        erp.new == 0 && mail.new == 5 && mail.paused
    })
    .await;
    assert!(to_mailer.is_empty(), "the paused mailer got nothing");
    relay.stop().await;

    let relay = support::start_routes(&db.outbox, config(), routes(&erp, &mailer));
    publish(&db, "order.placed", 5, 5).await;
    publish(&db, "mail.send", 5, 5).await;
    to_erp.take(5).await;
    eventually("the restarted relay's ERP side idle again", || async {
        db.outbox.destinations().await.unwrap().iter().any(|d| d.name == "erp" && d.new == 0)
    })
    .await;
    assert!(to_mailer.is_empty(), "still paused after the restart");
    let pauses = db.outbox.pauses().await.unwrap();
    assert_eq!(pauses.len(), 1);
    assert_eq!((pauses[0].destination.as_deref(), pauses[0].topic.as_deref()), (Some("mailer"), None));

    assert!(db.outbox.resume_destination("mailer", None).await.unwrap());
    let mails = to_mailer.take(10).await;
    assert!(mails.iter().all(|d| d.event.topic == "mail.send"));
    relay.stop().await;
    assert!(to_mailer.counts().values().all(|n| *n == 1) && to_mailer.counts().len() == 10);
    assert!(to_erp.counts().values().all(|n| *n == 1) && to_erp.counts().len() == 10);
}

/// Per destination, successful deliveries in the order they happened, and the failures.
#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<(i64, String)>>>, Arc<std::sync::atomic::AtomicUsize>);

impl Log {
    fn push(&self, event: &Event) {
        self.0.lock().unwrap().push((event.id, event.key.clone().unwrap_or_default()));
    }

    fn refuse(&self, why: &str) -> Result<(), DeliveryError> {
        self.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Err(DeliveryError::transient(why))
    }

    fn refused(&self) -> usize {
        self.1.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn by_key(&self) -> HashMap<String, Vec<i64>> {
        let mut by_key: HashMap<String, Vec<i64>> = HashMap::new();
        for (id, key) in self.0.lock().unwrap().iter() {
            by_key.entry(key.clone()).or_default().push(*id);
        }
        by_key
    }

    fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }
}

/// A destination that refuses the attempts `refuses` picks (given the refusals so far), and logs
/// the others.
struct Flaky {
    log: Log,
    refuses: fn(&Event, usize) -> bool,
}

impl Handler for Flaky {
    async fn handle(&self, event: &Event) -> Result<(), DeliveryError> {
        if (self.refuses)(event, self.log.refused()) {
            return self.log.refuse("the destination refuses this attempt");
        }
        self.log.push(event);
        Ok(())
    }
}

/// Both destinations take every event; each fails some events' first attempts (a different set
/// each). Per destination every event is delivered, once, and each key's events in id order:
/// a failing event holds its key at that destination only.
#[tokio::test]
async fn order_per_key_holds_per_destination_under_failures() {
    let db = TestDb::new().await;
    let (a_log, b_log) = (Log::default(), Log::default());
    let a = Flaky { log: a_log.clone(), refuses: |event, _| event.id % 3 == 0 && event.attempts == 1 };
    let b = Flaky { log: b_log.clone(), refuses: |event, _| event.id % 4 == 1 && event.attempts <= 2 };
    let cfg = RelayConfig { batch_size: 16, breaker_threshold: 0, ..config() };
    let routes = vec![Route::new("a", "order.#", a).unwrap(), Route::new("b", "#", b).unwrap()];
    let relay = support::start_routes(&db.outbox, cfg, routes);
    for _ in 0..4 {
        publish(&db, "order.placed", 50, 10).await;
    }
    eventually_within("every event at both destinations", PATIENCE, || async {
        a_log.len() == 200 && b_log.len() == 200
    })
    .await;
    relay.stop().await;
    for (name, log) in [("a", &a_log), ("b", &b_log)] {
        let by_key = log.by_key();
        assert_eq!(by_key.len(), 10, "{name}");
        for (key, ids) in by_key {
            assert!(ids.windows(2).all(|w| w[0] < w[1]), "{name}: key {key} out of order or twice: {ids:?}");
        }
    }
    assert!(a_log.refused() >= 66 && b_log.refused() >= 100, "every planned failure happened");
    assert_eq!(db.outbox.queue_stats().await.unwrap().dead_letters, 0);
}

/// An event that no destination's pattern matches is not dropped: it goes to the dead letters
/// of the destination '' saying so when it is removed (its retention over: here at once),
/// `queue_stats` counts it, and once a route for it exists a retry delivers it.
#[tokio::test]
async fn an_event_no_route_matches_goes_to_the_dead_letters_and_a_retry_delivers_it() {
    let db = TestDb::new().await;
    let (erp, mut to_erp) = recorder();
    let cfg = RelayConfig { retention: Duration::ZERO, ..config() };
    let relay =
        support::start_routes(&db.outbox, cfg.clone(), vec![Route::new("erp", "order.#", erp.clone()).unwrap()]);
    publish(&db, "user.created", 1, 1).await;
    publish(&db, "order.placed", 1, 1).await;
    to_erp.next().await;
    eventually("the unrouted event in the dead letters", || async {
        db.outbox.queue_stats().await.unwrap().unrouted == 1
    })
    .await;
    relay.stop().await;
    let dead = db.outbox.dead_letters(10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!((dead[0].destination.as_str(), dead[0].topic.as_str()), ("", "user.created"));
    assert!(
        dead[0].last_error.contains("no destination's pattern matches") && dead[0].last_error.contains("erp order.#")
    );

    let (users, mut to_users) = recorder();
    let routes = vec![Route::new("erp", "order.#", erp).unwrap(), Route::new("users", "user.*", users).unwrap()];
    let relay = support::start_routes(&db.outbox, cfg, routes);
    eventually("the new destination registered", || async {
        db.outbox.destinations().await.unwrap().iter().any(|d| d.name == "users" && d.relays == 1)
    })
    .await;
    let uuid: uuid::Uuid = db
        .client()
        .await
        .query_one("select uuid from outbox_relay.dead_letters where id = $1", &[&dead[0].id])
        .await
        .unwrap()
        .get(0);
    assert_eq!(db.outbox.retry_dead_letters(&[dead[0].id]).await.unwrap(), [dead[0].id]);
    let revived = to_users.next().await;
    assert_eq!((revived.event.id, revived.event.uuid), (dead[0].id, uuid), "the same event, id and uuid kept");
    relay.stop().await;
    assert!(to_erp.is_empty(), "the ERP's pattern does not match it");
    assert_eq!(db.outbox.queue_stats().await.unwrap().dead_letters, 0);
}

/// A destination added to a database that another destination has delivered from starts where
/// that one is (it does not get the events delivered before it existed); a destination that
/// no relay serves any more keeps the outbox's rows until it is dropped, and dropping it lets
/// them go.
#[tokio::test]
async fn a_new_destination_starts_where_the_others_are_and_dropping_one_lets_its_events_go() {
    let db = TestDb::new().await;
    let cfg = RelayConfig { retention: Duration::ZERO, ..config() };
    let (a, mut to_a) = recorder();
    let relay = support::start_routes(&db.outbox, cfg.clone(), vec![Route::new("a", "#", a.clone()).unwrap()]);
    publish(&db, "order.placed", 5, 5).await;
    to_a.take(5).await;
    relay.stop().await;
    publish(&db, "order.placed", 5, 5).await;
    let (b, mut to_b) = recorder();
    let routes = vec![Route::new("a", "#", a.clone()).unwrap(), Route::new("b", "#", b).unwrap()];
    let relay = support::start_routes(&db.outbox, cfg.clone(), routes);
    let later: Vec<i64> = to_a.take(5).await.into_iter().map(|d| d.event.id).collect();
    let mut at_b: Vec<i64> = to_b.take(5).await.into_iter().map(|d| d.event.id).collect();
    at_b.sort();
    let mut later_sorted = later.clone();
    later_sorted.sort();
    assert_eq!(at_b, later_sorted, "b starts where a was: the five events written while no relay ran");
    relay.stop().await;

    // Only a runs now: b's position keeps what a delivered, until b is dropped.
    let relay = support::start_routes(&db.outbox, cfg, vec![Route::new("a", "#", a).unwrap()]);
    publish(&db, "order.placed", 3, 3).await;
    to_a.take(3).await;
    eventually("b shown waiting, with no relay", || async {
        db.outbox.destinations().await.unwrap().iter().any(|d| d.name == "b" && d.new == 3 && d.relays == 0)
    })
    .await;
    assert_eq!(count(&db.client().await, "select count(*) from outbox_relay.outbox").await, 3, "kept for b");
    assert_eq!(db.outbox.drop_destination("b").await.unwrap(), 0);
    eventually("the rows finished once b is gone", || async {
        count(&db.client().await, "select count(*) from outbox_relay.outbox").await == 0
    })
    .await;
    assert!(db.outbox.drop_destination("b").await.unwrap_err().to_string().contains("no destination is named"));
    relay.stop().await;
    assert!(to_b.is_empty());
}

/// Bad routes are refused when the relay is built, naming the problem.
#[tokio::test]
async fn bad_routes_are_refused_naming_the_problem() {
    let db = TestDb::new().await;
    let (r, _) = recorder();
    let e = Route::new("erp", "order..placed", r.clone()).unwrap_err().to_string();
    assert!(e.contains("word 2 is empty"), "{e}");
    let e = Route::new("e r p", "#", r.clone()).unwrap_err().to_string();
    assert!(e.contains("not allowed"), "{e}");
    let twice = vec![Route::new("erp", "#", r.clone()).unwrap(), Route::new("erp", "order.*", r.clone()).unwrap()];
    let e = pg_outbox_relay::Relay::with_routes(&db.outbox, config(), twice).err().unwrap().to_string();
    assert!(e.contains("two routes are named \"erp\""), "{e}");
    let e = pg_outbox_relay::Relay::with_routes(&db.outbox, config(), Vec::<Route<support::Recorder>>::new())
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("at least one route"), "{e}");
    let zero = Route::new("erp", "#", r).unwrap().concurrency(0);
    let e = pg_outbox_relay::Relay::with_routes(&db.outbox, config(), vec![zero]).err().unwrap().to_string();
    assert!(e.contains("route \"erp\"") && e.contains("concurrency"), "{e}");
}

/// The sweeper finishes what every destination has passed even while a transaction older than
/// the event stays open (a report, a forgotten session: every position's snapshot then has that
/// transaction in progress, below the event): a row no pattern matches reaches the dead letters
/// with the transaction still open, and one both destinations passed without taking it is gone.
#[tokio::test]
async fn the_sweeper_finishes_passed_rows_while_an_older_transaction_stays_open() {
    let db = TestDb::new().await;
    let held = db.client().await;
    held.batch_execute("begin; select pg_current_xact_id();").await.unwrap();
    let (a, mut to_a) = recorder();
    let cfg = RelayConfig { retention: Duration::ZERO, ..config() };
    let routes = vec![Route::new("a", "order.#", a.clone()).unwrap(), Route::new("b", "mail.#", a).unwrap()];
    let relay = support::start_routes(&db.outbox, cfg, routes);
    publish(&db, "user.created", 1, 1).await;
    publish(&db, "order.placed", 1, 1).await;
    to_a.next().await;
    eventually("the unrouted event dead-lettered while the old transaction is open", || async {
        db.outbox.queue_stats().await.unwrap().unrouted == 1
    })
    .await;
    eventually("the order's row finished while the old transaction is open", || async {
        count(&db.client().await, "select count(*) from outbox_relay.outbox").await == 0
    })
    .await;
    held.batch_execute("commit").await.unwrap();
    relay.stop().await;
}

/// A destination of either kind (the routes of a relay share one handler type).
enum Either {
    Flaky(Flaky),
    Recorder(support::Recorder),
}

impl Handler for Either {
    async fn handle(&self, event: &Event) -> Result<(), DeliveryError> {
        match self {
            Either::Flaky(h) => h.handle(event).await,
            Either::Recorder(h) => h.handle(event).await,
        }
    }
}

/// One destination refuses an event on its only allowed attempt while the other takes it: the
/// dead letter names the destination that refused it, the other has it once, the outbox row is
/// done with, and a retry of the dead letter goes to the refusing destination only.
#[tokio::test]
async fn a_dead_letter_names_the_destination_that_refused_the_event_and_its_retry_goes_there_only() {
    let db = TestDb::new().await;
    let (b, mut to_b) = recorder();
    let a_log = Log::default();
    let a = Flaky { log: a_log.clone(), refuses: |_, refused| refused == 0 };
    let routes =
        vec![Route::new("a", "#", Either::Flaky(a)).unwrap(), Route::new("b", "#", Either::Recorder(b)).unwrap()];
    let cfg = RelayConfig { max_attempts: 1, retention: Duration::ZERO, ..config() };
    let relay = support::start_routes(&db.outbox, cfg, routes);
    publish(&db, "order.placed", 1, 1).await;
    let delivered = to_b.next().await;
    eventually("the dead letter at a", || async { db.outbox.queue_stats().await.unwrap().dead_letters == 1 }).await;
    let dead = db.outbox.dead_letters(10).await.unwrap();
    assert_eq!((dead[0].destination.as_str(), dead[0].id), ("a", delivered.event.id));
    eventually("the outbox row done with", || async {
        count(&db.client().await, "select count(*) from outbox_relay.outbox").await == 0
    })
    .await;
    assert_eq!(db.outbox.retry_dead_letters(&[dead[0].id]).await.unwrap(), [dead[0].id]);
    eventually("a has it on its second attempt", || async { a_log.len() == 1 }).await;
    relay.stop().await;
    assert!(to_b.is_empty(), "b had it once, and not again");
    assert_eq!(db.outbox.queue_stats().await.unwrap().dead_letters, 0);
    assert_eq!(count(&db.client().await, "select count(*) from outbox_relay.parked").await, 0);
}

/// A destination a connected relay delivers to is not dropped; dropping the last destination
/// makes its position the origin, so that the next destination does not get again every event
/// kept (completion mark) since the migrations.
#[tokio::test]
async fn a_served_destination_is_not_dropped_and_the_last_one_dropped_leaves_its_position_as_the_origin() {
    let db = TestDb::new().await;
    let (a, mut to_a) = recorder();
    let relay = support::start_routes(&db.outbox, config(), vec![Route::new("a", "#", a).unwrap()]);
    publish(&db, "order.placed", 3, 3).await;
    to_a.take(3).await;
    eventually("the relay's row shows it serves a", || async {
        db.outbox.destinations().await.unwrap().iter().any(|d| d.name == "a" && d.relays == 1)
    })
    .await;
    let e = db.outbox.drop_destination("a").await.unwrap_err().to_string();
    assert!(e.contains("delivered to by 1 connected relay") && e.contains("nothing was dropped"), "{e}");
    relay.stop().await;
    assert_eq!(db.outbox.drop_destination("a").await.unwrap(), 0);

    let (c, mut to_c) = recorder();
    let relay = support::start_routes(&db.outbox, config(), vec![Route::new("c", "#", c).unwrap()]);
    publish(&db, "order.placed", 1, 1).await;
    let first = to_c.next().await;
    assert_eq!(first.event.id, 4, "c starts where a was, not with the three events kept processed");
    relay.stop().await;
    assert!(to_c.is_empty());
}

/// Two relays name one destination with two patterns (a rolling deploy that changes a route):
/// the second is refused at start, naming the destination, both patterns and the relay that
/// serves it, and the first delivers every event of its pattern. The second used to take the
/// destination over with a warning: each relay's claims moved the one position past the events
/// the other pattern wanted, and 200 events of one pattern or the other went nowhere.
#[tokio::test]
async fn a_relay_with_another_pattern_for_a_served_destination_is_refused_and_nothing_is_lost() {
    let db = TestDb::new().await;
    let (orders, mut to_orders) = recorder();
    let relay = support::start_routes(&db.outbox, config(), vec![Route::new("erp", "order.#", orders).unwrap()]);
    eventually("the first relay serves erp", || async {
        db.outbox.destinations().await.unwrap().iter().any(|d| d.name == "erp" && d.relays == 1)
    })
    .await;
    let (mails, _to_mails) = recorder();
    let second =
        pg_outbox_relay::Relay::with_routes(&db.outbox, config(), vec![Route::new("erp", "mail.#", mails).unwrap()])
            .unwrap();
    let refused = tokio::time::timeout(PATIENCE, second.run(std::future::pending()))
        .await
        .expect("refused at start, not left waiting")
        .unwrap_err();
    assert_eq!(refused.kind(), pg_outbox_relay::ErrorKind::Config);
    let said = refused.to_string();
    for part in ["destination erp", "the pattern order.#", "the pattern mail.#", "listener backend pid"] {
        assert!(said.contains(part), "the refusal names {part}: {said}");
    }
    publish(&db, "order.placed", 200, 20).await;
    publish(&db, "mail.send", 200, 20).await;
    let delivered = to_orders.take(200).await;
    assert!(delivered.iter().all(|d| d.event.topic == "order.placed"));
    let erp = db.outbox.destinations().await.unwrap().into_iter().find(|d| d.name == "erp").unwrap();
    assert_eq!(erp.pattern, "order.#", "the served pattern stays");
    relay.stop().await;
    assert!(to_orders.is_empty());
}

/// A destination that cannot be reached, with few keys: 50 events over 5 keys, `max_attempts` 3
/// and backoffs that would spend them in well under a second, the receiver's port refusing
/// connections for 5 s. Nothing goes to the dead letters and every event arrives once the
/// receiver is back: a failure in which no connection could be made spends no attempt, and the
/// breaker opens once every head has failed that way (5 distinct events, under its threshold
/// of 10). The heads used to go to the dead letters within a second.
#[tokio::test]
async fn a_destination_that_cannot_be_reached_with_few_keys_dead_letters_nothing() {
    let db = TestDb::new().await;
    let mut receiver = HttpReceiver::start().await;
    receiver.go_away().await;
    let sink = HttpSink::new(&receiver.url(), Duration::from_secs(2)).unwrap();
    let routes = vec![Route::new("mailer", "mail.#", sink).unwrap()];
    let relay = support::start_routes(&db.outbox, support::outage_config(), routes);
    publish(&db, "mail.send", 50, 5).await;
    tokio::time::sleep(Duration::from_secs(5)).await; // the port refuses connections
    let stats = db.outbox.queue_stats().await.unwrap();
    assert_eq!(stats.dead_letters, 0, "nothing dead-lettered during the outage: {stats:?}");
    assert!(stats.max_attempts < 3, "the outage consumed no attempt: {stats:?}");
    let mailer = relay.snapshot_of("mailer");
    assert!(mailer.breaker_opens >= 1, "the breaker opened with 5 heads failing: {mailer:?}");
    receiver.come_back().await;
    eventually_within("every mail delivered", PATIENCE, || async { receiver.counts().len() == 50 }).await;
    relay.stop().await;
    assert!(receiver.counts().values().all(|n| *n == 1), "each mail arrived once");
    assert_eq!(db.outbox.queue_stats().await.unwrap().dead_letters, 0);
}

/// A relay bounded by `max_connections` runs fewer workers and opens no more connections than it
/// may, however busy both its destinations are; its connections carry its id, by which
/// `connected_relays` tells its two listeners apart from two relays. A bound that not even one
/// worker per destination fits is refused, naming the least.
#[tokio::test]
async fn max_connections_bounds_what_a_relay_opens_and_its_listeners_count_as_one_relay() {
    let db = TestDb::new().await;
    let (handler, deliveries) = recorder();
    let max = RelayConfig::connections_needed(2, 1);
    assert_eq!(max, 13);
    // Every event fails once: its retry is parked, and parked events are claimed by every
    // worker at once (new ones one claim at a time), each claim holding a connection while its
    // slow deliveries run.
    let failing_once = |label: &'static str| {
        let handler = handler.labelled(label);
        pg_outbox_relay::handler_fn(move |event: Event| {
            let handler = handler.clone();
            async move {
                tokio::time::sleep(Duration::from_millis(3)).await;
                if event.attempts == 0 {
                    return Err(DeliveryError::transient("the first attempt fails"));
                }
                handler.handle(&event).await
            }
        })
    };
    let cfg = RelayConfig { workers: 8, batch_size: 10, breaker_threshold: 0, max_connections: Some(max), ..config() };
    let routes = vec![
        Route::new("erp", "order.#", failing_once("erp")).unwrap(),
        Route::new("mailer", "mail.#", failing_once("mailer")).unwrap(),
    ];
    publish(&db, "order.placed", 1000, 1000).await;
    publish(&db, "mail.send", 1000, 1000).await;
    let relay = pg_outbox_relay::Relay::with_routes(&db.outbox, cfg.clone(), routes).unwrap();
    assert_eq!(relay.config().workers, 1, "as many workers as fit 13 connections with two destinations");
    let relay = support::run(relay);
    let client = db.client().await;
    let named = "select count(*) from pg_stat_activity
                  where datname = current_database() and application_name ~ '^outbox-relay (listener )?[0-9a-f]{8}$'";
    let mut most = 0;
    let drained = tokio::time::timeout(PATIENCE, async {
        while deliveries.counts().len() < 2000 {
            most = most.max(count(&client, named).await);
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
    assert!(drained.is_ok(), "{} of 2000 delivered", deliveries.counts().len());
    assert!((3..=max as i64).contains(&most), "{most} connections open at most, with max_connections {max}");
    let relays = db.outbox.connected_relays().await.unwrap();
    assert_eq!(relays.len(), 2, "a listener per destination: {relays:?}");
    let id = relays[0].relay.clone().expect("the listener's name carries the relay's id");
    assert!(relays.iter().all(|r| r.relay.as_deref() == Some(id.as_str())), "one relay: {relays:?}");
    let held = relays[0].relay_connections.unwrap();
    assert!((2..=max as i64).contains(&held), "{held}");
    relay.stop().await;

    let (handler, _) = recorder();
    let too_few = RelayConfig { max_connections: Some(12), ..cfg };
    let routes = vec![
        Route::new("erp", "order.#", handler.labelled("erp")).unwrap(),
        Route::new("mailer", "mail.#", handler.labelled("mailer")).unwrap(),
    ];
    let refused = pg_outbox_relay::Relay::with_routes(&db.outbox, too_few, routes).err().expect("refused");
    assert!(refused.to_string().contains("needs at least 13"), "{refused}");
    assert_eq!(refused.kind(), pg_outbox_relay::ErrorKind::Config);
}
