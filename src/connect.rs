//! Database URLs, connection pools and the dedicated connections of the relay.

use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use tokio_postgres::Config;
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::conninfo::{ConnInfo, describe_target};
use crate::error::{Error, ErrorKind, Result};

/// How long a new connection may take before it counts as unreachable, per host, when the URL
/// gives no `connect_timeout`: 10 s. As in libpq, it bounds the whole attempt (TCP, TLS, the
/// startup and authentication handshake), not only the TCP connect.
pub(crate) const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Idle time before TCP keepalive probes start, so a dead peer is found in seconds, not in the
/// operating system's two hours.
pub(crate) const KEEPALIVES_IDLE: Duration = Duration::from_secs(10);
/// How long sent data may stay unacknowledged before the connection counts as dead.
pub(crate) const TCP_USER_TIMEOUT: Duration = Duration::from_secs(30);

/// A parsed database URL (or key=value string), with the password kept out of every message.
///
/// Parsed with the grammar libpq and tokio-postgres share (see [`DatabaseUrl::parse`]); when
/// printed (`Display`, `Debug`) it is rebuilt from the parsed form as
/// `postgres://user:***@host:port/database`, so no form of password can show.
#[derive(Clone)]
pub struct DatabaseUrl {
    info: ConnInfo,
    tls: MakeRustlsConnect,
}

impl DatabaseUrl {
    /// Parses `postgres://user:password@host:port/db?...` or `host=... user=...`.
    ///
    /// TLS follows libpq's `sslmode` (`disable`, `prefer`, `require`, `verify-ca`, `verify-full`)
    /// and `sslrootcert` (a PEM file of trusted roots; the system's store when absent). What the
    /// string leaves out comes from libpq's environment (`PGHOST`, `PGPORT`, `PGUSER`,
    /// `PGPASSWORD` or the password file `PGPASSFILE` / `~/.pgpass`, `PGDATABASE`, `PGSSLMODE`,
    /// `PGSSLROOTCERT`, `PGAPPNAME`, `PGCONNECT_TIMEOUT`), the string first. An error names
    /// what is wrong (an option, a byte offset, a variable), never a value.
    pub fn parse(url: &str) -> Result<Self> {
        let mut info = ConnInfo::parse_with_env(url, &|name| std::env::var(name).ok())?;
        let tls = crate::tls::connector(info.verify, info.root_cert.as_deref())?;
        let config = &mut info.config;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(DEFAULT_CONNECT_TIMEOUT);
        }
        config.keepalives(true).keepalives_idle(KEEPALIVES_IDLE);
        config.keepalives_interval(Duration::from_secs(5)).keepalives_retries(3);
        // Data sent but not acknowledged for this long means the peer is gone (a stalled link).
        config.tcp_user_timeout(TCP_USER_TIMEOUT);
        if config.get_application_name().is_none() {
            config.application_name("outbox-relay");
        }
        Ok(DatabaseUrl { info, tls })
    }

    /// The same server, credentials and settings, another database.
    pub fn for_database(&self, database: &str) -> DatabaseUrl {
        let mut url = self.clone();
        url.info.config.dbname(database);
        url
    }

    /// The same server, database and TLS settings, another user, with `password` or none.
    pub fn for_user(&self, user: &str, password: Option<&str>) -> Result<DatabaseUrl> {
        DatabaseUrl::parse(&self.info.render(Some(user), password.map(str::as_bytes), None))
    }

    /// The same credentials, database and TLS settings on another server (one host and port).
    pub fn for_host(&self, host: &str, port: u16) -> Result<DatabaseUrl> {
        let config = &self.info.config;
        DatabaseUrl::parse(&self.info.render(config.get_user(), config.get_password(), Some((host, port))))
    }

    /// The URL again, password included, for handing to another process or tool (never for a
    /// log): user, password, hosts, database and the TLS settings, rebuilt from the parsed form.
    pub fn to_connection_string(&self) -> String {
        self.info.to_url()
    }

    /// The tokio-postgres configuration.
    pub fn config(&self) -> &Config {
        &self.info.config
    }

    /// Where the database is, as `host:port[,host:port]`, for messages.
    pub fn target(&self) -> String {
        describe_target(&self.info.config)
    }

    /// How long making one connection may take in all: the URL's `connect_timeout` (10 s by
    /// default) for each of its hosts, the handshake included.
    pub fn connect_timeout(&self) -> Duration {
        let per_host = self.info.config.get_connect_timeout().copied().unwrap_or(DEFAULT_CONNECT_TIMEOUT);
        per_host.saturating_mul(self.info.config.get_hosts().len().max(1) as u32)
    }

    /// Builds a connection pool of `size` connections. Connections are made lazily, each within
    /// [`DatabaseUrl::connect_timeout`].
    pub fn pool(&self, size: usize) -> Result<Pool> {
        build_pool(self.info.config.clone(), self.tls.clone(), size, self.connect_timeout())
    }

    /// A pool for the relay's own bookkeeping, its sessions named `application_name`, which run with `synchronous_commit = off`:
    /// a claim or completion lost in a server crash only causes a redelivery, which at-least-once
    /// delivery allows, so they need not wait for the WAL flush. Business transactions never use it.
    /// A session that stays idle in a transaction for `lease` (a held claim whose relay stalled)
    /// is ended by the server, which gives its events back. Its prepared statements use generic
    /// plans from the first run: they are written for their indexes, and re-planning the claim
    /// for every run (which PostgreSQL may otherwise settle on) costs more than running it. JIT
    /// compilation is off: a claim's generic plan's estimates can pass `jit_above_cost` on a
    /// large outbox, and compiling an earlier, larger claim took 2.4 s per claim (measured with
    /// a backlog of 20,000 events) for a run of a millisecond. Sequential and bitmap scans are off:
    /// every statement of the relay is written for an index, and a generic plan is kept for the
    /// session's life, so one built while the outbox looked empty (its statistics taken between
    /// two bursts) would read the whole table on every claim afterwards, dead rows included: the
    /// collapse under a held snapshot that the claim is built to avoid (measured: 17 ms a claim
    /// after 40 s of a held snapshot at 800 events/s, against 0.8 ms).
    pub(crate) fn relay_pool(&self, size: usize, lease: Duration, application_name: &str) -> Result<Pool> {
        let mut config = self.info.config.clone();
        config.application_name(application_name);
        let ours = format!(
            "-c synchronous_commit=off -c plan_cache_mode=force_generic_plan -c jit=off -c enable_seqscan=off -c enable_bitmapscan=off -c idle_in_transaction_session_timeout={}",
            lease.as_millis().clamp(1, i32::MAX as u128)
        );
        let options = match config.get_options() {
            Some(existing) if !existing.is_empty() => format!("{existing} {ours}"),
            _ => ours,
        };
        config.options(options);
        build_pool(config, self.tls.clone(), size, self.connect_timeout())
    }

    /// The TLS connector for this URL's `sslmode`.
    pub(crate) fn tls(&self) -> MakeRustlsConnect {
        self.tls.clone()
    }

    /// Opens one dedicated (not pooled) connection within [`DatabaseUrl::connect_timeout`] and
    /// spawns its I/O task.
    pub async fn connect(&self) -> Result<tokio_postgres::Client> {
        let connecting = self.info.config.connect(self.tls.clone());
        let (client, connection) = tokio::time::timeout(self.connect_timeout(), connecting)
            .await
            .map_err(|_| handshake_timeout(self))?
            .map_err(|e| connect_error(&self.info.config, e))?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "database connection closed");
            }
        });
        Ok(client)
    }
}

impl std::fmt::Debug for DatabaseUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.info.redacted())
    }
}

impl std::fmt::Display for DatabaseUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.info.redacted())
    }
}

fn build_pool(config: Config, tls: MakeRustlsConnect, size: usize, connect_timeout: Duration) -> Result<Pool> {
    if size == 0 {
        return Err(Error::config("pool size must be at least 1"));
    }
    let connect = PooledConnect { tls, target: describe_target(&config) };
    let manager = Manager::from_connect(config, connect, ManagerConfig { recycling_method: RecyclingMethod::Fast });
    // Making a connection is bounded as libpq bounds it; waiting for a free one is the caller's.
    let timeouts = deadpool_postgres::Timeouts { create: Some(connect_timeout), wait: None, recycle: None };
    Pool::builder(manager)
        .max_size(size)
        .timeouts(timeouts)
        .runtime(deadpool_postgres::Runtime::Tokio1)
        .build()
        .map_err(|e| Error::config(format!("cannot build the connection pool: {e}")))
}

/// How often the end of a pooled connection is logged as a warning: when PostgreSQL restarts or
/// a pooler drops its clients, every pooled connection ends at once, and one line says it.
const ENDED_WARNING_EVERY: Duration = Duration::from_secs(60);

/// When the process last warned that a pooled connection ended (every pool's: a service's
/// outbox and its relay lose theirs together).
static LAST_ENDED_WARNING: std::sync::Mutex<Option<std::time::Instant>> = std::sync::Mutex::new(None);

/// Opens the pool's connections (as deadpool's own does) and says in the library's words, at
/// most once a minute per process, that one ended with an error (deadpool's own says
/// `Connection error: db error` once per connection, without the reason).
struct PooledConnect {
    tls: MakeRustlsConnect,
    target: String,
}

type Connected = (tokio_postgres::Client, tokio::task::JoinHandle<()>);

impl deadpool_postgres::Connect for PooledConnect {
    fn connect(
        &self,
        config: &Config,
    ) -> futures::future::BoxFuture<'_, std::result::Result<Connected, tokio_postgres::Error>> {
        let config = config.clone();
        Box::pin(async move {
            let (client, connection) = config.connect(self.tls.clone()).await?;
            let target = self.target.clone();
            // (under the span of whoever opened it: the relay's id is on its lines)
            let task = tokio::spawn(tracing::Instrument::instrument(
                async move {
                    if let Err(e) = connection.await {
                        // (its Display carries PostgreSQL's own words and SQLSTATE, or the I/O cause)
                        let ended = Error::new(ErrorKind::Connect, "ended").with_source(e);
                        let now = std::time::Instant::now();
                        let warn = {
                            let mut last = LAST_ENDED_WARNING.lock().unwrap_or_else(|p| p.into_inner());
                            let warn = last.is_none_or(|at| now.duration_since(at) >= ENDED_WARNING_EVERY);
                            if warn {
                                *last = Some(now);
                            }
                            warn
                        };
                        if warn {
                            tracing::warn!(
                                "a pooled connection to PostgreSQL at {target} {ended}; the pool opens a new one when it next needs one (more endings within a minute are logged at debug)"
                            );
                        } else {
                            tracing::debug!("a pooled connection to PostgreSQL at {target} {ended}");
                        }
                    }
                },
                tracing::Span::current(),
            ));
            Ok((client, task))
        })
    }
}

/// The error for a database that cannot be reached, naming the host and port, never the password.
pub(crate) fn connect_error(config: &Config, err: tokio_postgres::Error) -> Error {
    let code = err.as_db_error().map(|db| db.code().clone());
    let kind = if code.is_some() { ErrorKind::Database } else { ErrorKind::Connect };
    let db = config.get_dbname().unwrap_or("(default)");
    Error::new(kind, format!("cannot connect to PostgreSQL at {} (database {db})", describe_target(config)))
        .with_source(err)
}

/// The error for a server that accepted the connection but did not finish its handshake in time.
fn handshake_timeout(url: &DatabaseUrl) -> Error {
    Error::new(
        ErrorKind::Connect,
        format!(
            "PostgreSQL at {} did not complete the connection within {} (connect_timeout): the server accepts connections but does not answer (frozen, overloaded, or a hung proxy?)",
            url.target(),
            humantime::format_duration(url.connect_timeout())
        ),
    )
}

/// The error for a pool that could not hand out a connection.
pub(crate) fn pool_error(url: &DatabaseUrl, err: deadpool_postgres::PoolError) -> Error {
    use deadpool_postgres::PoolError;
    match err {
        PoolError::Backend(e) => connect_error(&url.info.config, e),
        PoolError::Timeout(deadpool_postgres::TimeoutType::Create) => handshake_timeout(url),
        PoolError::Timeout(_) => {
            Error::new(ErrorKind::Connect, format!("timed out waiting for a connection to {}", url.target()))
        }
        other => Error::new(ErrorKind::Connect, format!("no connection to {}: {other}", url.target())),
    }
}

/// A connection string as it may be shown: rebuilt from its parsed form with the password as
/// `***`; a string that does not parse is not shown at all.
pub fn redact(url: &str) -> String {
    match ConnInfo::parse(url) {
        Ok(info) => info.redacted(),
        Err(_) => "(a connection string that does not parse)".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_errors_and_debug_never_show_the_password() {
        let url = DatabaseUrl::parse("postgres://app:s3cret@db:6543/x").unwrap();
        assert_eq!(url.target(), "db:6543");
        assert!(!format!("{url:?} {url}").contains("s3cret"));
        assert_eq!(url.for_database("other").to_string(), "postgres://app:***@db:6543/other");
        let err = DatabaseUrl::parse("postgres://app:s3cret@db:notaport/x").unwrap_err();
        assert!(!err.to_string().contains("s3cret"), "{err}");
        assert_eq!(err.kind(), ErrorKind::Config);
        assert_eq!(redact("postgres://app:right/pw@db/x"), "postgres://app:***@db:5432/x");
        assert_eq!(redact("host=db password = s3cret"), "postgres://:***@db:5432/");
        assert!(!redact("PASSWORD=s3cret").contains("s3cret"));
    }
}
