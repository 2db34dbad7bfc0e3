//! A Kafka-protocol broker for the tests of the Kafka sink: a private tansu broker per test
//! (<https://github.com/tansu-io/tansu>, a published crate), on a free port of 127.0.0.1 with
//! its storage in SQLite in a temporary directory, so that it can be stopped and started again
//! with what it had, and started with SASL logins required. What the relay sent is read back by
//! Python's confluent-kafka (librdkafka), and a key's partition is checked against kafka-python's
//! own implementation of the Java client's murmur2 partitioner.
//!
//! The broker is `TANSU` (a path), or `~/.local/tansu-0.6.0/bin/tansu` where `.ci/run`
//! installs it, or `tansu` on `PATH`; it needs SQLite storage (the `libsql` feature). Without
//! one, a test fails naming the command that installs it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::free_port;
use crate::tools::{PythonPackage, answers, find_program, log_tail, private_dir, python, spawn_watchdog};

/// How to get the broker, for the messages.
pub const INSTALL: &str = "cargo install tansu --version 0.6.0 --locked --features dynostore,libsql --root ~/.local/tansu-0.6.0 (about 12 minutes), or set TANSU to its path";

/// How long a starting broker may take to accept connections.
const START_PATIENCE: Duration = Duration::from_secs(20);

/// Confluent's Python client (librdkafka), which reads the topics back.
pub const CONFLUENT_KAFKA: PythonPackage = PythonPackage { module: "confluent_kafka", pip: "confluent-kafka>=2.4" };

/// kafka-python, whose `murmur2` is a Python port of the Java client's default partitioner.
pub const KAFKA_PYTHON: PythonPackage = PythonPackage { module: "kafka.partitioner.default", pip: "kafka-python>=2.0" };

/// A private broker; stopped and its directory removed when dropped (or, should the test
/// process die, by its watchdog).
pub struct Kafka {
    binary: PathBuf,
    port: u16,
    dir: PathBuf,
    server: Option<Child>,
    authentication: bool,
    /// Storage in memory (lost at a restart) instead of SQLite.
    in_memory: bool,
    _watchdog: Child,
}

/// One message read back.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct Message {
    /// Its partition.
    pub partition: i32,
    /// Its offset in the partition.
    pub offset: i64,
    /// Its key as text.
    pub key: Option<String>,
    /// The partition the Java client's default partitioner gives its key (kafka-python's
    /// murmur2 over the topic's partitions); `None` without a key.
    pub java_partition: Option<i32>,
    /// Its headers, as text.
    pub headers: BTreeMap<String, String>,
    /// Its value as text.
    pub value: String,
    /// Its timestamp, in milliseconds since the epoch.
    pub timestamp: i64,
}

impl Kafka {
    /// Starts a broker that takes anyone, its storage in SQLite.
    pub fn start() -> Kafka {
        Kafka::start_with(false)
    }

    /// Starts a broker that takes anyone, its storage in memory: a restart starts it empty,
    /// without its topics and without what it knew of producers. (tansu 0.6's SQLite storage
    /// keeps them, but its first produce from an idempotent producer after a restart panics in
    /// the broker, so a test that restarts a broker under a producer uses this one.)
    pub fn start_in_memory() -> Kafka {
        Kafka::start_with(true)
    }

    fn start_with(in_memory: bool) -> Kafka {
        let binary = binary();
        let dir = private_dir("kafka").unwrap_or_else(|e| panic!("{e}"));
        let watchdog = spawn_watchdog("tansu", &dir).unwrap_or_else(|e| panic!("{e}"));
        let mut kafka = Kafka {
            binary,
            port: free_port(),
            dir,
            server: None,
            authentication: false,
            in_memory,
            _watchdog: watchdog,
        };
        kafka.launch();
        kafka
    }

    /// Starts a broker that takes only `user` with `password` (SASL SCRAM-SHA-256 and
    /// SCRAM-SHA-512), with `topics` (name, partitions): the user and the topics are made on the
    /// broker without logins, which is then started again on the same storage with logins
    /// required (tansu's admin command has no login).
    pub fn start_with_login(user: &str, password: &str, topics: &[(&str, u32)]) -> Kafka {
        let mut kafka = Kafka::start();
        for mechanism in ["scram256", "scram512"] {
            kafka.tansu(&["user", "create", "--broker", &kafka.tcp(), "--mechanism", mechanism, user, password]);
        }
        for (topic, partitions) in topics {
            kafka.create_topic(topic, *partitions);
        }
        kafka.stop();
        kafka.authentication = true;
        kafka.launch();
        kafka
    }

    /// The sink's spec: `kafka://127.0.0.1:port`.
    pub fn url(&self) -> String {
        format!("kafka://{}", self.brokers())
    }

    /// `127.0.0.1:port`, for clients' `bootstrap.servers`.
    pub fn brokers(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn tcp(&self) -> String {
        format!("tcp://{}", self.brokers())
    }

    /// Creates a topic of `partitions` partitions.
    pub fn create_topic(&self, name: &str, partitions: u32) {
        self.tansu(&["topic", "create", "--broker", &self.tcp(), "--partitions", &partitions.to_string(), name]);
    }

    /// Kills the broker (SIGKILL: a crash, not a shutdown).
    pub fn stop(&mut self) {
        if let Some(mut server) = self.server.take() {
            let _ = server.kill();
            let _ = server.wait();
        }
    }

    /// Starts the stopped broker again, on the same port and storage.
    pub fn restart(&mut self) {
        assert!(self.server.is_none(), "the broker runs");
        self.launch();
    }

    /// Reads `topic` back from its beginning: every message, once `expected` arrived and no
    /// other followed for two seconds, or whatever arrived within `patience`.
    pub fn read(&self, topic: &str, expected: usize, patience: Duration) -> Vec<Message> {
        let args = [self.brokers(), topic.to_string(), expected.to_string(), patience.as_secs_f64().to_string()];
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let output = python(READ, &args, b"", &[CONFLUENT_KAFKA, KAFKA_PYTHON]);
        assert!(output.status.success(), "reading {topic} back failed: {}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .map(|line| serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}")))
            .collect()
    }

    fn launch(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("log"))
            .unwrap_or_else(|e| panic!("opening the broker's log: {e}"));
        let mut command = Command::new(&self.binary);
        // tansu puts an SQLite file where the URL's host and path say, under its working directory.
        command
            .current_dir(&self.dir)
            .args(["broker", "--listener-url", &self.tcp(), "--advertised-listener-url", &self.tcp()])
            .args(["--storage-engine", if self.in_memory { "memory://tansu/" } else { "sqlite://./tansu.db" }])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("the log"))
            .stderr(log);
        if self.authentication {
            command.arg("--authentication");
        }
        let mut server = command.spawn().unwrap_or_else(|e| panic!("spawning {}: {e}", self.binary.display()));
        std::fs::write(self.dir.join("pid"), server.id().to_string()).expect("writing the broker's pid");
        let deadline = Instant::now() + START_PATIENCE;
        while answers(&self.tcp(), self.port).is_err() {
            if let Ok(Some(status)) = server.try_wait() {
                panic!("tansu exited ({status}); does it have SQLite storage? ({INSTALL}): {}", log_tail(&self.dir));
            }
            assert!(Instant::now() < deadline, "tansu did not accept connections within {START_PATIENCE:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
        self.server = Some(server);
    }

    /// Runs a `tansu` admin command; fails the test when it fails.
    fn tansu(&self, args: &[&str]) {
        let output = Command::new(&self.binary).args(args).output().expect("tansu runs");
        assert!(
            output.status.success(),
            "tansu {} failed: {}",
            args[..2].join(" "),
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

impl Drop for Kafka {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The broker's binary; fails the test, naming how to install it, when there is none.
fn binary() -> PathBuf {
    if let Some(path) = std::env::var_os("TANSU") {
        return PathBuf::from(path);
    }
    let installed = std::env::var_os("HOME").map(|home| Path::new(&home).join(".local/tansu-0.6.0/bin/tansu"));
    if let Some(path) = installed.filter(|p| p.is_file()) {
        return path;
    }
    find_program("tansu")
        .unwrap_or_else(|| panic!("this test needs a Kafka broker: tansu is not installed ({INSTALL})"))
}

/// Reads a topic from its beginning and prints a JSON line per message.
const READ: &str = r#"
import json, sys, time
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient
from kafka.partitioner.default import murmur2

brokers, topic, expected, patience = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
metadata = AdminClient({"bootstrap.servers": brokers}).list_topics(topic, timeout=10)
partitions = sorted(metadata.topics[topic].partitions)
consumer = Consumer({"bootstrap.servers": brokers, "group.id": "outbox-relay-tests", "enable.auto.commit": False})
consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
deadline = time.monotonic() + patience
read, quiet_since = 0, None
while time.monotonic() < deadline:
    message = consumer.poll(0.2)
    if message is None:
        if read >= expected:
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since >= 2:
                break
        continue
    if message.error():
        print(message.error(), file=sys.stderr)
        continue
    quiet_since = None
    read += 1
    key = message.key()
    print(json.dumps({
        "partition": message.partition(),
        "offset": message.offset(),
        "key": key.decode() if key is not None else None,
        "java_partition": (murmur2(key) & 0x7fffffff) % len(partitions) if key is not None else None,
        "headers": {name: value.decode() for name, value in (message.headers() or [])},
        "value": message.value().decode(),
        "timestamp": message.timestamp()[1],
    }))
consumer.close()
"#;
