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
        Ok(Self::parse_tls(text)?.0)
    }

    /// Parses `text`, then takes what it leaves out from libpq's environment variables (`env`
    /// reads one), with libpq's precedence: the string first, then the environment, then the
    /// defaults. `PGHOST`, `PGPORT`, `PGUSER`, `PGPASSWORD` (else the password file:
    /// `PGPASSFILE` or `~/.pgpass`), `PGDATABASE`, `PGSSLMODE`, `PGSSLROOTCERT`, `PGAPPNAME`,
    /// `PGCONNECT_TIMEOUT`. An error names the variable, never its value.
    pub(crate) fn parse_with_env(text: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<ConnInfo> {
        let env = |name: &str| env(name).filter(|v| !v.is_empty());
        let env_port = env("PGPORT")
            .map(|port| port.trim().parse::<u16>().map_err(|_| Error::config("PGPORT is not a port number")))
            .transpose()?;
        // A URL's host without a port is read as port 5432 (tokio-postgres fills it in), so
        // PGPORT goes into the URL's hosts before it is parsed.
        let with_port;
        let text = match (url_rest(text.trim()), env_port) {
            (Some(rest), Some(port)) => {
                with_port = format!("postgresql://{}", default_port(rest, port));
                with_port.as_str()
            }
            _ => text,
        };
        let (mut info, tls) = Self::parse_tls(text)?;
        let config = &mut info.config;
        if config.get_hosts().is_empty()
            && let Some(hosts) = env("PGHOST")
        {
            for host in hosts.split(',') {
                config.host(host);
            }
        }
        if config.get_ports().is_empty()
            && let Some(port) = env_port
        {
            config.port(port);
        }
        if config.get_user().is_none()
            && let Some(user) = env("PGUSER")
        {
            config.user(&user);
        }
        if config.get_dbname().is_none()
            && let Some(dbname) = env("PGDATABASE")
        {
            config.dbname(&dbname);
        }
        if config.get_application_name().is_none()
            && let Some(name) = env("PGAPPNAME")
        {
            config.application_name(&name);
        }
        if config.get_options().is_none()
            && let Some(options) = env("PGOPTIONS")
        {
            config.options(&options);
        }
        if config.get_connect_timeout().is_none()
            && let Some(seconds) = env("PGCONNECT_TIMEOUT")
        {
            let seconds: u64 =
                seconds.trim().parse().map_err(|_| Error::config("PGCONNECT_TIMEOUT is not a number of seconds"))?;
            // libpq: 0 waits without end; a timeout of 1 s is raised to 2.
            if seconds > 0 {
                config.connect_timeout(std::time::Duration::from_secs(seconds.max(2)));
            }
        }
        let mut tls_env = TlsOptions::default();
        if !tls.sslmode_given
            && let Some(mode) = env("PGSSLMODE")
        {
            let passed = tls_env.take("sslmode", &mode).map_err(|_| {
                Error::config("PGSSLMODE: expected disable, allow, prefer, require, verify-ca or verify-full")
            })?;
            if let Some(passed) = passed {
                config.ssl_mode(match passed.as_str() {
                    "disable" => SslMode::Disable,
                    "require" => SslMode::Require,
                    _ => SslMode::Prefer,
                });
            }
            info.verify = tls_env.verify;
        }
        if info.root_cert.is_none()
            && let Some(path) = env("PGSSLROOTCERT")
        {
            info.root_cert = Some(PathBuf::from(path));
        }
        if info.config.get_hosts().is_empty() && info.config.get_hostaddrs().is_empty() {
            default_host(&mut info.config);
        }
        if info.config.get_password().is_none() {
            if let Some(password) = env("PGPASSWORD") {
                info.config.password(password);
            } else if let Some(password) = passfile_password(&info.config, &env) {
                info.config.password(password);
            }
        }
        Ok(info)
    }

    /// [`ConnInfo::parse`], with what the TLS options said.
    fn parse_tls(text: &str) -> Result<(ConnInfo, TlsOptions)> {
        let mut tls = TlsOptions::default();
        let text = text.trim();
        let rewritten = match url_rest(text) {
            Some(rest) => rewrite_url(rest, &mut tls)?,
            None if other_scheme(text).is_some() => {
                let scheme = other_scheme(text).unwrap_or_default();
                return Err(Error::config(format!(
                    "invalid database URL: {scheme}:// is not PostgreSQL's; only postgres:// and postgresql:// URLs are taken ({EXPECTED})"
                )));
            }
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
        let info = ConnInfo { config, verify: tls.verify, root_cert: tls.root_cert.clone() };
        Ok((info, tls))
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
/// libpq's default when neither the string nor PGHOST names a host: the server's Unix socket
/// (Debian's directory, /var/run/postgresql, or /tmp, where its socket file for the port is),
/// and otherwise localhost over TCP.
fn default_host(config: &mut Config) {
    let port = config.get_ports().first().copied().unwrap_or(5432);
    #[cfg(unix)]
    for dir in ["/var/run/postgresql", "/tmp"] {
        if std::path::Path::new(dir).join(format!(".s.PGSQL.{port}")).exists() {
            config.host(dir);
            return;
        }
    }
    config.host("localhost");
}

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

/// The scheme of a URL that is not PostgreSQL's (`mysql` of `mysql://...`): letters, digits,
/// `+`, `-` and `.` before `://`, the first a letter (RFC 3986). Never a value of a `key=value`
/// string: those have a `=` before any `://`.
fn other_scheme(text: &str) -> Option<&str> {
    let (scheme, _) = text.split_once("://")?;
    let mut chars = scheme.chars();
    let valid = chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    valid.then_some(scheme)
}

/// A URL (after its scheme) whose hosts without a port get `port`: `u@a,b:6000/db` with 7000
/// is `u@a:7000,b:6000/db`. An IPv6 address is in brackets, its port after them.
fn default_port(rest: &str, port: u16) -> String {
    let after_credentials = rest.find('@').map_or(0, |at| at + 1);
    let end = rest[after_credentials..].find(['/', '?']).map_or(rest.len(), |i| after_credentials + i);
    let hosts: Vec<String> = rest[after_credentials..end]
        .split(',')
        .map(|host| {
            let name_end = if host.starts_with('[') { host.find(']').map_or(host.len(), |i| i + 1) } else { 0 };
            if host.is_empty() || host[name_end..].contains(':') { host.to_string() } else { format!("{host}:{port}") }
        })
        .collect();
    format!("{}{}{}", &rest[..after_credentials], hosts.join(","), &rest[end..])
}

/// The password the password file gives for `config`'s first host, port, database and user
/// (libpq's rules: `PGPASSFILE` or `~/.pgpass`; lines `host:port:database:user:password`, `*`
/// matching anything, `\:` and `\\` escaped, `#` comments; a Unix socket matches `localhost`;
/// a file that others may read is ignored, with a warning).
fn passfile_password(config: &Config, env: &dyn Fn(&str) -> Option<String>) -> Option<String> {
    let path = match env("PGPASSFILE") {
        Some(path) => PathBuf::from(path),
        None => PathBuf::from(env("HOME")?).join(".pgpass"),
    };
    let text = std::fs::read_to_string(&path).ok()?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(&path).ok()?.permissions().mode();
        if mode & 0o077 != 0 {
            tracing::warn!(
                file = %path.display(),
                "the password file may be read by others (chmod 0600 it): its passwords are not used"
            );
            return None;
        }
    }
    let host = match config.get_hosts().first() {
        Some(Host::Tcp(name)) => name.clone(),
        #[cfg(unix)]
        Some(Host::Unix(_)) => "localhost".to_string(),
        None => "localhost".to_string(),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432).to_string();
    let user = config.get_user().map(str::to_string).or_else(|| env("USER"))?;
    let dbname = config.get_dbname().map_or_else(|| user.clone(), str::to_string);
    let wanted = [host.as_str(), port.as_str(), dbname.as_str(), user.as_str()];
    text.lines().filter(|line| !line.trim_start().starts_with('#')).find_map(|line| {
        let fields = passfile_fields(line);
        let [host, port, db, user, password] = <[String; 5]>::try_from(fields).ok()?;
        let matches = [host, port, db, user].iter().zip(wanted).all(|(field, want)| field == "*" || field == want);
        matches.then_some(password)
    })
}

/// A password file's line split at its unescaped `:` (at most 5 fields, the last keeping the
/// rest), with `\:` and `\\` unescaped.
fn passfile_fields(line: &str) -> Vec<String> {
    let mut fields = vec![String::new()];
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                if let Some(next) = chars.next() {
                    fields.last_mut().expect("one field at least").push(next);
                }
            }
            ':' if fields.len() < 5 => fields.push(String::new()),
            c => fields.last_mut().expect("one field at least").push(c),
        }
    }
    fields
}

/// What the TLS options of a connection string said.
#[derive(Debug, Default)]
struct TlsOptions {
    verify: Verify,
    root_cert: Option<PathBuf>,
    /// Whether the string gave an `sslmode` (else `PGSSLMODE` may).
    sslmode_given: bool,
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
                self.sslmode_given = true;
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
mod tests;
