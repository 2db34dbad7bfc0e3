-- Claims that a long transaction cannot slow down (issue 20; docs/storage.md says why).
--
-- Until 0007 every claim read the pending indexes from their start. A delivered event leaves a
-- dead entry there, and while any snapshot older than it is open (a report, pg_dump, a forgotten
-- psql session) vacuum may not remove it: every claim waded through every event delivered since
-- the oldest snapshot, and the relay stalled and then ate the machine.
--
-- From here on a claim reads *new* events by transaction snapshots, as PgQ does:
--
-- * Each event carries the id of the transaction that inserted it (`xid`).
-- * `outbox_relay.positions` holds the snapshot up to which new events were claimed. A claim
--   takes a new snapshot S: the new events are those of transactions visible in S and not in the
--   position C, that is, of transactions in C's in-progress list or from C's xmax on. Both are
--   ranges of the `xid` index above the position: the claim never reads an entry of an event it
--   claimed before, so no dead entry is ever on its path, however old the oldest snapshot is.
--   Commit order is exact: an event whose transaction commits after later ids were claimed is in
--   a later delta, never skipped.
-- * New events are claimed by one transaction at a time (an advisory lock held to its end), so
--   a key's new events are claimed in id order, batch after batch (the relay hands a batch's
--   events of one key over one after the other).
-- * An event that cannot be delivered when its delta is claimed (delayed, of a paused topic,
--   behind an earlier undelivered event of its key, held by a dead letter) and one whose delivery
--   failed or outlived its claim's hold is *parked* (`parked`): parked events are claimed from
--   small partial indexes of their own, as 0007 claimed pending ones (a key's lowest id first,
--   when due, row-locked). Their churn is per failure, delay or lease, never per delivered event.
--
-- A delivered event is still deleted (or marked processed), but no claim reads its dead entry
-- again: the new-event path reads ranges above the position, and the parked indexes never held
-- it.
--
-- Migration of a live installation: every pending event becomes parked (with its attempts, error,
-- backoff and lease as they are: parked events are claimed exactly as 0007 claimed pending ones),
-- and carries the frozen transaction id 2, which is before every position. Delivered rows kept
-- for their retention stay delivered. The position starts at a snapshot taken here: this
-- transaction inserts no event, and a writer that was waiting for its lock inserts after it with
-- its own xid, in the position's in-progress list or past its xmax.

alter table outbox_relay.outbox
    add column parked boolean not null default false,
    add column xid xid8 not null default '2'::xid8;
alter table outbox_relay.outbox alter column xid set default pg_current_xact_id();

comment on column outbox_relay.outbox.xid is
    'The transaction that inserted the event: claims read new events by transaction snapshots (outbox_relay.positions).';
comment on column outbox_relay.outbox.parked is
    'Set when the event could not be delivered when the claims reached it (delayed, paused, behind its key, failed, leased): it is claimed from the parked indexes.';

update outbox_relay.outbox set parked = true where processed_at is null;

drop index outbox_relay.outbox_pending_idx;
drop index outbox_relay.outbox_pending_key_idx;
drop index outbox_relay.outbox_pending_unkeyed_idx;

create index outbox_xid_idx on outbox_relay.outbox (xid);
-- The claim's probes are equalities on xid (a position's in-progress transactions), run with
-- generic plans. A sample taken after a bulk insert (a few transactions, thousands of events
-- each) makes the planner expect an xid to match a large part of the table, and prefer another
-- index: the plan is kept for the life of the relay's session. Events of one transaction are
-- few compared to the table: say so (from the next ANALYZE on).
alter table outbox_relay.outbox alter column xid set (n_distinct = -1);

create index outbox_parked_key_idx on outbox_relay.outbox (key, id)
    where parked and processed_at is null and key is not null;
create index outbox_parked_unkeyed_idx on outbox_relay.outbox (available_at, id)
    where parked and processed_at is null and key is null;
create index outbox_parked_due_idx on outbox_relay.outbox (available_at)
    where parked and processed_at is null;

-- The newest row is the position: new events of transactions visible in `snapshot` and not in
-- `since` are claimed, those with ids up to `after_id` when it is set (a delta larger than a
-- batch goes on in id order). Rows are only inserted, one per claim that moves the position,
-- numbered `n`: a claim whose read of the position was overtaken by another's commit conflicts on
-- the key and claims nothing. The janitor deletes old rows, whose dead entries a claim never
-- reaches (it reads the newest, from the end of the index).
create table outbox_relay.positions (
    n         bigint not null,
    since     pg_snapshot not null,
    snapshot  pg_snapshot not null,
    after_id  bigint,
    at        timestamptz not null default now(),
    constraint positions_pkey primary key (n)
);

comment on table outbox_relay.positions is
    'How far new events were claimed, as transaction snapshots; the newest row counts.';

insert into outbox_relay.positions (n, since, snapshot) values (0, pg_current_snapshot(), pg_current_snapshot());
