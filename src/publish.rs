//! The low-level write API: add events and audit entries inside a transaction the caller owns.
//!
//! These functions take any [`tokio_postgres::GenericClient`] (a `Client` or a `Transaction`), so
//! a service that manages its own transactions makes its events part of them: they commit with
//! the business change, or vanish with its rollback.

use tokio_postgres::GenericClient;

use crate::error::Result;
use crate::event::{AuditEntry, NewEvent};
use crate::sql::{self, Unprepared};

/// Adds one event inside the caller's transaction and returns its id.
///
/// ```no_run
/// # async fn f(client: &mut tokio_postgres::Client) -> Result<(), Box<dyn std::error::Error>> {
/// use pg_outbox_relay::{publish, NewEvent};
/// let tx = client.transaction().await?;
/// tx.execute("update accounts set balance = balance - 10 where id = 1", &[]).await?;
/// publish(&tx, &NewEvent::new("account.debited", serde_json::json!({"id": 1, "amount": 10}))).await?;
/// tx.commit().await?;
/// # Ok(()) }
/// ```
pub async fn publish<C: GenericClient + Sync>(client: &C, event: &NewEvent) -> Result<i64> {
    let checked = event.validate()?;
    sql::insert_event(&Unprepared(client), event, &checked).await
}

/// Adds many events in one statement and returns their ids in the same order.
pub async fn publish_all<C: GenericClient + Sync>(client: &C, events: &[NewEvent]) -> Result<Vec<i64>> {
    let checked = NewEvent::validate_all(events)?;
    sql::insert_events(&Unprepared(client), events, &checked).await
}

/// Adds one audit entry inside the caller's transaction and returns its id.
pub async fn audit<C: GenericClient + Sync>(client: &C, entry: &AuditEntry<'_>) -> Result<i64> {
    entry.validate()?;
    sql::insert_audit(&Unprepared(client), entry, None).await
}
