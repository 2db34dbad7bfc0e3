//! The listener: one dedicated connection that LISTENs on the outbox channel and wakes workers,
//! or hands the events its notifications carry to the fast path (`fast.rs`), whose lock it
//! holds for its session while this relay owns the destination's fast path.
//!
//! It must keep reading even while every worker is busy: PostgreSQL queues notifications for a
//! listener that does not read, and when that queue fills, NOTIFY (and with it every business
//! transaction that inserts events) fails. So this task does nothing but read, queue and wake.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::Notify;
use tokio_postgres::AsyncMessage;
use tokio_util::sync::CancellationToken;

use super::backoff::retry_delay;
use super::fast::{FastPath, OWNERSHIP_RETRY};
use super::metrics::RelayMetrics;
use super::row::RelayRow;
use super::signed::NotificationKey;
use super::timer::Timer;
use crate::connect::{DatabaseUrl, connect_error};
use crate::error::{Error, ErrorKind, Result};
use crate::sql;

/// The start of the listener's `application_name` (the relay's id follows), so operators can
/// tell it apart in `pg_stat_activity` and `status` counts the relays by it.
pub(crate) const LISTENER_APPLICATION_NAME: &str = "outbox-relay listener";

/// How often the listener checks that its connection still answers.
const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(10);
/// How long an answer to the check may take before the connection counts as stalled.
const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(5);

/// The least time the server lets the listener's session stay quiet before it ends it (while it
/// may take the fast path: the lease, at least this).
const QUIET_MIN: Duration = Duration::from_secs(1);

/// First wait before reconnecting; it doubles up to `reconnect_max`.
const RECONNECT_BASE: Duration = Duration::from_millis(50);

/// The listener and what it needs.
pub(crate) struct Listener {
    pub(crate) url: DatabaseUrl,
    /// Its `application_name`: [`LISTENER_APPLICATION_NAME`] and the relay's id.
    pub(crate) application_name: String,
    pub(crate) reconnect_max: Duration,
    /// Woken on every notification, and after every (re)connect for a catch-up claim.
    pub(crate) work: Arc<Notify>,
    pub(crate) metrics: Arc<RelayMetrics>,
    /// Woken by the notification a pause or resume sends, so that it applies at once.
    pub(crate) pauses_changed: Arc<Notify>,
    /// Told when parked events may be due (a dead letter retried, a reconnect).
    pub(crate) timer: Arc<Timer>,
    /// Told the listener's backend pid while it listens (the waiting mark carries it).
    pub(crate) row: Arc<RelayRow>,
    /// The destination's lock number: the listener's connection marks it served.
    pub(crate) lock_id: i32,
    /// Given the events notifications carry, while this relay owns the fast path (taken when it
    /// is enabled: `RelayConfig::fast_path`).
    pub(crate) fast: Arc<FastPath>,
    /// The relay's lease: a session of the listener that sends no statement for this long is
    /// ended by the server, and the fast path's lock with it (a frozen owner's, as its claims).
    pub(crate) lease: Duration,
    /// Whether it was logged that the fast path cannot be taken (it is said once).
    pub(crate) told_no_fast: std::sync::atomic::AtomicBool,
}

impl Listener {
    /// Listens until `stop`, reconnecting with capped backoff.
    pub(crate) async fn run(self, stop: CancellationToken) {
        let mut failures: u32 = 0;
        let mut connected_before = false;
        loop {
            match self.listen(&mut connected_before, &mut failures, &stop).await {
                Ok(()) => return, // stopped
                Err(e) => {
                    // (Also when it was lost before the end of `listen`, which says so too.)
                    self.row.listener_gone();
                    self.metrics.set_listening(false);
                    self.fast.listener_lost("the listener lost its connection");
                    failures += 1;
                    let wait = retry_delay(failures, RECONNECT_BASE, self.reconnect_max, 0.5, rand::random());
                    tracing::warn!(error = %e, retry_in = ?wait, "relay listener lost its connection; reconnecting");
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(wait) => {}
                    }
                }
            }
        }
    }

    /// Connects, listens, wakes the workers for a catch-up claim, then forwards notifications
    /// until the connection fails (an error) or the relay stops (`Ok`). The failure counter is
    /// reset only by a connection that got as far as LISTEN.
    async fn listen(&self, connected_before: &mut bool, failures: &mut u32, stop: &CancellationToken) -> Result<()> {
        let mut config = self.url.config().clone();
        config.application_name(&self.application_name);
        let (client, mut connection) = config.connect(self.url.tls()).await.map_err(|e| connect_error(&config, e))?;
        let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
        let forwarder = async {
            while let Some(message) = messages.next().await {
                match message {
                    Ok(AsyncMessage::Notification(n)) if n.payload() == sql::PAUSES_CHANGED => {
                        self.fast.pauses_changed();
                        self.pauses_changed.notify_one();
                    }
                    Ok(AsyncMessage::Notification(n)) if n.payload() == sql::PARKED_DUE => {
                        tracing::trace!("notified: parked events are due");
                        self.fast.parked_elsewhere();
                        self.timer.parked_may_be_due();
                        self.work.notify_one();
                    }
                    Ok(AsyncMessage::Notification(n)) => {
                        tracing::trace!("notified: events were committed");
                        self.metrics.woken();
                        // The fast path delivers them (and claims after), or a claim does.
                        let carried = self.fast.heard(n.payload());
                        if !carried {
                            self.work.notify_one();
                        }
                    }
                    Ok(_) => {} // notices
                    Err(e) => return Error::database("listening for notifications", e),
                }
            }
            Error::new(ErrorKind::Database, "the listener connection was closed by the server")
        };
        tokio::pin!(forwarder);

        // The connection only makes progress while `forwarder` is polled: run statements beside it.
        let pid = while_reading(&mut forwarder, sql::listen(&client, self.lock_id)).await??;
        self.row.listener_changed(pid).await;
        self.metrics.set_listening(true);
        if *connected_before {
            self.metrics.reconnected();
            tracing::info!("relay listener reconnected; catching up on what was committed meanwhile");
        }
        *connected_before = true;
        *failures = 0;
        // The fast path only on a session the server ends once it goes quiet for the lease (at
        // least a second, so that a busy machine's late heartbeat does not end a live one's).
        let quiet_for = self.lease.max(QUIET_MIN);
        let fast = self.fast.enabled()
            && self.bounded_quiet(while_reading(&mut forwarder, sql::end_session_when_idle(&client, quiet_for)).await?);
        let mut owner = fast && while_reading(&mut forwarder, self.own(&client, pid)).await??;
        // Anything committed while we were not listening sent its notification to nobody.
        self.timer.parked_may_be_due();
        self.work.notify_one();

        // A link that stalls without closing (a hung pooler or proxy that still acknowledges TCP)
        // is invisible to keepalives: a periodic round trip with a deadline finds it. With the
        // fast path, a statement at least every quarter lease keeps the session from being ended
        // as idle; a listener that does not own it tries to take it at each beat (it is free when
        // its owner died, or froze for the lease).
        let heartbeat = async {
            let beat = if fast { (quiet_for / 4).min(HEARTBEAT_INTERVAL) } else { HEARTBEAT_INTERVAL };
            loop {
                tokio::time::sleep(if fast && !owner { beat.min(OWNERSHIP_RETRY) } else { beat }).await;
                let checked = async {
                    if fast && !owner {
                        owner = self.own(&client, pid).await?;
                    } else {
                        sql::ping(&client, "checking the listener connection").await?;
                    }
                    Ok::<(), Error>(())
                };
                match tokio::time::timeout(HEARTBEAT_TIMEOUT, checked).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => return e,
                    Err(_) => {
                        return Error::new(
                            ErrorKind::Connect,
                            format!("the listener connection did not answer within {HEARTBEAT_TIMEOUT:?}"),
                        );
                    }
                }
            }
        };
        let result = tokio::select! {
            lost = &mut forwarder => Err(lost),
            stalled = heartbeat => Err(stalled),
            _ = stop.cancelled() => Ok(()),
        };
        if result.is_ok() {
            let unserved = tokio::time::timeout(HEARTBEAT_TIMEOUT, async {
                while_reading(&mut forwarder, sql::unserve(&client, self.lock_id)).await?
            });
            if let Ok(Err(e)) = unserved.await {
                tracing::debug!(error = %e, "the listener could not give up its served mark; it goes with its connection");
            }
        }
        self.row.listener_gone();
        self.fast.listener_lost("the listener stopped");
        self.metrics.set_listening(false);
        result
    }

    /// Whether this connection may take the fast path, given whether the server was told to end
    /// its session once it goes quiet (`sql::end_session_when_idle`): it was, on PostgreSQL 14 or
    /// later. Says why not.
    fn bounded_quiet(&self, bounded: Result<bool>) -> bool {
        match bounded {
            Ok(true) => true,
            Ok(false) => {
                self.fast_off("the server is older than PostgreSQL 14, which can end a frozen relay's idle session (idle_session_timeout), and with it its hold on the fast path");
                false
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not bound the listener's idle time; this connection does not take the fast path");
                false
            }
        }
    }

    /// Says (once) why this relay does not take the fast path.
    fn fast_off(&self, why: &str) {
        if !self.told_no_fast.swap(true, std::sync::atomic::Ordering::Relaxed) {
            tracing::warn!("the fast path is off: {why}; this relay claims new events before it delivers them");
        }
    }

    /// Takes the destination's fast path for this connection if the notifications' signing key
    /// can be read and the path is free; returns whether it did.
    async fn own(&self, client: &tokio_postgres::Client, pid: i32) -> Result<bool> {
        if !self.fast.has_key() {
            match sql::notification_key(client).await? {
                Ok(key) => self.fast.set_key(NotificationKey::new(key)),
                Err(why) => {
                    self.fast_off(why);
                    return Ok(false);
                }
            }
        }
        let owner = sql::take_fast_path(client, self.lock_id).await?;
        if owner {
            self.fast.owned(pid);
        }
        Ok(owner)
    }
}

/// Runs `work` on the listener's connection while the connection makes progress: `forwarder`,
/// which reads its messages and ends only when the connection is lost, is polled beside it.
async fn while_reading<F, T>(
    forwarder: &mut std::pin::Pin<&mut F>,
    work: impl std::future::Future<Output = T>,
) -> Result<T>
where
    F: std::future::Future<Output = Error>,
{
    tokio::select! {
        lost = forwarder.as_mut() => Err(lost),
        done = work => Ok(done),
    }
}
