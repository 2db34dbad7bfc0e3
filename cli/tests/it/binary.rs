//! The `outbox-relay` binary, run for real: helpers for the tests that spawn it.

use std::process::{Output, Stdio};

use serde_json::Value;
use tokio::process::{Child, Command};

use crate::harness::TestDb;
use crate::relay_support::PATIENCE;

pub const BIN: &str = env!("CARGO_BIN_EXE_outbox-relay");

/// Runs the binary to completion.
pub async fn cli(url: &str, args: &[&str]) -> Output {
    cli_within(url, args, PATIENCE).await
}

/// Runs the binary to completion, for at most `limit` (a benchmark, beside other tests).
pub async fn cli_within(url: &str, args: &[&str], limit: std::time::Duration) -> Output {
    let run = Command::new(BIN).args(args).env("DATABASE_URL", url).env("RUST_LOG", "warn").output();
    tokio::time::timeout(limit, run).await.expect("command hung").expect("cannot run the binary")
}

pub fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

pub fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Starts `outbox-relay run` with these arguments (delivered rows are kept for the default
/// retention, an hour, so that tests can read what became of each event).
pub fn spawn_run(url: &str, args: &[&str]) -> Child {
    spawn_run_as_shipped(url, args)
}

/// Starts `outbox-relay run` with exactly these arguments.
pub fn spawn_run_as_shipped(url: &str, args: &[&str]) -> Child {
    spawn_run_as_shipped_with_env(url, args, &[])
}

/// [`spawn_run`] with these environment variables too.
pub fn spawn_run_with_env(url: &str, args: &[&str], env: &[(&str, &str)]) -> Child {
    spawn_run_as_shipped_with_env(url, args, env)
}

fn spawn_run_as_shipped_with_env(url: &str, args: &[&str], env: &[(&str, &str)]) -> Child {
    Command::new(BIN)
        .arg("run")
        .args(args)
        .envs(env.iter().copied())
        .env("DATABASE_URL", url)
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("cannot start outbox-relay run")
}

/// Sends SIGTERM (as an orchestrator stops a process).
pub fn send_sigterm(child: &Child) {
    let pid = child.id().expect("running").to_string();
    let sent = std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(sent.success());
}

/// Sends SIGTERM and returns the exit code.
pub async fn terminate(mut child: Child) -> Option<i32> {
    send_sigterm(&child);
    let status = tokio::time::timeout(PATIENCE, child.wait()).await.expect("did not stop after SIGTERM").unwrap();
    status.code()
}

/// Sends SIGTERM and returns what the process printed (its stderr holds the logs).
pub async fn terminate_with_output(child: Child) -> Output {
    send_sigterm(&child);
    tokio::time::timeout(PATIENCE, child.wait_with_output()).await.expect("did not stop after SIGTERM").unwrap()
}

pub async fn publish(db: &TestDb, topic: &str, payload: Value) -> i64 {
    db.client().await.query_one("select outbox_relay.publish($1, $2)", &[&topic, &payload]).await.unwrap().get(0)
}

/// Serves `app` on a free port of 127.0.0.1 (a receiver for the HTTP sink) and returns its address.
pub async fn serve(app: axum::Router) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}
