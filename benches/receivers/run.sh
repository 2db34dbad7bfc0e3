#!/usr/bin/env bash
# One relay against one receiver of benches/receivers/receiver.py (issue 21):
#
#   bash benches/receivers/run.sh ADMIN_URL EVENTS KEYS 'RECEIVER ARGS' [RELAY ARGS...]
#
# e.g. bash benches/receivers/run.sh postgresql://postgres@127.0.0.1:5432/postgres 1000 0 '' --concurrency 2 --fixed-concurrency
#
# Makes a fresh database `outbox_receivers` on ADMIN_URL's server, writes EVENTS events (spread
# over KEYS keys, none when 0), starts the receiver on a free port and `outbox-relay run --sink
# http://...` (the release binary) with RELAY ARGS, waits until no event is pending, and prints
# one JSON line: seconds from the relay's start, events/s, the receiver's counts (requests,
# accepted, duplicates, 429s) and how often the relay's log said the breaker opened. RECEIVER=node,
# LATE=S and KILL_AFTER=N: see below. BINARY=path runs another build of the relay.
set -euo pipefail
admin=${1:?usage: run.sh ADMIN_URL EVENTS KEYS 'RECEIVER ARGS' [RELAY ARGS...]}
events=${2:?}
keys=${3:?}
receiver_args=${4-}
shift 4
here=$(cd "$(dirname "$0")" && pwd)
binary=${BINARY:-$here/../../target/release/outbox-relay}
[ -x "$binary" ] || { echo "build the release binary first: cargo build --release" >&2; exit 2; }
db=${admin%/*}/outbox_receivers
work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; [ -n "${KEEP_LOG:-}" ] && cp "$work/log" "$KEEP_LOG"; rm -rf "$work"; }
trap cleanup EXIT
psql -XAtq -v ON_ERROR_STOP=1 "$admin" -c "drop database if exists outbox_receivers" -c "create database outbox_receivers" 2>/dev/null
DATABASE_URL=$db RUST_LOG=error "$binary" migrate >/dev/null
key="null"
[ "$keys" -gt 0 ] && key="'k' || (g % $keys)"
psql -XAtq -v ON_ERROR_STOP=1 "$db" -c "insert into outbox_relay.outbox (topic, key, payload)
    select 'bench.receiver', $key, jsonb_build_object('n', g) from generate_series(1, $events) g"
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
# RECEIVER=node runs receiver.mjs (not the bottleneck) instead of Python's http.server.
start_receiver() {
    # shellcheck disable=SC2086
    if [ "${RECEIVER:-python}" = node ]; then
        node "$here/receiver.mjs" "$port" $receiver_args &
    else
        python3 "$here/receiver.py" "$port" $receiver_args &
    fi
    pids+=($!)
    until curl -sf "http://127.0.0.1:$port/stats" >/dev/null; do sleep 0.01; done
}
start_relay() {
    DATABASE_URL=$db RUST_LOG=${RELAY_LOG:-outbox_relay=warn} "$binary" run --sink "http://127.0.0.1:$port/" "$@" 2>"$work/log" >/dev/null &
    pids+=($!)
}
# LATE=S starts the relay S seconds before the receiver, and times from the receiver's start.
if [ -n "${LATE:-}" ]; then
    start_relay "$@"
    sleep "$LATE"
    start_receiver
    start=$(date +%s.%N)
else
    start_receiver
    start=$(date +%s.%N)
    start_relay "$@"
fi
# The events not recorded delivered yet: outbox rows not passed, and copies parked for the
# destination (a retry, or a claim's lease: its outbox rows are finished when it is leased).
# Not recorded delivered: pending in the outbox or parked, less what a claim that never committed
# recorded as delivered (early_deliveries, migration 0017, where the relay has it).
unrecorded() {
    local early="select unnest(ids) from outbox_relay.early_deliveries"
    [ -n "$(psql -XAtq "$db" -c "select to_regclass('outbox_relay.early_deliveries')")" ] || early="select null::int8 where false"
    # Not passed by every destination: processed_at until migration 0019, the positions since.
    local unpassed="processed_at is null"
    [ -z "$(psql -XAtq "$db" -c "select to_regproc('outbox_relay.passed_by_all')")" ] || unpassed="not outbox_relay.passed_by_all(xid, id)"
    psql -XAtq "$db" -c "select count(*) from (select id from outbox_relay.outbox where $unpassed
                         union select id from outbox_relay.parked where destination = 'default'
                         except $early) w"
}
# KILL_AFTER=N kills the relay with SIGKILL once the receiver accepted N requests, notes what the
# receiver had accepted that the database had not recorded, and starts a second relay.
killed='{}'
if [ -n "${KILL_AFTER:-}" ]; then
    accepted() { curl -sf "http://127.0.0.1:$port/stats" | python3 -c 'import json, sys; print(json.load(sys.stdin)["accepted"])'; }
    until [ "$(accepted)" -ge "$KILL_AFTER" ]; do sleep 0.005; done
    kill -9 "${pids[-1]}"
    wait "${pids[-1]}" 2>/dev/null || true
    at_kill=$(accepted)
    pending=$(unrecorded)
    killed="{\"accepted_at_kill\": $at_kill, \"accepted_unrecorded_at_kill\": $((at_kill + pending - events))}"
    cp "$work/log" "$work/log.killed"
    start_relay "$@"
fi
until [ "$(unrecorded)" = 0 ]; do sleep 0.02; done
end=$(date +%s.%N)
stats=$(curl -sf "http://127.0.0.1:$port/stats")
opened=$(grep -c "the destination looks down" "$work/log" || true)
python3 - "$start" "$end" "$events" "$stats" "$opened" "$killed" <<'PY'
import json, sys
start, end, events, stats, opened = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]), int(sys.argv[5])
print(json.dumps(dict(seconds=round(end - start, 3), events_per_s=round(events / (end - start), 1), breaker_opened=opened, **stats, **json.loads(sys.argv[6]))))
PY
