//! The adaptive concurrency limit: how many deliveries a destination takes at once, learnt from
//! its answers, up to [`RelayConfig::concurrency`](super::RelayConfig::concurrency).
//!
//! A delay-based limit in the manner of TCP Vegas (Netflix's `concurrency-limits` calls it
//! `VegasLimit`): each answer's round trip is compared with the destination's *no-load* round
//! trip, measured alone every ten seconds, and the difference says how many requests wait in the
//! destination's queue: `queue = limit x (1 - (2 x no_load + 1 ms) / rtt)` (up to twice the no-load
//! round trip is taken as the destination's own jitter). With nothing queued the limit
//! grows by one per answer (doubling each round trip, as TCP's slow start does) until the first
//! request waits; then by one step per round trip while fewer than a step wait, and it shrinks by
//! a step when more than three steps wait (a step is 1 up to a limit of 10, then its log10), and a sign of overload (a timeout, 429, 502/503/504, or an answer ten
//! times slower than the no-load one and 100 ms past it, as a connection that waited out a SYN
//! retransmit) cuts it to three quarters of what was in flight when that request left. Requests
//! that no round trip shows (connections a full backlog dropped, waiting out a SYN retransmit)
//! are told by Little's law: far more out than the answers a second times the round trip say the
//! destination serves. Past the limit a cut left, growth is a step per [`AVOIDANCE_PERIOD`]. Why delay and not loss alone (AIMD): the receivers that need
//! protecting, a small thread pool or a listen backlog of five, queue before they fail, and a
//! loss-based limit learns only by overflowing them, each overflow a second-long retransmit. Why
//! not a gradient of long- against short-term averages (Netflix's `Gradient2`, Envoy's adaptive
//! concurrency): the long-term average follows the latency up under sustained load, where the
//! no-load minimum, measured again every few hundred answers, stays put.
//!
//! Only answers given while the limit was in use raise it (at least half the limit in flight
//! when the request left): a relay that sends a trickle learns nothing from it.

use std::time::Duration;

use tokio::time::Instant;

/// The limit a destination starts with: low, as TCP's initial window is.
pub(crate) const INITIAL_LIMIT: usize = 4;

/// How often the no-load round trip is measured again: the limit is held at one request for a
/// few answers (BBR's ProbeRTT, Envoy's minRTT window), about 1 % of the time of a destination
/// answering in 20 ms.
const PROBE_EVERY: Duration = Duration::from_secs(10);
/// The answers, sent alone, that one measure of the no-load round trip takes.
const PROBE_ANSWERS: u32 = 5;
/// A measure that gets too few answers (the relay has little to send) ends after this long.
const PROBE_LONGEST: Duration = Duration::from_secs(1);

/// How much longer than the no-load round trip an answer may take before the difference counts
/// as requests waiting (Netflix's Gradient2 tolerates 1.5 by default; a box whose cores the receiver shares with the
/// relay and the database stretches round trips more than that before anything queues).
const TOLERANCE: f64 = 2.0;

/// After slow start the limit grows by a step at most once per round trip, and at most once
/// per this.
const GROWTH_PERIOD: Duration = Duration::from_millis(50);

/// Past the limit of the last cut, the limit grows by a step at most once per this: the
/// overflow that cut it showed where the destination's room ends, and the news of the next one
/// can take a second (a SYN retransmit), in which the limit must not run far past it again.
const AVOIDANCE_PERIOD: Duration = Duration::from_millis(100);

/// The answers a destination gives are counted over windows this long at least (two smoothed
/// round trips if longer), for the concurrency it actually serves (Little's law: answers a
/// second times the round trip).
const SERVED_WINDOW: Duration = Duration::from_millis(100);
/// Linux's first SYN retransmit: a connection dropped by a full listen backlog shows again no
/// sooner than this.
const SYN_RETRANSMIT: Duration = Duration::from_secs(1);

/// A cut is remembered this long: until then growth past its limit is slow.
const CUT_MEMORY: Duration = Duration::from_secs(10);

/// Answers and requests out since `since`, for the concurrency the destination serves.
#[derive(Debug, Clone, Copy)]
struct Window {
    since: Instant,
    /// When the last answer came, and how many requests were out after it.
    last: (Instant, usize),
    /// The round trips of the answers in it, summed (seconds).
    answered: f64,
    /// The requests out, integrated over time (request-seconds).
    out: f64,
}

impl Window {
    fn new(now: Instant) -> Window {
        Window { since: now, last: (now, 0), answered: 0.0, out: 0.0 }
    }
}

/// What became of one request, as the limit sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Sample {
    /// The destination answered after `rtt`, with `in_flight` requests out (this one included)
    /// when the request left.
    Answered { rtt: Duration, in_flight: usize },
    /// A sign of overload: a timeout, a 429 or 503, a gateway's 502 or 504, of a request that
    /// left `rtt` ago with `in_flight` requests out.
    Overloaded { rtt: Duration, in_flight: usize },
}

#[derive(Debug, Clone, Copy)]
enum Probe {
    /// The next measure of the no-load round trip is due then.
    Due(Instant),
    /// Measuring: the limit is one; `resume` is the limit to go back to.
    Running { since: Instant, answers: u32, shortest: Option<Duration>, resume: f64 },
}

/// The limit's state.
#[derive(Debug, Clone)]
pub(crate) struct Vegas {
    limit: f64,
    ceiling: f64,
    /// Growing by one per answer until the first sign of a queue.
    slow_start: bool,
    /// The destination's round trip with nothing queued: the last measure's, or any shorter
    /// answer since.
    no_load: Option<Duration>,
    /// The round trip, smoothed over the last few answers.
    smoothed: Option<Duration>,
    probe: Probe,
    /// When the limit last grew after slow start.
    grown: Instant,
    /// The window of [`Vegas::count_answer`].
    window: Window,
    /// When the limit was last cut: bad news of a request sent before is of the load the cut
    /// answered already (TCP cuts once per window of data in flight at its loss).
    last_cut: Option<Instant>,
    /// No cut for requests stuck out of sight before then (those of the last such cut are
    /// still out).
    stuck_quiet_until: Option<Instant>,
    /// The limit the last cut left (the ceiling before any): past it the limit grows by a step
    /// per [`AVOIDANCE_PERIOD`] only, as TCP grows past its slow-start threshold, for
    /// [`CUT_MEMORY`] after the cut.
    threshold: f64,
    /// Signs of overload before then answer the cut already made (requests sent together come
    /// back together, a SYN retransmit's victims a second later all at once).
    cut_until: Option<Instant>,
}

impl Vegas {
    /// A limit of [`INITIAL_LIMIT`] (at most `ceiling`) that learns up to `ceiling`.
    pub(crate) fn new(ceiling: usize, now: Instant) -> Self {
        let ceiling = ceiling.max(1) as f64;
        Vegas {
            limit: (INITIAL_LIMIT as f64).min(ceiling),
            ceiling,
            slow_start: true,
            no_load: None,
            smoothed: None,
            probe: Probe::Due(now + PROBE_EVERY),
            grown: now,
            threshold: ceiling,
            window: Window::new(now),
            stuck_quiet_until: None,
            last_cut: None,
            cut_until: None,
        }
    }

    /// The limit now.
    pub(crate) fn limit(&self) -> usize {
        match self.probe {
            Probe::Running { .. } => 1,
            Probe::Due(_) => self.limit as usize,
        }
    }

    /// Takes in one request's fate at `now`, with `in_flight_now` requests out (this one no
    /// longer); returns the limit then.
    pub(crate) fn observe(&mut self, sample: Sample, in_flight_now: usize, now: Instant) -> usize {
        if let Probe::Running { since, answers, shortest, resume } = &mut self.probe {
            if let Sample::Answered { rtt, in_flight: 1 } = sample {
                *answers += 1;
                *shortest = Some(shortest.map_or(rtt, |s| s.min(rtt)));
            }
            if *answers >= PROBE_ANSWERS || now >= *since + PROBE_LONGEST {
                if shortest.is_some() {
                    self.no_load = *shortest;
                }
                self.limit = *resume;
                self.probe = Probe::Due(now + PROBE_EVERY);
                self.window = Window::new(now);
            }
            return self.limit();
        }
        match sample {
            Sample::Overloaded { rtt, in_flight } => self.cut(rtt, in_flight.max(in_flight_now + 1), now),
            Sample::Answered { rtt, in_flight } => {
                let rtt = rtt.max(Duration::from_micros(1));
                let no_load = self.no_load.map_or(rtt, |n| n.min(rtt));
                self.no_load = Some(no_load);
                let smoothed = self.smoothed.map_or(rtt, |s| (s * 4 + rtt) / 5);
                self.smoothed = Some(smoothed);
                let served = self.count_answer(rtt, smoothed, in_flight_now, now);
                if rtt > no_load * 10 && rtt > no_load + Duration::from_millis(100) {
                    // Ten times slower and 100 ms past it: it waited in a queue that overflowed.
                    self.cut(rtt, in_flight.max(in_flight_now + 1), now);
                } else if let Some((served, out)) = served.filter(|&(served, out)| self.out_of_sight(served, out, now))
                {
                    // Requests out that the destination does not answer at the rate it answers
                    // the others: connections dropped by a full listen backlog, waiting out a
                    // SYN retransmit, which no round trip shows until a second later.
                    tracing::debug!(
                        limit = self.limit,
                        served,
                        out,
                        "requests out of sight at the destination: the concurrency limit is cut to what it serves"
                    );
                    self.lower_to(served.ceil(), now);
                    self.stuck_quiet_until = Some(now + SYN_RETRANSMIT + smoothed * 2);
                } else {
                    self.adjust(smoothed, no_load, in_flight, now);
                }
            }
        }
        if let Probe::Due(at) = self.probe
            && now >= at
        {
            self.probe = Probe::Running { since: now, answers: 0, shortest: None, resume: self.limit };
        }
        self.limit()
    }

    /// Counts one answer after `rtt`, given with `in_flight_now` others out. At the end of a
    /// window, returns the concurrency the destination served in it (Little's law: the round
    /// trips of its answers over the window's length) and the requests the relay had out on
    /// average (as counted after each answer; a quiet stretch counts as the few out then, so
    /// an idle relay's next burst is not taken for requests out of sight).
    fn count_answer(
        &mut self,
        rtt: Duration,
        smoothed: Duration,
        in_flight_now: usize,
        now: Instant,
    ) -> Option<(f64, f64)> {
        let w = &mut self.window;
        let (at, out) = w.last;
        w.out += out as f64 * now.saturating_duration_since(at).as_secs_f64();
        w.answered += rtt.as_secs_f64();
        w.last = (now, in_flight_now);
        let elapsed = now.saturating_duration_since(w.since).as_secs_f64();
        if elapsed < SERVED_WINDOW.max(smoothed * 2).as_secs_f64() {
            return None;
        }
        let measured = (w.answered / elapsed, w.out / elapsed);
        self.window = Window { last: (now, in_flight_now), ..Window::new(now) };
        Some(measured)
    }

    /// Whether, over a window, far more requests were out than the destination served (twice
    /// as many, and two steps): some wait where no round trip shows them. Not in slow start
    /// (the requests out double per round trip there, ahead of the answers), nor within a SYN
    /// retransmit of the last such cut (its victims are still out).
    fn out_of_sight(&self, served: f64, out: f64, now: Instant) -> bool {
        let step = self.limit.log10().max(1.0);
        !self.slow_start
            && self.stuck_quiet_until.is_none_or(|until| now >= until)
            && out > served * TOLERANCE + 2.0 * step
    }

    /// Cuts the limit to three quarters of `in_flight` (what was out when the overloaded request
    /// left, or is now, whichever is more), or of the limit if that is less (TCP cuts its window
    /// from the flight size, not from a window grown since), once per burst of bad news: the signs that follow within twice the
    /// no-load round trip (100 ms at least) are of requests sent before the cut. Past the new
    /// limit growth is slow ([`AVOIDANCE_PERIOD`]).
    fn cut(&mut self, rtt: Duration, in_flight: usize, now: Instant) {
        let sent = now.checked_sub(rtt).unwrap_or(now);
        if self.cut_until.is_some_and(|until| now < until) || self.last_cut.is_some_and(|cut| sent < cut) {
            return;
        }
        let before = self.limit;
        self.lower_to(self.limit.min(in_flight as f64) * 0.75, now);
        self.smoothed = None;
        tracing::debug!(before, after = self.limit, in_flight, "a sign of overload: the concurrency limit is cut");
        let settle = self.no_load.map_or(Duration::ZERO, |n| n * 2).max(Duration::from_millis(100));
        self.cut_until = Some(now + settle);
    }

    /// Lowers the limit to `limit` (never raises it, never below one): the end of slow start,
    /// and the threshold past which growth is slow, from `now`.
    fn lower_to(&mut self, limit: f64, now: Instant) {
        self.limit = self.limit.min(limit).max(1.0);
        self.threshold = self.limit;
        self.slow_start = false;
        self.grown = now;
        self.last_cut = Some(now);
    }

    fn adjust(&mut self, rtt: Duration, no_load: Duration, in_flight: usize, now: Instant) {
        let limit = self.limit;
        let step = limit.log10().max(1.0);
        let used = (in_flight as f64) * 2.0 >= limit;
        if self.slow_start {
            // Vegas's gamma: slow start ends at the first request that waits by the bare
            // estimate, before any tolerance: a receiver whose backlog overflows at a few
            // connections is not pushed past it while the limit doubles per round trip.
            let waiting = limit * (1.0 - no_load.as_secs_f64() / rtt.as_secs_f64());
            if waiting >= 1.0 {
                self.slow_start = false;
                self.grown = now;
            } else if used {
                self.limit = (limit + 1.0).min(self.ceiling);
            }
            return;
        }
        // A round trip within twice the no-load one (and a millisecond) is the destination's
        // own jitter, a timer's granularity, a busy box: nothing waits.
        let tolerated = no_load.mul_f64(TOLERANCE) + Duration::from_millis(1);
        let queue = (limit * (1.0 - tolerated.as_secs_f64() / rtt.as_secs_f64())).max(0.0);
        // TCP Vegas's thresholds, in requests waiting at the destination (1 and 3 there), grown
        // with the limit's order of magnitude as in Netflix's VegasLimit.
        let (alpha, beta) = (step, 3.0 * step);
        if queue > beta {
            tracing::trace!(?rtt, ?no_load, queue, "requests wait at the destination: the limit shrinks");
            self.limit = (limit - step).max(1.0);
            self.grown = now;
        } else if queue < alpha && used {
            // Room at the destination and the limit in use: a quarter more (a step at least)
            // per round trip, and no more often than every GROWTH_PERIOD however short the
            // round trip, so that the limit reaches a deep receiver's capacity within a second
            // and does not rush a shallow one; past the last cut's limit a step per
            // AVOIDANCE_PERIOD.
            let remembered = self.last_cut.is_some_and(|cut| now < cut + CUT_MEMORY);
            let (growth, period) = if limit < self.threshold || !remembered {
                (step.max(limit / 4.0), GROWTH_PERIOD)
            } else {
                (step, AVOIDANCE_PERIOD)
            };
            if now >= self.grown + rtt.max(period) {
                self.limit = (limit + growth).min(self.ceiling);
                self.grown = now;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answered(ms: f64, in_flight: usize) -> Sample {
        Sample::Answered { rtt: Duration::from_secs_f64(ms / 1000.0), in_flight }
    }

    /// A destination that serves `capacity` requests at once in `service_ms` each and queues the
    /// rest, kept busy up to the limit for `answers` answers on a simulated clock; returns the
    /// limits seen.
    fn drive(capacity: usize, service_ms: f64, answers: usize, ceiling: usize) -> Vec<usize> {
        let mut now = Instant::now();
        let mut vegas = Vegas::new(ceiling, now);
        let mut seen = Vec::new();
        for _ in 0..answers {
            let limit = vegas.limit();
            let rtt = service_ms * limit.div_ceil(capacity) as f64;
            now += Duration::from_secs_f64(rtt / 1000.0 / limit as f64);
            seen.push(vegas.observe(answered(rtt, limit), 0, now));
        }
        seen
    }

    #[test]
    fn a_destination_that_never_queues_gets_the_ceiling_within_a_few_hundred_answers() {
        let seen = drive(10_000, 20.0, 400, 256);
        assert_eq!(*seen.last().unwrap(), 256, "{seen:?}");
    }

    #[test]
    fn a_destination_that_serves_two_at_once_is_kept_within_a_few_of_it() {
        // A millisecond each: the tolerance (twice the no-load round trip and a millisecond)
        // lets three waves through before anything counts as waiting, and Vegas's thresholds a
        // few more; far from the ceiling of 256 either way.
        let seen = drive(2, 1.0, 50_000, 256);
        let tail = &seen[10_000..];
        let mean = tail.iter().sum::<usize>() as f64 / tail.len() as f64;
        assert!(tail.iter().all(|&l| l <= 16), "{:?}", tail.iter().max());
        assert!((2.0..=10.0).contains(&mean), "mean limit {mean}");
    }

    #[test]
    fn signs_of_overload_cut_the_flight_by_a_quarter_once_per_burst_and_never_below_one() {
        let now = Instant::now();
        let mut vegas = Vegas::new(64, now);
        for _ in 0..200 {
            vegas.observe(answered(1.0, 64), 0, now);
        }
        assert_eq!(vegas.limit(), 64);
        assert_eq!(vegas.observe(Sample::Overloaded { rtt: Duration::ZERO, in_flight: 64 }, 0, now), 48);
        assert_eq!(
            vegas.observe(Sample::Overloaded { rtt: Duration::ZERO, in_flight: 64 }, 0, now),
            48,
            "one cut per burst of bad news"
        );
        // A connection that waited out a SYN retransmit (a second against a millisecond), sent
        // before that cut: the cut answered its load already.
        let mut now = now + Duration::from_millis(100);
        assert_eq!(vegas.observe(answered(1000.0, 48), 0, now), 48, "sent before the cut");
        // One sent after it, with 40 out: three quarters of those.
        now += Duration::from_millis(1000);
        assert_eq!(vegas.observe(answered(900.0, 40), 0, now), 30, "three quarters of what was out");
        for _ in 0..50 {
            now += Duration::from_millis(100);
            vegas.observe(Sample::Overloaded { rtt: Duration::ZERO, in_flight: 64 }, 0, now);
        }
        assert_eq!(vegas.limit(), 1);
    }

    #[test]
    fn requests_out_of_sight_cut_the_limit_to_what_the_destination_serves() {
        // A destination that answers 20 of them in 20 ms, and lets the rest wait unseen (a full
        // listen backlog): 100 out, 1,000 answers a second.
        let mut now = Instant::now();
        let mut vegas = Vegas::new(256, now);
        vegas.limit = 100.0;
        vegas.slow_start = false;
        let mut limits = Vec::new();
        for _ in 0..200 {
            now += Duration::from_millis(1);
            limits.push(vegas.observe(answered(20.0, 100), 99, now));
        }
        let cut = limits.iter().position(|&l| l < 100).expect("a cut");
        assert!(limits[cut] <= 21 && limits[cut] >= 19, "cut to about 20: {limits:?}");
        // The cut's victims are still out: no second cut for them within a SYN retransmit.
        assert!(limits[cut..].iter().all(|&l| l >= limits[cut]), "{limits:?}");
        // Past the cut's limit the limit grows by a step per AVOIDANCE_PERIOD at most.
        let grown = limits.last().unwrap() - limits[cut];
        assert!(grown <= 2, "{limits:?}");
    }

    #[test]
    fn a_deep_destination_keeps_its_limit_across_a_quiet_spell_and_the_probes() {
        // Any number at once in 20 to 24 ms (enough jitter to end slow start early): the
        // ceiling; then the last requests come back, ten seconds pass with nothing to send
        // (the probe comes due meanwhile), and a burst comes again.
        let mut now = Instant::now();
        let mut vegas = Vegas::new(256, now);
        let mut n = 0u32;
        let mut busy = |vegas: &mut Vegas, now: &mut Instant, answers: usize| {
            for _ in 0..answers {
                n += 1;
                let limit = vegas.limit();
                *now += Duration::from_secs_f64(0.022 / limit as f64);
                let rtt = if n.is_multiple_of(2) { 20.0 } else { 24.0 };
                vegas.observe(answered(rtt, limit), limit - 1, *now);
            }
        };
        busy(&mut vegas, &mut now, 5_000);
        assert_eq!(vegas.limit(), 256);
        assert!(!vegas.slow_start);
        for out in (0..256).rev() {
            now += Duration::from_micros(80);
            vegas.observe(answered(22.0, 256), out, now);
        }
        now += Duration::from_secs(10);
        busy(&mut vegas, &mut now, 20_000);
        assert_eq!(vegas.limit(), 256);
        assert!(vegas.last_cut.is_none(), "no cut of a destination that kept up (limit {})", vegas.limit);
    }

    #[test]
    fn a_trickle_does_not_raise_the_limit() {
        let now = Instant::now();
        let mut vegas = Vegas::new(64, now);
        for _ in 0..1000 {
            vegas.observe(answered(1.0, 1), 0, now);
        }
        assert_eq!(vegas.limit(), INITIAL_LIMIT);
    }

    #[test]
    fn the_no_load_round_trip_is_measured_again_alone_and_followed() {
        let mut now = Instant::now();
        let mut vegas = Vegas::new(64, now);
        for _ in 0..200 {
            vegas.observe(answered(1.0, 64), 0, now);
        }
        assert_eq!(vegas.limit(), 64);
        // From now on it answers in 5 ms however few wait: that first reads as a queue.
        for _ in 0..200 {
            vegas.observe(answered(5.0, 64), 0, now);
        }
        assert!(vegas.limit() < 32, "{}", vegas.limit());
        // The measure that comes due holds the limit at one; answers of requests sent alone
        // are the no-load round trip from then on, and the limit grows back.
        now += PROBE_EVERY;
        assert_eq!(vegas.observe(answered(5.0, 64), 0, now), 1);
        for _ in 0..PROBE_ANSWERS {
            vegas.observe(answered(5.0, 1), 0, now);
        }
        assert_eq!(vegas.no_load, Some(Duration::from_millis(5)));
        for _ in 0..3000 {
            now += Duration::from_millis(1);
            vegas.observe(answered(5.0, 64), 0, now);
        }
        assert_eq!(vegas.limit(), 64);
    }
}
