//! A private, throwaway PostgreSQL cluster for tests, `demo` and `bench`.
//!
//! [`EmbeddedPostgres::start`] builds a brand-new cluster in a temporary directory
//! (`$TMPDIR/outbox-relay-pg-XXXXXX`) and starts a server on a free TCP port of `127.0.0.1`.
//! Nothing outside that directory is used: the Unix socket lives inside it too, so a system
//! server (and `/var/run/postgresql`) is never touched.
//!
//! # What it needs
//!
//! The PostgreSQL *server* binaries `initdb`, `pg_ctl` and `postgres`. They are searched for on
//! `PATH` first (a symlink such as `/usr/local/bin/initdb` is followed to the real installation
//! directory, so `pg_ctl` and `postgres` are taken from next to the real `initdb`), then in
//! `/usr/lib/postgresql/*/bin`, highest version first. `psql` is not needed.
//!
//! `initdb` refuses to run as root. When the effective uid is 0 the cluster is therefore created
//! and run as the `postgres` system user (looked up in `/etc/passwd`), and the temporary
//! directory is handed over to it. Otherwise everything runs as the current user.
//!
//! # The cluster
//!
//! * Authentication is `trust`; the superuser is `postgres`; encoding UTF8, locale `C`, time zone
//!   UTC. Connect with [`EmbeddedPostgres::url`], e.g. `postgres://postgres@127.0.0.1:PORT/postgres`.
//! * `max_connections=200`, `shared_buffers=128MB`.
//! * Unless [`EmbeddedOptions::durable`] is set, `fsync` and `full_page_writes` are off (and
//!   `initdb --no-sync` is used): fast, but a crash of the *machine* may lose data, which does not
//!   matter for a throwaway cluster. `synchronous_commit` stays on, so an acknowledged commit
//!   survives a restart of the server. Benchmarks should set `durable` to measure realistic
//!   commit costs.
//!
//! Starting takes roughly one to three seconds (mostly `initdb`). All methods block; from async
//! code call them through `tokio::task::spawn_blocking` (or before the runtime starts).
//!
//! # Cleanup
//!
//! Dropping an [`EmbeddedPostgres`] stops the server (`pg_ctl stop -m immediate`) and deletes the
//! temporary directory. Because a process may die without running destructors (SIGKILL, a panic
//! with `panic = "abort"`, or a value kept in a `static OnceLock`, whose `Drop` never runs), every
//! cluster also has a small detached watchdog (`/bin/sh`, in its own process group, stdio on
//! `/dev/null`) that polls once a second whether this process is still alive and, once it is not,
//! stops the server and removes the directory. So a leaked cluster outlives its owner by about
//! one second. `Drop` kills the watchdog after cleaning up itself.
//!
//! Unix only: the crate is empty elsewhere.

#![cfg(unix)]
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod ctl;
mod settings;
mod system;
#[cfg(test)]
mod tests;
mod watchdog;

use std::io;
use std::path::Path;
use std::process::Child;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Instant;

use pg_outbox_relay::DatabaseUrl;
use tempfile::TempDir;

pub use self::settings::{EmbeddedError, StopMode};

use self::ctl::Ctl;
use self::settings::{HOST, PORT_ATTEMPTS, SUPERUSER, SYSTEM_USER};
use self::system::{create_temp_dir, effective_uid, find_binaries, free_port, lookup_user};
use self::watchdog::spawn_watchdog;

/// Options for an embedded cluster.
#[derive(Debug, Clone, Default)]
pub struct EmbeddedOptions {
    /// Keep fsync and full_page_writes on (for benchmarks). Defaults to false: fsync=off and
    /// full_page_writes=off for fast tests; synchronous_commit stays on either way, so commits
    /// survive a server restart.
    pub durable: bool,
}

/// A private PostgreSQL server in a temporary directory; stopped and deleted on drop.
///
/// `EmbeddedPostgres` is `Send + Sync`, so it can live in a `static OnceLock` shared by tests
/// (the watchdog then cleans up when the test process exits).
#[derive(Debug)]
pub struct EmbeddedPostgres {
    /// Paths and settings used to drive pg_ctl.
    ctl: Ctl,
    /// Whether we believe the server is running.
    running: AtomicBool,
    /// Serialises [`EmbeddedPostgres::restart`] calls, which only take `&self`.
    control: Mutex<()>,
    /// The watchdog that cleans up if this process dies without running `Drop`.
    watchdog: Option<Child>,
    /// The directory holding data dir, socket dir and log; `None` once removed.
    temp_dir: Option<TempDir>,
}

impl EmbeddedPostgres {
    /// Blocking: find binaries, initdb, start on a free 127.0.0.1 port, wait until it accepts connections.
    ///
    /// # Errors
    ///
    /// [`EmbeddedError::BinariesNotFound`], [`EmbeddedError::NoPostgresUser`] (as root), and I/O,
    /// command or timeout errors; everything created so far is cleaned up before returning.
    pub fn start(options: EmbeddedOptions) -> Result<Self, EmbeddedError> {
        let started = Instant::now();
        let binaries = find_binaries()?;
        tracing::debug!(bin_dir = %binaries.dir.display(), "using PostgreSQL binaries");

        let run_as = if effective_uid() == Some(0) {
            let user = lookup_user(SYSTEM_USER).ok_or(EmbeddedError::NoPostgresUser)?;
            tracing::debug!(uid = user.uid, gid = user.gid, "running as root: using the postgres system user");
            Some(user)
        } else {
            None
        };

        let temp_dir = create_temp_dir(run_as)?;
        let root = temp_dir.path().to_path_buf();
        let ctl = Ctl {
            pg_ctl: binaries.pg_ctl.clone(),
            run_as,
            data_dir: root.join("data"),
            socket_dir: root.join("socket"),
            log_file: root.join("server.log"),
            root,
            port: 0,
            durable: options.durable,
        };
        tracing::debug!(dir = %ctl.root.display(), "created embedded PostgreSQL directory");

        // From here on, `Drop` (and, should we die, the watchdog) cleans up.
        let watchdog = spawn_watchdog(&ctl)?;
        let mut pg = EmbeddedPostgres {
            ctl,
            running: AtomicBool::new(false),
            control: Mutex::new(()),
            watchdog: Some(watchdog),
            temp_dir: Some(temp_dir),
        };

        let initdb_started = Instant::now();
        pg.ctl.initdb(&binaries.initdb)?;
        tracing::debug!(elapsed_ms = initdb_started.elapsed().as_millis(), "initdb done");

        pg.start_on_free_port()?;
        tracing::info!(
            port = pg.ctl.port,
            dir = %pg.ctl.root.display(),
            durable = options.durable,
            elapsed_ms = started.elapsed().as_millis(),
            "embedded PostgreSQL started"
        );
        Ok(pg)
    }

    /// The TCP port the server listens on.
    pub fn port(&self) -> u16 {
        self.ctl.port
    }

    /// The host the server listens on: `127.0.0.1`.
    pub fn host(&self) -> &str {
        HOST
    }

    /// The connection URL of the `postgres` database: `postgres://postgres@127.0.0.1:PORT/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://{SUPERUSER}@{HOST}:{}/postgres", self.ctl.port)
    }

    /// [`url`](Self::url), parsed: derive the URL of another database with
    /// [`DatabaseUrl::for_database`].
    pub fn database_url(&self) -> DatabaseUrl {
        DatabaseUrl::parse(&self.url()).expect("the embedded cluster's URL parses")
    }

    /// The cluster's data directory (inside the temporary directory).
    pub fn data_dir(&self) -> &Path {
        &self.ctl.data_dir
    }

    /// Restart (`pg_ctl restart -m MODE -w`) on the same port; used by fault tests.
    ///
    /// Existing connections are broken (with [`StopMode::Smart`] the restart waits for them to
    /// close). Returns once the server accepts TCP connections again. Also starts a stopped server.
    ///
    /// # Errors
    ///
    /// [`EmbeddedError::CommandFailed`] or [`EmbeddedError::Timeout`], with the server log's tail.
    pub fn restart(&self, mode: StopMode) -> Result<(), EmbeddedError> {
        let _guard = self.control.lock().unwrap_or_else(PoisonError::into_inner);
        tracing::debug!(port = self.ctl.port, mode = mode.as_arg(), "restarting embedded PostgreSQL");
        let log_offset = self.ctl.log_len();
        self.running.store(true, Ordering::SeqCst);
        self.ctl.pg_ctl_restart(mode, log_offset)?;
        self.ctl.wait_for_tcp(log_offset)?;
        tracing::info!(port = self.ctl.port, mode = mode.as_arg(), "embedded PostgreSQL restarted");
        Ok(())
    }

    /// Stop (`pg_ctl stop -m MODE -w`). Idempotent: stopping a stopped server succeeds.
    ///
    /// # Errors
    ///
    /// [`EmbeddedError::CommandFailed`] or [`EmbeddedError::Timeout`] if the server is still running.
    pub fn stop(&mut self, mode: StopMode) -> Result<(), EmbeddedError> {
        if !self.ctl.pid_file().exists() {
            *self.running.get_mut() = false;
            return Ok(());
        }
        tracing::debug!(port = self.ctl.port, mode = mode.as_arg(), "stopping embedded PostgreSQL");
        match self.ctl.pg_ctl_stop(mode) {
            Ok(()) => {}
            // It went away by itself meanwhile (or the pid file was stale): stopped is stopped.
            Err(_) if !self.ctl.pid_file().exists() => {}
            Err(err) => return Err(err),
        }
        *self.running.get_mut() = false;
        tracing::info!(port = self.ctl.port, "embedded PostgreSQL stopped");
        Ok(())
    }

    /// Start again after [`stop`](Self::stop), with the same data directory and port.
    ///
    /// Does nothing if the server is running.
    ///
    /// # Errors
    ///
    /// [`EmbeddedError::CommandFailed`] (e.g. another process took the port meanwhile) or
    /// [`EmbeddedError::Timeout`], with the server log's tail.
    pub fn start_again(&mut self) -> Result<(), EmbeddedError> {
        if *self.running.get_mut() && self.ctl.pid_file().exists() {
            return Ok(());
        }
        let log_offset = self.ctl.log_len();
        *self.running.get_mut() = true;
        self.ctl.pg_ctl_start(log_offset)?;
        self.ctl.wait_for_tcp(log_offset)?;
        tracing::info!(port = self.ctl.port, "embedded PostgreSQL started again");
        Ok(())
    }

    /// Picks a free port and starts the server, retrying if the port got taken meanwhile.
    fn start_on_free_port(&mut self) -> Result<(), EmbeddedError> {
        let mut attempt = 1;
        loop {
            self.ctl.port = free_port()?;
            let log_offset = self.ctl.log_len();
            *self.running.get_mut() = true;
            match self.ctl.pg_ctl_start(log_offset) {
                Ok(()) => return self.ctl.wait_for_tcp(log_offset),
                Err(err) => {
                    *self.running.get_mut() = false;
                    if attempt >= PORT_ATTEMPTS || !self.ctl.port_taken_since(log_offset) {
                        return Err(err);
                    }
                    tracing::debug!(port = self.ctl.port, attempt, "port was taken meanwhile, retrying with another");
                    attempt += 1;
                }
            }
        }
    }
}

impl Drop for EmbeddedPostgres {
    /// Stops the server (`-m immediate`), kills the watchdog and removes the temporary directory.
    fn drop(&mut self) {
        let needs_stop = self.temp_dir.is_some() && (*self.running.get_mut() || self.ctl.pid_file().exists());
        if needs_stop
            && let Err(err) = self.ctl.pg_ctl_stop(StopMode::Immediate)
            && self.ctl.pid_file().exists()
        {
            // Leave the watchdog and the directory alone: the watchdog retries the stop (falling
            // back to signalling the postmaster) and removes the directory once we exit.
            tracing::warn!(error = %err, "could not stop embedded PostgreSQL; its watchdog will retry when this process exits");
            drop(self.watchdog.take());
            if let Some(dir) = self.temp_dir.take() {
                let _ = dir.keep();
            }
            return;
        }
        if let Some(mut child) = self.watchdog.take() {
            // Errors mean it has already exited; either way it is gone afterwards.
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some(dir) = self.temp_dir.take() {
            let path = dir.path().to_path_buf();
            match dir.close() {
                Ok(()) => tracing::debug!(dir = %path.display(), "removed embedded PostgreSQL directory"),
                Err(err) if err.kind() == io::ErrorKind::NotFound => {}
                Err(err) => {
                    tracing::warn!(dir = %path.display(), error = %err, "could not remove embedded PostgreSQL directory");
                }
            }
        }
    }
}
