//! The library's integration tests, against a real PostgreSQL: the test kit's
//! [`harness`](pg_outbox_relay_testkit::harness) says where the server comes from, and gives each
//! test a database of its own. The command's tests are in `cli/tests/`.

use pg_outbox_relay_testkit::{factory, harness, support as relay_support, tools};

mod bad_rows;
mod delivery;
mod edges;
mod fast_path;
mod faults;
mod headers;
mod http_conventions;
mod http_sink;
mod inbox;
mod kafka;
mod leases;
mod leaves;
mod limits;
mod log;
mod migrations;
mod orders;
mod orders_service;
mod pauses;
mod privileges;
mod relay;
mod routes;
mod sql_door_examples;
mod sql_publish;
mod sql_unit_of_work;
mod sqlx_publish;
mod sqlx_work;
mod storage;
mod tls;
mod webhook_receiver;
mod write_path;
