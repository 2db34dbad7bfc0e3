//! `run --sink amqp://…` against the machine's RabbitMQ (the test kit's `rabbitmq`: `AMQP_URL`,
//! default amqp://guest:guest@127.0.0.1:5672/%2f; `.ci/run` starts one when none listens), consumed with
//! lapin: persistent messages with the event's uuid as `message_id` and its id as `outbox-event-id`,
//! confirmed; an unroutable event
//! waits with an error that says so; a connection closed by the broker is re-opened.

use std::collections::HashSet;

use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties, ExchangeKind};
use serde_json::{Value, json};

use crate::binary::{cli, publish, spawn_run, stderr, terminate, terminate_with_output};
use crate::harness::TestDb;
use crate::relay_support::{PATIENCE, eventually};

/// The local ports of the TCP connections that process `pid` holds to the broker's port, read
/// from /proc (the socket inodes of its descriptors, matched in /proc/net/tcp and tcp6).
fn broker_ports(pid: u32) -> Vec<u16> {
    let broker_port = amqp_url().parse::<lapin::uri::AMQPUri>().expect("AMQP_URL is an AMQP URI").authority.port;
    let inodes: HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("the relay's descriptors")
        .filter_map(|entry| std::fs::read_link(entry.ok()?.path()).ok())
        .filter_map(|link| Some(link.to_str()?.strip_prefix("socket:[")?.strip_suffix(']')?.to_owned()))
        .collect();
    let port_of = |address: &str| u16::from_str_radix(address.rsplit_once(':')?.1, 16).ok();
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|table| std::fs::read_to_string(table).ok())
        .flat_map(|table| {
            table
                .lines()
                .skip(1)
                .filter_map(|line| {
                    let fields: Vec<&str> = line.split_whitespace().collect();
                    let (local, remote, inode) = (fields.get(1)?, fields.get(2)?, fields.get(9)?);
                    (port_of(remote)? == broker_port && inodes.contains(*inode)).then(|| port_of(local))?
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// The test kit's broker (`AMQP_URL`, or the machine's at 127.0.0.1:5672); fails the test when
/// none answers.
pub fn amqp_url() -> String {
    crate::rabbitmq::url()
}

/// A name of its own for each test run, so that tests never share an exchange or a queue.
fn unique(prefix: &str) -> String {
    format!("{prefix}-{:016x}", rand::random::<u64>())
}

/// A consumer on a new queue bound to `exchange` for every routing key.
pub async fn bound_queue(exchange: &str) -> (Connection, lapin::Consumer) {
    bound_queue_for(exchange, "#").await
}

/// A consumer on a new queue bound to `exchange` for `pattern`.
async fn bound_queue_for(exchange: &str, pattern: &str) -> (Connection, lapin::Consumer) {
    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .expect("RabbitMQ on AMQP_URL (default 127.0.0.1:5672, guest/guest)");
    let channel = connection.create_channel().await.unwrap();
    channel
        .exchange_declare(
            exchange.into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions { durable: true, ..Default::default() },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let queue = unique("outbox-relay-test");
    channel
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions { auto_delete: true, ..Default::default() },
            FieldTable::default(),
        )
        .await
        .unwrap();
    channel
        .queue_bind(
            queue.as_str().into(),
            exchange.into(),
            pattern.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let consumer = channel
        .basic_consume(queue.as_str().into(), "test".into(), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .unwrap();
    (connection, consumer)
}

pub async fn next(consumer: &mut lapin::Consumer) -> lapin::message::Delivery {
    let delivery = tokio::time::timeout(PATIENCE, consumer.next()).await.expect("a message within the patience limit");
    let delivery = delivery.expect("the consumer ended").expect("a delivery");
    delivery.ack(BasicAckOptions::default()).await.unwrap();
    delivery
}

/// The event id a message carries in its `outbox-event-id` header.
pub fn event_id(delivery: &lapin::message::Delivery) -> i64 {
    let headers = delivery.properties.headers().as_ref().expect("headers");
    match headers.inner().get("outbox-event-id") {
        Some(AMQPValue::LongLongInt(id)) => *id,
        other => panic!("outbox-event-id header: {other:?}"),
    }
}

async fn delete_exchange(exchange: &str) {
    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default()).await.unwrap();
    let channel = connection.create_channel().await.unwrap();
    let _ = channel.exchange_delete(exchange.into(), Default::default()).await;
}

/// Against the broker: `AMQP_URL` or the machine's RabbitMQ.
mod needs_rabbitmq {
    use super::*;

    #[tokio::test]
    async fn a_hundred_events_reach_a_queue_persistent_with_their_ids_and_keys() {
        let db = TestDb::new().await;
        let exchange = unique("outbox-test");
        let (_connection, mut consumer) = bound_queue(&exchange).await;
        let relay = spawn_run(&db.url, &["--sink", &amqp_url(), "--exchange", &exchange]);
        let mut ids = HashSet::new();
        for n in 0..100 {
            let id: i64 = db
            .client()
            .await
            .query_one("select outbox_relay.publish('order.placed', jsonb_build_object('n', $1::int), 'customer-' || ($1::int % 7))", &[&n])
            .await
            .unwrap()
            .get(0);
            ids.insert(id);
        }
        let mut seen = HashSet::new();
        for _ in 0..100 {
            let delivery = next(&mut consumer).await;
            let properties = &delivery.properties;
            let id = event_id(&delivery);
            let message_id = properties.message_id().as_ref().expect("message_id").as_str();
            assert_eq!(*properties.delivery_mode(), Some(2), "persistent");
            assert_eq!(properties.content_type().as_ref().map(|c| c.as_str()), Some("application/json"));
            assert_eq!(delivery.routing_key.as_str(), "order.placed", "routing key = topic");
            let body: Value = serde_json::from_slice(&delivery.data).unwrap();
            assert_eq!(body["id"], json!(id), "the body is the event's JSON");
            assert_eq!(body["uuid"], json!(message_id), "message_id is the event's uuid");
            let headers = properties.headers().as_ref().expect("headers");
            let key = match headers.inner().get("outbox-key") {
                Some(AMQPValue::LongString(key)) => String::from_utf8(key.as_bytes().to_vec()).unwrap(),
                other => panic!("outbox-key header: {other:?}"),
            };
            assert_eq!(json!(key), body["key"]);
            // (an attempt may be a retry on a loaded machine: a held claim cut off, say)
            let attempt = match headers.inner().get("outbox-attempt") {
                Some(AMQPValue::LongLongInt(n)) => *n,
                other => panic!("outbox-attempt header: {other:?}"),
            };
            assert_eq!(json!(attempt), body["attempts"], "the header is the event's attempt");
            seen.insert(id);
        }
        assert_eq!(seen, ids, "each event once, by its id");
        eventually("every event recorded delivered", || async { crate::cli::settled(&db, 100).await }).await;
        assert_eq!(db.outbox.queue_stats().await.unwrap().dead_letters, 0);
        assert_eq!(terminate(relay).await, Some(0));
        delete_exchange(&exchange).await;
    }

    #[tokio::test]
    async fn an_unroutable_event_waits_saying_so_until_a_queue_is_bound() {
        let db = TestDb::new().await;
        let exchange = unique("outbox-test");
        let relay = spawn_run(
            &db.url,
            &["--sink", &amqp_url(), "--exchange", &exchange, "--backoff-base", "50ms", "--backoff-max", "200ms"],
        );
        let id = publish(&db, "mail.send", json!({"to": "ana"})).await;
        let last_error = || async {
            db.client()
                .await
                .query_opt(
                    "select last_error from outbox_relay.parked where destination = 'default' and id = $1",
                    &[&id],
                )
                .await
                .unwrap()
                .and_then(|row| row.get::<_, Option<String>>(0))
        };
        eventually("the event fails as unroutable", || async {
            last_error().await.is_some_and(|e| e.contains("unroutable") && e.contains("mail.send"))
        })
        .await;
        let (_connection, mut consumer) = bound_queue(&exchange).await;
        let delivery = next(&mut consumer).await;
        assert_eq!(event_id(&delivery), id);
        assert_eq!(terminate(relay).await, Some(0));
        delete_exchange(&exchange).await;
    }

    /// Unroutable is one topic's trouble, not an outage: it does not open the breaker, so the other
    /// topics go on, and its attempts count (it is dead-lettered in the end like any failure).
    #[tokio::test]
    async fn an_unroutable_topic_does_not_stop_the_others() {
        let db = TestDb::new().await;
        let exchange = unique("outbox-test");
        let (_connection, mut consumer) = bound_queue_for(&exchange, "good.#").await;
        let relay = spawn_run(
            &db.url,
            &[
                "--sink",
                &amqp_url(),
                "--exchange",
                &exchange,
                "--breaker-threshold",
                "3",
                "--backoff-base",
                "50ms",
                "--backoff-max",
                "100ms",
            ],
        );
        for n in 0..8 {
            publish(&db, "bad.x", json!({"n": n})).await;
        }
        let good = publish(&db, "good.x", json!({})).await;
        assert_eq!(event_id(&next(&mut consumer).await), good);
        // (each waits for its retry as a copy parked for the destination, its attempts counted there)
        eventually("the unroutable events are retried, their attempts counted", || async {
        let row = db
            .client()
            .await
            .query_one(
                "select count(*), min(attempts) from outbox_relay.parked where destination = 'default' and topic = 'bad.x'",
                &[],
            )
            .await
            .unwrap();
        row.get::<_, i64>(0) == 8 && row.get::<_, Option<i32>>(1).is_some_and(|n| n >= 2)
    })
    .await;
        let output = terminate_with_output(relay).await;
        let logs = String::from_utf8_lossy(&output.stderr);
        assert!(!logs.contains("looks down"), "the breaker stayed closed:\n{logs}");
        assert!(
            !logs.contains("BasicReturnMessage"),
            "lapin's dump of returned messages stays out of the log:\n{logs}"
        );
        delete_exchange(&exchange).await;
    }

    #[tokio::test]
    async fn a_connection_closed_by_the_broker_is_opened_again() {
        // (rabbitmqctl closes the relay's connection from the broker's side)
        let rabbitmqctl = crate::rabbitmq::rabbitmqctl();
        let db = TestDb::new().await;
        let exchange = unique("outbox-test");
        let (_connection, mut consumer) = bound_queue(&exchange).await;
        let relay = spawn_run(
            &db.url,
            &["--sink", &amqp_url(), "--exchange", &exchange, "--backoff-base", "50ms", "--backoff-max", "500ms"],
        );
        let first = publish(&db, "order.placed", json!({})).await;
        assert_eq!(event_id(&next(&mut consumer).await), first);
        // The broker closes the relay's connections, as on a restart: only this relay's (found by the
        // ports its process holds open to the broker), since other tests run relays beside it. A
        // connection that closes between the listing and the question is skipped, not an error.
        let ports = broker_ports(relay.id().expect("running"));
        assert!(!ports.is_empty(), "the relay holds no connection to the broker");
        let ports = ports.iter().map(u16::to_string).collect::<Vec<_>>().join(",");
        let closed = tokio::process::Command::new(rabbitmqctl)
            .args([
                "eval",
                &format!(
                    "[rabbit_networking:close_connection(P, \"test\") || P <- rabbit_networking:connections(), \
                 lists:member(case catch rabbit_networking:connection_info(P, [peer_port]) of \
                 [{{peer_port, Port}}] -> Port; _ -> none end, [{ports}])]."
                ),
            ])
            .output()
            .await
            .unwrap();
        assert!(closed.status.success(), "{}", String::from_utf8_lossy(&closed.stderr));
        let closed = String::from_utf8_lossy(&closed.stdout);
        assert!(closed.contains("ok"), "the broker closed no connection of the relay's: {closed}");
        let second = publish(&db, "order.placed", json!({})).await;
        let mut got = Vec::new();
        while !got.contains(&second) {
            got.push(event_id(&next(&mut consumer).await));
        }
        let output = terminate_with_output(relay).await;
        let logs = String::from_utf8_lossy(&output.stderr);
        assert!(logs.contains("connected to RabbitMQ"), "the reconnect is logged:\n{logs}");
        assert!(!logs.contains("guest:guest"), "no password in the logs:\n{logs}");
        delete_exchange(&exchange).await;
    }

    #[tokio::test]
    async fn a_broker_that_refuses_the_login_stops_the_start_without_showing_the_password() {
        let db = TestDb::new().await;
        let url = amqp_url().replace("guest:guest", "guest:wrong-pass-9f3");
        let output = cli(&db.url, &["run", "--sink", &url]).await;
        assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
        let text = stderr(&output);
        assert!(text.contains("cannot connect to RabbitMQ"), "{text}");
        assert!(!text.contains("wrong-pass-9f3"), "{text}");
        let output = cli(&db.url, &["run", "--sink", "amqps://guest:guest@127.0.0.1:5671/%2f"]).await;
        assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
        assert!(stderr(&output).contains("no TLS"), "{}", stderr(&output));
        let output = cli(&db.url, &["run", "--sink", &amqp_url(), "--exchange", "amq.bad"]).await;
        assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
    }
}
