//! A dump restored into another cluster: the positions it brings are the old cluster's
//! transaction snapshots. Two real clusters, `pg_dump -Fc` and `pg_restore`.

use std::path::PathBuf;
use std::process::Command;

use pg_outbox_relay::{NewEvent, Outbox};
use pg_outbox_relay_cluster::{EmbeddedOptions, EmbeddedPostgres};
use serde_json::json;

use super::until_delivered;
use crate::faults::connect;
use crate::relay_support::{self as support, config, count, recorder};

/// `pg_dump` or `pg_restore`: on PATH, else in the newest `/usr/lib/postgresql/*/bin`.
fn pg_tool(name: &str) -> PathBuf {
    let on_path = std::env::var_os("PATH")
        .map(|path| std::env::split_paths(&path).map(|dir| dir.join(name)).find(|p| p.is_file()))
        .unwrap_or_default();
    let versioned = || {
        let mut dirs: Vec<PathBuf> =
            std::fs::read_dir("/usr/lib/postgresql").ok()?.flatten().map(|e| e.path()).collect();
        dirs.sort();
        dirs.into_iter().rev().map(|dir| dir.join("bin").join(name)).find(|p| p.is_file())
    };
    on_path.or_else(versioned).unwrap_or_else(|| {
        panic!("{name} not found on PATH nor in /usr/lib/postgresql/*/bin: install the PostgreSQL client (postgresql-client)")
    })
}

fn run(tool: &str, args: &[&str]) {
    let out = Command::new(pg_tool(tool)).args(args).output().unwrap_or_else(|e| panic!("{tool}: {e}"));
    assert!(out.status.success(), "{tool} {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
}

async fn cluster() -> EmbeddedPostgres {
    tokio::task::spawn_blocking(|| EmbeddedPostgres::start(EmbeddedOptions::default()))
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("cannot start a private PostgreSQL: {e}"))
}

/// The URL of a new database `shop` on `pg`.
async fn shop(pg: &EmbeddedPostgres) -> String {
    connect(&pg.url()).await.batch_execute("create database shop").await.unwrap();
    pg.database_url().for_database("shop").to_connection_string()
}

/// Moves the cluster's transaction counter on by `n` (a subtransaction with a write each).
async fn burn_xids(url: &str, n: u32) {
    connect(url)
        .await
        .batch_execute(&format!(
            "create temporary table burn (n int);
             do $$ begin for i in 1..{n} loop begin insert into burn values (i); exception when others then null; end; end loop; end $$;"
        ))
        .await
        .unwrap();
}

async fn publish(outbox: &Outbox, topic: &str, n: usize) -> Vec<i64> {
    let events: Vec<NewEvent> =
        (0..n).map(|i| NewEvent::new(topic, json!({"n": i})).key(format!("k{}", i % 3))).collect();
    outbox.publish_all(&events).await.unwrap()
}

/// The old cluster's counter is 20,000 transactions ahead of the new one's; 20 events were
/// delivered there and 5 wait when it is dumped. Restored into the new cluster, 10 more events are
/// published (`counter_moved_past`: then the new cluster's counter is moved past the old one's,
/// so that only the cluster's identity tells the positions apart), and a relay starts: the 15
/// undelivered events arrive, each once, the 20 delivered ones are not sent again, and the relay
/// counts the fresh positions.
async fn restored(counter_moved_past: bool) {
    let (old, new) = (cluster().await, cluster().await);
    let old_url = shop(&old).await;
    let outbox = Outbox::connect(&old_url).await.unwrap();
    outbox.migrate().await.unwrap();
    burn_xids(&old_url, 20_000).await;
    let (handler, mut deliveries) = recorder();
    let relay = support::start(&outbox, config(), handler);
    let delivered = publish(&outbox, "order.placed", 20).await;
    until_delivered(&mut deliveries, &delivered).await;
    relay.stop().await;
    let pending = publish(&outbox, "order.pending", 5).await;
    outbox.pool().close();

    let dump = tempfile::NamedTempFile::new().unwrap();
    let dump_path = dump.path().to_str().unwrap().to_string();
    run("pg_dump", &["-Fc", "-d", &old_url, "-f", &dump_path]);
    let new_url = shop(&new).await;
    run("pg_restore", &["--no-owner", "-d", &new_url, &dump_path]);

    let outbox = Outbox::connect(&new_url).await.unwrap();
    outbox.migrate().await.unwrap();
    let fresh = publish(&outbox, "order.fresh", 10).await;
    if counter_moved_past {
        burn_xids(&new_url, 25_000).await;
        let client = connect(&new_url).await;
        let behind = "select count(*) from outbox_relay.positions
                       where pg_snapshot_xmax(snapshot) > pg_snapshot_xmax(pg_current_snapshot())";
        assert_eq!(count(&client, behind).await, 0, "the counter is past every restored position");
    }
    let (handler, mut deliveries) = recorder();
    let relay = support::start(&outbox, config(), handler);
    let expected: Vec<i64> = pending.iter().chain(&fresh).copied().collect();
    until_delivered(&mut deliveries, &expected).await;
    // One more through, so that anything sent twice by then has arrived.
    let last = publish(&outbox, "order.last", 1).await;
    until_delivered(&mut deliveries, &last).await;
    assert!(relay.snapshot().positions_rebased >= 1, "the relay counts the fresh positions");
    relay.stop().await;
    let counts = deliveries.counts();
    assert!(delivered.iter().all(|id| !counts.contains_key(id)), "delivered before the dump: not again {counts:?}");
    assert_eq!(counts.len(), expected.len() + 1, "{counts:?}");
    assert!(counts.values().all(|n| *n == 1), "nothing twice: {counts:?}");
    let client = connect(&new_url).await;
    let unfinished =
        count(&client, "select count(*) from outbox_relay.outbox where not outbox_relay.passed_by_all(xid, id)").await;
    assert_eq!(unfinished, 0, "every event finished");
    outbox.pool().close();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dump_restored_into_a_cluster_with_a_lower_counter_delivers_every_new_event() {
    restored(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dump_restored_into_another_cluster_whose_counter_then_moved_past_delivers_every_new_event() {
    restored(true).await;
}
