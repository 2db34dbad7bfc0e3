-- The events ride in their notification (issue 41). Until now a waiting relay was told only
-- "events were committed" and then claimed them: a round trip between the commit and the
-- handler, most of the relay's latency above a plain LISTEN client's. Now, when a relay waits,
-- the trigger puts the statement's events in the notification, and the relay that owns the
-- destination's fast path hands them to the handler at once; its next claim records them.
--
-- The payload of a notification is its signature (below), then JSON, one of:
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
-- Every notification that carries events is signed: its payload is the HMAC-SHA256 of the JSON
-- (64 hex digits) followed by the JSON. The key is made here, at random, and kept in
-- `outbox_relay.notification_key`, which only the relay reads: any role that may connect may
-- NOTIFY on the channel, and a relay must not deliver an event it made up. Any role that may
-- connect may also LISTEN, and so read the events' payloads as they are committed; where such
-- roles must not see them, `update outbox_relay.notification_key set carry_events = false` and
-- the trigger goes back to empty notifications (the relays claim before they deliver).
--
-- Nothing changes when no relay waits: the trigger checks that first, as before, and reads no
-- row. `set local outbox_relay.notify = off` still skips it (a transaction that will be
-- PREPAREd). Relays of earlier versions take any other payload as "events were committed".

create table outbox_relay.notification_key (
    one boolean primary key default true check (one),
    -- HMAC-SHA256's key (the relay's copy) and its inner and outer padded forms (the trigger's).
    key bytea not null,
    inner_pad bytea not null,
    outer_pad bytea not null,
    carry_events boolean not null default true
);
revoke all on outbox_relay.notification_key from public;

do $$
declare
    k bytea := decode(replace(gen_random_uuid()::text || gen_random_uuid()::text, '-', ''), 'hex');
    i bytea := decode(repeat('36', 64), 'hex');
    o bytea := decode(repeat('5c', 64), 'hex');
begin
    for n in 0 .. length(k) - 1 loop
        i := set_byte(i, n, get_byte(i, n) # get_byte(k, n));
        o := set_byte(o, n, get_byte(o, n) # get_byte(k, n));
    end loop;
    insert into outbox_relay.notification_key (key, inner_pad, outer_pad) values (k, i, o);
end
$$;

comment on table outbox_relay.notification_key is
    'The key that signs the notifications carrying events (migration 0018), read by the relay; carry_events = false sends empty notifications instead (for databases where roles that must not read events may connect and LISTEN).';

create or replace function outbox_relay.notify_relay() returns trigger
language plpgsql as $$
begin
    if coalesce(current_setting('outbox_relay.notify', true), '') <> 'off'
       and exists (select 1 from outbox_relay.relays where waiting) then
        perform outbox_relay.notify_events();
    end if;
    return null;
end
$$;

-- HMAC-SHA256 (RFC 2104) of `message` under the key whose padded forms `signing` holds, in hex,
-- then `message`: a notification the relay can tell from one another role sent.
create or replace function outbox_relay.notify_signed(signing outbox_relay.notification_key, message text)
returns void
language sql
set search_path = pg_catalog, pg_temp
as $$
    select pg_notify('outbox_relay', encode(sha256(signing.outer_pad || sha256(signing.inner_pad || convert_to(message, 'UTF8'))), 'hex') || message)
$$;
revoke execute on function outbox_relay.notify_signed(outbox_relay.notification_key, text) from public;

-- The notifications of the current statement's events (called by the trigger while a relay
-- waits). Its reads go by the xid index whatever the table looked like when a session first ran
-- it: PL/pgSQL keeps one plan per session, and a plan made while the outbox held a few pages
-- (a seq scan) would read the whole table on every statement until the next analyze, as the
-- outbox grew (measured: 0.24 ms a statement after 5,000 rows). `jit = off`, as the cost that
-- disables a seq scan would otherwise start the JIT compiler on every call.
create or replace function outbox_relay.notify_events() returns void
language plpgsql
-- It reads the current transaction's own rows, all their columns (a writer's role may only
-- insert them), and the signing key.
security definer
set search_path = pg_catalog, pg_temp
set enable_seqscan = off
set jit = off
as $$
declare
    signing outbox_relay.notification_key;
    n int;
    total int;
    body text;
    last bigint;
    head text;
    entries text[];
    entry text;
    chunk text := '';
begin
    select * into signing from outbox_relay.notification_key;
    if not coalesce(signing.carry_events, false) then
        perform pg_notify('outbox_relay', '');
        return;
    end if;
    -- The common case in one statement: the events as JSON, joined, counted and measured.
    select count(*), sum(octet_length(s.whole)), string_agg(s.whole, ',' order by s.id), max(s.id)
      into n, total, body, last
      from (select e.id,
                   json_build_array(e.id, e.uuid, e.topic, e.key, e.headers,
                                    (extract(epoch from e.created_at) * 1000000)::int8,
                                    e.available_at > clock_timestamp(), e.payload)::text as whole
              from outbox_relay.outbox e
             where e.xid = pg_current_xact_id() and e.xid <> '0'::xid8
               and e.id > coalesce(nullif(current_setting('outbox_relay.notified_upto', true), ''), '0')::bigint
             order by e.xid, e.id
             limit 33) s;
    if n = 0 then
        return; -- an insert of no row
    end if;
    head := '{"x":"' || pg_current_xact_id()::text || '"';
    if n > 32 then
        perform outbox_relay.notify_signed(signing, head || ',"more":true}'),
                set_config('outbox_relay.notified_upto', (select max(e.id) from outbox_relay.outbox e
                    where e.xid = pg_current_xact_id() and e.xid <> '0'::xid8)::text, true);
        return;
    end if;
    if octet_length(head) + total + n + 10 <= 7920 then
        perform outbox_relay.notify_signed(signing, head || ',"e":[' || body || ']}'),
                set_config('outbox_relay.notified_upto', last::text, true);
        return;
    end if;
    -- Too much for one notification: several, and an event too large for one of its own
    -- without its payload.
    select array_agg(case when octet_length(s.whole) <= 7830 then s.whole else s.short end order by s.id)
      into entries
      from (select e.id,
                   json_build_array(e.id, e.uuid, e.topic, e.key, e.headers,
                                    (extract(epoch from e.created_at) * 1000000)::int8,
                                    e.available_at > clock_timestamp(), e.payload)::text as whole,
                   json_build_array(e.id, e.uuid, e.topic, e.key)::text as short
              from outbox_relay.outbox e
             where e.xid = pg_current_xact_id() and e.xid <> '0'::xid8 and e.id > coalesce(nullif(current_setting('outbox_relay.notified_upto', true), ''), '0')::bigint
               and e.id <= last) s;
    foreach entry in array entries loop
        if chunk <> '' and octet_length(head) + octet_length(chunk) + octet_length(entry) + 10 > 7920 then
            perform outbox_relay.notify_signed(signing, head || ',"e":[' || chunk || ']}');
            chunk := '';
        end if;
        chunk := case when chunk = '' then entry else chunk || ',' || entry end;
    end loop;
    perform outbox_relay.notify_signed(signing, head || ',"e":[' || chunk || ']}'),
            set_config('outbox_relay.notified_upto', last::text, true);
end
$$;

comment on function outbox_relay.notify_relay() is
    'Wakes a waiting relay at commit, the statement''s events in the notification (migration 0018); `set local outbox_relay.notify = off` skips it (a transaction that will be PREPAREd).';

comment on function outbox_relay.notify_events() is
    'The notifications of the current statement''s events, for the trigger outbox_notify_relay while a relay waits (migration 0018).';
