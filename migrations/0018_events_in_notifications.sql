-- The events ride in their notification (issue 41). Until now a waiting relay was told only
-- "events were committed" and then claimed them: a round trip between the commit and the
-- handler, most of the relay's latency above a plain LISTEN client's. Now, when a relay waits,
-- the trigger puts the statement's events in the notification, and the relay that owns the
-- destination's fast path hands them to the handler at once; its next claim records them.
--
-- The payload of a notification is JSON, one of:
--   {"x":"<xid>","e":[[id,"uuid","topic",key,headers,created_at_us,delayed,payload], ...]}
--     the statement's events (several notifications when they do not fit in one: PostgreSQL
--     takes at most 7,999 bytes); an event too large for a notification of its own comes as
--     [id,"uuid","topic",key] (no payload: the claim delivers it);
--   {"x":"<xid>","more":true}
--     a statement of more than 32 events: the relay claims them (one notification, not one per
--     32 events, and no payload read on the write path of a bulk insert).
-- `x` is the inserting transaction's id (the events' `xid`): the relay compares it with the
-- snapshot of its last claim, so that an event a claim already took is not delivered again.
-- Events a transaction inserted in earlier statements are not sent twice (`notified_upto`, a
-- setting local to the transaction).
--
-- Nothing changes when no relay waits: the trigger checks that first, as before, and reads no
-- row. `set local outbox_relay.notify = off` still skips it (a transaction that will be
-- PREPAREd). Relays of earlier versions take any other payload as "events were committed".

create or replace function outbox_relay.notify_relay() returns trigger
language plpgsql as $$
declare
    upto bigint;
    last bigint;
    entries text[];
    entry text;
    chunk text := '';
    head text;
begin
    if coalesce(current_setting('outbox_relay.notify', true), '') = 'off'
       or not exists (select 1 from outbox_relay.relays where waiting) then
        return null;
    end if;
    head := '{"x":"' || pg_current_xact_id()::text || '"';
    upto := coalesce(nullif(current_setting('outbox_relay.notified_upto', true), ''), '0')::bigint;
    select array_agg(case when octet_length(s.whole) <= 7900 then s.whole else s.short end order by s.id), max(s.id)
      into entries, last
      from (select e.id,
                   json_build_array(e.id, e.uuid, e.topic, e.key, e.headers,
                                    (extract(epoch from e.created_at) * 1000000)::int8,
                                    e.available_at > clock_timestamp(), e.payload)::text as whole,
                   json_build_array(e.id, e.uuid, e.topic, e.key)::text as short
              from outbox_relay.outbox e
             where e.xid = pg_current_xact_id() and e.xid <> '0'::xid8 and e.id > upto
             order by e.xid, e.id
             limit 33) s;
    if entries is null then
        return null; -- an insert of no row
    end if;
    if cardinality(entries) > 32 then
        perform pg_notify('outbox_relay', head || ',"more":true}');
        perform set_config('outbox_relay.notified_upto', (select max(e.id) from outbox_relay.outbox e
            where e.xid = pg_current_xact_id() and e.xid <> '0'::xid8)::text, true);
        return null;
    end if;
    foreach entry in array entries loop
        if chunk <> '' and octet_length(head) + octet_length(chunk) + octet_length(entry) + 10 > 7990 then
            perform pg_notify('outbox_relay', head || ',"e":[' || chunk || ']}');
            chunk := '';
        end if;
        chunk := case when chunk = '' then entry else chunk || ',' || entry end;
    end loop;
    perform pg_notify('outbox_relay', head || ',"e":[' || chunk || ']}');
    perform set_config('outbox_relay.notified_upto', last::text, true);
    return null;
end
$$;

comment on function outbox_relay.notify_relay() is
    'Wakes a waiting relay at commit, the statement''s events in the notification (migration 0018); `set local outbox_relay.notify = off` skips it (a transaction that will be PREPAREd).';
