//! What a command ends with: its failures, and the lines it prints.

/// A command's failure: printed as one line.
pub(crate) type CliError = Box<dyn std::error::Error + Send + Sync>;

/// Arguments that do not make sense together: exit code 2, like clap's own errors.
#[derive(Debug)]
pub(crate) struct UsageError(pub(crate) String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// Writes one line of the command's output (see [`out!`]).
pub(crate) fn print_out(line: std::fmt::Arguments<'_>) {
    use std::io::Write;
    if let Err(e) = writeln!(std::io::stdout().lock(), "{line}") {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprintln!("error: cannot write the output: {e}");
        std::process::exit(1);
    }
}

/// `text` on one line for a terminal: whitespace runs as one space, and control and bidi
/// characters (a destination's error, a key written by hand) as `\u{..}`, as the logs show them.
pub(crate) fn one_line(text: &str) -> String {
    let spaced = text.split_whitespace().collect::<Vec<_>>().join(" ");
    pg_outbox_relay::printable(&spaced).into_owned()
}
