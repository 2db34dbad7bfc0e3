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

create index on storage_proto.events (lane, id);

-- A position: the lane's events of transactions visible in `snap` and not in `since` are
-- claimed, those with ids up to `after_id` when it is set (a delta larger than a batch).
create table storage_proto.positions (
    lane     int2 not null,
    n        bigint generated always as identity,
    since    pg_snapshot not null,
    snap     pg_snapshot not null,
    after_id bigint,
    claimed  int not null,
    primary key (lane, n)
);
insert into storage_proto.positions (lane, since, snap, claimed)
select lane, pg_current_snapshot(), pg_current_snapshot(), 0 from storage_proto.lanes;

create table storage_proto.parked (
    id  bigint primary key,
    key text,
    due timestamptz not null
);
create index on storage_proto.parked (key);

-- Claims up to `batch` events of lane `l`, if no other claim holds it; returns how many.
-- A new delta (the last one finished) is read through (lane, xid); a delta larger than a batch
-- goes on in id order from `after_id` through (lane, id).
create function storage_proto.claim(l int2, batch int) returns int
language plpgsql as $$
declare
    p storage_proto.positions;
    c pg_snapshot;
    s pg_snapshot;
    got int;
    last bigint;
begin
    perform 1 from storage_proto.lanes where lane = l for update skip locked;
    if not found then
        return 0;
    end if;
    select * into p from storage_proto.positions where lane = l order by n desc limit 1;
    if p.after_id is null then
        c := p.snap;
        s := pg_current_snapshot();
        select count(*), max(id) into got, last from (
            select e.id, e.payload
              from storage_proto.events e
             where e.lane = l
               and (e.xid = any (array(select pg_snapshot_xip(c)))
                    or (e.xid >= pg_snapshot_xmax(c) and e.xid < pg_snapshot_xmax(s)))
               and pg_visible_in_snapshot(e.xid, s)
               and not (e.key is not null and exists (select 1 from storage_proto.parked k where k.key = e.key))
             order by e.id
             limit batch
        ) delta;
    else
        c := p.since;
        s := p.snap;
        select count(*), max(id) into got, last from (
            select e.id, e.payload
              from storage_proto.events e
             where e.lane = l and e.id > p.after_id
               and pg_visible_in_snapshot(e.xid, s) and not pg_visible_in_snapshot(e.xid, c)
               and not (e.key is not null and exists (select 1 from storage_proto.parked k where k.key = e.key))
             order by e.id
             limit batch
        ) delta;
    end if;
    if got > 0 or p.after_id is not null then
        -- A full batch may have more behind it; a short one ends the delta.
        insert into storage_proto.positions (lane, since, snap, after_id, claimed)
        values (l, c, s, case when got = batch then last end, got);
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
         where available_at <= now()
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
