-- The library's tables. Everything lives in the `outbox_relay` schema so that it never collides
-- with a user's own `audit`, `orders` or `outbox`.

create schema if not exists outbox_relay;

-- Events waiting for (or done with) delivery.
create table outbox_relay.outbox (
    id           bigserial primary key,
    topic        text not null,
    key          text,
    payload      jsonb not null,
    created_at   timestamptz not null default now(),
    available_at timestamptz not null default now(),
    processed_at timestamptz,
    attempts     integer not null default 0,
    last_error   text,
    lease_token  bigint,
    constraint outbox_topic_valid check (topic ~ '^[A-Za-z0-9._:/-]{1,255}$'),
    constraint outbox_key_valid check (key is null or (char_length(key) between 1 and 255 and key !~ '[[:cntrl:]]')),
    constraint outbox_attempts_nonnegative check (attempts >= 0)
);

comment on table outbox_relay.outbox is
    'Events written in the same transaction as the business change they describe; the relay delivers them at least once.';
comment on column outbox_relay.outbox.id is
    'Stable event id: consumers use it to drop duplicates. Kept when an event goes to the dead letters and back.';
comment on column outbox_relay.outbox.topic is 'What happened, e.g. order.placed: letters, digits and . _ - : / (1 to 255).';
comment on column outbox_relay.outbox.key is 'Optional partition key for consumers (e.g. the order id).';
comment on column outbox_relay.outbox.payload is 'The event body (at most 1 MiB of JSON text).';
comment on column outbox_relay.outbox.available_at is
    'Not delivered before this time: delayed events, retry backoff, and the lease of a claimed event.';
comment on column outbox_relay.outbox.processed_at is 'When delivery succeeded; null while pending.';
comment on column outbox_relay.outbox.attempts is 'How many times a relay claimed the event for delivery.';
comment on column outbox_relay.outbox.last_error is 'The error of the last failed delivery.';
comment on column outbox_relay.outbox.lease_token is
    'Set by the claim that currently owns the event; an outcome is recorded only by the claim holding this token.';

-- Pending rows only, in claim order: the claim reads a prefix of this index.
create index outbox_pending_idx on outbox_relay.outbox (available_at, id) where processed_at is null;

-- Events that failed permanently or ran out of attempts.
create table outbox_relay.dead_letters (
    id         bigint primary key,
    topic      text not null,
    key        text,
    payload    jsonb not null,
    created_at timestamptz not null,
    attempts   integer not null,
    last_error text not null,
    failed_at  timestamptz not null default now()
);

comment on table outbox_relay.dead_letters is
    'Events that failed permanently or after the maximum attempts; an operator can list, retry or purge them.';
comment on column outbox_relay.dead_letters.id is 'The event id it had in the outbox; a retry puts it back under the same id.';

-- Audit entries, written in the same transaction as the change they describe.
create table outbox_relay.audit (
    id              bigserial primary key,
    entity          text not null,
    entity_id       text not null,
    action          text not null,
    data            jsonb not null,
    idempotency_key text,
    at              timestamptz not null default now(),
    constraint audit_entity_nonempty check (entity <> '' and action <> '')
);

comment on table outbox_relay.audit is 'Who changed what: one row per business change, committed with it.';
comment on column outbox_relay.audit.idempotency_key is 'The key of the request that made the change, when there was one.';

create index audit_entity_idx on outbox_relay.audit (entity, entity_id);

-- Idempotency receipts: the key decides races; the fingerprint refuses a key reused for another request.
create table outbox_relay.idempotency (
    key         text primary key,
    fingerprint bytea not null,
    response    jsonb,
    created_at  timestamptz not null default now(),
    constraint idempotency_key_valid check (char_length(key) between 1 and 255 and key !~ '[[:cntrl:]]')
);

comment on table outbox_relay.idempotency is 'One receipt per idempotency key, committed with the work it answers for.';
comment on column outbox_relay.idempotency.fingerprint is 'SHA-256 of the request; the same key with another request is refused.';
comment on column outbox_relay.idempotency.response is 'The response given the first time, returned again to every replay.';

create index idempotency_created_at_idx on outbox_relay.idempotency (created_at);

-- Consumers' record of events already handled (at-least-once delivery makes duplicates possible).
create table outbox_relay.inbox (
    consumer     text not null,
    event_id     bigint not null,
    processed_at timestamptz not null default now(),
    constraint inbox_pkey primary key (consumer, event_id)
);

comment on table outbox_relay.inbox is
    'Event ids a consumer has handled, written in the consumer''s own transaction so that a redelivery is dropped.';

-- Wake the relay when events are inserted. One notification per statement, and no event data in it:
-- the notification is only a hint, the table is the truth.
create function outbox_relay.notify_relay() returns trigger
language plpgsql as $$
begin
    perform pg_notify('outbox_relay', '');
    return null;
end
$$;

create trigger outbox_notify_relay
    after insert on outbox_relay.outbox
    for each statement execute function outbox_relay.notify_relay();

-- Add one event from any language inside the caller's own transaction:
--   select outbox_relay.publish('order.placed', '{"order_id": 42}', '42');
-- Validates like the Rust API and raises invalid_parameter_value (22023) with a message naming the problem.
create function outbox_relay.publish(topic text, payload jsonb, key text default null) returns bigint
language plpgsql as $$
declare
    event_id bigint;
begin
    if topic is null or topic = '' then
        raise exception using errcode = '22023',
            message = 'outbox_relay.publish: topic must not be empty';
    end if;
    if char_length(topic) > 255 then
        raise exception using errcode = '22023',
            message = format('outbox_relay.publish: topic is %s characters long; the limit is 255', char_length(topic));
    end if;
    if topic !~ '^[A-Za-z0-9._:/-]+$' then
        raise exception using errcode = '22023',
            message = format('outbox_relay.publish: topic %L has a character outside letters, digits and . _ - : /', topic);
    end if;
    if payload is null then
        raise exception using errcode = '22023',
            message = 'outbox_relay.publish: payload must not be null (use ''null''::jsonb for a JSON null)';
    end if;
    if octet_length(payload::text) > 1048576 then
        raise exception using errcode = '22023',
            message = format('outbox_relay.publish: payload is %s bytes of JSON; the limit is 1048576', octet_length(payload::text));
    end if;
    if key is not null and (key = '' or char_length(key) > 255 or key ~ '[[:cntrl:]]') then
        raise exception using errcode = '22023',
            message = 'outbox_relay.publish: key must be 1 to 255 characters without control characters, or null';
    end if;
    insert into outbox_relay.outbox (topic, key, payload)
    values (publish.topic, publish.key, publish.payload)
    returning id into event_id;
    return event_id;
end
$$;

comment on function outbox_relay.publish(text, jsonb, text) is
    'Adds one event to the outbox inside the caller''s transaction and returns its id.';
