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
use odfs_service::load::{Disks, Look, Own};
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
/// look. Precreation's own writes (a journal commit, inode table blocks) count too, so it may
/// pause for its own writeback; measured, the pools still filled within seconds (see
/// docs/decisions/0009-chunk-files-precreated-while-quiet.md).
const MAX_DISK_BUSY: f64 = 0.1;

/// Starts the thread that keeps each pool at `want` files while `requests` (the store's count
/// of chunk requests) stands still and at least `min_idle` of the node's CPU time is idle.
pub(crate) fn start(pools: Vec<(TargetId, Weak<Recycler>)>, want: usize, min_idle: f64, requests: Arc<AtomicU64>) {
    let disks = if min_idle > 0.0 {
        let pools: Vec<Arc<Recycler>> = pools.iter().filter_map(|(_, p)| p.upgrade()).collect();
        Disks::under(pools.iter().map(|p| p.dir()))
    } else {
        Disks::default()
    };
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
    node: Look,
    looked: Instant,
}

impl<'a> Quiet<'a> {
    fn new(min_idle: f64, disks: Disks, requests: &'a AtomicU64) -> Quiet<'a> {
        Quiet {
            requests,
            seen: requests.load(Ordering::Relaxed),
            min_idle,
            node: Look::new(Own::Thread, disks),
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
        self.looked = Instant::now();
        let idle = self.node.quiet_since_last(self.min_idle, MAX_DISK_BUSY);
        if !idle {
            self.seen = self.requests.load(Ordering::Relaxed);
        }
        idle
    }
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

/// Lowers this thread to `SCHED_IDLE`: it gets the CPU only when no other thread wants it.
fn idle_priority() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `param` is a valid sched_param for the call's duration; pid 0 is this thread.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) } != 0 {
        debug!("precreate thread keeps normal priority: {}", std::io::Error::last_os_error());
    }
}
