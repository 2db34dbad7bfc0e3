//! The test harness: one PostgreSQL server per test process, one fresh database per test.
//!
//! The server is the one `DATABASE_URL` names when it is set; otherwise a private throwaway
//! cluster from the machine's `initdb`/`pg_ctl` ([`outbox_relay::embedded`]), stopped by its
//! watchdog when the test process exits. Each test gets its own database, copied from a migrated
//! template, so tests run in parallel and never see each other's rows.

#![allow(dead_code, unreachable_pub)]

use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

use outbox_relay::embedded::{EmbeddedOptions, EmbeddedPostgres};
use outbox_relay::{DatabaseUrl, Outbox};
use tokio_postgres::{Client, NoTls};

/// The server every test of this process uses.
pub enum Server {
    /// Named by `DATABASE_URL`.
    External(DatabaseUrl),
    /// Started by this process.
    Embedded(EmbeddedPostgres),
}

static SERVER: OnceLock<Server> = OnceLock::new();
static TEMPLATE: OnceLock<String> = OnceLock::new();
static COUNTER: AtomicUsize = AtomicUsize::new(0);

const TEST_DB_PREFIX: &str = "outbox_test_";

/// The server, started on first use.
pub fn server() -> &'static Server {
    SERVER.get_or_init(|| match std::env::var("DATABASE_URL") {
        Ok(url) if !url.is_empty() => {
            Server::External(DatabaseUrl::parse(&url).expect("DATABASE_URL is not a valid database URL"))
        }
        _ => {
            Server::Embedded(EmbeddedPostgres::start(EmbeddedOptions::default()).unwrap_or_else(|e| {
                panic!("DATABASE_URL is not set and no throwaway PostgreSQL could be started: {e}")
            }))
        }
    })
}

impl Server {
    /// A tokio-postgres config for `database` on this server.
    pub fn config_for(&self, database: &str) -> tokio_postgres::Config {
        let mut config = match self {
            Server::External(url) => url.config().clone(),
            Server::Embedded(pg) => pg.url().parse().expect("embedded URL"),
        };
        config.dbname(database);
        config
    }

    /// A URL for `database` on this server, with the server's credentials.
    pub fn url_for(&self, database: &str) -> String {
        let config = self.config_for(database);
        let password = config.get_password().map(|p| String::from_utf8_lossy(p).into_owned());
        url(&config, config.get_user().unwrap_or("postgres"), password.as_deref())
    }

    /// A URL for `database` on this server as another `user`, without a password (the test
    /// server trusts local connections).
    pub fn url_as(&self, database: &str, user: &str) -> String {
        url(&self.config_for(database), user, None)
    }

    /// The embedded cluster, for tests that restart it; `None` with `DATABASE_URL`.
    pub fn embedded(&self) -> Option<&EmbeddedPostgres> {
        match self {
            Server::Embedded(pg) => Some(pg),
            Server::External(_) => None,
        }
    }

    fn admin_database(&self) -> String {
        match self {
            Server::External(url) => url.config().get_dbname().unwrap_or("postgres").to_string(),
            Server::Embedded(_) => "postgres".to_string(),
        }
    }
}

fn url(config: &tokio_postgres::Config, user: &str, password: Option<&str>) -> String {
    let database = config.get_dbname().unwrap_or("postgres");
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let password = password.map(|p| format!(":{p}")).unwrap_or_default();
    match &config.get_hosts()[0] {
        tokio_postgres::config::Host::Tcp(host) => format!("postgres://{user}{password}@{host}:{port}/{database}"),
        tokio_postgres::config::Host::Unix(dir) => {
            format!("postgres://{user}{password}@/{database}?host={}&port={port}", dir.display())
        }
    }
}

/// Runs an async block on a private runtime in its own thread. The harness needs this where it
/// works outside the test's runtime (once-per-process set-up, and `Drop`).
fn on_own_runtime<T: Send + 'static>(f: impl std::future::Future<Output = T> + Send + 'static) -> T {
    std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime").block_on(f)
    })
    .join()
    .expect("harness thread panicked")
}

async fn connect(config: tokio_postgres::Config) -> Client {
    let (client, connection) = config.connect(NoTls).await.expect("cannot connect to the test server");
    tokio::spawn(connection);
    client
}

/// The name of the migrated template database, made once per process (and reused across
/// processes while the migrations do not change).
fn template() -> &'static str {
    TEMPLATE.get_or_init(|| {
        let server = server();
        let admin = server.config_for(&server.admin_database());
        let name = format!("outbox_relay_template_{}", migrations_digest());
        let template_url = server.url_for(&name);
        on_own_runtime(async move {
            let client = connect(admin).await;
            // Serializes template creation across test processes sharing one server. CREATE
            // DATABASE cannot run in a transaction, so this is a session lock.
            client.execute("select pg_advisory_lock(7355608)", &[]).await.unwrap();
            let ready = client
                .query_opt("select 1 from pg_database where datname = $1 and datistemplate", &[&name])
                .await
                .unwrap()
                .is_some();
            if !ready {
                client.batch_execute(&format!("drop database if exists \"{name}\"")).await.unwrap_or(());
                client.batch_execute(&format!("create database \"{name}\"")).await.unwrap();
                let outbox = Outbox::connect_with(DatabaseUrl::parse(&template_url).unwrap(), 1).await.unwrap();
                outbox.migrate().await.expect("migrating the template database");
                outbox.pool().close();
                drop(outbox);
                client.batch_execute(&format!("alter database \"{name}\" is_template true")).await.unwrap();
            }
            client.execute("select pg_advisory_unlock(7355608)", &[]).await.unwrap();
            sweep_leftovers(&client).await;
            name
        })
    })
}

/// Drops test databases left by earlier test processes that are gone (killed before cleanup).
async fn sweep_leftovers(client: &Client) {
    let rows = client
        .query("select datname from pg_database where datname like $1", &[&format!("{TEST_DB_PREFIX}%")])
        .await
        .unwrap();
    for row in rows {
        let name: String = row.get(0);
        let pid = name.trim_start_matches(TEST_DB_PREFIX).split('_').next().unwrap_or("");
        if !pid.is_empty() && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            client.batch_execute(&format!("drop database if exists \"{name}\" with (force)")).await.ok();
        }
    }
}

fn migrations_digest() -> String {
    use std::hash::{Hash, Hasher};
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/migrations");
    let mut files: Vec<_> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).filter(|p| p.is_file()).collect();
    files.sort();
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    for file in files {
        std::fs::read(file).unwrap().hash(&mut hasher);
    }
    format!("{:016x}", hasher.finish())
}

/// A database of its own for one test, with the library's migrations applied, dropped at the end.
pub struct TestDb {
    /// The database name.
    pub name: String,
    /// Its URL.
    pub url: String,
    /// An outbox on it.
    pub outbox: Outbox,
}

impl TestDb {
    /// A fresh migrated database.
    pub async fn new() -> TestDb {
        TestDb::create(Some(template())).await
    }

    /// A fresh database with nothing in it (not even the migrations).
    pub async fn empty() -> TestDb {
        TestDb::create(None).await
    }

    async fn create(template: Option<&str>) -> TestDb {
        let server = server();
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let name = format!("{TEST_DB_PREFIX}{}_{n}", std::process::id());
        let admin = connect(server.config_for(&server.admin_database())).await;
        let from = template.map(|t| format!(" template \"{t}\"")).unwrap_or_default();
        admin.batch_execute(&format!("create database \"{name}\"{from}")).await.unwrap();
        let url = server.url_for(&name);
        let outbox = Outbox::connect_with(DatabaseUrl::parse(&url).unwrap(), 32).await.unwrap();
        TestDb { name, url, outbox }
    }

    /// A new dedicated connection to this database.
    pub async fn client(&self) -> Client {
        connect(server().config_for(&self.name)).await
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        self.outbox.pool().close();
        let name = self.name.clone();
        let admin = server().config_for(&server().admin_database());
        on_own_runtime(async move {
            let client = connect(admin).await;
            if let Err(e) = client.batch_execute(&format!("drop database if exists \"{name}\" with (force)")).await {
                eprintln!("warning: could not drop test database {name}: {e}");
            }
        });
    }
}
