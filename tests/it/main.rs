//! Integration tests against a real PostgreSQL: see `harness` for where the server comes from.

mod bad_rows;
mod binary;
mod cli;
mod faults;
mod harness;
mod http_sink;
mod migrations;
mod operator;
mod orders;
mod orders_service;
mod privileges;
mod relay;
mod relay_support;
mod secrets;
mod sql_publish;
mod tls;
mod write_path;
