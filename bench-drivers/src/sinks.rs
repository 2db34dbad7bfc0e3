//! Draining to real destinations: NATS JetStream (and a plain JetStream publisher on the same
//! stream, the drain's reference), and the stdout sink's work aimed at `/dev/null` (HTTP
//! receivers are in `receivers`).

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use async_nats::HeaderMap;
use async_nats::jetstream::context::PublishError;
use async_nats::jetstream::publish::PublishAck;
use futures::StreamExt;
use pg_outbox_relay::sink::{NATS_ACKS_IN_FLIGHT, NatsSink};
use pg_outbox_relay::{DeliveryError, Event, Handler, Slots};

use super::BoxError;
use super::brokers::{TIMEOUT, event_json};

/// A NATS JetStream sink on a stream of its own (created when it does not exist), for a drain
/// measurement; `None` with the reason when no NATS server answers at `url`.
pub async fn nats_sink(url: &str, stream: &str) -> Result<Result<NatsSink, String>, BoxError> {
    match NatsSink::builder(url).subject_prefix(stream.to_lowercase()).create_stream(stream).connect().await {
        Ok(sink) => Ok(Ok(sink)),
        Err(e) if e.kind() == pg_outbox_relay::ErrorKind::Connect => Ok(Err(e.to_string())),
        Err(e) => Err(e.into()),
    }
}

/// The NATS drain's stream, its sink ([`nats_sink`]), and a plain JetStream publisher on the
/// same stream as the drain's reference. The stream is emptied before each drain or publisher
/// run ([`NatsBench::purge`]) and deleted at the end ([`NatsBench::remove`]).
pub struct NatsBench {
    /// The sink the drain delivers with.
    pub sink: NatsSink,
    jetstream: async_nats::jetstream::Context,
    stream: String,
}

impl NatsBench {
    /// Connects, making the stream; `Ok(Err(why))` when no NATS server answers at `url`.
    pub async fn connect(url: &str, stream: &str) -> Result<Result<NatsBench, String>, BoxError> {
        let sink = match nats_sink(url, stream).await? {
            Ok(sink) => sink,
            Err(why) => return Ok(Err(why)),
        };
        let client = async_nats::ConnectOptions::new().connection_timeout(TIMEOUT).connect(url).await?;
        // (as long as the NATS sink waits for one by default: 10 s; as many acknowledgements in
        // flight as the sink's)
        let jetstream = async_nats::jetstream::ContextBuilder::new()
            .timeout(TIMEOUT)
            .max_ack_inflight(NATS_ACKS_IN_FLIGHT)
            .build(client);
        Ok(Ok(NatsBench { sink, jetstream, stream: stream.to_owned() }))
    }

    /// Empties the stream.
    pub async fn purge(&self) -> Result<(), BoxError> {
        self.jetstream.get_stream(&self.stream).await?.purge().await?;
        Ok(())
    }

    /// Deletes the stream.
    pub async fn remove(self) -> Result<(), BoxError> {
        self.jetstream.delete_stream(&self.stream).await?;
        Ok(())
    }

    /// The rate of a plain JetStream publisher, in messages per second: no database, no relay,
    /// the broker and its client alone. It publishes `messages` to the subject the drain's
    /// events go to, the way the NATS sink publishes a batch: `window` publishes sent, then their
    /// acknowledgements awaited together, then the next window; each message as the sink makes
    /// it (the event's JSON, about the bench event's size; the headers `Nats-Msg-Id`, a new one
    /// each, `Outbox-Event-Id` and `Outbox-Topic`). What the NATS drain reaches of it is what the
    /// relay's claims and records leave of the broker's own pace.
    ///
    /// With `in_flight` above 1, the next window is sent while the acknowledgements of up to
    /// `in_flight - 1` windows before it are awaited (the oldest window's first): what a delivery
    /// that overlapped one batch's acknowledgements with the next batch's publishes could reach.
    /// A window is at most [`NATS_ACKS_IN_FLIGHT`] messages, as the sink's, and fewer windows are
    /// in flight where they would pass that many ([`windows_in_flight`]: the client makes a
    /// publish past it wait).
    pub async fn publisher_rate(&self, messages: usize, window: usize, in_flight: usize) -> Result<f64, BoxError> {
        // A new `Nats-Msg-Id` for every message of the process: none is taken for a duplicate.
        static SENT: AtomicU64 = AtomicU64::new(0);
        let in_flight = windows_in_flight(window, in_flight);
        let window = window.clamp(1, NATS_ACKS_IN_FLIGHT);
        let subject = format!("{}.bench.drain", self.stream.to_lowercase());
        let run = std::process::id();
        let started = Instant::now();
        let mut awaited = futures::stream::FuturesOrdered::new();
        let mut n = 0;
        while n < messages {
            let end = (n + window).min(messages);
            let mut acks = Vec::with_capacity(end - n);
            for id in n..end {
                let uuid = format!("{run:08x}-0000-4000-8000-{:012x}", SENT.fetch_add(1, Ordering::Relaxed));
                let payload = event_json(id, &uuid);
                let mut headers = HeaderMap::new();
                headers.insert("Nats-Msg-Id", uuid.as_str());
                headers.insert("Outbox-Event-Id", id.to_string().as_str());
                headers.insert("Outbox-Topic", "bench.drain");
                acks.push(self.jetstream.publish_with_headers(subject.clone(), headers, payload.into()).await?);
            }
            awaited.push_back(futures::future::join_all(acks.into_iter().map(std::future::IntoFuture::into_future)));
            while awaited.len() >= in_flight {
                acknowledged(awaited.next().await)?;
            }
            n = end;
        }
        while !awaited.is_empty() {
            acknowledged(awaited.next().await)?;
        }
        Ok(messages as f64 / started.elapsed().as_secs_f64())
    }
}

/// How many windows of `window` messages [`NatsBench::publisher_rate`] has in flight when asked
/// for `wanted`: no more than fit in the client's bound on acknowledgements awaited
/// ([`NATS_ACKS_IN_FLIGHT`]), and at least one.
pub fn windows_in_flight(window: usize, wanted: usize) -> usize {
    wanted.clamp(1, (NATS_ACKS_IN_FLIGHT / window.clamp(1, NATS_ACKS_IN_FLIGHT)).max(1))
}

/// Whether every acknowledgement of a window came (an error for the first that did not).
fn acknowledged(window: Option<Vec<Result<PublishAck, PublishError>>>) -> Result<(), BoxError> {
    for ack in window.unwrap_or_default() {
        ack?;
    }
    Ok(())
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
