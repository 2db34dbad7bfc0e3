#!/usr/bin/env bash
# Whether a partition of a partitioned outbox can be truncated beside claims that read the parent
# (issue 42's open question: PostgreSQL 15 locks every partition of a generic plan, so a claim
# holds ACCESS SHARE on all of them until its transaction ends, delivery included).
#
# A table shaped like the outbox, list-partitioned into 4 slots, 200,000 rows (slot 0's refilled
# before each case, so that each case's first truncate has 50,000 rows to remove). Two pgbench
# clients run claim-shaped transactions (a prepared statement on the parent, generic plan, then
# `pg_sleep(HOLD)` for the delivery in the transaction, then commit) at a rate or back to back;
# beside them, 10 times a second, a rotation takes slot 0's ACCESS EXCLUSIVE lock under a
# `lock_timeout` and truncates it, or gives up (`lock_not_available`). Prints, per case, the
# claims' rate and latency percentiles (pgbench's per-transaction log) and how many rotations got
# their lock.
#
#   bash benches/storage/rotation.sh 'postgresql://postgres@127.0.0.1:5432/postgres' [SECONDS]
#
# Each case is "HOLD_SECONDS RATE LOCK_TIMEOUT ROTATE" (RATE 0: back to back).
set -euo pipefail
db=${1:?usage: rotation.sh DATABASE_URL [SECONDS]}
secs=${2:-20}
work=$(mktemp -d)
psql() { PGOPTIONS="-c client_min_messages=warning" command psql -v ON_ERROR_STOP=1 -XAtq "$db" "$@"; }
trap 'psql -c "drop schema if exists rotation_bench cascade" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT

psql -c "drop schema if exists rotation_bench cascade" -c "create schema rotation_bench" \
    -c "create table rotation_bench.parted (
            slot int2 not null, id bigint not null, topic text not null, key text,
            payload jsonb not null, created_at timestamptz not null default now(),
            xid xid8 not null default pg_current_xact_id(), primary key (slot, id)) partition by list (slot)" \
    -c "create table rotation_bench.parted_0 partition of rotation_bench.parted for values in (0)" \
    -c "create table rotation_bench.parted_1 partition of rotation_bench.parted for values in (1)" \
    -c "create table rotation_bench.parted_2 partition of rotation_bench.parted for values in (2)" \
    -c "create table rotation_bench.parted_3 partition of rotation_bench.parted for values in (3)" \
    -c "create index on rotation_bench.parted (xid, id)" \
    -c "create table rotation_bench.result (at timestamptz, ok bool)"
# 50,000 rows in each slot (slot 0 filled again before each case).
fill() {
    psql -c "insert into rotation_bench.parted (slot, id, topic, key, payload)
             select g % 4, g, 'order.placed', 'order-' || g, jsonb_build_object('n', g, 'customer', repeat('x', 160))
               from generate_series(1, 200000) g where g % 4 in ($1)"
}
fill "0, 1, 2, 3"
psql -c "vacuum analyze rotation_bench.parted"

# A cached generic plan locks every partition whatever its predicate prunes at run time (and
# the index it scans in the partitions that are left).
locks=$(psql -c "set plan_cache_mode = force_generic_plan" \
    -c "prepare c(xid8, int2) as select id from rotation_bench.parted where xid >= \$1 and slot = \$2 order by xid limit 10" \
    -c "execute c('0', 1::int2)" -c "execute c('0', 1::int2)" -c "begin" -c "execute c('0', 1::int2)" \
    -c "select string_agg(relation::regclass::text, ' ' order by relation::regclass::text) from pg_locks
         where pid = pg_backend_pid() and locktype = 'relation' and relation::regclass::text like 'rotation_bench.%'" \
    -c "rollback" | tail -1)
echo "relations a cached generic plan with a slot predicate holds: $locks"

cat > "$work/claim.pgbench" <<'EOF'
begin;
select count(*) from (select id from rotation_bench.parted where xid >= '0'::xid8 order by xid limit 1) s;
select pg_sleep(:hold);
commit;
EOF

run() {
    local hold=$1 rate=$2 lt=$3 rotate=$4 rotator="" limit=""
    psql -c "truncate rotation_bench.result" -c "truncate rotation_bench.parted_0"
    fill 0
    rm -f "$work"/log*
    [ "$rate" != 0 ] && limit="-R $rate"
    if [ "$rotate" = yes ]; then
        cat > "$work/rotate.pgbench" <<EOF
do \$\$
begin
    perform set_config('lock_timeout', '$lt', true);
    begin
        lock table rotation_bench.parted_0 in access exclusive mode;
        truncate rotation_bench.parted_0;
        insert into rotation_bench.result values (clock_timestamp(), true);
    exception when lock_not_available then
        insert into rotation_bench.result values (clock_timestamp(), false);
    end;
end \$\$;
EOF
        pgbench -n -f "$work/rotate.pgbench" -c 1 -R 10 -T "$secs" "$db" > "$work/rotate.out" 2>&1 &
        rotator=$!
    fi
    # shellcheck disable=SC2086 # $limit is empty or two words
    PGOPTIONS="-c plan_cache_mode=force_generic_plan" pgbench -n -M prepared -f "$work/claim.pgbench" \
        -D hold="$hold" -c 2 -j 2 $limit -T "$secs" -l --log-prefix="$work/log" "$db" > "$work/claim.out" 2>&1 \
        || { cat "$work/claim.out" >&2; exit 1; }
    if [ -n "$rotator" ]; then
        wait "$rotator" || { cat "$work/rotate.out" >&2; exit 1; }
    fi
    local tps lat got
    tps=$(grep -o "tps = [0-9]*" "$work/claim.out" | head -1 | cut -d' ' -f3)
    lat=$(cat "$work"/log* | awk '{print $3}' | sort -n | awk '
        function at(p,  i) { i = int(NR * p); if (i < 1) i = 1; return a[i] / 1000 }
        {a[NR] = $1}
        END { printf "p50 %.2f / p99 %.2f / p99.9 %.2f / max %.2f ms", at(0.5), at(0.99), at(0.999), at(1) }')
    got=$(psql -c "select count(*) filter (where ok) || ' of ' || count(*) from rotation_bench.result")
    echo "delivery held ${hold}s, rate ${rate/#0/back to back}, lock_timeout $lt, rotating $rotate: $tps claims/s, $lat; rotations that got the lock: $got"
}

for case in "0.0005 400 5ms no" "0.0005 400 5ms yes" "0.002 0 5ms no" "0.002 0 5ms yes" \
            "0.02 0 5ms no" "0.02 0 5ms yes" "0.02 0 50ms yes"; do
    # shellcheck disable=SC2086 # the case's four words
    run $case
done
