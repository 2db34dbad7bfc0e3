//! Writers that commit in two phases: PostgreSQL refuses to PREPARE a transaction that has
//! notified, so such a writer turns the outbox's notification off for its transaction
//! (`set local outbox_relay.notify = off`), and the relay's poll finds its events once COMMIT
//! PREPARED makes them visible.

use std::time::Duration;

use pg_outbox_relay::{Outbox, RelayConfig};
use pg_outbox_relay_cluster::{EmbeddedOptions, EmbeddedPostgres};

use super::until_delivered;
use crate::faults::connect;
use crate::relay_support::{self as support, config, recorder, relay_waiting};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prepared_transaction_publishes_without_notifying_and_is_delivered_after_commit_prepared() {
    // A private cluster: the shared server may not allow prepared transactions.
    let pg = tokio::task::spawn_blocking(|| EmbeddedPostgres::start(EmbeddedOptions::default()))
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("cannot start a private PostgreSQL: {e}"));
    let outbox = Outbox::connect(&pg.url()).await.unwrap();
    outbox.migrate().await.unwrap();
    let client = connect(&pg.url()).await;
    let (handler, mut deliveries) = recorder();
    let cfg = RelayConfig { poll_interval: Duration::from_millis(200), ..config() };
    let relay = support::start(&outbox, cfg, handler);
    relay_waiting(&client).await;

    // With a relay waiting the trigger notifies, and PREPARE refuses.
    client.batch_execute("begin; select outbox_relay.publish('order.prepared', '{}')").await.unwrap();
    let refused = client.batch_execute("prepare transaction 'notified'").await.unwrap_err();
    assert!(format!("{refused:?}").contains("NOTIFY"), "{refused:?}");
    client.batch_execute("rollback").await.unwrap();

    client.batch_execute("begin; set local outbox_relay.notify = off").await.unwrap();
    let id: i64 =
        client.query_one("select outbox_relay.publish('order.prepared', '{\"n\": 1}')", &[]).await.unwrap().get(0);
    client.batch_execute("prepare transaction 'quiet'").await.unwrap();
    client.batch_execute("commit prepared 'quiet'").await.unwrap();
    until_delivered(&mut deliveries, &[id]).await;
    relay.stop().await;
    outbox.pool().close();
}
