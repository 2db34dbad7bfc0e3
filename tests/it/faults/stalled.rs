//! A database that takes connections and then answers nothing (a frozen or overloaded server, a
//! hung proxy): every operation of an `Outbox` returns within its bound with an error that says
//! so, and a new connection gives up after the URL's `connect_timeout`, handshake included.

use std::time::Duration;

use pg_outbox_relay::{ErrorKind, Outbox};

use super::proxy::{Link, Proxy, upstream};
use crate::harness::TestDb;
use crate::relay_support::PATIENCE;

/// Runs `operation`, which must fail within the test's patience with a "did not answer" error.
async fn gives_up<T: std::fmt::Debug>(what: &str, operation: impl Future<Output = pg_outbox_relay::Result<T>>) {
    let err = tokio::time::timeout(PATIENCE, operation)
        .await
        .unwrap_or_else(|_| panic!("{what} hung on a database that does not answer"))
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Connect, "{what}: {err}");
    assert!(err.to_string().contains("did not answer within 1s"), "{what}: {err}");
}

#[tokio::test]
async fn a_database_that_stops_answering_fails_each_operation_within_its_bound() {
    let db = TestDb::new().await;
    let proxy = Proxy::start(upstream(&db.name)).await;
    let outbox = Outbox::connect_with(proxy.url(&db.name), 2).await.unwrap().with_timeout(Duration::from_secs(1));
    outbox.queue_stats().await.expect("answers through the open link");

    proxy.set(Link::Stalled);
    gives_up("queue_stats", outbox.queue_stats()).await;
    gives_up("dead_letters", outbox.dead_letters(10)).await;
    gives_up("health", outbox.health()).await;
    gives_up("look_up", outbox.look_up(Some(1), None, 10)).await;
    gives_up("pause", outbox.pause(None)).await;
    gives_up("retry_dead_letters", outbox.retry_dead_letters(&[1])).await;
    gives_up("ping", outbox.ping()).await;
    gives_up("check_schema", outbox.check_schema()).await;
    gives_up("migrate", outbox.migrate()).await;
    gives_up("cleanup", outbox.cleanup(Duration::ZERO, Duration::ZERO, 100)).await;

    // A new connection: the proxy accepts it and forwards nothing, so only the URL's
    // connect_timeout (which tokio-postgres applies to the TCP connect alone) can end it.
    let url = proxy.url(&db.name).to_connection_string();
    let url = format!("{url}{}connect_timeout=1", if url.contains('?') { '&' } else { '?' });
    let err = tokio::time::timeout(PATIENCE, Outbox::connect(&url))
        .await
        .expect("connecting to a server that does not answer hung")
        .unwrap_err();
    assert!(err.is_connect(), "{err}");
    assert!(err.to_string().contains("did not complete the connection within 1s (connect_timeout)"), "{err}");
    assert!(!err.to_string().contains(&url), "the URL is not shown: {err}");

    proxy.set(Link::Open);
    outbox.queue_stats().await.expect("answers again once the link forwards");
}
