-- An event's `xid` is the transaction that inserts it, whoever writes the row (issue 20).
--
-- Claims read new events by transaction snapshots (0008): an event is found in the delta of the
-- claim whose snapshot first sees its transaction commit. An event written by hand with another
-- transaction's id, one committed before the position (`'2'`, say), is in no delta: no claim of
-- new events would ever read it, and it would wait unseen while `status` counted it pending. The
-- writers' role could not set the column (`migrations/optional/least_privilege_roles.sql` grants
-- no insert on it), but the table's owner and the relay's role could. This trigger refuses such a
-- row, naming the event and both transactions; leaving the column out (its default) or naming
-- the inserting transaction passes. Its condition is evaluated without calling the function, so a
-- row written the usual way costs one comparison.

create function outbox_relay.refuse_foreign_xid() returns trigger
    language plpgsql
as $$
begin
    raise exception 'outbox_relay.outbox: event % names transaction % in xid, but transaction % writes it', new.id, new.xid, pg_current_xact_id()
        using errcode = 'check_violation',
              detail = 'Relays read new events by the transaction that inserted them: an event with another transaction''s id may lie before every relay''s position, where none would ever deliver it.',
              hint = 'Leave xid out of the insert: its default is the inserting transaction.';
end
$$;

comment on function outbox_relay.refuse_foreign_xid() is
    'Refuses an outbox row whose xid is not the writing transaction''s (a hand-written row no claim of new events would read).';

create trigger outbox_xid_is_the_inserters
    before insert or update of xid on outbox_relay.outbox
    for each row
    when (new.xid is distinct from pg_current_xact_id())
    execute function outbox_relay.refuse_foreign_xid();
