#!/usr/bin/env python3
"""Receivers of the kind users run, for benches/receivers/run.sh (issue 21).

    python3 receiver.py PORT [--delay-ms D] [--rate R] [--threaded|--deep]

Default: Python's own http.server (ThreadingHTTPServer, HTTP/1.0, a listen backlog of 5, as
socketserver sets it), answering 200 after D ms (0 by default). --rate R answers 429 with
Retry-After: 1 to requests past R per second (a sliding second). --deep listens with a backlog of
1024 instead (a receiver whose queue does not overflow). GET /stats returns
{"requests", "accepted", "distinct", "duplicates", "rejected"} as JSON; every accepted event is
counted by its Outbox-Event-Id.
"""
import collections
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

port = int(sys.argv[1])
args = sys.argv[2:]
delay = float(args[args.index("--delay-ms") + 1]) / 1000 if "--delay-ms" in args else 0.0
rate = float(args[args.index("--rate") + 1]) if "--rate" in args else None
lock = threading.Lock()
seen = collections.Counter()
stats = {"requests": 0, "accepted": 0, "rejected": 0}
window = collections.deque()


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *_):
        pass

    def do_GET(self):
        with lock:
            body = dict(stats, distinct=len(seen), duplicates=sum(n - 1 for n in seen.values()))
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if delay:
            time.sleep(delay)
        event = self.headers.get("Outbox-Event-Id")
        with lock:
            stats["requests"] += 1
            now = time.monotonic()
            while window and window[0] <= now - 1:
                window.popleft()
            refused = rate is not None and len(window) >= rate
            if refused:
                stats["rejected"] += 1
            else:
                window.append(now)
                stats["accepted"] += 1
                seen[event] += 1
        if refused:
            self.send_response(429)
            self.send_header("Retry-After", "1")
        else:
            self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()


class Deep(ThreadingHTTPServer):
    request_queue_size = 1024


server = (Deep if "--deep" in args else ThreadingHTTPServer)(("127.0.0.1", port), Handler)
server.daemon_threads = True
server.serve_forever()
