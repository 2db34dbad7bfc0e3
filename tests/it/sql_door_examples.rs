//! The SQL door's examples (examples/sql_door): the article's transaction from Python (psycopg)
//! and from Node.js (node-postgres), run as a user runs them, under the writer role.

use std::path::{Path, PathBuf};
use std::process::Output;

use serde_json::{Value, json};

use crate::harness::TestDb;
use crate::sql_unit_of_work::writer_database;
use pg_outbox_relay_testkit::tools::{PSYCOPG, probe_python, program};

fn example(file: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/sql_door").join(file)
}

/// Runs the example three ways and checks what each did: a fresh request, its retry (a replay
/// of the same response), the key reused for another customer (exit 3, nothing written).
async fn check(run: impl Fn(&str, &[&str]) -> Output) {
    let db = TestDb::new().await;
    let url = writer_database(&db).await;
    let ok = |output: Output| -> Value {
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(output.status.success(), "{:?}: {stdout} {}", output.status, String::from_utf8_lossy(&output.stderr));
        serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"))
    };
    let first = ok(run(&url, &["order-7f3c", "ana", "12.50"]));
    assert_eq!(first["replayed"], json!(false), "{first}");
    let order_id = first["response"]["order_id"].as_i64().expect("an order id");
    let again = ok(run(&url, &["order-7f3c", "ana", "12.50"]));
    assert_eq!(again, json!({"response": {"order_id": order_id}, "replayed": true}));
    let refused = run(&url, &["order-7f3c", "bob", "3.00"]);
    assert_eq!(refused.status.code(), Some(3), "{}", String::from_utf8_lossy(&refused.stderr));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("was already used for a different request"));

    let admin = db.client().await;
    let row = admin
        .query_one(
            "select (select count(*) from orders), (select count(*) from outbox_relay.audit where idempotency_key = 'order-7f3c'),
                    (select count(*) from outbox_relay.idempotency),
                    (select count(*) from outbox_relay.outbox where topic = 'order.placed' and key = $1::text
                        and payload = jsonb_build_object('order_id', $2::int8, 'customer', 'ana'))",
            &[&order_id.to_string(), &order_id],
        )
        .await
        .unwrap();
    let counts: (i64, i64, i64, i64) = (row.get(0), row.get(1), row.get(2), row.get(3));
    assert_eq!(counts, (1, 1, 1, 1), "orders, audit rows, receipts, events");
}

#[tokio::test]
async fn the_python_example_places_an_order_once_per_key() {
    let python3 = probe_python(&[PSYCOPG]);
    check(|url, args| {
        std::process::Command::new(&python3)
            .arg(example("place_order.py"))
            .args(args)
            .env("DATABASE_URL", url)
            .output()
            .expect("python3 runs")
    })
    .await;
}

#[tokio::test]
async fn the_node_example_places_an_order_once_per_key() {
    let node = program("node", "Debian: apt install nodejs npm");
    assert!(
        example("node_modules/pg").is_dir(),
        "this test needs node-postgres in examples/sql_door: run `npm ci --prefix examples/sql_door`"
    );
    check(|url, args| {
        std::process::Command::new(&node)
            .arg(example("place_order.mjs"))
            .args(args)
            .env("DATABASE_URL", url)
            .output()
            .expect("node runs")
    })
    .await;
}
