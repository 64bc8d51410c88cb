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
