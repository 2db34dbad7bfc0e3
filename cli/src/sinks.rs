//! The sink a spec names, built with the command's sink flags (or a destination's settings in
//! `--config`): each flag applies to one kind of sink, and one given for another is refused.

use std::path::PathBuf;
use std::time::Duration;

use pg_outbox_relay::sink::{
    AmqpSink, DEFAULT_EXCHANGE, DEFAULT_HTTP_TIMEOUT, DEFAULT_KAFKA_TOPIC, DEFAULT_SUBJECT_PREFIX, EventFormat,
    HttpSink, KafkaSink, NatsSink, SaslMechanism, Secret, SigningSecret, Sink, StdoutSink,
};

use crate::outcome::{CliError, UsageError};

/// The sink settings of the command line or of one destination in the configuration file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SinkOptions {
    /// Of one HTTP request, and of connecting to NATS or RabbitMQ and each acknowledgement.
    pub(crate) timeout: Duration,
    /// NATS: events go to `<prefix>.<topic>`.
    pub(crate) subject_prefix: String,
    /// NATS: create (or reuse) a JetStream stream of this name capturing `<prefix>.>`.
    pub(crate) create_stream: Option<String>,
    /// RabbitMQ: the exchange events are published to.
    pub(crate) exchange: String,
    /// HTTP: Standard Webhooks signing secrets (`whsec_…`); every one signs each request.
    pub(crate) signing_secrets: Vec<Secret>,
    /// HTTP and Kafka: how an event goes into its request or message.
    pub(crate) format: EventFormat,
    /// HTTP and Kafka: the CloudEvents `source`.
    pub(crate) cloudevents_source: Option<String>,
    /// HTTP: fixed headers sent with every request, as `(name, value)`.
    pub(crate) headers: Vec<(String, Secret)>,
    /// Kafka: the settings of the Kafka sink.
    pub(crate) kafka: KafkaOptions,
}

/// The Kafka sink's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct KafkaOptions {
    /// The topic template (`{topic}` the event's topic).
    pub(crate) topic: String,
    /// TLS to the brokers.
    pub(crate) tls: bool,
    /// The CA certificates the brokers are verified against (implies TLS).
    pub(crate) ca_file: Option<PathBuf>,
    /// The SASL mechanism; SCRAM-SHA-512 when a user is given without one.
    pub(crate) sasl_mechanism: Option<SaslMechanism>,
    /// The SASL user.
    pub(crate) username: Option<String>,
    /// The SASL password.
    pub(crate) password: Option<Secret>,
    /// librdkafka properties, as `(name, value)`.
    pub(crate) properties: Vec<(String, Secret)>,
}

impl Default for KafkaOptions {
    fn default() -> Self {
        KafkaOptions {
            topic: DEFAULT_KAFKA_TOPIC.into(),
            tls: false,
            ca_file: None,
            sasl_mechanism: None,
            username: None,
            password: None,
            properties: Vec::new(),
        }
    }
}

impl Default for SinkOptions {
    fn default() -> Self {
        SinkOptions {
            timeout: DEFAULT_HTTP_TIMEOUT,
            subject_prefix: DEFAULT_SUBJECT_PREFIX.into(),
            create_stream: None,
            exchange: DEFAULT_EXCHANGE.into(),
            signing_secrets: Vec::new(),
            format: EventFormat::Raw,
            cloudevents_source: None,
            headers: Vec::new(),
            kafka: KafkaOptions::default(),
        }
    }
}

impl SinkOptions {
    /// Refuses a setting given for a sink it does not apply to (the message names the flags;
    /// [`crate::routes`] names a file's keys instead).
    pub(crate) fn check_for(&self, spec: &str) -> Result<(), UsageError> {
        let refuse = |why: &str| Err(UsageError(why.to_string()));
        let http = spec.starts_with("http://") || spec.starts_with("https://");
        let kafka = spec.starts_with("kafka://");
        if !http && (!self.signing_secrets.is_empty() || !self.headers.is_empty()) {
            return refuse("signing secrets and --header apply to the HTTP sink only");
        }
        if !http && !kafka && (self.format != EventFormat::Raw || self.cloudevents_source.is_some()) {
            return refuse("--format and --cloudevents-source apply to the HTTP and the Kafka sink only");
        }
        if !kafka && self.kafka != KafkaOptions::default() {
            return refuse("--kafka-* settings apply to the Kafka sink (kafka://) only");
        }
        if kafka && self.kafka.username.is_some() != self.kafka.password.is_some() {
            return refuse("a Kafka login needs both --kafka-username and the password (OUTBOX_RELAY_KAFKA_PASSWORD)");
        }
        if kafka && self.kafka.sasl_mechanism.is_some() && self.kafka.username.is_none() {
            return refuse(
                "--kafka-sasl-mechanism needs --kafka-username and the password (OUTBOX_RELAY_KAFKA_PASSWORD)",
            );
        }
        if self.cloudevents_source.is_some() && self.format == EventFormat::Raw {
            return refuse("--cloudevents-source applies to --format cloudevents or cloudevents-structured");
        }
        let amqp = spec.starts_with("amqp://") || spec.starts_with("amqps://");
        if !amqp && self.exchange != DEFAULT_EXCHANGE {
            return refuse("--exchange applies to the RabbitMQ sink (amqp://) only");
        }
        let nats = spec.starts_with("nats://");
        if !nats && (self.subject_prefix != DEFAULT_SUBJECT_PREFIX || self.create_stream.is_some()) {
            return refuse("--subject-prefix and --create-stream apply to the NATS sink (nats://) only");
        }
        Ok(())
    }
}

/// Whether the sink `spec` names is standard output.
pub(crate) fn is_stdout(spec: &str) -> bool {
    let spec = pg_outbox_relay::sink::lower_scheme(spec);
    spec == "stdout" || spec == "-"
}

/// Builds the sink `spec` names with `options`; connects where the sink needs a connection, so
/// an unreachable destination is reported here, not at the first event.
pub(crate) async fn connect(spec: &str, options: &SinkOptions) -> Result<Sink, CliError> {
    let spec = &*pg_outbox_relay::sink::lower_scheme(spec);
    options.check_for(spec)?;
    if is_stdout(spec) {
        return Ok(Sink::Stdout(StdoutSink::new()));
    }
    if spec.starts_with("http://") || spec.starts_with("https://") {
        return Ok(Sink::Http(http_sink(spec, options)?));
    }
    if spec.starts_with("nats://") {
        let mut builder = NatsSink::builder(spec).timeout(options.timeout).subject_prefix(&options.subject_prefix);
        if let Some(stream) = &options.create_stream {
            builder = builder.create_stream(stream);
        }
        return Ok(Sink::Nats(builder.connect().await?));
    }
    if spec.starts_with("amqp://") || spec.starts_with("amqps://") {
        let builder = AmqpSink::builder(spec).timeout(options.timeout).exchange(&options.exchange);
        return Ok(Sink::Amqp(builder.connect().await?));
    }
    if spec.starts_with("kafka://") {
        return Ok(Sink::Kafka(kafka_sink(spec, options).connect().await?));
    }
    // Refused there, with the spec shown redacted.
    Ok(Sink::connect(spec).await?)
}

/// The HTTP sink `options` describe.
fn http_sink(spec: &str, options: &SinkOptions) -> Result<HttpSink, CliError> {
    let mut builder = HttpSink::builder(spec).timeout(options.timeout).format(options.format);
    if let Some(source) = &options.cloudevents_source {
        builder = builder.cloudevents_source(source.clone());
    }
    let count = options.signing_secrets.len();
    for (n, secret) in options.signing_secrets.iter().enumerate() {
        let which = if count > 1 { format!("signing secret {} of {count}", n + 1) } else { "signing secret".into() };
        if secret.expose().trim().is_empty() {
            let why = format!("the {which} is empty (a stray comma in OUTBOX_RELAY_SIGNING_SECRETS?)");
            return Err(UsageError(why).into());
        }
        let parsed = SigningSecret::parse(secret.expose()).map_err(|e| UsageError(format!("the {which}: {e}")))?;
        builder = builder.signing_secret(parsed);
    }
    for (name, value) in &options.headers {
        builder = builder.header(name.clone(), value.expose());
    }
    Ok(builder.build()?)
}

/// The Kafka sink `options` describe, ready to connect.
fn kafka_sink(spec: &str, options: &SinkOptions) -> pg_outbox_relay::sink::KafkaSinkBuilder {
    let kafka = &options.kafka;
    let mut builder = KafkaSink::builder(spec)
        .timeout(options.timeout)
        .format(options.format)
        .topic(kafka.topic.clone())
        .tls(kafka.tls);
    if let Some(source) = &options.cloudevents_source {
        builder = builder.cloudevents_source(source.clone());
    }
    if let Some(path) = &kafka.ca_file {
        builder = builder.ca_file(path.clone());
    }
    if let (Some(username), Some(password)) = (&kafka.username, &kafka.password) {
        let mechanism = kafka.sasl_mechanism.unwrap_or(SaslMechanism::ScramSha512);
        builder = builder.sasl(mechanism, username.clone(), password.clone());
    }
    for (name, value) in &kafka.properties {
        builder = builder.property(name.clone(), value.expose());
    }
    builder
}

/// `--kafka-property NAME=VALUE` flags as `(name, value)`; an error never shows a value.
pub(crate) fn kafka_properties(given: &[Secret]) -> Result<Vec<(String, Secret)>, UsageError> {
    given
        .iter()
        .map(|property| match property.expose().split_once('=') {
            Some((name, value)) if !name.trim().is_empty() => Ok((name.trim().to_string(), Secret::new(value))),
            _ => Err(UsageError("a --kafka-property must look like NAME=VALUE (one had no name or no '=')".into())),
        })
        .collect()
}
