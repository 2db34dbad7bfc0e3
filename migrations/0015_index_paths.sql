-- Index paths that hold when the statistics say the outbox is empty (issue 39).
--
-- The outbox is empty most of the time, so an analyze (autovacuum's, between two bursts, or under
-- a held transaction that keeps every deleted row) often records 0 rows over many pages, beside
-- the columns' statistics of an earlier one. Every index then looks free to walk, and:
--
-- * the statements that find events by id (the claim's read of what it took, recording
--   deliveries, the sweeper's finish) chose the (xid, id) index with the id as a condition on its
--   second column: each run walked every page of the index, the dead entries a held transaction
--   keeps included (0.2 to 0.9 s a statement after minutes at 800 events/s, until the next
--   analyze). The index is built again with a condition every row meets (no transaction has the
--   id 0; the trigger of migration 0009 lets a row name only the transaction that writes it) and
--   that only a statement stating it lets the planner use: the claims' probes and the sweeper's
--   cursor add `xid <> '0'::xid8`; a statement that names events by id has the primary key alone.
-- * the janitor's deletion of events processed past their retention (`--completion mark`) walked
--   the primary key from its first entry once a minute, past every dead entry (200,000 pages after
--   4 minutes of a hold), also where no event is ever marked processed. It reads the processed
--   events through an index of their own, empty when events are deleted as they are delivered.
--
-- Relays of an earlier version do not state that condition: once this migration is applied,
-- their claims read new events through the primary key (the whole outbox, each claim) until they
-- are restarted with this version. Apply it with the new relays (`run --migrate`, or `migrate`
-- right before them) and replace the old ones promptly.
--
-- On a large outbox, building the indexes holds writers back for as long as it takes; to avoid
-- that, build them beforehand with CREATE INDEX CONCURRENTLY under the names and definitions
-- below (this migration then finds them in place).

create index if not exists outbox_xid_id_by_xid_idx on outbox_relay.outbox (xid, id) where xid <> '0'::xid8;
drop index outbox_relay.outbox_xid_id_idx;

comment on index outbox_relay.outbox_xid_id_by_xid_idx is
    'Events in (xid, id) order, for the statements that read by transaction id and state xid <> ''0''.';

create index if not exists outbox_processed_idx on outbox_relay.outbox (processed_at) where processed_at is not null;

comment on index outbox_relay.outbox_processed_idx is
    'Events marked processed, oldest first, for the janitor (--completion mark).';
