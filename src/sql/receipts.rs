//! Idempotency receipts: taking a key, reading a stored answer, writing one, expiring them.

use std::time::Duration;

use serde_json::Value;

use super::{Db, all, count, micros, one};
use crate::error::{Error, ErrorKind, Result};

/// The class of the advisory locks that serialize requests of one idempotency key (migration
/// 0022): `pg_advisory_xact_lock(RECEIPT_LOCK_CLASS, hashtext(key))`. Apart from the events'
/// key locks ([`super::KEY_LOCK_CLASS`]).
pub(crate) const RECEIPT_LOCK_CLASS: i32 = 0x6964_6d70;

/// Takes the key's lock: waits while another request of the key runs, until it ends. The
/// receipt is read after it, in a statement of its own, which sees what that request committed
/// (READ COMMITTED takes a snapshot per statement; one taken before the wait would not, so the
/// transaction's isolation comes back to be checked). Also returns when the transaction began
/// (`now()`, in microseconds), which [`RECEIPT_INSERT`] compares with its own.
pub(crate) const RECEIPT_LOCK: &str = "\
select current_setting('transaction_isolation') as isolation,
       (extract(epoch from now()) * 1000000)::int8 as began
  from pg_advisory_xact_lock($1, hashtext($2))";

pub(crate) const RECEIPT_GET: &str = "select fingerprint, response from outbox_relay.idempotency where key = $1";

/// The receipt with its response, written once at the end of the work, in the COMMIT's round
/// trip. It fails with unique_violation when a request that does not take the key's lock (the
/// Rust doors before migration 0022) wrote the key's receipt meanwhile, and writes nothing when
/// it does not run in the transaction that took the key (`$4`: when that one began): the work
/// ended it itself, and the key's lock is gone.
pub(crate) const RECEIPT_INSERT: &str = "\
insert into outbox_relay.idempotency (key, fingerprint, response)
select $1::text, $2::bytea, $3::jsonb where (extract(epoch from now()) * 1000000)::int8 = $4::int8";

/// The key's lock held: when the transaction took it, and the transaction's isolation.
pub(crate) struct KeyLock {
    pub(crate) began: i64,
    pub(crate) isolation: String,
}

/// A stored receipt: the request's fingerprint and the response given.
pub(crate) struct Receipt {
    pub(crate) fingerprint: Vec<u8>,
    pub(crate) response: Option<Value>,
}

/// Takes `key`'s lock and reads its receipt, in one round trip: both statements are prepared
/// first, so that they are sent in this order when the joined futures are first polled. (On a
/// connection that keeps statements: one of [`super::Unprepared`] would prepare each at its
/// first poll, and could send the read ahead of the lock.)
pub(crate) async fn lock_and_get_receipt(db: &impl Db, key: &str) -> Result<(KeyLock, Option<Receipt>)> {
    db.prepare(RECEIPT_LOCK).await.map_err(|e| Error::database("taking the idempotency key's lock", e))?;
    db.prepare(RECEIPT_GET).await.map_err(|e| Error::database("reading the idempotency receipt", e))?;
    let lock_params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&RECEIPT_LOCK_CLASS, &key];
    let get_params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&key];
    let (locked, rows) = futures::join!(
        one(db, RECEIPT_LOCK, &lock_params, "taking the idempotency key's lock"),
        all(db, RECEIPT_GET, &get_params, "reading the idempotency receipt"),
    );
    let locked = locked?;
    let lock = KeyLock { began: locked.get("began"), isolation: locked.get("isolation") };
    let receipt = rows?.first().map(|r| Receipt { fingerprint: r.get("fingerprint"), response: r.get("response") });
    Ok((lock, receipt))
}

/// Writes the receipt of `key` with `response`, in the transaction that took the key's lock
/// when `began`.
pub(crate) async fn insert_receipt(
    db: &impl Db,
    key: &str,
    fingerprint: &[u8],
    response: &Value,
    began: i64,
) -> Result<()> {
    match db.run(RECEIPT_INSERT, &[&key, &fingerprint, response, &began]).await {
        Ok(rows) => receipt_written(key, rows),
        Err(e) => Err(receipt_refused(key, e.code().map(|code| code.code())).with_source(e)),
    }
}

/// What [`RECEIPT_INSERT`] writing `rows` rows means (both Rust doors): one is the receipt; none
/// means that it did not run in the transaction that took the key.
pub(crate) fn receipt_written(key: &str, rows: u64) -> Result<()> {
    if rows == 1 {
        return Ok(());
    }
    Err(Error::new(
        ErrorKind::Database,
        format!(
            "the transaction of idempotency key {key:?} ended before the work's commit (a COMMIT or ROLLBACK run inside the work?): its receipt was not written, and the work's writes were committed or rolled back by that statement, not by this commit"
        ),
    ))
}

/// What [`RECEIPT_INSERT`] failing with `sqlstate` means (both Rust doors; each adds the
/// database's error as the source).
pub(crate) fn receipt_refused(key: &str, sqlstate: Option<&str>) -> Error {
    match sqlstate {
        // The key was taken, while this request ran, by one that does not take the key's lock.
        Some("23505") => Error::new(
            ErrorKind::Database,
            format!(
                "idempotency key {key:?} was taken while this request ran, by a request that does not take the key's lock (a version of this library before migration 0022, or a receipt written by hand): nothing was written; a retry replays that request's answer (or is refused, if it was another request)"
            ),
        ),
        Some("42501") => Error::new(
            ErrorKind::Permission,
            "storing the response: this role may not insert a receipt with its response (since migration 0022 the unit of work writes the receipt once, at its commit): grant it insert (key, fingerprint, response) on outbox_relay.idempotency, or re-run migrations/optional/least_privilege_roles.sql for outbox_writer; nothing was written",
        ),
        _ => Error::new(ErrorKind::Database, "storing the response"),
    }
}

/// The transaction's isolation, when it is not the READ COMMITTED a key's lock relies on.
pub(crate) fn check_isolation(key: &str, isolation: &str) -> Result<()> {
    if isolation == "read committed" {
        return Ok(());
    }
    Err(Error::new(
        ErrorKind::InvalidInput,
        format!(
            "the unit of work of idempotency key {key:?} needs READ COMMITTED, and its transaction is {isolation}: a request of the key that committed while this one waited would not be seen (begin the transaction with `isolation level read committed`); nothing was written"
        ),
    ))
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
