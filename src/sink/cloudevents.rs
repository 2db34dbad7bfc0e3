//! CloudEvents 1.0 for the sinks that speak it (the HTTP and the Kafka binding): an event's
//! attributes for binary mode, and the JSON object of structured mode. Each binding puts the
//! attributes into its own headers (`ce-` and percent-encoded for HTTP, `ce_` for Kafka).

use super::EventFormat;
use crate::error::{Error, Result};
use crate::event::Event;

/// The CloudEvents `source` of events when none is given.
pub const DEFAULT_CLOUDEVENTS_SOURCE: &str = "urn:outbox-relay";

/// What goes into one message for an event.
pub(crate) struct Parts<'a> {
    pub(crate) body: Vec<u8>,
    pub(crate) content_type: &'static str,
    /// Binary mode's attributes, by their CloudEvents names (`id`, `type`, ...) and unencoded,
    /// the event's headers that are extensions among them; empty in the other formats.
    pub(crate) attributes: Vec<(&'a str, String)>,
    /// The event's headers that go as the transport's own headers, as given: all of them in
    /// [`EventFormat::Raw`]; in CloudEvents those whose names are no extension's, and the trace
    /// context, which receivers' instrumentation reads from the transport (W3C Trace Context).
    pub(crate) headers: Pairs<'a>,
}

/// The context attributes of CloudEvents 1.0, which no header may stand for.
const CONTEXT_ATTRIBUTES: [&str; 11] = [
    "specversion",
    "id",
    "source",
    "type",
    "time",
    "subject",
    "datacontenttype",
    "dataschema",
    "data",
    "data_base64",
    "partitionkey",
];

/// A header that travels as a CloudEvents extension attribute: its name is one (lower-case
/// letters and digits, at most 20) and not a context attribute's.
fn is_extension(name: &str) -> bool {
    (1..=20).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        && !CONTEXT_ATTRIBUTES.contains(&name)
}

/// The trace context, which goes as the transport's headers in every format.
fn is_trace_context(name: &str) -> bool {
    name == crate::Headers::TRACEPARENT || name == crate::Headers::TRACESTATE
}

/// Header names and values, borrowed from the event.
type Pairs<'a> = Vec<(&'a str, &'a str)>;

/// The event's headers split for `format`: (extension attributes, transport headers).
fn split_headers(event: &Event, format: EventFormat) -> (Pairs<'_>, Pairs<'_>) {
    if format == EventFormat::Raw {
        return (Vec::new(), event.headers.iter().collect());
    }
    let extensions = event.headers.iter().filter(|(name, _)| is_extension(name)).collect();
    let transport = event.headers.iter().filter(|(name, _)| !is_extension(name) || is_trace_context(name)).collect();
    (extensions, transport)
}

/// The body, its content type and (binary mode) the CloudEvents attributes for `format`:
/// `id` the event's uuid, `type` its topic, `source`, `time` its `created_at`, `partitionkey`
/// its key.
///
/// The event's headers: in CloudEvents, those named as extensions (`tenant`, `traceparent`) are
/// extension attributes; the rest, and the trace context again, go as transport headers.
pub(crate) fn parts<'a>(
    event: &'a Event,
    format: EventFormat,
    source: &str,
) -> std::result::Result<Parts<'a>, serde_json::Error> {
    let (extensions, headers) = split_headers(event, format);
    match format {
        EventFormat::Raw => Ok(Parts {
            body: serde_json::to_vec(event)?,
            content_type: "application/json",
            attributes: Vec::new(),
            headers,
        }),
        EventFormat::CloudEventsBinary => {
            let mut attributes = vec![
                ("specversion", "1.0".to_string()),
                ("id", event.uuid.to_string()),
                ("source", source.to_string()),
                ("type", event.topic.clone()),
                ("time", crate::timestamp::rfc3339_micros(event.created_at)),
            ];
            if let Some(key) = &event.key {
                attributes.push(("partitionkey", key.clone()));
            }
            attributes.extend(extensions.into_iter().map(|(name, value)| (name, value.to_string())));
            Ok(Parts {
                body: event.payload.get().as_bytes().to_vec(),
                content_type: "application/json",
                attributes,
                headers,
            })
        }
        EventFormat::CloudEventsStructured => {
            let object = Structured {
                specversion: "1.0",
                id: event.uuid.to_string(),
                source,
                r#type: &event.topic,
                time: crate::timestamp::rfc3339_micros(event.created_at),
                datacontenttype: "application/json",
                data: &event.payload,
                partitionkey: event.key.as_deref(),
                extensions: extensions.into_iter().collect(),
            };
            Ok(Parts {
                body: serde_json::to_vec(&object)?,
                content_type: "application/cloudevents+json; charset=utf-8",
                attributes: Vec::new(),
                headers,
            })
        }
    }
}

/// A CloudEvent in the structured mode's JSON, its `data` the payload's text as stored.
#[derive(serde::Serialize)]
struct Structured<'a> {
    specversion: &'static str,
    id: String,
    source: &'a str,
    r#type: &'a str,
    time: String,
    datacontenttype: &'static str,
    data: &'a crate::Payload,
    #[serde(skip_serializing_if = "Option::is_none")]
    partitionkey: Option<&'a str>,
    /// The event's headers that are extension attributes.
    #[serde(flatten)]
    extensions: std::collections::BTreeMap<&'a str, &'a str>,
}

/// Checks a CloudEvents source: a URI-reference, so non-empty and without spaces or controls.
pub(crate) fn check_source(source: &str) -> Result<()> {
    if source.is_empty() || source.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(Error::config(format!(
            "the CloudEvents source {source:?} is no URI-reference (e.g. urn:shop:orders or https://shop.example/orders)"
        )));
    }
    Ok(())
}
