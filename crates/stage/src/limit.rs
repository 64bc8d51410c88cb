//! Per-agent limits toward the shared store: requests per second and bytes per second
//! (token buckets from `governor`). Owns nothing else.

use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use odfs_proto::stage::StageLimits;
use std::num::NonZeroU32;

/// Bandwidth is counted in KiB so that large rates fit the limiter's 32-bit cells.
const UNIT: u64 = 1024;

pub struct Limits {
    requests: Option<DefaultDirectRateLimiter>,
    bytes: Option<(DefaultDirectRateLimiter, u32)>,
}

impl Limits {
    pub fn new(l: &StageLimits) -> Limits {
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
        Limits { requests, bytes }
    }

    /// Waits until one more request may go.
    pub async fn request(&self) {
        if let Some(r) = &self.requests {
            r.until_ready().await;
        }
    }

    /// Waits until `n` more bytes may move.
    pub async fn bytes(&self, n: u64) {
        if let Some((r, burst)) = &self.bytes {
            let mut units = n.div_ceil(UNIT);
            while units > 0 {
                let take = units.min(*burst as u64) as u32;
                let _ = r.until_n_ready(NonZeroU32::new(take).expect("non-zero")).await;
                units -= take as u64;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[tokio::test]
    async fn unlimited_costs_nothing_and_limits_pace() {
        let none = Limits::new(&StageLimits { concurrency: 1, requests_per_sec: 0.0, bytes_per_sec: 0 });
        for _ in 0..1000 {
            none.request().await;
        }
        none.bytes(1 << 40).await;
        let l = Limits::new(&StageLimits { concurrency: 1, requests_per_sec: 20.0, bytes_per_sec: 0 });
        let t = Instant::now();
        for _ in 0..11 {
            l.request().await;
        }
        // 11 requests at 20/s: the first is free, ten more need 0.5 s.
        assert!(t.elapsed().as_millis() >= 450, "{:?}", t.elapsed());
        // Bytes are paced from the first one: 1 MiB at 4 MiB/s takes a quarter of a second.
        let b = Limits::new(&StageLimits { concurrency: 1, requests_per_sec: 0.0, bytes_per_sec: 4 << 20 });
        let t = Instant::now();
        b.bytes(1 << 20).await;
        assert!(t.elapsed().as_millis() >= 200, "{:?}", t.elapsed());
    }
}
