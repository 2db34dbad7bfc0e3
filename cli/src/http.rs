//! `run --http ADDR` and `console --listen ADDR`: Prometheus metrics, liveness and readiness
//! probes, and the console, on one small axum server.
//!
//! Safe by default: it binds where it is told and nowhere else; on a loopback address it answers
//! only requests whose `Host` names a loopback host (a page elsewhere cannot reach it by DNS
//! rebinding). The console (its pages, its API, its actions: everything but `/metrics` and the
//! probes) needs the `--http-token` when one is set, given once at a login form (a session
//! cookie follows) or as `Authorization: Bearer`; on an address that is not loopback it is not
//! served without one. Requests that change data are POSTs carrying the process's CSRF token
//! (the console's forms hold it) and say exactly what they act on. The token is compared in
//! constant time and never logged.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{Form, Path, Query, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use pg_outbox_relay::prometheus::{CONTENT_TYPE, Exporter};
use pg_outbox_relay::sink::Secret;
use pg_outbox_relay::{Outbox, RelayMetrics};
use serde::Deserialize;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::console::{self, Console, Sample};
use crate::outcome::CliError;

/// How long `/readyz` waits for the database.
const READY_TIMEOUT: Duration = Duration::from_secs(2);
/// How long one database operation of the console may wait (at most; `--db-timeout` when shorter).
const CONSOLE_DB_TIMEOUT: Duration = Duration::from_secs(4);
/// How long a console request (a page makes several operations) may take in all.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Checks an access token: at least 16 characters, no spaces or controls. The error never
/// shows it (a clap value parser's would).
fn check_token(token: &Secret) -> Result<(), crate::outcome::UsageError> {
    let text = token.expose();
    if text.chars().count() < 16 {
        return Err(crate::outcome::UsageError("the --http-token must be at least 16 characters long".into()));
    }
    if text.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err(crate::outcome::UsageError(
            "the --http-token must not contain spaces or control characters".into(),
        ));
    }
    Ok(())
}

/// How often the chart's history is sampled, and how many samples it keeps (ten minutes).
const SAMPLE_EVERY: Duration = Duration::from_secs(2);
const SAMPLES_KEPT: usize = 300;

/// Binds `addr` now (so that a taken port fails the command at once) and returns the server,
/// to be run until `stop`.
pub(crate) async fn bind(
    addr: SocketAddr,
    outbox: &Outbox,
    destinations: Option<Vec<(String, Arc<RelayMetrics>)>>,
    token: Option<Secret>,
) -> Result<(tokio::net::TcpListener, Arc<Console>), CliError> {
    // An empty OUTBOX_RELAY_HTTP_TOKEN means none.
    let token = token.filter(|t| !t.expose().is_empty());
    if let Some(token) = &token {
        check_token(token)?;
    }
    let listener =
        tokio::net::TcpListener::bind(addr).await.map_err(|e| format!("cannot listen for HTTP on {addr}: {e}"))?;
    let loopback = addr.ip().is_loopback();
    let has_relay = destinations.as_ref().is_some_and(|d| !d.is_empty());
    let console = Console {
        outbox: outbox.clone().with_timeout(outbox.timeout().min(CONSOLE_DB_TIMEOUT)),
        exported: outbox.clone(),
        has_relay,
        destinations: std::sync::RwLock::new(destinations.unwrap_or_default()),
        csrf: format!("{:032x}", rand::random::<u128>()),
        session: format!("{:032x}", rand::random::<u128>()),
        token_required: token.is_some(),
        console_allowed: token.is_some() || loopback,
        token,
        loopback,
        history: std::sync::Mutex::default(),
        done: std::sync::Mutex::default(),
    };
    let bound = listener.local_addr().map_err(|e| format!("cannot read the HTTP address: {e}"))?;
    if console.console_allowed {
        tracing::info!(address = %bound, token = console.token_required, "serving /metrics, /healthz, /readyz and the console");
    } else {
        tracing::warn!(address = %bound, "serving /metrics, /healthz and /readyz; the console is off: on a non-loopback address it needs --http-token (or OUTBOX_RELAY_HTTP_TOKEN)");
    }
    Ok((listener, Arc::new(console)))
}

/// Samples the relay's latency and delivery rate for the chart, until `stop`.
async fn sample(console: Arc<Console>, stop: CancellationToken) {
    let delivered = |console: &Console| console.relay().map_or(0, |relay| relay.snapshot().delivered);
    let mut last = delivered(&console);
    let mut ticks = tokio::time::interval(SAMPLE_EVERY);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks.tick().await;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = ticks.tick() => {}
        }
        let Some(relay) = console.relay() else { continue };
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
    if console.has_relay {
        tokio::spawn(sample(console.clone(), stop.clone()));
    }
    let pages = Router::new()
        .route("/", get(console_page))
        .route("/api/summary", get(summary))
        .route("/api/events/{id}", get(event))
        .route("/actions/{action}", post(action))
        .route_layer(middleware::from_fn(bounded))
        .route_layer(middleware::from_fn_with_state(console.clone(), authenticated));
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/login", post(login))
        .merge(pages)
        .layer(middleware::from_fn_with_state(console.clone(), guard))
        .with_state(console);
    let served = axum::serve(listener, app).with_graceful_shutdown(async move { stop.cancelled().await }).await;
    if let Err(e) = served {
        tracing::error!(error = %e, "the HTTP server stopped");
    }
}

/// Answers 503 for a console request that has not finished within [`REQUEST_TIMEOUT`] (each of
/// its database operations is bounded by [`CONSOLE_DB_TIMEOUT`]; a page makes several).
async fn bounded(request: Request, next: Next) -> Response {
    match tokio::time::timeout(REQUEST_TIMEOUT, next.run(request)).await {
        Ok(response) => response,
        Err(_) => {
            let why = format!(
                "the database did not answer within {}: the server may be frozen or overloaded, or a proxy hung",
                humantime::format_duration(REQUEST_TIMEOUT)
            );
            tracing::warn!("console request gave up: {why}");
            (StatusCode::SERVICE_UNAVAILABLE, axum::Json(json!({"error": why}))).into_response()
        }
    }
}

/// Refuses requests to a loopback address whose `Host` is not a loopback name, and sets the
/// headers every response carries.
async fn guard(State(console): State<Arc<Console>>, request: Request, next: Next) -> Response {
    // An absolute request target (`GET http://elsewhere/ HTTP/1.1`) is for proxies; a browser
    // talking to us sends a path, so one names another host than the `Host` header checked here.
    if request.uri().scheme().is_some() || request.uri().authority().is_some() {
        return (
            StatusCode::BAD_REQUEST,
            "this server takes request targets as paths (origin-form), not absolute URLs\n",
        )
            .into_response();
    }
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

/// The name of the session cookie a login sets.
const SESSION_COOKIE: &str = "outbox_relay_session";

/// Lets a request to the console through when it may see it: served at all, and with a token
/// set, carrying the session cookie or `Authorization: Bearer <token>`. Otherwise the login
/// form (for the page) or a refusal.
async fn authenticated(State(console): State<Arc<Console>>, request: Request, next: Next) -> Response {
    if !console.console_allowed {
        return refuse(
            StatusCode::FORBIDDEN,
            "the console on a non-loopback address needs --http-token (or OUTBOX_RELAY_HTTP_TOKEN); /metrics, /healthz and /readyz are served",
        );
    }
    if let Some(token) = &console.token {
        let headers = request.headers();
        let bearer =
            headers.get(header::AUTHORIZATION).and_then(|h| h.to_str().ok()).and_then(|h| h.strip_prefix("Bearer "));
        let cookie = headers
            .get_all(header::COOKIE)
            .iter()
            .filter_map(|h| h.to_str().ok())
            .flat_map(|h| h.split(';'))
            .filter_map(|pair| pair.trim().strip_prefix(SESSION_COOKIE)?.strip_prefix('='))
            .any(|value| same(value, &console.session));
        if !cookie && !bearer.is_some_and(|given| same(given, token.expose())) {
            if request.method() == axum::http::Method::GET && request.uri().path() == "/" {
                return (StatusCode::UNAUTHORIZED, Html(console::login_page(None))).into_response();
            }
            tracing::warn!(path = %request.uri().path(), "console request refused: no valid session or token");
            return refuse(
                StatusCode::UNAUTHORIZED,
                "the console needs its access token: log in at /, or send Authorization: Bearer",
            );
        }
    }
    next.run(request).await
}

#[derive(Deserialize)]
struct LoginForm {
    token: String,
}

/// Checks the token typed into the login form; sets the session cookie.
async fn login(State(console): State<Arc<Console>>, Form(form): Form<LoginForm>) -> Response {
    let Some(token) = &console.token else {
        return Redirect::to("/").into_response();
    };
    if !same(&form.token, token.expose()) {
        tracing::warn!("console login refused: wrong token");
        return (StatusCode::UNAUTHORIZED, Html(console::login_page(Some("That is not the token.")))).into_response();
    }
    let cookie = format!("{SESSION_COOKIE}={}; HttpOnly; SameSite=Strict; Path=/", console.session);
    ([(header::SET_COOKIE, cookie)], Redirect::to("/")).into_response()
}

/// `127.0.0.1:9187`, `[::1]:9187`, `localhost` and the like: a loopback name or address and at
/// most a port of digits after it, nothing else (`[::1]evil.com` and `localhost:80x` are no
/// loopback hosts).
fn loopback_host(host: &str) -> bool {
    let port_ok = |port: Option<&str>| port.is_none_or(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()));
    if let Some(rest) = host.strip_prefix('[') {
        let Some((address, after)) = rest.split_once(']') else { return false };
        let port_ok = match after {
            "" => true,
            after => after.strip_prefix(':').is_some_and(|port| port_ok(Some(port))),
        };
        return port_ok && address.parse::<std::net::Ipv6Addr>().is_ok_and(|ip| ip.is_loopback());
    }
    let (name, port) = match host.split_once(':') {
        Some((name, port)) => (name, Some(port)),
        None => (host, None),
    };
    port_ok(port)
        && (name.eq_ignore_ascii_case("localhost")
            || name.parse::<std::net::Ipv4Addr>().is_ok_and(|ip| ip.is_loopback()))
}

async fn metrics(State(console): State<Arc<Console>>) -> Response {
    let exporter = Exporter::new(&console.exported).with_destinations(console.destinations()).with_counter(
        "outbox_relay_spans_dropped",
        "Spans whose export to the OTLP endpoint failed since the process started (not those the exporter's full queue dropped)",
        crate::telemetry::SPANS_DROPPED.load(std::sync::atomic::Ordering::Relaxed),
    );
    ([(header::CONTENT_TYPE, CONTENT_TYPE)], exporter.encode().await).into_response()
}

/// Liveness: the process serves, and its relay (if it runs one) has not stopped.
async fn healthz(State(console): State<Arc<Console>>) -> Response {
    match console.destinations().iter().find(|(_, relay)| !relay.snapshot().running) {
        Some((name, _)) => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(
                json!({"status": "stopped", "reason": format!("the relay is not running (destination {name})")}),
            ),
        )
            .into_response(),
        None => axum::Json(json!({"status": "ok"})).into_response(),
    }
}

/// Readiness: the database answers and, with a relay, its listener listens.
async fn readyz(State(console): State<Arc<Console>>) -> Response {
    let reason = match tokio::time::timeout(READY_TIMEOUT, console.outbox.ping()).await {
        Err(_) => Some(format!("the database did not answer within {READY_TIMEOUT:?}")),
        Ok(Err(e)) => Some(format!("the database does not answer: {}", crate::outcome::one_line(&e.to_string()))),
        Ok(Ok(())) => match console.destinations().iter().find(|(_, relay)| !relay.snapshot().listening) {
            Some((name, _)) => {
                Some(format!("the relay's listener for destination {name} is not listening (it reconnects)"))
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
    /// The number of the action whose message to show.
    done: Option<u64>,
}

async fn console_page(State(console): State<Arc<Console>>, Query(query): Query<PageQuery>) -> Response {
    if query.lookup.as_deref().is_some_and(|l| l.contains('\0')) {
        return refuse(StatusCode::BAD_REQUEST, "a look-up cannot contain a NUL character");
    }
    let done = query.done.and_then(|n| {
        let done = console.done.lock().unwrap_or_else(|e| e.into_inner());
        done.iter().find(|(k, _)| *k == n).map(|(_, text)| text.clone())
    });
    Html(console::page(&console, query.lookup.as_deref(), done.as_deref()).await).into_response()
}

async fn summary(State(console): State<Arc<Console>>) -> Response {
    match console::summary(&console).await {
        Ok(summary) => axum::Json(summary).into_response(),
        Err(e) => {
            (StatusCode::SERVICE_UNAVAILABLE, axum::Json(json!({"error": crate::outcome::one_line(&e.to_string())})))
                .into_response()
        }
    }
}

/// One event (delivered, waiting, dead...) with its payload: what the console shows on demand.
async fn event(State(console): State<Arc<Console>>, Path(id): Path<String>) -> Response {
    let Ok(id) = id.parse::<i64>() else {
        return (StatusCode::BAD_REQUEST, axum::Json(json!({"error": "an event id is a whole number"})))
            .into_response();
    };
    match console.outbox.look_up(Some(id), None, 1).await {
        Ok(found) => match found.into_iter().next() {
            Some(event) => axum::Json(event).into_response(),
            None => {
                (StatusCode::NOT_FOUND, axum::Json(json!({"error": format!("no event with id {id}")}))).into_response()
            }
        },
        Err(e) => {
            (StatusCode::SERVICE_UNAVAILABLE, axum::Json(json!({"error": crate::outcome::one_line(&e.to_string())})))
                .into_response()
        }
    }
}

/// An action's fields; any other field is refused (a misspelt `ids` must not mean "all").
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ActionForm {
    csrf: Option<String>,
    /// The dead letter to retry or purge.
    id: Option<String>,
    /// The topic to pause or resume.
    topic: Option<String>,
    /// `1`: every dead letter (retry, purge), or every topic (pause, resume).
    all: Option<String>,
    /// The button pressed (ignored).
    #[serde(rename = "do")]
    _button: Option<String>,
}

/// What an action acts on: one thing, or all of them, said explicitly.
enum Target<T> {
    One(T),
    All,
}

/// The target of an action from its form: exactly one of `field` or `all=1`.
fn target<'f>(form: &'f ActionForm, field: &'f Option<String>, name: &str) -> Result<Target<&'f str>, String> {
    let one = field.as_deref().filter(|v| !v.is_empty());
    let all = match form.all.as_deref() {
        None | Some("") => false,
        Some("1") => true,
        Some(_) => return Err("all must be 1 when given".into()),
    };
    match (one, all) {
        (Some(value), false) => Ok(Target::One(value)),
        (None, true) => Ok(Target::All),
        (Some(_), true) => Err(format!("give either {name} or all=1, not both")),
        (None, false) => Err(format!("say what to act on: {name}=... or all=1")),
    }
}

/// Retry, purge, pause, resume: checks the CSRF token and what the form names (the console's
/// access was checked before); runs the action, logs it and goes back to the console.
async fn action(
    State(console): State<Arc<Console>>,
    Path(action): Path<String>,
    Form(form): Form<ActionForm>,
) -> Response {
    if !form.csrf.as_deref().is_some_and(|given| same(given, &console.csrf)) {
        tracing::warn!(action = %action, "console action refused: missing or stale CSRF token");
        return refuse(StatusCode::FORBIDDEN, "missing or stale CSRF token: reload the console and try again");
    }
    let outbox = &console.outbox;
    let done = match action.as_str() {
        "retry" | "purge" => {
            if form.topic.is_some() {
                return refuse(StatusCode::BAD_REQUEST, "retry and purge take id=N or all=1, not a topic");
            }
            let id = match target(&form, &form.id, "id") {
                Err(why) => return refuse(StatusCode::BAD_REQUEST, &why),
                Ok(Target::All) => None,
                Ok(Target::One(text)) => match text.trim().parse::<i64>() {
                    Ok(id) => Some(id),
                    Err(_) => return refuse(StatusCode::BAD_REQUEST, "id must be a whole number"),
                },
            };
            match (action.as_str(), id) {
                ("retry", Some(id)) => outbox.retry_dead_letters(&[id]).await.map(|ids| counted("retried", &ids)),
                ("retry", None) => outbox.retry_all_dead_letters().await.map(|ids| counted("retried", &ids)),
                (_, Some(id)) => outbox.purge_dead_letters_by_id(&[id]).await.map(|ids| counted("purged", &ids)),
                (_, None) => {
                    outbox.purge_dead_letters(Duration::ZERO).await.map(|n| format!("purged {n} dead letters"))
                }
            }
        }
        "pause" | "resume" => {
            if form.id.is_some() {
                return refuse(StatusCode::BAD_REQUEST, "pause and resume take topic=T or all=1, not an id");
            }
            let topic = match target(&form, &form.topic, "topic") {
                Err(why) => return refuse(StatusCode::BAD_REQUEST, &why),
                Ok(Target::All) => None,
                Ok(Target::One(topic)) => Some(topic),
            };
            let what = topic.map_or("every topic".to_string(), |t| format!("topic {t}"));
            let changed = if action == "pause" { outbox.pause(topic).await } else { outbox.resume(topic).await };
            match changed {
                Ok(changed) => {
                    let mut done = match (action.as_str(), changed) {
                        ("pause", true) => format!("paused {what}"),
                        ("pause", false) => format!("{what} was paused already"),
                        (_, true) => format!("resumed {what}"),
                        (_, false) => format!("{what} was not paused"),
                    };
                    if action == "resume"
                        && let Ok(left) = outbox.pauses().await
                        && !left.is_empty()
                    {
                        let names: Vec<&str> =
                            left.iter().map(|p| p.topic.as_deref().unwrap_or("every topic")).collect();
                        done.push_str(&format!("; still paused: {}", names.join(", ")));
                    }
                    Ok(done)
                }
                Err(e) => Err(e),
            }
        }
        other => return refuse(StatusCode::NOT_FOUND, &format!("no action {other:?}")),
    };
    match done {
        Ok(done) => {
            tracing::info!(action = %action, "{} (console)", crate::outcome::one_line(&done));
            Redirect::to(&format!("/?done={}", console.remember(done))).into_response()
        }
        Err(e) if e.kind() == pg_outbox_relay::ErrorKind::InvalidInput => {
            refuse(StatusCode::BAD_REQUEST, &e.to_string())
        }
        Err(e) => {
            // The whole error (it may quote a row) goes to the log, not to the browser.
            tracing::warn!(action = %action, error = %e, "console action failed");
            refuse(
                StatusCode::SERVICE_UNAVAILABLE,
                &format!("the {action} failed in the database; the relay's log says why"),
            )
        }
    }
}

/// How many action messages are kept for their pages.
const DONE_KEPT: usize = 64;

impl Console {
    /// Keeps `message` for the page an action leads back to; returns its number.
    fn remember(&self, message: String) -> u64 {
        let mut done = self.done.lock().unwrap_or_else(|e| e.into_inner());
        let n = done.back().map_or(1, |(n, _)| n + 1);
        if done.len() == DONE_KEPT {
            done.pop_front();
        }
        done.push_back((n, message));
        n
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
}
