//! Connection strings: parsed with the grammar libpq and tokio-postgres share, shown only from
//! the parsed form.
//!
//! Two forms are accepted, as libpq does:
//! - a URL, `postgres://user:password@host:port,host2:port2/database?key=value&...` (the scheme
//!   in any case: `POSTGRES://` is a URL too);
//! - `key=value` pairs separated by whitespace, with spaces allowed around `=` and values quoted
//!   with `'...'` (backslash escapes `\'` and `\\`), e.g. `host=db password='x y' sslmode=require`.
//!
//! tokio-postgres parses both, but knows neither libpq's `sslmode=verify-ca|verify-full` nor
//! `sslrootcert`. So this module takes those two options out first, with the same grammar, and
//! hands the rest to tokio-postgres' own parser: every other setting means what it means to
//! tokio-postgres, and none is dropped.
//!
//! Nothing here ever prints the text it was given. An error says what is wrong and where (a byte
//! offset, an option's name), never a value; [`ConnInfo::redacted`] is rebuilt from the parsed
//! configuration, with `***` for a password.

use std::fmt::Write as _;
use std::path::PathBuf;

use tokio_postgres::Config;
use tokio_postgres::config::{Host, SslMode};

use crate::error::{Error, Result};

/// How the server's certificate is checked, from libpq's `sslmode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum Verify {
    /// Not at all (`disable`, `allow`, `prefer`, `require`).
    #[default]
    None,
    /// The chain (`verify-ca`).
    Chain,
    /// The chain and the host name (`verify-full`).
    Full,
}

/// A parsed connection string: tokio-postgres' configuration plus the TLS settings it lacks.
#[derive(Clone)]
pub(crate) struct ConnInfo {
    pub(crate) config: Config,
    pub(crate) verify: Verify,
    pub(crate) root_cert: Option<PathBuf>,
}

/// The options tokio-postgres understands (`Config::from_str`), for a helpful message when a
/// string names another one. Keywords are case-sensitive, as in libpq.
const KNOWN_OPTIONS: &[&str] = &[
    "user",
    "password",
    "dbname",
    "options",
    "application_name",
    "sslmode",
    "sslnegotiation",
    "sslrootcert",
    "host",
    "hostaddr",
    "port",
    "connect_timeout",
    "tcp_user_timeout",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_retries",
    "target_session_attrs",
    "channel_binding",
    "load_balance_hosts",
];

const EXPECTED: &str = "expected postgres://user[:password]@host[:port]/database or key=value pairs";

impl ConnInfo {
    /// Parses a URL or a `key=value` string.
    pub(crate) fn parse(text: &str) -> Result<ConnInfo> {
        let mut tls = TlsOptions::default();
        let text = text.trim();
        let rewritten = match url_rest(text) {
            Some(rest) => rewrite_url(rest, &mut tls)?,
            None => rewrite_pairs(text, &mut tls)?,
        };
        let config: Config = rewritten.parse().map_err(|e: tokio_postgres::Error| {
            // tokio-postgres names options and offsets, never values.
            Error::config(format!("invalid database URL: {} ({EXPECTED})", crate::error::chain(&e)))
        })?;
        for host in config.get_hosts() {
            if let Host::Tcp(name) = host
                && name.contains('@')
            {
                return Err(Error::config(
                    "invalid database URL: a host name contains '@'; write an @ inside a password as %40",
                ));
            }
        }
        Ok(ConnInfo { config, verify: tls.verify, root_cert: tls.root_cert })
    }

    /// The connection string to show people: `postgres://user:***@host:port/database`, plus the
    /// sslmode when one was given; rebuilt from the parsed form, never cut from the input.
    pub(crate) fn redacted(&self) -> String {
        describe(&self.config, self.sslmode())
    }

    fn sslmode(&self) -> Option<&'static str> {
        match (self.verify, self.config.get_ssl_mode()) {
            (Verify::Full, _) => Some("verify-full"),
            (Verify::Chain, _) => Some("verify-ca"),
            (Verify::None, SslMode::Disable) => Some("disable"),
            (Verify::None, SslMode::Require) => Some("require"),
            _ => None,
        }
    }
}

impl std::fmt::Debug for ConnInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.redacted())
    }
}

impl ConnInfo {
    /// The connection string again, password included, as a URL (for handing to another
    /// process; never for a log): the user, password, hosts, ports, database and the TLS
    /// settings. The client tuning that every parse sets (timeouts, keepalives) is left out.
    pub(crate) fn to_url(&self) -> String {
        self.render(self.config.get_user(), self.config.get_password(), None)
    }

    /// [`to_url`](Self::to_url) with this user and password, and this one host and port when
    /// `address` is given.
    pub(crate) fn render(&self, user: Option<&str>, password: Option<&[u8]>, address: Option<(&str, u16)>) -> String {
        let config = &self.config;
        let mut out = String::from("postgres://");
        if let Some(user) = user {
            out.push_str(&percent_encode(user.as_bytes()));
        }
        if let Some(password) = password {
            out.push(':');
            out.push_str(&percent_encode(password));
        }
        if user.is_some() || password.is_some() {
            out.push('@');
        }
        let ports = config.get_ports();
        let hosts: Vec<String> = match address {
            Some((host, port)) => vec![format!("{}:{port}", percent_encode(host.as_bytes()))],
            None => config
                .get_hosts()
                .iter()
                .enumerate()
                .map(|(i, host)| {
                    let host = match host {
                        Host::Tcp(name) if name.contains(':') => format!("[{name}]"),
                        Host::Tcp(name) => percent_encode(name.as_bytes()),
                        Host::Unix(path) => percent_encode(path.as_os_str().as_encoded_bytes()),
                    };
                    match ports.get(i).or(ports.first()) {
                        Some(port) => format!("{host}:{port}"),
                        None => host,
                    }
                })
                .collect(),
        };
        out.push_str(&hosts.join(","));
        out.push('/');
        out.push_str(&percent_encode(config.get_dbname().unwrap_or("").as_bytes()));
        let mut query = Vec::new();
        if let Some(mode) = self.sslmode() {
            query.push(format!("sslmode={mode}"));
        }
        if let Some(root) = &self.root_cert {
            query.push(format!("sslrootcert={}", percent_encode(root.as_os_str().as_encoded_bytes())));
        }
        if !query.is_empty() {
            out.push('?');
            out.push_str(&query.join("&"));
        }
        out
    }
}

/// Percent-encodes every byte but RFC 3986's unreserved characters.
fn percent_encode(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len());
    for &byte in bytes {
        if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
            out.push(char::from(byte));
        } else {
            let _ = write!(out, "%{byte:02X}");
        }
    }
    out
}

/// `postgres://user[:***]@hosts/database[?sslmode=...]` for `config`.
pub(crate) fn describe(config: &Config, sslmode: Option<&str>) -> String {
    let mut out = String::from("postgres://");
    let password = config.get_password().is_some();
    if let Some(user) = config.get_user().or(password.then_some("")) {
        out.push_str(user);
        if password {
            out.push_str(":***");
        }
        out.push('@');
    }
    out.push_str(&describe_target(config));
    out.push('/');
    out.push_str(config.get_dbname().unwrap_or(""));
    if let Some(mode) = sslmode {
        let _ = write!(out, "?sslmode={mode}");
    }
    out
}

/// Where the database is, as `host:port[,host:port]` (a socket directory as `dir/.s.PGSQL.port`).
pub(crate) fn describe_target(config: &Config) -> String {
    let ports = config.get_ports();
    let hosts = config.get_hosts();
    if hosts.is_empty() {
        return format!("localhost:{}", ports.first().copied().unwrap_or(5432));
    }
    hosts
        .iter()
        .enumerate()
        .map(|(i, host)| {
            let port = ports.get(i).or(ports.first()).copied().unwrap_or(5432);
            match host {
                Host::Tcp(name) => format!("{name}:{port}"),
                Host::Unix(path) => format!("{}/.s.PGSQL.{port}", path.display()),
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// The part after `postgres://` or `postgresql://`, the scheme in any case; `None` for a
/// `key=value` string.
fn url_rest(text: &str) -> Option<&str> {
    ["postgresql://", "postgres://"].iter().find_map(|scheme| {
        let head = text.get(..scheme.len())?;
        head.eq_ignore_ascii_case(scheme).then(|| &text[scheme.len()..])
    })
}

/// What the TLS options of a connection string said.
#[derive(Debug, Default)]
struct TlsOptions {
    verify: Verify,
    root_cert: Option<PathBuf>,
}

impl TlsOptions {
    /// Takes `sslmode` and `sslrootcert` (returning `None`: the option is consumed, or the value
    /// tokio-postgres should get instead) and passes every other option through.
    fn take(&mut self, key: &str, value: &str) -> Result<Option<String>> {
        match key {
            "sslmode" => {
                let (verify, passed) = match value {
                    "disable" => (Verify::None, "disable"),
                    "allow" | "prefer" => (Verify::None, "prefer"),
                    "require" => (Verify::None, "require"),
                    "verify-ca" => (Verify::Chain, "require"),
                    "verify-full" => (Verify::Full, "require"),
                    _ => {
                        return Err(Error::config(
                            "invalid sslmode: expected disable, allow, prefer, require, verify-ca or verify-full",
                        ));
                    }
                };
                self.verify = verify;
                Ok(Some(passed.to_string()))
            }
            "sslrootcert" => {
                self.root_cert = Some(PathBuf::from(value));
                Ok(None)
            }
            _ => Ok(Some(value.to_string())),
        }
    }
}

/// Rewrites a URL's query the way tokio-postgres reads it: the credentials run to the first `@`,
/// the query starts at the first `?` after them, its pairs are split at `&` and at their first
/// `=`, and keys and values are percent-decoded. `sslmode` and `sslrootcert` are taken out; every
/// other pair is passed on exactly as written.
fn rewrite_url(rest: &str, tls: &mut TlsOptions) -> Result<String> {
    let after_credentials = rest.find('@').map_or(0, |at| at + 1);
    let (base, query) = match rest[after_credentials..].find('?') {
        Some(q) => rest.split_at(after_credentials + q),
        None => (rest, ""),
    };
    let mut kept = Vec::new();
    for pair in query.strip_prefix('?').unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (raw_key, raw_value) = pair
            .split_once('=')
            .ok_or_else(|| Error::config(format!("invalid database URL: a query parameter has no '=' ({EXPECTED})")))?;
        let key = percent_decode(raw_key)?;
        check_known(&key)?;
        match tls.take(&key, &percent_decode(raw_value)?)? {
            None => {}
            Some(value) if key == "sslmode" => kept.push(format!("sslmode={value}")),
            Some(_) => kept.push(pair.to_string()),
        }
    }
    let mut out = format!("postgresql://{base}");
    if !kept.is_empty() {
        out.push('?');
        out.push_str(&kept.join("&"));
    }
    Ok(out)
}

/// Rewrites a `key=value` string: the same tokens as libpq and tokio-postgres read them, without
/// `sslmode` and `sslrootcert`, every value re-quoted.
fn rewrite_pairs(text: &str, tls: &mut TlsOptions) -> Result<String> {
    let mut out = String::new();
    for (key, value) in Pairs::new(text) {
        let (key, value) = (key?, value);
        check_known(key)?;
        if let Some(value) = tls.take(key, &value?)? {
            if !out.is_empty() {
                out.push(' ');
            }
            let _ = write!(out, "{key}='{}'", value.replace('\\', "\\\\").replace('\'', "\\'"));
        }
    }
    Ok(out)
}

fn check_known(key: &str) -> Result<()> {
    if KNOWN_OPTIONS.contains(&key) {
        return Ok(());
    }
    let hint = if KNOWN_OPTIONS.contains(&key.to_ascii_lowercase().as_str()) {
        " (option names are lower case)".to_string()
    } else {
        String::new()
    };
    // An option's name is not a secret; its value may be, and is never shown.
    Err(Error::config(format!("unknown connection option {key:?}{hint}; known options: {}", KNOWN_OPTIONS.join(", "))))
}

fn percent_decode(text: &str) -> Result<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && let Some(byte) = bytes.get(i + 1..i + 3).and_then(|h| std::str::from_utf8(h).ok())
            && let Ok(byte) = u8::from_str_radix(byte, 16)
        {
            out.push(byte);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| Error::config("invalid database URL: a percent-encoded part is not UTF-8"))
}

/// The `key = value` pairs of a libpq keyword/value string, as tokio-postgres tokenizes them:
/// whitespace separates pairs, spaces may surround `=`, a value is either `'quoted'` or runs to
/// the next whitespace, and a backslash escapes the next character in both.
struct Pairs<'a> {
    text: &'a str,
    pos: usize,
    failed: bool,
}

impl<'a> Pairs<'a> {
    fn new(text: &'a str) -> Self {
        Pairs { text, pos: 0, failed: false }
    }

    fn peek(&self) -> Option<char> {
        self.text[self.pos..].chars().next()
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.peek()?;
        self.pos += c.len_utf8();
        Some(c)
    }

    fn skip_whitespace(&mut self) {
        while self.peek().is_some_and(char::is_whitespace) {
            self.bump();
        }
    }

    fn fail(&mut self, what: String) -> Error {
        self.failed = true;
        Error::config(format!("invalid database URL: {what} ({EXPECTED})"))
    }

    fn value(&mut self) -> Result<String> {
        let mut value = String::new();
        if self.peek() == Some('\'') {
            self.bump();
            loop {
                match self.bump() {
                    Some('\'') => return Ok(value),
                    Some('\\') => value.extend(self.bump()),
                    Some(c) => value.push(c),
                    None => return Err(self.fail("a quoted value is not closed with '".to_string())),
                }
            }
        }
        while let Some(c) = self.peek().filter(|c| !c.is_whitespace()) {
            self.bump();
            if c == '\\' {
                value.extend(self.bump());
            } else {
                value.push(c);
            }
        }
        if value.is_empty() {
            let at = self.pos;
            return Err(self.fail(format!("a value is missing at byte {at}")));
        }
        Ok(value)
    }
}

impl<'a> Iterator for Pairs<'a> {
    type Item = (Result<&'a str>, Result<String>);

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            return None;
        }
        self.skip_whitespace();
        let start = self.pos;
        while self.peek().is_some_and(|c| !c.is_whitespace() && c != '=') {
            self.bump();
        }
        if self.pos == start {
            if self.peek() == Some('=') {
                let at = self.pos;
                return Some((
                    Err(self.fail(format!("an option name is missing before '=' at byte {at}"))),
                    Ok(String::new()),
                ));
            }
            return None; // the end
        }
        let key = &self.text[start..self.pos];
        self.skip_whitespace();
        if self.bump() != Some('=') {
            // The word may be a secret typed in the wrong place: say where, not what.
            return Some((
                Err(self.fail(format!("the word at byte {start} is not followed by '='"))),
                Ok(String::new()),
            ));
        }
        self.skip_whitespace();
        let value = self.value();
        Some((Ok(key), value))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> ConnInfo {
        ConnInfo::parse(text).unwrap_or_else(|e| panic!("{text}: {e}"))
    }

    fn password(info: &ConnInfo) -> String {
        String::from_utf8(info.config.get_password().unwrap().to_vec()).unwrap()
    }

    #[test]
    fn a_slash_in_a_url_password_is_parsed_and_never_shown() {
        let info = parse("postgres://u:right/pw+x@host/db");
        assert_eq!(password(&info), "right/pw+x");
        assert_eq!(info.config.get_dbname(), Some("db"));
        assert_eq!(info.redacted(), "postgres://u:***@host:5432/db");
    }

    #[test]
    fn an_at_sign_in_a_url_password_is_refused_without_showing_it() {
        let err = ConnInfo::parse("postgres://u:s3c@ret@host/db").unwrap_err();
        let text = err.to_string();
        assert!(text.contains("%40"), "{text}");
        assert!(!text.contains("s3c") && !text.contains("ret"), "{text}");
        let info = parse("postgres://u:s3c%40ret@host/db");
        assert_eq!(password(&info), "s3c@ret");
    }

    #[test]
    fn the_scheme_may_be_upper_case() {
        let info = parse("POSTGRES://u:s3cret@db:6543/x");
        assert_eq!(info.redacted(), "postgres://u:***@db:6543/x");
        assert_eq!(parse("PostgreSQL://u@db/x").redacted(), "postgres://u@db:5432/x");
    }

    #[test]
    fn key_value_strings_follow_the_libpq_grammar() {
        let info = parse("host=db  password = s3cret user=app");
        assert_eq!(password(&info), "s3cret");
        assert_eq!(info.redacted(), "postgres://app:***@db:5432/");

        let info = parse("password='x y' sslmode=require dbname=t1 host=db");
        assert_eq!(password(&info), "x y");
        assert_eq!(info.config.get_ssl_mode(), SslMode::Require, "the settings after a quoted value are kept");
        assert_eq!(info.config.get_dbname(), Some("t1"));

        let info = parse(r"host=db password='it\'s \\ fine' dbname=d\ b");
        assert_eq!(password(&info), r"it's \ fine");
        assert_eq!(info.config.get_dbname(), Some("d b"));
    }

    #[test]
    fn tls_options_are_taken_out_in_both_forms() {
        let info = parse("postgres://u@db/x?sslmode=verify-full&sslrootcert=/etc/ca.pem&connect_timeout=5");
        assert_eq!(info.verify, Verify::Full);
        assert_eq!(info.root_cert.as_deref(), Some(std::path::Path::new("/etc/ca.pem")));
        assert_eq!(info.config.get_ssl_mode(), SslMode::Require);
        assert_eq!(info.config.get_connect_timeout(), Some(&std::time::Duration::from_secs(5)));
        assert_eq!(info.redacted(), "postgres://u@db:5432/x?sslmode=verify-full");

        let info = parse("host=db sslmode=verify-ca user=u sslrootcert='/a b/ca.pem'");
        assert_eq!(info.verify, Verify::Chain);
        assert_eq!(info.root_cert.as_deref(), Some(std::path::Path::new("/a b/ca.pem")));
        assert_eq!(info.config.get_user(), Some("u"));

        let info = parse("postgres://u@db/x?application_name=a%20b&sslmode=disable");
        assert_eq!(info.config.get_application_name(), Some("a b"));
        assert_eq!(info.config.get_ssl_mode(), SslMode::Disable);
    }

    #[test]
    fn errors_never_show_a_value() {
        let secret = "s3cr3t-value";
        for text in [
            format!("PASSWORD={secret} host=db"),
            format!("host=db {secret}"),
            format!("host=db password='{secret}"),
            format!("postgres://u:{secret}@db:notaport/x"),
            format!("postgres://u:{secret}@db/x?sslmode=always-{secret}"),
            format!("postgres://u:{secret}@db/x?{secret}"),
            format!("host=db password = {secret} port={secret}"),
            format!("postgres://u:{secret}@db/x?Password={secret}"),
        ] {
            let err = ConnInfo::parse(&text).expect_err(&text);
            assert!(!err.to_string().contains(secret), "{text}: {err}");
            assert!(!format!("{err:?}").contains(secret), "{text}: {err:?}");
        }
    }

    #[test]
    fn unknown_options_are_named() {
        let err = ConnInfo::parse("host=db PASSWORD=x").unwrap_err().to_string();
        assert!(err.contains("unknown connection option \"PASSWORD\" (option names are lower case)"), "{err}");
        let err = ConnInfo::parse("postgres://db/x?sslmod=require").unwrap_err().to_string();
        assert!(err.contains("unknown connection option \"sslmod\""), "{err}");
    }

    #[test]
    fn the_url_rebuilt_from_the_parsed_form_parses_to_the_same_settings() {
        for text in [
            "postgres://u:right/pw+x@host:6543/db",
            "host=db password='x y' user='a b' dbname='my db' sslmode=require",
            "postgres://app@%2Fvar%2Frun%2Fpostgresql:5433/shop",
            "postgres://app:s3c%40ret@h1:5432,h2:5433/shop?sslmode=verify-full&sslrootcert=/etc/ca.pem",
        ] {
            let info = parse(text);
            let again = parse(&info.to_url());
            assert_eq!(again.config.get_user(), info.config.get_user(), "{text}");
            assert_eq!(again.config.get_password(), info.config.get_password(), "{text}");
            assert_eq!(again.config.get_hosts(), info.config.get_hosts(), "{text}");
            let ports = |c: &Config| if c.get_ports().is_empty() { vec![5432] } else { c.get_ports().to_vec() };
            assert_eq!(ports(&again.config), ports(&info.config), "{text}");
            assert_eq!(again.config.get_dbname(), info.config.get_dbname(), "{text}");
            assert_eq!(again.config.get_ssl_mode(), info.config.get_ssl_mode(), "{text}");
            assert_eq!((again.verify, &again.root_cert), (info.verify, &info.root_cert), "{text}");
        }
    }

    #[test]
    fn socket_directories_and_several_hosts_are_shown() {
        let info = parse("postgres://app@%2Fvar%2Frun%2Fpostgresql/shop");
        assert_eq!(info.redacted(), "postgres://app@/var/run/postgresql/.s.PGSQL.5432/shop");
        let info = parse("postgres://app:pw@h1:5432,h2:5433/shop");
        assert_eq!(info.redacted(), "postgres://app:***@h1:5432,h2:5433/shop");
    }
}
