//! A real OTLP endpoint for the trace tests: a private HTTP server in Python that decodes what it
//! receives with OpenTelemetry's own protobuf classes (the `opentelemetry-proto` package) and
//! keeps every span as a line of JSON. No one here wrote the decoder; the server only writes
//! down what it decoded.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::Deserialize;

use crate::support::free_port;
use crate::tools::{PythonPackage, answers, log_tail, private_dir, probe_python, spawn_watchdog};

/// OpenTelemetry's Python classes of the OTLP protocol.
pub const OPENTELEMETRY_PROTO: PythonPackage = PythonPackage {
    module: "opentelemetry.proto.collector.trace.v1.trace_service_pb2",
    pip: "opentelemetry-proto>=1.20",
};

const COLLECTOR: &str = r#"
import json, sys, http.server
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest, ExportTraceServiceResponse)
from google.protobuf.json_format import MessageToDict

port, out = int(sys.argv[1]), sys.argv[2]

def value(v):
    d = MessageToDict(v)
    return next(iter(d.values()), None)

class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if self.path != "/v1/traces":
            self.send_response(404); self.end_headers(); return
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        with open(out, "a") as f:
            for rs in request.resource_spans:
                resource = {a.key: value(a.value) for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        f.write(json.dumps({
                            "service": resource.get("service.name"),
                            "scope": ss.scope.name,
                            "name": s.name,
                            "kind": s.kind,
                            "trace_id": s.trace_id.hex(),
                            "span_id": s.span_id.hex(),
                            "parent_span_id": s.parent_span_id.hex() or None,
                            "links": [{"trace_id": l.trace_id.hex(), "span_id": l.span_id.hex()} for l in s.links],
                            "attributes": {a.key: value(a.value) for a in s.attributes},
                            "status": s.status.code,
                        }) + "\n")
        answer = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass

http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"#;

/// A span as the collector decoded it.
#[derive(Debug, Clone, Deserialize)]
pub struct Span {
    /// The resource's `service.name`.
    pub service: Option<String>,
    /// The instrumentation scope's name.
    pub scope: String,
    /// The span's name (`send order.placed`).
    pub name: String,
    /// OTLP's span kind: 1 internal, 2 server, 3 client, 4 producer, 5 consumer.
    pub kind: i32,
    /// Its trace, in hex.
    pub trace_id: String,
    /// Its id, in hex.
    pub span_id: String,
    /// Its parent's id, in hex; `None` for a trace's root.
    pub parent_span_id: Option<String>,
    /// The spans it links to.
    pub links: Vec<Link>,
    /// Attribute values as protobuf's JSON mapping gives them (an int64 as a string).
    pub attributes: HashMap<String, serde_json::Value>,
    /// OTLP's status code: 0 unset, 1 ok, 2 error.
    pub status: i32,
}

/// A span's link to another.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct Link {
    /// The linked span's trace, in hex.
    pub trace_id: String,
    /// The linked span's id, in hex.
    pub span_id: String,
}

impl Span {
    /// An attribute as text.
    pub fn attribute(&self, name: &str) -> Option<String> {
        self.attributes.get(name).map(|v| v.as_str().map_or_else(|| v.to_string(), str::to_string))
    }
}

/// OTLP's producer span kind.
pub const PRODUCER: i32 = 4;

/// A private OTLP/HTTP endpoint, stopped when dropped (or by a watchdog when the test process is
/// killed).
pub struct Collector {
    server: Child,
    port: u16,
    dir: PathBuf,
    _watchdog: Child,
}

impl Collector {
    /// Starts one on a free port; fails the test naming what to install when python3 or
    /// opentelemetry-proto is missing.
    pub fn start() -> Collector {
        let python3 = probe_python(&[OPENTELEMETRY_PROTO]);
        let dir = private_dir("otlp").unwrap_or_else(|e| panic!("{e}"));
        let watchdog = spawn_watchdog("OTLP collector", &dir).unwrap_or_else(|e| panic!("{e}"));
        let port = free_port();
        let log = std::fs::File::create(dir.join("log")).expect("the collector's log");
        let server = Command::new(python3)
            .arg("-c")
            .arg(COLLECTOR)
            .arg(port.to_string())
            .arg(dir.join("spans.jsonl"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("the log"))
            .stderr(log)
            .spawn()
            .expect("python3 starts");
        std::fs::write(dir.join("pid"), server.id().to_string()).expect("writing the collector's pid");
        let collector = Collector { server, port, dir, _watchdog: watchdog };
        let started = Instant::now();
        while answers(&collector.endpoint(), port).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "the OTLP collector did not start: {}",
                log_tail(&collector.dir)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        collector
    }

    /// Its base URL, as `OTEL_EXPORTER_OTLP_ENDPOINT` takes it.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<Span> {
        let text = std::fs::read_to_string(self.dir.join("spans.jsonl")).unwrap_or_default();
        text.lines().map(|line| serde_json::from_str(line).expect("a span line")).collect()
    }

    /// The spans once `done` holds of them; fails the test after `patience`.
    pub async fn wait_for(&self, what: &str, patience: Duration, done: impl Fn(&[Span]) -> bool) -> Vec<Span> {
        let started = Instant::now();
        loop {
            let spans = self.spans();
            if done(&spans) {
                return spans;
            }
            assert!(started.elapsed() < patience, "{what}: not within {patience:?}; the spans: {spans:#?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        let _ = self.server.kill();
        let _ = self.server.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
