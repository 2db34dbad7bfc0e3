//! The relay's connection pool, and the bounds of its shutdown.

use tokio::task::JoinSet;

use crate::connect::{DatabaseUrl, pool_error};
use crate::error::Result;

/// How long shutdown waits, after the grace period, for each remaining step (stuck workers, the
/// other tasks, removing the waiting mark) before it abandons it: `run` returns even when the
/// database link is stalled.
pub(crate) const STOP_BOUND: std::time::Duration = std::time::Duration::from_secs(3);

/// The relay's own connection pool (its sessions run with `synchronous_commit = off`), with
/// errors that name the server.
#[derive(Clone)]
pub(crate) struct RelayPool {
    pub(super) pool: deadpool_postgres::Pool,
    pub(super) url: DatabaseUrl,
    /// The relay's id (its log span's), which its connections' `application_name` carries.
    pub(super) relay: std::sync::Arc<str>,
}

impl std::fmt::Debug for RelayPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayPool").field("url", &self.url).finish_non_exhaustive()
    }
}

impl RelayPool {
    /// A connection, or an error naming the server.
    pub(crate) async fn client(&self) -> Result<deadpool_postgres::Object> {
        self.pool.get().await.map_err(|e| pool_error(&self.url, e))
    }
}

/// Waits for every task of `tasks`, logging those that failed.
pub(crate) async fn drain(tasks: &mut JoinSet<()>) {
    while let Some(result) = tasks.join_next().await {
        if let Err(e) = result {
            tracing::error!(error = %e, "relay task failed");
        }
    }
}
