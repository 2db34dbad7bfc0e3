//! HTTP: a POST per event, as the event's JSON or as a CloudEvent, optionally signed.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use reqwest::StatusCode;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue, LOCATION, RETRY_AFTER};

use super::cloudevents::{DEFAULT_CLOUDEVENTS_SOURCE, check_source};
use super::conventions::{RequestParts, SigningSecret, request_parts, signatures};
use super::url::redact as redact_url;
use super::{EventFormat, Secret};
use crate::error::{Error, Result};
use crate::event::Event;
use crate::relay::{DeliveryError, Handler};

/// Header carrying the event's id in this database ([`Event::id`]): its order.
pub const EVENT_ID_HEADER: &str = "Outbox-Event-Id";
/// Header carrying the event's uuid ([`Event::uuid`]), for the receiver's deduplication (with
/// a signing secret, `webhook-id` carries it too).
pub const EVENT_UUID_HEADER: &str = "Outbox-Event-Uuid";
/// Header carrying the topic.
pub const TOPIC_HEADER: &str = "Outbox-Topic";
/// Header carrying the attempt number (1 for the first delivery).
pub const ATTEMPT_HEADER: &str = "Outbox-Attempt";

/// How much of an error answer's body is read (for the error message); the rest is never read,
/// so an endless body costs nothing.
const ERROR_BODY_LIMIT: usize = 4096;
/// How many characters of it the error message shows.
const ERROR_SNIPPET_CHARS: usize = 200;

/// POSTs each event to one URL: as its JSON object, or as a CloudEvent; signed the Standard
/// Webhooks way when given secrets.
///
/// A 2xx answer is a delivery. 408, 429, 5xx, timeouts and connection errors are transient
/// (retried with backoff, or after the answer's `Retry-After` when it gives one); any other 4xx is
/// permanent (dead-lettered): the receiver refused this event and would refuse it again.
/// Redirects are never followed (a 3xx is a transient failure naming the `Location`): following
/// one would send a 301/302/303's event as a GET without its body, or a 307/308's to wherever the
/// receiver points. The URL's password and query values, the secrets and the fixed headers'
/// values never appear in logs or errors.
#[derive(Debug, Clone)]
pub struct HttpSink {
    client: reqwest::Client,
    url: reqwest::Url,
    /// `url` as it may be shown.
    pub(super) shown: String,
    format: EventFormat,
    source: String,
    secrets: Arc<[SigningSecret]>,
    /// Fixed headers; their values are not shown (`Debug` of a sensitive value hides it).
    headers: HeaderMap,
}

/// Builds an [`HttpSink`]: `HttpSink::builder(url).signing_secret(secret).format(..).build()`.
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct HttpSinkBuilder {
    url: String,
    timeout: Duration,
    format: EventFormat,
    source: String,
    secrets: Vec<SigningSecret>,
    headers: Vec<(String, Secret)>,
}

impl HttpSinkBuilder {
    /// Each request bounded by this (1 ms to [`super::MAX_TIMEOUT`]; default
    /// [`super::DEFAULT_HTTP_TIMEOUT`]).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How the event goes into the request (default [`EventFormat::Raw`]).
    pub fn format(mut self, format: EventFormat) -> Self {
        self.format = format;
        self
    }

    /// The CloudEvents `source` (default [`DEFAULT_CLOUDEVENTS_SOURCE`]): name the service or
    /// database, since `source` and `id` together identify an event.
    pub fn cloudevents_source(mut self, source: impl Into<String>) -> Self {
        self.source = source.into();
        self
    }

    /// Signs every request with this secret too (Standard Webhooks: `webhook-id` = the event's uuid,
    /// `webhook-timestamp` = the attempt's time, `webhook-signature` = one `v1,` signature per
    /// secret).
    pub fn signing_secret(mut self, secret: SigningSecret) -> Self {
        self.secrets.push(secret);
        self
    }

    /// Sends this header with every request (an `Authorization` token, say). Its value is never
    /// shown. The names no one but the sinks may set are refused, as for an event's headers
    /// ([`crate::Headers`]): `Content-Type`, `Host`, `User-Agent`, the framing headers,
    /// `webhook-*`, `ce-*`, `ce_*`, `Outbox-*`, `Nats-*`.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), Secret::new(value.into())));
        self
    }

    /// The sink, or an error naming what is wrong (never a secret or a header's value).
    pub fn build(self) -> Result<HttpSink> {
        let parsed = reqwest::Url::parse(&self.url).map_err(|e| {
            Error::config(format!(
                "invalid sink URL {}: {e} (expected http://host[:port]/path)",
                super::describe_spec(&self.url)
            ))
        })?;
        let shown = redact_url(&parsed);
        if !matches!(parsed.scheme(), "http" | "https") || parsed.host_str().is_none_or(str::is_empty) {
            return Err(Error::config(format!("invalid sink URL {shown}: expected http(s)://host[:port]/path")));
        }
        super::check_timeout(self.timeout)?;
        check_source(&self.source)?;
        let mut headers = HeaderMap::new();
        for (name, value) in &self.headers {
            let header = HeaderName::from_bytes(name.trim().as_bytes())
                .map_err(|_| Error::config(format!("{name:?} is no HTTP header name")))?;
            if crate::headers::is_reserved(header.as_str()) {
                return Err(Error::config(format!(
                    "the header {header} is set by the sink itself, or would change how the request is read; it cannot be given"
                )));
            }
            let mut value = HeaderValue::from_str(value.expose().trim()).map_err(|_| {
                Error::config(format!("the value of the header {header} holds characters a header cannot (control characters, a line break)"))
            })?;
            value.set_sensitive(true);
            headers.append(header, value);
        }
        let client = reqwest::Client::builder()
            .tls_backend_preconfigured(crate::tls::https_client_config()?)
            .timeout(self.timeout)
            .connect_timeout(self.timeout)
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("outbox-relay/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| Error::config(format!("cannot build the HTTP client: {e}")))?;
        Ok(HttpSink {
            client,
            url: parsed,
            shown,
            format: self.format,
            source: self.source,
            secrets: self.secrets.into(),
            headers,
        })
    }
}

impl HttpSink {
    /// A sink POSTing each event's JSON to `url`, each request bounded by `timeout`.
    pub fn new(url: &str, timeout: Duration) -> Result<Self> {
        HttpSink::builder(url).timeout(timeout).build()
    }

    /// A builder for a sink POSTing to `url`, with signing, formats and headers.
    pub fn builder(url: &str) -> HttpSinkBuilder {
        HttpSinkBuilder {
            url: url.to_string(),
            timeout: super::DEFAULT_HTTP_TIMEOUT,
            format: EventFormat::Raw,
            source: DEFAULT_CLOUDEVENTS_SOURCE.to_string(),
            secrets: Vec::new(),
            headers: Vec::new(),
        }
    }
}

impl Handler for HttpSink {
    async fn handle(&self, event: &Event) -> Result<(), DeliveryError> {
        let RequestParts { body, content_type, headers: ce_headers } = request_parts(event, self.format, &self.source)
            .map_err(|e| DeliveryError::permanent(format!("cannot serialize event {}: {e}", event.id)))?;
        let mut request = self
            .client
            .post(self.url.clone())
            .headers(self.headers.clone())
            .header(reqwest::header::CONTENT_TYPE, content_type)
            .header(EVENT_ID_HEADER, event.id.to_string())
            .header(EVENT_UUID_HEADER, event.uuid.to_string())
            .header(TOPIC_HEADER, &event.topic)
            .header(ATTEMPT_HEADER, event.attempts.to_string());
        // The CloudEvents attributes and the event's own headers; where the destination's fixed
        // headers name the same one, the operator's value stands.
        for (name, value) in ce_headers {
            if !self.headers.contains_key(name.as_str()) {
                request = request.header(name, value);
            }
        }
        if !self.secrets.is_empty() {
            // A fresh timestamp per attempt: receivers refuse old ones (replays).
            let timestamp = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs());
            let id = event.uuid.to_string();
            request = request
                .header("webhook-signature", signatures(&self.secrets, &id, timestamp, &body))
                .header("webhook-id", id)
                .header("webhook-timestamp", timestamp.to_string());
        }
        let response = request.body(body).send().await.map_err(|e| {
            let timed_out = e.is_timeout();
            let refused = connection_refused(&e);
            // (no connection made: refused, DNS, the connect or TLS handshake)
            let unreached = e.is_connect();
            let what = if timed_out { "timed out" } else { "failed" };
            // reqwest's message names the URL in full: say it ourselves, redacted.
            let error = DeliveryError::transient(format!(
                "POST {} {what}: {}",
                self.shown,
                crate::error::chain(&e.without_url())
            ));
            // A request that timed out (connecting included) waited in a queue somewhere: the
            // adaptive limit takes it as a sign of overload. A refused connection is not one.
            let error = match (timed_out, refused) {
                (true, _) => error.overloaded(),
                (false, true) => error.refused(),
                (false, false) => error,
            };
            if unreached { error.unreached() } else { error }
        })?;
        let status = response.status();
        if status.is_success() {
            return Ok(());
        }
        let retry_after = retry_after(response.headers(), SystemTime::now());
        if status.is_redirection() {
            let location = response.headers().get(LOCATION).map(|l| match l.to_str() {
                Ok(text) => self.url.join(text).map(|l| redact_url(&l)).unwrap_or_else(|_| "(unparseable)".into()),
                Err(_) => "(not text)".into(),
            });
            let error = DeliveryError::transient(format!(
                "POST {} answered {status} with Location {}: redirects are not followed (the event would not \
                 reach its destination intact); point the sink at the final address",
                self.shown,
                location.as_deref().unwrap_or("(none)")
            ));
            return Err(with_delay(error, retry_after));
        }
        let snippet = error_snippet(response).await;
        let message = format!("POST {} answered {status}: {snippet}", self.shown);
        if is_permanent(status) {
            return Err(DeliveryError::permanent(message));
        }
        let mut error = with_delay(DeliveryError::transient(message), retry_after);
        if is_overload(status) {
            error = error.overloaded();
        }
        if status == StatusCode::TOO_MANY_REQUESTS {
            // Up, and asking for less: the adaptive limit and the rate limit slow down; the
            // outage breaker does not count it.
            error = error.destination_answered();
        }
        Err(error)
    }
}

fn with_delay(error: DeliveryError, delay: Option<Duration>) -> DeliveryError {
    match delay {
        Some(delay) => error.retry_after(delay),
        None => error,
    }
}

/// The start of an error answer's body, on one line: at most [`ERROR_BODY_LIMIT`] bytes are read.
async fn error_snippet(mut response: reqwest::Response) -> String {
    let mut body = Vec::new();
    while body.len() < ERROR_BODY_LIMIT {
        match response.chunk().await {
            Ok(Some(chunk)) => body.extend_from_slice(&chunk[..chunk.len().min(ERROR_BODY_LIMIT - body.len())]),
            Ok(None) | Err(_) => break,
        }
    }
    // Dropping the response closes the connection on a body that goes on.
    drop(response);
    let text = String::from_utf8_lossy(&body);
    let mut snippet: String =
        text.split_whitespace().collect::<Vec<_>>().join(" ").chars().take(ERROR_SNIPPET_CHARS).collect();
    if snippet.is_empty() {
        snippet.push_str("(no body)");
    }
    snippet
}

/// The delay a `Retry-After` header asks for: seconds, or an HTTP date (`now` if it has passed).
fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let value = headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// Whether the request failed because the destination refused the connection.
fn connection_refused(error: &reqwest::Error) -> bool {
    crate::error::causes(error)
        .filter_map(|e| e.downcast_ref::<std::io::Error>())
        .any(|io| io.kind() == std::io::ErrorKind::ConnectionRefused)
}

/// The answers that say the destination (or a gateway before it) takes too much at once.
fn is_overload(status: StatusCode) -> bool {
    matches!(
        status,
        StatusCode::TOO_MANY_REQUESTS
            | StatusCode::BAD_GATEWAY
            | StatusCode::SERVICE_UNAVAILABLE
            | StatusCode::GATEWAY_TIMEOUT
    )
}

/// 4xx other than 408 (request timeout) and 429 (too many requests) means the event was refused.
fn is_permanent(status: StatusCode) -> bool {
    status.is_client_error() && status != StatusCode::REQUEST_TIMEOUT && status != StatusCode::TOO_MANY_REQUESTS
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
        let err = HttpSink::new("http://user:s3cret@/hook", DEFAULT).unwrap_err();
        assert!(!err.to_string().contains("s3cret"), "{err}");
    }

    #[test]
    fn retry_after_takes_seconds_or_a_date() {
        let mut headers = HeaderMap::new();
        assert_eq!(retry_after(&headers, SystemTime::now()), None);
        headers.insert(RETRY_AFTER, "5".parse().unwrap());
        assert_eq!(retry_after(&headers, SystemTime::now()), Some(Duration::from_secs(5)));
        let now = httpdate::parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT").unwrap();
        headers.insert(RETRY_AFTER, "Sun, 06 Nov 1994 08:50:07 GMT".parse().unwrap());
        assert_eq!(retry_after(&headers, now), Some(Duration::from_secs(30)));
        headers.insert(RETRY_AFTER, "Sun, 06 Nov 1994 08:00:00 GMT".parse().unwrap());
        assert_eq!(retry_after(&headers, now), Some(Duration::ZERO));
        headers.insert(RETRY_AFTER, "soon".parse().unwrap());
        assert_eq!(retry_after(&headers, now), None);
    }

    const DEFAULT: Duration = Duration::from_secs(1);
}
