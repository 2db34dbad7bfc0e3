//! The write path: business transactions per second from concurrent writers, through the
//! library's own `execute` (and `audit` for the shapes without a receipt).

use std::fmt;
use std::time::{Duration, Instant};

use pg_outbox_relay::{AuditEntry, NewEvent, Outbox};
use serde_json::json;

use super::cpu::{CpuProfile, CpuSample};
use super::notify::{NotifyMode, reset_notify, set_notify_mode};
use super::{BoxError, db};

const CUSTOMER: &str = "bench-customer";
const TOTAL: f64 = 12.5;
/// `bench_orders` and the article's own tables (see the file), created if missing.
const WRITE_TABLES_CREATE: &str = include_str!("write_tables.sql");
const ORDERS_INSERT: &str = "insert into public.bench_orders (customer, total) values ($1, $2) returning id";
const WRITE_TABLES_TRUNCATE: &str = "truncate public.bench_orders, outbox_relay.audit, outbox_relay.idempotency,
    outbox_relay.outbox, public.bench_article_outbox, public.bench_article_audit, public.bench_article_idempotency";
/// The article's transaction on its own tables (after the order's insert): audit, outbox,
/// receipt with the response.
const ARTICLE_PLAIN: [&str; 3] = [
    "insert into public.bench_article_audit (entity, entity_id, action, data) values ('order', $1::int8::text, 'placed', $2)",
    "insert into public.bench_article_outbox (topic, payload) values ('order.placed', $1)",
    "insert into public.bench_article_idempotency (key, response) values ($1, $2)",
];
/// The same transaction through the SQL door (migration 0020): the key claimed first, then the
/// order, its audit entry, its event (keyed by the order) and the response.
const ARTICLE_SQL: [&str; 4] = [
    "select outbox_relay.begin_request($1, $2)",
    "select outbox_relay.audit('order', $1::int8::text, 'placed', $2, $3)",
    "select outbox_relay.publish('order.placed', $1, $2::int8::text)",
    "select outbox_relay.store_response($1, $2)",
];

/// Which door a business transaction goes through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Way {
    /// The article's own statements on its own plain tables (no guarantee past its own: the
    /// reference the other two are compared with).
    PlainTables,
    /// The SQL functions of the unit of work (`begin_request`, `audit`, `publish`,
    /// `store_response`), one statement each, as a service in any language runs them.
    SqlFunctions,
    /// The Rust unit of work ([`Outbox::execute`], `Work::audit`, `Work::publish`).
    RustUnitOfWork,
}

impl Way {
    /// Every way, in the order a round runs them.
    pub const ALL: [Way; 3] = [Way::PlainTables, Way::SqlFunctions, Way::RustUnitOfWork];

    /// A short name (`plain_tables`, `sql_functions`, `rust_unit_of_work`).
    pub fn name(self) -> &'static str {
        match self {
            Way::PlainTables => "plain_tables",
            Way::SqlFunctions => "sql_functions",
            Way::RustUnitOfWork => "rust_unit_of_work",
        }
    }
}

/// What one business transaction of the write path writes, besides its `bench_orders` row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteTx {
    /// An `outbox_relay.audit` entry.
    pub audit: bool,
    /// An idempotency receipt under a fresh key: the transaction is [`Outbox::execute`].
    pub receipt: bool,
    /// Events: one is [`pg_outbox_relay::Work::publish`], more are one
    /// [`pg_outbox_relay::Work::publish_all`]. Only with a receipt.
    pub events: usize,
    /// The events carry the order's id as their key (so the insert takes the key's lock), or
    /// no key.
    pub keyed: bool,
    /// The door: the fields above describe [`Way::RustUnitOfWork`]; the other two ways always
    /// write the article's transaction (order, audit entry, receipt, one event).
    pub way: Way,
}

impl WriteTx {
    /// The business row alone.
    pub const BARE: WriteTx =
        WriteTx { audit: false, receipt: false, events: 0, keyed: false, way: Way::RustUnitOfWork };
    /// The business row and its audit entry.
    pub const WITH_AUDIT: WriteTx = WriteTx { audit: true, ..WriteTx::BARE };
    /// The business row, its audit entry and the idempotency receipt.
    pub const WITH_RECEIPT: WriteTx = WriteTx { receipt: true, ..WriteTx::WITH_AUDIT };
    /// The full transaction: business row, audit entry, receipt and one event keyed by the order.
    pub const FULL: WriteTx = WriteTx { events: 1, keyed: true, ..WriteTx::WITH_RECEIPT };
    /// [`WriteTx::FULL`] with an event without a key (no key lock).
    pub const FULL_UNKEYED: WriteTx = WriteTx { keyed: false, ..WriteTx::FULL };

    /// The full transaction with `events` keyed events.
    pub const fn full_with_events(events: usize) -> WriteTx {
        WriteTx { events, ..WriteTx::FULL }
    }

    /// The article's transaction through `way` ([`WriteTx::FULL`] for the Rust unit of work).
    pub const fn article(way: Way) -> WriteTx {
        WriteTx { way, ..WriteTx::FULL }
    }
}

/// Creates `bench_orders` if it is missing, empties it and the audit, receipt and outbox tables,
/// and runs a `CHECKPOINT` so that one due to earlier runs' WAL does not land in the next
/// measurement (skipped when the user may not: it needs superuser or `pg_checkpoint`).
pub async fn reset_write_tables(outbox: &Outbox) -> Result<(), BoxError> {
    let client = outbox.connection().await?;
    client.batch_execute(WRITE_TABLES_CREATE).await.map_err(db("creating the write path's tables"))?;
    client.batch_execute(WRITE_TABLES_TRUNCATE).await.map_err(db("truncating the write-path tables"))?;
    if let Err(e) = client.batch_execute("checkpoint").await {
        tracing::debug!(error = %e, "no checkpoint before the write measurement");
    }
    Ok(())
}

/// Commits per second of `writers` concurrent writers running the full transaction
/// ([`WriteTx::FULL`]) for `duration`, with the trigger in `mode`. The tables are emptied first,
/// no relay runs, and the trigger is back to normal afterwards.
pub async fn write_tps(outbox: &Outbox, writers: usize, duration: Duration, mode: NotifyMode) -> Result<f64, BoxError> {
    set_notify_mode(outbox, mode).await?;
    let measured = async {
        reset_write_tables(outbox).await?;
        let mut writers = Writers::connect(outbox, writers, WriteTx::FULL).await?;
        let (commits, elapsed) = writers.run_for(duration).await?;
        Ok::<_, BoxError>(commits as f64 / elapsed.as_secs_f64())
    }
    .await;
    let restored = reset_notify(outbox).await;
    let tps = measured?;
    restored?;
    Ok(tps)
}

/// Concurrent writers, each a task with a connection of its own, running one kind of business
/// transaction ([`WriteTx`]).
pub struct Writers {
    writers: Vec<Writer>,
    shape: WriteTx,
}

impl fmt::Debug for Writers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Writers")
            .field("writers", &self.writers.len())
            .field("shape", &self.shape)
            .finish_non_exhaustive()
    }
}

impl Writers {
    /// Opens `count` connections to `outbox`'s database (an [`Outbox`] with a pool of one each);
    /// creates `bench_orders` if it is missing.
    pub async fn connect(outbox: &Outbox, count: usize, shape: WriteTx) -> Result<Writers, BoxError> {
        if count == 0 {
            return Err("at least one writer is needed".into());
        }
        if shape.events > 0 && !shape.receipt {
            return Err("events are written through execute, which needs a receipt".into());
        }
        {
            let client = outbox.connection().await?;
            client.batch_execute(WRITE_TABLES_CREATE).await.map_err(db("creating the write path's tables"))?;
        }
        let run = rand::random::<u64>();
        let connecting = (0..count).map(|n| Writer::connect(outbox, format!("bench-{run:016x}-{n}")));
        let writers = futures::future::try_join_all(connecting).await?;
        Ok(Writers { writers, shape })
    }

    /// How many writers there are.
    pub fn len(&self) -> usize {
        self.writers.len()
    }

    /// Always false: there is at least one writer.
    pub fn is_empty(&self) -> bool {
        self.writers.is_empty()
    }

    /// Runs `total` transactions, spread evenly over the writers, and returns the wall time.
    pub async fn run_count(&mut self, total: u64) -> Result<Duration, BoxError> {
        let n = self.writers.len() as u64;
        let started = Instant::now();
        self.run(|i| Quota::Count(total / n + u64::from((i as u64) < total % n))).await?;
        Ok(started.elapsed())
    }

    /// Runs transactions on every writer until `duration` has passed (each finishes the one it
    /// is in) and returns how many committed and the wall time until the last writer finished.
    pub async fn run_for(&mut self, duration: Duration) -> Result<(u64, Duration), BoxError> {
        let started = Instant::now();
        let deadline = started + duration;
        let commits = self.run(|_| Quota::Until(deadline)).await?;
        Ok((commits, started.elapsed()))
    }

    /// Runs every writer in its own task with its quota; returns the commits. A writer that
    /// failed is lost, and with it this value's use: the first error is returned.
    async fn run(&mut self, quota: impl Fn(usize) -> Quota) -> Result<u64, BoxError> {
        let shape = self.shape;
        let tasks: Vec<_> = std::mem::take(&mut self.writers)
            .into_iter()
            .enumerate()
            .map(|(i, mut writer)| {
                let quota = quota(i);
                tokio::spawn(async move {
                    let result = writer.run(shape, quota).await;
                    (writer, result)
                })
            })
            .collect();
        let mut commits = 0;
        let mut first_error: Option<BoxError> = None;
        for task in tasks {
            match task.await {
                Ok((writer, Ok(n))) => {
                    commits += n;
                    self.writers.push(writer);
                }
                Ok((_, Err(e))) => {
                    first_error.get_or_insert(e);
                }
                Err(e) => {
                    first_error.get_or_insert(format!("a writer task failed: {e}").into());
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(commits),
        }
    }
}

/// How long one writer runs.
#[derive(Clone, Copy)]
enum Quota {
    Count(u64),
    Until(Instant),
}

/// One writer: an outbox with one connection, and its key sequence.
struct Writer {
    outbox: Outbox,
    key_prefix: String,
    next_key: u64,
    /// The article's statements, prepared on the writer's one connection.
    statements: std::collections::HashMap<&'static str, tokio_postgres::Statement>,
}

impl Writer {
    async fn connect(outbox: &Outbox, key_prefix: String) -> Result<Writer, BoxError> {
        let own = Outbox::connect_with(outbox.url().clone(), 1).await?;
        let client = own.connection().await?;
        client
            .batch_execute(&format!("set statement_timeout = '{}'", super::latency::STATEMENT_TIMEOUT))
            .await
            .map_err(db("configuring a writer connection"))?;
        drop(client);
        Ok(Writer { outbox: own, key_prefix, next_key: 0, statements: Default::default() })
    }

    async fn run(&mut self, shape: WriteTx, quota: Quota) -> Result<u64, BoxError> {
        let mut commits = 0;
        loop {
            let more = match quota {
                Quota::Count(n) => commits < n,
                Quota::Until(deadline) => Instant::now() < deadline,
            };
            if !more {
                return Ok(commits);
            }
            self.transaction(shape).await?;
            commits += 1;
        }
    }

    /// One business transaction, as a service writes it with the library.
    async fn transaction(&mut self, shape: WriteTx) -> Result<(), BoxError> {
        self.next_key += 1;
        let request = json!({"customer": CUSTOMER, "total": TOTAL});
        if shape.way != Way::RustUnitOfWork {
            return self.article(shape.way, &request).await;
        }
        if !shape.receipt {
            let mut connection = self.outbox.connection().await?;
            let tx = connection.transaction().await.map_err(db("starting a transaction"))?;
            let order_id: i64 = tx
                .query_one(ORDERS_INSERT, &[&CUSTOMER, &TOTAL])
                .await
                .map_err(db("inserting the business row"))?
                .get(0);
            if shape.audit {
                pg_outbox_relay::audit(&tx, &AuditEntry::new("order", order_id, "placed", &request)?).await?;
            }
            tx.commit().await.map_err(db("committing"))?;
            return Ok(());
        }
        let key = format!("{}-{}", self.key_prefix, self.next_key);
        self.outbox
            .execute(&key, &request, async |work| {
                let insert = work.prepare_cached(ORDERS_INSERT).await?;
                let order_id: i64 = work.query_one(&insert, &[&CUSTOMER, &TOTAL]).await?.get(0);
                work.audit(&AuditEntry::new("order", order_id, "placed", &request)?).await?;
                let event = |n: usize| {
                    let event = NewEvent::new("order.placed", json!({"order_id": order_id, "n": n}));
                    if shape.keyed { event.key(order_id.to_string()) } else { event }
                };
                match shape.events {
                    0 => {}
                    1 => {
                        work.publish(&event(0)).await?;
                    }
                    n => {
                        work.publish_all(&(0..n).map(event).collect::<Vec<_>>()).await?;
                    }
                }
                Ok::<_, pg_outbox_relay::Error>(json!({"order_id": order_id}))
            })
            .await?;
        Ok(())
    }

    /// The article's transaction on its plain tables, or through the SQL functions: one
    /// statement a step, each prepared once on the writer's connection, as a service's driver
    /// keeps them.
    async fn article(&mut self, way: Way, request: &serde_json::Value) -> Result<(), BoxError> {
        let key = format!("{}-{}", self.key_prefix, self.next_key);
        let connection = self.outbox.connection().await?;
        let statements = &mut self.statements;
        let mut prepared = async |sql: &'static str| -> Result<tokio_postgres::Statement, BoxError> {
            if let Some(statement) = statements.get(sql) {
                return Ok(statement.clone());
            }
            let statement = connection.prepare(sql).await.map_err(db("preparing"))?;
            statements.insert(sql, statement.clone());
            Ok(statement)
        };
        let order = |id: i64| json!({"order_id": id, "customer": CUSTOMER, "total": TOTAL});
        let (begin, insert) = (prepared("begin").await?, prepared(ORDERS_INSERT).await?);
        connection.execute(&begin, &[]).await.map_err(db("starting a transaction"))?;
        let written = async {
            if way == Way::SqlFunctions {
                let claim = prepared(ARTICLE_SQL[0]).await?;
                let replayed: Option<serde_json::Value> =
                    connection.query_one(&claim, &[&key, request]).await.map_err(db("claiming the key"))?.get(0);
                if replayed.is_some() {
                    return Err::<(), BoxError>(format!("key {key} replayed: the bench's keys must be fresh").into());
                }
            }
            let order_id: i64 = connection
                .query_one(&insert, &[&CUSTOMER, &TOTAL])
                .await
                .map_err(db("inserting the business row"))?
                .get(0);
            let response = json!({"order_id": order_id});
            match way {
                Way::PlainTables => {
                    let [audit, outbox, receipt] = ARTICLE_PLAIN;
                    let audit = prepared(audit).await?;
                    connection.execute(&audit, &[&order_id, request]).await.map_err(db("adding the audit row"))?;
                    let outbox = prepared(outbox).await?;
                    connection.execute(&outbox, &[&order(order_id)]).await.map_err(db("adding the event"))?;
                    let receipt = prepared(receipt).await?;
                    connection.execute(&receipt, &[&key, &response]).await.map_err(db("adding the receipt"))?;
                }
                Way::SqlFunctions => {
                    let [_, audit, publish, store] = ARTICLE_SQL;
                    let audit = prepared(audit).await?;
                    connection
                        .execute(&audit, &[&order_id, request, &key])
                        .await
                        .map_err(db("adding the audit row"))?;
                    let publish = prepared(publish).await?;
                    connection.execute(&publish, &[&order(order_id), &order_id]).await.map_err(db("publishing"))?;
                    let store = prepared(store).await?;
                    connection.execute(&store, &[&key, &response]).await.map_err(db("storing the response"))?;
                }
                Way::RustUnitOfWork => unreachable!("the Rust unit of work is Outbox::execute"),
            }
            let commit = prepared("commit").await?;
            connection.execute(&commit, &[]).await.map_err(db("committing"))?;
            Ok(())
        }
        .await;
        if written.is_err() {
            drop(connection.batch_execute("rollback").await);
        }
        written
    }
}

/// One run of the article's transaction: how many committed, and the machine's CPU meanwhile.
#[derive(Debug, Clone)]
pub struct ArticleRun {
    /// Commits per second.
    pub tps: f64,
    /// Transactions committed.
    pub commits: u64,
    /// Where the machine's CPU went while the writers ran (PostgreSQL's backends, this process).
    pub cpu: CpuProfile,
}

/// The article's transaction through `way`, `writers` concurrent writers for `duration` (the
/// tables emptied first, no relay running, the trigger as shipped).
pub async fn article_run(
    outbox: &Outbox,
    way: Way,
    writers: usize,
    duration: Duration,
) -> Result<ArticleRun, BoxError> {
    reset_write_tables(outbox).await?;
    let mut writers = Writers::connect(outbox, writers, WriteTx::article(way)).await?;
    let sample = CpuSample::now();
    let (commits, elapsed) = writers.run_for(duration).await?;
    let cpu = sample.profile();
    Ok(ArticleRun { tps: commits as f64 / elapsed.as_secs_f64(), commits, cpu })
}
