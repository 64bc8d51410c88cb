//! Per-agent limits toward the shared store: requests per second and bytes per second
//! (token buckets from `governor`), and a drain's share of the node's time while the job is
//! busy (`Share`). Owns nothing else.

use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use odfs_proto::stage::StageLimits;
use odfs_service::load::{Disks, Look, Own};
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

/// Bandwidth is counted in KiB so that large rates fit the limiter's 32-bit cells.
const UNIT: u64 = 1024;

pub struct Limits {
    requests: Option<DefaultDirectRateLimiter>,
    bytes: Option<(DefaultDirectRateLimiter, u32)>,
    /// The node's share gate and this run's fraction of it (drains only).
    share: Option<(Arc<Share>, f64)>,
}

impl Limits {
    /// The limits of a run; `share` is the agent's gate, used when the run has a share.
    pub fn new(l: &StageLimits, share: Option<Arc<Share>>) -> Limits {
        let requests = (l.requests_per_sec > 0.0).then(|| {
            let per_sec = NonZeroU32::new(l.requests_per_sec.ceil() as u32).unwrap_or(NonZeroU32::MIN);
            // A burst of one: requests are spread evenly, never sent in a clump.
            RateLimiter::direct(Quota::per_second(per_sec).allow_burst(NonZeroU32::MIN))
        });
        let bytes = (l.bytes_per_sec > 0).then(|| {
            let per_sec = (l.bytes_per_sec / UNIT).clamp(1, u32::MAX as u64) as u32;
            // The burst must hold the largest single take (one 16 MiB block).
            let burst = per_sec.max((16 << 20) / UNIT as u32);
            let q = Quota::per_second(NonZeroU32::new(per_sec).expect("at least 1"))
                .allow_burst(NonZeroU32::new(burst).expect("at least 1"));
            let r = RateLimiter::direct(q);
            // A new limiter starts full; emptied, it paces from the first byte instead of letting
            // every agent send a whole burst at once.
            let _ = r.check_n(NonZeroU32::new(burst).expect("at least 1"));
            (r, burst)
        });
        let share = share.filter(|_| gated(l.share)).map(|g| (g, l.share));
        Limits { requests, bytes, share }
    }

    /// Waits until one more request may go.
    pub async fn request(&self) {
        self.turn().await;
        if let Some(r) = &self.requests {
            r.until_ready().await;
        }
    }

    /// Waits until `n` more bytes may move.
    pub async fn bytes(&self, n: u64) {
        self.turn().await;
        if let Some((r, burst)) = &self.bytes {
            let mut units = n.div_ceil(UNIT);
            while units > 0 {
                let take = units.min(*burst as u64) as u32;
                let _ = r.until_n_ready(NonZeroU32::new(take).expect("non-zero")).await;
                units -= take as u64;
            }
        }
    }

    /// Waits for the run's turn under its share, if it has one.
    pub async fn turn(&self) {
        if let Some((gate, fraction)) = &self.share {
            gate.admit(*fraction).await;
        }
    }
}

/// The length of one share cycle: the drain works in the first part of each, and what the
/// node did in the rest tells whether the job is busy. Long against what a transfer does
/// once started (a part's send, up to `DRAIN_PART` bytes per upload in flight, ~0.1 s), which
/// runs over the drain's part of the cycle; short against a job's phases.
pub const PERIOD: Duration = Duration::from_secs(5);
/// The pause at the end of a cycle while the job is idle: enough to look at the node again.
pub const PROBE: Duration = Duration::from_millis(500);
/// The multipart part size of a drain with a share (and the size from which it splits a
/// file): a part is read and hashed block by block in the drain's turns, but sent in one
/// request, so smaller parts keep the drain closer to its share. S3's 10,000-part limit
/// makes a larger part where a file needs it.
pub const DRAIN_PART: u64 = 8 << 20;

/// Whether `share` (a run's `StageLimits::share`) puts the run under a gate: only a fraction
/// strictly between none and all of the node's time does.
pub fn gated(share: f64) -> bool {
    share > 0.0 && share < 1.0
}

/// Tells whether the job kept the node busy while a drain paused.
pub trait Load: Send {
    /// The drain pauses now.
    fn mark(&mut self);
    /// Whether the node was busy since the mark.
    fn busy_since_mark(&mut self) -> bool;
}

/// A drain's share of the node (`--share`), one gate per agent for all of its drain runs.
///
/// Time is cut into cycles of `PERIOD`. While the job is busy, drain transfers start only in
/// the first `fraction` of each cycle, so a drain takes at most that share of the node's time
/// from the job (plus what is in flight when its part ends: a block being read, or one part's
/// or small file's send, per upload); while the job is idle, they pause only for the last
/// `PROBE` of each cycle. Whether the job is busy is measured while the drain pauses, so the
/// drain's own work never counts: the cycle after a pause in which the node was busy is a busy
/// one. A cycle whose pause was not seen long enough to judge — none at all (the drain had
/// nothing to send), under half a `PROBE` (transfers ran late), or a pause that began cycles
/// ago (its waiters went away) — counts as busy, so a drain never runs unchecked into a busy
/// job on an old or too short look. Several drains with different shares share one gate: the
/// node's drain time is the largest of their shares.
pub struct Share {
    cycle: Mutex<Cycle>,
}

struct Cycle {
    start: Instant,
    busy: bool,
    /// When the drain's pause in this cycle began (the load was marked then).
    marked: Option<Instant>,
    load: Box<dyn Load>,
}

impl Cycle {
    /// Whether the job was busy in the pause of the cycle that ends at `now`.
    fn judge(&mut self, now: Instant) -> bool {
        match self.marked.take() {
            Some(at) if now - at >= PROBE / 2 && now - self.start < 2 * PERIOD => self.load.busy_since_mark(),
            _ => true,
        }
    }
}

impl Share {
    pub fn new(load: Box<dyn Load>) -> Arc<Share> {
        Arc::new(Share { cycle: Mutex::new(Cycle { start: Instant::now(), busy: true, marked: None, load }) })
    }

    /// Waits until a transfer with `fraction` of the node's time may start.
    pub async fn admit(&self, fraction: f64) {
        loop {
            let wait = {
                let mut c = self.cycle.lock().expect("share lock");
                let now = Instant::now();
                if now >= c.start + PERIOD {
                    c.busy = c.judge(now);
                    c.start = now;
                }
                let work = if c.busy { PERIOD.mul_f64(fraction.clamp(0.0, 1.0)) } else { PERIOD - PROBE };
                if now < c.start + work {
                    return;
                }
                if c.marked.is_none() {
                    c.load.mark();
                    c.marked = Some(now);
                }
                c.start + PERIOD - now
            };
            tokio::time::sleep(wait).await;
        }
    }

    /// Whether the job was busy at the last look.
    pub fn job_busy(&self) -> bool {
        self.cycle.lock().expect("share lock").busy
    }
}

/// Share of the node's CPU time, other than the agent's own, above which the job is busy.
const BUSY_CPU: f64 = 0.5;
/// Share of the time a disk under this node's targets may do I/O with the job still idle.
const BUSY_DISK: f64 = 0.1;

/// The node as the stage agent sees it: its CPUs (the agent's own time not counted) and the
/// disks under its targets. Busy is either: a job computing on the CPUs or reading and
/// writing through the page cache shows in the first, FUSE passthrough I/O that reaches no odfs
/// daemon in the second.
pub struct NodeLoad(Look);

impl NodeLoad {
    pub fn new(target_dirs: &[std::path::PathBuf]) -> NodeLoad {
        NodeLoad(Look::new(Own::Process, Disks::under(target_dirs.iter().map(|d| d.as_path()))))
    }
}

impl Load for NodeLoad {
    fn mark(&mut self) {
        self.0.restart();
    }

    fn busy_since_mark(&mut self) -> bool {
        !self.0.quiet_since_last(1.0 - BUSY_CPU, BUSY_DISK)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[tokio::test]
    async fn unlimited_costs_nothing_and_limits_pace() {
        let none =
            Limits::new(&StageLimits { concurrency: 1, requests_per_sec: 0.0, bytes_per_sec: 0, share: 0.0 }, None);
        for _ in 0..1000 {
            none.request().await;
        }
        none.bytes(1 << 40).await;
        let l =
            Limits::new(&StageLimits { concurrency: 1, requests_per_sec: 20.0, bytes_per_sec: 0, share: 0.0 }, None);
        let t = Instant::now();
        for _ in 0..11 {
            l.request().await;
        }
        // 11 requests at 20/s: the first is free, ten more need 0.5 s.
        assert!(t.elapsed().as_millis() >= 450, "{:?}", t.elapsed());
        // Bytes are paced from the first one: 1 MiB at 4 MiB/s takes a quarter of a second.
        let b = Limits::new(
            &StageLimits { concurrency: 1, requests_per_sec: 0.0, bytes_per_sec: 4 << 20, share: 0.0 },
            None,
        );
        let t = Instant::now();
        b.bytes(1 << 20).await;
        assert!(t.elapsed().as_millis() >= 200, "{:?}", t.elapsed());
    }

    /// A load whose answers the test sets, counting the looks.
    struct Scripted {
        busy: Arc<std::sync::atomic::AtomicBool>,
        marks: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl Load for Scripted {
        fn mark(&mut self) {
            self.marks.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        fn busy_since_mark(&mut self) -> bool {
            self.busy.load(std::sync::atomic::Ordering::Relaxed)
        }
    }

    /// Steps of 10 ms of work, each admitted by the gate, over `secs` of (paused) time: the
    /// share of the time the work went on.
    async fn worked(gate: &Share, fraction: f64, secs: u64) -> f64 {
        let step = Duration::from_millis(10);
        let (start, mut steps) = (tokio::time::Instant::now(), 0u64);
        while start.elapsed() < Duration::from_secs(secs) {
            gate.admit(fraction).await;
            tokio::time::sleep(step).await;
            steps += 1;
        }
        (steps * step.as_millis() as u64) as f64 / start.elapsed().as_millis() as f64
    }

    #[tokio::test(start_paused = true)]
    async fn a_share_holds_a_drain_to_its_fraction_while_the_job_is_busy_and_frees_it_when_idle() {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        let busy = Arc::new(AtomicBool::new(true));
        let marks = Arc::new(AtomicUsize::new(0));
        let gate = Share::new(Box::new(Scripted { busy: busy.clone(), marks: marks.clone() }));
        // The clock is tokio's paused one: every sleep advances it exactly, so these shares are
        // exact up to one step per cycle.
        let w = worked(&gate, 0.2, 100).await;
        assert!((0.19..=0.23).contains(&w), "busy job, share 20%: worked {w}");
        assert!(gate.job_busy());
        assert!(marks.load(Ordering::Relaxed) >= 19, "the node is looked at in every pause");
        busy.store(false, Ordering::Relaxed);
        let w = worked(&gate, 0.2, 100).await;
        assert!(w >= 0.85, "idle job: only the probe pauses, worked {w}");
        assert!(!gate.job_busy());
        busy.store(true, Ordering::Relaxed);
        let w = worked(&gate, 0.5, 100).await;
        assert!((0.49..=0.56).contains(&w), "busy again, share 50%: worked {w}");
        // A pause whose waiters went away long ago is no look at the job: busy, even though the
        // load now says idle.
        busy.store(false, Ordering::Relaxed);
        tokio::time::sleep(PERIOD * 3).await;
        gate.admit(0.2).await;
        assert!(gate.job_busy(), "a stale look counts as busy");
    }
}
