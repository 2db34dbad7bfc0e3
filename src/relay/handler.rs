//! What a service implements to deliver events: a [`Handler`].

use std::fmt;
use std::future::Future;
use std::time::Duration;

use futures::FutureExt;

use crate::event::Event;

/// Why a delivery failed, and whether retrying can help.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveryError {
    permanent: bool,
    message: String,
    retry_after: Option<Duration>,
}

impl DeliveryError {
    /// The destination could not take the event now (down, overloaded, timed out): retry later
    /// with backoff, and dead-letter after the maximum attempts.
    pub fn transient(message: impl fmt::Display) -> Self {
        DeliveryError { permanent: false, message: message.to_string(), retry_after: None }
    }

    /// The event itself is bad (the destination refused it): dead-letter it now.
    pub fn permanent(message: impl fmt::Display) -> Self {
        DeliveryError { permanent: true, message: message.to_string(), retry_after: None }
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

    /// The message stored as the event's `last_error`.
    pub fn message(&self) -> &str {
        &self.message
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
    /// records them together once the future completes. A handler that writes a batch at once
    /// (one write and flush, one pipelined round trip) overrides this; each result must say
    /// what became of that event, so a buffering handler makes the batch durable before it
    /// returns `Ok` for any of it. Defaults to [`handle`](Self::handle) for each event in turn,
    /// a panic failing only the event it happened on.
    fn handle_batch(&self, events: &[Event]) -> impl Future<Output = Vec<Result<(), DeliveryError>>> + Send {
        async move {
            let mut results = Vec::with_capacity(events.len());
            for event in events {
                let delivery = std::panic::AssertUnwindSafe(self.handle(event)).catch_unwind().await;
                results.push(delivery.unwrap_or_else(|panic| Err(panicked(&*panic))));
            }
            results
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

    fn handle_batch(&self, events: &[Event]) -> impl Future<Output = Vec<Result<(), DeliveryError>>> + Send {
        (**self).handle_batch(events)
    }
}
