//! `run --sink http://…` with the receivers' conventions: signing secrets from flags and from
//! the environment, CloudEvents, fixed headers; none of their values in the output.

use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::http::HeaderMap;
use axum::routing::post;
use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

use crate::binary::{BIN, cli, publish, stderr, terminate_with_output};
use crate::harness::TestDb;
use crate::relay_support::{PATIENCE, eventually};

const SECRET_A: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const SECRET_B: &str = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD";

pub type Seen = Arc<Mutex<Vec<(HeaderMap, Bytes)>>>;

/// A receiver at `/hook` that answers 200 and keeps every request's headers and body.
pub async fn receiver() -> (String, Seen) {
    let seen: Seen = Arc::default();
    let app = axum::Router::new().route(
        "/hook",
        post({
            let seen = seen.clone();
            move |headers: HeaderMap, body: Bytes| async move {
                seen.lock().unwrap().push((headers, body));
                axum::http::StatusCode::OK
            }
        }),
    );
    let addr = crate::binary::serve(app).await;
    (format!("http://{addr}/hook"), seen)
}

/// Verifies one request with the official `standardwebhooks` package; "ok" or its error.
fn verify(secret: &str, headers: &HeaderMap, body: &[u8]) -> String {
    let headers: serde_json::Map<String, serde_json::Value> =
        headers.iter().map(|(k, v)| (k.to_string(), json!(v.to_str().unwrap()))).collect();
    let script = r#"
import json, sys
from standardwebhooks.webhooks import Webhook
headers = json.loads(sys.argv[2])
try:
    Webhook(sys.argv[1]).verify(sys.stdin.buffer.read(), headers)
    print("ok")
except Exception as e:
    print(type(e).__name__, e)
"#;
    let headers = serde_json::Value::Object(headers).to_string();
    let output = crate::tools::python(script, &[secret, &headers], body, &[crate::tools::STANDARDWEBHOOKS]);
    assert!(output.status.success(), "the verifying script failed: {}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8(output.stdout).unwrap().trim().to_string()
}

#[tokio::test]
async fn http_options_are_checked_without_showing_their_values() {
    let db = TestDb::new().await;
    let (url, _) = receiver().await;
    for (args, says, hidden) in [
        (vec!["--sink", "stdout", "--signing-secret", SECRET_A], "HTTP sink only", "MfKQ9r8"),
        (vec!["--sink", &url, "--signing-secret", "whsec_c2VjcmV0LXNob3J0"], "at least 16", "c2VjcmV0"),
        (vec!["--sink", &url, "--signing-secret", "s3cr3t-without-prefix"], "whsec_", "s3cr3t"),
        (vec!["--sink", &url, "--header", "Bearer tok-77c"], "'Name: value'", "tok-77c"),
        (vec!["--sink", &url, "--header", "Content-Type: text/plain"], "set by the sink", "text/plain"),
        (vec!["--sink", &url, "--format", "xml"], "invalid value 'xml'", "(nothing secret)"),
        (vec!["--sink", &url, "--signing-secret", ""], "is empty", "(nothing secret)"),
        (vec!["--sink", &url, "--header", "Upgrade: h2c"], "set by the sink", "h2c"),
        (vec!["--sink", &url, "--cloudevents-source", "urn:x"], "--format cloudevents", "(nothing secret)"),
        (vec!["--sink", &url, "--exchange", "orders"], "RabbitMQ sink", "(nothing secret)"),
        (vec!["--sink", "amqp://guest:guest@127.0.0.1:5672/%2f", "--subject-prefix", "x"], "NATS sink", "guest:guest"),
    ] {
        let output = cli(&db.url, &[&["run"], args.as_slice()].concat()).await;
        let text = stderr(&output);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {text}");
        assert!(text.contains(says), "{args:?}: {text}");
        assert!(!text.contains(hidden), "{args:?} shows its value: {text}");
    }
}

/// Signatures verified by the official Python standardwebhooks package.
mod needs_python {
    use super::*;

    #[tokio::test]
    async fn secrets_from_the_environment_and_headers_from_flags_reach_the_receiver_unshown() {
        let db = TestDb::new().await;
        let (url, seen) = receiver().await;
        let mut child = Command::new(BIN)
            .args([
                "run",
                "--sink",
                &url,
                "--format",
                "cloudevents",
                "--cloudevents-source",
                "urn:shop:orders",
                "--header",
                "Authorization: Bearer tok-8b1d",
            ])
            .env("DATABASE_URL", &db.url)
            .env("OUTBOX_RELAY_SIGNING_SECRETS", format!("{SECRET_A},{SECRET_B}"))
            .env("RUST_LOG", "debug")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        // Read as it is written: a debug log left in its pipe stops the relay once the pipe is
        // full (64 KiB: the statements it prepares at start, logged whole, come near that).
        let mut log = BufReader::new(child.stderr.take().unwrap()).lines();
        let reader = tokio::spawn(async move {
            let mut lines = Vec::new();
            while let Ok(Some(line)) = log.next_line().await {
                lines.push(line);
            }
            lines.join("\n")
        });
        let id = publish(&db, "order.placed", json!({"n": 1})).await;
        eventually("delivered", || async { !seen.lock().unwrap().is_empty() }).await;
        let (headers, body) = seen.lock().unwrap()[0].clone();
        assert_eq!(headers["outbox-event-id"], id.to_string().as_str());
        let uuid = headers["outbox-event-uuid"].to_str().unwrap();
        assert!(pg_outbox_relay::Uuid::parse_str(uuid).is_ok(), "{uuid}");
        assert_eq!(headers["ce-id"], uuid, "the CloudEvent's id is the event's uuid");
        assert_eq!(headers["ce-source"], "urn:shop:orders");
        assert_eq!(headers["authorization"], "Bearer tok-8b1d");
        assert_eq!(headers["webhook-id"], uuid, "webhook-id is the event's uuid");
        assert_eq!(verify(SECRET_A, &headers, &body), "ok");
        assert_eq!(verify(SECRET_B, &headers, &body), "ok");
        assert_eq!(&body[..], br#"{"n": 1}"#, "binary mode: the body is the payload, as PostgreSQL stores it");

        terminate_with_output(child).await;
        let logs = tokio::time::timeout(PATIENCE, reader).await.expect("the log ends when the relay stops").unwrap();
        for secret in ["MfKQ9r8GKYqrTwjUPD8I", "C2FVsBQIhrscChlQ", "tok-8b1d"] {
            assert!(!logs.contains(secret), "{secret} in the logs:\n{logs}");
        }
    }

    /// Flags that follow a `--route` are that route's own (issue 40, item 7): two HTTP routes with
    /// their own secret, format and header, and a stdout route beside them that a signing secret
    /// given to every route would have made a usage error; a flag before the first route applies to
    /// all. Before, every flag applied to every route, so such a command was refused.
    #[tokio::test]
    async fn flags_after_a_route_are_its_own_so_mixed_routes_need_no_file() {
        let db = TestDb::new().await;
        let (erp, erp_seen) = receiver().await;
        let (crm, crm_seen) = receiver().await;
        let erp_route = format!("erp=order.#={erp}");
        let crm_route = format!("crm=order.#={crm}");
        let mut child = Command::new(BIN)
            .args(["run", "--timeout", "5s", "--route", &erp_route, "--signing-secret", SECRET_A])
            .args(["--header", "X-Route: erp", "--route", &crm_route, "--format", "cloudevents", "--signing-secret"])
            .args([SECRET_B, "--route", "audit=#=stdout"])
            .env("DATABASE_URL", &db.url)
            .env("RUST_LOG", "info")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let id = publish(&db, "order.placed", json!({"n": 1})).await;
        let line = tokio::time::timeout(PATIENCE, lines.next_line()).await.expect("the audit line").unwrap().unwrap();
        assert_eq!(serde_json::from_str::<serde_json::Value>(&line).unwrap()["id"], json!(id));
        eventually("both receivers got the order", || async {
            erp_seen.lock().unwrap().len() == 1 && crm_seen.lock().unwrap().len() == 1
        })
        .await;
        let (erp_headers, erp_body) = erp_seen.lock().unwrap()[0].clone();
        let (crm_headers, crm_body) = crm_seen.lock().unwrap()[0].clone();
        assert_eq!(verify(SECRET_A, &erp_headers, &erp_body), "ok", "erp signs with its own secret");
        assert_ne!(verify(SECRET_B, &erp_headers, &erp_body), "ok", "and not with crm's");
        assert_eq!(verify(SECRET_B, &crm_headers, &crm_body), "ok", "crm signs with its own secret");
        assert_eq!(erp_headers["x-route"], "erp");
        assert!(!crm_headers.contains_key("x-route"), "a header given after erp's route is erp's only");
        assert!(crm_headers.contains_key("ce-id") && !erp_headers.contains_key("ce-id"), "crm's format is its own");
        let output = terminate_with_output(child).await;
        assert!(output.status.success(), "{}", stderr(&output));

        // A flag that fits no sink of the route it follows names that route.
        let out = cli(&db.url, &["run", "--route", "audit=#=stdout", "--signing-secret", SECRET_A]).await;
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        assert!(stderr(&out).contains("destination \"audit\": signing secrets"), "{}", stderr(&out));
        assert!(!stderr(&out).contains(SECRET_A), "{}", stderr(&out));
    }
}
