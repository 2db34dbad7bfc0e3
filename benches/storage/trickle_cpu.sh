#!/usr/bin/env bash
# CPU of a relay and its backends at a trickle: a fresh database on the server, `BINARY run --sink
# stdout`, pgbench publishing RATE events a second through outbox_relay.publish (a key each), and
# the relay process's and its backends' CPU read from /proc over SECONDS (the server must be on
# this machine). Run it for two builds alternately to compare them.
#
#   bash benches/storage/trickle_cpu.sh target/release/outbox-relay [SECONDS] [RATE] [HOST]
set -euo pipefail
bin=$1; secs=${2:-20}; rate=${3:-40}; host=${4:-127.0.0.1}
db=trickle_$$
psql -XAtq -h "$host" -U postgres -c "create database $db" >/dev/null
url=postgres://postgres@$host:5432/$db
script=$(mktemp)
trap 'rm -f "$script"; psql -XAtq -h "$host" -U postgres -c "drop database if exists $db with (force)" >/dev/null' EXIT
"$bin" migrate --database-url "$url" >/dev/null 2>&1
"$bin" run --database-url "$url" --sink stdout > /dev/null 2>/dev/null &
relay=$!
sleep 2
echo "select outbox_relay.publish('order.placed', '{\"n\": 1}', 'k' || (random()*100)::int);" > "$script"
ticks() { awk '{print $14+$15}' "/proc/$1/stat"; }
backends() { psql -XAtq -h "$host" -U postgres -c "select pid from pg_stat_activity where datname = '$db' and application_name <> 'pgbench' and pid <> pg_backend_pid()"; }
sum_backends() { local s=0 t; for p in $(backends); do t=$(awk '{print $14+$15}' "/proc/$p/stat" 2>/dev/null || echo 0); s=$((s+t)); done; echo $s; }
(pgbench -n -R "$rate" -T $((secs+2)) -c 1 -f "$script" "$url" > /dev/null 2>&1 &)
sleep 1
r0=$(ticks $relay); b0=$(sum_backends); t0=$(date +%s.%N)
sleep "$secs"
r1=$(ticks $relay); b1=$(sum_backends); t1=$(date +%s.%N)
hz=$(getconf CLK_TCK)
python3 -c "
el=$t1-$t0; r=($r1-$r0)/$hz/el; b=($b1-$b0)/$hz/el
print(f'relay {r*100:.2f} %  backends {b*100:.2f} %  total {(r+b)*100:.2f} % of a core over {el:.1f} s')"
sleep 2
kill -TERM $relay; wait $relay || true
