-- The claim of one destination's parked events (migrations 0008 and 0012; src/sql/events.rs runs
-- it): failed, delayed, paused, leased, behind their key. Parameters: $1 how many at most, $2 an
-- earlier dead letter holds its key, $3 where the walk over the parked keys goes on, $4 how many
-- keys it walks at most, $5 the paused topics, $6 the destination.
--
-- Per key its lowest parked id when due (the walk over the destination's parked keys from $3, one
-- index probe per key), and those without a key in (available_at, id) order; row-locked for the
-- rest of the caller's transaction, skipping rows another claim holds. `parked` holds waiting
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
    select o.id from outbox_relay.parked o join walk w on o.destination = $6::text and o.id = w.id
     where o.available_at <= now() and coalesce(o.topic <> all($5::text[]), true)
       and not ($2 and exists (
            select 1 from outbox_relay.dead_letters d where d.destination = $6::text and d.key = o.key and d.id < o.id))
     order by o.available_at, o.id
     limit $1::int8
       for update of o skip locked
),
unkeyed as (
    select o.id from outbox_relay.parked o
     where o.destination = $6::text and o.key is null and o.available_at <= now()
       and coalesce(o.topic <> all($5::text[]), true)
     order by o.destination, o.available_at, o.id
     limit $1::int8 - (select count(*) from keyed)
       for update of o skip locked
),
taken as (select id from keyed union all select id from unkeyed)
-- The events, in id order, then one marker row (id null): where the walk ended when it walked as
-- far as it may (the next one goes on from there).
select o.id, o.topic, o.key, o.payload, o.created_at, least(o.attempts, 2147483646) + 1 as attempt,
       case when o.created_at >= '1970-01-01 00:00:00+00' and o.created_at < '10000-01-01 00:00:00+00'
            then (extract(epoch from clock_timestamp() - o.created_at) * 1000000)::int8 end as age_us,
       o.uuid, o.headers, null::text as walked_to
  from outbox_relay.parked o where o.destination = $6::text and o.id in (select id from taken)
union all
select null, null, null, null, null, null, null, null, null,
       (select case when count(*) >= $4 then max(w.key) end from walk w)
order by 1
