//! What the mount answered, by kind of FUSE request: count, errors and a latency histogram (from
//! a request's arrival to its reply), with `(no request)` kinds for those answered on the
//! reader thread with no request to any service. Lock-free (atomic counters in a table fixed
//! at compile time): the two reader threads count every request, tens of thousands a second
//! when the caches answer, and a lock they both take is a wake-up between them whenever they
//! meet. Read by `odfs stats` through the mount (`Client::on_stats`).

use odfs_proto::stats::{latency_bucket, CountingSince, MethodStats, StatsSnapshot, LATENCY_BUCKETS};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// Every kind counted: the operation names the adapter runs requests under, and those it
/// answers without a request.
const KINDS: &[&str] = &[
    "lookup (no request)",
    "getattr (no request)",
    "open (no request)",
    "open (prefetched)",
    "flush (no request)",
    "release (no request)",
    "write (no request)",
    "lookup",
    "getattr",
    "open",
    "read",
    "read (spliced)",
    "write",
    "flush",
    "release",
    "create",
    "unlink",
    "mkdir",
    "rmdir",
    "rename",
    "setattr",
    "readdir",
    "readdirplus",
    "access",
    "fsync",
    "fsyncdir",
    "fallocate",
    "link",
    "symlink",
    "readlink",
    "mknod",
    "statfs",
    "getxattr",
    "setxattr",
    "listxattr",
    "removexattr",
    "getlk",
    "setlk",
];

#[derive(Default)]
struct Slot {
    count: AtomicU64,
    errors: AtomicU64,
    latency: [AtomicU64; LATENCY_BUCKETS],
}

/// The mount's counters.
pub struct Counts {
    since: CountingSince,
    slots: Vec<Slot>,
}

impl Default for Counts {
    fn default() -> Self {
        Counts { since: CountingSince::default(), slots: KINDS.iter().map(|_| Slot::default()).collect() }
    }
}

impl Counts {
    /// Counts one request of kind `op` that took `took`. A kind not in the table is a
    /// programming error, caught by the test below; it is not counted.
    pub fn count(&self, op: &str, took: Duration, failed: bool) {
        let Some(i) = KINDS.iter().position(|k| *k == op) else {
            debug_assert!(false, "FUSE request kind {op} is not counted");
            return;
        };
        let s = &self.slots[i];
        s.count.fetch_add(1, Relaxed);
        if failed {
            s.errors.fetch_add(1, Relaxed);
        }
        s.latency[latency_bucket(took.as_micros() as u64)].fetch_add(1, Relaxed);
    }

    /// Everything counted so far, kinds by name.
    pub fn snapshot(&self) -> StatsSnapshot {
        let mut methods: Vec<MethodStats> = KINDS
            .iter()
            .zip(&self.slots)
            .filter(|(_, s)| s.count.load(Relaxed) > 0)
            .map(|(name, s)| {
                let latency: Vec<u64> = s.latency.iter().map(|n| n.load(Relaxed)).collect();
                let used = latency.iter().rposition(|n| *n > 0).map_or(0, |i| i + 1);
                MethodStats {
                    name: name.to_string(),
                    count: s.count.load(Relaxed),
                    errors: s.errors.load(Relaxed),
                    bytes_in: 0,
                    bytes_out: 0,
                    latency_us: latency[..used].to_vec(),
                }
            })
            .collect();
        methods.sort_by(|a, b| a.name.cmp(&b.name));
        StatsSnapshot { methods, ..self.since.snapshot() }
    }

    /// The same, with what the client's prefetch did: `prefetch (files read ahead)` counts
    /// files read into its buffer, `prefetch (files used)` opens served from it.
    pub fn snapshot_with(&self, p: odfs_client::PrefetchCounts) -> StatsSnapshot {
        let mut s = self.snapshot();
        for (name, count) in [("prefetch (files read ahead)", p.fetched), ("prefetch (files used)", p.used)] {
            if count > 0 {
                s.methods.push(MethodStats {
                    name: name.into(),
                    count,
                    errors: 0,
                    bytes_in: 0,
                    bytes_out: 0,
                    latency_us: Vec::new(),
                });
            }
        }
        s.methods.sort_by(|a, b| a.name.cmp(&b.name));
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_the_adapter_names_is_counted() {
        // The kinds `fs.rs` runs requests under: each must be in the table.
        let src = include_str!("fs.rs");
        let lines: Vec<&str> = src.lines().map(str::trim).collect();
        let mut named = Vec::new();
        for (i, line) in lines.iter().enumerate() {
            // `self.here(` / `self.spawn(` with the kind on the same or the next line, and
            // `count("kind"`.
            if (line.ends_with(".here(") || line.ends_with(".spawn(")) && i + 1 < lines.len() {
                named.push(lines[i + 1].trim_start_matches('"').split('"').next().unwrap().to_string());
            }
            for call in ["count(\"", ".spawn(\"", ".here(\""] {
                if let Some((_, rest)) = line.split_once(call) {
                    named.push(rest.split('"').next().unwrap().to_string());
                }
            }
        }
        assert!(named.len() > 20, "found only {named:?}");
        for n in &named {
            assert!(KINDS.contains(&n.as_str()), "{n} is not in KINDS");
        }
    }

    #[test]
    fn counts_errors_and_latency_by_kind() {
        let c = Counts::default();
        c.count("create", Duration::from_micros(100), false);
        c.count("create", Duration::from_micros(3000), true);
        c.count("open (no request)", Duration::from_nanos(500), false);
        let s = c.snapshot();
        let names: Vec<_> = s.methods.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, ["create", "open (no request)"]);
        let create = &s.methods[0];
        assert_eq!((create.count, create.errors), (2, 1));
        assert_eq!(create.percentile_us(0.5), 128);
        assert_eq!(create.percentile_us(1.0), 4096);
        assert_eq!(s.methods[1].latency_us, vec![1]);
    }
}
