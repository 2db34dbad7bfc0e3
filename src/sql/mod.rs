//! Every statement the library runs, one function each, with typed parameters and rows. DDL
//! lives in `migrations/`.
//!
//! A statement runs on a [`Db`]: the library's own pooled connections and transactions prepare
//! each statement once per connection and keep it (deadpool's statement cache); a client the
//! caller owns runs it unprepared ([`Unprepared`]: parse, bind and execute in one round trip,
//! nothing left behind on the caller's connection). Errors name what was being done.

/// The outbox rows `e` that wait for destination `d` whose position is `p` (its newest row):
/// matched by its pattern, and not passed by its position (`outbox_relay.passed`, migration 0019;
/// `sweep.sql` states the same test). Read through the `xid` index from the position's xmin: the
/// events kept for the retention below it are not read.
macro_rules! waiting_for_destination {
    () => {
        "e.xid >= pg_snapshot_xmin(case when p.after_id is null then p.snapshot else p.since end) and e.xid <> '0'::xid8
           and (d.topic_regex is null or ('.' || e.topic) ~ d.topic_regex)
           and not (pg_visible_in_snapshot(e.xid, case when p.after_id is null then p.snapshot else p.since end)
                    or (p.after_id is not null and e.id <= p.after_id and pg_visible_in_snapshot(e.xid, p.snapshot)))"
    };
}

mod admin;
mod claim;
mod destinations;
mod events;
mod inbox;
mod leaves;
mod migrations;
mod outcomes;
mod rebase;
mod receipts;
mod relays;

use std::future::Future;
use std::time::Duration;

use tokio_postgres::types::ToSql;
use tokio_postgres::{GenericClient, Row};

pub(crate) use self::admin::*;
pub(crate) use self::claim::*;
pub(crate) use self::destinations::*;
pub(crate) use self::events::*;
pub(crate) use self::inbox::*;
pub(crate) use self::leaves::*;
pub(crate) use self::migrations::*;
pub(crate) use self::outcomes::*;
pub(crate) use self::rebase::*;
pub(crate) use self::receipts::*;
pub(crate) use self::relays::*;
use crate::error::Error;

/// Parameters of a statement.
type Params<'a> = &'a [&'a (dyn ToSql + Sync)];

/// A connection a statement can run on.
pub(crate) trait Db: Sync {
    /// Runs `sql` and returns its rows.
    fn rows<'a>(
        &'a self,
        sql: &'static str,
        params: Params<'a>,
    ) -> impl Future<Output = Result<Vec<Row>, tokio_postgres::Error>> + Send + 'a;

    /// Runs `sql` and returns its rows as they arrive: the first can be read while the server
    /// still sends the later ones.
    fn stream<'a>(
        &'a self,
        sql: &'static str,
        params: Params<'a>,
    ) -> impl Future<Output = Result<tokio_postgres::RowStream, tokio_postgres::Error>> + Send + 'a;

    /// Runs `sql` and returns how many rows it touched.
    fn run<'a>(
        &'a self,
        sql: &'static str,
        params: Params<'a>,
    ) -> impl Future<Output = Result<u64, tokio_postgres::Error>> + Send + 'a;

    /// Prepares `sql` ahead of its use where statements are kept, so that a later run sends it
    /// at its first poll (what pipelining a statement before COMMIT relies on).
    fn prepare(&self, sql: &'static str) -> impl Future<Output = Result<(), tokio_postgres::Error>> + Send;

    /// Runs `sql` planned for these parameters and the tables as they are now (see
    /// [`Replanned`]), and returns its rows.
    fn rows_replanned<'a>(
        &'a self,
        sql: &'static str,
        params: Params<'a>,
    ) -> impl Future<Output = Result<Vec<Row>, tokio_postgres::Error>> + Send + 'a {
        async move { Ok(drain(self.stream_replanned(sql, params).await?).await?.0) }
    }

    /// Runs `sql` planned as [`Db::rows_replanned`] does, and returns its rows as they arrive.
    fn stream_replanned<'a>(
        &'a self,
        sql: &'static str,
        params: Params<'a>,
    ) -> impl Future<Output = Result<tokio_postgres::RowStream, tokio_postgres::Error>> + Send + 'a {
        self.stream(sql, params)
    }

    /// Runs `sql` planned as [`Db::rows_replanned`] does, and returns how many rows it touched.
    fn run_replanned<'a>(
        &'a self,
        sql: &'static str,
        params: Params<'a>,
    ) -> impl Future<Output = Result<u64, tokio_postgres::Error>> + Send + 'a {
        async move { Ok(drain(self.stream_replanned(sql, params).await?).await?.1) }
    }
}

/// A statement planned anew at each run, for the tables as they are then: parse, bind and
/// execute as one unnamed statement in one round trip, the parameters typed as the kept
/// statement's (in the relay's sessions the plan is still generic, `plan_cache_mode`, but built
/// now). For the statements over `parked` and `dead_letters`, tables that go from empty to a
/// backlog of thousands and back in minutes: a kept statement's plan is built at its first run,
/// often while the table is empty and before it was ever analyzed (autovacuum late, or off), and
/// then kept for the session's life. Such a plan took a destination's whole set of parked events
/// for every lookup of one id (its primary key and `parked_due_idx` looked alike on an empty
/// table): 20,000 paused events drained at 500 every 4 seconds after `resume`, and parking them
/// took 20 s. Planning anew costs about 2 ms for the claim of parked events and a fraction of
/// that for the others; none of them is on the path of a new event's delivery.
pub(crate) struct Replanned<'d, D>(pub(crate) &'d D);

impl<D: Db> Db for Replanned<'_, D> {
    fn rows<'a>(
        &'a self,
        sql: &'static str,
        params: Params<'a>,
    ) -> impl Future<Output = Result<Vec<Row>, tokio_postgres::Error>> + Send + 'a {
        self.0.rows_replanned(sql, params)
    }

    async fn stream<'a>(
        &'a self,
        sql: &'static str,
        params: Params<'a>,
    ) -> Result<tokio_postgres::RowStream, tokio_postgres::Error> {
        self.0.stream_replanned(sql, params).await
    }

    fn run<'a>(
        &'a self,
        sql: &'static str,
        params: Params<'a>,
    ) -> impl Future<Output = Result<u64, tokio_postgres::Error>> + Send + 'a {
        self.0.run_replanned(sql, params)
    }

    fn prepare(&self, sql: &'static str) -> impl Future<Output = Result<(), tokio_postgres::Error>> + Send {
        self.0.prepare(sql)
    }
}

/// Runs `sql` on a client that keeps statements as an unnamed statement, planned for `params`:
/// the kept statement only says the parameters' types (and is prepared once per connection).
macro_rules! replanned {
    ($client:expr, $sql:expr, $params:expr) => {{
        let statement = $client.prepare_cached($sql).await?;
        let typed: Vec<(&(dyn ToSql + Sync), tokio_postgres::types::Type)> =
            $params.iter().copied().zip(statement.params().iter().cloned()).collect();
        $client.query_typed_raw($sql, typed).await?
    }};
}

/// The rows of a stream, and how many rows the statement touched.
async fn drain(stream: tokio_postgres::RowStream) -> Result<(Vec<Row>, u64), tokio_postgres::Error> {
    use futures::TryStreamExt;
    futures::pin_mut!(stream);
    let mut rows = Vec::new();
    while let Some(row) = stream.try_next().await? {
        rows.push(row);
    }
    Ok((rows, stream.rows_affected().unwrap_or(0)))
}

/// The library's own connections and transactions: each statement prepared once per connection
/// and kept (deadpool's statement cache).
macro_rules! kept_statements {
    ($client:ty) => {
        impl Db for $client {
            async fn rows<'a>(
                &'a self,
                sql: &'static str,
                params: Params<'a>,
            ) -> Result<Vec<Row>, tokio_postgres::Error> {
                self.query(&self.prepare_cached(sql).await?, params).await
            }

            async fn stream<'a>(
                &'a self,
                sql: &'static str,
                params: Params<'a>,
            ) -> Result<tokio_postgres::RowStream, tokio_postgres::Error> {
                self.query_raw(&self.prepare_cached(sql).await?, params.iter().copied()).await
            }

            async fn stream_replanned<'a>(
                &'a self,
                sql: &'static str,
                params: Params<'a>,
            ) -> Result<tokio_postgres::RowStream, tokio_postgres::Error> {
                Ok(replanned!(self, sql, params))
            }

            async fn run<'a>(&'a self, sql: &'static str, params: Params<'a>) -> Result<u64, tokio_postgres::Error> {
                self.execute(&self.prepare_cached(sql).await?, params).await
            }

            async fn prepare(&self, sql: &'static str) -> Result<(), tokio_postgres::Error> {
                self.prepare_cached(sql).await.map(drop)
            }
        }
    };
}

kept_statements!(deadpool_postgres::ClientWrapper);
kept_statements!(deadpool_postgres::Transaction<'_>);

/// A caller's own client or transaction: statements run unprepared.
pub(crate) struct Unprepared<'c, C>(pub(crate) &'c C);

impl<C: GenericClient + Sync> Db for Unprepared<'_, C> {
    fn rows<'a>(
        &'a self,
        sql: &'static str,
        params: Params<'a>,
    ) -> impl Future<Output = Result<Vec<Row>, tokio_postgres::Error>> + Send + 'a {
        self.0.query(sql, params)
    }

    fn stream<'a>(
        &'a self,
        sql: &'static str,
        params: Params<'a>,
    ) -> impl Future<Output = Result<tokio_postgres::RowStream, tokio_postgres::Error>> + Send + 'a {
        self.0.query_raw(sql, params.iter().copied())
    }

    fn run<'a>(
        &'a self,
        sql: &'static str,
        params: Params<'a>,
    ) -> impl Future<Output = Result<u64, tokio_postgres::Error>> + Send + 'a {
        self.0.execute(sql, params)
    }

    async fn prepare(&self, _sql: &'static str) -> Result<(), tokio_postgres::Error> {
        Ok(())
    }
}

/// The one row a statement returns.
async fn one(db: &impl Db, sql: &'static str, params: Params<'_>, doing: &str) -> Result<Row, Error> {
    let mut rows = db.rows(sql, params).await.map_err(|e| Error::database(doing, e))?;
    rows.pop().ok_or_else(|| Error::new(crate::error::ErrorKind::Database, format!("{doing}: no row came back")))
}

/// All rows of a statement.
async fn all(db: &impl Db, sql: &'static str, params: Params<'_>, doing: &str) -> Result<Vec<Row>, Error> {
    db.rows(sql, params).await.map_err(|e| Error::database(doing, e))
}

/// How many rows a statement touched.
async fn count(db: &impl Db, sql: &'static str, params: Params<'_>, doing: &str) -> Result<u64, Error> {
    db.run(sql, params).await.map_err(|e| Error::database(doing, e))
}

/// A duration as the microseconds the statements multiply by `interval '1 microsecond'`.
pub(crate) fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}
