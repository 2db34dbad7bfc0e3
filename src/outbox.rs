//! The handle on one database's outbox: its connection pool, its migrations, one-off publishes,
//! and the in-process wake-up a relay in the same process listens to.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use deadpool_postgres::Pool;

use crate::connect::{DEFAULT_POOL_SIZE, DatabaseUrl, pool_error};
use crate::error::Result;
use crate::event::NewEvent;
use crate::migrate::{self, MigrationReport};
use crate::sql;
use crate::wake::Wakeup;

/// A handle on the outbox of one database: a connection pool plus the in-process wake-up that a
/// relay in the same process listens to. Cheap to clone.
#[derive(Clone)]
pub struct Outbox {
    inner: Arc<Inner>,
}

struct Inner {
    url: DatabaseUrl,
    pool: Pool,
    wakeup: Wakeup,
}

impl Outbox {
    /// Connects to `url` with a pool of [`DEFAULT_POOL_SIZE`] connections, checking that the database
    /// answers.
    pub async fn connect(url: &str) -> Result<Outbox> {
        Outbox::connect_with(DatabaseUrl::parse(url)?, DEFAULT_POOL_SIZE).await
    }

    /// Connects with a parsed URL and a pool of `pool_size` connections.
    pub async fn connect_with(url: DatabaseUrl, pool_size: usize) -> Result<Outbox> {
        let pool = url.pool(pool_size)?;
        let outbox = Outbox { inner: Arc::new(Inner { url, pool, wakeup: Wakeup::new() }) };
        drop(outbox.pooled().await?);
        Ok(outbox)
    }

    /// The connection pool (deadpool-postgres'), for the service's own queries.
    pub fn pool(&self) -> &Pool {
        &self.inner.pool
    }

    /// The database this outbox writes to (password redacted when printed).
    pub fn url(&self) -> &DatabaseUrl {
        &self.inner.url
    }

    pub(crate) fn wakeup(&self) -> &Wakeup {
        &self.inner.wakeup
    }

    /// A connection from the pool: for the service's own queries (it derefs to
    /// [`tokio_postgres::Client`]), and for units of work under an idempotency key
    /// ([`Connection::begin`]). The error names the server when none can be had.
    pub async fn connection(&self) -> Result<Connection> {
        Ok(Connection { client: self.pooled().await?, outbox: self.clone() })
    }

    /// A pooled connection, with an error that names the server when none can be had.
    pub(crate) async fn pooled(&self) -> Result<deadpool_postgres::Object> {
        self.inner.pool.get().await.map_err(|e| pool_error(&self.inner.url, e))
    }

    /// Applies the pending migrations of `migrations/` and says what it applied.
    pub async fn migrate(&self) -> Result<MigrationReport> {
        let mut client = self.pooled().await?;
        migrate::run(&mut client).await
    }

    /// Checks that the database has every migration of this version applied (and none of a newer
    /// one), and that this role may use the schema; the error says what to do.
    pub async fn check_schema(&self) -> Result<()> {
        let client = self.pooled().await?;
        migrate::check_applied(&client).await
    }

    /// Adds one event in a transaction of its own, and wakes a relay in this process.
    pub async fn publish(&self, event: &NewEvent) -> Result<i64> {
        event.validate()?;
        let id = sql::insert_event(&*self.pooled().await?, event).await?;
        self.inner.wakeup.wake();
        Ok(id)
    }

    /// Adds many events in one statement and transaction, and wakes a relay in this process.
    pub async fn publish_all(&self, events: &[NewEvent]) -> Result<Vec<i64>> {
        for event in events {
            event.validate()?;
        }
        let ids = sql::insert_events(&*self.pooled().await?, events).await?;
        self.inner.wakeup.wake();
        Ok(ids)
    }
}

impl std::fmt::Debug for Outbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbox").field("url", &self.inner.url).finish_non_exhaustive()
    }
}

/// A connection from an [`Outbox`]'s pool; back to the pool when dropped.
///
/// It derefs to [`tokio_postgres::Client`] for the service's own queries and transactions, and
/// [`begin`](Connection::begin)s units of work under an idempotency key.
pub struct Connection {
    pub(crate) client: deadpool_postgres::Object,
    pub(crate) outbox: Outbox,
}

impl Deref for Connection {
    type Target = tokio_postgres::Client;

    fn deref(&self) -> &Self::Target {
        &self.client
    }
}

impl DerefMut for Connection {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.client
    }
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection").field("url", self.outbox.url()).finish_non_exhaustive()
    }
}
