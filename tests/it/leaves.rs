//! The outbox in leaves of time (issue 42, migration 0024): a leaf is truncated only once nothing
//! in it is visible (a writer that commits into it while its truncate waits for the lock is seen
//! under the lock), a truncate killed while it waits removes nothing, the relay truncates a leaf
//! its sweeper emptied while a snapshot is held (its disk is free: range deletes alone leave it
//! to the hold), it waits for `pg_dump`'s lock while delivery goes on, and the slots' span is set
//! for new transactions. A truncate terminated before its commit leaves the leaf as it was, and two
//! relays with different settings rotate beside each other.

use std::time::Duration;

use pg_outbox_relay::RelayConfig;

use crate::harness::TestDb;
use crate::relay_support::{self as support, config, count, eventually, eventually_within, recorder};

/// A try of `outbox_relay.truncate_leaf`: its outcome, and the snapshot it checked the leaf in.
async fn truncate_leaf(
    client: &tokio_postgres::Client,
    slot: i16,
    seen: Option<&str>,
    wait_ms: i32,
) -> (String, Option<String>) {
    let row = client
        .query_one(
            "select outcome, seen::text from outbox_relay.truncate_leaf($1::int2, $2::text::pg_snapshot, $3::int4)",
            &[&slot, &seen, &wait_ms],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

/// A slot two slots away from the one writers use now: no writer's, and not a neighbour's.
async fn far_slot(client: &tokio_postgres::Client) -> i16 {
    client.query_one("select ((outbox_relay.current_slot() + 2) % 4)::int2", &[]).await.unwrap().get(0)
}

/// The heap size of the leaf of `slot`, in bytes.
async fn leaf_size(client: &tokio_postgres::Client, slot: i16) -> i64 {
    count(client, &format!("select pg_relation_size('outbox_relay.outbox_{slot}')")).await
}

/// Rows written into a leaf by hand (a slot of their own): a leaf with rows visible is left, one
/// whose rows are all removed is truncated while a transaction is held open (which range
/// deletes' disk waits for), and a writer that committed into the leaf while the truncate waited
/// for its lock is seen under the lock, not truncated with it.
#[tokio::test]
async fn a_leaf_is_truncated_only_once_nothing_in_it_is_visible() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let slot = far_slot(&client).await;
    client
        .execute(
            "insert into outbox_relay.outbox (topic, payload, slot)
             select 'order.placed', jsonb_build_object('n', g), $1 from generate_series(1, 100) g",
            &[&slot],
        )
        .await
        .unwrap();
    assert_eq!(truncate_leaf(&client, slot, None, 5).await.0, "rows");
    // A snapshot this cluster has not reached (another cluster's, or made up) proves nothing: the
    // leaf is read whole again, not only for the transactions such a snapshot could not see.
    assert_eq!(truncate_leaf(&client, slot, Some("999999999:999999999:"), 5).await.0, "rows");
    // Outside READ COMMITTED the look under the lock would not see what committed meanwhile.
    client.batch_execute("begin isolation level repeatable read").await.unwrap();
    let refused = client
        .query_one("select outcome from outbox_relay.truncate_leaf($1::int2, null, 5)", &[&slot])
        .await
        .unwrap_err();
    assert!(
        refused.as_db_error().is_some_and(|e| e.message().contains("only in a read committed transaction")),
        "{refused:?}"
    );
    client.batch_execute("rollback").await.unwrap();
    assert_eq!(count(&client, &format!("select count(*) from outbox_relay.outbox_{slot}")).await, 100);

    let held = db.client().await;
    held.batch_execute("begin; select txid_current()").await.unwrap();
    client.execute("delete from outbox_relay.outbox where slot = $1", &[&slot]).await.unwrap();
    let writer = db.client().await;
    writer
        .batch_execute(&format!(
            "begin; insert into outbox_relay.outbox (topic, payload, slot) values ('order.late', '{{}}', {slot})"
        ))
        .await
        .unwrap();
    // Nothing visible yet, but the writer's lock is held: refused, with the snapshot it checked.
    let (outcome, seen) = truncate_leaf(&client, slot, None, 5).await;
    assert_eq!(outcome, "locked");
    let seen = seen.expect("the snapshot the leaf was checked in");
    writer.batch_execute("commit").await.unwrap();
    // Under the lock, the rows of the transactions that snapshot could not see are looked for.
    assert_eq!(truncate_leaf(&client, slot, Some(&seen), 5).await.0, "rows");
    assert_eq!(count(&client, "select count(*) from outbox_relay.outbox where topic = 'order.late'").await, 1);

    client.execute("delete from outbox_relay.outbox where slot = $1", &[&slot]).await.unwrap();
    assert!(leaf_size(&client, slot).await > 0, "the removed rows stay on disk while the transaction is held");
    assert_eq!(truncate_leaf(&client, slot, None, 5).await.0, "truncated");
    assert_eq!(leaf_size(&client, slot).await, 0, "their disk is free, the transaction still held");
    assert_eq!(count(&held, "select 1::int8").await, 1);
    held.batch_execute("commit").await.unwrap();
    assert_eq!(truncate_leaf(&client, slot, None, 5).await.0, "empty");
}

/// A leaf two slots away from writers' whose 50 rows were deleted (their dead rows still on
/// disk: its slot and size), and 30 rows in the next leaf, kept.
async fn emptied_leaf_beside_rows(client: &tokio_postgres::Client) -> (i16, i64) {
    let slot = far_slot(client).await;
    let other = (slot + 1) % 4;
    client
        .execute(
            "insert into outbox_relay.outbox (topic, payload, slot)
             select 'order.placed', jsonb_build_object('n', g), case when g <= 50 then $1::int2 else $2::int2 end
               from generate_series(1, 80) g",
            &[&slot, &other],
        )
        .await
        .unwrap();
    client.execute("delete from outbox_relay.outbox where slot = $1", &[&slot]).await.unwrap();
    let size = leaf_size(client, slot).await;
    assert!(size > 0);
    (slot, size)
}

/// Terminates the one session named `name`.
async fn terminate(client: &tokio_postgres::Client, name: &str) {
    let ended: i64 = client
        .query_one(
            "select count(pg_terminate_backend(pid)) from pg_stat_activity where application_name = $1",
            &[&name],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(ended, 1, "one session named {name}");
}

/// A truncate whose session is terminated while it waits for the leaf's lock removes nothing,
/// neither in its leaf nor elsewhere; the next one, once the lock is free, frees the leaf.
#[tokio::test]
async fn a_truncate_killed_while_it_waits_for_its_lock_removes_nothing() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let (slot, size) = emptied_leaf_beside_rows(&client).await;
    let holder = db.client().await;
    holder.batch_execute(&format!("begin; lock table outbox_relay.outbox_{slot} in access share mode")).await.unwrap();

    let rotation = named_session(&db, "truncate_under_test").await;
    let waiting = tokio::spawn(async move { truncate_leaf(&rotation, slot, None, 60_000).await });
    eventually("the truncate waits for the leaf's lock", || async {
        count(
            &client,
            "select count(*) from pg_locks l join pg_stat_activity a on a.pid = l.pid
              where a.application_name = 'truncate_under_test' and not l.granted",
        )
        .await
            == 1
    })
    .await;
    terminate(&client, "truncate_under_test").await;
    assert!(waiting.await.is_err(), "the truncate's session ended under it");
    holder.batch_execute("commit").await.unwrap();
    assert_eq!(leaf_size(&client, slot).await, size, "nothing truncated");
    assert_eq!(count(&client, "select count(*) from outbox_relay.outbox").await, 30, "the other leaf's rows all there");
    assert_eq!(truncate_leaf(&client, slot, None, 5).await.0, "truncated");
    assert_eq!(count(&client, "select count(*) from outbox_relay.outbox").await, 30);
}

/// A session of its own, named so that the test can find its backend and terminate it.
async fn named_session(db: &TestDb, name: &str) -> tokio_postgres::Client {
    let separator = if db.url.contains('?') { '&' } else { '?' };
    let (client, connection) =
        tokio_postgres::connect(&format!("{}{separator}application_name={name}", db.url), tokio_postgres::NoTls)
            .await
            .unwrap();
    tokio::spawn(connection);
    client
}

/// A truncate whose session is terminated after it truncated the leaf, before its commit (a
/// relay killed between the two steps), leaves the leaf as it was: its removed rows still on disk,
/// every other row there, writers and the relay going on. The relay then delivers each event once,
/// and its rotation truncates the leaf.
#[tokio::test]
async fn a_truncate_terminated_before_its_commit_leaves_the_leaf_as_it_was() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let (slot, size) = emptied_leaf_beside_rows(&client).await;

    let rotation = named_session(&db, "truncate_before_commit").await;
    rotation.batch_execute("begin").await.unwrap();
    assert_eq!(truncate_leaf(&rotation, slot, None, 5).await.0, "truncated");
    terminate(&client, "truncate_before_commit").await;
    assert!(rotation.batch_execute("commit").await.is_err(), "the truncate's session ended before its commit");
    assert_eq!(leaf_size(&client, slot).await, size, "the leaf's file as it was: the truncate rolled back");
    assert_eq!(count(&client, "select count(*) from outbox_relay.outbox").await, 30, "the other leaf's rows all there");

    let (handler, mut deliveries) = recorder();
    let relay = support::start(&db.outbox, RelayConfig { retention: Duration::ZERO, ..config() }, handler);
    write_now(&client, 20).await;
    deliveries.take(50).await;
    eventually_within("the leaf truncated by the relay", Duration::from_secs(60), || async {
        leaf_size(&client, slot).await == 0
    })
    .await;
    let counts = deliveries.counts();
    assert_eq!(counts.len(), 50, "every event delivered");
    assert!(counts.values().all(|&n| n == 1), "each event delivered once");
    relay.stop().await;
}

/// Writes `n` events now, into the leaf of the current slot.
async fn write_now(client: &tokio_postgres::Client, n: i64) {
    client
        .execute(
            "insert into outbox_relay.outbox (topic, payload)
             select 'order.placed', jsonb_build_object('late', g) from generate_series(1, $1::int8) g",
            &[&n],
        )
        .await
        .unwrap();
}

/// Writes `n` events into the leaf of `slot` (by hand, a slot of their own), and waits until the
/// statistics count them (the rotation tries only a leaf they say has no live row: a try while they
/// are late finds rows and leaves the leaf for a minute).
async fn fill_leaf(client: &tokio_postgres::Client, slot: i16, n: i64) {
    client
        .execute(
            "insert into outbox_relay.outbox (topic, payload, slot)
             select 'order.placed', jsonb_build_object('n', g), $1 from generate_series(1, $2::int8) g",
            &[&slot, &n],
        )
        .await
        .unwrap();
    client.batch_execute("select pg_stat_force_next_flush()").await.unwrap();
    eventually("the statistics count the leaf's rows", || async {
        count(client, &format!("select pg_stat_get_live_tuples('outbox_relay.outbox_{slot}'::regclass)")).await >= n
    })
    .await;
}

/// A transaction held open the whole time: the relay delivers each event of a leaf writers no
/// longer use once, its sweeper removes them (retention 0), and the emptied leaf is truncated
/// under the hold: its disk is free, which range deletes alone leave to the end of the hold.
#[tokio::test]
async fn the_relay_truncates_a_leaf_it_emptied_while_a_transaction_is_held() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let slot = far_slot(&client).await;
    fill_leaf(&client, slot, 160).await;
    let held = db.client().await;
    held.batch_execute("begin; select txid_current()").await.unwrap();
    let (handler, mut deliveries) = recorder();
    let relay = support::start(&db.outbox, RelayConfig { retention: Duration::ZERO, ..config() }, handler);
    deliveries.take(160).await;
    eventually("the sweeper removed the delivered events", || async {
        count(&client, "select count(*) from outbox_relay.outbox").await == 0
    })
    .await;
    eventually("the emptied leaf truncated under the hold", || async { leaf_size(&client, slot).await == 0 }).await;
    assert!(deliveries.counts().values().all(|&n| n == 1), "each event delivered once");
    assert_eq!(count(&held, "select 1::int8").await, 1, "the held transaction goes on");
    held.batch_execute("commit").await.unwrap();
    relay.stop().await;
}

/// `set_slot_span` sets the span of the slots for the transactions that start from then on
/// (writers' plans are made again): with a span of one second, rows written over 2.5 s go into
/// three leaves or more. A span out of range is refused, saying so.
#[tokio::test]
async fn the_slots_span_is_set_and_checked() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let refused = client.batch_execute("select outbox_relay.set_slot_span(0)").await.unwrap_err();
    assert!(
        refused.as_db_error().is_some_and(|e| e.message() == "a slot's span must be 1 to 86400 seconds, not 0"),
        "{refused:?}"
    );
    let insert = client
        .prepare("insert into outbox_relay.outbox (topic, payload) values ('order.placed', '{}') returning slot")
        .await
        .unwrap();
    let before: i16 = client.query_one(&insert, &[]).await.unwrap().get(0);
    client.batch_execute("select outbox_relay.set_slot_span(1)").await.unwrap();
    let mut slots = std::collections::BTreeSet::new();
    for _ in 0..11 {
        slots.insert(client.query_one(&insert, &[]).await.unwrap().get::<_, i16>(0));
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(slots.len() >= 3, "rows went into several leaves after the span was set: {slots:?} (before: {before})");
    assert!(slots.iter().all(|s| (0..4).contains(s)), "{slots:?}");
}

/// With `pg_dump`'s lock on the outbox (ACCESS SHARE on every leaf, in a repeatable-read
/// snapshot) held, the rotation's truncate of a leaf the sweeper emptied is refused, delivery goes
/// on, and nothing is truncated under the dump; once the dump ends, the leaf is.
#[tokio::test]
async fn the_rotation_waits_for_pg_dump_while_delivery_goes_on() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let slot = far_slot(&client).await;
    fill_leaf(&client, slot, 20).await;
    let dump = db.client().await;
    support::hold_as_pg_dump(&dump).await;
    let (handler, mut deliveries) = recorder();
    let relay = support::start(&db.outbox, RelayConfig { retention: Duration::ZERO, ..config() }, handler);
    deliveries.take(20).await;
    eventually("the sweeper removed the delivered events", || async {
        count(&client, &format!("select count(*) from outbox_relay.outbox_{slot}")).await == 0
    })
    .await;
    // Long enough for the statistics to see the leaf emptied, and for tries of the rotation.
    tokio::time::sleep(Duration::from_secs(5)).await;
    write_now(&client, 20).await;
    deliveries.take(20).await;
    assert!(leaf_size(&client, slot).await > 0, "not truncated under the dump");
    assert!(support::outbox_share_locks(&client).await >= 1, "the dump's lock held throughout");
    dump.batch_execute("commit").await.unwrap();
    eventually_within("the emptied leaf truncated once the dump ended", Duration::from_secs(60), || async {
        leaf_size(&client, slot).await == 0
    })
    .await;
    assert!(deliveries.counts().values().all(|&n| n == 1), "each event delivered once");
    relay.stop().await;
}

/// Two relays with different settings (one sweeping at once in batches of 7 on one worker, the
/// other keeping a day's retention and leasing batches of 500), a transaction held open, events
/// in an old leaf and more written while they run: each event is delivered once, and the leaf
/// the first relay's sweeper empties is truncated under the hold, whichever relay's rotation
/// does it (their looks may refuse each other's lock once, then are tried again).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_relays_with_different_settings_rotate_beside_each_other() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let slot = far_slot(&client).await;
    fill_leaf(&client, slot, 300).await;
    let held = db.client().await;
    held.batch_execute("begin; select txid_current()").await.unwrap();
    let (handler, mut deliveries) = recorder();
    let second = pg_outbox_relay::Outbox::connect_with(db.database_url(), 8).await.unwrap();
    let relays = [
        support::start(
            &db.outbox,
            RelayConfig { retention: Duration::ZERO, batch_size: 7, workers: 1, ..config() },
            handler.labelled("sweeping"),
        ),
        support::start(
            &second,
            RelayConfig { retention: Duration::from_secs(86_400), batch_size: 500, hold: Duration::ZERO, ..config() },
            handler.labelled("keeping"),
        ),
    ];
    write_now(&client, 200).await;
    deliveries.take(500).await;
    eventually_within("the old leaf emptied and truncated under the hold", Duration::from_secs(60), || async {
        count(&client, &format!("select count(*) from outbox_relay.outbox_{slot}")).await == 0
            && leaf_size(&client, slot).await == 0
    })
    .await;
    assert_eq!(count(&held, "select 1::int8").await, 1, "the held transaction goes on");
    held.batch_execute("commit").await.unwrap();
    for relay in relays {
        relay.stop().await;
    }
    let counts = deliveries.counts();
    assert_eq!(counts.len(), 500, "every event delivered");
    assert!(counts.values().all(|&n| n == 1), "each event delivered once");
}
