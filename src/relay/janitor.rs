//! The janitor: deletes processed events and idempotency receipts past their retention.

use std::sync::Arc;

use super::{Handler, Shared};

pub(crate) async fn run<H: Handler>(shared: Arc<Shared<H>>) {
    let config = &shared.config;
    loop {
        match shared.outbox.cleanup(config.retention, config.idempotency_retention, config.janitor_batch).await {
            Ok(report) if report.events + report.receipts > 0 => {
                tracing::info!(events = report.events, receipts = report.receipts, "janitor removed expired rows");
            }
            Ok(_) => tracing::debug!("janitor found nothing to remove"),
            Err(e) => tracing::warn!(error = %e, "janitor pass failed; trying again next interval"),
        }
        if let Ok(client) = shared.pool.get().await
            && let Err(e) = client.execute(crate::sql::RELAY_REMOVE_DEAD, &[]).await
        {
            let e = crate::error::Error::database("removing the marks of dead relays", e);
            tracing::warn!(error = %e, "janitor pass failed; trying again next interval");
        }
        tokio::select! {
            _ = shared.stop.cancelled() => return,
            _ = tokio::time::sleep(config.janitor_interval) => {}
        }
    }
}
