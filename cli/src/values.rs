//! The parsers of flag values: durations within bounds, counts, rates, secrets.

use std::time::Duration;

use pg_outbox_relay::RelayConfig;
use pg_outbox_relay::sink::Secret;

/// A flag's value kept as a secret: clap never shows it in an error.
pub(crate) fn secret(text: &str) -> Result<Secret, String> {
    Ok(Secret::new(text))
}

pub(crate) fn sasl_mechanism(text: &str) -> Result<pg_outbox_relay::sink::SaslMechanism, String> {
    text.parse().map_err(|e: pg_outbox_relay::Error| e.to_string())
}

pub(crate) const MILLISECOND: Duration = Duration::from_millis(1);

/// A parser of humantime durations (`500ms`, `30s`, `5m`, `7d`) within `min..=max`; clap's error
/// names the flag, and a negative value reaches it (`allow_hyphen_values`) to be refused as such.
pub(crate) fn duration_in(
    min: Duration,
    max: Duration,
) -> impl Fn(&str) -> Result<Duration, String> + Clone + Send + Sync {
    move |text: &str| {
        if text.trim_start().starts_with('-') {
            return Err("a duration cannot be negative".to_string());
        }
        let value = humantime::parse_duration(text)
            .map_err(|e| format!("{e}; expected a number with a unit, e.g. 500ms, 30s, 5m, 2h or 7d"))?;
        let show = |d: Duration| humantime::format_duration(d).to_string();
        if value < min {
            return Err(format!("is {}; it must be at least {}", show(value), show(min)));
        }
        if value > max {
            return Err(format!("is {}; it must be at most {}", show(value), show(max)));
        }
        Ok(value)
    }
}

/// Retention-like ages: 0s to 100 years.
pub(crate) fn retention() -> impl Fn(&str) -> Result<Duration, String> + Clone + Send + Sync {
    duration_in(Duration::ZERO, RelayConfig::MAX_RETENTION)
}

pub(crate) fn db_timeout() -> impl Fn(&str) -> Result<Duration, String> + Clone + Send + Sync {
    duration_in(Duration::from_millis(100), Duration::from_secs(24 * 3600))
}

pub(crate) fn parse_workers(text: &str) -> Result<usize, String> {
    parse_count(text, 1, RelayConfig::MAX_WORKERS)
}

/// A rate as events per second: `N/s`, `N/m` (or `N/min`), `N/h`.
pub(crate) fn parse_rate(text: &str) -> Result<f64, String> {
    let expected = "expected events per unit of time, such as 200/s, 6000/m or 100000/h";
    let (count, unit) = text.trim().split_once('/').ok_or_else(|| format!("{text:?}: {expected}"))?;
    let per = match unit.trim() {
        "s" | "sec" => 1.0,
        "m" | "min" => 60.0,
        "h" | "hour" => 3600.0,
        other => return Err(format!("{other:?} is no unit of time: {expected}")),
    };
    let count: f64 = count.trim().parse().map_err(|_| format!("{count:?} is no number: {expected}"))?;
    let rate = count / per;
    if rate.is_finite() && rate > 0.0 && rate <= RelayConfig::MAX_RATE_LIMIT {
        Ok(rate)
    } else {
        Err(format!("{text} is out of range: above 0 and at most {} events a second", RelayConfig::MAX_RATE_LIMIT))
    }
}

pub(crate) fn parse_concurrency(text: &str) -> Result<usize, String> {
    parse_count(text, 1, RelayConfig::MAX_CONCURRENCY)
}

pub(crate) fn parse_batch_size(text: &str) -> Result<usize, String> {
    parse_count(text, 1, RelayConfig::MAX_BATCH_SIZE)
}

pub(crate) fn parse_batch_bytes(text: &str) -> Result<usize, String> {
    let (min, max) = (RelayConfig::MIN_BATCH_BYTES, RelayConfig::MAX_BATCH_BYTES);
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let scale: usize = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "kB" | "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        other => return Err(format!("unknown unit {other:?}; expected B, KiB, MiB, GiB, kB, MB or GB")),
    };
    let n = number.parse::<usize>().ok().and_then(|n| n.checked_mul(scale));
    match n {
        Some(n) if (min..=max).contains(&n) => Ok(n),
        Some(n) => Err(format!("{n} bytes is out of range; expected 1KiB ({min}) to 1GiB ({max})")),
        None => Err("expected a whole number of bytes, e.g. 8MiB".to_string()),
    }
}

pub(crate) fn parse_count(text: &str, min: usize, max: usize) -> Result<usize, String> {
    let n: usize = text.parse().map_err(|_| format!("expected a whole number from {min} to {max}"))?;
    if (min..=max).contains(&n) { Ok(n) } else { Err(format!("{n} is out of range; expected {min} to {max}")) }
}

/// A moment: an RFC 3339 time in UTC (`2026-12-05T08:00:00Z`, fractions of a second allowed) or
/// how long ago (`90m`, `2h`, `7d`), read against this machine's clock.
pub(crate) fn moment(text: &str) -> Result<std::time::SystemTime, String> {
    let text = text.trim();
    if text.len() > 10 && (text[10..].contains('+') || text[10..].contains('-')) {
        return Err(format!(
            "{text:?}: give the time in UTC (ending in Z, e.g. 2026-12-05T08:00:00Z), not with an offset"
        ));
    }
    if let Ok(at) = humantime::parse_rfc3339_weak(text) {
        return Ok(at);
    }
    if text.starts_with('-') {
        return Err("a time ago cannot be negative".to_string());
    }
    match humantime::parse_duration(text) {
        Ok(ago) => std::time::SystemTime::now().checked_sub(ago).ok_or_else(|| format!("{text} ago is before 1970")),
        Err(_) => Err(format!(
            "{text:?} is neither a time (RFC 3339 in UTC, e.g. 2026-12-05T08:00:00Z) nor a duration ago (e.g. 90m, 2h, 7d)"
        )),
    }
}
