#!/usr/bin/env bash
# Storage designs under a held snapshot, at the SQL level: 800 events/s published (pgbench -R 800;
# into the lanes prototype a plain INSERT with a key, into the shipped outbox through
# outbox_relay.publish without a key, its delete claim's path: the write paths differ), claims
# at 2,000/s from 2 clients (batches of 500), PHASE seconds with
# nothing held, then PHASE seconds while a session holds `begin; select txid_current();`.
# Prints per design and phase: claims per second kept and their mean latency (pgbench's, which
# includes its schedule lag: seconds mean the claims fell behind), whole-box CPU, and the
# events left unclaimed at the end of the phase.
#
#   bash benches/storage/run.sh 'postgresql://postgres@127.0.0.1:5432/storage_proto' [PHASE]
#
# DESIGNS='lanes delete' (the default) chooses which run, in that order.
# The database must exist and hold the migrated outbox_relay schema (`outbox-relay migrate`);
# the script creates the storage_proto schema itself and truncates outbox_relay.outbox.
set -euo pipefail
db=${1:?usage: run.sh DATABASE_URL [PHASE_SECONDS]}
phase=${2:-60}
here=$(cd "$(dirname "$0")" && pwd)
ticks=$(getconf CLK_TCK)
psql() { PGOPTIONS="-c client_min_messages=warning" command psql -v ON_ERROR_STOP=1 "$@"; }
# Whatever runs in the background ends with the script, also when a step fails.
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT
busy() { awk '/^cpu /{print $2+$3+$4+$7+$8+$9}' /proc/stat; }
pending() {
    case $1 in
        lanes) psql -XAtq "$db" -c "select (select count(*) from storage_proto.events) - (select coalesce(sum(claimed), 0) from storage_proto.positions)" ;;
        delete) psql -XAtq "$db" -c "select count(*) from outbox_relay.outbox" ;;
    esac
}
# One consumer run of a phase: its claims per second and mean latency, from pgbench's summary.
consume() { # consumer
    local out
    out=$(pgbench -n -R 2000 -c 2 -j 1 -T "$phase" -f "$1" "$db" 2>&1) || { echo "pgbench failed: $out" >&2; return 1; }
    awk '/^latency average/{lat=$4} /^tps/{tps=$3} END{printf "%.0f claims/s, mean latency %s ms", tps, lat}' <<<"$out"
}
# One phase: the claims, the whole box's CPU over them, and what is left unclaimed.
phase() { # design consumer label
    local before after claims
    before=$(busy)
    claims=$(consume "$2")
    after=$(busy)
    echo "$1, $3: $claims, CPU $(( (after - before) * 100 / ticks / phase )) % of a core, unclaimed $(pending "$1")"
}
measure() { # design producer consumer
    local design=$1 producer=$2 consumer=$3
    pgbench -n -R 800 -c 2 -j 1 -T $((2 * phase + 5)) -f "$producer" "$db" >/dev/null 2>&1 &
    local producing=$!
    sleep 1
    phase "$design" "$consumer" "nothing held"
    psql -XAtq "$db" -c "begin; select txid_current(); select pg_sleep($phase + 1); commit" >/dev/null &
    local holding=$!
    sleep 0.5
    phase "$design" "$consumer" "a transaction held"
    wait "$producing" "$holding" || true
}
psql -XAtq "$db" -f "$here/snapshot_lanes.sql" >/dev/null
psql -XAtq "$db" -c "truncate outbox_relay.outbox" >/dev/null
for design in ${DESIGNS:-lanes delete}; do
    psql -XAtq "$db" -c "vacuum analyze outbox_relay.outbox" >/dev/null
    case $design in
        lanes) measure lanes "$here/produce_lanes.pgbench" "$here/consume_lanes.pgbench" ;;
        delete) measure delete "$here/produce_unkeyed.pgbench" "$here/consume_delete.pgbench" ;;
        *) echo "unknown design $design (lanes, delete)" >&2; exit 2 ;;
    esac
done
