//! Kafka: one message per event, keyed by the event's key and partitioned as Java clients
//! partition, written by an idempotent producer and acknowledged by every in-sync replica
//! before the event counts as delivered.

mod builder;
mod context;
mod topic;

use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::util::Timeout;

pub use self::builder::{KafkaSasl, KafkaSinkBuilder, SaslMechanism};
use self::context::Context;
use self::topic::TopicTemplate;
use super::cloudevents::{self, Parts};
use super::{DEFAULT_HTTP_TIMEOUT, DEFAULT_KAFKA_TOPIC, EventFormat};
use crate::error::{Error, ErrorKind, Result};
use crate::event::Event;
use crate::relay::{DeliveryError, Handler, Slots};

/// The header that carries the event's uuid, its id across databases and restores.
pub const KAFKA_UUID_HEADER: &str = "outbox-event-uuid";

/// Publishes each event as one Kafka message and waits for the broker's acknowledgement
/// (`acks=all`, the idempotent producer) before the event counts as delivered.
///
/// - **Key and partition**: the message key is the event's key, partitioned with librdkafka's
///   `murmur2_random`, which is the Java client's default partitioner: a Java or Kafka Streams
///   consumer agrees on each key's partition, and a key's events stay in order end to end (the
///   relay hands a key's next event over only once the one before was acknowledged). Events
///   without a key spread over the partitions at random.
/// - **Topic**: the event's topic through a template, `{topic}` by default
///   (`outbox.{topic}` prefixes it; a template without `{topic}` sends every event to one
///   topic). A topic that does not exist on the cluster is a failure of that event, retried
///   with backoff, that the outage breaker does not count: one missing topic does not stop the
///   others.
/// - **Value and headers**: the event's JSON object (as every sink sends), `content-type:
///   application/json`, and the headers `outbox-event-uuid` (the id to drop duplicates by),
///   `outbox-event-id` (its order in this database), `outbox-topic` and `outbox-attempt`; with
///   [`EventFormat::CloudEventsBinary`] the value is the payload and the attributes go into
///   `ce_*` headers (the CloudEvents Kafka binding), with
///   [`EventFormat::CloudEventsStructured`] the value is the structured JSON. The message's
///   timestamp is the event's `created_at`.
/// - **Credentials**: SASL (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512) and TLS through the builder;
///   the password is never shown in logs, errors or `Debug`.
pub struct KafkaSink {
    /// Replaced by a new one when librdkafka reports a fatal error (an idempotent producer
    /// that lost its sequence cannot go on).
    producer: RwLock<Arc<FutureProducer<Context>>>,
    /// What the producer was made of, for its replacement. It holds the password.
    config: ClientConfig,
    context: Context,
    topic: TopicTemplate,
    format: EventFormat,
    source: String,
    timeout: Duration,
    /// The brokers as they may be shown.
    pub(super) shown: String,
}

impl std::fmt::Debug for KafkaSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSink")
            .field("brokers", &self.shown)
            .field("topic", &self.topic.text)
            .field("format", &self.format)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl KafkaSink {
    /// A builder for a sink to the cluster of `spec`, `kafka://host:port[,host:port...]`.
    pub fn builder(spec: &str) -> KafkaSinkBuilder {
        KafkaSinkBuilder {
            spec: spec.to_string(),
            topic: DEFAULT_KAFKA_TOPIC.to_string(),
            format: EventFormat::Raw,
            source: None,
            timeout: DEFAULT_HTTP_TIMEOUT,
            tls: false,
            ca_file: None,
            sasl: None,
            properties: Vec::new(),
        }
    }

    /// Connects to the cluster of `spec` with the defaults.
    pub async fn connect(spec: &str) -> Result<Self> {
        KafkaSink::builder(spec).connect().await
    }

    /// Asks the cluster for its metadata (on the blocking pool: librdkafka's call blocks).
    async fn reach(&self) -> Result<()> {
        let producer = self.producer();
        let timeout = self.timeout;
        let asked = tokio::task::spawn_blocking(move || producer.client().fetch_metadata(None, timeout).map(|_| ()))
            .await
            .map_err(|e| Error::new(ErrorKind::Connect, format!("asking Kafka for its metadata failed: {e}")))?;
        asked.map_err(|e| {
            let why = self.context.last_error().unwrap_or_else(|| e.to_string());
            // A refused login is the operator's to fix, not an outage to wait out.
            let (kind, refused) =
                if e.rdkafka_error_code() == Some(RDKafkaErrorCode::Authentication) || why.contains("SASL") {
                    (ErrorKind::Permission, " (the broker refused the login)")
                } else {
                    (ErrorKind::Connect, "")
                };
            Error::new(kind, format!("cannot connect to Kafka at {}{refused}: {why}", self.shown))
        })
    }

    fn producer(&self) -> Arc<FutureProducer<Context>> {
        Arc::clone(&self.producer.read().unwrap_or_else(std::sync::PoisonError::into_inner))
    }

    /// Replaces `failed` by a new producer after a fatal error, or after a delivery whose every
    /// event went unacknowledged (`timed_out`), unless another delivery already did. A broker
    /// back from a restart without its producer state answers the old producer's messages with
    /// `UNKNOWN_PRODUCER_ID` for as long as it lives (tansu 0.6 does); a new producer gets a new
    /// id. The events of the old one are retried by the relay, each key's in order.
    fn renew(&self, failed: &Arc<FutureProducer<Context>>, timed_out: bool) {
        let fatal = failed.client().fatal_error();
        if fatal.is_none() && !timed_out {
            return;
        }
        let mut producer = self.producer.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        if !Arc::ptr_eq(&producer, failed) {
            return;
        }
        match create(&self.config, &self.context, &[]) {
            Ok(new) => {
                match fatal {
                    Some((code, reason)) => {
                        tracing::warn!(broker = %self.shown, %code, %reason, "the Kafka producer failed for good; a new one takes over")
                    }
                    None => {
                        tracing::debug!(broker = %self.shown, "no acknowledgement for a whole delivery; a new Kafka producer takes over")
                    }
                }
                *producer = Arc::new(new);
            }
            Err(e) => tracing::warn!(broker = %self.shown, error = %e, "the Kafka producer cannot be replaced"),
        }
    }

    /// Publishes one event and waits for its acknowledgement.
    async fn send(&self, producer: &FutureProducer<Context>, event: &Event) -> Result<(), DeliveryError> {
        let topic = self.topic.render(&event.topic)?;
        let Parts { body, content_type, attributes, headers: event_headers } =
            cloudevents::parts(event, self.format, &self.source)
                .map_err(|e| DeliveryError::permanent(format!("cannot serialize event {}: {e}", event.id)))?;
        let uuid = event.uuid.to_string();
        let id = event.id.to_string();
        let attempt = event.attempts.to_string();
        let mut headers = OwnedHeaders::new_with_capacity(5 + attributes.len() + event_headers.len())
            .insert(Header { key: "content-type", value: Some(content_type) })
            .insert(Header { key: KAFKA_UUID_HEADER, value: Some(&uuid) })
            .insert(Header { key: "outbox-event-id", value: Some(&id) })
            .insert(Header { key: "outbox-topic", value: Some(&event.topic) })
            .insert(Header { key: "outbox-attempt", value: Some(&attempt) });
        for (name, value) in &attributes {
            headers = headers.insert(Header { key: &format!("ce_{name}"), value: Some(value) });
        }
        for (name, value) in event_headers {
            headers = headers.insert(Header { key: name, value: Some(value) });
        }
        let created = event.created_at.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_millis());
        let mut record = FutureRecord::to(&topic)
            .payload(&body)
            .headers(headers)
            .timestamp(i64::try_from(created).unwrap_or(i64::MAX));
        if let Some(key) = &event.key {
            record = record.key(key.as_bytes());
        }
        match producer.send(record, Timeout::After(self.timeout)).await {
            Ok(_) => Ok(()),
            Err((e, _)) => Err(self.failure(&topic, event, &e)),
        }
    }

    /// What a failed publish says, and whether the breaker should count it.
    fn failure(&self, topic: &str, event: &Event, e: &KafkaError) -> DeliveryError {
        use RDKafkaErrorCode as Code;
        let shown = &self.shown;
        match e.rdkafka_error_code() {
            Some(Code::UnknownTopicOrPartition | Code::UnknownTopic | Code::UnknownPartition) => {
                DeliveryError::transient(format!(
                    "the Kafka topic {topic:?} does not exist at {shown}; the event is retried until it is created"
                ))
                .destination_answered()
            }
            Some(Code::TopicAuthorizationFailed) => DeliveryError::transient(format!(
                "Kafka at {shown} does not let this user write to the topic {topic:?}"
            ))
            .destination_answered(),
            Some(Code::InvalidTopic) => {
                DeliveryError::permanent(format!("Kafka at {shown} takes no topic named {topic:?}"))
            }
            Some(Code::MessageSizeTooLarge | Code::InvalidMessageSize) => DeliveryError::permanent(format!(
                "event {} is larger than Kafka at {shown} takes (the broker's message.max.bytes, the producer's message.max.bytes)",
                event.id
            )),
            Some(Code::MessageTimedOut) => {
                let why = self
                    .context
                    .recent_error(self.timeout)
                    .map_or(String::new(), |why| format!(" (librdkafka's last error: {why})"));
                let error = DeliveryError::transient(format!(
                    "Kafka at {shown} did not acknowledge within {:?}{why}",
                    self.timeout
                ))
                .overloaded();
                if why.contains("Connection refused") { error.refused() } else { error }
            }
            _ => DeliveryError::transient(format!("publishing to Kafka at {shown} failed: {e}")),
        }
    }
}

impl Handler for KafkaSink {
    async fn handle(&self, event: &Event) -> Result<(), DeliveryError> {
        let producer = self.producer();
        let result = self.send(&producer, event).await;
        if let Err(e) = &result {
            self.renew(&producer, e.is_overload());
        }
        result
    }

    /// Publishes the whole batch (a round holds at most one event per key), then awaits the
    /// acknowledgements together: librdkafka batches the messages per partition, one slot.
    async fn handle_batch(&self, events: &[Event], slots: &Slots) -> Vec<Result<(), DeliveryError>> {
        let _slot = slots.take_for(events.len()).await;
        let producer = self.producer();
        let results = futures::future::join_all(events.iter().map(|event| self.send(&producer, event))).await;
        if results.iter().any(Result::is_err) {
            // Only a timeout marks a Kafka failure as overload.
            let timed_out = results.iter().all(|r| r.as_ref().is_err_and(DeliveryError::is_overload));
            self.renew(&producer, timed_out);
        }
        results
    }
}

/// Makes a producer of `config`; a refused setting is reported without the texts of `secrets`.
fn create(config: &ClientConfig, context: &Context, secrets: &[String]) -> Result<FutureProducer<Context>> {
    config.create_with_context(context.clone()).map_err(|e| {
        let mut text = e.to_string();
        for secret in secrets {
            text = text.replace(secret.as_str(), "***");
        }
        Error::config(format!("cannot make the Kafka producer: {text}"))
    })
}
