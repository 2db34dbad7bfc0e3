//! Claims a relay died holding or outlived: a held claim given back at once, a lease that ends,
//! a delivery that outlives its lease, a key's event parked behind a leased batch, and a stale
//! worker that must not overwrite a newer claim.

use std::time::Duration;

use pg_outbox_relay::{Event, Handler, NewEvent, RelayConfig, handler_fn};
use serde_json::json;

use crate::harness::TestDb;
use crate::relay_support::{self as support, config, count, eventually, recorder};

/// A handler that never finishes, as if its process froze mid-batch; it says which events it
/// was given.
fn stuck_handler() -> (impl Handler, tokio::sync::mpsc::UnboundedReceiver<i64>) {
    let (started_tx, started) = tokio::sync::mpsc::unbounded_channel::<i64>();
    let stuck = handler_fn(move |event: Event| {
        let started_tx = started_tx.clone();
        async move {
            started_tx.send(event.id).ok();
            futures::future::pending::<()>().await;
            Ok(())
        }
    });
    (stuck, started)
}

/// A handler that says which event it was handed and succeeds once `true` is sent on the
/// watch channel (for every event after that at once).
fn gated_handler() -> (impl Handler + Clone, tokio::sync::mpsc::UnboundedReceiver<i64>, tokio::sync::watch::Sender<bool>)
{
    let (started_tx, started) = tokio::sync::mpsc::unbounded_channel::<i64>();
    let (go_tx, go_rx) = tokio::sync::watch::channel(false);
    let gated = handler_fn(move |event: Event| {
        let started_tx = started_tx.clone();
        let mut go = go_rx.clone();
        async move {
            started_tx.send(event.id).ok();
            go.wait_for(|go| *go).await.ok();
            Ok(())
        }
    });
    (gated, started, go_tx)
}

/// A second relay (polling every 100 ms) delivers the events `ids` a dead one left, each once;
/// returns them in id order, once nothing is left pending: no outbox row that a destination has
/// not passed, nothing waiting for the destination, nothing dead-lettered.
async fn rescue(db: &TestDb, ids: &[i64]) -> Vec<Event> {
    let (handler, mut deliveries) = recorder();
    let rescuer =
        support::start(&db.outbox, RelayConfig { poll_interval: Duration::from_millis(100), ..config() }, handler);
    let mut got: Vec<Event> = deliveries.take(ids.len()).await.into_iter().map(|d| d.event).collect();
    got.sort_by_key(|e| e.id);
    assert_eq!(got.iter().map(|e| e.id).collect::<Vec<_>>(), ids);
    rescuer.stop().await;
    let client = db.client().await;
    let pending = "select count(*) from outbox_relay.outbox where not outbox_relay.passed_by_all(xid, id)";
    assert_eq!(count(&client, pending).await, 0);
    assert_eq!(count(&client, "select count(*) from outbox_relay.parked").await, 0, "nothing waits any more");
    assert_eq!(count(&client, "select count(*) from outbox_relay.dead_letters").await, 0);
    got
}

/// A relay that dies while its claim is held (within `hold`): its session ends, the server rolls
/// the claim back, and the events are claimable at once, long before any lease would end. The
/// attempt left no trace, so it is not counted.
#[tokio::test]
async fn events_of_a_relay_that_died_holding_its_claim_come_back_at_once() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let (stuck, mut started) = stuck_handler();
    let crashing = RelayConfig {
        workers: 1,
        batch_size: 10,
        lease: Duration::from_secs(3600),
        hold: Duration::from_secs(60),
        ..config()
    };
    let crashed = support::start(&db.outbox, crashing, stuck);
    let ids: Vec<i64> =
        db.outbox.publish_all(&(0..5).map(|n| NewEvent::new("t", json!(n))).collect::<Vec<_>>()).await.unwrap();
    started.recv().await.unwrap();
    let open =
        "select count(*) from pg_stat_activity where datname = current_database() and state = 'idle in transaction'";
    // (a next claim of the worker can be seen open for a moment too, before it finds nothing)
    eventually("the claim holds its transaction open", || async { count(&client, open).await == 1 }).await;
    assert_eq!(count(&client, "select count(*) from outbox_relay.parked").await, 0, "a held claim writes no lease");
    crashed.crash().await;

    // (a lease of an hour: only the end of the dead relay's session can have freed them)
    let got = rescue(&db, &ids).await;
    assert!(got.iter().all(|e| e.attempts == 1), "a held claim that died is no attempt: {got:?}");
}

/// A delivery that outlives `hold` has its claim turned into a lease (the rows carry the token,
/// the attempt is counted, no transaction stays open); when that relay dies, the events come
/// back once the lease ends.
#[tokio::test]
async fn events_of_a_crashed_relay_come_back_when_their_lease_ends() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let (stuck, mut started) = stuck_handler();
    let lease = Duration::from_millis(500);
    let crashing = RelayConfig { workers: 1, batch_size: 10, lease, hold: Duration::from_millis(100), ..config() };
    let crashed = support::start(&db.outbox, crashing, stuck);
    let ids: Vec<i64> =
        db.outbox.publish_all(&(0..5).map(|n| NewEvent::new("t", json!(n))).collect::<Vec<_>>()).await.unwrap();
    started.recv().await.unwrap();
    eventually("the held claim turned into a lease", || async {
        count(
            &client,
            "select count(*) from outbox_relay.parked
              where destination = 'default' and lease_token is not null and attempts = 1",
        )
        .await
            == 5
    })
    .await;
    crashed.crash().await;

    let got = rescue(&db, &ids).await;
    assert!(got.iter().all(|e| e.attempts == 2), "the leased claim counts as an attempt: {got:?}");
}

/// A delivery that outlives its lease is not cut off and not given back while it runs: the
/// lease is renewed, so that a second relay polling all along takes none of its events, and
/// once the receiver answers each event is recorded delivered after its one attempt.
#[tokio::test]
async fn a_delivery_that_outlives_its_lease_keeps_its_events_until_it_ends() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let (slow, mut started, go_tx) = gated_handler();
    // Every event in flight at once from the start (an adaptive limit starts at four).
    let cfg = RelayConfig {
        batch_size: 10,
        fixed_concurrency: true,
        lease: Duration::from_millis(300),
        hold: Duration::from_millis(50),
        poll_interval: Duration::from_millis(50),
        ..config()
    };
    let relays = [support::start(&db.outbox, cfg.clone(), slow.clone()), support::start(&db.outbox, cfg, slow)];
    let ids: Vec<i64> =
        db.outbox.publish_all(&(0..5).map(|n| NewEvent::new("t", json!(n))).collect::<Vec<_>>()).await.unwrap();
    let mut seen = Vec::new();
    while seen.len() < ids.len() {
        seen.push(started.recv().await.unwrap());
    }
    // The lease's end moves on, past several leases' length.
    let lease_end = "select extract(epoch from max(available_at))::float8 from outbox_relay.parked
                      where destination = 'default' and lease_token is not null";
    eventually("the claim leased", || async {
        client.query_one(lease_end, &[]).await.unwrap().get::<_, Option<f64>>(0).is_some()
    })
    .await;
    let first: f64 = client.query_one(lease_end, &[]).await.unwrap().get(0);
    eventually("the lease renewed for more than two leases' length", || async {
        client.query_one(lease_end, &[]).await.unwrap().get::<_, f64>(0) - first > 0.6
    })
    .await;
    assert!(started.try_recv().is_err(), "an event was handed over again while its delivery went on");
    let leased = "select count(*) from outbox_relay.parked
                   where destination = 'default' and lease_token is not null and attempts = 1 and last_error is null";
    assert_eq!(count(&client, leased).await, 5, "every event leased, its one attempt counted, no failure");
    go_tx.send(true).unwrap();
    // Recorded delivered: the leased copies are gone from the destination's parked events.
    eventually("every event recorded", || async {
        count(&client, "select count(*) from outbox_relay.parked").await == 0
            && relays.iter().map(|r| r.snapshot().delivered).sum::<u64>() >= 5
    })
    .await;
    let snapshots: Vec<_> = relays.iter().map(|r| r.snapshot()).collect();
    for relay in relays {
        relay.stop().await;
    }
    assert!(started.try_recv().is_err(), "an event was handed over twice");
    let delivered: u64 = snapshots.iter().map(|m| m.delivered).sum();
    let retried: u64 = snapshots.iter().map(|m| m.retried).sum();
    let dead: u64 = snapshots.iter().map(|m| m.dead_lettered).sum();
    assert_eq!((delivered, retried, dead), (5, 0, 0), "one attempt each, no failure recorded");
    assert_eq!(count(&client, "select count(*) from outbox_relay.dead_letters").await, 0);
    assert_eq!(
        count(&client, "select count(*) from outbox_relay.outbox where outbox_relay.passed_by_all(xid, id)").await,
        5,
        "every outbox row passed"
    );
}

/// A batch leased while its delivery goes on parks its events; a later event of its key,
/// claimed meanwhile, is parked behind it, and follows as soon as the batch is done (the poll is
/// an hour and the lease two minutes: only the relay's own word can bring it).
#[tokio::test]
async fn an_event_parked_behind_a_leased_batch_follows_it_at_once() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let (go_tx, go_rx) = tokio::sync::watch::channel(false);
    let (handler, mut deliveries) = recorder();
    let gated = handler_fn(move |event: Event| {
        let handler = handler.clone();
        let mut go = go_rx.clone();
        async move {
            if event.payload.get() == r#"{"n": 0}"# {
                go.wait_for(|go| *go).await.ok();
            }
            handler.handle(&event).await
        }
    });
    let cfg = RelayConfig { hold: Duration::from_millis(50), lease: Duration::from_secs(120), ..config() };
    let relay = support::start(&db.outbox, cfg, gated);
    let first = db.outbox.publish(&NewEvent::new("t", json!({"n": 0})).key("k")).await.unwrap();
    eventually("the first event's claim leased", || async {
        count(
            &client,
            "select count(*) from outbox_relay.parked where destination = 'default' and lease_token is not null",
        )
        .await
            == 1
    })
    .await;
    let second = db.outbox.publish(&NewEvent::new("t", json!({"n": 1})).key("k")).await.unwrap();
    eventually("the second event parked behind it", || async {
        count(&client, "select count(*) from outbox_relay.parked where destination = 'default' and lease_token is null")
            .await
            == 1
    })
    .await;
    go_tx.send(true).unwrap();
    let got: Vec<i64> = deliveries.take(2).await.into_iter().map(|d| d.event.id).collect();
    assert_eq!(got, [first, second]);
    relay.stop().await;
}

#[tokio::test]
async fn a_stale_worker_does_not_overwrite_a_newer_claim() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let (handler, mut started, go_tx) = gated_handler();
    // Leased at once (a held claim's new events are locked: no other claim can take them).
    let relay = support::start(&db.outbox, RelayConfig { workers: 1, hold: Duration::ZERO, ..config() }, handler);
    let id = db.outbox.publish(&NewEvent::new("t", json!({}))).await.unwrap();
    assert_eq!(started.recv().await.unwrap(), id);
    // Meanwhile another worker claimed the event (its lease had ended): a new token.
    let taken = client
        .execute(
            "update outbox_relay.parked set lease_token = 42, attempts = 2 where destination = 'default' and id = $1",
            &[&id],
        )
        .await
        .unwrap();
    assert_eq!(taken, 1, "the leased copy of the event");
    go_tx.send(true).unwrap();
    relay.stop().await;
    // The newer claim's copy is left as it was: not recorded delivered (deleted), not rescheduled.
    let row = client
        .query_one(
            "select count(*), max(lease_token), max(attempts) from outbox_relay.parked
              where destination = 'default' and id = $1",
            &[&id],
        )
        .await
        .unwrap();
    assert_eq!(
        (row.get::<_, i64>(0), row.get::<_, Option<i64>>(1), row.get::<_, Option<i32>>(2)),
        (1, Some(42), Some(2))
    );
}
