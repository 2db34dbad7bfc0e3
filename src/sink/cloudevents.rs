//! CloudEvents 1.0 for the sinks that speak it (the HTTP and the Kafka binding): an event's
//! attributes for binary mode, and the JSON object of structured mode. Each binding puts the
//! attributes into its own headers (`ce-` and percent-encoded for HTTP, `ce_` for Kafka).

use super::EventFormat;
use crate::error::{Error, Result};
use crate::event::Event;

/// The CloudEvents `source` of events when none is given.
pub const DEFAULT_CLOUDEVENTS_SOURCE: &str = "urn:outbox-relay";

/// What goes into one message for an event.
pub(crate) struct Parts {
    pub(crate) body: Vec<u8>,
    pub(crate) content_type: &'static str,
    /// Binary mode's attributes, by their CloudEvents names (`id`, `type`, ...) and unencoded;
    /// empty in the other formats.
    pub(crate) attributes: Vec<(&'static str, String)>,
}

/// The body, its content type and (binary mode) the CloudEvents attributes for `format`:
/// `id` the event's uuid, `type` its topic, `source`, `time` its `created_at`, `partitionkey`
/// its key.
pub(crate) fn parts(event: &Event, format: EventFormat, source: &str) -> std::result::Result<Parts, serde_json::Error> {
    match format {
        EventFormat::Raw => {
            Ok(Parts { body: serde_json::to_vec(event)?, content_type: "application/json", attributes: Vec::new() })
        }
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
            Ok(Parts { body: event.payload.get().as_bytes().to_vec(), content_type: "application/json", attributes })
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
            };
            Ok(Parts {
                body: serde_json::to_vec(&object)?,
                content_type: "application/cloudevents+json; charset=utf-8",
                attributes: Vec::new(),
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
