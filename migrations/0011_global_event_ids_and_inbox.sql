-- Event ids that name one event everywhere, and the consumers' inbox keyed by them (issue 22).
--
-- `id` is a sequence of this database. After a restore from a backup the sequence may hand out
-- again ids that consumers already saw, and a second database numbers its own events 1, 2, 3: a
-- consumer that drops duplicates by `id` would drop new events. From here on every event also
-- carries a random UUID (version 4), drawn when it is written and kept when it goes to the dead
-- letters and back. The sinks send it as the event's id (`webhook-id`, `ce-id`, `Nats-Msg-Id`,
-- the AMQP `message-id`), and the inbox records it. `id` stays the order of this database's
-- events.
--
-- On a live installation the column is added without a default (no rewrite of the table), then
-- the default is set for the rows inserted from here on, and the rows already there get theirs.

alter table outbox_relay.outbox add column uuid uuid;
alter table outbox_relay.outbox alter column uuid set default gen_random_uuid();
update outbox_relay.outbox set uuid = gen_random_uuid() where uuid is null;
alter table outbox_relay.outbox alter column uuid set not null;

comment on column outbox_relay.outbox.uuid is
    'The event''s id for consumers, unique across databases and restores: the sinks send it, the inbox records it. Kept through the dead letters.';
comment on column outbox_relay.outbox.id is
    'The order of this database''s events (a sequence). Consumers drop duplicates by uuid, which a restore or a second database cannot repeat.';

alter table outbox_relay.dead_letters add column uuid uuid;
alter table outbox_relay.dead_letters alter column uuid set default gen_random_uuid();
update outbox_relay.dead_letters set uuid = gen_random_uuid() where uuid is null;
alter table outbox_relay.dead_letters alter column uuid set not null;

comment on column outbox_relay.dead_letters.uuid is 'The event''s uuid in the outbox; a retry puts it back with it.';

-- The inbox of 0001 recorded bigint ids, and nothing in the library wrote or read it. It is
-- replaced by one keyed by the uuid; rows someone wrote into the old one are kept, in
-- `outbox_relay.inbox_0001`.
do $$
begin
    if exists (select 1 from outbox_relay.inbox) then
        alter table outbox_relay.inbox rename constraint inbox_pkey to inbox_0001_pkey;
        alter table outbox_relay.inbox rename to inbox_0001;
    else
        drop table outbox_relay.inbox;
    end if;
end
$$;

create table outbox_relay.inbox (
    consumer    text not null,
    event_id    uuid not null,
    received_at timestamptz not null default now(),
    constraint inbox_pkey primary key (consumer, event_id),
    constraint inbox_consumer_valid check (char_length(consumer) between 1 and 255 and consumer !~ '[[:cntrl:]]')
);

comment on table outbox_relay.inbox is
    'The events each consumer has handled, recorded in the consumer''s own transaction with its writes, so that a redelivery is dropped.';
comment on column outbox_relay.inbox.event_id is 'The event''s uuid (outbox_relay.outbox.uuid), as the sinks send it.';
comment on column outbox_relay.inbox.received_at is 'When the consumer recorded it: retention deletes the oldest.';

-- Retention deletes a consumer's oldest rows.
create index inbox_received_at_idx on outbox_relay.inbox (consumer, received_at);
