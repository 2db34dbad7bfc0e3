//! A NATS server with JetStream for the tests of the NATS sink: the one `NATS_URL` names when it
//! is set; otherwise a private `nats-server -js` that this process starts once, on a free port of
//! 127.0.0.1 with its store in a temporary directory, as the harness does with PostgreSQL.
//!
//! The private server outlives no test process: a small detached watchdog (`/bin/sh`, like the
//! throwaway cluster's) stops it and removes its directory once the process is gone (a value in
//! a `static` is never dropped). Without `NATS_URL` and without `nats-server`, a test fails with
//! a message that says what to install.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::support::free_port;
use crate::tools::{answers, find_program, log_tail, private_dir, spawn_watchdog};

/// How to get `nats-server`, for the messages.
const INSTALL: &str = "Debian: apt install nats-server; or set NATS_URL to a server with JetStream";

/// How long a starting server may take to accept connections.
const START_PATIENCE: Duration = Duration::from_secs(20);

/// The server every NATS test of this process uses.
pub struct Nats {
    url: String,
    /// The private server and its directory; `None` with `NATS_URL`.
    _private: Option<Private>,
}

struct Private {
    _server: Child,
    _watchdog: Child,
    _dir: PathBuf,
}

static NATS: OnceLock<Nats> = OnceLock::new();

/// The URL of the NATS server, started on first use; fails the test when there is none.
pub fn url() -> String {
    NATS.get_or_init(Nats::find_or_start).url.clone()
}

impl Nats {
    fn find_or_start() -> Nats {
        match std::env::var("NATS_URL") {
            Ok(url) if !url.is_empty() => {
                if let Err(e) = answers(&url, 4222) {
                    panic!(
                        "no NATS server answers at NATS_URL={url} ({e}); unset NATS_URL to let the tests start nats-server ({INSTALL})"
                    )
                }
                Nats { url, _private: None }
            }
            _ => {
                let Some(binary) = find_program("nats-server") else {
                    panic!(
                        "this test needs NATS with JetStream: nats-server is not on PATH and NATS_URL is not set ({INSTALL})"
                    )
                };
                let (url, private) =
                    start(&binary, None).unwrap_or_else(|e| panic!("could not start nats-server: {e}"));
                Nats { url, _private: Some(private) }
            }
        }
    }
}

/// A private `nats-server -js` of one test, on a port the test chose (a destination that comes
/// up after the relay); stopped when dropped.
pub struct LateNats {
    /// `nats://127.0.0.1:PORT`.
    pub url: String,
    private: Private,
}

impl LateNats {
    /// Starts `nats-server -js` on `port`; fails the test when it cannot.
    pub fn start_on(port: u16) -> LateNats {
        let Some(binary) = find_program("nats-server") else {
            panic!("this test needs nats-server on PATH ({INSTALL})")
        };
        let (url, private) = start(&binary, Some(port)).unwrap_or_else(|e| panic!("could not start nats-server: {e}"));
        LateNats { url, private }
    }
}

impl Drop for LateNats {
    fn drop(&mut self) {
        let _ = self.private._server.kill();
        let _ = self.private._server.wait();
        let _ = std::fs::remove_dir_all(&self.private._dir);
    }
}

/// Starts `nats-server -js` on `port`, or on a free port (another one if that got taken
/// meanwhile).
fn start(binary: &std::path::Path, port: Option<u16>) -> Result<(String, Private), String> {
    let dir = private_dir("nats")?;
    let mut last_error = String::new();
    for _ in 0..3 {
        let port = port.unwrap_or_else(free_port);
        let log = std::fs::File::create(dir.join("log")).map_err(|e| format!("creating its log: {e}"))?;
        let mut server = Command::new(binary)
            .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
            .arg(dir.join("store"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("spawning {}: {e}", binary.display()))?;
        let url = format!("nats://127.0.0.1:{port}");
        let deadline = Instant::now() + START_PATIENCE;
        loop {
            if answers(&url, 4222).is_ok() {
                std::fs::write(dir.join("pid"), server.id().to_string())
                    .map_err(|e| format!("writing its pid: {e}"))?;
                let watchdog = spawn_watchdog("nats-server", &dir)?;
                return Ok((url, Private { _server: server, _watchdog: watchdog, _dir: dir }));
            }
            if let Ok(Some(status)) = server.try_wait() {
                last_error = format!("nats-server exited ({status}): {}", log_tail(&dir));
                break;
            }
            if Instant::now() > deadline {
                let _ = server.kill();
                let _ = server.wait();
                last_error =
                    format!("nats-server did not accept connections within {START_PATIENCE:?}: {}", log_tail(&dir));
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    Err(last_error)
}
