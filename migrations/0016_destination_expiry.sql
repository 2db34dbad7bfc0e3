-- Registrations that age (issue 40): a destination records when a relay last served it, and the
-- registering relay's `destination_expiry` (null: never). A destination that no relay has served
-- for its expiry stops keeping events in the outbox: a relay's janitor moves what waits for it
-- (its parked events, and the new events its position has not passed) to its dead letters and
-- drops it, the way a message broker expires an idle consumer group. Nothing is lost: the dead
-- letters keep every event, and `dead-letters retry` sends them again once a relay serves the
-- destination.

alter table outbox_relay.destinations
    add column served_at timestamptz not null default now(),
    add column expire_after interval,
    add constraint destinations_expire_after_positive check (expire_after > interval '0');

comment on column outbox_relay.destinations.served_at is
    'When a relay last served the destination: its registration, then each janitor pass of a relay connected to it.';
comment on column outbox_relay.destinations.expire_after is
    'The destination expires once no relay has served it for this long (the registering relay''s destination_expiry); null: never.';
