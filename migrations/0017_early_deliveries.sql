-- Deliveries recorded as they end (issue 40, item 9). A held claim's outcomes commit with its
-- transaction, at the end of its delivery; until then a relay killed with SIGKILL leaves every
-- event of the claim to be claimed and sent again, also those the receiver had accepted. While a
-- held claim is in delivery, the relay writes the ids of the events delivered since its last
-- write here, one row every `record_every` (20 ms) from another connection, committed at once.
-- The claim's own commit (or its turn into a lease) deletes its rows with its outcomes; after a
-- crash the next claim of the destination finds the ids, records those events as delivered in
-- its own transaction without sending them again, and takes them out. So a kill sends again
-- only what was in flight, not the claim. One row per write, not per event: the writes a claim
-- adds do not grow with its events.
--
-- A row says only "these events were delivered to this destination by a claim that had not
-- committed": it is not a delivery log, and it is gone once the events are recorded.

create table outbox_relay.early_deliveries (
    destination text not null,
    token       bigint not null,
    recorded_at timestamptz not null default clock_timestamp(),
    ids         bigint[] not null,
    constraint early_deliveries_pkey primary key (destination, token, recorded_at)
);

comment on table outbox_relay.early_deliveries is
    'Events delivered by a claim still in delivery (its transaction open), recorded from another connection; the claim''s commit, or after a crash the next claim, records them as delivered and deletes the rows.';
comment on column outbox_relay.early_deliveries.token is
    'The claim''s token: its commit deletes its rows.';

-- The relay's role needs to write them wherever it may write the parked events.
do $$
declare
    grantee text;
begin
    for grantee in
        select distinct a.grantee::regrole::text
          from pg_class c cross join lateral aclexplode(c.relacl) a
         where c.oid = 'outbox_relay.parked'::regclass
           and a.privilege_type = 'INSERT' and a.grantee <> 0 and a.grantee <> c.relowner
    loop
        execute format('grant select, insert, update, delete on outbox_relay.early_deliveries to %s', grantee);
    end loop;
end
$$;
