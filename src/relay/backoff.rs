//! Retry delays: exponential, capped, jittered. A pure function, so its bounds are tested.

use std::time::Duration;

/// The delay before retrying after failed attempt number `attempt` (1 for the first failure).
///
/// The undisturbed delay is `base * 2^(attempt - 1)`, capped at `max`. Jitter takes a share
/// `jitter` (0 to 1) of it and scales that share by `random` (0 to 1): the result lies in
/// `[delay * (1 - jitter), delay]`, so it never exceeds `max` and never drops below
/// `delay * (1 - jitter)`.
pub(crate) fn retry_delay(attempt: u32, base: Duration, max: Duration, jitter: f64, random: f64) -> Duration {
    let exponent = attempt.saturating_sub(1).min(62);
    let full = base.saturating_mul(1u32.checked_shl(exponent.min(31)).unwrap_or(u32::MAX));
    let full = if exponent > 31 { max } else { full.min(max) };
    let jitter = jitter.clamp(0.0, 1.0);
    let random = random.clamp(0.0, 1.0);
    full.mul_f64(1.0 - jitter + jitter * random)
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn without_jitter_the_delay_doubles_up_to_the_cap() {
        let max = Duration::from_secs(60);
        let delays: Vec<u64> = (1..=9).map(|a| retry_delay(a, S, max, 0.0, 0.5).as_secs()).collect();
        assert_eq!(delays, vec![1, 2, 4, 8, 16, 32, 60, 60, 60]);
    }

    #[test]
    fn huge_attempt_numbers_stay_at_the_cap() {
        let max = Duration::from_secs(3600);
        for attempt in [30, 31, 32, 33, 63, 64, 1000, u32::MAX] {
            assert_eq!(retry_delay(attempt, S, max, 0.0, 0.0), max, "attempt {attempt}");
        }
    }

    #[test]
    fn jitter_stays_within_its_bounds() {
        let max = Duration::from_secs(3600);
        for attempt in 1..40 {
            let full = retry_delay(attempt, S, max, 0.0, 0.0);
            let low = retry_delay(attempt, S, max, 0.25, 0.0);
            let high = retry_delay(attempt, S, max, 0.25, 1.0);
            assert_eq!(high, full);
            assert_eq!(low, full.mul_f64(0.75));
            for r in [0.1, 0.5, 0.9] {
                let d = retry_delay(attempt, S, max, 0.25, r);
                assert!(d >= low && d <= high && d <= max, "attempt {attempt}: {d:?}");
            }
        }
    }

    #[test]
    fn attempt_zero_is_treated_as_the_first() {
        assert_eq!(retry_delay(0, S, Duration::from_secs(10), 0.0, 0.0), S);
    }

    #[test]
    fn out_of_range_jitter_and_random_are_clamped() {
        let max = Duration::from_secs(10);
        assert_eq!(retry_delay(1, S, max, 2.0, 1.0), S);
        assert_eq!(retry_delay(1, S, max, -1.0, 0.0), S);
        assert_eq!(retry_delay(1, S, max, 1.0, -3.0), Duration::ZERO);
    }
}
