#!/usr/bin/env bash
# What a partitioned outbox would cost a claim's reads (issue 42: a disk bounded by the retention
# under a held snapshot needs partitions that a rotation truncates). Compares, on tables shaped
# like the outbox with 300,000 rows written by 300 transactions:
#   flat    one table (today's outbox: a unique index on id, the (xid, id) index);
#   parted  list-partitioned by an expression of the id, `(id >> 16) & 7` (8 leaves of 65,536
#           ids each, reused in turn: writers fill the key without a read), a unique index on
#           id in each leaf (a partitioned table cannot have one on an expression key), the
#           (xid, id) index on the parent.
# Each query is run by pgbench with prepared statements and the relay's session settings
# (generic plans, no sequential or bitmap scans, no JIT), one client, SECONDS each, alternately:
#   scan_xid      the first path of a claim: 501 rows from an xid on, in xid order;
#   scan_id       a cut delta's path: 501 rows from an id on, in id order;
#   read_parent   scan_id, then its rows read again by tuple id through the parent (the claim's
#                 `o.ctid = any (...)`; on a partitioned table every leaf is read with every tuple id,
#                 so the claim would also have to check that the row is its own);
#   read_leaves   scan_id, then its rows read again by tuple id naming each leaf (its own tuple ids).
#
#   bash benches/storage/partitioned_reads.sh 'postgresql://postgres@127.0.0.1:5432/postgres' [SECONDS] [ROUNDS]
#
# PostgreSQL 15 or later (min and max of xid8). It makes, and drops at the end, the schema
# `partitioned_reads` in that database (one of that name already there is dropped first).
set -euo pipefail
db=${1:?usage: partitioned_reads.sh DATABASE_URL [SECONDS] [ROUNDS]}
secs=${2:-4}
rounds=${3:-3}
work=$(mktemp -d)
psql() { PGOPTIONS="-c client_min_messages=warning" command psql -v ON_ERROR_STOP=1 -XAtq "$db" "$@"; }
trap 'psql -c "drop schema if exists partitioned_reads cascade" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT

psql -c "drop schema if exists partitioned_reads cascade" -c "create schema partitioned_reads" \
    -c "create table partitioned_reads.flat (
            id bigint primary key, topic text not null, key text, payload jsonb not null,
            created_at timestamptz not null default now(), xid xid8 not null default pg_current_xact_id(),
            uuid uuid not null default gen_random_uuid())" \
    -c "create index on partitioned_reads.flat (xid, id) where xid <> '0'::xid8" \
    -c "create table partitioned_reads.parted (like partitioned_reads.flat including defaults)
            partition by list (((id >> 16) & 7))" \
    -c "do \$\$ begin for s in 0..7 loop
            execute format('create table partitioned_reads.parted_%s partition of partitioned_reads.parted for values in (%s)', s, s);
            execute format('create unique index on partitioned_reads.parted_%s (id)', s);
        end loop; end \$\$" \
    -c "create index on partitioned_reads.parted (xid, id) where xid <> '0'::xid8"
# 300 transactions of 1,000 rows, the same rows in both tables.
for t in $(seq 0 299); do
    echo "begin;
insert into partitioned_reads.flat (id, topic, key, payload)
select g, 'order.placed', 'order-' || (g % 100), jsonb_build_object('n', g, 'customer', repeat('x', 160))
  from generate_series($t * 1000 + 1, $t * 1000 + 1000) g;
insert into partitioned_reads.parted select * from partitioned_reads.flat where id > $t * 1000;
commit;"
done | psql >/dev/null
psql -c "vacuum analyze partitioned_reads.flat, partitioned_reads.parted"
xids=$(psql -c "select min(xid)::text || ' ' || max(xid)::text from partitioned_reads.flat")
read -r xlo xhi <<<"$xids"

scan_xid() {
    echo "\\set x random($xlo, $xhi)
select count(*) from (select e.id, e.ctid from partitioned_reads.$1 e
  where e.xid >= (:x)::text::xid8 and e.xid <> '0'::xid8 order by e.xid limit 501) c;"
}
scan() {
    echo "\\set lo random(1, 299000)
with c as materialized (select e.id, e.ctid from partitioned_reads.$1 e
  where e.id > :lo and pg_visible_in_snapshot(e.xid, pg_current_snapshot()) order by e.id limit 501)"
}
scan_xid flat >"$work/scan_xid_flat.sql"
scan_xid parted >"$work/scan_xid_parted.sql"
{ scan flat; echo "select count(*) from c;"; } >"$work/scan_id_flat.sql"
{ scan parted; echo "select count(*) from c;"; } >"$work/scan_id_parted.sql"
{ scan flat; echo "select count(*), sum(length(o.payload::text)) from partitioned_reads.flat o where o.ctid = any (array(select c.ctid from c));"; } >"$work/read_parent_flat.sql"
{ scan parted; echo "select count(*), sum(length(o.payload::text)) from partitioned_reads.parted o
  where o.ctid = any (array(select c.ctid from c)) and o.id + 0 = any (array(select c.id from c));"; } >"$work/read_parent_parted.sql"
{
    scan parted
    echo ", s as materialized (select (c.id >> 16) & 7 as slot, array_agg(c.ctid) as tids from c group by 1)"
    echo "select count(*), sum(length(x.payload::text)) from ("
    for s in 0 1 2 3 4 5 6 7; do
        [ "$s" = 0 ] || echo "  union all"
        echo "  select o.payload from partitioned_reads.parted_$s o where o.ctid = any (coalesce((select s.tids from s where s.slot = $s), '{}'))"
    done
    echo ") x;"
} >"$work/read_leaves_parted.sql"

# pgbench's latency average (ms) of one script; fails, with pgbench's output, when it gives none.
run() {
    local out ms
    out=$(PGOPTIONS="-c plan_cache_mode=force_generic_plan -c enable_seqscan=off -c enable_bitmapscan=off -c jit=off" \
        pgbench -n -M prepared -T "$secs" -f "$work/$1.sql" "$db" 2>&1) || true
    ms=$(sed -n 's/^latency average = \([0-9.]*\) ms$/\1/p' <<<"$out")
    if [ -z "$ms" ]; then
        echo "pgbench gave no latency for $1:" >&2
        echo "$out" >&2
        exit 1
    fi
    echo "$ms"
}
printf '%-12s %10s %10s %10s\n' query flat parted 'read by leaf'
for r in $(seq 1 "$rounds"); do
    for q in scan_xid scan_id read_parent; do
        flat=$(run "${q}_flat")
        parted=$(run "${q}_parted")
        printf '%-12s %10s %10s' "$q" "$flat" "$parted"
        if [ "$q" = read_parent ]; then
            leaves=$(run read_leaves_parted)
            printf ' %10s' "$leaves"
        fi
        printf '\n'
    done
done
echo "(ms a statement, pgbench's latency average; round after round)"
