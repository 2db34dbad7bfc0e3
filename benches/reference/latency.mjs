// Commit-to-handler latency of graphile-worker and of outbox-relay, measured the same way by
// one driver: one job (event) every 20 ms, each in its own transaction; the interval runs from
// just before COMMIT is sent to the instant the no-op task starts (graphile-worker, in this
// process) or the event's line arrives on `outbox-relay run --sink stdout`'s stdout (which adds
// a pipe hop to outbox-relay's figure). `floor` measures what no relay woken by NOTIFY can beat
// on this server: the same commit, of a transaction that inserts a row (so that its commit
// flushes WAL as the others' do) and calls pg_notify, to the instant a second client of this
// process that LISTENs has the notification (no claim, no delivery).
// `outbox-claim-first` is outbox-relay with its fast path off (`--no-fast-path`: it claims each
// event before it delivers it, as every version before migration 0018 did). `floor-pipe` is the
// floor with the pipe hop that outbox-relay's figure has: the LISTENing client is a child process
// (this script again, as `floor-child`) that writes each notification as a line to its stdout.
// Usage (run.sh installs graphile-worker first):
//
//   node latency.mjs graphile|outbox|outbox-claim-first|floor|floor-pipe DATABASE_URL SAMPLES [OUTBOX_RELAY_BINARY]
import { spawn } from "node:child_process";
import { createInterface } from "node:readline";
import pg from "pg";
import { Logger, run } from "graphile-worker";

const [mode, url, samplesArg, binary] = process.argv.slice(2);
if (mode === "floor-child") {
  const listener = new pg.Client({ connectionString: url });
  await listener.connect();
  listener.on("notification", (message) => process.stdout.write(`${message.payload}\n`));
  await listener.query("listen outbox_reference_floor");
  process.stdout.write("listening\n");
  await new Promise(() => {}); // until the parent kills it
}
const samples = Number(samplesArg ?? 500);
const warmup = 20;
const every = 20;
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const now = () => process.hrtime.bigint();

const started = new Map();
const latencies = [];
const arrived = (n) => {
  const t = now();
  const t0 = started.get(n);
  if (t0 !== undefined) {
    started.delete(n);
    if (n >= warmup) latencies.push(Number(t - t0) / 1e6);
  }
};

const writer = new pg.Client({ connectionString: url });
await writer.connect();
let stop;
let enqueue;
if (mode === "graphile") {
  const runner = await run({
    connectionString: url,
    concurrency: 1,
    noHandleSignals: true,
    // Silent, as outbox-relay is at RUST_LOG=error: its default logs a line per job.
    logger: new Logger(() => () => {}),
    taskList: { noop: async (payload) => arrived(payload.n) },
  });
  enqueue = async (n) => {
    await writer.query("begin");
    await writer.query("select graphile_worker.add_job('noop', json_build_object('n', $1::int))", [n]);
    return n;
  };
  stop = () => runner.stop();
} else if (mode === "outbox" || mode === "outbox-claim-first") {
  const flags = mode === "outbox" ? [] : ["--no-fast-path"];
  const relay = spawn(binary, ["run", "--sink", "stdout", ...flags], {
    env: { ...process.env, DATABASE_URL: url, RUST_LOG: "error" },
    stdio: ["ignore", "pipe", "inherit"],
  });
  const ids = new Map();
  createInterface({ input: relay.stdout }).on("line", (line) => {
    const id = JSON.parse(line).id;
    if (ids.has(id)) arrived(ids.get(id));
  });
  await sleep(1000);
  enqueue = async (n) => {
    await writer.query("begin");
    const { rows } = await writer.query("select outbox_relay.publish('bench.reference', json_build_object('n', $1::int)::jsonb) as id", [n]);
    ids.set(Number(rows[0].id), n);
    return n;
  };
  stop = async () => relay.kill("SIGTERM");
} else if (mode === "floor" || mode === "floor-pipe") {
  if (mode === "floor") {
    const listener = new pg.Client({ connectionString: url });
    await listener.connect();
    listener.on("notification", (message) => arrived(Number(message.payload)));
    await listener.query("listen outbox_reference_floor");
    stop = () => listener.end();
  } else {
    const child = spawn(process.execPath, [process.argv[1], "floor-child", url], { stdio: ["ignore", "pipe", "inherit"] });
    const lines = createInterface({ input: child.stdout });
    await new Promise((resolve) => lines.once("line", resolve)); // "listening"
    lines.on("line", (line) => arrived(Number(line)));
    stop = async () => child.kill("SIGTERM");
  }
  await writer.query("create table if not exists outbox_reference_floor (n int)");
  enqueue = async (n) => {
    await writer.query("begin");
    await writer.query("insert into outbox_reference_floor values ($1)", [n]);
    await writer.query("select pg_notify('outbox_reference_floor', $1::text)", [n]);
    return n;
  };
} else {
  throw new Error(`mode is ${mode}; it must be graphile, outbox, outbox-claim-first, floor or floor-pipe`);
}

for (let n = 0; n < warmup + samples; n++) {
  await sleep(every);
  await enqueue(n);
  started.set(n, now());
  await writer.query("commit");
}
const deadline = Date.now() + 10_000;
while (latencies.length < samples && Date.now() < deadline) await sleep(10);
await stop();
await writer.end();
latencies.sort((a, b) => a - b);
const at = (q) => latencies[Math.min(latencies.length - 1, Math.floor(q * latencies.length))];
console.log(JSON.stringify({ mode, samples: latencies.length, p50_ms: at(0.5), p90_ms: at(0.9), p99_ms: at(0.99), max_ms: latencies.at(-1) }));
process.exit(latencies.length === samples ? 0 : 1);
