-- The sweeper's statement (src/sql/destinations.rs runs it, and says what it does and returns):
-- finishes the outbox rows every destination has passed, from the cursor ($1 xid, $4 id) on, at
-- most $2 rows, deleting them ($3) or marking them processed, and the unfinished rows of the
-- transactions the cursor passed while they ran ($5).
with newest as materialized (
    select p.since, p.snapshot, p.after_id
      from outbox_relay.destinations d cross join lateral (
        select q.since, q.snapshot, q.after_id from outbox_relay.positions q
         where q.destination = d.name order by q.n desc limit 1) p
),
trusted as materialized (
    select not exists (select 1 from newest n where pg_snapshot_xmax(n.snapshot) > pg_snapshot_xmax(pg_current_snapshot()))
           and (select i.system_identifier from outbox_relay.installation i)
               is not distinct from (select c.system_identifier from pg_control_system() c) as ok
),
horizon as materialized (
    select (select pg_snapshot_xmax(n.snapshot) from newest n order by 1 limit 1) as top
),
-- From the cursor on, and the unfinished rows of the transactions it passed while they ran
-- (`$5`: one index probe each, nothing read for one that wrote no row).
read as materialized (
    (select e.id, e.xid, e.processed_at, false as owed
       from outbox_relay.outbox e, horizon h
      where (e.xid, e.id) >= ($1::text::xid8, $4::int8) and e.xid < h.top and e.xid <> '0'::xid8
      order by e.xid, e.id limit $2)
  union all
    (select e.id, e.xid, e.processed_at, true
       from outbox_relay.outbox e
      where e.xid = any ($5::text[]::xid8[]) and e.xid < $1::text::xid8 and e.xid <> '0'::xid8 and e.processed_at is null
      order by e.xid, e.id limit $2)
),
seen as materialized (
    select e.id, e.xid, e.processed_at, e.owed,
           (select t.ok from trusted t) and not exists (
            select 1 from newest p
             where not (pg_visible_in_snapshot(e.xid, case when p.after_id is null then p.snapshot else p.since end)
                        or (p.after_id is not null and e.id <= p.after_id
                            and pg_visible_in_snapshot(e.xid, p.snapshot)))) as passed
      from read e
),
ahead as materialized (select s.* from seen s where not s.owed),
gone as materialized (
    select e.id, e.uuid, e.topic, e.key, e.payload, e.headers, e.created_at, e.attempts
      from outbox_relay.outbox e
     where e.id = any (array(select s.id from seen s where s.passed and s.processed_at is null))
       for update of e skip locked
),
unrouted as materialized (
    insert into outbox_relay.dead_letters (destination, id, uuid, topic, key, payload, headers, created_at, attempts, last_error)
    select '', g.id, g.uuid, g.topic, g.key, g.payload, g.headers, g.created_at, g.attempts,
           'no destination''s pattern matches its topic (the destinations: '
           || (select string_agg(d.name || ' ' || d.pattern, ', ' order by d.name) from outbox_relay.destinations d)
           || ')'
      from gone g
     where not exists (select 1 from outbox_relay.destinations d where d.topic_regex is null or ('.' || g.topic) ~ d.topic_regex)
    on conflict (destination, id) do update set failed_at = now(), last_error = excluded.last_error
     where dead_letters.uuid = excluded.uuid
    returning id
),
deleted as (
    delete from outbox_relay.outbox
     where id = any (array(select id from gone)) and ($3 or id in (select id from unrouted))
    returning 1
),
marked as (
    update outbox_relay.outbox set processed_at = now()
     where not $3 and id = any (array(select id from gone)) and id not in (select id from unrouted)
    returning 1
)
select (select count(*) from gone) as finished, (select count(*) from unrouted) as unrouted,
       not (select t.ok from trusted t) as foreign_positions,
       (select count(*) from seen s where s.passed and s.processed_at is null) - (select count(*) from gone) as locked,
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
          where s.processed_at is null and not (s.passed and s.id in (select g.id from gone g))
          order by s.xid, s.id limit 1)
        union all
        (select s.xid, s.id + 1 from ahead s where (select count(*) from ahead) >= $2 order by s.xid desc, s.id desc limit 1)
        union all
        select h.top, 0 from horizon h where (select count(*) from ahead) < $2
    ) x where (select h.top from horizon h) is not null
     order by x.xid, x.id limit 1) c on true
