//! The relay's `send` spans (with the `opentelemetry` feature): each delivery continues the
//! trace context its event stored (see `crate::trace`).

use opentelemetry::trace::TraceContextExt;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use super::failure::DeliveryError;
use crate::event::Event;
use crate::trace::{SYSTEM, headers_of, stored_context};

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
            // (the target the command exports and docs/tracing.md names, as `crate::trace`'s
            // spans have it: this module's own path would leave them out)
            let span = tracing::info_span!(
                target: "pg_outbox_relay::trace",
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
