//! Integration tests against a real PostgreSQL: see `harness` for where the server comes from.

mod cli;
mod faults;
mod harness;
mod migrations;
mod orders;
mod orders_service;
mod privileges;
mod relay;
mod relay_support;
mod sql_publish;
mod tls;
mod write_path;
