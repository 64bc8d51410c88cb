//! Who asks: the caller of a request with its supplementary groups, which the kernel does not
//! send. Owns a short-lived memo of each calling thread's groups.
//!
//! Reading `/proc/<pid>/status` costs more than the rest of a create's work in odfs-fuse, and a
//! metadata storm makes thousands of requests per second from the same few threads, so each
//! thread's groups are kept for `GROUPS_TTL`, keyed by pid, uid and gid (a thread that changes
//! identity, or a pid reused by another user's process, misses). Safe because the groups are
//! only metad's second check: the mount uses `default_permissions`, so the kernel has checked
//! every request against the caller's real credentials before odfs-fuse sees it; a process
//! that dropped a group by `setgroups` alone is seen with it for at most `GROUPS_TTL` by that
//! second check.

use odfs_client::Ctx;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a thread's groups are used without reading them again.
pub const GROUPS_TTL: Duration = Duration::from_secs(1);

/// Entries kept before the expired ones are swept.
const SWEEP_AT: usize = 4096;

/// A thread's groups by (pid, uid, gid), with when they were read.
type Memo = HashMap<(u32, u32, u32), (Instant, Vec<u32>)>;

/// The memo of callers' groups.
#[derive(Default)]
pub struct Callers {
    memo: Mutex<Memo>,
}

impl Callers {
    /// The caller `uid`/`gid` of thread `pid` with its supplementary groups (none for pid 0 or
    /// a thread that is gone).
    pub fn ctx(&self, uid: u32, gid: u32, pid: u32) -> Ctx {
        if pid == 0 {
            return Ctx { uid, gid, groups: Vec::new() };
        }
        let key = (pid, uid, gid);
        let now = Instant::now();
        if let Some((at, groups)) = self.lock().get(&key) {
            if now.duration_since(*at) < GROUPS_TTL {
                return Ctx { uid, gid, groups: groups.clone() };
            }
        }
        let groups = groups_of(pid);
        let mut memo = self.lock();
        if memo.len() >= SWEEP_AT {
            memo.retain(|_, (at, _)| now.duration_since(*at) < GROUPS_TTL);
        }
        memo.insert(key, (now, groups.clone()));
        Ctx { uid, gid, groups }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Memo> {
        self.memo.lock().expect("callers lock")
    }
}

fn groups_of(pid: u32) -> Vec<u32> {
    match std::fs::read_to_string(format!("/proc/{pid}/status")) {
        Ok(text) => parse_groups(&text),
        Err(_) => Vec::new(),
    }
}

/// The supplementary groups of a /proc/<pid>/status text ("Groups:" line).
pub fn parse_groups(status: &str) -> Vec<u32> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("Groups:"))
        .map(|g| g.split_whitespace().filter_map(|n| n.parse().ok()).collect())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn own_groups() -> Vec<u32> {
        let mut g = vec![0u32; 256];
        // SAFETY: the buffer holds 256 entries and its length is passed.
        let n = unsafe { libc::getgroups(g.len() as i32, g.as_mut_ptr()) };
        g.truncate(n.max(0) as usize);
        g
    }

    #[test]
    fn a_callers_groups_come_from_proc_and_are_kept_per_identity() {
        let c = Callers::default();
        let me = c.ctx(1, 2, std::process::id());
        assert_eq!((me.uid, me.gid), (1, 2));
        assert_eq!(me.groups, own_groups());
        assert!(c.ctx(1, 2, 0).groups.is_empty());
        // Memoised under (pid, uid, gid); another identity on the same pid is read afresh.
        assert_eq!(c.lock().len(), 1);
        c.ctx(3, 4, std::process::id());
        assert_eq!(c.lock().len(), 2);
        // A gone process has no groups.
        assert!(c.ctx(1, 2, u32::MAX - 1).groups.is_empty());
    }

    #[test]
    fn groups_parse_from_a_status_text() {
        assert_eq!(parse_groups("Name:\tx\nGroups:\t4 24 27 \nNSpid:\t1\n"), vec![4, 24, 27]);
        assert!(parse_groups("Name:\tx\nGroups:\t\n").is_empty());
        assert!(parse_groups("Name:\tx\n").is_empty());
    }
}
