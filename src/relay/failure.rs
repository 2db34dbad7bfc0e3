//! What a failed delivery says: a [`DeliveryError`], transient or permanent, with how long to
//! wait and whether the destination answered at all.

use std::fmt;
use std::time::Duration;

/// Why a delivery failed, and whether retrying can help.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveryError {
    permanent: bool,
    message: String,
    retry_after: Option<Duration>,
    /// The destination answered: this failure says nothing of an outage.
    answered: bool,
    /// A sign that the destination is overloaded (see [`DeliveryError::overloaded`]).
    overloaded: bool,
    /// Nobody listens at the destination now (see [`DeliveryError::refused`]).
    refused: bool,
    /// The destination never got the request (see [`DeliveryError::unreached`]).
    unreached: bool,
}

impl DeliveryError {
    /// The destination could not take the event now (down, overloaded, timed out): retry later
    /// with backoff, and dead-letter after the maximum attempts.
    pub fn transient(message: impl fmt::Display) -> Self {
        DeliveryError {
            permanent: false,
            message: shown(message),
            retry_after: None,
            answered: false,
            overloaded: false,
            refused: false,
            unreached: false,
        }
    }

    /// The event itself is bad (the destination refused it): dead-letter it now.
    pub fn permanent(message: impl fmt::Display) -> Self {
        DeliveryError {
            permanent: true,
            message: shown(message),
            retry_after: None,
            answered: true,
            overloaded: false,
            refused: false,
            unreached: false,
        }
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

    /// The failure is a sign that the destination takes too much at once (a timeout, an HTTP
    /// 429 or 503, a gateway's 502 or 504): a [`Slot`] given it back with [`Slot::done`] lowers
    /// the adaptive concurrency limit.
    #[must_use]
    pub fn overloaded(mut self) -> Self {
        self.overloaded = true;
        self
    }

    /// The destination refused the connection: nothing listens there now (a receiver not yet
    /// started, or restarting). Asking again costs nothing, so the open outage breaker probes
    /// again at its shortest interval (`breaker_probe_min`) instead of doubling it: the relay
    /// delivers soon after the receiver opens its port.
    #[must_use]
    pub fn refused(mut self) -> Self {
        self.refused = true;
        self
    }

    /// The request never reached the destination: no connection could be made (refused, a name
    /// that did not resolve, a failed or timed-out connect or TLS handshake). Such a failure says
    /// nothing of the event: the attempt is not counted toward `max_attempts` (an outage never
    /// sends an event to the dead letters), the event is tried again after `breaker_probe_min` at
    /// least, and the outage breaker opens once every event it could try has failed this way,
    /// however few they are. A failure once the request was on its way (a timeout, a connection
    /// reset or closed before the response) is not one of these: the event itself may be the
    /// cause (a body the receiver cannot take), and it must still reach the dead letters.
    #[must_use]
    pub fn unreached(mut self) -> Self {
        self.unreached = true;
        self
    }

    /// Whether the request never reached the destination ([`DeliveryError::unreached`]).
    pub fn is_unreached(&self) -> bool {
        self.unreached && !self.permanent && !self.answered
    }

    /// Whether the destination refused the connection ([`DeliveryError::refused`]).
    pub fn is_refused(&self) -> bool {
        self.refused
    }

    /// Whether the failure is a sign of overload ([`DeliveryError::overloaded`]).
    pub fn is_overload(&self) -> bool {
        self.overloaded
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
