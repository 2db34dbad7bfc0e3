//! The janitor: deletes idempotency receipts past their retention, claim positions no longer
//! needed, and the marks of relays that crashed; records which destinations relays serve, warns
//! of those no relay has served for half their expiry, and expires those past it. (Events every
//! destination has passed are the sweeper's.)

use std::collections::HashMap;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::config::RelayConfig;
use super::pool::RelayPool;
use crate::sql;

/// The janitor and what it needs.
pub(crate) struct Janitor {
    pub(crate) pool: RelayPool,
    pub(crate) config: RelayConfig,
}

/// The longest a relay runs before it expires destinations (see `Janitor::destinations`).
const EXPIRY_GRACE_MAX: Duration = Duration::from_secs(3600);

/// How often the janitor warns again of one destination that no relay serves.
const AGING_WARNING_EVERY: Duration = Duration::from_secs(3600);

impl Janitor {
    pub(crate) async fn run(self, stop: CancellationToken) {
        let config = &self.config;
        // A short expiry is checked more often than the janitor's interval.
        let interval = match config.destination_expiry {
            expiry if expiry.is_zero() => config.janitor_interval,
            expiry => config.janitor_interval.min(expiry / 4).max(Duration::from_millis(100)),
        };
        let mut warned: HashMap<String, Instant> = HashMap::new();
        let started = Instant::now();
        loop {
            if let Err(e) = self.destinations(&mut warned, started.elapsed()).await {
                tracing::warn!(error = %e, "janitor could not look at the destinations; trying again next interval");
            }
            let pass = async {
                let client = self.pool.client().await?;
                // (Events are the sweeper's.)
                let report = crate::admin::cleanup(
                    &*client,
                    None,
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
                _ = tokio::time::sleep(interval) => {}
            }
        }
    }

    /// Marks the destinations that connected relays serve, warns (at most hourly) of those no
    /// relay has served for half their expiry, and expires those past it. A relay with no
    /// expiry of its own (`destination_expiry` zero) only marks. A relay that has run for less
    /// than a destination's expiry (an hour at most) does not expire it: after an outage of every
    /// relay, the first one back leaves the others the time to come back too.
    async fn destinations(&self, warned: &mut HashMap<String, Instant>, running: Duration) -> crate::error::Result<()> {
        let mut client = self.pool.client().await?;
        let aging = sql::destinations_served(&*client).await?;
        if self.config.destination_expiry.is_zero() {
            return Ok(());
        }
        warned.retain(|name, _| aging.iter().any(|a| &a.name == name));
        for destination in aging {
            let (unserved, expiry) = (whole(destination.unserved), whole(destination.expiry));
            if destination.unserved < destination.expiry {
                if warned.get(&destination.name).is_none_or(|at| at.elapsed() >= AGING_WARNING_EVERY) {
                    tracing::warn!(
                        destination = %destination.name,
                        unserved = %humantime::format_duration(unserved),
                        expires_in = %humantime::format_duration(whole(destination.expiry - destination.unserved)),
                        "no relay has served this destination for half its expiry or more: once it expires, what \
                         waits for it goes to its dead letters (start a relay with its route, or drop it)"
                    );
                    warned.insert(destination.name, Instant::now());
                }
                continue;
            }
            if running < destination.expiry.min(EXPIRY_GRACE_MAX) {
                continue;
            }
            match sql::expire_destination(&mut client, &destination.name).await? {
                sql::Dropped::Done(buried) => tracing::warn!(
                    destination = %destination.name,
                    unserved = %humantime::format_duration(unserved),
                    expiry = %humantime::format_duration(expiry),
                    dead_lettered = buried,
                    "destination expired: no relay served it for its expiry; what waited for it is in its dead letters \
                     (`outbox-relay dead-letters retry` sends it again once a relay serves the destination)"
                ),
                sql::Dropped::Unknown | sql::Dropped::Served(_) => {}
            }
        }
        Ok(())
    }
}

/// `d` in whole seconds, as the logs show it.
fn whole(d: Duration) -> Duration {
    Duration::from_secs(d.as_secs())
}
