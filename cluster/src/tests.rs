//! The cluster against real `initdb`, `pg_ctl` and `postgres`.

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::Command;

use super::settings::{HOST, StopMode};
use super::system::{
    RunAs, find_binaries, find_tool, guc_list_item, is_executable, parse_passwd, parse_version, sh_quote, tail,
};
use super::watchdog::watchdog_script;
use super::*;

/// Runs one query returning a single text value, over a real client connection.
fn query_text(url: &str, sql: &str) -> String {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    runtime.block_on(async {
        let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.expect("connect");
        let connection = tokio::spawn(connection);
        let value: String = client.query_one(sql, &[]).await.expect("query").get(0);
        drop(client);
        let _ = connection.await;
        value
    })
}

fn accepts(pg: &EmbeddedPostgres) -> bool {
    TcpStream::connect((pg.host(), pg.port())).is_ok()
}

#[test]
fn starts_accepts_connections_and_drop_removes_everything() {
    let pg = EmbeddedPostgres::start(EmbeddedOptions::default()).expect("start");
    assert_eq!(pg.host(), "127.0.0.1");
    assert_eq!(pg.url(), format!("postgres://postgres@127.0.0.1:{}/postgres", pg.port()));
    assert_eq!(pg.database_url().for_database("my db").config().get_dbname(), Some("my db"));
    assert!(pg.data_dir().join("PG_VERSION").is_file());
    assert!(accepts(&pg));
    assert_eq!(query_text(&pg.url(), "SHOW fsync"), "off");
    assert_eq!(query_text(&pg.url(), "SHOW unix_socket_directories"), pg.ctl.socket_dir.to_string_lossy());
    let root = pg.ctl.root.clone();
    let port = pg.port();
    drop(pg);
    assert!(!root.exists(), "{} still exists", root.display());
    assert!(TcpStream::connect((HOST, port)).is_err(), "server still listening on {port}");
}

#[test]
fn restart_keeps_the_port() {
    let pg = EmbeddedPostgres::start(EmbeddedOptions::default()).expect("start");
    let port = pg.port();
    pg.restart(StopMode::Fast).expect("restart fast");
    assert_eq!(pg.port(), port);
    assert!(accepts(&pg));
    pg.restart(StopMode::Immediate).expect("restart immediate");
    assert_eq!(query_text(&pg.url(), "SELECT 'ok'"), "ok");
}

#[test]
fn stop_is_idempotent_and_start_again_works() {
    let mut pg = EmbeddedPostgres::start(EmbeddedOptions::default()).expect("start");
    let port = pg.port();
    pg.stop(StopMode::Fast).expect("stop");
    assert!(!accepts(&pg));
    pg.stop(StopMode::Fast).expect("second stop");
    pg.start_again().expect("start again");
    assert_eq!(pg.port(), port);
    assert!(accepts(&pg));
    pg.start_again().expect("start again while running");
}

#[test]
fn durable_cluster_starts() {
    let pg = EmbeddedPostgres::start(EmbeddedOptions { durable: true }).expect("start");
    assert!(accepts(&pg));
    assert_eq!(query_text(&pg.url(), "SHOW fsync"), "on");
    assert_eq!(query_text(&pg.url(), "SHOW synchronous_commit"), "on");
}

/// Runs a second watchdog, for a process that has already exited (so it acts at once), with
/// the given user-switching tools, and checks that it stopped the server and removed the directory.
fn check_watchdog(runuser: Option<PathBuf>, su: Option<PathBuf>) {
    let pg = EmbeddedPostgres::start(EmbeddedOptions::default()).expect("start");
    let mut dead = Command::new("true").spawn().expect("spawn true");
    let dead_pid = dead.id();
    dead.wait().expect("wait");
    let script = watchdog_script(dead_pid, &pg.ctl, runuser, su);
    let status = Command::new("/bin/sh").arg("-c").arg(script).status().expect("run watchdog");
    assert!(status.success());
    assert!(!pg.ctl.root.exists());
    assert!(!accepts(&pg));
    drop(pg); // Must cope with everything being gone already.
}

#[test]
fn watchdog_cleans_up_after_a_dead_owner() {
    check_watchdog(find_tool("runuser"), find_tool("su"));
}

#[test]
fn watchdog_without_runuser_or_su() {
    check_watchdog(None, find_tool("su"));
    check_watchdog(None, None);
}

#[test]
fn start_again_on_a_taken_port_reports_the_log() {
    let mut pg = EmbeddedPostgres::start(EmbeddedOptions::default()).expect("start");
    pg.stop(StopMode::Immediate).expect("stop");
    let _squatter = TcpListener::bind((HOST, pg.port())).expect("bind the freed port");
    let err = pg.start_again().expect_err("port is taken");
    assert!(matches!(err, EmbeddedError::CommandFailed { .. }), "{err:?}");
    assert!(err.to_string().contains("Address already in use"), "{err}");
    assert!(pg.ctl.port_taken_since(0));
}

#[test]
fn is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<EmbeddedPostgres>();
}

#[test]
fn helpers() {
    assert_eq!(sh_quote("max_connections=200"), "max_connections=200");
    assert_eq!(sh_quote("a b"), "'a b'");
    assert_eq!(sh_quote("it's"), r"'it'\''s'");
    assert_eq!(sh_quote(""), "''");
    assert_eq!(guc_list_item("/tmp/x"), "/tmp/x");
    assert_eq!(guc_list_item("/tmp/a b"), "\"/tmp/a b\"");
    assert_eq!(parse_version("15"), Some(vec![15]));
    assert_eq!(parse_version("9.6"), Some(vec![9, 6]));
    assert_eq!(parse_version("common"), None);
    assert_eq!(tail("a\nb\nc\n", 2), "b\nc");
    let passwd = "root:x:0:0:root:/root:/bin/bash\npostgres:x:101:104:PostgreSQL administrator,,,:/var/lib/postgresql:/bin/bash\n";
    assert_eq!(parse_passwd(passwd, "postgres"), Some(RunAs { uid: 101, gid: 104 }));
    assert_eq!(parse_passwd(passwd, "post"), None);
}

#[test]
fn finds_binaries_next_to_the_real_initdb() {
    let binaries = find_binaries().expect("PostgreSQL binaries");
    assert!(is_executable(&binaries.initdb));
    assert_eq!(binaries.pg_ctl.parent(), binaries.initdb.parent());
}
