#!/usr/bin/env bash
# The floor under the write path's guarantees (issue 43): the article's transaction (an order,
# its audit entry, one event, its receipt) with pgbench, three ways, at 1, 4 and 16 writers, in
# ROUNDS alternating rounds of SECONDS each:
#
#   plain     the article's own tables (no trigger, no check, no function): the reference;
#   floor     the same, with what a request needs before its work to replay rather than fail
#             when its key was used: the key's advisory lock and the receipt's read, pipelined
#             (one round trip), as the Rust unit of work sends them; nothing else;
#   rust      the Rust unit of work's own statements on the project's schema (Outbox::execute
#             as the server sees it: START TRANSACTION ISOLATION LEVEL READ COMMITTED, the lock
#             and the read pipelined, the order, audit, the keyed event, the receipt pipelined
#             with COMMIT).
#
#   bash benches/write_path/run.sh 'postgresql://postgres@127.0.0.1:5432/postgres' [SECONDS] [ROUNDS]
#
# pgbench is the client (C, light), so the shares are the server's; `outbox-relay bench
# --write-path-only` measures the same with the library as the client, and its CPU per commit.
# Uses a fresh database `outbox_write_path` on that server (dropped and re-created) and the
# release binary to migrate it (cargo build --release first). Prints one line per run and the
# shares of plain's tps in the same round.
set -euo pipefail
admin=${1:?usage: run.sh ADMIN_DATABASE_URL [SECONDS] [ROUNDS]}
seconds=${2:-8}
rounds=${3:-3}
here=$(cd "$(dirname "$0")" && pwd)
binary=$(cd "$here/../.." && pwd)/target/release/outbox-relay
[ -x "$binary" ] || { echo "build the release binary first: cargo build --release" >&2; exit 2; }
[[ $admin =~ ^postgres(ql)?://[^?]*/[^/?]+$ ]] || { echo "give a URL of the form postgresql://user@host:port/database, without parameters" >&2; exit 2; }
db=${admin%/*}/outbox_write_path
psql -XAtq -v ON_ERROR_STOP=1 "$admin" -c "drop database if exists outbox_write_path" -c "create database outbox_write_path" 2>/dev/null
DATABASE_URL=$db RUST_LOG=error "$binary" migrate >/dev/null
psql -XAtq -v ON_ERROR_STOP=1 "$db" -f "$here/../../bench-drivers/src/write_tables.sql"

for writers in 1 4 16; do
    for round in $(seq "$rounds"); do
        declare -A tps=()
        for way in plain floor rust; do
            psql -XAtq "$db" -c "truncate bench_orders, bench_article_audit, bench_article_outbox, bench_article_idempotency, outbox_relay.audit, outbox_relay.outbox, outbox_relay.idempotency" -c checkpoint
            out=$(pgbench -n -M prepared -c "$writers" -j "$(( writers < 2 ? 1 : 2 ))" -T "$seconds" -f "$here/$way.pgbench" "$db" 2>&1) \
                || { echo "pgbench failed on $way.pgbench:" >&2; grep -i error <<<"$out" | head -5 >&2; exit 1; }
            tps[$way]=$(sed -n 's/^tps = \([0-9.]*\).*/\1/p' <<<"$out")
        done
        awk -v w="$writers" -v r="$round" -v p="${tps[plain]}" -v f="${tps[floor]}" -v u="${tps[rust]}" 'BEGIN {
            printf "writers %2d round %d: plain %7.0f tps, floor %7.0f (%3.0f %%), rust %7.0f (%3.0f %%)\n", w, r, p, f, f / p * 100, u, u / p * 100 }'
    done
done
