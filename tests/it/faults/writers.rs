//! Concurrent writers, overlapping keys, injected failures.

use std::collections::BTreeMap;

use super::{LONG_PATIENCE, assert_no_orphans, place, rows_by_key};
use crate::harness::TestDb;
use crate::orders::{ORDERS_TABLE, TestError};

/// Fault: 8 tasks run 400 `execute` calls over 60 keys (so the same key is often in flight in
/// several tasks at once), each call failing on purpose after all of its writes one time in five
/// (and every call for 4 of the keys, so that some keys only ever fail). Every key always carries
/// the same request, so no call is refused as a reused key.
///
/// Proves: per key exactly one order, audit entry, receipt and event exist when any call for it
/// succeeded, and none when every call failed; exactly one call per key did the work and every
/// other success was a replay of the same order; totals match and nothing is orphaned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_path_under_concurrency_with_overlapping_keys_and_injected_failures() {
    const TASKS: usize = 8;
    const OPS_PER_TASK: usize = 50;
    const KEYS: usize = 60;
    // Every call for these keys fails: they must end with nothing at all.
    const DOOMED: usize = 4;
    let db = TestDb::new().await;
    let client = db.client().await;
    client.batch_execute(ORDERS_TABLE).await.unwrap();

    let tasks: Vec<_> = (0..TASKS)
        .map(|_| {
            let outbox = db.outbox.clone();
            tokio::spawn(async move {
                let mut results = Vec::new();
                for _ in 0..OPS_PER_TASK {
                    let k = rand::random_range(0..KEYS);
                    let key = format!("key-{k:02}");
                    let fail = k < DOOMED || rand::random::<f64>() < 0.2;
                    let result = match place(&outbox, &key, fail).await {
                        Ok(placed) => Some(placed),
                        Err(TestError::Injected) => None,
                        Err(TestError::Outbox(e)) => panic!("{key}: unexpected error {e}"),
                        Err(TestError::Sqlx(e)) => panic!("{key}: unexpected error {e}"),
                    };
                    results.push((key, fail, result));
                }
                results
            })
        })
        .collect();
    let mut by_key: BTreeMap<String, Vec<Option<(i64, bool)>>> = BTreeMap::new();
    for task in tasks {
        let results = tokio::time::timeout(LONG_PATIENCE, task).await.expect("writers finish").unwrap();
        for (key, _, result) in results {
            by_key.entry(key).or_default().push(result);
        }
    }

    let keys: Vec<String> = (0..KEYS).map(|k| format!("key-{k:02}")).collect();
    let state = rows_by_key(&client, &keys).await;
    let (mut placed_keys, mut failed_keys, mut replays) = (0, 0, 0);
    for key in &keys {
        let rows = state[key];
        let successes: Vec<(i64, bool)> = by_key.get(key).into_iter().flatten().flatten().copied().collect();
        if successes.is_empty() {
            assert!(rows.all(0), "{key}: every call failed (or none ran), yet the database holds {rows:?}");
            failed_keys += usize::from(by_key.contains_key(key));
            continue;
        }
        placed_keys += 1;
        assert!(rows.all(1), "{key}: exactly one order, audit entry, receipt and event: {rows:?}");
        let fresh = successes.iter().filter(|(_, replayed)| !replayed).count();
        assert_eq!(fresh, 1, "{key}: exactly one call did the work: {successes:?}");
        replays += successes.len() - 1;
        assert!(
            successes.iter().all(|(order_id, _)| Some(*order_id) == rows.order_id),
            "{key}: every success answers with the stored order {:?}: {successes:?}",
            rows.order_id
        );
    }
    let total = assert_no_orphans(&client).await;
    assert_eq!(total as usize, placed_keys);
    assert!(
        failed_keys >= 1 && placed_keys >= KEYS / 2,
        "both outcomes occurred: {failed_keys} failed, {placed_keys} placed"
    );
    let calls: usize = by_key.values().map(Vec::len).sum();
    let injected = by_key.values().flatten().filter(|r| r.is_none()).count();
    assert_eq!(calls, TASKS * OPS_PER_TASK);
    eprintln!(
        "{calls} calls over {} keys: {placed_keys} keys placed, {failed_keys} keys with only failed calls, \
         {injected} injected failures, {replays} replays",
        by_key.len()
    );
}
