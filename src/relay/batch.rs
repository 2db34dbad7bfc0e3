//! One batch from claim to record: claim it (`claim.rs`), keep it this claim's while it is
//! delivered (`lease.rs`), hand it to the handler (`deliver.rs`), judge the results
//! (`outcome.rs`) and record them (`record.rs`).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::breaker::Breaker;
use super::claim::{Batch, Claim, Claims};
use super::deliver::Delivery;
use super::handler::{Handler, Progress};
use super::held::{Held, NewLock};
use super::lease::Leases;
use super::outcome::{Judge, Outcome, Outcomes};
use super::record::{Recorder, Report};
use super::row::RelayRow;
use super::timer::Timer;
use crate::error::Result;
use crate::event::Event;

/// A destination's batches: the parts that claim, deliver, judge and record them.
pub(crate) struct Batches<H> {
    pub(crate) claims: Claims,
    pub(crate) leases: Leases,
    pub(crate) delivery: Delivery<H>,
    pub(crate) judge: Judge,
    pub(crate) recorder: Recorder,
    /// Told when parked events may be due once a batch is done.
    pub(crate) timer: Arc<Timer>,
    /// Whether the relay is marked waiting (writers notify it).
    pub(crate) row: Arc<RelayRow>,
    /// The relay is stopping: the batches in hand are finished, none is read ahead.
    pub(crate) stop: CancellationToken,
}

impl<H: Handler> Batches<H> {
    /// The destination's outage breaker.
    pub(crate) fn breaker(&self) -> &Breaker {
        &self.claims.breaker
    }

    /// The most events a claim takes.
    pub(crate) fn batch_size(&self) -> usize {
        self.claims.config.batch_size
    }

    /// Claims one batch (`None`: nothing to claim, or the breaker is open and this is no probe).
    pub(crate) async fn claim(&self, claim: Claim) -> Result<Option<Batch>> {
        self.claims.claim(claim, &self.leases).await
    }

    /// Claims one batch and delivers it; returns how many events were claimed. While the
    /// breaker is open only a probe claims.
    pub(crate) async fn claim_and_deliver(&self, claim: Claim) -> Result<usize> {
        match self.claim(claim).await? {
            None => Ok(0),
            Some(batch) => {
                let count = batch.count;
                self.deliver_and_record(batch).await;
                Ok(count)
            }
        }
    }

    /// Delivers a claimed batch and records what became of it. A held claim whose delivery
    /// outlives `hold` is leased meanwhile. Returns whether the worker should claim again now
    /// (see the end of this function).
    ///
    /// While a backlog of new events waits, the held claim's transaction delivers them batch
    /// after batch: the next batch is claimed in it (read ahead, `Claims::read_ahead`) while the
    /// last is delivered, so the claim's work on the server overlaps the delivery, and the
    /// transaction commits once for all of them. A batch's outcomes are written in the
    /// transaction before the next batch read ahead is delivered, and that batch's events of a
    /// key that waits now (one of its events failed or was given back, after the claim had read
    /// ahead) are parked behind it. The transaction reads ahead for at most half of `hold` and
    /// [`READ_AHEAD_MAX`] batches; its lease, and what it records early, count from its first
    /// claim. At-least-once is kept: a crash rolls back every batch of the transaction, and the
    /// next claim delivers them again (but for what was recorded early).
    pub(crate) async fn deliver_and_record(&self, first: Batch) -> bool {
        let held_since = first.claimed_at;
        // One token for the transaction: what it records early goes with its commit.
        let token = first.token;
        // Its claims read ahead need not read those records (`Turn::own_records`): they name
        // new events below the position it moved, unless its first batch took parked events,
        // whose outbox rows may lie ahead of the position still (a copy the fast path made when
        // a delivery outlived the hold): a claim read ahead may meet one of those, and only
        // its record says that it was delivered.
        let own_records = if first.parked.is_empty() { token } else { 0 };
        // What the transaction's deliveries achieved and it has not recorded early, carried from
        // batch to batch so that a record early never names a key's later event without its
        // earlier ones.
        let progress: Arc<Progress> = Arc::default();
        // When it is recorded next (`record_every`, counted from the transaction's first claim).
        let mut record_at = held_since + self.leases.record_every;
        // The transaction's earlier batches, recorded in it: their reports and what they ask
        // once it commits, and their keys held back from the fast path until then.
        let mut recorded_in: Vec<(Report, Aftermath)> = Vec::new();
        let mut busy_keys = Vec::new();
        let mut early_any = false;
        let mut parked_keyed = false;
        // The outcomes of the batch delivered last, written in the transaction beside the next
        // one's delivery (with the next batch's claim read ahead after them: one round trip).
        let mut adopt: Option<Adoption> = None;
        // What the fast path decided for the events of the batch read ahead that `adopt` makes
        // the transaction's: forgotten by the fast path once that is written (`Claims::adopted`).
        let mut adopt_decided: Vec<(i64, bool)> = Vec::new();
        // Batches of the transaction delivered before this one.
        let mut delivered = 0;
        let mut batch = first;
        loop {
            let ahead = self.may_read_ahead(&batch, delivered, held_since);
            delivered += 1;
            let claimed = batch.claimed();
            let Batch {
                mut held,
                claimed_at,
                held_new,
                parked_keyed: keyed,
                events,
                ages,
                mut outcomes,
                probe,
                parked,
                busy,
                ..
            } = batch;
            parked_keyed |= keyed;
            busy_keys.extend(busy);
            let breaker = self.breaker();
            // Events of the held claim recorded in `early_deliveries` while it delivered.
            let mut early = Vec::new();
            let (mut next, mut cut_off, mut broken) = (None, false, None);
            let mut adopting = adopt.take();
            if !events.is_empty() {
                if !probe && breaker.is_open() {
                    // Claimed while the breaker was opening: the outage covers it, nothing is tried.
                    outcomes.release_all(&events);
                } else {
                    let delivery = self.delivery.deliver(&events, &progress);
                    tokio::pin!(delivery);
                    let mut ended = None;
                    if let Some(claim) = held.as_mut()
                        && (ahead || adopting.is_some())
                    {
                        // What the transaction's earlier batches delivered is recorded early,
                        // beside it, once `record_every` has passed (batches delivered while their
                        // successor was claimed wait for no timer that would record them).
                        let due = self.leases.due(&mut record_at, &progress);
                        let work = async {
                            let record = self.leases.record_beside(due, token, &progress, &mut early);
                            futures::join!(self.in_transaction(claim, own_records, adopting.take(), ahead), record).0
                        };
                        let ((adopted, read), done) = super::lease::beside(&mut delivery, work).await;
                        claim.set_read_ahead(!matches!(read, Ok(None)));
                        match adopted {
                            Ok(adopted) => {
                                self.claims.adopted(std::mem::take(&mut adopt_decided));
                                recorded_in.extend(adopted);
                            }
                            Err(e) => {
                                // The transaction is aborted, with the savepoint of the batch in
                                // delivery still there: nothing of it may commit (a lease's undo
                                // would roll back to that savepoint and commit the rest). Closed
                                // now, it rolls back; the delivery goes on, unrecorded.
                                broken = Some(e);
                                held = None;
                            }
                        }
                        match read {
                            Ok(read) => next = read,
                            Err(e) => {
                                tracing::debug!(error = %e, "reading the next batch ahead failed; it is claimed once this one is done")
                            }
                        }
                        ended = done;
                    }
                    let results = match ended {
                        Some(results) => results,
                        // No transaction to keep: the delivery's results are not recorded.
                        None if broken.is_some() => delivery.await,
                        None => {
                            let since = (claimed_at, held_since);
                            let kept = self.leases.keep_while(
                                delivery,
                                &mut held,
                                &claimed,
                                &parked,
                                token,
                                since,
                                &mut record_at,
                                &progress,
                                &mut early,
                            );
                            kept.await
                        }
                    };
                    match results {
                        // Cut off at shutdown: the events go back, the attempt not counted, but
                        // for those already recorded delivered beside the held claim.
                        None => {
                            cut_off = true;
                            outcomes.release_all_but(&events, &early);
                        }
                        Some(results) => {
                            self.judge.judge(&events, &ages, claimed_at, results, probe, &mut outcomes).await
                        }
                    }
                }
            } else if probe {
                breaker.probe_found_nothing();
            }
            if let (Some(adoption), Some(claim)) = (adopting, held.as_mut()) {
                // This batch had no delivery to write them beside.
                match self.in_transaction(claim, own_records, Some(adoption), false).await.0 {
                    Ok(adopted) => {
                        claim.set_read_ahead(false);
                        self.claims.adopted(std::mem::take(&mut adopt_decided));
                        recorded_in.extend(adopted);
                    }
                    Err(e) => broken = Some(e),
                }
            }
            if !early.is_empty() {
                early_any = true;
                if let Some(claim) = held.as_mut() {
                    claim.set_recorded_early();
                }
            }
            let aftermath = Aftermath::of(&events, &outcomes, held.is_none() && broken.is_none());
            if let Some(e) = broken {
                tracing::error!(error = %e, events = events.len(), "recording delivery outcomes failed; the claim's transaction ended, so its events are claimable again and will be delivered again");
                drop(held); // closes the connection: the transaction rolls back
                self.end(recorded_in, aftermath, false);
                return true;
            }
            // A batch read ahead is delivered next while the transaction goes on; otherwise (the
            // claim was leased meanwhile, and the batch read ahead undone with its savepoint; or
            // the delivery was cut off) this batch is the transaction's last.
            match (next, held) {
                (Some(mut next), Some(claim)) if !cut_off => {
                    adopt_decided = std::mem::take(&mut next.fast_decided);
                    self.carry(&progress, &outcomes, &early);
                    let behind = next.behind(&aftermath.waiting);
                    adopt = Some(Adoption { outcomes, parked, behind, aftermath });
                    next.held = Some(claim);
                    batch = next;
                }
                (_, held) => {
                    // Batches read ahead parked what they could not hand over (behind a key,
                    // delayed, paused) where the claims run meanwhile could not see it, nor the
                    // timer its due time: a claim after the commit reads both.
                    let read_ahead = !recorded_in.is_empty();
                    let recorded = self.recorder.record(held, token, outcomes, &parked, early_any).await;
                    let due = self.end(recorded_in, aftermath, recorded);
                    drop(busy_keys);
                    if (parked_keyed || read_ahead) && !due {
                        // A parked key's next event is its head now (or the batches read ahead
                        // parked events): a worker that found nothing while this batch held it may
                        // be waiting already.
                        self.timer.parked_may_be_due();
                        self.leases.work.notify_one();
                    }
                    // Claim again now if parked events may be due, or if this batch held the new
                    // events' lock and new events may wait: a claim of this relay was turned away
                    // by the lock meanwhile, or the relay is busy (not marked waiting: writers do
                    // not notify it). A relay marked waiting hears every commit, so a turned-away
                    // claim of its own says so.
                    return parked_keyed
                        || read_ahead
                        || due
                        || (held_new && (!self.row.is_marked() || NewLock::take_wanted(&self.claims.new_lock)));
                }
            }
        }
    }

    /// Carries what a batch delivered, and was not recorded early (`early`), into `progress`,
    /// for the transaction's next record: a handler that writes a batch in one piece reports
    /// nothing as it goes, and the batch is not committed when it ends (its transaction goes on).
    fn carry(&self, progress: &Progress, outcomes: &Outcomes, early: &[i64]) {
        let early: HashSet<i64> = early.iter().copied().collect();
        let mut pending = progress.take();
        pending.extend(
            outcomes
                .events
                .iter()
                .filter(|(id, _, outcome)| matches!(outcome, Outcome::Delivered) && !early.contains(id))
                .map(|(id, _, _)| *id),
        );
        pending.sort_unstable();
        pending.dedup();
        progress.put_back(pending);
    }

    /// In the held claim's transaction, beside a delivery: writes the outcomes of the batch
    /// delivered before (`adopt`), which makes the batch in delivery, read ahead in its savepoint,
    /// the transaction's; then, with `ahead`, reads the next batch ahead. Both are sent at once,
    /// the writes first (the claim then sees what they parked): one round trip. `own_records` is
    /// the token of the transaction's records early that the claim need not read (0: none).
    /// Returns what was written, for once the transaction commits, and the batch read ahead.
    async fn in_transaction(
        &self,
        claim: &Held,
        own_records: i64,
        adopt: Option<Adoption>,
        ahead: bool,
    ) -> (Result<Option<(Report, Aftermath)>>, Result<Option<Batch>>) {
        let adopted = async {
            let Some(Adoption { outcomes, parked, behind, mut aftermath }) = adopt else { return Ok(None) };
            let report = self.recorder.write_held(claim, outcomes, &parked, &behind).await?;
            aftermath.written = Some(tokio::time::Instant::now());
            Ok(Some((report, aftermath)))
        };
        let read =
            async { if ahead { self.claims.read_ahead(claim, own_records, &self.leases).await } else { Ok(None) } };
        futures::join!(adopted, read)
    }

    /// Whether the next batch is read ahead in `batch`'s transaction while `batch` is delivered:
    /// it holds the new events' lock, more wait, nothing of it is decided already (an event the
    /// fast path tried, or one no handler can be given, whose key the claim read ahead would not
    /// know to hold back), and the transaction is young: the next batch would be among its
    /// first [`READ_AHEAD_MAX`], and it has been open for less than half of `hold`; and the relay
    /// is not stopping.
    fn may_read_ahead(&self, batch: &Batch, before: usize, held_since: tokio::time::Instant) -> bool {
        batch.held.is_some()
            && batch.held_new
            && batch.more
            && !batch.probe
            && batch.outcomes.events.is_empty()
            && before + 1 < READ_AHEAD_MAX
            && held_since.elapsed() < self.leases.hold / 2
            && !self.breaker().is_open()
            && !self.stop.is_cancelled()
    }

    /// The transaction's batches are recorded (`recorded`) or not: each one's report is counted
    /// and logged, and what it asks is done. Returns whether parked events may be due now.
    fn end(&self, earlier: Vec<(Report, Aftermath)>, last: Aftermath, recorded: bool) -> bool {
        let mut due = false;
        for (report, aftermath) in earlier {
            if recorded {
                self.recorder.report(report);
            }
            due |= self.after(aftermath, recorded);
        }
        due | self.after(last, recorded)
    }

    /// Records what became of a batch's `events` (in the held claim's transaction, or by the
    /// lease's `token`), tells the fast path which keys wait now, and asks for the retries'
    /// wake-ups. `parked`: the ids claimed from the parked events; `early`: some were recorded
    /// in `early_deliveries` beside the held claim. Returns whether parked events may be due now
    /// (a worker is woken for them).
    pub(crate) async fn settle(
        &self,
        held: Option<Held>,
        token: i64,
        events: &[Event],
        outcomes: Outcomes,
        parked: &HashSet<i64>,
        early: bool,
    ) -> bool {
        let aftermath = Aftermath::of(events, &outcomes, held.is_none());
        let recorded = self.recorder.record(held, token, outcomes, parked, early).await;
        self.after(aftermath, recorded)
    }

    /// Tells the fast path which keys wait now, asks for the retries' wake-ups and, when events
    /// were given back, wakes a worker. Returns whether parked events may be due now.
    fn after(&self, aftermath: Aftermath, recorded: bool) -> bool {
        let Aftermath { retries, written, waiting, wake } = aftermath;
        self.claims.fast.batch_done(waiting, recorded);
        let written = written.unwrap_or_else(tokio::time::Instant::now);
        for delay in retries {
            self.timer.schedule(written + delay);
        }
        if wake {
            // Events were given back, due at once: a worker that found nothing while this batch
            // held them may be waiting already.
            self.timer.parked_may_be_due();
            self.leases.work.notify_one();
        }
        wake
    }
}

/// How many batches one held transaction delivers at most (the first claimed, the others read
/// ahead: one fewer). Each batch read ahead is claimed in a subtransaction; PostgreSQL keeps 64
/// subtransaction ids per session in shared memory, and past them every snapshot taken on the
/// server reads `pg_subtrans`: a transaction stays well within them.
const READ_AHEAD_MAX: usize = 32;

/// A batch delivered in a transaction that goes on: its outcomes, to be written in it before
/// anything else is claimed there, with the events of the next batch that wait behind it.
struct Adoption {
    outcomes: Outcomes,
    /// Its ids claimed from the parked events.
    parked: HashSet<i64>,
    /// Events of the next batch, with their attempts, whose keys wait now (`Batch::behind`).
    behind: Vec<(i64, i32)>,
    aftermath: Aftermath,
}

/// What a batch's outcomes ask of the relay once they are recorded.
struct Aftermath {
    /// Every retry's wake-up, asked for once it is written: its `available_at` counts from the
    /// write, and a claim woken before it (at the judgement, a commit's round trip earlier, more
    /// on a loaded machine) found nothing due and looked no further. (A probe's retry wakes a
    /// worker that, the breaker open, claims nothing: the breaker times the next probe.)
    retries: Vec<Duration>,
    /// When the retries were written, if before the commit (a batch of a transaction that
    /// went on): their wake-ups count from then.
    written: Option<tokio::time::Instant>,
    /// The keys that wait now (a retry, a dead letter, an event given back): held back from
    /// the fast path.
    waiting: Vec<String>,
    /// Events were given back, or a leased batch's events with a key (later events of their
    /// keys, claimed meanwhile, were parked behind them and wait for a claim of parked events
    /// once these are done).
    wake: bool,
}

impl Aftermath {
    fn of(events: &[Event], outcomes: &Outcomes, leased: bool) -> Aftermath {
        let released = outcomes.count(|outcome| matches!(outcome, Outcome::Released)) > 0;
        let leased_keyed = leased && events.iter().any(|event| event.key.is_some());
        let retries = outcomes
            .events
            .iter()
            .filter_map(|(_, _, outcome)| match outcome {
                Outcome::Retry { delay, .. } => Some(*delay),
                _ => None,
            })
            .collect();
        let waiting = outcomes
            .events
            .iter()
            .filter(|(_, _, outcome)| !matches!(outcome, Outcome::Delivered))
            .filter_map(|(id, _, _)| events.iter().find(|event| event.id == *id)?.key.clone())
            .collect();
        Aftermath { retries, written: None, waiting, wake: released || leased_keyed }
    }
}
