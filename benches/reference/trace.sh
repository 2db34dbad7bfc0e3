#!/usr/bin/env bash
# Where one event's latency goes, from the relay's own trace lines (see trace.mjs):
#
#   bash benches/reference/trace.sh 'postgresql://postgres@127.0.0.1:5432/postgres' [EVENTS]
#
# Uses a fresh database `outbox_trace` on that server and the release binary.
set -euo pipefail
admin=${1:?usage: trace.sh ADMIN_DATABASE_URL [EVENTS]}
events=${2:-300}
. "$(dirname "$0")/setup.sh"
setup "$admin" outbox_trace trace.mjs pg@8
node "$work/trace.mjs" "$db" "$binary" "$events"
