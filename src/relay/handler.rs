//! What a service implements to deliver events: a [`Handler`].

use std::future::Future;
use std::sync::{Arc, Mutex};

use futures::{FutureExt, StreamExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use super::limit::{Sample, Vegas};
use super::metrics::RelayMetrics;
use super::rate::Bucket;

use super::failure::DeliveryError;
use crate::event::Event;

/// Delivers events to their destination.
///
/// Return `Ok(())` once the destination has the event. Delivery is at least once: the same event
/// (same [`Event::id`]) can arrive again after a crash or an expired lease, so destinations should
/// drop ids they have seen. A handler that panics counts as a transient failure for every event
/// of the batch it was given; the relay goes on.
///
/// ```
/// use pg_outbox_relay::{DeliveryError, Event, Handler};
///
/// struct Print;
/// impl Handler for Print {
///     async fn handle(&self, event: &Event) -> Result<(), DeliveryError> {
///         println!("{} {}", event.topic, event.payload);
///         Ok(())
///     }
/// }
/// ```
pub trait Handler: Send + Sync + 'static {
    /// Delivers `event`.
    fn handle(&self, event: &Event) -> impl Future<Output = Result<(), DeliveryError>> + Send;

    /// Delivers a batch, returning one result per event, in the order of `events`; the relay
    /// records them once the future completes, and, once the claim is leased, the events reported
    /// delivered with [`Slots::finished`] before (every
    /// [`RelayConfig::record_every`](super::RelayConfig::record_every)).
    ///
    /// The relay never hands a batch two events of one key (a claim may hold several; they are
    /// handed over in rounds, a key's next event only once the one before it was delivered), so
    /// the events of a batch may be delivered in any order and at once. `slots` bounds the
    /// deliveries the whole relay has in progress
    /// ([`RelayConfig::concurrency`](super::RelayConfig::concurrency)) and the events a second
    /// it sends ([`RelayConfig::rate_limit`](super::RelayConfig::rate_limit)): take a slot for
    /// each request, write or round trip in flight ([`Slots::take_for`] for one that carries
    /// several events).
    ///
    /// Defaults to [`handle`](Self::handle) for every event at once, each holding a slot (and
    /// giving it back with its result, [`Slot::done`], which teaches the adaptive limit), a
    /// panic failing only the event it happened on. A handler that writes a batch in one piece
    /// (one write and flush, one pipelined exchange) overrides it; each result must say what
    /// became of that event, so a buffering handler makes the batch durable before it returns
    /// `Ok` for any of it.
    fn handle_batch(
        &self,
        events: &[Event],
        slots: &Slots,
    ) -> impl Future<Output = Vec<Result<(), DeliveryError>>> + Send {
        futures::stream::iter(events)
            .map(move |event| async move {
                let slot = slots.take().await;
                let delivery = std::panic::AssertUnwindSafe(self.handle(event)).catch_unwind().await;
                let result = delivery.unwrap_or_else(|panic| Err(panicked(&*panic)));
                slot.done(&result);
                slots.finished(event, &result);
                result
            })
            .buffered(events.len().max(1))
            .collect()
    }
}

/// The relay's bound on deliveries in progress at once, shared by all its batches: see
/// [`Handler::handle_batch`]. Fixed ([`Slots::new`]), or adaptive ([`Slots::adaptive`]): the
/// limit is learnt from the answers that slots given back with [`Slot::done`] report (see
/// [`RelayConfig::concurrency`](super::RelayConfig::concurrency)); a slot merely dropped says
/// nothing of the destination.
#[derive(Debug, Clone)]
pub struct Slots {
    inner: Arc<SlotsInner>,
    /// Where the deliveries of the batch these slots were handed with are reported as they end.
    progress: Option<Arc<Progress>>,
}

/// The events of a batch delivered so far, not yet taken for recording (see [`Slots::finished`]).
#[derive(Debug, Default)]
pub(crate) struct Progress {
    delivered: Mutex<Vec<i64>>,
}

impl Progress {
    /// The ids delivered since the last call.
    pub(crate) fn take(&self) -> Vec<i64> {
        std::mem::take(&mut *self.delivered.lock().unwrap_or_else(|poisoned| poisoned.into_inner()))
    }

    /// Gives back ids taken that could not be recorded.
    pub(crate) fn put_back(&self, ids: Vec<i64>) {
        self.delivered.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).extend(ids);
    }
}

#[derive(Debug)]
struct SlotsInner {
    semaphore: Arc<Semaphore>,
    state: Mutex<SlotsState>,
    metrics: Option<Arc<RelayMetrics>>,
}

#[derive(Debug)]
struct SlotsState {
    adaptive: Option<Vegas>,
    /// The rate limit, and the pause a `Retry-After` asked for.
    bucket: Bucket,
    limit: usize,
    /// Permits to forget as they come back: the limit shrank below what was in flight.
    debt: usize,
    in_flight: usize,
}

/// One delivery's place within [`Slots`]; it frees the place when dropped, or when given back
/// with its result ([`Slot::done`]).
#[derive(Debug)]
pub struct Slot {
    slots: Arc<SlotsInner>,
    permit: Option<OwnedSemaphorePermit>,
    taken: Instant,
    in_flight: usize,
}

impl Slots {
    /// A fixed bound of `limit` deliveries at once (at least one).
    pub fn new(limit: usize) -> Self {
        Slots::with(limit.max(1), None, None, None)
    }

    /// A bound learnt from the destination's answers, from a few deliveries at once up to
    /// `ceiling` (a delay-based limit: see "The concurrency limit" in docs/relay.md).
    pub fn adaptive(ceiling: usize) -> Self {
        let vegas = Vegas::new(ceiling, Instant::now());
        Slots::with(vegas.limit(), Some(vegas), None, None)
    }

    pub(crate) fn for_relay(config: &super::RelayConfig, metrics: Arc<RelayMetrics>) -> Self {
        let vegas = (!config.fixed_concurrency).then(|| Vegas::new(config.concurrency, Instant::now()));
        let limit = vegas.as_ref().map_or(config.concurrency.max(1), Vegas::limit);
        Slots::with(limit, vegas, config.rate_limit, Some(metrics))
    }

    fn with(limit: usize, adaptive: Option<Vegas>, rate: Option<f64>, metrics: Option<Arc<RelayMetrics>>) -> Self {
        if let Some(metrics) = &metrics {
            metrics.deliveries(limit, 0);
        }
        let bucket = Bucket::new(rate, Instant::now());
        let state = SlotsState { adaptive, bucket, limit, debt: 0, in_flight: 0 };
        Slots {
            inner: Arc::new(SlotsInner {
                semaphore: Arc::new(Semaphore::new(limit)),
                state: Mutex::new(state),
                metrics,
            }),
            progress: None,
        }
    }

    /// These slots, reporting the deliveries that end to `progress`.
    pub(crate) fn reporting(&self, progress: Arc<Progress>) -> Slots {
        Slots { inner: self.inner.clone(), progress: Some(progress) }
    }

    /// Tells the relay that `event`, of the batch being handled, is delivered (`result` is `Ok`)
    /// before the rest of the batch is: the relay records it within moments
    /// ([`RelayConfig::record_every`](super::RelayConfig::record_every)) rather than with the
    /// whole batch, so that a crash delivers again only what was in flight. The default
    /// [`Handler::handle_batch`] calls it for every event; a handler that overrides it may, for
    /// each event the destination has durably taken. A failure is not reported: it is recorded
    /// with the batch.
    pub fn finished(&self, event: &Event, result: &Result<(), DeliveryError>) {
        if let (Some(progress), Ok(())) = (&self.progress, result) {
            progress.delivered.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).push(event.id);
        }
    }

    /// Waits for a free place and takes it, for one event.
    pub async fn take(&self) -> Slot {
        self.take_for(1).await
    }

    /// Waits for a free place and takes it, for a write of `events` events at once (a batch
    /// sent in one piece): the rate limit counts them all, the concurrency limit one.
    pub async fn take_for(&self, events: usize) -> Slot {
        let permit = self.inner.semaphore.clone().acquire_owned().await.expect("the relay never closes its slots");
        // Then the rate limit's tokens (and the pause a Retry-After asked for): only holders of a
        // place wait for them, and the round trip is timed from when the request may leave.
        loop {
            let taken = self.inner.lock().bucket.take(events, Instant::now());
            match taken {
                Ok(()) => break,
                Err(wait) => tokio::time::sleep(wait).await,
            }
        }
        let in_flight = {
            let mut state = self.inner.lock();
            state.in_flight += 1;
            self.inner.publish(&state);
            state.in_flight
        };
        Slot { slots: self.inner.clone(), permit: Some(permit), taken: Instant::now(), in_flight }
    }

    /// How many places are free now.
    pub fn available(&self) -> usize {
        self.inner.semaphore.available_permits()
    }

    /// The limit now: fixed, or as learnt so far.
    pub fn limit(&self) -> usize {
        self.inner.lock().limit
    }
}

impl SlotsInner {
    fn lock(&self) -> std::sync::MutexGuard<'_, SlotsState> {
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn publish(&self, state: &SlotsState) {
        if let Some(metrics) = &self.metrics {
            metrics.deliveries(state.limit, state.in_flight);
        }
    }

    /// Moves the limit to `limit`: new permits, or permits forgotten (now if free, else as
    /// they come back).
    fn resize(&self, state: &mut SlotsState, limit: usize) {
        if limit > state.limit {
            let more = limit - state.limit;
            let paid = more.min(state.debt);
            state.debt -= paid;
            self.semaphore.add_permits(more - paid);
        } else if limit < state.limit {
            let fewer = state.limit - limit;
            let forgotten = self.semaphore.forget_permits(fewer);
            state.debt += fewer - forgotten;
        }
        state.limit = limit;
    }
}

impl Slot {
    /// Gives the place back with what became of its request: an answer (success, or a failure
    /// the destination answered with) tells an adaptive limit the destination's round trip, a
    /// failure marked [`DeliveryError::overloaded`] lowers it, any other failure (a connection
    /// refused: the outage breaker's business) says nothing.
    pub fn done(mut self, result: &Result<(), DeliveryError>) {
        let now = Instant::now();
        let slots = self.slots.clone();
        let mut state = slots.lock();
        let sample = match result {
            Err(e) if e.is_overload() => {
                if e.may_be_an_outage() {
                    // A 503 or a gateway's answer, perhaps with a Retry-After: a pause for all.
                    state.bucket.pause(e.requested_delay(), now);
                } else {
                    // A 429: slower from now on, and a pause if it asked for one.
                    state.bucket.refused(e.requested_delay(), now);
                }
                Some(Sample::Overloaded { rtt: now - self.taken, in_flight: self.in_flight })
            }
            Err(e) if e.may_be_an_outage() => None,
            _ => Some(Sample::Answered { rtt: now - self.taken, in_flight: self.in_flight }),
        };
        // The others still out: the limit tells those it cannot see answered from these.
        let others = state.in_flight.saturating_sub(1);
        if let (Some(sample), Some(vegas)) = (sample, &mut state.adaptive) {
            let limit = vegas.observe(sample, others, now);
            if limit != state.limit {
                tracing::trace!(limit, in_flight = state.in_flight, "the delivery limit moved");
                slots.resize(&mut state, limit);
            }
        }
        self.give_back(&mut state);
    }

    fn give_back(&mut self, state: &mut SlotsState) {
        let Some(permit) = self.permit.take() else { return };
        state.in_flight -= 1;
        if state.debt > 0 {
            state.debt -= 1;
            permit.forget();
        } else {
            drop(permit);
        }
        self.slots.publish(state);
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if self.permit.is_some() {
            let slots = self.slots.clone();
            let mut state = slots.lock();
            self.give_back(&mut state);
        }
    }
}

/// The failure a panicking handler counts as.
pub(crate) fn panicked(panic: &(dyn std::any::Any + Send)) -> DeliveryError {
    let message = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-string panic payload".to_string());
    DeliveryError::transient(format!("handler panicked: {message}"))
}

/// A handler made from an async closure that takes the event by value.
///
/// ```
/// use pg_outbox_relay::{handler_fn, Event};
/// let handler = handler_fn(|event: Event| async move {
///     println!("{}", event.id);
///     Ok(())
/// });
/// ```
pub fn handler_fn<F, Fut>(f: F) -> HandlerFn<F>
where
    F: Fn(Event) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), DeliveryError>> + Send,
{
    HandlerFn(f)
}

/// The [`Handler`] made by [`handler_fn`].
#[derive(Debug, Clone)]
pub struct HandlerFn<F>(F);

impl<F, Fut> Handler for HandlerFn<F>
where
    F: Fn(Event) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), DeliveryError>> + Send,
{
    fn handle(&self, event: &Event) -> impl Future<Output = Result<(), DeliveryError>> + Send {
        (self.0)(event.clone())
    }
}

impl<H: Handler> Handler for std::sync::Arc<H> {
    fn handle(&self, event: &Event) -> impl Future<Output = Result<(), DeliveryError>> + Send {
        (**self).handle(event)
    }

    fn handle_batch(
        &self,
        events: &[Event],
        slots: &Slots,
    ) -> impl Future<Output = Vec<Result<(), DeliveryError>>> + Send {
        (**self).handle_batch(events, slots)
    }
}
