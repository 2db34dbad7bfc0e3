//! Trace context through the outbox: what a publish records of the writer's span, and how a
//! stored context is read back (the relay's spans that continue it are `relay/trace.rs`'s).

use std::borrow::Cow;

use crate::headers::Headers;

/// The headers to store: the writer's, plus the current span's W3C trace context when the
/// `opentelemetry` feature is on, a span is being traced and the writer gave no `traceparent`.
pub(crate) fn with_current_context<'a>(headers: &'a Headers, _topic: &str) -> Cow<'a, Headers> {
    #[cfg(feature = "opentelemetry")]
    if headers.traceparent().is_none()
        && let Some(context) = otel::current_context(_topic)
    {
        let mut headers = headers.clone();
        for (name, value) in context {
            headers.set(name, value);
        }
        return Cow::Owned(headers);
    }
    Cow::Borrowed(headers)
}

#[cfg(feature = "opentelemetry")]
pub(crate) use otel::{SYSTEM, headers_of, stored_context};

/// The spans themselves, through tracing-opentelemetry: they exist where the application's
/// `tracing` subscriber has an OpenTelemetry layer, and cost nothing else.
#[cfg(feature = "opentelemetry")]
mod otel {
    use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId};
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    use crate::headers::Headers;

    /// What the spans call the system (OpenTelemetry's `messaging.system`).
    pub(crate) const SYSTEM: &str = "pg_outbox_relay";

    /// The W3C headers of a span context: `traceparent`, and `tracestate` when it has one.
    pub(crate) fn headers_of(context: &SpanContext) -> Vec<(String, String)> {
        let mut headers = vec![(
            Headers::TRACEPARENT.to_string(),
            format!("00-{}-{}-{:02x}", context.trace_id(), context.span_id(), context.trace_flags().to_u8()),
        )];
        let state = context.trace_state().header();
        if !state.is_empty() {
            headers.push((Headers::TRACESTATE.to_string(), state));
        }
        headers
    }

    /// The trace context an event carries, as a remote span context.
    pub(crate) fn stored_context(headers: &Headers) -> Option<SpanContext> {
        let mut fields = headers.traceparent()?.split('-');
        let (_version, trace, span, flags) = (fields.next()?, fields.next()?, fields.next()?, fields.next()?);
        let state = headers.get(Headers::TRACESTATE).and_then(|s| s.parse().ok()).unwrap_or_default();
        let context = SpanContext::new(
            TraceId::from_hex(trace).ok()?,
            SpanId::from_hex(span).ok()?,
            TraceFlags::new(u8::from_str_radix(flags, 16).ok()?),
            true,
            state,
        );
        context.is_valid().then_some(context)
    }

    /// The context of a `create` span for an event on `topic`, a child of the current span,
    /// when that span is traced (OpenTelemetry's messaging conventions: each message gets a
    /// creation context of its own, also when many are published at once).
    pub(super) fn current_context(topic: &str) -> Option<Vec<(String, String)>> {
        let current = tracing::Span::current().context().span().span_context().clone();
        if !current.is_valid() {
            return None;
        }
        let span = tracing::info_span!(
            "create",
            otel.name = format!("create {topic}"),
            otel.kind = "producer",
            messaging.system = SYSTEM,
            "messaging.operation.type" = "create",
            messaging.operation.name = "publish",
            messaging.destination.name = topic,
        );
        let context = span.context().span().span_context().clone();
        // A subscriber that filters out this crate's spans still gets the writer's own context.
        Some(headers_of(if context.is_valid() { &context } else { &current }))
    }
}
