//! The command line: every command, its flags and what they take.

use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use pg_outbox_relay::RelayConfig;
use pg_outbox_relay::sink::Secret;

use crate::telemetry::LogFormat;
use crate::values::*;
use crate::{bench, demo};

/// What `--help` and the manual page end with: the environment, the exit status, the files.
const ENVIRONMENT: &str = "\
Environment:
  DATABASE_URL                  the database (--database-url); else libpq's PGHOST, PGPORT, PGUSER,
                                PGPASSWORD (or PGPASSFILE, ~/.pgpass), PGDATABASE, PGSSLMODE,
                                PGSSLROOTCERT, PGAPPNAME, PGOPTIONS, PGCONNECT_TIMEOUT
  OUTBOX_RELAY_LOG_FORMAT       text or json (--log-format); RUST_LOG filters the log
  OUTBOX_RELAY_SIGNING_SECRETS, OUTBOX_RELAY_KAFKA_PASSWORD, OUTBOX_RELAY_HTTP_TOKEN
                                secrets of run and console, kept out of the process list
  OTEL_EXPORTER_OTLP_ENDPOINT   where run exports its spans (OTLP http/protobuf), with
                                OTEL_SERVICE_NAME and the other standard OTEL_* variables

Exit status: 0 on success, 2 for bad arguments (a flag, a value, the database URL, a config
file, a sink), 1 for everything else.

Files (the Debian package): /etc/outbox-relay/relay.toml (run --config), /etc/default/outbox-relay
(the service's environment), /lib/systemd/system/outbox-relay.service; the documentation, which
the help's docs/*.md names, in /usr/share/doc/outbox-relay.";

/// Atomic writes and their events on PostgreSQL, delivered within milliseconds of commit.
#[derive(Debug, Parser)]
#[command(name = "outbox-relay", version, about, propagate_version = true, after_long_help = ENVIRONMENT)]
pub(crate) struct Cli {
    /// PostgreSQL URL, e.g. postgres://user:password@host:5432/db (or set DATABASE_URL).
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true, value_name = "URL")]
    pub(crate) database_url: Option<String>,

    /// How long any one database operation of the command may wait for an answer (a count, a
    /// listing, an action, a migration; not the relay's own work) before the command fails
    /// saying that the database did not answer. A migration waits this long for table locks
    /// another session holds (a pg_dump, a long transaction), a moment at a time so that relays
    /// and writers go on, then fails naming that session. Making a connection is bounded by the
    /// URL's connect_timeout (10 s when it gives none), handshake included.
    #[arg(long, global = true, value_name = "DUR", default_value = "30s", value_parser = db_timeout(), allow_hyphen_values = true)]
    pub(crate) db_timeout: Duration,

    /// How logs are written to stderr: text, or json (one object per line with time, level,
    /// target, message, the relay's id, the destination and the event's own fields).
    #[arg(long, global = true, env = "OUTBOX_RELAY_LOG_FORMAT", value_name = "FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub(crate) log_format: LogFormat,

    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Run the article's scenario end to end and print a report (a throwaway PostgreSQL when no
    /// database is given; with one, a fresh database on that server, dropped at the end).
    Demo(demo::DemoArgs),
    /// Measure commit-to-delivery latency, drain throughput and the trigger's cost on writes (a
    /// throwaway PostgreSQL, fsync on, when no database is given).
    Bench(bench::BenchArgs),
    /// Apply the library's schema migrations (safe to run again, and from several processes at once).
    Migrate,
    /// Run the relay until SIGINT or SIGTERM, delivering events to a sink.
    Run(Box<RunArgs>),
    /// Show the queue (pending, delayed, in flight, processed, dead letters), the relays, the
    /// pauses and the health signals, with a warning line for each that needs attention.
    Status {
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// List, retry or purge dead letters.
    #[command(subcommand)]
    DeadLetters(DeadLetterCommand),
    /// Pause delivery, for every relay on this database, until `resume` (kept in the database:
    /// restarts do not lift it; relays stop claiming within moments, a batch already claimed is
    /// still delivered). Paused events stay pending and are charged no attempt; a paused event at
    /// the head of its key holds the key's later events, of any topic.
    Pause {
        /// Pause only this topic (by default every topic).
        #[arg(long, value_name = "TOPIC")]
        topic: Option<String>,
        /// Pause only this destination (by default every destination); the others go on. It
        /// must be registered (a typo would pause nothing), unless --unregistered.
        #[arg(long, value_name = "NAME")]
        destination: Option<String>,
        /// Pause a --destination no relay has registered yet: it holds that destination's events
        /// from its first start.
        #[arg(long, requires = "destination")]
        unregistered: bool,
    },
    /// Lift a pause: without --topic the pause of every topic (pauses of single topics stay),
    /// with --topic that topic's; without --destination the pause of every destination, with it
    /// that destination's.
    Resume {
        /// Lift the pause of this topic (by default the pause of every topic).
        #[arg(long, value_name = "TOPIC")]
        topic: Option<String>,
        /// Lift the pause of this destination (by default the pause of every destination).
        #[arg(long, value_name = "NAME")]
        destination: Option<String>,
    },
    /// List the destinations the relays registered, add one (starting in the past), or drop one
    /// that no relay delivers to any more.
    #[command(subcommand)]
    Destinations(DestinationCommand),
    /// Send the retained events of a time range to one destination again: in order per key, with
    /// their ids and uuids (consumers' inboxes drop what they have), the other destinations
    /// untouched. Only events the destination has passed, and kept for the relays' --retention.
    Replay {
        /// The destination to send them to.
        #[arg(long, value_name = "NAME")]
        destination: String,
        /// From events created at this moment on: an RFC 3339 time in UTC (2026-12-05T08:00:00Z)
        /// or how long ago (90m, 2h).
        #[arg(long, value_name = "TIME", value_parser = moment, allow_hyphen_values = true)]
        since: std::time::SystemTime,
        /// Up to events created before this moment (default: now); as --since.
        #[arg(long, value_name = "TIME", value_parser = moment, allow_hyphen_values = true)]
        until: Option<std::time::SystemTime>,
        /// Only the events whose topic this pattern matches (`order.*`, `mail.#`).
        #[arg(long, value_name = "PATTERN")]
        topic: Option<String>,
        /// Count what would be sent, and send nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Serve the web console, /metrics and the health endpoints without running a relay.
    Console {
        /// Where to listen: an IP address and a port, e.g. 127.0.0.1:9187 (not a host name).
        #[arg(long, value_name = "ADDR")]
        listen: std::net::SocketAddr,
        /// Token the console needs (its pages, API and actions; not /metrics or the probes); without
        /// one the console is served on loopback addresses only. At least 16 characters; never
        /// logged.
        #[arg(long, env = "OUTBOX_RELAY_HTTP_TOKEN", hide_env_values = true, value_name = "TOKEN", value_parser = secret)]
        http_token: Option<Secret>,
    },
    /// Print a completion script for a shell: e.g. `outbox-relay completions bash >
    /// /etc/bash_completion.d/outbox-relay`, `outbox-relay completions zsh > ~/.zfunc/_outbox-relay`.
    Completions {
        /// bash, zsh, fish, elvish or powershell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the manual page (roff; `outbox-relay man | man -l -`), or write one page per command
    /// into a directory with --dir.
    Man {
        /// Write outbox-relay.1 and a page for each command (outbox-relay-run.1, ...) here.
        #[arg(long, value_name = "DIR")]
        dir: Option<std::path::PathBuf>,
    },
    /// Run one pass of the janitor and print what it removed.
    Cleanup {
        /// Remove the events every destination has passed that are older than this (0s to 100
        /// years).
        #[arg(long, value_name = "DUR", value_parser = retention(), allow_hyphen_values = true, default_value = "1h")]
        retention: Duration,
        /// Delete idempotency receipts older than this (0s to 100 years).
        #[arg(long, value_name = "DUR", value_parser = retention(), allow_hyphen_values = true, default_value = "7d")]
        idempotency_retention: Duration,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum DestinationCommand {
    /// Each destination with its pattern, what waits for it, and the relays that deliver to it.
    List {
        /// Print a JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Register a destination before a relay serves it (a relay started with a route of that
    /// name and pattern delivers to it); with --since, it starts in the past: the retained
    /// events created since then that its pattern matches are sent to it first.
    Add {
        /// The destination's name.
        name: String,
        /// Its topic pattern (`order.*`, `mail.#`, `#`).
        #[arg(long, value_name = "PATTERN")]
        pattern: String,
        /// Start at this moment in the past: an RFC 3339 time in UTC (2026-12-05T08:00:00Z) or
        /// how long ago (90m, 2h).
        #[arg(long, value_name = "TIME", value_parser = moment, allow_hyphen_values = true)]
        since: Option<std::time::SystemTime>,
    },
    /// Drop a destination: events stop waiting for it (what was parked for it goes to its dead
    /// letters) and its position no longer keeps events in the outbox. Stop the relays that
    /// deliver to it first: one that still does registers it again.
    Drop {
        /// The destination's name.
        name: String,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum DeadLetterCommand {
    /// List dead letters, oldest first: those of at most --limit events, every destination's
    /// dead letter of each; the next page with --after the last id shown.
    List {
        /// Print a JSON array instead of a table.
        #[arg(long)]
        json: bool,
        /// Show those of at most this many events.
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(i64).range(1..))]
        limit: i64,
        /// Show those with an id above this one (the last id of the page before).
        #[arg(long, value_name = "ID")]
        after: Option<i64>,
        #[command(flatten)]
        filter: DeadLetterFilterArgs,
    },
    /// Put dead letters back into the outbox under their own ids, attempts reset: these ids,
    /// those the filters take, or --all. Says how many; --dry-run only counts them.
    #[command(group(clap::ArgGroup::new("which").required(true).multiple(true).args(["all", "ids", "destination", "topic", "since", "until", "error"])))]
    Retry {
        /// Retry every dead letter.
        #[arg(long, conflicts_with_all = ["ids", "destination", "topic", "since", "until", "error"])]
        all: bool,
        /// The ids to retry (all of them, or none when one is no dead letter).
        #[arg(value_name = "ID", conflicts_with_all = ["destination", "topic", "since", "until", "error"])]
        ids: Vec<i64>,
        #[command(flatten)]
        filter: DeadLetterFilterArgs,
        /// Count what would be retried, and change nothing (with filters or --all).
        #[arg(long, conflicts_with = "ids")]
        dry_run: bool,
    },
    /// Delete dead letters: those that failed longer ago than --older-than, those the filters
    /// take (both: those both take), or --all. Says how many; --dry-run only counts them.
    #[command(group(clap::ArgGroup::new("which").required(true).multiple(true).args(["all", "older_than", "destination", "topic", "since", "until", "error"])))]
    Purge {
        /// Delete every dead letter.
        #[arg(long, conflicts_with_all = ["older_than", "destination", "topic", "since", "until", "error"])]
        all: bool,
        /// Delete those that failed longer ago than this (0s to 100 years; as --until with a
        /// duration).
        #[arg(long, value_name = "DUR", value_parser = retention(), allow_hyphen_values = true)]
        older_than: Option<Duration>,
        #[command(flatten)]
        filter: DeadLetterFilterArgs,
        /// Count what would be deleted, and delete nothing.
        #[arg(long)]
        dry_run: bool,
    },
}

/// Which dead letters a command takes: those every condition given holds for.
#[derive(Debug, Args)]
pub(crate) struct DeadLetterFilterArgs {
    /// Only those dead at this destination.
    #[arg(long, value_name = "NAME")]
    pub(crate) destination: Option<String>,
    /// Only those of a topic this pattern matches (`order.*`, `mail.#`).
    #[arg(long, value_name = "PATTERN")]
    pub(crate) topic: Option<String>,
    /// Only those that failed at this moment or later: an RFC 3339 time in UTC
    /// (2026-12-05T08:00:00Z) or how long ago (90m, 2h).
    #[arg(long, value_name = "TIME", value_parser = moment, allow_hyphen_values = true)]
    pub(crate) since: Option<std::time::SystemTime>,
    /// Only those that failed before this moment; as --since.
    #[arg(long, value_name = "TIME", value_parser = moment, allow_hyphen_values = true)]
    pub(crate) until: Option<std::time::SystemTime>,
    /// Only those whose last error contains this text, in any case ("timed out", "HTTP 410").
    #[arg(long, value_name = "TEXT")]
    pub(crate) error: Option<String>,
}

/// What `run` delivers to, and how.
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("destinations").required(true).multiple(true).args(["sink", "route", "config"])))]
pub(crate) struct RunArgs {
    /// Where every event goes: stdout, http://host[:port]/path, https://..., nats://host:port,
    /// amqp://user:pass@host:5672/vhost (RabbitMQ) or kafka://host:port[,host:port]. One
    /// destination, named `default`.
    #[arg(long, value_name = "SINK", conflicts_with_all = ["route", "config"])]
    pub(crate) sink: Option<String>,
    /// A destination: the events whose topic PATTERN matches go to SINK (repeatable; each event
    /// to every route that matches). NAME=PATTERN=SINK, or PATTERN=SINK to name it after its
    /// pattern. Patterns: words split on '.', '*' one word, '#' zero or more (order.*, order.#,
    /// #). The sink options below given after a --route apply to it alone; given before the
    /// first, to every route.
    #[arg(long, value_name = "NAME=PATTERN=SINK")]
    pub(crate) route: Vec<String>,
    /// A TOML file of destinations ([[destination]] with name, pattern, sink, and optionally
    /// format, signing_secrets, headers, timeout, rate_limit, concurrency, fixed_concurrency,
    /// subject_prefix, create_stream, exchange, cloudevents_source, kafka_topic, kafka_tls,
    /// kafka_ca_file, kafka_username, kafka_password, kafka_sasl_mechanism, kafka_properties);
    /// the flags give what it leaves out. Combines with --route.
    #[arg(long, value_name = "FILE")]
    pub(crate) config: Option<std::path::PathBuf>,
    /// Concurrent claimers (each claims its own batches; new events one claim at a time).
    #[arg(long, default_value_t = RelayConfig::DEFAULT_WORKERS, value_parser = parse_workers)]
    pub(crate) workers: usize,
    /// The most PostgreSQL connections this process opens: per destination a listener and
    /// 2 × --workers + 2 pooled, 3 for the relay's housekeeping and 2 for the command's own
    /// (the console, the checks); below that, fewer workers per destination, down to one
    /// (docs/operations.md, "Connections"). By default as many as the workers need.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub(crate) max_connections: Option<u32>,
    /// The most deliveries in progress at once, across all workers (HTTP requests in flight; a
    /// NATS or stdout batch counts once). The relay learns how many the destination takes, up to
    /// this, unless --fixed-concurrency.
    #[arg(long, default_value_t = RelayConfig::DEFAULT_CONCURRENCY, value_parser = parse_concurrency)]
    pub(crate) concurrency: usize,
    /// Keep --concurrency as a fixed limit instead of learning one up to it.
    #[arg(long)]
    pub(crate) fixed_concurrency: bool,
    /// At most so many events go to the destination, e.g. 200/s, 6000/m or 100000/h (a 429
    /// lowers it for a while). By default none.
    #[arg(long, value_name = "RATE", value_parser = parse_rate)]
    pub(crate) rate_limit: Option<f64>,
    /// When the head event of a key goes to the dead letters, hold the key's later events until
    /// the dead letter is retried or purged (by default they go on).
    #[arg(long)]
    pub(crate) dead_letter_holds_key: bool,
    /// Claim every event before delivering it, instead of delivering new events from their
    /// notification (the fast path: docs/design.md). For writers that turn notifications off
    /// (`set local outbox_relay.notify = off`, a prepared transaction) and share keys with others.
    #[arg(long)]
    pub(crate) no_fast_path: bool,
    /// Distinct events failing transiently in a row that open the outage breaker (0: never).
    #[arg(long, default_value_t = RelayConfig::DEFAULT_BREAKER_THRESHOLD)]
    pub(crate) breaker_threshold: u32,
    /// First wait before the open breaker probes the destination; doubles per failed probe,
    /// except after a refused connection (10ms to 1h).
    #[arg(long, value_name = "DUR", value_parser = duration_in(RelayConfig::MIN_BREAKER_PROBE, RelayConfig::MAX_BREAKER_PROBE), allow_hyphen_values = true, default_value = "250ms")]
    pub(crate) breaker_probe_min: Duration,
    /// Longest wait between probes (10ms to 1h, at least --breaker-probe-min).
    #[arg(long, value_name = "DUR", value_parser = duration_in(RelayConfig::MIN_BREAKER_PROBE, RelayConfig::MAX_BREAKER_PROBE), allow_hyphen_values = true, default_value = "1m")]
    pub(crate) breaker_probe_max: Duration,
    /// Events per claim.
    #[arg(long, default_value_t = RelayConfig::DEFAULT_BATCH_SIZE, value_parser = parse_batch_size)]
    pub(crate) batch_size: usize,
    /// Most bytes of payload per claim, past its first event (1KiB to 1GiB): events of megabytes
    /// are claimed a few at a time, so that memory follows this, not their size. A number of
    /// bytes, or with KiB, MiB, GiB, kB, MB or GB.
    #[arg(long, value_name = "SIZE", default_value = "8MiB", value_parser = parse_batch_bytes)]
    pub(crate) batch_bytes: usize,
    /// Fallback poll interval (NOTIFY wakes the relay at once; this covers lost notifications);
    /// 1ms to 1 day.
    #[arg(long, value_name = "DUR", value_parser = duration_in(RelayConfig::MIN_POLL_INTERVAL, RelayConfig::MAX_POLL_INTERVAL), allow_hyphen_values = true, default_value = "1s")]
    pub(crate) poll_interval: Duration,
    /// Delivery attempts before an event goes to the dead letters.
    #[arg(long, default_value_t = RelayConfig::DEFAULT_MAX_ATTEMPTS, value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) max_attempts: u32,
    /// First retry delay; doubles per attempt (1ms to 7 days).
    #[arg(long, value_name = "DUR", value_parser = duration_in(MILLISECOND, RelayConfig::MAX_BACKOFF), allow_hyphen_values = true, default_value = "1s")]
    pub(crate) backoff_base: Duration,
    /// Longest retry delay (1ms to 7 days, at least --backoff-base).
    #[arg(long, value_name = "DUR", value_parser = duration_in(MILLISECOND, RelayConfig::MAX_BACKOFF), allow_hyphen_values = true, default_value = "1h")]
    pub(crate) backoff_max: Duration,
    /// How long events every destination has passed stay in the outbox, for `replay`, a
    /// destination added with --since and `outbox_relay.event_state`; then they are removed in
    /// bulk. 0s removes them as soon as every destination has passed them (0s to 100 years).
    #[arg(long, value_name = "DUR", value_parser = retention(), allow_hyphen_values = true)]
    pub(crate) retention: Option<Duration>,
    /// Delete idempotency receipts older than this (0s to 100 years).
    #[arg(long, value_name = "DUR", value_parser = retention(), allow_hyphen_values = true, default_value = "7d")]
    pub(crate) idempotency_retention: Duration,
    /// How often the events of a claim still in delivery that are delivered already are
    /// recorded (0s to 1m; 0s: once the whole claim is delivered), so that a relay killed in a
    /// slow delivery sends again only what was in flight.
    #[arg(long, value_name = "DUR", value_parser = duration_in(Duration::ZERO, RelayConfig::MAX_HOLD), allow_hyphen_values = true, default_value = "20ms")]
    pub(crate) record_every: Duration,
    /// A destination of this relay that no relay serves for this long expires: what waits for it
    /// goes to its dead letters, and it no longer keeps events in the outbox (0s: never; up to
    /// 100 years). Warned of in the log, `status` and the metrics from half of it.
    #[arg(long, value_name = "DUR", value_parser = retention(), allow_hyphen_values = true, default_value = "7d")]
    pub(crate) destination_expiry: Duration,
    /// How long a claimed event belongs to its worker before another may take it (100ms to 1 day).
    #[arg(long, value_name = "DUR", value_parser = duration_in(RelayConfig::MIN_LEASE, RelayConfig::MAX_LEASE), allow_hyphen_values = true, default_value = "30s")]
    pub(crate) lease: Duration,
    /// How long a claim's transaction may stay open while its batch is delivered (its row locks
    /// hold the events, the fastest way); a longer delivery turns the claim into a lease. 0s
    /// leases every claim. 0s to 1m, shorter than --lease, and cut to half of --lease when
    /// longer than that. Defaults to 1s, or half of --lease when that is shorter.
    #[arg(long, value_name = "DUR", value_parser = duration_in(Duration::ZERO, RelayConfig::MAX_HOLD), allow_hyphen_values = true)]
    pub(crate) hold: Option<Duration>,
    /// No longer applies (delivery writes no outbox row: --retention says how long delivered
    /// events stay); `delete` is read as --retention 0s, `mark` changes nothing. Warned of.
    #[arg(long, value_enum, hide = true)]
    pub(crate) completion: Option<CompletionArg>,
    /// Time in-flight deliveries get to finish on shutdown (0s to 1h).
    #[arg(long, value_name = "DUR", value_parser = duration_in(Duration::ZERO, RelayConfig::MAX_SHUTDOWN_GRACE), allow_hyphen_values = true, default_value = "10s")]
    pub(crate) shutdown_grace: Duration,
    /// Timeout of one HTTP delivery (and of NATS connects and acknowledgements); 1ms to 1h.
    #[arg(long, value_name = "DUR", value_parser = duration_in(MILLISECOND, pg_outbox_relay::sink::MAX_TIMEOUT), allow_hyphen_values = true, default_value = "10s")]
    pub(crate) timeout: Duration,
    /// NATS subject prefix: events go to <PREFIX>.<topic>.
    #[arg(long, default_value = pg_outbox_relay::sink::DEFAULT_SUBJECT_PREFIX)]
    pub(crate) subject_prefix: String,
    /// Create (or reuse) a JetStream stream of this name capturing <PREFIX>.>.
    #[arg(long, value_name = "NAME")]
    pub(crate) create_stream: Option<String>,
    /// RabbitMQ sink: the exchange to publish to (declared as a durable topic exchange when
    /// missing); the routing key is the topic.
    #[arg(long, value_name = "NAME", default_value = pg_outbox_relay::sink::DEFAULT_EXCHANGE)]
    pub(crate) exchange: String,
    /// HTTP sink: a Standard Webhooks signing secret (whsec_...); give it again (or several,
    /// comma-separated, in the environment variable) to rotate: every secret signs. Never shown.
    #[arg(long = "signing-secret", env = "OUTBOX_RELAY_SIGNING_SECRETS", hide_env_values = true, value_delimiter = ',', value_name = "SECRET", value_parser = secret)]
    pub(crate) signing_secrets: Vec<Secret>,
    /// HTTP and Kafka sink: the event's JSON (raw), a CloudEvent in binary mode (cloudevents)
    /// or in structured mode (cloudevents-structured).
    #[arg(long, value_enum, default_value_t = FormatArg::Raw)]
    pub(crate) format: FormatArg,
    /// HTTP and Kafka sink: the CloudEvents source attribute (default urn:outbox-relay).
    #[arg(long, value_name = "URI")]
    pub(crate) cloudevents_source: Option<String>,
    /// HTTP sink: a header sent with every request, 'Name: value' (repeatable). Its value is
    /// never shown.
    #[arg(long = "header", value_name = "NAME: VALUE", value_parser = secret)]
    pub(crate) headers: Vec<Secret>,
    /// Kafka sink: the topic of an event, {topic} standing for the event's topic (e.g.
    /// outbox.{topic}; without {topic} every event goes to one topic).
    #[arg(long, value_name = "TEMPLATE", default_value = pg_outbox_relay::sink::DEFAULT_KAFKA_TOPIC)]
    pub(crate) kafka_topic: String,
    /// Kafka sink: TLS to the brokers, verified against the system's roots.
    #[arg(long)]
    pub(crate) kafka_tls: bool,
    /// Kafka sink: verify the brokers against the certificates of this PEM file (implies
    /// --kafka-tls).
    #[arg(long, value_name = "FILE")]
    pub(crate) kafka_ca_file: Option<std::path::PathBuf>,
    /// Kafka sink: the SASL user; the password comes from OUTBOX_RELAY_KAFKA_PASSWORD.
    #[arg(long, env = "OUTBOX_RELAY_KAFKA_USERNAME", value_name = "USER")]
    pub(crate) kafka_username: Option<String>,
    /// Kafka sink: the SASL password. Set it in the environment: a flag's value is visible to
    /// every user of the machine. Never shown.
    #[arg(long, env = "OUTBOX_RELAY_KAFKA_PASSWORD", hide_env_values = true, value_name = "PASSWORD", value_parser = secret)]
    pub(crate) kafka_password: Option<Secret>,
    /// Kafka sink: the SASL mechanism (plain, scram-sha-256, scram-sha-512; scram-sha-512 when
    /// not given).
    #[arg(long, value_name = "MECHANISM", value_parser = sasl_mechanism)]
    pub(crate) kafka_sasl_mechanism: Option<pg_outbox_relay::sink::SaslMechanism>,
    /// Kafka sink: a librdkafka producer property, NAME=VALUE (repeatable; e.g.
    /// compression.type=lz4). Its value is never shown.
    #[arg(long = "kafka-property", value_name = "NAME=VALUE", value_parser = secret)]
    pub(crate) kafka_properties: Vec<Secret>,
    /// Apply pending migrations before starting.
    #[arg(long)]
    pub(crate) migrate: bool,
    /// Exit at once (status 1) when the database cannot be reached at start. By default the
    /// relay waits for it, trying again with backoff and saying so, and starts delivering once it
    /// answers (/readyz answers 503 meanwhile); a database that answers with an error
    /// (migrations not applied, a wrong password, no such database) ends the command either way.
    #[arg(long)]
    pub(crate) exit_on_database_error: bool,
    /// Exit at once (status 1) when a sink's broker (NATS, RabbitMQ, Kafka) does not answer at
    /// start. By default the relay starts without it: that destination's events wait (spending
    /// no attempt) and it connects at a later delivery, as after an outage, while the other
    /// destinations deliver. A broker that refuses the login ends the command either way.
    #[arg(long)]
    pub(crate) exit_on_sink_error: bool,
    /// The flags given after each `--route`, which apply to it alone (see `route_flags.rs`).
    #[arg(skip)]
    pub(crate) route_flags: Vec<crate::args::RouteFlags>,
    /// Serve /metrics, /healthz, /readyz and the console here: an IP address and a port, e.g.
    /// 127.0.0.1:9187 (off by default).
    #[arg(long, value_name = "ADDR")]
    pub(crate) http: Option<std::net::SocketAddr>,
    /// Token the console needs (its pages, API and actions; not /metrics or the probes); without
    /// one the console is served on loopback addresses only. At least 16 characters; never
    /// logged.
    #[arg(long, env = "OUTBOX_RELAY_HTTP_TOKEN", hide_env_values = true, value_name = "TOKEN", value_parser = secret)]
    pub(crate) http_token: Option<Secret>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum FormatArg {
    /// The event's JSON object.
    Raw,
    /// CloudEvents binary mode: ce-* headers, the payload as the body.
    Cloudevents,
    /// CloudEvents structured mode: one application/cloudevents+json object.
    CloudeventsStructured,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum CompletionArg {
    /// Kept delivered rows (now: the retention does).
    Mark,
    /// Deleted delivered rows at once (now: --retention 0s).
    Delete,
}

/// The flags given after one `--route`, parsed.
#[derive(Debug)]
pub(crate) struct RouteFlags {
    /// Which `--route` (0 for the first).
    pub(crate) route: usize,
    /// The ids of [`PER_ROUTE`](crate::route_flags::PER_ROUTE) given for it.
    pub(crate) given: Vec<String>,
    /// Their values (every other field as clap's default has it).
    pub(crate) args: Box<RunArgs>,
}
