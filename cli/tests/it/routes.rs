//! `run --route` and `run --config`, and the commands that show and operate destinations, run
//! as an operator would.

use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::binary::{cli, publish, spawn_run, spawn_run_as_shipped, stderr, stdout, terminate};
use crate::harness::TestDb;
use crate::relay_support::{PATIENCE, eventually};

/// Two routes to stdout: each event goes to every route whose pattern matches (an order to one,
/// an event of both to both), one no pattern matches goes to the dead letters, and `status`,
/// `destinations list` and `dead-letters list` show what happened per destination.
#[tokio::test]
async fn run_with_two_routes_delivers_each_event_to_every_match_and_dead_letters_the_unrouted() {
    let db = TestDb::new().await;
    let mut child =
        spawn_run(&db.url, &["--route", "erp=order.#=stdout", "--route", "#.audited=stdout", "--retention", "0s"]);
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let order = publish(&db, "order.placed", json!({"n": 1})).await;
    let both = publish(&db, "order.audited", json!({"n": 2})).await;
    let lost = publish(&db, "user.created", json!({"n": 3})).await;
    let mut seen: Vec<i64> = Vec::new();
    while seen.len() < 3 {
        let line = tokio::time::timeout(PATIENCE, lines.next_line()).await.expect("no output").unwrap().expect("eof");
        let event: Value = serde_json::from_str(&line).unwrap();
        seen.push(event["id"].as_i64().unwrap());
    }
    seen.sort();
    assert_eq!(seen, [order, both, both], "the order once, the audited order once per route");
    eventually("the unrouted event dead-lettered", || async {
        let out = cli(&db.url, &["status", "--json"]).await;
        serde_json::from_str::<Value>(&stdout(&out)).unwrap()["unrouted"] == json!(1)
    })
    .await;

    let out = cli(&db.url, &["status"]).await;
    let text = stdout(&out);
    assert!(text.contains("destinations              2"), "{text}");
    assert!(text.contains("warning: 1 events matched no destination's pattern"), "{text}");
    assert!(text.lines().any(|l| l.starts_with("erp ") && l.contains("order.#")), "{text}");
    let out = cli(&db.url, &["destinations", "list", "--json"]).await;
    let list: Value = serde_json::from_str(&stdout(&out)).unwrap();
    let names: Vec<&str> = list.as_array().unwrap().iter().map(|d| d["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["#.audited", "erp"], "a route without a name is named after its pattern");
    assert!(list.as_array().unwrap().iter().all(|d| d["relays"] == json!(1)));
    let out = cli(&db.url, &["dead-letters", "list"]).await;
    let text = stdout(&out);
    assert!(text.contains("(no route)") && text.contains("user.created"), "{text}");
    assert!(text.contains(&lost.to_string()));
    assert_eq!(terminate(child).await, Some(0));
}

/// A configuration file gives each destination its own options; a pause of one destination
/// holds only its events; `destinations drop` lets a gone destination's events go.
#[tokio::test]
async fn run_with_a_config_file_and_a_paused_destination() {
    let db = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("relay.toml");
    std::fs::write(
        &config,
        r##"
[[destination]]
name = "orders"
pattern = "order.*"
sink = "stdout"
concurrency = 4

[[destination]]
name = "mailer"
pattern = "mail.#"
sink = "stdout"
rate_limit = "1000/s"
"##,
    )
    .unwrap();
    // A name no relay registered is refused (a typo would pause nothing), unless meant.
    let out = cli(&db.url, &["pause", "--destination", "mailer"]).await;
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("no destination is named \"mailer\" (none is registered yet)"), "{}", stderr(&out));
    assert!(stderr(&out).contains("add --unregistered"), "{}", stderr(&out));
    let out = cli(&db.url, &["pause", "--destination", "mailer", "--unregistered"]).await;
    assert!(stdout(&out).contains("paused every topic at destination mailer"), "{}", stdout(&out));
    let mut child = spawn_run(&db.url, &["--config", config.to_str().unwrap()]);
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mail = publish(&db, "mail.send", json!({"to": "ana"})).await;
    let order = publish(&db, "order.placed", json!({"n": 1})).await;
    let line = tokio::time::timeout(PATIENCE, lines.next_line()).await.unwrap().unwrap().unwrap();
    assert_eq!(serde_json::from_str::<Value>(&line).unwrap()["id"], json!(order), "the order, not the paused mail");
    eventually("the mailer shown paused with its mail waiting", || async {
        let out = cli(&db.url, &["destinations", "list", "--json"]).await;
        let list: Value = serde_json::from_str(&stdout(&out)).unwrap();
        list.as_array()
            .unwrap()
            .iter()
            .any(|d| d["name"] == json!("mailer") && d["paused"] == json!(true) && d["new"] == json!(1))
    })
    .await;
    let out = cli(&db.url, &["pause", "--destination", "mailr"]).await;
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("no destination is named \"mailr\" (registered: "), "{err}");
    assert!(err.contains("\"mailer\"") && err.contains("\"orders\""), "{err}");
    let out = cli(&db.url, &["resume", "--destination", "mailer"]).await;
    assert!(stdout(&out).contains("resumed every topic at destination mailer"), "{}", stdout(&out));
    let line = tokio::time::timeout(PATIENCE, lines.next_line()).await.unwrap().unwrap().unwrap();
    assert_eq!(serde_json::from_str::<Value>(&line).unwrap()["id"], json!(mail));
    assert_eq!(terminate(child).await, Some(0));

    // The mailer's relay is gone (a route removed): its events stay until it is dropped.
    let mut child = spawn_run_as_shipped(&db.url, &["--route", "orders=order.*=stdout"]);
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    publish(&db, "mail.send", json!({"to": "bea"})).await;
    publish(&db, "order.placed", json!({"n": 2})).await;
    tokio::time::timeout(PATIENCE, lines.next_line()).await.unwrap().unwrap().unwrap();
    eventually("status warns of the mailer nobody serves", || async {
        stdout(&cli(&db.url, &["status"]).await)
            .contains("destination mailer: 1 events wait for it and no relay delivers to it")
    })
    .await;
    let client = db.client().await;
    let waiting = "select count(*) from outbox_relay.outbox where not outbox_relay.passed_by_all(xid, id)";
    assert_eq!(
        client.query_one(waiting, &[]).await.unwrap().get::<_, i64>(0),
        2,
        "the mailer's position, which nobody moves, keeps the order and the mail"
    );
    let out = cli(&db.url, &["destinations", "drop", "mailer"]).await;
    assert!(stdout(&out).contains("dropped destination mailer"), "{}", stdout(&out));
    eventually("every row passed once the mailer is dropped", || async {
        client.query_one(waiting, &[]).await.unwrap().get::<_, i64>(0) == 0
    })
    .await;
    let out = cli(&db.url, &["destinations", "drop", "mailer"]).await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("no destination is named \"mailer\""), "{}", stderr(&out));
    assert_eq!(terminate(child).await, Some(0));
}

/// Bad routes and files are refused before anything runs, with exit code 2 and a line that
/// names the problem and never a secret.
#[tokio::test]
async fn bad_routes_and_files_are_refused_at_start_naming_the_problem() {
    let db = TestDb::new().await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("relay.toml");
    let bad_pattern = "[[destination]]\nname = \"erp\"\npattern = \"order..placed\"\nsink = \"stdout\"\n";
    let leaky = "[[destination]]\nname = \"erp\"\npattern = \"#\"\nsink = \"stdout\"\nheaders = { Authorization = \"Bearer s3cr3t-token\" \n";
    let unknown = "[[destination]]\nname = \"erp\"\npattern = \"#\"\nsink = \"stdout\"\nsigning_secret = \"whsec_x\"\n";
    let number_secret = "[[destination]]\nname = \"erp\"\npattern = \"#\"\nsink = \"https://erp.example/hook\"\nsigning_secrets = 12345678\n";
    let one_table = "[destination]\nname = \"erp\"\npattern = \"#\"\nsink = \"stdout\"\n";
    let exchange_on_http =
        "[[destination]]\nname = \"erp\"\npattern = \"#\"\nsink = \"https://erp.example/hook\"\nexchange = \"x\"\n";
    for (file, expected) in [
        (number_secret, "(line 5): signing_secrets is a secret as a string, or a list of them"),
        (one_table, "[destination] is a single table; write [[destination]] (two brackets)"),
        (exchange_on_http, "destination \"erp\": exchange applies to the RabbitMQ sink (amqp://) only"),
        (bad_pattern, "relay.toml: destination \"erp\": pattern: topic pattern \"order..placed\": word 2 is empty"),
        (leaky, "(line 5)"),
        (unknown, "unknown field `signing_secret`"),
    ] {
        std::fs::write(&config, file).unwrap();
        let out = cli(&db.url, &["run", "--config", config.to_str().unwrap()]).await;
        assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
        assert!(stderr(&out).contains(expected), "{}", stderr(&out));
        assert!(
            !stderr(&out).contains("s3cr3t") && !stderr(&out).contains("whsec_x") && !stderr(&out).contains("12345678"),
            "{}",
            stderr(&out)
        );
    }
    for (args, expected) in [
        (vec!["run", "--route", "erp=order.*"], "no sink after the pattern"),
        (vec!["run", "--route", "erp=order.*=ftp://x"], "destination \"erp\": unknown sink"),
        (vec!["run", "--route", "erp=order.*=notasink"], "the sink must be stdout or a URL"),
        (vec!["run", "--route", "a=b=c=stdout"], "amqps://, kafka://)"),
        (vec!["run", "--route", "a=#=stdout", "--route", "a=order.*=stdout"], "two routes are named \"a\""),
        (vec!["run", "--route", "a b=#=stdout"], "destination name \"a b\""),
        (vec!["run", "--sink", "stdout", "--route", "a=#=stdout"], "cannot be used with"),
        (vec!["run"], "<--sink <SINK>|--route <NAME=PATTERN=SINK>|--config <FILE>>"),
        (vec!["dead-letters", "retry"], "<--all|ID|--destination <NAME>|--topic <PATTERN>"),
    ] {
        let out = cli(&db.url, &args).await;
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(expected), "{args:?}: {}", stderr(&out));
    }
}

/// A destination no relay serves expires after its `--destination-expiry` (issue 40, item 6): a
/// short run with a mistyped route registered `typo`, which then kept every later event in the
/// outbox after the real relay had delivered them. `status` and `destinations list` say how long
/// it has gone unserved and when it expires; once it has, what waited for it is in its dead
/// letters (nothing lost) and the outbox lets the events go.
#[tokio::test]
async fn a_destination_no_relay_serves_expires_into_its_dead_letters() {
    let db = TestDb::new().await;
    let expiry = ["--destination-expiry", "8s"];
    let mut typo = spawn_run(&db.url, &[&["--route", "typo=order.#=stdout"][..], &expiry].concat());
    let mut lines = BufReader::new(typo.stdout.take().unwrap()).lines();
    publish(&db, "order.placed", json!({"n": 0})).await;
    tokio::time::timeout(PATIENCE, lines.next_line()).await.expect("typo delivers").unwrap().unwrap();
    assert_eq!(terminate(typo).await, Some(0));
    let mut ids = Vec::new();
    for n in 1..=10 {
        ids.push(publish(&db, "order.placed", json!({"n": n})).await);
    }
    let text = stdout(&cli(&db.url, &["status"]).await);
    assert!(
        text.contains("destination typo: 10 events wait for it and no relay delivers to it (none has for"),
        "{text}"
    );
    assert!(text.contains("it expires in"), "{text}");
    let text = stdout(&cli(&db.url, &["destinations", "list"]).await);
    assert!(text.lines().any(|l| l.starts_with("typo ") && l.contains("ago, expires in")), "{text}");

    let mut real = spawn_run(&db.url, &[&["--route", "real=order.#=stdout"][..], &expiry].concat());
    let mut lines = BufReader::new(real.stdout.take().unwrap()).lines();
    for _ in 0..10 {
        tokio::time::timeout(PATIENCE, lines.next_line()).await.expect("real delivers").unwrap().unwrap();
    }
    eventually("typo expired", || async {
        let out = cli(&db.url, &["destinations", "list", "--json"]).await;
        let list: Value = serde_json::from_str(&stdout(&out)).unwrap();
        list.as_array().unwrap().iter().all(|d| d["name"] != json!("typo"))
    })
    .await;
    let client = db.client().await;
    let buried: Vec<i64> = client
        .query(
            "select id from outbox_relay.dead_letters where destination = 'typo'
                and last_error like 'the destination expired: no relay served it for 8s%' order by id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(buried, ids, "every event that waited for typo is in its dead letters");
    let waiting = "select count(*) from outbox_relay.outbox where not outbox_relay.passed_by_all(xid, id)";
    eventually("the outbox lets the events go", || async {
        client.query_one(waiting, &[]).await.unwrap().get::<_, i64>(0) == 0
    })
    .await;
    let text = stdout(&cli(&db.url, &["destinations", "list"]).await);
    assert!(text.lines().any(|l| l.starts_with("real ") && l.ends_with("now")), "{text}");
    let output = crate::binary::terminate_with_output(real).await;
    let logs = String::from_utf8_lossy(&output.stderr);
    assert!(logs.contains("destination expired") && logs.contains("dead_lettered=10"), "{logs}");
}

/// A reloaded file whose routes are refused when they register (it changes the pattern of a
/// destination another process serves) leaves the relay delivering with the routes it had; it
/// used to end the process, the old relay already stopped.
#[tokio::test]
async fn a_reload_refused_at_registration_goes_back_to_the_routes_before() {
    let db = TestDb::new().await;
    let other = spawn_run(&db.url, &["--route", "erp=order.#=stdout"]);
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("relay.toml");
    std::fs::write(&config, "[[destination]]\nname = \"mine\"\npattern = \"mail.#\"\nsink = \"stdout\"\n").unwrap();
    let mut relay = spawn_run(&db.url, &["--config", config.to_str().unwrap()]);
    let mut lines = BufReader::new(relay.stdout.take().unwrap()).lines();
    let served = |name: &'static str| {
        let url = db.url.clone();
        move || {
            let url = url.clone();
            async move {
                let out = cli(&url, &["destinations", "list", "--json"]).await;
                let list: Value = serde_json::from_str(&stdout(&out)).unwrap();
                list.as_array().unwrap().iter().any(|d| d["name"] == json!(name) && d["relays"] == json!(1))
            }
        }
    };
    // (a destination registered after an event was passed by the others does not get it)
    eventually("the other relay serves erp", served("erp")).await;
    eventually("mine is served", served("mine")).await;
    let first = publish(&db, "mail.send", json!({"n": 1})).await;
    let line = tokio::time::timeout(PATIENCE, lines.next_line()).await.expect("mine delivers").unwrap().unwrap();
    assert_eq!(serde_json::from_str::<Value>(&line).unwrap()["id"], json!(first));
    std::fs::write(&config, "[[destination]]\nname = \"erp\"\npattern = \"mail.#\"\nsink = \"stdout\"\n").unwrap();
    let pid = relay.id().unwrap().to_string();
    std::process::Command::new("kill").args(["-HUP", &pid]).status().unwrap();
    eventually("mine is served again after the refusal", served("mine")).await;
    // Delivered after the refusal: the routes before it run again.
    let second = publish(&db, "mail.send", json!({"n": 2})).await;
    let line = tokio::time::timeout(PATIENCE, lines.next_line()).await.expect("mine delivers again").unwrap().unwrap();
    assert_eq!(serde_json::from_str::<Value>(&line).unwrap()["id"], json!(second));
    let output = crate::binary::terminate_with_output(relay).await;
    assert_eq!(output.status.code(), Some(0), "{}", String::from_utf8_lossy(&output.stderr));
    let logs = String::from_utf8_lossy(&output.stderr);
    assert!(logs.contains("the reloaded routes were refused; the relay goes on with the routes it had"), "{logs}");
    assert!(logs.contains("destination erp is served by a connected relay with the pattern order.#"), "{logs}");
    assert_eq!(terminate(other).await, Some(0));
}

mod needs_nats {
    use super::*;
    use crate::cli::unique;
    use crate::nats::LateNats;
    use crate::relay_support::{HttpReceiver, free_port};

    /// A destination whose broker does not answer at start holds only its own events, spending
    /// no attempt, while the others deliver; it is connected (its stream created) at a delivery
    /// once the broker answers, without a restart (issue 40, item 3). Before, the command exited
    /// 1 at start and delivered nothing anywhere.
    #[tokio::test]
    async fn a_broker_away_at_start_holds_only_its_events_and_is_connected_once_it_answers() {
        let db = TestDb::new().await;
        let receiver = HttpReceiver::start().await;
        let port = free_port();
        let prefix = unique("late");
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("relay.toml");
        let file = format!(
            "[[destination]]\nname = \"ok\"\npattern = \"order.#\"\nsink = \"{}\"\n\n\
             [[destination]]\nname = \"away\"\npattern = \"mail.#\"\nsink = \"nats://127.0.0.1:{port}\"\n\
             subject_prefix = \"{prefix}\"\ncreate_stream = \"{prefix}\"\ntimeout = \"1s\"\n",
            receiver.url()
        );
        std::fs::write(&config, file).unwrap();
        let args = ["--config", config.to_str().unwrap(), "--max-attempts", "2", "--backoff-base", "20ms"];
        let child = spawn_run(&db.url, &args);
        for n in 0..20 {
            publish(&db, "order.placed", json!({"n": n})).await;
            db.outbox
                .publish(&pg_outbox_relay::NewEvent::new("mail.send", json!({"n": n})).key(format!("to-{}", n % 4)))
                .await
                .unwrap();
        }
        eventually("the orders delivered", || async { receiver.accepted() == 20 }).await;
        let client = db.client().await;
        let tried = "select count(*), coalesce(max(attempts), 0) from outbox_relay.parked
                      where destination = 'away' and last_error like '%cannot connect to NATS%'";
        eventually("the mail tried and waiting", || async {
            client.query_one(tried, &[]).await.unwrap().get::<_, i64>(0) >= 4
        })
        .await;
        // Several rounds of tries (2 attempts would have buried the heads of the 4 keys).
        tokio::time::sleep(std::time::Duration::from_secs(2)).await;
        let row = client.query_one(tried, &[]).await.unwrap();
        assert_eq!(row.get::<_, i32>(1), 0, "no attempt spent while the broker was away");
        assert_eq!(db.outbox.queue_stats().await.unwrap().dead_letters, 0);

        let nats = LateNats::start_on(port);
        let waiting = "select count(*) from outbox_relay.parked where destination = 'away'";
        eventually("the mail delivered once the broker answers", || async {
            client.query_one(waiting, &[]).await.unwrap().get::<_, i64>(0) == 0
                && db.outbox.queue_stats().await.unwrap().pending == 0
        })
        .await;
        assert_eq!(db.outbox.queue_stats().await.unwrap().dead_letters, 0);
        let output = crate::binary::terminate_with_output(child).await;
        let logs = String::from_utf8_lossy(&output.stderr);
        assert!(logs.contains("the destination does not answer; the relay starts without it"), "{logs}");
        assert!(logs.contains("the destination answers; delivering to it"), "{logs}");
        let js = async_nats::jetstream::new(async_nats::connect(&nats.url).await.unwrap());
        let mut stream = js.get_stream(&prefix).await.expect("the stream created once the broker answered");
        assert_eq!(stream.info().await.unwrap().state.messages, 20, "each mail once");
        assert_eq!(receiver.counts().values().filter(|&&n| n != 1).count(), 0, "each order once");
    }
}
