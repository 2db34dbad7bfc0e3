-- Least-privilege roles for outbox-relay. Not applied by `outbox-relay migrate`: roles are
-- cluster-wide objects and creating them needs CREATEROLE. Apply once per database, after the
-- migrations (and again after upgrading outbox-relay: it is safe to re-run), as a superuser or
-- the schema owner with CREATEROLE:
--
--   psql "$DATABASE_URL" -v ON_ERROR_STOP=1 -f migrations/optional/least_privilege_roles.sql
--
-- Then give each login role the group it needs:
--
--   create role orders_service login password '...' in role outbox_writer;   -- plus its own business grants
--   create role outbox_relay_daemon login password '...' in role outbox_relayer;
--   create role billing_service login password '...' in role outbox_consumer;   -- in the consumer's database
--
-- outbox_writer:  services that add events, audit entries and idempotency receipts inside their
--                 own transactions (Outbox::execute, publish, outbox_relay.publish). It may name
--                 only the columns a writer sets (never an id, a transaction id, a lease or a time),
--                 reads back only ids and receipts, and writes a receipt's response only with a
--                 new receipt or through outbox_relay.store_response, which touches nothing but
--                 the receipt its own transaction created: it cannot change a receipt once
--                 written, nor events, nor touch dead letters.
-- outbox_relayer: the relay (`outbox-relay run`, `status`, `dead-letters`, `cleanup`). It reads and
--                 updates the library's tables and nothing else: no business table.
-- outbox_consumer: a receiver's service recording the events it handled in its own transactions
--                 (outbox_relay::inbox) and deleting old records; nothing else of the schema.

-- (Roles belong to the cluster: two sessions applying this file at once, to two databases, may
-- both find a role missing; the second to create it finds it made, and goes on.)
do $$
declare
    role text;
begin
    foreach role in array array['outbox_writer', 'outbox_relayer', 'outbox_consumer'] loop
        if not exists (select from pg_roles where rolname = role) then
            begin
                execute format('create role %I nologin', role);
            exception when duplicate_object or unique_violation then
                null;
            end;
        end if;
    end loop;
end
$$;

grant usage on schema outbox_relay to outbox_writer, outbox_relayer, outbox_consumer;

-- Writers. Table-wide grants of earlier versions are taken back first: a table-level INSERT
-- would cover every column.
revoke all on outbox_relay.outbox, outbox_relay.audit, outbox_relay.idempotency from outbox_writer;
grant insert (topic, key, payload, available_at, headers) on outbox_relay.outbox to outbox_writer;
grant insert (entity, entity_id, action, data, idempotency_key) on outbox_relay.audit to outbox_writer;
-- `insert ... returning id` needs to read the id, and only the id.
grant select (id) on outbox_relay.outbox, outbox_relay.audit to outbox_writer;
grant usage on sequence outbox_relay.outbox_id_seq, outbox_relay.audit_id_seq to outbox_writer;
-- Receipts: write one with its response (the Rust doors, migration 0022) or claim a key and
-- fill in the response of one's own (the SQL door); read a stored one for a replay.
grant insert (key, fingerprint, response), select (key, fingerprint, response) on outbox_relay.idempotency to outbox_writer;
grant execute on function outbox_relay.store_response(text, jsonb) to outbox_writer;
-- The outbox trigger runs as the writer and reads whether a relay is waiting.
grant select on outbox_relay.relays to outbox_writer;
grant execute on function outbox_relay.publish(text, jsonb, text, jsonb) to outbox_writer;
-- The unit of work in SQL (migration 0020), for services in any language.
grant execute on function outbox_relay.begin_request(text, jsonb), outbox_relay.audit(text, text, text, jsonb, text)
    to outbox_writer;

-- The relay: claim, complete, retry, bury; its waiting mark; the janitor; operators' commands
-- (a dead-letter retry puts the event back under its own id: into its destination's parked
-- events, or the outbox when no destination's pattern matched it).
grant select, insert, update, delete on outbox_relay.outbox to outbox_relayer;
-- A claim reads the outbox's leaves by their names (migration 0024); the janitor truncates a leaf
-- the sweeper has emptied (a function that runs as the schema's owner, and only on such a leaf).
grant select on outbox_relay.outbox_before, outbox_relay.outbox_0, outbox_relay.outbox_1, outbox_relay.outbox_2,
    outbox_relay.outbox_3 to outbox_relayer;
grant execute on function outbox_relay.truncate_leaf(smallint, pg_snapshot, integer) to outbox_relayer;
grant select, insert, update, delete on outbox_relay.dead_letters to outbox_relayer;
-- The claims' positions (migration 0008): every claim that moves one inserts a row, the janitor deletes old ones.
grant select, insert, delete on outbox_relay.positions to outbox_relayer;
-- The cluster the positions were taken in (migration 0014): a relay that finds them from another
-- cluster (a restored dump) starts fresh positions and records this one.
grant select, update on outbox_relay.installation to outbox_relayer;
-- Destinations (migration 0012): a relay registers the ones it delivers to (the registration locks
-- the table, which needs UPDATE); `outbox-relay destinations drop` deletes one. What waits for a
-- destination is parked, claimed with row locks, and recorded there.
grant select, insert, update, delete on outbox_relay.destinations to outbox_relayer;
grant select, insert, update, delete on outbox_relay.parked to outbox_relayer;
-- Deliveries of a claim still in delivery (migration 0017), recorded as they end.
grant select, insert, update, delete on outbox_relay.early_deliveries to outbox_relayer;
-- Deliveries of parked events, kept for the retention (migration 0019: `event_state` reads them),
-- and what became of each event; `outbox-relay replay` copies retained events into `parked`.
grant select, insert, update, delete on outbox_relay.parked_deliveries to outbox_relayer;
grant select on outbox_relay.event_state to outbox_relayer;
grant select, insert, update, delete on outbox_relay.relays to outbox_relayer;
-- The key that signs the notifications carrying events (migration 0018): the fast path checks it.
grant select on outbox_relay.notification_key to outbox_relayer;
-- Pauses: the relay reads them; `outbox-relay pause` and `resume` write them.
grant select, insert, update, delete on outbox_relay.pauses to outbox_relayer;
-- (the janitor locks the rows it deletes, FOR UPDATE SKIP LOCKED, which needs UPDATE)
grant select, update, delete on outbox_relay.idempotency to outbox_relayer;
grant select on outbox_relay.schema_migrations to outbox_relayer;

-- Consumers: record an event handled (the purge locks the rows it deletes, which needs UPDATE).
grant select, insert, update, delete on outbox_relay.inbox to outbox_consumer;
