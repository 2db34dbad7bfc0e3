// A receiver that is not the bottleneck, for benches/receivers/run.sh (issue 21): Node's http
// server, keep-alive, answering 200 after D ms, or 429 (Retry-After: 1) past R requests per
// second; listen backlog B (511 by default). GET /stats as receiver.py's.
//
//   node receiver.mjs PORT [--delay-ms D] [--rate R] [--backlog B]
import http from "node:http";

const [portArg, ...args] = process.argv.slice(2);
const opt = (name, fallback) => (args.includes(name) ? Number(args[args.indexOf(name) + 1]) : fallback);
const delay = opt("--delay-ms", 0);
const rate = opt("--rate", null);
const backlog = opt("--backlog", 511);
const seen = new Map();
const stats = { requests: 0, accepted: 0, rejected: 0 };
const window = [];

const server = http.createServer((req, res) => {
  if (req.method === "GET") {
    let duplicates = 0;
    for (const n of seen.values()) duplicates += n - 1;
    res.end(JSON.stringify({ ...stats, distinct: seen.size, duplicates }));
    return;
  }
  req.resume();
  req.on("end", () => {
    setTimeout(() => {
      stats.requests++;
      const now = performance.now();
      while (window.length && window[0] <= now - 1000) window.shift();
      if (rate !== null && window.length >= rate) {
        stats.rejected++;
        res.writeHead(429, { "Retry-After": "1", "Content-Length": "0" }).end();
        return;
      }
      window.push(now);
      stats.accepted++;
      const id = req.headers["outbox-event-id"];
      seen.set(id, (seen.get(id) ?? 0) + 1);
      res.writeHead(200, { "Content-Length": "0" }).end();
    }, delay);
  });
});
server.keepAliveTimeout = 60_000;
server.listen(Number(portArg), "127.0.0.1", backlog);
