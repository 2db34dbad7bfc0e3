-- Paused delivery, kept in the database so that a pause survives restarts and applies to every
-- relay on this database (each re-reads this table about once a second). A row per paused
-- topic; the empty topic (no event can have it) pauses every topic. Paused events stay
-- pending: no relay claims them, so no attempt is charged.

create table if not exists outbox_relay.pauses (
    topic     text primary key,
    paused_at timestamptz not null default now(),
    paused_by text not null default current_user,
    constraint pauses_topic_length check (char_length(topic) <= 255)
);

comment on table outbox_relay.pauses is
    'Topics whose events no relay claims until resumed; the empty topic pauses them all.';
