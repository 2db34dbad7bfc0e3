//! Commit-to-handler latency, one event at a time, on the NOTIFY, in-process and poll paths, and
//! the floor: a client that LISTENs and gets the same commit's notification.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use pg_outbox_relay::{Event, NewEvent, Outbox, Relay, RelayConfig, RelayMetrics, handler_fn};
use serde_json::json;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_postgres::Statement;

use super::notify::{reset_notify, set_notify_trigger};
use super::{BoxError, db};

/// Poll interval of the relay when only a wake-up may find an event.
const NO_POLL: Duration = Duration::from_secs(3600);
/// How long one latency sample may take beyond its poll interval.
const SAMPLE_TIMEOUT: Duration = Duration::from_secs(10);
/// Samples taken and discarded when a probe starts.
const WARMUP_SAMPLES: usize = 5;
/// Largest random pause between two latency samples on the wake-up paths.
const MAX_PAUSE: Duration = Duration::from_millis(2);
/// How long a stopping relay may take to return.
const RELAY_STOP_TIMEOUT: Duration = Duration::from_secs(30);
/// Statement timeout of the benchmark's own connections, so a stuck lock cannot hang a run.
pub(super) const STATEMENT_TIMEOUT: &str = "30s";
const TOPIC: &str = "bench.event";
const PUBLISH_SQL: &str = "select outbox_relay.publish($1::text, $2::jsonb)";
const RELAY_WAITING: &str = "select exists (select 1 from outbox_relay.relays where waiting)";
/// How long a latency sample waits for the relay to be idle before it goes ahead anyway.
const IDLE_TIMEOUT: Duration = Duration::from_secs(2);
/// A relay that made no claim for this long (and is marked waiting) counts as idle.
const IDLE_QUIET: Duration = Duration::from_millis(5);

/// How the relay learns of a new event in a latency measurement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WakePath {
    /// No relay: a client that LISTENs on the outbox channel gets the same commit's
    /// notification (a placeholder relay row marked waiting makes the trigger send it). No relay
    /// woken by NOTIFY can beat it.
    Floor,
    /// The outbox trigger's `NOTIFY`, from a writer on another connection; the relay delivers
    /// from the notification (its fast path).
    Notify,
    /// The same with the relay's fast path off: it claims before it delivers.
    NotifyClaimFirst,
    /// An [`Outbox`] shared with the relay writes (the trigger in place, as in production: its
    /// notification brings the event to the fast path; the in-process wake-up is the fallback).
    InProcess,
    /// Only the relay's fallback poll, at this interval (trigger dropped).
    Poll(Duration),
}

impl WakePath {
    fn poll_interval(self) -> Duration {
        match self {
            WakePath::Poll(interval) => interval,
            _ => NO_POLL,
        }
    }

    fn uses_trigger(self) -> bool {
        !matches!(self, WakePath::Poll(_))
    }
}

impl fmt::Display for WakePath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WakePath::Floor => f.write_str("floor (a LISTEN client)"),
            WakePath::Notify => f.write_str("NOTIFY"),
            WakePath::NotifyClaimFirst => f.write_str("NOTIFY, claim first"),
            WakePath::InProcess => f.write_str("in-process"),
            WakePath::Poll(interval) => write!(f, "poll {}", humantime::format_duration(*interval)),
        }
    }
}

/// Takes `samples` latency samples on `path` (after a few discarded warm-up samples), one at a
/// time; see the [module documentation](super) for what one covers. The trigger is back in place
/// afterwards, also after an error.
pub async fn latency(outbox: &Outbox, path: WakePath, samples: usize) -> Result<Vec<Duration>, BoxError> {
    let mut probe = LatencyProbe::start(outbox, path).await?;
    let mut taken = Vec::with_capacity(samples);
    let mut result = Ok(());
    for _ in 0..samples {
        match probe.sample().await {
            Ok(sample) => taken.push(sample),
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    let stopped = probe.stop().await;
    result?;
    stopped?;
    Ok(taken)
}

/// A running latency measurement: a relay with a recording handler, and a writer. Take samples
/// with [`sample`](Self::sample), then [`stop`](Self::stop) it, which stops the relay and puts
/// the trigger back. Dropping it without `stop` stops the relay but leaves the trigger as the
/// path needed it.
pub struct LatencyProbe {
    path: WakePath,
    outbox: Outbox,
    /// The separate connection of the `Notify` and `Poll` paths, with its prepared publish.
    writer: Option<(tokio_postgres::Client, Statement)>,
    deliveries: mpsc::UnboundedReceiver<(i64, Instant)>,
    shutdown: Option<oneshot::Sender<()>>,
    relay: Option<JoinHandle<pg_outbox_relay::Result<()>>>,
    metrics: Arc<RelayMetrics>,
    /// The floor's listening connection (no relay then).
    floor: Option<tokio_postgres::Client>,
    sequence: u64,
}

impl fmt::Debug for LatencyProbe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LatencyProbe")
            .field("path", &self.path)
            .field("samples", &self.sequence)
            .finish_non_exhaustive()
    }
}

impl LatencyProbe {
    /// Sets the trigger as `path` needs it, starts the relay and the writer, and takes a few
    /// warm-up samples.
    pub async fn start(outbox: &Outbox, path: WakePath) -> Result<LatencyProbe, BoxError> {
        reset_notify(outbox).await?;
        set_notify_trigger(outbox, path.uses_trigger()).await?;
        match LatencyProbe::start_relay(outbox, path).await {
            Ok(probe) => Ok(probe),
            Err(e) => {
                // Best effort: the error that stopped us is the one to report.
                reset_notify(outbox).await.ok();
                Err(e)
            }
        }
    }

    async fn start_relay(outbox: &Outbox, path: WakePath) -> Result<LatencyProbe, BoxError> {
        let writer = match path {
            WakePath::InProcess => None,
            _ => {
                let client = outbox.url().connect().await?;
                client
                    .batch_execute(&format!("set statement_timeout = '{STATEMENT_TIMEOUT}'"))
                    .await
                    .map_err(db("configuring the writer connection"))?;
                let publish = client.prepare(PUBLISH_SQL).await.map_err(db("preparing the publish statement"))?;
                Some((client, publish))
            }
        };
        let (sender, deliveries) = mpsc::unbounded_channel();
        if path == WakePath::Floor {
            return LatencyProbe::start_floor(outbox, writer, sender, deliveries).await;
        }
        let handler = handler_fn(move |event: Event| {
            let seen = Instant::now();
            // The receiver is gone only when the probe is; nothing to report to then.
            sender.send((event.id, seen)).ok();
            std::future::ready(Ok(()))
        });
        let config = RelayConfig {
            workers: 1,
            poll_interval: path.poll_interval(),
            janitor_interval: Duration::ZERO,
            fast_path: path != WakePath::NotifyClaimFirst,
            ..RelayConfig::default()
        };
        let relay = Relay::new(outbox, config, handler)?;
        let metrics = relay.metrics();
        let (shutdown, stop) = oneshot::channel::<()>();
        let task = tokio::spawn(relay.run(async move {
            // A dropped sender stops the relay too.
            stop.await.ok();
        }));
        let mut probe = LatencyProbe {
            path,
            outbox: outbox.clone(),
            writer,
            deliveries,
            shutdown: Some(shutdown),
            relay: Some(task),
            metrics: metrics.clone(),
            floor: None,
            sequence: 0,
        };
        // Let the relay come up (its first claim ran, its listener and in-process bridge are
        // subscribed) before the first write, so no sample waits for a poll that never comes.
        let ready = Instant::now();
        while metrics.snapshot().claims == 0 {
            if ready.elapsed() > SAMPLE_TIMEOUT {
                return Err("the relay made no claim within 10 s of starting".into());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        for _ in 0..WARMUP_SAMPLES {
            probe.sample().await?;
        }
        Ok(probe)
    }

    /// The floor: a connection that LISTENs and notes when each event's notification arrives;
    /// a placeholder relay row marked waiting (removed with the connection) makes writers notify.
    async fn start_floor(
        outbox: &Outbox,
        writer: Option<(tokio_postgres::Client, Statement)>,
        sender: mpsc::UnboundedSender<(i64, Instant)>,
        deliveries: mpsc::UnboundedReceiver<(i64, Instant)>,
    ) -> Result<LatencyProbe, BoxError> {
        use futures::StreamExt;
        use tokio_postgres::AsyncMessage;

        let config = outbox.url().config().clone();
        if config.get_ssl_mode() == tokio_postgres::config::SslMode::Require {
            return Err("the floor's LISTEN client connects without TLS: measure on a server that allows it".into());
        }
        let (client, mut connection) =
            config.connect(tokio_postgres::NoTls).await.map_err(db("connecting the LISTEN client"))?;
        tokio::spawn(async move {
            let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
            while let Some(Ok(message)) = messages.next().await {
                if let AsyncMessage::Notification(n) = message {
                    let at = Instant::now();
                    // The JSON after the notification's signature (64 hex digits: migration 0018).
                    let json = n.payload().get(64..).unwrap_or_default();
                    let value: serde_json::Value = serde_json::from_str(json).unwrap_or_default();
                    if let Some(id) = value["e"][0][0].as_i64() {
                        sender.send((id, at)).ok();
                    }
                }
            }
        });
        client
            .batch_execute(
                "listen outbox_relay;
                 insert into outbox_relay.relays (id, listener_pid, waiting, destination)
                 values (-1, pg_backend_pid(), true, 'bench floor')",
            )
            .await
            .map_err(db("listening"))?;
        let mut probe = LatencyProbe {
            path: WakePath::Floor,
            outbox: outbox.clone(),
            writer,
            deliveries,
            shutdown: None,
            relay: None,
            metrics: Arc::default(),
            floor: Some(client),
            sequence: 0,
        };
        for _ in 0..WARMUP_SAMPLES {
            probe.sample().await?;
        }
        Ok(probe)
    }

    /// Waits until the relay is idle, pauses for a random time (see the
    /// [module documentation](super)), writes one event and returns the time from just before its
    /// commit to the start of its delivery.
    pub async fn sample(&mut self) -> Result<Duration, BoxError> {
        self.wait_until_idle().await?;
        tokio::time::sleep(pause_before_sample(self.path)).await;
        self.sequence += 1;
        let payload = json!({"sample": self.sequence});
        let (id, committing) = match &mut self.writer {
            None => {
                // A transaction on the relay's own Outbox, timed from just before COMMIT as the
                // other paths are (`Outbox::publish` would add its insert's round trip).
                let mut connection = self.outbox.connection().await?;
                let tx = connection.transaction().await.map_err(db("starting a transaction"))?;
                let id = pg_outbox_relay::publish(&tx, &NewEvent::new(TOPIC, payload)).await?;
                let committing = Instant::now();
                tx.commit().await.map_err(db("committing"))?;
                (id, committing)
            }
            Some((client, publish)) => {
                let tx = client.transaction().await.map_err(db("starting a transaction"))?;
                let row = tx.query_one(&*publish, &[&TOPIC, &payload]).await.map_err(db("publishing an event"))?;
                let committing = Instant::now();
                tx.commit().await.map_err(db("committing"))?;
                (row.get::<_, i64>(0), committing)
            }
        };
        let timeout = SAMPLE_TIMEOUT + self.path.poll_interval().min(SAMPLE_TIMEOUT);
        let deadline = committing + timeout;
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(remaining, self.deliveries.recv()).await {
                Ok(Some((delivered, at))) if delivered == id => return Ok(at.saturating_duration_since(committing)),
                Ok(Some(_)) => continue, // an event of an earlier, timed-out sample
                Ok(None) => return Err("the relay stopped during a latency sample".into()),
                Err(_) => {
                    return Err(format!(
                        "event {id} was not delivered within {} on the {} path",
                        humantime::format_duration(timeout),
                        self.path
                    )
                    .into());
                }
            }
        }
    }

    /// Waits (at most [`IDLE_TIMEOUT`], then goes ahead) until the relay is idle: it has made no
    /// claim for [`IDLE_QUIET`] and, where relays mark themselves waiting (migration 0002), has
    /// marked itself. A relay that was just busy first keeps claiming every millisecond for a
    /// while and then closes the race of its mark with one more claim; a sample taken meanwhile
    /// would measure that, not the path.
    async fn wait_until_idle(&self) -> Result<(), BoxError> {
        if self.path == WakePath::Floor {
            return Ok(());
        }
        let client = self.outbox.connection().await?;
        let statement = client.prepare(RELAY_WAITING).await.map_err(db("preparing"))?;
        let since = Instant::now();
        while since.elapsed() < IDLE_TIMEOUT {
            let marked: bool =
                client.query_one(&statement, &[]).await.map_err(db("reading the relay's waiting mark"))?.get(0);
            if marked {
                let claims = self.metrics.snapshot().claims;
                tokio::time::sleep(IDLE_QUIET).await;
                if self.metrics.snapshot().claims == claims {
                    return Ok(());
                }
            } else {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        Ok(())
    }

    /// Stops the relay and puts the trigger back.
    pub async fn stop(mut self) -> Result<(), BoxError> {
        let stopped = stop_relay(self.shutdown.take(), self.relay.take()).await;
        if let Some(floor) = self.floor.take() {
            // The floor's events were never delivered: no relay after it should find them.
            floor
                .batch_execute(&format!(
                    "delete from outbox_relay.relays where id = -1; delete from outbox_relay.outbox where topic = '{TOPIC}'"
                ))
                .await
                .map_err(db("removing the floor's placeholder relay and events"))?;
        }
        reset_notify(&self.outbox).await?;
        stopped
    }
}

/// A random pause before a latency sample: up to [`MAX_PAUSE`] on the wake-up paths, up to one
/// poll interval on the poll path (see the [module documentation](super)).
fn pause_before_sample(path: WakePath) -> Duration {
    let max = match path {
        WakePath::Poll(interval) => interval,
        _ => MAX_PAUSE,
    };
    let max_us = u64::try_from(max.as_micros()).unwrap_or(u64::MAX);
    if max_us == 0 { Duration::ZERO } else { Duration::from_micros(rand::random_range(0..max_us)) }
}

/// Signals a relay to stop and waits (bounded) for it to return.
pub(super) async fn stop_relay(
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<pg_outbox_relay::Result<()>>>,
) -> Result<(), BoxError> {
    if let Some(shutdown) = shutdown {
        shutdown.send(()).ok();
    }
    let Some(task) = task else { return Ok(()) };
    match tokio::time::timeout(RELAY_STOP_TIMEOUT, task).await {
        Ok(Ok(result)) => Ok(result?),
        Ok(Err(e)) => Err(format!("the relay task failed: {e}").into()),
        Err(_) => Err("the relay did not stop within 30 s".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn wake_paths_print_readably() {
        assert_eq!(WakePath::Notify.to_string(), "NOTIFY");
        assert_eq!(WakePath::InProcess.to_string(), "in-process");
        assert_eq!(WakePath::Poll(ms(100)).to_string(), "poll 100ms");
    }

    #[test]
    fn poll_pauses_spread_over_the_interval() {
        let poll = WakePath::Poll(ms(100));
        let pauses: Vec<Duration> = (0..200).map(|_| pause_before_sample(poll)).collect();
        assert!(pauses.iter().all(|p| *p < ms(100)));
        assert!(pauses.iter().any(|p| *p > ms(10)), "pauses should spread over the whole interval");
        assert!((0..100).all(|_| pause_before_sample(WakePath::Notify) < MAX_PAUSE));
        assert_eq!(pause_before_sample(WakePath::Poll(Duration::ZERO)), Duration::ZERO);
    }
}
