#!/usr/bin/env bash
# One `outbox-relay run --sink stdout` against a fresh database while pgbench publishes events at
# a fixed rate, each with its own key, through `outbox_relay.publish`; optionally while another
# session holds a transaction (and its snapshot) open. Prints the publish rate pgbench kept, and
# the latency from each event's created_at (its writer's transaction start, so the writer's own
# commit is inside it) to its line on the relay's stdout, and the whole machine's CPU:
#
#   bash benches/storage/relay_at_rate.sh ADMIN_DATABASE_URL BINARY [RATE] [SECONDS] [hold]
#
# HOLD_AFTER=S starts the hold S seconds into the run (default: at once), so that one run shows
# before and during; WINDOWS=1 also prints every 10 s window (by the time each event reached
# stdout): delivered/s, p50 and p99, the backlog at its end (events created and not yet out),
# the relay's and the whole machine's CPU, and the outbox's dead rows (the server's counter).
#
# e.g. bash benches/storage/relay_at_rate.sh 'postgresql://postgres@127.0.0.1:5432/postgres' \
#          target/release/outbox-relay 800 60 hold
# Quicker than `outbox-relay bench --held-only` (no embedded cluster, one phase per run), for
# comparing two builds one after the other (build the other in a `git worktree` with its own
# CARGO_TARGET_DIR). Uses (and drops first) the database `outbox_rate` on that server. RELAY_URL,
# when set, is the relay's own URL for that database (to pass session settings in `options`).
set -euo pipefail
admin=${1:?usage: relay_at_rate.sh ADMIN_DATABASE_URL BINARY [RATE] [SECONDS] [hold]}
binary=${2:?the outbox-relay binary}
rate=${3:-800}
seconds=${4:-20}
hold=${5:-}
db=$(python3 -c 'import sys, urllib.parse as u; p = u.urlsplit(sys.argv[1]); print(u.urlunsplit(p._replace(path="/outbox_rate")))' "$admin")
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$work"' EXIT
psql -X -q "$admin" -c "drop database if exists outbox_rate" -c "create database outbox_rate"
DATABASE_URL=$db RUST_LOG=error "$binary" migrate >/dev/null
cat > "$work/publish.sql" <<'SQL'
select outbox_relay.publish('orders', '{"a": 1}'::jsonb, 'k' || (random() * 1e9)::int8::text);
SQL
cat > "$work/stamp.py" <<'PY'
import sys, time, json, datetime
with open(sys.argv[1], "w") as out:
    for line in sys.stdin:
        now = time.time()
        event = json.loads(line)
        created = datetime.datetime.fromisoformat(event["created_at"].replace("Z", "+00:00")).timestamp()
        out.write(f"{event['id']} {(now - created) * 1000:.3f} {created:.6f} {now:.6f}\n")
PY
DATABASE_URL=${RELAY_URL:-$db} RUST_LOG=error "$binary" run --sink stdout > >(python3 "$work/stamp.py" "$work/latencies") &
relay=$!
sleep 2
busy() { awk '/^cpu /{print $2 + $3 + $4 + $7 + $8}' /proc/stat; }
relay_ticks() { awk '{print $14 + $15}' "/proc/$(pgrep -P "$relay" -x outbox-relay || echo "$relay")/stat" 2>/dev/null || echo 0; }
if [ -n "${WINDOWS:-}" ]; then
    (while sleep 10; do
        echo "$(date +%s.%N) $(busy) $(relay_ticks) $(psql -X -At "$db" -c "select n_dead_tup from pg_stat_user_tables where relid = 'outbox_relay.outbox'::regclass" 2>/dev/null || echo -)"
     done > "$work/samples") &
    echo "$(date +%s.%N) $(busy) $(relay_ticks) 0" > "$work/samples0"
fi
if [ "$hold" = hold ]; then
    (sleep "${HOLD_AFTER:-0}"; psql -X -q "$db" -c "begin; select txid_current(); select pg_sleep($seconds + 5); commit" >/dev/null 2>&1) &
    [ -n "${HOLD_AFTER:-}" ] || sleep 0.5
fi
cpu0=$(busy); t0=$(date +%s.%N)
pgbench -n -R "$rate" -c 4 -j 2 -T "$seconds" -f "$work/publish.sql" "$db" 2>&1 | grep -E '^tps' | sed 's/ (.*//'
cpu1=$(busy); t1=$(date +%s.%N)
sleep 2
kill -TERM "$relay"
wait "$relay" || true
sleep 1 # the reader's last lines
python3 - "$work/latencies" "$cpu0" "$cpu1" "$t0" "$t1" "$(getconf CLK_TCK)" <<'PY'
import sys
path, c0, c1, t0, t1, tck = sys.argv[1], *map(float, sys.argv[2:])
rows = [line.split() for line in open(path)]
ids = [r[0] for r in rows]
lat = sorted(float(r[1]) for r in rows)
n = len(lat)
p = lambda q: lat[min(n - 1, int(q * n))]
print(f"delivered {n}, twice {n - len(set(ids))}; created_at to stdout p50 {p(.5):.2f} / p90 {p(.9):.2f} / p99 {p(.99):.2f} ms; "
      f"whole machine CPU {(c1 - c0) / tck / (t1 - t0) * 100:.0f} % of a core")
PY
if [ -n "${WINDOWS:-}" ]; then
    python3 - "$work/latencies" "$work/samples0" "$work/samples" "$(getconf CLK_TCK)" "${HOLD_AFTER:-0}" "$t0" "$hold" <<'PY'
import sys
path, s0, s1, tck, hold_after, t0, hold = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5]), float(sys.argv[6]), sys.argv[7]
events = [tuple(map(float, line.split()[1:4])) for line in open(path)]
samples = [line.split() for line in open(s0)] + [line.split() for line in open(s1)]
print("| t (s) | held | delivered/s | p50 ms | p99 ms | backlog | relay CPU | machine CPU | dead rows |")
print("|---|---|---|---|---|---|---|---|---|")
for a, b in zip(samples, samples[1:]):
    start, end = float(a[0]), float(b[0])
    lat = sorted(l for l, _, out in events if start <= out < end)
    if not lat:
        continue
    q = lambda f: lat[min(len(lat) - 1, int(f * len(lat)))]
    backlog = sum(1 for _, created, out in events if created <= end < out)
    span = end - start
    held = "yes" if hold == "hold" and start - t0 >= hold_after else "no"
    print(f"| {max(0.0, start - t0):.0f}-{end - t0:.0f} | {held} | {len(lat) / span:.0f} | {q(.5):.2f} | {q(.99):.2f} | {backlog} "
          f"| {(float(b[2]) - float(a[2])) / tck / span * 100:.1f} % | {(float(b[1]) - float(a[1])) / tck / span * 100:.0f} % | {b[3]} |")
PY
fi
# (with force: the held transaction may still be sleeping)
psql -X -q "$admin" -c "drop database if exists outbox_rate with (force)"
