//! Outbox rows written by hand, for the states a test sets up directly instead of reaching them
//! through the library (an event created long ago, one not due yet).
//!
//! A row from [`OutboxRow`] skips the library's write path (no validation, no key lock), as a
//! row written by another tool would; a test of the write path uses `Outbox::publish`. Rows that
//! are odd on purpose (an empty topic word, an `infinity` timestamp, a row the constraints
//! refuse) stay spelled out in SQL in their tests, where the oddity is the point.

use std::time::Duration;

use serde_json::{Value, json};
use tokio_postgres::Client;

/// The statement of [`OutboxRow::insert`]: times are relative to the server's `now()`.
const OUTBOX_ROW_INSERT: &str = "\
insert into outbox_relay.outbox (topic, key, payload, created_at, available_at)
values ($1, $2, $3::text::jsonb,
        now() - $4::int8 * interval '1 microsecond',
        now() + $5::int8 * interval '1 microsecond')
returning id";

/// One row of `outbox_relay.outbox` to insert by hand. Defaults: no key, payload `{}`, created
/// and available now.
#[must_use]
#[derive(Debug, Clone)]
pub struct OutboxRow {
    topic: String,
    key: Option<String>,
    payload: Value,
    created_ago: Duration,
    available_in: Duration,
}

impl OutboxRow {
    /// A row of `topic` with the defaults.
    pub fn new(topic: &str) -> OutboxRow {
        OutboxRow {
            topic: topic.to_string(),
            key: None,
            payload: json!({}),
            created_ago: Duration::ZERO,
            available_in: Duration::ZERO,
        }
    }

    /// Its key. Defaults to none.
    pub fn key(self, key: &str) -> OutboxRow {
        OutboxRow { key: Some(key.to_string()), ..self }
    }

    /// Its payload. Defaults to `{}`.
    pub fn payload(self, payload: Value) -> OutboxRow {
        OutboxRow { payload, ..self }
    }

    /// Created `ago` before now (`created_at`). Defaults to now.
    pub fn created_ago(self, ago: Duration) -> OutboxRow {
        OutboxRow { created_ago: ago, ..self }
    }

    /// Due `after` from now (`available_at`), as a delayed event. Defaults to now.
    pub fn available_in(self, after: Duration) -> OutboxRow {
        OutboxRow { available_in: after, ..self }
    }

    /// Inserts the row; returns its id.
    pub async fn insert(&self, client: &Client) -> i64 {
        let micros = |d: Duration| i64::try_from(d.as_micros()).expect("an offset of less than 290,000 years");
        let payload = self.payload.to_string();
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 5] =
            [&self.topic, &self.key, &payload, &micros(self.created_ago), &micros(self.available_in)];
        let row =
            client.query_one(OUTBOX_ROW_INSERT, &params).await.unwrap_or_else(|e| panic!("inserting {self:?}: {e}"));
        row.get(0)
    }

    /// Inserts `n` such rows; returns their ids in order.
    pub async fn insert_many(&self, client: &Client, n: usize) -> Vec<i64> {
        let mut ids = Vec::with_capacity(n);
        for _ in 0..n {
            ids.push(self.insert(client).await);
        }
        ids
    }
}

/// Marks every event committed so far as passed, as a relay's claims would: a position at the
/// current snapshot for every registered destination (for the origin, the position the first
/// destination starts from, while none is), taken `ago` before now (the sweeper removes passed
/// events only once a position older than the retention sees them). Events committed later are
/// not passed. Positions taken since that moment are moved before it, so that the claims' clock
/// still runs forward (the sweeper finds the newest position before a moment by its time).
pub async fn pass_everything(client: &Client, ago: Duration) {
    let micros = i64::try_from(ago.as_micros()).expect("an offset of less than 290,000 years");
    client
        .execute(
            "update outbox_relay.positions set at = now() - $1::int8 * interval '1 microsecond' - interval '1 second'
              where at > now() - $1::int8 * interval '1 microsecond' - interval '1 second'",
            &[&micros],
        )
        .await
        .expect("moving the positions' times back");
    client
        .execute(
            "insert into outbox_relay.positions (destination, n, since, snapshot, after_id, at)
             select d.name, coalesce((select max(q.n) + 1 from outbox_relay.positions q where q.destination = d.name), 0),
                    pg_current_snapshot(), pg_current_snapshot(), null, now() - $1::int8 * interval '1 microsecond'
               from (select name from outbox_relay.destinations
                     union all select '' where not exists (select 1 from outbox_relay.destinations)) d",
            &[&micros],
        )
        .await
        .expect("moving the positions past every event");
}
