-- Prototype of an append-only outbox read by transaction snapshots (PgQ's idea), split into
-- lanes so that several claimers work side by side and each key stays in one lane. Not the
-- shipped schema: `run.sh` measures it against the delete-based claim under a held snapshot.
--
-- * events: only ever inserted; each row carries the inserting transaction's id (`xid`).
-- * positions: per lane, the snapshot up to which its events were claimed. Only ever
--   inserted; the newest row per lane is the position (an index probe from the end, which never
--   reaches the dead rows a pruning DELETE of old positions would leave).
-- * lanes: one row per lane, locked FOR UPDATE by the claim that reads it (a row lock writes no
--   new row version).
-- * parked: the side table of failed, delayed and held-behind events (empty here; the claim
--   probes it per keyed event, as the real one would).
--
-- A claim of lane l: the events inserted by transactions that are visible in a new snapshot S
-- and were not in the lane's position C. Those are the transactions in C's in-progress list,
-- and those from C's xmax to S's xmax: two index ranges on (lane, xid), whatever the oldest
-- transaction in the database (C's xmin) is.

drop schema if exists storage_proto cascade;
create schema storage_proto;

create table storage_proto.events (
    id         bigserial primary key,
    topic      text not null,
    key        text,
    payload    jsonb not null,
    created_at timestamptz not null default now(),
    xid        xid8 not null default pg_current_xact_id(),
    lane       int2 not null
);
create index on storage_proto.events (lane, xid);

create table storage_proto.lanes (lane int2 primary key);
insert into storage_proto.lanes select generate_series(0, 15);

create table storage_proto.positions (
    lane    int2 not null,
    n       bigint generated always as identity,
    snap    pg_snapshot not null,
    claimed int not null,
    primary key (lane, n)
);
insert into storage_proto.positions (lane, snap, claimed) select lane, pg_current_snapshot(), 0 from storage_proto.lanes;

create table storage_proto.parked (
    id  bigint primary key,
    key text,
    due timestamptz not null
);
create index on storage_proto.parked (key);

-- Claims up to `batch` events of lane `l`, if no other claim holds it; returns how many.
create function storage_proto.claim(l int2, batch int) returns int
language plpgsql as $$
declare
    c pg_snapshot;
    s pg_snapshot;
    got int;
begin
    perform 1 from storage_proto.lanes where lane = l for update skip locked;
    if not found then
        return 0;
    end if;
    select snap into c from storage_proto.positions p where p.lane = l order by p.n desc limit 1;
    s := pg_current_snapshot();
    select count(*), count(*) into got, got from (
        select e.id, e.payload
          from storage_proto.events e
         where e.lane = l
           and (e.xid = any (array(select pg_snapshot_xip(c)))
                or (e.xid >= pg_snapshot_xmax(c) and e.xid < pg_snapshot_xmax(s)))
           and pg_visible_in_snapshot(e.xid, s)
           and not (e.key is not null and exists (select 1 from storage_proto.parked p where p.key = e.key))
         order by e.id
         limit batch
    ) delta;
    if got > 0 then
        insert into storage_proto.positions (lane, snap, claimed) values (l, s, got);
    end if;
    return got;
end
$$;

-- The delete-based claim in the same shape (one call per claim), for the comparison: the
-- shipped outbox's unkeyed path, claimed FOR UPDATE SKIP LOCKED from the pending index and
-- deleted in the same transaction.
create function storage_proto.delete_claim(batch int) returns int
language plpgsql as $$
declare
    got int;
begin
    with claimed as (
        select id from outbox_relay.outbox
         where processed_at is null and available_at <= now()
         order by available_at, id
         limit batch
           for update skip locked
    ), deleted as (
        delete from outbox_relay.outbox o using claimed c where o.id = c.id returning o.payload
    )
    select count(*) into got from deleted;
    return got;
end
$$;
