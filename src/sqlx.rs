//! Events and audit entries inside a [sqlx](https://docs.rs/sqlx/0.8) transaction (feature
//! `sqlx`, sqlx 0.8): the same statements, validation and errors as [`crate::publish`], on the
//! caller's `PgConnection`, so the events commit with the business change or vanish with its
//! rollback.
//!
//! ```no_run
//! # async fn f(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! use pg_outbox_relay::NewEvent;
//! let mut tx = pool.begin().await?;
//! let order_id: i64 = sqlx::query_scalar("insert into orders (total) values (12.5) returning id")
//!     .fetch_one(&mut *tx)
//!     .await?;
//! pg_outbox_relay::sqlx::publish(&mut *tx, &NewEvent::new("order.placed", serde_json::json!({"order_id": order_id}))).await?;
//! tx.commit().await?;
//! # Ok(()) }
//! ```

use ::sqlx::PgConnection;
use ::sqlx::types::Json;

use crate::error::{Error, ErrorKind, Result};
use crate::event::AuditEntry;
use crate::event::NewEvent;
use crate::sql;

/// A sqlx error while `doing`, its SQLSTATE kept for [`Error::code`].
fn failed(doing: &str) -> impl FnOnce(::sqlx::Error) -> Error + '_ {
    move |e| caused_by(Error::new(ErrorKind::Database, format!("{doing}: {e}")), e)
}

/// The SQLSTATE of a sqlx error, when the database answered.
fn sqlstate(e: &::sqlx::Error) -> Option<String> {
    e.as_database_error().and_then(|db| db.code()).map(|code| code.into_owned())
}

/// `error`, caused by the sqlx error `e`: its SQLSTATE kept for [`Error::code`].
fn caused_by(error: Error, e: ::sqlx::Error) -> Error {
    let error = match sqlstate(&e) {
        Some(code) => error.with_sqlstate(&code),
        None => error,
    };
    error.with_source(e)
}

/// Adds one event inside the caller's transaction (`&mut *tx`) and returns its id. A keyed
/// event takes its key's lock first, so writers of one key commit in id order.
pub async fn publish(conn: &mut PgConnection, event: &NewEvent) -> Result<i64> {
    let checked = event.validate()?;
    let delay = sql::micros(event.delay);
    let query = match &event.key {
        None => ::sqlx::query_scalar::<_, i64>(sql::EVENT_INSERT),
        Some(_) => ::sqlx::query_scalar::<_, i64>(sql::EVENT_INSERT_KEYED),
    };
    let query = query
        .bind(&event.topic)
        .bind(event.key.as_deref())
        .bind(checked.payload.get())
        .bind(delay)
        .bind(checked.headers.as_deref());
    let query = if event.key.is_some() { query.bind(sql::KEY_LOCK_CLASS) } else { query };
    query.fetch_one(conn).await.map_err(failed("adding an event"))
}

/// Adds many events in one statement and returns their ids in the same order.
pub async fn publish_all(conn: &mut PgConnection, events: &[NewEvent]) -> Result<Vec<i64>> {
    let checked = NewEvent::validate_all(events)?;
    if events.is_empty() {
        return Ok(Vec::new());
    }
    let c = sql::EventColumns::new(events, &checked);
    if !c.keyed.is_empty() {
        ::sqlx::query(sql::KEYS_LOCK)
            .bind(sql::KEY_LOCK_CLASS)
            .bind(&c.keyed)
            .execute(&mut *conn)
            .await
            .map_err(failed("locking the events' keys"))?;
    }
    ::sqlx::query_scalar::<_, i64>(sql::EVENT_INSERT_MANY)
        .bind(&c.topics)
        .bind(&c.keys)
        .bind(&c.payloads)
        .bind(&c.delays)
        .bind(&c.headers)
        .fetch_all(conn)
        .await
        .map_err(failed("adding events"))
}

/// Adds one audit entry inside the caller's transaction and returns its id.
pub async fn audit(conn: &mut PgConnection, entry: &AuditEntry<'_>) -> Result<i64> {
    insert_audit(conn, entry, None).await
}

/// Adds one audit entry, linked to an idempotency key when there is one; returns its id.
async fn insert_audit(conn: &mut PgConnection, entry: &AuditEntry<'_>, idempotency_key: Option<&str>) -> Result<i64> {
    entry.validate()?;
    ::sqlx::query_scalar::<_, i64>(sql::AUDIT_INSERT)
        .bind(entry.entity)
        .bind(&entry.entity_id)
        .bind(entry.action)
        .bind(Json(&entry.data))
        .bind(idempotency_key)
        .fetch_one(conn)
        .await
        .map_err(failed("adding an audit entry"))
}

/// [`Inbox::record`](crate::inbox::Inbox::record) in a sqlx transaction (`&mut tx`): records
/// `event` for the inbox's consumer and says whether it is new; the record commits or rolls
/// back with the handler's writes.
pub async fn record_in_inbox(
    tx: &mut ::sqlx::Transaction<'_, ::sqlx::Postgres>,
    inbox: &crate::inbox::Inbox,
    event: uuid::Uuid,
) -> Result<crate::inbox::Recorded> {
    let row = ::sqlx::query_scalar::<_, bool>(sql::INBOX_RECORD)
        .bind(inbox.consumer())
        .bind(event)
        .fetch_optional(&mut **tx)
        .await
        .map_err(failed("recording an event in the inbox"))?;
    Ok(if row.is_some() { crate::inbox::Recorded::New } else { crate::inbox::Recorded::Duplicate })
}

/// [`Inbox::purge`](crate::inbox::Inbox::purge) on a sqlx connection: deletes the inbox's
/// records older than `retention` (at least [`MIN_RETENTION`](crate::inbox::MIN_RETENTION)), in
/// batches, and returns how many.
pub async fn purge_inbox(
    conn: &mut PgConnection,
    inbox: &crate::inbox::Inbox,
    retention: std::time::Duration,
) -> Result<u64> {
    crate::inbox::check_retention(retention)?;
    let batch = crate::inbox::PURGE_BATCH;
    let mut deleted = 0;
    loop {
        let n = ::sqlx::query(sql::INBOX_PURGE)
            .bind(inbox.consumer())
            .bind(sql::micros(retention))
            .bind(batch)
            .execute(&mut *conn)
            .await
            .map_err(failed("deleting old inbox records"))?
            .rows_affected();
        deleted += n;
        if n < batch as u64 {
            return Ok(deleted);
        }
    }
}

/// How a unit of work under an idempotency key begins through sqlx: see [`begin`].
#[must_use = "a Fresh unit of work must be committed, or it rolls back when dropped"]
#[derive(Debug)]
pub enum Begun<'t> {
    /// The key was used before for the same request: its stored response; nothing was written
    /// and nothing is to be done (the transaction was rolled back).
    Replayed(crate::Replayed),
    /// The key now belongs to this transaction: do the work, then [`Work::commit`] the response.
    Fresh(Work<'t>),
}

/// [`Connection::begin`](crate::outbox::Connection::begin) on a sqlx transaction the caller
/// began: takes `key` for `request` (its fingerprint is the SHA-256 of its JSON, as the
/// tokio-postgres door computes it, so the two doors replay each other's keys, and they take a
/// key's lock alike). If another request of the key is running, this waits for it: when it
/// commits, its stored response comes back as [`Begun::Replayed`] (and `tx` is rolled back);
/// when it rolls back, this request gets the key.
///
/// # Errors
/// An invalid key, or a transaction not at READ COMMITTED ([`ErrorKind::InvalidInput`]: the
/// read after the key's lock must see what a request waited for committed), a key reused with
/// a different request or taken through the SQL door ([`ErrorKind::KeyReused`]; nothing is
/// written), or a database failure.
///
/// ```no_run
/// # async fn f(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// use pg_outbox_relay::sqlx::{Begun, begin};
/// use pg_outbox_relay::{AuditEntry, NewEvent};
/// use serde_json::json;
/// let request = json!({"customer": "ana", "total": 12.5});
/// let mut work = match begin(pool.begin().await?, "order-7f3c", &request).await? {
///     Begun::Replayed(replayed) => return Ok(println!("{}", replayed.into_json())),
///     Begun::Fresh(work) => work,
/// };
/// let id: i64 = sqlx::query_scalar("insert into orders (customer) values ('ana') returning id")
///     .fetch_one(&mut *work)
///     .await?;
/// work.audit(&AuditEntry::new("order", id, "placed", &request)?).await?;
/// work.publish(&NewEvent::new("order.placed", json!({"order_id": id})).key(id.to_string())).await?;
/// work.commit(&json!({"order_id": id})).await?;
/// # Ok(()) }
/// ```
pub async fn begin<'t, Req: serde::Serialize + ?Sized>(
    mut tx: ::sqlx::Transaction<'t, ::sqlx::Postgres>,
    key: &str,
    request: &Req,
) -> Result<Begun<'t>> {
    crate::event::validate_key("idempotency key", key)?;
    let fingerprint = crate::work::fingerprint(request)?;
    // The key's lock, then the receipt in a statement of its own (see `Connection::begin`):
    // sqlx sends one statement at a time, so these are two round trips.
    let (isolation, began) = ::sqlx::query_as::<_, (String, i64)>(sql::RECEIPT_LOCK)
        .bind(sql::RECEIPT_LOCK_CLASS)
        .bind(key)
        .fetch_one(&mut *tx)
        .await
        .map_err(failed("taking the idempotency key's lock"))?;
    sql::check_isolation(key, &isolation)?;
    let stored = ::sqlx::query_as::<_, (Vec<u8>, Option<Json<serde_json::Value>>)>(sql::RECEIPT_GET)
        .bind(key)
        .fetch_optional(&mut *tx)
        .await
        .map_err(failed("reading the idempotency receipt"))?;
    if let Some((stored_fingerprint, response)) = stored {
        drop(tx.rollback().await);
        let receipt = sql::Receipt { fingerprint: stored_fingerprint, response: response.map(|r| r.0) };
        return crate::work::replay(key, &fingerprint, receipt).map(Begun::Replayed);
    }
    Ok(Begun::Fresh(Work { tx, key: key.to_string(), fingerprint, began }))
}

/// [`Outbox::execute`](crate::Outbox::execute) on a sqlx pool: runs `work` once per idempotency
/// key, in one transaction ([`begin`], then `work`, then [`Work::commit`] with its response).
/// An error returned by `work` rolls everything back and is returned as is.
pub async fn execute<Req, T, E, F>(
    pool: &::sqlx::PgPool,
    key: &str,
    request: &Req,
    work: F,
) -> std::result::Result<crate::Executed<T>, E>
where
    Req: serde::Serialize + ?Sized,
    T: serde::Serialize + serde::de::DeserializeOwned,
    E: From<Error>,
    F: AsyncFnOnce(&mut Work<'_>) -> std::result::Result<T, E>,
{
    let tx = pool.begin().await.map_err(failed("starting a transaction"))?;
    let mut unit = match begin(tx, key, request).await? {
        Begun::Replayed(replayed) => {
            return Ok(crate::Executed { response: replayed.response()?, replayed: true });
        }
        Begun::Fresh(unit) => unit,
    };
    let response = work(&mut unit).await?;
    unit.commit(&response).await?;
    Ok(crate::Executed { response, replayed: false })
}

/// A unit of work under an idempotency key on a sqlx transaction (it derefs to the
/// transaction's `PgConnection`: `&mut *work` for business SQL, as `&mut *tx` for a sqlx
/// transaction), plus audit entries and events that commit with it. [`commit`](Work::commit) it with the
/// response; dropping it rolls back.
pub struct Work<'t> {
    tx: ::sqlx::Transaction<'t, ::sqlx::Postgres>,
    key: String,
    fingerprint: Vec<u8>,
    /// When the transaction that took the key began (`now()`, microseconds).
    began: i64,
}

impl Work<'_> {
    /// The idempotency key this work runs under.
    pub fn idempotency_key(&self) -> &str {
        &self.key
    }

    /// Adds an event that commits with this work.
    pub async fn publish(&mut self, event: &NewEvent) -> Result<i64> {
        publish(&mut self.tx, event).await
    }

    /// Adds many events in one statement; returns their ids in order.
    pub async fn publish_all(&mut self, events: &[NewEvent]) -> Result<Vec<i64>> {
        publish_all(&mut self.tx, events).await
    }

    /// Adds an audit entry that commits with this work, linked to the idempotency key.
    pub async fn audit(&mut self, entry: &AuditEntry<'_>) -> Result<i64> {
        insert_audit(&mut self.tx, entry, Some(&self.key)).await
    }

    /// Writes the receipt with `response` (what every replay of this key will return) and
    /// commits: business rows, audit entries, receipt and events, together.
    pub async fn commit<T: serde::Serialize + ?Sized>(mut self, response: &T) -> Result<()> {
        let stored = crate::work::response_to_store(response)?;
        let inserted = ::sqlx::query(sql::RECEIPT_INSERT)
            .bind(&self.key)
            .bind(&self.fingerprint)
            .bind(Json(&stored))
            .bind(self.began)
            .execute(&mut *self.tx)
            .await;
        match inserted {
            Ok(done) => sql::receipt_written(&self.key, done.rows_affected())?,
            Err(e) => return Err(caused_by(sql::receipt_refused(&self.key, sqlstate(&e).as_deref()), e)),
        }
        self.tx.commit().await.map_err(failed("committing"))
    }

    /// Rolls everything back now (dropping the work does the same).
    pub async fn rollback(self) -> Result<()> {
        self.tx.rollback().await.map_err(failed("rolling back"))
    }
}

impl std::ops::Deref for Work<'_> {
    type Target = PgConnection;

    fn deref(&self) -> &Self::Target {
        &self.tx
    }
}

impl std::ops::DerefMut for Work<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.tx
    }
}

impl std::fmt::Debug for Work<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Work").field("idempotency_key", &self.key).finish_non_exhaustive()
    }
}
