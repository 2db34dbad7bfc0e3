//! Positions from another cluster (migration 0014): found, and replaced by fresh ones.
//!
//! A position is a transaction snapshot, meaningful only against the transaction counter of the
//! cluster that took it. A database restored from a dump into another cluster keeps the old
//! cluster's positions: where they lie ahead of the new counter, every new transaction looks
//! passed, no claim reads its events and the sweeper would remove them unsent. Such positions are
//! never trusted: the claims and the sweeper take nothing on their word, and [`rebase_positions`]
//! starts every destination afresh, with every event that some destination had not passed as a
//! new one.

use super::{Db, one};
use crate::error::{Error, Result};

/// Whether the positions were taken in another cluster: a destination's (or the origin's) newest
/// position lies ahead of this cluster's transaction counter, or `installation` names another
/// cluster (a counter that has since grown past the old positions is caught by that).
const POSITIONS_FOREIGN: &str = "\
select exists (
           select 1 from (select d.name from outbox_relay.destinations d union all select '') d
            cross join lateral (
               select q.snapshot from outbox_relay.positions q
                where q.destination = d.name order by q.n desc limit 1) p
            where pg_snapshot_xmax(p.snapshot) > pg_snapshot_xmax(pg_current_snapshot())) as ahead,
       (select i.system_identifier from outbox_relay.installation i)
           is distinct from (select c.system_identifier from pg_control_system() c) as moved";

/// Why positions were found foreign.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Foreign {
    /// A position lies ahead of the cluster's transaction counter.
    pub(crate) ahead: bool,
    /// The positions were recorded in a cluster with another system identifier.
    pub(crate) moved: bool,
}

impl Foreign {
    fn any(self) -> bool {
        self.ahead || self.moved
    }
}

impl std::fmt::Display for Foreign {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.ahead, self.moved) {
            (true, true) => {
                f.write_str("they lie ahead of this cluster's transaction counter and were taken in another cluster")
            }
            (true, false) => f.write_str("they lie ahead of this cluster's transaction counter"),
            _ => f.write_str("they were taken in another cluster (its system identifier differs)"),
        }
    }
}

/// Whether the positions are foreign, and why.
pub(crate) async fn positions_foreign(db: &impl Db) -> Result<Foreign> {
    let row = one(db, POSITIONS_FOREIGN, &[], "checking the positions' cluster").await?;
    Ok(Foreign { ahead: row.get("ahead"), moved: row.get("moved") })
}

/// The snapshot the fresh positions take: read before this transaction has an id of its own, so
/// that the rows it stamps lie past it (a snapshot taken later would count this transaction's id
/// as passed).
const SNAPSHOT_NOW: &str = "select pg_current_snapshot()::text as snapshot";

/// Whether the outbox row `e` keeps the outbox's checks (those added `not valid`, which a row
/// written before them, or by its owner past them, may break: such a row cannot be updated).
macro_rules! keeps_the_checks {
    () => {
        "coalesce(e.topic ~ '^[A-Za-z0-9_:/-]+(\\.[A-Za-z0-9_:/-]+)*$' and char_length(e.topic) <= 255
                  and e.created_at >= '1970-01-01 00:00:00+00' and e.created_at < '10000-01-01 00:00:00+00'
                  and isfinite(e.available_at) and outbox_relay.headers_problem(e.headers) is null, false)"
    };
}

/// Whether every registered destination's newest position passed the outbox row `e`, read with
/// the positions as they are (foreign ones too: their snapshots are of the transaction ids of the
/// rows restored with them). A row written in this cluster since (its id from this counter, which
/// an old snapshot may see as long committed) was created after every old position was taken: so
/// a row counts as passed only when it was also created before the position (its `at`, the claim's
/// start; a row committed in the moment between that and the claim's snapshot is sent again).
macro_rules! passed_before {
    () => {
        "(exists (select 1 from outbox_relay.destinations) and not exists (
            select 1 from outbox_relay.destinations d cross join lateral (
                select q.since, q.snapshot, q.after_id, q.at from outbox_relay.positions q
                 where q.destination = d.name order by q.n desc limit 1) p
             where not (e.created_at <= p.at and outbox_relay.passed(e.xid, e.id, p.since, p.snapshot, p.after_id))))"
    };
}

/// Rows every destination had passed (kept for their retention) whose ids come from the old
/// cluster's counter, ahead of this one's, would be read by every claim as new: they become the
/// transaction's that runs this, committed before the fresh positions' snapshot, so that every
/// destination has passed them. (The outbox's trigger lets a row name only the transaction that
/// writes it.) Those that break the checks cannot be updated, and are deleted: they were
/// delivered.
const REBASE_FINISHED_ROWS: &str = concat!(
    "with broken as (
    delete from outbox_relay.outbox e
     where e.xid >= pg_snapshot_xmax(pg_current_snapshot()) and ",
    passed_before!(),
    " and not ",
    keeps_the_checks!(),
    "
)
update outbox_relay.outbox e set xid = pg_current_xact_id()
 where e.xid >= pg_snapshot_xmax(pg_current_snapshot()) and ",
    passed_before!(),
    " and ",
    keeps_the_checks!()
);

/// Events not passed by every destination that break the checks cannot be updated: they go to the dead letters
/// of the destination '', saying why, as no handler could take them (one whose id another
/// event's dead letter there carries stays, and the rebase fails on it, loudly).
const REBASE_BURY_UNREADABLE: &str = concat!(
    "with bad as (
    select e.id, e.uuid, e.topic, e.key, e.payload, e.headers, e.created_at
      from outbox_relay.outbox e where not ",
    passed_before!(),
    " and not ",
    keeps_the_checks!(),
    "
),
buried as (
    insert into outbox_relay.dead_letters (destination, id, uuid, topic, key, payload, headers, created_at, attempts, last_error)
    select '', id, uuid, topic, key, payload, headers, created_at, 0,
           'the row breaks the outbox''s checks and was found while the positions were started afresh'
      from bad
    on conflict (destination, id) do nothing
    returning id
)
delete from outbox_relay.outbox where id in (select id from buried)"
);

/// Every event not passed by every destination becomes this transaction's: past the fresh positions (their
/// snapshot `$1` was taken before this transaction had an id), it is in the next claim's delta
/// of every destination.
const REBASE_ROWS: &str =
    concat!("update outbox_relay.outbox e set xid = pg_current_xact_id() where not ", passed_before!());

/// A fresh position for every destination, and for the origin where it has one.
const REBASE_POSITIONS: &str = "\
insert into outbox_relay.positions (destination, n, since, snapshot, after_id)
select d.name, coalesce((select max(q.n) from outbox_relay.positions q where q.destination = d.name), -1) + 1,
       $1::text::pg_snapshot, $1::text::pg_snapshot, null
  from (select name from outbox_relay.destinations
        union all select '' where exists (select 1 from outbox_relay.positions where destination = '')) d";

/// Every position but each destination's (and the origin's) newest, which the rebase just wrote.
const REBASE_FOREIGN_POSITIONS_GONE: &str = "\
delete from outbox_relay.positions p
 where p.n < (select max(q.n) from outbox_relay.positions q where q.destination = p.destination)";

/// The destinations' starts (snapshots of the other cluster).
const REBASE_STARTS_GONE: &str = "update outbox_relay.destinations set started = null where started is not null";

const INSTALLATION_RECORD: &str = "\
insert into outbox_relay.installation (system_identifier)
select system_identifier from pg_control_system()
on conflict (only_row) do update set system_identifier = excluded.system_identifier, checked_at = now()";

/// What a rebase did.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rebased {
    /// Why the positions were foreign.
    pub(crate) why: Foreign,
    /// Events not passed by every destination, now new to every destination.
    pub(crate) events: u64,
}

/// Replaces foreign positions by fresh ones, in one transaction that every claim waits for: every
/// event not passed by every destination is new again (delivered to each destination whose pattern matches it,
/// once more to those that had passed it: at least once), parked events and dead letters stay as
/// they are. `None` when the positions are this cluster's (another relay rebased them first).
pub(crate) async fn rebase_positions(client: &mut deadpool_postgres::Object) -> Result<Option<Rebased>> {
    let doing = "starting fresh positions";
    let fail = |e| Error::database(doing, e);
    // First the finished rows, in a transaction of their own that commits before the fresh
    // positions' snapshot is taken (a crash in between leaves the positions foreign: the next
    // relay to find them does it all again).
    if positions_foreign(&**client).await?.any() {
        let tx = client.transaction().await.map_err(fail)?;
        super::count(&tx, REBASE_FINISHED_ROWS, &[], doing).await?;
        tx.commit().await.map_err(fail)?;
    }
    let tx = client.transaction().await.map_err(fail)?;
    super::count(&tx, super::destinations::DESTINATIONS_LOCK, &[], doing).await?;
    one(&tx, super::destinations::DESTINATIONS_WAIT_FOR_CLAIMS, &[], doing).await?;
    let why = positions_foreign(&tx).await?;
    if !why.any() {
        return Ok(None);
    }
    let snapshot: String = one(&tx, SNAPSHOT_NOW, &[], doing).await?.get("snapshot");
    super::count(&tx, REBASE_BURY_UNREADABLE, &[], doing).await?;
    let events = super::count(&tx, REBASE_ROWS, &[], doing).await?;
    super::count(&tx, REBASE_POSITIONS, &[&snapshot], doing).await?;
    // The other cluster's positions and starts mean nothing here (the sweeper would take their
    // times and snapshots for this cluster's, `event_state` would hide every new event).
    super::count(&tx, REBASE_FOREIGN_POSITIONS_GONE, &[], doing).await?;
    super::count(&tx, REBASE_STARTS_GONE, &[], doing).await?;
    super::count(&tx, INSTALLATION_RECORD, &[], doing).await?;
    tx.commit().await.map_err(fail)?;
    Ok(Some(Rebased { why, events }))
}
