//! Rows written by hand, past every check of the library: as the table owner, or from before
//! migration 0003's constraints (simulated by dropping them). None may stop delivery or a
//! listing: a row no handler can be given goes to the dead letters with the reason, the rest of
//! its batch goes on.

use crate::harness::TestDb;
use crate::relay_support::{self as support, config, eventually, recorder};

#[tokio::test]
async fn hand_written_rows_neither_stop_the_relay_nor_break_the_listings() {
    let db = TestDb::new().await;
    let owner = db.client().await;
    owner
        .batch_execute(
            "alter table outbox_relay.outbox drop constraint outbox_created_at_valid,
                                             drop constraint outbox_available_at_finite,
                                             drop constraint outbox_topic_valid;
             insert into outbox_relay.outbox (topic, payload, created_at) values ('bad.infinity', '{}', 'infinity');
             insert into outbox_relay.outbox (topic, payload, created_at) values ('bad.minus_infinity', '{}', '-infinity');
             insert into outbox_relay.outbox (topic, payload, created_at) values ('bad.old', '{}', '1900-01-01');
             insert into outbox_relay.outbox (topic, payload, available_at) values ('bad.never', '{}', 'infinity');
             insert into outbox_relay.outbox (topic, payload) values ('bad..topic', '{}');
             insert into outbox_relay.outbox (topic, payload)
                 values ('bad.deep', (repeat('[', 200) || repeat(']', 200))::jsonb);
             insert into outbox_relay.outbox (topic, payload)
                 select 'good.event', jsonb_build_object('n', g) from generate_series(1, 50) g;",
        )
        .await
        .unwrap();
    let (handler, mut deliveries) = recorder();
    let relay = support::start(&db.outbox, config(), handler);
    let delivered: Vec<String> = deliveries.take(51).await.into_iter().map(|d| d.event.topic).collect();
    assert_eq!(delivered.iter().filter(|t| *t == "good.event").count(), 50);
    assert!(delivered.contains(&"bad..topic".to_string()), "only the NATS sink minds empty words");
    eventually("the undeliverable rows dead-lettered", || async {
        db.outbox.queue_stats().await.unwrap().dead_letters == 4
    })
    .await;
    relay.stop().await;

    let dead = db.outbox.dead_letters(10).await.unwrap();
    let reason = |topic: &str| dead.iter().find(|d| d.topic == topic).map(|d| d.last_error.clone()).unwrap();
    for topic in ["bad.infinity", "bad.minus_infinity", "bad.old"] {
        assert!(reason(topic).contains("is outside the years 1970 to 9999"), "{topic}: {}", reason(topic));
    }
    assert!(reason("bad.deep").contains("more than 100 deep"), "{}", reason("bad.deep"));

    // The listings read every one of them (`cli/tests/it/operator.rs` runs the commands on them).
    let stats = db.outbox.queue_stats().await.unwrap();
    assert_eq!(stats.delayed, 1, "the event due at infinity: {stats:?}");
    db.outbox.pending_errors(5).await.unwrap();
    // As JSON too (the deep payload, whose text no recursive parser reads back, is written as is).
    let letters = db.outbox.dead_letters(100).await.unwrap();
    let created = |topic: &str| {
        let letter = letters.iter().find(|l| l.topic == topic).unwrap();
        let json = serde_json::to_string(letter).unwrap();
        let after = &json[json.find(r#""created_at":""#).unwrap() + 14..];
        after[..after.find('"').unwrap()].to_string()
    };
    assert!(created("bad.infinity").starts_with('+'), "{}", created("bad.infinity"));
}

/// Migration 0003's constraints refuse such rows from now on, whoever writes them.
#[tokio::test]
async fn the_table_refuses_rows_no_relay_could_deliver() {
    let db = TestDb::new().await;
    let owner = db.client().await;
    for row in [
        "(topic, payload, created_at) values ('t', '{}', 'infinity')",
        "(topic, payload, created_at) values ('t', '{}', '1969-12-31 23:59:59+00')",
        "(topic, payload, available_at) values ('t', '{}', '-infinity')",
        "(topic, payload) values ('order..placed', '{}')",
        "(topic, payload) values ('.order', '{}')",
        "(topic, payload) values ('', '{}')",
        "(topic, payload) values (repeat('t', 256), '{}')",
        "(topic, payload) values ('ordér.placed', '{}')",
        "(topic, payload) values ('order placed', '{}')",
        "(topic, payload, key) values ('t', '{}', '')",
        "(topic, payload, key) values ('t', '{}', repeat('k', 256))",
        "(topic, payload, key) values ('t', '{}', repeat('é', 256))",
        "(topic, payload, key) values ('t', '{}', E'a\\nb')",
        "(topic, payload, key) values ('t', '{}', E'\\x01')",
        "(topic, payload, headers) values ('t', '{}', '{\"x-a\": 1}')",
    ] {
        let err = owner.batch_execute(&format!("insert into outbox_relay.outbox {row}")).await.unwrap_err();
        assert_eq!(err.code(), Some(&tokio_postgres::error::SqlState::CHECK_VIOLATION), "{row}: {err}");
    }
    for key in ["''", "repeat('k', 256)", "E'a\\tb'"] {
        let err = owner
            .batch_execute(&format!("insert into outbox_relay.idempotency (key, fingerprint) values ({key}, '\\x00')"))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Some(&tokio_postgres::error::SqlState::CHECK_VIOLATION), "receipt key {key}: {err}");
    }
    // Migration 0021 rewrote the checks in fewer nodes; what they admit is unchanged: the
    // longest topic, a key of 255 characters that are not ASCII, no key, headers.
    owner
        .batch_execute(
            "insert into outbox_relay.outbox (topic, payload, key) values (repeat('t', 255), '{}', repeat('é', 255));
             insert into outbox_relay.outbox (topic, payload, key) values ('a.b_c:d/e-f.G9', '{}', null);
             insert into outbox_relay.outbox (topic, payload, headers) values ('t', '{}', '{\"x-a\": \"1\"}');
             insert into outbox_relay.idempotency (key, fingerprint) values (repeat('é', 255), '\\x00');",
        )
        .await
        .unwrap();
}

/// An event's `xid` is its inserting transaction's (migration 0009): one naming a transaction
/// committed before the relays' position would be in no claim's delta, pending and never
/// delivered. Naming the inserting transaction, or leaving the column to its default, passes.
#[tokio::test]
async fn an_event_naming_another_transaction_is_refused() {
    let db = TestDb::new().await;
    let owner = db.client().await;
    for statement in [
        "insert into outbox_relay.outbox (topic, payload, xid) values ('t', '{}', '2')",
        "insert into outbox_relay.outbox (topic, payload, xid) values ('t', '{}', (pg_current_xact_id()::text::int8 + 1)::text::xid8)",
    ] {
        let err = owner.batch_execute(statement).await.unwrap_err();
        let db_err = err.as_db_error().unwrap_or_else(|| panic!("{statement}: {err}"));
        assert_eq!(db_err.code(), &tokio_postgres::error::SqlState::CHECK_VIOLATION, "{statement}: {err}");
        assert!(db_err.message().contains("names transaction"), "{}", db_err.message());
        assert!(db_err.hint().is_some_and(|h| h.contains("Leave xid out")), "{db_err:?}");
    }
    owner
        .batch_execute(
            "insert into outbox_relay.outbox (topic, payload, xid) values ('by.hand', '{}', pg_current_xact_id());
             insert into outbox_relay.outbox (topic, payload) values ('by.default', '{}')",
        )
        .await
        .unwrap();
    // An update that moves an event to another transaction is refused as well.
    let err =
        owner.batch_execute("update outbox_relay.outbox set xid = '2' where topic = 'by.hand'").await.unwrap_err();
    assert_eq!(err.code(), Some(&tokio_postgres::error::SqlState::CHECK_VIOLATION), "{err}");

    let (handler, mut deliveries) = recorder();
    let relay = support::start(&db.outbox, config(), handler);
    let mut topics: Vec<String> = deliveries.take(2).await.into_iter().map(|d| d.event.topic).collect();
    topics.sort();
    assert_eq!(topics, ["by.default", "by.hand"]);
    relay.stop().await;
}
