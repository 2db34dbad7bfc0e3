//! The relay's log lines, read back from a real subscriber: the process's own, so this test has
//! a binary of its own (a thread's subscriber misses lines when other tests log at the same
//! time).

use std::sync::Arc;

use pg_outbox_relay::NewEvent;
use pg_outbox_relay_testkit::harness::TestDb;
use pg_outbox_relay_testkit::support::{self, config, recorder};
use serde_json::json;

/// A writer that keeps what a subscriber writes, for reading the log lines back.
#[derive(Clone, Default)]
struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Two relays in one process are told apart in the logs: every line of each is in a span
/// `relay` with an id of its own, and below it `destination` with the destination's name.
#[tokio::test]
async fn two_relays_in_one_process_log_under_their_own_ids() {
    let db = TestDb::new().await;
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .with_env_filter("pg_outbox_relay=info")
        .finish();
    // The process's subscriber: this binary holds this test alone.
    tracing::subscriber::set_global_default(subscriber).unwrap();
    let (first, mut first_got) = recorder();
    let (second, mut second_got) = recorder();
    let one = support::start(&db.outbox, config(), first);
    let two = support::start(&db.outbox, config(), second);
    let id = db.outbox.publish(&NewEvent::new("t", json!({}))).await.unwrap();
    // One event, two relays of the destination `default`: one of them delivers it.
    tokio::select! {
        got = first_got.next() => assert_eq!(got.event.id, id),
        got = second_got.next() => assert_eq!(got.event.id, id),
    }
    one.stop().await;
    two.stop().await;
    let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    let ids = |message: &str| -> std::collections::BTreeSet<String> {
        text.lines()
            .filter(|line| line.contains(message))
            .filter_map(|line| line.split("relay{id=").nth(1)?.split('}').next().map(str::to_string))
            .collect()
    };
    let started = ids("relay starting");
    assert_eq!(started.len(), 2, "two relays, two ids:\n{text}");
    assert!(started.iter().all(|id| id.len() == 8 && id.chars().all(|c| c.is_ascii_hexdigit())), "{started:?}");
    assert_eq!(ids("relay stopped"), started, "each relay's last line carries its id:\n{text}");
    let summaries: Vec<&str> = text.lines().filter(|l| l.contains("relay activity")).collect();
    assert_eq!(summaries.len(), 2, "each relay sums up at its stop:\n{text}");
    assert!(
        summaries.iter().all(|l| l.contains("destination{name=default}")),
        "a destination's lines name it:\n{text}"
    );
}
