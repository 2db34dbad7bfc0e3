//! The relay: wake-ups, claims, outcomes, crashes and shutdown, against a real PostgreSQL.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use pg_outbox_relay::{DeliveryError, Event, NewEvent, RelayConfig, handler_fn};
use serde_json::json;

use crate::factory::{self, OutboxRow};
use crate::harness::TestDb;
use crate::relay_support::{
    self as support, Deliveries, config, count, eventually, listener_pid, listener_ready, recorder, relay_waiting,
};

async fn publish_sql(client: &tokio_postgres::Client, n: i32) -> i64 {
    client
        .query_one("select outbox_relay.publish('test.event', jsonb_build_object('n', $1::int))", &[&n])
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ten_thousand_events_two_relays_each_delivered_exactly_once() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "insert into outbox_relay.outbox (topic, payload) select 'bulk', jsonb_build_object('n', g) from generate_series(1, 10000) g",
        )
        .await
        .unwrap();
    let (handler, mut deliveries) = recorder();
    // The shipped hold; delivered rows removed by the sweepers as the relays go (a retention of 0).
    let cfg = RelayConfig { workers: 4, retention: Duration::ZERO, ..config() };
    assert_eq!(cfg.hold, RelayConfig::default().hold);
    let a = support::start(&db.outbox, cfg.clone(), handler.labelled("a"));
    let b = support::start(&db.outbox, cfg, handler.labelled("b"));
    let delivered = deliveries.take(10_000).await;

    let counts = deliveries.counts();
    assert_eq!(counts.len(), 10_000);
    assert!(counts.values().all(|n| *n == 1), "no event twice");
    assert!(deliveries.is_empty());
    eventually("every delivered row removed", || async {
        count(&client, "select count(*) from outbox_relay.outbox").await == 0
    })
    .await;
    a.stop().await;
    b.stop().await;
    let by_a = delivered.iter().filter(|d| d.by == "a").count();
    eprintln!("relay a delivered {by_a}, relay b {}", 10_000 - by_a);
}

#[tokio::test]
async fn notify_wakes_the_relay_without_polling() {
    let db = TestDb::new().await;
    let (handler, mut deliveries) = recorder();
    let relay = support::start(&db.outbox, config(), handler);
    let writer = db.client().await;
    // The poll interval is an hour: once the relay waits, each of these arrives through NOTIFY.
    for n in 0..3 {
        relay_waiting(&writer).await;
        let id = publish_sql(&writer, n).await;
        assert_eq!(deliveries.next().await.event.id, id);
    }
    assert!(relay.snapshot().wakeups >= 1, "{:?}", relay.snapshot());
    relay.stop().await;
}

#[tokio::test]
async fn a_writer_in_the_same_process_wakes_the_relay_directly() {
    let db = TestDb::new().await;
    // Without the trigger, no NOTIFY is sent: only the in-process wake can deliver.
    db.client().await.batch_execute("drop trigger outbox_notify_relay on outbox_relay.outbox").await.unwrap();
    let (handler, mut deliveries) = recorder();
    let relay = support::start(&db.outbox, config(), handler);
    listener_ready(&db.client().await).await;
    // Also while the fast path is armed (it expects the commit's notification, which never comes).
    eventually("the fast path is armed", || async { relay.snapshot().fast_path_armed }).await;
    for n in 0..3 {
        let id = db.outbox.publish(&NewEvent::new("inproc", json!({"n": n}))).await.unwrap();
        assert_eq!(deliveries.next().await.event.id, id);
    }
    // and through execute()
    let executed = db
        .outbox
        .execute("key-1", &json!({}), async |work| work.publish(&NewEvent::new("inproc", json!({}))).await)
        .await
        .unwrap();
    assert_eq!(deliveries.next().await.event.id, executed.response);
    relay.stop().await;
}

#[tokio::test]
async fn after_the_listener_is_killed_it_catches_up_and_listens_again() {
    let db = TestDb::new().await;
    let (handler, mut deliveries) = recorder();
    let relay =
        support::start(&db.outbox, RelayConfig { reconnect_max: Duration::from_millis(200), ..config() }, handler);
    let admin = db.client().await;
    // Once the relay waits, its listener is fully set up (LISTEN done, pid known): kill that one.
    relay_waiting(&admin).await;
    let pid: i32 = admin.query_one("select listener_pid from outbox_relay.relays", &[]).await.unwrap().get(0);
    admin.execute("select pg_terminate_backend($1)", &[&pid]).await.unwrap();
    // Committed while the listener is down: their notifications reach nobody.
    let during: Vec<i64> = {
        let mut ids = Vec::new();
        for n in 0..5 {
            ids.push(publish_sql(&admin, n).await);
        }
        ids
    };
    let mut got: Vec<i64> = deliveries.take(5).await.iter().map(|d| d.event.id).collect();
    got.sort_unstable();
    assert_eq!(got, during);
    eventually("a new listener", || async { listener_pid(&admin).await.is_some_and(|p| p != pid) }).await;
    eventually("the reconnect counted", || async { relay.snapshot().reconnects >= 1 }).await;
    // and NOTIFY works again on the new connection, once the relay waits again
    relay_waiting(&admin).await;
    let id = publish_sql(&admin, 99).await;
    // (with the poll at an hour, only NOTIFY or the waiting mark's own catch-up claim can deliver it)
    assert_eq!(deliveries.next().await.event.id, id);
    relay.stop().await;
}

#[tokio::test]
async fn a_transient_failure_is_recorded_and_rescheduled_within_the_backoff_bounds() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let (failed_tx, mut failed) = tokio::sync::mpsc::unbounded_channel::<()>();
    let failing = handler_fn(move |_event: Event| {
        let failed_tx = failed_tx.clone();
        async move {
            failed_tx.send(()).ok();
            Err(DeliveryError::transient("the ERP is down"))
        }
    });
    let hour = Duration::from_secs(3600);
    let cfg = RelayConfig { backoff_base: hour, backoff_max: 2 * hour, backoff_jitter: 0.5, ..config() };
    let relay = support::start(&db.outbox, cfg, failing);
    let id = db.outbox.publish(&NewEvent::new("t", json!({}))).await.unwrap();
    failed.recv().await.unwrap();
    eventually("the failure to be recorded", || async {
        count(&client, "select count(*) from outbox_relay.parked where last_error is not null").await == 1
    })
    .await;
    relay.stop().await;
    let row = client
        .query_one(
            "select attempts, last_error, lease_token is null,
                    available_at - now() between interval '29 minutes' and interval '60 minutes'
               from outbox_relay.parked where destination = 'default' and id = $1",
            &[&id],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, i32>(0), 1);
    assert_eq!(row.get::<_, String>(1), "the ERP is down");
    assert!(row.get::<_, bool>(2));
    assert!(row.get::<_, bool>(3), "first retry between base * (1 - jitter) and base from now");
}

#[tokio::test]
async fn a_failing_sink_is_retried_until_it_recovers() {
    let db = TestDb::new().await;
    let (handler, mut deliveries) = recorder();
    let calls = Arc::new(AtomicUsize::new(0));
    let flaky = {
        let calls = calls.clone();
        handler_fn(move |event: Event| {
            let handler = handler.clone();
            let calls = calls.clone();
            async move {
                if calls.fetch_add(1, Ordering::SeqCst) < 2 {
                    return Err(DeliveryError::transient("503 from the sink"));
                }
                pg_outbox_relay::Handler::handle(&handler, &event).await
            }
        })
    };
    let relay = support::start(&db.outbox, config(), flaky);
    let id = db.outbox.publish(&NewEvent::new("t", json!({}))).await.unwrap();
    let delivered = deliveries.next().await.event;
    assert_eq!(delivered.id, id);
    assert_eq!(delivered.attempts, 3);
    assert_eq!(relay.snapshot().retried, 2);
    relay.stop().await;
    let row = db
        .client()
        .await
        .query_one(
            "select (select outbox_relay.passed_by_all(xid, id) from outbox_relay.outbox where id = $1),
                    (select count(*) from outbox_relay.parked where id = $1),
                    (select count(*) from outbox_relay.dead_letters where id = $1)",
            &[&id],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, Option<bool>>(0), Some(true), "the outbox row passed");
    assert_eq!((row.get::<_, i64>(1), row.get::<_, i64>(2)), (0, 0), "its retry copy gone once delivered, none buried");
}

#[tokio::test]
async fn permanent_failures_and_exhausted_attempts_go_to_the_dead_letters_and_can_be_retried() {
    let db = TestDb::new().await;
    let healthy = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (handler, mut deliveries) = recorder();
    let sink = {
        let healthy = healthy.clone();
        handler_fn(move |event: Event| {
            let handler = handler.clone();
            let healthy = healthy.clone();
            async move {
                if healthy.load(Ordering::SeqCst) {
                    return pg_outbox_relay::Handler::handle(&handler, &event).await;
                }
                match event.topic.as_str() {
                    "bad" => Err(DeliveryError::permanent("400: malformed order")),
                    _ => Err(DeliveryError::transient("timeout")),
                }
            }
        })
    };
    let relay = support::start(&db.outbox, RelayConfig { max_attempts: 3, ..config() }, sink);
    let bad = db.outbox.publish(&NewEvent::new("bad", json!({"x": 1}))).await.unwrap();
    let slow = db.outbox.publish(&NewEvent::new("slow", json!({"y": 2}))).await.unwrap();
    eventually("both events dead-lettered", || async { db.outbox.queue_stats().await.unwrap().dead_letters == 2 })
        .await;

    let dead = db.outbox.dead_letters(100).await.unwrap();
    assert_eq!(dead.iter().map(|d| d.id).collect::<Vec<_>>(), vec![bad, slow]);
    assert_eq!((dead[0].attempts, dead[0].last_error.as_str()), (1, "400: malformed order"));
    assert_eq!(dead[1].attempts, 3);
    assert_eq!(dead[1].last_error, "gave up after 3 attempts: timeout");
    assert_eq!(dead[0].payload.get(), r#"{"x": 1}"#);
    assert_eq!(relay.snapshot().dead_lettered, 2);
    let stats = db.outbox.queue_stats().await.unwrap();
    assert_eq!((stats.pending, stats.delayed, stats.in_flight), (0, 0, 0));

    healthy.store(true, Ordering::SeqCst);
    assert_eq!(db.outbox.retry_dead_letters(&[slow]).await.unwrap(), vec![slow]);
    let again = deliveries.next().await.event;
    assert_eq!((again.id, again.attempts, again.topic.as_str()), (slow, 1, "slow"), "same id, attempts reset");
    assert_eq!(db.outbox.retry_all_dead_letters().await.unwrap(), vec![bad]);
    assert_eq!(deliveries.next().await.event.id, bad);
    assert!(db.outbox.dead_letters(100).await.unwrap().is_empty());
    relay.stop().await;
}

#[tokio::test]
async fn purge_removes_dead_letters_by_age() {
    let db = TestDb::new().await;
    db.client()
        .await
        .batch_execute(
            "insert into outbox_relay.dead_letters (destination, id, topic, payload, created_at, attempts, last_error, failed_at)
             values ('default', 1, 'a', '{}', now(), 3, 'x', now() - interval '2 days'),
                    ('default', 2, 'b', '{}', now(), 3, 'x', now())",
        )
        .await
        .unwrap();
    assert_eq!(db.outbox.purge_dead_letters(Duration::from_secs(86400)).await.unwrap(), 1);
    assert_eq!(db.outbox.dead_letters(10).await.unwrap().iter().map(|d| d.id).collect::<Vec<_>>(), vec![2]);
    assert_eq!(db.outbox.purge_dead_letters(Duration::ZERO).await.unwrap(), 1);
}

#[tokio::test]
async fn a_panicking_handler_is_a_failure_not_a_dead_relay() {
    let db = TestDb::new().await;
    let (handler, mut deliveries) = recorder();
    let sink = handler_fn(move |event: Event| {
        let handler = handler.clone();
        async move {
            if event.topic == "boom" && event.attempts == 1 {
                panic!("handler bug");
            }
            pg_outbox_relay::Handler::handle(&handler, &event).await
        }
    });
    let relay = support::start(&db.outbox, RelayConfig { workers: 1, ..config() }, sink);
    let boom = db.outbox.publish(&NewEvent::new("boom", json!({}))).await.unwrap();
    let fine = db.outbox.publish(&NewEvent::new("fine", json!({}))).await.unwrap();
    let mut got: Vec<(i64, i32)> = deliveries.take(2).await.iter().map(|d| (d.event.id, d.event.attempts)).collect();
    got.sort_unstable();
    assert_eq!(got, vec![(boom, 2), (fine, 1)]);
    assert_eq!(relay.snapshot().retried, 1);
    relay.stop().await;
}

#[tokio::test]
async fn a_delayed_event_is_not_delivered_early_and_is_delivered_after() {
    let db = TestDb::new().await;
    let (handler, mut deliveries) = recorder();
    let relay = support::start(&db.outbox, config(), handler);
    let delay = Duration::from_millis(700);
    let id = db.outbox.publish(&NewEvent::new("later", json!({})).delay(delay)).await.unwrap();
    let delivered = deliveries.next().await;
    assert_eq!(delivered.event.id, id);
    let available_at: std::time::SystemTime = db
        .client()
        .await
        .query_one("select created_at + interval '700 milliseconds' from outbox_relay.outbox where id = $1", &[&id])
        .await
        .unwrap()
        .get(0);
    assert!(delivered.at >= available_at, "delivered at {:?}, before {:?}", delivered.at, available_at);
    relay.stop().await;
}

#[tokio::test]
async fn graceful_shutdown_finishes_in_flight_work_and_leaves_no_lease() {
    let db = TestDb::new().await;
    let (handler, mut deliveries) = recorder();
    let (started_tx, mut started) = tokio::sync::mpsc::unbounded_channel::<()>();
    let slow = handler_fn(move |event: Event| {
        let handler = handler.clone();
        let started_tx = started_tx.clone();
        async move {
            started_tx.send(()).ok();
            tokio::time::sleep(Duration::from_millis(50)).await;
            pg_outbox_relay::Handler::handle(&handler, &event).await
        }
    });
    let relay = support::start(&db.outbox, RelayConfig { workers: 1, batch_size: 10, ..config() }, slow);
    db.outbox.publish_all(&(0..5).map(|n| NewEvent::new("t", json!(n))).collect::<Vec<_>>()).await.unwrap();
    started.recv().await.unwrap();
    relay.stop().await;
    assert_eq!(deliveries.take(5).await.len(), 5, "the claimed batch was finished");
    let client = db.client().await;
    assert_eq!(count(&client, "select count(*) from outbox_relay.parked").await, 0, "no lease, nothing waits");
    assert_eq!(
        count(&client, "select count(*) from outbox_relay.outbox where not outbox_relay.passed_by_all(xid, id)").await,
        0
    );
    assert_eq!(count(&client, "select count(*) from outbox_relay.dead_letters").await, 0);
}

#[tokio::test]
async fn deliveries_past_the_grace_period_are_cut_off_and_their_events_released() {
    let db = TestDb::new().await;
    let (started_tx, mut started) = tokio::sync::mpsc::unbounded_channel::<()>();
    let stuck = handler_fn(move |_event: Event| {
        let started_tx = started_tx.clone();
        async move {
            started_tx.send(()).ok();
            futures::future::pending::<()>().await;
            Ok(())
        }
    });
    let cfg = RelayConfig { workers: 1, shutdown_grace: Duration::from_millis(100), ..config() };
    let relay = support::start(&db.outbox, cfg, stuck);
    db.outbox.publish_all(&(0..3).map(|n| NewEvent::new("t", json!(n))).collect::<Vec<_>>()).await.unwrap();
    started.recv().await.unwrap();
    relay.stop().await;
    let client = db.client().await;
    let row = client
        .query_one(
            "select count(*) filter (where lease_token is null and available_at <= now() and attempts = 0), count(*)
               from outbox_relay.parked where destination = 'default'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!((row.get::<_, i64>(0), row.get::<_, i64>(1)), (3, 3), "all released, claimable at once");
}

#[tokio::test]
async fn a_zero_retention_removes_delivered_rows_in_bulk() {
    let db = TestDb::new().await;
    let (handler, mut deliveries) = recorder();
    let relay = support::start(&db.outbox, RelayConfig { retention: Duration::ZERO, ..config() }, handler);
    db.outbox.publish_all(&(0..10).map(|n| NewEvent::new("t", json!(n))).collect::<Vec<_>>()).await.unwrap();
    deliveries.take(10).await;
    let client = db.client().await;
    eventually("the sweeper removed the delivered rows", || async {
        count(&client, "select count(*) from outbox_relay.outbox").await == 0
    })
    .await;
    relay.stop().await;
}

/// Delivery writes nothing to an outbox row (migration 0019): every delivered row is as its
/// insert left it (`xmax` 0: no update, delete or row lock ever touched it), and kept for the
/// retention, passed by every destination.
#[tokio::test]
async fn delivery_writes_no_outbox_row() {
    let db = TestDb::new().await;
    let (handler, mut deliveries) = recorder();
    let relay = support::start(&db.outbox, config(), handler);
    let mut events: Vec<NewEvent> = (0..300).map(|n| NewEvent::new("order.placed", json!(n))).collect();
    events.extend((0..200).map(|n| NewEvent::new("order.placed", json!(n)).key(format!("k{}", n % 7))));
    db.outbox.publish_all(&events).await.unwrap();
    for n in 0..20 {
        db.outbox.publish(&NewEvent::new("order.updated", json!(n)).key("one")).await.unwrap();
    }
    deliveries.take(520).await;
    relay.stop().await;
    let client = db.client().await;
    assert_eq!(
        count(&client, "select count(*) from outbox_relay.outbox where outbox_relay.passed_by_all(xid, id)").await,
        520
    );
    assert_eq!(count(&client, "select count(*) from outbox_relay.outbox where xmax <> '0'::xid").await, 0);
}

#[tokio::test]
async fn a_cleanup_removes_passed_events_past_the_retention_and_receipts_in_batches() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let day = Duration::from_secs(86400);
    OutboxRow::new("old").created_ago(8 * day).insert_many(&client, 25).await;
    factory::pass_everything(&client, 8 * day).await;
    OutboxRow::new("recent").created_ago(8 * day).insert(&client).await;
    factory::pass_everything(&client, Duration::ZERO).await;
    OutboxRow::new("pending").created_ago(30 * day).insert(&client).await;
    client
        .batch_execute(
            "insert into outbox_relay.idempotency (key, fingerprint, response, created_at)
                 select 'k' || g, '\\x00', '{}', now() - interval '8 days' from generate_series(1, 7) g;
             insert into outbox_relay.idempotency (key, fingerprint, response) values ('fresh', '\\x00', '{}');",
        )
        .await
        .unwrap();
    let report = db.outbox.cleanup(7 * day, 7 * day, 10).await.unwrap();
    assert_eq!((report.events, report.receipts), (25, 7));
    let left: Vec<String> = client
        .query("select topic from outbox_relay.outbox order by topic", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        left,
        vec!["pending", "recent"],
        "events not passed are never removed, and passed ones only once passed for the retention"
    );
    assert_eq!(count(&client, "select count(*) from outbox_relay.idempotency").await, 1);
}

#[tokio::test]
async fn metrics_count_deliveries_and_latency() {
    let db = TestDb::new().await;
    let (handler, mut deliveries) = recorder();
    let relay = support::start(&db.outbox, config(), handler);
    db.outbox.publish_all(&(0..20).map(|n| NewEvent::new("t", json!(n))).collect::<Vec<_>>()).await.unwrap();
    deliveries.take(20).await;
    eventually("metrics", || async { relay.snapshot().delivered == 20 }).await;
    let m = relay.snapshot();
    assert!(m.latency_p50.is_some() && m.latency_p99 >= m.latency_p50, "{m:?}");
    relay.stop().await;
}

#[tokio::test]
async fn an_invalid_config_is_refused_naming_the_field() {
    let db = TestDb::new().await;
    let (handler, _deliveries): (_, Deliveries) = recorder();
    let err = pg_outbox_relay::Relay::new(&db.outbox, RelayConfig { workers: 0, ..config() }, handler).err().unwrap();
    assert!(err.to_string().contains("workers is 0"), "{err}");
}

/// Writers notify only a waiting relay, and the relay closes the race between its mark and
/// writers that checked just before: with the fallback poll at an hour, an event that slipped
/// through would never arrive. Two writers insert with random gaps around the linger time, so
/// the relay goes back and forth between lingering and waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_event_waits_for_the_fallback_poll_as_the_relay_goes_idle_and_back() {
    let db = TestDb::new().await;
    let (handler, mut deliveries) = recorder();
    let cfg = RelayConfig { linger: Duration::from_millis(5), ..config() };
    let relay = support::start(&db.outbox, cfg, handler);
    listener_ready(&db.client().await).await;
    let writers: Vec<_> = (0..2)
        .map(|w| {
            let url = db.url.clone();
            tokio::spawn(async move {
                let config: tokio_postgres::Config = url.parse().unwrap();
                let (client, connection) = config.connect(tokio_postgres::NoTls).await.unwrap();
                tokio::spawn(connection);
                let mut ids = Vec::new();
                for n in 0..60 {
                    let gap = rand::random::<u64>() % 12;
                    tokio::time::sleep(Duration::from_millis(gap)).await;
                    ids.push(publish_sql(&client, w * 1000 + n).await);
                }
                ids
            })
        })
        .collect();
    let mut written: Vec<i64> = Vec::new();
    for w in writers {
        written.extend(w.await.unwrap());
    }
    let mut got: Vec<i64> = deliveries.take(written.len()).await.iter().map(|d| d.event.id).collect();
    got.sort_unstable();
    written.sort_unstable();
    assert_eq!(got, written);
    relay.stop().await;
}

/// At a trickle the relay stays marked waiting while it works: every insert notifies it (which
/// costs nothing measurable at that rate), and it claims only when notified, never lingering:
/// a couple of claims per event, not one every millisecond.
#[tokio::test]
async fn at_a_trickle_the_relay_claims_only_when_notified() {
    let db = TestDb::new().await;
    let (handler, mut deliveries) = recorder();
    let relay = support::start(&db.outbox, config(), handler);
    let writer = db.client().await;
    relay_waiting(&writer).await;
    let (listener, mut notifications) = support::listen(&db).await;
    let claims_before = relay.snapshot().claims;
    let events = 20;
    for n in 0..events {
        let id = publish_sql(&writer, n).await;
        assert_eq!(deliveries.next().await.event.id, id);
        // 20 events a second
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let claims = relay.snapshot().claims - claims_before;
    listener.batch_execute("select 1").await.unwrap();
    let mut sent = 0;
    while notifications.try_recv().is_ok() {
        sent += 1;
    }
    relay.stop().await;
    assert_eq!(sent, events, "every insert notified the relay, which stayed marked waiting");
    assert!(claims <= 3 * events as u64, "{claims} claims for {events} events: the relay lingered");
}

/// How often each of the parked events' indexes was scanned, by name, once the relay's sessions
/// have ended (a session's statistics are flushed when it ends).
async fn parked_index_scans(client: &tokio_postgres::Client) -> std::collections::HashMap<String, i64> {
    eventually("the relay's sessions ended, their statistics flushed", || async {
        count(
            client,
            "select count(*) from pg_stat_activity
              where datname = current_database() and application_name like 'outbox-relay %'",
        )
        .await
            == 0
    })
    .await;
    client.batch_execute("select pg_stat_clear_snapshot()").await.unwrap();
    client
        .query(
            "select indexrelname::text, idx_scan from pg_stat_user_indexes
              where schemaname = 'outbox_relay' and relname = 'parked'",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

/// An idle destination's polls look for parked events with one index probe of `parked`:
/// the claim of parked events, planned anew at each run (about 2.5 ms of the server's time, once
/// a poll for every destination), runs only once the destination has one. That claim, and no
/// other statement, reads the events without a key through `parked_unkeyed_idx`: with nothing
/// parked, no poll reads it; with an event parked (due in an hour), the polls do.
#[tokio::test]
async fn an_idle_destinations_polls_run_no_claim_of_parked_events() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let (handler, _deliveries) = recorder();
    let polling = RelayConfig { poll_interval: Duration::from_millis(50), ..config() };
    let relay = support::start(&db.outbox, polling.clone(), handler.clone());
    relay_waiting(&client).await;
    // Some 30 polls.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    relay.stop().await;
    eventually("the polls' looks for parked events counted", || async {
        let scans = parked_index_scans(&client).await;
        scans["parked_pkey"] + scans["parked_due_idx"] >= 10
    })
    .await;
    let idle = parked_index_scans(&client).await;
    assert_eq!(idle["parked_unkeyed_idx"], 0, "no claim of parked events ran: {idle:?}");

    client
        .batch_execute(
            "insert into outbox_relay.parked (destination, id, uuid, topic, key, payload, created_at, available_at)
             values ('default', 1, gen_random_uuid(), 'order.placed', 'k', '{}', now(), now() + interval '1 hour')",
        )
        .await
        .unwrap();
    let relay = support::start(&db.outbox, polling, handler);
    relay_waiting(&client).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    relay.stop().await;
    eventually("with an event parked, the polls ran the claim", || async {
        parked_index_scans(&client).await["parked_unkeyed_idx"] > 0
    })
    .await;
    assert_eq!(count(&client, "select count(*) from outbox_relay.parked").await, 1, "not due: still parked");
}

/// Under sustained load the relay never marks itself waiting, so writers do not notify.
///
/// The writers commit twenty events at a time with short pauses between, so that the relay
/// runs out of work again and again while the rate stays well above the one from which it
/// lingers: a relay that marked itself waiting whenever it ran out would be notified by most
/// commits (`linger: 0` got 120 to 133 of 200 notified here), one that lingers by the few that
/// follow a stall of the whole machine long enough to look like a quiet spell.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn under_sustained_load_writers_do_not_notify() {
    let db = TestDb::new().await;
    let (handler, mut deliveries) = recorder();
    // A long linger, so that scheduling noise on a busy machine cannot look like a quiet spell.
    let cfg = RelayConfig { linger: Duration::from_millis(500), ..config() };
    let relay = support::start(&db.outbox, cfg, handler);
    let writer = db.client().await;
    relay_waiting(&writer).await;

    let (listener, mut notifications) = support::listen(&db).await;

    // The first round brings the relay up to that rate (the commits before it got there notify,
    // more of them the busier the machine); in the second it is busy throughout. A transaction
    // notifies at most once, whatever it inserts.
    const PER_COMMIT: i32 = 20;
    let commits = 200;
    let mut clients = Vec::new();
    for _ in 0..4 {
        clients.push(std::sync::Arc::new(db.client().await));
    }
    let mut notified = Vec::new();
    for round in 0..2 {
        let mut writers = tokio::task::JoinSet::new();
        for (w, client) in clients.iter().enumerate() {
            let (client, w) = (client.clone(), w as i32);
            writers.spawn(async move {
                for n in 0..commits / 4 {
                    let first = round * 100_000 + w * 10_000 + n * PER_COMMIT;
                    client
                        .execute(
                            "select outbox_relay.publish('test.event', jsonb_build_object('n', g)) \
                             from generate_series($1::int, $1::int + $2::int - 1) g",
                            &[&first, &PER_COMMIT],
                        )
                        .await
                        .unwrap();
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            });
        }
        writers.join_all().await;
        // Every notification of this round's commits has reached the listener by this round trip.
        listener.batch_execute("select 1").await.unwrap();
        // (A commit's statements each send one, with their events: counted once a transaction.)
        let mut sent = std::collections::HashSet::new();
        while let Ok((_, payload)) = notifications.try_recv() {
            // (the JSON after the signature's 64 hex digits)
            sent.insert(serde_json::from_str::<serde_json::Value>(&payload[64..]).unwrap()["x"].to_string());
        }
        notified.push(sent.len() as i32);
    }
    deliveries.take(2 * (commits * PER_COMMIT) as usize).await;
    assert!(
        notified[1] < commits / 5,
        "{} of {commits} commits notified while the relay was busy (and {} while it got busy); it should have been lingering, not waiting",
        notified[1],
        notified[0]
    );
    relay.stop().await;
}

/// A payload no double can hold (`1e999`, inserted by hand) is delivered as PostgreSQL stores
/// it, in order with the events around it; nothing is dead-lettered.
#[tokio::test]
async fn a_number_beyond_any_double_is_delivered_as_written() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let before = publish_sql(&client, 1).await;
    let huge: i64 = client
        .query_one(
            "insert into outbox_relay.outbox (topic, payload) values ('weird', '{\"amount\": 1e999}') returning id",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let after = publish_sql(&client, 2).await;
    let (handler, mut deliveries) = recorder();
    let relay = support::start(&db.outbox, RelayConfig { workers: 1, ..config() }, handler);
    let mut got: Vec<(i64, String)> =
        deliveries.take(3).await.iter().map(|d| (d.event.id, d.event.payload.get().to_string())).collect();
    got.sort_unstable();
    assert_eq!(got.iter().map(|(id, _)| *id).collect::<Vec<_>>(), vec![before, huge, after]);
    assert_eq!(got[1].1, format!(r#"{{"amount": 1{}}}"#, "0".repeat(999)));
    assert_eq!(db.outbox.queue_stats().await.unwrap().dead_letters, 0);
    relay.stop().await;
}

/// A transaction left open anywhere in the database (a long report, a forgotten `begin`) is one
/// the relay's race closure must wait for; meanwhile NOTIFY must keep waking the relay. With the
/// fallback poll at an hour, each event below arrives only if it does; the open transaction ends
/// only after all of them did.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_long_transaction_elsewhere_does_not_stop_notify_wakeups() {
    let db = TestDb::new().await;
    let mut long = db.client().await;
    let report = long.transaction().await.unwrap();
    report.batch_execute("select count(*) from pg_class").await.unwrap();
    let (handler, mut deliveries) = recorder();
    let relay = support::start(&db.outbox, RelayConfig { workers: 2, ..config() }, handler);
    let writer = db.client().await;
    for n in 0..5 {
        // the relay idle and waiting (while its race closure waits for the open transaction)
        support::relay_waiting(&writer).await;
        let id = publish_sql(&writer, n).await;
        assert_eq!(deliveries.next().await.event.id, id, "event {n}");
    }
    report.rollback().await.unwrap();
    relay.stop().await;
}
