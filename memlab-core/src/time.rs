//! Wall-clock times as memlab writes them: `YYYY-MM-DD HH:MM:SS.mmm`, UTC.
//!
//! The tracker's log lines and the out-of-memory reports stamp their entries
//! this way; the date is computed here (no time-zone database, no crate), so
//! a stamp costs one small string.

use std::time::{SystemTime, UNIX_EPOCH};

/// `YYYY-MM-DD HH:MM:SS.mmm` in UTC for `secs` seconds and `millis`
/// milliseconds after 1970-01-01 00:00:00 UTC.
pub fn utc(secs: u64, millis: u32) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}.{millis:03}", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// The time now, as [`utc`] writes it (a clock set before 1970 reads as 1970).
pub fn utc_now() -> String {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
    utc(now.as_secs(), now.subsec_millis())
}

#[cfg(test)]
mod tests {
    #[test]
    fn utc_dates() {
        assert_eq!(super::utc(0, 0), "1970-01-01 00:00:00.000");
        assert_eq!(super::utc(951_782_400, 5), "2000-02-29 00:00:00.005");
        assert_eq!(super::utc(1_795_287_845, 123), "2026-11-21 19:04:05.123");
    }
}
