//! RabbitMQ (AMQP 0-9-1): one persistent, confirmed publish per event to a topic exchange.

use std::time::{Duration, SystemTime};

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ExchangeKind};
use tokio::sync::Mutex;

use super::{DEFAULT_EXCHANGE, DEFAULT_HTTP_TIMEOUT, event_json};
use crate::error::{Error, ErrorKind, Result};
use crate::event::Event;
use crate::relay::{DeliveryError, Handler, Slots};

/// Publishes each event to an exchange (a durable topic exchange, declared when missing) with
/// the topic as routing key, `message_id` = the event's uuid, persistent delivery, `application/json`
/// (the same JSON object as every sink) and the headers `outbox-key`, `outbox-attempt` and `outbox-event-id` (the event's id in this database); and
/// waits for the broker's publisher confirm before the event counts as delivered (a batch is
/// published in one go, its confirms awaited together).
///
/// Messages are published `mandatory`: one that no queue is bound to receive comes back, and
/// that is a transient failure whose error says so (the event stays pending until a queue is
/// bound). A lost connection is re-established at the next delivery.
#[derive(Debug)]
pub struct AmqpSink {
    uri: String,
    exchange: String,
    timeout: Duration,
    /// Boxed: a connection and a channel are large, and the sink sits in an enum of sinks.
    link: Mutex<Option<Box<Link>>>,
    /// Set when the link failed mid-delivery (no confirm in time, an error): the next delivery
    /// opens a new one.
    broken: std::sync::atomic::AtomicBool,
    /// The broker's URL as it may be shown.
    pub(super) shown: String,
}

#[derive(Debug)]
struct Link {
    connection: Connection,
    channel: Channel,
}

/// Builds an [`AmqpSink`]: `AmqpSink::builder(uri).exchange("events").connect().await`.
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `connect` is called"]
pub struct AmqpSinkBuilder {
    uri: String,
    exchange: String,
    timeout: Duration,
}

impl AmqpSinkBuilder {
    /// The exchange events are published to (declared as a durable topic exchange when
    /// missing). Defaults to [`DEFAULT_EXCHANGE`].
    pub fn exchange(mut self, exchange: impl Into<String>) -> Self {
        self.exchange = exchange.into();
        self
    }

    /// How long connecting and each confirm may take (1 ms to
    /// [`MAX_TIMEOUT`](super::MAX_TIMEOUT)). Defaults to 10 s.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Connects to the broker and declares the exchange as a durable topic exchange (nothing
    /// changes when it exists as one; an exchange of that name of another kind is an error).
    pub async fn connect(self) -> Result<AmqpSink> {
        let AmqpSinkBuilder { uri, exchange, timeout } = self;
        let uri = uri.as_str();
        let shown = super::url::describe(uri);
        if uri.starts_with("amqps://") {
            return Err(Error::config(format!(
                "{shown}: this build's RabbitMQ sink has no TLS; use amqp:// on a trusted network, or a TLS-terminating proxy"
            )));
        }
        let parsed = ::url::Url::parse(uri).map_err(|e| Error::config(format!("invalid AMQP URL {shown}: {e}")))?;
        if parsed.scheme() != "amqp" || parsed.host_str().is_none_or(str::is_empty) {
            return Err(Error::config(format!("invalid AMQP URL {shown}: expected amqp://user:pass@host:5672/vhost")));
        }
        validate_exchange(&exchange)?;
        super::check_timeout(timeout)?;
        let sink = AmqpSink {
            uri: uri.to_string(),
            exchange,
            timeout,
            link: Mutex::new(None),
            broken: std::sync::atomic::AtomicBool::new(false),
            shown,
        };
        let link = sink.open().await?;
        *sink.link.lock().await = Some(Box::new(link));
        Ok(sink)
    }
}

impl AmqpSink {
    /// A builder for a sink to the broker of `uri` (`amqp://user:pass@host:5672/vhost`).
    pub fn builder(uri: &str) -> AmqpSinkBuilder {
        AmqpSinkBuilder { uri: uri.to_string(), exchange: DEFAULT_EXCHANGE.to_string(), timeout: DEFAULT_HTTP_TIMEOUT }
    }

    /// Connects to the broker of `uri` with the defaults.
    pub async fn connect(uri: &str) -> Result<Self> {
        AmqpSink::builder(uri).connect().await
    }

    /// A connection, a channel in confirm mode, the exchange declared.
    async fn open(&self) -> Result<Link> {
        let connect =
            Connection::connect(&self.uri, ConnectionProperties::default().with_connection_name("outbox-relay".into()));
        let connection = match tokio::time::timeout(self.timeout, connect).await {
            Ok(Ok(connection)) => connection,
            Ok(Err(e)) => {
                let text = e.to_string();
                let why = if text.contains("Parsing Error") || text.contains("ParserErrors") {
                    "the server does not speak AMQP 0-9-1 (is this RabbitMQ's port?)".to_string()
                } else {
                    self.hide(&text)
                };
                // A refused login is the operator's to fix, not an outage to wait out.
                let kind = if text.contains("ACCESS_REFUSED") { ErrorKind::Permission } else { ErrorKind::Connect };
                return Err(Error::new(kind, format!("cannot connect to RabbitMQ at {}: {why}", self.shown)));
            }
            Err(_) => {
                return Err(Error::new(
                    ErrorKind::Connect,
                    format!("cannot connect to RabbitMQ at {}: no answer within {:?}", self.shown, self.timeout),
                ));
            }
        };
        let failed = |what: &str, e: lapin::Error| {
            Error::new(ErrorKind::Connect, format!("RabbitMQ at {}: {what}: {}", self.shown, self.hide(&e.to_string())))
        };
        let channel = connection.create_channel().await.map_err(|e| failed("cannot open a channel", e))?;
        channel
            .exchange_declare(
                ShortString::from(self.exchange.as_str()),
                ExchangeKind::Topic,
                ExchangeDeclareOptions { durable: true, ..ExchangeDeclareOptions::default() },
                FieldTable::default(),
            )
            .await
            .map_err(|e| {
                Error::new(
                    ErrorKind::Config,
                    format!(
                        "RabbitMQ at {}: cannot declare the exchange {:?} as a durable topic exchange (does one of another kind exist?): {}",
                        self.shown,
                        self.exchange,
                        self.hide(&e.to_string())
                    ),
                )
            })?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| failed("cannot turn publisher confirms on", e))?;
        Ok(Link { connection, channel })
    }

    /// The channel to publish on: the open one, or a new link when it was lost.
    async fn channel(&self) -> Result<Channel, DeliveryError> {
        let mut link = self.link.lock().await;
        let broken = self.broken.swap(false, std::sync::atomic::Ordering::AcqRel);
        if let Some(open) = link.as_ref()
            && !broken
            && open.connection.status().connected()
            && open.channel.status().connected()
        {
            return Ok(open.channel.clone());
        }
        if let Some(old) = link.take() {
            let _ = tokio::time::timeout(Duration::from_secs(1), old.connection.close(0, "reconnecting".into())).await;
        }
        let open = self.open().await.map_err(|e| DeliveryError::transient(e.to_string()))?;
        tracing::info!(broker = %self.shown, "connected to RabbitMQ");
        let channel = open.channel.clone();
        *link = Some(Box::new(open));
        Ok(channel)
    }

    /// An error text without the URL's password (lapin's errors may quote the URI).
    fn hide(&self, text: &str) -> String {
        match ::url::Url::parse(&self.uri).ok().and_then(|u| u.password().map(str::to_string)) {
            Some(password) if !password.is_empty() => text.replace(&password, "***"),
            _ => text.to_string(),
        }
    }

    fn properties(event: &Event) -> BasicProperties {
        let mut headers = FieldTable::default();
        if let Some(key) = &event.key {
            headers.insert("outbox-key".into(), AMQPValue::LongString(LongString::from(key.as_bytes())));
        }
        headers.insert("outbox-attempt".into(), AMQPValue::LongLongInt(i64::from(event.attempts)));
        headers.insert("outbox-event-id".into(), AMQPValue::LongLongInt(event.id));
        for (name, value) in &event.headers {
            headers.insert(name.into(), AMQPValue::LongString(LongString::from(value.as_bytes())));
        }
        let created = event.created_at.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        BasicProperties::default()
            .with_message_id(event.uuid.to_string().into())
            .with_content_type("application/json".into())
            .with_delivery_mode(2)
            .with_timestamp(created)
            .with_headers(headers)
    }

    /// Publishes one event; its confirm comes later.
    async fn send(&self, channel: &Channel, event: &Event) -> Result<lapin::PublisherConfirm, DeliveryError> {
        let body = event_json(event)?;
        channel
            .basic_publish(
                ShortString::from(self.exchange.as_str()),
                ShortString::from(event.topic.as_str()),
                BasicPublishOptions { mandatory: true, ..BasicPublishOptions::default() },
                &body,
                Self::properties(event),
            )
            .await
            .map_err(|e| self.lost(&e))
    }

    /// What the broker's confirm of one event says.
    async fn confirmed(&self, event: &Event, confirm: lapin::PublisherConfirm) -> Result<(), DeliveryError> {
        let confirmation = match tokio::time::timeout(self.timeout, confirm).await {
            Err(_) => {
                // A channel that stopped confirming is not used again.
                self.broken.store(true, std::sync::atomic::Ordering::Release);
                return Err(DeliveryError::transient(format!(
                    "RabbitMQ at {} did not confirm within {:?}; the connection is opened anew",
                    self.shown, self.timeout
                )));
            }
            Ok(Err(e)) => {
                self.broken.store(true, std::sync::atomic::Ordering::Release);
                return Err(self.lost(&e));
            }
            Ok(Ok(confirmation)) => confirmation,
        };
        match confirmation {
            Confirmation::Ack(None) => Ok(()),
            Confirmation::Ack(Some(returned)) | Confirmation::Nack(Some(returned)) => Err(DeliveryError::transient(
                format!(
                    "unroutable: no queue is bound to exchange {:?} for routing key {:?} ({} {}); it is retried until one is",
                    self.exchange, event.topic, returned.reply_code, returned.reply_text
                ),
            )
            .destination_answered()),
            Confirmation::Nack(None) => Err(DeliveryError::transient(format!(
                "RabbitMQ at {} refused the message (nack: a full queue with overflow reject-publish, or a broker resource alarm)",
                self.shown
            ))),
            Confirmation::NotRequested => Ok(()),
        }
    }

    fn lost(&self, e: &lapin::Error) -> DeliveryError {
        self.broken.store(true, std::sync::atomic::Ordering::Release);
        DeliveryError::transient(format!(
            "publishing to RabbitMQ at {} failed: {}",
            self.shown,
            self.hide(&e.to_string())
        ))
    }
}

/// An exchange name: 1 to 255 characters of letters, digits, `-`, `_`, `.` and `:` (AMQP's own).
fn validate_exchange(name: &str) -> Result<()> {
    let valid = !name.is_empty()
        && name.len() <= 255
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':'))
        && !name.starts_with("amq.");
    if valid {
        Ok(())
    } else {
        Err(Error::config(format!(
            "invalid exchange name {name:?}: use letters, digits, - _ . : (up to 255, not starting with amq.)"
        )))
    }
}

impl Handler for AmqpSink {
    async fn handle(&self, event: &Event) -> Result<(), DeliveryError> {
        let channel = self.channel().await?;
        let confirm = self.send(&channel, event).await?;
        self.confirmed(event, confirm).await
    }

    /// Publishes the whole batch, then awaits the confirms together: one pipelined exchange,
    /// one slot.
    async fn handle_batch(&self, events: &[Event], slots: &Slots) -> Vec<Result<(), DeliveryError>> {
        let _slot = slots.take_for(events.len()).await;
        let channel = match self.channel().await {
            Ok(channel) => channel,
            Err(e) => return events.iter().map(|_| Err(e.clone())).collect(),
        };
        let mut sent = Vec::with_capacity(events.len());
        for event in events {
            sent.push(self.send(&channel, event).await);
        }
        let confirms = events.iter().zip(sent).map(|(event, sent)| async move { self.confirmed(event, sent?).await });
        futures::future::join_all(confirms).await
    }
}

#[cfg(test)]
mod tests {
    use super::validate_exchange;

    #[test]
    fn exchange_names_are_checked() {
        assert!(validate_exchange("outbox").is_ok());
        assert!(validate_exchange("shop.events-1").is_ok());
        for bad in ["", "a b", "amq.topic", "é", &"x".repeat(256)] {
            assert!(validate_exchange(bad).is_err(), "{bad:?}");
        }
    }
}
