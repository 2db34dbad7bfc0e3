//! Draining to the HTTP receivers webhooks meet, and what the relay's adaptive concurrency limit
//! and rate limit make of them (issue 21).
//!
//! The receivers, all on 127.0.0.1, each counting the requests it accepted per event id (the
//! `outbox-event-id` header), so that a redelivery shows:
//!
//! - [`Receiver::small`]: the shape of Python's `http.server`, a dev server or a small service.
//!   One connection at a time, each a single HTTP/1.0 request answered after its pace and then
//!   closed, behind a listen backlog of five. Connections beyond what the backlog holds are not
//!   refused: the kernel drops their SYNs, and the client retransmits after 1 s, then 3 s.
//! - [`Receiver::slow`]: a receiver that takes its time (an ERP) but takes any number of requests
//!   at once, with keep-alive and a deep backlog.
//! - [`Receiver::rate_limited`]: a partner API that answers 429 with `Retry-After: 1` once it
//!   accepted a given number of requests in the last second.
//! - [`Receiver::late`]: a receiver that opens its port only some time after it was made (the
//!   relay starts a moment later, once the outbox is filled).
//!
//! [`drain_to_receiver`] drains a pre-filled outbox to one of them as [`super::drain_to`] does and
//! returns, besides the time, what the receiver and the relay saw: redeliveries, 429s, breaker
//! openings and the limit the relay ended with.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::post;
use pg_outbox_relay::sink::HttpSink;
use pg_outbox_relay::{MetricsSnapshot, Outbox, RelayConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};

use super::BoxError;
use super::drain::{DrainSetup, Drained, drain_measured};

/// The listen backlog of [`Receiver::small`] (Python's `socketserver` default).
pub const SMALL_BACKLOG: u32 = 5;
/// The listen backlog of the other receivers.
const DEEP_BACKLOG: u32 = 1024;
/// The header carrying the event id (`pg_outbox_relay::sink::HttpSink`'s).
const EVENT_ID: &str = "outbox-event-id";
/// The most a request head may take; larger ones are dropped.
const MAX_HEAD: usize = 64 * 1024;
/// How long [`Receiver::small`] waits for a connection's request before it gives up on it.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// An HTTP receiver on 127.0.0.1 (see the [module documentation](self)); stops when dropped.
pub struct Receiver {
    addr: SocketAddr,
    tally: Arc<Tally>,
    task: tokio::task::JoinHandle<()>,
}

/// What a receiver saw: accepted requests per event id, and the 429s it answered.
#[derive(Default)]
struct Tally {
    accepted: Mutex<HashMap<String, u64>>,
    too_many: AtomicU64,
    /// When the port opened.
    opened: OnceLock<Instant>,
}

impl Tally {
    fn accept(&self, id: Option<&str>) {
        let id = id.unwrap_or("(none)").to_string();
        *self.accepted.lock().unwrap_or_else(|e| e.into_inner()).entry(id).or_default() += 1;
    }
}

/// What a receiver counted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Distinct events it accepted.
    pub distinct: u64,
    /// Requests it accepted for an event it had accepted before.
    pub redelivered: u64,
    /// Requests it answered with 429.
    pub too_many: u64,
}

/// How a receiver built on axum answers: after `latency`, and 429 past `rate` requests a second.
#[derive(Clone)]
struct Answer {
    latency: Duration,
    window: Option<(usize, Arc<Mutex<VecDeque<Instant>>>)>,
    tally: Arc<Tally>,
}

impl Receiver {
    /// One connection at a time, one HTTP/1.0 request each, answered 200 after `pace`, behind a
    /// listen backlog of [`SMALL_BACKLOG`].
    pub async fn small(pace: Duration) -> Result<Receiver, BoxError> {
        let listener = bound()?.listen(SMALL_BACKLOG)?;
        let tally = Arc::new(Tally::default());
        let addr = listener.local_addr()?;
        tally.opened.set(Instant::now()).ok();
        let task = tokio::spawn(serve_one_at_a_time(listener, pace, tally.clone()));
        Ok(Receiver { addr, tally, task })
    }

    /// Answers every POST with 200 after `latency`, any number at once.
    pub async fn slow(latency: Duration) -> Result<Receiver, BoxError> {
        Receiver::axum(Duration::ZERO, latency, None)
    }

    /// Answers 200 at once, or 429 with `Retry-After: 1` when `rate` requests were accepted in
    /// the last second.
    pub async fn rate_limited(rate: usize) -> Result<Receiver, BoxError> {
        Receiver::axum(Duration::ZERO, Duration::ZERO, Some(rate))
    }

    /// [`Receiver::slow`], on a port that opens only after `delay`: until then a connection to it
    /// is refused.
    pub async fn late(delay: Duration, latency: Duration) -> Result<Receiver, BoxError> {
        Receiver::axum(delay, latency, None)
    }

    fn axum(delay: Duration, latency: Duration, rate: Option<usize>) -> Result<Receiver, BoxError> {
        let tally = Arc::new(Tally::default());
        let answer = Answer { latency, window: rate.map(|r| (r, Arc::default())), tally: tally.clone() };
        let app = Router::new().route("/hook", post(answer_post)).with_state(answer);
        // Bound at once (the port stays ours), listening only after `delay`: until then a
        // connection to it is refused.
        let socket = bound()?;
        let addr = socket.local_addr()?;
        let opened = tally.clone();
        let task = tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let listener = match socket.listen(DEEP_BACKLOG) {
                Ok(listener) => listener,
                Err(e) => {
                    tracing::error!("the receiver cannot listen on {addr}: {e}");
                    return;
                }
            };
            opened.opened.set(Instant::now()).ok();
            let _ = axum::serve(listener, app).await;
        });
        Ok(Receiver { addr, tally, task })
    }

    /// Its URL.
    pub fn url(&self) -> String {
        format!("http://{}/hook", self.addr)
    }

    /// An HTTP sink POSTing to it, with the default timeout.
    pub fn sink(&self) -> Result<HttpSink, BoxError> {
        Ok(HttpSink::new(&self.url(), pg_outbox_relay::sink::DEFAULT_HTTP_TIMEOUT)?)
    }

    /// What it counted so far.
    pub fn counts(&self) -> Counts {
        let accepted = self.tally.accepted.lock().unwrap_or_else(|e| e.into_inner());
        Counts {
            distinct: accepted.len() as u64,
            redelivered: accepted.values().map(|n| n - 1).sum(),
            too_many: self.tally.too_many.load(Ordering::Relaxed),
        }
    }

    /// When its port opened (`None` while a late receiver has not opened yet).
    pub fn opened(&self) -> Option<Instant> {
        self.tally.opened.get().copied()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn answer_post(State(answer): State<Answer>, headers: HeaderMap) -> impl IntoResponse {
    tokio::time::sleep(answer.latency).await;
    if let Some((rate, window)) = &answer.window {
        let now = Instant::now();
        let mut window = window.lock().unwrap_or_else(|e| e.into_inner());
        while window.front().is_some_and(|t| now.duration_since(*t) >= Duration::from_secs(1)) {
            window.pop_front();
        }
        if window.len() >= *rate {
            answer.tally.too_many.fetch_add(1, Ordering::Relaxed);
            return (StatusCode::TOO_MANY_REQUESTS, [(header::RETRY_AFTER, HeaderValue::from_static("1"))])
                .into_response();
        }
        window.push_back(now);
    }
    answer.tally.accept(headers.get(EVENT_ID).and_then(|v| v.to_str().ok()));
    StatusCode::OK.into_response()
}

/// A socket bound to a free port on 127.0.0.1, not listening yet (a connection is refused).
fn bound() -> std::io::Result<TcpSocket> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(SocketAddr::from(([127, 0, 0, 1], 0)))?;
    Ok(socket)
}

/// [`Receiver::small`]'s loop: the next connection is accepted only once the last one was
/// answered and closed.
async fn serve_one_at_a_time(listener: TcpListener, pace: Duration, tally: Arc<Tally>) {
    loop {
        let Ok((mut stream, _)) = listener.accept().await else {
            // Out of file descriptors, say: not a busy loop.
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        if let Ok(Ok(id)) = tokio::time::timeout(READ_TIMEOUT, read_request(&mut stream)).await {
            tokio::time::sleep(pace).await;
            tally.accept(id.as_deref());
            let answered = stream.write_all(b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n").await;
            if answered.is_ok() {
                let _ = stream.shutdown().await;
            }
        }
    }
}

/// Reads one request (head and `Content-Length` body) and returns its event id header.
async fn read_request(stream: &mut TcpStream) -> Result<Option<String>, BoxError> {
    let mut buf = Vec::with_capacity(4096);
    let head_end = loop {
        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        if buf.len() > MAX_HEAD {
            return Err("the request head is too long".into());
        }
        let mut chunk = [0u8; 4096];
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Err("the connection closed before the request ended".into());
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = std::str::from_utf8(&buf[..head_end])?;
    let header = |name: &str| {
        head.split("\r\n").skip(1).find_map(|line| {
            let (key, value) = line.split_once(':')?;
            key.trim().eq_ignore_ascii_case(name).then(|| value.trim().to_string())
        })
    };
    let length: usize = header("content-length").map(|v| v.parse()).transpose()?.unwrap_or(0);
    let id = header(EVENT_ID);
    let mut unread = length.saturating_sub(buf.len() - head_end);
    let mut chunk = [0u8; 4096];
    while unread > 0 {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Err("the connection closed before the body ended".into());
        }
        unread = unread.saturating_sub(n);
    }
    Ok(id)
}

/// One drain to a receiver: how long it took and what both sides saw.
#[derive(Debug, Clone)]
pub struct ReceiverRun {
    /// When the relay started (after the outbox was filled).
    pub started: Instant,
    /// From the relay's start to the last delivery recorded.
    pub elapsed: Duration,
    /// What the receiver counted.
    pub counts: Counts,
    /// The relay's metrics at the end.
    pub metrics: MetricsSnapshot,
}

impl ReceiverRun {
    /// Events per second.
    pub fn rate(&self, events: usize) -> f64 {
        events as f64 / self.elapsed.as_secs_f64()
    }
}

/// Drains `setup`'s events to `receiver` with `config` (as [`super::drain_with`]) and checks that
/// the receiver accepted each of them.
pub async fn drain_to_receiver(
    outbox: &Outbox,
    setup: DrainSetup,
    config: RelayConfig,
    receiver: &Receiver,
) -> Result<ReceiverRun, BoxError> {
    let before = receiver.counts();
    let Drained { started, elapsed, metrics, .. } = drain_measured(outbox, setup, config, receiver.sink()?).await?;
    let after = receiver.counts();
    // (a receiver may serve several drains: only this one's requests count)
    let counts = Counts {
        distinct: after.distinct - before.distinct,
        redelivered: after.redelivered - before.redelivered,
        too_many: after.too_many - before.too_many,
    };
    if counts.distinct != setup.events as u64 {
        return Err(format!(
            "the receiver accepted {} distinct events of the {} the relay recorded as delivered",
            counts.distinct, setup.events
        )
        .into());
    }
    Ok(ReceiverRun { started, elapsed, counts, metrics })
}

/// The pace of [`Receiver::small`] in the stage: about what Python's `http.server` takes per
/// request on this kind of machine.
pub const SMALL_PACE: Duration = Duration::from_millis(1);
/// The latency of [`Receiver::slow`] in the stage.
pub const SLOW_LATENCY: Duration = Duration::from_millis(20);
/// The rate past which [`Receiver::rate_limited`] answers 429 in the stage.
pub const LIMITED_RATE: usize = 200;
/// How long after the relay [`Receiver::late`] opens in the stage.
pub const LATE_BY: Duration = Duration::from_secs(2);
/// The fixed limits tried against the small receiver; the best of them is compared with the
/// defaults. 64 was the fixed limit before the adaptive one.
pub const SMALL_SWEEP: [usize; 6] = [1, 2, 4, 8, 16, 64];
/// The events of each receiver in the stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReceiverStage {
    /// Events per drain to the small receiver.
    pub small_events: usize,
    /// Events per drain to the slow receiver.
    pub slow_events: usize,
    /// Keys of the keyed drains to the slow receiver.
    pub keys: usize,
    /// Events per drain to the rate-limited receiver.
    pub limited_events: usize,
    /// Events waiting for the late receiver.
    pub late_events: usize,
    /// Rounds of defaults against the best fixed limit at the small receiver (alternately).
    pub rounds: usize,
}

impl ReceiverStage {
    /// `events` to the small and the rate-limited receivers, ten times as many to the slow one
    /// (over 400 keys for the keyed drains), up to 100 waiting for the late one, 3 rounds.
    pub fn for_events(events: usize) -> ReceiverStage {
        ReceiverStage {
            small_events: events,
            slow_events: events.saturating_mul(10),
            keys: 400,
            limited_events: events,
            late_events: events.min(100),
            rounds: 3,
        }
    }
}

impl Default for ReceiverStage {
    /// [`ReceiverStage::for_events`] of 1,000.
    fn default() -> ReceiverStage {
        ReceiverStage::for_events(1000)
    }
}

/// How the relay was set for a row: its defaults, a fixed concurrency limit, or the defaults
/// with a rate limit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Settings {
    /// `RelayConfig::default()` (an adaptive limit up to 256).
    Defaults,
    /// `--fixed-concurrency --concurrency N`.
    Fixed(usize),
    /// `--rate-limit N/s`.
    RateLimit(f64),
}

impl Settings {
    fn config(self, setup: DrainSetup) -> RelayConfig {
        let config = setup.config();
        match self {
            Settings::Defaults => config,
            Settings::Fixed(limit) => RelayConfig { concurrency: limit, fixed_concurrency: true, ..config },
            Settings::RateLimit(rate) => RelayConfig { rate_limit: Some(rate), ..config },
        }
    }
}

impl std::fmt::Display for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Settings::Defaults => f.write_str("defaults"),
            Settings::Fixed(limit) => write!(f, "fixed {limit}"),
            Settings::RateLimit(rate) => write!(f, "rate limit {rate}/s"),
        }
    }
}

/// Which receiver a row measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReceiverKind {
    /// [`Receiver::small`] at [`SMALL_PACE`].
    Small,
    /// [`Receiver::slow`] at [`SLOW_LATENCY`].
    Slow,
    /// [`Receiver::rate_limited`] at [`LIMITED_RATE`].
    RateLimited,
    /// [`Receiver::late`] by [`LATE_BY`], at [`SLOW_LATENCY`].
    Late,
}

/// One measured drain.
#[derive(Debug, Clone)]
pub struct Row {
    /// The receiver.
    pub receiver: ReceiverKind,
    /// The relay's settings.
    pub settings: Settings,
    /// Events drained.
    pub events: usize,
    /// Keys they were spread over, if any.
    pub keys: Option<usize>,
    /// The run (for rounds, the median one by time).
    pub run: ReceiverRun,
    /// Rounds it is the median of (1: measured once).
    pub rounds: usize,
}

/// What the stage measured.
#[derive(Debug, Clone)]
pub struct ReceiversReport {
    /// Every drain, in the order measured (the rounds folded into their median).
    pub rows: Vec<Row>,
    /// The best fixed limit at the small receiver in the sweep.
    pub small_best: usize,
    /// The late receiver: from its opening to the last of its events recorded as delivered.
    pub late_after_opening: Duration,
}

impl ReceiversReport {
    /// The row of `receiver` with `settings` (and keys, if any).
    pub fn row(&self, receiver: ReceiverKind, settings: Settings, keys: Option<usize>) -> Option<&Row> {
        // The sweep's row of the best limit is measured again in the rounds, which come last.
        self.rows.iter().rev().find(|r| r.receiver == receiver && r.settings == settings && r.keys == keys)
    }
}

/// Runs the stage (see the [module documentation](self)): the small receiver with a sweep of
/// fixed limits and then the defaults and the best of them alternately; the slow receiver with
/// the defaults and the ceiling fixed, with and without keys; the rate-limited receiver with the
/// defaults and a rate limit just under its own; the late receiver with the defaults.
pub async fn receivers(outbox: &Outbox, stage: ReceiverStage) -> Result<ReceiversReport, BoxError> {
    // A receiver of its own for each drain: a request the small one has not accepted yet when a
    // drain ends (one the relay gave up on) must not count as a redelivery of the next drain.
    let drain = async |kind, settings: Settings, events, keys| -> Result<(Row, Receiver), BoxError> {
        let receiver = match kind {
            ReceiverKind::Small => Receiver::small(SMALL_PACE).await?,
            ReceiverKind::Slow => Receiver::slow(SLOW_LATENCY).await?,
            ReceiverKind::RateLimited => Receiver::rate_limited(LIMITED_RATE).await?,
            // It opens LATE_BY after this; the relay starts once the outbox is filled.
            ReceiverKind::Late => Receiver::late(LATE_BY, SLOW_LATENCY).await?,
        };
        let setup = DrainSetup { keys, ..DrainSetup::defaults(events) };
        let run = drain_to_receiver(outbox, setup, settings.config(setup), &receiver).await?;
        Ok((Row { receiver: kind, settings, events, keys, run, rounds: 1 }, receiver))
    };
    let mut rows = Vec::new();

    for limit in SMALL_SWEEP {
        rows.push(drain(ReceiverKind::Small, Settings::Fixed(limit), stage.small_events, None).await?.0);
    }
    let small_best = rows.iter().min_by_key(|r| r.run.elapsed).map_or(1, |r| match r.settings {
        Settings::Fixed(limit) => limit,
        _ => 1,
    });
    let (mut defaults, mut best) = (Vec::new(), Vec::new());
    for _ in 0..stage.rounds.max(1) {
        defaults.push(drain(ReceiverKind::Small, Settings::Defaults, stage.small_events, None).await?.0);
        best.push(drain(ReceiverKind::Small, Settings::Fixed(small_best), stage.small_events, None).await?.0);
    }
    rows.extend([median_row(defaults), median_row(best)]);

    let ceiling = RelayConfig::default().concurrency;
    for keys in [None, Some(stage.keys)] {
        for settings in [Settings::Defaults, Settings::Fixed(ceiling)] {
            rows.push(drain(ReceiverKind::Slow, settings, stage.slow_events, keys).await?.0);
        }
    }
    let under = LIMITED_RATE as f64 * 0.9;
    for settings in [Settings::Defaults, Settings::RateLimit(under)] {
        rows.push(drain(ReceiverKind::RateLimited, settings, stage.limited_events, None).await?.0);
    }
    let (row, late) = drain(ReceiverKind::Late, Settings::Defaults, stage.late_events, None).await?;
    let opened = late.opened().ok_or("the late receiver never opened")?;
    let late_after_opening = (row.run.started + row.run.elapsed).saturating_duration_since(opened);
    rows.push(row);

    Ok(ReceiversReport { rows, small_best, late_after_opening })
}

/// The median of rounds by time, counting the rounds.
fn median_row(mut rounds: Vec<Row>) -> Row {
    rounds.sort_by_key(|r| r.run.elapsed);
    let count = rounds.len();
    let mut median = rounds.swap_remove((count - 1) / 2);
    median.rounds = count;
    median
}
