-- The receipt written once (issue 43). The Rust doors (Outbox::execute, Connection::begin and
-- the sqlx door) claimed a key by inserting its receipt without a response, and filled the
-- response in at the end (outbox_relay.store_response): two writes of one row per request, the
-- second an UPDATE that leaves a dead version behind. They now serialize requests of one key on
-- an advisory lock of the transaction (class 0x69646d70, the key's hashtext), read the receipt
-- in a statement of their own once they hold it (READ COMMITTED: that statement sees what the
-- lock's last holder committed), and insert the receipt with its response at the end, sent with
-- the COMMIT. A request of an earlier version of the library (it claims a key with a row and
-- takes no lock) may take the same key meanwhile; then the final insert meets that receipt,
-- fails with unique_violation, and everything rolls back: the retry replays.
--
-- Measured with pgbench (one writer, the Rust door's statements, backend CPU per transaction,
-- synchronous_commit off, alternately): 630 / 670 / 635 µs claim and update, 595 / 622 / 640 µs
-- lock, read and one insert as the doors send them (docs/performance.md).
--
-- Writers therefore insert the response column too. That gives them nothing new: a writer
-- could already write any response into a receipt of a fresh key (claim it, then
-- store_response), and still cannot change a receipt once written. Every role that may insert
-- a receipt's fingerprint (the outbox_writer of migrations/optional/least_privilege_roles.sql,
-- or a role of the operator's own) may now insert its response as well.

do $$
declare
    grantee text;
begin
    for grantee in
        select case when a.grantee = 0 then 'public' else a.grantee::regrole::text end
          from pg_attribute t cross join lateral aclexplode(t.attacl) a
         where t.attrelid = 'outbox_relay.idempotency'::regclass and t.attname = 'fingerprint'
           and a.privilege_type = 'INSERT'
    loop
        execute format('grant insert (response) on outbox_relay.idempotency to %s', grantee);
    end loop;
end
$$;

-- The SQL door keeps its claim (a receipt without a response, filled in by store_response: it
-- cannot know that its caller will store one, and a key must not be free again after a request
-- committed without it). It takes the key's lock first, as the Rust doors do (class 0x69646d70
-- = 1768189296), so that a request of theirs still running is waited for, as before.
create or replace function outbox_relay.begin_request(key text, request jsonb) returns jsonb
language plpgsql as $$
declare
    problem text := outbox_relay.key_problem('the idempotency key', key);
    wanted bytea;
    stored record;
begin
    if problem is not null then
        raise exception using errcode = '22023', message = 'outbox_relay.begin_request: ' || problem;
    end if;
    if request is null then
        raise exception using errcode = '22004',
            message = 'outbox_relay.begin_request: the request must not be null (pass what identifies it, e.g. its body as JSON)';
    end if;
    wanted := convert_to('sql1', 'UTF8') || sha256(convert_to(request::text, 'UTF8'));
    -- The key's lock, as the Rust doors take it: a request of theirs that is still running (its
    -- receipt is written at its end) is waited for, and its receipt is then what the claim meets.
    perform pg_advisory_xact_lock(1768189296, hashtext(key));
    -- A stored receipt may vanish between the conflicting claim and the read (the janitor
    -- removed an expired one): the key is free again, and the next claim takes it. Each statement
    -- sees what is committed when it starts (READ COMMITTED; under REPEATABLE READ a receipt
    -- committed after the snapshot is a serialization failure, SQLSTATE 40001: retry).
    for attempt in 1..3 loop
        insert into outbox_relay.idempotency (key, fingerprint) values (begin_request.key, wanted)
        on conflict do nothing;
        if found then
            return null;
        end if;
        select i.fingerprint, i.response into stored from outbox_relay.idempotency i where i.key = begin_request.key;
        if found then
            if length(stored.fingerprint) = 32 then
                raise exception using errcode = 'OR001',
                    message = format('outbox_relay.begin_request: idempotency key %L was claimed through the Rust API, which fingerprints requests its own way; nothing was written', key),
                    hint = 'Retry a request through the door that first took its key.';
            end if;
            if stored.fingerprint <> wanted then
                raise exception using errcode = 'OR001',
                    message = format('outbox_relay.begin_request: idempotency key %L was already used for a different request; nothing was written', key),
                    hint = 'A retry must send the same request with its key; a new request needs a new key.';
            end if;
            if stored.response is null then
                raise exception using errcode = '55000',
                    message = format('outbox_relay.begin_request: the request of idempotency key %L committed without a response (outbox_relay.store_response was not called): nothing to replay', key);
            end if;
            return stored.response;
        end if;
    end loop;
    raise exception using errcode = '40001',
        message = format('outbox_relay.begin_request: idempotency key %L kept changing hands; try again', key);
end
$$;

comment on column outbox_relay.idempotency.response is
    'The response given the first time, returned again to every replay. Null only while a request of the SQL door (outbox_relay.begin_request), or of a version of the Rust doors before migration 0022, holds the key uncommitted, or after one committed without outbox_relay.store_response.';
