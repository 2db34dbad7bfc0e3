//! Recording what became of a batch's events: in the held claim's transaction, committing it,
//! or by the lease's token.
//!
//! An event claimed from the new ones has passed the destination's position: what still waits
//! for the destination is copied into its parked events or dead letters (its outbox row is never
//! written: migration 0019). An event claimed from the parked ones changes there. Once a claim is leased
//! all its events are parked ones.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;

use super::held::{ADOPT_READ_AHEAD, Held};
use super::metrics::RelayMetrics;
use super::outcome::{Outcome, Outcomes};
use super::pool::RelayPool;
use crate::error::Result;
use crate::sql;

/// How many ids and distinct errors one dead-letter warning names; the rest are counted.
const BURIED_SHOWN: usize = 10;

/// Writes the outcomes of a destination's batches.
pub(crate) struct Recorder {
    pub(crate) pool: RelayPool,
    /// The destination's name.
    pub(crate) to: String,
    pub(crate) metrics: Arc<RelayMetrics>,
}

impl Recorder {
    /// Writes the outcomes of one batch: in the held claim's transaction, committing it, or
    /// by the lease's token (each statement only touches rows still holding it). A held claim's
    /// failure here ends its transaction, so its events are claimable again at once; a leased
    /// one's is retried a few times and then left to the lease. Either way the events are
    /// delivered again, which at-least-once delivery allows. `parked`: the ids claimed from the
    /// parked events; `early`: whether the held claim recorded some of them in
    /// `early_deliveries` as they were delivered (those records go with its commit). Returns
    /// whether the outcomes were written.
    pub(crate) async fn record(
        &self,
        held: Option<Held>,
        token: i64,
        outcomes: Outcomes,
        parked: &HashSet<i64>,
        early: bool,
    ) -> bool {
        let leased = held.is_none();
        let mut writes = Writes::of(&outcomes, |id| leased || parked.contains(&id));
        writes.early = (early && !leased).then_some(token);
        let recorded = match held {
            Some(held) => self.commit(held, &writes, outcomes.events.len()).await,
            None => self.by_token(token, &writes, outcomes.events.len()).await,
        };
        if recorded {
            self.report(Report::of(outcomes, &writes));
        }
        recorded
    }

    /// Writes the outcomes of one batch in the held claim's transaction without committing it:
    /// the batch read ahead in it is delivered next (and `adopted` by the transaction, its
    /// savepoint released). `behind`: events of that batch, with their attempts, whose keys wait
    /// now (an event of theirs in this batch failed or was given back): they wait too, parked
    /// behind them, written before anything else is claimed. The report is for once the
    /// transaction commits.
    pub(crate) async fn write_held(
        &self,
        held: &Held,
        outcomes: Outcomes,
        parked: &HashSet<i64>,
        behind: &[(i64, i32)],
    ) -> Result<Report> {
        let mut writes = Writes::of(&outcomes, |id| parked.contains(&id));
        for (id, attempt) in behind {
            writes.new_waiting.push(*id, Duration::ZERO, None, attempt - 1);
        }
        let db = held.db();
        let (written, adopted) = futures::join!(write(db, &self.to, None, &writes), db.batch_execute(ADOPT_READ_AHEAD));
        written?;
        adopted.map_err(|e| crate::error::Error::database("keeping a claim read ahead", e))?;
        Ok(Report::of(outcomes, &writes))
    }

    /// Counts and logs outcomes whose transaction committed.
    pub(crate) fn report(&self, report: Report) {
        self.metrics.retried(report.retried);
        self.metrics.delivered(report.latencies.into_iter());
        self.metrics.dead_lettered(report.buried.0.len());
        if !report.buried.0.is_empty() {
            log_buried(&report.buried.0, &report.buried.1);
        }
    }

    /// In the held claim's transaction, committing it.
    async fn commit(&self, held: Held, writes: &Writes, events: usize) -> bool {
        let recorded =
            held.commit_after(async |db: &deadpool_postgres::ClientWrapper| write(db, &self.to, None, writes).await);
        match recorded.await {
            Ok(()) => true,
            Err(e) => {
                tracing::error!(error = %e, events, "recording delivery outcomes failed; the claim's transaction ended, so its events are claimable again and will be delivered again");
                false
            }
        }
    }

    /// By the lease's token, tried a few times.
    async fn by_token(&self, token: i64, writes: &Writes, events: usize) -> bool {
        let mut tries = 0;
        loop {
            tries += 1;
            let written = async { write(&*self.pool.client().await?, &self.to, Some(token), writes).await };
            match written.await {
                Ok(()) => return true,
                Err(e) if tries < 4 => {
                    tracing::warn!(error = %e, "recording delivery outcomes failed; trying again");
                    tokio::time::sleep(Duration::from_millis(100 * tries)).await;
                }
                Err(e) => {
                    tracing::error!(error = %e, events, "recording delivery outcomes failed; the events will be delivered again after their lease");
                    return false;
                }
            }
        }
    }
}

/// What recorded outcomes tell the metrics and the log once their transaction commits.
pub(crate) struct Report {
    retried: usize,
    latencies: Vec<Duration>,
    /// The dead letters' ids and errors.
    buried: (Vec<i64>, Vec<String>),
}

impl Report {
    fn of(outcomes: Outcomes, writes: &Writes) -> Report {
        Report {
            retried: outcomes.count(|o| matches!(o, Outcome::Retry { .. })),
            latencies: outcomes.latencies,
            buried: writes.buried().map(|(id, e)| (*id, e.clone())).unzip(),
        }
    }
}

/// The outcomes as the statements take them.
#[derive(Default)]
struct Writes {
    /// New events that wait: retries and events given back.
    new_waiting: sql::Copies,
    /// New events to the dead letters: ids, errors, attempts.
    new_buried: (Vec<i64>, Vec<String>, Vec<i32>),
    parked_delivered: Vec<i64>,
    /// Parked events that wait again: retries and events given back.
    parked_waiting: sql::Copies,
    parked_buried: (Vec<i64>, Vec<String>, Vec<i32>),
    /// The token of the held claim that recorded events early (`early_deliveries`): its
    /// records go.
    early: Option<i64>,
}

impl Writes {
    /// `parked`: the ids claimed from the parked events (all of them, once the claim is leased).
    fn of(outcomes: &Outcomes, parked: impl Fn(i64) -> bool) -> Writes {
        let mut w = Writes::default();
        let released_why = outcomes.released_why.clone();
        for (id, attempt, outcome) in &outcomes.events {
            let (id, attempt, given_back) = (*id, *attempt, (*attempt - 1).max(0));
            let parked = parked(id);
            let (waiting, buried) = if parked {
                (&mut w.parked_waiting, &mut w.parked_buried)
            } else {
                (&mut w.new_waiting, &mut w.new_buried)
            };
            match outcome {
                Outcome::Delivered if parked => w.parked_delivered.push(id),
                Outcome::Delivered => {}
                Outcome::Retry { delay, error, counted } => {
                    waiting.push(id, *delay, Some(error.clone()), if *counted { attempt } else { given_back });
                }
                Outcome::Bury { error } => {
                    buried.0.push(id);
                    buried.1.push(error.clone());
                    buried.2.push(attempt);
                }
                Outcome::Released => waiting.push(id, Duration::ZERO, released_why.clone(), given_back),
            }
        }
        w
    }

    fn buried(&self) -> impl Iterator<Item = (&i64, &String)> {
        self.new_buried.0.iter().zip(&self.new_buried.1).chain(self.parked_buried.0.iter().zip(&self.parked_buried.1))
    }
}

/// Runs the statements of one batch's outcomes for destination `to` on `db`, pipelined (one
/// round trip for all, run in order);
/// `token`: the lease's, or `None` for a held claim.
async fn write(db: &deadpool_postgres::ClientWrapper, to: &str, token: Option<i64>, w: &Writes) -> Result<()> {
    let mut writes: Vec<BoxFuture<'_, Result<u64>>> = Vec::new();
    if !w.new_waiting.ids.is_empty() {
        writes.push(Box::pin(sql::park_new_events(db, to, &w.new_waiting, None)));
    }
    if !w.new_buried.0.is_empty() {
        writes.push(Box::pin(sql::bury_new_events(db, to, &w.new_buried.0, &w.new_buried.1, &w.new_buried.2)));
    }
    if !w.parked_delivered.is_empty() {
        writes.push(Box::pin(sql::complete_parked(db, to, &w.parked_delivered, token)));
    }
    if !w.parked_waiting.ids.is_empty() {
        writes.push(Box::pin(sql::reschedule_parked(db, to, &w.parked_waiting, token)));
    }
    if !w.parked_buried.0.is_empty() {
        let (ids, errors, attempts) = &w.parked_buried;
        writes.push(Box::pin(sql::bury_parked(db, to, ids, errors, attempts, token)));
    }
    if let Some(claim) = w.early {
        writes.push(Box::pin(sql::forget_early_deliveries(db, to, claim)));
    }
    futures::future::try_join_all(writes).await.map(drop)
}

/// One warning for a batch's dead letters, of bounded length: the first ids, each distinct
/// error once with how many events it buried.
fn log_buried(ids: &[i64], errors: &[String]) {
    let mut distinct: Vec<(&str, usize)> = Vec::new();
    for error in errors {
        match distinct.iter_mut().find(|(e, _)| *e == error.as_str()) {
            Some((_, n)) => *n += 1,
            None => distinct.push((error.as_str(), 1)),
        }
    }
    let causes: Vec<String> = distinct.iter().take(BURIED_SHOWN).map(|(e, n)| format!("{n} x {e}")).collect();
    tracing::warn!(
        events = ids.len(),
        ids = %crate::text::some_ids(ids, BURIED_SHOWN),
        errors = %causes.join(" | "),
        "events moved to the dead letters"
    );
}
