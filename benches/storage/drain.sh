#!/usr/bin/env bash
# Drain rate of both claims at the SQL level: EVENTS events pre-filled (into the lanes prototype
# with a key each, into the shipped outbox without: its delete claim's path), then 2 pgbench
# clients claim in batches of 500 for SECONDS seconds; prints claimed events per second. Pre-fill
# more than the faster one drains in SECONDS, or its rate is capped (the script says so).
#
#   bash benches/storage/drain.sh 'postgresql://postgres@127.0.0.1:5432/storage_proto' [EVENTS] [SECONDS]
set -euo pipefail
db=${1:?usage: drain.sh DATABASE_URL [EVENTS] [SECONDS]}
events=${2:-1000000}
seconds=${3:-5}
here=$(cd "$(dirname "$0")" && pwd)
psql() { PGOPTIONS="-c client_min_messages=warning" command psql -v ON_ERROR_STOP=1 "$@"; }
psql -XAtq "$db" -f "$here/snapshot_lanes.sql" >/dev/null
psql -XAtq "$db" -c "truncate outbox_relay.outbox" >/dev/null
psql -XAtq "$db" -c "insert into storage_proto.events (topic, key, payload, lane)
    select 'order.placed', 'order-' || g, jsonb_build_object('n', g), hashtext('order-' || g) & 15
      from generate_series(1, $events) g" >/dev/null
psql -XAtq "$db" -c "insert into outbox_relay.outbox (topic, payload)
    select 'order.placed', jsonb_build_object('n', g) from generate_series(1, $events) g" >/dev/null
psql -XAtq "$db" -c "vacuum analyze storage_proto.events" -c "vacuum analyze outbox_relay.outbox" >/dev/null
pgbench -n -c 2 -j 2 -T "$seconds" -f "$here/consume_lanes.pgbench" "$db" >/dev/null
lanes=$(psql -XAtq "$db" -c "select sum(claimed) from storage_proto.positions")
pgbench -n -c 2 -j 2 -T "$seconds" -f "$here/consume_delete.pgbench" "$db" >/dev/null
deleted=$(( events - $(psql -XAtq "$db" -c "select count(*) from outbox_relay.outbox") ))
for claimed in "$lanes" "$deleted"; do
    [ $((claimed * 10)) -lt $((events * 9)) ] || echo "warning: a claim drained $claimed of $events events within $seconds s: its rate is capped by the pre-fill; pre-fill more" >&2
done
echo "snapshot lanes: $(( lanes / seconds )) events/s; claim and delete: $(( deleted / seconds )) events/s ($events pre-filled, 2 clients, batches of 500, $seconds s)"
