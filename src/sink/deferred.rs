//! A sink whose destination did not answer when the relay started: it connects at a delivery,
//! once the destination answers, so that one destination away at start does not stop the others.

use std::sync::OnceLock;
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::sync::Mutex;
use tokio::time::Instant;

use super::Sink;
use crate::event::Event;
use crate::relay::{DeliveryError, Handler, Slots};

/// How long a failed connect answers for the deliveries that follow it before one tries again
/// (a destination that does not answer at all would otherwise cost each batch a connect timeout).
const RETRY_GAP: Duration = Duration::from_secs(1);

/// What a [`Deferred`] sink calls to connect: the sink, or why it cannot be had.
pub type ConnectSink =
    Box<dyn Fn() -> BoxFuture<'static, Result<Sink, Box<dyn std::error::Error + Send + Sync>>> + Send + Sync>;

/// A sink that is connected at the first delivery that finds its destination up.
///
/// Until then every delivery fails at once: a connect that failed with
/// [`ErrorKind::Connect`](crate::ErrorKind::Connect) (nothing answers: refused, a name that does
/// not resolve, a timeout) as [`DeliveryError::unreached`], so that the events wait without
/// spending attempts and the outage breaker opens and probes, as for an outage at runtime;
/// any other error (a login refused, a stream that cannot be created) as a transient failure
/// that counts. A failed connect answers for the deliveries of the next second; then the next
/// delivery connects again.
pub struct Deferred {
    shown: String,
    connect: ConnectSink,
    /// Serializes the connects; holds the last failure and when it happened.
    failed: Mutex<Option<(Instant, DeliveryError)>>,
    ready: OnceLock<Box<dyn Erased>>,
}

impl std::fmt::Debug for Deferred {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Deferred").field("sink", &self.shown).field("connected", &self.ready.get().is_some()).finish()
    }
}

impl Deferred {
    /// A sink to the destination of `spec` (a sink spec or URL: it is shown redacted, never
    /// with its password) that `connect` connects at a delivery.
    pub fn new(spec: &str, connect: ConnectSink) -> Self {
        let shown = super::shown_spec(spec).unwrap_or_else(|placeholder| placeholder);
        Deferred { shown, connect, failed: Mutex::new(None), ready: OnceLock::new() }
    }

    /// The destination as it may be shown.
    pub fn describe(&self) -> &str {
        &self.shown
    }

    /// Whether the sink is connected.
    pub fn is_connected(&self) -> bool {
        self.ready.get().is_some()
    }

    /// The connected sink, connecting it if the last failure is more than [`RETRY_GAP`] old.
    async fn sink(&self) -> Result<&dyn Erased, DeliveryError> {
        if let Some(sink) = self.ready.get() {
            return Ok(&**sink);
        }
        let mut failed = self.failed.lock().await;
        if let Some(sink) = self.ready.get() {
            return Ok(&**sink);
        }
        if let Some((at, error)) = &*failed
            && at.elapsed() < RETRY_GAP
        {
            return Err(error.clone());
        }
        match (self.connect)().await {
            Ok(sink) => {
                tracing::info!(sink = %self.shown, "the destination answers; delivering to it");
                Ok(&**self.ready.get_or_init(|| Box::new(sink)))
            }
            Err(e) => {
                let away = e.downcast_ref::<crate::Error>().is_some_and(crate::Error::is_connect);
                let error = DeliveryError::transient(e.to_string());
                let error = if away { error.unreached() } else { error };
                tracing::debug!(sink = %self.shown, error = %e, "the destination still does not answer");
                *failed = Some((Instant::now(), error.clone()));
                Err(error)
            }
        }
    }
}

impl Handler for Deferred {
    async fn handle(&self, event: &Event) -> Result<(), DeliveryError> {
        self.sink().await?.handle_one(event).await
    }

    async fn handle_batch(&self, events: &[Event], slots: &Slots) -> Vec<Result<(), DeliveryError>> {
        match self.sink().await {
            Ok(sink) => sink.handle_all(events, slots).await,
            Err(error) => events.iter().map(|_| Err(error.clone())).collect(),
        }
    }
}

/// A sink's handler behind a trait object: the futures of [`Sink`] hold those of [`Deferred`],
/// so these cannot hold a [`Sink`]'s in turn.
trait Erased: Send + Sync {
    fn handle_one<'a>(&'a self, event: &'a Event) -> BoxFuture<'a, Result<(), DeliveryError>>;
    fn handle_all<'a>(&'a self, events: &'a [Event], slots: &'a Slots)
    -> BoxFuture<'a, Vec<Result<(), DeliveryError>>>;
}

impl<H: Handler> Erased for H {
    fn handle_one<'a>(&'a self, event: &'a Event) -> BoxFuture<'a, Result<(), DeliveryError>> {
        Box::pin(self.handle(event))
    }

    fn handle_all<'a>(
        &'a self,
        events: &'a [Event],
        slots: &'a Slots,
    ) -> BoxFuture<'a, Vec<Result<(), DeliveryError>>> {
        Box::pin(self.handle_batch(events, slots))
    }
}
