-- Rows a relay can always claim, deliver and list, whoever wrote them; and a writer role that can
-- add events and receipts but not forge them.
--
-- 1. Constraints on what any writer may insert. They are added NOT VALID (new and updated rows
--    are checked) and then validated where the existing rows allow it; a database that already
--    holds such rows keeps them, and the relay dead-letters them with the reason when it claims them.
-- 2. One definition of a deliverable payload, shared by `outbox_relay.publish` and the Rust API
--    (`src/payload.rs`): at most 1,040,384 bytes of jsonb text, at most 100 arrays and objects
--    nested, numbers within the range of a double.
-- 3. `outbox_relay.store_response`, through which a writer fills in the response of the receipt
--    its own transaction created; `migrations/optional/least_privilege_roles.sql` grants writers
--    that function and INSERT on named columns instead of UPDATE on receipts.

-- Topics: dot-separated non-empty words (`order.placed`, not `order..placed`, `.order` or
-- `order.`), so that every topic is a valid NATS subject and AMQP routing key.
alter table outbox_relay.outbox drop constraint outbox_topic_valid;
alter table outbox_relay.outbox add constraint outbox_topic_valid
    check (char_length(topic) between 1 and 255 and topic ~ '^[A-Za-z0-9_:/-]+(\.[A-Za-z0-9_:/-]+)*$') not valid;

-- Times an event can carry and a relay can compute with: no infinity, no year before 1970.
alter table outbox_relay.outbox add constraint outbox_created_at_valid
    check (created_at >= '1970-01-01 00:00:00+00' and created_at < '10000-01-01 00:00:00+00') not valid;
alter table outbox_relay.outbox add constraint outbox_available_at_finite
    check (isfinite(available_at)) not valid;

do $$
declare
    name text;
begin
    foreach name in array array['outbox_topic_valid', 'outbox_created_at_valid', 'outbox_available_at_finite'] loop
        begin
            execute format('alter table outbox_relay.outbox validate constraint %I', name);
        exception when check_violation then
            raise notice 'outbox_relay.outbox has rows that break %; they stay, and the relay dead-letters them', name;
        end;
    end loop;
end
$$;

-- Why a payload cannot be delivered, or null when it can. The same rules as the Rust API.
create function outbox_relay.payload_problem(payload jsonb) returns text
language sql immutable parallel safe as $$
    select case
        when payload is null then
            'payload must not be null (use ''null''::jsonb for a JSON null)'
        when octet_length(payload::text) > 1040384 then
            format('payload is %s bytes of JSON (as PostgreSQL prints it); the limit is 1040384', octet_length(payload::text))
        when jsonb_path_exists(payload, 'strict $.**{100 to last} ? (@.type() == "array" || @.type() == "object")') then
            'payload nests arrays and objects more than 100 deep'
        when jsonb_path_exists(payload, 'strict $.** ? (@.type() == "number" && (@ > 1.7976931348623157e308 || @ < -1.7976931348623157e308))') then
            'payload has a number beyond the range of a double (about 1.8e308), which consumers cannot read'
    end
$$;

comment on function outbox_relay.payload_problem(jsonb) is
    'Why a payload cannot be delivered (size, nesting, number range), or null; the Rust API checks the same.';

create or replace function outbox_relay.publish(topic text, payload jsonb, key text default null) returns bigint
language plpgsql as $$
declare
    event_id bigint;
    problem text;
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
    if topic !~ '^[^.]+(\.[^.]+)*$' then
        raise exception using errcode = '22023',
            message = format('outbox_relay.publish: topic %L has an empty word: dots separate non-empty words, as in order.placed', topic);
    end if;
    problem := outbox_relay.payload_problem(payload);
    if problem is not null then
        raise exception using errcode = '22023', message = 'outbox_relay.publish: ' || problem;
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

-- Fills in the response of the receipt that the calling transaction created (and only that: a
-- committed receipt, or another transaction's, is never changed). Runs with its owner's rights,
-- so a writer needs no UPDATE on receipts and cannot forge what a replay returns.
create function outbox_relay.store_response(key text, response jsonb) returns void
language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
begin
    update outbox_relay.idempotency i
       set response = store_response.response
     where i.key = store_response.key and i.response is null and i.xmin = pg_current_xact_id()::xid;
    if not found then
        raise exception using errcode = '55000',
            message = format('outbox_relay.store_response: no receipt for key %L was created by this transaction', store_response.key);
    end if;
end
$$;

revoke execute on function outbox_relay.store_response(text, jsonb) from public;

comment on function outbox_relay.store_response(text, jsonb) is
    'Stores the response of the idempotency receipt this transaction created; nothing else.';
