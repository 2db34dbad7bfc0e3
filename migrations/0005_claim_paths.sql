-- The claim's two paths (see src/sql/events.rs): events without a key are taken in
-- (available_at, id) order from an index that holds nothing else, so that no backlog of keyed
-- events waiting behind their heads is ever scanned for them; keyed heads are found by walking
-- outbox_pending_key_idx (migration 0004) one key at a time.
--
-- On a large outbox, building the index holds writers back for as long as it takes; to avoid
-- that, create it beforehand with CREATE INDEX CONCURRENTLY under the same name and definition
-- (this migration then finds it in place).

create index if not exists outbox_pending_unkeyed_idx
    on outbox_relay.outbox (available_at, id) where processed_at is null and key is null;

comment on index outbox_relay.outbox_pending_unkeyed_idx is
    'Pending events without a key, in claim order.';
