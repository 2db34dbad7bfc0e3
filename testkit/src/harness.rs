//! The test harness: one PostgreSQL server per test process, one fresh database per test.
//!
//! The server is the one `DATABASE_URL` names when it is set; otherwise a private throwaway
//! cluster from the machine's `initdb`/`pg_ctl` ([`pg_outbox_relay_cluster`]), stopped by its watchdog
//! when the test process exits. Each test gets its own database, copied from a migrated
//! template, so tests run in parallel and never see each other's rows. Databases left by test
//! processes that were killed are dropped by the next run.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

use pg_outbox_relay::{DatabaseUrl, Outbox};
use tokio_postgres::{Client, NoTls};

/// The server every test of this process uses.
pub enum Server {
    /// Named by `DATABASE_URL`.
    External(DatabaseUrl),
    /// Started by this process.
    #[cfg(unix)]
    Embedded(pg_outbox_relay_cluster::EmbeddedPostgres),
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
        #[cfg(unix)]
        _ => Server::Embedded(
            pg_outbox_relay_cluster::EmbeddedPostgres::start(pg_outbox_relay_cluster::EmbeddedOptions::default())
                .unwrap_or_else(|e| {
                    panic!("DATABASE_URL is not set and no throwaway PostgreSQL could be started: {e}")
                }),
        ),
        #[cfg(not(unix))]
        _ => panic!("DATABASE_URL is not set, and the throwaway PostgreSQL needs a Unix system"),
    })
}

impl Server {
    /// The URL of the server's administrative database (the one `DATABASE_URL` names, or the
    /// embedded cluster's `postgres`).
    pub fn url(&self) -> DatabaseUrl {
        match self {
            Server::External(url) => url.clone(),
            #[cfg(unix)]
            Server::Embedded(pg) => pg.database_url(),
        }
    }

    /// The URL of `database` on this server, with the server's credentials.
    pub fn url_for(&self, database: &str) -> DatabaseUrl {
        self.url().for_database(database)
    }

    /// The URL of `database` on this server as another `user`, without a password (the test
    /// server trusts local connections).
    pub fn url_as(&self, database: &str, user: &str) -> DatabaseUrl {
        self.url_for(database).for_user(user, None).expect("a URL for another user")
    }

    /// The embedded cluster, for tests that restart it; `None` with `DATABASE_URL`.
    #[cfg(unix)]
    pub fn embedded(&self) -> Option<&pg_outbox_relay_cluster::EmbeddedPostgres> {
        match self {
            Server::Embedded(pg) => Some(pg),
            Server::External(_) => None,
        }
    }

    fn admin_database(&self) -> String {
        self.url().config().get_dbname().unwrap_or("postgres").to_string()
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

/// A plain connection to `url` (no TLS: the test server is local).
pub async fn connect(url: &DatabaseUrl) -> Client {
    let (client, connection) = url.config().connect(NoTls).await.expect("cannot connect to the test server");
    tokio::spawn(connection);
    client
}

/// The name of the migrated template database, made once per process (and reused across
/// processes while the migrations do not change).
fn template() -> &'static str {
    TEMPLATE.get_or_init(|| {
        let server = server();
        let admin = server.url_for(&server.admin_database());
        let name = format!("outbox_relay_template_{}", migrations_digest());
        let template_url = server.url_for(&name);
        on_own_runtime(async move {
            let client = connect(&admin).await;
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
                let outbox = Outbox::connect_with(template_url, 1).await.unwrap();
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

/// A digest of the library's migrations, so that a template made from other migrations is not
/// reused.
fn migrations_digest() -> String {
    use std::hash::{Hash, Hasher};
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../migrations");
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
    /// Its connection string (password included), for tools and child processes.
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
        let admin = connect(&server.url_for(&server.admin_database())).await;
        let from = template.map(|t| format!(" template \"{t}\"")).unwrap_or_default();
        admin.batch_execute(&format!("create database \"{name}\"{from}")).await.unwrap();
        let url = server.url_for(&name);
        let outbox = Outbox::connect_with(url.clone(), 32).await.unwrap();
        TestDb { url: url.to_connection_string(), name, outbox }
    }

    /// The URL of this database, parsed.
    pub fn database_url(&self) -> DatabaseUrl {
        server().url_for(&self.name)
    }

    /// The URL of this database as another `user`, without a password, for tools and child
    /// processes.
    pub fn url_as(&self, user: &str) -> String {
        server().url_as(&self.name, user).to_connection_string()
    }

    /// A new dedicated connection to this database.
    pub async fn client(&self) -> Client {
        connect(&self.database_url()).await
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        self.outbox.pool().close();
        let name = self.name.clone();
        let admin = server().url_for(&server().admin_database());
        on_own_runtime(async move {
            let client = connect(&admin).await;
            if let Err(e) = client.batch_execute(&format!("drop database if exists \"{name}\" with (force)")).await {
                eprintln!("warning: could not drop test database {name}: {e}");
            }
        });
    }
}
