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
    move |e| {
        let code = e.as_database_error().and_then(|db| db.code()).map(|code| code.into_owned());
        let error = Error::new(ErrorKind::Database, format!("{doing}: {e}"));
        let error = match code {
            Some(code) => error.with_sqlstate(&code),
            None => error,
        };
        error.with_source(e)
    }
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
    entry.validate()?;
    ::sqlx::query_scalar::<_, i64>(sql::AUDIT_INSERT)
        .bind(entry.entity)
        .bind(&entry.entity_id)
        .bind(entry.action)
        .bind(Json(&entry.data))
        .bind(None::<&str>)
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
