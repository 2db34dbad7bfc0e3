//! Shared by the examples: the signal that stops a server gracefully.

use std::future::Future;

/// Resolves on Ctrl-C or SIGTERM (what `kill`, systemd and container engines send), so that a
/// server finishes its requests in flight and exits 0 rather than being killed (exit 143).
///
/// The handlers are installed when this is called, not when the future is first polled: call it
/// before saying that the server listens, so that a signal sent as soon as that line shows (by a
/// test, a supervisor or a user) stops it gracefully, not by the signal's default action.
pub fn shutdown_signal() -> impl Future<Output = ()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{Signal, SignalKind, signal};
        let interrupt = signal(SignalKind::interrupt()).ok();
        let terminate = signal(SignalKind::terminate()).ok();
        async fn received(signal: Option<Signal>) {
            match signal {
                Some(mut signal) => {
                    signal.recv().await;
                }
                None => std::future::pending::<()>().await,
            }
        }
        async move {
            tokio::select! {
                () = received(interrupt) => {}
                () = received(terminate) => {}
            }
        }
    }
    #[cfg(not(unix))]
    async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}
