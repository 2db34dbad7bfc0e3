-- The outbox in leaves of time (issue 42). Since migration 0019 the sweeper removes the events
-- every destination has passed once their retention is over, by range deletes. Those leave dead
-- rows that vacuum may not remove while any snapshot older than the deletes is held (a
-- transaction open for minutes, a long report, a dump): the table grew with the hold, not with
-- the retention. Truncation frees a table's disk whatever is held, so the outbox is now a table
-- list-partitioned by `slot`, a column writers fill without a read of their own (the transaction's
-- clock: `outbox_relay.current_slot()`, four slots of `span` seconds used in turn, thirty minutes
-- unless `outbox_relay.set_slot_span` says otherwise), and each relay's sweeper truncates a leaf
-- once it has removed every row of it (`outbox_relay.truncate_leaf`): that removes nothing the
-- sweeper has not removed already, and frees what a held snapshot keeps.
--
-- * Writers change nothing: `slot` has a default (a row written by hand with its own slot is
--   refused unless the slot is one of the leaves', and a row's slot never changes).
-- * The outbox of before is attached as the leaf of slot -1 (`outbox_relay.outbox_before`), not
--   copied: this reads it once, under its lock, to check every row's slot and to build the
--   leaf's index on (id, slot) (0.5 s for a million events here: writers and claims wait). No
--   new row goes there; once the sweeper has emptied it, it is truncated like any leaf.
-- * Its checks (as valid as they were), triggers (as enabled), comments, grants (of the table
--   and of its columns), its id sequence and the view `event_state` move to the new table; the
--   new leaves take its storage options; a publication of it publishes the new table too. A view
--   of the service's own on the outbox is refused, naming it (it would go on reading the old
--   table): drop it, migrate, create it again.
-- * A primary key on (id, slot): PostgreSQL allows no unique index on a partitioned table without
--   its partition key. Ids still come from one sequence.

-- The slots: four, each `span` seconds of the clock (the writing transaction's start), used in
-- turn. `slot_at` is inlined into the column's default, so that a write costs no lookup and no
-- function call (stable, not immutable: `extract` from a timestamptz is stable, and an immutable
-- SQL function with a stable body is called, not inlined); it is written again, with the new
-- span, by `set_slot_span`.
create table outbox_relay.slot_span (
    one boolean primary key default true check (one),
    seconds integer not null check (seconds between 1 and 86400)
);
insert into outbox_relay.slot_span (seconds) values (1800);
comment on table outbox_relay.slot_span is
    'How many seconds of the clock each of the outbox''s four slots (its leaves) takes in turn; '
    'outbox_relay.set_slot_span changes it.';

create function outbox_relay.slot_at(at timestamptz) returns smallint
language sql stable parallel safe as $$
    select ((floor(extract(epoch from $1))::int8 / 1800) % 4)::int2
$$;
comment on function outbox_relay.slot_at(timestamptz) is
    'The outbox slot (leaf) a transaction that started at this time writes into.';

create function outbox_relay.current_slot() returns smallint
language sql stable parallel safe as $$
    select outbox_relay.slot_at(now())
$$;
comment on function outbox_relay.current_slot() is
    'The outbox slot (leaf) this transaction writes into: the default of outbox.slot.';

-- Sets the span of a slot (seconds) for the transactions that start from now on: `slot_at` is
-- written again, and the plans that inlined it are made again. Rows already written stay where
-- they are; a leaf is truncated only once nothing in it is visible, whatever its slot's time.
-- Only the owner of the schema's functions may run it (it replaces one).
create function outbox_relay.set_slot_span(seconds integer) returns void
language plpgsql as $$
begin
    if seconds is null or seconds < 1 or seconds > 86400 then
        raise exception 'a slot''s span must be 1 to 86400 seconds, not %', coalesce(seconds::text, 'null')
            using errcode = 'invalid_parameter_value';
    end if;
    update outbox_relay.slot_span set seconds = set_slot_span.seconds;
    execute format($f$create or replace function outbox_relay.slot_at(at timestamptz) returns smallint
language sql stable parallel safe as 'select ((floor(extract(epoch from $1))::int8 / %s) %% 4)::int2'$f$, seconds);
end
$$;
revoke execute on function outbox_relay.set_slot_span(integer) from public;
comment on function outbox_relay.set_slot_span(integer) is
    'Sets how many seconds each of the outbox''s four slots takes, for transactions that start from now on.';

-- A view of the service's own on the outbox would go on reading the old table (a view keeps its
-- table's oid), which gets no new row: refused, naming it, rather than left to read less and less.
do $$
declare
    views text := (select string_agg(distinct quote_ident(n.nspname) || '.' || quote_ident(v.relname), ', ')
                     from pg_depend d join pg_rewrite r on r.oid = d.objid join pg_class v on v.oid = r.ev_class
                     join pg_namespace n on n.oid = v.relnamespace
                    where d.classid = 'pg_rewrite'::regclass and d.refobjid = 'outbox_relay.outbox'::regclass
                      and v.oid <> 'outbox_relay.event_state'::regclass);
begin
    if views is not null then
        raise exception 'the views % read outbox_relay.outbox, which migration 0024 makes a partitioned table: drop them, migrate, and create them again', views
            using errcode = 'dependent_objects_still_exist';
    end if;
end
$$;

-- The view that reads the outbox is made again on the new table (a view keeps its table's oid):
-- its text, comment and grants are kept here and restored below.
create temporary table migration_0024_view on commit drop as
select pg_get_viewdef('outbox_relay.event_state'::regclass) as body,
       obj_description('outbox_relay.event_state'::regclass, 'pg_class') as note,
       (select relacl from pg_class where oid = 'outbox_relay.event_state'::regclass) as acl;
drop view outbox_relay.event_state;

alter table outbox_relay.outbox rename to outbox_before;
alter index outbox_relay.outbox_xid_id_by_xid_idx rename to outbox_before_xid_id_by_xid_idx;
alter table outbox_relay.outbox_before add column slot smallint not null default -1;
-- Every row's slot, checked once here so that the attach below need not read the table again.
alter table outbox_relay.outbox_before add constraint outbox_before_slot check (slot = -1);
-- The primary key a leaf needs, (id, slot): with one slot in it, as unique as its id alone.
create unique index outbox_before_pkey on outbox_relay.outbox_before (id, slot);
alter table outbox_relay.outbox_before drop constraint outbox_pkey;
alter table outbox_relay.outbox_before add constraint outbox_before_pkey primary key using index outbox_before_pkey;

create table outbox_relay.outbox (
    id           bigint not null default nextval('outbox_relay.outbox_id_seq'::regclass),
    topic        text not null,
    key          text,
    payload      jsonb not null,
    created_at   timestamptz not null default now(),
    available_at timestamptz not null default now(),
    xid          xid8 not null default pg_current_xact_id(),
    uuid         uuid not null default gen_random_uuid(),
    headers      jsonb,
    slot         smallint not null default outbox_relay.current_slot(),
    constraint outbox_pkey primary key (id, slot)
) partition by list (slot);
create index outbox_xid_id_by_xid_idx on outbox_relay.outbox (xid, id) where xid <> '0'::xid8;
alter sequence outbox_relay.outbox_id_seq owned by outbox_relay.outbox.id;

-- Every check of the old table, as valid as it was there: those its old rows need not pass
-- (added NOT VALID by 0003 and 0013 where rows broke them) stay NOT VALID, since an attach
-- refuses a partition whose check is NOT VALID where its parent's is valid.
do $$
declare
    c record;
begin
    for c in select conname, pg_get_constraintdef(oid) as def, convalidated from pg_constraint
              where conrelid = 'outbox_relay.outbox_before'::regclass and contype = 'c'
                and conname <> 'outbox_before_slot'
    loop
        execute format('alter table outbox_relay.outbox add constraint %I %s%s', c.conname,
                       replace(c.def, ' NOT VALID', ''), case when c.convalidated then '' else ' not valid' end);
    end loop;
end
$$;

alter table outbox_relay.outbox attach partition outbox_relay.outbox_before for values in (-1);
-- The leaves of the slots, with the old table's storage options (autovacuum's, a fillfactor).
do $$
declare
    options text := (select array_to_string(reloptions, ', ') from pg_class where oid = 'outbox_relay.outbox_before'::regclass);
begin
    for s in 0..3 loop
        execute format('create table outbox_relay.outbox_%s partition of outbox_relay.outbox for values in (%s)%s', s, s,
                       case when options is not null then ' with (' || options || ')' else '' end);
        -- Each transaction's events are few compared to the table (migration 0008): the
        -- statistics of a partitioned table's column are not its leaves'.
        execute format('alter table outbox_relay.outbox_%s alter column xid set (n_distinct = -1)', s);
    end loop;
end
$$;
-- A publication of the outbox (change data capture) publishes the new table too.
do $$
declare
    p text;
begin
    for p in select pub.pubname from pg_publication_rel r join pg_publication pub on pub.oid = r.prpubid
              where r.prrelid = 'outbox_relay.outbox_before'::regclass
    loop
        execute format('alter publication %I add table outbox_relay.outbox', p);
    end loop;
end
$$;

-- The triggers move to the new table (a row trigger is cloned into every leaf); one someone
-- disabled stays disabled (below).
create temporary table migration_0024_disabled on commit drop as
select t.tgname from pg_trigger t
 where t.tgrelid = 'outbox_relay.outbox_before'::regclass and not t.tgisinternal and t.tgenabled = 'D';
drop trigger if exists outbox_xid_is_the_inserters on outbox_relay.outbox_before;
drop trigger if exists outbox_keep_ids_unique on outbox_relay.outbox_before;
drop trigger if exists outbox_notify_relay on outbox_relay.outbox_before;
create trigger outbox_xid_is_the_inserters
    before insert or update of xid on outbox_relay.outbox
    for each row when (new.xid is distinct from pg_current_xact_id())
    execute function outbox_relay.refuse_foreign_xid();
create trigger outbox_keep_ids_unique
    after truncate on outbox_relay.outbox
    for each statement execute function outbox_relay.keep_ids_unique();
create trigger outbox_notify_relay
    after insert on outbox_relay.outbox
    for each statement when (outbox_relay.relay_waiting())
    execute function outbox_relay.notify_relay();
do $$
declare
    t text;
begin
    for t in select tgname from migration_0024_disabled loop
        execute format('alter table outbox_relay.outbox disable trigger %I', t);
    end loop;
end
$$;

-- A row keeps its slot: a truncate of a leaf trusts that a row visible in it was written there
-- by its own transaction (its `xid`), which an update moving an older row in would break.
create function outbox_relay.refuse_slot_change() returns trigger
language plpgsql as $$
begin
    raise exception 'an outbox row''s slot cannot change (event %: % to %)', old.id, old.slot, new.slot
        using errcode = 'check_violation',
              hint = 'The slot is the leaf a row was written into (outbox_relay.current_slot()).';
end
$$;
create trigger outbox_slot_is_kept
    before update of slot on outbox_relay.outbox
    for each row when (new.slot is distinct from old.slot)
    execute function outbox_relay.refuse_slot_change();

-- Comments and grants, of the table and of each column, as they were.
do $$
declare
    c record;
begin
    execute format('comment on table outbox_relay.outbox is %L',
                   obj_description('outbox_relay.outbox_before'::regclass, 'pg_class'));
    for c in select a.attname, col_description(a.attrelid, a.attnum) as note from pg_attribute a
              where a.attrelid = 'outbox_relay.outbox_before'::regclass and a.attnum > 0 and not a.attisdropped
                and col_description(a.attrelid, a.attnum) is not null
    loop
        execute format('comment on column outbox_relay.outbox.%I is %L', c.attname, c.note);
    end loop;
    for c in select case when g.grantee = 0 then 'public' else quote_ident(g.grantee::regrole::text) end as who,
                    g.privilege_type, g.is_grantable
               from pg_class t cross join lateral aclexplode(t.relacl) g
              where t.oid = 'outbox_relay.outbox_before'::regclass and g.grantee <> t.relowner
    loop
        execute format('grant %s on outbox_relay.outbox to %s%s', c.privilege_type, c.who,
                       case when c.is_grantable then ' with grant option' else '' end);
    end loop;
    for c in select a.attname, case when g.grantee = 0 then 'public' else quote_ident(g.grantee::regrole::text) end as who,
                    g.privilege_type, g.is_grantable
               from pg_attribute a cross join lateral aclexplode(a.attacl) g
              where a.attrelid = 'outbox_relay.outbox_before'::regclass and a.attnum > 0 and not a.attisdropped
    loop
        execute format('grant %s (%I) on outbox_relay.outbox to %s%s', c.privilege_type, c.attname, c.who,
                       case when c.is_grantable then ' with grant option' else '' end);
    end loop;
end
$$;
comment on column outbox_relay.outbox.slot is
    'The leaf the row was written into: the writing transaction''s slot of time (outbox_relay.current_slot()); '
    '-1 for the rows written before migration 0024.';
comment on table outbox_relay.outbox_before is
    'The outbox''s rows written before migration 0024 (slot -1): truncated once the sweeper has removed them all.';

do $$
declare
    v record;
    g record;
begin
    select * into v from migration_0024_view;
    execute 'create view outbox_relay.event_state as ' || v.body;
    execute format('comment on view outbox_relay.event_state is %L', v.note);
    for g in select case when a.grantee = 0 then 'public' else quote_ident(a.grantee::regrole::text) end as who,
                    a.privilege_type, a.is_grantable
               from aclexplode(v.acl) a
              where a.grantee <> (select relowner from pg_class where oid = 'outbox_relay.event_state'::regclass)
    loop
        execute format('grant %s on outbox_relay.event_state to %s%s', g.privilege_type, g.who,
                       case when g.is_grantable then ' with grant option' else '' end);
    end loop;
end
$$;

-- The truncation of a leaf, by each relay's sweeper (src/relay/rotation.rs). It runs as the owner
-- of this function (the relay's role may not truncate), and truncates only a leaf in which
-- nothing is visible: every row the sweeper removed, every row a transaction that did not commit
-- wrote. Returns 'truncated', 'rows' (something is visible in it), 'locked' (its lock was not
-- granted within `lock_wait_ms`: a claim in flight, a dump), or 'empty' (nothing to free).
--
-- The first look reads the whole leaf without its lock (under a held snapshot, every row removed
-- since the hold is read): `checked` is its snapshot, given back to the caller, who passes it in
-- again for its next try of the same leaf after 'locked'. Under the leaf's lock (no transaction
-- is writing into it any more) the look is done again, but only for the rows that snapshot could
-- not see: the rows of the transactions in progress for it and of those after it (their `xid`,
-- one probe each through the (xid, id) index), so that a try under the lock costs no full read.
-- A row's slot never changes (`outbox_slot_is_kept`), and its `xid` is its writer's.
create function outbox_relay.truncate_leaf(slot smallint, checked pg_snapshot, lock_wait_ms integer,
                                           out outcome text, out seen pg_snapshot)
language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
declare
    leaf regclass;
    found boolean;
    lock_timeout_was text := current_setting('lock_timeout');
begin
    select i.inhrelid::regclass into leaf
      from pg_inherits i
     where i.inhparent = 'outbox_relay.outbox'::regclass
       and i.inhrelid = to_regclass(case when truncate_leaf.slot = -1 then 'outbox_relay.outbox_before'
                                         else 'outbox_relay.outbox_' || truncate_leaf.slot end);
    if leaf is null then
        raise exception 'the outbox has no leaf for slot %', truncate_leaf.slot using errcode = 'invalid_parameter_value';
    end if;
    -- The look under the lock needs a snapshot taken after the lock: each statement's own, as in
    -- READ COMMITTED; a transaction's one snapshot would not see what committed meanwhile.
    if current_setting('transaction_isolation') <> 'read committed' then
        raise exception 'outbox_relay.truncate_leaf runs only in a read committed transaction, not %',
                        current_setting('transaction_isolation')
            using errcode = 'invalid_transaction_state';
    end if;
    -- A snapshot this cluster has not reached (another cluster's, or made up) is no proof of
    -- anything here: the leaf is read whole again.
    seen := case when pg_snapshot_xmax(checked) <= pg_snapshot_xmax(pg_current_snapshot()) then checked end;
    if pg_relation_size(leaf) = 0 then
        outcome := 'empty';
        return;
    end if;
    if seen is null then
        perform set_config('enable_seqscan', 'on', true);
        execute format('select pg_current_snapshot(), exists (select 1 from %s)', leaf) into seen, found;
        if found then
            outcome := 'rows';
            seen := null;
            return;
        end if;
    end if;
    begin
        perform set_config('lock_timeout', greatest(lock_wait_ms, 1) || 'ms', true);
        execute format('lock table %s in access exclusive mode', leaf);
    exception when lock_not_available then
        outcome := 'locked';
        return;
    end;
    perform set_config('lock_timeout', lock_timeout_was, true);
    execute format('select exists (select 1 from %s e where e.xid >= $1 and e.xid <> ''0''::xid8)
                       or exists (select 1 from %s e, pg_snapshot_xip($2) x(xid) where e.xid = x.xid and e.xid <> ''0''::xid8)',
                   leaf, leaf)
       into found using pg_snapshot_xmax(seen), seen;
    if found then
        outcome := 'rows';
        seen := null;
        return;
    end if;
    execute format('truncate %s', leaf);
    outcome := 'truncated';
    seen := null;
end
$$;
revoke execute on function outbox_relay.truncate_leaf(smallint, pg_snapshot, integer) from public;
comment on function outbox_relay.truncate_leaf(smallint, pg_snapshot, integer) is
    'Truncates the outbox''s leaf of a slot when nothing in it is visible any more (the sweeper removed '
    'every row): truncated, rows, locked or empty. Run by each relay''s sweeper.';

-- The relay's role: a claim reads each leaf by its name (src/sql/claim_new.sql), so whoever may
-- read the outbox may read its leaves; whoever may delete from it (the sweeper) may truncate a
-- leaf so.
do $$
declare
    g record;
begin
    for g in select distinct case when a.grantee = 0 then 'public' else quote_ident(a.grantee::regrole::text) end as who,
                    a.privilege_type
               from pg_class t cross join lateral aclexplode(t.relacl) a
              where t.oid = 'outbox_relay.outbox'::regclass and a.privilege_type in ('SELECT', 'DELETE')
                and a.grantee <> t.relowner
    loop
        if g.privilege_type = 'SELECT' then
            execute format('grant select on outbox_relay.outbox_before, outbox_relay.outbox_0, outbox_relay.outbox_1, '
                           'outbox_relay.outbox_2, outbox_relay.outbox_3 to %s', g.who);
        else
            execute format('grant execute on function outbox_relay.truncate_leaf(smallint, pg_snapshot, integer) to %s', g.who);
        end if;
    end loop;
end
$$;
