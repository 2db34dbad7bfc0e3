//! Idempotency receipts: claiming a key, reading a stored answer, storing one, expiring them.

use std::time::Duration;

use serde_json::Value;

use super::{Db, all, count, micros};
use crate::error::Result;

/// Claims an idempotency key: returns a row when this transaction now owns the key. When another
/// transaction holds the key uncommitted, this waits for it to end.
pub(crate) const IDEMPOTENCY_CLAIM: &str = "\
insert into outbox_relay.idempotency (key, fingerprint) values ($1, $2)
on conflict (key) do nothing
returning key";

/// Claims `key` for this transaction; false when another request holds it (committed).
pub(crate) async fn claim_receipt(db: &impl Db, key: &str, fingerprint: &[u8]) -> Result<bool> {
    Ok(!all(db, IDEMPOTENCY_CLAIM, &[&key, &fingerprint], "claiming the idempotency key").await?.is_empty())
}

pub(crate) const IDEMPOTENCY_GET: &str = "select fingerprint, response from outbox_relay.idempotency where key = $1";

/// A stored receipt: the request's fingerprint and the response given.
pub(crate) struct Receipt {
    pub(crate) fingerprint: Vec<u8>,
    pub(crate) response: Option<Value>,
}

/// The receipt of `key`, if there is one.
pub(crate) async fn get_receipt(db: &impl Db, key: &str) -> Result<Option<Receipt>> {
    let rows = all(db, IDEMPOTENCY_GET, &[&key], "reading the idempotency receipt").await?;
    Ok(rows.first().map(|r| Receipt { fingerprint: r.get("fingerprint"), response: r.get("response") }))
}

/// Fills in the response of the receipt this transaction claimed (migration 0003's function, so
/// that writers need no UPDATE on receipts).
pub(crate) const IDEMPOTENCY_STORE_RESPONSE: &str = "select outbox_relay.store_response($1, $2)";

/// Stores `response` with the receipt of `key` that this transaction claimed.
pub(crate) async fn store_response(db: &impl Db, key: &str, response: &Value) -> Result<()> {
    all(db, IDEMPOTENCY_STORE_RESPONSE, &[&key, response], "storing the response").await.map(drop)
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
