//! Trace context through the outbox: what a publish records of the writer's span, and (with the
//! `opentelemetry` feature) the relay's spans that continue it.

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
pub(crate) use otel::Sends;

/// The spans themselves, through tracing-opentelemetry: they exist where the application's
/// `tracing` subscriber has an OpenTelemetry layer, and cost nothing else.
#[cfg(feature = "opentelemetry")]
mod otel {
    use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId};
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    use crate::event::Event;
    use crate::headers::Headers;
    use crate::relay::DeliveryError;

    /// What the spans call the system (OpenTelemetry's `messaging.system`).
    const SYSTEM: &str = "pg_outbox_relay";

    /// The W3C headers of a span context: `traceparent`, and `tracestate` when it has one.
    fn headers_of(context: &SpanContext) -> Vec<(String, String)> {
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
    fn stored_context(headers: &Headers) -> Option<SpanContext> {
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

    /// The `send` spans of one hand-over, one per event that carries a trace context: the
    /// first attempt's a child of the writer's span, a retry's a new trace linked to it (one
    /// trace per attempt: a redelivery hours later is not stretched into the writer's). Each
    /// event goes to the handler with its span's context as `traceparent`, so that the
    /// receiver's trace continues from the delivery.
    pub(crate) struct Sends {
        spans: Vec<Option<tracing::Span>>,
    }

    impl Sends {
        /// The spans, and the events as the handler gets them (`None`: unchanged).
        pub(crate) fn start(events: &[Event], destination: &str) -> (Sends, Option<Vec<Event>>) {
            let mut spans = Vec::with_capacity(events.len());
            let mut changed: Option<Vec<Event>> = None;
            for (i, event) in events.iter().enumerate() {
                let Some(stored) = stored_context(&event.headers) else {
                    spans.push(None);
                    continue;
                };
                let span = tracing::info_span!(
                    parent: None,
                    "send",
                    otel.name = format!("send {}", event.topic),
                    otel.kind = "producer",
                    otel.status_code = tracing::field::Empty,
                    otel.status_description = tracing::field::Empty,
                    messaging.system = SYSTEM,
                    "messaging.operation.type" = "send",
                    messaging.operation.name = "send",
                    messaging.destination.name = event.topic.as_str(),
                    messaging.message.id = %event.uuid,
                    outbox_relay.destination = destination,
                    outbox_relay.event.id = event.id,
                    outbox_relay.attempt = event.attempts,
                    "error.type" = tracing::field::Empty,
                );
                if event.attempts <= 1 {
                    let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(stored));
                } else {
                    span.add_link(stored);
                }
                let context = span.context().span().span_context().clone();
                if context.is_valid() {
                    let events = changed.get_or_insert_with(|| events.to_vec());
                    for (name, value) in headers_of(&context) {
                        events[i].headers.set(name, value);
                    }
                }
                spans.push(Some(span));
            }
            (Sends { spans }, changed)
        }

        /// Records each event's result on its span, and ends them.
        pub(crate) fn finish(self, results: &[Result<(), DeliveryError>]) {
            for (span, result) in self.spans.into_iter().zip(results) {
                let (Some(span), Err(error)) = (span, result) else { continue };
                span.record("otel.status_code", "ERROR");
                span.record("otel.status_description", error.to_string());
                span.record("error.type", if error.is_permanent() { "permanent" } else { "transient" });
            }
        }
    }
}
