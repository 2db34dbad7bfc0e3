//! pg-outbox-relay's test kit: what its tests need and a service using the library does not.
//! Not published.
//!
//! - [`harness`]: one server per test process (`DATABASE_URL` or a throwaway cluster of
//!   [`pg_outbox_relay_cluster`]) and one fresh, migrated database per test
//!   ([`harness::TestDb`]);
//! - [`support`]: handlers that record deliveries, a relay running in the background, waiting
//!   on a condition instead of sleeping, and counting rows;
//! - [`factory`]: outbox rows written by hand ([`factory::OutboxRow`]);
//! - what some tests need besides PostgreSQL, each found or started the way the harness does
//!   PostgreSQL, or else the test fails naming what to install: [`nats`] (`NATS_URL` or a private
//!   `nats-server -js`), [`rabbitmq`] (`AMQP_URL` or the machine's broker), [`kafka`] (a
//!   private tansu broker per test), [`browser`]
//!   (chromedriver and Chromium) and [`tools`] (openssl, python3 and its packages).
//!   The tests that need them live in modules named `needs_nats`, `needs_rabbitmq`, `needs_kafka`,
//!   `needs_browser`, `needs_python` and `needs_openssl`, so that
//!   `cargo test -- --skip ::needs_` runs the PostgreSQL-only part.
//!
//! The benchmark drivers, which the command's `bench` runs too, are the crate
//! `pg-outbox-relay-bench`.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod browser;
pub mod factory;
pub mod harness;
pub mod kafka;
pub mod nats;
pub mod otlp;
pub mod rabbitmq;
pub mod support;
pub mod tools;
