-- Several destinations in one database (issue 22): each event goes to every destination whose
-- topic pattern matches it, and each destination is delivered to on its own.
--
-- * A destination is registered by the first relay that delivers to it
--   (`outbox_relay.destinations`), with its pattern and the number of its new events' lock.
-- * Each destination has its own position (`positions.destination`): its claims read the same
--   new events, by transaction snapshots above its own position, and take those its pattern
--   matches. A down or paused destination leaves its position where it is; the others go on.
-- * What waits for one destination (a failure, a delay, a paused topic, an event behind its key,
--   a lease) waits in `outbox_relay.parked`, a copy of the event per destination, claimed from
--   there. The outbox row itself is no longer changed by a delivery.
-- * An outbox row is done once every registered destination's position has passed it: the claim
--   that passes it last deletes it (or marks it processed) in its own transaction, and the
--   janitor does the rest (rows passed last by a destination their pattern does not match). A
--   row that no registered destination's pattern matches goes to the dead letters with the
--   destination '' and says so: it is never dropped silently.
-- * Dead letters and pauses name their destination.
--
-- Migration of a live installation: the single position becomes the *origin* (destination ''),
-- which the first registered destination starts from, so that a relay of this version delivering
-- to one destination goes on exactly where the last one stopped. Parked events (failed, delayed,
-- paused, behind their key, leased) move to `parked` as the destination `default`'s, the name a
-- relay with a single sink delivers to; dead letters are `default`'s too.

create table outbox_relay.destinations (
    name          text not null,
    pattern       text not null,
    topic_regex   text,
    lock_id       integer generated always as identity (start with 1),
    registered_at timestamptz not null default now(),
    constraint destinations_pkey primary key (name),
    constraint destinations_lock_id_key unique (lock_id),
    constraint destinations_name_valid check (name ~ '^[A-Za-z0-9._:/*#-]{1,255}$'),
    constraint destinations_pattern_length check (char_length(pattern) between 1 and 255)
);

comment on table outbox_relay.destinations is
    'Where events go: every event to each destination whose topic pattern matches it. Registered by the relays.';
comment on column outbox_relay.destinations.pattern is
    'The topic pattern as given: words split on ".", "*" one word, "#" zero or more words.';
comment on column outbox_relay.destinations.topic_regex is
    'The pattern as a POSIX regular expression over ''.'' || topic; null for "#", which matches every topic.';
comment on column outbox_relay.destinations.lock_id is
    'The second key of the advisory lock its claims of new events take (the first is 1869901932; 0 is the origin''s).';

alter table outbox_relay.positions add column destination text not null default '';
alter table outbox_relay.positions alter column destination drop default;
alter table outbox_relay.positions drop constraint positions_pkey;
alter table outbox_relay.positions add constraint positions_pkey primary key (destination, n);

comment on column outbox_relay.positions.destination is
    'The destination whose position this is; '''' is the origin that the first destination starts from.';

create table outbox_relay.parked (
    destination  text not null,
    id           bigint not null,
    uuid         uuid not null,
    topic        text not null,
    key          text,
    payload      jsonb not null,
    created_at   timestamptz not null,
    available_at timestamptz not null default now(),
    attempts     integer not null default 0,
    last_error   text,
    lease_token  bigint,
    parked_at    timestamptz not null default now(),
    -- A copy of an outbox row as it is, also one written by hand past the outbox's checks: a
    -- claim must never fail on a row (the relay dead-letters what no handler can be given).
    constraint parked_pkey primary key (destination, id)
);

comment on table outbox_relay.parked is
    'Events that wait for one destination (failed, delayed, paused, behind their key, leased): a copy per destination, claimed from here.';
comment on column outbox_relay.parked.available_at is
    'Not delivered before this time: a delay, a retry''s backoff, or the lease of a delivery in progress.';
comment on column outbox_relay.parked.lease_token is
    'Set by the claim that leased the event; its outcome is recorded only where the token still matches.';

-- The walk over a destination's waiting keys (their lowest id first), the events without a key
-- in due order, and the next due moment.
create index parked_key_idx on outbox_relay.parked (destination, key, id) where key is not null;
create index parked_unkeyed_idx on outbox_relay.parked (destination, available_at, id) where key is null;
create index parked_due_idx on outbox_relay.parked (destination, available_at);

insert into outbox_relay.parked (destination, id, uuid, topic, key, payload, created_at, available_at, attempts,
                                 last_error, lease_token)
select 'default', id, uuid, topic, key, payload, created_at, available_at, attempts, last_error, lease_token
  from outbox_relay.outbox
 where parked and processed_at is null;
delete from outbox_relay.outbox where parked and processed_at is null;

-- A delivery no longer changes the outbox row (the parked indexes go with the column).
alter table outbox_relay.outbox drop column parked, drop column lease_token, drop column last_error;
comment on column outbox_relay.outbox.processed_at is
    'With completion "mark": when every destination had passed the event (it is kept for the retention).';
comment on column outbox_relay.outbox.available_at is
    'Not delivered before this time: a delayed event waits in outbox_relay.parked until then.';

alter table outbox_relay.dead_letters add column destination text not null default 'default';
alter table outbox_relay.dead_letters alter column destination drop default;
alter table outbox_relay.dead_letters drop constraint dead_letters_pkey;
alter table outbox_relay.dead_letters add constraint dead_letters_pkey primary key (destination, id);
drop index outbox_relay.dead_letters_key_idx;
create index dead_letters_key_idx on outbox_relay.dead_letters (destination, key, id) where key is not null;
create index dead_letters_id_idx on outbox_relay.dead_letters (id);

comment on column outbox_relay.dead_letters.destination is
    'The destination that refused the event; '''' when no destination''s pattern matched its topic.';

alter table outbox_relay.pauses add column destination text not null default '';
alter table outbox_relay.pauses drop constraint pauses_pkey;
alter table outbox_relay.pauses add constraint pauses_pkey primary key (destination, topic);
alter table outbox_relay.pauses add constraint pauses_destination_length check (char_length(destination) <= 255);

comment on column outbox_relay.pauses.destination is
    'The destination paused; '''' for every destination.';

alter table outbox_relay.relays add column destination text;

comment on column outbox_relay.relays.destination is
    'The destination this relay delivers to (a process with several routes has a row per destination).';
