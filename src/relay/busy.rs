//! How fast the relay claims: whether it is busy enough to stop writers from notifying it and
//! linger instead (see `row.rs`).

use std::time::Duration;

/// The claim rate (events per second) from which the relay stops writers from notifying it and
/// lingers instead; see `row.rs`.
pub(crate) const BUSY_RATE: f64 = 500.0;
/// The window over which [`Rate`] counts claimed events.
const RATE_WINDOW: Duration = Duration::from_millis(200);

/// The rate at which the relay claims events, over the last [`RATE_WINDOW`] or two.
#[derive(Debug)]
pub(crate) struct Rate {
    /// Start of the current window, its count so far, and the rate of the window before it.
    window: std::sync::Mutex<(tokio::time::Instant, u64, f64)>,
}

impl Default for Rate {
    fn default() -> Self {
        Rate { window: std::sync::Mutex::new((tokio::time::Instant::now(), 0, 0.0)) }
    }
}

impl Rate {
    /// Counts `events` just claimed.
    pub(crate) fn claimed(&self, events: usize) {
        let mut window = self.window.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        Self::roll(&mut window);
        window.1 += events as u64;
    }

    /// True when the recent rate is at least [`BUSY_RATE`].
    pub(crate) fn is_busy(&self) -> bool {
        let mut window = self.window.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        Self::roll(&mut window);
        let (start, count, previous) = *window;
        let current = count as f64 / start.elapsed().max(RATE_WINDOW / 4).as_secs_f64();
        previous.max(current) >= BUSY_RATE
    }

    fn roll(window: &mut (tokio::time::Instant, u64, f64)) {
        let elapsed = window.0.elapsed();
        if elapsed >= RATE_WINDOW {
            // A window with nothing in it (or several) leaves no rate behind.
            let previous = if elapsed < 2 * RATE_WINDOW { window.1 as f64 / elapsed.as_secs_f64() } else { 0.0 };
            *window = (tokio::time::Instant::now(), 0, previous);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_rate_follows_the_claims_and_fades() {
        let rate = Rate::default();
        assert!(!rate.is_busy());
        rate.claimed(10);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!rate.is_busy(), "10 events in 100 ms is 100 a second");
        rate.claimed(200);
        assert!(rate.is_busy(), "210 in 100 ms");
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert!(rate.is_busy(), "the last window still counts");
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(!rate.is_busy(), "quiet windows leave no rate");
    }
}
