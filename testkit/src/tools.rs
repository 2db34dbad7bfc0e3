//! Programs a test runs besides PostgreSQL: `openssl`, `rabbitmqctl`, `python3` with the
//! receivers' own libraries. Each is found, or the test fails with a message that names what to
//! install; a missing tool never lets a test pass.

use std::io::Write as _;
use std::net::{TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

/// The path of `name` on `PATH`; fails the test, naming `install`, when it is not there.
pub fn program(name: &str, install: &str) -> PathBuf {
    find_program(name).unwrap_or_else(|| panic!("this test needs {name}, which is not on PATH ({install})"))
}

/// The path of `name` on `PATH`, if it is there.
pub fn find_program(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|dir| dir.join(name)).find(|candidate| is_executable(candidate))
}

fn is_executable(path: &std::path::Path) -> bool {
    use std::os::unix::fs::PermissionsExt as _;
    path.metadata().is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// A Python package a test's script imports: the module it imports and what pip installs.
#[derive(Debug, Clone, Copy)]
pub struct PythonPackage {
    /// The module the script imports (`standardwebhooks.webhooks`).
    pub module: &'static str,
    /// The requirement pip installs (`standardwebhooks>=1.0`).
    pub pip: &'static str,
}

/// The Prometheus project's Python client, for its OpenMetrics parser.
pub const PROMETHEUS_CLIENT: PythonPackage =
    PythonPackage { module: "prometheus_client.openmetrics.parser", pip: "prometheus-client>=0.20" };

/// The official Standard Webhooks package, which verifies signatures.
pub const STANDARDWEBHOOKS: PythonPackage =
    PythonPackage { module: "standardwebhooks.webhooks", pip: "standardwebhooks>=1.0" };

/// The CloudEvents SDK (2.0 and later: `cloudevents.core`), which parses both HTTP modes.
pub const CLOUDEVENTS: PythonPackage =
    PythonPackage { module: "cloudevents.core.bindings.http", pip: "cloudevents>=2.0" };

/// psycopg 3, the PostgreSQL driver of the SQL door's Python example.
pub const PSYCOPG: PythonPackage = PythonPackage { module: "psycopg", pip: "psycopg[binary]>=3.1" };

/// Runs `python3 -c script args…` with `stdin`, once every package of `needs` imports; returns
/// what it did (the caller checks the status). Fails the test, naming the package to install,
/// when python3 or a package is missing.
pub fn python(script: &str, args: &[&str], stdin: &[u8], needs: &[PythonPackage]) -> Output {
    let python3 = probe_python(needs);
    let mut child = Command::new(&python3)
        .arg("-c")
        .arg(script)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 starts");
    child.stdin.take().expect("its stdin").write_all(stdin).expect("writing to python3");
    child.wait_with_output().expect("python3 finishes")
}

/// The path of python3, once every package of `needs` imports; fails the test, naming the
/// package to install, when python3 or a package is missing.
pub fn probe_python(needs: &[PythonPackage]) -> PathBuf {
    let python3 = program("python3", "Debian: apt install python3");
    for package in needs {
        let probe =
            Command::new(&python3).args(["-c", &format!("import {}", package.module)]).output().expect("python3 runs");
        if !probe.status.success() {
            let why = String::from_utf8_lossy(&probe.stderr);
            panic!(
                "this test needs the Python package {} (pip install '{}'); python3 says: {}",
                package.pip,
                package.pip,
                why.trim().lines().last().unwrap_or("")
            );
        }
    }
    python3
}

/// Whether something accepts TCP connections at the host and port of `url`
/// (`scheme://[user:pass@]host[:port][/…]`, `default_port` when none is given).
pub fn answers(url: &str, default_port: u16) -> Result<(), String> {
    let authority = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = authority.rsplit_once('@').map_or(authority, |(_, host)| host);
    let authority = authority.split(['/', ',']).next().unwrap_or(authority);
    let address = if authority.rsplit_once(':').is_some_and(|(_, port)| port.parse::<u16>().is_ok()) {
        authority.to_string()
    } else {
        format!("{authority}:{default_port}")
    };
    let addrs: Vec<_> = address.to_socket_addrs().map_err(|e| format!("{address}: {e}"))?.collect();
    let mut error = format!("{address}: no address");
    for addr in addrs {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
            Ok(_) => return Ok(()),
            Err(e) => error = format!("{addr}: {e}"),
        }
    }
    Err(error)
}

/// A new directory of this process for a private server (`kind`: `nats`, `kafka`) under the
/// temporary directory.
pub fn private_dir(kind: &str) -> Result<PathBuf, String> {
    use std::hash::{BuildHasher as _, RandomState};
    let suffix = RandomState::new().hash_one(std::time::SystemTime::now()) as u32;
    let dir = std::env::temp_dir().join(format!("outbox-relay-{kind}-{}-{suffix:08x}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    Ok(dir)
}

/// The detached watchdog of a private server: once this process is gone, it stops the process
/// whose id the file `pid` of `dir` holds (read then, so a restarted server is the one stopped)
/// and removes `dir`. A value in a `static` is never dropped, and a killed test process drops
/// nothing.
pub fn spawn_watchdog(what: &str, dir: &std::path::Path) -> Result<std::process::Child, String> {
    use std::os::unix::process::CommandExt as _;
    let script = format!(
        "trap '' HUP INT\n\
         while kill -0 {owner} 2>/dev/null; do sleep 1; done\n\
         server=$(cat '{dir}/pid' 2>/dev/null)\n\
         if [ -n \"$server\" ]; then\n\
           kill $server 2>/dev/null\n\
           for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 $server 2>/dev/null || break; sleep 0.5; done\n\
           kill -9 $server 2>/dev/null\n\
         fi\n\
         rm -rf '{dir}'\n",
        owner = std::process::id(),
        dir = dir.display(),
    );
    Command::new("/bin/sh")
        .args(["-c", &script])
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        // Its own process group: a Ctrl-C aimed at the tests must not kill the cleanup too.
        .process_group(0)
        .spawn()
        .map_err(|e| format!("spawning the {what} watchdog (/bin/sh): {e}"))
}

/// The last lines of the file `log` of `dir`.
pub fn log_tail(dir: &std::path::Path) -> String {
    let log = std::fs::read_to_string(dir.join("log")).unwrap_or_default();
    log.lines().rev().take(5).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n")
}
