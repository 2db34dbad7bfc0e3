//! The high-level write API: a unit of work under an idempotency key, in one transaction.

use std::ops::Deref;
use std::sync::Arc;

use deadpool_postgres::Pool;
use futures::future::BoxFuture;
use serde::Serialize;
use serde::de::DeserializeOwned;
use sha2::{Digest, Sha256};

use crate::connect::{DEFAULT_POOL_SIZE, DatabaseUrl, pool_error};
use crate::error::{Error, ErrorKind, Result};
use crate::event::{NewEvent, validate_key};
use crate::migrate::{self, MigrationReport};
use crate::publish::{self, AuditEntry};
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

/// The answer of [`Outbox::execute`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Executed<T> {
    /// The response: computed now, or the one stored by the first request with this key.
    pub response: T,
    /// True when the key had been used already and the stored response was returned; nothing was
    /// written by this call.
    pub replayed: bool,
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
        drop(outbox.client().await?);
        Ok(outbox)
    }

    /// The connection pool, for the service's own queries.
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

    /// A pooled connection, with an error that names the server when none can be had.
    pub async fn client(&self) -> Result<deadpool_postgres::Object> {
        self.inner.pool.get().await.map_err(|e| pool_error(&self.inner.url, e))
    }

    /// Applies the pending migrations of `migrations/` and says what it applied.
    pub async fn migrate(&self) -> Result<MigrationReport> {
        let mut client = self.client().await?;
        migrate::run(&mut client).await
    }

    /// Checks that the database has every migration of this version applied (and none of a newer
    /// one), and that this role may use the schema; the error says what to do.
    pub async fn check_schema(&self) -> Result<()> {
        let client = self.client().await?;
        migrate::check_applied(&client).await
    }

    /// Adds one event in a transaction of its own, and wakes a relay in this process.
    pub async fn publish(&self, event: &NewEvent) -> Result<i64> {
        event.validate()?;
        let client = self.client().await?;
        let statement = client.prepare_cached(sql::EVENT_INSERT).await.map_err(|e| Error::database("preparing", e))?;
        let id = publish::insert_event(&**client, &statement, event).await?;
        self.inner.wakeup.wake();
        Ok(id)
    }

    /// Adds many events in one statement and transaction, and wakes a relay in this process.
    pub async fn publish_all(&self, events: &[NewEvent]) -> Result<Vec<i64>> {
        for event in events {
            event.validate()?;
        }
        let client = self.client().await?;
        let statement =
            client.prepare_cached(sql::EVENT_INSERT_MANY).await.map_err(|e| Error::database("preparing", e))?;
        let ids = publish::insert_events(&**client, &statement, events).await?;
        self.inner.wakeup.wake();
        Ok(ids)
    }

    /// Runs a unit of work once per idempotency key, in one transaction.
    ///
    /// # Behavior
    /// 1. Validates `key` and fingerprints `request` (SHA-256 of its JSON).
    /// 2. Opens a transaction and claims the key. If another request holds the key uncommitted,
    ///    this waits for it: when it commits, its stored response is returned with
    ///    `replayed: true` and `work` never runs; when it rolls back, this request proceeds.
    /// 3. Runs `work`, which does its business SQL through the [`Work`] handle (it derefs to the
    ///    transaction) and records audit entries and events with [`Work::audit`] and
    ///    [`Work::publish`].
    /// 4. Stores the response with the receipt and commits: business rows, audit entries, receipt
    ///    and events exist together, or none does.
    ///
    /// # Errors
    /// An error returned by `work` rolls everything back and is returned as is. The crate's own
    /// errors reach the caller through `E: From<Error>`: an invalid key ([`ErrorKind::InvalidInput`]),
    /// a key reused with a different request ([`ErrorKind::KeyReused`]; nothing is written), or a
    /// database failure. When the commit itself fails on a broken connection its outcome is
    /// unknown; retrying with the same key is safe and replays the response if it had committed.
    ///
    /// # Example
    /// ```no_run
    /// # async fn f(outbox: outbox_relay::Outbox) -> Result<(), outbox_relay::Error> {
    /// use outbox_relay::{AuditEntry, NewEvent};
    /// use serde_json::json;
    /// let request = json!({"customer": "ana", "total": 12.5});
    /// let placed = outbox
    ///     .execute("order-7f3c", &request, |work| {
    ///         let request = request.clone();
    ///         Box::pin(async move {
    ///             let row = work
    ///                 .query_one("insert into orders (customer, total) values ($1, $2) returning id",
    ///                            &[&"ana", &12.5f64])
    ///                 .await?;
    ///             let id: i64 = row.get(0);
    ///             work.audit(&AuditEntry::new("order", id, "placed", &request)?).await?;
    ///             work.publish(&NewEvent::new("order.placed", json!({"order_id": id})).key(id.to_string())).await?;
    ///             Ok::<_, outbox_relay::Error>(json!({"order_id": id}))
    ///         })
    ///     })
    ///     .await?;
    /// println!("order {} (replayed: {})", placed.response["order_id"], placed.replayed);
    /// # Ok(()) }
    /// ```
    pub async fn execute<Req, T, E, F>(&self, key: &str, request: &Req, work: F) -> Result<Executed<T>, E>
    where
        Req: Serialize + ?Sized,
        T: Serialize + DeserializeOwned,
        E: From<Error>,
        F: for<'c> FnOnce(&'c mut Work<'_>) -> BoxFuture<'c, Result<T, E>>,
    {
        validate_key("idempotency key", key)?;
        let fingerprint = fingerprint(request)?;
        let mut client = self.client().await?;
        // A receipt may vanish between our conflicting insert and our read (the janitor removed an
        // expired one); then the key is free again and the claim is retried.
        for _ in 0..3 {
            let tx = client.transaction().await.map_err(|e| Error::database("starting a transaction", e))?;
            let claim = tx.prepare_cached(sql::IDEMPOTENCY_CLAIM).await.map_err(|e| Error::database("preparing", e))?;
            let claimed = tx
                .query_opt(&claim, &[&key, &fingerprint])
                .await
                .map_err(|e| Error::database("claiming the idempotency key", e))?;
            if claimed.is_none() {
                let get = tx.prepare_cached(sql::IDEMPOTENCY_GET).await.map_err(|e| Error::database("preparing", e))?;
                let stored = tx
                    .query_opt(&get, &[&key])
                    .await
                    .map_err(|e| Error::database("reading the idempotency receipt", e))?;
                drop(tx.rollback().await);
                let Some(stored) = stored else { continue };
                return Ok(replay(key, &fingerprint, &stored)?);
            }

            let mut handle = Work { tx, key };
            let response = match work(&mut handle).await {
                Ok(response) => response,
                Err(err) => {
                    drop(handle.tx.rollback().await);
                    return Err(err);
                }
            };
            let tx = handle.tx;
            let stored = serde_json::to_value(&response).map_err(Error::from)?;
            crate::payload::check_storable("the response of the unit of work", &stored)?;
            tx.execute(sql::IDEMPOTENCY_STORE_RESPONSE, &[&key, &stored])
                .await
                .map_err(|e| Error::database("storing the response", e))?;
            tx.commit().await.map_err(|e| Error::database("committing", e))?;
            self.inner.wakeup.wake();
            return Ok(Executed { response, replayed: false });
        }
        Err(Error::new(ErrorKind::Database, format!("idempotency key {key:?} kept changing hands; try again")).into())
    }
}

impl std::fmt::Debug for Outbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbox").field("url", &self.inner.url).finish_non_exhaustive()
    }
}

fn fingerprint<Req: Serialize + ?Sized>(request: &Req) -> Result<Vec<u8>> {
    let json = serde_json::to_vec(request)?;
    Ok(Sha256::digest(&json).to_vec())
}

fn replay<T: DeserializeOwned>(key: &str, fingerprint: &[u8], stored: &tokio_postgres::Row) -> Result<Executed<T>> {
    let stored_fingerprint: &[u8] = stored.get(0);
    if stored_fingerprint != fingerprint {
        return Err(Error::new(
            ErrorKind::KeyReused,
            format!("idempotency key {key:?} was already used for a different request; nothing was written"),
        ));
    }
    let response: Option<serde_json::Value> = stored.get(1);
    let response = response.ok_or_else(|| {
        Error::new(ErrorKind::Database, format!("the receipt of idempotency key {key:?} has no stored response"))
    })?;
    Ok(Executed { response: serde_json::from_value(response)?, replayed: true })
}

/// The handle a unit of work gets from [`Outbox::execute`]: the open transaction (it derefs to
/// [`tokio_postgres::Transaction`] for business SQL), plus audit entries and events that commit
/// with it.
pub struct Work<'a> {
    tx: deadpool_postgres::Transaction<'a>,
    key: &'a str,
}

impl<'a> Work<'a> {
    /// The idempotency key this work runs under.
    pub fn idempotency_key(&self) -> &str {
        self.key
    }

    /// Adds an event that commits with this work.
    pub async fn publish(&self, event: &NewEvent) -> Result<i64> {
        event.validate()?;
        let statement = self.tx.prepare_cached(sql::EVENT_INSERT).await.map_err(|e| Error::database("preparing", e))?;
        publish::insert_event(&**self, &statement, event).await
    }

    /// Adds many events in one statement; returns their ids in order.
    pub async fn publish_all(&self, events: &[NewEvent]) -> Result<Vec<i64>> {
        for event in events {
            event.validate()?;
        }
        let statement =
            self.tx.prepare_cached(sql::EVENT_INSERT_MANY).await.map_err(|e| Error::database("preparing", e))?;
        publish::insert_events(&**self, &statement, events).await
    }

    /// Adds an audit entry that commits with this work, linked to the idempotency key.
    pub async fn audit(&self, entry: &AuditEntry<'_>) -> Result<i64> {
        entry.validate()?;
        let statement = self.tx.prepare_cached(sql::AUDIT_INSERT).await.map_err(|e| Error::database("preparing", e))?;
        publish::insert_audit(&**self, &statement, entry, Some(self.key)).await
    }
}

impl<'a> Deref for Work<'a> {
    type Target = tokio_postgres::Transaction<'a>;

    fn deref(&self) -> &Self::Target {
        &self.tx
    }
}
