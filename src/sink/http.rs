//! HTTP: a POST of the event's JSON per event.

use std::time::Duration;

use reqwest::StatusCode;

use super::event_json;
use crate::error::{Error, Result};
use crate::event::Event;
use crate::relay::{DeliveryError, Handler};

/// Header carrying the event id, for the receiver's deduplication.
pub const EVENT_ID_HEADER: &str = "Outbox-Event-Id";
/// Header carrying the topic.
pub const TOPIC_HEADER: &str = "Outbox-Topic";
/// Header carrying the attempt number (1 for the first delivery).
pub const ATTEMPT_HEADER: &str = "Outbox-Attempt";

/// POSTs each event as JSON to one URL.
///
/// A 2xx answer is a delivery. 408, 429, 5xx, timeouts and connection errors are transient
/// (retried with backoff); any other 4xx is permanent (dead-lettered): the receiver refused this
/// event and would refuse it again.
#[derive(Debug, Clone)]
pub struct HttpSink {
    client: reqwest::Client,
    url: reqwest::Url,
}

impl HttpSink {
    /// A sink POSTing to `url`, each request bounded by `timeout`.
    pub fn new(url: &str, timeout: Duration) -> Result<Self> {
        let parsed = reqwest::Url::parse(url)
            .map_err(|e| Error::config(format!("invalid sink URL {url:?}: {e} (expected http://host[:port]/path)")))?;
        if parsed.host_str().is_none() {
            return Err(Error::config(format!("invalid sink URL {url:?}: no host")));
        }
        if timeout.is_zero() {
            return Err(Error::config("the HTTP timeout must be positive"));
        }
        crate::tls::install_crypto_provider();
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout)
            .user_agent(concat!("outbox-relay/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| Error::config(format!("cannot build the HTTP client: {e}")))?;
        Ok(HttpSink { client, url: parsed })
    }
}

impl Handler for HttpSink {
    async fn handle(&self, event: &Event) -> Result<(), DeliveryError> {
        let body = event_json(event)?;
        let response = self
            .client
            .post(self.url.clone())
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header(EVENT_ID_HEADER, event.id.to_string())
            .header(TOPIC_HEADER, &event.topic)
            .header(ATTEMPT_HEADER, event.attempts.to_string())
            .body(body)
            .send()
            .await
            .map_err(|e| {
                let what = if e.is_timeout() { "timed out" } else { "failed" };
                DeliveryError::transient(format!("POST {} {what}: {}", self.url, error_chain(&e)))
            })?;
        let status = response.status();
        if status.is_success() {
            return Ok(());
        }
        let body = response.text().await.unwrap_or_default();
        let snippet: String = body.chars().take(200).collect();
        let message = format!("POST {} answered {status}: {snippet}", self.url);
        if is_permanent(status) {
            Err(DeliveryError::permanent(message))
        } else {
            Err(DeliveryError::transient(message))
        }
    }
}

/// 4xx other than 408 (request timeout) and 429 (too many requests) means the event was refused.
fn is_permanent(status: StatusCode) -> bool {
    status.is_client_error() && status != StatusCode::REQUEST_TIMEOUT && status != StatusCode::TOO_MANY_REQUESTS
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_classes() {
        for code in [400, 401, 403, 404, 409, 410, 422] {
            assert!(is_permanent(StatusCode::from_u16(code).unwrap()), "{code}");
        }
        for code in [408, 429, 500, 502, 503, 504, 302] {
            assert!(!is_permanent(StatusCode::from_u16(code).unwrap()), "{code}");
        }
    }

    #[test]
    fn bad_urls_are_refused() {
        assert!(HttpSink::new("http://", DEFAULT).is_err());
        assert!(HttpSink::new("http://example.com/hook", Duration::ZERO).is_err());
        assert!(HttpSink::new("http://127.0.0.1:9/hook", DEFAULT).is_ok());
    }

    const DEFAULT: Duration = Duration::from_secs(1);
}
