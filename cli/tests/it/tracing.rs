//! One trace from the writer's request to the receivers (issue 25): an event published inside a
//! traced span, and one whose `traceparent` a writer set by hand in SQL, reach an HTTP receiver,
//! a NATS subscriber and a RabbitMQ consumer with the trace in `traceparent`; the relay's `send`
//! spans arrive at a real OTLP endpoint (decoded by OpenTelemetry's own Python classes) as
//! children of the writer's `create` span, a retry's as a new trace linked to it; and the
//! receivers' `traceparent` names the relay's span that sent them.

/// Needs python3 with opentelemetry-proto (the OTLP endpoint), NATS and RabbitMQ.
mod needs_otel {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};

    use axum::http::{HeaderMap, StatusCode};
    use lapin::types::AMQPValue;
    use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
    use opentelemetry_otlp::WithExportConfig;
    use opentelemetry_sdk::Resource;
    use opentelemetry_sdk::trace::SdkTracerProvider;
    use pg_outbox_relay::NewEvent;
    use pg_outbox_relay_testkit::otlp::{Collector, PRODUCER, Span};
    use serde_json::json;
    use tracing::Instrument;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    use tracing_subscriber::layer::SubscriberExt;

    use crate::binary::{spawn_run_with_env, stderr, terminate_with_output};
    use crate::cli::{nats, nats_url, stream_for, unique};
    use crate::harness::TestDb;
    use crate::relay_support::{PATIENCE, eventually};

    /// The trace a writer set by hand through SQL, as any language can.
    const HAND_TRACE: &str = "5b8efff798038103d269b633813fc60c";
    const HAND_SPAN: &str = "eee19b7ec3c1b174";

    /// The writer's tracer provider, exporting to `collector` (built and shut down off the async
    /// runtime: the exporter's HTTP client is a blocking one).
    fn writer_provider(collector: &Collector) -> SdkTracerProvider {
        let endpoint = format!("{}/v1/traces", collector.endpoint());
        let _ = rustls::crypto::ring::default_provider().install_default();
        std::thread::spawn(move || {
            let exporter =
                opentelemetry_otlp::SpanExporter::builder().with_http().with_endpoint(endpoint).build().unwrap();
            SdkTracerProvider::builder()
                .with_batch_exporter(exporter)
                .with_resource(Resource::builder_empty().with_service_name("orders-test").build())
                .build()
        })
        .join()
        .unwrap()
    }

    type Requests = Arc<Mutex<Vec<HeaderMap>>>;

    /// An HTTP receiver that answers 503 to the first request of `trace.placed` (so that it is
    /// retried) and 200 to everything else.
    async fn receiver() -> (String, Requests) {
        let seen: Requests = Arc::default();
        let app = axum::Router::new().route(
            "/hook",
            axum::routing::post({
                let seen = seen.clone();
                move |headers: HeaderMap| async move {
                    let mut seen = seen.lock().unwrap();
                    let placed = |h: &HeaderMap| h.get("outbox-topic").is_some_and(|t| t == "trace.placed");
                    let first = placed(&headers) && !seen.iter().any(placed);
                    seen.push(headers);
                    if first { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::OK }
                }
            }),
        );
        let addr = crate::binary::serve(app).await;
        (format!("http://{addr}/hook"), seen)
    }

    /// A `traceparent`'s trace and parent ids.
    fn ids(traceparent: &str) -> (String, String) {
        let fields: Vec<&str> = traceparent.split('-').collect();
        assert_eq!((fields.len(), fields[0], fields[3]), (4, "00", "01"), "{traceparent}");
        (fields[1].to_string(), fields[2].to_string())
    }

    fn only<'a>(spans: &'a [Span], what: &str, pick: impl Fn(&Span) -> bool) -> &'a Span {
        let found: Vec<&Span> = spans.iter().filter(|s| pick(s)).collect();
        assert_eq!(found.len(), 1, "one {what} span: {spans:#?}");
        found[0]
    }

    #[tokio::test]
    async fn a_trace_runs_from_the_writers_span_through_the_relay_to_every_receiver() {
        let db = TestDb::new().await;
        let collector = Collector::start();

        // The writer: a request span, and the event published inside it.
        let provider = writer_provider(&collector);
        let subscriber =
            tracing_subscriber::registry().with(tracing_opentelemetry::layer().with_tracer(provider.tracer("orders")));
        let guard = tracing::subscriber::set_default(subscriber);
        let request = tracing::info_span!("POST /orders");
        let trace = request.context().span().span_context().trace_id().to_string();
        let request_id = request.context().span().span_context().span_id().to_string();
        let placed = NewEvent::new("trace.placed", json!({"order": 1})).key("1");
        let placed = db.outbox.publish(&placed).instrument(request.clone()).await.unwrap();
        drop(request);
        drop(guard);
        tokio::task::spawn_blocking(move || provider.shutdown().unwrap()).await.unwrap();
        // A writer in another language, through SQL, with its own trace context.
        let hand = format!("00-{HAND_TRACE}-{HAND_SPAN}-01");
        let headers = json!({"traceparent": hand, "tracestate": "shop=1"}).to_string();
        db.client()
            .await
            .execute("select outbox_relay.publish('trace.sql', '{}', null, $1::text::jsonb)", &[&headers])
            .await
            .unwrap();
        let stored: String = db
            .client()
            .await
            .query_one("select headers->>'traceparent' from outbox_relay.outbox where id = $1", &[&placed])
            .await
            .unwrap()
            .get(0);
        let (stored_trace, create_id) = ids(&stored);
        assert_eq!(stored_trace, trace, "publish recorded the request's trace");

        // The receivers, and one relay delivering to all three.
        let (url, requests) = receiver().await;
        let js = nats().await;
        let prefix = unique("trace");
        let stream = stream_for(&js, &prefix).await;
        let exchange = format!("trace-{:016x}", rand::random::<u64>());
        let (_connection, mut consumer) = crate::amqp::bound_queue(&exchange).await;
        let config = format!(
            "[[destination]]\nname = \"webhook\"\npattern = \"trace.#\"\nsink = \"{url}\"\n\n\
             [[destination]]\nname = \"bus\"\npattern = \"trace.#\"\nsink = \"{nats}\"\nsubject_prefix = \"{prefix}\"\n\n\
             [[destination]]\nname = \"queue\"\npattern = \"trace.#\"\nsink = \"{amqp}\"\nexchange = \"{exchange}\"\n",
            nats = nats_url(),
            amqp = crate::amqp::amqp_url(),
        );
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("relay.toml");
        std::fs::write(&file, config).unwrap();
        let relay = spawn_run_with_env(
            &db.url,
            &["--config", file.to_str().unwrap(), "--backoff-base", "200ms"],
            &[("OTEL_EXPORTER_OTLP_ENDPOINT", &collector.endpoint()), ("OTEL_SERVICE_NAME", "relay-test")],
        );
        eventually("both events delivered to all three, the webhook's first after a retry", || async {
            requests.lock().unwrap().len() == 3 && crate::cli::settled(&db, 2).await
        })
        .await;
        let output = terminate_with_output(relay).await;
        assert_eq!(output.status.code(), Some(0), "{}", stderr(&output));

        // The spans: the writer's, then the relay's, flushed when it stopped.
        let spans = collector
            .wait_for("the writer's two spans and the relay's seven", PATIENCE, |spans| spans.len() >= 9)
            .await;
        let request_span = only(&spans, "request", |s| s.name == "POST /orders");
        assert_eq!((&request_span.trace_id, &request_span.span_id), (&trace, &request_id));
        let create = only(&spans, "create", |s| s.name == "create trace.placed");
        assert_eq!(create.kind, PRODUCER);
        assert_eq!((&create.trace_id, create.parent_span_id.as_ref()), (&trace, Some(&request_id)));
        assert_eq!(create.span_id, create_id, "the event carries the create span's context");
        assert_eq!(create.attribute("messaging.operation.type").as_deref(), Some("create"));

        let sends: Vec<&Span> = spans.iter().filter(|s| s.service.as_deref() == Some("relay-test")).collect();
        assert_eq!(sends.len(), 7, "3 destinations x 2 events + the webhook's retry: {sends:#?}");
        let send = |topic: &str, destination: &str, attempt: i32| -> &Span {
            only(&spans, &format!("send {topic} to {destination}, attempt {attempt}"), |s| {
                s.name == format!("send {topic}")
                    && s.attribute("outbox_relay.destination").as_deref() == Some(destination)
                    && s.attribute("outbox_relay.attempt") == Some(attempt.to_string())
            })
        };
        for destination in ["webhook", "bus", "queue"] {
            let first = send("trace.placed", destination, 1);
            assert_eq!(first.kind, PRODUCER);
            assert_eq!((&first.trace_id, first.parent_span_id.as_ref()), (&trace, Some(&create_id)), "{destination}");
            assert_eq!(first.attribute("messaging.operation.type").as_deref(), Some("send"));
            assert_eq!(first.attribute("messaging.destination.name").as_deref(), Some("trace.placed"));
            let by_hand = send("trace.sql", destination, 1);
            assert_eq!((by_hand.trace_id.as_str(), by_hand.parent_span_id.as_deref()), (HAND_TRACE, Some(HAND_SPAN)));
        }
        assert_eq!(send("trace.placed", "webhook", 1).status, 2, "the refused attempt is an error");
        let retry = send("trace.placed", "webhook", 2);
        assert_ne!(retry.trace_id, trace, "a retry is a trace of its own");
        assert_eq!(retry.parent_span_id, None);
        let link = &retry.links[..];
        assert_eq!(link.len(), 1, "{retry:#?}");
        assert_eq!((&link[0].trace_id, &link[0].span_id), (&trace, &create_id), "linked to the writer's span");

        // What each receiver got: the trace, its parent the span that sent it.
        let sent_by = |span: &Span| format!("00-{}-{}-01", span.trace_id, span.span_id);
        let http: HashMap<String, Vec<String>> = requests.lock().unwrap().iter().fold(HashMap::new(), |mut by, h| {
            let topic = h["outbox-topic"].to_str().unwrap().to_string();
            by.entry(topic).or_default().push(h["traceparent"].to_str().unwrap().to_string());
            by
        });
        assert_eq!(
            http["trace.placed"],
            [sent_by(send("trace.placed", "webhook", 1)), sent_by(retry)],
            "HTTP: each attempt's own span"
        );
        assert_eq!(http["trace.sql"], [sent_by(send("trace.sql", "webhook", 1))]);
        let by_hand_http = requests.lock().unwrap().iter().find(|h| h["outbox-topic"] == "trace.sql").unwrap().clone();
        assert_eq!(by_hand_http["tracestate"], "shop=1", "tracestate travels with it");

        for seq in 1..=2 {
            let message = stream.get_raw_message(seq).await.unwrap();
            let topic = message.headers.get("Outbox-Topic").unwrap().as_str().to_string();
            let traceparent = message.headers.get("traceparent").unwrap().as_str().to_string();
            assert_eq!(traceparent, sent_by(send(&topic, "bus", 1)), "NATS: {topic}");
        }
        js.delete_stream(&prefix).await.unwrap();

        for _ in 0..2 {
            let delivery = crate::amqp::next(&mut consumer).await;
            let table = delivery.properties.headers().clone().unwrap();
            let text = |name: &str| match table.inner().get(name) {
                Some(AMQPValue::LongString(v)) => v.to_string(),
                other => panic!("RabbitMQ {name}: {other:?}"),
            };
            let topic = delivery.routing_key.to_string();
            assert_eq!(text("traceparent"), sent_by(send(&topic, "queue", 1)), "RabbitMQ: {topic}");
        }
    }

    /// OTLP settings the command cannot follow stop it at start, naming the setting; with none,
    /// it exports nothing and says nothing of it.
    #[tokio::test]
    async fn otlp_settings_it_cannot_follow_are_refused_at_start() {
        let db = TestDb::new().await;
        for (env, expected) in [
            (
                vec![("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318"), ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")],
                "OTEL_EXPORTER_OTLP_PROTOCOL=grpc",
            ),
            (vec![("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4318")], "no http:// or https:// URL"),
        ] {
            let child = spawn_run_with_env(&db.url, &["--sink", "stdout"], &env);
            let output = tokio::time::timeout(PATIENCE, child.wait_with_output()).await.unwrap().unwrap();
            assert_eq!(output.status.code(), Some(2), "{env:?}: {}", stderr(&output));
            assert!(stderr(&output).contains(expected), "{env:?}: {}", stderr(&output));
        }
        let child = spawn_run_with_env(&db.url, &["--sink", "stdout"], &[("OTEL_SERVICE_NAME", "x")]);
        let output = terminate_with_output(child).await;
        assert!(!stderr(&output).to_lowercase().contains("otlp"), "{}", stderr(&output));
    }
}

/// An OTLP endpoint where nothing listens: the relay delivers all the same, says so once (not
/// per batch of spans) naming the endpoint, counts the spans it could not export on /metrics, and
/// says at exit how many were lost.
#[tokio::test]
async fn an_unreachable_otlp_endpoint_is_warned_of_once_and_its_dropped_spans_counted() {
    use crate::binary::{spawn_run_with_env, stderr, terminate_with_output};
    use crate::harness::TestDb;
    use crate::relay_support::{PATIENCE, eventually, free_port};

    let db = TestDb::new().await;
    let (http, nowhere) = (free_port(), free_port());
    let endpoint = format!("http://127.0.0.1:{nowhere}");
    let relay = spawn_run_with_env(
        &db.url,
        &["--sink", "stdout", "--http", &format!("127.0.0.1:{http}")],
        &[("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint), ("OTEL_BSP_SCHEDULE_DELAY", "50")],
    );
    let traced =
        serde_json::json!({"traceparent": "00-5b8efff798038103d269b633813fc60c-eee19b7ec3c1b174-01"}).to_string();
    // Three rounds, each its own export batch.
    for _ in 0..3 {
        db.client()
            .await
            .execute(
                "select outbox_relay.publish('trace.sql', '{}', null, $1::text::jsonb) from generate_series(1, 5)",
                &[&traced],
            )
            .await
            .unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    }
    let metrics = format!("http://127.0.0.1:{http}/metrics");
    let http_client = crate::http::http();
    eventually("15 spans counted as dropped", || async {
        let Ok(answer) = http_client.get(&metrics).timeout(PATIENCE).send().await else { return false };
        let text = answer.text().await.unwrap_or_default();
        text.lines()
            .find_map(|l| l.strip_prefix("outbox_relay_spans_dropped_total ")?.parse::<f64>().ok())
            .is_some_and(|n| n >= 15.0)
    })
    .await;
    let output = terminate_with_output(relay).await;
    let log = stderr(&output);
    let warned: Vec<&str> =
        log.lines().filter(|l| l.contains("spans could not be exported to the OTLP endpoint")).collect();
    assert_eq!(warned.len(), 1, "once, not per batch: {log}");
    assert!(warned[0].contains(&endpoint) && warned[0].contains("WARN"), "{}", warned[0]);
    assert!(log.contains("spans could not be exported over OTLP while the command ran"), "{log}");
    assert_eq!(output.status.code(), Some(0), "{log}");
}
