//! Draining to real destinations: an HTTP receiver that takes its time, NATS JetStream, and the
//! stdout sink's work aimed at `/dev/null`.

use std::io::Write;
use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use outbox_relay::sink::{HttpSink, NatsSink, SinkOptions};
use outbox_relay::{DeliveryError, Event, Handler, Slots};

use super::BoxError;

/// An HTTP receiver on 127.0.0.1 that answers every POST with 200 after `latency` (a webhook or
/// an ERP that takes its time); stops when dropped.
pub struct SlowReceiver {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl SlowReceiver {
    /// Starts the receiver on a free port.
    pub async fn start(latency: Duration) -> Result<SlowReceiver, BoxError> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let app = Router::new().route(
            "/hook",
            post(move || async move {
                tokio::time::sleep(latency).await;
                StatusCode::OK
            }),
        );
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(SlowReceiver { addr, task })
    }

    /// An HTTP sink POSTing to it, with the default timeout.
    pub fn sink(&self) -> Result<HttpSink, BoxError> {
        Ok(HttpSink::new(&format!("http://{}/hook", self.addr), outbox_relay::sink::DEFAULT_HTTP_TIMEOUT)?)
    }
}

impl Drop for SlowReceiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A NATS JetStream sink on a stream of its own (created, or purged when it exists), for a
/// drain measurement; `None` with the reason when no NATS server answers at `url`.
pub async fn nats_sink(url: &str, stream: &str) -> Result<Result<NatsSink, String>, BoxError> {
    let options = SinkOptions {
        subject_prefix: stream.to_lowercase(),
        create_stream: Some(stream.to_string()),
        ..SinkOptions::default()
    };
    match NatsSink::connect(url, &options).await {
        Ok(sink) => Ok(Ok(sink)),
        Err(e) if e.kind() == outbox_relay::ErrorKind::Connect => Ok(Err(e.to_string())),
        Err(e) => Err(e.into()),
    }
}

/// The stdout sink's work (each event serialized to a JSON line, a batch written and flushed
/// as one piece on the blocking pool, one slot per batch), aimed at `/dev/null`: what draining
/// to stdout costs the relay, without a terminal or a pipe in the way.
#[derive(Debug, Default, Clone, Copy)]
pub struct DevNullLines;

impl Handler for DevNullLines {
    async fn handle(&self, event: &Event) -> Result<(), DeliveryError> {
        self.handle_batch(std::slice::from_ref(event), &Slots::new(1)).await.pop().unwrap_or(Ok(()))
    }

    async fn handle_batch(&self, events: &[Event], slots: &Slots) -> Vec<Result<(), DeliveryError>> {
        let _slot = slots.take_for(events.len()).await;
        let mut lines = Vec::new();
        for event in events {
            if let Ok(line) = serde_json::to_vec(event) {
                lines.extend_from_slice(&line);
                lines.push(b'\n');
            }
        }
        let written = tokio::task::spawn_blocking(move || {
            let mut null = std::fs::OpenOptions::new().write(true).open("/dev/null")?;
            null.write_all(&lines).and_then(|()| null.flush())
        })
        .await;
        let result = match written {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(DeliveryError::transient(e)),
            Err(e) => Err(DeliveryError::transient(e)),
        };
        events.iter().map(|_| result.clone()).collect()
    }
}
