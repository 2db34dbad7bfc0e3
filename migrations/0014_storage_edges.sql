-- Storage edges (issue 38): a position from another cluster, ids reused after a truncate, and
-- writers that prepare their transactions.
--
-- * Positions are transaction snapshots, and a transaction id means something only in the cluster
--   that assigned it. A dump restored into another cluster (a new server, a staging copy, logical
--   replication to a new cluster, an upgrade that does not carry the xid epoch) brings positions
--   from the old cluster's counter: where they lie ahead of the new one, every new transaction
--   looks passed, and no claim would read its events. `installation` records which cluster the
--   positions were taken in (its system identifier); a relay that finds another identifier, or a
--   position ahead of the transaction counter, starts fresh positions and treats every event not
--   yet finished as new (src/sql/rebase.rs).
-- * A parked copy or a dead letter keeps its event's id after the outbox row is gone. A
--   `truncate outbox_relay.outbox restart identity` would hand the same ids to new events; the
--   trigger below moves the sequence past every id still kept there instead.
-- * The sweeper's cursor is (xid, id): see the index at the end.
-- * The notification trigger may be turned off for one transaction (`set local
--   outbox_relay.notify = off`): PostgreSQL refuses to PREPARE a transaction that notified, so a
--   two-phase-commit writer opts out, and the relay's poll finds its events once COMMIT PREPARED
--   makes them visible.

create table outbox_relay.installation (
    only_row          boolean not null default true,
    system_identifier bigint not null,
    checked_at        timestamptz not null default now(),
    constraint installation_pkey primary key (only_row),
    constraint installation_one_row check (only_row)
);

comment on table outbox_relay.installation is
    'The cluster whose transaction ids the positions hold (pg_control_system().system_identifier); a relay that finds another starts fresh positions.';

insert into outbox_relay.installation (system_identifier) select system_identifier from pg_control_system();

create or replace function outbox_relay.notify_relay() returns trigger
language plpgsql as $$
begin
    if coalesce(current_setting('outbox_relay.notify', true), '') <> 'off'
       and exists (select 1 from outbox_relay.relays where waiting) then
        perform pg_notify('outbox_relay', '');
    end if;
    return null;
end
$$;

comment on function outbox_relay.notify_relay() is
    'Wakes a waiting relay at commit; `set local outbox_relay.notify = off` skips it (a transaction that will be PREPAREd).';

create function outbox_relay.keep_ids_unique() returns trigger
language plpgsql as $$
declare
    sequence regclass := pg_get_serial_sequence('outbox_relay.outbox', 'id')::regclass;
    kept bigint := greatest((select max(id) from outbox_relay.parked), (select max(id) from outbox_relay.dead_letters));
begin
    if kept > coalesce(pg_sequence_last_value(sequence), 0) then
        perform setval(sequence, kept);
    end if;
    return null;
end
$$;

comment on function outbox_relay.keep_ids_unique() is
    'After a truncate of the outbox (with RESTART IDENTITY too), moves its id sequence past the ids parked events and dead letters keep.';

create trigger outbox_keep_ids_unique
    after truncate on outbox_relay.outbox
    for each statement execute function outbox_relay.keep_ids_unique();

-- The sweeper goes on from where it ended in (xid, id) order, a total order: one transaction may
-- hold more rows than a sweep reads. The claims' probes (an xid, or xids from a snapshot's xmax
-- on) read the same index.
create index outbox_xid_id_idx on outbox_relay.outbox (xid, id);
drop index outbox_relay.outbox_xid_idx;

-- What the relay runs where a new event would take the place of an older event with the same id
-- (a parked copy or a dead letter kept from before the ids were reused): nothing is merged, the
-- statement fails and its transaction with it, so the new event stays in the outbox.
create function outbox_relay.refuse_reused_ids(destination text, place text, reused text[]) returns boolean
language plpgsql as $$
begin
    if cardinality(reused) > 0 then
        raise exception 'the outbox''s ids were reused: event % has the id of another event in % of destination "%"',
                        array_to_string(reused, ', '), place, destination
            using errcode = 'unique_violation',
                  detail = 'Ids are reused after a truncate with RESTART IDENTITY before migration 0014, a sequence set back by hand, or ids written by hand. Nothing was merged and nothing was lost, but this destination cannot go on past the event.',
                  hint = 'Deliver, retry or purge the older event, or publish the new one again under a fresh id; and move outbox_relay.outbox_id_seq past every id in use (setval).';
    end if;
    return true;
end
$$;

comment on function outbox_relay.refuse_reused_ids(text, text, text[]) is
    'Fails, naming the events, when a new event has the id of another event kept for the destination (reused ids).';

-- How many bytes a payload counts for in a claim's byte bound (`RelayConfig::batch_bytes`): a
-- payload stored inline counts its stored size, a larger one its text's length (read from TOAST).
-- A SQL function the planner inlines.
create function outbox_relay.payload_bytes(payload jsonb) returns int8
language sql stable parallel safe
as $$
    select case when pg_column_size(payload) < 1024 then pg_column_size(payload)::int8
                else octet_length(payload::text)::int8 end
$$;

comment on function outbox_relay.payload_bytes(jsonb) is
    'The bytes a payload counts for in a claim''s byte bound: its stored size when small, else its text''s length.';
