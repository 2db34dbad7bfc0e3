//! Secrets never reach logs, errors or output: database passwords of every shape the
//! connection-string grammars allow, and sink credentials.

use std::process::Stdio;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

use crate::binary::{BIN, cli, stderr, stdout};
use crate::harness::TestDb;
use crate::relay_support::{PATIENCE, eventually};

/// The password of the database URL never reaches the logs, errors or output.
#[tokio::test]
async fn the_password_never_appears_in_logs_or_errors() {
    let db = TestDb::new().await;
    // The test server trusts local connections, so a password in the URL is accepted and unused.
    let with_password = db.url.replacen("://postgres@", "://postgres:s3cr3t-pw@", 1);
    assert_ne!(with_password, db.url, "the test URL has the expected shape");
    let mut child = Command::new(BIN)
        .args(["run", "--sink", "stdout"])
        .env("DATABASE_URL", &with_password)
        .env("RUST_LOG", "debug")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut errors = BufReader::new(child.stderr.take().unwrap()).lines();
    // wait until it logged its start (which names the database)
    loop {
        let line = tokio::time::timeout(PATIENCE, errors.next_line()).await.unwrap().unwrap().expect("log line");
        assert!(!line.contains("s3cr3t-pw"), "{line}");
        if line.contains("relay starting") {
            assert!(line.contains("postgres:***@"), "{line}");
            break;
        }
    }
    let pid = child.id().unwrap().to_string();
    std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    while let Ok(Some(line)) = errors.next_line().await {
        assert!(!line.contains("s3cr3t-pw"), "{line}");
    }
    assert_eq!(child.wait().await.unwrap().code(), Some(0));

    // errors and the migrate report
    let bad = with_password.replacen(&format!("/{}", db.name), "/no_such_database", 1);
    for args in [&["status"][..], &["migrate"][..]] {
        let output = cli(&bad, args).await;
        assert!(!stderr(&output).contains("s3cr3t-pw") && !stdout(&output).contains("s3cr3t-pw"));
        assert!(stderr(&output).contains("no_such_database"), "{}", stderr(&output));
    }
    let migrate = cli(&with_password, &["migrate"]).await;
    assert!(stdout(&migrate).contains("postgres:***@"), "{}", stdout(&migrate));
    assert!(!stdout(&migrate).contains("s3cr3t-pw"));
    // Debug of the library's handles
    let outbox = pg_outbox_relay::Outbox::connect(&with_password).await.unwrap();
    let debug = format!("{outbox:?} {:?} {}", outbox.url(), outbox.url());
    assert!(!debug.contains("s3cr3t-pw") && debug.contains("***"), "{debug}");
}

/// The passwords that leaked before: a `/` (the text redaction cut at it), an `@` (tokio-postgres
/// reads the credentials to the first one), a string that does not parse, a quoted value with a
/// space (whose settings after it were dropped, sslmode among them).
#[tokio::test]
async fn odd_passwords_never_appear_and_every_setting_is_kept() {
    let db = TestDb::new().await;
    let with_slash = db.url.replacen("://postgres@", "://postgres:right/pw+x@", 1);
    for args in [&["migrate"][..], &["status"][..]] {
        let output = cli(&with_slash, args).await;
        assert!(output.status.success(), "{args:?}: {}", stderr(&output));
        let all = format!("{}{}", stdout(&output), stderr(&output));
        assert!(!all.contains("right/pw") && !all.contains("pw+x"), "{args:?}: {all}");
    }
    let migrate = stdout(&cli(&with_slash, &["migrate"]).await);
    assert!(migrate.contains("postgres:***@127.0.0.1"), "{migrate}");
    let bad_db = with_slash.replacen(&format!("/{}", db.name), "/no_such_database", 1);
    let status = cli(&bad_db, &["status"]).await;
    assert!(!stderr(&status).contains("pw+x") && stderr(&status).contains("no_such_database"), "{}", stderr(&status));

    let with_at = db.url.replacen("://postgres@", "://postgres:s3c@ret@", 1);
    let output = cli(&with_at, &["status"]).await;
    assert_eq!(output.status.code(), Some(2), "a malformed URL is a bad argument");
    assert!(!stderr(&output).contains("ret@") && !stderr(&output).contains("s3c"), "{}", stderr(&output));
    assert!(stderr(&output).contains("%40"), "{}", stderr(&output));

    let config: tokio_postgres::Config = db.url.parse().unwrap();
    let port = config.get_ports()[0];
    for unparseable in [
        "POSTGRES://postgres:upper-s3cret@127.0.0.1:1/x".to_string(),
        format!("host=127.0.0.1 port={port} PASSWORD=upper-s3cret"),
        format!("host=127.0.0.1 port={port} password='upper-s3cret"),
        "host=127.0.0.1 upper-s3cret".to_string(),
    ] {
        let output = cli(&unparseable, &["status"]).await;
        assert!(!output.status.success(), "{unparseable}");
        assert!(!stderr(&output).contains("upper-s3cret"), "{unparseable}: {}", stderr(&output));
    }
    // libpq's key=value form with spaces around '=' and a quoted value with a space in it
    let spaced = format!("host = 127.0.0.1 port = {port} user=postgres password = 'x y' dbname={}", db.name);
    let output = cli(&spaced, &["status"]).await;
    assert!(output.status.success(), "{}", stderr(&output));
    // ... and what follows a quoted value is kept: sslmode=require against a server without TLS
    let require = format!("host=127.0.0.1 port={port} user=postgres password='x y' sslmode=require dbname={}", db.name);
    let output = cli(&require, &["status"]).await;
    assert!(!output.status.success(), "sslmode=require was dropped: the relay connected in plaintext");
    assert!(!stderr(&output).contains("x y"), "{}", stderr(&output));
}

/// The credentials of a sink URL stay out of the `delivering` line, the failure warnings,
/// `last_error` and the dead-letter listing; a NATS URL's password out of its connect error.
#[tokio::test]
async fn sink_credentials_never_appear_in_the_binary_output() {
    let db = TestDb::new().await;
    let sink = "http://hook-user:hook-s3cret@127.0.0.1:1/hooks?token=t0ken";
    let mut child = Command::new(BIN)
        .args(["run", "--sink", sink, "--max-attempts", "1"])
        .env("DATABASE_URL", &db.url)
        .env("RUST_LOG", "debug")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    // Read as it is written: a debug log left in its pipe would stop the relay once the pipe is full.
    let mut log = BufReader::new(child.stderr.take().unwrap()).lines();
    let reader = tokio::spawn(async move {
        let mut lines = Vec::new();
        while let Ok(Ok(Some(line))) = tokio::time::timeout(PATIENCE, log.next_line()).await {
            lines.push(line);
        }
        lines
    });
    crate::binary::publish(&db, "order.placed", serde_json::json!({})).await;
    // (a refused connection spends no attempt: the event waits, its error recorded)
    eventually("the failure recorded", || async {
        db.outbox.pending_errors(5).await.unwrap().iter().any(|e| e.error.contains("127.0.0.1:1/hooks"))
    })
    .await;
    let pid = child.id().unwrap().to_string();
    std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    let lines = reader.await.unwrap();
    child.wait().await.unwrap();
    let all = lines.join("\n");
    // (the `delivering` line names each destination with its pattern and its sink)
    assert!(all.contains("destinations=default (#) -> http://hook-user:***@127.0.0.1:1/hooks?token=***"), "{all}");
    assert!(!all.contains("hook-s3cret") && !all.contains("t0ken"), "{all}");
    for args in [&["dead-letters", "list"][..], &["dead-letters", "list", "--json"][..], &["status", "--json"][..]] {
        let out = stdout(&cli(&db.url, args).await);
        assert!(!out.contains("hook-s3cret") && !out.contains("t0ken"), "{args:?}: {out}");
    }
    let nats = cli(
        &db.url,
        &["run", "--sink", "nats://nats-user:nats-s3cret@127.0.0.1:1", "--timeout", "500ms", "--exit-on-sink-error"],
    )
    .await;
    let err = stderr(&nats);
    assert!(err.contains("cannot connect to NATS at nats://nats-user:***@127.0.0.1:1"), "{err}");
    assert!(!err.contains("nats-s3cret"), "{err}");
}
