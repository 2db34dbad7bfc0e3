//! The Kafka sink against a real Kafka-protocol broker (a private tansu per test), read back by
//! a client no one here wrote (Python's confluent-kafka), partitions checked against
//! kafka-python's port of the Java client's partitioner.

mod needs_kafka {
    use std::collections::{BTreeMap, HashMap, HashSet};
    use std::time::Duration;

    use pg_outbox_relay::RelayConfig;
    use pg_outbox_relay::sink::{KafkaSink, SaslMechanism, Secret};
    use pg_outbox_relay_testkit::kafka::{Kafka, Message};

    use crate::harness::TestDb;
    use crate::relay_support::{self as support, PATIENCE, config, eventually, eventually_within};

    /// Every event of the outbox finished: passed by the destination, and nothing waits.
    async fn all_delivered(db: &TestDb, events: i64) -> bool {
        let stats = db.outbox.queue_stats().await.unwrap();
        stats.retained == events && (stats.pending, stats.held_by_key, stats.delayed, stats.in_flight) == (0, 0, 0, 0)
    }

    async fn uuids(db: &TestDb, topic: &str) -> HashSet<String> {
        let rows = db
            .client()
            .await
            .query("select uuid::text from outbox_relay.outbox where topic = $1", &[&topic])
            .await
            .unwrap();
        rows.iter().map(|row| row.get(0)).collect()
    }

    fn header<'a>(message: &'a Message, name: &str) -> &'a str {
        message.headers.get(name).unwrap_or_else(|| panic!("no {name} header: {message:?}"))
    }

    /// The ids of each key's messages in the order they stand in their partition, first
    /// appearances only (a redelivery repeats an event, it does not reorder the others).
    fn first_order_by_key(messages: &[Message]) -> BTreeMap<String, Vec<i64>> {
        let mut sorted: Vec<&Message> = messages.iter().collect();
        sorted.sort_by_key(|m| (m.partition, m.offset));
        let mut order: BTreeMap<String, Vec<i64>> = BTreeMap::new();
        for message in sorted {
            let Some(key) = &message.key else { continue };
            let id: i64 = header(message, "outbox-event-id").parse().unwrap();
            let ids = order.entry(key.clone()).or_default();
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
        order
    }

    fn assert_in_order(order: &BTreeMap<String, Vec<i64>>) {
        for (key, ids) in order {
            assert!(ids.windows(2).all(|w| w[0] < w[1]), "key {key}'s events out of order: {ids:?}");
        }
    }

    #[tokio::test]
    async fn a_thousand_keyed_events_arrive_once_each_on_the_java_partition_of_their_key() {
        let db = TestDb::new().await;
        let kafka = Kafka::start();
        kafka.create_topic("order.placed", 4);
        db.client()
            .await
            .batch_execute(
                "insert into outbox_relay.outbox (topic, key, payload)
                 select 'order.placed', 'customer-' || (g % 40), jsonb_build_object('n', g) from generate_series(1, 1000) g",
            )
            .await
            .unwrap();
        let sink = KafkaSink::builder(&kafka.url()).timeout(Duration::from_secs(5)).connect().await.unwrap();
        let relay = support::start(&db.outbox, config(), sink);
        // Events without a key, in ten commits, each delivered before the next is written and
        // 50 ms apart: librdkafka sends such events to one partition for a while
        // (sticky.partitioning.linger.ms, 10 ms, as the Java client does), then to another chosen
        // at random. (Written while the relay was still busy, they would go in one batch.)
        eventually("the keyed events delivered", || async { all_delivered(&db, 1000).await }).await;
        for n in 0..10 {
            db.client()
                .await
                .execute(
                    "insert into outbox_relay.outbox (topic, payload)
                     select 'order.placed', jsonb_build_object('n', g) from generate_series($1::int * 10 + 1001, $1::int * 10 + 1010) g",
                    &[&n],
                )
                .await
                .unwrap();
            let delivered = 1000 + 10 * (i64::from(n) + 1);
            eventually("a commit of events without a key delivered", || async { all_delivered(&db, delivered).await })
                .await;
            tokio::time::sleep(Duration::from_millis(50)).await; // past the sticky partition's linger
        }
        eventually("every event delivered", || async { all_delivered(&db, 1100).await }).await;
        let snapshot = relay.snapshot();
        relay.stop().await;
        assert_eq!((snapshot.delivered, snapshot.retried, snapshot.dead_lettered), (1100, 0, 0), "{snapshot:?}");

        let messages = kafka.read("order.placed", 1100, PATIENCE);
        assert_eq!(messages.len(), 1100, "each event once");
        let sent: HashSet<String> = messages.iter().map(|m| header(m, "outbox-event-uuid").to_string()).collect();
        assert_eq!(sent, uuids(&db, "order.placed").await, "every event, by its uuid, and no other");
        let mut partitions_of_key: HashMap<&str, HashSet<i32>> = HashMap::new();
        let mut unkeyed_partitions = HashSet::new();
        for message in &messages {
            let value: serde_json::Value = serde_json::from_str(&message.value).unwrap();
            assert_eq!(value["uuid"].as_str(), Some(header(message, "outbox-event-uuid")), "{message:?}");
            assert_eq!(value["id"].to_string(), header(message, "outbox-event-id"));
            assert_eq!(header(message, "outbox-topic"), "order.placed");
            assert_eq!(header(message, "content-type"), "application/json");
            match &message.key {
                Some(key) => {
                    assert_eq!(value["key"].as_str(), Some(key.as_str()));
                    assert_eq!(Some(message.partition), message.java_partition, "key {key}: Java's partition");
                    partitions_of_key.entry(key).or_default().insert(message.partition);
                }
                None => {
                    unkeyed_partitions.insert(message.partition);
                }
            }
        }
        assert_eq!(partitions_of_key.len(), 40);
        assert!(partitions_of_key.values().all(|p| p.len() == 1), "one partition per key: {partitions_of_key:?}");
        let used: HashSet<i32> = partitions_of_key.values().flatten().copied().collect();
        assert!(used.len() > 1, "40 keys over 4 partitions use more than one: {used:?}");
        assert!(unkeyed_partitions.len() > 1, "events without a key spread: {unkeyed_partitions:?}");
        let order = first_order_by_key(&messages);
        assert!(order.values().all(|ids| ids.len() == 25), "25 events per key");
        assert_in_order(&order);
    }

    /// The broker is killed under a running relay and comes back 15 s later, with `max_attempts`
    /// 3 and backoffs that would spend them in a second: the breaker holds the events, nothing
    /// is dead-lettered, and every event written during the outage arrives, each key's in
    /// order. (The broker keeps its messages in memory, so it comes back empty: its topic is made
    /// again, and the producer it no longer knows is replaced.)
    #[tokio::test]
    async fn the_broker_stopped_for_15_s_dead_letters_nothing() {
        let db = TestDb::new().await;
        let mut kafka = Kafka::start_in_memory();
        kafka.create_topic("order.placed", 2);
        let insert = |from: i32, to: i32| {
            format!(
                "insert into outbox_relay.outbox (topic, key, payload)
                 select 'order.placed', 'k' || (g % 10), jsonb_build_object('n', g) from generate_series({from}, {to}) g"
            )
        };
        db.client().await.batch_execute(&insert(1, 100)).await.unwrap();
        let sink = KafkaSink::builder(&kafka.url()).timeout(Duration::from_secs(1)).connect().await.unwrap();
        let relay_config = support::outage_config();
        let relay = support::start(&db.outbox, relay_config, sink);
        eventually("the first 100 delivered", || async { all_delivered(&db, 100).await }).await;
        assert_eq!(kafka.read("order.placed", 100, PATIENCE).len(), 100);

        kafka.stop();
        db.client().await.batch_execute(&insert(101, 300)).await.unwrap();
        eventually("the breaker open", || async { relay.snapshot().breaker_open }).await;
        tokio::time::sleep(Duration::from_secs(15)).await; // the outage itself, not a synchronization
        let stats = db.outbox.queue_stats().await.unwrap();
        assert_eq!(stats.dead_letters, 0, "nothing dead-lettered during the outage: {stats:?}");
        kafka.restart();
        kafka.create_topic("order.placed", 2);
        eventually_within("every event delivered", PATIENCE, || async { all_delivered(&db, 300).await }).await;
        let snapshot = relay.snapshot();
        relay.stop().await;
        assert!(snapshot.breaker_opens >= 1 && !snapshot.breaker_open, "{snapshot:?}");
        assert_eq!(db.outbox.queue_stats().await.unwrap().dead_letters, 0);

        let messages = kafka.read("order.placed", 200, PATIENCE);
        let sent: HashSet<String> = messages.iter().map(|m| header(m, "outbox-event-uuid").to_string()).collect();
        let written_during_the_outage: HashSet<String> = db
            .client()
            .await
            .query("select uuid::text from outbox_relay.outbox where id > 100", &[])
            .await
            .unwrap()
            .iter()
            .map(|row| row.get(0))
            .collect();
        assert_eq!(sent, written_during_the_outage, "every event written during the outage arrived");
        let order = first_order_by_key(&messages);
        assert!(order.values().all(|ids| ids.len() == 20), "20 events per key: {order:?}");
        assert_in_order(&order);
    }

    /// Events to a topic the cluster does not have wait, each with an error that names it; the
    /// breaker does not open, the other topic's events flow, and once the topic is made its
    /// events follow.
    #[tokio::test]
    async fn a_missing_topic_does_not_stop_the_others() {
        let db = TestDb::new().await;
        let kafka = Kafka::start();
        kafka.create_topic("order.placed", 2);
        db.client()
            .await
            .batch_execute(
                "insert into outbox_relay.outbox (topic, key, payload, headers)
                 select case when g % 2 = 0 then 'order.placed' else 'mail.sent' end, 'k' || (g % 6), '{}',
                        jsonb_build_object('x-n', g::text)
                   from generate_series(1, 100) g",
            )
            .await
            .unwrap();
        let sink = KafkaSink::builder(&kafka.url()).timeout(Duration::from_secs(5)).connect().await.unwrap();
        let relay = support::start(&db.outbox, RelayConfig { max_attempts: 1000, ..config() }, sink);
        eventually("order.placed's 50 delivered and mail.sent's 50 waiting", || async {
            let client = db.client().await;
            let waiting = support::count(
                &client,
                "select count(*) from outbox_relay.parked
                  where topic = 'mail.sent' and last_error like '%topic \"mail.sent\" does not exist%'",
            )
            .await;
            relay.snapshot().delivered == 50 && waiting > 0
        })
        .await;
        assert_eq!(kafka.read("order.placed", 50, PATIENCE).len(), 50);
        let snapshot = relay.snapshot();
        assert_eq!(snapshot.breaker_opens, 0, "a missing topic is no outage: {snapshot:?}");

        kafka.create_topic("mail.sent", 2);
        eventually("mail.sent's events follow", || async { all_delivered(&db, 100).await }).await;
        relay.stop().await;
        let mail = kafka.read("mail.sent", 50, PATIENCE);
        let sent: HashSet<String> = mail.iter().map(|m| header(m, "outbox-event-uuid").to_string()).collect();
        assert_eq!(sent, uuids(&db, "mail.sent").await);
        let numbers: HashSet<String> = mail.iter().map(|m| header(m, "x-n").to_string()).collect();
        assert_eq!(numbers, (1..=99).step_by(2).map(|n: i32| n.to_string()).collect(), "each event's own header");
        assert_in_order(&first_order_by_key(&mail));
        assert_eq!(db.outbox.queue_stats().await.unwrap().dead_letters, 0);
    }

    /// A wrong password is refused at connect with an error that says so and shows neither
    /// password; the right one delivers.
    #[tokio::test]
    async fn a_wrong_password_is_a_clear_error_that_does_not_show_it() {
        let db = TestDb::new().await;
        let kafka = Kafka::start_with_login("alice", "right-horse-battery", &[("order.placed", 1)]);
        let builder = |password: &str| {
            KafkaSink::builder(&kafka.url())
                .sasl(SaslMechanism::ScramSha256, "alice", Secret::new(password))
                .timeout(Duration::from_secs(5))
        };
        let wrong = builder("wrong-staple-correct");
        let shown = format!("{wrong:?}");
        assert!(!shown.contains("wrong-staple"), "{shown}");
        let error = wrong.connect().await.unwrap_err();
        let text = error.to_string();
        assert_eq!(
            error.kind(),
            pg_outbox_relay::ErrorKind::Permission,
            "a refused login is the operator's to fix, not an outage"
        );
        assert!(text.contains("refused the login") && text.contains(&kafka.url()), "{text}");
        assert!(!text.contains("wrong-staple") && !text.contains("right-horse"), "{text}");

        db.client()
            .await
            .batch_execute("insert into outbox_relay.outbox (topic, key, payload) values ('order.placed', 'k', '{}')")
            .await
            .unwrap();
        for mechanism in [SaslMechanism::ScramSha256, SaslMechanism::ScramSha512] {
            let sink = KafkaSink::builder(&kafka.url())
                .sasl(mechanism, "alice", Secret::new("right-horse-battery"))
                .connect()
                .await
                .unwrap_or_else(|e| panic!("{mechanism:?}: {e}"));
            drop(sink);
        }
        let sink = builder("right-horse-battery").connect().await.unwrap();
        let relay = support::start(&db.outbox, config(), sink);
        eventually("the event delivered", || async { all_delivered(&db, 1).await }).await;
        relay.stop().await;
    }

    /// Bad settings are refused before anything is sent, naming the problem.
    #[tokio::test]
    async fn bad_settings_are_refused_naming_the_problem() {
        let kafka = Kafka::start();
        let refused =
            async |builder: pg_outbox_relay::sink::KafkaSinkBuilder| builder.connect().await.unwrap_err().to_string();
        let e = refused(KafkaSink::builder(&kafka.url()).topic("outbox/{topic}")).await;
        assert!(e.contains("topic template"), "{e}");
        let e = refused(KafkaSink::builder(&kafka.url()).property("sasl.password", "hunter22")).await;
        assert!(e.contains("sasl.password") && !e.contains("hunter22"), "{e}");
        let e = refused(KafkaSink::builder(&kafka.url()).property("linger.ms", "soon-hunter22")).await;
        assert!(e.contains("linger.ms") && !e.contains("hunter22"), "{e}");
        let e = refused(KafkaSink::builder(&kafka.url()).property("no.such.property", "1")).await;
        assert!(e.contains("no.such.property"), "{e}");
        let e = refused(KafkaSink::builder("kafka://bob:hunter22@127.0.0.1:9092")).await;
        assert!(!e.contains("hunter22"), "{e}");
        let nobody = format!("kafka://127.0.0.1:{}", support::free_port());
        let e = refused(KafkaSink::builder(&nobody).timeout(Duration::from_secs(2))).await;
        assert!(e.contains("cannot connect to Kafka"), "{e}");
    }
}
