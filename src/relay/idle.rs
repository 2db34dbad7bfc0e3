//! Going idle: linger, then mark the relay waiting so that writers start notifying it.
//!
//! Writers notify only when some relay is marked waiting (migration 0002): NOTIFY makes every
//! commit take a global lock, which costs throughput under many concurrent writers. So a relay
//! that runs out of work does not mark itself waiting at once. One of its workers *lingers*,
//! claiming every [`LINGER_POLL`], for `linger`; under sustained load it keeps finding work, never
//! marks itself waiting, and writers never notify. After a quiet `linger` the relay marks itself
//! waiting, and from then on the next insert wakes it through NOTIFY.
//!
//! The race: a writer whose trigger ran just before the mark committed saw no waiting relay, and
//! commits later without notifying. So right after the mark commits the relay notes every
//! transaction open at that moment (by virtual transaction id, which a transaction holds from its
//! start, before it has a real xid), waits until all of them have ended, and claims once more.
//! Any statement that ran its trigger after the mark saw it and notifies.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::Mutex;
use tokio::time::Instant;

use super::{Handler, Shared, worker};
use crate::error::{Error, Result};
use crate::sql;

/// How often a lingering worker claims.
pub(crate) const LINGER_POLL: Duration = Duration::from_millis(1);

/// The relay's waiting mark, as last written to `outbox_relay.relays`.
#[derive(Debug, Default)]
pub(crate) struct Idle {
    /// Held by the one worker that lingers for the whole relay.
    pub(crate) lingering: Mutex<()>,
    /// What the database row says; written only under this lock, so marks never reorder.
    marked: Mutex<bool>,
    /// A lock-free copy of `marked`, for the hot path.
    marked_hint: AtomicBool,
}

impl Idle {
    /// True when the relay may be marked waiting (writers notify).
    pub(crate) fn is_marked(&self) -> bool {
        self.marked_hint.load(Ordering::Acquire)
    }

    /// Writes the mark when it differs from what the database holds.
    pub(crate) async fn set<H: Handler>(&self, shared: &Shared<H>, waiting: bool) -> Result<()> {
        let mut marked = self.marked.lock().await;
        if *marked == waiting {
            return Ok(());
        }
        let client = shared.client().await?;
        if waiting {
            let pid = shared.listener_pid.load(Ordering::Acquire);
            client.execute(sql::RELAY_MARK_WAITING, &[&shared.relay_id, &pid]).await
        } else {
            client.execute(sql::RELAY_MARK_BUSY, &[&shared.relay_id]).await
        }
        .map_err(|e| Error::database("marking the relay waiting or busy", e))?;
        *marked = waiting;
        self.marked_hint.store(waiting, Ordering::Release);
        Ok(())
    }

    /// Forgets the mark: after a reconnect the database may have lost it (the table is unlogged),
    /// so the next `set(true)` writes it again.
    pub(crate) async fn forget(&self) {
        let mut marked = self.marked.lock().await;
        *marked = false;
        self.marked_hint.store(false, Ordering::Release);
    }
}

/// Lingers while work keeps coming, then marks the relay waiting and closes the race. Returns
/// when the relay is waiting (or stopping, or the listener is down and only the poll can help).
pub(crate) async fn linger<H: Handler>(shared: &Shared<H>) {
    let mut quiet_since = Instant::now();
    while quiet_since.elapsed() < shared.config.linger {
        tokio::select! {
            _ = shared.stop.cancelled() => return,
            _ = shared.work.notified() => {}
            _ = tokio::time::sleep(LINGER_POLL) => {}
        }
        match worker::claim_and_deliver(shared, false).await {
            Ok(0) => {}
            Ok(n) => {
                quiet_since = Instant::now();
                if n == shared.config.batch_size {
                    // A backlog: let the other workers help.
                    shared.work.notify_one();
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "claiming events failed while lingering");
                return;
            }
        }
    }
    if shared.stop.is_cancelled() || shared.listener_pid.load(Ordering::Acquire) == 0 {
        return; // no listener to hear a NOTIFY: the fallback poll and the reconnect catch-up cover it
    }
    if let Err(e) = go_waiting(shared).await {
        tracing::warn!(error = %e, "marking the relay waiting failed; the fallback poll covers it");
    }
}

async fn go_waiting<H: Handler>(shared: &Shared<H>) -> Result<()> {
    shared.idle.set(shared, true).await?;
    let open: Vec<String> = {
        let client = shared.client().await?;
        client
            .query_one(sql::TRANSACTIONS_OPEN, &[])
            .await
            .map_err(|e| Error::database("listing open transactions", e))?
            .get(0)
    };
    // Every transaction that might have run its trigger before the mark is in `open`. Wait for
    // them to end (bounded: a very long one is left to the fallback poll).
    let deadline = Instant::now() + shared.config.poll_interval;
    let mut pause = LINGER_POLL;
    while !open.is_empty() && Instant::now() < deadline {
        let still_open: i64 = {
            let client = shared.client().await?;
            client
                .query_one(sql::TRANSACTIONS_STILL_OPEN, &[&open])
                .await
                .map_err(|e| Error::database("checking open transactions", e))?
                .get(0)
        };
        if still_open == 0 {
            break;
        }
        tokio::select! {
            _ = shared.stop.cancelled() => return Ok(()),
            _ = tokio::time::sleep(pause) => {}
        }
        pause = (pause * 2).min(Duration::from_millis(20));
    }
    if worker::claim_and_deliver(shared, true).await? > 0 {
        // Work slipped in through the race: go round again (busy, then linger).
        shared.work.notify_one();
    }
    Ok(())
}
