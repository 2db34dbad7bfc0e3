//! The producer's context: librdkafka's logs and errors.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};

/// The producer's context: librdkafka's log lines go to `tracing`, and its last error is kept
/// to say why a connection or an acknowledgement failed.
#[derive(Clone)]
pub(super) struct Context {
    last_error: Arc<Mutex<Option<LastError>>>,
    shown: Arc<str>,
}

/// librdkafka's last error: its code, its text, when it came.
struct LastError {
    code: Option<RDKafkaErrorCode>,
    reason: String,
    at: std::time::Instant,
}

impl Context {
    pub(super) fn new(shown: &str) -> Self {
        Context { last_error: Arc::new(Mutex::new(None)), shown: shown.into() }
    }

    /// librdkafka's last error but "all brokers are down", which follows the one that says why.
    pub(super) fn last_error(&self) -> Option<String> {
        let last = self.last_error.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        last.as_ref().map(|last| last.reason.clone())
    }

    /// The last error with its age, when it is at most `within` old.
    pub(super) fn recent_error(&self, within: Duration) -> Option<String> {
        let last = self.last_error.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let last = last.as_ref()?;
        let age = last.at.elapsed();
        (age <= within).then(|| format!("{}, {} ms ago", last.reason, age.as_millis()))
    }
}

impl ClientContext for Context {
    fn log(&self, level: RDKafkaLogLevel, facility: &str, line: &str) {
        // librdkafka reconnects on its own and says so at every try; the relay's delivery
        // failures are what an operator reads, so these stay at debug.
        match level {
            RDKafkaLogLevel::Emerg | RDKafkaLogLevel::Alert | RDKafkaLogLevel::Critical => {
                tracing::warn!(broker = %self.shown, facility, "librdkafka: {line}");
            }
            _ => tracing::debug!(broker = %self.shown, facility, "librdkafka: {line}"),
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        let code = error.rdkafka_error_code();
        if code == Some(RDKafkaErrorCode::AllBrokersDown) {
            tracing::debug!(broker = %self.shown, "Kafka: {reason}");
            return;
        }
        let mut last = self.last_error.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if last.as_ref().is_none_or(|last| last.code != code) {
            // Once per kind of error: a broker that stays down is not logged at every reconnect.
            tracing::info!(broker = %self.shown, "Kafka: {reason}");
        }
        *last = Some(LastError { code, reason: reason.to_string(), at: std::time::Instant::now() });
    }
}
