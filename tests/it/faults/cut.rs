//! Connections between the relay and the server cut, or stalled, by a TCP proxy.

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::time::Duration;

use pg_outbox_relay::{Outbox, RelayConfig};
use tokio_postgres::Client;

use super::proxy::{Link, Proxy, upstream};
use crate::harness::TestDb;
use crate::relay_support::{
    self as support, config, eventually, listener_pid, listener_ready, recorder, relay_waiting,
};

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
    let outbox = Outbox::connect_with(proxy.url(&db.name), 16).await.unwrap();
    let (handler, mut deliveries) = recorder();
    let cfg =
        RelayConfig { poll_interval: Duration::from_secs(3600), reconnect_max: Duration::from_millis(500), ..config() };
    let relay = support::start(&outbox, cfg, handler);
    let direct = db.client().await;
    relay_waiting(&direct).await;
    let before = publish_direct(&direct, "fault.before", 0).await;
    assert_eq!(deliveries.next().await.event.id, before);
    // Recorded, so that the cut finds the relay idle rather than between a delivery and its record.
    eventually("the first delivery recorded", || {
        let delivered = relay.snapshot().delivered;
        async move { delivered == 1 }
    })
    .await;
    let through_proxy = proxy.accepted.load(Ordering::SeqCst);
    assert!(through_proxy >= 2, "the relay's listener and pool go through the proxy");

    proxy.set(Link::Cut);
    let cut_at = tokio::time::Instant::now();
    eventually("the relay's listener connection closed", || async { listener_pid(&direct).await.is_none() }).await;
    let mut during = BTreeSet::new();
    for n in 0..20 {
        during.insert(publish_direct(&direct, "fault.during_cut", n).await);
    }
    // The relay tries to reconnect and is refused, several times, before the link comes back.
    eventually("refused reconnection attempts", || {
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
    eventually("the relay waiting under its new listener", || async {
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
    let outbox = Outbox::connect_with(proxy.url(&db.name), 16).await.unwrap();
    let (handler, mut deliveries) = recorder();
    let cfg =
        RelayConfig { poll_interval: Duration::from_millis(200), shutdown_grace: Duration::from_secs(1), ..config() };
    let relay = support::start(&outbox, cfg, handler);
    let direct = db.client().await;
    relay_waiting(&direct).await;
    let before = publish_direct(&direct, "fault.before", 0).await;
    assert_eq!(deliveries.next().await.event.id, before);
    proxy.set(Link::Stalled);
    // The next fallback poll's claim is sent and held by the stalled link: a worker waits on it.
    eventually("a claim held by the stalled link", || async { proxy.held() > 0 }).await;
    // Within PATIENCE (30 s); the relay's own bounds add up to about 10 s after the 1 s grace.
    relay.stop().await;
    outbox.pool().close();
}
