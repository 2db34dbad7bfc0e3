//! Where `run` delivers: one `--sink`, `--route NAME=PATTERN=SINK` flags, or the destinations of
//! a `--config` file, each with its own sink options where the file gives them.
//!
//! ```toml
//! [[destination]]
//! name = "erp"
//! pattern = "order.#"
//! sink = "https://erp.example.com/hooks/outbox"
//! format = "cloudevents"
//! signing_secrets = ["whsec_..."]
//! headers = { Authorization = "Bearer ..." }
//! timeout = "5s"
//! concurrency = 32
//!
//! [[destination]]
//! name = "mailer"
//! pattern = "mail.*"
//! sink = "http://127.0.0.1:8025/send"
//! rate_limit = "20/s"
//! ```

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use pg_outbox_relay::sink::{ConnectSink, Deferred, EventFormat, Secret, Sink};
use pg_outbox_relay::{DEFAULT_DESTINATION, Route};
use serde::Deserialize;

use crate::outcome::{CliError, UsageError};
use crate::sinks::{KafkaOptions, SinkOptions};

/// One destination as the command line or the file gives it, before its sink is connected.
#[derive(Debug, Clone)]
pub(crate) struct Destination {
    pub(crate) name: String,
    pub(crate) pattern: String,
    pub(crate) sink: String,
    pub(crate) options: SinkOptions,
    pub(crate) concurrency: Option<usize>,
    pub(crate) fixed_concurrency: Option<bool>,
    pub(crate) rate_limit: Option<f64>,
}

impl Destination {
    /// Connects its sink (a bad spec is refused before anything touches the database) and makes
    /// its route. A broker that does not answer makes a sink connected at a later delivery
    /// (unless `exit_if_away`): one destination away does not stop the others.
    pub(crate) async fn route(self, exit_if_away: bool) -> Result<(Route<Sink>, String), CliError> {
        let sink = match crate::sinks::connect(&self.sink, &self.options).await {
            Ok(sink) => sink,
            Err(error) if !exit_if_away && is_away(&error) => {
                tracing::warn!(
                    destination = %self.name,
                    error = %error,
                    "the destination does not answer; the relay starts without it: its events wait, spending no attempt, \
                     and it is connected at a later delivery (--exit-on-sink-error exits instead)"
                );
                let (spec, options) = (self.sink.clone(), self.options.clone());
                let connect: ConnectSink = Box::new(move || {
                    let (spec, options) = (spec.clone(), options.clone());
                    Box::pin(async move { crate::sinks::connect(&spec, &options).await })
                });
                Sink::Deferred(Deferred::new(&self.sink, connect))
            }
            // `--sink`'s error as it was; a route's names the route.
            Err(error) if self.name == DEFAULT_DESTINATION && self.pattern == "#" => return Err(error),
            Err(error) => return Err(AtDestination { name: self.name, error }.into()),
        };
        let shown = format!("{} ({}) -> {}", self.name, self.pattern, sink.describe());
        let mut route = Route::new(self.name, &self.pattern, sink)?;
        if let Some(concurrency) = self.concurrency {
            route = route.concurrency(concurrency);
        }
        if let Some(fixed) = self.fixed_concurrency {
            route = route.fixed_concurrency(fixed);
        }
        if self.rate_limit.is_some() {
            route = route.rate_limit(self.rate_limit);
        }
        Ok((route, shown))
    }
}

/// Whether a sink's error says that its broker does not answer (rather than a bad spec or a
/// refused login).
fn is_away(error: &CliError) -> bool {
    error.downcast_ref::<pg_outbox_relay::Error>().is_some_and(pg_outbox_relay::Error::is_connect)
}

/// A destination's sink that cannot be had, naming the destination; its exit code is the
/// error's (2 for a bad spec, 1 for a broker that does not answer or refuses the login).
#[derive(Debug)]
pub(crate) struct AtDestination {
    name: String,
    pub(crate) error: CliError,
}

impl std::fmt::Display for AtDestination {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "destination {:?}: {}", self.name, self.error)
    }
}

impl std::error::Error for AtDestination {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.error)
    }
}

/// The single `--sink`: every event, to the destination `default`.
pub(crate) fn single(sink: String, options: SinkOptions) -> Destination {
    Destination {
        name: DEFAULT_DESTINATION.to_string(),
        pattern: "#".to_string(),
        sink,
        options,
        concurrency: None,
        fixed_concurrency: None,
        rate_limit: None,
    }
}

/// A `--route`: `NAME=PATTERN=SINK`, or `PATTERN=SINK` (named after its pattern). The sink is
/// what follows the first `=` when that is `stdout` or a URL (`scheme://`), else what follows the
/// second.
pub(crate) fn parse_route(spec: &str, options: &SinkOptions) -> Result<Destination, CliError> {
    let bad = |why: &str| {
        // A sink URL may carry a password: only a name or pattern before the first '=' is shown.
        let first = spec.split_once('=').map_or(spec, |(first, _)| first);
        let shown = if is_plain(first) { format!("{first:?}") } else { "(not shown)".to_string() };
        UsageError(format!(
            "--route {shown}: {why}; expected NAME=PATTERN=SINK or PATTERN=SINK, e.g. erp=order.#=https://erp.example/hook"
        ))
    };
    let (first, rest) = spec.split_once('=').ok_or_else(|| bad("there is no '='"))?;
    let (name, pattern, sink) = if looks_like_sink(rest) {
        (first, first, rest)
    } else {
        let (pattern, sink) = rest.split_once('=').ok_or_else(|| bad("no sink after the pattern"))?;
        (first, pattern, sink)
    };
    if !looks_like_sink(sink) {
        return Err(
            bad("the sink must be stdout or a URL (http://, https://, nats://, amqp://, amqps://, kafka://)").into()
        );
    }
    Ok(Destination {
        name: name.to_string(),
        pattern: pattern.to_string(),
        sink: sink.to_string(),
        options: options.clone(),
        concurrency: None,
        fixed_concurrency: None,
        rate_limit: None,
    })
}

/// Whether `text` is made of the characters of names and patterns only (so no URL, no password).
fn is_plain(text: &str) -> bool {
    !text.is_empty() && text.chars().all(|c| c.is_ascii_alphanumeric() || "._-*#".contains(c))
}

fn looks_like_sink(text: &str) -> bool {
    text == "stdout"
        || text.split_once("://").is_some_and(|(scheme, _)| {
            !scheme.is_empty() && scheme.chars().all(|c| c.is_ascii_alphanumeric() || c == '+')
        })
}

/// A configuration file: its destinations.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(rename = "destination", default)]
    destinations: Vec<FileDestination>,
}

/// One `[[destination]]` of the file; what it leaves out comes from the command line's flags.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileDestination {
    name: String,
    pattern: String,
    sink: String,
    format: Option<String>,
    signing_secrets: Option<OneOrMany>,
    headers: Option<BTreeMap<String, String>>,
    timeout: Option<String>,
    rate_limit: Option<String>,
    concurrency: Option<usize>,
    fixed_concurrency: Option<bool>,
    subject_prefix: Option<String>,
    create_stream: Option<String>,
    exchange: Option<String>,
    cloudevents_source: Option<String>,
    kafka_topic: Option<String>,
    kafka_tls: Option<bool>,
    kafka_ca_file: Option<std::path::PathBuf>,
    kafka_username: Option<String>,
    kafka_password: Option<String>,
    kafka_sasl_mechanism: Option<String>,
    kafka_properties: Option<BTreeMap<String, String>>,
}

/// One secret or a list of them (so that a single one given as a string is no type error that
/// would print it).
#[derive(Debug, Deserialize)]
#[serde(
    untagged,
    expecting = "signing_secrets is a secret as a string, or a list of them (signing_secrets = \"whsec_...\")"
)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

/// The destinations of the file at `path`, each with the command line's sink options
/// (`defaults`) where it gives none. Errors name the file, the destination and the setting, never
/// a secret's value.
pub(crate) fn read_file(path: &Path, defaults: &SinkOptions) -> Result<Vec<Destination>, CliError> {
    let shown = path.display();
    let text = std::fs::read_to_string(path).map_err(|e| UsageError(format!("--config {shown}: {e}")))?;
    // `[destination]` (one table) where `[[destination]]` (one of a list) was meant: said so,
    // rather than the type error it would be.
    if let Ok(table) = toml::from_str::<toml::Table>(&text)
        && table.get("destination").is_some_and(toml::Value::is_table)
    {
        return Err(UsageError(format!(
            "--config {shown}: [destination] is a single table; write [[destination]] (two brackets) before each destination"
        ))
        .into());
    }
    let file: File = toml::from_str(&text).map_err(|e| {
        let line = e.span().map(|span| text[..span.start.min(text.len())].matches('\n').count() + 1);
        let at = line.map_or(String::new(), |line| format!(" (line {line})"));
        // The message only: the error's own rendering quotes the line, which may hold a secret,
        // and a value of the wrong type is named by its type, not shown.
        UsageError(format!("--config {shown}{at}: {}", without_strings(e.message().trim())))
    })?;
    if file.destinations.is_empty() {
        return Err(UsageError(format!("--config {shown}: no [[destination]] in it")).into());
    }
    file.destinations
        .into_iter()
        .map(|d| {
            let name = d.name.clone();
            d.resolve(defaults)
                .map_err(|why| UsageError(format!("--config {shown}: destination {name:?}: {why}")).into())
        })
        .collect()
}

/// A message about flags (`--exchange`, `--kafka-username`, the password's variable) told about
/// a configuration file's keys instead (`exchange`, `kafka_username`, `kafka_password`).
fn as_file_keys(message: &str) -> String {
    message
        .replace("the password (OUTBOX_RELAY_KAFKA_PASSWORD)", "kafka_password")
        .split(' ')
        .map(|word| match word.strip_prefix("--") {
            Some("header") => "headers".to_string(),
            Some(flag) => flag.replace('-', "_"),
            None => word.to_string(),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

impl FileDestination {
    fn resolve(self, defaults: &SinkOptions) -> Result<Destination, String> {
        pg_outbox_relay::TopicPattern::parse(&self.pattern).map_err(|e| format!("pattern: {e}"))?;
        let mut options = defaults.clone();
        self.kafka_settings(&mut options.kafka)?;
        if let Some(format) = &self.format {
            options.format = format.parse::<EventFormat>().map_err(|e| format!("format: {e}"))?;
        }
        if let Some(secrets) = self.signing_secrets {
            options.signing_secrets = match secrets {
                OneOrMany::One(one) => vec![Secret::new(one)],
                OneOrMany::Many(many) => many.into_iter().map(Secret::new).collect(),
            };
        }
        if let Some(headers) = self.headers {
            options.headers = headers.into_iter().map(|(name, value)| (name, Secret::new(value))).collect();
        }
        if let Some(timeout) = &self.timeout {
            options.timeout = parse_timeout(timeout).map_err(|e| format!("timeout: {e}"))?;
        }
        if let Some(prefix) = self.subject_prefix {
            options.subject_prefix = prefix;
        }
        if self.create_stream.is_some() {
            options.create_stream = self.create_stream;
        }
        if let Some(exchange) = self.exchange {
            options.exchange = exchange;
        }
        if self.cloudevents_source.is_some() {
            options.cloudevents_source = self.cloudevents_source;
        }
        let rate_limit = match &self.rate_limit {
            Some(rate) => Some(crate::values::parse_rate(rate).map_err(|e| format!("rate_limit: {e}"))?),
            None => None,
        };
        if let Some(concurrency) = self.concurrency {
            crate::values::parse_concurrency(&concurrency.to_string()).map_err(|e| format!("concurrency: {e}"))?;
        }
        // A setting of the file's that this sink does not take, named as the file names it (one
        // the command line gave is refused at the start, naming the flag).
        let sink = pg_outbox_relay::sink::lower_scheme(&self.sink);
        if defaults.check_for(&sink).is_ok() {
            options.check_for(&sink).map_err(|e| as_file_keys(&e.0))?;
        }
        Ok(Destination {
            name: self.name,
            pattern: self.pattern,
            sink: self.sink,
            options,
            concurrency: self.concurrency,
            fixed_concurrency: self.fixed_concurrency,
            rate_limit,
        })
    }
}

impl FileDestination {
    /// The Kafka sink's settings the destination gives.
    fn kafka_settings(&self, kafka: &mut KafkaOptions) -> Result<(), String> {
        if let Some(topic) = &self.kafka_topic {
            kafka.topic.clone_from(topic);
        }
        if let Some(tls) = self.kafka_tls {
            kafka.tls = tls;
        }
        if self.kafka_ca_file.is_some() {
            kafka.ca_file.clone_from(&self.kafka_ca_file);
        }
        if self.kafka_username.is_some() {
            kafka.username.clone_from(&self.kafka_username);
        }
        if let Some(password) = &self.kafka_password {
            kafka.password = Some(Secret::new(password.clone()));
        }
        if let Some(mechanism) = &self.kafka_sasl_mechanism {
            kafka.sasl_mechanism = Some(mechanism.parse().map_err(|e| format!("kafka_sasl_mechanism: {e}"))?);
        }
        if let Some(properties) = &self.kafka_properties {
            kafka.properties =
                properties.iter().map(|(name, value)| (name.clone(), Secret::new(value.clone()))).collect();
        }
        Ok(())
    }
}

/// `message` with every `string "…"` serde quotes written `a string`.
fn without_strings(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut rest = message;
    while let Some(at) = rest.find("string \"") {
        out.push_str(&rest[..at]);
        out.push_str("a string");
        let after = &rest[at + "string \"".len()..];
        // To the closing quote (serde escapes quotes inside), or the end.
        let mut end = after.len();
        let mut escaped = false;
        for (i, c) in after.char_indices() {
            match c {
                '\\' if !escaped => escaped = true,
                '"' if !escaped => {
                    end = i + 1;
                    break;
                }
                _ => escaped = false,
            }
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

fn parse_timeout(text: &str) -> Result<Duration, String> {
    crate::values::duration_in(Duration::from_millis(1), pg_outbox_relay::sink::MAX_TIMEOUT)(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_parse_with_and_without_a_name() {
        let o = SinkOptions::default();
        let d = parse_route("erp=order.#=https://erp.example/hook?a=b", &o).unwrap();
        assert_eq!(
            (d.name.as_str(), d.pattern.as_str(), d.sink.as_str()),
            ("erp", "order.#", "https://erp.example/hook?a=b")
        );
        let d = parse_route("mail.*=stdout", &o).unwrap();
        assert_eq!((d.name.as_str(), d.pattern.as_str(), d.sink.as_str()), ("mail.*", "mail.*", "stdout"));
        let d = parse_route("order.#=http://user:p=w@host/x", &o).unwrap();
        assert_eq!(d.sink, "http://user:p=w@host/x");
        for bad in ["stdout", "erp=order.#", "erp=order.#=ftp", "=stdout=x"] {
            let e = parse_route(bad, &o).unwrap_err().to_string();
            assert!(e.contains("--route"), "{bad}: {e}");
        }
        let e = parse_route("erp=order.#=notasink:secret", &o).unwrap_err().to_string();
        assert!(!e.contains("secret"), "{e}");
        for leaky in ["https://user:pw@erp/hook", "https://user:pw@erp/hook?x=1", "amqp://u:pw@h/%2f"] {
            let e = parse_route(leaky, &o).unwrap_err().to_string();
            assert!(!e.contains("pw") && e.contains("(not shown)"), "{e}");
        }
    }

    #[test]
    fn a_file_gives_each_destination_its_own_options_and_errors_hide_secrets() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("relay.toml");
        std::fs::write(
            &path,
            r##"
[[destination]]
name = "erp"
pattern = "order.#"
sink = "http://127.0.0.1:1/hook"
format = "cloudevents"
signing_secrets = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
headers = { Authorization = "Bearer hidden-token" }
timeout = "5s"
concurrency = 8
rate_limit = "20/s"

[[destination]]
name = "all"
pattern = "#"
sink = "stdout"
"##,
        )
        .unwrap();
        let defaults = SinkOptions::default();
        let read = read_file(&path, &defaults).unwrap();
        assert_eq!(read.len(), 2);
        assert_eq!(read[0].options.timeout, Duration::from_secs(5));
        assert_eq!(read[0].options.format, EventFormat::CloudEventsBinary);
        assert_eq!(read[0].options.signing_secrets.len(), 1);
        assert_eq!(read[0].concurrency, Some(8));
        assert_eq!(read[0].rate_limit, Some(20.0));
        assert_eq!(read[1].options, defaults);

        std::fs::write(&path, "[[destination]]\nname = \"erp\"\npattern = \"#\"\nsink = \"stdout\"\ntimout = \"5s\"\n")
            .unwrap();
        let e = read_file(&path, &defaults).unwrap_err().to_string();
        assert!(e.contains("timout") && e.contains("line"), "{e}");

        std::fs::write(&path, "[[destination]]\nname = \"erp\"\npattern = \"#\"\nsink = \"stdout\"\nheaders = { A = \"Bearer s3cr3t-value\" \n").unwrap();
        let e = read_file(&path, &defaults).unwrap_err().to_string();
        assert!(!e.contains("s3cr3t"), "{e}");

        let wrong_type =
            "[[destination]]\nname = \"erp\"\npattern = \"#\"\nsink = \"stdout\"\nheaders = \"Bearer s3cr3t\"\n";
        std::fs::write(&path, wrong_type).unwrap();
        let e = read_file(&path, &defaults).unwrap_err().to_string();
        assert!(!e.contains("s3cr3t") && e.contains("a string"), "{e}");

        std::fs::write(
            &path,
            "[[destination]]\nname = \"erp\"\npattern = \"#\"\nsink = \"stdout\"\ntimeout = \"-1s\"\n",
        )
        .unwrap();
        let e = read_file(&path, &defaults).unwrap_err().to_string();
        assert!(e.contains("destination \"erp\": timeout"), "{e}");

        let e = read_file(&dir.path().join("missing.toml"), &defaults).unwrap_err().to_string();
        assert!(e.contains("missing.toml"), "{e}");
    }
}
