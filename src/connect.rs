//! Database URLs, connection pools and the dedicated connections of the relay.

use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use tokio_postgres::Config;
use tokio_postgres::config::Host;
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::error::{Error, ErrorKind, Result};

/// How long a new connection may take before it counts as unreachable. Defaults to 10 s.
pub(crate) const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Idle time before TCP keepalive probes start, so a dead peer is found in seconds, not in the
/// operating system's two hours.
pub(crate) const KEEPALIVES_IDLE: Duration = Duration::from_secs(10);
/// How long sent data may stay unacknowledged before the connection counts as dead.
pub(crate) const TCP_USER_TIMEOUT: Duration = Duration::from_secs(30);
/// Default number of pooled connections.
pub const DEFAULT_POOL_SIZE: usize = 16;

/// A parsed database URL (or key=value string), with the password kept out of every message.
#[derive(Clone)]
pub struct DatabaseUrl {
    config: Config,
    redacted: String,
    tls: MakeRustlsConnect,
}

impl DatabaseUrl {
    /// Parses `postgres://user:password@host:port/db?...` or `host=... user=...`.
    ///
    /// TLS follows libpq's `sslmode` (`disable`, `prefer`, `require`, `verify-ca`, `verify-full`)
    /// and `sslrootcert` (a PEM file of trusted roots; the system's store when absent).
    pub fn parse(url: &str) -> Result<Self> {
        let (rewritten, verify, root) = crate::tls::split_tls_options(url)?;
        let tls = crate::tls::connector(verify, root.as_deref())?;
        let mut config: Config = rewritten.parse().map_err(|e: tokio_postgres::Error| {
            Error::config(format!(
                "invalid database URL {}: {e} (expected postgres://user[:password]@host[:port]/database)",
                redact(url)
            ))
        })?;
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
        Ok(DatabaseUrl { config, redacted: redact(url), tls })
    }

    /// The same server and credentials, another database.
    pub fn for_database(&self, database: &str) -> DatabaseUrl {
        let mut config = self.config.clone();
        config.dbname(database);
        let user = config.get_user().map(|u| format!("{u}@")).unwrap_or_default();
        let redacted = format!("postgres://{user}{}/{database}", describe_target(&config));
        DatabaseUrl { config, redacted, tls: self.tls.clone() }
    }

    /// The tokio-postgres configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Where the database is, as `host:port[,host:port]`, for messages.
    pub fn target(&self) -> String {
        describe_target(&self.config)
    }

    /// Builds a connection pool of `size` connections. Connections are made lazily.
    pub fn pool(&self, size: usize) -> Result<Pool> {
        build_pool(self.config.clone(), self.tls.clone(), size)
    }

    /// A pool for the relay's own bookkeeping, whose sessions run with `synchronous_commit = off`:
    /// a claim or completion lost in a server crash only causes a redelivery, which at-least-once
    /// delivery allows, so they need not wait for the WAL flush. Business transactions never use it.
    pub(crate) fn relay_pool(&self, size: usize) -> Result<Pool> {
        let mut config = self.config.clone();
        let options = match config.get_options() {
            Some(existing) if !existing.is_empty() => format!("{existing} -c synchronous_commit=off"),
            _ => "-c synchronous_commit=off".to_string(),
        };
        config.options(options);
        build_pool(config, self.tls.clone(), size)
    }

    /// The TLS connector for this URL's `sslmode`.
    pub(crate) fn tls(&self) -> MakeRustlsConnect {
        self.tls.clone()
    }

    /// Opens one dedicated (not pooled) connection and spawns its I/O task.
    pub async fn connect(&self) -> Result<tokio_postgres::Client> {
        let (client, connection) =
            self.config.connect(self.tls.clone()).await.map_err(|e| connect_error(&self.config, e))?;
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
        f.write_str(&self.redacted)
    }
}

impl std::fmt::Display for DatabaseUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.redacted)
    }
}

fn build_pool(config: Config, tls: MakeRustlsConnect, size: usize) -> Result<Pool> {
    if size == 0 {
        return Err(Error::config("pool size must be at least 1"));
    }
    let manager = Manager::from_config(config, tls, ManagerConfig { recycling_method: RecyclingMethod::Fast });
    Pool::builder(manager)
        .max_size(size)
        .runtime(deadpool_postgres::Runtime::Tokio1)
        .build()
        .map_err(|e| Error::config(format!("cannot build the connection pool: {e}")))
}

/// The error for a database that cannot be reached, naming the host and port, never the password.
pub(crate) fn connect_error(config: &Config, err: tokio_postgres::Error) -> Error {
    let code = err.as_db_error().map(|db| db.code().clone());
    let kind = if code.is_some() { ErrorKind::Database } else { ErrorKind::Connect };
    let db = config.get_dbname().unwrap_or("(default)");
    Error::new(kind, format!("cannot connect to PostgreSQL at {} (database {db})", describe_target(config)))
        .with_source(err)
}

/// The error for a pool that could not hand out a connection.
pub(crate) fn pool_error(url: &DatabaseUrl, err: deadpool_postgres::PoolError) -> Error {
    use deadpool_postgres::PoolError;
    match err {
        PoolError::Backend(e) => connect_error(&url.config, e),
        PoolError::Timeout(_) => {
            Error::new(ErrorKind::Connect, format!("timed out waiting for a connection to {}", url.target()))
        }
        other => Error::new(ErrorKind::Connect, format!("no connection to {}: {other}", url.target())),
    }
}

fn describe_target(config: &Config) -> String {
    let ports = config.get_ports();
    config
        .get_hosts()
        .iter()
        .enumerate()
        .map(|(i, host)| {
            let port = ports.get(i).or(ports.first()).copied().unwrap_or(5432);
            match host {
                Host::Tcp(name) => format!("{name}:{port}"),
                Host::Unix(path) => format!("{}/.s.PGSQL.{port}", path.display()),
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Replaces the password of a URL or key=value connection string with `***`.
pub fn redact(url: &str) -> String {
    if let Some(rest) = url.strip_prefix("postgres://").or_else(|| url.strip_prefix("postgresql://")) {
        let scheme = &url[..url.len() - rest.len()];
        let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(authority_end);
        if let Some(at) = authority.rfind('@') {
            let userinfo = &authority[..at];
            if let Some(colon) = userinfo.find(':') {
                return format!("{scheme}{}:***{}{tail}", &userinfo[..colon], &authority[at..]);
            }
        }
        let redacted_tail = redact_query_password(tail);
        return format!("{scheme}{authority}{redacted_tail}");
    }
    // key=value form
    url.split_whitespace()
        .map(|pair| if pair.starts_with("password=") { "password=***".to_string() } else { pair.to_string() })
        .collect::<Vec<_>>()
        .join(" ")
}

fn redact_query_password(tail: &str) -> String {
    let Some(q) = tail.find('?') else { return tail.to_string() };
    let (path, query) = tail.split_at(q + 1);
    let query = query
        .split('&')
        .map(|pair| if pair.starts_with("password=") { "password=***".to_string() } else { pair.to_string() })
        .collect::<Vec<_>>()
        .join("&");
    format!("{path}{query}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redact_hides_the_password_in_every_form() {
        assert_eq!(redact("postgres://app:s3cret@db:5432/x"), "postgres://app:***@db:5432/x");
        assert_eq!(redact("postgresql://app:s3cret@db/x?sslmode=require"), "postgresql://app:***@db/x?sslmode=require");
        assert_eq!(
            redact("postgres://app@db/x?password=s3cret&sslmode=require"),
            "postgres://app@db/x?password=***&sslmode=require"
        );
        assert_eq!(redact("host=db user=app password=s3cret"), "host=db user=app password=***");
        assert_eq!(redact("postgres://db/x"), "postgres://db/x");
    }

    #[test]
    fn parse_errors_and_debug_never_show_the_password() {
        let url = DatabaseUrl::parse("postgres://app:s3cret@db:6543/x").unwrap();
        assert_eq!(url.target(), "db:6543");
        assert!(!format!("{url:?} {url}").contains("s3cret"));
        let err = DatabaseUrl::parse("postgres://app:s3cret@db:notaport/x").unwrap_err();
        assert!(!err.to_string().contains("s3cret"), "{err}");
        assert_eq!(err.kind(), ErrorKind::Config);
    }
}
