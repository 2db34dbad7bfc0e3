//! The article's orders, for the tests that write them: the business table, the request, and the
//! full transaction (order, audit entry, receipt and event under one idempotency key).

use pg_outbox_relay::{AuditEntry, Error, Executed, NewEvent, Outbox};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio_postgres::Client;

/// The business table. The idempotency key is kept on the order too, so that every row can be
/// traced to its key.
pub const ORDERS_TABLE: &str = "create table orders (
    id bigserial primary key,
    key text not null,
    customer text not null,
    total numeric(12, 2) not null
)";

/// The request body.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PlaceOrder {
    pub customer: String,
    pub total: f64,
}

impl PlaceOrder {
    /// Ana's order of 12.50.
    pub fn ana() -> PlaceOrder {
        PlaceOrder { customer: "ana".into(), total: 12.5 }
    }

    /// The one request body used for `key`: a retry (or a concurrent duplicate) sends exactly this.
    pub fn for_key(key: &str) -> PlaceOrder {
        PlaceOrder { customer: format!("customer-{key}"), total: key.len() as f64 + 0.5 }
    }
}

/// The response.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Placed {
    pub order_id: i64,
}

/// What the tests' units of work fail with.
#[derive(Debug)]
pub enum TestError {
    Outbox(Error),
    /// The failure a test injects on purpose after every write.
    Injected,
    /// A business statement through sqlx failed.
    Sqlx(sqlx::Error),
}

impl From<Error> for TestError {
    fn from(e: Error) -> Self {
        TestError::Outbox(e)
    }
}

impl From<tokio_postgres::Error> for TestError {
    fn from(e: tokio_postgres::Error) -> Self {
        TestError::Outbox(e.into())
    }
}

/// The article's transaction: the order, its audit entry and its `order.placed` event (payload
/// `{"order_id", "customer", "key"}`), under `key`. With `fail_after_writes` the unit of work
/// returns [`TestError::Injected`] after all of its writes (the receipt was claimed before).
pub async fn place_order(
    outbox: &Outbox,
    key: &str,
    order: &PlaceOrder,
    fail_after_writes: bool,
) -> Result<Executed<Placed>, TestError> {
    outbox
        .execute(key, order, async |work| {
            let row = work
                .query_one(
                    "insert into orders (key, customer, total) values ($1, $2, $3::float8::numeric) returning id",
                    &[&key, &order.customer, &order.total],
                )
                .await?;
            let order_id: i64 = row.get(0);
            work.audit(&AuditEntry::new("order", order_id, "placed", order)?).await?;
            let payload = json!({"order_id": order_id, "customer": order.customer, "key": key});
            work.publish(&NewEvent::new("order.placed", payload).key(order_id.to_string())).await?;
            if fail_after_writes {
                return Err(TestError::Injected);
            }
            Ok(Placed { order_id })
        })
        .await
}

/// Checks the answers of concurrent calls with one key: one did the work, every other replayed
/// its response.
pub fn assert_settled(results: &[Executed<Placed>]) {
    let order_id = results[0].response.order_id;
    assert!(results.iter().all(|r| r.response.order_id == order_id), "all calls answer the same order");
    assert_eq!(results.iter().filter(|r| !r.replayed).count(), 1);
    assert_eq!(results.iter().filter(|r| r.replayed).count(), results.len() - 1);
}

/// Rows of each kind the write path makes.
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
pub struct Counts {
    pub orders: i64,
    pub audit: i64,
    pub receipts: i64,
    pub events: i64,
}

impl Counts {
    pub const NOTHING: Counts = Counts { orders: 0, audit: 0, receipts: 0, events: 0 };
    pub const ONE_OF_EACH: Counts = Counts { orders: 1, audit: 1, receipts: 1, events: 1 };

    /// Counts the rows now.
    pub async fn read(client: &Client) -> Counts {
        let row = client
            .query_one(
                "select (select count(*) from orders), (select count(*) from outbox_relay.audit),
                        (select count(*) from outbox_relay.idempotency), (select count(*) from outbox_relay.outbox)",
                &[],
            )
            .await
            .unwrap();
        Counts { orders: row.get(0), audit: row.get(1), receipts: row.get(2), events: row.get(3) }
    }
}

impl From<sqlx::Error> for TestError {
    fn from(e: sqlx::Error) -> Self {
        TestError::Sqlx(e)
    }
}

/// [`place_order`] through the sqlx door (`pg_outbox_relay::sqlx::execute`).
pub async fn place_order_sqlx(
    pool: &sqlx::PgPool,
    key: &str,
    order: &PlaceOrder,
    fail_after_writes: bool,
) -> Result<Executed<Placed>, TestError> {
    pg_outbox_relay::sqlx::execute(pool, key, order, async |work| {
        let order_id: i64 = sqlx::query_scalar(
            "insert into orders (key, customer, total) values ($1, $2, $3::float8::numeric) returning id",
        )
        .bind(key)
        .bind(&order.customer)
        .bind(order.total)
        .fetch_one(&mut **work)
        .await?;
        work.audit(&AuditEntry::new("order", order_id, "placed", order)?).await?;
        let payload = json!({"order_id": order_id, "customer": order.customer, "key": key});
        work.publish(&NewEvent::new("order.placed", payload).key(order_id.to_string())).await?;
        if fail_after_writes {
            return Err(TestError::Injected);
        }
        Ok(Placed { order_id })
    })
    .await
}
