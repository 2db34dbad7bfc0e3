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
//!
//! That wait can be long (a report running for minutes anywhere in the database), so it runs in
//! a task of its own ([`close_race`]) and holds nothing: meanwhile the relay stays marked
//! waiting, writers notify it, and a worker that finds work, marks the relay busy and runs out
//! again can linger and mark it anew. A new mark replaces the set being waited for: it holds
//! every transaction of the old set still open, and the claim after it sees what the others
//! committed.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::{Mutex, watch};
use tokio::time::Instant;

use super::{Handler, Shared, worker};
use crate::error::{Error, Result};
use crate::sql;

/// How often a lingering worker claims.
pub(crate) const LINGER_POLL: Duration = Duration::from_millis(1);
/// The longest pause between two checks of whether the transactions open at the mark ended.
const CLOSE_POLL_MAX: Duration = Duration::from_millis(250);

/// The relay's waiting mark, as last written to `outbox_relay.relays`.
#[derive(Debug)]
pub(crate) struct Idle {
    /// Held by the one worker that lingers for the whole relay.
    pub(crate) lingering: Mutex<()>,
    /// What the database row says; written only under this lock, so marks never reorder.
    marked: Mutex<bool>,
    /// A lock-free copy of `marked`, for the hot path.
    marked_hint: AtomicBool,
    /// The virtual transaction ids open right after the latest mark, for [`close_race`].
    open_at_mark: watch::Sender<Vec<String>>,
}

impl Default for Idle {
    fn default() -> Self {
        Idle {
            lingering: Mutex::default(),
            marked: Mutex::default(),
            marked_hint: AtomicBool::default(),
            open_at_mark: watch::Sender::new(Vec::new()),
        }
    }
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

/// Marks the relay waiting and hands the transactions open at that moment to [`close_race`].
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
    shared.idle.open_at_mark.send_replace(open);
    Ok(())
}

/// Waits, for each mark, until every transaction open right after it has ended, then wakes a
/// worker for one more claim: what such a transaction committed may have notified nobody.
pub(crate) async fn close_race<H: Handler>(shared: Arc<Shared<H>>) {
    let mut marks = shared.idle.open_at_mark.subscribe();
    loop {
        tokio::select! {
            _ = shared.stop.cancelled() => return,
            changed = marks.changed() => if changed.is_err() { return },
        }
        'mark: loop {
            let open = marks.borrow_and_update().clone();
            let mut pause = LINGER_POLL;
            while !open.is_empty() {
                match still_open(&shared, &open).await {
                    Ok(0) => break,
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(error = %e, "checking the transactions open at the waiting mark failed; claiming anyway");
                        break;
                    }
                }
                tokio::select! {
                    _ = shared.stop.cancelled() => return,
                    _ = tokio::time::sleep(pause) => {}
                    // A newer mark: wait for its transactions instead.
                    changed = marks.changed() => if changed.is_ok() { continue 'mark } else { return },
                }
                pause = (pause * 2).min(CLOSE_POLL_MAX);
            }
            break;
        }
        shared.work.notify_one();
    }
}

async fn still_open<H: Handler>(shared: &Shared<H>, open: &[String]) -> Result<i64> {
    let client = shared.client().await?;
    let row = client
        .query_one(sql::TRANSACTIONS_STILL_OPEN, &[&open])
        .await
        .map_err(|e| Error::database("checking open transactions", e))?;
    Ok(row.get(0))
}
