//! `pg_ctl` and `initdb` for one cluster, as the right user, with the server log at hand for errors.

use std::ffi::OsString;
use std::fmt::Write as _;
use std::fs;
use std::io::{self, Read as _, Seek as _, SeekFrom};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use super::settings::{EmbeddedError, HOST, PG_CTL_TIMEOUT_SECS, READY_TIMEOUT, SUPERUSER, StopMode, TAIL_LINES};
use super::system::{RunAs, guc_list_item, sh_quote, tail};

/// Everything needed to run pg_ctl against this cluster.
#[derive(Debug)]
pub(super) struct Ctl {
    /// Path of pg_ctl (same directory as the initdb used).
    pub(super) pg_ctl: PathBuf,
    /// The user to run initdb/pg_ctl as, when we are root.
    pub(super) run_as: Option<RunAs>,
    /// The temporary directory.
    pub(super) root: PathBuf,
    /// `root/data`.
    pub(super) data_dir: PathBuf,
    /// `root/socket`, the only Unix socket directory.
    pub(super) socket_dir: PathBuf,
    /// `root/server.log`.
    pub(super) log_file: PathBuf,
    /// The TCP port.
    pub(super) port: u16,
    /// Whether fsync etc. stay on.
    pub(super) durable: bool,
}

impl Ctl {
    /// `data/postmaster.pid`, present while a server runs.
    pub(super) fn pid_file(&self) -> PathBuf {
        self.data_dir.join("postmaster.pid")
    }

    /// A command for `program`, running as the postgres user when we are root, in the temp dir,
    /// with stdin on /dev/null.
    pub(super) fn command(&self, program: &Path) -> Command {
        let mut cmd = Command::new(program);
        cmd.current_dir(&self.root).stdin(Stdio::null());
        // Ignore the caller's libpq/server environment; everything is given explicitly.
        for var in ["PGDATA", "PGPORT", "PGHOST", "PGCTLTIMEOUT"] {
            cmd.env_remove(var);
        }
        if let Some(user) = self.run_as {
            cmd.uid(user.uid).gid(user.gid);
        }
        cmd
    }

    /// Runs `initdb`.
    pub(super) fn initdb(&self, initdb: &Path) -> Result<(), EmbeddedError> {
        let mut cmd = self.command(initdb);
        cmd.arg("-D")
            .arg(&self.data_dir)
            .args(["-A", "trust", "-U", SUPERUSER, "-E", "UTF8", "--no-locale"])
            // Skips initdb's scan of /usr/share/zoneinfo and gives tests a fixed time zone.
            .env("TZ", "UTC");
        if !self.durable {
            cmd.arg("--no-sync");
        }
        self.run(cmd, "initdb", None).map(drop)
    }

    /// The `-o` string for pg_ctl (interpreted by `/bin/sh`, so each word is shell-quoted).
    pub(super) fn server_options(&self) -> String {
        let mut words = vec![
            "-c".to_owned(),
            format!("listen_addresses={HOST}"),
            "-p".to_owned(),
            self.port.to_string(),
            "-c".to_owned(),
            format!("unix_socket_directories={}", guc_list_item(&self.socket_dir.to_string_lossy())),
            "-c".to_owned(),
            "max_connections=200".to_owned(),
            "-c".to_owned(),
            "shared_buffers=128MB".to_owned(),
            // Writers that commit in two phases are tested too.
            "-c".to_owned(),
            "max_prepared_transactions=16".to_owned(),
        ];
        if !self.durable {
            // synchronous_commit stays on: an acknowledged commit is in the WAL (in the OS's
            // cache), so it survives a restart of the server, even `-m immediate`; only an
            // operating-system crash could lose it, which a throwaway cluster does not care about.
            for setting in ["fsync=off", "full_page_writes=off"] {
                words.push("-c".to_owned());
                words.push(setting.to_owned());
            }
        }
        words.iter().map(|word| sh_quote(word)).collect::<Vec<_>>().join(" ")
    }

    /// Arguments common to `pg_ctl start` and `pg_ctl restart`.
    pub(super) fn start_args(&self) -> Vec<OsString> {
        vec![
            "-D".into(),
            self.data_dir.clone().into(),
            "-w".into(),
            "-t".into(),
            PG_CTL_TIMEOUT_SECS.to_string().into(),
            "-l".into(),
            self.log_file.clone().into(),
            "-o".into(),
            self.server_options().into(),
        ]
    }

    /// `pg_ctl start -w`.
    pub(super) fn pg_ctl_start(&self, log_offset: u64) -> Result<(), EmbeddedError> {
        tracing::debug!(port = self.port, dir = %self.root.display(), "starting embedded PostgreSQL");
        let mut cmd = self.command(&self.pg_ctl);
        cmd.arg("start").args(self.start_args());
        self.run(cmd, "pg_ctl start", Some(log_offset)).map(drop)
    }

    /// `pg_ctl restart -m MODE -w`.
    pub(super) fn pg_ctl_restart(&self, mode: StopMode, log_offset: u64) -> Result<(), EmbeddedError> {
        let mut cmd = self.command(&self.pg_ctl);
        cmd.arg("restart").args(["-m", mode.as_arg()]).args(self.start_args());
        self.run(cmd, "pg_ctl restart", Some(log_offset)).map(drop)
    }

    /// `pg_ctl stop -m MODE -w`.
    pub(super) fn pg_ctl_stop(&self, mode: StopMode) -> Result<(), EmbeddedError> {
        let log_offset = self.log_len();
        let mut cmd = self.command(&self.pg_ctl);
        cmd.arg("stop")
            .arg("-D")
            .arg(&self.data_dir)
            .args(["-m", mode.as_arg(), "-w", "-t"])
            .arg(PG_CTL_TIMEOUT_SECS.to_string());
        self.run(cmd, "pg_ctl stop", Some(log_offset)).map(drop)
    }

    /// Runs a command to completion; on failure returns an error with its output and, if
    /// `log_offset` is given, the server log written since then.
    pub(super) fn run(&self, mut cmd: Command, name: &str, log_offset: Option<u64>) -> Result<Output, EmbeddedError> {
        tracing::debug!(command = ?cmd, "running");
        let output =
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).output().map_err(|err| {
                EmbeddedError::io(format!("could not run {name} ({})", cmd.get_program().display()), err)
            })?;
        if output.status.success() {
            return Ok(output);
        }
        let stderr = String::from_utf8_lossy(&output.stderr);
        let stdout = String::from_utf8_lossy(&output.stdout);
        let mut details = tail(if stderr.trim().is_empty() { &stdout } else { &stderr }, TAIL_LINES);
        if let Some(offset) = log_offset {
            let log = self.log_since(offset);
            if !log.trim().is_empty() {
                let _ =
                    write!(details, "\n--- {} (last lines) ---\n{}", self.log_file.display(), tail(&log, TAIL_LINES));
            }
        }
        if stderr.contains("did not start in time") {
            return Err(EmbeddedError::Timeout {
                what: format!("the server to start ({name})"),
                waited: Duration::from_secs(PG_CTL_TIMEOUT_SECS),
                details,
            });
        }
        if stderr.contains("does not shut down") {
            return Err(EmbeddedError::Timeout {
                what: format!("the server to shut down ({name})"),
                waited: Duration::from_secs(PG_CTL_TIMEOUT_SECS),
                details,
            });
        }
        Err(EmbeddedError::CommandFailed { command: name.to_owned(), status: output.status.to_string(), details })
    }

    /// Waits (bounded) until the port accepts TCP connections.
    pub(super) fn wait_for_tcp(&self, log_offset: u64) -> Result<(), EmbeddedError> {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, self.port));
        let started = Instant::now();
        loop {
            if TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_ok() {
                return Ok(());
            }
            if started.elapsed() >= READY_TIMEOUT {
                return Err(EmbeddedError::Timeout {
                    what: format!("{addr} to accept connections"),
                    waited: READY_TIMEOUT,
                    details: tail(&self.log_since(log_offset), TAIL_LINES),
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The current size of server.log (0 if it does not exist yet).
    pub(super) fn log_len(&self) -> u64 {
        fs::metadata(&self.log_file).map_or(0, |meta| meta.len())
    }

    /// What server.log received since `offset` (lossy UTF-8; empty if unreadable).
    pub(super) fn log_since(&self, offset: u64) -> String {
        let read = || -> io::Result<Vec<u8>> {
            let mut file = fs::File::open(&self.log_file)?;
            let len = file.metadata()?.len();
            file.seek(SeekFrom::Start(if offset > len { 0 } else { offset }))?;
            let mut bytes = Vec::new();
            file.read_to_end(&mut bytes)?;
            Ok(bytes)
        };
        read().map(|bytes| String::from_utf8_lossy(&bytes).into_owned()).unwrap_or_default()
    }

    /// Whether the server log since `offset` says the TCP port was already in use.
    pub(super) fn port_taken_since(&self, offset: u64) -> bool {
        self.log_since(offset).contains("Address already in use")
    }
}
