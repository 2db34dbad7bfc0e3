//! The Kafka sink's settings: the builder, the SASL login, the brokers' list.

use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rdkafka::config::{ClientConfig, RDKafkaLogLevel};

use super::context::Context;
use super::topic::TopicTemplate;
use super::{KafkaSink, create};
use crate::error::{Error, Result};
use crate::sink::cloudevents::{DEFAULT_CLOUDEVENTS_SOURCE, check_source};
use crate::sink::{EventFormat, Secret};

/// The port of a broker given without one.
const DEFAULT_PORT: u16 = 9092;
/// How long librdkafka waits at most between attempts to reach a broker: a broker back from a
/// restart is used within about a second.
const RECONNECT_BACKOFF_MAX: &str = "1000";
/// How long a topic the cluster does not know may take to appear before librdkafka fails its
/// messages as of an unknown topic (its default, 30 s, would hold every batch with such an event
/// for up to the sink's timeout, and then report a timeout instead).
const UNKNOWN_TOPIC_AFTER: Duration = Duration::from_secs(1);
/// The properties the builder sets itself, with the method that sets them.
const OWN_PROPERTIES: [(&str, &str); 9] = [
    ("bootstrap.servers", "the sink's kafka://host:port list"),
    ("metadata.broker.list", "the sink's kafka://host:port list"),
    ("security.protocol", "tls() and sasl()"),
    ("sasl.mechanism", "sasl()"),
    ("sasl.mechanisms", "sasl()"),
    ("sasl.username", "sasl()"),
    ("sasl.password", "sasl()"),
    ("ssl.ca.location", "ca_file()"),
    ("message.timeout.ms", "timeout()"),
];

/// A SASL mechanism Kafka brokers take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SaslMechanism {
    /// The password itself goes to the broker: use it with TLS.
    Plain,
    /// SCRAM with SHA-256.
    ScramSha256,
    /// SCRAM with SHA-512.
    ScramSha512,
}

impl SaslMechanism {
    fn name(self) -> &'static str {
        match self {
            SaslMechanism::Plain => "PLAIN",
            SaslMechanism::ScramSha256 => "SCRAM-SHA-256",
            SaslMechanism::ScramSha512 => "SCRAM-SHA-512",
        }
    }
}

impl std::str::FromStr for SaslMechanism {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self> {
        match text.to_ascii_uppercase().replace('_', "-").as_str() {
            "PLAIN" => Ok(SaslMechanism::Plain),
            "SCRAM-SHA-256" => Ok(SaslMechanism::ScramSha256),
            "SCRAM-SHA-512" => Ok(SaslMechanism::ScramSha512),
            _ => Err(Error::config(format!(
                "unknown SASL mechanism {text:?}: expected plain, scram-sha-256 or scram-sha-512"
            ))),
        }
    }
}

/// A SASL login: a mechanism, a user and a password (which `Debug` does not show).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KafkaSasl {
    /// How the password is proven.
    pub mechanism: SaslMechanism,
    /// The user.
    pub username: String,
    /// The password.
    pub password: Secret,
}

/// Builds a [`KafkaSink`]: `KafkaSink::builder("kafka://b1:9092,b2:9092").topic("outbox.{topic}").connect().await`.
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `connect` is called"]
pub struct KafkaSinkBuilder {
    pub(super) spec: String,
    pub(super) topic: String,
    pub(super) format: EventFormat,
    pub(super) source: Option<String>,
    pub(super) timeout: Duration,
    pub(super) tls: bool,
    pub(super) ca_file: Option<PathBuf>,
    pub(super) sasl: Option<KafkaSasl>,
    /// librdkafka properties; their values are not shown.
    pub(super) properties: Vec<(String, Secret)>,
}

impl KafkaSinkBuilder {
    /// The topic template: `{topic}` stands for the event's topic. Defaults to
    /// [`DEFAULT_KAFKA_TOPIC`](crate::sink::DEFAULT_KAFKA_TOPIC) (the event's topic itself).
    pub fn topic(mut self, template: impl Into<String>) -> Self {
        self.topic = template.into();
        self
    }

    /// How an event goes into its message: its JSON object ([`EventFormat::Raw`], the default)
    /// or a CloudEvent in the Kafka binding's binary or structured mode.
    pub fn format(mut self, format: EventFormat) -> Self {
        self.format = format;
        self
    }

    /// The CloudEvents `source` attribute. Defaults to [`DEFAULT_CLOUDEVENTS_SOURCE`].
    pub fn cloudevents_source(mut self, source: impl Into<String>) -> Self {
        self.source = Some(source.into());
        self
    }

    /// How long connecting and each acknowledgement may take (librdkafka's
    /// `message.timeout.ms`; 1 ms to [`MAX_TIMEOUT`](crate::sink::MAX_TIMEOUT)). Defaults to 10 s.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Speaks TLS to the brokers, verifying them against the system's roots (or
    /// [`ca_file`](Self::ca_file)).
    pub fn tls(mut self, tls: bool) -> Self {
        self.tls = tls;
        self
    }

    /// Verifies the brokers against the certificates of this PEM file; implies TLS.
    pub fn ca_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.ca_file = Some(path.into());
        self.tls = true;
        self
    }

    /// Logs in with SASL.
    pub fn sasl(mut self, mechanism: SaslMechanism, username: impl Into<String>, password: Secret) -> Self {
        self.sasl = Some(KafkaSasl { mechanism, username: username.into(), password });
        self
    }

    /// Sets a librdkafka producer property (`compression.type`, `linger.ms`,
    /// `ssl.certificate.location`, ...; see librdkafka's CONFIGURATION.md). Its value is never
    /// shown. The properties the builder sets itself (the brokers, TLS, SASL, the timeout) are
    /// refused here.
    pub fn property(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.properties.push((name.into(), Secret::new(value.into())));
        self
    }

    /// Checks the settings, makes the producer and asks the cluster for its metadata, so that
    /// an unreachable cluster or a refused login is reported here, not at the first event.
    pub async fn connect(self) -> Result<KafkaSink> {
        let brokers = parse_brokers(&self.spec)?;
        let shown = format!("kafka://{brokers}");
        let topic = TopicTemplate::parse(&self.topic)?;
        crate::sink::check_timeout(self.timeout)?;
        let source = self.source.clone().unwrap_or_else(|| DEFAULT_CLOUDEVENTS_SOURCE.to_string());
        check_source(&source)?;
        let config = self.client_config(&brokers)?;
        let context = Context::new(&shown);
        let producer = create(&config, &context, &self.secrets())?;
        let sink = KafkaSink {
            producer: RwLock::new(Arc::new(producer)),
            config,
            context,
            topic,
            format: self.format,
            source,
            timeout: self.timeout,
            shown,
        };
        sink.reach().await?;
        Ok(sink)
    }

    /// The producer's configuration.
    fn client_config(&self, brokers: &str) -> Result<ClientConfig> {
        let mut config = ClientConfig::new();
        let timeout_ms = self.timeout.as_millis().max(1).to_string();
        config
            .set("bootstrap.servers", brokers)
            .set("client.id", "outbox-relay")
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("partitioner", "murmur2_random")
            .set("linger.ms", "1")
            .set("message.timeout.ms", &timeout_ms)
            .set("socket.connection.setup.timeout.ms", &timeout_ms)
            .set("reconnect.backoff.max.ms", RECONNECT_BACKOFF_MAX)
            .set(
                "topic.metadata.propagation.max.ms",
                self.timeout.min(UNKNOWN_TOPIC_AFTER).as_millis().max(1).to_string(),
            )
            .set_log_level(RDKafkaLogLevel::Warning);
        let protocol = match (self.tls, self.sasl.is_some()) {
            (false, false) => "plaintext",
            (true, false) => "ssl",
            (false, true) => "sasl_plaintext",
            (true, true) => "sasl_ssl",
        };
        config.set("security.protocol", protocol);
        if let Some(path) = &self.ca_file {
            let path = path.to_str().ok_or_else(|| Error::config("the Kafka CA file's path is not UTF-8"))?;
            config.set("ssl.ca.location", path);
        }
        if let Some(sasl) = &self.sasl {
            if sasl.username.is_empty() {
                return Err(Error::config("the Kafka SASL user is empty"));
            }
            if sasl.mechanism == SaslMechanism::Plain && !self.tls {
                tracing::warn!(
                    "SASL PLAIN without TLS sends the Kafka password in the clear: add TLS (--kafka-tls) or use SCRAM"
                );
            }
            config
                .set("sasl.mechanisms", sasl.mechanism.name())
                .set("sasl.username", &sasl.username)
                .set("sasl.password", sasl.password.expose());
        }
        for (name, value) in &self.properties {
            if let Some((_, how)) = OWN_PROPERTIES.iter().find(|(own, _)| own == name) {
                return Err(Error::config(format!("the Kafka property {name:?} is the sink's own: set it with {how}")));
            }
            config.set(name, value.expose());
        }
        Ok(config)
    }

    /// The texts that must not appear in an error: the password and the properties' values.
    fn secrets(&self) -> Vec<String> {
        let password = self.sasl.iter().map(|s| s.password.expose().to_string());
        let values = self.properties.iter().map(|(_, value)| value.expose().to_string());
        password.chain(values).filter(|s| !s.is_empty()).collect()
    }
}

/// `kafka://host[:port][,host[:port]...]` as librdkafka's `bootstrap.servers`.
fn parse_brokers(spec: &str) -> Result<String> {
    let rest = spec
        .strip_prefix("kafka://")
        .ok_or_else(|| Error::config("a Kafka sink is kafka://host:port[,host:port...]".to_string()))?;
    if rest.contains('@') {
        return Err(Error::config(
            "a Kafka sink's URL holds no user or password: give them to the sink's SASL settings (--kafka-username, OUTBOX_RELAY_KAFKA_PASSWORD)",
        ));
    }
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.contains(['/', '?', '#']) {
        return Err(Error::config(format!(
            "invalid Kafka sink {spec:?}: only brokers, kafka://host:port[,host:port...] (the topic has a setting of its own)"
        )));
    }
    let brokers: Result<Vec<String>> = rest.split(',').map(|broker| parse_broker(spec, broker)).collect();
    Ok(brokers?.join(","))
}

/// One `host[:port]` (`[v6]:port` too).
fn parse_broker(spec: &str, broker: &str) -> Result<String> {
    let bad = |why: &str| Error::config(format!("invalid Kafka sink {spec:?}: {why}"));
    let (host, port) = if let Some(v6) = broker.strip_prefix('[') {
        let (host, after) = v6.split_once(']').ok_or_else(|| bad("an IPv6 address without its ']'"))?;
        (host, after.strip_prefix(':'))
    } else {
        match broker.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (broker, None),
        }
    };
    let host_ok =
        !host.is_empty() && host.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | ':'));
    if !host_ok {
        return Err(bad(&format!("{broker:?} is no host[:port]")));
    }
    let port = match port {
        None => DEFAULT_PORT,
        Some(port) => {
            port.parse::<u16>().ok().filter(|p| *p > 0).ok_or_else(|| bad(&format!("{port:?} is no port")))?
        }
    };
    Ok(if host.contains(':') { format!("[{host}]:{port}") } else { format!("{host}:{port}") })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn brokers_parse() {
        assert_eq!(parse_brokers("kafka://a:9093,b").unwrap(), "a:9093,b:9092");
        assert_eq!(parse_brokers("kafka://[::1]:19092/").unwrap(), "[::1]:19092");
        for bad in
            ["kafka://", "kafka://a:0", "kafka://a:x", "kafka://a/topic", "kafka://a,,b", "kafka://a b", "http://a"]
        {
            assert!(parse_brokers(bad).is_err(), "{bad}");
        }
        let e = parse_brokers("kafka://alice:s3cret@b:9092").unwrap_err().to_string();
        assert!(!e.contains("s3cret"), "{e}");
    }

    #[test]
    fn mechanisms_parse() {
        assert_eq!("scram-sha-512".parse::<SaslMechanism>().unwrap(), SaslMechanism::ScramSha512);
        assert_eq!("SCRAM_SHA_256".parse::<SaslMechanism>().unwrap(), SaslMechanism::ScramSha256);
        assert_eq!("plain".parse::<SaslMechanism>().unwrap(), SaslMechanism::Plain);
        assert!("gssapi".parse::<SaslMechanism>().is_err());
    }
}
