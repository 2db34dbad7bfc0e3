//! The low-level write API: add events and audit entries inside a transaction the caller owns.
//!
//! These functions take any [`tokio_postgres::GenericClient`] (a `Client` or a `Transaction`), so
//! a service that manages its own transactions makes its events part of them: they commit with
//! the business change, or vanish with its rollback.

use serde::Serialize;
use tokio_postgres::GenericClient;
use tokio_postgres::types::ToSql;

use crate::error::{Error, Result};
use crate::event::{NewEvent, validate_key};
use crate::sql;

/// Adds one event inside the caller's transaction and returns its id.
///
/// ```no_run
/// # async fn f(client: &mut tokio_postgres::Client) -> Result<(), Box<dyn std::error::Error>> {
/// use outbox_relay::{publish, NewEvent};
/// let tx = client.transaction().await?;
/// tx.execute("update accounts set balance = balance - 10 where id = 1", &[]).await?;
/// publish(&tx, &NewEvent::new("account.debited", serde_json::json!({"id": 1, "amount": 10}))).await?;
/// tx.commit().await?;
/// # Ok(()) }
/// ```
pub async fn publish<C: GenericClient + Sync>(client: &C, event: &NewEvent) -> Result<i64> {
    event.validate()?;
    insert_event(client, sql::EVENT_INSERT, event).await
}

/// Adds many events in one statement and returns their ids in the same order.
pub async fn publish_all<C: GenericClient + Sync>(client: &C, events: &[NewEvent]) -> Result<Vec<i64>> {
    for event in events {
        event.validate()?;
    }
    insert_events(client, sql::EVENT_INSERT_MANY, events).await
}

/// Adds one audit entry inside the caller's transaction and returns its id.
pub async fn audit<C: GenericClient + Sync>(client: &C, entry: &AuditEntry<'_>) -> Result<i64> {
    entry.validate()?;
    insert_audit(client, sql::AUDIT_INSERT, entry, None).await
}

/// An audit entry: who changed what.
#[derive(Debug, Clone)]
pub struct AuditEntry<'a> {
    /// The kind of thing changed, e.g. `order`.
    pub entity: &'a str,
    /// Its id, as text.
    pub entity_id: String,
    /// What was done, e.g. `placed`.
    pub action: &'a str,
    /// Details (the request, the new state).
    pub data: serde_json::Value,
}

impl<'a> AuditEntry<'a> {
    /// An entry for `entity` `entity_id` and `action`, with `data` serialized to JSON.
    pub fn new(
        entity: &'a str,
        entity_id: impl ToString,
        action: &'a str,
        data: &impl Serialize,
    ) -> Result<AuditEntry<'a>> {
        Ok(AuditEntry { entity, entity_id: entity_id.to_string(), action, data: serde_json::to_value(data)? })
    }

    pub(crate) fn validate(&self) -> Result<()> {
        validate_key("audit entity", self.entity)?;
        validate_key("audit action", self.action)?;
        if self.entity_id.is_empty() {
            return Err(Error::invalid_input("audit entity id must not be empty"));
        }
        crate::payload::check_storable("the audit entry's data", &self.data)
    }
}

pub(crate) async fn insert_event<C, S>(client: &C, statement: &S, event: &NewEvent) -> Result<i64>
where
    C: GenericClient + Sync,
    S: tokio_postgres::ToStatement + Sync + Send + ?Sized,
{
    let delay = event.delay_micros();
    let params: [&(dyn ToSql + Sync); 4] = [&event.topic, &event.key, &event.payload, &delay];
    let row = client.query_one(statement, &params).await.map_err(|e| Error::database("adding an event", e))?;
    Ok(row.get(0))
}

pub(crate) async fn insert_events<C, S>(client: &C, statement: &S, events: &[NewEvent]) -> Result<Vec<i64>>
where
    C: GenericClient + Sync,
    S: tokio_postgres::ToStatement + Sync + Send + ?Sized,
{
    if events.is_empty() {
        return Ok(Vec::new());
    }
    let topics: Vec<&str> = events.iter().map(|e| e.topic.as_str()).collect();
    let keys: Vec<Option<&str>> = events.iter().map(|e| e.key.as_deref()).collect();
    let payloads: Vec<&serde_json::Value> = events.iter().map(|e| &e.payload).collect();
    let delays: Vec<i64> = events.iter().map(NewEvent::delay_micros).collect();
    let params: [&(dyn ToSql + Sync); 4] = [&topics, &keys, &payloads, &delays];
    let rows = client.query(statement, &params).await.map_err(|e| Error::database("adding events", e))?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

pub(crate) async fn insert_audit<C, S>(
    client: &C,
    statement: &S,
    entry: &AuditEntry<'_>,
    idempotency_key: Option<&str>,
) -> Result<i64>
where
    C: GenericClient + Sync,
    S: tokio_postgres::ToStatement + Sync + Send + ?Sized,
{
    let params: [&(dyn ToSql + Sync); 5] =
        [&entry.entity, &entry.entity_id, &entry.action, &entry.data, &idempotency_key];
    let row = client.query_one(statement, &params).await.map_err(|e| Error::database("adding an audit entry", e))?;
    Ok(row.get(0))
}
