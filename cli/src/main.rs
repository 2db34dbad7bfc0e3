//! The `outbox-relay` command: a thin shell over the library. It parses the arguments, sets up
//! logging, runs one command and turns its failure into one line on stderr and an exit code.

/// `println!` for the command's output: a reader that went away (`outbox-relay status | head -1`)
/// ends the command quietly with exit status 0, as a closed pipe ends `cat`, never a panic.
macro_rules! out {
    () => {
        $crate::outcome::print_out(format_args!(""))
    };
    ($($arg:tt)*) => {
        $crate::outcome::print_out(format_args!($($arg)*))
    };
}

mod args;
mod bench;
mod commands;
mod console;
mod demo;
mod docs_check;
mod http;
mod json_logs;
mod outcome;
mod route_flags;
mod routes;
mod signals;
mod sinks;
mod telemetry;
mod values;

use std::process::ExitCode;

use self::args::Command;
use self::outcome::{CliError, UsageError, one_line};

/// 2 for bad arguments (flags, a malformed database URL or sink), 1 for everything else.
fn exit_code(error: &CliError) -> ExitCode {
    fn bad_arguments(error: &(dyn std::error::Error + Send + Sync + 'static)) -> bool {
        let config = |e: &pg_outbox_relay::Error| e.kind() == pg_outbox_relay::ErrorKind::Config;
        error.is::<UsageError>()
            || error.downcast_ref::<pg_outbox_relay::Error>().is_some_and(config)
            || error.downcast_ref::<routes::AtDestination>().is_some_and(|e| bad_arguments(&*e.error))
    }
    if bad_arguments(&**error) { ExitCode::from(2) } else { ExitCode::FAILURE }
}

/// The log format the arguments or the environment ask for, read before they are parsed (an
/// error in them is said in that format too).
fn asked_format() -> telemetry::LogFormat {
    let args: Vec<String> = std::env::args().collect();
    let flag = args.iter().enumerate().find_map(|(i, a)| match a.strip_prefix("--log-format") {
        Some("") => args.get(i + 1).cloned(),
        Some(rest) => rest.strip_prefix('=').map(str::to_string),
        None => None,
    });
    let asked = flag.or_else(|| std::env::var("OUTBOX_RELAY_LOG_FORMAT").ok());
    if asked.is_some_and(|f| f.eq_ignore_ascii_case("json")) {
        telemetry::LogFormat::Json
    } else {
        telemetry::LogFormat::Text
    }
}

/// Parses the arguments, runs the command, and turns its error into one line and exit code 1
/// (2 for bad arguments).
fn main() -> ExitCode {
    let cli = match route_flags::parse(std::env::args_os().collect()) {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => {
            // --help and --version
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            // clap's message, without the usage block, on one line
            let text = e.to_string();
            let reason: Vec<&str> = text
                .lines()
                .take_while(|l| !l.starts_with("Usage:"))
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with("For more information"))
                .collect();
            telemetry::say(asked_format(), tracing::Level::ERROR, &format!("{} (see --help)", reason.join(" ")));
            return ExitCode::from(2);
        }
    };
    // The demo prints a report; its expected failures (a dead letter) need not be logged too.
    // Only `run` exports spans: the OTEL_* variables are no other command's concern.
    let _telemetry = match telemetry::init(
        if matches!(cli.command, Command::Demo(_) | Command::Bench(_)) { "error" } else { "info" },
        cli.log_format,
        matches!(cli.command, Command::Run(_)),
    ) {
        Ok(telemetry) => telemetry,
        Err(e) => {
            telemetry::say(cli.log_format, tracing::Level::ERROR, &e);
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let format = cli.log_format;
    match runtime.block_on(commands::run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            telemetry::say(format, tracing::Level::ERROR, &one_line(&e.to_string()));
            exit_code(&e)
        }
    }
}
