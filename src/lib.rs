#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

mod connect;
pub mod embedded;
mod error;
mod event;
mod migrate;
mod outbox;
mod publish;
mod sql;
mod wake;

pub use connect::{DEFAULT_POOL_SIZE, DatabaseUrl, redact};
pub use error::{Error, ErrorKind, Result};
pub use event::{Event, MAX_KEY_LEN, MAX_PAYLOAD_BYTES, MAX_TOPIC_LEN, NewEvent, validate_topic};
pub use migrate::MigrationReport;
pub use outbox::{Executed, Outbox, Work};
pub use publish::{AuditEntry, audit, publish, publish_all};
