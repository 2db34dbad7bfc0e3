//! The sweeper finishes the rows every destination has passed but none finished, going on from
//! where it ended: its cursor must move past a transaction of more rows than it reads at once.

use pg_outbox_relay::{Completion, RelayConfig, Route};

use crate::harness::TestDb;
use crate::relay_support::{self as support, config, count, eventually_within, recorder};

/// Two destinations (`order.#` and `mail.#`), delivered rows kept (`--completion mark`) and a
/// sweep of 1,000 rows: 1,500 delivered rows as migration 0008 left 0007's (transaction id 2),
/// then 12,000 `order.placed` events in one transaction, then an event no pattern matches. The
/// sweeper finishes all 12,000 (the mail destination passes them after the order one took them)
/// and goes on to dead-letter the unrouted event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweeper_goes_past_a_transaction_larger_than_its_batch_and_past_0007s_rows() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "set session_replication_role = replica;
             insert into outbox_relay.outbox (topic, payload, processed_at, xid)
             select 'order.migrated', jsonb_build_object('n', g), now(), '2'::xid8 from generate_series(1, 1500) g;
             set session_replication_role = origin;",
        )
        .await
        .unwrap();
    let (handler, _deliveries) = recorder();
    let cfg = RelayConfig { completion: Completion::MarkProcessed, janitor_batch: 1000, ..config() };
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
    eventually_within(
        "every row finished and the unrouted one dead-lettered",
        crate::faults::LONG_PATIENCE,
        || async {
            count(&client, "select count(*) from outbox_relay.outbox where processed_at is null").await == 0
                && count(
                    &client,
                    "select count(*) from outbox_relay.dead_letters where destination = '' and topic = 'misc.unrouted'",
                )
                .await
                    == 1
        },
    )
    .await;
    relay.stop().await;
    let delivered_once =
        "select count(*) from outbox_relay.outbox where topic = 'order.placed' and processed_at is not null";
    assert_eq!(count(&client, delivered_once).await, 12000);
}
