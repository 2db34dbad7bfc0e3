//! The server benchmarks run on: `DATABASE_URL`'s, or an embedded durable cluster.

use std::fmt;

use pg_outbox_relay::{DatabaseUrl, Outbox};

use super::{BoxError, db};

/// Every database [`BenchDb::fresh_database`] creates is named with this prefix.
pub const DATABASE_PREFIX: &str = "outbox_bench_";

/// Connections in the pool of the [`Outbox`] that [`BenchDb::fresh_database`] returns.
const POOL_SIZE: usize = 8;

/// The server benchmarks run on: the one a database URL names, or an embedded durable cluster
/// that lives as long as this value (dropping it stops the cluster and deletes its files).
pub struct BenchDb {
    server: Server,
}

enum Server {
    External(DatabaseUrl),
    #[cfg(unix)]
    Embedded(pg_outbox_relay_cluster::EmbeddedPostgres),
}

impl BenchDb {
    /// Uses the server `database_url` names (an empty string counts as none), or else starts an
    /// embedded cluster with `fsync` and `synchronous_commit` on.
    ///
    /// Blocking (starting a cluster takes a few seconds): call it before the runtime starts or
    /// through `tokio::task::spawn_blocking`.
    ///
    /// With a URL, its user must be allowed to create databases: [`BenchDb::fresh_database`]
    /// creates `outbox_bench_*` databases on that server, and the database the URL names is used
    /// only to run `CREATE DATABASE` and `DROP DATABASE`.
    ///
    /// # Errors
    /// An invalid URL, or an embedded cluster that could not be started (no PostgreSQL server
    /// binaries, no `postgres` user when running as root, ...).
    pub fn start(database_url: Option<&str>) -> Result<BenchDb, BoxError> {
        match database_url.filter(|url| !url.is_empty()) {
            Some(url) => Ok(BenchDb { server: Server::External(DatabaseUrl::parse(url)?) }),
            #[cfg(unix)]
            None => {
                let options = pg_outbox_relay_cluster::EmbeddedOptions { durable: true };
                let pg = pg_outbox_relay_cluster::EmbeddedPostgres::start(options).map_err(|e| {
                    format!(
                        "no database URL given (--database-url or DATABASE_URL), and the embedded \
                         PostgreSQL could not be started: {e}"
                    )
                })?;
                Ok(BenchDb { server: Server::Embedded(pg) })
            }
            #[cfg(not(unix))]
            None => {
                Err("no database URL given (--database-url or DATABASE_URL), and the embedded PostgreSQL needs Unix"
                    .into())
            }
        }
    }

    /// True when this is the embedded cluster.
    pub fn is_embedded(&self) -> bool {
        !matches!(self.server, Server::External(_))
    }

    /// Where the benchmarks run, for reports (never with a password).
    pub fn describe(&self) -> String {
        match &self.server {
            Server::External(url) => format!("server {url}"),
            #[cfg(unix)]
            Server::Embedded(pg) => {
                format!("embedded PostgreSQL at {}:{} (durable: fsync and synchronous_commit on)", pg.host(), pg.port())
            }
        }
    }

    /// The URL `CREATE DATABASE` runs on.
    fn admin_url(&self) -> DatabaseUrl {
        match &self.server {
            Server::External(url) => url.clone(),
            #[cfg(unix)]
            Server::Embedded(pg) => pg.database_url(),
        }
    }

    /// Creates the database `outbox_bench_<hint>` (dropping a leftover of that name first, with
    /// its connections), applies the migrations, and returns its URL and an [`Outbox`] on it.
    ///
    /// The hint is reduced to lower-case letters, digits and `_`.
    pub async fn fresh_database(&self, name_hint: &str) -> Result<(DatabaseUrl, Outbox), BoxError> {
        let name = database_name(name_hint);
        let admin = self.admin_url().connect().await?;
        admin
            .batch_execute(&format!("drop database if exists \"{name}\" with (force)"))
            .await
            .map_err(db("dropping a leftover benchmark database"))?;
        admin
            .batch_execute(&format!("create database \"{name}\""))
            .await
            .map_err(db("creating a benchmark database"))?;
        let url = self.admin_url().for_database(&name);
        let outbox = Outbox::connect_with(url.clone(), POOL_SIZE).await?;
        outbox.migrate().await?;
        Ok((url, outbox))
    }

    /// Drops the database `outbox_bench_<hint>` if it exists, closing its connections.
    pub async fn drop_database(&self, name_hint: &str) -> Result<(), BoxError> {
        let name = database_name(name_hint);
        let admin = self.admin_url().connect().await?;
        admin
            .batch_execute(&format!("drop database if exists \"{name}\" with (force)"))
            .await
            .map_err(db("dropping a benchmark database"))?;
        Ok(())
    }
}

impl fmt::Debug for BenchDb {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BenchDb").field("server", &self.describe()).finish()
    }
}

/// `outbox_bench_<hint>`, the hint reduced to `[a-z0-9_]` and the whole to PostgreSQL's 63 bytes.
fn database_name(hint: &str) -> String {
    let mut clean: String =
        hint.chars().map(|c| c.to_ascii_lowercase()).map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
    if clean.is_empty() {
        clean.push_str("default");
    }
    clean.truncate(63 - DATABASE_PREFIX.len());
    format!("{DATABASE_PREFIX}{clean}")
}

/// What the figures depend on: the server's version and its durability settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerInfo {
    /// `server_version`, e.g. `15.8 (Debian 15.8-0+deb12u1)`.
    pub version: String,
    /// `fsync`: `on` or `off`.
    pub fsync: String,
    /// `synchronous_commit` of a business transaction: `on`, `off`, `local`, ...
    pub synchronous_commit: String,
}

/// Reads [`ServerInfo`] through `outbox`'s pool.
pub async fn server_info(outbox: &Outbox) -> Result<ServerInfo, BoxError> {
    let client = outbox.connection().await?;
    let row = client
        .query_one(
            "select current_setting('server_version'), current_setting('fsync'), \
             current_setting('synchronous_commit')",
            &[],
        )
        .await
        .map_err(db("reading the server settings"))?;
    Ok(ServerInfo { version: row.get(0), fsync: row.get(1), synchronous_commit: row.get(2) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_names_are_safe_identifiers() {
        assert_eq!(database_name("latency"), "outbox_bench_latency");
        assert_eq!(database_name("Notify Cost!"), "outbox_bench_notify_cost_");
        assert_eq!(database_name(""), "outbox_bench_default");
        assert_eq!(database_name(&"x".repeat(100)).len(), 63);
        assert_eq!(database_name("é\"; drop"), "outbox_bench_____drop");
    }
}
