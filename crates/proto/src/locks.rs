//! A table of file locks (`flock`, `fcntl`, OFD) by inode (docs/architecture.md, "Locks across
//! nodes"): a metad shard's, of every client, and a client's copy of its own grants, which it
//! takes back from a restarted shard.
//!
//! Owns the POSIX rules of one lock table: conflicts between owners, an owner's own locks
//! replaced and split by a new lock or unlock on part of their range, and which locks go when
//! an owner closes or a client's session ends.

use crate::meta::{LockHolder, LockKind};
use crate::InodeId;
use std::collections::HashMap;

/// Locks one inode may hold at once (every owner together): a bound on what a runaway locker
/// costs the shard's memory; past it a new lock is refused with ENOLCK.
pub const MAX_LOCKS_PER_INODE: usize = 16_384;

/// One lock: its holder (client and the kernel's lock owner there), kind and inclusive range.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Held {
    client: u64,
    owner: u64,
    pid: u32,
    write: bool,
    start: u64,
    end: u64,
}

impl Held {
    fn overlaps(&self, start: u64, end: u64) -> bool {
        self.start <= end && start <= self.end
    }

    fn is(&self, client: u64, owner: u64) -> bool {
        self.client == client && self.owner == owner
    }
}

/// What a lock request found.
#[derive(Debug, PartialEq, Eq)]
pub enum SetOutcome {
    Granted,
    /// Another owner holds a conflicting lock.
    Conflict,
    /// The inode holds `MAX_LOCKS_PER_INODE` locks already.
    Full,
}

/// Locks by inode: a shard's, of every client, or a client's copy of its own grants.
#[derive(Default)]
pub struct LockTable {
    by_ino: HashMap<InodeId, Vec<Held>>,
}

/// A lock request of one owner on one inode's range.
#[derive(Debug, Clone, Copy)]
pub struct Request {
    pub client: u64,
    pub owner: u64,
    pub pid: u32,
    pub kind: LockKind,
    pub start: u64,
    pub end: u64,
}

impl LockTable {
    /// The first lock of another owner that a lock of `kind` on the range would conflict with.
    pub fn test(&self, ino: InodeId, q: &Request) -> Option<LockHolder> {
        let write = match q.kind {
            LockKind::Unlock => return None,
            k => k == LockKind::Write,
        };
        let h = self.conflict(ino, q, write)?;
        Some(LockHolder {
            kind: if h.write { LockKind::Write } else { LockKind::Read },
            start: h.start,
            end: h.end,
            // A pid means something only on the node that holds the lock.
            pid: if h.client == q.client { h.pid } else { 0 },
        })
    }

    fn conflict(&self, ino: InodeId, q: &Request, write: bool) -> Option<&Held> {
        self.by_ino
            .get(&ino)?
            .iter()
            .find(|h| !h.is(q.client, q.owner) && h.overlaps(q.start, q.end) && (h.write || write))
    }

    /// Takes, changes or drops (unlock) the owner's lock on the range, unless another owner's
    /// lock conflicts. An unlock always succeeds and reports whether anything went.
    pub fn set(&mut self, ino: InodeId, q: &Request) -> (SetOutcome, bool) {
        let write = q.kind == LockKind::Write;
        if q.kind != LockKind::Unlock && self.conflict(ino, q, write).is_some() {
            return (SetOutcome::Conflict, false);
        }
        let locks = self.by_ino.entry(ino).or_default();
        if q.kind != LockKind::Unlock && locks.len() >= MAX_LOCKS_PER_INODE {
            return (SetOutcome::Full, false);
        }
        let freed = cut(locks, q);
        if q.kind != LockKind::Unlock {
            locks.push(Held { client: q.client, owner: q.owner, pid: q.pid, write, start: q.start, end: q.end });
        }
        if locks.is_empty() {
            self.by_ino.remove(&ino);
        }
        (SetOutcome::Granted, freed)
    }

    /// Drops every lock of `client`'s `owners` on `ino`; true when any went.
    pub fn drop_owners(&mut self, client: u64, ino: InodeId, owners: &[u64]) -> bool {
        let Some(locks) = self.by_ino.get_mut(&ino) else { return false };
        let before = locks.len();
        locks.retain(|h| !(h.client == client && owners.contains(&h.owner)));
        let freed = locks.len() != before;
        if locks.is_empty() {
            self.by_ino.remove(&ino);
        }
        freed
    }

    /// Every lock of inodes that `pick` selects, as the requests that would take them again.
    pub fn locks_where(&self, pick: impl Fn(InodeId) -> bool) -> Vec<(InodeId, Request)> {
        let mut out = Vec::new();
        for (ino, locks) in self.by_ino.iter().filter(|(i, _)| pick(**i)) {
            for h in locks {
                let kind = if h.write { LockKind::Write } else { LockKind::Read };
                let q = Request { client: h.client, owner: h.owner, pid: h.pid, kind, start: h.start, end: h.end };
                out.push((*ino, q));
            }
        }
        out
    }

    /// Drops every lock of `client` (its session ended); true when any went.
    pub fn drop_client(&mut self, client: u64) -> bool {
        let mut freed = false;
        self.by_ino.retain(|_, locks| {
            let before = locks.len();
            locks.retain(|h| h.client != client);
            freed |= locks.len() != before;
            !locks.is_empty()
        });
        freed
    }
}

/// Removes the owner's coverage of the request's range from `locks`, keeping the parts of its
/// locks outside it; true when a lock that could refuse others shrank or went.
fn cut(locks: &mut Vec<Held>, q: &Request) -> bool {
    if !locks.iter().any(|h| h.is(q.client, q.owner) && h.overlaps(q.start, q.end)) {
        return false;
    }
    let mut freed = false;
    let mut kept = Vec::with_capacity(locks.len() + 1);
    for h in locks.drain(..) {
        if !h.is(q.client, q.owner) || !h.overlaps(q.start, q.end) {
            kept.push(h);
            continue;
        }
        // A write lock turned read, or any lock dropped, may let a waiter in.
        freed |= q.kind == LockKind::Unlock || (h.write && q.kind == LockKind::Read);
        if h.start < q.start {
            kept.push(Held { end: q.start - 1, ..h.clone() });
        }
        if h.end > q.end {
            kept.push(Held { start: q.end + 1, ..h });
        }
    }
    *locks = kept;
    freed
}

#[cfg(test)]
mod tests {
    use super::*;

    const INO: InodeId = InodeId(7);

    fn q(client: u64, owner: u64, kind: LockKind, start: u64, end: u64) -> Request {
        Request { client, owner, pid: 100 + owner as u32, kind, start, end }
    }

    #[test]
    fn readers_share_and_a_writer_waits_for_them() {
        let mut t = LockTable::default();
        assert_eq!(t.set(INO, &q(1, 1, LockKind::Read, 0, 99)).0, SetOutcome::Granted);
        assert_eq!(t.set(INO, &q(2, 1, LockKind::Read, 50, 149)).0, SetOutcome::Granted);
        assert_eq!(t.set(INO, &q(2, 2, LockKind::Write, 90, 95)).0, SetOutcome::Conflict);
        // Beyond both readers' ranges a writer is alone.
        assert_eq!(t.set(INO, &q(2, 2, LockKind::Write, 150, 200)).0, SetOutcome::Granted);
        assert!(t.drop_owners(1, INO, &[1]));
        assert_eq!(t.set(INO, &q(2, 2, LockKind::Write, 0, 49)).0, SetOutcome::Granted);
    }

    #[test]
    fn test_reports_the_holder_and_its_pid_only_on_its_own_node() {
        let mut t = LockTable::default();
        t.set(INO, &q(1, 3, LockKind::Write, 10, 19));
        let same = t.test(INO, &q(1, 4, LockKind::Read, 0, 100)).expect("conflict");
        assert_eq!((same.kind, same.start, same.end, same.pid), (LockKind::Write, 10, 19, 103));
        assert_eq!(t.test(INO, &q(2, 4, LockKind::Read, 0, 100)).expect("conflict").pid, 0);
        assert_eq!(t.test(INO, &q(1, 3, LockKind::Write, 0, 100)), None, "an owner never conflicts with itself");
        assert_eq!(t.test(INO, &q(2, 4, LockKind::Read, 20, 100)), None);
    }

    #[test]
    fn an_unlock_in_the_middle_splits_the_owners_lock() {
        let mut t = LockTable::default();
        t.set(INO, &q(1, 1, LockKind::Write, 0, 99));
        assert_eq!(t.set(INO, &q(1, 1, LockKind::Unlock, 40, 59)), (SetOutcome::Granted, true));
        assert_eq!(t.set(INO, &q(2, 1, LockKind::Write, 40, 59)).0, SetOutcome::Granted);
        assert_eq!(t.set(INO, &q(2, 2, LockKind::Read, 39, 39)).0, SetOutcome::Conflict);
        assert_eq!(t.set(INO, &q(2, 2, LockKind::Read, 60, 60)).0, SetOutcome::Conflict);
        assert_eq!(t.set(INO, &q(2, 2, LockKind::Read, 100, u64::MAX)).0, SetOutcome::Granted);
    }

    #[test]
    fn a_downgrade_lets_readers_in_and_an_upgrade_waits_for_them() {
        let mut t = LockTable::default();
        t.set(INO, &q(1, 1, LockKind::Write, 0, u64::MAX));
        assert_eq!(t.set(INO, &q(2, 1, LockKind::Read, 0, 0)).0, SetOutcome::Conflict);
        assert_eq!(t.set(INO, &q(1, 1, LockKind::Read, 0, u64::MAX)), (SetOutcome::Granted, true));
        assert_eq!(t.set(INO, &q(2, 1, LockKind::Read, 0, 0)).0, SetOutcome::Granted);
        assert_eq!(t.set(INO, &q(1, 1, LockKind::Write, 0, u64::MAX)).0, SetOutcome::Conflict);
        // The refused upgrade kept the read lock.
        assert_eq!(t.set(INO, &q(3, 1, LockKind::Write, 5, 5)).0, SetOutcome::Conflict);
    }

    #[test]
    fn a_session_end_drops_only_that_clients_locks() {
        let mut t = LockTable::default();
        t.set(INO, &q(1, 1, LockKind::Write, 0, 9));
        t.set(InodeId(8), &q(1, 2, LockKind::Read, 0, 9));
        t.set(INO, &q(2, 1, LockKind::Write, 10, 19));
        assert!(t.drop_client(1));
        assert!(!t.drop_client(1));
        assert_eq!(t.set(INO, &q(3, 1, LockKind::Write, 0, 9)).0, SetOutcome::Granted);
        assert_eq!(t.set(INO, &q(3, 1, LockKind::Write, 10, 10)).0, SetOutcome::Conflict);
        assert!(!t.by_ino.contains_key(&InodeId(8)), "an inode without locks leaves the table");
    }

    #[test]
    fn a_full_inode_refuses_new_locks_but_not_unlocks() {
        let mut t = LockTable::default();
        for i in 0..MAX_LOCKS_PER_INODE as u64 {
            t.set(INO, &q(1, 1, LockKind::Read, 2 * i, 2 * i));
        }
        assert_eq!(t.set(INO, &q(1, 2, LockKind::Read, 1, 1)).0, SetOutcome::Full);
        assert_eq!(t.set(INO, &q(1, 1, LockKind::Unlock, 0, 0)), (SetOutcome::Granted, true));
        assert_eq!(t.set(INO, &q(1, 2, LockKind::Read, 1, 1)).0, SetOutcome::Granted);
    }
}
