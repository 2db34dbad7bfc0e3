//! The sweeper removes the rows every destination has passed once their retention is over,
//! going on from where it ended: its cursor must move past a transaction of more rows than it
//! reads at once.

use std::time::Duration;

use pg_outbox_relay::{RelayConfig, Route};

use crate::harness::TestDb;
use crate::relay_support::{self as support, config, count, eventually_within, recorder};

/// Two destinations (`order.#` and `mail.#`), a retention of 0 and a sweep of 1,000 rows: 1,500
/// delivered rows as migration 0008 left 0007's (transaction id 2), then 12,000 `order.placed`
/// events in one transaction, then an event no pattern matches. The sweeper removes all of them
/// (the mail destination passes the orders after the order one took them) and dead-letters the
/// unrouted event as it goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweeper_goes_past_a_transaction_larger_than_its_batch_and_past_0007s_rows() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "set session_replication_role = replica;
             insert into outbox_relay.outbox (topic, payload, xid)
             select 'order.migrated', jsonb_build_object('n', g), '2'::xid8 from generate_series(1, 1500) g;
             set session_replication_role = origin;",
        )
        .await
        .unwrap();
    let (handler, _deliveries) = recorder();
    let cfg = RelayConfig { janitor_batch: 1000, retention: Duration::ZERO, ..config() };
    let routes = vec![
        Route::new("orders", "order.#", handler.labelled("orders")).unwrap(),
        Route::new("mailer", "mail.#", handler.labelled("mailer")).unwrap(),
    ];
    let relay = support::start_routes(&db.outbox, cfg, routes);
    client
        .batch_execute(
            "insert into outbox_relay.outbox (topic, payload) select 'order.placed', jsonb_build_object('n', g)
               from generate_series(1, 12000) g",
        )
        .await
        .unwrap();
    client.batch_execute("select outbox_relay.publish('misc.unrouted', '{}')").await.unwrap();
    eventually_within("every row removed and the unrouted one dead-lettered", crate::faults::LONG_PATIENCE, || async {
        count(&client, "select count(*) from outbox_relay.outbox").await == 0
            && count(
                &client,
                "select count(*) from outbox_relay.dead_letters where destination = '' and topic = 'misc.unrouted'",
            )
            .await
                == 1
    })
    .await;
    relay.stop().await;
    assert_eq!(count(&client, "select count(*) from outbox_relay.dead_letters").await, 1, "only the unrouted one");
}
