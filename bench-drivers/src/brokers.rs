//! Draining to RabbitMQ and Kafka, each on a queue or topic of its own, and the rate of a plain
//! Kafka producer on the same broker as the drain's reference.

use std::sync::Arc;
use std::time::{Duration, Instant};

use lapin::options::{QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions, QueuePurgeOptions};
use lapin::types::{FieldTable, ShortString};
use lapin::{Connection, ConnectionProperties};
use pg_outbox_relay::sink::{AmqpSink, KafkaSink};
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::util::Timeout;

use super::BoxError;

/// Partitions of the bench's Kafka topics.
const PARTITIONS: i32 = 4;
/// How long connecting and each acknowledgement may take (the brokers' drains and plain
/// clients, NATS's too).
pub(super) const TIMEOUT: Duration = Duration::from_secs(10);

/// A bench event (topic `bench.drain`, payload `{"n": id}`) as a sink sends it, for the plain
/// clients that publish without the relay: the size and shape of the drains' messages.
pub(super) fn event_json(id: usize, uuid: &str) -> String {
    format!(
        r#"{{"id":{id},"uuid":"{uuid}","topic":"bench.drain","key":null,"payload":{{"n":{id}}},"created_at":"2026-12-03T12:00:00.000000Z","attempts":1}}"#
    )
}

/// A RabbitMQ sink publishing to `exchange`, with a queue of that name bound to take every
/// message (so none comes back unroutable), purged after each drain and deleted at the end.
pub struct AmqpDrain {
    /// The sink.
    pub sink: Arc<AmqpSink>,
    connection: Connection,
    queue: String,
}

impl AmqpDrain {
    /// Connects; `Ok(Err(why))` when no broker answers at `url`.
    pub async fn connect(url: &str, exchange: &str) -> Result<Result<AmqpDrain, String>, BoxError> {
        let sink = match AmqpSink::builder(url).exchange(exchange).timeout(TIMEOUT).connect().await {
            Ok(sink) => sink,
            Err(e) if e.kind() == pg_outbox_relay::ErrorKind::Connect => return Ok(Err(e.to_string())),
            Err(e) => return Err(e.into()),
        };
        let connection = Connection::connect(url, ConnectionProperties::default()).await?;
        let channel = connection.create_channel().await?;
        let queue = ShortString::from(exchange);
        channel.queue_declare(queue.clone(), QueueDeclareOptions::default(), FieldTable::default()).await?;
        channel
            .queue_bind(
                queue.clone(),
                queue,
                ShortString::from("#"),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
        Ok(Ok(AmqpDrain { sink: Arc::new(sink), connection, queue: exchange.to_string() }))
    }

    /// Empties the queue.
    pub async fn purge(&self) -> Result<(), BoxError> {
        let channel = self.connection.create_channel().await?;
        channel.queue_purge(ShortString::from(self.queue.as_str()), QueuePurgeOptions::default()).await?;
        Ok(())
    }

    /// Deletes the queue.
    pub async fn remove(self) -> Result<(), BoxError> {
        let channel = self.connection.create_channel().await?;
        channel.queue_delete(ShortString::from(self.queue.as_str()), QueueDeleteOptions::default()).await?;
        Ok(())
    }
}

/// A Kafka cluster for the bench: topics of its own, made and deleted per drain.
pub struct KafkaBench {
    url: String,
    admin: AdminClient<DefaultClientContext>,
}

impl KafkaBench {
    /// Connects; `Ok(Err(why))` when no broker answers at `url` (`kafka://host:port`).
    pub async fn connect(url: &str) -> Result<Result<KafkaBench, String>, BoxError> {
        // The sink checks the cluster answers, and says why not.
        if let Err(e) = KafkaSink::builder(url).timeout(TIMEOUT).connect().await {
            return if e.kind() == pg_outbox_relay::ErrorKind::Connect {
                Ok(Err(e.to_string()))
            } else {
                Err(e.into())
            };
        }
        let brokers = url.trim_start_matches("kafka://").to_string();
        let admin = ClientConfig::new().set("bootstrap.servers", &brokers).create()?;
        Ok(Ok(KafkaBench { url: url.to_string(), admin }))
    }

    /// Makes the topic `name` of [`PARTITIONS`] partitions.
    pub async fn create_topic(&self, name: &str) -> Result<(), BoxError> {
        let topic = NewTopic::new(name, PARTITIONS, TopicReplication::Fixed(1));
        let options = AdminOptions::new().operation_timeout(Some(Timeout::After(TIMEOUT)));
        for result in self.admin.create_topics(&[topic], &options).await? {
            result.map_err(|(topic, code)| format!("creating the Kafka topic {topic}: {code}"))?;
        }
        Ok(())
    }

    /// Deletes the topic `name`.
    pub async fn delete_topic(&self, name: &str) -> Result<(), BoxError> {
        let options = AdminOptions::new().operation_timeout(Some(Timeout::After(TIMEOUT)));
        for result in self.admin.delete_topics(&[name], &options).await? {
            result.map_err(|(topic, code)| format!("deleting the Kafka topic {topic}: {code}"))?;
        }
        Ok(())
    }

    /// A sink sending every event to `topic`.
    pub async fn sink(&self, topic: &str) -> Result<Arc<KafkaSink>, BoxError> {
        Ok(Arc::new(KafkaSink::builder(&self.url).topic(topic).timeout(TIMEOUT).connect().await?))
    }

    /// Messages per second a plain producer gets acknowledged on `topic`, with the sink's
    /// producer settings (idempotent, `acks=all`, `murmur2_random`, `linger.ms=1`), a value of
    /// the size of an event's JSON and the sink's five headers: all `messages` enqueued at once,
    /// then every acknowledgement awaited.
    pub async fn producer_rate(&self, topic: &str, messages: usize) -> Result<f64, BoxError> {
        let producer: FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", self.url.trim_start_matches("kafka://"))
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("partitioner", "murmur2_random")
            .set("linger.ms", "1")
            .set("message.timeout.ms", "60000")
            .create()?;
        let value = event_json(123456, "0192b7c4-9a3e-7d21-8f00-4c6a1e2b3d4f");
        let started = Instant::now();
        let sends = (0..messages).map(|n| {
            let id = n.to_string();
            let producer = &producer;
            let value = &value;
            async move {
                let headers = OwnedHeaders::new_with_capacity(5)
                    .insert(Header { key: "content-type", value: Some("application/json") })
                    .insert(Header { key: "outbox-event-uuid", value: Some("0192b7c4-9a3e-7d21-8f00-4c6a1e2b3d4f") })
                    .insert(Header { key: "outbox-event-id", value: Some(&id) })
                    .insert(Header { key: "outbox-topic", value: Some("bench.drain") })
                    .insert(Header { key: "outbox-attempt", value: Some("1") });
                let record = FutureRecord::<(), _>::to(topic).payload(value.as_str()).headers(headers);
                producer.send(record, Timeout::After(TIMEOUT)).await.map(|_| ()).map_err(|(e, _)| e)
            }
        });
        for result in futures::future::join_all(sends).await {
            result?;
        }
        Ok(messages as f64 / started.elapsed().as_secs_f64())
    }
}
