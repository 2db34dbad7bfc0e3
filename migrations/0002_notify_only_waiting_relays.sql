-- NOTIFY serializes commits: a transaction that issued NOTIFY takes a global lock while it
-- commits, which costs write throughput under many concurrent writers. So writers notify only
-- when some relay is waiting for work. A relay that runs out of work first lingers, polling at a
-- short interval, and only then marks itself waiting here; under sustained load it never does,
-- and writers never notify. The race (a writer whose trigger ran just before the mark) is closed
-- by the relay: after marking, it waits for every transaction open at that moment to end and
-- claims once more.

-- Running relays; unlogged (lost in a crash, which only means the next mark re-creates it).
create unlogged table outbox_relay.relays (
    id           bigint primary key,
    listener_pid integer not null,
    waiting      boolean not null default false,
    updated_at   timestamptz not null default now()
) with (fillfactor = 50);

comment on table outbox_relay.relays is
    'Running relays and whether each waits for a notification; the outbox trigger notifies only when one does.';
comment on column outbox_relay.relays.listener_pid is
    'Backend pid of the relay''s LISTEN connection; rows whose backend is gone are removed by the janitor.';
comment on column outbox_relay.relays.waiting is 'True while the relay has no work and sleeps until a NOTIFY.';

create or replace function outbox_relay.notify_relay() returns trigger
language plpgsql as $$
begin
    if exists (select 1 from outbox_relay.relays where waiting) then
        perform pg_notify('outbox_relay', '');
    end if;
    return null;
end
$$;
