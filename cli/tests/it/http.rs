//! `run --http` and `console`: metrics read by the Prometheus project's own parser, readiness
//! through a real database outage, pauses across restarts, the console's guards, and the
//! console driven in a real (headless) Chromium.

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use pg_outbox_relay_cluster::{EmbeddedOptions, EmbeddedPostgres, StopMode};
use serde_json::{Value, json};
use tokio::io::AsyncBufReadExt;
use tokio::process::{Child, Command};

use crate::binary::{BIN, cli, publish, spawn_run, stderr, stdout, terminate, terminate_with_output};
use crate::harness::TestDb;
use crate::relay_support::{PATIENCE, eventually, free_port, until};
use pg_outbox_relay_testkit::browser::{Chromedriver, chromium};

pub fn http() -> reqwest::Client {
    // (reqwest is built without a crypto provider of its own; the library uses ring)
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap()
}

/// The status and body of a GET, or `None` while nothing answers.
async fn get(url: &str) -> Option<(u16, String)> {
    let response = http().get(url).send().await.ok()?;
    Some((response.status().as_u16(), response.text().await.ok()?))
}

/// Waits until `url` answers with `status`; returns the body.
async fn until_status(url: &str, status: u16) -> String {
    until(&format!("{url} answers {status}"), || async {
        get(url).await.filter(|(s, _)| *s == status).map(|(_, body)| body)
    })
    .await
}

/// Families as `prometheus_client.openmetrics.parser` (the Prometheus project's Python client)
/// reads the text: name -> (type, sample -> value), a sample named by its name, followed by its
/// labels in braces when it has any (`name{a="x",b="y"}`, sorted by label).
fn parse_openmetrics(text: &str) -> HashMap<String, (String, HashMap<String, f64>)> {
    const SCRIPT: &str = r#"
import json, sys
from prometheus_client.openmetrics.parser import text_string_to_metric_families
def key(s):
    if not s.labels:
        return s.name
    return s.name + "{" + ",".join('%s="%s"' % (k, v) for k, v in sorted(s.labels.items())) + "}"
out = {}
for family in text_string_to_metric_families(sys.stdin.read()):
    out[family.name] = [family.type, {key(s): s.value for s in family.samples}]
print(json.dumps(out))
"#;
    let output = crate::tools::python(SCRIPT, &[], text.as_bytes(), &[crate::tools::PROMETHEUS_CLIENT]);
    assert!(
        output.status.success(),
        "the OpenMetrics parser refused the text: {}\n{text}",
        String::from_utf8_lossy(&output.stderr)
    );
    let parsed: HashMap<String, (String, HashMap<String, f64>)> = serde_json::from_slice(&output.stdout).unwrap();
    parsed
}

/// One sample's value in the raw text (for polling before the parser is run).
fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

/// A private PostgreSQL of the test's own (to stop and start), migrated, and its URL.
pub(crate) async fn migrated_private_cluster() -> (EmbeddedPostgres, String) {
    let pg = tokio::task::spawn_blocking(|| EmbeddedPostgres::start(EmbeddedOptions::default()))
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("cannot start a private PostgreSQL: {e}"));
    let url = pg.url();
    let migrated = cli(&url, &["migrate"]).await;
    assert!(migrated.status.success(), "{}", stderr(&migrated));
    (pg, url)
}

/// `pg` stopped (fast: its clients disconnected).
async fn stopped(mut pg: EmbeddedPostgres) -> EmbeddedPostgres {
    tokio::task::spawn_blocking(move || {
        pg.stop(StopMode::Fast).unwrap();
        pg
    })
    .await
    .unwrap()
}

/// `pg` started again on its port.
async fn started_again(mut pg: EmbeddedPostgres) -> EmbeddedPostgres {
    tokio::task::spawn_blocking(move || {
        pg.start_again().unwrap();
        pg
    })
    .await
    .unwrap()
}

#[tokio::test]
async fn readyz_follows_a_database_outage_both_ways() {
    let (pg, url) = migrated_private_cluster().await;
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let relay = spawn_run(&url, &["--sink", "stdout", "--http", &format!("127.0.0.1:{port}")]);
    assert_eq!(until_status(&format!("{base}/readyz"), 200).await, r#"{"ready":true}"#);

    let pg = stopped(pg).await;
    let body = until_status(&format!("{base}/readyz"), 503).await;
    let body: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(body["ready"], false);
    assert!(body["reason"].as_str().unwrap().contains("database"), "{body}");
    // Alive all the same: an orchestrator should not restart a relay for its database's outage.
    assert_eq!(get(&format!("{base}/healthz")).await.unwrap().0, 200);
    let (_, metrics) = get(&format!("{base}/metrics")).await.unwrap();
    assert_eq!(sample(&metrics, "outbox_relay_database_up"), Some(0.0), "{metrics}");

    let pg = started_again(pg).await;
    until_status(&format!("{base}/readyz"), 200).await;
    assert_eq!(terminate(relay).await, Some(0));
    drop(pg);
}

/// A relay started while its database is down (a container started beside it, a supervisor
/// restarting both) waits for it, answering /readyz with 503, and delivers once the database
/// comes up, without a restart. It used to exit at once with status 1: a crash loop under a
/// supervisor. `--exit-on-database-error` keeps that behaviour for those who want it.
#[tokio::test]
async fn a_relay_started_before_its_database_waits_and_delivers_once_it_is_up() {
    let (pg, url) = migrated_private_cluster().await;
    let pg = stopped(pg).await;

    let refused = cli(&url, &["run", "--sink", "stdout", "--exit-on-database-error"]).await;
    assert_eq!(refused.status.code(), Some(1), "{}", stderr(&refused));
    assert!(stderr(&refused).contains("cannot connect to PostgreSQL"), "{}", stderr(&refused));

    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let mut relay = spawn_run(&url, &["--sink", "stdout", "--http", &format!("127.0.0.1:{port}")]);
    let body = until_status(&format!("{base}/readyz"), 503).await;
    assert!(body.contains("database"), "{body}");
    // (the log read as it is written: a full pipe would stop the relay)
    let (lines, mut logged) = tokio::sync::mpsc::unbounded_channel();
    let mut log = tokio::io::BufReader::new(relay.stderr.take().unwrap()).lines();
    tokio::spawn(async move {
        while let Ok(Some(line)) = log.next_line().await {
            let _ = lines.send(line);
        }
    });
    tokio::time::timeout(PATIENCE, async {
        while let Some(line) = logged.recv().await {
            if line.contains("the database cannot be reached; waiting for it") {
                return;
            }
        }
        panic!("the relay's log ended before it said it waits for the database");
    })
    .await
    .expect("the relay says that it waits for the database");
    // The database comes up a few seconds after the relay.
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    let pg = started_again(pg).await;
    let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(connection);
    let id: i64 = client
        .query_one("select outbox_relay.publish('order.placed', '{\"late\": true}'::jsonb)", &[])
        .await
        .unwrap()
        .get(0);
    let mut out = tokio::io::BufReader::new(relay.stdout.take().unwrap()).lines();
    tokio::time::timeout(PATIENCE, async {
        while let Some(line) = out.next_line().await.unwrap() {
            let event: Value = serde_json::from_str(&line).unwrap();
            if event["id"] == id {
                return;
            }
        }
        panic!("the relay's output ended before the event");
    })
    .await
    .expect("the event published once the database was up is delivered");
    until_status(&format!("{base}/readyz"), 200).await;
    assert_eq!(terminate(relay).await, Some(0));
    drop(pg);
}

#[tokio::test]
async fn a_pause_from_the_command_outlives_a_relay_restart() {
    let db = TestDb::new().await;
    let paused = cli(&db.url, &["pause", "--topic", "mail.send"]).await;
    assert!(paused.status.success(), "{}", stderr(&paused));
    assert!(stdout(&paused).contains("paused topic mail.send"), "{}", stdout(&paused));
    let refused = cli(&db.url, &["pause", "--topic", "not a topic"]).await;
    assert!(!refused.status.success());
    assert!(stderr(&refused).contains("topic \"not a topic\""), "{}", stderr(&refused));

    let held = publish(&db, "mail.send", json!({})).await;
    let relay = spawn_run(&db.url, &["--sink", "stdout"]);
    let other = publish(&db, "erp.sync", json!({})).await;
    // Delivered: passed by the destination (kept for the retention), no copy of it waiting for
    // the destination (a paused event waits as one), not dead-lettered.
    let delivered = |id: i64| {
        let db = &db;
        async move {
            db.client()
                .await
                .query_one(
                    "select coalesce((select outbox_relay.passed_by_all(xid, id) from outbox_relay.outbox where id = $1), false)
                        and not exists (select 1 from outbox_relay.parked where id = $1)
                        and not exists (select 1 from outbox_relay.dead_letters where id = $1)",
                    &[&id],
                )
                .await
                .unwrap()
                .get::<_, bool>(0)
        }
    };
    // The paused event, waiting for the destination: its attempts so far.
    let waiting_attempts = |id: i64| {
        let db = &db;
        async move {
            db.client()
                .await
                .query_opt("select attempts from outbox_relay.parked where destination = 'default' and id = $1", &[&id])
                .await
                .unwrap()
                .map(|row| row.get::<_, i32>(0))
        }
    };
    eventually("the other topic is delivered", || delivered(other)).await;
    assert!(!delivered(held).await, "claims go in id order: the paused event was passed over");
    assert_eq!(waiting_attempts(held).await, Some(0), "the paused event waits, charged no attempt");
    let output = terminate_with_output(relay).await;
    assert_eq!(output.status.code(), Some(0));
    assert_eq!(printed_ids(&output), [other], "only the other topic reached the sink");

    let status = cli(&db.url, &["status"]).await;
    assert!(stdout(&status).contains("paused                    topic mail.send"), "{}", stdout(&status));
    let relay = spawn_run(&db.url, &["--sink", "stdout"]);
    let other = publish(&db, "erp.sync", json!({})).await;
    eventually("the restarted relay delivers the other topic", || delivered(other)).await;
    assert!(!delivered(held).await, "still paused after the restart");
    assert_eq!(waiting_attempts(held).await, Some(0), "still waiting, charged no attempt");
    let resumed = cli(&db.url, &["resume", "--topic", "mail.send"]).await;
    assert!(stdout(&resumed).contains("resumed topic mail.send"), "{}", stdout(&resumed));
    eventually("the resumed event is delivered", || delivered(held)).await;
    let output = terminate_with_output(relay).await;
    assert_eq!(output.status.code(), Some(0));
    assert_eq!(printed_ids(&output), [other, held], "the other topic, then the resumed event");
    let event: Value = serde_json::from_str(stdout(&output).lines().last().unwrap()).unwrap();
    assert_eq!(event["attempts"], json!(1), "the pause cost it no attempt");
}

/// The ids of the events a `--sink stdout` relay printed, in order.
fn printed_ids(output: &std::process::Output) -> Vec<i64> {
    stdout(output)
        .lines()
        .map(|line| serde_json::from_str::<Value>(line).unwrap_or_else(|e| panic!("not JSON: {line}: {e}")))
        .map(|event| event["id"].as_i64().unwrap())
        .collect()
}

/// `outbox-relay console` with these arguments.
pub fn spawn_console(url: &str, args: &[&str], token: Option<&str>) -> Child {
    let mut command = Command::new(BIN);
    command.arg("console").args(args).env("DATABASE_URL", url).env("RUST_LOG", "info");
    if let Some(token) = token {
        command.env("OUTBOX_RELAY_HTTP_TOKEN", token);
    }
    command.stdout(Stdio::piped()).stderr(Stdio::piped()).kill_on_drop(true).spawn().unwrap()
}

fn csrf_of(page: &str) -> String {
    let at = page.find("name=\"csrf\" value=\"").expect("a form with the CSRF token") + 19;
    page[at..at + 32].to_string()
}

async fn post(url: &str, form: &[(&str, &str)]) -> (u16, String) {
    let response = http().post(url).form(form).send().await.unwrap();
    let status = response.status().as_u16();
    (status, response.text().await.unwrap())
}

#[tokio::test]
async fn with_a_token_the_console_needs_a_login_and_actions_need_the_csrf_token_too() {
    let db = TestDb::new().await;
    let token = "s3cret-token-0123456789";
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let console = spawn_console(&db.url, &["--listen", &format!("127.0.0.1:{port}")], Some(token));
    // Without the token: a login form, nothing of the queue; the API and actions refuse.
    let login = until_status(&format!("{base}/"), 401).await;
    assert!(login.contains("action=\"/login\"") && !login.contains("Dead letters"), "{login}");
    assert_eq!(get(&format!("{base}/api/summary")).await.unwrap().0, 401);
    assert_eq!(get(&format!("{base}/api/events/1")).await.unwrap().0, 401);
    assert_eq!(post(&format!("{base}/actions/pause"), &[("all", "1")]).await.0, 401);
    // The probes and the metrics need none.
    assert_eq!(get(&format!("{base}/metrics")).await.unwrap().0, 200);
    assert_eq!(get(&format!("{base}/readyz")).await.unwrap().0, 200);
    let (status, _) = post(&format!("{base}/login"), &[("token", "s3cret-token-0123456780")]).await;
    assert_eq!(status, 401, "a near miss");

    // A login sets the session cookie; the page and the actions then work with it.
    let browser =
        reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).cookie_store(true).build().unwrap();
    let logged_in = browser.post(format!("{base}/login")).form(&[("token", token)]).send().await.unwrap();
    assert_eq!(logged_in.status().as_u16(), 303);
    let cookie = logged_in.headers()["set-cookie"].to_str().unwrap().to_string();
    assert!(cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict") && !cookie.contains(token), "{cookie}");
    let page = browser.get(format!("{base}/")).send().await.unwrap().text().await.unwrap();
    let csrf = csrf_of(&page);
    let act = |form: Vec<(&'static str, String)>| {
        let browser = browser.clone();
        let url = format!("{base}/actions/pause");
        async move {
            let response = browser.post(url).form(&form).send().await.unwrap();
            (response.status().as_u16(), response.text().await.unwrap())
        }
    };
    assert_eq!(act(vec![("topic", "a.b".into())]).await.0, 403, "no CSRF token");
    assert_eq!(act(vec![("csrf", "0".repeat(32)), ("topic", "a.b".into())]).await.0, 403, "a wrong one");
    assert!(db.outbox.pauses().await.unwrap().is_empty(), "nothing was paused by a refused request");
    assert_eq!(act(vec![("csrf", csrf.clone()), ("topic", "a.b".into())]).await.0, 303);
    assert_eq!(db.outbox.pauses().await.unwrap()[0].topic.as_deref(), Some("a.b"));
    let (status, body) = act(vec![("csrf", csrf.clone()), ("topic", "<script>".into())]).await;
    assert_eq!(status, 400, "{body}");
    // A script may send the token itself.
    let scripted = http()
        .post(format!("{base}/actions/resume"))
        .bearer_auth(token)
        .form(&[("csrf", csrf.as_str()), ("topic", "a.b")])
        .send()
        .await
        .unwrap();
    assert_eq!(scripted.status().as_u16(), 303);
    assert!(db.outbox.pauses().await.unwrap().is_empty());
    // A page elsewhere cannot reach the loopback console by a name of its own (DNS rebinding).
    let rebound = http().get(format!("{base}/")).header("Host", "evil.example:80").send().await.unwrap();
    assert_eq!(rebound.status().as_u16(), 421);

    let output = terminate_with_output(console).await;
    let logs = String::from_utf8_lossy(&output.stderr);
    assert!(!logs.contains(token), "the token is never logged:\n{logs}");
    assert!(logs.contains("paused topic a.b (console)"), "{logs}");
    assert!(logs.contains("console login refused"), "{logs}");
}

#[tokio::test]
async fn actions_say_exactly_what_they_act_on() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .batch_execute(
            "insert into outbox_relay.dead_letters (destination, id, topic, payload, created_at, attempts, last_error)
             select 'default', g, 'invoice.issue', '{}', now(), 3, 'refused' from generate_series(1001, 1003) g",
        )
        .await
        .unwrap();
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let _console = spawn_console(&db.url, &["--listen", &format!("127.0.0.1:{port}")], None);
    let csrf = csrf_of(&until_status(&format!("{base}/"), 200).await);
    let csrf = csrf.as_str();
    let purge = format!("{base}/actions/purge");
    for (form, says) in [
        (vec![("csrf", csrf)], "id=... or all=1"),
        (vec![("csrf", csrf), ("id", "")], "id=... or all=1"),
        (vec![("csrf", csrf), ("id", "1001"), ("all", "1")], "not both"),
        (vec![("csrf", csrf), ("topic", "invoice.issue")], "not a topic"),
        (vec![("csrf", csrf), ("id", "x")], "whole number"),
        (vec![("csrf", csrf), ("all", "yes")], "all must be 1"),
    ] {
        let (status, body) = post(&purge, &form).await;
        assert_eq!(status, 400, "{form:?}: {body}");
        assert!(body.contains(says), "{form:?}: {body}");
    }
    let (status, body) = post(&purge, &[("csrf", csrf), ("ids", "1001")]).await;
    assert_eq!(status, 422, "a misspelt field is refused: {body}");
    let dead = || async {
        db.client()
            .await
            .query_one("select count(*) from outbox_relay.dead_letters", &[])
            .await
            .unwrap()
            .get::<_, i64>(0)
    };
    assert_eq!(dead().await, 3, "no refused request purged anything");
    assert_eq!(post(&purge, &[("csrf", csrf), ("id", "1001")]).await.0, 303);
    assert_eq!(dead().await, 2);
    let (status, _) = post(&format!("{base}/actions/pause"), &[("csrf", csrf), ("topic", "")]).await;
    assert_eq!(status, 400, "an empty topic is not every topic");
    assert!(db.outbox.pauses().await.unwrap().is_empty());
    assert_eq!(post(&purge, &[("csrf", csrf), ("all", "1")]).await.0, 303);
    assert_eq!(dead().await, 0);
}

#[tokio::test]
async fn a_weak_token_is_refused_without_being_shown() {
    let db = TestDb::new().await;
    for token in ["short-tok-91", "has a space in it, 24 chars", "ééééééééé"] {
        let output = cli(&db.url, &["console", "--listen", "127.0.0.1:0", "--http-token", token]).await;
        assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
        assert!(stderr(&output).contains("--http-token"), "{}", stderr(&output));
        assert!(!stderr(&output).contains(token), "{}", stderr(&output));
    }
}

#[tokio::test]
async fn on_a_public_address_without_a_token_only_the_probes_and_metrics_are_served() {
    let db = TestDb::new().await;
    db.outbox.publish(&pg_outbox_relay::NewEvent::new("hr.update", json!({"ssn": "123-45-6789"}))).await.unwrap();
    let port = free_port();
    let console = spawn_console(&db.url, &["--listen", &format!("0.0.0.0:{port}")], None);
    let base = format!("http://127.0.0.1:{port}");
    assert!(until_status(&format!("{base}/metrics"), 200).await.contains("outbox_relay_database_up 1"));
    assert_eq!(get(&format!("{base}/readyz")).await.unwrap().0, 200);
    for path in ["/", "/?lookup=1", "/api/summary", "/api/events/1"] {
        let (status, body) = get(&format!("{base}{path}")).await.unwrap();
        assert_eq!(status, 403, "{path}");
        assert!(body.contains("--http-token") && !body.contains("123-45-6789"), "{path}: {body}");
    }
    let (status, _) = post(&format!("{base}/actions/pause"), &[("all", "1")]).await;
    assert_eq!(status, 403);
    assert!(db.outbox.pauses().await.unwrap().is_empty());
    drop(console);
}

/// A receiver that refuses every event (422, for good) until it is told to take them.
async fn receiver() -> (String, Arc<AtomicBool>, tokio::sync::mpsc::UnboundedReceiver<Value>) {
    use axum::routing::post;
    let accept = Arc::new(AtomicBool::new(false));
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let state = (accept.clone(), tx);
    let app = axum::Router::new()
        .route(
            "/hook",
            post(
                |axum::extract::State((accept, tx)): axum::extract::State<(
                    Arc<AtomicBool>,
                    tokio::sync::mpsc::UnboundedSender<Value>,
                )>,
                 axum::Json(body): axum::Json<Value>| async move {
                    if accept.load(Ordering::SeqCst) {
                        tx.send(body).ok();
                        axum::http::StatusCode::OK
                    } else {
                        axum::http::StatusCode::UNPROCESSABLE_ENTITY
                    }
                },
            ),
        )
        .with_state(state);
    let addr = crate::binary::serve(app).await;
    (format!("http://{addr}/hook"), accept, rx)
}

/// Debian's chromedriver and Chromium, headless (the test kit's `browser`; `.ci/run` installs
/// them).
struct Browser {
    client: fantoccini::Client,
    _driver: Chromedriver,
    _profile: tempfile::TempDir,
}

impl Browser {
    async fn start() -> Browser {
        let driver = Chromedriver::start();
        let profile = tempfile::tempdir().unwrap();
        let mut chrome = serde_json::Map::new();
        chrome.insert(
            "args".into(),
            json!([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                format!("--user-data-dir={}", profile.path().display()),
            ]),
        );
        chrome.insert("binary".into(), json!(chromium()));
        let mut capabilities = serde_json::Map::new();
        capabilities.insert("goog:chromeOptions".into(), Value::Object(chrome));
        let client = until("chromedriver starts a headless Chromium", || async {
            let connector = hyper_util::client::legacy::connect::HttpConnector::new();
            fantoccini::ClientBuilder::new(connector)
                .capabilities(capabilities.clone())
                .connect(&driver.url())
                .await
                .ok()
        })
        .await;
        Browser { client, _driver: driver, _profile: profile }
    }
}

/// The metrics read by the Prometheus project's Python client (`tools::python` names what is
/// missing).
mod needs_python {
    use super::*;

    #[tokio::test]
    async fn metrics_parse_with_the_documented_families_and_move_with_deliveries() {
        let db = TestDb::new().await;
        let port = free_port();
        let base = format!("http://127.0.0.1:{port}");
        let relay = spawn_run(&db.url, &["--sink", "stdout", "--http", &format!("127.0.0.1:{port}")]);
        until_status(&format!("{base}/readyz"), 200).await;
        let (status, before) = get(&format!("{base}/metrics")).await.unwrap();
        assert_eq!(status, 200);
        // The relay's families carry the destination: `default` for a single --sink.
        let delivered = r#"outbox_relay_events_delivered_total{destination="default"}"#;
        assert_eq!(sample(&before, delivered), Some(0.0), "{before}");

        for n in 0..3 {
            publish(&db, "order.placed", json!({"n": n})).await;
        }
        let url = format!("{base}/metrics");
        // The counter moves when the handler returns, the pending count once the claim's
        // transaction has committed: both, before the rest is read.
        let text = until("the delivered counter reaches 3 and nothing is pending", || async {
            let (_, text) = get(&url).await?;
            (sample(&text, delivered) == Some(3.0) && sample(&text, "outbox_relay_pending_events") == Some(0.0))
                .then_some(text)
        })
        .await;
        let families = parse_openmetrics(&text);
        let expected = [
            ("outbox_relay_events_delivered", "counter"),
            ("outbox_relay_events_retried", "counter"),
            ("outbox_relay_events_dead_lettered", "counter"),
            ("outbox_relay_delivery_latency_seconds", "histogram"),
            ("outbox_relay_pending_events", "gauge"),
            ("outbox_relay_oldest_pending_age_seconds", "gauge"),
            ("outbox_relay_dead_letters", "gauge"),
            ("outbox_relay_breaker_open", "gauge"),
            ("outbox_relay_notification_queue_usage_ratio", "gauge"),
            ("outbox_relay_claims", "counter"),
            ("outbox_relay_failed_claims", "counter"),
            ("outbox_relay_positions_rebased", "counter"),
            ("outbox_relay_claim_duration_seconds", "histogram"),
            ("outbox_relay_oldest_transaction_age_seconds", "gauge"),
            ("outbox_relay_xmin_horizon_age_transactions", "gauge"),
            ("outbox_relay_outbox_dead_tuples", "gauge"),
            ("outbox_relay_database_up", "gauge"),
            ("outbox_relay_listening", "gauge"),
            ("outbox_relay_paused", "gauge"),
            ("outbox_relay_unrouted_dead_letters", "gauge"),
            ("outbox_relay_destination_new_events", "gauge"),
            ("outbox_relay_destination_parked_events", "gauge"),
            ("outbox_relay_destination_dead_letters", "gauge"),
            ("outbox_relay_destination_relays", "gauge"),
        ];
        for (name, kind) in expected {
            let (found, _) = families.get(name).unwrap_or_else(|| panic!("no family {name} in\n{text}"));
            assert_eq!(found, kind, "{name}");
        }
        let value = |family: &str, sample: &str| {
            *families[family].1.get(sample).unwrap_or_else(|| panic!("no sample {sample} of {family} in\n{text}"))
        };
        // A family of the relay, or of a destination: its series for the destination `default`.
        let of_default = |family: &str, sample: &str| value(family, &format!("{sample}{{destination=\"default\"}}"));
        assert_eq!(of_default("outbox_relay_events_delivered", "outbox_relay_events_delivered_total"), 3.0);
        assert_eq!(of_default("outbox_relay_events_retried", "outbox_relay_events_retried_total"), 0.0);
        assert_eq!(
            of_default("outbox_relay_delivery_latency_seconds", "outbox_relay_delivery_latency_seconds_count"),
            3.0
        );
        assert!(of_default("outbox_relay_claims", "outbox_relay_claims_total") >= 1.0);
        assert_eq!(value("outbox_relay_database_up", "outbox_relay_database_up"), 1.0);
        assert_eq!(of_default("outbox_relay_listening", "outbox_relay_listening"), 1.0);
        assert_eq!(value("outbox_relay_pending_events", "outbox_relay_pending_events"), 0.0);
        assert_eq!(value("outbox_relay_unrouted_dead_letters", "outbox_relay_unrouted_dead_letters"), 0.0);
        assert_eq!(of_default("outbox_relay_destination_new_events", "outbox_relay_destination_new_events"), 0.0);
        assert_eq!(of_default("outbox_relay_destination_parked_events", "outbox_relay_destination_parked_events"), 0.0);
        assert_eq!(of_default("outbox_relay_destination_dead_letters", "outbox_relay_destination_dead_letters"), 0.0);
        assert_eq!(of_default("outbox_relay_destination_relays", "outbox_relay_destination_relays"), 1.0);
        // Nothing of the relay's without its destination: every series of its families is labelled.
        for (family, _) in expected.iter().filter(|(name, _)| {
            name.starts_with("outbox_relay_events_") || ["outbox_relay_claims", "outbox_relay_listening"].contains(name)
        }) {
            let unlabelled: Vec<&String> = families[*family].1.keys().filter(|k| !k.contains("destination=")).collect();
            assert!(unlabelled.is_empty(), "{family}: {unlabelled:?}");
        }
        assert_eq!(until_status(&format!("{base}/healthz"), 200).await, r#"{"status":"ok"}"#);
        assert_eq!(terminate(relay).await, Some(0));
    }
}

/// The console driven in a headless Chromium through chromedriver (the test kit's `browser`).
mod needs_browser {
    use super::*;

    #[tokio::test]
    async fn in_a_browser_a_dead_letter_is_shown_and_a_click_on_retry_delivers_it() {
        let db = TestDb::new().await;
        let (hook, accept, mut received) = receiver().await;
        let port = free_port();
        let base = format!("http://127.0.0.1:{port}");
        let relay = spawn_run(&db.url, &["--sink", &hook, "--http", &format!("127.0.0.1:{port}")]);
        until_status(&format!("{base}/readyz"), 200).await;
        let id = publish(&db, "invoice.issue", json!({"invoice": "F-7"})).await;
        eventually("the refused event is in the dead letters", || async {
            db.client()
                .await
                .query_one("select count(*) from outbox_relay.dead_letters where id = $1", &[&id])
                .await
                .unwrap()
                .get::<_, i64>(0)
                == 1
        })
        .await;
        accept.store(true, Ordering::SeqCst);

        let browser = Browser::start().await;
        let page = &browser.client;
        page.goto(&format!("{base}/")).await.unwrap();
        // The relay's concurrency limit, as the page's script refreshes it: "N (M in flight)".
        let limit = page.find(fantoccini::Locator::Id("limit")).await.unwrap().text().await.unwrap();
        let (n, in_flight) = limit.split_once(" (").unwrap_or_else(|| panic!("{limit:?}"));
        assert!(n.parse::<u32>().is_ok_and(|n| n >= 1) && in_flight.ends_with(" in flight)"), "{limit:?}");
        let row = page.find(fantoccini::Locator::Css(&format!("#dead-{id}"))).await.expect("the dead letter's row");
        let text = row.text().await.unwrap();
        assert!(text.contains("invoice.issue") && text.contains("422"), "{text}");
        // The payload, on demand.
        row.find(fantoccini::Locator::Css("summary")).await.unwrap().click().await.unwrap();
        until("the payload shows", || async {
            let shown = row.find(fantoccini::Locator::Css("pre")).await.ok()?.text().await.ok()?;
            shown.contains("F-7").then_some(())
        })
        .await;

        row.find(fantoccini::Locator::Css("form[action='/actions/retry'] button"))
            .await
            .unwrap()
            .click()
            .await
            .unwrap();
        let delivered =
            tokio::time::timeout(PATIENCE, received.recv()).await.expect("delivered after the retry").unwrap();
        assert_eq!(delivered["id"], json!(id), "{delivered}");
        let done = page.find(fantoccini::Locator::Css(".done")).await.expect("the console says what it did");
        assert_eq!(done.text().await.unwrap(), format!("retried dead letter {id}"));
        // Looked up: delivered to the destination, once the delivery is recorded: no copy
        // waiting for it, no dead letter.
        let found = until("the delivery recorded", || async {
            page.goto(&format!("{base}/?lookup={id}")).await.ok()?;
            let found = page.find(fantoccini::Locator::Id("lookup-result")).await.ok()?.text().await.ok()?;
            let waiting = ["pending", "waiting", "delayed", "retrying", "in flight", "dead"]
                .iter()
                .any(|state| found.contains(state));
            (!waiting).then_some(found)
        })
        .await;
        assert!(found.contains("delivered"), "{found}");

        browser.client.clone().close().await.unwrap();
        drop(browser);
        assert_eq!(terminate(relay).await, Some(0));
    }
}
