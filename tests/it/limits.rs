//! The adaptive concurrency limit against real HTTP receivers: one that serves a request at a
//! time behind a listen backlog of five, one that takes everything at once, and the bench's receiver
//! that answers 429 past a rate (issue 21).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::http::HeaderMap;
use axum::routing::post;
use pg_outbox_relay::RelayConfig;
use pg_outbox_relay::sink::HttpSink;
use pg_outbox_relay_bench as bench;

use crate::harness::TestDb;
use crate::relay_support::{self as support, config, eventually};

/// A receiver that answers each request after `pace`, `serial`: one at a time, on a listen
/// backlog of five (a single-threaded server); else all at once, on a backlog that takes every
/// connection. It counts requests per event id and the most it had in progress at once.
#[derive(Default)]
struct Receiver {
    in_flight: AtomicUsize,
    most: AtomicUsize,
    received: Mutex<HashMap<i64, usize>>,
    one_at_a_time: tokio::sync::Mutex<()>,
}

async fn receiver(pace: Duration, serial: bool) -> (Arc<Receiver>, String) {
    let state = Arc::new(Receiver::default());
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(if serial { 5 } else { 1024 }).unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    let app = Router::new().route(
        "/hook",
        post({
            let state = state.clone();
            move |headers: HeaderMap| {
                let state = state.clone();
                async move {
                    let now = state.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                    state.most.fetch_max(now, Ordering::SeqCst);
                    {
                        let _turn = if serial { Some(state.one_at_a_time.lock().await) } else { None };
                        // The receiver's own pace, not a synchronization.
                        tokio::time::sleep(pace).await;
                    }
                    let id: i64 = headers["outbox-event-id"].to_str().unwrap().parse().unwrap();
                    *state.received.lock().unwrap().entry(id).or_default() += 1;
                    state.in_flight.fetch_sub(1, Ordering::SeqCst);
                    ""
                }
            }
        }),
    );
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (state, url)
}

async fn insert(db: &TestDb, events: i64) {
    db.client()
        .await
        .execute(
            "insert into outbox_relay.outbox (topic, payload) select 't', jsonb_build_object('n', g)
               from generate_series(1, $1::int8) g",
            &[&events],
        )
        .await
        .unwrap();
}

/// The defaults (a limit learnt up to 256) against a receiver that serves one request at a
/// time: the relay keeps a few requests at it, not the ceiling, and nothing fails, is retried,
/// opens the breaker or arrives twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_that_serves_one_at_a_time_is_sent_a_few_at_once() {
    let db = TestDb::new().await;
    let (state, url) = receiver(Duration::from_millis(2), true).await;
    insert(&db, 300).await;
    let relay = support::start(&db.outbox, config(), HttpSink::new(&url, Duration::from_secs(10)).unwrap());
    eventually("all 300 received", || async { state.received.lock().unwrap().len() == 300 }).await;
    let metrics = relay.snapshot();
    relay.stop().await;
    let most = state.most.load(Ordering::SeqCst);
    assert!(most <= 16, "{most} requests at once at a receiver that serves one at a time");
    assert!(state.received.lock().unwrap().values().all(|&n| n == 1), "an event arrived twice");
    assert_eq!((metrics.retried, metrics.breaker_opens), (0, 0), "{metrics:?}");
    assert!(metrics.delivery_limit >= 1 && metrics.delivery_limit <= 16, "{metrics:?}");
}

/// Against a receiver that takes every request at once the limit grows to its ceiling; a
/// limit of 96 puts 96 requests at once at the receiver; with `fixed_concurrency` the ceiling is
/// the limit from the start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_that_takes_everything_gets_the_ceiling() {
    let db = TestDb::new().await;
    let (state, url) = receiver(Duration::from_millis(20), false).await;
    insert(&db, 50_000).await;
    let cfg = RelayConfig { concurrency: 96, ..config() };
    let relay = support::start(&db.outbox, cfg, HttpSink::new(&url, Duration::from_secs(10)).unwrap());
    eventually("the limit at its ceiling", || async { relay.snapshot().delivery_limit == 96 }).await;
    relay.stop().await;
    assert!(state.received.lock().unwrap().values().all(|&n| n == 1), "an event arrived twice");

    // The limit is real: 96 requests in progress at once. At a slower pace, so that a machine
    // busy with other tests still has all 96 out before the first answers (at 20 ms it may not,
    // and the limit, which the answers' delay drives, is fixed here for that reason).
    let (slow, url) = receiver(Duration::from_millis(500), false).await;
    insert(&db, 2_000).await;
    let fixed = RelayConfig { concurrency: 96, fixed_concurrency: true, ..config() };
    let relay = support::start(&db.outbox, fixed, HttpSink::new(&url, Duration::from_secs(10)).unwrap());
    eventually("96 requests at once at the receiver", || async { slow.most.load(Ordering::SeqCst) == 96 }).await;
    relay.stop().await;
    assert!(slow.received.lock().unwrap().values().all(|&n| n == 1), "an event arrived twice");

    let fixed = RelayConfig { concurrency: 12, fixed_concurrency: true, ..config() };
    let relay = support::start(&db.outbox, fixed, HttpSink::new(&url, Duration::from_secs(10)).unwrap());
    eventually("the fixed limit in the metrics", || async { relay.snapshot().delivery_limit == 12 }).await;
    relay.stop().await;
}

/// With a rate limit under the receiver's, nothing is refused; without one the 429s (and their
/// `Retry-After`) slow the relay down, and every event is accepted once, none dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limit_keeps_a_receiver_from_refusing_and_429s_slow_the_relay_down() {
    let db = TestDb::new().await;
    // The bench's receiver: 429 with `Retry-After: 1` past 50 accepted in the last second.
    let receiver = bench::Receiver::rate_limited(50).await.unwrap();
    let url = receiver.url();
    insert(&db, 60).await;
    let cfg = RelayConfig { rate_limit: Some(40.0), ..config() };
    let relay = support::start(&db.outbox, cfg, HttpSink::new(&url, Duration::from_secs(10)).unwrap());
    eventually("60 accepted", || async { receiver.counts().distinct == 60 }).await;
    relay.stop().await;
    assert_eq!(receiver.counts().too_many, 0, "40 a second (and a burst of 4) never pass 50");

    insert(&db, 300).await;
    let relay = support::start(&db.outbox, config(), HttpSink::new(&url, Duration::from_secs(10)).unwrap());
    eventually("360 accepted", || async { receiver.counts().distinct == 360 }).await;
    let metrics = relay.snapshot();
    relay.stop().await;
    assert!(receiver.counts().too_many > 0, "300 at once pass 50 a second");
    assert_eq!(receiver.counts().redelivered, 0, "an event was accepted twice");
    assert_eq!((metrics.dead_lettered, metrics.breaker_opens), (0, 0), "429s are answers: {metrics:?}");
}
