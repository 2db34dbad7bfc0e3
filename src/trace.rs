//! Trace context through the outbox: what a publish records of the writer's span, and (with the
//! `opentelemetry` feature) the relay's spans that continue it.

use std::borrow::Cow;

use crate::headers::Headers;

/// The headers to store: the writer's, plus the current span's W3C trace context when the
/// `opentelemetry` feature is on, a span is being traced and the writer gave no `traceparent`.
pub(crate) fn with_current_context(headers: &Headers) -> Cow<'_, Headers> {
    #[cfg(feature = "opentelemetry")]
    if headers.traceparent().is_none()
        && let Some(context) = otel::current_context()
    {
        let mut headers = headers.clone();
        for (name, value) in context {
            headers.set(name, value);
        }
        return Cow::Owned(headers);
    }
    Cow::Borrowed(headers)
}
