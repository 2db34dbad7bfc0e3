-- The claim of one destination's parked events (migrations 0008 and 0012; src/sql/events.rs runs
-- it): failed, delayed, paused, leased, behind their key. Parameters: $1 how many at most, $2 an
-- earlier dead letter holds its key, $3 where the walk over the parked keys goes on, $4 how many
-- keys it walks at most, $5 the paused topics, $6 the destination, $7 the most bytes of payload
-- a batch takes (past its first event).
--
-- Per key its lowest parked id when due (the walk over the destination's parked keys from $3, one
-- index probe per key), and those without a key in (available_at, id) order; row-locked for the
-- rest of the caller's transaction, skipping rows another claim holds. Rows found by id are read
-- by `id = any (array(…))`, one primary key probe each: a join or `in` let the planner read all
-- of the destination's parked events once per walked key (7.5 s a claim with 20,000 parked). `parked` holds waiting
-- events only: its churn is per failure, delay or lease, never per delivered event.
with recursive walk(key, id, n) as (
    (select e.key, e.id, 1 from outbox_relay.parked e
      where e.destination = $6::text and e.key is not null and e.key > $3
      order by e.destination, e.key, e.id limit 1)
  union all
    (select nx.key, nx.id, w.n + 1 from walk w, lateral (
        select e.key, e.id from outbox_relay.parked e
         where e.destination = $6::text and e.key is not null and e.key > w.key
         order by e.destination, e.key, e.id limit 1) nx
      where w.n < $4)
),
keyed as (
    select o.id from outbox_relay.parked o
     where o.destination = $6::text and o.id = any (array(select w.id from walk w))
       and o.available_at <= now() and coalesce(o.topic <> all($5::text[]), true)
       and not ($2 and exists (
            select 1 from outbox_relay.dead_letters d where d.destination = $6::text and d.key = o.key and d.id < o.id))
     order by o.available_at, o.id
     limit $1::int8
       for update of o skip locked
),
-- Behind the first heads taken (16, in id order), each key's next parked events in id order, as
-- long as each is due and not paused, while the batch has room: they are handed over one after
-- the other, after their head (the relay delivers a batch's events of one key in rounds), so that
-- a key with thousands of parked events drains a batch at a claim, not an event. (Where the heads
-- fill the batch, as with many keys, nothing more is read.) Their rows are locked without
-- skipping: another claim takes a key's later events only while it holds the key's head, which
-- this one holds. Taken in id order up to the room left, which keeps a prefix of every key's run.
room as materialized (
    select $1::int8 - (select count(*) from keyed) as n
),
followers as (
    select f.id from (select h.id from keyed h order by h.id limit 16) h
      join outbox_relay.parked hp on hp.destination = $6::text and hp.id = h.id
     cross join room r
     cross join lateral (
        select x.id from (
            select n.id, bool_and(n.available_at <= now() and coalesce(n.topic <> all($5::text[]), true))
                         over (order by n.id) as clear
              from (select o.id, o.available_at, o.topic from outbox_relay.parked o
                     where o.destination = $6::text and o.key = hp.key and o.id > hp.id
                     order by o.destination, o.key, o.id
                     limit r.n) n
        ) x where x.clear) f
     where r.n > 0
     order by f.id
     limit (select n from room)
),
followers_locked as (
    select o.id from outbox_relay.parked o
     where o.destination = $6::text and o.id = any (array(select id from followers))
       for update of o
),
unkeyed as (
    select o.id from outbox_relay.parked o
     where o.destination = $6::text and o.key is null and o.available_at <= now()
       and coalesce(o.topic <> all($5::text[]), true)
     order by o.destination, o.available_at, o.id
     limit $1::int8 - (select count(*) from keyed) - (select count(*) from followers_locked)
       for update of o skip locked
),
-- No more bytes of payload than $7 (but always the first event, in id order), added one event
-- at a time as in the claim of new events: the rest stay locked until this transaction ends,
-- untouched, and the marker says the claim was cut.
locked as (select id from keyed union all select id from followers_locked union all select id from unkeyed),
ids as materialized (
    select coalesce(array_agg(l.id order by l.id), '{}') as a from locked l
),
sized(n, id, upto) as (
    select 1, i.a[1], (select outbox_relay.payload_bytes(e.payload) from outbox_relay.parked e where e.destination = $6::text and e.id = i.a[1])
      from ids i where cardinality(i.a) > 0
    union all
    select s.n + 1, i.a[s.n + 1],
           s.upto + (select outbox_relay.payload_bytes(e.payload) from outbox_relay.parked e where e.destination = $6::text and e.id = i.a[s.n + 1])
      from sized s, ids i
     where s.n < cardinality(i.a) and s.upto <= $7::int8
),
taken as (select s.id from sized s where s.n = 1 or s.upto <= $7::int8)
-- The events, in id order, each with whether a claim that did not commit delivered it already
-- (`early_deliveries`, as in the claim of new events), then one marker row (id null): where the walk ended when it walked as
-- far as it may (the next one goes on from there), and whether the bytes cut the claim short.
select o.id, o.topic, o.key, o.payload, o.created_at, least(o.attempts, 2147483646) + 1 as attempt,
       case when o.created_at >= '1970-01-01 00:00:00+00' and o.created_at < '10000-01-01 00:00:00+00'
            then (extract(epoch from clock_timestamp() - o.created_at) * 1000000)::int8 end as age_us,
       o.uuid, o.headers,
       case when (select exists (select 1 from outbox_relay.early_deliveries x where x.destination = $6::text))
            then coalesce(o.id in (select unnest(x.ids) from outbox_relay.early_deliveries x where x.destination = $6::text), false)
            else false end as done,
       null::text as walked_to, null::boolean as cut
  from outbox_relay.parked o where o.destination = $6::text and o.id = any (array(select id from taken))
union all
select null, null, null, null, null, null, null, null, null, null,
       (select case when count(*) >= $4 then max(w.key) end from walk w),
       (select count(*) from locked) > (select count(*) from taken)
order by 1
