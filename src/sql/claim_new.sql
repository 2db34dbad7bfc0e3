-- The claim of new events for one destination (migrations 0008 and 0012; src/sql/claim.rs
-- runs it). Parameters: $1 the batch, $2 an earlier dead letter holds its key, $3 the paused
-- topics, $4 the destination, $5 its lock's number, $6 its pattern as a regular expression over
-- '.' || topic (null: every topic; see src/relay/route.rs), $7 the most bytes of payload a batch
-- takes (past its first event), $8 the backend pid of this relay's listener when it owns the
-- destination's fast path (else 0), $9 the token of the claiming transaction's own records in
-- `early_deliveries` when none of them can name an event this claim meets (a held transaction
-- reading ahead that took only new events, src/relay/batch.rs; else 0).
--
-- One transaction at a time claims a destination's new events: the advisory lock is held until
-- it ends (one that another transaction holds turns this claim away). While a relay owns the
-- destination's fast path (its listener holds the second lock for its session:
-- src/relay/fast.rs), it alone claims new events: another relay's claim tries that lock first,
-- and is turned away without touching the first (were it to hold the first lock for a moment,
-- the owner's claim recording what the fast path delivered could be turned away by it, and
-- nothing would wake the owner to claim again); the owner's claims check that its listener's
-- backend still lives (if it died, the lock went with it, and another relay may own the fast
-- path now). The position is the
-- destination's newest row of `positions`, read from the end of its index. The new events are the
-- delta from its snapshot to this statement's: the events of transactions past its xmax and of
-- those in progress then, that this statement sees (an event this statement cannot see is not in
-- the delta: its transaction is in progress for this statement's snapshot too, so in the next
-- delta's list). Nothing below the position is read, so no event delivered before (kept for the
-- retention, migration 0019) and no dead entry of one removed is ever on the path. Of the delta, the events the pattern matches are taken; the position moves
-- past the others too. A delta with more matching events than the batch (in events or in bytes) goes on from `after_id`,
-- in id order, between the two snapshots kept. The position was read before the lock: if another
-- claim's commit overtook it in between, the insert of the next position conflicts and nothing
-- is claimed.
with recursive lock as materialized (
    select case when $8::int4 <> 0
                then pg_try_advisory_xact_lock(1869901932, $5::int4)
                     and exists (select 1 from pg_stat_get_activity($8::int4))
                when pg_try_advisory_xact_lock(1869901934, $5::int4)
                then pg_try_advisory_xact_lock(1869901932, $5::int4)
                else false end as held
),
head as materialized (
    select p.n, p.since, p.snapshot, p.after_id,
           pg_snapshot_xmax(p.snapshot) > pg_snapshot_xmax(pg_current_snapshot()) as ahead
      from lock l cross join lateral (
        select q.n, q.since, q.snapshot, q.after_id from outbox_relay.positions q
         where l.held and q.destination = $4::text order by q.n desc limit 1) p
),
-- A position ahead of this cluster's transaction counter was taken in another cluster (a
-- restored dump, migration 0014): nothing is claimed on its word (src/sql/rebase.rs).
pos as materialized (
    select h.n, h.since, h.snapshot, h.after_id from head h where not h.ahead
),
-- The delta through the xid index (each probe ordered by xid, so that no plan walks the ids
-- from the first and filters on xid: that walk would pass every event ever delivered), each
-- event with whether the pattern matches it, then sorted.
delta as materialized (
    select e.id, e.slot, e.ctid, e.key, e.matches, e.stored from pos k cross join lateral (
        select e.id, e.slot, e.ctid, e.key, ($6::text is null or ('.' || e.topic) ~ $6::text) as matches,
               pg_column_size(e.payload) as stored from outbox_relay.outbox e
         where k.after_id is null and e.xid >= pg_snapshot_xmax(k.snapshot) and e.xid <> '0'::xid8
         order by e.xid) e
    union all
    select e.id, e.slot, e.ctid, e.key, e.matches, e.stored from pos k cross join lateral pg_snapshot_xip(k.snapshot) as x(xid)
     cross join lateral (
        select e.id, e.slot, e.ctid, e.key, ($6::text is null or ('.' || e.topic) ~ $6::text) as matches,
               pg_column_size(e.payload) as stored from outbox_relay.outbox e
         where k.after_id is null and e.xid = x.xid and e.xid <> '0'::xid8
         order by e.xid) e
),
cand as materialized (
    select x.id, x.slot, x.ctid, x.key, x.stored from (
        select d.id, d.slot, d.ctid, d.key, d.stored from delta d where d.matches
        union all
        select c.id, c.slot, c.ctid, c.key, c.stored from pos k cross join lateral (
            select e.id, e.slot, e.ctid, e.key, pg_column_size(e.payload) as stored from outbox_relay.outbox e
             where k.after_id is not null and e.id > k.after_id
               and pg_visible_in_snapshot(e.xid, k.snapshot) and not pg_visible_in_snapshot(e.xid, k.since)
               and ($6::text is null or ('.' || e.topic) ~ $6::text)
             order by e.id limit $1::int8 + 1) c
    ) x order by x.id limit $1::int8 + 1
),
-- The batch: at most $1 events, and no more bytes of payload than $7 (but always the first), so
-- that a relay's memory follows its batch size however large the events are. A payload stored
-- inline counts its stored size, a larger one its text's length. When every candidate is stored
-- inline (the sizes came with the scan) the sizes are summed in one pass; otherwise they are
-- added one event at a time, in id order, and only until the bound is passed (a larger payload's
-- text read from TOAST only for the events that may be taken, never for a whole delta of large
-- events). The two ways count the same bytes.
small as materialized (
    select coalesce(bool_and(c.stored < 1024), true) as all_inline from cand c
),
ids as materialized (
    select coalesce(array_agg(c.id order by c.id), '{}') as a, coalesce(array_agg(c.ctid order by c.id), '{}') as t,
           coalesce(array_agg(c.slot order by c.id), '{}') as s
      from cand c where not (select m.all_inline from small m)
),
sized(n, id, slot, ctid, upto) as (
    select 1, i.a[1], i.s[1], i.t[1],
           (select outbox_relay.payload_bytes(e.payload) from outbox_relay.outbox e where e.ctid = i.t[1] and e.slot = i.s[1])
      from ids i where cardinality(i.a) > 0
    union all
    select s.n + 1, i.a[s.n + 1], i.s[s.n + 1], i.t[s.n + 1],
           s.upto + (select outbox_relay.payload_bytes(e.payload) from outbox_relay.outbox e
                      where e.ctid = i.t[s.n + 1] and e.slot = i.s[s.n + 1])
      from sized s, ids i
     where s.n < least(cardinality(i.a), $1::int4) and s.upto <= $7::int8
),
taken as materialized (
    select t.id, t.slot, t.ctid from (
        select w.id, w.slot, w.ctid from (
            select c.id, c.slot, c.ctid, row_number() over w as n, sum(c.stored) over w as upto
              from cand c window w as (order by c.id rows unbounded preceding)) w
         where (select m.all_inline from small m) and w.n <= $1::int8 and (w.n = 1 or w.upto <= $7::int8)
        union all
        select s.id, s.slot, s.ctid from sized s where s.n = 1 or s.upto <= $7::int8
    ) t order by t.id
),
-- The batch's keys (`taken` is the first of the candidates in id order) that have an event
-- parked for this destination, one probe a key: only their events are looked up one at a time
-- below (a claim of 500 keyed events spent a quarter of its time on a lookup for each; a key
-- without a parked event, the common case, is now probed once a claim, and under a held
-- snapshot its dead parked entries are walked once, not once an event).
-- The batch's tuple ids, by leaf: each leaf is read with its own (below).
tids as materialized (
    select t.slot, array_agg(t.ctid) as a from taken t group by t.slot
),
waiting as materialized (
    select coalesce(array_agg(k.key), '{}') as keys
      from (select distinct c.key from cand c
             where c.key is not null and c.id <= (select max(t.id) from taken t)) k
     where (select b.id from outbox_relay.parked b
             where b.destination = $4::text and b.key = k.key
             order by b.destination, b.key, b.id limit 1) is not null
),
moved as (
    insert into outbox_relay.positions (destination, n, since, snapshot, after_id)
    select $4::text, k.n + 1,
           case when k.after_id is null then k.snapshot else k.since end,
           case when k.after_id is null then pg_current_snapshot() else k.snapshot end,
           case when (select count(*) from cand) > (select count(*) from taken) then (select max(t.id) from taken t) end
      from pos k
     where k.after_id is not null or exists (select 1 from delta)
    on conflict do nothing
    returning n
)
-- The events in id order, each with whether it can be handed over now: not delayed (by the
-- clock after the snapshot: a writer that began after this transaction and committed before its
-- snapshot has an `available_at` past now()), not paused, not behind an event of its key parked
-- for this destination (looked up one event at a time only for the keys in `waiting`), not held
-- by an earlier dead letter of its key at this destination (with $2), and whether a claim that
-- did not commit delivered it already (`early_deliveries`, migration 0017: a relay killed in the
-- middle of a delivery; read only when the destination has such rows at all, one probe a claim
-- otherwise; not the records $9 names, the claiming transaction's own, which can only name
-- events below the position it moved: reading them for every row made a claim read ahead of a
-- long chain three times slower), and whether it has a copy in the destination's
-- parked events already (the same event, by its uuid: a delivery from its notification that
-- outlived the hold was leased so, src/relay/fast_task.rs, and the copy stands for it; read only
-- when the destination has a parked event from the batch's first id on, one probe a claim
-- otherwise: every other copy's outbox row was passed when it was made). Then one marker row (id null): how long until the destination's next parked event is due
-- (when one is due later), whether this transaction holds the lock, whether it moved the
-- position, whether more new events wait (cut short), and whether another claim's commit
-- overtook its read of the position (it found new events or a cut delta's end but could not move
-- the position: it claimed nothing, and must look again), whether the position lies ahead of the
-- transaction counter (another cluster's: nothing was claimed on its word), whether the
-- destination has no position at all (it was dropped while this relay served it), and this
-- statement's snapshot (the fast path drops what it sees: this claim took it).
-- (Each probe is a scalar subquery ordered as its index, and the events are read again by the
-- tuple ids the scan found (`taken`: a TID scan, no index descent; the row version the scan
-- saw stays at its tuple id while this statement's snapshot sees it): no plan may choose to walk an index
-- from its start, past the dead entries a held snapshot keeps. A tuple id names a row within its
-- leaf only (migration 0024): each leaf is read by its own name with the tuple ids of its slot;
-- through the partitioned table, every leaf would be read with every tuple id, six times the cost.)
select o.id, o.topic, o.key, o.payload, o.created_at, 1 as attempt,
       case when o.created_at >= '1970-01-01 00:00:00+00' and o.created_at < '10000-01-01 00:00:00+00'
            then (date_part('epoch', clock_timestamp() - o.created_at) * 1000000)::int8 end as age_us,
       o.uuid, o.headers,
       o.available_at <= clock_timestamp() and coalesce(o.topic <> all($3::text[]), true)
       and (o.key is null or o.key <> all ((select w.keys from waiting w)::text[])
            or (select b.id from outbox_relay.parked b
                 where b.destination = $4::text and b.key = o.key and b.id < o.id
                 order by b.destination, b.key, b.id limit 1) is null)
       and not ($2 and o.key is not null and exists (
            select 1 from outbox_relay.dead_letters d where d.destination = $4::text and d.key = o.key and d.id < o.id)) as ready,
       case when (select exists (select 1 from outbox_relay.early_deliveries x
                                  where x.destination = $4::text and x.token <> $9::int8))
            then coalesce(o.id in (select unnest(x.ids) from outbox_relay.early_deliveries x
                                    where x.destination = $4::text and x.token <> $9::int8), false)
            else false end as done,
       case when (select x.id from outbox_relay.parked x
                   where x.destination = $4::text and x.id >= (select min(t.id) from taken t)
                   order by x.destination, x.id limit 1) is not null
            then exists (select 1 from outbox_relay.parked x where x.destination = $4::text and x.id = o.id and x.uuid = o.uuid)
            else false end as copied,
       null::int8 as next_due_us, null::boolean as held, null::boolean as moved, null::boolean as more,
       null::boolean as overtaken, null::boolean as foreign_position, null::boolean as unregistered,
       null::text as snapshot
  from (
        select o.id, o.topic, o.key, o.payload, o.created_at, o.available_at, o.uuid, o.headers from outbox_relay.outbox_before o
         where o.ctid = any (coalesce((select d.a from tids d where d.slot = -1), '{}'))
        union all
        select o.id, o.topic, o.key, o.payload, o.created_at, o.available_at, o.uuid, o.headers from outbox_relay.outbox_0 o
         where o.ctid = any (coalesce((select d.a from tids d where d.slot = 0), '{}'))
        union all
        select o.id, o.topic, o.key, o.payload, o.created_at, o.available_at, o.uuid, o.headers from outbox_relay.outbox_1 o
         where o.ctid = any (coalesce((select d.a from tids d where d.slot = 1), '{}'))
        union all
        select o.id, o.topic, o.key, o.payload, o.created_at, o.available_at, o.uuid, o.headers from outbox_relay.outbox_2 o
         where o.ctid = any (coalesce((select d.a from tids d where d.slot = 2), '{}'))
        union all
        select o.id, o.topic, o.key, o.payload, o.created_at, o.available_at, o.uuid, o.headers from outbox_relay.outbox_3 o
         where o.ctid = any (coalesce((select d.a from tids d where d.slot = 3), '{}'))
       ) o
 where exists (select 1 from moved)
union all
select null, null, null, null, null, null, null, null, null, null, null, null,
       (select (extract(epoch from min(e.available_at) - now()) * 1000000)::int8 from outbox_relay.parked e
         where e.destination = $4::text and e.available_at > now() and isfinite(e.available_at)),
       (select l.held from lock l),
       exists (select 1 from moved),
       (select count(*) from cand) > (select count(*) from taken),
       exists (select 1 from pos k where k.after_id is not null or exists (select 1 from delta))
         and not exists (select 1 from moved),
       exists (select 1 from head h where h.ahead),
       (select l.held from lock l) and not exists (select 1 from head),
       pg_current_snapshot()::text
order by 1
