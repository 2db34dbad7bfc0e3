//! A headless Chromium for the console's browser test: `chromedriver` started on a free port of
//! 127.0.0.1 for one test, and stopped when it is dropped. Without chromedriver or Chromium, the
//! test fails with a message that says what to install.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::{PATIENCE, free_port};
use crate::tools::{answers, find_program, program};

const INSTALL: &str = "Debian: apt install chromium chromium-driver";

/// A running chromedriver, for a WebDriver client.
pub struct Chromedriver {
    process: Child,
    port: u16,
}

impl Chromedriver {
    /// Starts chromedriver on a free port and waits until it answers.
    pub fn start() -> Chromedriver {
        let driver = program("chromedriver", INSTALL);
        chromium();
        let port = free_port();
        let mut process = Command::new(driver)
            .arg(format!("--port={port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver starts");
        let url = format!("http://127.0.0.1:{port}");
        let deadline = Instant::now() + PATIENCE;
        while let Err(e) = answers(&url, port) {
            if let Ok(Some(status)) = process.try_wait() {
                panic!("chromedriver exited ({status}) before it answered at {url}");
            }
            assert!(Instant::now() < deadline, "chromedriver did not answer at {url} within {PATIENCE:?}: {e}");
            std::thread::sleep(Duration::from_millis(20));
        }
        Chromedriver { process, port }
    }

    /// Its WebDriver URL.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

impl Drop for Chromedriver {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}

/// The Chromium (or Chrome) binary chromedriver drives; fails the test when there is none.
pub fn chromium() -> PathBuf {
    ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .find_map(|name| find_program(name))
        .unwrap_or_else(|| panic!("this test needs Chromium, which is not on PATH ({INSTALL})"))
}
