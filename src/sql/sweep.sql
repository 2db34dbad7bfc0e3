-- The sweeper's statement (src/sql/destinations.rs runs it, and says what it does and returns):
-- removes the outbox rows every destination has passed that were committed more than $3
-- microseconds ago (their retention is over: the newest position taken before then sees them),
-- from the cursor ($1 xid, $4 id) on, at most $2 rows, and the rows of the transactions the
-- cursor passed while they ran ($5); a row no destination's pattern matches goes to the dead
-- letters of the destination '' as it goes.
with newest as materialized (
    select p.since, p.snapshot, p.after_id
      from (select name from outbox_relay.destinations
            union all select '' where not exists (select 1 from outbox_relay.destinations)) d cross join lateral (
        select q.since, q.snapshot, q.after_id from outbox_relay.positions q
         where q.destination = d.name order by q.n desc limit 1) p
),
trusted as materialized (
    select not exists (select 1 from newest n where pg_snapshot_xmax(n.snapshot) > pg_snapshot_xmax(pg_current_snapshot()))
           and (select i.system_identifier from outbox_relay.installation i)
               is not distinct from (select c.system_identifier from pg_control_system() c) as ok
),
-- An event's retention is over once the newest position taken before the retention's start
-- (of any destination; positions are kept for the retention, src/sql/events.rs) sees its
-- transaction: it committed before then. So a sweep reads no further than every destination has
-- passed and than that position's xmax: no row the retention keeps but those of transactions
-- still running then, whatever transaction stays open meanwhile (an xmin would stop there).
old as materialized (
    select q.snapshot from outbox_relay.positions q
     where q.at < (now() - $3::int8 * interval '1 microsecond') order by q.at desc limit 1
),
horizon as materialized (
    select case when (select o.snapshot from old o) is not null
                then least((select pg_snapshot_xmax(n.snapshot) from newest n order by 1 limit 1),
                           (select pg_snapshot_xmax(o.snapshot) from old o))
           end as top
     where exists (select 1 from newest)
),
-- From the cursor on, and the unfinished rows of the transactions it passed while they ran
-- (`$5`: one index probe each, nothing read for one that wrote no row). The horizon is a scalar
-- subquery, so that it bounds the index scan (without a horizon, nothing is read): joined, it
-- was a filter on a scan from the cursor to the outbox's end, and every sweep read every row the
-- retention keeps (117 ms a sweep, every second, with 150,000 of them).
read as materialized (
    (select e.id, e.xid, e.created_at, false as owed
       from outbox_relay.outbox e
      where (e.xid, e.id) >= ($1::text::xid8, $4::int8) and e.xid < (select h.top from horizon h) and e.xid <> '0'::xid8
      order by e.xid, e.id limit $2)
  union all
    (select e.id, e.xid, e.created_at, true
       from outbox_relay.outbox e
      where e.xid = any ($5::text[]::xid8[]) and e.xid < $1::text::xid8 and e.xid <> '0'::xid8
      order by e.xid, e.id limit $2)
),
seen as materialized (
    select e.id, e.xid, coalesce(pg_visible_in_snapshot(e.xid, (select o.snapshot from old o)), false) as old, e.owed,
           (select t.ok from trusted t) and not exists (
            select 1 from newest p
             where not (pg_visible_in_snapshot(e.xid, case when p.after_id is null then p.snapshot else p.since end)
                        or (p.after_id is not null and e.id <= p.after_id
                            and pg_visible_in_snapshot(e.xid, p.snapshot)))) as passed
      from read e
),
ahead as materialized (select s.* from seen s where not s.owed),
gone as materialized (
    select e.id, e.xid, e.uuid, e.topic, e.key, e.payload, e.headers, e.created_at
      from outbox_relay.outbox e
     where e.id = any (array(select s.id from seen s where s.passed and s.old))
       for update of e skip locked
),
unrouted as materialized (
    insert into outbox_relay.dead_letters (destination, id, uuid, topic, key, payload, headers, created_at, attempts, last_error)
    select '', g.id, g.uuid, g.topic, g.key, g.payload, g.headers, g.created_at, 0,
           'no destination''s pattern matches its topic (the destinations: '
           || (select string_agg(d.name || ' ' || d.pattern, ', ' order by d.name) from outbox_relay.destinations d)
           || ')'
      from gone g
     where exists (select 1 from outbox_relay.destinations)
       and not exists (select 1 from outbox_relay.destinations d
                        where (d.topic_regex is null or ('.' || g.topic) ~ d.topic_regex)
                          and (d.started is null or not pg_visible_in_snapshot(g.xid, d.started)))
    on conflict (destination, id) do update set failed_at = now(), last_error = excluded.last_error
     where dead_letters.uuid = excluded.uuid
    returning id
),
deleted as (
    delete from outbox_relay.outbox where id = any (array(select id from gone))
    returning 1
)
select (select count(*) from gone) as finished, (select count(*) from unrouted) as unrouted,
       not (select t.ok from trusted t) as foreign_positions,
       (select count(*) from seen s where s.passed and s.old) - (select count(*) from gone) as locked,
       (select count(*) from ahead) as read, c.xid::text as next_xid, c.id as next_id,
       array(
           select x.xid::text from (
               select r.xid from seen r where r.owed
               union
               select t.xid from pg_snapshot_xip(pg_current_snapshot()) t(xid)
                where t.xid >= $1::text::xid8 or t.xid = any ($5::text[]::xid8[])
           ) x where x.xid < c.xid order by 1) as owed
  from (select null) n left join (
    select x.xid, x.id from (
        (select s.xid, s.id from ahead s
          where not (s.passed and s.id in (select g.id from gone g))
          order by s.xid, s.id limit 1)
        union all
        (select s.xid, s.id + 1 from ahead s where (select count(*) from ahead) >= $2 order by s.xid desc, s.id desc limit 1)
        union all
        select h.top, 0 from horizon h where (select count(*) from ahead) < $2
    ) x where (select h.top from horizon h) is not null
     order by x.xid, x.id limit 1) c on true
