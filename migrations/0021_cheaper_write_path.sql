-- The write path at the cost of what it guards (issue 43). Measured in a backend's profile
-- (perf, one writer of the Rust door's statements): the outbox's check constraints were 14 % of
-- the backend's time. PostgreSQL reads a table's CHECK expressions from their stored node text,
-- plans and compiles them again at every INSERT statement (ExecRelCheck), so a single-row
-- insert pays for every node of every constraint; the evaluation itself is the small part.
-- Per single-row INSERT, in a loop of 20,000 (same run): topic and key checks as they were
-- 36 µs, as below 27 µs; a table without them 7 µs.
--
-- * The topic's and key's checks keep their names and their meaning, in fewer nodes: the
--   topic's pattern admits only ASCII (so its length in bytes is its length in characters) and
--   no empty topic; a key's pattern admits no empty key and no control character.
-- * The headers' check calls its function only when there are headers (it was called for
--   every row, to return null).
-- * The receipt's key check, the same as the outbox key's.
--
-- The constraints are added NOT VALID: each is equivalent to the one it replaces, which the
-- existing rows passed (or, where an operator wrote rows past a dropped check, which the relay
-- dead-letters as before); validating would hold the outbox's ACCESS EXCLUSIVE lock while it
-- read every retained row. They are enforced on every new row from now on.

alter table outbox_relay.outbox drop constraint outbox_topic_valid;
alter table outbox_relay.outbox add constraint outbox_topic_valid
    check (octet_length(topic) <= 255 and topic ~ '^[A-Za-z0-9_:/-]+(\.[A-Za-z0-9_:/-]+)*$') not valid;

alter table outbox_relay.outbox drop constraint outbox_key_valid;
alter table outbox_relay.outbox add constraint outbox_key_valid
    check (char_length(key) <= 255 and key ~ '^[^[:cntrl:]]+$') not valid;

alter table outbox_relay.outbox drop constraint outbox_headers_valid;
alter table outbox_relay.outbox add constraint outbox_headers_valid
    check (headers is null or outbox_relay.headers_problem(headers) is null) not valid;

alter table outbox_relay.idempotency drop constraint idempotency_key_valid;
alter table outbox_relay.idempotency add constraint idempotency_key_valid
    check (char_length(key) <= 255 and key ~ '^[^[:cntrl:]]+$') not valid;

-- Whether a payload can be delivered, or null: as before, with the nesting walk only where it can
-- find something. Nesting arrays and objects d deep takes at least 2d characters of JSON text,
-- so a payload under 202 bytes of text nests at most 100 deep, the limit; the walk
-- (jsonb_path_exists over every value) ran for every payload.
create or replace function outbox_relay.payload_problem(payload jsonb) returns text
language sql immutable parallel safe as $$
    select case
        when payload is null then
            'payload must not be null (use ''null''::jsonb for a JSON null)'
        when octet_length(payload::text) > 1040384 then
            'payload is ' || octet_length(payload::text)::text || ' bytes of JSON (as PostgreSQL prints it); the limit is 1040384'
        when octet_length(payload::text) >= 202
             and jsonb_path_exists(payload, 'strict $.**{100 to last} ? (@.type() == "array" || @.type() == "object")') then
            'payload nests arrays and objects more than 100 deep'
    end
$$;

-- publish: one statement instead of two. The key's advisory lock is taken by the insert itself
-- (its function scan runs before the row's id is drawn, as in the Rust door's statement), so
-- writers of one key still commit its events in id order.
create or replace function outbox_relay.publish(topic text, payload jsonb, key text default null, headers jsonb default null)
returns bigint
language plpgsql as $$
declare
    event_id bigint;
    problem text;
begin
    if topic is null or octet_length(topic) > 255 or topic !~ '^[A-Za-z0-9_:/-]+(\.[A-Za-z0-9_:/-]+)*$' then
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
        raise exception using errcode = '22023',
            message = format('outbox_relay.publish: topic %L has an empty word: dots separate non-empty words, as in order.placed', topic);
    end if;
    problem := outbox_relay.payload_problem(payload);
    if problem is not null then
        raise exception using errcode = '22023', message = 'outbox_relay.publish: ' || problem;
    end if;
    if key is not null and (char_length(key) > 255 or key !~ '^[^[:cntrl:]]+$') then
        if key = '' then
            raise exception using errcode = '22023',
                message = 'outbox_relay.publish: key must not be empty (use null for an event without a key)';
        end if;
        if char_length(key) > 255 then
            raise exception using errcode = '22023',
                message = format('outbox_relay.publish: key is %s characters long; the limit is 255', char_length(key));
        end if;
        raise exception using errcode = '22023',
            message = format('outbox_relay.publish: key has a control character at position %s; keys may not hold any',
                             length(substring(key from '^[^[:cntrl:]]*')) + 1);
    end if;
    if headers is not null then
        problem := outbox_relay.headers_problem(headers);
        if problem is not null then
            raise exception using errcode = '22023', message = 'outbox_relay.publish: ' || problem;
        end if;
    end if;
    if key is null then
        insert into outbox_relay.outbox (topic, key, payload, headers)
        values (publish.topic, null, publish.payload, nullif(publish.headers, '{}'::jsonb))
        returning id into event_id;
        return event_id;
    end if;
    -- Writers of one key serialize, so that the key's events commit in id order.
    insert into outbox_relay.outbox (topic, key, payload, headers)
    select publish.topic, publish.key, publish.payload, nullif(publish.headers, '{}'::jsonb)
      from pg_advisory_xact_lock(1869968482, hashtext(publish.key))
    returning id into event_id;
    return event_id;
end
$$;

-- store_response: one statement instead of two. The update says which door took the key (the
-- Rust doors' fingerprints are 32 bytes); a JSON null refused after it is undone with the
-- failed statement, as every write of the transaction is.
create or replace function outbox_relay.store_response(key text, response jsonb) returns void
language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
declare
    rust_door boolean;
begin
    if response is not null then
        update outbox_relay.idempotency i set response = store_response.response
         where i.key = store_response.key and i.response is null and i.xmin = pg_current_xact_id()::xid
        returning length(i.fingerprint) = 32 into rust_door;
        if not found then
            raise exception using errcode = '55000',
                message = format('outbox_relay.store_response: no receipt for key %L was created by this transaction', store_response.key);
        end if;
    end if;
    if response is null or (jsonb_typeof(response) = 'null' and not rust_door) then
        raise exception using errcode = '22004',
            message = format('outbox_relay.store_response: the response of idempotency key %L must not be null: a replay could not tell it from a fresh request (store an object, e.g. {})', store_response.key);
    end if;
end
$$;

-- audit: the common case tested in one expression, the detailed tests only to say what is wrong.
-- The expression states key_problem's rules again (one pattern each): with key_problem's inlined
-- CASEs in it a call cost 10 µs more (pgbench, backend CPU, 5,000 calls: 192 to 194 µs against
-- 180 to 184 µs; 194 to 202 µs as in 0020).
create or replace function outbox_relay.audit(entity text, entity_id text, action text, data jsonb, idempotency_key text default null)
returns bigint
language plpgsql as $$
declare
    problem text;
    entry_id bigint;
begin
    if entity is null or char_length(entity) > 255 or entity !~ '^[^[:cntrl:]]+$'
       or action is null or char_length(action) > 255 or action !~ '^[^[:cntrl:]]+$'
       or entity_id is null or entity_id = '' or data is null
       or octet_length(data::text) >= 202
       or (idempotency_key is not null and (char_length(idempotency_key) > 255 or idempotency_key !~ '^[^[:cntrl:]]+$')) then
        problem := coalesce(outbox_relay.key_problem('the audit entity', entity),
                            outbox_relay.key_problem('the audit action', action));
        if problem is null and (entity_id is null or entity_id = '') then
            problem := 'the audit entity id must not be empty';
        end if;
        if problem is null and data is null then
            problem := 'the audit entry''s data must not be null (use {} for none)';
        end if;
        problem := coalesce(problem, outbox_relay.payload_problem(data));
        if problem is null and idempotency_key is not null then
            problem := outbox_relay.key_problem('the idempotency key', idempotency_key);
        end if;
        if problem is not null then
            raise exception using errcode = '22023', message = 'outbox_relay.audit: ' || problem;
        end if;
    end if;
    insert into outbox_relay.audit (entity, entity_id, action, data, idempotency_key)
    values (audit.entity, audit.entity_id, audit.action, audit.data, audit.idempotency_key)
    returning id into entry_id;
    return entry_id;
end
$$;
