//! The consumer's side: `pg_outbox_relay::inbox` (tokio-postgres and sqlx) records each event once
//! in the consumer's own transaction, also when deliveries race; retention; the uuid every
//! event carries, kept through the dead letters.

// `&mut *tx` is how sqlx's own documentation passes a transaction; the tests write it so.
#![allow(clippy::explicit_auto_deref)]

use std::collections::HashSet;
use std::time::Duration;

use pg_outbox_relay::inbox::{Inbox, Recorded};
use pg_outbox_relay::{ErrorKind, NewEvent, Uuid};
use serde_json::json;

use crate::harness::TestDb;
use crate::relay_support::{self as support, config, count, recorder};

fn uuid(n: u128) -> Uuid {
    Uuid::from_u128(0x0c5b_8a34_5f0e_4d8e_9a3b_0000_0000_0000 + n)
}

#[tokio::test]
async fn an_event_is_new_once_and_a_rolled_back_record_is_not_kept() {
    let db = TestDb::new().await;
    let mut client = db.client().await;
    let billing = Inbox::new("billing").unwrap();
    let mailer = Inbox::new("mailer").unwrap();

    let tx = client.transaction().await.unwrap();
    assert_eq!(billing.record(&tx, uuid(1)).await.unwrap(), Recorded::New);
    assert_eq!(billing.record(&tx, uuid(1)).await.unwrap(), Recorded::Duplicate, "in the same transaction too");
    tx.commit().await.unwrap();

    let tx = client.transaction().await.unwrap();
    assert_eq!(billing.record(&tx, uuid(1)).await.unwrap(), Recorded::Duplicate, "after the commit");
    assert_eq!(mailer.record(&tx, uuid(1)).await.unwrap(), Recorded::New, "each consumer has its own inbox");
    assert_eq!(billing.record(&tx, uuid(2)).await.unwrap(), Recorded::New);
    tx.rollback().await.unwrap();

    // The handler failed and its transaction rolled back: the redelivery is new again.
    let tx = client.transaction().await.unwrap();
    assert_eq!(billing.record(&tx, uuid(2)).await.unwrap(), Recorded::New, "a rolled-back record is gone");
    assert_eq!(mailer.record(&tx, uuid(1)).await.unwrap(), Recorded::New);
    tx.commit().await.unwrap();
    assert_eq!(count(&db.client().await, "select count(*) from outbox_relay.inbox").await, 3);
}

/// Two deliveries of one event handled at the same time: the second waits for the first's
/// transaction and finds the record when it committed, or takes over when it rolled back.
#[tokio::test]
async fn racing_deliveries_of_one_event_are_handled_once() {
    let db = TestDb::new().await;
    let inbox = Inbox::new("billing").unwrap();
    for first_commits in [true, false] {
        let event = uuid(u128::from(first_commits));
        let mut first = db.client().await;
        let mut second = db.client().await;
        let tx1 = first.transaction().await.unwrap();
        assert_eq!(inbox.record(&tx1, event).await.unwrap(), Recorded::New);
        let tx2 = second.transaction().await.unwrap();
        let recorded = {
            let racing = inbox.record(&tx2, event);
            tokio::pin!(racing);
            // The second record waits on the first's uncommitted one.
            assert!(tokio::time::timeout(Duration::from_millis(300), &mut racing).await.is_err(), "it waits");
            if first_commits {
                tx1.commit().await.unwrap();
            } else {
                tx1.rollback().await.unwrap();
            }
            racing.await.unwrap()
        };
        if first_commits {
            assert_eq!(recorded, Recorded::Duplicate);
        } else {
            assert_eq!(recorded, Recorded::New, "the first handler failed: the second handles it");
        }
        tx2.commit().await.unwrap();
    }
    assert_eq!(count(&db.client().await, "select count(*) from outbox_relay.inbox").await, 2);

    // Fifty concurrent deliveries of one event: one is new.
    let event = uuid(99);
    let results = futures::future::join_all((0..50).map(|_| async {
        let mut client = db.client().await;
        let tx = client.transaction().await.unwrap();
        let recorded = inbox.record(&tx, event).await.unwrap();
        tx.commit().await.unwrap();
        recorded
    }))
    .await;
    assert_eq!(results.iter().filter(|r| **r == Recorded::New).count(), 1, "{results:?}");
}

#[tokio::test]
async fn purge_deletes_only_the_consumers_records_past_the_retention() {
    let db = TestDb::new().await;
    let mut client = db.client().await;
    let billing = Inbox::new("billing").unwrap();
    let mailer = Inbox::new("mailer").unwrap();
    let tx = client.transaction().await.unwrap();
    for n in 0..30 {
        let _ = billing.record(&tx, uuid(n)).await.unwrap();
        let _ = mailer.record(&tx, uuid(n)).await.unwrap();
    }
    tx.commit().await.unwrap();
    // Twenty of each are two days old.
    client
        .execute(
            "update outbox_relay.inbox set received_at = now() - interval '2 days' \
             where event_id in (select event_id from outbox_relay.inbox where consumer = 'billing' order by event_id limit 20)",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(billing.purge(&client, Duration::from_secs(3 * 86_400)).await.unwrap(), 0, "none older than 3 days");
    assert_eq!(billing.purge(&client, Duration::from_secs(86_400)).await.unwrap(), 20);
    assert_eq!(
        count(&db.client().await, "select count(*) from outbox_relay.inbox where consumer = 'billing'").await,
        10
    );
    assert_eq!(
        count(&db.client().await, "select count(*) from outbox_relay.inbox where consumer = 'mailer'").await,
        30
    );

    let e = billing.purge(&client, Duration::from_secs(10)).await.unwrap_err();
    assert!(e.is_invalid_input() && e.to_string().contains("shorter than the minimum"), "{e}");
    assert_eq!(
        count(&db.client().await, "select count(*) from outbox_relay.inbox").await,
        40,
        "a refused purge deletes nothing"
    );
}

/// More old records than one statement deletes: the purge goes on batch after batch.
#[tokio::test]
async fn purge_goes_on_past_one_batch() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let rows = pg_outbox_relay::inbox::PURGE_BATCH * 2 + 7;
    client
        .execute(
            "insert into outbox_relay.inbox (consumer, event_id, received_at) \
             select 'billing', gen_random_uuid(), now() - interval '1 hour' from generate_series(1, $1::int8)",
            &[&rows],
        )
        .await
        .unwrap();
    let inbox = Inbox::new("billing").unwrap();
    assert_eq!(inbox.purge(&client, Duration::from_secs(60)).await.unwrap(), rows as u64);
    assert_eq!(count(&db.client().await, "select count(*) from outbox_relay.inbox").await, 0);
}

#[tokio::test]
async fn the_sqlx_inbox_records_and_purges_alike() {
    let db = TestDb::new().await;
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(2).connect(&db.url).await.unwrap();
    let inbox = Inbox::new("billing").unwrap();
    let mut tx = pool.begin().await.unwrap();
    assert_eq!(pg_outbox_relay::sqlx::record_in_inbox(&mut tx, &inbox, uuid(1)).await.unwrap(), Recorded::New);
    assert_eq!(pg_outbox_relay::sqlx::record_in_inbox(&mut tx, &inbox, uuid(1)).await.unwrap(), Recorded::Duplicate);
    tx.rollback().await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    assert_eq!(pg_outbox_relay::sqlx::record_in_inbox(&mut tx, &inbox, uuid(1)).await.unwrap(), Recorded::New);
    tx.commit().await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    assert_eq!(pg_outbox_relay::sqlx::record_in_inbox(&mut tx, &inbox, uuid(1)).await.unwrap(), Recorded::Duplicate);
    tx.commit().await.unwrap();

    sqlx::query("update outbox_relay.inbox set received_at = now() - interval '2 hours'").execute(&pool).await.unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let e = pg_outbox_relay::sqlx::purge_inbox(&mut *conn, &inbox, Duration::ZERO).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    assert_eq!(pg_outbox_relay::sqlx::purge_inbox(&mut *conn, &inbox, Duration::from_secs(3600)).await.unwrap(), 1);
}

/// A consumer name the database would refuse is refused before any statement.
#[tokio::test]
async fn a_bad_consumer_name_is_refused_by_the_library_and_by_the_table() {
    let db = TestDb::new().await;
    assert!(Inbox::new("").unwrap_err().is_invalid_input());
    let refused = db
        .client()
        .await
        .execute("insert into outbox_relay.inbox (consumer, event_id) values (E'a\\nb', gen_random_uuid())", &[])
        .await
        .unwrap_err();
    assert!(
        refused.to_string().contains("inbox_consumer_valid") || format!("{refused:?}").contains("inbox_consumer_valid")
    );
}

/// Every event gets its own uuid, which the handler sees on every delivery and which survives
/// the dead letters and a retry from them.
#[tokio::test]
async fn every_event_has_a_uuid_kept_through_the_dead_letters() {
    let db = TestDb::new().await;
    let ids = db
        .outbox
        .publish_all(&(0..20).map(|n| NewEvent::new("order.placed", json!({"n": n}))).collect::<Vec<_>>())
        .await
        .unwrap();
    let client = db.client().await;
    let stored: Vec<(i64, Uuid)> = client
        .query("select id, uuid from outbox_relay.outbox order by id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(stored.iter().map(|s| s.0).collect::<Vec<_>>(), ids);
    assert_eq!(stored.iter().map(|s| s.1).collect::<HashSet<_>>().len(), 20, "one uuid per event");
    assert!(stored.iter().all(|(_, u)| u.get_version_num() == 4), "random (version 4)");

    let (handler, mut deliveries) = recorder();
    let relay = support::start(&db.outbox, config(), handler);
    let mut seen = Vec::new();
    for _ in 0..20 {
        let event = deliveries.next().await.event;
        seen.push((event.id, event.uuid));
    }
    relay.stop().await;
    seen.sort();
    assert_eq!(seen, stored, "the handler gets each event's uuid");

    // To the dead letters and back.
    let event = db.outbox.publish(&NewEvent::new("mail.send", json!({}))).await.unwrap();
    let before: Uuid =
        client.query_one("select uuid from outbox_relay.outbox where id = $1", &[&event]).await.unwrap().get(0);
    let failing = pg_outbox_relay::handler_fn(|_: pg_outbox_relay::Event| async {
        Err(pg_outbox_relay::DeliveryError::permanent("refused"))
    });
    let relay = support::start(&db.outbox, config(), failing);
    crate::relay_support::eventually("dead-lettered", || async {
        db.outbox.dead_letters(10).await.unwrap().iter().any(|d| d.id == event)
    })
    .await;
    relay.stop().await;
    let buried: Uuid =
        client.query_one("select uuid from outbox_relay.dead_letters where id = $1", &[&event]).await.unwrap().get(0);
    assert_eq!(buried, before);
    db.outbox.retry_dead_letters(&[event]).await.unwrap();
    let back: Uuid =
        client.query_one("select uuid from outbox_relay.outbox where id = $1", &[&event]).await.unwrap().get(0);
    assert_eq!(back, before, "a retry puts the event back with its uuid");
}
