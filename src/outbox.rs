//! The handle on one database's outbox: its connection pool, its migrations, one-off publishes,
//! and the in-process wake-up a relay in the same process listens to.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::Pool;

use crate::connect::{DatabaseUrl, pool_error};
use crate::error::{Error, ErrorKind, Result};
use crate::event::NewEvent;
use crate::migrate::{self, MigrationReport};
use crate::sql;
use crate::wake::Wakeup;

/// A handle on the outbox of one database: a connection pool plus the in-process wake-up that a
/// relay in the same process listens to. Cheap to clone.
#[derive(Clone)]
pub struct Outbox {
    inner: Arc<Inner>,
    /// The bound on each operation's wait for the database ([`Outbox::with_timeout`]).
    timeout: Duration,
}

impl Outbox {
    /// Default number of pooled connections.
    pub const DEFAULT_POOL_SIZE: usize = 16;
    /// How long an operation of an [`Outbox`] (a listing, a count, a pause, a migration, each
    /// statement of a cleanup) may wait for the database before it fails. Defaults to 30 s.
    pub const DEFAULT_OPERATION_TIMEOUT: Duration = Duration::from_secs(30);
}

struct Inner {
    url: DatabaseUrl,
    pool: Pool,
    wakeup: Wakeup,
}

impl Outbox {
    /// Connects to `url` with a pool of [`Outbox::DEFAULT_POOL_SIZE`] connections, checking that the database
    /// answers.
    pub async fn connect(url: &str) -> Result<Outbox> {
        Outbox::connect_with(DatabaseUrl::parse(url)?, Outbox::DEFAULT_POOL_SIZE).await
    }

    /// Connects with a parsed URL and a pool of `pool_size` connections.
    pub async fn connect_with(url: DatabaseUrl, pool_size: usize) -> Result<Outbox> {
        let outbox = Outbox::connect_lazy(url, pool_size)?;
        drop(outbox.pooled().await?);
        Ok(outbox)
    }

    /// An outbox on `url` with a pool of `pool_size` connections, without connecting yet: each
    /// operation connects as it needs (and fails with [`ErrorKind::Connect`] while the database
    /// cannot be reached). For a process that starts before its database does and waits for it;
    /// only a pool that cannot be built (a bad setting of the URL) is an error here.
    pub fn connect_lazy(url: DatabaseUrl, pool_size: usize) -> Result<Outbox> {
        let pool = url.pool(pool_size)?;
        Ok(Outbox {
            inner: Arc::new(Inner { url, pool, wakeup: Wakeup::new() }),
            timeout: Outbox::DEFAULT_OPERATION_TIMEOUT,
        })
    }

    /// The same outbox, its operations bounded by `timeout` instead of
    /// [`Outbox::DEFAULT_OPERATION_TIMEOUT`]: the admin operations ([`Outbox::queue_stats`],
    /// [`Outbox::dead_letters`], [`Outbox::pause`], [`Outbox::ping`], ...), [`Outbox::migrate`],
    /// [`Outbox::check_schema`] and each statement of [`Outbox::cleanup`]. An operation past it
    /// fails with an error of kind [`ErrorKind::Connect`] that says the database did not answer
    /// (a frozen or overloaded server, a hung proxy). Writes ([`Outbox::publish`], units of
    /// work) are the caller's to bound. Making a connection is bounded by the URL's
    /// `connect_timeout` in any case.
    pub fn with_timeout(mut self, timeout: Duration) -> Outbox {
        self.timeout = timeout;
        self
    }

    /// The bound on each operation's wait for the database.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Runs `work` (`doing` names it in the error) within the operation timeout.
    pub(crate) async fn bounded<T>(&self, doing: &str, work: impl Future<Output = Result<T>>) -> Result<T> {
        within(self.timeout, &self.inner.url, doing, work).await
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

    /// Applies the pending migrations of `migrations/`, in one transaction, and says what it
    /// applied. Several processes may migrate at once (they queue on an advisory lock).
    ///
    /// A migration's DDL needs table locks, and while it waits for one (held by a `pg_dump`, a
    /// long transaction, a claim in delivery) every claim and write that comes after queues
    /// behind it. So each attempt waits for a lock at most 100 ms, twice as long each attempt up
    /// to 2 s (`lock_timeout`); an attempt refused rolls back whole and is tried again. Past the
    /// operation timeout ([`Outbox::with_timeout`]) the error, of kind [`ErrorKind::Migration`],
    /// names the sessions that hold locks on the schema's tables, and nothing was applied.
    pub async fn migrate(&self) -> Result<MigrationReport> {
        let started = tokio::time::Instant::now();
        let mut wait = migrate::LOCK_WAIT_FIRST;
        // The last refusal by a lock (the first one is logged, with who held locks then).
        let mut refused: Option<Error> = None;
        loop {
            let left = self.timeout.saturating_sub(started.elapsed());
            // A lock is waited for within the time left, with some to spare for the other
            // statements, so that the refusal, not the timeout, says why.
            let attempt = async { migrate::attempt(&mut *self.pooled().await?, wait.min(left * 3 / 4)).await };
            let e = match tokio::time::timeout(left, attempt).await {
                Ok(Err(e)) if e.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) => {
                    if refused.is_none() {
                        let holders = self.lock_holders().await;
                        tracing::warn!(error = %e, holders, "a migration waits for table locks; it gives them back and tries again, so that claims and writes queue behind it for at most {} at a time", humantime::format_duration(migrate::LOCK_WAIT_MAX));
                    }
                    e
                }
                Ok(done) => return done,
                // Out of time in an attempt after a refusal: waiting for a lock again, most likely.
                Err(_) => match refused.take() {
                    Some(e) => e,
                    None => return Err(unanswered(&self.inner.url, self.timeout, "applying the migrations")),
                },
            };
            if started.elapsed() + migrate::LOCK_RETRY_PAUSE >= self.timeout {
                let holders = self.lock_holders().await;
                return Err(Error::new(
                    ErrorKind::Migration,
                    format!(
                        "migrations could not take the table locks they need within {} ({holders}); nothing \
                         was applied: run them again once those sessions end (Outbox::with_timeout, or the \
                         command's --db-timeout, waits longer)",
                        humantime::format_duration(self.timeout)
                    ),
                )
                .with_source(e));
            }
            refused = Some(e);
            tokio::time::sleep(migrate::LOCK_RETRY_PAUSE).await;
            wait = (wait * 2).min(migrate::LOCK_WAIT_MAX);
        }
    }

    /// Who holds locks on the schema's tables now, in one line, for a migration's warning or
    /// error (read within a second: it must not hold the error up).
    async fn lock_holders(&self) -> String {
        let read = async { sql::lock_holders(&**self.pooled().await?).await };
        within(Duration::from_secs(1), &self.inner.url, "reading who holds locks", read)
            .await
            .unwrap_or_else(|e| format!("who holds them could not be read: {e}"))
    }

    /// Checks that the database has every migration of this version applied (and none of a newer
    /// one), and that this role may use the schema; the error says what to do.
    pub async fn check_schema(&self) -> Result<()> {
        self.bounded("checking the schema", async { migrate::check_applied(&*self.pooled().await?).await }).await
    }

    /// Adds one event in a transaction of its own, and wakes a relay in this process.
    pub async fn publish(&self, event: &NewEvent) -> Result<i64> {
        let checked = event.validate()?;
        let id = sql::insert_event(&*self.pooled().await?, event, &checked).await?;
        self.inner.wakeup.wake();
        Ok(id)
    }

    /// Adds many events in one statement and transaction, and wakes a relay in this process.
    pub async fn publish_all(&self, events: &[NewEvent]) -> Result<Vec<i64>> {
        let checked = NewEvent::validate_all(events)?;
        let ids = sql::insert_events(&*self.pooled().await?, events, &checked).await?;
        self.inner.wakeup.wake();
        Ok(ids)
    }
}

/// Runs `work` for at most `timeout`; past it, an error saying that the database at `url` did not
/// answer while `doing`.
pub(crate) async fn within<T>(
    timeout: Duration,
    url: &DatabaseUrl,
    doing: &str,
    work: impl Future<Output = Result<T>>,
) -> Result<T> {
    match tokio::time::timeout(timeout, work).await {
        Ok(done) => done,
        Err(_) => Err(unanswered(url, timeout, doing)),
    }
}

/// The database at `url` did not answer within `timeout` while `doing` something.
fn unanswered(url: &DatabaseUrl, timeout: Duration, doing: &str) -> Error {
    Error::new(
        ErrorKind::Connect,
        format!(
            "the database at {} did not answer within {} while {doing} (a frozen or overloaded server, or a hung proxy?)",
            url.target(),
            humantime::format_duration(timeout)
        ),
    )
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
