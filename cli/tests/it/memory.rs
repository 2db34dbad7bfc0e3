//! The relay's memory follows its batch, not the size of the events: a claim takes at most
//! `--batch-bytes` of payload (8 MiB by default) past its first event.

use std::process::Stdio;

use tokio::process::Command;

use crate::binary::BIN;
use crate::harness::TestDb;
use crate::relay_support::{count, eventually_within};

/// The peak resident memory of a process (`VmHWM`), in bytes.
fn peak_memory(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("the process's status");
    let kib: u64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc/PID/status");
    kib * 1024
}

/// 500 events of nearly a megabyte each (the largest payload `publish` takes), written in one
/// transaction, drained to stdout by a relay with its defaults: its peak resident memory stays
/// under 200 MB (it reached 1.1 GB when claims were bounded by events alone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_of_a_megabyte_are_drained_within_bounded_memory() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "insert into outbox_relay.outbox (topic, payload)
             select 'blob.stored', jsonb_build_object('n', g, 'blob', repeat(md5(g::text), 32000))
               from generate_series(1, 500) g",
        )
        .await
        .unwrap();
    let mut relay = Command::new(BIN)
        .args(["run", "--sink", "stdout"])
        .env("DATABASE_URL", &db.url)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("cannot start outbox-relay run");
    let pid = relay.id().expect("running");
    let done = "select count(*) from outbox_relay.outbox where outbox_relay.passed_by_all(xid, id)";
    eventually_within("500 events of a megabyte delivered", std::time::Duration::from_secs(240), || async {
        count(&client, done).await == 500
    })
    .await;
    let peak = peak_memory(pid);
    relay.kill().await.unwrap();
    assert!(peak < 200 << 20, "the relay's peak resident memory was {} MiB", peak >> 20);
}
