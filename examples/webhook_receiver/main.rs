//! A webhook receiver that handles each event once, however often the relay sends it.
//!
//! ```sh
//! WEBHOOK_SECRET=whsec_... DATABASE_URL=postgres://postgres@127.0.0.1:5432/erp \
//!     cargo run --example webhook_receiver -- --listen 127.0.0.1:9090
//! ```
//!
//! At start-up it applies the library's migrations to its own database (for `outbox_relay.inbox`)
//! and creates its `received_events` table. Every hour it deletes inbox records older than
//! `--inbox-retention`. See `app.rs` for what a request does.

mod app;
#[path = "../shared/shutdown.rs"]
mod shutdown;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use pg_outbox_relay::Outbox;
use pg_outbox_relay::inbox::Inbox;

/// Receives the relay's signed webhooks and handles each event once (the inbox).
#[derive(Debug, Parser)]
#[command(name = "webhook_receiver")]
struct Args {
    /// Address to serve HTTP on.
    #[arg(long, default_value = "127.0.0.1:9090")]
    listen: SocketAddr,

    /// The receiver's PostgreSQL database (or set DATABASE_URL).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    database_url: String,

    /// The Standard Webhooks secret the relay signs with (`--signing-secret`), whsec_...
    #[arg(long, env = "WEBHOOK_SECRET", hide_env_values = true)]
    secret: String,

    /// The name this receiver records events under in the inbox.
    #[arg(long, default_value = "webhook_receiver")]
    consumer: String,

    /// How long inbox records are kept: longer than any redelivery can come (a dead letter
    /// retried days later, say).
    #[arg(long, default_value = "30d", value_parser = humantime::parse_duration)]
    inbox_retention: Duration,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,tokio_postgres=warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<(), BoxError> {
    pg_outbox_relay::inbox::check_retention(args.inbox_retention)?;
    let database = Outbox::connect(&args.database_url).await?;
    app::setup(&database).await?;
    let receiver = app::Receiver::new(database.clone(), &args.consumer, &args.secret)?;
    tokio::spawn(purge_every_hour(database.clone(), Inbox::new(&args.consumer)?, args.inbox_retention));
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    // (the signals' handlers installed before the line that says it listens)
    let stop = shutdown::shutdown_signal();
    tracing::info!(address = %listener.local_addr()?, database = %database.url(), "webhook receiver listening");
    axum::serve(listener, app::router(receiver))
        .with_graceful_shutdown(async {
            stop.await;
            tracing::info!("shutting down: finishing requests in flight");
        })
        .await?;
    Ok(())
}

/// Deletes old inbox records once an hour; a failure is logged and tried again the next hour.
async fn purge_every_hour(database: Outbox, inbox: Inbox, retention: Duration) {
    let mut every = tokio::time::interval(Duration::from_secs(3600));
    loop {
        every.tick().await;
        let purged = match database.connection().await {
            Ok(client) => inbox.purge(&*client, retention).await,
            Err(e) => Err(e),
        };
        match purged {
            Ok(0) => {}
            Ok(n) => tracing::info!(deleted = n, "deleted old inbox records"),
            Err(e) => tracing::warn!("cannot delete old inbox records: {e}"),
        }
    }
}
