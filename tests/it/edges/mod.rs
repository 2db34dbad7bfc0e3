//! Storage edges that once lost events or repeated them (issue 38): a dump restored into another
//! cluster, ids reused after a truncate, a transaction of more events than the sweeper reads at
//! once, leases under a hold, a row locked by another session, prepared transactions, a
//! destination dropped under its relay, a sequence that hands out ids in blocks, events of
//! megabytes, and parked backlogs.

mod dropped;
mod held;
mod ids;
mod leases;
mod locks;
mod parked;
mod prepared;
mod restore;
mod sweeper;

use std::collections::HashSet;

use crate::relay_support::Deliveries;

/// Takes deliveries until every id of `ids` has arrived; returns them in arrival order.
pub(super) async fn until_delivered(deliveries: &mut Deliveries, ids: &[i64]) -> Vec<i64> {
    let mut missing: HashSet<i64> = ids.iter().copied().collect();
    let mut arrived = Vec::new();
    while !missing.is_empty() {
        let delivered = deliveries.next().await;
        missing.remove(&delivered.event.id);
        arrived.push(delivered.event.id);
    }
    arrived
}
