//! Handing a batch to the handler: in rounds by key, so that the handler never has two events
//! of one key at once, and an event behind a failure of its key is left untried.

use std::collections::{HashMap, HashSet};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use futures::FutureExt;
use tokio_util::sync::CancellationToken;

use super::failure::DeliveryError;
use super::handler::{Handler, Progress, Slots, panicked};
use crate::event::Event;

/// What handing events to the handler needs.
pub(crate) struct Delivery<H> {
    pub(crate) handler: H,
    /// The destination's name (the delivery spans say it).
    #[cfg_attr(not(feature = "opentelemetry"), allow(dead_code))]
    pub(crate) to: String,
    /// The bound on deliveries in progress, shared by every batch.
    pub(crate) slots: Slots,
    /// Stop delivering now; release what is in hand (shutdown past its grace).
    pub(crate) abort: CancellationToken,
}

/// Each event's result, `None` for one left untried behind a failure of its key.
pub(crate) type Results = Vec<Option<Result<(), DeliveryError>>>;

impl<H: Handler> Delivery<H> {
    /// Hands `events` to the handler in rounds. The first round has every event without a key
    /// and the first of each key; each next round the next event of every key whose last one was
    /// delivered. `None` when the shutdown's abort cut the delivery off.
    pub(crate) async fn deliver(&self, events: &[Event], progress: &Arc<Progress>) -> Option<Results> {
        let slots = self.slots.reporting(progress.clone());
        tracing::trace!(events = events.len(), "delivering");
        let rounds = rounds_by_key(events);
        let run = async {
            let mut results = vec![None; events.len()];
            let mut failed_keys: HashSet<&str> = HashSet::new();
            for round in &rounds {
                let now: Vec<usize> = round
                    .iter()
                    .copied()
                    .filter(|&i| events[i].key.as_deref().is_none_or(|key| !failed_keys.contains(key)))
                    .collect();
                if now.is_empty() {
                    break;
                }
                let delivered = if now.len() == events.len() {
                    self.hand_over(events, &slots).await
                } else {
                    let part: Vec<Event> = now.iter().map(|&i| events[i].clone()).collect();
                    self.hand_over(&part, &slots).await
                };
                for (&i, result) in now.iter().zip(delivered) {
                    if let (Err(_), Some(key)) = (&result, &events[i].key) {
                        failed_keys.insert(key.as_str());
                    }
                    results[i] = Some(result);
                }
            }
            results
        };
        tokio::select! {
            results = run => Some(results),
            _ = self.abort.cancelled() => None,
        }
    }

    /// One call of the handler: one result per event, a panic failing them all. With the
    /// `opentelemetry` feature, each event that carries a trace context is sent in a span of its
    /// own, whose context it carries to the receiver.
    async fn hand_over(&self, events: &[Event], slots: &Slots) -> Vec<Result<(), DeliveryError>> {
        #[cfg(feature = "opentelemetry")]
        {
            let (sends, traced) = super::trace::Sends::start(events, &self.to);
            let results = self.call(traced.as_deref().unwrap_or(events), slots).await;
            sends.finish(&results);
            results
        }
        #[cfg(not(feature = "opentelemetry"))]
        self.call(events, slots).await
    }

    async fn call(&self, events: &[Event], slots: &Slots) -> Vec<Result<(), DeliveryError>> {
        let delivery = AssertUnwindSafe(self.handler.handle_batch(events, slots)).catch_unwind();
        let mut results = match delivery.await {
            Ok(results) => results,
            Err(panic) => {
                let error = panicked(&*panic);
                events.iter().map(|_| Err(error.clone())).collect()
            }
        };
        if results.len() != events.len() {
            let message = format!("the handler returned {} results for {} events", results.len(), events.len());
            results.resize_with(events.len(), || Err(DeliveryError::transient(&message)));
        }
        results
    }
}

/// The rounds in which a batch (in id order) is handed over: indexes into `events`, per round
/// every event without a key (in the first) and the next event of each key.
fn rounds_by_key(events: &[Event]) -> Vec<Vec<usize>> {
    let mut seen: HashMap<&str, usize> = HashMap::new();
    let mut rounds: Vec<Vec<usize>> = vec![Vec::with_capacity(events.len())];
    for (i, event) in events.iter().enumerate() {
        let round = match &event.key {
            None => 0,
            Some(key) => {
                let n = seen.entry(key.as_str()).or_insert(0);
                *n += 1;
                *n - 1
            }
        };
        if rounds.len() <= round {
            rounds.resize_with(round + 1, Vec::new);
        }
        rounds[round].push(i);
    }
    rounds
}
