//! pg-outbox-relay's test kit: what its tests need and a service using the library does not.
//! Not published.
//!
//! - [`harness`]: one server per test process (`DATABASE_URL` or a throwaway cluster of
//!   [`pg_outbox_relay_cluster`]) and one fresh, migrated database per test
//!   ([`harness::TestDb`]);
//! - [`support`]: handlers that record deliveries, a relay running in the background, waiting
//!   on a condition instead of sleeping, and counting rows;
//! - [`factory`]: outbox rows written by hand ([`factory::OutboxRow`]).
//!
//! The benchmark drivers, which the command's `bench` runs too, are the crate
//! `pg-outbox-relay-bench`.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod factory;
pub mod harness;
pub mod support;
