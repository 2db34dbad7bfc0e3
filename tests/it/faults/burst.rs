//! A burst of notifications while every worker is busy.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;

use pg_outbox_relay::{DeliveryError, Event, Handler, RelayConfig};
use tokio::sync::Semaphore;
use tokio_postgres::Client;

use super::LONG_PATIENCE;
use crate::harness::TestDb;
use crate::relay_support::count;
use crate::relay_support::{self as support, PATIENCE, config, eventually, eventually_within, listener_ready};

/// A handler that holds every delivery until the gate opens: the workers are busy for as long as
/// the test wants. Counts the deliveries that entered it.
struct Gate(Arc<Semaphore>, Arc<AtomicUsize>);

impl Handler for Gate {
    async fn handle(&self, _event: &Event) -> Result<(), DeliveryError> {
        self.1.fetch_add(1, Ordering::SeqCst);
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
    let entered = Arc::new(AtomicUsize::new(0));
    let relay = support::start(&db.outbox, cfg, Gate(gate.clone(), entered.clone()));
    let fake = db.client().await;
    listener_ready(&fake).await;
    // A waiting relay (this connection stays open), so that every insert notifies.
    fake.batch_execute(
        "insert into outbox_relay.relays (id, listener_pid, waiting) values (424242, pg_backend_pid(), true)",
    )
    .await
    .unwrap();
    // Both events hang in the handler (taken by the workers' claims, or from their notifications
    // by the fast path, which then holds the claims of new events back until they are done).
    fake.batch_execute(
        "select outbox_relay.publish('fault.first', '{}'); select outbox_relay.publish('fault.second', '{}')",
    )
    .await
    .unwrap();
    eventually("both events in the handler", || {
        let n = entered.load(Ordering::SeqCst);
        async move { n >= 2 }
    })
    .await;

    let started = Instant::now();
    let woken_before = relay.snapshot().wakeups;
    let (ours, samples) = burst(&db, STATEMENTS).await;
    let burst_time = started.elapsed();
    eventually_within("the relay's listener read every notification", LONG_PATIENCE, || {
        let woken = relay.snapshot().wakeups - woken_before;
        async move { woken >= STATEMENTS as u64 }
    })
    .await;
    // Delivered: passed by the destination, with no copy waiting for it and no dead letter.
    let delivered = count(
        &fake,
        "select count(*) from outbox_relay.outbox o
          where outbox_relay.passed_by_all(o.xid, o.id)
            and not exists (select 1 from outbox_relay.parked p where p.id = o.id)
            and not exists (select 1 from outbox_relay.dead_letters d where d.id = o.id)",
    )
    .await;
    assert_eq!((delivered, relay.snapshot().delivered), (0, 0), "the workers were held the whole time");

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
