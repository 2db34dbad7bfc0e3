//! The command's logs and spans: logs to stderr; the relay's delivery spans exported over OTLP
//! (http/protobuf) when the standard variables say where (`OTEL_EXPORTER_OTLP_ENDPOINT` or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `OTEL_SERVICE_NAME`), and nothing at all otherwise.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanExporter};
use tracing_subscriber::filter::{LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// The target of the library's spans (`pg_outbox_relay::trace`): exported, never logged.
const SPANS: &str = "pg_outbox_relay::trace";

/// Flushes the exporter when the command ends.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
    format: LogFormat,
}

/// Says a warning or an error on stderr outside the log (the log may be gone): `warning: ...`
/// or `error: ...`, or a JSON object with `--log-format json`.
pub fn say(format: LogFormat, level: tracing::Level, message: &str) {
    match format {
        LogFormat::Json => eprintln!("{}", crate::json_logs::outside(level, "outbox_relay", message)),
        LogFormat::Text if level == tracing::Level::ERROR => eprintln!("error: {message}"),
        LogFormat::Text => eprintln!("warning: {message}"),
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take() {
            if let Err(e) = provider.shutdown() {
                say(self.format, tracing::Level::WARN, &format!("the last spans could not be exported over OTLP: {e}"));
            }
            let dropped = SPANS_DROPPED.load(Ordering::Relaxed);
            if dropped > 0 {
                let said = format!("{dropped} spans could not be exported over OTLP while the command ran");
                say(self.format, tracing::Level::WARN, &said);
            }
        }
    }
}

/// How logs are written to stderr.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Lines for people (coloured on a terminal).
    Text,
    /// One JSON object per line, for a log pipeline (docs/operations.md).
    Json,
}

/// Logs go to stderr (stdout is for results) in `format`, filtered by RUST_LOG, `level` by
/// default (PostgreSQL's notices only from `warn`); spans go to the OTLP endpoint when one is
/// configured. An OTLP setting this command cannot follow is an error that names it.
pub fn init(level: &str, format: LogFormat, export_spans: bool) -> Result<Telemetry, String> {
    // deadpool says that a pooled connection ended once per connection ("Connection error: db
    // error", "Connection could not be recycled"), without the reason; the library says it once
    // a minute with PostgreSQL's words. (RUST_LOG that names deadpool has them back.)
    let deadpool_named = std::env::var("RUST_LOG").is_ok_and(|v| v.contains("deadpool"));
    let mut filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(format!("{level},tokio_postgres=warn,async_nats=warn")))
        // lapin logs every returned (unroutable) message whole, payload included, and at trace
        // the login frame with the password: the sink reports what matters itself.
        .add_directive("lapin=off".parse().expect("a valid directive"))
        .add_directive("amq_protocol=off".parse().expect("a valid directive"))
        .add_directive(format!("{SPANS}=off").parse().expect("a valid directive"));
    if !deadpool_named {
        filter = filter.add_directive("deadpool=error".parse().expect("a valid directive"));
    }
    use std::io::IsTerminal;
    let logs = match format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(std::io::stderr().is_terminal())
            .boxed(),
        LogFormat::Json => crate::json_logs::JsonLogs.boxed(),
    }
    .with_filter(filter);
    let (provider, endpoint) = if export_spans { provider()?.unzip() } else { (None, None) };
    let spans = provider.as_ref().map(|provider| {
        tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("outbox-relay"))
            .with_filter(Targets::new().with_target(SPANS, LevelFilter::INFO))
    });
    tracing_subscriber::registry().with(logs).with(spans).init();
    if let Some(endpoint) = endpoint {
        tracing::info!(%endpoint, "exporting the relay's spans over OTLP (http/protobuf)");
    }
    Ok(Telemetry { provider, format })
}

fn set(name: &str) -> Option<String> {
    std::env::var(name).ok().map(|v| v.trim().to_string()).filter(|v| !v.is_empty())
}

/// The tracer provider the variables configure, or `None` when they name no endpoint (or
/// `OTEL_SDK_DISABLED=true`, or `OTEL_TRACES_EXPORTER=none`).
fn provider() -> Result<Option<(SdkTracerProvider, String)>, String> {
    let endpoint = set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").or_else(|| set("OTEL_EXPORTER_OTLP_ENDPOINT"));
    let disabled = set("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true"))
        || set("OTEL_TRACES_EXPORTER").is_some_and(|v| v.eq_ignore_ascii_case("none"));
    let Some(endpoint) = endpoint.filter(|_| !disabled) else { return Ok(None) };
    for name in ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"] {
        if let Some(protocol) = set(name)
            && protocol != "http/protobuf"
        {
            return Err(format!(
                "{name}={protocol}: this command exports spans over OTLP http/protobuf only (a collector's port 4318)"
            ));
        }
    }
    let shown = shown(&endpoint);
    if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
        return Err(format!("the OTLP endpoint {shown} is no http:// or https:// URL (e.g. http://127.0.0.1:4318)"));
    }
    // reqwest is built without a crypto provider of its own (the library brings ring's).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .build()
        .map_err(|e| format!("cannot export spans to the OTLP endpoint {shown}: {e}"))?;
    let exporter = Watched { inner: exporter, endpoint: shown.clone(), state: Default::default() };
    let mut resource = Resource::builder();
    let named_in_attributes = set("OTEL_RESOURCE_ATTRIBUTES").is_some_and(|a| a.contains("service.name="));
    if set("OTEL_SERVICE_NAME").is_none() && !named_in_attributes {
        resource = resource.with_service_name("outbox-relay");
    }
    let provider = SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource.build()).build();
    Ok(Some((provider, shown)))
}

/// Spans the OTLP endpoint did not take (their export failed) since the command started:
/// `outbox_relay_spans_dropped_total` on /metrics.
pub static SPANS_DROPPED: AtomicU64 = AtomicU64::new(0);

/// How often a failing export is warned of while it lasts.
const EXPORT_WARNING_EVERY: Duration = Duration::from_secs(60);

/// The OTLP exporter, watched: a failed export is warned of (at once, then at most once a
/// minute while failures last, with the count) and its spans counted in [`SPANS_DROPPED`]; the
/// first success after failures says so.
#[derive(Debug)]
struct Watched<E> {
    inner: E,
    endpoint: String,
    state: Mutex<ExportState>,
}

#[derive(Debug, Default)]
struct ExportState {
    last_warning: Option<Instant>,
    /// Spans dropped since the last warning, and since the exports began failing.
    unreported: u64,
    failing: u64,
}

impl<E: SpanExporter> Watched<E> {
    fn record(&self, result: &OTelSdkResult, spans: u64) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        match result {
            Ok(()) if state.failing > 0 => {
                tracing::info!(
                    "spans reach the OTLP endpoint {} again; {} were dropped meanwhile",
                    self.endpoint,
                    state.failing
                );
                // (a new outage is warned of at once)
                *state = ExportState::default();
            }
            Ok(()) => {}
            Err(e) => {
                SPANS_DROPPED.fetch_add(spans, Ordering::Relaxed);
                state.unreported += spans;
                state.failing += spans;
                let now = Instant::now();
                if state.last_warning.is_none_or(|at| now.duration_since(at) >= EXPORT_WARNING_EVERY) {
                    let total = SPANS_DROPPED.load(Ordering::Relaxed);
                    tracing::warn!(
                        endpoint = %self.endpoint,
                        error = %e,
                        dropped = state.unreported,
                        dropped_in_all = total,
                        "spans could not be exported to the OTLP endpoint {}: {e}; {} dropped since the last warning ({total} in all; outbox_relay_spans_dropped_total counts them, and this repeats at most once a minute)",
                        self.endpoint,
                        state.unreported,
                    );
                    state.last_warning = Some(now);
                    state.unreported = 0;
                }
            }
        }
    }
}

impl<E: SpanExporter> SpanExporter for Watched<E> {
    fn export(&self, batch: Vec<SpanData>) -> impl std::future::Future<Output = OTelSdkResult> + Send {
        let spans = batch.len() as u64;
        let export = self.inner.export(batch);
        async move {
            let result = export.await;
            self.record(&result, spans);
            result
        }
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// An endpoint as messages show it: without a password in it or its query.
fn shown(endpoint: &str) -> String {
    let endpoint = endpoint.split(['?', '#']).next().unwrap_or_default();
    let (scheme, rest) = endpoint.split_once("://").unwrap_or(("", endpoint));
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let authority = match authority.rsplit_once('@') {
        Some((_, host)) => format!("***@{host}"),
        None => authority.to_string(),
    };
    let scheme = if scheme.is_empty() { String::new() } else { format!("{scheme}://") };
    format!("{scheme}{authority}{path}")
}

#[cfg(test)]
mod tests {
    #[test]
    fn endpoints_are_shown_without_secrets() {
        assert_eq!(
            super::shown("http://user:pa55@collector:4318/v1/traces?token=x"),
            "http://***@collector:4318/v1/traces"
        );
        assert_eq!(super::shown("http://127.0.0.1:4318"), "http://127.0.0.1:4318");
        assert_eq!(super::shown("collector:4318"), "collector:4318");
    }
}
