//! The orders service of the article: an HTTP API whose writes commit with their events, and a
//! relay in the same process that delivers them.
//!
//! ```sh
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres \
//!     cargo run --example orders_service -- --listen 127.0.0.1:8080 [--sink stdout|http://...|nats://...]
//!     [--signing-secret whsec_...]
//! ```
//!
//! At start-up it applies the library's migrations and creates the `orders` table. Without
//! `--sink` each delivered event is logged. Ctrl-C or SIGTERM stops the HTTP server (requests in
//! flight finish), then the relay (deliveries in flight finish). See `app.rs` for the API.

mod app;
#[path = "../shared/shutdown.rs"]
mod shutdown;

use std::net::SocketAddr;
use std::process::ExitCode;

use clap::{CommandFactory, Parser};
use pg_outbox_relay::Outbox;
use tokio_util::sync::CancellationToken;

/// The orders service of the outbox-relay article: POST /orders, GET /orders/{id}, and an
/// embedded relay delivering the `order.placed` events.
#[derive(Debug, Parser)]
#[command(name = "orders_service")]
struct Args {
    /// Address to serve HTTP on.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,

    /// PostgreSQL URL, e.g. postgres://user:password@host:5432/db (or set DATABASE_URL).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: Option<String>,

    /// Deliver events to this sink instead of logging them: stdout, http(s)://host/path or
    /// nats://host:port.
    #[arg(long, value_name = "SPEC")]
    sink: Option<String>,

    /// Sign the HTTP sink's requests with this Standard Webhooks secret (whsec_...), as
    /// `examples/webhook_receiver` verifies them.
    #[arg(long, env = "WEBHOOK_SECRET", hide_env_values = true, value_name = "SECRET")]
    signing_secret: Option<String>,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let Some(url) = args.database_url.clone().filter(|url| !url.is_empty()) else {
        Args::command()
            .error(
                clap::error::ErrorKind::MissingRequiredArgument,
                "no database given: pass --database-url URL or set DATABASE_URL",
            )
            .exit()
    };
    init_tracing();
    match run(args, &url).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            ExitCode::FAILURE
        }
    }
}

/// Logs go to stderr, filtered by RUST_LOG (`info` by default), coloured only on a terminal.
fn init_tracing() {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,tokio_postgres=warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}

async fn run(args: Args, url: &str) -> Result<(), BoxError> {
    let outbox = Outbox::connect(url).await?;
    app::setup(&outbox).await?;
    let handler = app::AppHandler::new(args.sink.as_deref(), args.signing_secret.as_deref()).await?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    // (the signals' handlers installed before the line that says it listens)
    let stop = shutdown::shutdown_signal();
    tracing::info!(address = %listener.local_addr()?, database = %outbox.url(), "orders service listening");

    let stop_relay = CancellationToken::new();
    let relay = app::spawn_relay(&outbox, handler, stop_relay.clone().cancelled_owned())?;
    axum::serve(listener, app::router(outbox)).with_graceful_shutdown(stopping(stop)).await?;
    // The last request has been answered: let the relay deliver what is in flight, then stop.
    stop_relay.cancel();
    relay.await??;
    tracing::info!("orders service stopped");
    Ok(())
}

/// Resolves on Ctrl-C or SIGTERM (`stop`, from `shutdown::shutdown_signal`).
async fn stopping(stop: impl std::future::Future<Output = ()>) {
    stop.await;
    tracing::info!("shutting down: finishing requests in flight, then stopping the relay");
}
