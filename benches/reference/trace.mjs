// Where one event's latency goes: `outbox-relay run --sink stdout` with RUST_LOG=outbox_relay=trace,
// one event every 50 ms from another connection; for each, the moments of the relay's trace lines
// (notified, a worker woke, claiming, a connection in hand, claimed, delivering) and of its stdout
// line, from just before COMMIT. Prints the medians. Usage (trace.sh installs the pg client):
//
//   node trace.mjs DATABASE_URL OUTBOX_RELAY_BINARY [EVENTS]
import { spawn } from "node:child_process";
import { createInterface } from "node:readline";
import pg from "pg";

const [url, binary, eventsArg] = process.argv.slice(2);
const events = Number(eventsArg ?? 300);
const warmup = 20;
const wall = () => (performance.timeOrigin + performance.now()) * 1000; // microseconds since the epoch
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const steps = [
  ["notified", "notified: events were committed"],
  ["a worker woke", "a worker woke"],
  ["claim begins", "claiming"],
  ["connection in hand", "claiming: a connection in hand"],
  ["claimed", "claimed events"],
  ["delivery begins", "delivering"],
];

const relay = spawn(binary, ["run", "--sink", "stdout"], {
  env: { ...process.env, DATABASE_URL: url, RUST_LOG: "outbox_relay=trace", NO_COLOR: "1" },
  stdio: ["ignore", "pipe", "pipe"],
});
const traced = [];
createInterface({ input: relay.stderr }).on("line", (line) => {
  const m = line.replace(/\x1b\[[0-9;]*m/g, "").match(/^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)\.(\d+)Z\s+\w+\s+(.*)$/);
  if (m) traced.push([Date.parse(`${m[1]}Z`) * 1000 + Number(m[2].padEnd(6, "0").slice(0, 6)), m[3]]);
});
const lines = new Map();
createInterface({ input: relay.stdout }).on("line", (line) => lines.set(JSON.parse(line).id, wall()));
const writer = new pg.Client({ connectionString: url });
await writer.connect();
await sleep(1500);
const sent = [];
for (let n = 0; n < warmup + events; n++) {
  await sleep(50);
  await writer.query("begin");
  const { rows } = await writer.query("select outbox_relay.publish('trace.one', '{}'::jsonb) as id");
  const before = wall();
  await writer.query("commit");
  sent.push({ id: Number(rows[0].id), before, committed: wall() });
}
await sleep(500);
relay.kill("SIGTERM");
await writer.end();

// A trace line says `text` when its message is `text`, alone or followed by its fields
// (`target: text key=value ...`).
const says = (message, text) => {
  const i = message.indexOf(`: ${text}`);
  const after = message[i + text.length + 2];
  return i >= 0 && (after === undefined || after === " ");
};
const at = {};
for (const [name] of [["commit returned"], ...steps, ["line on stdout"]]) at[name] = [];
for (const { id, before, committed } of sent.slice(warmup)) {
  const line = lines.get(id);
  if (line === undefined) continue;
  at["commit returned"].push(committed - before);
  for (const [name, text] of steps) {
    const first = traced.find(([t, message]) => t >= before - 50 && t <= line && says(message, text));
    if (first) at[name].push(first[0] - before);
  }
  at["line on stdout"].push(line - before);
}
const median = (v) => [...v].sort((a, b) => a - b)[Math.floor(v.length / 2)];
let previous = 0;
for (const [name, v] of Object.entries(at)) {
  if (v.length === 0) continue;
  const m = median(v);
  console.log(`${name.padEnd(20)} ${String(Math.round(m)).padStart(6)} us  (+${Math.round(m - previous)}, ${v.length} events)`);
  previous = m;
}
process.exit(0);
