//! What the cluster needs from the machine: the PostgreSQL binaries, a user to run them as, a
//! private directory, a free port; and the quoting of what goes to `/bin/sh` and the server.

use std::fs;
use std::net::{Ipv4Addr, TcpListener};
use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use tempfile::TempDir;

use super::settings::{EmbeddedError, SYSTEM_TOOL_DIRS, TEMP_PREFIX};

/// A system user to run the server as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct RunAs {
    /// User id.
    pub(super) uid: u32,
    /// Primary group id.
    pub(super) gid: u32,
}

/// The PostgreSQL binaries to use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Binaries {
    /// The directory holding them.
    pub(super) dir: PathBuf,
    /// `dir/initdb`.
    pub(super) initdb: PathBuf,
    /// `dir/pg_ctl`.
    pub(super) pg_ctl: PathBuf,
}

/// Finds initdb and pg_ctl (preferably with postgres) in one directory: PATH first, then
/// `/usr/lib/postgresql/*/bin`, highest version first.
pub(super) fn find_binaries() -> Result<Binaries, EmbeddedError> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut candidates = Vec::new();
    for dir in std::env::split_paths(&path) {
        let initdb = dir.join("initdb");
        if dir.as_os_str().is_empty() || !is_executable(&initdb) {
            continue;
        }
        // Follow a symlinked initdb to its installation directory, where pg_ctl and postgres
        // live too (pg_ctl finds postgres next to its own resolved path).
        if let Some(real_dir) = fs::canonicalize(&initdb).ok().and_then(|real| real.parent().map(Path::to_path_buf)) {
            candidates.push(real_dir);
        }
        candidates.push(dir);
    }
    candidates.extend(versioned_bin_dirs(Path::new("/usr/lib/postgresql")));

    let has = |dir: &Path, name: &str| is_executable(&dir.join(name));
    let complete = candidates.iter().find(|dir| has(dir, "initdb") && has(dir, "pg_ctl") && has(dir, "postgres"));
    let usable = complete.or_else(|| candidates.iter().find(|dir| has(dir, "initdb") && has(dir, "pg_ctl")));
    match usable {
        Some(dir) => Ok(Binaries { initdb: dir.join("initdb"), pg_ctl: dir.join("pg_ctl"), dir: dir.clone() }),
        None => Err(EmbeddedError::BinariesNotFound { path: path.to_string_lossy().into_owned() }),
    }
}

/// `base/*/bin` for every numeric version directory under `base`, highest version first.
pub(super) fn versioned_bin_dirs(base: &Path) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(base) else {
        return Vec::new();
    };
    let mut versions: Vec<(Vec<u32>, PathBuf)> = entries
        .filter_map(Result::ok)
        .filter_map(|entry| {
            let version = parse_version(entry.file_name().to_str()?)?;
            Some((version, entry.path().join("bin")))
        })
        .collect();
    versions.sort_by(|a, b| b.0.cmp(&a.0));
    versions.into_iter().map(|(_, dir)| dir).collect()
}

/// Parses `15` or `9.6` into its numeric components.
pub(super) fn parse_version(name: &str) -> Option<Vec<u32>> {
    name.split('.').map(|part| part.parse().ok()).collect()
}

/// Whether `path` is a regular file with an execute bit (following symlinks).
pub(super) fn is_executable(path: &Path) -> bool {
    fs::metadata(path).is_ok_and(|meta| meta.is_file() && meta.mode() & 0o111 != 0)
}

/// Finds a system tool on PATH or in the usual sbin/bin directories.
pub(super) fn find_tool(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(SYSTEM_TOOL_DIRS.iter().map(PathBuf::from))
        .filter(|dir| !dir.as_os_str().is_empty())
        .map(|dir| dir.join(name))
        .find(|candidate| is_executable(candidate))
}

/// The effective uid of this process, from the owner of `/proc/self` (falling back to `id -u`).
pub(super) fn effective_uid() -> Option<u32> {
    if let Ok(meta) = fs::metadata("/proc/self") {
        return Some(meta.uid());
    }
    let output = Command::new("id").arg("-u").stdin(Stdio::null()).stderr(Stdio::null()).output().ok()?;
    String::from_utf8_lossy(&output.stdout).trim().parse().ok()
}

/// Looks up a system user's uid and gid in `/etc/passwd`, then via `getent passwd`.
pub(super) fn lookup_user(name: &str) -> Option<RunAs> {
    if let Some(user) = fs::read_to_string("/etc/passwd").ok().and_then(|passwd| parse_passwd(&passwd, name)) {
        return Some(user);
    }
    let output =
        Command::new("getent").args(["passwd", name]).stdin(Stdio::null()).stderr(Stdio::null()).output().ok()?;
    parse_passwd(&String::from_utf8_lossy(&output.stdout), name)
}

/// Finds `name` in passwd(5)-formatted text (`name:password:uid:gid:gecos:home:shell`).
pub(super) fn parse_passwd(passwd: &str, name: &str) -> Option<RunAs> {
    passwd.lines().find_map(|line| {
        let mut fields = line.split(':');
        if fields.next()? != name {
            return None;
        }
        let _password = fields.next()?;
        let uid = fields.next()?.trim().parse().ok()?;
        let gid = fields.next()?.trim().parse().ok()?;
        Some(RunAs { uid, gid })
    })
}

/// Creates the temporary directory (with the socket directory inside), owned by `run_as` if
/// given, mode 0700.
pub(super) fn create_temp_dir(run_as: Option<RunAs>) -> Result<TempDir, EmbeddedError> {
    let mut base = std::env::temp_dir();
    // The postgres user must be able to reach the directory; a private TMPDIR (say under /root)
    // would not do, so fall back to /tmp.
    if run_as.is_some() && !traversable_by_others(&base) {
        base = PathBuf::from("/tmp");
    }
    let dir = tempfile::Builder::new().prefix(TEMP_PREFIX).tempdir_in(&base).map_err(|err| {
        EmbeddedError::io(format!("could not create a temporary directory in {}", base.display()), err)
    })?;
    let socket_dir = dir.path().join("socket");
    fs::create_dir(&socket_dir)
        .map_err(|err| EmbeddedError::io(format!("could not create {}", socket_dir.display()), err))?;
    for path in [dir.path(), socket_dir.as_path()] {
        if let Some(user) = run_as {
            std::os::unix::fs::chown(path, Some(user.uid), Some(user.gid)).map_err(|err| {
                EmbeddedError::io(format!("could not hand {} over to the postgres user", path.display()), err)
            })?;
        }
        fs::set_permissions(path, fs::Permissions::from_mode(0o700))
            .map_err(|err| EmbeddedError::io(format!("could not set permissions of {}", path.display()), err))?;
    }
    Ok(dir)
}

/// Whether every directory from `/` down to `path` can be traversed by other users.
pub(super) fn traversable_by_others(path: &Path) -> bool {
    let Ok(path) = fs::canonicalize(path) else {
        return false;
    };
    path.ancestors().all(|dir| fs::metadata(dir).is_ok_and(|meta| meta.mode() & 0o001 != 0))
}
/// Binds `127.0.0.1:0` to find a currently free port.
pub(super) fn free_port() -> Result<u16, EmbeddedError> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .map_err(|err| EmbeddedError::io("could not bind 127.0.0.1:0 to find a free port", err))?;
    let port = listener
        .local_addr()
        .map_err(|err| EmbeddedError::io("could not read the address of a bound socket", err))?
        .port();
    Ok(port)
}

/// Quotes a word for `/bin/sh` (unchanged if it only has safe characters).
pub(super) fn sh_quote(word: &str) -> String {
    let safe = |c: char| c.is_ascii_alphanumeric() || "-_./=:,@%+".contains(c);
    if !word.is_empty() && word.chars().all(safe) {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// Quotes one element of a PostgreSQL list setting (like `unix_socket_directories`) if needed.
pub(super) fn guc_list_item(item: &str) -> String {
    if item.chars().any(|c| c == ',' || c == '"' || c.is_whitespace()) {
        format!("\"{}\"", item.replace('"', "\"\""))
    } else {
        item.to_owned()
    }
}

/// The last `lines` lines of `text`, trimmed.
pub(super) fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.trim_end().lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
