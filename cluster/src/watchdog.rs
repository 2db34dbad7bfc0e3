//! The watchdog: a detached `/bin/sh` that stops the server and removes its directory once the
//! owning process is gone, even when it died without running destructors (SIGKILL).

use std::os::unix::process::CommandExt as _;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use super::ctl::Ctl;
use super::settings::{EmbeddedError, SYSTEM_USER};
use super::system::{find_tool, sh_quote};

/// Spawns the detached watchdog that stops the server and removes the directory once this
/// process is gone.
pub(super) fn spawn_watchdog(ctl: &Ctl) -> Result<Child, EmbeddedError> {
    let script = watchdog_script(std::process::id(), ctl, find_tool("runuser"), find_tool("su"));
    Command::new("/bin/sh")
        .arg("-c")
        .arg(script)
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        // Its own process group: a Ctrl-C aimed at our group must not kill the cleanup too.
        .process_group(0)
        .spawn()
        .map_err(|err| EmbeddedError::io("could not spawn the embedded PostgreSQL watchdog (/bin/sh)", err))
}

/// The watchdog's shell script: wait for `pid` to disappear, stop the server, remove the directory.
pub(super) fn watchdog_script(pid: u32, ctl: &Ctl, runuser: Option<PathBuf>, su: Option<PathBuf>) -> String {
    let pid_file = sh_quote(&ctl.pid_file().to_string_lossy());
    let pg_ctl_stop = format!(
        "{} stop -D {} -m immediate -w -t 30",
        sh_quote(&ctl.pg_ctl.to_string_lossy()),
        sh_quote(&ctl.data_dir.to_string_lossy())
    );
    let stop = match (ctl.run_as, runuser, su) {
        (None, _, _) => pg_ctl_stop,
        (Some(_), Some(runuser), _) => {
            format!("{} -u {SYSTEM_USER} -- {pg_ctl_stop}", sh_quote(&runuser.to_string_lossy()))
        }
        (Some(_), None, Some(su)) => {
            format!("{} {SYSTEM_USER} -s /bin/sh -c {}", sh_quote(&su.to_string_lossy()), sh_quote(&pg_ctl_stop))
        }
        // No way to switch users: fall through to signalling the postmaster directly
        // (SIGQUIT = immediate shutdown), which root may do.
        (Some(_), None, None) => "false".to_owned(),
    };
    format!(
        "trap '' HUP INT\n\
         while kill -0 {pid} 2>/dev/null; do sleep 1; done\n\
         if [ -f {pid_file} ]; then\n\
         \x20 {stop} >/dev/null 2>&1 || kill -QUIT \"$(head -n 1 {pid_file})\" >/dev/null 2>&1\n\
         fi\n\
         rm -rf {root}\n",
        root = sh_quote(&ctl.root.to_string_lossy()),
    )
}
