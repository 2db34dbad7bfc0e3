//! The body of each command.

use pg_outbox_relay::sink::{EventFormat, Secret, Sink, StdoutSink};
use pg_outbox_relay::{DatabaseUrl, Outbox, Relay, RelayConfig, Route, TopicPattern};

use crate::args::{
    Cli, Command, CompletionArg, DeadLetterCommand, DeadLetterFilterArgs, DestinationCommand, FormatArg, RouteFlags,
    RunArgs,
};
use crate::outcome::{CliError, UsageError};
use crate::signals::{Asked, SIGHUP_IGNORED, Signals, shutdown_signal};
use crate::sinks::{KafkaOptions, SinkOptions, kafka_properties};

pub(crate) async fn run(cli: Cli) -> Result<(), CliError> {
    let timeout = cli.db_timeout;
    let require_url = |url: Option<String>| require_url(url, timeout);
    match cli.command {
        Command::Demo(args) => crate::demo::run(args, cli.database_url).await,
        Command::Bench(args) => crate::bench::run(args, cli.database_url).await,
        Command::Migrate => migrate(&require_url(cli.database_url)?).await,
        Command::Run(args) => run_relay(&require_url(cli.database_url)?, *args).await,
        Command::Status { json } => status(&require_url(cli.database_url)?, json).await,
        Command::DeadLetters(command) => dead_letters(&require_url(cli.database_url)?, command).await,
        Command::Pause { topic, destination, unregistered } => {
            refuse_empty("--topic", &topic)?;
            refuse_empty("--destination", &destination)?;
            let outbox = connect(&require_url(cli.database_url)?).await?;
            if let Some(name) = destination.as_deref().filter(|_| !unregistered) {
                refuse_unknown_destination(&outbox, name).await?;
            }
            let what = paused_what(topic.as_deref(), destination.as_deref());
            if outbox.pause_destination(destination.as_deref().unwrap_or(""), topic.as_deref()).await? {
                out!(
                    "paused {what}: the relays on this database stop claiming its events within moments (a batch already claimed is still delivered), until `outbox-relay resume{}`",
                    resume_flags(&topic, &destination)
                );
            } else {
                out!("{what} was paused already");
            }
            Ok(())
        }
        Command::Resume { topic, destination } => {
            refuse_empty("--topic", &topic)?;
            refuse_empty("--destination", &destination)?;
            let outbox = connect(&require_url(cli.database_url)?).await?;
            let what = paused_what(topic.as_deref(), destination.as_deref());
            if outbox.resume_destination(destination.as_deref().unwrap_or(""), topic.as_deref()).await? {
                out!("resumed {what}");
            } else {
                out!("{what} was not paused");
            }
            let left = outbox.pauses().await?;
            if !left.is_empty() {
                let names: Vec<String> =
                    left.iter().map(|p| paused_what(p.topic.as_deref(), p.destination.as_deref())).collect();
                out!("still paused: {}", names.join(", "));
            }
            Ok(())
        }
        Command::Destinations(command) => destinations(&require_url(cli.database_url)?, command).await,
        Command::Replay { destination, since, until, topic, dry_run } => {
            let topic = topic.as_deref().map(TopicPattern::parse).transpose()?;
            let outbox = connect(&require_url(cli.database_url)?).await?;
            let range = format!(
                "created from {} to {}{}",
                humantime::format_rfc3339_seconds(since),
                until.map_or("now".to_string(), |u| humantime::format_rfc3339_seconds(u).to_string()),
                topic.as_ref().map_or(String::new(), |t| format!(" with a topic {t} matches"))
            );
            let name = crate::outcome::one_line(&destination);
            if dry_run {
                let n = outbox.replay_count(&destination, since, until, topic.as_ref()).await?;
                out!("would replay {n} events {range} to destination {name} (dry run: nothing sent)");
            } else {
                let n = outbox.replay(&destination, since, until, topic.as_ref()).await?;
                out!(
                    "replaying {n} events {range} to destination {name}: they wait in its parked events, in order per key"
                );
            }
            Ok(())
        }
        Command::Console { listen, http_token } => {
            let outbox = connect(&require_url(cli.database_url)?).await?;
            let shutdown = shutdown_signal()?;
            let (listener, console) = crate::http::bind(listen, &outbox, None, http_token).await?;
            let stop = tokio_util::sync::CancellationToken::new();
            let server = tokio::spawn(crate::http::serve(listener, console, stop.clone()));
            shutdown.await;
            stop.cancel();
            let _ = server.await;
            Ok(())
        }
        Command::Completions { shell } => {
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut <Cli as clap::CommandFactory>::command(), "outbox-relay", &mut script);
            out!("{}", String::from_utf8_lossy(&script).trim_end());
            Ok(())
        }
        Command::Man { dir } => manual(dir.as_deref()),
        Command::Cleanup { retention, idempotency_retention } => {
            let outbox = connect(&require_url(cli.database_url)?).await?;
            let report = outbox
                .cleanup(retention, idempotency_retention, pg_outbox_relay::RelayConfig::DEFAULT_JANITOR_BATCH)
                .await?;
            out!(
                "removed {} events every destination passed older than {} and {} idempotency receipts older than {}",
                report.events,
                humantime::format_duration(retention),
                report.receipts,
                humantime::format_duration(idempotency_retention)
            );
            Ok(())
        }
    }
}

/// The manual page on stdout, or one page per command written into `dir`.
fn manual(dir: Option<&std::path::Path>) -> Result<(), CliError> {
    let command = <Cli as clap::CommandFactory>::command();
    let Some(dir) = dir else {
        let mut page = Vec::new();
        clap_mangen::Man::new(command).render(&mut page).map_err(|e| format!("cannot render the manual page: {e}"))?;
        out!("{}", String::from_utf8_lossy(&page).trim_end());
        return Ok(());
    };
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    clap_mangen::generate_to(command, dir)
        .map_err(|e| format!("cannot write the manual pages into {}: {e}", dir.display()))?;
    out!("wrote the manual pages into {}", dir.display());
    Ok(())
}

/// The database a command works on, and the bound on each of its waits for it (`--db-timeout`).
pub(crate) struct Database {
    url: DatabaseUrl,
    timeout: std::time::Duration,
}

impl std::fmt::Display for Database {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.url.fmt(f)
    }
}

impl Database {
    /// An outbox with a pool of `pool_size`, its operations bounded by `--db-timeout` (making a
    /// connection, by the URL's `connect_timeout`).
    async fn open(&self, pool_size: usize) -> Result<Outbox, CliError> {
        Ok(Outbox::connect_with(self.url.clone(), pool_size).await?.with_timeout(self.timeout))
    }
}

/// libpq's variables that name a database without a URL, as `psql` takes them.
const LIBPQ_TARGET: [&str; 4] = ["PGHOST", "PGPORT", "PGDATABASE", "PGUSER"];

fn require_url(url: Option<String>, timeout: std::time::Duration) -> Result<Database, CliError> {
    match url.filter(|u| !u.is_empty()) {
        Some(url) => Ok(Database { url: DatabaseUrl::parse(&url)?, timeout }),
        // No URL, but libpq's environment names a server or database: everything from it.
        None if LIBPQ_TARGET.iter().any(|name| std::env::var_os(name).is_some_and(|v| !v.is_empty())) => {
            Ok(Database { url: DatabaseUrl::parse("")?, timeout })
        }
        None => Err(UsageError(
            "no database given: pass --database-url URL, set DATABASE_URL, or set libpq's PGHOST, PGDATABASE, ..."
                .into(),
        )
        .into()),
    }
}

/// An outbox on `db` whose schema this version can work with (every migration applied, and the
/// role may use it), or an error that says what to do.
async fn connect(db: &Database) -> Result<Outbox, CliError> {
    let outbox = db.open(4).await?;
    outbox.check_schema().await?;
    Ok(outbox)
}

async fn migrate(db: &Database) -> Result<(), CliError> {
    let outbox = db.open(1).await?;
    let report = outbox.migrate().await?;
    for (version, name) in &report.applied {
        out!("applied {version:04}_{name}");
    }
    if report.applied.is_empty() {
        out!("nothing to apply: {} migrations already applied to {db}", report.already_applied);
    } else {
        out!("{} applied, {} already in place, on {db}", report.applied.len(), report.already_applied);
    }
    Ok(())
}

/// Refuses a flag given an empty value (`--topic ''`): a bad argument, before any connection.
fn refuse_empty(flag: &str, value: &Option<String>) -> Result<(), UsageError> {
    match value.as_deref() {
        Some("") => Err(UsageError(format!("{flag} must not be empty (leave it out for every one)"))),
        _ => Ok(()),
    }
}

/// Refuses a destination no relay registered (a typo would pause nothing, silently), naming
/// those that are.
async fn refuse_unknown_destination(outbox: &pg_outbox_relay::Outbox, name: &str) -> Result<(), CliError> {
    let known = outbox.destination_names().await?;
    if known.iter().any(|k| k == name) {
        return Ok(());
    }
    let registered = if known.is_empty() {
        "none is registered yet".to_string()
    } else {
        format!("registered: {}", known.iter().map(|k| format!("{k:?}")).collect::<Vec<_>>().join(", "))
    };
    Err(UsageError(format!(
        "no destination is named {name:?} ({registered}); a relay registers its routes when it starts (`outbox-relay destinations add` registers one before); to pause one before its first start, add --unregistered"
    ))
    .into())
}

/// The sink settings `args` give (the defaults of every destination, or one route's own).
fn sink_options(args: &RunArgs) -> Result<SinkOptions, CliError> {
    let mut headers = Vec::with_capacity(args.headers.len());
    for header in &args.headers {
        // Split here, not in clap: its errors would show the value (a token, say).
        let Some((name, value)) = header.expose().split_once(':') else {
            return Err(UsageError("a --header must look like 'Name: value' (one had no colon)".into()).into());
        };
        headers.push((name.trim().to_string(), Secret::new(value.trim())));
    }
    Ok(SinkOptions {
        timeout: args.timeout,
        subject_prefix: args.subject_prefix.clone(),
        create_stream: args.create_stream.clone(),
        exchange: args.exchange.clone(),
        signing_secrets: args.signing_secrets.clone(),
        format: match args.format {
            FormatArg::Raw => EventFormat::Raw,
            FormatArg::Cloudevents => EventFormat::CloudEventsBinary,
            FormatArg::CloudeventsStructured => EventFormat::CloudEventsStructured,
        },
        cloudevents_source: args.cloudevents_source.clone(),
        headers,
        kafka: KafkaOptions {
            topic: args.kafka_topic.clone(),
            tls: args.kafka_tls,
            ca_file: args.kafka_ca_file.clone(),
            sasl_mechanism: args.kafka_sasl_mechanism,
            username: args.kafka_username.clone(),
            password: args.kafka_password.clone(),
            properties: kafka_properties(&args.kafka_properties)?,
        },
    })
}

/// Gives the route the settings of the flags that followed it (see `route_flags.rs`).
fn apply_route_flags(route: &mut crate::routes::Destination, flags: &RouteFlags) -> Result<(), CliError> {
    let own = sink_options(&flags.args)?;
    let options = &mut route.options;
    for id in &flags.given {
        match id.as_str() {
            "timeout" => options.timeout = own.timeout,
            "subject_prefix" => options.subject_prefix = own.subject_prefix.clone(),
            "create_stream" => options.create_stream = own.create_stream.clone(),
            "exchange" => options.exchange = own.exchange.clone(),
            "signing_secrets" => options.signing_secrets = own.signing_secrets.clone(),
            "format" => options.format = own.format,
            "cloudevents_source" => options.cloudevents_source = own.cloudevents_source.clone(),
            "headers" => options.headers = own.headers.clone(),
            "kafka_topic" => options.kafka.topic = own.kafka.topic.clone(),
            "kafka_tls" => options.kafka.tls = own.kafka.tls,
            "kafka_ca_file" => options.kafka.ca_file = own.kafka.ca_file.clone(),
            "kafka_username" => options.kafka.username = own.kafka.username.clone(),
            "kafka_password" => options.kafka.password = own.kafka.password.clone(),
            "kafka_sasl_mechanism" => options.kafka.sasl_mechanism = own.kafka.sasl_mechanism,
            "kafka_properties" => options.kafka.properties = own.kafka.properties.clone(),
            "concurrency" => route.concurrency = Some(flags.args.concurrency),
            "fixed_concurrency" => route.fixed_concurrency = Some(flags.args.fixed_concurrency),
            "rate_limit" => route.rate_limit = flags.args.rate_limit,
            other => unreachable!("{other} is not a per-route flag"),
        }
    }
    Ok(())
}

async fn run_relay(db: &Database, args: RunArgs) -> Result<(), CliError> {
    let mut signals = Signals::install()?;
    if args.backoff_max < args.backoff_base {
        return Err(UsageError(format!(
            "--backoff-max ({}) is shorter than --backoff-base ({})",
            humantime::format_duration(args.backoff_max),
            humantime::format_duration(args.backoff_base)
        ))
        .into());
    }
    if args.breaker_probe_max < args.breaker_probe_min {
        return Err(UsageError(format!(
            "--breaker-probe-max ({}) is shorter than --breaker-probe-min ({})",
            humantime::format_duration(args.breaker_probe_max),
            humantime::format_duration(args.breaker_probe_min)
        ))
        .into());
    }
    match args.completion {
        Some(CompletionArg::Delete) if args.retention.is_none() => tracing::warn!(
            "--completion no longer applies: delivery writes no outbox row, and --retention says how long delivered \
             events stay (default 1h); --completion delete is read as --retention 0s"
        ),
        Some(_) => tracing::warn!(
            "--completion no longer applies: delivery writes no outbox row, and --retention says how long delivered \
             events stay (default 1h); drop the flag"
        ),
        None => {}
    }
    let config = RelayConfig {
        workers: args.workers,
        concurrency: args.concurrency,
        fixed_concurrency: args.fixed_concurrency,
        rate_limit: args.rate_limit,
        dead_letter_holds_key: args.dead_letter_holds_key,
        fast_path: !args.no_fast_path,
        breaker_threshold: args.breaker_threshold,
        breaker_probe_min: args.breaker_probe_min,
        breaker_probe_max: args.breaker_probe_max,
        batch_size: args.batch_size,
        batch_bytes: args.batch_bytes,
        poll_interval: args.poll_interval,
        lease: args.lease,
        hold: args.hold.unwrap_or(RelayConfig::DEFAULT_HOLD.min(args.lease / 2)),
        max_attempts: args.max_attempts,
        backoff_base: args.backoff_base,
        backoff_max: args.backoff_max,
        retention: match (args.retention, args.completion) {
            (Some(retention), _) => retention,
            (None, Some(CompletionArg::Delete)) => std::time::Duration::ZERO,
            (None, _) => RelayConfig::DEFAULT_RETENTION,
        },
        idempotency_retention: args.idempotency_retention,
        destination_expiry: args.destination_expiry,
        record_every: args.record_every,
        shutdown_grace: args.shutdown_grace,
        ..RelayConfig::default()
    };
    config.validate()?;
    let defaults = sink_options(&args)?;
    // The sinks first: a bad spec is refused before anything touches the database.
    let destinations = destinations_of(&args, &defaults)?;
    let (routes, shown) = routes_of(destinations.clone(), args.exit_on_sink_error).await?;
    let (config, own_pool) = within_max_connections(config, args.max_connections, routes.len())?;
    let outbox = Outbox::connect_lazy(db.url.clone(), own_pool)?.with_timeout(db.timeout);
    let relay = Relay::with_routes(&outbox, config.clone(), routes)?;
    let stop_http = tokio_util::sync::CancellationToken::new();
    let console = match args.http {
        Some(addr) => {
            let metrics = relay.destination_metrics();
            let (listener, console) = crate::http::bind(addr, &outbox, Some(metrics), args.http_token.clone()).await?;
            Some((tokio::spawn(crate::http::serve(listener, console.clone(), stop_http.clone())), console))
        }
        None => None,
    };
    let started = {
        let stopped =
            signals.stopped("the relay waits for its database (SIGHUP reloads --config only once it delivers)");
        let mut stopped = std::pin::pin!(stopped);
        wait_for_database(db, &outbox, args.migrate, args.exit_on_database_error, stopped.as_mut()).await
    };
    let reload = Reload { args: &args, defaults: &defaults, outbox: &outbox, config: &config };
    let ran = match started {
        Ok(true) => {
            let running = Running { relay, shown, destinations, previous: None };
            reload.deliver(running, &mut signals, console.as_ref().map(|(_, c)| &**c)).await
        }
        Ok(false) => Ok(()),
        Err(e) => Err(e),
    };
    stop_http.cancel();
    if let Some((server, _)) = console {
        let _ = tokio::time::timeout(std::time::Duration::from_secs(3), server).await;
    }
    ran?;
    Ok(())
}

/// The connections `run` keeps for itself (the console's pages, the waits for the database)
/// when --max-connections bounds them.
const COMMAND_CONNECTIONS: usize = 2;

/// The relay's configuration within `--max-connections` (what is left after the command's own),
/// and the size of the command's own pool.
fn within_max_connections(
    mut config: RelayConfig,
    max: Option<u32>,
    destinations: usize,
) -> Result<(RelayConfig, usize), CliError> {
    let Some(max) = max.map(|m| m as usize) else { return Ok((config.clone(), config.workers + 2)) };
    let least = RelayConfig::connections_needed(destinations, 1) + COMMAND_CONNECTIONS;
    if max < least {
        return Err(UsageError(format!(
            "--max-connections {max} is too few for {destinations} destinations: `run` needs at least {least} (per destination a listener and 4 pooled for one worker, 3 for the relay's housekeeping, {COMMAND_CONNECTIONS} for the command)"
        ))
        .into());
    }
    config.max_connections = Some(max - COMMAND_CONNECTIONS);
    Ok((config, COMMAND_CONNECTIONS))
}

/// The destinations `args` give: `--sink`, the `--config` file as it reads now, `--route` with
/// the flags that follow each.
fn destinations_of(args: &RunArgs, defaults: &SinkOptions) -> Result<Vec<crate::routes::Destination>, CliError> {
    let mut destinations = Vec::new();
    if let Some(sink) = &args.sink {
        destinations.push(crate::routes::single(sink.clone(), defaults.clone()));
    }
    if let Some(path) = &args.config {
        destinations.extend(crate::routes::read_file(path, defaults)?);
    }
    let mut routes_given = Vec::with_capacity(args.route.len());
    for spec in &args.route {
        routes_given.push(crate::routes::parse_route(spec, defaults)?);
    }
    for flags in &args.route_flags {
        apply_route_flags(&mut routes_given[flags.route], flags)?;
    }
    destinations.extend(routes_given);
    Ok(destinations)
}

/// The routes of `destinations`, their sinks connected, and each as the log shows it.
async fn routes_of(
    destinations: Vec<crate::routes::Destination>,
    exit_on_sink_error: bool,
) -> Result<(Vec<Route<Sink>>, Vec<String>), CliError> {
    let mut routes = Vec::with_capacity(destinations.len());
    let mut shown = Vec::with_capacity(destinations.len());
    for destination in destinations {
        let (route, described) = destination.route(exit_on_sink_error).await?;
        routes.push(route);
        shown.push(described);
    }
    Ok((routes, shown))
}

/// What `run` needs to make a relay again when SIGHUP asks it to read `--config` again.
struct Reload<'a> {
    args: &'a RunArgs,
    defaults: &'a SinkOptions,
    outbox: &'a Outbox,
    config: &'a RelayConfig,
}

/// A relay about to run, what it was made of, and, after a reload, what the relay before it was
/// made of (to go back to if the new routes are refused when they register).
struct Running {
    relay: Relay<Sink>,
    shown: Vec<String>,
    destinations: Vec<crate::routes::Destination>,
    previous: Option<Vec<crate::routes::Destination>>,
}

impl Reload<'_> {
    /// Delivers until SIGINT or SIGTERM. On SIGHUP with `--config`, reads the file again; when
    /// it makes a relay (every route valid, every sink built), the running relay stops as at
    /// SIGTERM (it lets its deliveries finish and records them: nothing is delivered twice) and
    /// the new one takes over, its counters in `console`. A file that does not make one is logged
    /// and changes nothing; new routes refused when they register (a pattern change of a
    /// destination another process serves) are logged, and the routes before them run again.
    async fn deliver(
        &self,
        mut running: Running,
        signals: &mut Signals,
        console: Option<&crate::console::Console>,
    ) -> Result<(), CliError> {
        loop {
            let reload = if self.args.config.is_some() { ", reload --config with SIGHUP" } else { "" };
            tracing::info!(destinations = %running.shown.join("; "), "delivering; stop with SIGINT or SIGTERM{reload}");
            if let Some(console) = console {
                console.set_destinations(running.relay.destination_metrics());
            }
            let mut next = None;
            let mut stdout_closed = false;
            let asked = async {
                loop {
                    if let Asked::Stop = signals.next().await {
                        return;
                    }
                    if self.args.config.is_none() {
                        tracing::warn!("{SIGHUP_IGNORED}");
                        continue;
                    }
                    // A SIGTERM while the new sinks connect stops the relay at once.
                    let made = tokio::select! {
                        made = self.relay() => made,
                        asked = signals.next() => match asked {
                            Asked::Stop => return,
                            Asked::Reload => {
                                tracing::warn!("SIGHUP received while --config was being read again; send it again once it is");
                                continue;
                            }
                        },
                    };
                    match made {
                        Ok(made) => {
                            next = Some(made);
                            return;
                        }
                        Err(e) => tracing::error!(
                            error = %crate::outcome::one_line(&e.to_string()),
                            "SIGHUP: --config was not reloaded; the relay goes on with the routes it has"
                        ),
                    }
                }
            };
            // A stdout sink whose reader went away can deliver nothing more: the relay stops (its
            // other destinations too: the process ends), and the command fails, so that whatever
            // started the pipeline sees it.
            let to_stdout = running.destinations.iter().any(|d| crate::sinks::is_stdout(&d.sink));
            let until = async {
                tokio::select! {
                    () = asked => {}
                    () = StdoutSink::closed(), if to_stdout => stdout_closed = true,
                }
            };
            let ran = running.relay.run(until).await;
            running = match (ran, next, running.previous) {
                (Ok(()), None, _) if stdout_closed => return Err(STDOUT_CLOSED.into()),
                (Ok(()), None, _) => return Ok(()),
                (Ok(()), Some((relay, shown, destinations)), _) => {
                    tracing::info!("SIGHUP: --config reloaded; the relay with the new routes takes over");
                    Running { relay, shown, destinations, previous: Some(running.destinations) }
                }
                (Err(e), _, Some(previous)) if e.kind() == pg_outbox_relay::ErrorKind::Config => {
                    tracing::error!(
                        error = %crate::outcome::one_line(&e.to_string()),
                        "SIGHUP: the reloaded routes were refused; the relay goes on with the routes it had"
                    );
                    let (routes, shown) = routes_of(previous.clone(), self.args.exit_on_sink_error).await?;
                    let relay = Relay::with_routes(self.outbox, self.config.clone(), routes)?;
                    Running { relay, shown, destinations: previous, previous: None }
                }
                (Err(e), _, _) => return Err(e.into()),
            };
        }
    }

    /// A relay with the routes of the file as it reads now, and what it was made of.
    async fn relay(&self) -> Result<(Relay<Sink>, Vec<String>, Vec<crate::routes::Destination>), CliError> {
        let destinations = destinations_of(self.args, self.defaults)?;
        // (--max-connections checked again: the file may give more destinations now)
        let unbounded = RelayConfig { max_connections: None, ..self.config.clone() };
        let (config, _) = within_max_connections(unbounded, self.args.max_connections, destinations.len())?;
        let (routes, shown) = routes_of(destinations.clone(), self.args.exit_on_sink_error).await?;
        Ok((Relay::with_routes(self.outbox, config, routes)?, shown, destinations))
    }
}

/// Why `run` stopped when standard output, a destination's sink, was closed.
const STDOUT_CLOSED: &str = "standard output was closed (its reader went away), so the stdout sink can deliver \
     nothing more: the relay stopped. The events it could not write wait in the outbox for the next run (those \
     written into the pipe before its reader left count as delivered)";

/// The longest pause between two tries of a database that cannot be reached at start.
const DATABASE_WAIT_MAX: std::time::Duration = std::time::Duration::from_secs(5);

/// Makes sure the database is ready for the relay (its migrations applied, with `--migrate`, or
/// checked), waiting for it while it cannot be reached (refused, timed out, starting up, out of
/// connection slots), unless `exit_at_once`: a relay started beside its database, or by a
/// supervisor while the database is down, starts delivering once it answers, without a restart.
/// False when `shutdown` came first. Any other answer (a wrong password, no such database), and
/// any failure of the migrations or of the check once it answers, is an error at once.
async fn wait_for_database(
    db: &Database,
    outbox: &Outbox,
    migrate: bool,
    exit_at_once: bool,
    mut shutdown: std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
) -> Result<bool, CliError> {
    use tokio_postgres::error::SqlState;
    let mut failures: u32 = 0;
    let mut said = None;
    loop {
        // Only reaching it is waited for: a migration or a check that fails or times out on a
        // database that answers is an error (run again, a migration would start over).
        let e = match outbox.ping().await {
            Ok(()) => {
                if failures > 0 {
                    tracing::info!(database = %db, "the database answers; the relay starts");
                }
                if migrate {
                    outbox.migrate().await?;
                } else {
                    outbox.check_schema().await?;
                }
                return Ok(true);
            }
            Err(e) => e,
        };
        let away = e.is_connect()
            || e.code()
                .is_some_and(|code| *code == SqlState::CANNOT_CONNECT_NOW || *code == SqlState::TOO_MANY_CONNECTIONS);
        if !away || exit_at_once {
            return Err(e.into());
        }
        failures += 1;
        let pause = DATABASE_WAIT_MAX.min(std::time::Duration::from_millis(100) * 2u32.saturating_pow(failures.min(8)));
        // Said at once, then every half minute or so.
        if said.is_none_or(|at: tokio::time::Instant| at.elapsed() >= std::time::Duration::from_secs(30)) {
            said = Some(tokio::time::Instant::now());
            tracing::warn!(
                database = %db,
                error = %crate::outcome::one_line(&e.to_string()),
                "the database cannot be reached; waiting for it, trying again every {} at most (nothing is delivered \
                 meanwhile; --exit-on-database-error exits instead)",
                humantime::format_duration(DATABASE_WAIT_MAX)
            );
        }
        tokio::select! {
            () = tokio::time::sleep(pause) => {}
            () = shutdown.as_mut() => {
                tracing::info!("relay stopped before the database answered");
                return Ok(false);
            }
        }
    }
}

fn resume_flags(topic: &Option<String>, destination: &Option<String>) -> String {
    let topic = topic.as_deref().map_or(String::new(), |t| format!(" --topic {t}"));
    let destination = destination.as_deref().map_or(String::new(), |d| format!(" --destination {d}"));
    format!("{topic}{destination}")
}

/// What a pause holds back, in words.
fn paused_what(topic: Option<&str>, destination: Option<&str>) -> String {
    let topic = topic.map_or("every topic".to_string(), |t| format!("topic {}", crate::outcome::one_line(t)));
    match destination {
        Some(d) => format!("{topic} at destination {}", crate::outcome::one_line(d)),
        None => topic,
    }
}

async fn destinations(db: &Database, command: DestinationCommand) -> Result<(), CliError> {
    let outbox = connect(db).await?;
    match command {
        DestinationCommand::List { json } => {
            let destinations = outbox.destinations().await?;
            if json {
                out!("{}", serde_json::to_string(&destinations)?);
                return Ok(());
            }
            if destinations.is_empty() {
                out!("no destination registered yet: a relay registers the ones it delivers to when it starts");
                return Ok(());
            }
            print_destinations(&destinations);
        }
        DestinationCommand::Add { name, pattern, since } => {
            let pattern = TopicPattern::parse(&pattern)?;
            let replayed = outbox.add_destination(&name, &pattern, since).await?;
            let name = crate::outcome::one_line(&name);
            match since {
                Some(since) => out!(
                    "added destination {name} (pattern {pattern}), starting at {}: {replayed} retained events wait for it; start a relay with --route '{name}={pattern}=<sink>'",
                    humantime::format_rfc3339_seconds(since)
                ),
                None => out!(
                    "added destination {name} (pattern {pattern}), starting with the events no destination has passed; start a relay with --route '{name}={pattern}=<sink>'"
                ),
            }
        }
        DestinationCommand::Drop { name } => {
            let buried = outbox.drop_destination(&name).await?;
            out!(
                "dropped destination {}: {buried} events that waited for it went to its dead letters",
                crate::outcome::one_line(&name)
            );
        }
    }
    Ok(())
}

/// The destinations as a table.
fn print_destinations(destinations: &[pg_outbox_relay::DestinationStats]) {
    out!(
        "{:<20}  {:<20}  {:>8}  {:>8}  {:>8}  {:>9}  {:>6}  {:>8}  {:>6}  {:<16}  served",
        "destination",
        "pattern",
        "new",
        "due",
        "delayed",
        "in flight",
        "dead",
        "attempts",
        "relays",
        "position moved"
    );
    for d in destinations {
        let rounded = crate::console::rounded;
        let moved = d.position_age.map_or("-".to_string(), |age| format!("{} ago", rounded(age)));
        let served = match (d.relays, d.unserved, d.expires_in) {
            (1.., _, _) => "now".to_string(),
            (_, Some(unserved), Some(expires)) => {
                format!("{} ago, expires in {}", rounded(unserved), rounded(expires))
            }
            (_, Some(unserved), None) => format!("{} ago", rounded(unserved)),
            (_, None, _) => "never".to_string(),
        };
        let paused = if d.paused { "  PAUSED" } else { "" };
        out!(
            "{:<20}  {:<20}  {:>8}  {:>8}  {:>8}  {:>9}  {:>6}  {:>8}  {:>6}  {moved:<16}  {served}{paused}",
            crate::outcome::one_line(&d.name),
            if d.registered { crate::outcome::one_line(&d.pattern) } else { "(not registered)".to_string() },
            d.new,
            d.due,
            d.delayed,
            d.in_flight,
            d.dead_letters,
            d.max_attempts,
            d.relays
        );
    }
}

/// How many of the most common errors of pending events `status` shows.
const STATUS_ERRORS: i64 = 5;

async fn status(db: &Database, json: bool) -> Result<(), CliError> {
    let outbox = connect(db).await?;
    let stats = outbox.queue_stats().await?;
    let errors = outbox.pending_errors(STATUS_ERRORS).await?;
    let relays = outbox.connected_relays().await?;
    let pauses = outbox.pauses().await?;
    let health = outbox.health().await?;
    let destinations = outbox.destinations().await?;
    let mut warnings = crate::console::queue_warnings(&stats, &pauses, &relays);
    warnings.extend(crate::console::destination_warnings(&destinations));
    warnings.extend(health.warnings());
    if json {
        #[derive(serde::Serialize)]
        struct Status<'a> {
            #[serde(flatten)]
            stats: &'a pg_outbox_relay::QueueStats,
            errors: &'a [pg_outbox_relay::ErrorCount],
            relays: &'a [pg_outbox_relay::ConnectedRelay],
            destinations: &'a [pg_outbox_relay::DestinationStats],
            pauses: &'a [pg_outbox_relay::Pause],
            health: &'a pg_outbox_relay::Health,
            warnings: &'a [String],
        }
        let status = Status {
            stats: &stats,
            errors: &errors,
            relays: &relays,
            destinations: &destinations,
            pauses: &pauses,
            health: &health,
            warnings: &warnings,
        };
        out!("{}", serde_json::to_string(&status)?);
        return Ok(());
    }
    let age = |age: Option<std::time::Duration>| {
        age.map(|age| humantime::format_duration(age).to_string()).unwrap_or_else(|| "-".into())
    };
    let waiting = relays.iter().filter(|r| r.waiting).count();
    out!("pending (ready)           {}", stats.pending);
    out!("pending (held by key)     {}", stats.held_by_key);
    out!("pending (delayed)         {}", stats.delayed);
    out!("in flight                 {}", stats.in_flight);
    out!("retained (all passed)     {}", stats.retained);
    out!("dead letters              {}", stats.dead_letters);
    out!("oldest pending            {}", age(stats.oldest_pending_age));
    out!("oldest ready (lag)        {}", age(stats.oldest_ready_age));
    out!("highest attempts          {}", stats.max_attempts);
    out!("notification queue usage  {:.6}", stats.notification_queue_usage);
    out!("oldest open transaction   {}", age(health.oldest_transaction_age));
    out!(
        "xmin horizon age          {}",
        health.xmin_horizon_age.map_or("-".to_string(), |a| format!("{a} transactions"))
    );
    out!("outbox dead tuples        {} ({} live)", health.outbox_dead_tuples, health.outbox_live_tuples);
    if pauses.is_empty() {
        out!("paused                    nothing");
    } else {
        let names: Vec<String> =
            pauses.iter().map(|p| paused_what(p.topic.as_deref(), p.destination.as_deref())).collect();
        out!("paused                    {}", names.join(", "));
    }
    if !destinations.is_empty() {
        out!("destinations              {}", destinations.len());
        print_destinations(&destinations);
    }
    // A relay (a process, most often) has a listener per destination; listeners of a relay
    // that did not name its connections count as one relay each.
    let named: std::collections::BTreeMap<&str, i64> =
        relays.iter().filter_map(|r| Some((r.relay.as_deref()?, r.relay_connections.unwrap_or(0)))).collect();
    let count = named.len() + relays.iter().filter(|r| r.relay.is_none()).count();
    let held: i64 = named.values().sum();
    out!(
        "relays connected          {count} ({} listeners, {waiting} waiting for NOTIFY; {held} connections)",
        relays.len()
    );
    out!("server connections        {} of max_connections {}", health.connections, health.max_connections);
    for relay in &relays {
        let state = match (relay.breaker_open, relay.waiting) {
            (true, _) => "BREAKER OPEN: destination down, probing",
            (false, true) => "waiting",
            (false, false) => "busy or lingering",
        };
        let limit = match (relay.delivery_limit, relay.deliveries_in_flight) {
            (Some(limit), Some(in_flight)) => format!(", limit {limit} ({in_flight} in flight)"),
            (Some(limit), None) => format!(", limit {limit}"),
            _ => String::new(),
        };
        let to =
            relay.destination.as_deref().map_or(String::new(), |d| format!("  to {}", crate::outcome::one_line(d)));
        let of = relay.relay.as_deref().map_or(String::new(), |id| format!("relay {id}  "));
        out!(
            "  {of}listener pid {:<8} from {:<15} since {}{to}  {state}{limit}",
            relay.listener_pid,
            relay.client,
            pg_outbox_relay::rfc3339(relay.connected_at)
        );
    }
    for warning in &warnings {
        out!("warning: {}", crate::outcome::one_line(warning));
    }
    if !errors.is_empty() {
        out!("most common errors of pending events:");
        for e in &errors {
            let whole = crate::outcome::one_line(&e.error);
            let mut text: String = whole.chars().take(160).collect();
            if text.len() < whole.len() {
                text.push('…');
            }
            out!("  {:>8}  {text}", e.events);
        }
    }
    Ok(())
}

async fn dead_letters(db: &Database, command: DeadLetterCommand) -> Result<(), CliError> {
    let outbox = connect(db).await?;
    match command {
        DeadLetterCommand::List { json, limit, after, filter } => {
            let filter = dead_letter_filter(filter, None)?;
            let letters = outbox.find_dead_letters(&filter, after, limit).await?;
            if json {
                out!("{}", serde_json::to_string(&letters)?);
                return Ok(());
            }
            if letters.is_empty() {
                let which = if filter.is_everything() && after.is_none() { "" } else { " that match" };
                out!("no dead letters{which}");
                return Ok(());
            }
            out!(
                "{:>10}  {:<16}  {:<24}  {:>8}  {:<27}  last error",
                "id",
                "destination",
                "topic",
                "attempts",
                "failed at"
            );
            for d in &letters {
                let failed = pg_outbox_relay::rfc3339(d.failed_at);
                let destination = if d.destination.is_empty() {
                    "(no route)".to_string()
                } else {
                    crate::outcome::one_line(&d.destination)
                };
                out!(
                    "{:>10}  {:<16}  {:<24}  {:>8}  {:<27}  {}",
                    d.id,
                    destination,
                    crate::outcome::one_line(&d.topic),
                    d.attempts,
                    failed,
                    crate::outcome::one_line(&d.last_error)
                );
            }
            let events = letters.iter().map(|d| d.id).collect::<std::collections::BTreeSet<_>>();
            if let Some(last) = events.last().filter(|_| events.len() as i64 == limit) {
                out!("({limit} events' dead letters shown; more may follow: --after {last})");
            }
        }
        DeadLetterCommand::Retry { all: _, ids, filter, dry_run } => {
            // (clap requires ids, a filter or --all, --all alone, and no --dry-run with ids)
            let filter = dead_letter_filter(filter, None)?;
            if dry_run {
                let n = outbox.count_dead_letters(&filter).await?;
                out!("would retry {n} dead letters (dry run: nothing changed)");
                return Ok(());
            }
            let mut revived = if ids.is_empty() {
                outbox.retry_dead_letters_matching(&filter).await?
            } else {
                outbox.retry_dead_letters(&ids).await?
            };
            let n = revived.len();
            revived.sort_unstable();
            revived.dedup();
            out!("retried {n} dead letters{}", list_ids(&revived));
        }
        DeadLetterCommand::Purge { all: _, older_than, filter, dry_run } => {
            // (clap requires --older-than, a filter or --all, and --all alone)
            let filter = dead_letter_filter(filter, older_than)?;
            if dry_run {
                let n = outbox.count_dead_letters(&filter).await?;
                out!("would purge {n} dead letters (dry run: nothing deleted)");
                return Ok(());
            }
            let purged = outbox.purge_dead_letters_matching(&filter).await?;
            out!("purged {purged} dead letters");
        }
    }
    Ok(())
}

/// The library's filter from the flags (`--older-than` by the database's clock).
fn dead_letter_filter(
    args: DeadLetterFilterArgs,
    older_than: Option<std::time::Duration>,
) -> Result<pg_outbox_relay::DeadLetterFilter, CliError> {
    // (--destination '' is the events no destination's pattern matched)
    let mut filter = pg_outbox_relay::DeadLetterFilter::default();
    filter.destination = args.destination;
    filter.topic = args.topic.as_deref().map(TopicPattern::parse).transpose()?;
    filter.failed_since = args.since;
    filter.failed_before = args.until;
    filter.failed_longer_ago = older_than;
    filter.error = args.error;
    filter.check().map_err(|e| UsageError(format!("{e} (--since, --until, --error)")))?;
    Ok(filter)
}

fn list_ids(ids: &[i64]) -> String {
    if ids.is_empty() {
        return String::new();
    }
    let shown: Vec<String> = ids.iter().take(20).map(i64::to_string).collect();
    let more = if ids.len() > 20 { format!(" and {} more", ids.len() - 20) } else { String::new() };
    format!(": {}{more}", shown.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every per-route flag has its place in a route (none reaches the `unreachable!`).
    #[test]
    fn every_per_route_flag_applies_to_a_route() {
        let parsed = || {
            let argv = ["outbox-relay", "run", "--route", "a=#=stdout"].map(std::ffi::OsString::from).to_vec();
            let Command::Run(args) = crate::route_flags::parse(argv).unwrap().command else { panic!("run") };
            args
        };
        let args = parsed();
        let defaults = sink_options(&args).unwrap();
        let mut route = crate::routes::parse_route("a=#=stdout", &defaults).unwrap();
        let given = crate::route_flags::PER_ROUTE.iter().map(|id| id.to_string()).collect();
        let flags = crate::args::RouteFlags { route: 0, given, args: parsed() };
        apply_route_flags(&mut route, &flags).unwrap();
    }
}
