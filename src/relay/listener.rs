//! The listener: one dedicated connection that LISTENs on the outbox channel and wakes workers.
//!
//! It must keep reading even while every worker is busy: PostgreSQL queues notifications for a
//! listener that does not read, and when that queue fills, NOTIFY (and with it every business
//! transaction that inserts events) fails. So this task does nothing but read and wake.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::StreamExt;
use tokio_postgres::AsyncMessage;

use super::backoff::retry_delay;
use super::{CHANNEL, Handler, Shared};
use crate::connect::connect_error;
use crate::error::{Error, Result};

/// The listener's `application_name`, so operators can tell it apart in `pg_stat_activity`.
pub(crate) const LISTENER_APPLICATION_NAME: &str = "outbox-relay listener";

/// How often the listener checks that its connection still answers.
const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(10);
/// How long an answer to the check may take before the connection counts as stalled.
const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(5);

/// First wait before reconnecting; it doubles up to `reconnect_max`.
const RECONNECT_BASE: Duration = Duration::from_millis(50);

pub(crate) async fn run<H: Handler>(shared: Arc<Shared<H>>) {
    let mut failures: u32 = 0;
    let mut connected_before = false;
    loop {
        match listen(&shared, &mut connected_before, &mut failures).await {
            Ok(()) => return, // stopped
            Err(e) => {
                failures += 1;
                let wait = retry_delay(failures, RECONNECT_BASE, shared.config.reconnect_max, 0.5, rand::random());
                tracing::warn!(error = %e, retry_in = ?wait, "relay listener lost its connection; reconnecting");
                tokio::select! {
                    _ = shared.stop.cancelled() => return,
                    _ = tokio::time::sleep(wait) => {}
                }
            }
        }
    }
}

/// Connects, listens, wakes the workers for a catch-up claim, then forwards notifications until
/// the connection fails (an error) or the relay stops (`Ok`). The failure counter is reset only by
/// a connection that got as far as LISTEN.
async fn listen<H: Handler>(shared: &Arc<Shared<H>>, connected_before: &mut bool, failures: &mut u32) -> Result<()> {
    let mut config = shared.outbox.url().config().clone();
    config.application_name(LISTENER_APPLICATION_NAME);
    let (client, mut connection) =
        config.connect(shared.outbox.url().tls()).await.map_err(|e| connect_error(&config, e))?;
    let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
    let forwarder = {
        let shared = shared.clone();
        async move {
            while let Some(message) = messages.next().await {
                match message {
                    Ok(AsyncMessage::Notification(_)) => {
                        shared.metrics.woken();
                        shared.work.notify_one();
                    }
                    Ok(_) => {} // notices
                    Err(e) => return Error::database("listening for notifications", e),
                }
            }
            Error::new(crate::error::ErrorKind::Database, "the listener connection was closed by the server")
        }
    };
    tokio::pin!(forwarder);

    // The connection only makes progress while `forwarder` is polled: run statements beside it.
    let listen_statement = format!("listen {CHANNEL}");
    let setup = async {
        client.batch_execute(&listen_statement).await.map_err(|e| Error::database("starting to listen", e))?;
        let row = client
            .query_one("select pg_backend_pid()", &[])
            .await
            .map_err(|e| Error::database("reading the listener's backend pid", e))?;
        Ok::<i32, Error>(row.get(0))
    };
    let pid = tokio::select! {
        lost = &mut forwarder => return Err(lost),
        pid = setup => pid?,
    };
    // The waiting mark may be gone with a restarted server (its table is unlogged): write it anew.
    shared.idle.forget().await;
    shared.listener_pid.store(pid, Ordering::Release);
    if *connected_before {
        shared.metrics.reconnected();
        tracing::info!("relay listener reconnected; catching up on what was committed meanwhile");
    }
    *connected_before = true;
    *failures = 0;
    // Anything committed while we were not listening sent its notification to nobody.
    shared.work.notify_one();

    // A link that stalls without closing (a hung pooler or proxy that still acknowledges TCP)
    // is invisible to keepalives: a periodic round trip with a deadline finds it.
    let heartbeat = async {
        loop {
            tokio::time::sleep(HEARTBEAT_INTERVAL).await;
            match tokio::time::timeout(HEARTBEAT_TIMEOUT, client.simple_query("")).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Error::database("checking the listener connection", e),
                Err(_) => {
                    return Error::new(
                        crate::error::ErrorKind::Connect,
                        format!("the listener connection did not answer within {HEARTBEAT_TIMEOUT:?}"),
                    );
                }
            }
        }
    };
    let result = tokio::select! {
        lost = &mut forwarder => Err(lost),
        stalled = heartbeat => Err(stalled),
        _ = shared.stop.cancelled() => Ok(()),
    };
    shared.listener_pid.store(0, Ordering::Release);
    result
}
