//! The rate limit of a relay's deliveries ([`RelayConfig::rate_limit`](super::RelayConfig::rate_limit)),
//! shared by its workers, and the pause a destination's `Retry-After` asks for.
//!
//! A token bucket of a tenth of a second's events (one at least): a delivery takes a token, and
//! waits for one when there is none. A 429 cuts the rate in effect by a quarter (once a second at most); it
//! grows back by a tenth of the configured rate per second without one. A 429 or 503 whose `Retry-After` asks for a pause
//! holds every delivery until then (at most [`LONGEST_PAUSE`]), with or without a rate limit.

use std::time::Duration;

use tokio::time::Instant;

/// The longest pause a `Retry-After` imposes on every delivery (the event that got it waits as
/// long as it asks, within `backoff_max`).
pub(crate) const LONGEST_PAUSE: Duration = Duration::from_secs(60);

/// The lowest rate a run of 429s brings the configured rate to, as a share of it.
const FLOOR_SHARE: f64 = 0.01;

/// The bucket's state.
#[derive(Debug, Clone)]
pub(crate) struct Bucket {
    /// Events per second, as configured.
    configured: Option<f64>,
    /// In effect: the configured rate, lowered by 429s.
    rate: f64,
    tokens: f64,
    refilled: Instant,
    /// No delivery before then (a `Retry-After`).
    paused_until: Option<Instant>,
    last_refusal: Option<Instant>,
}

impl Bucket {
    /// A bucket for `per_second` events a second (`None`: no rate limit, only the pauses).
    pub(crate) fn new(per_second: Option<f64>, now: Instant) -> Self {
        let rate = per_second.unwrap_or(f64::INFINITY);
        Bucket {
            configured: per_second,
            rate,
            tokens: capacity(rate),
            refilled: now,
            paused_until: None,
            last_refusal: None,
        }
    }

    /// The rate in effect (infinite without a rate limit).
    #[cfg(test)]
    pub(crate) fn rate(&self) -> f64 {
        self.rate
    }

    /// Takes `n` tokens at `now` if it can (a batch larger than the bucket takes it full, and
    /// leaves it in debt), or says how long to wait before asking again.
    pub(crate) fn take(&mut self, n: usize, now: Instant) -> Result<(), Duration> {
        if let Some(until) = self.paused_until.filter(|until| *until > now) {
            return Err(until - now);
        }
        let Some(configured) = self.configured else { return Ok(()) };
        let elapsed = now.saturating_duration_since(self.refilled).as_secs_f64();
        self.refilled = self.refilled.max(now);
        if self.last_refusal.is_none_or(|at| now.saturating_duration_since(at) >= Duration::from_secs(1)) {
            self.rate = (self.rate + configured * 0.1 * elapsed).min(configured);
        }
        let capacity = capacity(self.rate);
        self.tokens = (self.tokens + elapsed * self.rate).min(capacity);
        let wanted = (n as f64).min(capacity);
        if self.tokens >= wanted {
            self.tokens -= n as f64;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((wanted - self.tokens) / self.rate).max(Duration::from_millis(1)))
        }
    }

    /// The destination answered 429 (at `now`), asking to wait `retry_after` if it said.
    pub(crate) fn refused(&mut self, retry_after: Option<Duration>, now: Instant) {
        // Once a second at most: the answers to requests sent together come back together.
        let cut = self.last_refusal.is_none_or(|at| now.saturating_duration_since(at) >= Duration::from_secs(1));
        if let Some(configured) = self.configured
            && cut
        {
            self.rate = (self.rate * 0.75).max(configured * FLOOR_SHARE);
            self.tokens = self.tokens.min(capacity(self.rate));
        }
        self.last_refusal = Some(now);
        self.pause(retry_after, now);
    }

    /// The destination asked for a pause of `retry_after` (a 503's `Retry-After`).
    pub(crate) fn pause(&mut self, retry_after: Option<Duration>, now: Instant) {
        if let Some(delay) = retry_after.filter(|d| !d.is_zero()) {
            let until = now + delay.min(LONGEST_PAUSE);
            self.paused_until = Some(self.paused_until.map_or(until, |at| at.max(until)));
        }
    }
}

/// A tenth of a second's events, one at least.
fn capacity(rate: f64) -> f64 {
    (rate / 10.0).max(1.0)
}

#[cfg(test)]
#[cfg(test)]
mod tests {
    use super::*;

    /// Takes one token at a time at `now` until the bucket says to wait.
    fn burst(bucket: &mut Bucket, now: Instant) -> (usize, Duration) {
        let mut n = 0;
        loop {
            match bucket.take(1, now) {
                Ok(()) => n += 1,
                Err(wait) => return (n, wait),
            }
        }
    }

    #[test]
    fn deliveries_are_spaced_at_the_rate_after_a_tenth_of_a_second_s_burst() {
        let mut now = Instant::now();
        let mut bucket = Bucket::new(Some(200.0), now);
        assert_eq!(burst(&mut bucket, now), (20, Duration::from_millis(5)));
        now += Duration::from_millis(5);
        assert_eq!(burst(&mut bucket, now), (1, Duration::from_millis(5)));
        // A batch larger than the bucket takes it full and leaves it in debt.
        now += Duration::from_millis(100);
        assert_eq!(bucket.take(100, now), Ok(()));
        assert_eq!(bucket.take(1, now), Err(Duration::from_millis(405)));
    }

    #[test]
    fn a_429_cuts_the_rate_once_a_second_and_it_grows_back_without_them() {
        let mut now = Instant::now();
        let mut bucket = Bucket::new(Some(100.0), now);
        bucket.refused(None, now);
        bucket.refused(None, now);
        assert_eq!(bucket.rate(), 75.0, "answers to requests sent together cut it once");
        for _ in 0..40 {
            now += Duration::from_secs(1);
            bucket.refused(None, now);
        }
        assert_eq!(bucket.rate(), 1.0, "never below a hundredth of the configured rate");
        now += Duration::from_millis(500);
        let _ = bucket.take(0, now);
        assert_eq!(bucket.rate(), 1.0, "no growth within a second of a 429");
        now += Duration::from_secs(20);
        let _ = bucket.take(0, now);
        assert_eq!(bucket.rate(), 100.0);
    }

    #[test]
    fn retry_after_pauses_every_delivery_with_or_without_a_rate_limit() {
        let now = Instant::now();
        for configured in [None, Some(1000.0)] {
            let mut bucket = Bucket::new(configured, now);
            assert_eq!(bucket.take(1, now), Ok(()));
            bucket.refused(Some(Duration::from_secs(2)), now);
            assert_eq!(bucket.take(1, now), Err(Duration::from_secs(2)), "{configured:?}");
            assert_eq!(bucket.take(1, now + Duration::from_secs(3)), Ok(()), "{configured:?}");
            bucket.pause(Some(Duration::from_secs(3600)), now);
            assert_eq!(bucket.take(1, now), Err(LONGEST_PAUSE), "{configured:?}");
        }
    }
}
