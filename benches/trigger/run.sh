#!/usr/bin/env bash
# What the outbox trigger costs writers while a relay waits (issue 41): the trigger of migration
# 0014 (an empty notification) against the one of 0018 (the statement's events in the
# notification), and, for reference, no relay waiting (no notification), at 1, 4 and 16
# writers, in ROUNDS alternating rounds of SECONDS each. Each writer commits the article's
# publish (`outbox_relay.publish` with a key) one transaction at a time (pgbench); a LISTEN
# client reads every notification meanwhile, as a relay's listener would.
#
#   bash benches/trigger/run.sh 'postgresql://postgres@127.0.0.1:5432/postgres' [SECONDS] [ROUNDS]
#
# The relay here is a placeholder row marked waiting for the whole run: a worst case, as a real
# relay marks itself busy from 500 events/s and writers then stop notifying.
#
# Uses a fresh database `outbox_trigger` on that server (dropped and re-created) and the
# release binary to migrate it (cargo build --release first). Prints one line per run and the
# medians: tps and the share of the 0014 trigger's.
set -euo pipefail
admin=${1:?usage: run.sh ADMIN_DATABASE_URL [SECONDS] [ROUNDS]}
seconds=${2:-10}
rounds=${3:-3}
here=$(cd "$(dirname "$0")" && pwd)
binary=$(cd "$here/../.." && pwd)/target/release/outbox-relay
[ -x "$binary" ] || { echo "build the release binary first: cargo build --release" >&2; exit 2; }
[[ $admin =~ ^postgres(ql)?://[^?]*/[^/?]+$ ]] || { echo "give a URL of the form postgresql://user@host:port/database, without parameters" >&2; exit 2; }
db=${admin%/*}/outbox_trigger
work=$(mktemp -d)
listener=
trap '[ -n "$listener" ] && kill "$listener" 2>/dev/null; rm -rf "$work"' EXIT
psql -XAtq -v ON_ERROR_STOP=1 "$admin" -c "drop database if exists outbox_trigger" -c "create database outbox_trigger" 2>/dev/null
DATABASE_URL=$db RUST_LOG=error "$binary" migrate >/dev/null

# The trigger function of migration 0014 (from the repository's own file), kept beside the
# shipped one.
sed -n '/^create or replace function outbox_relay.notify_relay()/,/^\$\$;/p' "$here/../../migrations/0014_storage_edges.sql" \
    | sed 's/outbox_relay.notify_relay()/outbox_relay.notify_relay_0014()/' > "$work/old.sql"
sed -n '/^create or replace function outbox_relay.notify_relay()/,/^\$\$;/p' "$here/../../migrations/0018_events_in_notifications.sql" \
    | sed 's/outbox_relay.notify_relay()/outbox_relay.notify_relay_0018()/' > "$work/new.sql"
psql -XAtq -v ON_ERROR_STOP=1 "$db" -f "$work/old.sql" -f "$work/new.sql"

cat > "$work/publish.sql" <<'SQL'
\set k random(1, 1000)
begin;
select outbox_relay.publish('order.placed', '{"order_id": 42, "total": 129.90, "items": [{"sku": "A-1", "qty": 2}]}', 'order-' || :k);
commit;
SQL

# A LISTEN client that reads everything (psql reads notifications after each command).
# ($! is psql itself: killing it at exit ends the loop that feeds it, with SIGPIPE.)
psql -XAtq "$db" -f <(while :; do echo "listen outbox_relay; select pg_sleep(0.01);"; done) >/dev/null 2>&1 &
listener=$!
sleep 0.5
# A relay marked waiting: the placeholder row names the listener-free session of this script.
psql -XAtq -v ON_ERROR_STOP=1 "$db" -c "insert into outbox_relay.relays (id, listener_pid, waiting, destination) values (-7, 0, true, 'bench')"

use() { # use 0014|0018|none
    local fn=notify_relay_0018 waiting=true
    case $1 in 0014) fn=notify_relay_0014 ;; none) waiting=false ;; esac
    psql -XAtq -v ON_ERROR_STOP=1 "$db" \
        -c "create or replace trigger outbox_notify_relay after insert on outbox_relay.outbox for each statement execute function outbox_relay.$fn()" \
        -c "update outbox_relay.relays set waiting = $waiting where id = -7" \
        -c "truncate outbox_relay.outbox" -c "vacuum analyze outbox_relay.outbox" >/dev/null
}

declare -A tps
for round in $(seq "$rounds"); do
    for clients in 1 4 16; do
        for variant in none 0014 0018; do
            use "$variant"
            t=$(pgbench -n -f "$work/publish.sql" -c "$clients" -j "$clients" -T "$seconds" "$db" 2>/dev/null | sed -n 's/^tps = \([0-9.]*\).*/\1/p')
            echo "round $round, $clients writers, $variant: $t tps"
            tps[$clients,$variant]="${tps[$clients,$variant]:-} $t"
        done
    done
done
median() { tr ' ' '\n' | grep . | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
echo
echo "medians of $rounds rounds ($seconds s each): tps, share of the 0014 trigger's"
for clients in 1 4 16; do
    none=$(echo "${tps[$clients,none]}" | median)
    old=$(echo "${tps[$clients,0014]}" | median)
    new=$(echo "${tps[$clients,0018]}" | median)
    awk -v c="$clients" -v n="$none" -v o="$old" -v w="$new" \
        'BEGIN { printf "%2d writers: no relay waiting %8.1f | 0014 trigger %8.1f | 0018 trigger %8.1f (%.1f %% of 0014)\n", c, n, o, w, 100 * w / o }'
done
