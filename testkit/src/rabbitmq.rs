//! RabbitMQ for the tests of the AMQP sink: the broker `AMQP_URL` names, by default
//! `amqp://guest:guest@127.0.0.1:5672/%2f`.
//!
//! Unlike PostgreSQL and NATS, the kit starts no private broker: `rabbitmq-server` takes seconds
//! to start, shares the machine's Erlang port mapper and cookie, and is reached by `rabbitmqctl`
//! through its node name. `.ci/run` starts the machine's broker; without one, a test fails with a
//! message that says what to install or set.

use std::sync::OnceLock;

use crate::tools::{answers, program};

/// The broker when `AMQP_URL` is not set.
pub const DEFAULT_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

const INSTALL: &str = "Debian: apt install rabbitmq-server, then start it (.ci/run does); or set AMQP_URL";

static URL: OnceLock<String> = OnceLock::new();

/// The broker's URL, once something answers there; fails the test otherwise.
pub fn url() -> String {
    URL.get_or_init(|| {
        let url = std::env::var("AMQP_URL").ok().filter(|u| !u.is_empty()).unwrap_or_else(|| DEFAULT_URL.to_string());
        if let Err(e) = answers(&url, 5672) {
            panic!("this test needs RabbitMQ: nothing answers at {url} ({e}) ({INSTALL})");
        }
        url
    })
    .clone()
}

/// `rabbitmqctl`, for a test that acts on the broker's side (it must run where the broker runs).
pub fn rabbitmqctl() -> std::path::PathBuf {
    program("rabbitmqctl", "Debian: apt install rabbitmq-server, on the broker's machine")
}
