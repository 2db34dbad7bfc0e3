#!/usr/bin/env bash
# graphile-worker 0.17 (the latency reference of issue 20) beside outbox-relay (with its fast
# path, and with it off: --no-fast-path), on one server, in one run: ROUNDS alternating rounds of
# SAMPLES jobs each (one every 20 ms), medians by the reader; each round also measures the floor
# (a commit to a LISTENing client's notification), and the floor through a child process's stdout
# (the pipe hop outbox-relay's figure has: `floor-pipe`).
# graphile-worker and the pg client are installed from npm into a temporary directory.
#
#   bash benches/reference/run.sh 'postgresql://postgres@127.0.0.1:5432/postgres' [SAMPLES] [ROUNDS]
#
# Uses a fresh database `outbox_reference` on that server (dropped and re-created), and the
# release binary (cargo build --release first).
set -euo pipefail
admin=${1:?usage: run.sh ADMIN_DATABASE_URL [SAMPLES] [ROUNDS]}
samples=${2:-500}
rounds=${3:-3}
. "$(dirname "$0")/setup.sh"
setup "$admin" outbox_reference latency.mjs graphile-worker@0.17.3 pg@8
for _ in $(seq "$rounds"); do
    node "$work/latency.mjs" graphile "$db" "$samples"
    node "$work/latency.mjs" outbox "$db" "$samples" "$binary"
    node "$work/latency.mjs" outbox-claim-first "$db" "$samples" "$binary"
    node "$work/latency.mjs" floor "$db" "$samples"
    node "$work/latency.mjs" floor-pipe "$db" "$samples"
done
