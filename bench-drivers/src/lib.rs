//! Measurements of the outbox and its relay against a real PostgreSQL, shared by the criterion
//! benchmarks (`benches/relay.rs`, run by `cargo bench`) and the `outbox-relay bench` command.
//!
//! It is a crate of its own, not part of the library: both front ends measure exactly the same
//! thing, and a service using the library compiles none of it.
//!
//! # The server
//!
//! [`BenchDb`] is the server to measure on: the one `DATABASE_URL` names, or else a private
//! embedded cluster ([`pg_outbox_relay_cluster`]) started with [`EmbeddedOptions::durable`], so `fsync`
//! and `synchronous_commit` are on and every business commit waits for its WAL flush, as it does
//! for users. (The relay's own bookkeeping runs with `synchronous_commit = off`, as always.)
//! [`BenchDb::fresh_database`] creates (after dropping any leftover) a database
//! `outbox_bench_<hint>`, applies the migrations and returns an [`Outbox`] on it.
//!
//! Everything runs on one machine: the server, the writers and the relay share its cores, so the
//! figures are a lower bound for a setup with the database on its own host.
//!
//! # Delivery latency: [`latency`], [`LatencyProbe`]
//!
//! A relay (1 worker, janitor off) runs with a handler that notes `Instant::now()` and the event
//! id. Each sample writes **one** event and waits until the handler has seen it, one sample at a
//! time. A sample is the interval from the instant **just before the commit is sent** to the
//! instant **the handler starts** for that event. It therefore includes the commit itself (with
//! its WAL flush), the wake-up, the relay's claim statement and the hand-over to the handler; it
//! does not include recording the delivery afterwards. The paths ([`WakePath`]):
//!
//! - [`WakePath::Notify`]: the writer is a separate plain connection, not the [`Outbox`], that
//!   runs `begin; select outbox_relay.publish(..); commit`; the relay's fallback poll is 1 hour,
//!   so only the trigger's `NOTIFY` can wake it. The interval starts just before `COMMIT`.
//! - [`WakePath::Floor`]: no relay; a second connection LISTENs on the outbox channel (a
//!   placeholder relay row marked waiting makes the trigger notify) and the sample ends when it
//!   has the commit's notification. No relay woken by NOTIFY can beat it.
//! - [`WakePath::NotifyClaimFirst`]: as `Notify`, the relay's fast path off (it claims first).
//! - [`WakePath::InProcess`]: the event is written in a transaction on a connection of the
//!   relay's own [`Outbox`], the trigger in place as in production (poll 1 hour); the interval
//!   starts just before `COMMIT`, as for `Notify`. While the relay's fast path is armed, the
//!   commit's notification brings the event (the in-process wake-up would only race it).
//! - [`WakePath::Poll`]: the trigger is dropped, the writer is a separate connection as for
//!   `Notify`, and the relay's `poll_interval` is the given duration: only the poll finds events.
//!
//! Each sample starts with the relay idle: it has made no claim for 5 ms and, where relays mark
//! themselves waiting (`outbox_relay.relays`, migration 0002: a relay that runs out of work keeps
//! claiming every millisecond for a short `linger`, and only then asks writers to notify it), has
//! marked itself. A sample written right after the previous delivery would otherwise be found by
//! that short polling and measure neither path. Then the probe pauses for a random time: 0 to
//! 2 ms for `Notify` and `InProcess`, 0 to one poll interval for `Poll`. The long pause matters:
//! a sample that waited for a poll tick ends right after the tick, so without it the next write
//! would always land just after a tick and wait a whole interval, and the figures would show the
//! worst case instead of the spread. With it, poll latencies spread evenly over the interval
//! (mean about half of it). Each probe first takes a few warm-up samples that are not reported.
//!
//! # Drain throughput: [`drain_throughput`], [`drain_time`]
//!
//! The outbox is truncated and pre-filled with N events in one
//! `insert .. select .. generate_series` (payload `{"n": i}`), then `VACUUM ANALYZE`d. The clock
//! starts just before a relay (the given workers, batch size and retention; janitor off;
//! a handler that only counts) is started, and stops once the handler has run for all N events
//! and the relay has recorded every delivery (its `delivered` counter reaches N, checked every
//! millisecond). So the interval includes the relay's start-up (its connections are opened
//! lazily: one per worker plus the listener), which is a few milliseconds. Result: N / interval.
//!
//! # Write path: [`Writers`], [`write_tps`]
//!
//! Each writer is a task with its own connection (an [`Outbox`] with a pool of one) and runs
//! business transactions ([`WriteTx`]) back to back through the library's own write path: the
//! full transaction is [`Outbox::execute`] under a fresh idempotency key, whose unit of work
//! inserts the business row and records the audit entry and the event, exactly as a service
//! writes it:
//!
//! ```text
//! begin isolation level read committed;
//! select .. from pg_advisory_xact_lock($1, hashtext($2));                            -- the key's lock, and
//! select fingerprint, response from outbox_relay.idempotency where key = $1;         -- its receipt (none)
//! insert into bench_orders (customer, total) values ($1, $2) returning id;          -- business row
//! insert into outbox_relay.audit (entity, entity_id, action, data, idempotency_key) .. ;
//! insert into outbox_relay.outbox (topic, key, payload, available_at) .. ;          -- one event
//! insert into outbox_relay.idempotency (key, fingerprint, response) .. ;             -- the receipt, and
//! commit;                                                                             -- (one round trip)
//! ```
//!
//! The shapes without a receipt use a plain transaction and the low-level [`pg_outbox_relay::audit`].
//!
//! [`write_tps`] runs `writers` such tasks for a duration and returns commits per second, with no
//! relay running, in one of three [`NotifyMode`]s: the trigger disabled; the trigger as shipped
//! with no relay waiting (what writers pay under load: a check, no `NOTIFY`); and every commit
//! sending `NOTIFY` (a placeholder relay marked waiting). The last shows the cost the shipped
//! trigger avoids: PostgreSQL serialises the commits of notifying transactions on a
//! database-wide lock held through the commit (WAL flush included), so concurrent writers lose
//! group commit.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod brokers;
mod cpu;
mod drain;
mod held;
mod latency;
mod notify;
mod receivers;
mod server;
mod sinks;
mod trickle;
mod write;

pub use pg_outbox_relay::Percentiles;

pub use self::brokers::{AmqpDrain, KafkaBench};
pub use self::cpu::{CpuProfile, CpuSample};
pub use self::drain::{
    ClaimDeleteLoop, DrainSetup, Drained, ReadLoop, claim_delete_time, drain_each_measured, drain_measured,
    drain_throughput, drain_time, drain_to, drain_to_each, drain_with, read_loop_time,
};
pub use self::held::{HELD_WINDOW, HELD_WRITERS, HeldReport, HeldSnapshot, Phase, Window, held_snapshot};
pub use self::latency::{LatencyProbe, WakePath, latency};
pub use self::notify::{NotifyMode, reset_notify, set_notify_mode, set_notify_trigger};
pub use self::receivers::{
    Counts, LATE_BY, LIMITED_RATE, Receiver, ReceiverKind, ReceiverRun, ReceiverStage, ReceiversReport, Row,
    SLOW_LATENCY, SMALL_BACKLOG, SMALL_PACE, SMALL_SWEEP, Settings, drain_to_receiver, receivers,
};
pub use self::server::{BenchDb, DATABASE_PREFIX, ServerInfo, server_info};
pub use self::sinks::{DevNullLines, NatsBench, nats_sink, windows_in_flight};
pub use self::trickle::{Trickle, TrickleReport, trickle};
pub use self::write::{ArticleRun, Way, WriteTx, Writers, article_run, reset_write_tables, write_tps};

/// The error type of this module: any error, with a message that says what failed.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Wraps a tokio-postgres error with what was being done, and PostgreSQL's own words.
fn db(context: &'static str) -> impl FnOnce(tokio_postgres::Error) -> BoxError {
    move |e| match e.as_db_error() {
        Some(db) => format!("{context}: {} [SQLSTATE {}]", db.message(), db.code().code()).into(),
        None => format!("{context}: {e}").into(),
    }
}
