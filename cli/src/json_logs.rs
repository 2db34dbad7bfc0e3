//! `--log-format json`: one JSON object per line on stderr, for a log pipeline.
//!
//! Each line holds `time` (RFC 3339, UTC, microseconds), `level`, `target`, `message`, the event's
//! own fields by name (`error`, `events`, `ids`, ...), and what the spans around it say: `relay`
//! (the relay's id), `destination` (its name), `worker` (its number) and, for any other span, its
//! fields as `span.field`. Values keep their JSON type where they have one (numbers, booleans);
//! the rest are strings.

use std::io::Write;

use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Subscriber};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::Context;
use tracing_subscriber::registry::LookupSpan;

/// Names a line gives itself; an event's field of one of these names is kept as `field.NAME`.
const OWN: [&str; 4] = ["time", "level", "target", "message"];

/// The layer: writes each event it is given to stderr as one line.
pub struct JsonLogs;

/// A span's fields, kept in its extensions when it is made.
struct SpanFields(Map<String, Value>);

/// Collects fields into a JSON object.
struct Collect<'a>(&'a mut Map<String, Value>);

impl Visit for Collect<'_> {
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.put(
            field,
            serde_json::Number::from_f64(value).map_or_else(|| Value::String(value.to_string()), Value::Number),
        );
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.put(field, Value::from(value));
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.put(field, Value::from(value));
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.put(field, Value::Bool(value));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.put(field, Value::String(value.to_string()));
    }
    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.put(field, Value::String(value.to_string()));
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.put(field, Value::String(format!("{value:?}")));
    }
}

impl Collect<'_> {
    fn put(&mut self, field: &Field, value: Value) {
        self.0.insert(field.name().to_string(), value);
    }
}

/// Where a span's field goes on the line: the spans every relay line is under get short names.
fn key(span: &str, field: &str) -> String {
    match (span, field) {
        ("relay", "id") => "relay".into(),
        ("destination", "name") => "destination".into(),
        ("worker", "n") => "worker".into(),
        _ => format!("{span}.{field}"),
    }
}

/// One log line for an event: its own fields, then the spans' (the innermost span's value wins).
fn line<S: Subscriber + for<'a> LookupSpan<'a>>(event: &Event<'_>, ctx: &Context<'_, S>) -> Map<String, Value> {
    let mut fields = Map::new();
    event.record(&mut Collect(&mut fields));
    let metadata = event.metadata();
    let mut line = Map::new();
    line.insert(
        "time".into(),
        Value::String(humantime::format_rfc3339_micros(std::time::SystemTime::now()).to_string()),
    );
    line.insert("level".into(), Value::String(metadata.level().to_string()));
    // A line of a crate that logs through `log` (librdkafka's, say) comes with its target and
    // place as `log.*` fields: its target is the line's, the rest is noise.
    let target = match fields.remove("log.target") {
        Some(Value::String(target)) => target,
        _ => metadata.target().to_string(),
    };
    fields.retain(|name, _| !name.starts_with("log."));
    line.insert("target".into(), Value::String(target));
    let message = fields.remove("message").unwrap_or(Value::String(String::new()));
    line.insert("message".into(), message);
    for (name, value) in fields {
        let name = if OWN.contains(&name.as_str()) { format!("field.{name}") } else { name };
        line.insert(name, value);
    }
    if let Some(scope) = ctx.event_scope(event) {
        for span in scope {
            if let Some(SpanFields(own)) = span.extensions().get::<SpanFields>() {
                for (field, value) in own {
                    line.entry(key(span.name(), field)).or_insert_with(|| value.clone());
                }
            }
        }
    }
    line
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for JsonLogs {
    fn on_new_span(&self, attributes: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut fields = Map::new();
        attributes.record(&mut Collect(&mut fields));
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(SpanFields(fields));
        }
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id)
            && let Some(SpanFields(fields)) = span.extensions_mut().get_mut::<SpanFields>()
        {
            values.record(&mut Collect(fields));
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let mut text = Value::Object(line(event, &ctx)).to_string();
        text.push('\n');
        // One write per line, so that lines of concurrent tasks never interleave; a log that
        // cannot be written (stderr closed) is dropped, as the text format drops it.
        let _ = std::io::stderr().lock().write_all(text.as_bytes());
    }
}

/// A line said outside the log (the command's last error, what the exporter lost at exit) as
/// one JSON object of the same shape, for a log pipeline that reads stderr whole.
pub fn outside(level: tracing::Level, target: &str, message: &str) -> String {
    serde_json::json!({
        "time": humantime::format_rfc3339_micros(std::time::SystemTime::now()).to_string(),
        "level": level.to_string(),
        "target": target,
        "message": message,
    })
    .to_string()
}
