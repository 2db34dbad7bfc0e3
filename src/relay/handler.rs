//! What a service implements to deliver events: a [`Handler`].

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::event::Event;

/// Why a delivery failed, and whether retrying can help.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveryError {
    permanent: bool,
    message: String,
    retry_after: Option<Duration>,
    /// The destination answered: this failure says nothing of an outage.
    answered: bool,
}

impl DeliveryError {
    /// The destination could not take the event now (down, overloaded, timed out): retry later
    /// with backoff, and dead-letter after the maximum attempts.
    pub fn transient(message: impl fmt::Display) -> Self {
        DeliveryError { permanent: false, message: shown(message), retry_after: None, answered: false }
    }

    /// The event itself is bad (the destination refused it): dead-letter it now.
    pub fn permanent(message: impl fmt::Display) -> Self {
        DeliveryError { permanent: true, message: shown(message), retry_after: None, answered: true }
    }

    /// The destination is up and answered, but cannot take this event yet (no RabbitMQ queue is
    /// bound for its routing key, no JetStream stream captures its subject): retried with
    /// backoff and dead-lettered after the maximum attempts like any transient failure, but not
    /// counted by the outage breaker, so that one such topic does not stop the others.
    #[must_use]
    pub fn destination_answered(mut self) -> Self {
        self.answered = true;
        self
    }

    /// Whether the failure may mean the destination is down (what the outage breaker counts):
    /// transient, and not [`DeliveryError::destination_answered`].
    pub fn may_be_an_outage(&self) -> bool {
        !self.answered
    }

    /// The destination asked not to be tried again before `delay` (an HTTP `Retry-After`): the
    /// retry waits at least that long (at most the relay's `backoff_max`), however short the
    /// backoff would be.
    #[must_use]
    pub fn retry_after(mut self, delay: Duration) -> Self {
        self.retry_after = Some(delay);
        self
    }

    /// The delay the destination asked for, if any.
    pub fn requested_delay(&self) -> Option<Duration> {
        self.retry_after
    }

    /// True for a permanent failure.
    pub fn is_permanent(&self) -> bool {
        self.permanent
    }

    /// The message stored as the event's `last_error`, its control and bidi characters written
    /// out as `\u{..}` (see [`printable`](crate::printable)): a receiver's error body cannot act
    /// on the terminal of an operator who reads the logs or `status`.
    pub fn message(&self) -> &str {
        &self.message
    }
}

/// A message as a delivery error keeps it.
fn shown(message: impl fmt::Display) -> String {
    let message = message.to_string();
    match crate::text::printable(&message) {
        std::borrow::Cow::Borrowed(_) => message,
        std::borrow::Cow::Owned(escaped) => escaped,
    }
}

impl fmt::Display for DeliveryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = if self.permanent { "permanent" } else { "transient" };
        write!(f, "{kind} delivery failure: {}", self.message)
    }
}

impl std::error::Error for DeliveryError {}

/// Delivers events to their destination.
///
/// Return `Ok(())` once the destination has the event. Delivery is at least once: the same event
/// (same [`Event::id`]) can arrive again after a crash or an expired lease, so destinations should
/// drop ids they have seen. A handler that panics counts as a transient failure for every event
/// of the batch it was given; the relay goes on.
///
/// ```
/// use outbox_relay::{DeliveryError, Event, Handler};
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
    /// records them together once the future completes.
    ///
    /// The relay never hands a batch two events of one key (a claim may hold several; they are
    /// handed over in rounds, a key's next event only once the one before it was delivered), so
    /// the events of a batch may be delivered in any order and at once. `slots` bounds the
    /// deliveries the whole relay has in progress
    /// ([`RelayConfig::concurrency`](super::RelayConfig::concurrency)): take a slot for each
    /// request, write or round trip in flight.
    ///
    /// Defaults to [`handle`](Self::handle) for every event at once, each holding a slot, a
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
                let _slot = slots.take().await;
                let delivery = std::panic::AssertUnwindSafe(self.handle(event)).catch_unwind().await;
                delivery.unwrap_or_else(|panic| Err(panicked(&*panic)))
            })
            .buffered(events.len().max(1))
            .collect()
    }
}

/// The relay's bound on deliveries in progress at once, shared by all its batches: see
/// [`Handler::handle_batch`].
#[derive(Debug, Clone)]
pub struct Slots {
    semaphore: Arc<Semaphore>,
}

/// One delivery's place within [`Slots`]; it frees the place when dropped.
#[derive(Debug)]
pub struct Slot {
    _permit: OwnedSemaphorePermit,
}

impl Slots {
    /// A bound of `limit` deliveries at once (at least one).
    pub fn new(limit: usize) -> Self {
        Slots { semaphore: Arc::new(Semaphore::new(limit.max(1))) }
    }

    /// Waits for a free place and takes it.
    pub async fn take(&self) -> Slot {
        let permit = self.semaphore.clone().acquire_owned().await.expect("the relay never closes its slots");
        Slot { _permit: permit }
    }

    /// How many places are free now.
    pub fn available(&self) -> usize {
        self.semaphore.available_permits()
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
/// use outbox_relay::{handler_fn, Event};
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
