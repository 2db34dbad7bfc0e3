//! Idempotency receipts: taking a key, reading a stored answer, writing one, expiring them.

use std::time::Duration;

use serde_json::Value;

use super::{Db, all, count, micros};
use crate::error::Result;

/// The class of the advisory locks that serialize requests of one idempotency key (migration
/// 0022): `pg_advisory_xact_lock(RECEIPT_LOCK_CLASS, hashtext(key))`. Apart from the events'
/// key locks ([`super::KEY_LOCK_CLASS`]).
pub(crate) const RECEIPT_LOCK_CLASS: i32 = 0x6964_6d70;

/// Takes the key's lock: waits while another request of the key runs, until it ends. The
/// receipt is read after it, in a statement of its own, which sees what that request committed
/// (READ COMMITTED takes a snapshot per statement; one taken before the wait would not).
pub(crate) const RECEIPT_LOCK: &str = "select pg_advisory_xact_lock($1, hashtext($2))";

pub(crate) const RECEIPT_GET: &str = "select fingerprint, response from outbox_relay.idempotency where key = $1";

/// The receipt with its response, written once at the end of the work, in the COMMIT's round
/// trip. It fails with unique_violation when a request that does not take the key's lock (the
/// Rust doors before migration 0022) wrote the key's receipt meanwhile.
pub(crate) const RECEIPT_INSERT: &str =
    "insert into outbox_relay.idempotency (key, fingerprint, response) values ($1, $2, $3)";

/// A stored receipt: the request's fingerprint and the response given.
pub(crate) struct Receipt {
    pub(crate) fingerprint: Vec<u8>,
    pub(crate) response: Option<Value>,
}

/// Takes `key`'s lock and reads its receipt, in one round trip: both statements are prepared
/// first, so that they are sent in this order when the joined futures are first polled. (On a
/// connection that keeps statements: one of [`super::Unprepared`] would prepare each at its
/// first poll, and could send the read ahead of the lock.)
pub(crate) async fn lock_and_get_receipt(db: &impl Db, key: &str) -> Result<Option<Receipt>> {
    db.prepare(RECEIPT_LOCK).await.map_err(|e| crate::Error::database("taking the idempotency key's lock", e))?;
    db.prepare(RECEIPT_GET).await.map_err(|e| crate::Error::database("reading the idempotency receipt", e))?;
    let lock_params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&RECEIPT_LOCK_CLASS, &key];
    let get_params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&key];
    let (locked, rows) = futures::join!(
        all(db, RECEIPT_LOCK, &lock_params, "taking the idempotency key's lock"),
        all(db, RECEIPT_GET, &get_params, "reading the idempotency receipt"),
    );
    locked?;
    Ok(rows?.first().map(|r| Receipt { fingerprint: r.get("fingerprint"), response: r.get("response") }))
}

/// Writes the receipt of `key` with `response`.
pub(crate) async fn insert_receipt(db: &impl Db, key: &str, fingerprint: &[u8], response: &Value) -> Result<()> {
    match db.run(RECEIPT_INSERT, &[&key, &fingerprint, response]).await {
        Ok(_) => Ok(()),
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION) => {
            Err(crate::Error::database(&receipt_taken_meanwhile(key), e))
        }
        Err(e) => Err(crate::Error::database("storing the response", e)),
    }
}

/// What a receipt's insert that met another one means: the key was taken, while this request
/// ran, by one that does not take the key's lock.
pub(crate) fn receipt_taken_meanwhile(key: &str) -> String {
    format!(
        "idempotency key {key:?} was taken while this request ran, by a request that does not take the key's lock (a version of this library before migration 0022, or a receipt written by hand): nothing was written; retry the request to get the answer of the one that took the key"
    )
}

const IDEMPOTENCY_DELETE_EXPIRED: &str = "\
delete from outbox_relay.idempotency where key in (
    select key from outbox_relay.idempotency
     where created_at < now() - $1::int8 * interval '1 microsecond'
     order by created_at
     limit $2
       for update skip locked
)";

/// Deletes up to `batch` receipts older than `age`.
pub(crate) async fn delete_expired_receipts(db: &impl Db, age: Duration, batch: i64) -> Result<u64> {
    count(db, IDEMPOTENCY_DELETE_EXPIRED, &[&micros(age), &batch], "deleting expired idempotency receipts").await
}
