//! The command as an operator meets it on a bad day: a full disk under stdout, a sink that is
//! down, flags out of range, a foot-gun of a purge, a database the relay cannot work with.

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

use crate::binary::{BIN, cli, publish, spawn_run, stderr, stdout, terminate};
use crate::harness::TestDb;
use crate::relay_support::{PATIENCE, count, eventually};

/// With stdout on a device that refuses every write, no event may count as delivered, however
/// the workers' batches interleave.
#[tokio::test]
async fn stdout_on_a_full_disk_marks_nothing_delivered() {
    let db = TestDb::new().await;
    db.client()
        .await
        .batch_execute("insert into outbox_relay.outbox (topic, payload) select 'order.placed', jsonb_build_object('n', g) from generate_series(1, 300) g")
        .await
        .unwrap();
    let full = std::fs::OpenOptions::new().write(true).open("/dev/full").expect("/dev/full");
    let mut child = Command::new(BIN)
        // (the breaker off: every event is to meet the full disk)
        .args([
            "run",
            "--sink",
            "stdout",
            "--workers",
            "4",
            "--batch-size",
            "1",
            "--backoff-base",
            "1h",
            "--breaker-threshold",
            "0",
        ])
        .env("DATABASE_URL", &db.url)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::from(full))
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    // (a failed delivery waits for its retry as a copy parked for the destination)
    let failed = "select count(*) from outbox_relay.parked
                   where destination = 'default' and attempts >= 1 and last_error is not null";
    eventually("every event attempted once", || async { count(&db.client().await, failed).await == 300 }).await;
    let pid = child.id().unwrap().to_string();
    std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    tokio::time::timeout(PATIENCE, child.wait()).await.unwrap().unwrap();
    // None delivered: every event still waits for the destination, none was dead-lettered.
    assert_eq!(count(&db.client().await, failed).await, 300);
    assert_eq!(count(&db.client().await, "select count(*) from outbox_relay.parked").await, 300);
    assert_eq!(count(&db.client().await, "select count(*) from outbox_relay.dead_letters").await, 0);
    let error: String =
        db.client().await.query_one("select last_error from outbox_relay.parked limit 1", &[]).await.unwrap().get(0);
    assert!(error.contains("writing to stdout failed"), "{error}");
}

/// `outbox-relay run --sink stdout | consumer`, and the consumer goes away: a closed pipe never
/// opens again, so the relay stops, exit status 1, saying why, instead of retrying forever; the
/// events it could not write wait, and the next run delivers each of them once.
#[tokio::test]
async fn run_stops_with_an_error_when_its_stdout_reader_goes_away_and_delivers_the_rest_next_time() {
    const EVENTS: i64 = 3000;
    let db = TestDb::new().await;
    db.client()
        .await
        .batch_execute(&format!(
            "insert into outbox_relay.outbox (topic, payload) select 'order.placed', jsonb_build_object('n', g) from generate_series(1, {EVENTS}) g"
        ))
        .await
        .unwrap();
    let mut first = spawn_run(&db.url, &["--sink", "stdout"]);
    let mut lines = BufReader::new(first.stdout.take().unwrap()).lines();
    let line = tokio::time::timeout(PATIENCE, lines.next_line()).await.expect("no output").unwrap().expect("eof");
    assert!(line.starts_with('{'), "{line}");
    drop(lines); // the reader goes away
    let output = tokio::time::timeout(PATIENCE, first.wait_with_output()).await.expect("went on after its reader left");
    let output = output.unwrap();
    let err = stderr(&output);
    assert_eq!(output.status.code(), Some(1), "{err}");
    assert!(err.contains("error: standard output was closed (its reader went away)"), "{err}");
    assert!(err.contains("it was closed, its reader is gone"), "the failed deliveries say why: {err}");
    assert_eq!(count(&db.client().await, "select count(*) from outbox_relay.dead_letters").await, 0);
    // (a batch that went into the pipe whole before its reader left was written, so delivered;
    // the rest failed)
    let db = &db;
    let ids = |sql: &'static str| async move {
        let rows = db.client().await.query(sql, &[]).await.unwrap();
        rows.iter().map(|row| row.get::<_, i64>(0)).collect::<std::collections::BTreeSet<i64>>()
    };
    let rest = ids("select id from outbox_relay.event_state where state <> 'delivered'").await;
    assert!(!rest.is_empty(), "the reader left before the end");

    // The next run delivers exactly the rest, each once.
    let mut second = spawn_run(&db.url, &["--sink", "stdout"]);
    let mut lines = BufReader::new(second.stdout.take().unwrap()).lines();
    let mut got = Vec::new();
    while got.len() < rest.len() {
        let line =
            tokio::time::timeout(PATIENCE, lines.next_line()).await.expect("events missing").unwrap().expect("eof");
        let event: Value = serde_json::from_str(&line).unwrap();
        got.push(event["id"].as_i64().unwrap());
    }
    assert_eq!(got.iter().copied().collect::<std::collections::BTreeSet<i64>>(), rest);
    assert_eq!(terminate(second).await, Some(0));
    let delivered = ids("select id from outbox_relay.event_state where state = 'delivered'").await;
    assert_eq!(delivered.len(), EVENTS as usize, "every event delivered");
}

/// The stop on a closed stdout holds for the relay a SIGHUP starts too: `run --config` reloads a
/// changed file (the route's pattern), the new relay delivers what only the new pattern matches,
/// and when the reader goes away it stops with the same error.
#[tokio::test]
async fn after_a_reload_run_still_stops_when_its_stdout_reader_goes_away() {
    let db = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("relay.toml");
    let file =
        |pattern: &str| format!("[[destination]]\nname = \"default\"\npattern = \"{pattern}\"\nsink = \"stdout\"\n");
    std::fs::write(&config, file("before.#")).unwrap();
    let mut relay = spawn_run(&db.url, &["--config", config.to_str().unwrap()]);
    let log = Arc::new(Mutex::new(String::new()));
    let mut errors = BufReader::new(relay.stderr.take().unwrap()).lines();
    let kept = log.clone();
    let logging = tokio::spawn(async move {
        while let Ok(Some(line)) = errors.next_line().await {
            kept.lock().unwrap().push_str(&(line + "\n"));
        }
    });
    let mut lines = BufReader::new(relay.stdout.take().unwrap()).lines();
    let mut topic_of_next_line = async || {
        let line = tokio::time::timeout(PATIENCE, lines.next_line()).await.expect("no output").unwrap().expect("eof");
        serde_json::from_str::<Value>(&line).unwrap()["topic"].as_str().unwrap().to_owned()
    };
    publish(&db, "before.x", json!({})).await;
    assert_eq!(topic_of_next_line().await, "before.x");
    std::fs::write(&config, file("after.#")).unwrap();
    let pid = relay.id().expect("running").to_string();
    assert!(std::process::Command::new("kill").args(["-HUP", &pid]).status().unwrap().success());
    let reloaded = || async { log.lock().unwrap().contains("--config reloaded") };
    eventually("the changed file applied", reloaded).await;
    publish(&db, "after.x", json!({})).await;
    assert_eq!(topic_of_next_line().await, "after.x", "the relay started from the new file delivers");
    drop(lines); // the reader goes away
    db.client()
        .await
        .batch_execute(
            "insert into outbox_relay.outbox (topic, payload) select 'after.x', '{}' from generate_series(1, 100)",
        )
        .await
        .unwrap();
    let status = tokio::time::timeout(PATIENCE, relay.wait()).await.expect("went on after its reader left").unwrap();
    logging.await.unwrap();
    let log = log.lock().unwrap().clone();
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(log.contains("error: standard output was closed (its reader went away)"), "{log}");
}

/// Every duration has a range, checked before anything starts, and the error names the flag;
/// bad arguments exit with 2.
#[tokio::test]
async fn durations_out_of_range_are_refused_naming_the_flag() {
    let db = TestDb::new().await;
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["run", "--sink", "stdout", "--poll-interval", "500000000000y"], "--poll-interval"),
        (vec!["run", "--sink", "stdout", "--poll-interval", "2d"], "at most 1day"),
        (vec!["run", "--sink", "stdout", "--poll-interval", "-1s"], "cannot be negative"),
        (vec!["run", "--sink", "stdout", "--lease", "100000000y"], "--lease"),
        (vec!["run", "--sink", "stdout", "--lease", "10ms"], "at least 100ms"),
        (vec!["run", "--sink", "stdout", "--retention", "10000y"], "--retention"),
        (vec!["run", "--sink", "stdout", "--backoff-max", "30d"], "--backoff-max"),
        (
            vec!["run", "--sink", "stdout", "--backoff-base", "1h", "--backoff-max", "1s"],
            "--backoff-max (1s) is shorter than --backoff-base (1h)",
        ),
        (vec!["run", "--sink", "stdout", "--shutdown-grace", "-5s"], "--shutdown-grace"),
        (vec!["run", "--sink", "nats://127.0.0.1:4222", "--timeout", "0s"], "--timeout"),
        (vec!["dead-letters", "purge", "--older-than", "200000y"], "--older-than"),
        (vec!["cleanup", "--idempotency-retention", "-1d"], "--idempotency-retention"),
        (vec!["run", "--sink", "stdout", "--rate-limit", "200"], "such as 200/s"),
        (vec!["run", "--sink", "stdout", "--rate-limit", "200/week"], "\"week\" is no unit of time"),
        (vec!["run", "--sink", "stdout", "--rate-limit", "0/s"], "out of range"),
        (vec!["run", "--sink", "stdout", "--rate-limit", "many/s"], "\"many\" is no number"),
    ];
    for (args, needle) in cases {
        let output = cli(&db.url, &args).await;
        let err = stderr(&output);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: one line expected, got {err}");
        assert!(err.contains(needle), "{args:?}: {err} should mention {needle}");
    }
}

/// A connection string that does not parse is a bad argument too, and names the option.
#[tokio::test]
async fn an_unknown_connection_option_is_named() {
    let output = cli("host=127.0.0.1 user=postgres sslmod=require", &["status"]).await;
    assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
    assert!(stderr(&output).contains("unknown connection option \"sslmod\""), "{}", stderr(&output));
}

/// `dead-letters purge` without a flag deletes nothing: it wants `--all` or `--older-than`.
#[tokio::test]
async fn purge_needs_all_or_older_than() {
    let db = TestDb::new().await;
    db.client()
        .await
        .batch_execute(
            "insert into outbox_relay.dead_letters (destination, id, topic, payload, created_at, attempts, last_error, failed_at)
             values ('default', 1, 'a', '{}', now(), 1, 'x', now() - interval '2 days'),
                    ('default', 2, 'b', '{}', now(), 1, 'x', now())",
        )
        .await
        .unwrap();
    let bare = cli(&db.url, &["dead-letters", "purge"]).await;
    assert_eq!(bare.status.code(), Some(2), "{}", stderr(&bare));
    assert!(stderr(&bare).contains("--all") || stderr(&bare).contains("--older-than"), "{}", stderr(&bare));
    assert_eq!(count(&db.client().await, "select count(*) from outbox_relay.dead_letters").await, 2);
    let both = cli(&db.url, &["dead-letters", "purge", "--all", "--older-than", "1d"]).await;
    assert_eq!(both.status.code(), Some(2));
    let old = cli(&db.url, &["dead-letters", "purge", "--older-than", "1d"]).await;
    assert!(stdout(&old).contains("purged 1 dead letters"), "{}", stdout(&old));
    let all = cli(&db.url, &["dead-letters", "purge", "--all"]).await;
    assert!(stdout(&all).contains("purged 1 dead letters"), "{}", stdout(&all));
}

/// A sink that refuses connections: the relay says so at warn (once, then a count, not a line
/// per event), `status` shows the error, the lag and the relay, and shutdown sums up.
#[tokio::test]
async fn a_failing_sink_is_logged_and_status_shows_why_events_wait() {
    let db = TestDb::new().await;
    let port = crate::relay_support::free_port();
    let http = format!("127.0.0.1:{port}");
    let mut child = spawn_run(
        &db.url,
        &[
            "--http",
            &http,
            "--sink",
            "http://127.0.0.1:1/hooks",
            "--backoff-base",
            "20ms",
            "--backoff-max",
            "50ms",
            "--max-attempts",
            "1000",
            // the breaker off: this is about the failures' own warnings
            "--breaker-threshold",
            "0",
        ],
    );
    let mut log = BufReader::new(child.stderr.take().unwrap()).lines();
    for n in 0..20 {
        publish(&db, "order.placed", json!({"n": n})).await;
    }
    let mut warnings = Vec::new();
    while warnings.is_empty() {
        let line = tokio::time::timeout(PATIENCE, log.next_line()).await.expect("no warning").unwrap().expect("eof");
        if line.contains("WARN") {
            warnings.push(line);
        }
    }
    assert!(warnings[0].contains("delivery failed; it will be retried"), "{}", warnings[0]);
    assert!(warnings[0].contains("POST http://127.0.0.1:1/hooks failed"), "{}", warnings[0]);
    assert!(warnings[0].contains("retry_in="), "{}", warnings[0]);
    // (a refused connection spends no attempt: the relay's metric counts the failures)
    eventually("more than 40 failed deliveries", || async {
        let Ok(response) = crate::http::http().get(format!("http://{http}/metrics")).send().await else {
            return false;
        };
        let text = response.text().await.unwrap_or_default();
        let retried = text.lines().find_map(|line| {
            line.strip_prefix("outbox_relay_events_retried_total{destination=\"default\"} ")?.parse::<f64>().ok()
        });
        retried.is_some_and(|n| n > 40.0)
    })
    .await;

    let status = cli(&db.url, &["status", "--json"]).await;
    assert!(status.status.success(), "{}", stderr(&status));
    let status: Value = serde_json::from_str(stdout(&status).trim()).unwrap();
    let errors = status["errors"].as_array().unwrap();
    assert!(errors[0]["error"].as_str().unwrap().contains("POST http://127.0.0.1:1/hooks failed"), "{status}");
    assert!(errors.iter().map(|e| e["events"].as_i64().unwrap()).sum::<i64>() >= 1, "{status}");
    assert_eq!(status["relays"].as_array().unwrap().len(), 1, "{status}");
    assert!(status["oldest_ready_age_ms"].is_i64() || status["oldest_ready_age_ms"].is_null(), "{status}");
    let table = cli(&db.url, &["status"]).await;
    let table = stdout(&table);
    assert!(table.contains("relays connected          1"), "{table}");
    assert!(table.contains("most common errors of pending events:"), "{table}");
    assert!(table.contains("oldest ready (lag)"), "{table}");

    assert_eq!(terminate_collecting(child, &mut log, &mut warnings).await, Some(0));
    let warn_lines = warnings.iter().filter(|l| l.contains("WARN")).count();
    assert!(warn_lines <= 5, "{warn_lines} warnings for >40 failures: they must be rate-limited\n{warnings:#?}");
    let summary = warnings.iter().find(|l| l.contains("relay activity since it started")).expect("a summary");
    assert!(summary.contains("delivered=0") && !summary.contains("retried=0"), "{summary}");
}

/// Sends SIGTERM and keeps every log line until the process ends.
async fn terminate_collecting(
    child: tokio::process::Child,
    log: &mut tokio::io::Lines<BufReader<tokio::process::ChildStderr>>,
    lines: &mut Vec<String>,
) -> Option<i32> {
    let pid = child.id().unwrap().to_string();
    std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    while let Ok(Ok(Some(line))) = tokio::time::timeout(PATIENCE, log.next_line()).await {
        lines.push(line);
    }
    terminate_wait(child).await
}

async fn terminate_wait(mut child: tokio::process::Child) -> Option<i32> {
    tokio::time::timeout(PATIENCE, child.wait()).await.expect("did not stop").unwrap().code()
}

/// A database missing a migration of this version is refused at start, with what to do.
#[tokio::test]
async fn the_relay_refuses_a_database_missing_a_migration() {
    let db = TestDb::new().await;
    db.client().await.batch_execute("delete from outbox_relay.schema_migrations where version = 3").await.unwrap();
    let child = spawn_run(&db.url, &["--sink", "stdout"]);
    let output = tokio::time::timeout(PATIENCE, child.wait_with_output()).await.unwrap().unwrap();
    assert_eq!(output.status.code(), Some(1));
    let err = stderr(&output);
    assert!(
        err.contains("lacks migration 0003_harden_rows_and_writer_path") && err.contains("outbox-relay migrate"),
        "{err}"
    );
}

/// A sequence that hands out ids in blocks (`cache 50`) breaks the order of a key's ids: the
/// relay says so at start, with the fix, and delivers all the same.
#[tokio::test]
async fn a_sequence_caching_ids_is_named_at_start() {
    let db = TestDb::new().await;
    db.client().await.batch_execute("alter sequence outbox_relay.outbox_id_seq cache 50").await.unwrap();
    let id = publish(&db, "order.placed", json!({})).await;
    let child = spawn_run(&db.url, &["--sink", "stdout"]);
    let client = db.client().await;
    eventually("the event delivered", || async {
        count(
            &client,
            &format!(
                "select count(*) from outbox_relay.outbox where id = {id} and outbox_relay.passed_by_all(xid, id)"
            ),
        )
        .await
            == 1
    })
    .await;
    let output = crate::binary::terminate_with_output(child).await;
    let err = stderr(&output);
    assert!(err.contains("blocks of 50") && err.contains("alter sequence outbox_relay.outbox_id_seq cache 1"), "{err}");
}

/// The destination down, then back, as the operator sees it: one warn line when the breaker
/// opens, `status` showing it open (table and JSON), one warn line when a probe gets through,
/// and every event delivered with none dead-lettered and no attempt spent on the outage.
#[tokio::test]
async fn the_breaker_shows_in_the_log_and_in_status() {
    let db = TestDb::new().await;
    // A port nobody listens on yet; the receiver takes it later.
    let addr = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    for n in 0..40 {
        publish(&db, "order.placed", json!({"n": n})).await;
    }
    let sink = format!("http://{addr}/hooks");
    let mut child = spawn_run(
        &db.url,
        &[
            "--sink",
            &sink,
            "--max-attempts",
            "3",
            "--backoff-base",
            "10ms",
            "--backoff-max",
            "20ms",
            "--breaker-probe-min",
            "100ms",
            "--breaker-probe-max",
            "200ms",
        ],
    );
    let mut log = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut lines = Vec::new();
    let opened = next_line_containing(&mut log, &mut lines, "the destination looks down").await;
    assert!(opened.contains("WARN") && opened.contains("probe_in="), "{opened}");

    // The relay publishes the breaker's state for `status` just after it logs the opening (its
    // own row, beside the listener's: not always the first).
    let open_relay = |status: &Value| {
        status["relays"].as_array().and_then(|relays| relays.iter().find(|r| r["breaker_open"] == json!(true)).cloned())
    };
    eventually("status shows the breaker open", || async {
        let status = cli(&db.url, &["status", "--json"]).await;
        open_relay(&serde_json::from_str(stdout(&status).trim()).unwrap()).is_some()
    })
    .await;
    let status = cli(&db.url, &["status", "--json"]).await;
    let status: Value = serde_json::from_str(stdout(&status).trim()).unwrap();
    let open = open_relay(&status).unwrap_or_else(|| panic!("the breaker open in {status}"));
    assert!(open["breaker_since"].is_string(), "{status}");
    let table = cli(&db.url, &["status"]).await;
    assert!(stdout(&table).contains("BREAKER OPEN"), "{}", stdout(&table));

    let listener = tokio::net::TcpListener::bind(addr).await.expect("the receiver's port");
    // The receiver keeps the highest attempt each event reached it at (its `Outbox-Attempt`).
    let attempts: Arc<Mutex<HashMap<i64, i64>>> = Arc::default();
    let received = attempts.clone();
    let app = axum::Router::new().route(
        "/hooks",
        axum::routing::post(move |headers: axum::http::HeaderMap| {
            let received = received.clone();
            async move {
                let header = |name: &str| headers[name].to_str().unwrap().parse::<i64>().unwrap();
                let attempt = header("outbox-attempt");
                let mut received = received.lock().unwrap();
                let highest = received.entry(header("outbox-event-id")).or_default();
                *highest = attempt.max(*highest);
                axum::http::StatusCode::OK
            }
        }),
    );
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    next_line_containing(&mut log, &mut lines, "the destination is back").await;
    eventually("every event delivered", || async {
        attempts.lock().unwrap().len() == 40 && crate::cli::settled(&db, 40).await
    })
    .await;
    let status = cli(&db.url, &["status", "--json"]).await;
    let status: Value = serde_json::from_str(stdout(&status).trim()).unwrap();
    assert_eq!(status["relays"][0]["breaker_open"], json!(false), "{status}");
    assert_eq!(status["dead_letters"], json!(0), "{status}");
    let highest = attempts.lock().unwrap().values().copied().max();
    assert!(highest.is_some_and(|n| n < 3), "the outage consumed no attempt: delivered at attempt {highest:?}");

    assert_eq!(terminate_collecting(child, &mut log, &mut lines).await, Some(0));
    let opens = lines.iter().filter(|l| l.contains("the destination looks down")).count();
    assert_eq!(opens, 1, "one warn line per change of the breaker:\n{lines:#?}");
}

/// Reads the log until a line contains `needle`, keeping every line read.
async fn next_line_containing(
    log: &mut tokio::io::Lines<BufReader<tokio::process::ChildStderr>>,
    lines: &mut Vec<String>,
    needle: &str,
) -> String {
    loop {
        let line = tokio::time::timeout(PATIENCE, log.next_line())
            .await
            .unwrap_or_else(|_| panic!("no log line containing {needle:?}; the log so far:\n{lines:#?}"))
            .unwrap()
            .unwrap_or_else(|| panic!("the log ended before a line containing {needle:?}:\n{lines:#?}"));
        lines.push(line.clone());
        if line.contains(needle) {
            return line;
        }
    }
}

/// `status` shows each relay's concurrency limit and its deliveries in flight (table and JSON),
/// as the relay publishes them: here a fixed limit of 3, full while the receiver holds every
/// request, then empty once it lets them through.
#[tokio::test]
async fn status_shows_the_concurrency_limit_and_the_deliveries_in_flight() {
    let db = TestDb::new().await;
    let (open, opened) = tokio::sync::watch::channel(false);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let sink = format!("http://{}/hooks", listener.local_addr().unwrap());
    let app = axum::Router::new().route(
        "/hooks",
        axum::routing::post(move || {
            let mut opened = opened.clone();
            async move {
                opened.wait_for(|open| *open).await.ok();
                axum::http::StatusCode::OK
            }
        }),
    );
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    for n in 0..10 {
        publish(&db, "order.placed", json!({"n": n})).await;
    }
    let mut child = spawn_run(&db.url, &["--sink", &sink, "--fixed-concurrency", "--concurrency", "3"]);
    let relay = async || {
        let status = cli(&db.url, &["status", "--json"]).await;
        let status: Value = serde_json::from_str(stdout(&status).trim()).unwrap();
        status["relays"][0].clone()
    };
    eventually("the limit published, full", || async {
        let relay = relay().await;
        relay["delivery_limit"] == json!(3) && relay["deliveries_in_flight"] == json!(3)
    })
    .await;
    let table = cli(&db.url, &["status"]).await;
    assert!(stdout(&table).contains("limit 3 (3 in flight)"), "{}", stdout(&table));

    open.send_replace(true);
    eventually("every event delivered", || async { crate::cli::settled(&db, 10).await }).await;
    assert_eq!(count(&db.client().await, "select count(*) from outbox_relay.dead_letters").await, 0);
    eventually("nothing in flight", || async { relay().await["deliveries_in_flight"] == json!(0) }).await;
    let mut log = BufReader::new(child.stderr.take().unwrap()).lines();
    assert_eq!(terminate_collecting(child, &mut log, &mut Vec::new()).await, Some(0));
}

/// A reader that goes away (`outbox-relay status | head -1`, `destinations list | true`) ends a
/// listing quietly with exit status 0: it used to panic ("failed printing to stdout: Broken
/// pipe", exit 101, a stack trace with RUST_BACKTRACE set).
#[tokio::test]
async fn a_closed_output_pipe_ends_a_listing_quietly() {
    let db = TestDb::new().await;
    publish(&db, "order.placed", json!({"n": 1})).await;
    for args in [&["status"][..], &["destinations", "list"], &["dead-letters", "list"], &["--help"]] {
        let said = stdout(&cli(&db.url, args).await);
        assert!(!said.is_empty(), "{args:?} prints something");
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        // (spawned, not `output()`, which would capture stdout instead)
        let child = Command::new(BIN)
            .args(args)
            .env("DATABASE_URL", &db.url)
            .env("RUST_LOG", "warn")
            .env("RUST_BACKTRACE", "1")
            .stdout(Stdio::from(writer))
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let output = tokio::time::timeout(PATIENCE, child.wait_with_output()).await.expect("command hung").unwrap();
        let said = stderr(&output);
        assert!(output.status.success(), "{args:?} into a closed pipe: {:?}, stderr: {said}", output.status);
        assert!(!said.contains("panicked"), "{args:?} into a closed pipe: {said}");
    }
}
