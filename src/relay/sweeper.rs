//! The sweeper: removes, in bulk, the outbox rows that every destination has passed once their
//! retention is over (migration 0019: delivery writes no outbox row, so this is where rows go).
//!
//! A row that no destination's pattern matches goes to the dead letters of the destination '' as
//! it goes, saying so. The sweeper goes on from where it ended (a transaction id), so it never
//! walks again over the rows it removed, and reads at most a batch a sweep, and only rows whose
//! retention is over: a destination that is down (whose position holds rows) costs a batch's
//! read a second, not its backlog's, and the retained rows cost nothing. After a full batch it
//! sweeps again at once, so that a drain's rows go at the pace they came. Then (at most once a
//! second) it truncates the outbox's leaves it has emptied (src/relay/rotation.rs).

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::config::RelayConfig;
use super::pool::RelayPool;
use super::rotation::Rotation;
use crate::sql;

/// How often the sweeper looks when its last look found less than a batch.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// The sweeper and what it needs.
pub(crate) struct Sweeper {
    pub(crate) pool: RelayPool,
    pub(crate) config: RelayConfig,
    /// Every destination's counters (a rebase of the positions counts in each).
    pub(crate) metrics: Vec<std::sync::Arc<super::RelayMetrics>>,
}

impl Sweeper {
    pub(crate) async fn run(self, stop: CancellationToken) {
        let batch = i64::try_from(self.config.janitor_batch.max(1)).unwrap_or(i64::MAX);
        let mut from = sql::SweepFrom::default();
        let mut failing = false;
        let mut locked = Locked::default();
        let mut rotation = Rotation::default();
        loop {
            let swept =
                async { sql::sweep_outbox(&*self.pool.client().await?, &from, batch, self.config.retention).await };
            let mut pause = SWEEP_EVERY;
            match swept.await {
                Ok(swept) => {
                    if failing {
                        tracing::info!("sweeping the outbox works again");
                        failing = false;
                    }
                    if swept.foreign_positions {
                        // Nothing was finished on their word; fresh positions, and sweep anew.
                        if super::rebase::rebase(&self.pool, &self.metrics).await {
                            from = sql::SweepFrom::default();
                            rotation.forget();
                            continue;
                        }
                    }
                    locked.saw(swept.locked, self.config.poll_interval);
                    if swept.unrouted > 0 {
                        tracing::warn!(
                            events = swept.unrouted,
                            "events that no destination's pattern matches went to the dead letters (destination ''); \
                             add a route for them and retry them with outbox-relay dead-letters retry"
                        );
                    }
                    if swept.finished > 0 {
                        tracing::debug!(
                            events = swept.finished,
                            "removed events every destination passed, past their retention"
                        );
                    }
                    let moved = swept.next.as_ref().is_some_and(|next| next.moved_from(&from));
                    if swept.read >= batch && moved {
                        // A backlog it can get through (not a destination that holds it): on.
                        pause = Duration::ZERO;
                    }
                    if let Some(next) = swept.next {
                        from = next;
                    }
                }
                // Once per streak: the rows wait, and are finished when it works again.
                Err(e) if !failing => {
                    failing = true;
                    tracing::warn!(error = %e, "sweeping the outbox failed; events every destination passed stay past their retention until it works (trying every second)");
                }
                Err(e) => tracing::debug!(error = %e, "sweeping the outbox failed again"),
            }
            rotation.turn(&self.pool, self.config.retention).await;
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(pause) => {}
            }
        }
    }
}

/// Outbox rows the sweeper found locked by another session (every destination has passed them,
/// but a `select ... for update` holds them): a warning once they stay locked past the poll
/// interval, and word when they are free again.
#[derive(Default)]
struct Locked {
    since: Option<tokio::time::Instant>,
    warned: bool,
}

impl Locked {
    fn saw(&mut self, rows: i64, poll: Duration) {
        if rows <= 0 {
            if self.warned {
                tracing::info!("the outbox rows another session held locked are free again and finished");
            }
            *self = Locked::default();
            return;
        }
        let since = *self.since.get_or_insert_with(tokio::time::Instant::now);
        if !self.warned && since.elapsed() >= poll {
            self.warned = true;
            tracing::warn!(
                rows,
                held_for = ?since.elapsed(),
                "outbox rows every destination has passed are locked by another session (a select ... for update \
                 on outbox_relay.outbox?); deliveries go on, and the rows are finished once the lock is released"
            );
        }
    }
}
