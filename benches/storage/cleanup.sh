#!/usr/bin/env bash
# The two ways to remove events every destination has passed (issue 42), at the SQL level, on a
# table shaped like the outbox (its columns, primary key and `(xid, id)` index): EVENTS rows of a
# ~200-byte payload, removed
#   range: by range deletes of BATCH rows in (xid, id) order, as the sweeper does;
#   truncate: as a list partition of its own, by `truncate` under `lock table ... nowait`;
# each once with nothing held and once while another session holds a transaction open (which
# keeps vacuum from reclaiming deleted rows). Prints, per case, the time, the WAL written, and
# the table's size on disk right after and after a `vacuum` (with the hold still on).
#
#   bash benches/storage/cleanup.sh 'postgresql://postgres@127.0.0.1:5432/postgres' [EVENTS] [BATCH]
set -euo pipefail
db=${1:?usage: cleanup.sh DATABASE_URL [EVENTS] [BATCH]}
events=${2:-200000}
batch=${3:-10000}
psql() { PGOPTIONS="-c client_min_messages=warning" command psql -v ON_ERROR_STOP=1 -XAtq "$db" "$@"; }

setup() {
    psql -c "drop schema if exists cleanup_bench cascade" -c "create schema cleanup_bench" \
        -c "create table cleanup_bench.plain (
                id bigint generated always as identity primary key, topic text not null, key text,
                payload jsonb not null, headers jsonb, uuid uuid not null default gen_random_uuid(),
                created_at timestamptz not null default now(), available_at timestamptz not null default now(),
                xid xid8 not null default pg_current_xact_id())" \
        -c "create index on cleanup_bench.plain (xid, id) where xid <> '0'::xid8" \
        -c "create table cleanup_bench.parted (
                slot int2 not null, id bigint not null, topic text not null, key text,
                payload jsonb not null, headers jsonb, uuid uuid not null default gen_random_uuid(),
                created_at timestamptz not null default now(), available_at timestamptz not null default now(),
                xid xid8 not null default pg_current_xact_id(), primary key (slot, id)) partition by list (slot)" \
        -c "create table cleanup_bench.parted_0 partition of cleanup_bench.parted for values in (0)" \
        -c "create table cleanup_bench.parted_1 partition of cleanup_bench.parted for values in (1)" \
        -c "create index on cleanup_bench.parted (xid, id) where xid <> '0'::xid8"
    psql -c "insert into cleanup_bench.plain (topic, key, payload)
             select 'order.placed', 'order-' || g, jsonb_build_object('n', g, 'customer', repeat('x', 160))
               from generate_series(1, $events) g"
    psql -c "insert into cleanup_bench.parted (slot, id, topic, key, payload)
             select 0, g, 'order.placed', 'order-' || g, jsonb_build_object('n', g, 'customer', repeat('x', 160))
               from generate_series(1, $events) g"
    psql -c "vacuum analyze cleanup_bench.plain" -c "vacuum analyze cleanup_bench.parted"
}

size() { psql -c "select pg_size_pretty(pg_total_relation_size('$1'))"; }
lsn() { psql -c "select pg_current_wal_lsn()"; }
wal_since() { psql -c "select pg_size_pretty(pg_wal_lsn_diff(pg_current_wal_lsn(), '$1'))"; }
now_ms() { date +%s%3N; }

measure() {
    local hold=$1
    setup
    local holder=""
    if [ "$hold" = held ]; then
        # A transaction with an id, open for the whole measurement: vacuum may remove nothing
        # deleted after it began.
        coproc HOLD { PGAPPNAME=cleanup_bench_hold PGOPTIONS="-c client_min_messages=warning" command psql -XAtq "$db"; }
        echo "begin; select txid_current(); select pg_sleep(3600);" >&"${HOLD[1]}"
        holder=$HOLD_PID
        sleep 0.5
    fi
    local before start ms
    before=$(lsn); start=$(now_ms)
    while [ "$(psql -c "with gone as (delete from cleanup_bench.plain where id = any (array(
                 select id from cleanup_bench.plain where xid <> '0'::xid8 order by xid, id limit $batch)) returning 1)
               select count(*) from gone")" -gt 0 ]; do :; done
    ms=$(( $(now_ms) - start ))
    echo "range deletes ($hold): $events rows in $ms ms, WAL $(wal_since "$before"), size after $(size cleanup_bench.plain), after vacuum $(psql -c 'vacuum cleanup_bench.plain' >/dev/null; size cleanup_bench.plain)"
    before=$(lsn); start=$(now_ms)
    psql -c "begin; set local lock_timeout = '10ms'; lock table cleanup_bench.parted_0 in access exclusive mode nowait;
             truncate cleanup_bench.parted_0; commit"
    ms=$(( $(now_ms) - start ))
    echo "truncate a partition ($hold): $events rows in $ms ms, WAL $(wal_since "$before"), size after $(size cleanup_bench.parted_0)"
    if [ -n "$holder" ]; then
        psql -c "select count(pg_terminate_backend(pid)) from pg_stat_activity where application_name = 'cleanup_bench_hold'" >/dev/null
        wait "$holder" 2>/dev/null || true
    fi
}

measure nothing
measure held
psql -c "drop schema cleanup_bench cascade"
