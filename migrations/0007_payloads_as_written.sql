-- Payloads delivered as written, and keys refused with the reason.
--
-- 1. Every number jsonb stores is deliverable: the relay passes the stored JSON text on without
--    reading it into doubles, so the rule "numbers within the range of a double" of migration
--    0003 goes. (It refused 1.7976931348623158e308, a spelling of the largest double, and let a
--    consumer's parser be the judge of what an outbox may carry.) Size and nesting stay.
-- 2. `outbox_relay.publish` says which rule a key breaks: empty, too long, or a control
--    character (never echoing the key's control characters).

create or replace function outbox_relay.payload_problem(payload jsonb) returns text
language sql immutable parallel safe as $$
    select case
        when payload is null then
            'payload must not be null (use ''null''::jsonb for a JSON null)'
        when octet_length(payload::text) > 1040384 then
            format('payload is %s bytes of JSON (as PostgreSQL prints it); the limit is 1040384', octet_length(payload::text))
        when jsonb_path_exists(payload, 'strict $.**{100 to last} ? (@.type() == "array" || @.type() == "object")') then
            'payload nests arrays and objects more than 100 deep'
    end
$$;

comment on function outbox_relay.payload_problem(jsonb) is
    'Why a payload cannot be delivered (size, nesting), or null; the Rust API checks the same.';

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
            message = format('outbox_relay.publish: topic %L has a character outside letters, digits and . _ - : /',
                             regexp_replace(topic, '[[:cntrl:]]', '?', 'g'));
    end if;
    if topic !~ '^[^.]+(\.[^.]+)*$' then
        raise exception using errcode = '22023',
            message = format('outbox_relay.publish: topic %L has an empty word: dots separate non-empty words, as in order.placed', topic);
    end if;
    problem := outbox_relay.payload_problem(payload);
    if problem is not null then
        raise exception using errcode = '22023', message = 'outbox_relay.publish: ' || problem;
    end if;
    if key = '' then
        raise exception using errcode = '22023',
            message = 'outbox_relay.publish: key must not be empty (use null for an event without a key)';
    end if;
    if char_length(key) > 255 then
        raise exception using errcode = '22023',
            message = format('outbox_relay.publish: key is %s characters long; the limit is 255', char_length(key));
    end if;
    if key ~ '[[:cntrl:]]' then
        raise exception using errcode = '22023',
            message = format('outbox_relay.publish: key has a control character at position %s; keys may not hold any',
                             length(substring(key from '^[^[:cntrl:]]*')) + 1);
    end if;
    if key is not null then
        -- Writers of one key serialize, so that the key's events commit in id order.
        perform pg_advisory_xact_lock(1869968482, hashtext(key));
    end if;
    insert into outbox_relay.outbox (topic, key, payload)
    values (publish.topic, publish.key, publish.payload)
    returning id into event_id;
    return event_id;
end
$$;
