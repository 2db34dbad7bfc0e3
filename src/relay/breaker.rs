//! The outage breaker: an outage is the destination's failure, not the events'.
//!
//! When deliveries of [`RelayConfig::breaker_threshold`](super::RelayConfig::breaker_threshold)
//! *distinct* events fail transiently in a row (no success and no refusal in between), the
//! destination is taken to be down and the breaker **opens**: the relay stops claiming, the
//! transient failures of the batch that opened it are given back without counting the attempt,
//! and one worker at a time **probes**: it claims one event and delivers it, first after
//! `breaker_probe_min`, then at doubling intervals up to `breaker_probe_max` (longer when the
//! destination's `Retry-After` asks for it). A failed probe's event is given back too (attempt
//! not counted) with the probe's delay, so the next probe tries another event. The first probe
//! that succeeds **closes** the breaker and every worker resumes at full speed. While it is open
//! no attempt is consumed and nothing is dead-lettered by the outage.
//!
//! A destination that cannot be reached (a connection refused, a name that does not resolve, a
//! failed connect or handshake: [`unreached`]) opens it sooner: once an event
//! fails that way again with only such failures since the streak began, every event the relay
//! could try has failed (a few keys, each head waiting for its retry), however fewer than the
//! threshold they are. Those failures never count an attempt either.
//!
//! [`unreached`]: super::DeliveryError::unreached
//!
//! Failures of events refused for good (permanent), failures the sink marks as answered (the
//! destination is up but cannot take this event yet: an unroutable RabbitMQ message, a subject
//! no JetStream stream captures) and successes all show the destination answering: they end a
//! streak. A queue of nothing but events the destination keeps failing is
//! indistinguishable from an outage, and is treated as one.

use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// What one delivery came to, as the breaker sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Seen {
    /// Delivered, or refused for good: the destination answers.
    Answered,
    /// A transient failure of this event.
    Failed(i64),
    /// A failure of this event in which no connection could be made (refused, no route, a
    /// failed handshake).
    Unreached(i64),
}

/// The breaker's view of a batch, once it has seen its results.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The destination works: record the outcomes as they are.
    Closed,
    /// The destination is down (the breaker is open, or this batch opened it): give the batch's
    /// transient failures back without counting the attempt.
    Open,
}

/// A change of state, to log and publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Change {
    /// Opened: so many distinct events failed in a row; probing after this delay.
    Opened { failures: usize, probe_in: Duration },
    /// Closed by a successful probe, after being open this long.
    Closed { after: Duration },
}

/// A worker's turn while the breaker is open.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Turn {
    /// The breaker closed: claim as usual.
    Closed,
    /// This worker probes now: claim one event and deliver it.
    Probe,
    /// The relay is stopping.
    Stop,
}

#[derive(Debug)]
enum Phase {
    /// `streak`: the distinct events failed in a row; `unreached`: whether the destination
    /// answered none of them.
    Closed {
        streak: Vec<i64>,
        unreached: bool,
    },
    Open {
        since: Instant,
        next_probe: Instant,
        delay: Duration,
        probing: bool,
    },
}

/// The breaker of one relay, shared by its workers.
#[derive(Debug)]
pub(crate) struct Breaker {
    threshold: usize,
    probe_min: Duration,
    probe_max: Duration,
    phase: Mutex<Phase>,
    /// Wakes the workers waiting for their turn: the breaker closed, or a probe ended.
    changed: Notify,
}

impl Breaker {
    /// A closed breaker; a `threshold` of 0 never opens.
    pub(crate) fn new(threshold: u32, probe_min: Duration, probe_max: Duration) -> Self {
        Breaker {
            threshold: threshold as usize,
            probe_min,
            probe_max,
            phase: Mutex::new(Phase::Closed { streak: Vec::new(), unreached: true }),
            changed: Notify::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Phase> {
        self.phase.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// True while the destination is taken to be down.
    pub(crate) fn is_open(&self) -> bool {
        matches!(*self.lock(), Phase::Open { .. })
    }

    /// Takes in the results of a delivered batch (`retry_after`: the longest delay a failure
    /// asked for). `probe` marks the open breaker's probe. Returns how to record the batch, and
    /// the change of state it caused, if any.
    pub(crate) fn observe(
        &self,
        results: &[Seen],
        retry_after: Option<Duration>,
        refused: bool,
        probe: bool,
    ) -> (Verdict, Option<Change>) {
        let mut phase = self.lock();
        match &mut *phase {
            Phase::Open { since, next_probe, delay, probing } => {
                if !probe {
                    // A batch claimed before the breaker opened: the outage covers it too.
                    return (Verdict::Open, None);
                }
                *probing = false;
                if results.contains(&Seen::Answered) {
                    let after = since.elapsed();
                    *phase = Phase::Closed { streak: Vec::new(), unreached: true };
                    drop(phase);
                    self.changed.notify_waiters();
                    return (Verdict::Closed, Some(Change::Closed { after }));
                }
                if !results.is_empty() {
                    // A refused connection costs nothing to try again: the probes stay at their
                    // shortest interval, so the relay delivers soon after the receiver listens.
                    let wanted = if refused { self.probe_min } else { *delay * 2 };
                    *delay = self.next_delay(wanted, retry_after);
                }
                *next_probe = Instant::now() + *delay;
                drop(phase);
                self.changed.notify_waiters();
                (Verdict::Open, None)
            }
            Phase::Closed { streak, unreached } => {
                if self.threshold == 0 {
                    return (Verdict::Closed, None);
                }
                // An event that could not reach the destination, failing again with no success in
                // between: every event the relay could try has failed that way, however few.
                let mut around = false;
                for result in results {
                    match result {
                        Seen::Answered => {
                            streak.clear();
                            *unreached = true;
                            around = false;
                        }
                        Seen::Failed(id) | Seen::Unreached(id) => {
                            *unreached &= matches!(result, Seen::Unreached(_));
                            if streak.contains(id) {
                                around |= *unreached;
                            } else {
                                streak.push(*id);
                            }
                        }
                    }
                }
                if streak.len() < self.threshold && !around {
                    return (Verdict::Closed, None);
                }
                let failures = streak.len();
                let delay = self.next_delay(self.probe_min, retry_after);
                *phase =
                    Phase::Open { since: Instant::now(), next_probe: Instant::now() + delay, delay, probing: false };
                (Verdict::Open, Some(Change::Opened { failures, probe_in: delay }))
            }
        }
    }

    fn next_delay(&self, wanted: Duration, retry_after: Option<Duration>) -> Duration {
        wanted.max(retry_after.unwrap_or_default()).clamp(self.probe_min, self.probe_max)
    }

    /// The probe's delay, for the event a failed probe gives back.
    pub(crate) fn probe_delay(&self) -> Duration {
        match &*self.lock() {
            Phase::Open { delay, .. } => *delay,
            Phase::Closed { .. } => self.probe_min,
        }
    }

    /// Waits while the breaker is open until it closes, or until this worker's turn to probe
    /// (one worker probes at a time, when the probe is due).
    pub(crate) async fn turn(&self, stop: &CancellationToken) -> Turn {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let wake_at = {
                let mut phase = self.lock();
                match &mut *phase {
                    Phase::Closed { .. } => return Turn::Closed,
                    Phase::Open { next_probe, probing, .. } => {
                        if !*probing && Instant::now() >= *next_probe {
                            *probing = true;
                            return Turn::Probe;
                        }
                        if *probing { None } else { Some(*next_probe) }
                    }
                }
            };
            let sleep = async {
                match wake_at {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = stop.cancelled() => return Turn::Stop,
                _ = changed => {}
                _ = sleep => {}
            }
        }
    }

    /// Ends a probe that found nothing to deliver: the next one follows after the same delay.
    pub(crate) fn probe_found_nothing(&self) {
        let mut phase = self.lock();
        if let Phase::Open { next_probe, probing, delay, .. } = &mut *phase {
            *probing = false;
            *next_probe = Instant::now() + *delay;
        }
        drop(phase);
        self.changed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn breaker() -> Breaker {
        Breaker::new(3, Duration::from_secs(1), Duration::from_secs(8))
    }

    #[test]
    fn distinct_failures_in_a_row_open_it() {
        let b = breaker();
        assert_eq!(
            b.observe(&[Seen::Failed(1), Seen::Failed(1), Seen::Failed(2)], None, false, false),
            (Verdict::Closed, None)
        );
        let (verdict, change) = b.observe(&[Seen::Failed(3)], None, false, false);
        assert_eq!(verdict, Verdict::Open);
        assert_eq!(change, Some(Change::Opened { failures: 3, probe_in: Duration::from_secs(1) }));
        assert!(b.is_open());
        // a batch still in flight when it opened is covered by the outage
        assert_eq!(b.observe(&[Seen::Answered], None, false, false), (Verdict::Open, None));
    }

    #[test]
    fn an_answer_ends_the_streak() {
        let b = breaker();
        b.observe(&[Seen::Failed(1), Seen::Failed(2)], None, false, false);
        b.observe(&[Seen::Answered], None, false, false);
        assert_eq!(b.observe(&[Seen::Failed(3), Seen::Failed(4)], None, false, false).0, Verdict::Closed);
        assert!(!b.is_open());
    }

    #[test]
    fn probes_back_off_and_a_success_closes_it() {
        let b = breaker();
        b.observe(&[Seen::Failed(1), Seen::Failed(2), Seen::Failed(3)], None, false, false);
        assert_eq!(b.probe_delay(), Duration::from_secs(1));
        b.observe(&[Seen::Failed(4)], None, false, true);
        assert_eq!(b.probe_delay(), Duration::from_secs(2));
        b.observe(&[Seen::Failed(5)], Some(Duration::from_secs(30)), false, true);
        assert_eq!(b.probe_delay(), Duration::from_secs(8), "Retry-After, within the longest probe interval");
        let (verdict, change) = b.observe(&[Seen::Answered], None, false, true);
        assert_eq!(verdict, Verdict::Closed);
        assert!(matches!(change, Some(Change::Closed { .. })));
        assert!(!b.is_open());
    }

    #[test]
    fn retry_after_sets_the_first_probe_delay() {
        let b = breaker();
        let (_, change) =
            b.observe(&[Seen::Failed(1), Seen::Failed(2), Seen::Failed(3)], Some(Duration::from_secs(5)), false, false);
        assert_eq!(change, Some(Change::Opened { failures: 3, probe_in: Duration::from_secs(5) }));
    }

    #[test]
    fn an_unreached_event_failing_again_opens_it_below_the_threshold() {
        let b = breaker();
        let heads: Vec<Seen> = (1..=2).map(Seen::Unreached).collect();
        assert_eq!(b.observe(&heads, None, true, false), (Verdict::Closed, None), "two of three, each once");
        let (verdict, change) = b.observe(&[Seen::Unreached(1)], None, true, false);
        assert_eq!(verdict, Verdict::Open, "every event it could try failed");
        assert!(matches!(change, Some(Change::Opened { failures: 2, .. })), "{change:?}");
    }

    #[test]
    fn an_event_the_destination_answered_failing_again_counts_once() {
        // A timeout (the destination may have taken the request) may be the event's own doing:
        // only distinct events count, as before.
        let b = breaker();
        for _ in 0..5 {
            assert_eq!(b.observe(&[Seen::Failed(1), Seen::Unreached(2)], None, false, false).0, Verdict::Closed);
        }
        let b = breaker();
        b.observe(&[Seen::Unreached(1)], None, true, false);
        b.observe(&[Seen::Answered], None, false, false);
        assert_eq!(b.observe(&[Seen::Unreached(1)], None, true, false).0, Verdict::Closed, "a success in between");
    }

    #[test]
    fn a_threshold_of_zero_never_opens() {
        let b = Breaker::new(0, Duration::from_secs(1), Duration::from_secs(8));
        let failures: Vec<Seen> = (0..100).map(Seen::Failed).collect();
        assert_eq!(b.observe(&failures, None, false, false).0, Verdict::Closed);
    }

    #[tokio::test(start_paused = true)]
    async fn one_worker_probes_when_it_is_due() {
        let b = std::sync::Arc::new(breaker());
        b.observe(&[Seen::Failed(1), Seen::Failed(2), Seen::Failed(3)], None, false, false);
        let stop = CancellationToken::new();
        let started = Instant::now();
        assert_eq!(b.turn(&stop).await, Turn::Probe);
        assert!(started.elapsed() >= Duration::from_secs(1), "not before the probe is due");
        // another worker waits for that probe to end, and then for the next one
        let other = {
            let (b, stop) = (b.clone(), stop.clone());
            tokio::spawn(async move { b.turn(&stop).await })
        };
        tokio::task::yield_now().await;
        b.observe(&[Seen::Answered], None, false, true);
        assert_eq!(other.await.unwrap(), Turn::Closed);
    }

    #[test]
    fn probes_refused_a_connection_stay_at_the_shortest_interval() {
        let b = breaker();
        b.observe(&[Seen::Failed(1), Seen::Failed(2), Seen::Failed(3)], None, true, false);
        assert_eq!(b.probe_delay(), Duration::from_secs(1));
        for event in 4..10 {
            b.observe(&[Seen::Failed(event)], None, true, true);
            assert_eq!(b.probe_delay(), Duration::from_secs(1), "nobody listens: ask again soon");
        }
        // Timeouts double it again.
        b.observe(&[Seen::Failed(10)], None, false, true);
        assert_eq!(b.probe_delay(), Duration::from_secs(2));
    }
}
