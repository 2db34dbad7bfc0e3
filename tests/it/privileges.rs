//! Least privilege: the roles of `migrations/optional/least_privilege_roles.sql` are enough for
//! their jobs and no more.

use pg_outbox_relay::{AuditEntry, DeliveryError, Event, NewEvent, Outbox, RelayConfig, handler_fn};
use serde_json::json;
use tokio_postgres::error::SqlState;

use crate::harness::TestDb;
use crate::relay_support::{self as support, config, eventually, recorder};

pub(crate) const ROLES_SQL: &str = include_str!("../../migrations/optional/least_privilege_roles.sql");

/// The URL of the test database for another user (trust authentication on the test server).
fn url_as(db: &TestDb, user: &str) -> String {
    db.url_as(user)
}

/// Applies the roles file, and makes a login role of `outbox_writer` (roles are cluster-wide: a
/// unique name per test database) that may also write a business table `orders`; its name.
async fn writer_of_orders(db: &TestDb, admin: &tokio_postgres::Client) -> String {
    admin.batch_execute(ROLES_SQL).await.expect("applying the roles file");
    let writer = format!("{}_writer", db.name);
    admin
        .batch_execute(&format!(
            "create role {writer} login in role outbox_writer;
             create table orders (id bigserial primary key, customer text not null);
             grant insert, select on orders to {writer};
             grant usage on sequence orders_id_seq to {writer};"
        ))
        .await
        .unwrap();
    writer
}

#[tokio::test]
async fn the_relay_role_relays_but_cannot_read_business_tables_and_the_writer_only_writes() {
    let db = TestDb::new().await;
    if crate::harness::server().embedded().is_none() {
        eprintln!("note: DATABASE_URL is set; this test needs to create roles, which the server may refuse");
    }
    let admin = db.client().await;
    let writer = writer_of_orders(&db, &admin).await;
    let relayer = format!("{}_relayer", db.name);
    admin
        .batch_execute(&format!(
            "create role {relayer} login in role outbox_relayer;
             insert into orders (customer) values ('someone');"
        ))
        .await
        .unwrap();

    // The service writes an order, its audit entry, receipt and event as the writer role.
    let service = Outbox::connect(&url_as(&db, &writer)).await.unwrap();
    let placed = service
        .execute("key-1", &json!({"customer": "ana"}), async |work| {
            let id: i64 =
                work.query_one("insert into orders (customer) values ('ana') returning id", &[]).await?.get(0);
            work.audit(&AuditEntry::new("order", id, "placed", &json!({"customer": "ana"}))?).await?;
            work.publish(&NewEvent::new("order.placed", json!({"order_id": id}))).await?;
            work.publish(&NewEvent::new("order.refused", json!({"order_id": id}))).await?;
            Ok::<_, pg_outbox_relay::Error>(id)
        })
        .await
        .unwrap();
    let replay = service
        .execute("key-1", &json!({"customer": "ana"}), async |_work| Ok::<_, pg_outbox_relay::Error>(0))
        .await
        .unwrap();
    assert!(replay.replayed && replay.response == placed.response);
    // ... and cannot read events back or touch the dead letters.
    let as_writer = service.connection().await.unwrap();
    let err = as_writer.query("select * from outbox_relay.outbox", &[]).await.unwrap_err();
    assert_eq!(err.code(), Some(&SqlState::INSUFFICIENT_PRIVILEGE));
    let err = as_writer.query("delete from outbox_relay.dead_letters", &[]).await.unwrap_err();
    assert_eq!(err.code(), Some(&SqlState::INSUFFICIENT_PRIVILEGE));
    // Nor set what only the relay sets, take an id the sequence will hand out, or forge a receipt.
    let next_id: i64 =
        admin.query_one("select last_value + 1 from outbox_relay.outbox_id_seq", &[]).await.unwrap().get(0);
    for forbidden in [
        "insert into outbox_relay.outbox (topic, payload, xid) values ('p.t', '{}', '1')".to_string(),
        "insert into outbox_relay.outbox (topic, payload, created_at) values ('p.t', '{}', 'infinity')".to_string(),
        // (a lease, a retry or a delay of the relay's is a copy parked for a destination)
        "insert into outbox_relay.parked (destination, id, uuid, topic, payload, created_at, lease_token)
         values ('default', 1, gen_random_uuid(), 'p.t', '{}', now(), 1)"
            .to_string(),
        format!("insert into outbox_relay.outbox (id, topic, payload) values ({next_id}, 'p.t', '{{}}')"),
        "insert into outbox_relay.audit (entity, entity_id, action, data, at) values ('o', '1', 'a', '{}', now())"
            .to_string(),
        "update outbox_relay.idempotency set response = '{\"order_id\": 666}' where key = 'key-1'".to_string(),
        // (a receipt is written with its response: a fresh key's only; never with a time)
        "insert into outbox_relay.idempotency (key, fingerprint, response, created_at) values ('forged', '\\x00', '{}', now())"
            .to_string(),
    ] {
        let err = as_writer.batch_execute(&forbidden).await.unwrap_err();
        assert_eq!(err.code(), Some(&SqlState::INSUFFICIENT_PRIVILEGE), "{forbidden}: {err}");
    }
    let err =
        as_writer.query("select outbox_relay.store_response('key-1', '{\"order_id\": 666}')", &[]).await.unwrap_err();
    assert!(err.to_string().contains("no receipt") || format!("{err:?}").contains("no receipt"), "{err:?}");
    let replay = service
        .execute("key-1", &json!({"customer": "ana"}), async |_work| Ok::<_, pg_outbox_relay::Error>(0))
        .await
        .unwrap();
    assert_eq!(replay.response, placed.response, "the receipt was not forged");

    // The relay runs as the relay role: delivers, dead-letters, cleans up, marks itself waiting.
    let relay_outbox = Outbox::connect(&url_as(&db, &relayer)).await.unwrap();
    let (recorded, mut deliveries) = recorder();
    let handler = handler_fn(move |event: Event| {
        let recorded = recorded.clone();
        async move {
            if event.topic == "order.refused" {
                return Err(DeliveryError::permanent("refused"));
            }
            pg_outbox_relay::Handler::handle(&recorded, &event).await
        }
    });
    let cfg = RelayConfig { janitor_interval: std::time::Duration::from_millis(50), ..config() };
    let relay = support::start(&relay_outbox, cfg, handler);
    assert_eq!(deliveries.next().await.event.topic, "order.placed");
    eventually("the refused event dead-lettered", || async {
        relay_outbox.queue_stats().await.unwrap().dead_letters == 1
    })
    .await;
    support::relay_waiting(&admin).await;
    relay.stop().await;
    assert_eq!(relay_outbox.retry_all_dead_letters().await.unwrap().len(), 1);
    assert_eq!(
        relay_outbox.cleanup(std::time::Duration::ZERO, std::time::Duration::ZERO, 100).await.unwrap().receipts,
        1
    );

    let as_relayer = relay_outbox.connection().await.unwrap();
    let err = as_relayer.query("select * from orders", &[]).await.unwrap_err();
    assert_eq!(err.code(), Some(&SqlState::INSUFFICIENT_PRIVILEGE), "{err}");
    let err = as_relayer.execute("insert into orders (customer) values ('x')", &[]).await.unwrap_err();
    assert_eq!(err.code(), Some(&SqlState::INSUFFICIENT_PRIVILEGE));

    drop((service, relay_outbox, as_writer, as_relayer));
    // Clean the cluster-wide login roles (the database goes with the test).
    admin
        .batch_execute(&format!("drop owned by {writer}, {relayer}; drop role {writer}; drop role {relayer}"))
        .await
        .ok();
}

/// A relay role that may read but not update the outbox is refused at start, naming what it
/// lacks; a role without USAGE on the schema gets a message that says so, not `db error`.
#[tokio::test]
async fn roles_that_cannot_relay_are_told_what_they_lack() {
    let db = TestDb::new().await;
    let admin = db.client().await;
    let reader = format!("{}_reader", db.name);
    let stranger = format!("{}_stranger", db.name);
    admin
        .batch_execute(&format!(
            "create role {reader} login; create role {stranger} login;
             grant usage on schema outbox_relay to {reader};
             grant select on all tables in schema outbox_relay to {reader};"
        ))
        .await
        .unwrap();
    let as_reader = Outbox::connect(&url_as(&db, &reader)).await.unwrap();
    let (handler, _deliveries) = recorder();
    let run = pg_outbox_relay::Relay::new(&as_reader, config(), handler).unwrap().run(std::future::pending()).await;
    let err = run.expect_err("a relay role that cannot update must not start");
    assert_eq!(err.kind(), pg_outbox_relay::ErrorKind::Permission, "{err}");
    assert!(err.to_string().contains(&format!("role \"{reader}\" cannot relay")), "{err}");
    assert!(err.to_string().contains("UPDATE on outbox_relay.outbox"), "{err}");
    let as_stranger = Outbox::connect(&url_as(&db, &stranger)).await.unwrap();
    let err = as_stranger.check_schema().await.unwrap_err().to_string();
    assert!(err.contains(&format!("role \"{stranger}\" may not use the schema outbox_relay")), "{err}");
    assert!(!err.contains("db error"), "{err}");
    drop((as_reader, as_stranger));
    admin
        .batch_execute(&format!("drop owned by {reader}, {stranger}; drop role {reader}; drop role {stranger}"))
        .await
        .ok();
}

/// A receiver's service as `outbox_consumer`: it records and purges its inbox, in its own
/// transactions, and reads nothing else of the schema.
#[tokio::test]
async fn the_consumer_role_keeps_its_inbox_and_nothing_else() {
    let db = TestDb::new().await;
    let admin = db.client().await;
    admin.batch_execute(ROLES_SQL).await.expect("applying the roles file");
    let consumer = format!("{}_consumer", db.name);
    admin.batch_execute(&format!("create role {consumer} login in role outbox_consumer")).await.unwrap();
    let (mut client, connection) =
        tokio_postgres::connect(&url_as(&db, &consumer), tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(connection);
    let inbox = pg_outbox_relay::inbox::Inbox::new("billing").unwrap();
    let event = pg_outbox_relay::Uuid::from_u128(7);
    let tx = client.transaction().await.unwrap();
    assert_eq!(inbox.record(&tx, event).await.unwrap(), pg_outbox_relay::inbox::Recorded::New);
    tx.commit().await.unwrap();
    let tx = client.transaction().await.unwrap();
    assert_eq!(inbox.record(&tx, event).await.unwrap(), pg_outbox_relay::inbox::Recorded::Duplicate);
    tx.commit().await.unwrap();
    admin.execute("update outbox_relay.inbox set received_at = now() - interval '1 day'", &[]).await.unwrap();
    assert_eq!(inbox.purge(&client, std::time::Duration::from_secs(3600)).await.unwrap(), 1);
    for table in ["outbox", "dead_letters", "idempotency"] {
        let refused = client.query(&format!("select 1 from outbox_relay.{table} limit 1"), &[]).await.unwrap_err();
        assert_eq!(refused.code(), Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE), "{table}");
    }
}

/// A writer role granted as before migration 0022 (a receipt's key and fingerprint only) cannot
/// write the receipt with its response: the unit of work fails at its commit with a permission
/// error that says which grant is missing, and writes nothing.
#[tokio::test]
async fn a_writer_without_the_receipts_response_is_told_which_grant_it_lacks() {
    let db = TestDb::new().await;
    let admin = db.client().await;
    let writer = writer_of_orders(&db, &admin).await;
    admin.batch_execute("revoke insert (response) on outbox_relay.idempotency from outbox_writer").await.unwrap();
    let service = Outbox::connect(&url_as(&db, &writer)).await.unwrap();
    let through_tokio_postgres = service
        .execute("key-1", &json!({"customer": "ana"}), async |work| {
            let id: i64 =
                work.query_one("insert into orders (customer) values ('ana') returning id", &[]).await?.get(0);
            work.publish(&NewEvent::new("order.placed", json!({"order_id": id}))).await?;
            Ok::<_, pg_outbox_relay::Error>(id)
        })
        .await
        .unwrap_err();
    let pool = sqlx::PgPool::connect(&url_as(&db, &writer)).await.unwrap();
    let through_sqlx = pg_outbox_relay::sqlx::execute(&pool, "key-1", &json!({"customer": "ana"}), async |work| {
        sqlx::query("insert into orders (customer) values ('ana')").execute(&mut **work).await.unwrap();
        Ok::<_, pg_outbox_relay::Error>(1)
    })
    .await
    .unwrap_err();
    pool.close().await;
    for err in [through_tokio_postgres, through_sqlx] {
        assert_eq!(err.kind(), pg_outbox_relay::ErrorKind::Permission, "{err}");
        assert_eq!(err.code(), Some(&SqlState::INSUFFICIENT_PRIVILEGE), "{err}");
        assert!(
            err.to_string().contains("grant it insert (key, fingerprint, response) on outbox_relay.idempotency"),
            "{err}"
        );
    }
    for table in ["orders", "outbox_relay.outbox", "outbox_relay.idempotency"] {
        let n: i64 = admin.query_one(&format!("select count(*) from {table}"), &[]).await.unwrap().get(0);
        assert_eq!(n, 0, "{table}");
    }
    drop(service);
    admin.batch_execute(&format!("drop owned by {writer}; drop role {writer}")).await.unwrap();
}
