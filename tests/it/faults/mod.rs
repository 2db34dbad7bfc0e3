//! Real faults, no switches in the code: a PostgreSQL server restarted (fast and immediate) under
//! a running relay and writer, connections cut or stalled by a TCP proxy, many concurrent writers
//! racing on overlapping idempotency keys with injected failures, and a burst of notifications
//! while every worker is busy. (The relay process killed with SIGKILL is the command's test:
//! `cli/tests/it/killed.rs`.)
//!
//! Every wait is bounded (a wait that runs out is a failure) and no assertion depends on timing,
//! so a slow machine can only make these tests slower, and a fast one never makes them fail.

mod burst;
mod cut;
mod held;
mod proxy;
mod restart;
mod stalled;
mod writers;

use std::collections::HashMap;
use std::time::Duration;

use pg_outbox_relay::Outbox;
use tokio_postgres::{Client, NoTls};

use crate::orders::{PlaceOrder, TestError, place_order};

/// How long the tests wait for things that take a while even on a quiet machine (a whole backlog
/// drained, a server restarted); only a hang should ever reach it.
pub(super) const LONG_PATIENCE: Duration = Duration::from_secs(90);

pub(super) async fn connect(url: &str) -> Client {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await.expect("cannot connect");
    tokio::spawn(connection);
    client
}

// The orders write path shared by the writer tests: order, audit entry, receipt and event in one
// `execute`, with the idempotency key kept on the order too, so that every row can be traced to
// its key.

/// Places the order of `key` (always the same request for a key, [`PlaceOrder::for_key`]); with
/// `fail_after_writes` the unit of work fails after all of its writes. Returns the order id and
/// whether the call was a replay.
pub(super) async fn place(outbox: &Outbox, key: &str, fail_after_writes: bool) -> Result<(i64, bool), TestError> {
    let executed = place_order(outbox, key, &PlaceOrder::for_key(key), fail_after_writes).await?;
    Ok((executed.response.order_id, executed.replayed))
}

/// What the database holds for one idempotency key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct KeyRows {
    pub(super) orders: i64,
    pub(super) audit: i64,
    pub(super) receipts: i64,
    pub(super) events: i64,
    /// The order's id when there is exactly one order.
    pub(super) order_id: Option<i64>,
}

impl KeyRows {
    pub(super) fn all(&self, n: i64) -> bool {
        self.orders == n && self.audit == n && self.receipts == n && self.events == n
    }
}

pub(super) async fn rows_by_key(client: &Client, keys: &[String]) -> HashMap<String, KeyRows> {
    let rows = client
        .query(
            "select k.key,
                    (select count(*) from orders o where o.key = k.key),
                    (select count(*) from outbox_relay.audit a where a.idempotency_key = k.key),
                    (select count(*) from outbox_relay.idempotency i where i.key = k.key),
                    (select count(*) from outbox_relay.outbox e where e.payload->>'key' = k.key),
                    (select min(o.id) from orders o where o.key = k.key)
               from unnest($1::text[]) as k(key)",
            &[&keys],
        )
        .await
        .unwrap();
    rows.iter()
        .map(|r| {
            let orders: i64 = r.get(1);
            let rows = KeyRows {
                orders,
                audit: r.get(2),
                receipts: r.get(3),
                events: r.get(4),
                order_id: if orders == 1 { r.get(5) } else { None },
            };
            (r.get(0), rows)
        })
        .collect()
}

/// Asserts that orders, audit entries, receipts and events match one to one: equal counts, and no
/// row of one kind without its partners (an event whose payload names a missing order, an audit
/// entry or receipt of another order, an order without its event...). Returns the common count.
pub(super) async fn assert_no_orphans(client: &Client) -> i64 {
    let row = client
        .query_one(
            "select (select count(*) from orders),
                    (select count(*) from outbox_relay.audit),
                    (select count(*) from outbox_relay.idempotency),
                    (select count(*) from outbox_relay.outbox),
                    (select count(*) from outbox_relay.outbox e
                      where not exists (select 1 from orders o
                                         where o.id = (e.payload->>'order_id')::int8 and o.key = e.payload->>'key')),
                    (select count(*) from outbox_relay.audit a
                      where not exists (select 1 from orders o
                                         where o.id::text = a.entity_id and o.key = a.idempotency_key)),
                    (select count(*) from outbox_relay.idempotency i
                      where not exists (select 1 from orders o
                                         where o.key = i.key and (i.response->>'order_id')::int8 = o.id)),
                    (select count(*) from orders o
                      where not exists (select 1 from outbox_relay.outbox e where (e.payload->>'order_id')::int8 = o.id)
                         or not exists (select 1 from outbox_relay.audit a where a.entity_id = o.id::text)
                         or not exists (select 1 from outbox_relay.idempotency i where i.key = o.key)),
                    (select count(*) from (select key from orders group by key having count(*) > 1) d)",
            &[],
        )
        .await
        .unwrap();
    let [orders, audit, receipts, events, orphan_events, orphan_audit, orphan_receipts, incomplete_orders, dup_keys]: [i64;
        9] = std::array::from_fn(|i| row.get(i));
    assert_eq!(orphan_events, 0, "events whose payload names no order");
    assert_eq!(orphan_audit, 0, "audit entries without their order");
    assert_eq!(orphan_receipts, 0, "receipts without their order (or answering with another order)");
    assert_eq!(incomplete_orders, 0, "orders missing their event, audit entry or receipt");
    assert_eq!(dup_keys, 0, "keys with more than one order");
    assert_eq!((orders, audit, receipts), (events, events, events), "orders, audit entries, receipts and events");
    events
}
