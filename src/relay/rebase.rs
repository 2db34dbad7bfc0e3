//! Positions from another cluster (a restored dump: migration 0014), found at the start, by a
//! claim or by the sweeper, and replaced by fresh ones.

use std::sync::Arc;

use super::metrics::RelayMetrics;
use super::pool::RelayPool;
use crate::sql;

/// Starts fresh positions where they were taken in another cluster, counting it in `metrics`;
/// returns whether the positions can be trusted now (false: the rebase failed and is tried again
/// by whoever finds them next).
pub(crate) async fn rebase(pool: &RelayPool, metrics: &[Arc<RelayMetrics>]) -> bool {
    let rebased = async { sql::rebase_positions(&mut pool.client().await?).await };
    match rebased.await {
        Ok(Some(rebased)) => {
            metrics.iter().for_each(|m| m.positions_rebased());
            tracing::warn!(
                rows = rebased.events,
                why = %rebased.why,
                "the claim positions were taken in another cluster (a database restored from a dump, or moved \
                 without its transaction counter): every destination starts from fresh positions, and every event \
                 not yet finished is delivered as a new one (again to a destination that had passed it: consumers \
                 drop those by the event's uuid)"
            );
            true
        }
        // Trusted: another relay started them afresh first.
        Ok(None) => true,
        Err(e) => {
            tracing::warn!(error = %e, "starting fresh claim positions failed; nothing is claimed or finished on the old ones' word; trying again");
            false
        }
    }
}

/// At the start: the positions checked before any claim, and started afresh when foreign.
pub(crate) async fn check(pool: &RelayPool, metrics: &[Arc<RelayMetrics>]) -> crate::error::Result<()> {
    let foreign = sql::positions_foreign(&*pool.client().await?).await?;
    if foreign.ahead || foreign.moved {
        rebase(pool, metrics).await;
    }
    Ok(())
}
