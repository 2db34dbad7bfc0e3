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

use std::ffi::OsString;
use std::fmt::Write as _;
use std::fs;
use std::io::{self, Read as _, Seek as _, SeekFrom};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use tempfile::TempDir;

/// The address the server listens on.
const HOST: &str = "127.0.0.1";
/// Prefix of the temporary directory holding the cluster.
const TEMP_PREFIX: &str = "outbox-relay-pg-";
/// The database superuser created by initdb.
const SUPERUSER: &str = "postgres";
/// The system user to run as when we are root.
const SYSTEM_USER: &str = "postgres";
/// `pg_ctl -t`: how long pg_ctl waits for a start or stop to complete.
const PG_CTL_TIMEOUT_SECS: u64 = 60;
/// How long to wait for the TCP port to accept connections after pg_ctl reported success.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How many free ports to try when the chosen one is taken before the server binds it.
const PORT_ATTEMPTS: usize = 5;
/// How many lines of server.log / stderr to put into errors.
const TAIL_LINES: usize = 20;
/// Directories searched for system tools (runuser, su) besides PATH.
const SYSTEM_TOOL_DIRS: [&str; 4] = ["/usr/sbin", "/sbin", "/usr/bin", "/bin"];

/// Options for an embedded cluster.
#[derive(Debug, Clone, Default)]
pub struct EmbeddedOptions {
    /// Keep fsync and full_page_writes on (for benchmarks). Defaults to false: fsync=off and
    /// full_page_writes=off for fast tests; synchronous_commit stays on either way, so commits
    /// survive a server restart.
    pub durable: bool,
}

/// How to stop or restart the server (maps to `pg_ctl -m`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopMode {
    /// Wait for all clients to disconnect, then shut down cleanly (may hit pg_ctl's 60 s timeout
    /// while connections stay open).
    Smart,
    /// Disconnect clients, roll back open transactions and shut down cleanly.
    Fast,
    /// Kill all server processes without a clean shutdown; the next start runs crash recovery.
    Immediate,
}

impl StopMode {
    /// The value of `pg_ctl -m`.
    fn as_arg(self) -> &'static str {
        match self {
            StopMode::Smart => "smart",
            StopMode::Fast => "fast",
            StopMode::Immediate => "immediate",
        }
    }
}

/// Errors starting or controlling the cluster.
#[derive(Debug, thiserror::Error)]
pub enum EmbeddedError {
    /// `initdb` and `pg_ctl` were not found.
    #[error(
        "PostgreSQL server binaries not found: looked for initdb and pg_ctl on PATH ({path}) and in \
         /usr/lib/postgresql/*/bin; install the PostgreSQL server package (e.g. `postgresql` on \
         Debian/Ubuntu), which provides initdb and pg_ctl, or put its bin directory on PATH"
    )]
    BinariesNotFound {
        /// The PATH that was searched.
        path: String,
    },
    /// Running as root, but there is no `postgres` system user to run the server as.
    #[error(
        "running as root, but there is no `postgres` system user (checked /etc/passwd and getent); \
         initdb refuses to run as root, so the embedded cluster runs as `postgres`: install the \
         PostgreSQL server package (which creates that user), create the user, or run as a non-root user"
    )]
    NoPostgresUser,
    /// A file system or process-spawning operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A command (initdb, pg_ctl) exited unsuccessfully.
    #[error("`{command}` failed ({status}): {details}")]
    CommandFailed {
        /// The command, e.g. `pg_ctl start`.
        command: String,
        /// How it exited.
        status: String,
        /// The tail of its stderr/stdout and, where relevant, of the server log.
        details: String,
    },
    /// The server did not become ready (or did not stop) in time.
    #[error("timed out after {}s waiting for {what}: {details}", waited.as_secs())]
    Timeout {
        /// What was awaited.
        what: String,
        /// How long we waited.
        waited: Duration,
        /// The tail of the server log (and command output, if any).
        details: String,
    },
}

impl EmbeddedError {
    /// Wraps an I/O error with context.
    fn io(context: impl Into<String>, source: io::Error) -> Self {
        EmbeddedError::Io { context: context.into(), source }
    }
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
        self.url_for("postgres")
    }

    /// The connection URL of another database on this server (the name is percent-encoded).
    pub fn url_for(&self, database: &str) -> String {
        format!("postgres://{SUPERUSER}@{HOST}:{}/{}", self.ctl.port, percent_encode(database))
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

/// A system user to run the server as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RunAs {
    /// User id.
    uid: u32,
    /// Primary group id.
    gid: u32,
}

/// Everything needed to run pg_ctl against this cluster.
#[derive(Debug)]
struct Ctl {
    /// Path of pg_ctl (same directory as the initdb used).
    pg_ctl: PathBuf,
    /// The user to run initdb/pg_ctl as, when we are root.
    run_as: Option<RunAs>,
    /// The temporary directory.
    root: PathBuf,
    /// `root/data`.
    data_dir: PathBuf,
    /// `root/socket`, the only Unix socket directory.
    socket_dir: PathBuf,
    /// `root/server.log`.
    log_file: PathBuf,
    /// The TCP port.
    port: u16,
    /// Whether fsync etc. stay on.
    durable: bool,
}

impl Ctl {
    /// `data/postmaster.pid`, present while a server runs.
    fn pid_file(&self) -> PathBuf {
        self.data_dir.join("postmaster.pid")
    }

    /// A command for `program`, running as the postgres user when we are root, in the temp dir,
    /// with stdin on /dev/null.
    fn command(&self, program: &Path) -> Command {
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
    fn initdb(&self, initdb: &Path) -> Result<(), EmbeddedError> {
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
    fn server_options(&self) -> String {
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
    fn start_args(&self) -> Vec<OsString> {
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
    fn pg_ctl_start(&self, log_offset: u64) -> Result<(), EmbeddedError> {
        tracing::debug!(port = self.port, dir = %self.root.display(), "starting embedded PostgreSQL");
        let mut cmd = self.command(&self.pg_ctl);
        cmd.arg("start").args(self.start_args());
        self.run(cmd, "pg_ctl start", Some(log_offset)).map(drop)
    }

    /// `pg_ctl restart -m MODE -w`.
    fn pg_ctl_restart(&self, mode: StopMode, log_offset: u64) -> Result<(), EmbeddedError> {
        let mut cmd = self.command(&self.pg_ctl);
        cmd.arg("restart").args(["-m", mode.as_arg()]).args(self.start_args());
        self.run(cmd, "pg_ctl restart", Some(log_offset)).map(drop)
    }

    /// `pg_ctl stop -m MODE -w`.
    fn pg_ctl_stop(&self, mode: StopMode) -> Result<(), EmbeddedError> {
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
    fn run(&self, mut cmd: Command, name: &str, log_offset: Option<u64>) -> Result<Output, EmbeddedError> {
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
    fn wait_for_tcp(&self, log_offset: u64) -> Result<(), EmbeddedError> {
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
    fn log_len(&self) -> u64 {
        fs::metadata(&self.log_file).map_or(0, |meta| meta.len())
    }

    /// What server.log received since `offset` (lossy UTF-8; empty if unreadable).
    fn log_since(&self, offset: u64) -> String {
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
    fn port_taken_since(&self, offset: u64) -> bool {
        self.log_since(offset).contains("Address already in use")
    }
}

/// The PostgreSQL binaries to use.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Binaries {
    /// The directory holding them.
    dir: PathBuf,
    /// `dir/initdb`.
    initdb: PathBuf,
    /// `dir/pg_ctl`.
    pg_ctl: PathBuf,
}

/// Finds initdb and pg_ctl (preferably with postgres) in one directory: PATH first, then
/// `/usr/lib/postgresql/*/bin`, highest version first.
fn find_binaries() -> Result<Binaries, EmbeddedError> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut candidates = Vec::new();
    for dir in std::env::split_paths(&path) {
        let initdb = dir.join("initdb");
        if dir.as_os_str().is_empty() || !is_executable(&initdb) {
            continue;
        }
        // Follow a symlinked initdb to its installation directory, where pg_ctl and postgres
        // live too (pg_ctl finds postgres next to its own resolved path).
        if let Some(real_dir) = fs::canonicalize(&initdb).ok().and_then(|real| real.parent().map(Path::to_path_buf)) {
            candidates.push(real_dir);
        }
        candidates.push(dir);
    }
    candidates.extend(versioned_bin_dirs(Path::new("/usr/lib/postgresql")));

    let has = |dir: &Path, name: &str| is_executable(&dir.join(name));
    let complete = candidates.iter().find(|dir| has(dir, "initdb") && has(dir, "pg_ctl") && has(dir, "postgres"));
    let usable = complete.or_else(|| candidates.iter().find(|dir| has(dir, "initdb") && has(dir, "pg_ctl")));
    match usable {
        Some(dir) => Ok(Binaries { initdb: dir.join("initdb"), pg_ctl: dir.join("pg_ctl"), dir: dir.clone() }),
        None => Err(EmbeddedError::BinariesNotFound { path: path.to_string_lossy().into_owned() }),
    }
}

/// `base/*/bin` for every numeric version directory under `base`, highest version first.
fn versioned_bin_dirs(base: &Path) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(base) else {
        return Vec::new();
    };
    let mut versions: Vec<(Vec<u32>, PathBuf)> = entries
        .filter_map(Result::ok)
        .filter_map(|entry| {
            let version = parse_version(entry.file_name().to_str()?)?;
            Some((version, entry.path().join("bin")))
        })
        .collect();
    versions.sort_by(|a, b| b.0.cmp(&a.0));
    versions.into_iter().map(|(_, dir)| dir).collect()
}

/// Parses `15` or `9.6` into its numeric components.
fn parse_version(name: &str) -> Option<Vec<u32>> {
    name.split('.').map(|part| part.parse().ok()).collect()
}

/// Whether `path` is a regular file with an execute bit (following symlinks).
fn is_executable(path: &Path) -> bool {
    fs::metadata(path).is_ok_and(|meta| meta.is_file() && meta.mode() & 0o111 != 0)
}

/// Finds a system tool on PATH or in the usual sbin/bin directories.
fn find_tool(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(SYSTEM_TOOL_DIRS.iter().map(PathBuf::from))
        .filter(|dir| !dir.as_os_str().is_empty())
        .map(|dir| dir.join(name))
        .find(|candidate| is_executable(candidate))
}

/// The effective uid of this process, from the owner of `/proc/self` (falling back to `id -u`).
fn effective_uid() -> Option<u32> {
    if let Ok(meta) = fs::metadata("/proc/self") {
        return Some(meta.uid());
    }
    let output = Command::new("id").arg("-u").stdin(Stdio::null()).stderr(Stdio::null()).output().ok()?;
    String::from_utf8_lossy(&output.stdout).trim().parse().ok()
}

/// Looks up a system user's uid and gid in `/etc/passwd`, then via `getent passwd`.
fn lookup_user(name: &str) -> Option<RunAs> {
    if let Some(user) = fs::read_to_string("/etc/passwd").ok().and_then(|passwd| parse_passwd(&passwd, name)) {
        return Some(user);
    }
    let output =
        Command::new("getent").args(["passwd", name]).stdin(Stdio::null()).stderr(Stdio::null()).output().ok()?;
    parse_passwd(&String::from_utf8_lossy(&output.stdout), name)
}

/// Finds `name` in passwd(5)-formatted text (`name:password:uid:gid:gecos:home:shell`).
fn parse_passwd(passwd: &str, name: &str) -> Option<RunAs> {
    passwd.lines().find_map(|line| {
        let mut fields = line.split(':');
        if fields.next()? != name {
            return None;
        }
        let _password = fields.next()?;
        let uid = fields.next()?.trim().parse().ok()?;
        let gid = fields.next()?.trim().parse().ok()?;
        Some(RunAs { uid, gid })
    })
}

/// Creates the temporary directory (with the socket directory inside), owned by `run_as` if
/// given, mode 0700.
fn create_temp_dir(run_as: Option<RunAs>) -> Result<TempDir, EmbeddedError> {
    let mut base = std::env::temp_dir();
    // The postgres user must be able to reach the directory; a private TMPDIR (say under /root)
    // would not do, so fall back to /tmp.
    if run_as.is_some() && !traversable_by_others(&base) {
        base = PathBuf::from("/tmp");
    }
    let dir = tempfile::Builder::new().prefix(TEMP_PREFIX).tempdir_in(&base).map_err(|err| {
        EmbeddedError::io(format!("could not create a temporary directory in {}", base.display()), err)
    })?;
    let socket_dir = dir.path().join("socket");
    fs::create_dir(&socket_dir)
        .map_err(|err| EmbeddedError::io(format!("could not create {}", socket_dir.display()), err))?;
    for path in [dir.path(), socket_dir.as_path()] {
        if let Some(user) = run_as {
            std::os::unix::fs::chown(path, Some(user.uid), Some(user.gid)).map_err(|err| {
                EmbeddedError::io(format!("could not hand {} over to the postgres user", path.display()), err)
            })?;
        }
        fs::set_permissions(path, fs::Permissions::from_mode(0o700))
            .map_err(|err| EmbeddedError::io(format!("could not set permissions of {}", path.display()), err))?;
    }
    Ok(dir)
}

/// Whether every directory from `/` down to `path` can be traversed by other users.
fn traversable_by_others(path: &Path) -> bool {
    let Ok(path) = fs::canonicalize(path) else {
        return false;
    };
    path.ancestors().all(|dir| fs::metadata(dir).is_ok_and(|meta| meta.mode() & 0o001 != 0))
}

/// Spawns the detached watchdog that stops the server and removes the directory once this
/// process is gone.
fn spawn_watchdog(ctl: &Ctl) -> Result<Child, EmbeddedError> {
    let script = watchdog_script(std::process::id(), ctl, find_tool("runuser"), find_tool("su"));
    Command::new("/bin/sh")
        .arg("-c")
        .arg(script)
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        // Its own process group: a Ctrl-C aimed at our group must not kill the cleanup too.
        .process_group(0)
        .spawn()
        .map_err(|err| EmbeddedError::io("could not spawn the embedded PostgreSQL watchdog (/bin/sh)", err))
}

/// The watchdog's shell script: wait for `pid` to disappear, stop the server, remove the directory.
fn watchdog_script(pid: u32, ctl: &Ctl, runuser: Option<PathBuf>, su: Option<PathBuf>) -> String {
    let pid_file = sh_quote(&ctl.pid_file().to_string_lossy());
    let pg_ctl_stop = format!(
        "{} stop -D {} -m immediate -w -t 30",
        sh_quote(&ctl.pg_ctl.to_string_lossy()),
        sh_quote(&ctl.data_dir.to_string_lossy())
    );
    let stop = match (ctl.run_as, runuser, su) {
        (None, _, _) => pg_ctl_stop,
        (Some(_), Some(runuser), _) => {
            format!("{} -u {SYSTEM_USER} -- {pg_ctl_stop}", sh_quote(&runuser.to_string_lossy()))
        }
        (Some(_), None, Some(su)) => {
            format!("{} {SYSTEM_USER} -s /bin/sh -c {}", sh_quote(&su.to_string_lossy()), sh_quote(&pg_ctl_stop))
        }
        // No way to switch users: fall through to signalling the postmaster directly
        // (SIGQUIT = immediate shutdown), which root may do.
        (Some(_), None, None) => "false".to_owned(),
    };
    format!(
        "trap '' HUP INT\n\
         while kill -0 {pid} 2>/dev/null; do sleep 1; done\n\
         if [ -f {pid_file} ]; then\n\
         \x20 {stop} >/dev/null 2>&1 || kill -QUIT \"$(head -n 1 {pid_file})\" >/dev/null 2>&1\n\
         fi\n\
         rm -rf {root}\n",
        root = sh_quote(&ctl.root.to_string_lossy()),
    )
}

/// Binds `127.0.0.1:0` to find a currently free port.
fn free_port() -> Result<u16, EmbeddedError> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .map_err(|err| EmbeddedError::io("could not bind 127.0.0.1:0 to find a free port", err))?;
    let port = listener
        .local_addr()
        .map_err(|err| EmbeddedError::io("could not read the address of a bound socket", err))?
        .port();
    Ok(port)
}

/// Quotes a word for `/bin/sh` (unchanged if it only has safe characters).
fn sh_quote(word: &str) -> String {
    let safe = |c: char| c.is_ascii_alphanumeric() || "-_./=:,@%+".contains(c);
    if !word.is_empty() && word.chars().all(safe) {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// Quotes one element of a PostgreSQL list setting (like `unix_socket_directories`) if needed.
fn guc_list_item(item: &str) -> String {
    if item.chars().any(|c| c == ',' || c == '"' || c.is_whitespace()) {
        format!("\"{}\"", item.replace('"', "\"\""))
    } else {
        item.to_owned()
    }
}

/// Percent-encodes everything but RFC 3986 unreserved characters.
fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
            out.push(char::from(byte));
        } else {
            let _ = write!(out, "%{byte:02X}");
        }
    }
    out
}

/// The last `lines` lines of `text`, trimmed.
fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.trim_end().lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

#[cfg(test)]
mod tests {
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
        assert_eq!(pg.url_for("my db"), format!("postgres://postgres@127.0.0.1:{}/my%20db", pg.port()));
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
        assert_eq!(percent_encode("outbox_test-1"), "outbox_test-1");
        assert_eq!(percent_encode("a/b?"), "a%2Fb%3F");
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
}
