//! How busy this node's CPUs and disks were since the last look.
//!
//! Owns the readings that background work (stored's precreation, the stage agent's drains)
//! uses to stay out of the job's way: the node's CPU time from `/proc/stat`, less the caller's
//! own, and the busy time of the block devices under given directories
//! (`/sys/dev/block/MAJOR:MINOR/stat`), and `Look`, which judges from both whether the node
//! was quiet between two looks. Each reading compares with the previous one, so the caller
//! decides the interval.

use std::path::{Path, PathBuf};
use std::time::Instant;

/// Whose CPU time counts as free beside the idle time: the caller's own work does not make the
/// node busy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Own {
    /// The calling thread's (a background thread that measures between its own steps).
    Thread,
    /// The whole process's (a daemon whose every thread does the background work).
    Process,
}

/// The node's CPU time so far (`/proc/stat`, all CPUs) and the caller's own, in clock ticks.
#[derive(Clone, Copy, Debug)]
pub struct CpuTimes {
    total: u64,
    /// Idle, waiting for I/O included (a CPU with I/O outstanding is free to run work).
    idle: u64,
    own: u64,
}

impl CpuTimes {
    pub fn read(own: Own) -> Option<CpuTimes> {
        let text = std::fs::read_to_string("/proc/stat").ok()?;
        let (total, idle) = Self::parse(text.lines().next()?)?;
        Some(CpuTimes { total, idle, own: own_ticks(own) })
    }

    /// The `cpu` line (user nice system idle iowait irq softirq steal ...): total and idle.
    fn parse(line: &str) -> Option<(u64, u64)> {
        let mut f = line.split_whitespace();
        (f.next()? == "cpu").then_some(())?;
        let v: Vec<u64> = f.take(8).map(|x| x.parse().ok()).collect::<Option<_>>()?;
        (v.len() == 8).then(|| (v.iter().sum(), v[3] + v[4]))
    }

    /// The share of the node's CPU time since `before` that was idle or the caller's own.
    pub fn idle_since(&self, before: &CpuTimes) -> f64 {
        let total = self.total.saturating_sub(before.total);
        if total == 0 {
            return 0.0;
        }
        let free = self.idle.saturating_sub(before.idle) + self.own.saturating_sub(before.own);
        (free as f64 / total as f64).min(1.0)
    }
}

/// The caller's CPU time in clock ticks (the unit of `/proc/stat`).
fn own_ticks(own: Own) -> u64 {
    let clock = match own {
        Own::Thread => libc::CLOCK_THREAD_CPUTIME_ID,
        Own::Process => libc::CLOCK_PROCESS_CPUTIME_ID,
    };
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid timespec for the call to fill; sysconf has no memory arguments.
    let (ok, hz) = unsafe { (libc::clock_gettime(clock, &mut ts) == 0, libc::sysconf(libc::_SC_CLK_TCK)) };
    if !ok || hz <= 0 {
        return 0;
    }
    let ns = ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64;
    ns * hz as u64 / 1_000_000_000
}

/// Block devices, read for how busy they were since the last look.
#[derive(Default, Debug)]
pub struct Disks {
    /// Each device's `stat` file and its busy milliseconds at the last look.
    devices: Vec<(PathBuf, Option<u64>)>,
    looked: Option<Instant>,
}

impl Disks {
    /// The devices `dirs` live on, each once. A directory on a filesystem with no block device
    /// of its own (tmpfs, overlay, btrfs's anonymous devices) adds none: its disk is not
    /// watched.
    pub fn under<'a>(dirs: impl IntoIterator<Item = &'a Path>) -> Disks {
        let mut devices: Vec<(PathBuf, Option<u64>)> = Vec::new();
        for dir in dirs {
            let Some(stat) = device_stat(dir) else { continue };
            if !devices.iter().any(|(p, _)| *p == stat) {
                devices.push((stat, None));
            }
        }
        Disks { devices, looked: None }
    }

    /// Whether any device is watched.
    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
    }

    /// The largest share of the time since the last call that any device spent doing I/O
    /// (0 at the first call, or when no device is watched).
    pub fn busy_since_last(&mut self) -> f64 {
        let now = Instant::now();
        let elapsed_ms = self.looked.replace(now).map(|t| now.duration_since(t).as_secs_f64() * 1000.0);
        let mut busiest: f64 = 0.0;
        for (stat, seen) in &mut self.devices {
            let ticks = io_ticks(stat);
            if let (Some(before), Some(after), Some(ms)) = (*seen, ticks, elapsed_ms) {
                if ms > 0.0 {
                    busiest = busiest.max(after.saturating_sub(before) as f64 / ms);
                }
            }
            *seen = ticks;
        }
        busiest
    }
}

/// The node's CPUs and some disks, compared from one look to the next: whether the node was
/// quiet in between.
#[derive(Debug)]
pub struct Look {
    own: Own,
    cpu: Option<CpuTimes>,
    disks: Disks,
}

impl Look {
    /// Takes the first look: the first interval starts now.
    pub fn new(own: Own, disks: Disks) -> Look {
        let mut look = Look { own, cpu: None, disks };
        look.restart();
        look
    }

    /// Starts the interval afresh from now.
    pub fn restart(&mut self) {
        self.cpu = CpuTimes::read(self.own);
        self.disks.busy_since_last();
    }

    /// Whether, since the last look, at least `min_idle` of the node's CPU time was idle (or
    /// the caller's own) and no disk was busy more than `max_disk_busy` of the time; an
    /// unreadable `/proc/stat` is not quiet. Starts the next interval.
    pub fn quiet_since_last(&mut self, min_idle: f64, max_disk_busy: f64) -> bool {
        let now = CpuTimes::read(self.own);
        let was = std::mem::replace(&mut self.cpu, now);
        let cpus = was.zip(now).is_some_and(|(a, b)| b.idle_since(&a) >= min_idle);
        // Both are read at every look, so each compares the same interval.
        let disks = self.disks.busy_since_last() <= max_disk_busy;
        cpus && disks
    }
}

/// `/sys/dev/block/MAJOR:MINOR/stat` of the block device holding `dir`, if it has one.
fn device_stat(dir: &Path) -> Option<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let dev = std::fs::metadata(dir).ok()?.dev();
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    if major == 0 {
        return None; // an anonymous device: no disk behind it to watch
    }
    let stat = PathBuf::from(format!("/sys/dev/block/{major}:{minor}/stat"));
    stat.exists().then_some(stat)
}

/// Milliseconds the device has spent doing I/O (`io_ticks`, the tenth field of its `stat`).
fn io_ticks(stat: &Path) -> Option<u64> {
    parse_io_ticks(&std::fs::read_to_string(stat).ok()?)
}

fn parse_io_ticks(text: &str) -> Option<u64> {
    text.split_whitespace().nth(9)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_time_is_the_share_of_cpu_nobody_but_the_caller_used() {
        let at = |busy: u64, idle: u64, iowait: u64, own: u64| {
            let (total, idle) =
                CpuTimes::parse(&format!("cpu  {busy} 0 0 {idle} {iowait} 0 0 0 0 0")).expect("a cpu line");
            CpuTimes { total, idle, own }
        };
        let start = at(1000, 1000, 100, 5);
        assert_eq!(at(1020, 1060, 120, 5).idle_since(&start), 0.8, "idle and iowait both free");
        assert_eq!(at(1070, 1030, 100, 5).idle_since(&start), 0.3, "70% busy");
        assert_eq!(at(1070, 1030, 100, 55).idle_since(&start), 0.8, "busy with the caller's own work");
        assert_eq!(start.idle_since(&start), 0.0, "no time passed");
        assert!(CpuTimes::parse("cpu0 1 2 3 4 5 6 7 8").is_none() && CpuTimes::parse("cpu 1 2").is_none());
        assert!(CpuTimes::read(Own::Thread).is_some(), "/proc/stat is readable");
        assert!(CpuTimes::read(Own::Process).is_some(), "/proc/stat is readable");
    }

    #[test]
    fn a_disks_busy_time_is_the_tenth_field_of_its_stat() {
        let line = "  181742    20522 11284754    85233   403946   382151 21346896  1101846        3   523450  1392437";
        assert_eq!(parse_io_ticks(line), Some(523450));
        assert_eq!(parse_io_ticks("1 2 3"), None);
        assert_eq!(parse_io_ticks("1 2 3 4 5 6 7 8 9 x"), None);
    }

    #[test]
    fn disks_are_as_busy_as_their_busiest_device_since_the_last_look() {
        let dir = std::env::temp_dir().join(format!("odfs-load-disks-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let stat = |name: &str, ticks: u64| {
            let p = dir.join(name);
            std::fs::write(&p, format!("1 2 3 4 5 6 7 8 0 {ticks} 11\n")).expect("write stat");
            p
        };
        let (a, b) = (stat("a", 100), stat("b", 5000));
        let mut disks = Disks { devices: vec![(a, None), (b, None)], looked: None };
        assert_eq!(disks.busy_since_last(), 0.0, "no interval at the first look");
        // Device b did I/O for 10 s since: more than any time that passes here, so it shows as
        // busy whatever the interval.
        stat("b", 15_000);
        assert!(disks.busy_since_last() > 0.5, "b was busy");
        assert_eq!(disks.busy_since_last(), 0.0, "nothing since");
        let _ = std::fs::remove_dir_all(&dir);
        assert!(device_stat(Path::new("/proc")).is_none(), "procfs has no disk");
        assert!(Disks::under([Path::new("/proc"), Path::new("/sys")]).is_empty());
    }
}
