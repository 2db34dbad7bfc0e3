//! Events per second a relay drains from a pre-filled outbox.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use outbox_relay::{Completion, Event, Outbox, Relay, RelayConfig, handler_fn};
use tokio::sync::{Notify, oneshot};

use super::latency::stop_relay;
use super::{BoxError, db};

/// A drain may take this long, plus [`DRAIN_TIMEOUT_PER_EVENT`] per event.
const DRAIN_TIMEOUT_BASE: Duration = Duration::from_secs(60);
/// See [`DRAIN_TIMEOUT_BASE`].
const DRAIN_TIMEOUT_PER_EVENT: Duration = Duration::from_millis(5);
const PREFILL_SQL: &str = "\
insert into outbox_relay.outbox (topic, payload)
select 'bench.drain', jsonb_build_object('n', g) from generate_series(1, $1::int8) as g";

/// How the relay is set up for a drain measurement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrainSetup {
    /// Events pre-filled and drained.
    pub events: usize,
    /// Relay workers.
    pub workers: usize,
    /// Events per claim.
    pub batch_size: usize,
    /// Mark delivered events processed, or delete them.
    pub completion: Completion,
}

/// Events per second a relay drains from a pre-filled outbox; see the
/// [module documentation](super).
pub async fn drain_throughput(
    outbox: &Outbox,
    events: usize,
    workers: usize,
    batch_size: usize,
    completion: Completion,
) -> Result<f64, BoxError> {
    let elapsed = drain_time(outbox, DrainSetup { events, workers, batch_size, completion }).await?;
    Ok(events as f64 / elapsed.as_secs_f64())
}

/// Truncates and pre-fills the outbox, then returns how long a relay took to deliver and record
/// every event (only the drain is timed); see the [module documentation](super).
pub async fn drain_time(outbox: &Outbox, setup: DrainSetup) -> Result<Duration, BoxError> {
    if setup.events == 0 {
        return Err("a drain needs at least one event".into());
    }
    let config = RelayConfig {
        workers: setup.workers,
        batch_size: setup.batch_size,
        completion: setup.completion,
        janitor_interval: Duration::ZERO,
        ..RelayConfig::default()
    };
    config.validate()?;
    prefill(outbox, setup.events).await?;

    let handled = Arc::new(AtomicUsize::new(0));
    let all_handled = Arc::new(Notify::new());
    let handler = {
        let (handled, all_handled, events) = (handled.clone(), all_handled.clone(), setup.events);
        handler_fn(move |_event: Event| {
            if handled.fetch_add(1, Ordering::Relaxed) + 1 == events {
                all_handled.notify_one();
            }
            std::future::ready(Ok(()))
        })
    };
    let relay = Relay::new(outbox, config, handler)?;
    let metrics = relay.metrics();
    let (shutdown, stop) = oneshot::channel::<()>();
    let events = setup.events as u64;

    let started = Instant::now();
    let task = tokio::spawn(relay.run(async move {
        stop.await.ok();
    }));
    let limit = DRAIN_TIMEOUT_BASE + DRAIN_TIMEOUT_PER_EVENT * u32::try_from(setup.events).unwrap_or(u32::MAX);
    let drained = tokio::time::timeout(limit, async {
        // Wait cheaply for the handler, then briefly for the last batch's outcome to be written.
        all_handled.notified().await;
        while metrics.snapshot().delivered < events {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
    let elapsed = started.elapsed();

    stop_relay(Some(shutdown), Some(task)).await?;
    if drained.is_err() {
        let snapshot = metrics.snapshot();
        return Err(format!(
            "the relay delivered {} of {events} events within {} ({} retried, {} dead-lettered)",
            snapshot.delivered,
            humantime::format_duration(limit),
            snapshot.retried,
            snapshot.dead_lettered
        )
        .into());
    }
    Ok(elapsed)
}

/// Empties the outbox and fills it with `events` deliverable events, then vacuums and analyzes it.
async fn prefill(outbox: &Outbox, events: usize) -> Result<(), BoxError> {
    let client = outbox.connection().await?;
    client.batch_execute("truncate outbox_relay.outbox").await.map_err(db("truncating the outbox"))?;
    client.execute(PREFILL_SQL, &[&i64::try_from(events)?]).await.map_err(db("pre-filling the outbox"))?;
    client.batch_execute("vacuum analyze outbox_relay.outbox").await.map_err(db("vacuuming the outbox"))?;
    Ok(())
}
