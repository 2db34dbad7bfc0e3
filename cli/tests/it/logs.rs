//! The relay's log as a log pipeline reads it (`--log-format json`), and what it says when
//! PostgreSQL goes away under it.

use pg_outbox_relay_cluster::StopMode;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::binary::{spawn_run, terminate_with_output};
use crate::http::migrated_private_cluster;
use crate::relay_support::PATIENCE;

async fn publish(client: &tokio_postgres::Client, n: i64) -> i64 {
    let payload = serde_json::json!({ "n": n });
    client.query_one("select outbox_relay.publish('order.placed', $1)", &[&payload]).await.unwrap().get(0)
}

/// Reads the relay's stdout until the event `id` is delivered.
async fn delivered(out: &mut tokio::io::Lines<BufReader<tokio::process::ChildStdout>>, id: i64) {
    tokio::time::timeout(PATIENCE, async {
        while let Some(line) = out.next_line().await.unwrap() {
            if serde_json::from_str::<Value>(&line).unwrap()["id"] == id {
                return;
            }
        }
        panic!("the relay's output ended before event {id}");
    })
    .await
    .unwrap_or_else(|_| panic!("event {id} was not delivered"));
}

/// Every line is one JSON object with the time, level, target and message, the relay's id and
/// the destination as fields; a restart of PostgreSQL under the relay is said once, with
/// PostgreSQL's reason, not once per pooled connection by deadpool.
#[tokio::test]
async fn json_logs_name_the_relay_and_destination_and_say_a_restart_once() {
    let (pg, url) = migrated_private_cluster().await;
    let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(connection);
    let mut relay = spawn_run(&url, &["--sink", "stdout", "--log-format", "json", "--workers", "4"]);
    let mut out = BufReader::new(relay.stdout.take().unwrap()).lines();
    let first = publish(&client, 1).await;
    delivered(&mut out, first).await;
    // Every pooled connection (the workers', the janitor's, ...) ends at once.
    let pg = tokio::task::spawn_blocking(move || {
        pg.restart(StopMode::Fast).unwrap();
        pg
    })
    .await
    .unwrap();
    let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(connection);
    let second = publish(&client, 2).await;
    delivered(&mut out, second).await;
    let output = terminate_with_output(relay).await;
    drop(pg);

    let log = String::from_utf8_lossy(&output.stderr);
    let lines: Vec<Value> = log
        .lines()
        .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("not one JSON object ({e}): {line}")))
        .collect();
    for line in &lines {
        for field in ["time", "level", "target", "message"] {
            assert!(line[field].is_string(), "no {field}: {line}");
        }
        assert!(humantime::parse_rfc3339(line["time"].as_str().unwrap()).is_ok(), "{line}");
        assert!(!line["target"].as_str().unwrap().starts_with("deadpool"), "deadpool's own line: {line}");
    }
    let registered = lines
        .iter()
        .find(|l| l["message"].as_str().unwrap().starts_with("destination registered"))
        .unwrap_or_else(|| panic!("no line about the destination's registration in {log}"));
    assert_eq!(registered["level"], "INFO");
    assert_eq!((&registered["destination"], &registered["pattern"]), (&"default".into(), &"#".into()), "{registered}");
    let relay_id = registered["relay"].as_str().unwrap_or_else(|| panic!("no relay id: {registered}"));
    assert!(relay_id.len() == 8 && relay_id.chars().all(|c| c.is_ascii_hexdigit()), "{registered}");
    let starting = lines.iter().find(|l| l["message"] == "relay starting").unwrap_or_else(|| panic!("{log}"));
    assert_eq!((&starting["workers"], &starting["relay"]), (&4.into(), &relay_id.into()), "numbers stay numbers");
    let ended: Vec<&Value> =
        lines.iter().filter(|l| l["message"].as_str().unwrap().contains("a pooled connection to PostgreSQL")).collect();
    assert_eq!(ended.len(), 1, "the restart said once, not per connection: {ended:?}");
    assert_eq!(ended[0]["level"], "WARN");
    let said = ended[0]["message"].as_str().unwrap();
    // (the server's reason, 57P01, when the connection read it before the socket closed; under
    // load the first to notice may only see the socket close, or its reset when the server
    // exited with the connection's bytes unread)
    let reason = said.contains("ended: terminating connection due to administrator command [SQLSTATE 57P01]")
        || said.contains("ended: connection closed")
        || said.contains("ended: error communicating with the server: Connection reset by peer");
    assert!(reason && said.contains("opens a new one"), "{said}");
}

/// With `--log-format json`, the command's last error (printed after the log ends) is a JSON
/// line of the same shape too, so a pipeline reading stderr loses nothing.
#[tokio::test]
async fn json_logs_carry_the_commands_last_error_as_json() {
    let output = tokio::process::Command::new(crate::binary::BIN)
        .args(["status", "--log-format", "json", "--database-url", "postgres://app:hunter2@127.0.0.1:1/shop"])
        .output()
        .await
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    let log = String::from_utf8_lossy(&output.stderr);
    let lines: Vec<Value> =
        log.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"))).collect();
    let last = lines.last().expect("a line");
    assert_eq!(last["level"], "ERROR", "{last}");
    let message = last["message"].as_str().unwrap();
    assert!(message.contains("127.0.0.1:1") && !message.contains("hunter2"), "{message}");
}
