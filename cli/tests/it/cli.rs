//! The `outbox-relay` binary, spawned for real against the test database.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

use crate::factory::{OutboxRow, pass_everything};
use crate::harness::TestDb;
use crate::relay_support::{PATIENCE, count, eventually, eventually_within};

use crate::binary::{
    BIN, cli, cli_within, publish, spawn_run, spawn_run_as_shipped, stderr, stdout, terminate, terminate_with_output,
};

/// Also: with the shipped defaults, delivered rows are kept for the retention, read as delivered.
#[tokio::test]
async fn run_stdout_prints_json_lines_and_stops_cleanly_on_sigterm() {
    let db = TestDb::new().await;
    let mut child = spawn_run_as_shipped(&db.url, &["--sink", "stdout", "--poll-interval", "1h"]);
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = publish(&db, "order.placed", json!({"order_id": 1})).await;
    let second = publish(&db, "order.shipped", json!({"order_id": 1, "carrier": "x"})).await;
    let mut seen = Vec::new();
    while seen.len() < 2 {
        let line = tokio::time::timeout(PATIENCE, lines.next_line()).await.expect("no output").unwrap().expect("eof");
        let event: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON: {line}: {e}"));
        for field in ["id", "topic", "key", "payload", "created_at", "attempts"] {
            assert!(event.get(field).is_some(), "{field} missing in {line}");
        }
        seen.push(event);
    }
    // Two keyless events may be delivered by two workers at once: no order between them.
    seen.sort_by_key(|event| event["id"].as_i64());
    assert_eq!(seen[0]["id"], json!(first));
    assert_eq!(seen[0]["topic"], json!("order.placed"));
    assert_eq!(seen[0]["payload"], json!({"order_id": 1}));
    assert_eq!(seen[0]["attempts"], json!(1));
    assert_eq!(seen[1]["id"], json!(second));
    assert!(humantime::parse_rfc3339(seen[1]["created_at"].as_str().unwrap()).is_ok());
    let client = db.client().await;
    eventually("the delivered rows kept, read as delivered", || async {
        client
            .query_one("select count(*) from outbox_relay.event_state where state = 'delivered'", &[])
            .await
            .unwrap()
            .get::<_, i64>(0)
            == 2
    })
    .await;
    // Nothing waits for the destination, nothing was dead-lettered.
    let stats = db.outbox.queue_stats().await.unwrap();
    assert_eq!((stats.pending, stats.held_by_key, stats.delayed, stats.in_flight), (0, 0, 0, 0), "{stats:?}");
    assert_eq!(stats.dead_letters, 0, "{stats:?}");
    assert_eq!(terminate(child).await, Some(0));
}

/// One request as the receiver saw it: lower-cased headers and the JSON body.
type Request = (HashMap<String, String>, Value);

/// A receiver whose answer depends on the topic header: `*.ok` 200, `*.flaky` 500 twice then
/// 200, `*.bad` 400. It records the headers of every request.
#[derive(Clone, Default)]
struct Receiver {
    requests: Arc<Mutex<Vec<Request>>>,
    flaky_failures: Arc<Mutex<u32>>,
}

async fn receive(State(receiver): State<Receiver>, headers: HeaderMap, body: axum::Json<Value>) -> StatusCode {
    let headers: HashMap<String, String> =
        headers.iter().map(|(k, v)| (k.as_str().to_string(), v.to_str().unwrap_or("").to_string())).collect();
    let topic = headers.get("outbox-topic").cloned().unwrap_or_default();
    receiver.requests.lock().unwrap().push((headers, body.0));
    if topic.ends_with(".bad") {
        return StatusCode::BAD_REQUEST;
    }
    if topic.ends_with(".flaky") {
        let mut failures = receiver.flaky_failures.lock().unwrap();
        if *failures < 2 {
            *failures += 1;
            return StatusCode::INTERNAL_SERVER_ERROR;
        }
    }
    StatusCode::OK
}

#[tokio::test]
async fn run_http_delivers_retries_5xx_and_dead_letters_4xx() {
    let db = TestDb::new().await;
    let receiver = Receiver::default();
    let app = axum::Router::new().route("/hook", axum::routing::post(receive)).with_state(receiver.clone());
    let addr = crate::binary::serve(app).await;

    let sink = format!("http://{addr}/hook");
    let args = ["--sink", &sink, "--backoff-base", "20ms", "--backoff-max", "100ms", "--poll-interval", "50ms"];
    let child = spawn_run(&db.url, &args);
    let ok = publish(&db, "order.ok", json!({"n": 1})).await;
    let flaky = publish(&db, "order.flaky", json!({"n": 2})).await;
    let bad = publish(&db, "order.bad", json!({"n": 3})).await;
    // Settled: every row passed by the destination, none waiting for it any more (the flaky one
    // delivered at last), the bad one dead-lettered.
    eventually("all three events settled", || async {
        let stats = db.outbox.queue_stats().await.unwrap();
        stats.retained == 3
            && stats.dead_letters == 1
            && (stats.pending, stats.held_by_key, stats.delayed, stats.in_flight) == (0, 0, 0, 0)
    })
    .await;
    assert_eq!(terminate(child).await, Some(0));

    let requests = receiver.requests.lock().unwrap().clone();
    let for_id = |id: i64| -> Vec<&Request> {
        requests.iter().filter(|(h, _)| h.get("outbox-event-id") == Some(&id.to_string())).collect()
    };
    let ok_requests = for_id(ok);
    assert_eq!(ok_requests.len(), 1);
    assert_eq!(ok_requests[0].0["outbox-topic"], "order.ok");
    assert_eq!(ok_requests[0].0["content-type"], "application/json");
    assert_eq!(ok_requests[0].1["id"], json!(ok));
    assert_eq!(ok_requests[0].1["payload"], json!({"n": 1}));
    let flaky_attempts: Vec<&str> = for_id(flaky).iter().map(|(h, _)| h["outbox-attempt"].as_str()).collect();
    assert_eq!(flaky_attempts, vec!["1", "2", "3"], "500 twice, then delivered");
    assert_eq!(for_id(bad).len(), 1, "a 400 is not retried");
    let dead = db.outbox.dead_letters(10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].id, bad);
    assert!(dead[0].last_error.contains("400"), "{}", dead[0].last_error);
}

/// `events` rows in the outbox, every one passed by the destination (retained), and
/// nothing waiting for it any more (no copy parked for a retry, a delay or a lease): each
/// delivered or dead-lettered.
pub async fn settled(db: &TestDb, events: i64) -> bool {
    let stats = db.outbox.queue_stats().await.unwrap();
    stats.retained == events && (stats.pending, stats.held_by_key, stats.delayed, stats.in_flight) == (0, 0, 0, 0)
}

/// The test kit's NATS server (`NATS_URL`, or a private `nats-server -js`).
pub fn nats_url() -> String {
    crate::nats::url()
}

/// A JetStream context on the test kit's NATS server.
pub async fn nats() -> async_nats::jetstream::Context {
    let url = nats_url();
    let client = async_nats::connect(&url).await.unwrap_or_else(|e| panic!("cannot connect to NATS at {url}: {e}"));
    async_nats::jetstream::new(client)
}

pub fn unique(prefix: &str) -> String {
    format!("{prefix}{}_{}", std::process::id(), rand::random::<u32>())
}

/// A JetStream stream named `prefix` that captures every subject under it.
pub async fn stream_for(js: &async_nats::jetstream::Context, prefix: &str) -> async_nats::jetstream::stream::Stream {
    let config = async_nats::jetstream::stream::Config {
        name: prefix.to_string(),
        subjects: vec![format!("{prefix}.>")],
        ..Default::default()
    };
    js.create_stream(config).await.unwrap()
}

#[tokio::test]
async fn status_json_matches_the_table() {
    let db = TestDb::new().await;
    let client = db.client().await;
    OutboxRow::new("done").insert(&client).await;
    pass_everything(&client, Duration::ZERO).await;
    OutboxRow::new("ready").created_ago(Duration::from_secs(5)).insert(&client).await;
    OutboxRow::new("ready").insert(&client).await;
    OutboxRow::new("later").available_in(Duration::from_secs(3600)).insert(&client).await;
    client
        .batch_execute(
            "insert into outbox_relay.parked (destination, id, uuid, topic, payload, created_at, available_at,
                                              lease_token, attempts)
                 values ('default', 900, gen_random_uuid(), 'leased', '{}', now(), now() + interval '30 seconds', 7, 3);
             insert into outbox_relay.dead_letters (destination, id, topic, payload, created_at, attempts, last_error)
                 values ('default', 1000, 'dead', '{}', now(), 12, 'gave up');",
        )
        .await
        .unwrap();
    let output = cli(&db.url, &["status", "--json"]).await;
    assert!(output.status.success(), "{}", stderr(&output));
    let status: Value = serde_json::from_str(stdout(&output).trim()).unwrap();
    assert_eq!(status["pending"], json!(2));
    assert_eq!(status["delayed"], json!(1));
    assert_eq!(status["in_flight"], json!(1));
    assert_eq!(status["retained"], json!(1));
    assert_eq!(status["dead_letters"], json!(1));
    assert!(status["oldest_pending_age_ms"].as_i64().unwrap() >= 5000, "{status}");
    assert_eq!(status["max_attempts"], json!(3));
    assert_eq!(status["unrouted"], json!(0));
    // No relay registered a destination yet: the leased row's `default` shows as not registered.
    let destinations = status["destinations"].as_array().unwrap();
    assert_eq!(destinations.len(), 1, "{status}");
    let d = &destinations[0];
    assert_eq!(
        (&d["name"], &d["registered"], &d["in_flight"], &d["relays"]),
        (&json!("default"), &json!(false), &json!(1), &json!(0))
    );
    assert!(
        status["warnings"]
            .as_array()
            .unwrap()
            .iter()
            .any(|w| w.as_str().unwrap().contains("which no relay registered")),
        "{status}"
    );
    assert!(status["notification_queue_usage"].as_f64().unwrap() < 0.01);

    let table = cli(&db.url, &["status"]).await;
    assert!(stdout(&table).contains("dead letters              1"), "{}", stdout(&table));
    assert!(
        stdout(&table).lines().any(|l| l.starts_with("default ") && l.contains("(not registered)")),
        "{}",
        stdout(&table)
    );
}

#[tokio::test]
async fn dead_letters_list_retry_and_purge() {
    let db = TestDb::new().await;
    db.client()
        .await
        .batch_execute(
            "insert into outbox_relay.dead_letters (destination, id, topic, payload, created_at, attempts, last_error, failed_at) values
                 ('default', 1001, 'a', '{\"n\": 1}', now(), 12, 'gave up after 12 attempts: 503', now()),
                 ('default', 1002, 'b', '{}', now(), 1, '400: bad', now() - interval '3 days'),
                 ('default', 1003, 'c', '{}', now(), 1, '400: bad', now());",
        )
        .await
        .unwrap();
    let list = cli(&db.url, &["dead-letters", "list", "--json"]).await;
    assert!(list.status.success(), "{}", stderr(&list));
    let letters: Vec<Value> = serde_json::from_str(stdout(&list).trim()).unwrap();
    assert_eq!(letters.iter().map(|l| l["id"].as_i64().unwrap()).collect::<Vec<_>>(), vec![1001, 1002, 1003]);
    assert_eq!(letters[0]["last_error"], json!("gave up after 12 attempts: 503"));
    assert_eq!(letters[0]["destination"], json!("default"));
    let table = cli(&db.url, &["dead-letters", "list"]).await;
    assert!(stdout(&table).contains("1001"));
    let header = stdout(&table).lines().next().unwrap_or_default().to_string();
    assert!(header.split_whitespace().take(2).eq(["id", "destination"]), "{header}");
    let row_1001 = stdout(&table).lines().find(|l| l.trim_start().starts_with("1001")).unwrap_or_default().to_string();
    assert!(row_1001.split_whitespace().take(2).eq(["1001", "default"]), "{row_1001}");

    let retry = cli(&db.url, &["dead-letters", "retry", "1001"]).await;
    assert!(retry.status.success(), "{}", stderr(&retry));
    assert!(stdout(&retry).contains("retried 1 dead letters: 1001"), "{}", stdout(&retry));
    // Back with its destination, to be delivered again: a copy parked for it, attempts reset.
    let client = db.client().await;
    let row = client
        .query_one(
            "select topic, attempts, payload, available_at <= now() from outbox_relay.parked
              where destination = 'default' and id = 1001",
            &[],
        )
        .await
        .unwrap();
    assert_eq!((row.get::<_, String>(0), row.get::<_, i32>(1)), ("a".to_string(), 0));
    assert_eq!(row.get::<_, Value>(2), json!({"n": 1}));
    assert!(row.get::<_, bool>(3), "deliverable at once");
    let left = "select count(*) from outbox_relay.dead_letters where id = 1001";
    assert_eq!(client.query_one(left, &[]).await.unwrap().get::<_, i64>(0), 0, "no longer a dead letter");

    let missing = cli(&db.url, &["dead-letters", "retry", "4242"]).await;
    assert!(!missing.status.success());
    assert!(stderr(&missing).contains("no dead letter with id 4242: nothing was retried"), "{}", stderr(&missing));

    let purge = cli(&db.url, &["dead-letters", "purge", "--older-than", "1d"]).await;
    assert!(stdout(&purge).contains("purged 1 dead letters"), "{}", stdout(&purge));
    let all = cli(&db.url, &["dead-letters", "retry", "--all"]).await;
    assert!(stdout(&all).contains("retried 1 dead letters: 1003"), "{}", stdout(&all));
}

/// The dead letters of a destination, a topic, a time range or an error, listed by page, counted
/// by a dry run, retried or purged; and the filters' mistakes refused as bad arguments.
#[tokio::test]
async fn dead_letter_filters_list_count_retry_and_purge_what_they_say() {
    let db = TestDb::new().await;
    db.client()
        .await
        .batch_execute(
            "insert into outbox_relay.dead_letters (destination, id, topic, payload, created_at, attempts, last_error, failed_at) values
                 ('erp',    2001, 'order.placed',    '{}', now(), 9, 'HTTP 503 Service Unavailable', now() - interval '3 days'),
                 ('erp',    2002, 'order.cancelled', '{}', now(), 9, 'timed out after 10s', now() - interval '1 hour'),
                 ('mailer', 2002, 'order.cancelled', '{}', now(), 9, 'Timed Out', now()),
                 ('mailer', 2003, 'mail.sent',       '{}', now(), 1, 'HTTP 410 Gone', now()),
                 ('mailer', 2004, 'order.placed',    '{}', now(), 1, 'HTTP 410 Gone', now()),
                 ('',       2005, 'misc.thing',      '{}', now(), 0, 'no destination''s pattern matches its topic', now());",
        )
        .await
        .unwrap();
    let listed = |args: &'static [&'static str]| {
        let url = db.url.clone();
        async move {
            let mut argv = vec!["dead-letters", "list", "--json"];
            argv.extend(args);
            let list = cli(&url, &argv).await;
            assert!(list.status.success(), "{args:?}: {}", stderr(&list));
            let letters: Vec<Value> = serde_json::from_str(stdout(&list).trim()).unwrap();
            letters
                .iter()
                .map(|l| format!("{}@{}", l["id"], l["destination"].as_str().unwrap()))
                .collect::<Vec<_>>()
                .join(" ")
        }
    };
    assert_eq!(listed(&["--destination", "mailer"]).await, "2002@mailer 2003@mailer 2004@mailer");
    assert_eq!(listed(&["--destination", ""]).await, "2005@", "'' is the events no destination's pattern matched");
    assert_eq!(listed(&["--topic", "order.*", "--error", "TIMED out"]).await, "2002@erp 2002@mailer");
    assert_eq!(listed(&["--since", "2h", "--until", "30m"]).await, "2002@erp");
    assert_eq!(listed(&["--destination", "nobody"]).await, "");
    // Pages of events: every destination's dead letter of an event on one page.
    assert_eq!(listed(&["--limit", "2"]).await, "2001@erp 2002@erp 2002@mailer");
    assert_eq!(listed(&["--limit", "2", "--after", "2002"]).await, "2003@mailer 2004@mailer");
    assert_eq!(listed(&["--limit", "2", "--after", "2004"]).await, "2005@");
    let table = cli(&db.url, &["dead-letters", "list", "--limit", "2"]).await;
    assert!(
        stdout(&table).trim_end().ends_with("(2 events' dead letters shown; more may follow: --after 2002)"),
        "{}",
        stdout(&table)
    );
    let filtered_out = cli(&db.url, &["dead-letters", "list", "--error", "no such error"]).await;
    assert_eq!(stdout(&filtered_out).trim(), "no dead letters that match");

    let letters = "select count(*) from outbox_relay.dead_letters";
    let dry = cli(&db.url, &["dead-letters", "retry", "--destination", "mailer", "--error", "410", "--dry-run"]).await;
    assert!(stdout(&dry).contains("would retry 2 dead letters (dry run: nothing changed)"), "{}", stdout(&dry));
    assert_eq!(count(&db.client().await, letters).await, 6);
    let retry = cli(&db.url, &["dead-letters", "retry", "--destination", "mailer", "--error", "410"]).await;
    assert!(stdout(&retry).contains("retried 2 dead letters: 2003, 2004"), "{} {}", stdout(&retry), stderr(&retry));
    let parked = "select count(*) from outbox_relay.parked where destination = 'mailer' and id in (2003, 2004)";
    assert_eq!(count(&db.client().await, parked).await, 2);
    assert_eq!(count(&db.client().await, letters).await, 4);

    let dry = cli(&db.url, &["dead-letters", "purge", "--topic", "order.#", "--older-than", "1d", "--dry-run"]).await;
    assert!(stdout(&dry).contains("would purge 1 dead letters (dry run: nothing deleted)"), "{}", stdout(&dry));
    // A dry run counts what the retry then takes: an event dead at two destinations is two.
    let dry = cli(&db.url, &["dead-letters", "retry", "--topic", "order.cancelled", "--dry-run"]).await;
    assert!(stdout(&dry).contains("would retry 2 dead letters"), "{}", stdout(&dry));
    let retry = cli(&db.url, &["dead-letters", "retry", "--topic", "order.cancelled"]).await;
    assert!(stdout(&retry).contains("retried 2 dead letters: 2002"), "{} {}", stdout(&retry), stderr(&retry));
    let purge = cli(&db.url, &["dead-letters", "purge", "--error", "http 503"]).await;
    assert!(stdout(&purge).contains("purged 1 dead letters"), "{}", stdout(&purge));
    assert_eq!(listed(&[]).await, "2005@");

    // Mistakes exit with 2 and say what is wrong; nothing changes.
    for (args, says) in [
        (&["retry", "--all", "--destination", "erp"][..], "cannot be used with"),
        (&["retry", "2001", "--dry-run"][..], "cannot be used with"),
        (&["retry"][..], "--all"),
        (&["purge", "--since", "1h", "--until", "2h"][..], "must be before"),
        (&["list", "--error", ""][..], "--error"),
        (&["purge", "--topic", "order..placed"][..], "order..placed"),
    ] {
        let mut argv = vec!["dead-letters"];
        argv.extend(args);
        let refused = cli(&db.url, &argv).await;
        assert_eq!(refused.status.code(), Some(2), "{args:?}: {}", stderr(&refused));
        assert!(stderr(&refused).contains(says), "{args:?}: {}", stderr(&refused));
    }
    assert_eq!(listed(&[]).await, "2005@");
}

#[tokio::test]
async fn cleanup_prints_what_it_removed() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let three_days = Duration::from_secs(3 * 86400);
    OutboxRow::new("old").created_ago(three_days).insert_many(&client, 4).await;
    pass_everything(&client, three_days).await;
    OutboxRow::new("new").insert(&client).await;
    client
        .batch_execute(
            "insert into outbox_relay.idempotency (key, fingerprint, created_at) values ('k', '\\x00', now() - interval '3 days');",
        )
        .await
        .unwrap();
    let output = cli(&db.url, &["cleanup", "--retention", "2d", "--idempotency-retention", "2d"]).await;
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(stdout(&output).contains("removed 4 events every destination passed"), "{}", stdout(&output));
    assert_eq!(
        crate::relay_support::count(&client, "select count(*) from outbox_relay.outbox").await,
        1,
        "the event not passed stays"
    );
    assert!(stdout(&output).contains("1 idempotency receipts"), "{}", stdout(&output));
}

#[tokio::test]
async fn migrate_reports_and_a_second_run_applies_nothing() {
    let db = TestDb::empty().await;
    // With the default log level: each migration is said once, on stdout, not in the log too.
    let first =
        Command::new(BIN).arg("migrate").env("DATABASE_URL", &db.url).env_remove("RUST_LOG").output().await.unwrap();
    assert!(first.status.success(), "{}", stderr(&first));
    assert!(stdout(&first).contains("applied 0001_create_outbox_tables"), "{}", stdout(&first));
    assert!(!stderr(&first).contains("applying migration"), "once, on stdout: {}", stderr(&first));
    let second = cli(&db.url, &["migrate"]).await;
    assert!(stdout(&second).contains("nothing to apply"), "{}", stdout(&second));
}

/// Bad input: one line on stderr, a non-zero exit, nothing started.
#[tokio::test]
async fn bad_input_gives_a_one_line_error_and_a_non_zero_exit() {
    let db = TestDb::new().await;
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["run", "--sink", "ftp://x"], "unknown sink \"ftp://x"),
        (vec!["run", "--sink", "stdout", "--poll-interval", "soon"], "--poll-interval"),
        (vec!["run", "--sink", "stdout", "--lease", "10"], "expected a number with a unit"),
        (vec!["run", "--sink", "stdout", "--workers", "0"], "--workers"),
        (vec!["run", "--sink", "stdout", "--backoff-base", "1h", "--backoff-max", "1s"], "--backoff-max"),
        (
            vec!["run", "--sink", "nats://127.0.0.1:1", "--timeout", "500ms", "--exit-on-sink-error"],
            "cannot connect to NATS at nats://127.0.0.1:1",
        ),
        (
            vec!["run", "--sink", "NATS://127.0.0.1:1", "--timeout", "500ms", "--exit-on-sink-error"],
            "cannot connect to NATS at nats://127.0.0.1:1",
        ),
        (vec!["status", "--json", "--bogus"], "--bogus"),
        (
            vec!["status", "--database-url", "mysql://root:hunter2@127.0.0.1:3306/shop"],
            "mysql:// is not PostgreSQL's; only postgres:// and postgresql:// URLs",
        ),
    ];
    for (args, needle) in cases {
        let output = cli(&db.url, &args).await;
        let err = stderr(&output);
        assert!(!output.status.success(), "{args:?} succeeded");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: one line expected, got {err}");
        assert!(err.contains(needle), "{args:?}: {err} should mention {needle}");
    }
    let unreachable = cli("postgres://app:hunter2@127.0.0.1:1/x", &["status"]).await;
    let err = stderr(&unreachable);
    assert!(!unreachable.status.success());
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("127.0.0.1:1") && !err.contains("hunter2"), "{err}");
    let mut no_db = Command::new(BIN);
    no_db.arg("status");
    for name in ["DATABASE_URL", "PGHOST", "PGPORT", "PGDATABASE", "PGUSER"] {
        no_db.env_remove(name);
    }
    let no_db = no_db.output().await.unwrap();
    assert!(String::from_utf8_lossy(&no_db.stderr).contains("no database given"));
    assert_eq!(no_db.status.code(), Some(2), "a missing database URL is a bad argument");
    // A value the command refuses is a bad argument too (exit 2), with or without a database.
    let empty_topic = cli(&db.url, &["pause", "--topic", ""]).await;
    assert_eq!(empty_topic.status.code(), Some(2), "{}", stderr(&empty_topic));
    assert!(stderr(&empty_topic).contains("--topic must not be empty"), "{}", stderr(&empty_topic));
    let no_db = Command::new(BIN).args(["pause", "--topic", ""]).env_remove("DATABASE_URL").output().await.unwrap();
    assert_eq!(no_db.status.code(), Some(2));
}

#[tokio::test]
async fn demo_runs_the_article_scenario_and_every_check_passes() {
    // On the test server: the demo makes (and drops) a database of its own there.
    let server = crate::harness::server().url_for("postgres").to_connection_string();
    let output = cli(&server, &["demo", "--orders", "12"]).await;
    let out = stdout(&output);
    assert!(output.status.success(), "{out}\n{}", stderr(&output));
    assert!(out.contains("all 8 checks passed"), "{out}");
    assert!(!out.contains("FAIL"), "{out}");
    assert!(out.contains("commit-to-delivery latency"), "{out}");
}

/// How long a short benchmark run may take beside the other tests (its receivers stage waits out
/// SYN retransmits on purpose: fixed 64 at a listen backlog of five).
const BENCH_PATIENCE: std::time::Duration = std::time::Duration::from_secs(300);

/// The held-snapshot stage's figures: both phases published and delivered, with latencies.
fn assert_held_figures(report: &Value) {
    for phase in ["held_clear", "held_held"] {
        for field in ["published_per_s", "delivered_per_s", "machine_cpu_share", "relay_and_backends_cpu_share"] {
            assert!(report[phase][field].as_f64().is_some_and(|v| v > 0.0), "{phase}.{field}: {report}");
        }
        assert!(report[phase]["latency_ms"]["p99"].as_f64().is_some_and(|v| v > 0.0), "{phase}: {report}");
        assert!(report[phase]["backlog_max"].as_u64().is_some(), "{phase}: {report}");
    }
    assert!(report["held_p99_ratio"].as_f64().is_some_and(|v| v > 0.0), "{report}");
    assert_eq!(report["held_duplicates"], 0, "{report}");
}

/// The receivers stage's figures: every receiver drained with the defaults, nothing redelivered
/// to the receivers that never fail, the comparison with the best fixed limit made.
fn assert_receiver_figures(report: &Value) {
    let rows = report["receivers"].as_array().unwrap_or_else(|| panic!("no receivers: {report}"));
    for receiver in ["small", "answers in 20ms", "429 past 200/s", "opens 2s late"] {
        let defaults = rows
            .iter()
            .find(|r| r["receiver"].as_str().is_some_and(|n| n.starts_with(receiver)) && r["settings"] == "defaults")
            .unwrap_or_else(|| panic!("no defaults row for {receiver}: {report}"));
        assert!(defaults["events_per_s"].as_f64().is_some_and(|v| v > 0.0), "{defaults}");
        assert!(defaults["limit_at_end"].as_u64().is_some_and(|v| v >= 1), "{defaults}");
    }
    for row in rows.iter().filter(|r| r["settings"] == "defaults") {
        assert_eq!(row["redelivered"], 0, "{row}");
    }
    assert!(report["receivers_small_defaults_over_best_fixed"].as_f64().is_some_and(|v| v > 0.0), "{report}");
    assert!(report["receivers_late_after_opening_s"].as_f64().is_some(), "{report}");
}

/// `--receivers-only` runs that stage alone and prints its table; too few events are refused.
#[tokio::test]
async fn bench_receivers_only_measures_the_receivers() {
    let server = crate::harness::server().url_for("postgres").to_connection_string();
    let args = ["bench", "--json", "--receivers-only", "--receiver-events", "50"];
    let output = cli_within(&server, &args, BENCH_PATIENCE).await;
    let out = stdout(&output);
    assert!(output.status.success(), "{out}\n{}", stderr(&output));
    assert_receiver_figures(&serde_json::from_str(out.trim()).unwrap());

    let output = cli(&server, &["bench", "--receivers-only", "--receiver-events", "5"]).await;
    assert!(!output.status.success());
    assert!(stderr(&output).contains("--receiver-events is 5; it must be 10 to 1000000"), "{}", stderr(&output));
}

/// `--latency-only` runs the floor and the three wake-up paths in alternating rounds: the
/// floor's client reads the trigger's notifications as they are (signed: migration 0018).
#[tokio::test]
async fn bench_latency_only_measures_each_path_against_the_floor() {
    let server = crate::harness::server().url_for("postgres").to_connection_string();
    let args = ["bench", "--json", "--latency-only", "--samples", "5"];
    let output = cli_within(&server, &args, BENCH_PATIENCE).await;
    let out = stdout(&output);
    assert!(output.status.success(), "{out}\n{}", stderr(&output));
    let report: Value = serde_json::from_str(out.trim()).unwrap();
    let paths = report["latency"].as_array().unwrap();
    let names: Vec<&str> = paths.iter().map(|p| p["path"].as_str().unwrap()).collect();
    assert_eq!(names.len(), 4, "{names:?}");
    assert!(names[0].starts_with("floor"), "{names:?}");
    for path in paths {
        assert_eq!(path["p50_ms_rounds"].as_array().unwrap().len(), 3, "{path}");
        assert!(path["p50_ms"].as_f64().unwrap() > 0.0, "{path}");
        assert!(path["p99_above_floor_ms"].is_number(), "{path}");
    }
}

/// `--write-path-only` runs the article's transaction three ways at 1, 4 and 16 writers, with the
/// CPU each way spent per commit.
#[tokio::test]
async fn bench_write_path_only_compares_the_three_ways_with_their_cpu() {
    let server = crate::harness::server().url_for("postgres").to_connection_string();
    let args = ["bench", "--json", "--write-path-only", "--write-duration", "200ms"];
    let output = cli_within(&server, &args, BENCH_PATIENCE).await;
    let out = stdout(&output);
    assert!(output.status.success(), "{out}\n{}", stderr(&output));
    let report: Value = serde_json::from_str(out.trim()).unwrap();
    let rows = report["article_transaction"].as_array().unwrap();
    let writers: Vec<u64> = rows.iter().map(|r| r["writers"].as_u64().unwrap()).collect();
    assert_eq!(writers, [1, 4, 16], "{report}");
    for row in rows {
        for way in ["plain_tables", "sql_functions", "rust_unit_of_work"] {
            assert!(row[format!("{way}_tps")].as_f64().unwrap() > 0.0, "{row}");
            let cpu = &row["cpu_per_commit"][way];
            // Linux's /proc: PostgreSQL's backends and this process both worked for each commit.
            assert!(cpu["postgres_us"].as_f64().unwrap() > 0.0, "{row}");
            assert!(cpu["client_us"].as_f64().unwrap() > 0.0, "{row}");
            assert!(cpu["machine_us"].as_f64().unwrap() >= cpu["client_us"].as_f64().unwrap(), "{row}");
        }
    }
}

/// `--held-only` runs that stage alone and prints its figures, with a `--relay-arg` passed to its
/// relay; a rate out of range is refused before anything runs.
#[tokio::test]
async fn bench_held_only_measures_the_held_snapshot_stage() {
    let server = crate::harness::server().url_for("postgres").to_connection_string();
    let args =
        ["bench", "--json", "--held-only", "--held-duration", "1s", "--held-rate", "200", "--relay-arg=--no-fast-path"];
    let output = cli(&server, &args).await;
    let out = stdout(&output);
    assert!(output.status.success(), "{out}\n{}", stderr(&output));
    let report: Value = serde_json::from_str(out.trim()).unwrap();
    assert_held_figures(&report);
    assert!(report.get("drain_events_per_s").is_none(), "only the held stage ran: {report}");
    assert_eq!(report["held_relay_args"], serde_json::json!(["--no-fast-path"]));

    let output = cli(&server, &["bench", "--held-only", "--held-rate", "0"]).await;
    assert!(!output.status.success());
    assert!(stderr(&output).contains("--held-rate is 0; it must be 1 to 10000 events/s"), "{}", stderr(&output));
}

/// The NATS sink, and the benchmark that drains to NATS: the test kit starts nats-server (or
/// uses `NATS_URL`).
mod needs_nats {
    use super::*;

    #[tokio::test]
    async fn run_nats_publishes_to_jetstream_once_per_event_id() {
        let db = TestDb::new().await;
        let js = nats().await;
        let prefix = unique("outboxtest");
        let mut stream = stream_for(&js, &prefix).await;

        let child = spawn_run(&db.url, &["--sink", &nats_url(), "--subject-prefix", &prefix]);
        let first = publish(&db, "order.placed", json!({"n": 1})).await;
        publish(&db, "order.shipped", json!({"n": 2})).await;
        eventually("both published", || async { settled(&db, 2).await }).await;
        assert_eq!(db.outbox.queue_stats().await.unwrap().dead_letters, 0, "both delivered");
        assert_eq!(terminate(child).await, Some(0));
        assert_eq!(stream.info().await.unwrap().state.messages, 2);
        let message = stream.get_last_raw_message_by_subject(&format!("{prefix}.order.placed")).await.unwrap();
        let body: Value = serde_json::from_slice(&message.payload).unwrap();
        assert_eq!(body["id"], json!(first));
        let headers = &message.headers;
        assert_eq!(headers.get("Nats-Msg-Id").map(|v| v.as_str()), body["uuid"].as_str(), "Nats-Msg-Id is the uuid");
        assert_eq!(headers.get("Outbox-Event-Id").map(|v| v.as_str()), Some(first.to_string().as_str()));

        // A redelivery of the same event (a relay that died before recording the outcome: its
        // lease, a copy parked for the destination, ended) is dropped by the stream: Nats-Msg-Id is
        // the event's uuid.
        let leased = db
            .client()
            .await
            .execute(
                "insert into outbox_relay.parked (destination, id, uuid, topic, key, payload, created_at, available_at,
                                              attempts, lease_token)
             select 'default', id, uuid, topic, key, payload, created_at, now(), 1, 7
               from outbox_relay.outbox where id = $1",
                &[&first],
            )
            .await
            .unwrap();
        assert_eq!(leased, 1);
        let child = spawn_run(&db.url, &["--sink", &nats_url(), "--subject-prefix", &prefix]);
        eventually("redelivered", || async { settled(&db, 2).await }).await;
        assert_eq!(db.outbox.queue_stats().await.unwrap().dead_letters, 0, "redelivered, not dead-lettered");
        assert_eq!(terminate(child).await, Some(0));
        assert_eq!(stream.info().await.unwrap().state.messages, 2, "the duplicate was dropped");
        js.delete_stream(&prefix).await.unwrap();
    }

    /// A batch of more events than the NATS client lets await their acknowledgements at once
    /// (5,000) is delivered: published whole before its acknowledgements, it used to wait for
    /// itself for ever (nothing delivered, and the relay cut off at its shutdown grace).
    #[tokio::test]
    async fn run_nats_delivers_a_batch_of_more_events_than_the_client_lets_await_acknowledgements() {
        let db = TestDb::new().await;
        let js = nats().await;
        let prefix = unique("outboxwide");
        let mut stream = stream_for(&js, &prefix).await;
        db.client()
            .await
            .execute(
                "insert into outbox_relay.outbox (topic, payload)
                 select 'order.placed', jsonb_build_object('n', g) from generate_series(1, 12000) g",
                &[],
            )
            .await
            .unwrap();
        let child = spawn_run(&db.url, &["--sink", &nats_url(), "--subject-prefix", &prefix, "--batch-size", "6000"]);
        eventually_within("12,000 events delivered in batches of 6,000", Duration::from_secs(60), || async {
            settled(&db, 12_000).await
        })
        .await;
        assert_eq!(terminate(child).await, Some(0), "the relay stopped within its grace");
        assert_eq!(db.outbox.queue_stats().await.unwrap().dead_letters, 0);
        assert_eq!(stream.info().await.unwrap().state.messages, 12_000);
        js.delete_stream(&prefix).await.unwrap();
    }

    /// Batches one NATS sink has in hand at once, each within the client's bound on
    /// acknowledgements awaited (5,000) but past it together (eight of 1,500, on tasks of a
    /// runtime with threads of its own, so that their publishes interleave), are all delivered:
    /// each window takes its share of the bound before its first publish (a destination's parked
    /// and new events are delivered by several workers at once).
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn nats_batches_in_hand_at_once_past_the_clients_bound_together_are_all_delivered() {
        use pg_outbox_relay::{Event, Handler, Payload, Slots, Uuid};
        const BATCHES: u16 = 8;
        const EACH: u16 = 1500;
        let js = nats().await;
        let prefix = unique("outboxshared");
        let mut stream = stream_for(&js, &prefix).await;
        let sink =
            pg_outbox_relay::sink::NatsSink::builder(&nats_url()).subject_prefix(&prefix).connect().await.unwrap();
        let event = |id: u16| Event {
            id: i64::from(id),
            uuid: Uuid::from_u128(0x5eed_0000_0000_4000_8000_0000_0000_0000 + u128::from(id)),
            topic: "order.placed".to_owned(),
            key: None,
            payload: Payload::from_json(format!("{{\"n\": {id}}}")).unwrap(),
            created_at: std::time::SystemTime::now(),
            attempts: 1,
            headers: Default::default(),
        };
        let slots = Slots::new(64);
        let start = Arc::new(tokio::sync::Barrier::new(usize::from(BATCHES)));
        let tasks: Vec<_> = (0..BATCHES)
            .map(|b| {
                let batch: Vec<Event> = (0..EACH).map(|i| event(b * EACH + i)).collect();
                let (sink, slots, start) = (sink.clone(), slots.clone(), start.clone());
                tokio::spawn(async move {
                    start.wait().await;
                    let results = sink.handle_batch(&batch, &slots).await;
                    (batch.len(), results)
                })
            })
            .collect();
        let done = tokio::time::timeout(Duration::from_secs(60), futures::future::join_all(tasks))
            .await
            .expect("eight batches of 1,500 delivered within 60 s");
        for task in done {
            let (events, results) = task.unwrap();
            assert_eq!(results.len(), events);
            assert!(results.iter().all(Result::is_ok), "{:?}", results.iter().find(|r| r.is_err()));
        }
        assert_eq!(stream.info().await.unwrap().state.messages, u64::from(BATCHES) * u64::from(EACH));
        js.delete_stream(&prefix).await.unwrap();
    }

    #[tokio::test]
    async fn run_nats_without_a_stream_keeps_the_event_pending_with_a_clear_error() {
        let db = TestDb::new().await;
        nats().await;
        let prefix = unique("nostream");
        let child = spawn_run(&db.url, &["--sink", &nats_url(), "--subject-prefix", &prefix, "--timeout", "2s"]);
        let id = publish(&db, "order.placed", json!({})).await;
        let client = db.client().await;
        // (a failed delivery waits for its retry as a copy parked for the destination)
        let waiting = "select last_error from outbox_relay.parked where destination = 'default' and id = $1";
        eventually("the failure recorded", || async {
            client
                .query_opt(waiting, &[&id])
                .await
                .unwrap()
                .is_some_and(|row| row.get::<_, Option<String>>(0).is_some())
        })
        .await;
        assert_eq!(terminate(child).await, Some(0));
        let row = client.query_opt(waiting, &[&id]).await.unwrap().expect("the event still waits for the destination");
        let error: String = row.get(0);
        assert!(error.contains("no JetStream stream captures subject"), "{error}");
        assert_eq!(db.outbox.queue_stats().await.unwrap().dead_letters, 0, "pending, not dead-lettered");
    }

    /// The largest payload the API accepts fits, envelope and headers included, in NATS' default
    /// max_payload (1 MiB); a topic from before migration 0003 with an empty word is refused for
    /// good, not retried for an hour.
    #[tokio::test]
    async fn run_nats_takes_the_largest_payload_and_refuses_a_subject_with_an_empty_word() {
        let db = TestDb::new().await;
        let js = nats().await;
        let prefix = unique("outboxbig");
        let mut stream = stream_for(&js, &prefix).await;
        let largest = json!("x".repeat(pg_outbox_relay::Payload::MAX_BYTES - 2));
        let big = db
            .outbox
            .publish(&pg_outbox_relay::NewEvent::new("order.placed", largest).key("k".repeat(255)))
            .await
            .unwrap();
        let client = db.client().await;
        client
            .batch_execute(
                "alter table outbox_relay.outbox drop constraint outbox_topic_valid;
             insert into outbox_relay.outbox (topic, payload) values ('order..placed', '{}');",
            )
            .await
            .unwrap();
        let child = spawn_run(&db.url, &["--sink", &nats_url(), "--subject-prefix", &prefix]);
        eventually("both settled", || async {
            let stats = db.outbox.queue_stats().await.unwrap();
            settled(&db, 2).await && stats.dead_letters == 1
        })
        .await;
        assert_eq!(terminate(child).await, Some(0));
        // Delivered: passed, nothing waiting for the destination, not dead-lettered.
        let delivered: Vec<i64> = client
            .query(
                "select id from outbox_relay.outbox o
              where outbox_relay.passed_by_all(xid, id)
                and not exists (select 1 from outbox_relay.dead_letters d where d.id = o.id)",
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        assert_eq!(delivered, [big]);
        assert_eq!(stream.info().await.unwrap().state.messages, 1, "the largest payload is in the stream");
        let dead = db.outbox.dead_letters(10).await.unwrap();
        assert_eq!(dead.len(), 1);
        assert_ne!(dead[0].id, big);
        assert!(dead[0].last_error.contains("cannot be a NATS subject"), "{}", dead[0].last_error);
        assert_eq!(dead[0].attempts, 1, "a permanent failure, not retried");
        js.delete_stream(&prefix).await.unwrap();
    }

    #[tokio::test]
    async fn bench_json_prints_one_object_with_every_figure() {
        // A short run on the test server (the bench makes and drops databases of its own there).
        let server = crate::harness::server().url_for("postgres").to_connection_string();
        let nats = nats_url();
        let args = [
            "bench",
            "--nats-url",
            &nats,
            "--json",
            "--events",
            "1000",
            "--samples",
            "8",
            "--write-duration",
            "300ms",
            "--trickle-duration",
            "1s",
            "--held-duration",
            "1s",
            "--held-rate",
            "200",
            "--receiver-events",
            "50",
        ];
        let output = cli_within(&server, &args, BENCH_PATIENCE).await;
        let out = stdout(&output);
        assert!(output.status.success(), "{out}\n{}", stderr(&output));
        assert_eq!(out.trim().lines().count(), 1, "exactly one JSON object on stdout: {out}");
        let report: Value = serde_json::from_str(out.trim()).unwrap();
        for path in ["latency_notify_ms", "latency_inprocess_ms", "latency_poll_ms", "trickle_latency_ms"] {
            for p in ["p50", "p90", "p99", "max"] {
                let v = report[path][p].as_f64().unwrap_or_else(|| panic!("{path}.{p} missing: {report}"));
                assert!(v > 0.0, "{path}.{p} = {v}");
            }
        }
        for field in [
            "drain_events_per_s",
            "claim_delete_loop_rows_per_s",
            "drain_share_of_claim_delete_loop",
            "claim_delete_loop_alike_rows_per_s",
            "drain_share_of_claim_delete_loop_alike",
            "drain_retention_0_events_per_s",
            "drain_keyed_events_per_s",
            "stdout_events_per_s",
            "nats_events_per_s",
            "nats_share_of_stdout",
            "nats_publisher_messages_per_s",
            "nats_share_of_publisher",
            "nats_publisher_two_windows_messages_per_s",
            "nats_publisher_windows_in_flight",
            "trickle_cpu_share",
            "write_tps_trigger",
            "write_tps_no_trigger",
            "write_tps_notify_every_commit",
            "write_trigger_share_of_no_trigger",
        ] {
            assert!(report[field].as_f64().is_some_and(|v| v > 0.0), "{field}: {report}");
        }
        assert_eq!(report["claim_delete_loop_clients"], 4);
        assert_eq!(report["claim_delete_loop_batch"], 100);
        assert_held_figures(&report);
        assert_receiver_figures(&report);
        assert!(stderr(&output).contains("[1/13]"), "progress goes to stderr");
    }
}

/// libpq's environment fills what the URL leaves out, for every command (the URL first): here
/// the database from `PGDATABASE` and the application name from `PGAPPNAME`.
#[tokio::test]
async fn libpqs_environment_fills_what_the_url_leaves_out() {
    let db = TestDb::new().await;
    let (server, database) = db.url.rsplit_once('/').expect("a URL with a database");
    assert_eq!(database, db.name, "{}", db.url);
    let output = Command::new(BIN)
        .args(["status", "--json", "--database-url", server])
        .env_remove("DATABASE_URL")
        .env("PGDATABASE", &db.name)
        .env("PGAPPNAME", "from-pgappname")
        .output()
        .await
        .unwrap();
    assert!(output.status.success(), "{}", stderr(&output));
    // The URL wins over the environment.
    let output = Command::new(BIN)
        .args(["status", "--database-url", &db.url])
        .env_remove("DATABASE_URL")
        .env("PGDATABASE", "no_such_database")
        .env("PGPORT", "1")
        .output()
        .await
        .unwrap();
    assert!(output.status.success(), "{}", stderr(&output));
    // A bad value is named by its variable.
    let output = Command::new(BIN)
        .args(["status", "--database-url", server])
        .env_remove("DATABASE_URL")
        .env("PGPORT", "not-a-port")
        .output()
        .await
        .unwrap();
    assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
    assert!(stderr(&output).contains("PGPORT is not a port number"), "{}", stderr(&output));
    // No URL at all: the environment alone, as psql takes it; PGOPTIONS reaches the server.
    let parsed = pg_outbox_relay::DatabaseUrl::parse(&db.url).unwrap();
    let config = parsed.config();
    let host = match &config.get_hosts()[0] {
        tokio_postgres::config::Host::Tcp(host) => host.clone(),
        other => panic!("{other:?}"),
    };
    let env_only = |options: &str| {
        let mut command = Command::new(BIN);
        command
            .args(["status", "--json"])
            .env_remove("DATABASE_URL")
            .env("PGHOST", &host)
            .env("PGPORT", config.get_ports()[0].to_string())
            .env("PGUSER", config.get_user().unwrap())
            .env("PGDATABASE", &db.name)
            .env("PGOPTIONS", options);
        command
    };
    let output = env_only("-c statement_timeout=5s").output().await.unwrap();
    assert!(output.status.success(), "{}", stderr(&output));
    let output = env_only("-c no_such_setting=1").output().await.unwrap();
    assert!(stderr(&output).contains("no_such_setting"), "PGOPTIONS went to the server: {}", stderr(&output));
}

/// One process with two routes is one relay in `status` (two listeners), with the connections
/// it holds, within --max-connections; a bound too small for its destinations is refused.
#[tokio::test]
async fn status_counts_a_process_with_two_routes_as_one_relay_within_max_connections() {
    let db = TestDb::new().await;
    let routes = ["--route", "erp=order.#=stdout", "--route", "mailer=mail.#=stdout"];
    let mut args = routes.to_vec();
    args.extend(["--max-connections", "16", "--workers", "4"]);
    let relay = spawn_run(&db.url, &args);
    let client = db.client().await;
    eventually("both listeners connected", || async {
        count(&client, "select count(*) from outbox_relay.relays where listener_pid is not null").await == 2
    })
    .await;
    let status = cli(&db.url, &["status", "--json"]).await;
    let status: Value = serde_json::from_str(stdout(&status).trim()).unwrap();
    let relays = status["relays"].as_array().unwrap();
    assert_eq!(relays.len(), 2, "{status}");
    assert_eq!(relays[0]["relay"], relays[1]["relay"], "{status}");
    let held = relays[0]["relay_connections"].as_i64().unwrap();
    assert!((2..=14).contains(&held), "16 less the command's own 2: {status}");
    assert!(status["health"]["max_connections"].as_i64().unwrap() > 0, "{status}");
    let table = stdout(&cli(&db.url, &["status"]).await);
    assert!(table.contains("relays connected          1 (2 listeners"), "{table}");
    assert!(table.contains("server connections        "), "{table}");
    let log = stderr(&terminate_with_output(relay).await);
    assert!(log.contains("fewer workers per destination"), "{log}");

    let mut args = routes.to_vec();
    args.extend(["--max-connections", "14"]);
    let refused = cli(&db.url, &[&["run"][..], &args].concat()).await;
    assert_eq!(refused.status.code(), Some(2), "{}", stderr(&refused));
    assert!(
        stderr(&refused).contains("--max-connections 14 is too few for 2 destinations: `run` needs at least 15"),
        "{}",
        stderr(&refused)
    );
}

/// Completion scripts and the manual page come from the parser's own definitions.
#[tokio::test]
async fn completions_and_the_manual_page_cover_every_command() {
    let bash = cli("", &["completions", "bash"]).await;
    assert!(bash.status.success(), "{}", stderr(&bash));
    let script = stdout(&bash);
    for word in ["dead-letters", "--max-connections", "--log-format", "replay", "--older-than"] {
        assert!(script.contains(word), "bash completion lacks {word}");
    }
    let zsh = stdout(&cli("", &["completions", "zsh"]).await);
    assert!(zsh.starts_with("#compdef outbox-relay"), "{}", &zsh[..zsh.len().min(200)]);
    let checked = std::process::Command::new("bash").arg("-n").arg("-c").arg(&script).status().unwrap();
    assert!(checked.success(), "the bash completion script does not parse");
    let unknown = cli("", &["completions", "tcsh"]).await;
    assert_eq!(unknown.status.code(), Some(2));

    let page = stdout(&cli("", &["man"]).await);
    assert!(page.starts_with(".ie") || page.contains(".TH outbox-relay 1"), "{}", &page[..page.len().min(200)]);
    assert!(page.contains("dead\\-letters") && page.contains("\\-\\-database\\-url"), "{page}");
    let dir = tempfile::tempdir().unwrap();
    let wrote = cli("", &["man", "--dir", dir.path().to_str().unwrap()]).await;
    assert!(wrote.status.success(), "{}", stderr(&wrote));
    for page in ["outbox-relay.1", "outbox-relay-run.1", "outbox-relay-dead-letters-purge.1"] {
        let text = std::fs::read_to_string(dir.path().join(page)).unwrap_or_else(|e| panic!("{page}: {e}"));
        assert!(text.contains(".TH"), "{page}");
    }
    // `man` renders it when it is there (man-db's nroff, as a packager's check would)
    if std::process::Command::new("man").arg("--version").output().is_ok_and(|o| o.status.success()) {
        let rendered = std::process::Command::new("man")
            .arg("-l")
            .arg(dir.path().join("outbox-relay-run.1"))
            .env("MANPAGER", "cat")
            .output()
            .unwrap();
        assert!(
            String::from_utf8_lossy(&rendered.stdout).contains("--max-connections"),
            "{}",
            String::from_utf8_lossy(&rendered.stderr)
        );
    }
}

/// The text of the docs' `status` and `dead-letters list` examples has every line and column the
/// commands print now: a field added to one and not the other is drift.
#[tokio::test]
async fn the_docs_status_and_dead_letter_examples_show_what_the_commands_print() {
    let db = TestDb::new().await;
    db.client()
        .await
        .batch_execute(
            "insert into outbox_relay.dead_letters (destination, id, topic, payload, created_at, attempts, last_error, failed_at)
             values ('erp', 1001, 'order.placed', '{}', now(), 12, 'gave up', now())",
        )
        .await
        .unwrap();
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/command.md")).unwrap();
    let block_after = |command: &str| -> String {
        let start = doc.find(&format!("$ {command}\n")).unwrap_or_else(|| panic!("no `$ {command}` in command.md"));
        let rest = &doc[start..];
        rest[..rest.find("\n```").unwrap()].to_string()
    };
    let status = stdout(&cli(&db.url, &["status"]).await);
    let shown = block_after("outbox-relay status");
    for line in status.lines().filter(|l| !l.starts_with(' ') && !l.starts_with("warning:")) {
        let label = line.split("  ").next().unwrap().trim();
        assert!(shown.contains(label), "`status` prints {label:?}, which command.md's example lacks:\n{shown}");
    }
    let list = stdout(&cli(&db.url, &["dead-letters", "list"]).await);
    let header: Vec<&str> = list.lines().next().unwrap().split("  ").map(str::trim).filter(|c| !c.is_empty()).collect();
    let shown = block_after(
        "outbox-relay dead-letters list            # or --json; --limit N events a page, --after ID for the next",
    );
    let shown_header: Vec<&str> =
        shown.lines().nth(1).unwrap().split("  ").map(str::trim).filter(|c| !c.is_empty()).collect();
    assert_eq!(header, shown_header, "command.md's dead-letters list example");
}
