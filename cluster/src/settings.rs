//! The cluster's settings and the values its parts share: where and as whom it runs, how long
//! it waits, how it stops, and its errors.

use std::io;
use std::time::Duration;

/// The address the server listens on.
pub(crate) const HOST: &str = "127.0.0.1";
/// Prefix of the temporary directory holding the cluster.
pub(crate) const TEMP_PREFIX: &str = "outbox-relay-pg-";
/// The database superuser created by initdb.
pub(crate) const SUPERUSER: &str = "postgres";
/// The system user to run as when we are root.
pub(crate) const SYSTEM_USER: &str = "postgres";
/// `pg_ctl -t`: how long pg_ctl waits for a start or stop to complete.
pub(crate) const PG_CTL_TIMEOUT_SECS: u64 = 60;
/// How long to wait for the TCP port to accept connections after pg_ctl reported success.
pub(crate) const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How many free ports to try when the chosen one is taken before the server binds it.
pub(crate) const PORT_ATTEMPTS: usize = 5;
/// How many lines of server.log / stderr to put into errors.
pub(crate) const TAIL_LINES: usize = 20;
/// Directories searched for system tools (runuser, su) besides PATH.
pub(crate) const SYSTEM_TOOL_DIRS: [&str; 4] = ["/usr/sbin", "/sbin", "/usr/bin", "/bin"];
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
    pub(crate) fn as_arg(self) -> &'static str {
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
    pub(crate) fn io(context: impl Into<String>, source: io::Error) -> Self {
        EmbeddedError::Io { context: context.into(), source }
    }
}
