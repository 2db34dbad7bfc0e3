//! `run --sink kafka://…` against a private tansu broker (the test kit's `kafka`), read back by
//! Python's confluent-kafka: the topic template, the CloudEvents Kafka binding, the login.

mod needs_kafka {
    use std::process::Stdio;

    use pg_outbox_relay_testkit::kafka::Kafka;
    use serde_json::{Value, json};

    use crate::binary::{BIN, cli, spawn_run, stderr, stdout, terminate_with_output};
    use crate::cli::settled;
    use crate::harness::TestDb;
    use crate::relay_support::{PATIENCE, eventually};

    #[tokio::test]
    async fn run_kafka_sends_cloudevents_to_the_templated_topic_keyed_by_the_event_key() {
        let db = TestDb::new().await;
        let kafka = Kafka::start();
        kafka.create_topic("outbox.order.placed", 2);
        let relay = spawn_run(
            &db.url,
            &[
                "--sink",
                &kafka.url(),
                "--kafka-topic",
                "outbox.{topic}",
                "--format",
                "cloudevents",
                "--cloudevents-source",
                "urn:shop:orders",
            ],
        );
        let client = db.client().await;
        // Headers written in SQL: an extension's name goes as ce_, others and the trace context
        // as Kafka headers of their own (issue 25).
        let traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let headers = json!({"tenant": "acme", "X-Correlation-Id": "c-1", "traceparent": traceparent}).to_string();
        for n in 1..=3 {
            let payload = json!({"order": n, "note": "ünïcode ✓"});
            client
                .execute(
                    "select outbox_relay.publish('order.placed', $1, $2, $3::text::jsonb)",
                    &[&payload, &format!("customer-{n}"), &headers],
                )
                .await
                .unwrap();
        }
        eventually("three delivered", || async { settled(&db, 3).await }).await;
        let output = terminate_with_output(relay).await;
        assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));

        let rows = client
            .query("select uuid::text, key, payload, id from outbox_relay.outbox order by id", &[])
            .await
            .unwrap();
        let messages = kafka.read("outbox.order.placed", 3, PATIENCE);
        assert_eq!(messages.len(), 3);
        for row in rows {
            let uuid: String = row.get(0);
            let message =
                messages.iter().find(|m| m.headers.get("ce_id") == Some(&uuid)).expect("each event, by ce_id");
            let key: String = row.get(1);
            assert_eq!(message.key.as_deref(), Some(key.as_str()));
            assert_eq!(Some(message.partition), message.java_partition);
            let h = |name: &str| message.headers.get(name).map(String::as_str);
            assert_eq!(h("ce_specversion"), Some("1.0"));
            assert_eq!(h("ce_type"), Some("order.placed"));
            assert_eq!(h("ce_source"), Some("urn:shop:orders"));
            assert_eq!(h("ce_partitionkey"), Some(key.as_str()));
            assert!(h("ce_time").is_some_and(|t| t.ends_with('Z')), "{message:?}");
            assert_eq!(h("content-type"), Some("application/json"));
            assert_eq!(h("outbox-event-uuid"), Some(uuid.as_str()));
            assert_eq!(h("outbox-event-id"), Some(row.get::<_, i64>(3).to_string().as_str()));
            assert_eq!((h("ce_tenant"), h("tenant")), (Some("acme"), None), "an extension");
            assert_eq!((h("X-Correlation-Id"), h("ce_x-correlation-id")), (Some("c-1"), None), "no extension's name");
            assert_eq!((h("traceparent"), h("ce_traceparent")), (Some(traceparent), Some(traceparent)), "both");
            let payload: Value = row.get(2);
            assert_eq!(serde_json::from_str::<Value>(&message.value).unwrap(), payload, "the payload as the value");
        }
    }

    #[tokio::test]
    async fn a_wrong_kafka_password_stops_the_start_without_showing_it() {
        let db = TestDb::new().await;
        let kafka = Kafka::start_with_login("relay", "good-Pa55-word", &[]);
        let run = |password: &str| {
            tokio::process::Command::new(BIN)
                .args(["run", "--sink", &kafka.url(), "--kafka-username", "relay", "--timeout", "5s"])
                .env("DATABASE_URL", &db.url)
                .env("OUTBOX_RELAY_KAFKA_PASSWORD", password)
                .env("RUST_LOG", "info")
                .stdin(Stdio::null())
                .output()
        };
        let output = tokio::time::timeout(PATIENCE, run("bad-Pa55-word")).await.expect("it stops").unwrap();
        let text = stderr(&output);
        assert_eq!(output.status.code(), Some(1), "{text}");
        assert!(text.contains("cannot connect to Kafka") && text.contains("refused the login"), "{text}");
        assert!(!text.contains("bad-Pa55") && !text.contains("good-Pa55"), "{text}");

        // A password without a user, and Kafka settings given to another sink, are refused.
        let output = cli(&db.url, &["run", "--sink", &kafka.url(), "--kafka-password", "x"]).await;
        assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
        let output = cli(&db.url, &["run", "--sink", "stdout", "--kafka-topic", "x.{topic}"]).await;
        assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
        assert!(stderr(&output).contains("apply to the Kafka sink"), "{}", stderr(&output));
        let output = cli(&db.url, &["run", "--sink", &kafka.url(), "--kafka-property", "sasl.password=hunter22"]).await;
        assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
        assert!(!stderr(&output).contains("hunter22"), "{}", stderr(&output));
    }

    /// `bench --sinks-only` drains to Kafka and measures a plain producer on the same broker; a
    /// broker that does not answer is skipped with the reason.
    #[tokio::test]
    async fn bench_drains_to_kafka_beside_a_plain_producer() {
        let server = crate::harness::server().url_for("postgres").to_connection_string();
        let kafka = Kafka::start_in_memory();
        let nobody = format!("127.0.0.1:{}", crate::relay_support::free_port());
        let (kafka_url, nats_url, amqp_url) =
            (kafka.url(), format!("nats://{nobody}"), format!("amqp://guest:guest@{nobody}/%2f"));
        let args = [
            "bench",
            "--json",
            "--sinks-only",
            "--events",
            "2000",
            "--kafka-url",
            &kafka_url,
            "--nats-url",
            &nats_url,
            "--amqp-url",
            &amqp_url,
        ];
        let output = cli(&server, &args).await;
        let out = stdout(&output);
        assert!(output.status.success(), "{out}\n{}", stderr(&output));
        let report: Value = serde_json::from_str(out.trim()).unwrap();
        for field in [
            "stdout_events_per_s",
            "stdout_two_destinations_events_per_s",
            "kafka_events_per_s",
            "kafka_producer_messages_per_s",
            "kafka_share_of_producer",
        ] {
            assert!(report[field].as_f64().is_some_and(|v| v > 0.0), "{field}: {report}");
        }
        assert!(report["nats_events_per_s"].is_null() && report["skipped"]["nats"].is_string(), "{report}");
        assert!(report["nats_publisher_messages_per_s"].is_null(), "{report}");
        assert!(report["nats_publisher_two_windows_messages_per_s"].is_null(), "{report}");
        assert!(report["nats_publisher_windows_in_flight"].is_null(), "{report}");
        assert!(report["sinks_cpu"]["kafka_producer"]["cores_by_command"].is_object(), "{report}");
        assert!(report["amqp_events_per_s"].is_null() && report["skipped"]["amqp"].is_string(), "{report}");
        assert!(!out.contains("guest:guest"), "no password in the report: {out}");
        assert_eq!(report["sinks_events"], json!(2000));
    }
}
