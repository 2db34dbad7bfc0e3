//! The crate's one error type.

use std::fmt;

type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What went wrong, in broad strokes. The [`Error`]'s message says exactly what.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// An argument was refused before anything was written: an empty or over-long key or topic,
    /// an oversized payload, a malformed value. Nothing was written.
    InvalidInput,
    /// An idempotency key was reused for a request with another fingerprint. Nothing was written.
    KeyReused,
    /// The database could not be reached (connection refused, timed out, pool exhausted).
    Connect,
    /// The database answered with an error, or the connection broke during a statement.
    Database,
    /// The schema migrations could not be applied.
    Migration,
    /// A configuration value is invalid.
    Config,
    /// A value could not be converted to or from JSON.
    Json,
    /// The database role lacks a privilege the operation needs, or a sink's broker refused the
    /// login.
    Permission,
}

/// An error from outbox-relay.
///
/// Use [`Error::kind`] to tell the cases apart, and [`Error::code`] for the SQLSTATE of a
/// database error. Messages never contain a password.
pub struct Error {
    kind: ErrorKind,
    message: String,
    source: Option<BoxError>,
    /// The SQLSTATE of a database error whose source is not tokio-postgres's (sqlx's).
    sqlstate: Option<tokio_postgres::error::SqlState>,
}

impl Error {
    pub(crate) fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error { kind, message: message.into(), source: None, sqlstate: None }
    }

    pub(crate) fn with_source(mut self, source: impl Into<BoxError>) -> Self {
        self.source = Some(source.into());
        self
    }

    pub(crate) fn invalid_input(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::InvalidInput, message)
    }

    pub(crate) fn config(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::Config, message)
    }

    /// Keeps the SQLSTATE of a database error that did not come through tokio-postgres.
    #[cfg_attr(not(feature = "sqlx"), allow(dead_code))]
    pub(crate) fn with_sqlstate(mut self, code: &str) -> Self {
        self.sqlstate = Some(tokio_postgres::error::SqlState::from_code(code));
        self
    }

    /// Wraps a database error that happened while doing `context` (e.g. "claiming events").
    pub(crate) fn database(context: &str, err: tokio_postgres::Error) -> Self {
        Error::new(ErrorKind::Database, context.to_string()).with_source(err)
    }

    /// The broad kind of this error.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// True when the input was refused before anything was written.
    pub fn is_invalid_input(&self) -> bool {
        self.kind == ErrorKind::InvalidInput
    }

    /// True when an idempotency key was reused for a different request.
    pub fn is_key_reused(&self) -> bool {
        self.kind == ErrorKind::KeyReused
    }

    /// True when the database could not be reached.
    pub fn is_connect(&self) -> bool {
        self.kind == ErrorKind::Connect
    }

    /// The SQLSTATE code, when PostgreSQL answered with an error (through tokio-postgres or,
    /// with the `sqlx` feature, through sqlx).
    pub fn code(&self) -> Option<&tokio_postgres::error::SqlState> {
        self.pg_error().and_then(|e| e.code()).or(self.sqlstate.as_ref())
    }

    /// True when the connection to the database was closed (the statement's outcome is unknown).
    pub fn is_closed(&self) -> bool {
        self.pg_error().is_some_and(|e| e.is_closed())
    }

    fn pg_error(&self) -> Option<&tokio_postgres::Error> {
        causes(self.source.as_deref()?).find_map(|e| e.downcast_ref::<tokio_postgres::Error>())
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)?;
        if let Some(source) = &self.source {
            match source.downcast_ref::<tokio_postgres::Error>().and_then(|e| e.as_db_error()) {
                // PostgreSQL's own words carry what a reader needs ("duplicate key value ...").
                Some(db) => {
                    write!(f, ": {}", db.message())?;
                    if let Some(detail) = db.detail() {
                        write!(f, " ({detail})")?;
                    }
                    if let Some(hint) = db.hint() {
                        write!(f, " (hint: {hint})")?;
                    }
                    write!(f, " [SQLSTATE {}]", db.code().code())?;
                }
                None => {
                    // tokio-postgres keeps the cause ("Connection refused") out of its Display.
                    write!(f, ": {source}")?;
                    let mut cause = source.source();
                    while let Some(c) = cause {
                        write!(f, ": {c}")?;
                        cause = c.source();
                    }
                }
            }
        }
        Ok(())
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The full message, PostgreSQL's words included; never a password (none is ever in it).
        f.debug_struct("Error").field("kind", &self.kind).field("message", &self.to_string()).finish()
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_deref().map(|e| e as _)
    }
}

/// Lets `?` turn the errors of a unit of work's business SQL into this type.
impl From<tokio_postgres::Error> for Error {
    fn from(err: tokio_postgres::Error) -> Self {
        Error::new(ErrorKind::Database, "database error").with_source(err)
    }
}

impl From<serde_json::Error> for Error {
    fn from(err: serde_json::Error) -> Self {
        Error::new(ErrorKind::Json, "JSON conversion failed").with_source(err)
    }
}

/// `error` and its sources, outermost first.
pub(crate) fn causes<'a>(
    error: &'a (dyn std::error::Error + 'static),
) -> impl Iterator<Item = &'a (dyn std::error::Error + 'static)> {
    std::iter::successors(Some(error), |e| e.source())
}

/// An error's message followed by those of its causes, `: `-separated (tokio-postgres, reqwest
/// and others keep the cause, such as "Connection refused", out of their own `Display`).
pub(crate) fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(c) = cause {
        let next = c.to_string();
        if !text.ends_with(&next) {
            text.push_str(": ");
            text.push_str(&next);
        }
        cause = c.source();
    }
    text
}

/// Shorthand for results of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
