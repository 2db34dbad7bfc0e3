//! One batch from claim to record: claim it (`claim.rs`), keep it this claim's while it is
//! delivered (`lease.rs`), hand it to the handler (`deliver.rs`), judge the results
//! (`outcome.rs`) and record them (`record.rs`).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use super::breaker::Breaker;
use super::claim::{Batch, Claim, Claims};
use super::deliver::Delivery;
use super::handler::Handler;
use super::held::{Held, NewLock};
use super::lease::Leases;
use super::outcome::{Judge, Outcome, Outcomes};
use super::record::Recorder;
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
    pub(crate) async fn deliver_and_record(&self, batch: Batch) -> bool {
        let claimed = batch.claimed();
        let Batch {
            mut held,
            token,
            claimed_at,
            held_new,
            parked_keyed,
            events,
            ages,
            mut outcomes,
            probe,
            parked,
            busy,
            ..
        } = batch;
        let breaker = self.breaker();
        // Events of the held claim recorded in `early_deliveries` while it delivered.
        let mut early = Vec::new();
        if !events.is_empty() {
            if !probe && breaker.is_open() {
                // Claimed while the breaker was opening: the outage covers it, nothing is tried.
                outcomes.release_all(&events);
            } else {
                let progress = Arc::default();
                let delivery = self.delivery.deliver(&events, &progress);
                tokio::pin!(delivery);
                let kept = self
                    .leases
                    .keep_while(delivery, &mut held, &claimed, &parked, token, claimed_at, &progress, &mut early);
                match kept.await {
                    // Cut off at shutdown: the events go back, the attempt not counted, but
                    // for those already recorded delivered beside the held claim.
                    None => outcomes.release_all_but(&events, &early),
                    Some(results) => self.judge.judge(&events, &ages, claimed_at, results, probe, &mut outcomes).await,
                }
            }
        } else if probe {
            breaker.probe_found_nothing();
        }
        let due = self.settle(held, token, &events, outcomes, &parked, !early.is_empty()).await;
        drop(busy);
        if parked_keyed && !due {
            // A parked key's next event is its head now: a worker that found nothing while this
            // batch held it may be waiting already.
            self.timer.parked_may_be_due();
            self.leases.work.notify_one();
        }
        // Claim again now if parked events may be due, or if this batch held the new events'
        // lock and new events may wait: a claim of this relay was turned away by the lock
        // meanwhile, or the relay is busy (not marked waiting: writers do not notify it). A
        // relay marked waiting hears every commit, so a turned-away claim of its own says so.
        parked_keyed || due || (held_new && (!self.row.is_marked() || NewLock::take_wanted(&self.claims.new_lock)))
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
        let released = outcomes.count(|outcome| matches!(outcome, Outcome::Released)) > 0;
        // A leased batch's events were parked: later events of their keys, claimed meanwhile,
        // were parked behind them, and wait for a claim of parked events once these are done.
        let leased_keyed = held.is_none() && events.iter().any(|event| event.key.is_some());
        // Every retry's wake-up, asked for once it is written: its `available_at` counts from the
        // write, and a claim woken before it (at the judgement, a commit's round trip earlier, more
        // on a loaded machine) found nothing due and looked no further. (A probe's retry wakes a
        // worker that, the breaker open, claims nothing: the breaker times the next probe.)
        let retries: Vec<Duration> = outcomes
            .events
            .iter()
            .filter_map(|(_, _, outcome)| match outcome {
                Outcome::Retry { delay, .. } => Some(*delay),
                _ => None,
            })
            .collect();
        // What waits now holds its key's later events back from the fast path.
        let waiting: Vec<String> = outcomes
            .events
            .iter()
            .filter(|(_, _, outcome)| !matches!(outcome, Outcome::Delivered))
            .filter_map(|(id, _, _)| events.iter().find(|event| event.id == *id)?.key.clone())
            .collect();
        let recorded = self.recorder.record(held, token, outcomes, parked, early).await;
        self.claims.fast.batch_done(waiting, recorded);
        let written = tokio::time::Instant::now();
        for delay in retries {
            self.timer.schedule(written + delay);
        }
        if released || leased_keyed {
            // Events were given back, due at once: a worker that found nothing while this batch
            // held them may be waiting already.
            self.timer.parked_may_be_due();
            self.leases.work.notify_one();
        }
        released || leased_keyed
    }
}
