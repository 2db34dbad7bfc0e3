//! RFC 3339 text of a point in time, for every `SystemTime` PostgreSQL can hand out.
//!
//! humantime formats only 1970 to 9999 and panics outside; a row written by hand can hold any
//! `timestamptz` (`1900-01-01`, even `infinity`, which arrives as year 294277), and listing or
//! delivering it must not bring the process down. Years outside 0000 to 9999 use ISO 8601's
//! expanded form (`+294277-01-09T04:00:54.775807Z`).

use std::fmt::Write as _;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// `2026-11-30T15:20:42.008892Z`: UTC, microseconds (rounded down).
pub(crate) fn rfc3339_micros(t: SystemTime) -> String {
    let nanos: i128 = match t.duration_since(UNIX_EPOCH) {
        Ok(after) => after.as_nanos() as i128,
        Err(before) => -(before.duration().as_nanos() as i128),
    };
    let total_micros = nanos.div_euclid(1000);
    let seconds = total_micros.div_euclid(1_000_000);
    let sub_micros = total_micros.rem_euclid(1_000_000);
    let days = seconds.div_euclid(86_400) as i64;
    let of_day = seconds.rem_euclid(86_400) as i64;
    let (year, month, day) = civil_from_days(days);
    let mut out = String::with_capacity(27);
    let _ = match year {
        0..=9999 => write!(out, "{year:04}"),
        10000.. => write!(out, "+{year}"),
        _ => write!(out, "-{:04}", -year),
    };
    let (hour, minute, second) = (of_day / 3600, of_day / 60 % 60, of_day % 60);
    let _ = write!(out, "-{month:02}-{day:02}T{hour:02}:{minute:02}:{second:02}.{sub_micros:06}Z");
    out
}

/// Serializes a time as [`rfc3339_micros`].
pub(crate) fn serialize<S: serde::Serializer>(t: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(&rfc3339_micros(*t))
}

/// Serializes an optional time as [`rfc3339_micros`] or null.
pub(crate) fn serialize_option<S: serde::Serializer>(t: &Option<SystemTime>, s: S) -> Result<S::Ok, S::Error> {
    match t {
        Some(t) => serialize(t, s),
        None => s.serialize_none(),
    }
}

/// Serializes an optional duration as whole milliseconds, or null.
pub(crate) fn serialize_millis<S: serde::Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_u64(u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
        None => s.serialize_none(),
    }
}

/// A duration of `ms` milliseconds as PostgreSQL computed it (a negative one, from clocks a
/// little apart, is zero).
pub(crate) fn millis(ms: Option<i64>) -> Option<Duration> {
    ms.map(|ms| Duration::from_millis(u64::try_from(ms).unwrap_or(0)))
}

/// The proleptic Gregorian date of a day counted from 1970-01-01 (Howard Hinnant's
/// `civil_from_days`, exact for every `i64` day a `SystemTime` can reach).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era = (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let shifted_month = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * shifted_month + 2) / 5 + 1) as u32;
    let month = if shifted_month < 10 { shifted_month + 3 } else { shifted_month - 9 } as u32;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn agrees_with_humantime_where_humantime_works() {
        let mut t: u64 = 0x1234_5678;
        for _ in 0..20_000 {
            // a cheap, deterministic spread over 1970..9999
            t = t.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            let micros = t % 253_402_300_799_000_000;
            let at = UNIX_EPOCH + Duration::from_micros(micros);
            assert_eq!(rfc3339_micros(at), humantime::format_rfc3339_micros(at).to_string());
        }
        let leap = UNIX_EPOCH + Duration::from_secs(951_782_400); // 2000-02-29
        assert_eq!(rfc3339_micros(leap), "2000-02-29T00:00:00.000000Z");
    }

    #[test]
    fn times_outside_1970_to_9999_do_not_panic() {
        let before = UNIX_EPOCH - Duration::from_micros(1);
        assert_eq!(rfc3339_micros(before), "1969-12-31T23:59:59.999999Z");
        let year_1900 = UNIX_EPOCH - Duration::from_secs(2_208_988_800);
        assert_eq!(rfc3339_micros(year_1900), "1900-01-01T00:00:00.000000Z");
        let year_10000 = UNIX_EPOCH + Duration::from_secs(253_402_300_800);
        assert_eq!(rfc3339_micros(year_10000), "+10000-01-01T00:00:00.000000Z");
        // PostgreSQL's 'infinity' and '-infinity' as tokio-postgres turns them into SystemTime
        let pg_epoch = UNIX_EPOCH + Duration::from_secs(946_684_800);
        let infinity = pg_epoch + Duration::from_micros(i64::MAX as u64);
        assert!(rfc3339_micros(infinity).starts_with("+294277-01-09T04:00:54"), "{}", rfc3339_micros(infinity));
        let minus_infinity = pg_epoch - Duration::from_micros(i64::MAX as u64 + 1);
        assert!(rfc3339_micros(minus_infinity).starts_with('-'), "{}", rfc3339_micros(minus_infinity));
    }
}
