//! Claiming a destination's events: the new ones above its position and its parked ones.

use std::collections::HashSet;
use std::time::{Duration, SystemTime};

use futures::TryStreamExt;
use tokio_postgres::Row;

use super::outcomes::{Copies, complete_parked, early_deliveries_passed, park_new_events};
use super::{Db, Replanned, all, one};
use crate::error::{Error, Result};
use crate::payload::Payload;

// The claims: of new events (`claim_new.sql`), read by transaction snapshots above the
// position, so that no claim ever reads an entry of an event delivered before it and a held
// snapshot cannot slow it down; and of parked events (`claim_parked.sql`: failed, delayed,
// paused, leased, behind their key), from small indexes of their own. Each ends with a marker
// row (id null). Both run in the caller's READ COMMITTED transaction, which holds what they took
// until it ends: the new events by the advisory lock that only one transaction at a time holds,
// the parked ones by row locks.

const CLAIM_NEW: &str = include_str!("claim_new.sql");
/// Microseconds until the destination's next parked event is due, when one is due later.
const NEXT_DUE: &str = "\
select (extract(epoch from min(e.available_at) - now()) * 1000000)::int8 from outbox_relay.parked e
 where e.destination = $1 and e.available_at > now() and isfinite(e.available_at)";
const CLAIM_PARKED: &str = include_str!("claim_parked.sql");
/// Whether the destination has any parked event at all: a kept statement, one index probe (of
/// `parked_due_idx`, in the relay's settings). The claim of parked events is planned anew at each
/// run (about 2.5 ms of the server's time: [`Replanned`]), and the relay looks at them at every
/// poll, once a second for every destination, most often to find none.
const ANY_PARKED: &str = "select exists (select 1 from outbox_relay.parked e where e.destination = $1)";

/// A claimed event as the claim returns it.
pub(crate) struct ClaimedRow {
    pub(crate) id: i64,
    pub(crate) uuid: uuid::Uuid,
    pub(crate) topic: String,
    pub(crate) key: Option<String>,
    /// The payload's text, or why it cannot be read (text that is not UTF-8 or not JSON: jsonb
    /// never gives such, but no row is trusted to stop a claim).
    pub(crate) payload: std::result::Result<Payload, String>,
    /// The headers, or why they cannot be sent (a row written past the check constraint's
    /// rules, e.g. before it was validated).
    pub(crate) headers: std::result::Result<crate::Headers, String>,
    pub(crate) created_at: SystemTime,
    pub(crate) attempts: i32,
    /// Its age at the claim; `None` for a `created_at` outside 1970 to 9999.
    pub(crate) age: Option<Duration>,
    /// It was claimed from the destination's parked events (else from the new ones).
    pub(crate) parked: bool,
}

/// Where a claim's columns are in its rows, found once a claim: a lookup by name walks the
/// columns comparing names, a dozen times a row (a few hundred microseconds a batch of 500, on
/// the path between one claim read ahead and the next).
struct Columns {
    id: usize,
    uuid: usize,
    topic: usize,
    key: usize,
    payload: usize,
    headers: usize,
    created_at: usize,
    attempt: usize,
    age_us: usize,
    /// Whether the event was delivered by a claim that did not commit (`done`).
    done: usize,
}

impl Columns {
    fn of(row: &Row) -> Columns {
        let at = |name| column(row, name);
        Columns {
            id: at("id"),
            uuid: at("uuid"),
            topic: at("topic"),
            key: at("key"),
            payload: at("payload"),
            headers: at("headers"),
            created_at: at("created_at"),
            attempt: at("attempt"),
            age_us: at("age_us"),
            done: at("done"),
        }
    }

    /// The row's event id; `None` on the marker row.
    fn id(&self, row: &Row) -> Option<i64> {
        row.get(self.id)
    }

    fn flag(row: &Row, at: usize) -> bool {
        row.get::<_, Option<bool>>(at).unwrap_or(false)
    }

    fn claimed_row(&self, row: &Row, id: i64, parked: bool) -> ClaimedRow {
        ClaimedRow {
            parked,
            id,
            uuid: row.get(self.uuid),
            topic: row.get(self.topic),
            key: row.get(self.key),
            payload: row.try_get::<_, Payload>(self.payload).map_err(|e| crate::error::chain(&e)),
            headers: crate::Headers::from_stored(row.get(self.headers)),
            created_at: row.get(self.created_at),
            attempts: row.get(self.attempt),
            age: row.get::<_, Option<i64>>(self.age_us).map(|us| Duration::from_micros(us.max(0) as u64)),
        }
    }
}

/// The position of the column `name` in a claim's rows (the statements are ours: each has it).
fn column(row: &Row, name: &str) -> usize {
    row.columns()
        .iter()
        .position(|c| c.name() == name)
        .unwrap_or_else(|| panic!("a claim's rows have no column {name}"))
}

/// The destination a relay's claims are for, as the statements take it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Destination {
    /// Its name (`outbox_relay.destinations.name`).
    pub(crate) name: String,
    /// Its topic pattern as given.
    pub(crate) pattern: String,
    /// The second key of its new events' lock.
    pub(crate) lock_id: i32,
    /// Its pattern as a regular expression over the topic; `None` matches every topic.
    pub(crate) topic_regex: Option<String>,
}

/// What a claim looks at, and in which order.
#[derive(Debug, Clone)]
pub(crate) struct Turn {
    /// Whether to look for new events (not while another transaction of this relay holds their
    /// lock).
    pub(crate) new: bool,
    /// Whether parked events may be due: only then is their claim run.
    pub(crate) parked: bool,
    /// Parked events take the batch first, or the new events do (the relay alternates, so that
    /// neither starves the other).
    pub(crate) parked_first: bool,
    /// Where the walk over the parked keys goes on (after this key), and how many it walks.
    pub(crate) walk_after: String,
    pub(crate) walk_keys: i32,
    /// Topics not to claim (paused). A paused head holds its key's later events back.
    pub(crate) paused: std::sync::Arc<[String]>,
    /// The most bytes of payload a claim takes (past its first event).
    pub(crate) bytes: i64,
    /// The backend pid of the relay's listener while it owns the destination's fast path (its
    /// claims check that it lives), else 0 (the claim takes the fast-path lock, and is turned
    /// away while another relay owns it).
    pub(crate) fast_owner: i32,
    /// The token of this transaction's own records in `early_deliveries` (a held transaction
    /// reading ahead: `Claims::read_ahead`), which its claim need not read: they name events
    /// below the position it moved, when the transaction took only new events (a parked
    /// event's outbox row may lie ahead of the position: then 0). 0 for a transaction that has
    /// none.
    pub(crate) own_records: i64,
}

/// What a claim found.
#[derive(Default)]
pub(crate) struct Claimed {
    pub(crate) rows: Vec<ClaimedRow>,
    /// How long until the next parked event is due, when one is due later.
    pub(crate) next_due: Option<Duration>,
    /// The claim parked new events or moved the position without returning an event: its
    /// transaction must commit, and there may be more to claim.
    pub(crate) changed: bool,
    /// The claim parked new events (they may be due at once: behind a key whose head is done).
    pub(crate) parked_new: bool,
    /// More new events wait: the delta was cut short.
    pub(crate) more: bool,
    /// The claim of parked events ran and took all it could: none other is due now but those
    /// that other claims hold.
    pub(crate) parked_all: bool,
    /// Where the walk over the parked keys ended, when the claim of parked events ran: the key
    /// to go on after when it walked as far as it may, `None` when it reached the last key (the
    /// next walk starts from the first). `None` outside: the next walk goes on where it was.
    pub(crate) walked_to: Option<Option<String>>,
    /// The claim of parked events took some with a key.
    pub(crate) parked_keyed: bool,
    /// The claim holds the new events' lock (until its transaction ends): a claim turned away
    /// meanwhile relies on this one's relay to claim again once it is done.
    pub(crate) held_new: bool,
    /// Another transaction held the new events' lock: this claim took none.
    pub(crate) turned_away: bool,
    /// The destination's position lies ahead of the transaction counter (taken in another
    /// cluster): no new event was claimed on its word; the positions must be started afresh.
    pub(crate) foreign_position: bool,
    /// The destination has no position (it was dropped while this relay served it).
    pub(crate) unregistered: bool,
    /// Events a claim that did not commit had delivered (`early_deliveries`: its relay was
    /// killed in the middle of the delivery), recorded as delivered in this claim's transaction
    /// instead of being handed over again.
    pub(crate) early: usize,
    /// New events whose outcome the fast path decided (delivered from their notification):
    /// their ids and attempts, to be recorded with the batch, not handed over.
    pub(crate) decided: Vec<(i64, i32)>,
    /// The snapshot of the claim of new events, as `pg_current_snapshot()` prints it.
    pub(crate) snapshot: Option<String>,
    /// The keys of the new events handed over, and of those parked (they wait now).
    pub(crate) handed_keys: Vec<String>,
    pub(crate) parked_keys: Vec<String>,
}

/// What the fast path settled for a new event (`src/relay/fast.rs`), which a claim records
/// instead of handing it over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Settled {
    /// Delivered from its notification.
    Delivered,
    /// Tried from its notification, and it failed: it waits now, and its key's later events too.
    Failed,
    /// Its delivery from its notification outlived the hold and was leased, and its outcome
    /// recorded by the lease's token: the claim only passes its outbox row.
    Leased,
}

/// How many times a claim of new events reads the position at most. A read that another claim's
/// commit overtook is read again in the same transaction, which then holds the lock, so the
/// second read is not overtaken; the bound only keeps a surprise from looping.
const OVERTAKEN_MAX: usize = 4;

/// Claims up to `batch` deliverable events, looking as `turn` says; with `dead_letters_hold`, a
/// key with an earlier event in the dead letters is held. Runs inside the caller's READ
/// COMMITTED transaction, which holds the events until it ends. New events that cannot be
/// handed over now are parked in it, with every later new event of their key.
///
/// `decided` says which new events the fast path settled already: those it delivered or tried
/// are returned in `Claimed::decided`, to be recorded with the batch instead of handed over;
/// those it leased are passed. So is a new event with a copy in the parked events already (the
/// fast path of this relay, or of one that died or lost it since, leased it): the copy stands
/// for it.
pub(crate) async fn claim_events(
    db: &impl Db,
    to: &Destination,
    batch: i64,
    dead_letters_hold: bool,
    turn: &Turn,
    decided: &(dyn Fn(i64) -> Option<Settled> + Sync),
) -> Result<Claimed> {
    let mut claimed = Claimed::default();
    if turn.parked && turn.parked_first {
        claim_parked(db, to, batch, dead_letters_hold, turn, &mut claimed).await?;
    }
    let room = batch - claimed.rows.len() as i64;
    if turn.new && room > 0 {
        claim_new(db, to, room, dead_letters_hold, turn, decided, &mut claimed).await?;
    }
    let room = batch - claimed.rows.len() as i64;
    if turn.parked && !turn.parked_first && room > 0 {
        claim_parked(db, to, room, dead_letters_hold, turn, &mut claimed).await?;
    }
    Ok(claimed)
}

async fn claim_new(
    db: &impl Db,
    to: &Destination,
    batch: i64,
    dead_letters_hold: bool,
    turn: &Turn,
    decided: &(dyn Fn(i64) -> Option<Settled> + Sync),
    claimed: &mut Claimed,
) -> Result<()> {
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 9] = [
        &batch,
        &dead_letters_hold,
        &&*turn.paused,
        &to.name,
        &to.lock_id,
        &to.topic_regex,
        &turn.bytes,
        &turn.fast_owner,
        &turn.own_records,
    ];
    for _ in 0..OVERTAKEN_MAX {
        // Each row is read as it arrives, while the server sends the next ones. (A statement
        // with a data-modifying CTE runs to its end before its first row leaves the server;
        // then each row is converted as it is sent, the payloads' JSON text most of that.)
        let mut fresh = Vec::new();
        let (mut moved, mut overtaken) = (false, false);
        let mut columns = None;
        let stream = db.stream(CLAIM_NEW, &params).await.map_err(|e| Error::database("claiming new events", e))?;
        futures::pin_mut!(stream);
        while let Some(row) = stream.try_next().await.map_err(|e| Error::database("claiming new events", e))? {
            let (columns, ready, copied) =
                columns.get_or_insert_with(|| (Columns::of(&row), column(&row, "ready"), column(&row, "copied")));
            let Some(id) = columns.id(&row) else {
                claimed.next_due = row
                    .get::<_, Option<i64>>("next_due_us")
                    .filter(|us| *us > 0)
                    .map(|us| Duration::from_micros(us as u64));
                claimed.held_new = row.get::<_, Option<bool>>("held").unwrap_or(false);
                moved = row.get::<_, Option<bool>>("moved").unwrap_or(false);
                claimed.more = row.get::<_, Option<bool>>("more").unwrap_or(false);
                overtaken = row.get::<_, Option<bool>>("overtaken").unwrap_or(false);
                claimed.foreign_position = row.get::<_, Option<bool>>("foreign_position").unwrap_or(false);
                claimed.unregistered = row.get::<_, Option<bool>>("unregistered").unwrap_or(false);
                claimed.snapshot = row.get("snapshot");
                continue;
            };
            let (ready, done, copied) =
                (Columns::flag(&row, *ready), Columns::flag(&row, columns.done), Columns::flag(&row, *copied));
            fresh.push((columns.claimed_row(&row, id, false), ready, done, copied));
        }
        claimed.turned_away = !claimed.held_new;
        if claimed.held_new && overtaken {
            continue; // another claim moved the position after this one read it: read it again
        }
        // A key whose event waits holds its later ones back too (they are in id order).
        let mut waiting_keys: HashSet<String> = HashSet::new();
        let mut park = Copies::default();
        let mut early = Vec::new();
        let mut copied = Vec::new();
        for (row, ready, done, has_copy) in fresh {
            let settled = decided(row.id);
            if has_copy || settled == Some(Settled::Leased) {
                // Leased by the fast path (its delivery from its notification outlived the hold),
                // of this relay or of one that died or lost the fast path since: the copy stands
                // for it (and holds its key's later events back), or stood for it and its outcome
                // was recorded.
                if let Some(key) = &row.key {
                    waiting_keys.insert(key.clone());
                }
                copied.push(row.id);
                continue;
            }
            if let Some(settled) = settled {
                // Delivered from its notification (src/relay/fast.rs), whatever it would be
                // judged now: recorded with the batch. One that failed holds its key's later
                // events back, as a failure in a batch does.
                if let (Settled::Failed, Some(key)) = (settled, &row.key) {
                    waiting_keys.insert(key.clone());
                }
                claimed.decided.push((row.id, row.attempts));
                continue;
            }
            if done {
                // Delivered by a claim that did not commit, in its key's order (a claim sends a
                // key's later event only once the earlier ones are delivered): recorded below.
                early.push(row.id);
                continue;
            }
            let wait = match &row.key {
                None => !ready,
                Some(key) => {
                    if !ready {
                        waiting_keys.insert(key.clone());
                    }
                    waiting_keys.contains(key)
                }
            };
            if wait {
                if let Some(key) = &row.key {
                    claimed.parked_keys.push(key.clone());
                }
                park.push(row.id, Duration::ZERO, None, row.attempts - 1);
            } else {
                if let Some(key) = &row.key {
                    claimed.handed_keys.push(key.clone());
                }
                claimed.rows.push(row);
            }
        }
        if !park.ids.is_empty() {
            // A copy waits for this destination (the outbox row is not written: the position
            // moved past it).
            park_new_events(db, &to.name, &park, None).await?;
            claimed.parked_new = true;
            // A delayed one may be due before anything the claim saw parked: the relay must
            // wake for it (the marker was read before it was parked).
            let due: Option<i64> =
                one(db, NEXT_DUE, &[&to.name], "reading when the next parked event is due").await?.get(0);
            if let Some(due) = due.filter(|us| *us > 0).map(|us| Duration::from_micros(us as u64)) {
                claimed.next_due = Some(claimed.next_due.map_or(due, |was| was.min(due)));
            }
        }
        if !early.is_empty() {
            // Passed by the position like the rest: nothing waits for this destination.
            early_deliveries_passed(db, &to.name, &early).await?;
            claimed.early += early.len();
        }
        // The position moved but the claim returns no event (all parked, or the end of a cut
        // delta): its transaction must commit, and there may be more.
        // (Outcomes decided by the fast path are written with the batch.)
        claimed.changed |= moved && claimed.rows.is_empty() && claimed.decided.is_empty();
        return Ok(());
    }
    // Overtaken every time: other claims are moving the position; theirs will claim again.
    claimed.turned_away = true;
    Ok(())
}

async fn claim_parked(
    db: &impl Db,
    to: &Destination,
    limit: i64,
    dead_letters_hold: bool,
    turn: &Turn,
    claimed: &mut Claimed,
) -> Result<()> {
    let rows = if one(db, ANY_PARKED, &[&to.name], "looking for parked events").await?.get::<_, bool>(0) {
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 7] =
            [&limit, &dead_letters_hold, &turn.walk_after, &turn.walk_keys, &&*turn.paused, &to.name, &turn.bytes];
        all(&Replanned(db), CLAIM_PARKED, &params, "claiming parked events").await?
    } else {
        // What the claim would have found: no event, and a walk that reached the last key. (Its
        // statement reads nothing but `parked` to find its events, in the same kind of snapshot.)
        claimed.walked_to = Some(None);
        Vec::new()
    };
    let mut taken = 0;
    let mut cut = false;
    let mut early = Vec::new();
    let mut columns = None;
    for row in &rows {
        let columns = columns.get_or_insert_with(|| Columns::of(row));
        let Some(id) = columns.id(row) else {
            claimed.walked_to = Some(row.get("walked_to"));
            cut = row.get::<_, Option<bool>>("cut").unwrap_or(false);
            continue;
        };
        taken += 1;
        let done = Columns::flag(row, columns.done);
        let row = columns.claimed_row(row, id, true);
        claimed.parked_keyed |= row.key.is_some();
        if done {
            // Delivered by a claim that did not commit: recorded below, not handed over.
            early.push(row.id);
        } else {
            claimed.rows.push(row);
        }
    }
    if !early.is_empty() {
        complete_parked(db, &to.name, &early, None).await?;
        early_deliveries_passed(db, &to.name, &early).await?;
        claimed.early += early.len();
        // Its transaction must commit, though the claim may hand nothing over.
        claimed.changed = true;
    }
    // All it could: a walk that began at the first key and reached the last took less than the
    // limit. (One that began after a key and reached the last has not looked at the keys before
    // it: the next claim walks from the first.)
    claimed.parked_all =
        !cut && (taken as i64) < limit && claimed.walked_to == Some(None) && turn.walk_after.is_empty();
    Ok(())
}

// What became of claimed events. An event claimed from the new ones is, for this destination,
// passed by the position the claim moved: whatever its outcome, its outbox row is done with as
// far as this destination goes (`finish_new_events`), and what still waits for this destination
// is a copy in `parked` (`park_new_events`) or a dead letter (`bury_new_events`), written first.
// An event claimed from `parked` changes there. The statements on parked events take the claim's
// lease token, or null for a held claim (its locks already say the rows are this claim's);
// `attempts` are set as the relay counted them: the attempt just made, or one fewer where it is
// given back.

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    /// Every `Seq Scan` of the outbox (its leaves, migration 0024) or the parked events in an
    /// EXPLAIN (FORMAT JSON) plan.
    fn outbox_seq_scans(plan: &Value, found: &mut Vec<String>) {
        match plan {
            Value::Object(node) => {
                let relation = node.get("Relation Name").and_then(Value::as_str).unwrap_or("");
                if node.get("Node Type") == Some(&Value::from("Seq Scan"))
                    && (relation == "outbox" || relation.starts_with("outbox_") || relation == "parked")
                {
                    found.push(format!(
                        "{relation} (as {}, filter {})",
                        node.get("Alias").and_then(Value::as_str).unwrap_or(""),
                        node.get("Filter").and_then(Value::as_str).unwrap_or("none")
                    ));
                }
                node.values().for_each(|v| outbox_seq_scans(v, found));
            }
            Value::Array(items) => items.iter().for_each(|v| outbox_seq_scans(v, found)),
            _ => {}
        }
    }

    /// The relay runs its claims with generic plans (`plan_cache_mode = force_generic_plan`):
    /// with a backlog of new and of parked events, both claims, with no topic paused and with
    /// one, must read through their indexes, never the whole outbox (a bare `topic <> all($5)`
    /// once made the planner do just that, a hundred times slower). Checked first without the
    /// relay's `enable_seqscan = off`, so that the plans stand on the statements alone, for the
    /// parked events and for the leaf of the outbox that holds the backlog. An empty leaf
    /// (migration 0024) is read whole there, as the cheapest way to read nothing; a plan kept
    /// from then would read it whole once it fills, which the relay's sessions rule out: checked
    /// second with their settings, where no table is read whole.
    #[tokio::test]
    async fn every_claim_walks_the_indexes_with_generic_plans() {
        let db = pg_outbox_relay_testkit::harness::TestDb::new().await;
        let client = db.client().await;
        client
            .batch_execute(
                "insert into outbox_relay.outbox (topic, payload, slot) select 'bench', '{}', 2 from generate_series(1, 100000);
                 insert into outbox_relay.outbox (topic, key, payload, slot) select 'bench', 'k' || (g % 100), '{}', 2 from generate_series(1, 10000) g;
                 insert into outbox_relay.parked (destination, id, uuid, topic, payload, created_at)
                 select 'default', g, gen_random_uuid(), 'bench', '{}', now() from generate_series(1, 100000) g;
                 insert into outbox_relay.parked (destination, id, uuid, topic, key, payload, created_at)
                 select 'default', g, gen_random_uuid(), 'bench', 'k' || (g % 100), '{}', now() from generate_series(100001, 110000) g;
                 analyze outbox_relay.outbox;
                 analyze outbox_relay.parked;
                 set plan_cache_mode = force_generic_plan",
            )
            .await
            .unwrap();
        // The backlog's leaf (slot 2); the other leaves are empty.
        let backlog = "outbox_2";
        for (settings, relay_sessions) in [("", false), ("set enable_seqscan = off; set enable_bitmapscan = off", true)]
        {
            client.batch_execute(&format!("deallocate all; {settings}")).await.unwrap();
            client.batch_execute(&format!("prepare claim_new as {CLAIM_NEW}")).await.unwrap();
            client.batch_execute(&format!("prepare claim_parked as {CLAIM_PARKED}")).await.unwrap();
            for paused in ["{}", "{mail.send}"] {
                for (name, args) in [
                    // (the last two: the fast path's owner, none and one, and the transaction's own records)
                    ("claim_new", format!("500, false, '{paused}', 'default', 1, null, 8388608, 0, 0")),
                    (
                        "claim_new",
                        format!("500, false, '{paused}', 'mailer', 2, '^\\.mail(\\.[^.]+)*$', 8388608, 1, 7"),
                    ),
                    ("claim_parked", format!("500, false, '', 1000, '{paused}', 'default', 8388608")),
                ] {
                    client.batch_execute("begin").await.unwrap();
                    let row =
                        client.query_one(&format!("explain (format json) execute {name}({args})"), &[]).await.unwrap();
                    client.batch_execute("rollback").await.unwrap();
                    let plan: Value = row.get(0);
                    let mut scans = Vec::new();
                    outbox_seq_scans(&plan, &mut scans);
                    if !relay_sessions {
                        scans.retain(|scan| {
                            let relation = scan.split(' ').next().unwrap_or("");
                            !relation.starts_with("outbox_") || relation == backlog
                        });
                    }
                    assert!(
                        scans.is_empty(),
                        "{name} (paused {paused}, relay's settings {relay_sessions}) reads whole tables: {scans:?}\n{plan}"
                    );
                }
            }
        }
    }
}
