#!/usr/bin/env bash
# How fast parked events drain against new ones, through the real relay (`outbox-relay run --sink
# stdout` with its defaults, stdout to /dev/null), each case in a fresh database:
#   new       EVENTS events over 1,000 keys written in one statement while the relay waits;
#   paused    the same events written behind a paused topic, timed from `resume` on;
#   one key   EVENTS/10 events, half of them on one key, the rest over 100 keys, paused, then resumed.
# Prints the seconds each took and the parked/new ratios.
#
#   BIN=target/release/outbox-relay bash benches/storage/parked_drain.sh 'postgres://postgres@127.0.0.1:5432/postgres' [EVENTS]
set -euo pipefail
admin=${1:?usage: parked_drain.sh ADMIN_DATABASE_URL [EVENTS]}
events=${2:-100000}
bin=${BIN:-target/release/outbox-relay}
[ -x "$bin" ] || { echo "no $bin: cargo build --release -p pg-outbox-relay-cli, or set BIN" >&2; exit 1; }
psql() { PGOPTIONS="-c client_min_messages=warning" command psql -v ON_ERROR_STOP=1 -XAtq "$@"; }
db_url() { printf '%s' "${admin%/*}/$1"; }
now() { date +%s.%N; }

# run_case NAME EVENTS KEYS_SQL PAUSED: prints the seconds from the start (new) or the resume
# (paused) until every event is delivered.
run_case() {
    local name=$1 n=$2 keys=$3 paused=$4 db url relay start end
    db="parked_drain_$name"
    psql "$admin" -c "drop database if exists $db" -c "create database $db"
    url=$(db_url "$db")
    "$bin" migrate --database-url "$url" >/dev/null 2>&1
    [ "$paused" = yes ] && "$bin" pause --topic order.placed --database-url "$url" >/dev/null
    RUST_LOG=warn "$bin" run --sink stdout --completion mark --database-url "$url" >/dev/null 2>"/tmp/parked_drain_$name.log" &
    relay=$!
    sleep 1
    if [ "$paused" = yes ]; then
        psql "$url" -c "insert into outbox_relay.outbox (topic, key, payload)
                        select 'order.placed', $keys, jsonb_build_object('n', g) from generate_series(1, $n) g"
        until [ "$(psql "$url" -c "select count(*) from outbox_relay.parked")" = "$n" ]; do sleep 0.2; done
        start=$(now)
        "$bin" resume --topic order.placed --database-url "$url" >/dev/null
        until [ "$(psql "$url" -c "select count(*) from outbox_relay.parked")" = 0 ]; do sleep 0.05; done
    else
        start=$(now)
        psql "$url" -c "insert into outbox_relay.outbox (topic, key, payload)
                        select 'order.placed', $keys, jsonb_build_object('n', g) from generate_series(1, $n) g"
        unpassed="processed_at is null"   # until migration 0019; the positions since
        [ -z "$(psql "$url" -c "select to_regproc('outbox_relay.passed_by_all')")" ] || unpassed="not outbox_relay.passed_by_all(xid, id)"
        until [ "$(psql "$url" -c "select count(*) from outbox_relay.outbox where $unpassed")" = 0 ]; do sleep 0.05; done
    fi
    end=$(now)
    kill -TERM "$relay"; wait "$relay" || true
    psql "$admin" -c "drop database $db"
    awk "BEGIN { printf \"%.2f\", $end - $start }"
}

new=$(run_case new "$events" "'k' || (g % 1000)" no)
paused=$(run_case paused "$events" "'k' || (g % 1000)" yes)
small=$((events / 10))
new_one=$(run_case new_one_key "$small" "case when g % 2 = 0 then 'hot' else 'k' || (g % 100) end" no)
one=$(run_case one_key "$small" "case when g % 2 = 0 then 'hot' else 'k' || (g % 100) end" yes)
echo "new:     $events events over 1,000 keys: $new s"
echo "paused:  the same, from resume: $paused s (parked/new time $(awk "BEGIN { printf \"%.2f\", $paused / $new }"))"
echo "one key: $small events, half on one key, new: $new_one s; paused, from resume: $one s (parked/new time $(awk "BEGIN { printf \"%.2f\", $one / $new_one }"))"
