-- Recording deliveries (src/sql/outcomes.rs runs it, in the claim's transaction).
-- Deletes (`$3`) or marks processed the outbox rows `$2` that every registered destination but
-- `$1` has passed: `$1`'s claim passed them in this transaction. A row another session has
-- locked (`select ... for update` on the outbox) is skipped, never waited for: the claim holds
-- its destination's new events while it runs, and the sweeper finishes the row later. A
-- destination has passed an event when its newest position's snapshot sees the event's
-- transaction, or when it is in the position's cut delta at or below `after_id`; a position
-- ahead of the transaction counter (another cluster's, migration 0014) has passed nothing. The
-- rows are read by id, through the primary key alone (migration 0015).
with others as materialized (
    select p.since, p.snapshot, p.after_id,
           pg_snapshot_xmax(p.snapshot) > pg_snapshot_xmax(pg_current_snapshot()) as ahead
      from outbox_relay.destinations d cross join lateral (
        select q.since, q.snapshot, q.after_id from outbox_relay.positions q
         where q.destination = d.name order by q.n desc limit 1) p
     where d.name <> $1::text
),
done as materialized (
    select e.id from outbox_relay.outbox e
     where e.id = any($2::int8[]) and e.processed_at is null
       and not exists (
        select 1 from others p
         where p.ahead or not (pg_visible_in_snapshot(e.xid, case when p.after_id is null then p.snapshot else p.since end)
                    or (p.after_id is not null and e.id <= p.after_id and pg_visible_in_snapshot(e.xid, p.snapshot))))
       for update of e skip locked
),
deleted as (delete from outbox_relay.outbox where $3 and id = any (array(select id from done)) returning 1),
marked as (update outbox_relay.outbox set processed_at = now() where not $3 and id = any (array(select id from done)) returning 1)
select (select count(*) from deleted) + (select count(*) from marked)
