//! Keeps every target's pool of empty chunk files filled, in the background and on idle CPU.
//!
//! Owns one thread per store, scheduled `SCHED_IDLE` (it runs only when nothing else wants the
//! CPU), that refills the pools only while the store is quiet (no chunk request since its last
//! look): a burst of small-file creates takes pooled files made while the node was quiet
//! instead of allocating an inode each on the request path, and the refill never competes with
//! the job's I/O, whose CPU and disk it would take (Lustre precreates its OST objects for the
//! same reason). The pools themselves (`recycle`) do the file work; the thread only
//! decides when and how many. It stops once the store is gone.

use crate::recycle::Recycler;
use odfs_proto::TargetId;
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

/// Starts the thread that keeps each pool at `want` files while `requests` (the store's count
/// of chunk requests) stands still.
pub(crate) fn start(pools: Vec<(TargetId, Weak<Recycler>)>, want: usize, requests: Arc<AtomicU64>) {
    let spawned = std::thread::Builder::new().name("precreate".into()).spawn(move || {
        idle_priority();
        run(&pools, want, &requests)
    });
    if let Err(e) = spawned {
        warn!("chunk files are not precreated: cannot start the thread: {e}");
    }
}

fn run(pools: &[(TargetId, Weak<Recycler>)], want: usize, requests: &AtomicU64) {
    let mut resting_until: Vec<Option<Instant>> = vec![None; pools.len()];
    let mut seen = requests.load(Ordering::Relaxed);
    loop {
        let mut made = 0;
        for ((id, pool), rest) in pools.iter().zip(&mut resting_until) {
            let Some(pool) = pool.upgrade() else {
                return; // the store is gone
            };
            // Requests since the last look: the store is busy; wait until it is quiet.
            let now = requests.load(Ordering::Relaxed);
            if std::mem::replace(&mut seen, now) != now {
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
        if made == 0 {
            std::thread::sleep(REST);
        }
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
