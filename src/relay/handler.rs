//! What a service implements to deliver events: a [`Handler`].

use std::fmt;
use std::future::Future;

use crate::event::Event;

/// Why a delivery failed, and whether retrying can help.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveryError {
    permanent: bool,
    message: String,
}

impl DeliveryError {
    /// The destination could not take the event now (down, overloaded, timed out): retry later
    /// with backoff, and dead-letter after the maximum attempts.
    pub fn transient(message: impl fmt::Display) -> Self {
        DeliveryError { permanent: false, message: message.to_string() }
    }

    /// The event itself is bad (the destination refused it): dead-letter it now.
    pub fn permanent(message: impl fmt::Display) -> Self {
        DeliveryError { permanent: true, message: message.to_string() }
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

/// Delivers one event to its destination.
///
/// Return `Ok(())` once the destination has the event. Delivery is at least once: the same event
/// (same [`Event::id`]) can arrive again after a crash or an expired lease, so destinations should
/// drop ids they have seen. A handler that panics counts as a transient failure; the relay goes on.
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

    /// Called after each batch, before its deliveries are recorded: a handler that buffers
    /// (a file, a socket) makes what it accepted durable here. An error turns every delivery of
    /// the batch into a transient failure. Defaults to doing nothing.
    fn flush(&self) -> impl Future<Output = Result<(), DeliveryError>> + Send {
        std::future::ready(Ok(()))
    }
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

    fn flush(&self) -> impl Future<Output = Result<(), DeliveryError>> + Send {
        (**self).flush()
    }
}
