//! outbox-relay's test kit: what its tests, its benchmarks and the `outbox-relay demo` and
//! `bench` commands need, and a service using the library does not. Not published.
//!
//! - [`embedded`]: a private, throwaway PostgreSQL cluster from the machine's `initdb`/`pg_ctl`
//!   (Unix only);
//! - [`harness`]: one server per test process (`DATABASE_URL` or a throwaway cluster) and one
//!   fresh, migrated database per test ([`harness::TestDb`]);
//! - [`support`]: handlers that record deliveries, a relay running in the background, and
//!   waiting on a condition instead of sleeping;
//! - [`bench`]: the measurements shared by the criterion benchmarks and `outbox-relay bench`.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod bench;
#[cfg(unix)]
pub mod embedded;
pub mod harness;
pub mod support;
