//! The signals a long-running command handles: SIGINT and SIGTERM stop it gracefully, SIGHUP
//! asks `run` to read its `--config` again.

use crate::outcome::CliError;

/// What a signal asks of `run`.
pub(crate) enum Asked {
    /// SIGINT, SIGTERM: stop gracefully.
    Stop,
    /// SIGHUP: read `--config` again.
    Reload,
}

/// What SIGHUP does without a configuration file to read again.
pub(crate) const SIGHUP_IGNORED: &str = "SIGHUP received and ignored: the relay goes on with the settings it started with (it reloads \
     only a --config file; to apply a change of flags, stop it with SIGTERM, which redelivers nothing, and start it again)";

/// The signals a long-running command handles, installed at once (one that arrives later, even
/// before the relay runs, is not lost to the default action). SIGHUP (systemd's ExecReload,
/// logrotate scripts, a closed terminal) used to end the process as SIGKILL does: its claims
/// stayed leased and were delivered again after a restart.
pub(crate) struct Signals {
    interrupt: tokio::signal::unix::Signal,
    terminate: tokio::signal::unix::Signal,
    hangup: tokio::signal::unix::Signal,
}

impl Signals {
    pub(crate) fn install() -> Result<Signals, CliError> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Signals {
            interrupt: signal(SignalKind::interrupt()).map_err(|e| format!("cannot handle SIGINT: {e}"))?,
            terminate: signal(SignalKind::terminate()).map_err(|e| format!("cannot handle SIGTERM: {e}"))?,
            hangup: signal(SignalKind::hangup()).map_err(|e| format!("cannot handle SIGHUP: {e}"))?,
        })
    }

    /// The next signal, logged.
    pub(crate) async fn next(&mut self) -> Asked {
        tokio::select! {
            _ = self.interrupt.recv() => { tracing::info!("SIGINT received"); Asked::Stop }
            _ = self.terminate.recv() => { tracing::info!("SIGTERM received"); Asked::Stop }
            _ = self.hangup.recv() => { tracing::info!("SIGHUP received"); Asked::Reload }
        }
    }

    /// Resolves on SIGINT or SIGTERM; a SIGHUP meanwhile is logged with `why` it changes nothing.
    pub(crate) async fn stopped(&mut self, why: &str) {
        while let Asked::Reload = self.next().await {
            tracing::warn!("SIGHUP ignored: {why}");
        }
    }
}

/// Resolves on SIGINT or SIGTERM (see [`Signals`]).
pub(crate) fn shutdown_signal() -> Result<impl std::future::Future<Output = ()>, CliError> {
    let mut signals = Signals::install()?;
    Ok(async move { signals.stopped("this command has nothing to reload").await })
}
