//! The `outbox-relay` command, spawned for real against a real PostgreSQL (the test kit's
//! harness: `DATABASE_URL` or a throwaway cluster, a database per test).

use pg_outbox_relay_testkit::{factory, harness, nats, rabbitmq, support as relay_support, tools};

mod amqp;
mod binary;
mod cli;
mod fidelity;
mod headers;
mod hostile;
mod http;
mod kafka;
mod killed;
mod logs;
mod memory;
mod operator;
mod packages;
mod routes;
mod secrets;
mod tracing;
mod webhooks;
