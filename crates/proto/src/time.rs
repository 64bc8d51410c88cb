//! Wall-clock timestamps as carried on the wire.

use serde::{Deserialize, Serialize};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Seconds and nanoseconds since the Unix epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize)]
pub struct Timespec {
    pub sec: i64,
    pub nsec: u32,
}

impl Timespec {
    pub fn now() -> Self {
        Self::from(SystemTime::now())
    }
}

impl From<SystemTime> for Timespec {
    fn from(t: SystemTime) -> Self {
        match t.duration_since(UNIX_EPOCH) {
            Ok(d) => Timespec { sec: d.as_secs() as i64, nsec: d.subsec_nanos() },
            Err(e) => {
                let d = e.duration();
                let mut sec = -(d.as_secs() as i64);
                let mut nsec = d.subsec_nanos();
                if nsec > 0 {
                    sec -= 1;
                    nsec = 1_000_000_000 - nsec;
                }
                Timespec { sec, nsec }
            }
        }
    }
}

impl From<Timespec> for SystemTime {
    fn from(t: Timespec) -> Self {
        if t.sec >= 0 {
            UNIX_EPOCH + Duration::new(t.sec as u64, t.nsec)
        } else {
            UNIX_EPOCH - Duration::new((-t.sec) as u64, 0) + Duration::new(0, t.nsec)
        }
    }
}

/// `t` as a UTC time of day, `HH:MM:SS UTC`: for a message that says until when something is
/// waited for.
pub fn utc_clock(t: std::time::SystemTime) -> String {
    let ms = t.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    let full = utc_clock_ms(ms);
    format!("{} UTC", &full[..8])
}

/// A time in milliseconds since the epoch as a UTC time of day, `HH:MM:SS.mmm UTC` (for a line
/// that scripts compare with their own clocks).
pub fn utc_clock_ms(unix_ms: u64) -> String {
    let ms_of_day = unix_ms % 86_400_000;
    let (h, m, s, ms) = (ms_of_day / 3_600_000, ms_of_day / 60_000 % 60, ms_of_day / 1000 % 60, ms_of_day % 1000);
    format!("{h:02}:{m:02}:{s:02}.{ms:03} UTC")
}

#[cfg(test)]
mod clock_tests {
    #[test]
    fn a_time_of_day_in_utc() {
        let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(86_400 * 3 + 13 * 3600 + 5 * 60 + 9);
        assert_eq!(super::utc_clock(t), "13:05:09 UTC");
        assert_eq!(super::utc_clock_ms(((86_400 * 3 + 13 * 3600 + 5 * 60 + 9) * 1000 + 42) as u64), "13:05:09.042 UTC");
    }
}
