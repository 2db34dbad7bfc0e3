//! The rotation (migration 0024): truncates the outbox's leaves the sweeper has emptied.
//!
//! The outbox is list-partitioned by `slot`, the writing transaction's slot of the clock (four
//! slots of `span` seconds, used in turn). The sweeper removes rows by range deletes, which leave
//! dead rows on disk for as long as any older snapshot is held; once nothing in a leaf is visible
//! any more, a truncate frees all of it, whatever is held. So after its sweeps (at most once a
//! second) the sweeper looks at the leaves, and tries each one that writers no longer use (not
//! the current slot's, nor the last one's in the first minute of this one, nor the next one's in
//! the minute before it), has pages, and that the statistics say has no live row
//! (`outbox_relay.truncate_leaf` checks for itself: it truncates only a leaf in which nothing is
//! visible, so it removes nothing the sweeper has not).
//!
//! The truncate needs the leaf's ACCESS EXCLUSIVE lock, which every claim in flight holds a share
//! of (a claim reads every leaf), and a dump for its whole length: it waits for it at most a few
//! milliseconds (5, doubling up to 100 after each refusal; claims queue behind the request
//! meanwhile), never queued behind a reader for longer, and tries again a second later, then
//! twice as long after each refusal up to 30 s (a dump refuses it for its whole length). A leaf
//! refused for a minute is said at warn, with who holds the locks.

use std::collections::HashMap;
use std::time::Duration;

use tokio::time::Instant;

use super::pool::RelayPool;
use crate::sql::{self, Truncation};

/// How long a truncate first waits for its lock, in milliseconds.
const LOCK_WAIT_FIRST_MS: i32 = 5;
/// The most a truncate waits for its lock, in milliseconds: what a claim may wait behind it.
const LOCK_WAIT_MAX_MS: i32 = 100;
/// How often the leaves are looked at.
const LOOK_EVERY: Duration = Duration::from_secs(1);
/// How long a leaf found with visible rows is left alone (the statistics that said otherwise
/// were late, or rows were written since).
const AFTER_ROWS: Duration = Duration::from_secs(60);
/// The longest a leaf refused its lock waits for its next try (after 1 s, then twice as long
/// after each refusal): a dump refuses it for its whole length.
const LOCKED_RETRY_MAX: Duration = Duration::from_secs(30);
/// How long a leaf's lock is refused before the rotation says so at warn.
const LOCKED_WARNING_AFTER: Duration = Duration::from_secs(60);

/// The rotation's memory of each leaf between its looks.
#[derive(Default)]
pub(crate) struct Rotation {
    tries: HashMap<i16, Try>,
    last_look: Option<Instant>,
    failing: bool,
    warned_span: bool,
}

/// One leaf's tries.
#[derive(Default)]
struct Try {
    /// The snapshot in which nothing in it was visible (an earlier try, refused its lock).
    seen: Option<String>,
    wait_ms: i32,
    refusals: u32,
    not_before: Option<Instant>,
    locked_since: Option<Instant>,
    warned: bool,
}

impl Rotation {
    /// Truncates the leaves the sweeper has emptied, at most once every [`LOOK_EVERY`].
    pub(crate) async fn turn(&mut self, pool: &RelayPool, retention: Duration) {
        let now = Instant::now();
        if self.last_look.is_some_and(|at| now.duration_since(at) < LOOK_EVERY) {
            return;
        }
        self.last_look = Some(now);
        match self.look(pool, retention).await {
            Ok(()) if self.failing => {
                tracing::info!("truncating the outbox's emptied leaves works again");
                self.failing = false;
            }
            Ok(()) => {}
            Err(e) => {
                self.forget();
                if self.failing {
                    tracing::debug!(error = %e, "truncating the outbox's emptied leaves failed again");
                } else {
                    self.failing = true;
                    tracing::warn!(
                        error = %e,
                        "could not truncate the outbox's emptied leaves; the sweeper's range deletes go on, and the \
                         disk they leave is reused once no older snapshot is held (trying every second)"
                    );
                }
            }
        }
    }

    /// Forgets every leaf's tries (their snapshots are this cluster's: after a rebase of the
    /// positions, the database may be another one).
    pub(crate) fn forget(&mut self) {
        self.tries.clear();
    }

    async fn look(&mut self, pool: &RelayPool, retention: Duration) -> crate::error::Result<()> {
        let mut client = pool.client().await?;
        let leaves = sql::outbox_leaves(&*client).await?;
        if let Some(span) = leaves.first().map(|l| Duration::from_secs(u64::try_from(l.span_seconds).unwrap_or(0))) {
            self.warn_of_span(span, retention);
        }
        for leaf in leaves {
            let t = self.tries.entry(leaf.slot).or_default();
            if leaf.near || !leaf.used {
                *t = Try::default();
                continue;
            }
            if (t.seen.is_none() && leaf.live > 0) || t.not_before.is_some_and(|at| Instant::now() < at) {
                continue;
            }
            let wait = t.wait_ms.max(LOCK_WAIT_FIRST_MS);
            // READ COMMITTED whatever the session's default: the look under the lock must see what
            // committed while the lock was waited for (the function refuses otherwise).
            let tx = client
                .build_transaction()
                .isolation_level(tokio_postgres::IsolationLevel::ReadCommitted)
                .start()
                .await
                .map_err(|e| crate::error::Error::database("starting a transaction", e))?;
            let tried = sql::truncate_leaf(&tx, leaf.slot, t.seen.as_deref(), wait).await?;
            tx.commit().await.map_err(|e| crate::error::Error::database("committing a truncate", e))?;
            match tried {
                Truncation::Truncated => {
                    tracing::info!(
                        slot = leaf.slot,
                        freed_bytes = leaf.bytes,
                        "truncated an outbox leaf the sweeper had emptied: its disk is free"
                    );
                    *t = Try::default();
                }
                Truncation::Empty => *t = Try::default(),
                Truncation::Rows => *t = Try { not_before: Some(Instant::now() + AFTER_ROWS), ..Try::default() },
                Truncation::Locked { seen } => {
                    t.seen = seen;
                    t.wait_ms = (wait * 2).min(LOCK_WAIT_MAX_MS);
                    let retry = Duration::from_secs(1u64 << t.refusals.min(5)).min(LOCKED_RETRY_MAX);
                    t.refusals += 1;
                    t.not_before = Some(Instant::now() + retry);
                    let since = *t.locked_since.get_or_insert_with(Instant::now);
                    if !t.warned && since.elapsed() >= LOCKED_WARNING_AFTER {
                        t.warned = true;
                        let holders = sql::leaf_lock_holders(&client, leaf.slot)
                            .await
                            .unwrap_or_else(|e| format!("who holds it could not be read: {e}"));
                        tracing::warn!(
                            slot = leaf.slot,
                            bytes = leaf.bytes,
                            refused_for = ?since.elapsed(),
                            "an outbox leaf the sweeper has emptied cannot be truncated: its lock is not granted \
                             (a dump, claims that stay open, a prepared transaction); its disk is freed once they \
                             end: {holders}"
                        );
                    }
                }
            }
        }
        Ok(())
    }

    /// Says once when the retention is longer than the leaves can keep apart: a leaf's slot comes
    /// round again (4 spans, less the minute before it) before the retention of the rows written
    /// at its end is over, so the leaf is never empty, and only range deletes remain (whose disk a
    /// held snapshot keeps).
    fn warn_of_span(&mut self, span: Duration, retention: Duration) {
        if self.warned_span || span.is_zero() || retention + span + span.min(Duration::from_secs(60)) <= span * 4 {
            return;
        }
        self.warned_span = true;
        tracing::warn!(
            retention = %humantime::format_duration(retention),
            slot_span = %humantime::format_duration(span),
            "the retention is longer than the outbox's leaves keep apart (3 slots of the span, less a minute): \
             a leaf's slot comes round again before its rows' retention is over, so it is never emptied and never \
             truncated, and a held snapshot keeps what the sweeper removes; make the span longer: \
             select outbox_relay.set_slot_span(seconds)"
        );
    }
}
