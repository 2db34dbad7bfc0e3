-- Headers with every event (issue 25): a writer's metadata beside the payload (a correlation id,
-- a tenant) and W3C trace context (`traceparent`, `tracestate`), stored as a JSON object of
-- strings and sent by every sink in its own way. The rules are `outbox_relay.headers_problem`'s,
-- the same as the Rust API's (src/headers.rs); check constraints hold them for rows written by
-- hand too, on the outbox and on every table an event moves to (parked, dead_letters).
--
-- On a live installation the columns are added without a default (no rewrite), and each
-- constraint is added NOT VALID and then validated, which reads the table without blocking its
-- writers.

create function outbox_relay.headers_problem(headers jsonb) returns text
language plpgsql immutable parallel safe as $$
declare
    name text;
    value jsonb;
    text_value text;
    shown text;
    seen text[] := '{}';
    bytes int := 0;
    parent text;
    fields text[];
begin
    if headers is null then
        return null;
    end if;
    if jsonb_typeof(headers) <> 'object' then
        return 'headers must be a JSON object of names to strings, e.g. {"x-correlation-id": "c-42"}';
    end if;
    if (select count(*) from jsonb_object_keys(headers)) > 32 then
        return format('an event carries %s headers; the limit is 32', (select count(*) from jsonb_object_keys(headers)));
    end if;
    for name, value in select e.key, e.value from jsonb_each(headers) e loop
        shown := regexp_replace(name, '[[:cntrl:]]', '?', 'g');
        if char_length(name) not between 1 and 64 then
            return format('header name %L is %s characters long; a name is 1 to 64', shown, char_length(name));
        end if;
        if name !~ '^[A-Za-z0-9._-]+$' then
            return format('header name %L has a character outside letters, digits, - _ and .', shown);
        end if;
        if lower(name) in ('content-type', 'content-length', 'content-encoding', 'transfer-encoding', 'host',
                           'connection', 'keep-alive', 'proxy-connection', 'upgrade', 'te', 'trailer', 'expect',
                           'user-agent')
           or lower(name) ~ '^(outbox-|webhook-|ce-|ce_|nats-)' then
            return format('header %s is reserved: the sinks set it themselves, or it changes how a request is read', name);
        end if;
        if lower(name) in ('traceparent', 'tracestate') and name <> lower(name) then
            return format('header %s must be written in lower case, as %s', name, lower(name));
        end if;
        if lower(name) = any (seen) then
            return format('header %s is given twice (names are compared regardless of case)', name);
        end if;
        seen := seen || lower(name);
        if jsonb_typeof(value) <> 'string' then
            return format('header %s: the value must be a JSON string, not %s', name, jsonb_typeof(value));
        end if;
        text_value := value #>> '{}';
        if text_value = '' then
            return format('header %s has an empty value; leave the header out instead', name);
        end if;
        if octet_length(text_value) > 1024 then
            return format('header %s has a value of %s bytes; the limit is 1024', name, octet_length(text_value));
        end if;
        if text_value !~ '^[ -~]+$' then
            return format('header %s has a character that is not printable ASCII (a line break, a control character or non-ASCII text); percent-encode such text', name);
        end if;
        if text_value ~ '^ | $' then
            return format('header %s has a value that starts or ends with a space, which HTTP would drop', name);
        end if;
        bytes := bytes + octet_length(name) + octet_length(text_value);
    end loop;
    if bytes > 8192 then
        return format('the headers are %s bytes of names and values; the limit is 8192', bytes);
    end if;
    parent := headers ->> 'traceparent';
    if parent is null then
        if headers ? 'tracestate' then
            return 'header tracestate is given without traceparent';
        end if;
        return null;
    end if;
    fields := string_to_array(parent, '-');
    if cardinality(fields) < 4 or fields[1] !~ '^[0-9a-f]{2}$' or fields[2] !~ '^[0-9a-f]{32}$'
       or fields[3] !~ '^[0-9a-f]{16}$' or fields[4] !~ '^[0-9a-f]{2}$' then
        return format('header traceparent %L is no W3C trace context (the fields are not lower-case hex of the right lengths; expected 00-<32 hex digits>-<16 hex digits>-<2 hex digits>)', parent);
    end if;
    if fields[1] = 'ff' then
        return format('header traceparent %L is no W3C trace context (version ff is invalid)', parent);
    end if;
    if fields[1] = '00' and cardinality(fields) <> 4 then
        return format('header traceparent %L is no W3C trace context (version 00 has four fields)', parent);
    end if;
    if fields[2] ~ '^0+$' or fields[3] ~ '^0+$' then
        return format('header traceparent %L is no W3C trace context (an id of all zeros is invalid)', parent);
    end if;
    return null;
end
$$;

comment on function outbox_relay.headers_problem(jsonb) is
    'Why an event''s headers cannot be stored (names, values, sizes, reserved names, trace context), or null; the Rust API checks the same.';

alter table outbox_relay.outbox add column headers jsonb;
alter table outbox_relay.outbox add constraint outbox_headers_valid
    check (outbox_relay.headers_problem(headers) is null) not valid;
alter table outbox_relay.outbox validate constraint outbox_headers_valid;
comment on column outbox_relay.outbox.headers is
    'The event''s headers, a JSON object of strings (null: none): the writer''s metadata and W3C trace context, sent by every sink.';

alter table outbox_relay.parked add column headers jsonb;
alter table outbox_relay.parked add constraint parked_headers_valid
    check (outbox_relay.headers_problem(headers) is null) not valid;
alter table outbox_relay.parked validate constraint parked_headers_valid;

alter table outbox_relay.dead_letters add column headers jsonb;
alter table outbox_relay.dead_letters add constraint dead_letters_headers_valid
    check (outbox_relay.headers_problem(headers) is null) not valid;
alter table outbox_relay.dead_letters validate constraint dead_letters_headers_valid;

-- The SQL door takes headers too. The three-argument function is replaced by one with a fourth,
-- defaulted argument (both would make a call with three arguments ambiguous); whoever could
-- execute the old one can execute the new one, and no one else.
create function outbox_relay.publish(topic text, payload jsonb, key text default null, headers jsonb default null)
returns bigint
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
    problem := outbox_relay.headers_problem(headers);
    if problem is not null then
        raise exception using errcode = '22023', message = 'outbox_relay.publish: ' || problem;
    end if;
    if key is not null then
        -- Writers of one key serialize, so that the key's events commit in id order.
        perform pg_advisory_xact_lock(1869968482, hashtext(key));
    end if;
    insert into outbox_relay.outbox (topic, key, payload, headers)
    values (publish.topic, publish.key, publish.payload, nullif(publish.headers, '{}'::jsonb))
    returning id into event_id;
    return event_id;
end
$$;

comment on function outbox_relay.publish(text, jsonb, text, jsonb) is
    'Adds an event in the caller''s transaction and returns its id: topic, payload, an optional key (its events commit in id order) and optional headers (a JSON object of strings, e.g. {"traceparent": "00-...-01"}).';

do $$
declare
    grantee text;
begin
    for grantee in
        select a.grantee::regrole::text
          from pg_proc p cross join lateral aclexplode(p.proacl) a
         where p.oid = 'outbox_relay.publish(text, jsonb, text)'::regprocedure
           and a.privilege_type = 'EXECUTE' and a.grantee <> 0 and a.grantee <> p.proowner
    loop
        execute format('grant execute on function outbox_relay.publish(text, jsonb, text, jsonb) to %s', grantee);
    end loop;
    -- A function is executable by PUBLIC until that is revoked: if it was, it is again.
    if exists (select 1 from pg_proc p
                where p.oid = 'outbox_relay.publish(text, jsonb, text)'::regprocedure and p.proacl is not null
                  and not exists (select 1 from aclexplode(p.proacl) a
                                   where a.grantee = 0 and a.privilege_type = 'EXECUTE')) then
        revoke execute on function outbox_relay.publish(text, jsonb, text, jsonb) from public;
    end if;
end
$$;

drop function outbox_relay.publish(text, jsonb, text);
