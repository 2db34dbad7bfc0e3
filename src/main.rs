//! The `outbox-relay` command: a thin shell over the library.

use std::process::ExitCode;

mod cli;

fn main() -> ExitCode {
    cli::main()
}
