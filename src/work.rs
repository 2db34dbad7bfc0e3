//! The high-level write API: a unit of work under an idempotency key, in one transaction.
//!
//! [`Connection::begin`] takes the key and answers [`Begun::Replayed`] (the key was used for
//! this request before: here is its response, nothing runs) or [`Begun::Fresh`] (a [`Work`]: the
//! open transaction, for the business SQL, audit entries and events). [`Work::commit`] writes the
//! receipt with the response and commits; dropping a `Work` rolls everything back.
//! [`Outbox::execute`] does the same around an async closure.

use std::ops::{Deref, DerefMut};

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::error::{Error, ErrorKind, Result};
use crate::event::AuditEntry;
use crate::event::{NewEvent, validate_key};
use crate::outbox::{Connection, Outbox};
use crate::sql;

/// How a unit of work under an idempotency key begins: see [`Connection::begin`].
#[must_use = "a Fresh unit of work must be committed, or it rolls back when dropped"]
#[derive(Debug)]
pub enum Begun<'c> {
    /// The key was used before for the same request: its stored response; nothing was written
    /// and nothing is to be done.
    Replayed(Replayed),
    /// The key now belongs to this transaction: do the work, then [`Work::commit`] the response.
    Fresh(Work<'c>),
}

/// The stored response of a request seen before.
#[derive(Debug, Clone, PartialEq)]
pub struct Replayed {
    response: Value,
}

impl Replayed {
    /// The stored response, as the type it was stored from.
    pub fn response<T: DeserializeOwned>(&self) -> Result<T> {
        Ok(serde_json::from_value(self.response.clone())?)
    }

    /// The stored response as JSON.
    pub fn into_json(self) -> Value {
        self.response
    }
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

impl Connection {
    /// Begins a unit of work under an idempotency key, in one transaction.
    ///
    /// # Behavior
    /// 1. Validates `key` and fingerprints `request` (SHA-256 of its JSON).
    /// 2. Opens a transaction (READ COMMITTED, whatever the session's default) and takes the
    ///    key's lock (an advisory lock of the transaction). If another request of the key is
    ///    running, this waits for it: when it commits, its stored response comes back as
    ///    [`Begun::Replayed`]; when it rolls back, this request gets the key. The receipt itself
    ///    is written once, with the response, by [`Work::commit`].
    /// 3. Returns [`Begun::Fresh`]: a [`Work`] that derefs to the open transaction for business
    ///    SQL, records audit entries and events, and [`commit`](Work::commit)s the response with
    ///    the receipt: business rows, audit entries, receipt and events exist together, or none
    ///    does. Dropping the `Work` (an early return, a `?`) rolls all of it back.
    ///
    /// # Errors
    /// An invalid key ([`ErrorKind::InvalidInput`]), a key reused with a different request
    /// ([`ErrorKind::KeyReused`]; nothing is written), or a database failure.
    ///
    /// # Example
    /// ```no_run
    /// use pg_outbox_relay::{AuditEntry, Begun, NewEvent, Outbox};
    /// use serde_json::{Value, json};
    ///
    /// async fn place_order(outbox: &Outbox, key: &str, request: &Value) -> Result<Value, pg_outbox_relay::Error> {
    ///     let mut connection = outbox.connection().await?;
    ///     let work = match connection.begin(key, request).await? {
    ///         Begun::Replayed(replayed) => return Ok(replayed.into_json()),
    ///         Begun::Fresh(work) => work,
    ///     };
    ///     let row = work.query_one("insert into orders (customer) values ($1) returning id", &[&request["customer"].as_str()]).await?;
    ///     let order_id: i64 = row.get(0);
    ///     work.audit(&AuditEntry::new("order", order_id, "placed", request)?).await?;
    ///     work.publish(&NewEvent::new("order.placed", json!({"order_id": order_id})).key(order_id.to_string())).await?;
    ///     let response = json!({"order_id": order_id});
    ///     work.commit(&response).await?;
    ///     Ok(response)
    /// }
    /// ```
    pub async fn begin<Req: Serialize + ?Sized>(&mut self, key: &str, request: &Req) -> Result<Begun<'_>> {
        validate_key("idempotency key", key)?;
        let fingerprint = fingerprint(request)?;
        // READ COMMITTED whatever the session's default: the receipt's read must see what a
        // request it waited for committed.
        let tx = self
            .client
            .build_transaction()
            .isolation_level(tokio_postgres::IsolationLevel::ReadCommitted)
            .start()
            .await
            .map_err(|e| Error::database("starting a transaction", e))?;
        // The key's lock first: another request of this key, still running, is waited for. Its
        // receipt, when it committed one, is what the read (a statement of its own, after the
        // wait) finds.
        let (lock, receipt) = sql::lock_and_get_receipt(&tx, key).await?;
        sql::check_isolation(key, &lock.isolation)?;
        if let Some(receipt) = receipt {
            drop(tx.rollback().await);
            return replay(key, &fingerprint, receipt).map(Begun::Replayed);
        }
        Ok(Begun::Fresh(Work { tx, key: key.to_string(), fingerprint, began: lock.began, outbox: &self.outbox }))
    }
}

/// `response` as the receipt stores it, checked as a payload is.
pub(crate) fn response_to_store<T: Serialize + ?Sized>(response: &T) -> Result<Value> {
    let stored = serde_json::to_value(response)?;
    crate::payload::check_storable("the response of the unit of work", &stored)?;
    Ok(stored)
}

impl Outbox {
    /// Runs a unit of work once per idempotency key, in one transaction: [`Connection::begin`],
    /// then `work`, then [`Work::commit`] with its response.
    ///
    /// An error returned by `work` rolls everything back and is returned as is; the crate's own
    /// errors reach the caller through `E: From<Error>`. When the commit itself fails on a broken
    /// connection its outcome is unknown; retrying with the same key is safe and replays the
    /// response if it had committed.
    ///
    /// ```no_run
    /// # async fn f(outbox: pg_outbox_relay::Outbox) -> Result<(), pg_outbox_relay::Error> {
    /// use pg_outbox_relay::{AuditEntry, NewEvent};
    /// use serde_json::json;
    /// let request = json!({"customer": "ana", "total": 12.5});
    /// let placed = outbox
    ///     .execute("order-7f3c", &request, async |work| {
    ///         let row = work.query_one("insert into orders (customer) values ('ana') returning id", &[]).await?;
    ///         let id: i64 = row.get(0);
    ///         work.audit(&AuditEntry::new("order", id, "placed", &request)?).await?;
    ///         work.publish(&NewEvent::new("order.placed", json!({"order_id": id}))).await?;
    ///         Ok::<_, pg_outbox_relay::Error>(json!({"order_id": id}))
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
        F: AsyncFnOnce(&mut Work<'_>) -> Result<T, E>,
    {
        let mut connection = self.connection().await?;
        let mut unit = match connection.begin(key, request).await? {
            Begun::Replayed(replayed) => return Ok(Executed { response: replayed.response()?, replayed: true }),
            Begun::Fresh(unit) => unit,
        };
        let response = work(&mut unit).await?;
        unit.commit(&response).await?;
        Ok(Executed { response, replayed: false })
    }
}

pub(crate) fn fingerprint<Req: Serialize + ?Sized>(request: &Req) -> Result<Vec<u8>> {
    let json = serde_json::to_vec(request)?;
    Ok(Sha256::digest(&json).to_vec())
}

/// The stored response of `key` for a request with `fingerprint`: refused when the key was
/// taken for another request, or through the SQL door (`outbox_relay.begin_request`, migration
/// 0020: its fingerprints are longer and hash the jsonb text, so the two doors cannot compare
/// requests).
pub(crate) fn replay(key: &str, fingerprint: &[u8], stored: sql::Receipt) -> Result<Replayed> {
    if stored.fingerprint.len() != fingerprint.len() {
        return Err(Error::new(
            ErrorKind::KeyReused,
            format!(
                "idempotency key {key:?} was claimed through outbox_relay.begin_request (the SQL door), which fingerprints requests its own way: retry a request through the door that first took its key; nothing was written"
            ),
        ));
    }
    if stored.fingerprint != fingerprint {
        return Err(Error::new(
            ErrorKind::KeyReused,
            format!("idempotency key {key:?} was already used for a different request; nothing was written"),
        ));
    }
    let response = stored.response.ok_or_else(|| {
        Error::new(ErrorKind::Database, format!("the receipt of idempotency key {key:?} has no stored response"))
    })?;
    Ok(Replayed { response })
}

/// A unit of work under an idempotency key: the open transaction (it derefs to
/// [`tokio_postgres::Transaction`] for business SQL), plus audit entries and events that commit
/// with it. [`commit`](Work::commit) it with the response; dropping it rolls back.
pub struct Work<'c> {
    tx: deadpool_postgres::Transaction<'c>,
    key: String,
    fingerprint: Vec<u8>,
    /// When the transaction that took the key began (`now()`, microseconds).
    began: i64,
    outbox: &'c Outbox,
}

impl<'c> Work<'c> {
    /// The idempotency key this work runs under.
    pub fn idempotency_key(&self) -> &str {
        &self.key
    }

    /// Adds an event that commits with this work.
    pub async fn publish(&self, event: &NewEvent) -> Result<i64> {
        let checked = event.validate()?;
        sql::insert_event(&self.tx, event, &checked).await
    }

    /// Adds many events in one statement; returns their ids in order.
    pub async fn publish_all(&self, events: &[NewEvent]) -> Result<Vec<i64>> {
        let checked = NewEvent::validate_all(events)?;
        sql::insert_events(&self.tx, events, &checked).await
    }

    /// Adds an audit entry that commits with this work, linked to the idempotency key.
    pub async fn audit(&self, entry: &AuditEntry<'_>) -> Result<i64> {
        entry.validate()?;
        sql::insert_audit(&self.tx, entry, Some(&self.key)).await
    }

    /// Opens a savepoint named `name`: a nested transaction of this work that commits into it or
    /// rolls back alone (dropping it rolls back to the savepoint).
    pub async fn savepoint(&mut self, name: &str) -> Result<tokio_postgres::Transaction<'_>> {
        let tx: &mut tokio_postgres::Transaction<'c> = &mut self.tx;
        tx.savepoint(name).await.map_err(|e| Error::database("opening a savepoint", e))
    }

    /// Prepares `sql` once per pooled connection (the pool's statement cache) and returns the
    /// statement: a business statement that every unit of work runs then costs one round trip,
    /// where `query(&str, ..)` prepares it anew each time (two).
    pub async fn prepare_cached(&self, sql: &str) -> Result<tokio_postgres::Statement> {
        self.tx.prepare_cached(sql).await.map_err(|e| Error::database("preparing a statement", e))
    }

    /// Writes the receipt with `response` (what every replay of this key will return) and
    /// commits: business rows, audit entries, receipt and events, together. Wakes a relay in
    /// this process.
    ///
    /// The receipt and the COMMIT go in one round trip. When the receipt's insert fails on the
    /// server (the key was taken meanwhile by a request that does not take its lock: an earlier
    /// version of this library), the server refuses what follows in the transaction, so the
    /// COMMIT rolls back and the error is the insert's. When the work ended the transaction
    /// itself (a COMMIT or ROLLBACK run through it), no receipt is written, and the error says so.
    pub async fn commit<T: Serialize + ?Sized>(self, response: &T) -> Result<()> {
        let stored = response_to_store(response)?;
        let Work { tx, key, fingerprint, began, outbox } = self;
        // Prepared first (once per connection), so that the insert is sent at its first poll,
        // ahead of the COMMIT. Its parameters (a text, a bytea, a JSON value and an int8, for
        // text, bytea, jsonb and int8) cannot fail to encode, so the COMMIT never goes without the
        // insert before it.
        sql::Db::prepare(&tx, sql::RECEIPT_INSERT).await.map_err(|e| Error::database("storing the response", e))?;
        let (stored, committed) =
            futures::join!(sql::insert_receipt(&tx, &key, &fingerprint, &stored, began), tx.batch_execute("commit"));
        // The transaction has ended on the server either way (committed, or rolled back by the
        // COMMIT of a failed transaction): the handle must not send its ROLLBACK when dropped.
        // It owns nothing on the heap (a top-level transaction has no savepoint name).
        std::mem::forget(tx);
        stored?;
        committed.map_err(|e| Error::database("committing", e))?;
        outbox.wakeup().wake();
        Ok(())
    }

    /// Rolls everything back now (dropping the work does the same, without waiting).
    pub async fn rollback(self) -> Result<()> {
        self.tx.rollback().await.map_err(|e| Error::database("rolling back", e))
    }
}

impl<'c> Deref for Work<'c> {
    type Target = tokio_postgres::Transaction<'c>;

    fn deref(&self) -> &Self::Target {
        &self.tx
    }
}

impl DerefMut for Work<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.tx
    }
}

impl std::fmt::Debug for Work<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Work").field("idempotency_key", &self.key).finish_non_exhaustive()
    }
}
