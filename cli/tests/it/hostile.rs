//! What a hostile receiver, a row written by hand or a careless operator can give the command:
//! terminal escapes and bidi overrides never reach the operator's terminal raw, a database that
//! takes connections and answers nothing does not hang `status`, dead-letter actions on ids that
//! are not there do nothing and say so, and the console answers only to requests for itself.

use axum::http::StatusCode;
use axum::routing::post;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::binary::{cli, publish, serve, spawn_run, stderr, stdout, terminate_with_output};
use crate::harness::TestDb;
use crate::http::{http, spawn_console};
use crate::relay_support::{PATIENCE, eventually, free_port};

/// What a receiver puts in its error body to take over a terminal: clear the screen, set the
/// window title (OSC ... BEL), ring, and reverse the text that follows (U+202E).
const HOSTILE: &str = "\u{1b}[2J\u{1b}]0;owned\u{7}refused\u{202e}gnp.exe\u{2066}x\u{7f}\u{9b}1m";

fn raw_escapes(text: &str) -> Vec<char> {
    text.chars().filter(|c| matches!(*c, '\u{1b}' | '\u{7}' | '\u{202e}' | '\u{2066}' | '\u{7f}' | '\u{9b}')).collect()
}

#[tokio::test]
async fn a_receivers_escape_sequences_never_reach_the_terminal_raw() {
    let db = TestDb::new().await;
    let app = axum::Router::new().route("/hook", post(|| async { (StatusCode::UNPROCESSABLE_ENTITY, HOSTILE) }));
    let url = format!("http://{}/hook", serve(app).await);
    let child = spawn_run(&db.url, &["--sink", &url, "--max-attempts", "1"]);
    publish(&db, "order.placed", json!({"n": 1})).await;
    eventually("the refused event dead-lettered", || async {
        db.outbox.queue_stats().await.unwrap().dead_letters == 1
    })
    .await;
    let output = terminate_with_output(child).await;
    let logs = stderr(&output);
    assert!(logs.contains("moved to the dead letters"), "{logs}");
    assert!(raw_escapes(&logs).is_empty(), "raw {:?} in the log:\n{logs:?}", raw_escapes(&logs));
    assert!(logs.contains("\\u{1b}[2J") && logs.contains("\\u{202e}gnp.exe"), "shown escaped: {logs}");

    for args in [&["dead-letters", "list"][..], &["status"]] {
        let shown = cli(&db.url, args).await;
        assert!(shown.status.success(), "{args:?}: {}", stderr(&shown));
        let text = stdout(&shown);
        assert!(raw_escapes(&text).is_empty(), "{args:?}: raw {:?} in {text:?}", raw_escapes(&text));
    }
    // JSON output stays JSON that says what the error was.
    let listed = cli(&db.url, &["dead-letters", "list", "--json"]).await;
    let letters: Value = serde_json::from_str(stdout(&listed).trim()).unwrap();
    let error = letters[0]["last_error"].as_str().unwrap();
    assert!(error.contains("422") && error.contains("\\u{202e}gnp.exe"), "{error}");
    assert!(raw_escapes(&stdout(&listed)).is_empty());
}

/// A server that accepts TCP connections and never says a word (a frozen PostgreSQL, a hung
/// proxy): `status` gives up after the URL's connect_timeout with an error that says so.
#[tokio::test]
async fn status_against_a_server_that_never_answers_gives_up_after_connect_timeout() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    let url = format!("postgres://postgres:secret@127.0.0.1:{port}/x?connect_timeout=1");
    let output = cli(&url, &["status"]).await;
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    let err = stderr(&output);
    assert!(
        err.contains(&format!("PostgreSQL at 127.0.0.1:{port} did not complete the connection within 1s")),
        "{err}"
    );
    assert!(!err.contains("secret"), "{err}");
}

#[tokio::test]
async fn dead_letter_actions_on_missing_ids_do_nothing_and_say_so() {
    let db = TestDb::new().await;
    db.client()
        .await
        .batch_execute(
            "insert into outbox_relay.dead_letters (destination, id, topic, payload, created_at, attempts, last_error)
             values ('default', 1, 'a', '{}', now(), 1, 'x')",
        )
        .await
        .unwrap();
    let zero = cli(&db.url, &["dead-letters", "retry", "0"]).await;
    assert_eq!(zero.status.code(), Some(1));
    assert_eq!(stdout(&zero), "", "no 'retried 0' beside the error");
    assert!(stderr(&zero).contains("no dead letter with id 0: nothing was retried"), "{}", stderr(&zero));

    let partly = cli(&db.url, &["dead-letters", "retry", "1", "999", "998"]).await;
    assert_eq!(partly.status.code(), Some(1));
    assert!(stderr(&partly).contains("no dead letter with ids 998, 999: nothing was retried"), "{}", stderr(&partly));
    assert_eq!(db.outbox.queue_stats().await.unwrap().dead_letters, 1, "1 stays a dead letter");

    let one = cli(&db.url, &["dead-letters", "retry", "1"]).await;
    assert!(one.status.success() && stdout(&one).contains("retried 1 dead letters: 1"), "{}", stdout(&one));

    let bare = cli(&db.url, &["dead-letters", "purge"]).await;
    assert_eq!(bare.status.code(), Some(2));
    assert!(stderr(&bare).contains("--all") && stderr(&bare).contains("--older-than"), "{}", stderr(&bare));
}

/// Sends one raw HTTP/1.1 request to the console and returns the status code.
async fn raw_request(port: u16, request: &str) -> u16 {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(PATIENCE, stream.read_to_end(&mut answer)).await.expect("an answer").unwrap();
    let answer = String::from_utf8_lossy(&answer);
    answer.split(' ').nth(1).and_then(|code| code.parse().ok()).unwrap_or_else(|| panic!("no status in {answer}"))
}

#[tokio::test]
async fn the_console_answers_only_to_requests_for_itself() {
    let db = TestDb::new().await;
    let port = free_port();
    let console = spawn_console(&db.url, &["--listen", &format!("127.0.0.1:{port}")], None);
    let request =
        |target: &str, host: &str| format!("GET {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    eventually("the console serves", || async { tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_ok() })
        .await;
    assert_eq!(raw_request(port, &request("/healthz", &format!("127.0.0.1:{port}"))).await, 200);
    assert_eq!(raw_request(port, &request("/healthz", &format!("[::1]:{port}"))).await, 200);
    assert_eq!(raw_request(port, &request("/healthz", "localhost")).await, 200);
    for host in ["[::1]evil.com", "[::1]:80evil", "127.0.0.1:80x", "localhost:", "[::1", "127.0.0.1.evil.com"] {
        assert_eq!(raw_request(port, &request("/healthz", host)).await, 421, "Host: {host}");
    }
    for target in ["http://evil.example/healthz", "http://127.0.0.1/healthz"] {
        assert_eq!(raw_request(port, &request(target, &format!("127.0.0.1:{port}"))).await, 400, "{target}");
    }
    terminate_with_output(console).await;
}

/// Every process of a private cluster stopped with SIGSTOP (a frozen server: the kernel still
/// accepts connections and data, nothing answers), and started again with SIGCONT when dropped.
struct Frozen(Vec<String>);

impl Frozen {
    fn freeze(data_dir: &std::path::Path) -> Frozen {
        let pid_file = std::fs::read_to_string(data_dir.join("postmaster.pid")).unwrap();
        let postmaster = pid_file.lines().next().unwrap().trim().to_string();
        let children = std::process::Command::new("pgrep").args(["-P", &postmaster]).output().unwrap();
        let mut pids: Vec<String> =
            String::from_utf8_lossy(&children.stdout).split_whitespace().map(String::from).collect();
        pids.push(postmaster);
        let stopped = std::process::Command::new("kill").arg("-STOP").args(&pids).status().unwrap();
        assert!(stopped.success());
        Frozen(pids)
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill").arg("-CONT").args(&self.0).status();
    }
}

#[tokio::test]
async fn a_frozen_database_gets_answers_that_say_so_from_the_console_and_status() {
    use pg_outbox_relay_cluster::{EmbeddedOptions, EmbeddedPostgres};
    let pg = tokio::task::spawn_blocking(|| EmbeddedPostgres::start(EmbeddedOptions::default()))
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("cannot start a private PostgreSQL: {e}"));
    let url = pg.url();
    assert!(cli(&url, &["migrate"]).await.status.success());
    let port = free_port();
    let console = spawn_console(&url, &["--listen", &format!("127.0.0.1:{port}")], None);
    let http = http();
    let summary = format!("http://127.0.0.1:{port}/api/summary");
    eventually("the console serves", || async {
        http.get(&summary).timeout(PATIENCE).send().await.is_ok_and(|r| r.status().is_success())
    })
    .await;

    let frozen = Frozen::freeze(pg.data_dir());
    for page in ["/api/summary", "/"] {
        let answer = http.get(format!("http://127.0.0.1:{port}{page}")).timeout(PATIENCE).send().await;
        let answer = answer.unwrap_or_else(|e| panic!("{page} gave no answer while the database is frozen: {e}"));
        let status = answer.status().as_u16();
        let body = answer.text().await.unwrap();
        // the page shows what failed; the API says it with its status
        assert!(status == 503 || (page == "/" && status == 200), "{page}: {status} {body}");
        assert!(body.contains("did not answer within"), "{page}: {body}");
    }
    let status = cli(&format!("{url}?connect_timeout=2"), &["status"]).await;
    assert_eq!(status.status.code(), Some(1), "{}", stderr(&status));
    assert!(stderr(&status).contains("did not complete the connection within 2s"), "{}", stderr(&status));
    drop(frozen);

    eventually("the console answers again", || async {
        http.get(&summary).timeout(PATIENCE).send().await.is_ok_and(|r| r.status().is_success())
    })
    .await;
    terminate_with_output(console).await;
    drop(pg);
}
