-- Order per key: events that share a key are delivered one at a time, in id order. The relay
-- claims an event only when no earlier event of its key is unfinished (pending, leased, or
-- waiting for a retry); these indexes make that check one probe per candidate.
--
-- Commit order is not id order: two writers of one key could commit out of id order, and a
-- later id would then be delivered before the earlier one became visible. So writers of one key
-- serialize on a transaction-scoped advisory lock taken *before* the insert draws its id:
-- pg_advisory_xact_lock(1869968482, hashtext(key)), where 1869968482 is 'outb' in ASCII (the
-- two-integer form of advisory locks, apart from the single-bigint locks applications use). The
-- library's inserts and outbox_relay.publish take it; a writer that inserts into the table
-- directly must take it too.

create index outbox_pending_key_idx on outbox_relay.outbox (key, id) where processed_at is null and key is not null;

comment on index outbox_relay.outbox_pending_key_idx is
    'Unfinished events by key: the claim delivers an event only when none of its key comes before it.';

-- With the relay's hold_keys_on_dead_letter setting, a dead letter holds its key's later events.
create index dead_letters_key_idx on outbox_relay.dead_letters (key, id) where key is not null;

-- The outage breaker of each relay (closed, or open while its destination is down), for status.
alter table outbox_relay.relays
    add column breaker text not null default 'closed',
    add column breaker_since timestamptz,
    add constraint relays_breaker_valid check (breaker in ('closed', 'open'));

comment on column outbox_relay.relays.breaker is
    'closed, or open: the relay found its destination down, stopped claiming, and probes it with one delivery at a time.';
comment on column outbox_relay.relays.breaker_since is 'When the breaker last changed state.';

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
