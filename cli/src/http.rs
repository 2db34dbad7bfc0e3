//! `run --http ADDR` and `console --listen ADDR`: Prometheus metrics, liveness and readiness
//! probes, and the console, on one small axum server.
//!
//! Safe by default: it binds where it is told and nowhere else; on a loopback address it answers
//! only requests whose `Host` names a loopback host (a page elsewhere cannot reach it by DNS
//! rebinding). Requests that change data are POSTs carrying the process's CSRF token (the
//! console's forms hold it); with `--http-token` they must also carry that token, and on any
//! other address they are refused without one. The token is compared in constant time and never
//! logged.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{Form, Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use outbox_relay::prometheus::{CONTENT_TYPE, Exporter};
use outbox_relay::sink::Secret;
use outbox_relay::{Outbox, RelayMetrics};
use serde::Deserialize;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::CliError;
use crate::console;

/// How long `/readyz` waits for the database.
const READY_TIMEOUT: Duration = Duration::from_secs(2);

/// Checks an access token: at least 16 characters, no spaces or controls. The error never
/// shows it (a clap value parser's would).
fn check_token(token: &Secret) -> Result<(), crate::UsageError> {
    let text = token.expose();
    if text.chars().count() < 16 {
        return Err(crate::UsageError("the --http-token must be at least 16 characters long".into()));
    }
    if text.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err(crate::UsageError("the --http-token must not contain spaces or control characters".into()));
    }
    Ok(())
}

/// What every request handler reads.
pub(crate) struct Console {
    pub(crate) outbox: Outbox,
    exporter: Exporter,
    pub(crate) relay: Option<Arc<RelayMetrics>>,
    /// The CSRF token of this process, in every form.
    pub(crate) csrf: String,
    token: Option<Secret>,
    /// Whether actions may run at all (a token is set, or the address is loopback).
    pub(crate) actions_allowed: bool,
    /// Whether actions need the token.
    pub(crate) token_required: bool,
    loopback: bool,
    /// The relay's latency and rate, every [`SAMPLE_EVERY`], for the console's chart.
    pub(crate) history: std::sync::Mutex<std::collections::VecDeque<Sample>>,
}

/// How often the chart's history is sampled, and how many samples it keeps (ten minutes).
const SAMPLE_EVERY: Duration = Duration::from_secs(2);
const SAMPLES_KEPT: usize = 300;

/// One point of the console's latency chart.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub(crate) struct Sample {
    /// Unix time, milliseconds.
    at_ms: u64,
    /// Latency percentiles of recent deliveries (the relay's window of the last 4,096), ms.
    p50_ms: Option<f64>,
    p99_ms: Option<f64>,
    /// Events delivered per second since the sample before.
    rate: f64,
}

/// Binds `addr` now (so that a taken port fails the command at once) and returns the server,
/// to be run until `stop`.
pub(crate) async fn bind(
    addr: SocketAddr,
    outbox: &Outbox,
    relay: Option<Arc<RelayMetrics>>,
    token: Option<Secret>,
) -> Result<(tokio::net::TcpListener, Arc<Console>), CliError> {
    if let Some(token) = &token {
        check_token(token)?;
    }
    let listener =
        tokio::net::TcpListener::bind(addr).await.map_err(|e| format!("cannot listen for HTTP on {addr}: {e}"))?;
    let loopback = addr.ip().is_loopback();
    let exporter = match &relay {
        Some(metrics) => Exporter::new(outbox).with_relay(metrics.clone()),
        None => Exporter::new(outbox),
    };
    let console = Console {
        outbox: outbox.clone(),
        exporter,
        relay,
        csrf: format!("{:032x}", rand::random::<u128>()),
        token_required: token.is_some(),
        actions_allowed: token.is_some() || loopback,
        token,
        loopback,
        history: std::sync::Mutex::default(),
    };
    let bound = listener.local_addr().map_err(|e| format!("cannot read the HTTP address: {e}"))?;
    if console.actions_allowed {
        tracing::info!(address = %bound, token = console.token_required, "serving /metrics, /healthz, /readyz and the console");
    } else {
        tracing::warn!(address = %bound, "serving /metrics, /healthz, /readyz and a read-only console: actions on a non-loopback address need --http-token (or OUTBOX_RELAY_HTTP_TOKEN)");
    }
    Ok((listener, Arc::new(console)))
}

/// Samples the relay's latency and delivery rate for the chart, until `stop`.
async fn sample(console: Arc<Console>, relay: Arc<RelayMetrics>, stop: CancellationToken) {
    let mut last = relay.snapshot().delivered;
    let mut ticks = tokio::time::interval(SAMPLE_EVERY);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks.tick().await;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = ticks.tick() => {}
        }
        let s = relay.snapshot();
        let ms = |d: Option<Duration>| d.map(|d| d.as_secs_f64() * 1000.0);
        let at_ms =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        let rate = s.delivered.saturating_sub(last) as f64 / SAMPLE_EVERY.as_secs_f64();
        last = s.delivered;
        let mut history = console.history.lock().unwrap_or_else(|e| e.into_inner());
        if history.len() == SAMPLES_KEPT {
            history.pop_front();
        }
        history.push_back(Sample { at_ms, p50_ms: ms(s.latency_p50), p99_ms: ms(s.latency_p99), rate });
    }
}

/// Serves until `stop`.
pub(crate) async fn serve(listener: tokio::net::TcpListener, console: Arc<Console>, stop: CancellationToken) {
    if let Some(relay) = console.relay.clone() {
        tokio::spawn(sample(console.clone(), relay, stop.clone()));
    }
    let app = Router::new()
        .route("/", get(console_page))
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/api/summary", get(summary))
        .route("/api/events/{id}", get(event))
        .route("/actions/{action}", post(action))
        .layer(middleware::from_fn_with_state(console.clone(), guard))
        .with_state(console);
    let served = axum::serve(listener, app).with_graceful_shutdown(async move { stop.cancelled().await }).await;
    if let Err(e) = served {
        tracing::error!(error = %e, "the HTTP server stopped");
    }
}

/// Refuses requests to a loopback address whose `Host` is not a loopback name, and sets the
/// headers every response carries.
async fn guard(State(console): State<Arc<Console>>, request: Request, next: Next) -> Response {
    if console.loopback && !request.headers().get(header::HOST).and_then(|h| h.to_str().ok()).is_some_and(loopback_host)
    {
        return (
            StatusCode::MISDIRECTED_REQUEST,
            "this server answers only to a loopback Host (127.0.0.1, [::1], localhost)\n",
        )
            .into_response();
    }
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    headers.insert(header::X_CONTENT_TYPE_OPTIONS, header::HeaderValue::from_static("nosniff"));
    headers.insert(header::X_FRAME_OPTIONS, header::HeaderValue::from_static("DENY"));
    headers.insert(header::CACHE_CONTROL, header::HeaderValue::from_static("no-store"));
    headers.insert(header::REFERRER_POLICY, header::HeaderValue::from_static("no-referrer"));
    // The page's one script and style are inline and ours; nothing else may load or frame it.
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        header::HeaderValue::from_static(
            "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src 'self' data:; frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
        ),
    );
    response
}

/// `127.0.0.1:9187`, `[::1]:9187`, `localhost` and the like.
fn loopback_host(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(""),
        None => host
            .rsplit_once(':')
            .map_or(host, |(name, port)| if port.bytes().all(|b| b.is_ascii_digit()) { name } else { host }),
    };
    name.eq_ignore_ascii_case("localhost") || name.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

async fn metrics(State(console): State<Arc<Console>>) -> Response {
    ([(header::CONTENT_TYPE, CONTENT_TYPE)], console.exporter.encode().await).into_response()
}

/// Liveness: the process serves, and its relay (if it runs one) has not stopped.
async fn healthz(State(console): State<Arc<Console>>) -> Response {
    match &console.relay {
        Some(relay) if !relay.snapshot().running => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({"status": "stopped", "reason": "the relay is not running"})),
        )
            .into_response(),
        _ => axum::Json(json!({"status": "ok"})).into_response(),
    }
}

/// Readiness: the database answers and, with a relay, its listener listens.
async fn readyz(State(console): State<Arc<Console>>) -> Response {
    let reason = match tokio::time::timeout(READY_TIMEOUT, console.outbox.ping()).await {
        Err(_) => Some(format!("the database did not answer within {READY_TIMEOUT:?}")),
        Ok(Err(e)) => Some(format!("the database does not answer: {}", crate::one_line(&e.to_string()))),
        Ok(Ok(())) => match &console.relay {
            Some(relay) if !relay.snapshot().listening => {
                Some("the relay's listener is not listening (it reconnects)".to_string())
            }
            _ => None,
        },
    };
    match reason {
        None => axum::Json(json!({"ready": true})).into_response(),
        Some(reason) => {
            (StatusCode::SERVICE_UNAVAILABLE, axum::Json(json!({"ready": false, "reason": reason}))).into_response()
        }
    }
}

#[derive(Deserialize)]
struct PageQuery {
    /// An event id or key to look up.
    lookup: Option<String>,
    /// What the last action did, shown once.
    done: Option<String>,
}

async fn console_page(State(console): State<Arc<Console>>, Query(query): Query<PageQuery>) -> Response {
    Html(console::page(&console, query.lookup.as_deref(), query.done.as_deref()).await).into_response()
}

async fn summary(State(console): State<Arc<Console>>) -> Response {
    match console::summary(&console).await {
        Ok(summary) => axum::Json(summary).into_response(),
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, axum::Json(json!({"error": crate::one_line(&e.to_string())})))
            .into_response(),
    }
}

/// One event (pending, processed or dead) with its payload: what the console shows on demand.
async fn event(State(console): State<Arc<Console>>, Path(id): Path<i64>) -> Response {
    match console.outbox.look_up(Some(id), None, 1).await {
        Ok(found) => match found.into_iter().next() {
            Some(event) => axum::Json(event).into_response(),
            None => {
                (StatusCode::NOT_FOUND, axum::Json(json!({"error": format!("no event with id {id}")}))).into_response()
            }
        },
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, axum::Json(json!({"error": crate::one_line(&e.to_string())})))
            .into_response(),
    }
}

#[derive(Deserialize)]
struct ActionForm {
    csrf: Option<String>,
    token: Option<String>,
    /// A dead letter's id (retry, purge), or none for all of them.
    id: Option<String>,
    /// A topic (pause, resume), or none for every topic.
    topic: Option<String>,
}

/// Retry, purge, pause, resume: checks the CSRF token and, where needed, the access token; then
/// runs the action and goes back to the console with what it did.
async fn action(
    State(console): State<Arc<Console>>,
    Path(action): Path<String>,
    headers: HeaderMap,
    Form(form): Form<ActionForm>,
) -> Response {
    if !console.actions_allowed {
        return refuse(
            StatusCode::FORBIDDEN,
            "actions on a non-loopback address need --http-token (or OUTBOX_RELAY_HTTP_TOKEN)",
        );
    }
    if !form.csrf.as_deref().is_some_and(|given| same(given, &console.csrf)) {
        return refuse(StatusCode::FORBIDDEN, "missing or stale CSRF token: reload the console and try again");
    }
    if let Some(token) = &console.token {
        let bearer =
            headers.get(header::AUTHORIZATION).and_then(|h| h.to_str().ok()).and_then(|h| h.strip_prefix("Bearer "));
        let given = form.token.as_deref().filter(|t| !t.is_empty()).or(bearer);
        if !given.is_some_and(|given| same(given, token.expose())) {
            return refuse(StatusCode::UNAUTHORIZED, "this action needs the console's access token (--http-token)");
        }
    }
    let id = match form.id.as_deref().map(str::trim).filter(|id| !id.is_empty()) {
        None => None,
        Some(text) => match text.parse::<i64>() {
            Ok(id) => Some(id),
            Err(_) => return refuse(StatusCode::BAD_REQUEST, &format!("{text:?} is no event id")),
        },
    };
    let topic = form.topic.as_deref().map(str::trim).filter(|t| !t.is_empty());
    let outbox = &console.outbox;
    let done = match action.as_str() {
        "retry" => match id {
            Some(id) => outbox.retry_dead_letters(&[id]).await.map(|ids| counted("retried", &ids)),
            None => outbox.retry_all_dead_letters().await.map(|ids| counted("retried", &ids)),
        },
        "purge" => match id {
            Some(id) => outbox.purge_dead_letters_by_id(&[id]).await.map(|ids| counted("purged", &ids)),
            None => outbox.purge_dead_letters(Duration::ZERO).await.map(|n| format!("purged {n} dead letters")),
        },
        "pause" => outbox.pause(topic).await.map(|new| match (new, topic) {
            (true, Some(t)) => format!("paused topic {t}"),
            (true, None) => "paused every topic".into(),
            (false, _) => "it was paused already".into(),
        }),
        "resume" => outbox.resume(topic).await.map(|lifted| match (lifted, topic) {
            (true, Some(t)) => format!("resumed topic {t}"),
            (true, None) => "lifted the pause of every topic".into(),
            (false, _) => "it was not paused".into(),
        }),
        other => return refuse(StatusCode::NOT_FOUND, &format!("no action {other:?}")),
    };
    match done {
        Ok(done) => {
            tracing::info!(action = %action, id, topic, "{done} (console)");
            let query = query_pair("done", &done);
            Redirect::to(&format!("/?{query}")).into_response()
        }
        Err(e) if e.kind() == outbox_relay::ErrorKind::InvalidInput => refuse(StatusCode::BAD_REQUEST, &e.to_string()),
        Err(e) => refuse(StatusCode::SERVICE_UNAVAILABLE, &crate::one_line(&e.to_string())),
    }
}

fn counted(what: &str, ids: &[i64]) -> String {
    match ids {
        [] => format!("{what} nothing: no such dead letter"),
        [id] => format!("{what} dead letter {id}"),
        ids => format!("{what} {} dead letters", ids.len()),
    }
}

fn refuse(status: StatusCode, reason: &str) -> Response {
    (status, [(header::CONTENT_TYPE, "text/plain; charset=utf-8")], format!("{reason}\n")).into_response()
}

/// Equal, in time that depends only on the lengths.
fn same(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// `name=value`, the value percent-encoded for a query string.
fn query_pair(name: &str, value: &str) -> String {
    let mut out = format!("{name}=");
    for b in value.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_hosts_pass() {
        for host in ["127.0.0.1:9187", "localhost", "LOCALHOST:80", "[::1]:9187", "[::1]", "127.1.2.3"] {
            assert!(loopback_host(host), "{host}");
        }
        for host in ["evil.example:9187", "10.0.0.1:9187", "localhost.evil.example", "[::2]:1", "", "127.0.0.1.nip.io"]
        {
            assert!(!loopback_host(host), "{host}");
        }
    }

    #[test]
    fn tokens_compare_whole() {
        assert!(same("abc", "abc"));
        assert!(!same("abc", "abd"));
        assert!(!same("abc", "abcd"));
        assert!(check_token(&Secret::new("short")).is_err());
        assert!(check_token(&Secret::new("with a space in it ok?")).is_err());
        assert!(check_token(&Secret::new("0123456789abcdef")).is_ok());
    }

    #[test]
    fn the_message_is_percent_encoded() {
        assert_eq!(query_pair("done", "paused topic a/b & c"), "done=paused%20topic%20a%2Fb%20%26%20c");
    }
}
