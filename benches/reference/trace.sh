#!/usr/bin/env bash
# Where one event's latency goes, from the relay's own trace lines (see trace.mjs):
#
#   bash benches/reference/trace.sh 'postgresql://postgres@127.0.0.1:5432/postgres' [EVENTS]
#
# Uses a fresh database `outbox_trace` on that server and the release binary.
set -euo pipefail
admin=${1:?usage: trace.sh ADMIN_DATABASE_URL [EVENTS]}
events=${2:-300}
here=$(cd "$(dirname "$0")" && pwd)
binary=$(cd "$here/../.." && pwd)/target/release/outbox-relay
[ -x "$binary" ] || { echo "build the release binary first: cargo build --release" >&2; exit 2; }
[[ $admin =~ ^postgres(ql)?://[^?]*/[^/?]+$ ]] || { echo "give a URL of the form postgresql://user@host:port/database, without parameters" >&2; exit 2; }
db=${admin%/*}/outbox_trace
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$here/trace.mjs" "$work/"
(cd "$work" && npm init -y >/dev/null && npm install --no-audit --no-fund --silent pg@8 >/dev/null)
psql -XAtq "$admin" -c "drop database if exists outbox_trace" -c "create database outbox_trace" 2>/dev/null
DATABASE_URL=$db "$binary" migrate >/dev/null 2>&1
node "$work/trace.mjs" "$db" "$binary" "$events"
