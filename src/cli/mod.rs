//! Argument parsing and the commands of the `outbox-relay` binary.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use outbox_relay::{DatabaseUrl, Outbox};

/// Atomic writes and their events on PostgreSQL, delivered within milliseconds of commit.
#[derive(Debug, Parser)]
#[command(name = "outbox-relay", version, about, propagate_version = true)]
struct Cli {
    /// PostgreSQL URL, e.g. postgres://user:password@host:5432/db (or set DATABASE_URL).
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    database_url: Option<String>,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Apply the library's schema migrations (safe to run again, and from several processes at once).
    Migrate,
}

/// Parses the arguments, runs the command, and turns its error into one line and exit code 1.
pub(crate) fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Logs go to stderr (stdout is for results), filtered by RUST_LOG, `info` by default (PostgreSQL's
/// notices only from `warn`).
fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,tokio_postgres=warn"));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
}

/// A command's failure: printed as one line.
type CliError = Box<dyn std::error::Error + Send + Sync>;

async fn run(cli: Cli) -> Result<(), CliError> {
    match cli.command {
        Command::Migrate => migrate(&require_url(cli.database_url)?).await,
    }
}

fn require_url(url: Option<String>) -> Result<DatabaseUrl, CliError> {
    match url.filter(|u| !u.is_empty()) {
        Some(url) => Ok(DatabaseUrl::parse(&url)?),
        None => Err("no database given: pass --database-url URL or set DATABASE_URL".into()),
    }
}

async fn migrate(url: &DatabaseUrl) -> Result<(), CliError> {
    let outbox = Outbox::connect_with(url.clone(), 1).await?;
    let report = outbox.migrate().await?;
    for (version, name) in &report.applied {
        println!("applied {version:04}_{name}");
    }
    if report.applied.is_empty() {
        println!("nothing to apply: {} migrations already applied to {url}", report.already_applied);
    } else {
        println!("{} applied, {} already in place, on {url}", report.applied.len(), report.already_applied);
    }
    Ok(())
}
