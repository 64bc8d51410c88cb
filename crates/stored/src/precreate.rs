//! Keeps every target's pool of empty chunk files filled, in the background, while the node is idle.
//!
//! Owns one thread per store, scheduled `SCHED_IDLE`, that refills the pools only while the
//! node is quiet: no chunk request reached the store since its last look, the node's CPUs
//! were mostly idle (`/proc/stat`, the thread's own time not counted), and the targets' disks
//! were mostly idle (their block devices' busy time, `/sys/dev/block/M:m/stat`). A burst of
//! small-file creates then takes pooled files made while the node was quiet instead of
//! allocating an inode each on the request path, and the refill never competes with the job,
//! whose CPU and filesystem it would take (Lustre precreates its OST objects for the same
//! reason). All three tests are needed: metadata-only work (empty files, mkdir) leaves stored
//! quiet, and `SCHED_IDLE` alone is not enough — running beside 4 x 20,000 empty-file creates it
//! halved them; FUSE passthrough writes a local checkpoint straight into its chunk file, which
//! leaves both stored and the CPUs idle (the writers wait for the disk) while the disk is at
//! its limit. The pools themselves (`recycle`) do the file work; the thread only decides when
//! and how many. It stops once the store is gone.

use crate::recycle::Recycler;
use odfs_proto::TargetId;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};
use tracing::{debug, warn};

/// Files made per step; between steps the thread checks whether the store is gone.
const BATCH: usize = 256;
/// How long the thread rests once every pool is full, or while the store is busy: a store is
/// quiet when it served no request for this long.
const REST: Duration = Duration::from_millis(500);
/// How long a target whose precreation failed (a full disk) is left alone.
const RETRY: Duration = Duration::from_secs(60);
/// The pool takes at most one in this many of its filesystem's free inodes.
const SPARE_INODES_PER_FILE: u64 = 4;
/// A disk is busy when it was doing I/O for more than this share of the time since the last
/// look. Precreation's own writes (a journal commit, inode table blocks) keep it well below.
const MAX_DISK_BUSY: f64 = 0.1;

/// Starts the thread that keeps each pool at `want` files while `requests` (the store's count
/// of chunk requests) stands still and at least `min_idle` of the node's CPU time is idle.
pub(crate) fn start(pools: Vec<(TargetId, Weak<Recycler>)>, want: usize, min_idle: f64, requests: Arc<AtomicU64>) {
    let disks = if min_idle > 0.0 { Disks::of(&pools) } else { Disks::default() };
    let spawned = std::thread::Builder::new().name("precreate".into()).spawn(move || {
        idle_priority();
        run(&pools, want, min_idle, disks, &requests)
    });
    if let Err(e) = spawned {
        warn!("chunk files are not precreated: cannot start the thread: {e}");
    }
}

fn run(pools: &[(TargetId, Weak<Recycler>)], want: usize, min_idle: f64, disks: Disks, requests: &AtomicU64) {
    let mut resting_until: Vec<Option<Instant>> = vec![None; pools.len()];
    let mut quiet = Quiet::new(min_idle, disks, requests);
    loop {
        if pools.iter().all(|(_, pool)| pool.strong_count() == 0) {
            return; // the store is gone
        }
        if !quiet.node_idle() {
            std::thread::sleep(REST);
            continue;
        }
        match fill_step(pools, &mut resting_until, want, &mut quiet) {
            None => return, // the store is gone
            Some(0) => std::thread::sleep(REST),
            Some(_) => {}
        }
    }
}

/// Makes up to one batch of files for each pool short of `want`, stopping at the first chunk
/// request the store gets meanwhile; how many were made, `None` once the store is gone.
fn fill_step(
    pools: &[(TargetId, Weak<Recycler>)],
    resting_until: &mut [Option<Instant>],
    want: usize,
    quiet: &mut Quiet,
) -> Option<usize> {
    let mut made = 0;
    for ((id, pool), rest) in pools.iter().zip(resting_until) {
        let pool = pool.upgrade()?;
        if !quiet.store_idle() {
            break;
        }
        if rest.is_some_and(|t| Instant::now() < t) {
            continue;
        }
        let short = want.saturating_sub(pool.len()).min(inodes_to_spare(&pool));
        if short == 0 {
            continue;
        }
        match pool.precreate(short.min(BATCH)) {
            Ok(n) => made += n,
            Err(e) => {
                warn!(target = id, "precreating chunk files paused for {} s: {e}", RETRY.as_secs());
                *rest = Some(Instant::now() + RETRY);
            }
        }
    }
    Some(made)
}

/// Whether the node is quiet enough to precreate: the store's request count, the node's CPU
/// time and the targets' disks' busy time, each compared with the last look.
struct Quiet<'a> {
    requests: &'a AtomicU64,
    /// The request count at the last look.
    seen: u64,
    /// 0 skips the CPU and disk tests.
    min_idle: f64,
    cpu: Option<CpuTimes>,
    disks: Disks,
    looked: Instant,
}

impl<'a> Quiet<'a> {
    fn new(min_idle: f64, mut disks: Disks, requests: &'a AtomicU64) -> Quiet<'a> {
        disks.busy_since_last();
        Quiet {
            requests,
            seen: requests.load(Ordering::Relaxed),
            min_idle,
            cpu: CpuTimes::read(),
            disks,
            looked: Instant::now(),
        }
    }

    /// No chunk request since the last look.
    fn store_idle(&mut self) -> bool {
        let now = self.requests.load(Ordering::Relaxed);
        std::mem::replace(&mut self.seen, now) == now
    }

    /// Whether at least `min_idle` of the node's CPU time was idle since the last look and no
    /// target's disk was busy, asked at most every half second (in between, the last answer,
    /// which was yes, stands). A no also starts the store's count afresh: requests while
    /// resting are not the next look's.
    fn node_idle(&mut self) -> bool {
        if self.min_idle <= 0.0 || self.looked.elapsed() < REST {
            return true;
        }
        let now = CpuTimes::read();
        let was = std::mem::replace(&mut self.cpu, now);
        self.looked = Instant::now();
        let cpus = was.zip(now).is_some_and(|(a, b)| b.idle_since(&a) >= self.min_idle);
        // Both are read at every look, so each compares the same interval.
        let disks = self.disks.busy_since_last() <= MAX_DISK_BUSY;
        let idle = cpus && disks;
        if !idle {
            self.seen = self.requests.load(Ordering::Relaxed);
        }
        idle
    }
}

/// The block devices under the targets, read for how busy they were since the last look.
#[derive(Default)]
struct Disks {
    /// Each device's `stat` file and its busy milliseconds at the last look.
    devices: Vec<(PathBuf, Option<u64>)>,
    looked: Option<Instant>,
}

impl Disks {
    /// The devices the pools' directories live on. A target on a filesystem with no block
    /// device of its own (tmpfs, overlay, btrfs's anonymous devices) adds none: its disk is
    /// not watched.
    fn of(pools: &[(TargetId, Weak<Recycler>)]) -> Disks {
        let mut devices: Vec<(PathBuf, Option<u64>)> = Vec::new();
        for (_, pool) in pools {
            let Some(stat) = pool.upgrade().and_then(|p| device_stat(p.dir())) else { continue };
            if !devices.iter().any(|(p, _)| *p == stat) {
                devices.push((stat, None));
            }
        }
        Disks { devices, looked: None }
    }

    /// The largest share of the time since the last call that any device spent doing I/O
    /// (0 at the first call, or when no device is watched).
    fn busy_since_last(&mut self) -> f64 {
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

/// Files the pool may still take from its filesystem's free inodes: a quarter of them, so
/// the pool never takes the last ones.
fn inodes_to_spare(pool: &Recycler) -> usize {
    match nix::sys::statvfs::statvfs(pool.dir()) {
        // Filesystems that report no inode counts (0) allocate them on demand.
        Ok(s) if s.files() == 0 => usize::MAX,
        Ok(s) => usize::try_from(s.files_available() / SPARE_INODES_PER_FILE).unwrap_or(usize::MAX),
        Err(_) => 0,
    }
}

/// The node's CPU time so far (`/proc/stat`, all CPUs) and this thread's, in clock ticks.
#[derive(Clone, Copy)]
struct CpuTimes {
    total: u64,
    /// Idle, waiting for I/O included (a CPU with I/O outstanding is free to run work).
    idle: u64,
    own: u64,
}

impl CpuTimes {
    fn read() -> Option<CpuTimes> {
        let text = std::fs::read_to_string("/proc/stat").ok()?;
        let (total, idle) = Self::parse(text.lines().next()?)?;
        Some(CpuTimes { total, idle, own: own_ticks() })
    }

    /// The `cpu` line (user nice system idle iowait irq softirq steal ...): total and idle.
    fn parse(line: &str) -> Option<(u64, u64)> {
        let mut f = line.split_whitespace();
        (f.next()? == "cpu").then_some(())?;
        let v: Vec<u64> = f.take(8).map(|x| x.parse().ok()).collect::<Option<_>>()?;
        (v.len() == 8).then(|| (v.iter().sum(), v[3] + v[4]))
    }

    /// The share of the node's CPU time since `before` that was idle or this thread's own.
    fn idle_since(&self, before: &CpuTimes) -> f64 {
        let total = self.total.saturating_sub(before.total);
        if total == 0 {
            return 0.0;
        }
        let free = self.idle.saturating_sub(before.idle) + self.own.saturating_sub(before.own);
        (free as f64 / total as f64).min(1.0)
    }
}

/// This thread's CPU time in clock ticks (the unit of `/proc/stat`).
fn own_ticks() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid timespec for the call to fill; sysconf has no memory arguments.
    let (ok, hz) =
        unsafe { (libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) == 0, libc::sysconf(libc::_SC_CLK_TCK)) };
    if !ok || hz <= 0 {
        return 0;
    }
    let ns = ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64;
    ns * hz as u64 / 1_000_000_000
}

/// Lowers this thread to `SCHED_IDLE`: it gets the CPU only when no other thread wants it.
fn idle_priority() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `param` is a valid sched_param for the call's duration; pid 0 is this thread.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) } != 0 {
        debug!("precreate thread keeps normal priority: {}", std::io::Error::last_os_error());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_time_is_the_share_of_cpu_nobody_but_this_thread_used() {
        let at = |busy: u64, idle: u64, iowait: u64, own: u64| {
            let (total, idle) =
                CpuTimes::parse(&format!("cpu  {busy} 0 0 {idle} {iowait} 0 0 0 0 0")).expect("a cpu line");
            CpuTimes { total, idle, own }
        };
        let start = at(1000, 1000, 100, 5);
        assert_eq!(at(1020, 1060, 120, 5).idle_since(&start), 0.8, "idle and iowait both free");
        assert_eq!(at(1070, 1030, 100, 5).idle_since(&start), 0.3, "70% busy");
        assert_eq!(at(1070, 1030, 100, 55).idle_since(&start), 0.8, "busy with this thread's own work");
        assert_eq!(start.idle_since(&start), 0.0, "no time passed");
        assert!(CpuTimes::parse("cpu0 1 2 3 4 5 6 7 8").is_none() && CpuTimes::parse("cpu 1 2").is_none());
        assert!(CpuTimes::read().is_some(), "/proc/stat is readable");
    }

    #[test]
    fn a_disks_busy_time_is_the_tenth_field_of_its_stat() {
        let line = "  181742    20522 11284754    85233   403946   382151 21346896  1101846        3   523450  1392437";
        assert_eq!(parse_io_ticks(line), Some(523450));
        assert_eq!(parse_io_ticks("1 2 3"), None);
        assert_eq!(parse_io_ticks("1 2 3 4 5 6 7 8 9 x"), None);
    }

    #[test]
    fn a_disk_is_as_busy_as_its_busiest_device_since_the_last_look() {
        let dir = std::env::temp_dir().join(format!("odfs-precreate-disks-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let stat = |name: &str, ticks: u64| {
            let p = dir.join(name);
            std::fs::write(&p, format!("1 2 3 4 5 6 7 8 0 {ticks} 11\n")).expect("write stat");
            p
        };
        let (a, b) = (stat("a", 100), stat("b", 5000));
        let mut disks = Disks { devices: vec![(a, None), (b, None)], looked: None };
        assert_eq!(disks.busy_since_last(), 0.0, "no interval at the first look");
        // Device b did I/O for 10 s since: far more than any elapsed time here, so it is busy
        // (the share is capped by nothing: it only has to exceed the threshold).
        stat("b", 15_000);
        assert!(disks.busy_since_last() > MAX_DISK_BUSY, "b was busy");
        assert_eq!(disks.busy_since_last(), 0.0, "nothing since");
        let _ = std::fs::remove_dir_all(&dir);
        assert!(device_stat(Path::new("/proc")).is_none(), "procfs has no disk");
    }
}
