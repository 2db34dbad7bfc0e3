//! The janitor: deletes processed events and idempotency receipts past their retention, and the
//! marks of relays that crashed.

use tokio_util::sync::CancellationToken;

use super::RelayPool;
use super::config::RelayConfig;
use crate::sql;

/// The janitor and what it needs.
pub(crate) struct Janitor {
    pub(crate) pool: RelayPool,
    pub(crate) config: RelayConfig,
}

impl Janitor {
    pub(crate) async fn run(self, stop: CancellationToken) {
        let config = &self.config;
        loop {
            let pass = async {
                let client = self.pool.client().await?;
                let report = crate::admin::cleanup(
                    &*client,
                    config.retention,
                    config.idempotency_retention,
                    config.janitor_batch,
                    None,
                )
                .await?;
                sql::remove_dead_relays(&*client).await?;
                Ok::<_, crate::error::Error>(report)
            };
            match pass.await {
                Ok(report) if report.events + report.receipts > 0 => {
                    tracing::info!(events = report.events, receipts = report.receipts, "janitor removed expired rows");
                }
                Ok(_) => tracing::debug!("janitor found nothing to remove"),
                Err(e) => tracing::warn!(error = %e, "janitor pass failed; trying again next interval"),
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(config.janitor_interval) => {}
            }
        }
    }
}
