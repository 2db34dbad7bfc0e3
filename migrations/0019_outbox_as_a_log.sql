-- The outbox as a log (issue 42). Until now every delivered event was deleted (or marked
-- processed) in the claim's transaction once every destination had passed it: a write per event
-- after its commit, the relay's largest cost on a drain, and the end of it (no replay). Now:
--
-- * Delivery writes nothing to an outbox row. A destination's position is its record of what it
--   has passed; what waits for it (a retry, a delay, a pause, a key held back, a lease) is a copy
--   in `parked` as before, and what failed for good a dead letter.
-- * Events every destination has passed are kept for the relays' `retention` (an hour unless
--   set), then removed in bulk by the sweeper, oldest first, in statements of `janitor_batch`
--   rows. An event no destination's pattern matches goes to the dead letters of the destination
--   '' then (it used to go as soon as every destination had passed it).
-- * `processed_at` and `attempts` go: neither meant what it said (an event was "processed" while
--   it waited in `parked` for a retry or lay in the dead letters, and its attempts are counted
--   in `parked` and the dead letters). `outbox_relay.event_state` says, for each retained event
--   and each destination whose pattern matches it, whether it was delivered, when, after how
--   many attempts, or what it waits for; `outbox_relay.passed_by_all(xid, id)` whether every
--   destination has passed it.
-- * `outbox_relay.replay(destination, since, until, topic_regex)` sends retained events of a
--   range to one destination again (copies into its parked events, claimed in order per key,
--   with their uuids), and a destination may be registered with the past replayed to it.
--
-- Rows the 0013 to 0018 relays marked processed stay, as retained events every destination has
-- passed; pending, parked, leased and dead-lettered events keep their state (they are copies in
-- `parked` and `dead_letters`, which this migration does not touch).

alter table outbox_relay.outbox drop column processed_at;
alter table outbox_relay.outbox drop column attempts;

comment on table outbox_relay.outbox is
    'The events, in commit order per destination. A row is never written again after its insert: '
    'each destination''s position (outbox_relay.positions) says what it has passed, and what waits '
    'for it is a copy in outbox_relay.parked. Rows every destination has passed are kept for the '
    'relays'' retention, then removed in bulk; outbox_relay.event_state says what became of each.';

-- Where a destination started: the snapshot of the position it was registered at. Events that
-- snapshot sees were passed before the destination existed: not its own (unless replayed to it).
-- Null for the destinations registered before this migration.
alter table outbox_relay.destinations add column started pg_snapshot;
comment on column outbox_relay.destinations.started is
    'The snapshot of the position the destination was registered at: the events it sees were '
    'never the destination''s own, unless replayed to it (null: registered before migration 0019).';

-- Deliveries of events that waited in `parked` (a retry, a delay, a pause, a key held back, a
-- lease, a replay): a parked event's row is deleted once delivered, and this keeps how many
-- attempts it took and when, for the retention. (An event delivered straight from the outbox
-- took one attempt, and was delivered by the time its destination's position passed it.)
create table outbox_relay.parked_deliveries (
    destination  text not null,
    id           bigint not null,
    uuid         uuid not null,
    attempts     integer not null,
    delivered_at timestamptz not null default clock_timestamp(),
    primary key (destination, id)
);
create index parked_deliveries_at_idx on outbox_relay.parked_deliveries (delivered_at);
comment on table outbox_relay.parked_deliveries is
    'Events delivered after they waited in outbox_relay.parked: their attempts and when; kept for '
    'the relays'' retention.';

-- Whether a position passed the event (`xid`, `id`): its snapshot sees the event's transaction,
-- or the event lies in its cut delta at or below `after_id`.
create function outbox_relay.passed(xid xid8, id bigint, since pg_snapshot, snapshot pg_snapshot, after_id bigint)
returns boolean language sql immutable parallel safe as $$
    select pg_visible_in_snapshot($1, case when $5 is null then $4 else $3 end)
           or ($5 is not null and $2 <= $5 and pg_visible_in_snapshot($1, $4))
$$;

-- Whether every registered destination's newest position has passed the event; while none is
-- registered, whether the origin's has (the position the first destination starts from: the
-- last destination's once it is dropped, migration 0012). False while a position is another
-- cluster's (migration 0014).
create function outbox_relay.passed_by_all(xid xid8, id bigint)
returns boolean language sql stable parallel safe as $$
    select exists (select 1 from outbox_relay.positions q where q.destination in (select name from outbox_relay.destinations)
                   union all
                   select 1 from outbox_relay.positions q
                    where q.destination = '' and not exists (select 1 from outbox_relay.destinations))
       and not exists (
        select 1 from (select name from outbox_relay.destinations
                       union all
                       select '' where not exists (select 1 from outbox_relay.destinations)) d
         cross join lateral (
            select q.since, q.snapshot, q.after_id from outbox_relay.positions q
             where q.destination = d.name order by q.n desc limit 1) p
         where pg_snapshot_xmax(p.snapshot) > pg_snapshot_xmax(pg_current_snapshot())
            or not outbox_relay.passed($1, $2, p.since, p.snapshot, p.after_id))
$$;

-- What became of each retained event at each destination whose pattern matches its topic:
--   pending      its destination's position has not passed it yet
--   delivered    delivered (`attempts`, and `delivered_at`: when the delivery was recorded; for
--                an event delivered straight from the outbox, the moment of the first kept
--                position past it, exact for ten minutes and within ten seconds after)
--   waiting      a copy waits in `parked`, due now (behind its key, paused, or being claimed)
--   delayed      a copy waits in `parked` for its `available_at`
--   retrying     a copy waits in `parked` for its next attempt after a failure
--   in flight    a copy is leased to a relay delivering it
--   dead         in the destination's dead letters (`failed_at`)
-- and, with a null destination, `unrouted`: no destination's pattern matches its topic (it goes
-- to the dead letters of '' when its retention ends). An event a destination's starting position
-- had passed (it was registered later) is not listed for it, unless it was replayed to it.
-- Read it for one event or key (`where id = ...`): each row looks up positions and copies.
create view outbox_relay.event_state as
select e.id, e.uuid, e.topic, e.key, e.created_at, d.name as destination,
       case when p.id is not null then
                 case when p.lease_token is not null and p.available_at > now() then 'in flight'
                      when p.available_at > now() and p.last_error is not null then 'retrying'
                      when p.available_at > now() then 'delayed'
                      else 'waiting' end
            when l.id is not null and (r.id is null or r.delivered_at < l.failed_at) then 'dead'
            when r.id is not null or s.passed then 'delivered'
            else 'pending' end as state,
       case when p.id is not null then p.attempts
            when l.id is not null and (r.id is null or r.delivered_at < l.failed_at) then l.attempts
            when r.id is not null then r.attempts
            when s.passed then 1
            else 0 end as attempts,
       case when p.id is not null then p.last_error
            when l.id is not null and (r.id is null or r.delivered_at < l.failed_at) then l.last_error end as last_error,
       case when p.id is not null or (l.id is not null and (r.id is null or r.delivered_at < l.failed_at)) then null
            when r.id is not null then r.delivered_at
            when s.passed then (
                select q.at from outbox_relay.positions q
                 where q.destination = d.name and outbox_relay.passed(e.xid, e.id, q.since, q.snapshot, q.after_id)
                 order by q.destination, q.n limit 1) end as delivered_at,
       case when p.id is not null then p.available_at end as due_at,
       case when p.id is null and l.id is not null and (r.id is null or r.delivered_at < l.failed_at)
            then l.failed_at end as failed_at
  from outbox_relay.outbox e
  join outbox_relay.destinations d on d.topic_regex is null or ('.' || e.topic) ~ d.topic_regex
 cross join lateral (
        select q.since, q.snapshot, q.after_id from outbox_relay.positions q
         where q.destination = d.name order by q.n desc limit 1) q
 cross join lateral (
        select pg_snapshot_xmax(q.snapshot) <= pg_snapshot_xmax(pg_current_snapshot())
               and outbox_relay.passed(e.xid, e.id, q.since, q.snapshot, q.after_id) as passed) s
  left join outbox_relay.parked p on p.destination = d.name and p.id = e.id and p.uuid = e.uuid
  left join outbox_relay.dead_letters l on l.destination = d.name and l.id = e.id and l.uuid = e.uuid
  left join outbox_relay.parked_deliveries r on r.destination = d.name and r.id = e.id and r.uuid = e.uuid
 where d.started is null or not pg_visible_in_snapshot(e.xid, d.started)
       or p.id is not null or l.id is not null or r.id is not null
union all
select e.id, e.uuid, e.topic, e.key, e.created_at, null, 'unrouted', 0, null, null, null, null
  from outbox_relay.outbox e
 where not exists (select 1 from outbox_relay.destinations d
                    where d.topic_regex is null or ('.' || e.topic) ~ d.topic_regex);
comment on view outbox_relay.event_state is
    'What became of each retained event at each destination whose pattern matches it: pending, '
    'delivered (attempts, delivered_at), waiting, delayed, retrying (due_at), in flight or dead '
    '(failed_at); '
    'unrouted (destination null) when no pattern matches. Read it for one event or key.';

-- Sends the retained events of `destination` created in [since, until) (and, with `topic_regex`,
-- whose '.' || topic it matches: the relay's form of a topic pattern) again: each is copied into
-- the destination's parked events, with its uuid and payload, due now, and claimed from there in
-- order per key (a new event of a replayed key waits behind the replayed ones). Only events the
-- destination's position has passed are copied (the others are still to come), and none that
-- waits for it in `parked` already. Returns how many were copied, and wakes the relays.
create function outbox_relay.replay(destination text, since timestamptz,
                                    until timestamptz default 'infinity', topic_regex text default null)
returns bigint language plpgsql as $$
#variable_conflict use_column
declare
    d outbox_relay.destinations;
    copied bigint;
begin
    if since is null or until is null then
        raise exception 'outbox_relay.replay: since and until must be times (until may be ''infinity'')'
            using errcode = '22004';
    end if;
    if since >= until then
        raise exception 'outbox_relay.replay: since (%) must be before until (%)', since, until
            using errcode = '22023';
    end if;
    select * into d from outbox_relay.destinations x where x.name = replay.destination;
    if not found then
        raise exception 'outbox_relay.replay: no destination % is registered', quote_literal(replay.destination)
            using errcode = '42704',
                  hint = 'outbox-relay destinations list shows them; outbox-relay destinations add registers one';
    end if;
    if topic_regex is not null then
        perform '' ~ topic_regex;
    end if;
    -- The destination's new events are claimed by one transaction at a time under this lock:
    -- taking it waits for a claim in delivery (held) to commit, so that none of its events is
    -- still in delivery while its key's replayed ones are claimed, and no claim moves the
    -- position meanwhile.
    perform pg_advisory_xact_lock(1869901932, d.lock_id);
    with q as (
        select p.since, p.snapshot, p.after_id from outbox_relay.positions p
         where p.destination = d.name order by p.n desc limit 1
    ),
    copied as (
        insert into outbox_relay.parked (destination, id, uuid, topic, key, payload, headers, created_at, available_at, attempts)
        select d.name, e.id, e.uuid, e.topic, e.key, e.payload, e.headers, e.created_at, now(), 0
          from outbox_relay.outbox e, q
         where e.created_at >= replay.since and e.created_at < replay.until
           and (d.topic_regex is null or ('.' || e.topic) ~ d.topic_regex)
           and (replay.topic_regex is null or ('.' || e.topic) ~ replay.topic_regex)
           and pg_snapshot_xmax(q.snapshot) <= pg_snapshot_xmax(pg_current_snapshot())
           and outbox_relay.passed(e.xid, e.id, q.since, q.snapshot, q.after_id)
         order by e.id
        on conflict (destination, id) do nothing
        returning 1
    )
    select count(*) into copied from copied;
    if copied > 0 then
        perform pg_notify('outbox_relay', 'parked');
    end if;
    return copied;
end
$$;
comment on function outbox_relay.replay(text, timestamptz, timestamptz, text) is
    'Sends the retained events of a destination created in [since, until) again, in order per key, '
    'with their uuids (copies into its parked events); returns how many.';

-- The sweeper reads the newest position taken before the retention's start (src/sql/sweep.sql),
-- and the janitor keeps positions for the retention, thinned (src/sql/events.rs).
create index positions_at_idx on outbox_relay.positions (at);
