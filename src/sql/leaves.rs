//! The outbox's leaves (migration 0024): what each holds, and the truncation of one the sweeper
//! has emptied.

use super::{Db, Error, all, one};

/// The outbox's leaves, by slot: the rows written before migration 0024 (slot -1), then one per
/// slot of the clock. Migration 0024 made them; the claim (`claim_new.sql`) and [`LEAVES`] name
/// them too.
pub(crate) const OUTBOX_LEAVES: [(i16, &str); 5] = [
    (-1, "outbox_relay.outbox_before"),
    (0, "outbox_relay.outbox_0"),
    (1, "outbox_relay.outbox_1"),
    (2, "outbox_relay.outbox_2"),
    (3, "outbox_relay.outbox_3"),
];

/// Each leaf of the outbox: its slot (-1: the rows written before migration 0024), its size on
/// disk (indexes and TOAST included), the statistics' count of its live rows (a hint, late by
/// seconds), whether its slot is the one writers use now, or the last one for the first minute
/// of this one (transactions that began in it), or the next one for the last minute before it
/// (a truncate then could make the first writers wait for its lock): those are left alone;
/// and the span of a slot.
const LEAVES: &str = "\
select s.slot::int2, pg_relation_size(s.leaf) > 0 as used, pg_total_relation_size(s.leaf) as bytes,
       pg_stat_get_live_tuples(s.leaf) as live,
       s.slot in (outbox_relay.current_slot(),
                  outbox_relay.slot_at(now() - make_interval(secs => least(p.seconds, 60))),
                  outbox_relay.slot_at(now() + make_interval(secs => least(p.seconds, 60)))) as near,
       p.seconds as span_seconds
  from (values (-1::int2, 'outbox_relay.outbox_before'::regclass), (0, 'outbox_relay.outbox_0'),
               (1, 'outbox_relay.outbox_1'), (2, 'outbox_relay.outbox_2'), (3, 'outbox_relay.outbox_3'))
       s(slot, leaf)
 cross join outbox_relay.slot_span p
 order by s.slot";

/// One leaf of the outbox, as [`LEAVES`] reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Leaf {
    pub(crate) slot: i16,
    pub(crate) used: bool,
    pub(crate) bytes: i64,
    pub(crate) live: i64,
    pub(crate) near: bool,
    /// The span of a slot, in seconds (`outbox_relay.slot_span`).
    pub(crate) span_seconds: i32,
}

/// The outbox's leaves.
pub(crate) async fn outbox_leaves(db: &impl Db) -> Result<Vec<Leaf>, Error> {
    let rows = all(db, LEAVES, &[], "reading the outbox's leaves").await?;
    Ok(rows
        .iter()
        .map(|r| Leaf {
            slot: r.get(0),
            used: r.get(1),
            bytes: r.get(2),
            live: r.get(3),
            near: r.get(4),
            span_seconds: r.get(5),
        })
        .collect())
}

/// `outbox_relay.truncate_leaf` (migration 0024): the leaf of a slot truncated if nothing in it is
/// visible any more.
const TRUNCATE_LEAF: &str = "\
select t.outcome, t.seen::text from outbox_relay.truncate_leaf($1::int2, $2::text::pg_snapshot, $3::int4) t";

/// What a try to truncate a leaf came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Truncation {
    /// Truncated: the disk its removed rows took is free.
    Truncated,
    /// Nothing to free (its heap is empty already).
    Empty,
    /// Something in it is still visible: rows the sweeper has not removed (their retention, a
    /// destination behind), or written since.
    Rows,
    /// Its lock was not granted in time (claims in flight, a dump); `seen` is the snapshot its
    /// rows were checked in, for the next try.
    Locked { seen: Option<String> },
}

/// Truncates the leaf of `slot` if nothing in it is visible any more, waiting at most
/// `lock_wait_ms` for its lock; `seen`, the snapshot of an earlier try's check that found
/// nothing visible, spares a read of the whole leaf.
pub(crate) async fn truncate_leaf(
    db: &impl Db,
    slot: i16,
    seen: Option<&str>,
    lock_wait_ms: i32,
) -> Result<Truncation, Error> {
    let row = one(db, TRUNCATE_LEAF, &[&slot, &seen, &lock_wait_ms], "truncating an outbox leaf").await?;
    let outcome: String = row.get(0);
    match outcome.as_str() {
        "truncated" => Ok(Truncation::Truncated),
        "empty" => Ok(Truncation::Empty),
        "rows" => Ok(Truncation::Rows),
        "locked" => Ok(Truncation::Locked { seen: row.get(1) }),
        other => Err(Error::new(
            crate::error::ErrorKind::Database,
            format!(
                "truncating an outbox leaf: outbox_relay.truncate_leaf said {other:?}, which this relay does not know"
            ),
        )),
    }
}

/// Who holds a lock on the leaf `$1` now: sessions (the longest in a transaction first) and
/// prepared transactions (which hold their locks until COMMIT PREPARED or ROLLBACK PREPARED), at
/// most 5, each said in a few words.
const LEAF_LOCK_HOLDERS: &str = "\
select coalesce(
         format('pid %s (%s, %s)', a.pid, coalesce(nullif(a.application_name, ''), a.usename::text, 'a session of another role'),
                coalesce('in a transaction for ' || extract(epoch from now() - a.xact_start)::int8 || ' s',
                         'its transaction''s age hidden from this role')),
         format('the prepared transaction %L (prepared %s s ago)', p.gid, extract(epoch from now() - p.prepared)::int8),
         'a session this role may not see') as who
  from pg_locks l
  left join pg_stat_activity a on a.pid = l.pid
  left join pg_prepared_xacts p on l.pid is null and l.virtualtransaction = '-1/' || p.transaction::text
 where l.locktype = 'relation' and l.granted and l.pid is distinct from pg_backend_pid()
   and l.relation = $1::text::regclass
 order by a.xact_start nulls first
 limit 5";

/// Who holds a lock on the leaf of `slot` now, in one line.
pub(crate) async fn leaf_lock_holders(client: &tokio_postgres::Client, slot: i16) -> Result<String, Error> {
    let leaf = OUTBOX_LEAVES.iter().find(|(s, _)| *s == slot).map_or("outbox_relay.outbox", |(_, leaf)| *leaf);
    let rows = client
        .query(LEAF_LOCK_HOLDERS, &[&leaf])
        .await
        .map_err(|e| Error::database("reading who holds an outbox leaf's lock", e))?;
    if rows.is_empty() {
        return Ok("no session holds a lock on the leaf now".to_string());
    }
    Ok(rows.iter().map(|r| r.get::<_, String>(0)).collect::<Vec<_>>().join("; "))
}
