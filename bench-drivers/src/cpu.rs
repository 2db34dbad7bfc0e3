//! Where a machine's CPU went while something ran: its busy time (`/proc/stat`) and each
//! command's share of it (`/proc/PID/stat`, summed by command name), to show what limits a
//! measurement on a machine of few cores (the relay, PostgreSQL's backends, a broker).

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// The CPU readings at a moment; [`CpuSample::profile`] gives what was spent since.
pub struct CpuSample {
    at: Instant,
    machine: Option<Duration>,
    /// Ticks per process, with its command name.
    processes: HashMap<u32, (String, u64)>,
}

/// CPU spent over a stretch of time, in total and by command.
#[derive(Debug, Clone, Default)]
pub struct CpuProfile {
    /// How long the stretch lasted.
    pub elapsed: Duration,
    /// The machine's busy time over every core (`None` without `/proc/stat`).
    pub machine: Option<Duration>,
    /// CPU time by command name, most first (a process started in between counts whole; one
    /// that ended in between is missing).
    pub by_command: Vec<(String, Duration)>,
    /// What this process spent.
    pub this_process: Duration,
}

impl CpuSample {
    /// Reads the machine's and every process's CPU time now.
    pub fn now() -> CpuSample {
        CpuSample { at: Instant::now(), machine: machine_cpu(), processes: process_ticks() }
    }

    /// What was spent from this sample to now.
    pub fn profile(&self) -> CpuProfile {
        let now = CpuSample::now();
        let ticks = clock_ticks_per_second() as f64;
        let time = |t: u64| Duration::from_secs_f64(t as f64 / ticks);
        let mut by_command: HashMap<String, u64> = HashMap::new();
        for (pid, (command, after)) in &now.processes {
            let before = self.processes.get(pid).filter(|(c, _)| c == command).map_or(0, |(_, t)| *t);
            *by_command.entry(command.clone()).or_default() += after.saturating_sub(before);
        }
        let mut by_command: Vec<(String, Duration)> =
            by_command.into_iter().filter(|(_, t)| *t > 0).map(|(c, t)| (c, time(t))).collect();
        by_command.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        let own = |sample: &CpuSample| sample.processes.get(&std::process::id()).map_or(0, |(_, t)| *t);
        CpuProfile {
            this_process: time(own(&now).saturating_sub(own(self))),
            elapsed: now.at.duration_since(self.at),
            machine: now.machine.zip(self.machine).map(|(after, before)| after.saturating_sub(before)),
            by_command,
        }
    }
}

impl CpuProfile {
    /// `cpu` as a share of one core over the stretch (1.0: a whole core).
    pub fn cores(&self, cpu: Duration) -> f64 {
        cpu.as_secs_f64() / self.elapsed.as_secs_f64().max(f64::MIN_POSITIVE)
    }

    /// The machine's busy time as a share of all its cores (1.0: every core busy throughout).
    pub fn machine_share(&self) -> Option<f64> {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        Some(self.cores(self.machine?) / cores)
    }

    /// Adds another stretch's figures (of the same measurement, another round).
    pub fn add(&mut self, other: &CpuProfile) {
        self.machine =
            if self.elapsed.is_zero() { other.machine } else { self.machine.zip(other.machine).map(|(a, b)| a + b) };
        self.elapsed += other.elapsed;
        self.this_process += other.this_process;
        for (command, cpu) in &other.by_command {
            match self.by_command.iter_mut().find(|(c, _)| c == command) {
                Some((_, total)) => *total += *cpu,
                None => self.by_command.push((command.clone(), *cpu)),
            }
        }
        self.by_command.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    }

    /// What the processes named `command` spent (zero when none ran).
    pub fn of(&self, command: &str) -> Duration {
        self.by_command.iter().filter(|(c, _)| c == command).map(|(_, cpu)| *cpu).sum()
    }

    /// The `n` commands that spent the most, each as cores used (e.g. `postgres 0.92`).
    pub fn top(&self, n: usize) -> Vec<(String, f64)> {
        self.by_command.iter().take(n).map(|(c, cpu)| (c.clone(), self.cores(*cpu))).collect()
    }
}

/// Busy CPU time of the whole machine (all cores: user, nice, system, irq, softirq, steal), from
/// the first line of `/proc/stat`.
pub(super) fn machine_cpu() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let fields: Vec<u64> = stat.lines().next()?.split_whitespace().skip(1).map(|f| f.parse().unwrap_or(0)).collect();
    let busy: u64 = [0, 1, 2, 5, 6, 7].iter().map(|i| fields.get(*i).copied().unwrap_or(0)).sum();
    Some(Duration::from_secs_f64(busy as f64 / clock_ticks_per_second() as f64))
}

/// Every process's command name and CPU ticks (user and system, its threads included).
fn process_ticks() -> HashMap<u32, (String, u64)> {
    let Ok(dir) = std::fs::read_dir("/proc") else { return HashMap::new() };
    dir.filter_map(|entry| {
        let pid: u32 = entry.ok()?.file_name().to_str()?.parse().ok()?;
        Some((pid, process_stat(pid)?))
    })
    .collect()
}

/// A process's command name and CPU ticks (user and system, all its threads), from
/// `/proc/<pid>/stat`.
fn process_stat(pid: u32) -> Option<(String, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (command) state ...": the command may hold spaces and parentheses.
    let (open, close) = (stat.find('(')?, stat.rfind(')')?);
    let command = stat.get(open + 1..close)?.to_owned();
    let rest: Vec<&str> = stat.get(close + 2..)?.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the command.
    let ticks = rest.get(11)?.parse::<u64>().ok()? + rest.get(12)?.parse::<u64>().ok()?;
    Some((command, ticks))
}

/// User and system CPU time of a process (all its threads), from `/proc/<pid>/stat`.
pub(super) fn process_cpu(pid: u32) -> Option<Duration> {
    let (_, ticks) = process_stat(pid)?;
    Some(Duration::from_secs_f64(ticks as f64 / clock_ticks_per_second() as f64))
}

/// The unit of `/proc`'s CPU times (`getconf CLK_TCK`; 100 on Linux unless it says otherwise).
fn clock_ticks_per_second() -> u64 {
    static TICKS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|out| String::from_utf8(out.stdout).ok()?.trim().parse().ok())
            .filter(|ticks| *ticks > 0)
            .unwrap_or(100)
    })
}
