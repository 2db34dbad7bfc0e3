#!/usr/bin/env bash
# graphile-worker 0.17 (the latency reference of issue 20) beside outbox-relay, on one server, in
# one run: ROUNDS alternating rounds of SAMPLES jobs each (one every 20 ms), medians by the
# reader. graphile-worker and the pg client are installed from npm into a temporary directory.
#
#   bash benches/reference/run.sh 'postgresql://postgres@127.0.0.1:5432/postgres' [SAMPLES] [ROUNDS]
#
# Uses a fresh database `outbox_reference` on that server (dropped and re-created), and the
# release binary (cargo build --release first).
set -euo pipefail
admin=${1:?usage: run.sh ADMIN_DATABASE_URL [SAMPLES] [ROUNDS]}
samples=${2:-500}
rounds=${3:-3}
here=$(cd "$(dirname "$0")" && pwd)
binary=$(cd "$here/../.." && pwd)/target/release/outbox-relay
[ -x "$binary" ] || { echo "build the release binary first: cargo build --release" >&2; exit 2; }
[[ $admin =~ ^postgres(ql)?://[^?]*/[^/?]+$ ]] || { echo "give a URL of the form postgresql://user@host:port/database, without parameters" >&2; exit 2; }
db=${admin%/*}/outbox_reference
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$here/latency.mjs" "$work/"
(cd "$work" && npm init -y >/dev/null && npm install --no-audit --no-fund --silent graphile-worker@0.17.3 pg@8 >/dev/null)
psql -XAtq "$admin" -c "drop database if exists outbox_reference" -c "create database outbox_reference"
DATABASE_URL=$db "$binary" migrate >/dev/null
for _ in $(seq "$rounds"); do
    node "$work/latency.mjs" graphile "$db" "$samples"
    node "$work/latency.mjs" outbox "$db" "$samples" "$binary"
done
