//! The delivery stage: the relay's drain, with default settings, to the stdout sink's work, to
//! two such destinations, and to the brokers that answer (NATS JetStream, RabbitMQ, Kafka), with
//! a plain JetStream publisher's and a plain Kafka producer's rates on the same brokers as the
//! NATS and Kafka drains' references.

use std::sync::Arc;

use pg_outbox_relay::Outbox;
use pg_outbox_relay_bench::{
    self as bench, AmqpDrain, CpuProfile, CpuSample, DrainSetup, Drained, KafkaBench, NatsBench,
};
use serde_json::json;

use super::common::{BenchArgs, BenchError, ROUNDS, grouped, median, rate, rounded};

/// The delivery stage's figures: medians of [`ROUNDS`], in events per second.
pub(super) struct SinksReport {
    pub(super) events: usize,
    pub(super) stdout: f64,
    /// Every event to each of two stdout destinations (each delivered twice).
    pub(super) stdout_two: f64,
    /// Each broker's drain, or why it was skipped.
    pub(super) nats: Result<NatsFigures, String>,
    pub(super) amqp: Result<f64, String>,
    pub(super) kafka: Result<KafkaFigures, String>,
    /// Where the machine's CPU went during each drain (stdout, two destinations, NATS,
    /// RabbitMQ, Kafka), the plain JetStream publisher and Kafka producer, and the publisher with
    /// two windows in flight, over every round.
    pub(super) cpu: [CpuProfile; 8],
}

/// The drains and plain clients of [`SinksReport::cpu`], in its order.
const DRAINS: [&str; 8] = [
    "stdout",
    "stdout_two_destinations",
    "nats",
    "amqp",
    "kafka",
    "nats_publisher",
    "kafka_producer",
    "nats_publisher_two_windows",
];

/// The JetStream stream of the NATS drain and of the plain publisher.
const NATS_STREAM: &str = "OUTBOX_BENCH";

/// How many commands a CPU profile names, those that spent the most (the rest are not shown).
const PROFILED: usize = 3;

fn cpu_json(profile: &CpuProfile) -> serde_json::Value {
    let cores: serde_json::Map<String, serde_json::Value> =
        profile.top(PROFILED).into_iter().map(|(command, cores)| (command, json!(rounded(cores, 3)))).collect();
    json!({ "machine_busy_share": profile.machine_share().map(|s| rounded(s, 3)), "cores_by_command": cores })
}

/// The machine's busy share and the commands that spent the most, e.g. `machine 97 % busy:
/// postgres 1.02, outbox-relay 0.61, nats-server 0.31 cores`.
fn cpu_line(profile: &CpuProfile) -> String {
    let busy = profile.machine_share().map_or("?".to_owned(), |s| format!("{:.0}", s * 100.0));
    let top: Vec<String> = profile.top(PROFILED).into_iter().map(|(c, cores)| format!("{c} {cores:.2}")).collect();
    format!("CPU: machine {busy} % busy; {} cores", top.join(", "))
}

/// The NATS drain beside a plain JetStream publisher on the same stream, publishing as the NATS
/// sink does (a batch's publishes, then their acknowledgements), in windows of the drain's batch;
/// and the same publisher with two windows in flight (the next window's publishes while the
/// acknowledgements of the one before are awaited), which the sink does not do.
pub(super) struct NatsFigures {
    pub(super) drain: f64,
    pub(super) publisher: f64,
    pub(super) publisher_two_windows: f64,
    /// The windows that publisher had in flight: two, unless two of the drain's batch would pass
    /// the client's bound on acknowledgements awaited.
    pub(super) windows: usize,
}

/// The Kafka drain beside a plain producer on the same broker.
pub(super) struct KafkaFigures {
    pub(super) drain: f64,
    pub(super) producer: f64,
}

pub(super) fn step(args: &BenchArgs) -> String {
    format!(
        "{} events to the stdout sink's work (to /dev/null), to two such destinations (every event to each), to NATS JetStream at {} (and a plain publisher there), RabbitMQ (--amqp-url) and Kafka at {} (and a plain producer there), alternately, {ROUNDS} rounds",
        args.events, args.nats_url, args.kafka_url
    )
}

/// Drains `args.events` events to each destination in turn, [`ROUNDS`] times.
pub(super) async fn stage(args: &BenchArgs, outbox: &Outbox) -> Result<SinksReport, BenchError> {
    let setup = DrainSetup::defaults(args.events);
    let nats = NatsBench::connect(&args.nats_url, NATS_STREAM).await?;
    let amqp = AmqpDrain::connect(&args.amqp_url, "outbox_bench").await?;
    let kafka = KafkaBench::connect(&args.kafka_url).await?;
    for (name, skipped) in
        [("NATS", nats.as_ref().err()), ("RabbitMQ", amqp.as_ref().err()), ("Kafka", kafka.as_ref().err())]
    {
        if let Some(why) = skipped {
            eprintln!("  {name} skipped: {why}");
        }
    }
    let mut rates: [Vec<f64>; 8] = Default::default();
    let mut cpu: [CpuProfile; 8] = Default::default();
    let config = setup.config();
    for round in 0..ROUNDS {
        let mut record = |i: usize, (per_s, profile): (f64, CpuProfile)| {
            rates[i].push(per_s);
            cpu[i].add(&profile);
        };
        let drained = |drained: Drained| (rate(setup.events, drained.elapsed), drained.cpu);
        record(0, drained(bench::drain_measured(outbox, setup, config.clone(), bench::DevNullLines).await?));
        record(
            1,
            drained(bench::drain_each_measured(outbox, setup, &["stdout-a", "stdout-b"], bench::DevNullLines).await?),
        );
        if let Ok(nats) = &nats {
            nats.purge().await?;
            record(2, drained(bench::drain_measured(outbox, setup, config.clone(), nats.sink.clone()).await?));
            nats.purge().await?;
            let sample = CpuSample::now();
            let per_s = nats.publisher_rate(setup.events, setup.batch_size, 1).await?;
            record(5, (per_s, sample.profile()));
            nats.purge().await?;
            let sample = CpuSample::now();
            let per_s = nats.publisher_rate(setup.events, setup.batch_size, 2).await?;
            record(7, (per_s, sample.profile()));
        }
        if let Ok(amqp) = &amqp {
            record(3, drained(bench::drain_measured(outbox, setup, config.clone(), Arc::clone(&amqp.sink)).await?));
            amqp.purge().await?;
        }
        if let Ok(kafka) = &kafka {
            let topic = format!("outbox-bench-drain-{}-{round}", std::process::id());
            kafka.create_topic(&topic).await?;
            record(4, drained(bench::drain_measured(outbox, setup, config.clone(), kafka.sink(&topic).await?).await?));
            kafka.delete_topic(&topic).await?;
            let topic = format!("outbox-bench-producer-{}-{round}", std::process::id());
            kafka.create_topic(&topic).await?;
            let sample = CpuSample::now();
            let per_s = kafka.producer_rate(&topic, setup.events).await?;
            record(6, (per_s, sample.profile()));
            kafka.delete_topic(&topic).await?;
        }
    }
    let [stdout, two, nats_rates, amqp_rates, kafka_rates, publisher_rates, producer_rates, pipelined_rates] =
        &mut rates;
    let report = SinksReport {
        events: setup.events,
        stdout: median(stdout),
        stdout_two: median(two),
        nats: match nats {
            Ok(nats) => {
                nats.remove().await?;
                Ok(NatsFigures {
                    drain: median(nats_rates),
                    publisher: median(publisher_rates),
                    publisher_two_windows: median(pipelined_rates),
                    windows: bench::windows_in_flight(setup.batch_size, 2),
                })
            }
            Err(why) => Err(why),
        },
        amqp: match amqp {
            Ok(amqp) => {
                amqp.remove().await?;
                Ok(median(amqp_rates))
            }
            Err(why) => Err(why),
        },
        kafka: kafka.map(|_| KafkaFigures { drain: median(kafka_rates), producer: median(producer_rates) }),
        cpu,
    };
    Ok(report)
}

impl SinksReport {
    pub(super) fn json(&self) -> serde_json::Value {
        let share = |rate: &Result<f64, String>| rate.as_ref().ok().map(|v| rounded(v / self.stdout, 3));
        let figure = |rate: &Result<f64, String>| rate.as_ref().ok().map(|v| rounded(*v, 1));
        let kafka = self.kafka.as_ref();
        let nats = self.nats.as_ref();
        json!({
            "sinks_events": self.events,
            "stdout_events_per_s": rounded(self.stdout, 1),
            "stdout_two_destinations_events_per_s": rounded(self.stdout_two, 1),
            "stdout_two_destinations_share_of_one": rounded(self.stdout_two / self.stdout, 3),
            "nats_events_per_s": nats.ok().map(|n| rounded(n.drain, 1)),
            "nats_share_of_stdout": nats.ok().map(|n| rounded(n.drain / self.stdout, 3)),
            "nats_publisher_messages_per_s": nats.ok().map(|n| rounded(n.publisher, 1)),
            "nats_share_of_publisher": nats.ok().map(|n| rounded(n.drain / n.publisher, 3)),
            "nats_publisher_two_windows_messages_per_s": nats.ok().map(|n| rounded(n.publisher_two_windows, 1)),
            "nats_publisher_windows_in_flight": nats.ok().map(|n| n.windows),
            "amqp_events_per_s": figure(&self.amqp),
            "amqp_share_of_stdout": share(&self.amqp),
            "kafka_events_per_s": kafka.ok().map(|k| rounded(k.drain, 1)),
            "kafka_producer_messages_per_s": kafka.ok().map(|k| rounded(k.producer, 1)),
            "kafka_share_of_producer": kafka.ok().map(|k| rounded(k.drain / k.producer, 3)),
            "sinks_cpu": DRAINS.iter().zip(&self.cpu).filter(|(_, p)| !p.elapsed.is_zero())
                .map(|(name, p)| ((*name).to_owned(), cpu_json(p))).collect::<serde_json::Map<_, _>>(),
            "skipped": {
                "nats": self.nats.as_ref().err(),
                "amqp": self.amqp.as_ref().err(),
                "kafka": self.kafka.as_ref().err(),
            },
        })
    }

    pub(super) fn print(&self) {
        out!("delivery, default settings (workers, batch, concurrency), {} events:", self.events);
        let line = |what: &str, rate: f64, note: String, cpu: Option<&CpuProfile>| {
            out!("  {what:<44}{:>12} events/s (median of {ROUNDS}{note})", grouped(rate));
            if let Some(cpu) = cpu.filter(|p| !p.elapsed.is_zero()) {
                out!("    {}", cpu_line(cpu));
            }
        };
        let [stdout_cpu, two_cpu, nats_cpu, amqp_cpu, kafka_cpu, publisher_cpu, producer_cpu, pipelined_cpu] =
            &self.cpu;
        line("to the stdout sink's work (/dev/null)", self.stdout, String::new(), Some(stdout_cpu));
        let share = self.stdout_two / self.stdout * 100.0;
        line(
            "to two such destinations, every event to each",
            self.stdout_two,
            format!("; {share:.0} % of one; each event delivered twice"),
            Some(two_cpu),
        );
        match &self.nats {
            Ok(n) => {
                let shares = format!(
                    "; {:.0} % of stdout, {:.0} % of the plain publisher",
                    n.drain / self.stdout * 100.0,
                    n.drain / n.publisher * 100.0
                );
                line("to NATS JetStream", n.drain, shares, Some(nats_cpu));
                line("a plain JetStream publisher, same stream", n.publisher, String::new(), Some(publisher_cpu));
                let share = format!("; {:.0} % of stdout", n.publisher_two_windows / self.stdout * 100.0);
                let what = match n.windows {
                    1 => "the same, one window in flight (two would pass the client's bound)".to_owned(),
                    windows => format!("the same, {windows} windows in flight"),
                };
                line(&what, n.publisher_two_windows, share, Some(pipelined_cpu));
            }
            Err(why) => out!("  {:<44}{:>12} ({why})", "to NATS JetStream", "skipped"),
        }
        match &self.amqp {
            Ok(rate) => {
                line("to RabbitMQ", *rate, format!("; {:.0} % of stdout", rate / self.stdout * 100.0), Some(amqp_cpu))
            }
            Err(why) => out!("  {:<44}{:>12} ({why})", "to RabbitMQ", "skipped"),
        }
        match &self.kafka {
            Ok(k) => {
                let share = format!("; {:.0} % of the plain producer", k.drain / k.producer * 100.0);
                line("to Kafka", k.drain, share, Some(kafka_cpu));
                line("a plain producer on the same broker", k.producer, String::new(), Some(producer_cpu));
            }
            Err(why) => out!("  {:<44}{:>12} ({why})", "to Kafka", "skipped"),
        }
    }
}
