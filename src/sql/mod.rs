//! Every statement the library runs, one function each, with typed parameters and rows. DDL
//! lives in `migrations/`.
//!
//! A statement runs on a [`Db`]: the library's own pooled connections and transactions prepare
//! each statement once per connection and keep it (deadpool's statement cache); a client the
//! caller owns runs it unprepared ([`Unprepared`]: parse, bind and execute in one round trip,
//! nothing left behind on the caller's connection). Errors name what was being done.

mod admin;
mod claim;
mod destinations;
mod events;
mod inbox;
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

    /// Runs `sql` and returns how many rows it touched.
    fn run<'a>(
        &'a self,
        sql: &'static str,
        params: Params<'a>,
    ) -> impl Future<Output = Result<u64, tokio_postgres::Error>> + Send + 'a;

    /// Prepares `sql` ahead of its use where statements are kept, so that a later run sends it
    /// at its first poll (what pipelining a statement before COMMIT relies on).
    fn prepare(&self, sql: &'static str) -> impl Future<Output = Result<(), tokio_postgres::Error>> + Send;
}

impl Db for deadpool_postgres::ClientWrapper {
    async fn rows<'a>(&'a self, sql: &'static str, params: Params<'a>) -> Result<Vec<Row>, tokio_postgres::Error> {
        self.query(&self.prepare_cached(sql).await?, params).await
    }

    async fn run<'a>(&'a self, sql: &'static str, params: Params<'a>) -> Result<u64, tokio_postgres::Error> {
        self.execute(&self.prepare_cached(sql).await?, params).await
    }

    async fn prepare(&self, sql: &'static str) -> Result<(), tokio_postgres::Error> {
        self.prepare_cached(sql).await.map(drop)
    }
}

impl Db for deadpool_postgres::Transaction<'_> {
    async fn rows<'a>(&'a self, sql: &'static str, params: Params<'a>) -> Result<Vec<Row>, tokio_postgres::Error> {
        self.query(&self.prepare_cached(sql).await?, params).await
    }

    async fn run<'a>(&'a self, sql: &'static str, params: Params<'a>) -> Result<u64, tokio_postgres::Error> {
        self.execute(&self.prepare_cached(sql).await?, params).await
    }

    async fn prepare(&self, sql: &'static str) -> Result<(), tokio_postgres::Error> {
        self.prepare_cached(sql).await.map(drop)
    }
}

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
