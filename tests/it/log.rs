//! The outbox as a log (issue 42, migration 0019): delivery writes no outbox row, events every
//! destination has passed are kept for the retention and then removed in bulk (beside
//! `pg_dump`'s lock, and a crash in the middle of it loses nothing), retained events can be sent
//! again to one destination, a destination can start in the past, and `outbox_relay.event_state`
//! says what became of each event.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use pg_outbox_relay::{Event, EventState, NewEvent, Route, TopicPattern};
use serde_json::json;

use crate::harness::TestDb;
use crate::relay_support::{self as support, RELAY_PLANNER_SETTINGS, config, count, eventually, recorder};

/// Publishes `n` events of `topic` over `keys` keys (`k-0` ...), one transaction each.
async fn publish_each(db: &TestDb, topic: &str, n: usize, keys: usize) -> Vec<i64> {
    let mut ids = Vec::with_capacity(n);
    for i in 0..n {
        let event = NewEvent::new(topic, json!({"n": i})).key(format!("k-{}", i % keys));
        ids.push(db.outbox.publish(&event).await.unwrap());
    }
    ids
}

/// Until every registered destination's position has passed every event in the outbox.
async fn until_every_destination_passed_everything(db: &TestDb) {
    eventually("every destination passed every event", || async {
        count(
            &db.client().await,
            "select count(*) from outbox_relay.outbox where not outbox_relay.passed_by_all(xid, id)",
        )
        .await
            == 0
    })
    .await;
}

/// The ids each key got, in the order delivered.
fn per_key(events: &[Event]) -> HashMap<String, Vec<i64>> {
    let mut keys: HashMap<String, Vec<i64>> = HashMap::new();
    for e in events {
        keys.entry(e.key.clone().unwrap_or_default()).or_default().push(e.id);
    }
    keys
}

/// Two destinations take every order; a range of them is replayed to one: it gets exactly the
/// range again, in order per key, with the uuids it had the first time, while new events keep
/// flowing to it behind the replayed ones of their keys; the other gets nothing more.
#[tokio::test]
async fn a_replay_of_a_range_reaches_one_destination_of_two_in_order_per_key_with_its_uuids() {
    let db = TestDb::new().await;
    let (erp, mut to_erp) = recorder();
    let (audit, mut to_audit) = recorder();
    let routes = vec![
        Route::new("erp", "order.#", erp.labelled("erp")).unwrap(),
        Route::new("audit", "order.#", audit.labelled("audit")).unwrap(),
    ];
    let relay = support::start_routes(&db.outbox, config(), routes);
    publish_each(&db, "order.placed", 10, 3).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let since = SystemTime::now();
    let range = publish_each(&db, "order.placed", 30, 3).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let until = SystemTime::now();
    publish_each(&db, "order.placed", 10, 3).await;
    let first: Vec<Event> = to_erp.take(50).await.into_iter().map(|d| d.event).collect();
    to_audit.take(50).await;
    let uuids: HashMap<i64, uuid::Uuid> = first.iter().map(|e| (e.id, e.uuid)).collect();
    until_every_destination_passed_everything(&db).await;

    assert_eq!(db.outbox.replay_count("erp", since, Some(until), None).await.unwrap(), 30, "a dry run counts");
    assert_eq!(count(&db.client().await, "select count(*) from outbox_relay.parked").await, 0, "and copies nothing");
    let copied = db.outbox.replay("erp", since, Some(until), None).await.unwrap();
    assert_eq!(copied, 30);
    // New events of the replayed keys while the replay drains: each after its key's replay.
    let later = publish_each(&db, "order.placed", 6, 3).await;
    let again: Vec<Event> = to_erp.take(36).await.into_iter().map(|d| d.event).collect();
    let replayed: Vec<&Event> = again.iter().filter(|e| range.contains(&e.id)).collect();
    assert_eq!(replayed.len(), 30, "the range, once each");
    for e in &replayed {
        assert_eq!(e.uuid, uuids[&e.id], "event {} keeps its uuid", e.id);
    }
    for (key, ids) in per_key(&again) {
        let mut sorted = ids.clone();
        sorted.sort_unstable();
        assert_eq!(ids, sorted, "key {key} in order: replayed events first, then the new ones");
    }
    assert!(later.iter().all(|id| again.iter().any(|e| e.id == *id)), "the live stream went on");
    to_audit.take(6).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(to_erp.is_empty() && to_audit.is_empty(), "nothing more, and nothing replayed to audit");
    relay.stop().await;

    // What became of one replayed event, at each destination.
    let found = db.outbox.look_up(Some(range[0]), None, 10).await.unwrap();
    let states: Vec<(Option<String>, EventState)> = found.iter().map(|f| (f.destination.clone(), f.state)).collect();
    assert_eq!(
        states,
        [(Some("audit".to_string()), EventState::Delivered), (Some("erp".to_string()), EventState::Delivered)]
    );
}

/// A replay refuses an unknown destination and a range that ends before it begins, naming them.
#[tokio::test]
async fn a_replay_names_an_unknown_destination_and_an_empty_range() {
    let db = TestDb::new().await;
    let now = SystemTime::now();
    let err = db.outbox.replay("nobody", now - Duration::from_secs(60), None, None).await.unwrap_err();
    assert!(err.is_invalid_input() && err.to_string().contains("no destination is named \"nobody\""), "{err}");
    let err = db.outbox.replay("nobody", now, Some(now - Duration::from_secs(1)), None).await.unwrap_err();
    assert!(err.is_invalid_input() && err.to_string().contains("must be before its until"), "{err}");
}

/// A destination added in the past gets the retained events since then that its pattern takes,
/// in order per key, before any newer one; one added now gets only what is new.
#[tokio::test]
async fn a_destination_added_in_the_past_gets_the_retained_events_since_then_first() {
    let db = TestDb::new().await;
    let (erp, mut to_erp) = recorder();
    let relay = support::start_routes(&db.outbox, config(), vec![Route::new("erp", "#", erp).unwrap()]);
    publish_each(&db, "mail.send", 5, 2).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let since = SystemTime::now();
    let retained = publish_each(&db, "mail.send", 8, 2).await;
    publish_each(&db, "order.placed", 4, 2).await;
    to_erp.take(17).await;
    until_every_destination_passed_everything(&db).await;

    let mail = TopicPattern::parse("mail.#").unwrap();
    assert_eq!(db.outbox.add_destination("mailer", &mail, Some(since)).await.unwrap(), 8);
    let again = db.outbox.add_destination("mailer", &mail, None).await.unwrap_err();
    assert!(again.is_invalid_input() && again.to_string().contains("registered already"), "{again}");
    assert_eq!(db.outbox.add_destination("newsletter", &mail, None).await.unwrap(), 0);
    let newer = publish_each(&db, "mail.send", 4, 2).await;
    relay.stop().await;

    let (erp, _to_erp) = recorder();
    let (mailer, mut to_mailer) = recorder();
    let (newsletter, mut to_newsletter) = recorder();
    let routes = vec![
        Route::new("erp", "#", erp).unwrap(),
        Route::new("mailer", "mail.#", mailer).unwrap(),
        Route::new("newsletter", "mail.#", newsletter).unwrap(),
    ];
    let relay = support::start_routes(&db.outbox, config(), routes);
    let got: Vec<Event> = to_mailer.take(12).await.into_iter().map(|d| d.event).collect();
    let ids: Vec<i64> = got.iter().map(|e| e.id).collect();
    let mut expected: Vec<i64> = retained.iter().chain(&newer).copied().collect();
    expected.sort_unstable();
    let mut sorted = ids.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, expected, "the mails since then, and the new ones: not the older mails, no order");
    for (key, ids) in per_key(&got) {
        let mut in_order = ids.clone();
        in_order.sort_unstable();
        assert_eq!(ids, in_order, "key {key} in order");
    }
    let fresh: Vec<i64> = to_newsletter.take(4).await.into_iter().map(|d| d.event.id).collect();
    assert_eq!(fresh.iter().copied().collect::<std::collections::BTreeSet<_>>(), newer.iter().copied().collect());
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(to_mailer.is_empty() && to_newsletter.is_empty());
    relay.stop().await;
}

/// `outbox_relay.event_state` (and the lookup that reads it) says what became of each event at
/// each destination: delivered at once (one attempt) or after a retry (two), retrying, dead,
/// and unrouted when no pattern matches.
#[tokio::test]
async fn event_state_says_what_became_of_each_event_at_each_destination() {
    let db = TestDb::new().await;
    let tried: std::sync::Arc<std::sync::Mutex<HashMap<i64, u32>>> = Default::default();
    let handler = {
        let tried = tried.clone();
        pg_outbox_relay::handler_fn(move |e: Event| {
            let n = {
                let mut tried = tried.lock().unwrap();
                let n = tried.entry(e.id).or_default();
                *n += 1;
                *n
            };
            async move {
                match e.key.as_deref() {
                    Some("flaky") if n == 1 => Err(pg_outbox_relay::DeliveryError::transient("503 once")),
                    Some("stuck") if n > 1 => Err(pg_outbox_relay::DeliveryError::transient("503 again")),
                    Some("stuck") => Err(pg_outbox_relay::DeliveryError::transient("503")),
                    Some("bad") => Err(pg_outbox_relay::DeliveryError::permanent("400 refused")),
                    _ => Ok(()),
                }
            }
        })
    };
    let cfg = pg_outbox_relay::RelayConfig {
        backoff_base: Duration::from_millis(50),
        backoff_max: Duration::from_millis(50),
        ..config()
    };
    let relay = support::start_routes(&db.outbox, cfg, vec![Route::new("erp", "order.#", handler).unwrap()]);
    let ok = db.outbox.publish(&NewEvent::new("order.placed", json!(1)).key("ok")).await.unwrap();
    let flaky = db.outbox.publish(&NewEvent::new("order.placed", json!(2)).key("flaky")).await.unwrap();
    let bad = db.outbox.publish(&NewEvent::new("order.placed", json!(3)).key("bad")).await.unwrap();
    let lost = db.outbox.publish(&NewEvent::new("nobody.listens", json!(4))).await.unwrap();
    eventually("ok and flaky delivered, bad dead", || async {
        let states = state_of(&db, &[ok, flaky, bad]).await;
        states == [(ok, "delivered".to_string(), 1), (flaky, "delivered".to_string(), 2), (bad, "dead".to_string(), 1)]
    })
    .await;
    relay.stop().await;
    let client = db.client().await;
    let row = client
        .query_one(
            "select state, destination is null, delivered_at is null from outbox_relay.event_state where id = $1",
            &[&lost],
        )
        .await
        .unwrap();
    assert_eq!(
        (row.get::<_, String>(0), row.get::<_, bool>(1), row.get::<_, bool>(2)),
        ("unrouted".into(), true, true)
    );
    let delivered_at: SystemTime = client
        .query_one("select delivered_at from outbox_relay.event_state where id = $1", &[&ok])
        .await
        .unwrap()
        .get(0);
    let age = SystemTime::now().duration_since(delivered_at).unwrap_or_default();
    assert!(age < Duration::from_secs(60), "delivered {age:?} ago");
    let found = db.outbox.look_up(Some(bad), None, 5).await.unwrap();
    assert_eq!(found.len(), 1);
    assert_eq!((found[0].state, found[0].attempts), (EventState::Dead, 1));
    assert!(found[0].last_error.as_deref().is_some_and(|e| e.contains("400 refused")), "{found:?}");
}

/// Each event's state and attempts at its one destination, by id.
async fn state_of(db: &TestDb, ids: &[i64]) -> Vec<(i64, String, i32)> {
    db.client()
        .await
        .query("select id, state, attempts from outbox_relay.event_state where id = any($1) order by id", &[&ids])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect()
}

/// Removal takes row locks only: with `pg_dump`'s lock (ACCESS SHARE on the outbox, in a
/// repeatable-read snapshot) held the whole time, delivery goes on and the sweeper removes every
/// delivered event (retention 0); the dump's snapshot still reads the rows it saw.
#[tokio::test]
async fn removal_goes_on_while_pg_dump_holds_its_lock_and_snapshot() {
    let db = TestDb::new().await;
    publish_each(&db, "order.placed", 10, 5).await;
    let dump = db.client().await;
    support::hold_as_pg_dump(&dump).await;
    let (handler, mut deliveries) = recorder();
    let relay =
        support::start(&db.outbox, pg_outbox_relay::RelayConfig { retention: Duration::ZERO, ..config() }, handler);
    publish_each(&db, "order.placed", 200, 20).await;
    deliveries.take(210).await;
    eventually("every delivered event removed", || async {
        count(&db.client().await, "select count(*) from outbox_relay.outbox").await == 0
    })
    .await;
    assert_eq!(count(&dump, "select count(*) from outbox_relay.outbox").await, 10, "the dump reads what it saw");
    let lock_held = support::outbox_share_locks(&db.client().await).await;
    assert!(lock_held >= 1, "the dump's lock was held throughout");
    dump.batch_execute("commit").await.unwrap();
    relay.stop().await;
}

/// A cleanup's session terminated between (or in) its statements loses nothing: the events not
/// yet passed all stay, each passed one is either removed or still there, and the next cleanup
/// removes the rest, once.
#[tokio::test]
async fn a_cleanup_killed_in_the_middle_loses_nothing_and_the_next_one_finishes() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "insert into outbox_relay.outbox (topic, key, payload, created_at)
             select 'order.placed', 'k' || (g % 50), jsonb_build_object('n', g), now() - interval '2 days'
               from generate_series(1, 60000) g",
        )
        .await
        .unwrap();
    crate::factory::pass_everything(&client, Duration::ZERO).await;
    client
        .batch_execute(
            "insert into outbox_relay.outbox (topic, payload, created_at)
             select 'order.placed', jsonb_build_object('late', g), now() - interval '2 days' from generate_series(1, 100) g",
        )
        .await
        .unwrap();
    let passed = "select count(*) from outbox_relay.outbox where payload ? 'n'";
    // The cleanup on connections of its own, named so that the test can end their session.
    let separator = if db.url.contains('?') { '&' } else { '?' };
    let url = format!("{}{separator}application_name=cleanup_under_test", db.url);
    let outbox = pg_outbox_relay::Outbox::connect(&url).await.unwrap();
    let cleanup = tokio::spawn({
        let outbox = outbox.clone();
        async move { outbox.cleanup(Duration::ZERO, Duration::from_secs(3600), 20).await }
    });
    let killer = db.client().await;
    support::until("the cleanup's session terminated in the middle", || async {
        if cleanup.is_finished() {
            panic!("the cleanup ended before it was terminated");
        }
        if count(&killer, passed).await > 59_000 {
            return None;
        }
        let row = killer
            .query_one(
                "select count(pg_terminate_backend(pid)) from pg_stat_activity
                  where application_name = 'cleanup_under_test'",
                &[],
            )
            .await
            .unwrap();
        (row.get::<_, i64>(0) > 0).then_some(())
    })
    .await;
    let first = cleanup.await.unwrap();
    outbox.pool().close();
    let left = count(&client, passed).await;
    eprintln!("the first cleanup, terminated: {first:?}; {left} of 60,000 passed events left");
    assert!(first.is_err() && left > 0, "the cleanup was terminated in the middle: {first:?}, {left} left");
    assert_eq!(count(&client, "select count(*) from outbox_relay.outbox where payload ? 'late'").await, 100);
    let second = db.outbox.cleanup(Duration::ZERO, Duration::from_secs(3600), 1000).await.unwrap();
    assert_eq!(second.events as i64, left, "the second removes what the first left");
    assert_eq!(count(&client, passed).await, 0);
    assert_eq!(
        count(&client, "select count(*) from outbox_relay.outbox where payload ? 'late'").await,
        100,
        "never the events not passed"
    );
    assert_eq!(count(&client, "select count(*) from outbox_relay.dead_letters").await, 0);
}

/// An event no destination's pattern matches is judged when the destinations change, not only
/// when its retention ends: a destination added within the hour (whose start had passed the
/// event: it never had it) does not make it routed, and it goes to the dead letters of '' then.
#[tokio::test]
async fn an_unrouted_event_is_dead_lettered_before_a_destination_is_added() {
    let db = TestDb::new().await;
    let (orders, mut to_orders) = recorder();
    let relay = support::start_routes(&db.outbox, config(), vec![Route::new("orders", "order.*", orders).unwrap()]);
    let lost = db.outbox.publish(&NewEvent::new("mail.sent", json!({"n": 1}))).await.unwrap();
    db.outbox.publish(&NewEvent::new("order.placed", json!({"n": 2}))).await.unwrap();
    to_orders.next().await;
    until_every_destination_passed_everything(&db).await;
    relay.stop().await;
    let every = TopicPattern::parse("#").unwrap();
    db.outbox.add_destination("archive", &every, None).await.unwrap();
    let client = db.client().await;
    let dead = count(
        &client,
        &format!("select count(*) from outbox_relay.dead_letters where destination = '' and id = {lost}"),
    )
    .await;
    assert_eq!(dead, 1, "the unrouted event in the dead letters of ''");
    assert_eq!(count(&client, &format!("select count(*) from outbox_relay.outbox where id = {lost}")).await, 0);
    let expiry: bool = client
        .query_one("select expire_after is not null from outbox_relay.destinations where name = 'archive'", &[])
        .await
        .unwrap()
        .get(0);
    assert!(expiry, "a destination added by hand expires if no relay ever serves it");
}

/// The sweep (`src/sql/sweep.sql`, the relay's statement every second) reads no row the
/// retention keeps: its horizon bounds its index scan. It was a filter on a scan from the cursor
/// to the outbox's end, so that a sweep read every retained row, every second (117 ms with
/// 150,000 of them), whether no position was older than the retention yet (no horizon) or one
/// was (a horizon below the rows).
#[tokio::test]
async fn a_sweep_reads_no_row_the_retention_keeps() {
    const SWEEP: &str = include_str!("../../src/sql/sweep.sql");
    let db = TestDb::new().await;
    let (handler, mut deliveries) = recorder();
    let relay = support::start(&db.outbox, config(), handler);
    // (the destination's first position, taken before any event is written)
    eventually("the destination registered", || async {
        count(&db.client().await, "select count(*) from outbox_relay.positions").await > 0
    })
    .await;
    let events: Vec<NewEvent> = (0..300).map(|n| NewEvent::new("t", json!({ "n": n }))).collect();
    db.outbox.publish_all(&events).await.unwrap();
    deliveries.take(300).await;
    until_every_destination_passed_everything(&db).await;
    relay.stop().await;

    let mut client = db.client().await;
    // Rows of the outbox a sweep read, whatever the path (the relay's session settings).
    async fn sweep_reads(client: &mut tokio_postgres::Client, retention: Duration) -> (i64, i64) {
        let tx = client.transaction().await.unwrap();
        // (set in the transaction, which rolls back: the client's session keeps its own)
        tx.batch_execute(RELAY_PLANNER_SETTINGS).await.unwrap();
        // (rows fetched from the table's leaves, and entries read from their indexes)
        let read = "select coalesce(sum(coalesce(t.seq_tup_read, 0) + coalesce(t.idx_tup_fetch, 0)), 0)::int8
                           + (select coalesce(sum(pg_stat_get_xact_tuples_returned(i.indexrelid)), 0)::int8
                                from pg_index i join pg_inherits h on h.inhrelid = i.indrelid
                               where h.inhparent = 'outbox_relay.outbox'::regclass)
                      from pg_stat_xact_user_tables t join pg_inherits h on h.inhrelid = t.relid
                     where h.inhparent = 'outbox_relay.outbox'::regclass";
        let before: i64 = tx.query_one(read, &[]).await.unwrap().get(0);
        let retention = i64::try_from(retention.as_micros()).unwrap();
        let swept = tx.query_one(SWEEP, &[&"0", &1000_i64, &retention, &0_i64, &Vec::<String>::new()]).await.unwrap();
        let after: i64 = tx.query_one(read, &[]).await.unwrap().get(0);
        tx.rollback().await.unwrap();
        (after - before, swept.get("finished"))
    }
    let hour = Duration::from_secs(3600);
    assert_eq!(sweep_reads(&mut client, hour).await, (0, 0), "no position older than the retention: nothing read");
    client
        .batch_execute(
            "update outbox_relay.positions set at = at - interval '2 hours'
              where n = (select min(n) from outbox_relay.positions)",
        )
        .await
        .unwrap();
    assert_eq!(
        sweep_reads(&mut client, hour).await,
        (0, 0),
        "a horizon (the first position, older than the retention) below every row: nothing read"
    );
    let (read, finished) = sweep_reads(&mut client, Duration::ZERO).await;
    assert_eq!(finished, 300, "a retention of 0: every event passed is removed");
    assert!(read >= 300, "{read} rows read");
}
