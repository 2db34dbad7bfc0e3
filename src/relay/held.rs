//! A held claim: the claim's transaction stays open on a connection of its own while its batch
//! is delivered, and its row locks are the lease.
//!
//! That is the cheapest way to own a batch: the claim writes nothing, and the outcome (for most
//! events a delete) is the rows' only change, committed with the transaction. A relay that dies
//! ends its session, so the server rolls back and the events are claimable at once, with no lease
//! to wait out; a relay that stalls without dying is cut off by the session's
//! `idle_in_transaction_session_timeout` (the lease). Since an open transaction holds back vacuum
//! and a pool connection, a delivery that outlives `hold` turns the claim into a lease and
//! commits (see `claim.rs`).
//!
//! The connection goes back to the pool only after the transaction ended cleanly. On any error,
//! and when a `Held` is dropped unfinished (a worker abandoned at shutdown), the connection is
//! taken out of the pool and closed: the server then rolls the transaction back.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// The savepoint a batch is read ahead in, while the transaction's last batch is delivered.
pub(crate) const READ_AHEAD: &str = "savepoint read_ahead";
/// Undoes the claim of a batch read ahead (its events are new again).
const UNDO_READ_AHEAD: &str = "rollback to savepoint read_ahead";
/// Keeps what the claim read ahead took: the savepoint's work is the transaction's.
pub(crate) const ADOPT_READ_AHEAD: &str = "release savepoint read_ahead";

/// An open transaction holding claimed rows, on a pooled connection.
pub(crate) struct Held {
    client: Option<deadpool_postgres::Object>,
    /// Set while the transaction holds the new events' lock.
    new_lock: Option<NewLock>,
    /// A batch read ahead in this transaction (`Claims::read_ahead`) is not delivered yet: its
    /// claim is undone (rolled back to its savepoint) before anything else commits.
    read_ahead: bool,
    /// Deliveries of an earlier batch of this transaction were recorded early under its token:
    /// whatever commits it forgets those records.
    recorded_early: bool,
}

/// The new events' lock as this relay sees it: since when one of its transactions holds it, and
/// whether a claim of the relay's was turned away meanwhile. One mutex guards both, so that a
/// claim that finds the lock taken and says so cannot fall between the holder's release and its
/// look at what was wanted: either the claim finds the lock free and claims itself, or the
/// holder, once done, finds the claim's word and claims again.
#[derive(Debug, Default)]
pub(crate) struct NewLockState {
    since: Option<Instant>,
    wanted: bool,
}

/// Shared by a relay's claims.
pub(crate) type SharedNewLock = Arc<Mutex<NewLockState>>;

/// While a relay's transaction holds the new events' lock, its other claims need not look for
/// new events: the lock would turn them away. Cleared when the transaction ends (the `Held` is
/// finished or dropped).
pub(crate) struct NewLock(SharedNewLock);

impl NewLock {
    fn state(shared: &SharedNewLock) -> std::sync::MutexGuard<'_, NewLockState> {
        shared.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a transaction of this relay has held the lock for less than `patience` (past it
    /// claims look again: the transaction's session may be gone, the server having terminated
    /// it, and with it the lock); if so, notes that a claim wanted new events, for the holder.
    pub(crate) fn in_hand_or_wanted(shared: &SharedNewLock, patience: Duration) -> bool {
        let mut state = Self::state(shared);
        let in_hand = state.since.is_some_and(|at| at.elapsed() < patience);
        state.wanted |= in_hand;
        in_hand
    }

    /// Whether a transaction of this relay holds the lock now (the fast path waits for it to end).
    pub(crate) fn held(shared: &SharedNewLock) -> bool {
        Self::state(shared).since.is_some()
    }

    /// Notes that a claim was turned away by the lock (held by another relay's transaction).
    pub(crate) fn wanted(shared: &SharedNewLock) {
        Self::state(shared).wanted = true;
    }

    /// Whether a claim wanted new events since this was last asked; asked by the holder after
    /// its transaction ended.
    pub(crate) fn take_wanted(shared: &SharedNewLock) -> bool {
        std::mem::take(&mut Self::state(shared).wanted)
    }
}

impl Drop for NewLock {
    fn drop(&mut self) {
        Self::state(&self.0).since = None;
    }
}

impl Held {
    /// Begins a transaction on `client` and runs `claim` in it, pipelined (one round trip);
    /// returns the open transaction and what `claim` returned.
    pub(crate) async fn begin<T, F>(client: deadpool_postgres::Object, claim: F) -> Result<(Held, T)>
    where
        F: AsyncFnOnce(&deadpool_postgres::ClientWrapper) -> Result<T>,
    {
        let held = Held { client: Some(client), new_lock: None, read_ahead: false, recorded_early: false };
        // BEGIN is sent on the first poll, before the claim's first message. READ COMMITTED
        // whatever the session's default: each claim statement reads the position and the new
        // events with a snapshot of its own, and must see what the last claim committed.
        let (begun, claimed) =
            futures::join!(held.db().batch_execute("begin isolation level read committed"), claim(held.db()));
        begun.map_err(|e| Error::database("beginning a claim's transaction", e))?;
        Ok((held, claimed?))
    }

    /// Notes in `taken` that this transaction holds the new events' lock, until it ends.
    pub(crate) fn holds_new_lock(&mut self, taken: &SharedNewLock) {
        NewLock::state(taken).since = Some(Instant::now());
        self.new_lock = Some(NewLock(taken.clone()));
    }

    /// Whether this transaction holds the new events' lock.
    pub(crate) fn has_new_lock(&self) -> bool {
        self.new_lock.is_some()
    }

    /// Notes whether a batch read ahead in this transaction, inside the savepoint
    /// [`READ_AHEAD`], waits for its delivery: until it is adopted, a commit undoes its claim.
    pub(crate) fn set_read_ahead(&mut self, pending: bool) {
        self.read_ahead = pending;
    }

    /// Notes that deliveries of this transaction's batch were recorded early (under its token).
    pub(crate) fn set_recorded_early(&mut self) {
        self.recorded_early = true;
    }

    /// Whether deliveries of this transaction were recorded early by an earlier batch of it.
    pub(crate) fn recorded_early(&self) -> bool {
        self.recorded_early
    }

    /// The connection, inside the transaction.
    pub(crate) fn db(&self) -> &deadpool_postgres::ClientWrapper {
        self.client.as_ref().expect("a Held has its connection until it is finished")
    }

    /// Runs `writes` (whose statements must be prepared on this connection already, so that
    /// each is sent on its first poll) and COMMIT after them, pipelined: one round trip. The
    /// connection goes back to the pool when both succeed.
    pub(crate) async fn commit_after<T, F>(mut self, writes: F) -> Result<T>
    where
        F: AsyncFnOnce(&deadpool_postgres::ClientWrapper) -> Result<T>,
    {
        let db = self.db();
        // A batch read ahead and not delivered goes back first: its events are new again once
        // this commits (the statements are sent in the order they are polled).
        let undo = async {
            if self.read_ahead {
                db.batch_execute(UNDO_READ_AHEAD)
                    .await
                    .map_err(|e| Error::database("undoing a claim read ahead", e))?;
            }
            Ok::<_, Error>(())
        };
        let (undone, written, committed) = futures::join!(undo, writes(db), db.batch_execute("commit"));
        undone?;
        let written = written?;
        committed.map_err(|e| Error::database("committing a claim's transaction", e))?;
        drop(self.client.take()); // back to the pool
        Ok(written)
    }

    /// Rolls back (the claim took nothing, or gives everything back as it was).
    pub(crate) async fn rollback(mut self) -> Result<()> {
        self.db().batch_execute("rollback").await.map_err(|e| Error::database("ending a claim's transaction", e))?;
        drop(self.client.take());
        Ok(())
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(client) = self.client.take() {
            // Unfinished: never hand an open transaction to the pool's next user. Closing the
            // connection makes the server roll it back.
            drop(deadpool_postgres::Object::take(client));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A claim that finds the lock in hand leaves word that the holder reads once it let go; one
    /// that comes after the release finds the lock free and leaves none.
    #[test]
    fn a_claim_turned_away_by_the_relays_own_lock_is_heard_by_the_holder() {
        let shared = SharedNewLock::default();
        let patience = Duration::from_secs(60);
        assert!(!NewLock::in_hand_or_wanted(&shared, patience), "nobody holds it");
        NewLock::state(&shared).since = Some(Instant::now());
        let holder = NewLock(shared.clone());
        assert!(NewLock::in_hand_or_wanted(&shared, patience), "held by the batch in hand");
        drop(holder);
        assert!(!NewLock::in_hand_or_wanted(&shared, patience), "free once the transaction ended");
        assert!(NewLock::take_wanted(&shared), "the holder hears the claim it turned away");
        assert!(!NewLock::take_wanted(&shared), "once");
        NewLock::state(&shared).since = Some(Instant::now() - patience);
        assert!(!NewLock::in_hand_or_wanted(&shared, patience), "held past the patience: look again");
        assert!(!NewLock::take_wanted(&shared));
    }
}
