//! File locks across nodes, the client's side (docs/architecture.md, "Locks across nodes"):
//! lock requests to the inode's metad shard, and which of this client's lock owners have taken
//! locks on which inodes, so that a close without locks costs no request.

use crate::fs::{Client, Ctx};
use crate::Result;
use odfs_proto::meta::{DropLocks, LockHolder, LockKind, SetLock, TestLock};
use odfs_proto::InodeId;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;
use tracing::warn;

/// A lock request: owner (the kernel's lock owner), kind and inclusive byte range.
#[derive(Debug, Clone, Copy)]
pub struct LockAsk {
    pub owner: u64,
    pub pid: u32,
    pub kind: LockKind,
    pub start: u64,
    pub end: u64,
}

/// Lock owners of this client that took locks, by inode. An owner stays listed after an
/// unlock of part of its range (it may hold the rest) until its close drops everything.
#[derive(Default)]
pub(crate) struct LockOwners {
    held: Mutex<HashMap<InodeId, HashSet<u64>>>,
    /// Inodes in `held`, read without the lock: every close asks, and almost none has locks.
    inodes: AtomicUsize,
}

impl LockOwners {
    fn note(&self, ino: InodeId, owner: u64) {
        let mut held = self.held.lock().expect("locks lock");
        held.entry(ino).or_default().insert(owner);
        self.inodes.store(held.len(), Ordering::Relaxed);
    }

    /// Forgets the owners of `ino` among `owners`; returns those that were listed.
    fn take(&self, ino: InodeId, owners: &[u64]) -> Vec<u64> {
        let mut held = self.held.lock().expect("locks lock");
        let Some(set) = held.get_mut(&ino) else { return Vec::new() };
        let gone: Vec<u64> = owners.iter().copied().filter(|o| set.remove(o)).collect();
        if set.is_empty() {
            held.remove(&ino);
        }
        self.inodes.store(held.len(), Ordering::Relaxed);
        gone
    }

    fn holds(&self, ino: InodeId, owner: u64) -> bool {
        if self.inodes.load(Ordering::Relaxed) == 0 {
            return false;
        }
        self.held.lock().expect("locks lock").get(&ino).is_some_and(|s| s.contains(&owner))
    }

    /// The shard forgot this client (it restarted, or the session lapsed): the locks this
    /// client's owners held there are gone. Said once, naming how many files it concerns.
    pub(crate) fn shard_forgot(&self, shard: u16) {
        let mut held = self.held.lock().expect("locks lock");
        let before = held.len();
        held.retain(|ino, _| ino.shard() != shard);
        self.inodes.store(held.len(), Ordering::Relaxed);
        let lost = before - held.len();
        if lost > 0 {
            warn!(
                shard,
                files = lost,
                "a metadata shard restarted or ended this node's session: the file locks held on its files are lost"
            );
        }
    }
}

impl Client {
    /// Asks `ino`'s shard for the lock (or unlock) `ask`, letting the shard wait up to `wait`
    /// for conflicting locks to go: true when granted.
    pub async fn set_lock(&self, ctx: &Ctx, ino: InodeId, ask: LockAsk, wait: Duration) -> Result<bool> {
        let wait_ms = wait.as_millis().min(u32::MAX as u128) as u32;
        let q =
            SetLock { ino, owner: ask.owner, pid: ask.pid, kind: ask.kind, start: ask.start, end: ask.end, wait_ms };
        // Listed before the request, so a close racing with the grant drops it too, and again
        // after a grant, in case such a close took it off the list meanwhile.
        if ask.kind != LockKind::Unlock {
            self.inner.locks.note(ino, ask.owner);
        }
        let granted = self.meta(ctx, ino.shard(), &q).await?;
        if granted && ask.kind != LockKind::Unlock {
            self.inner.locks.note(ino, ask.owner);
        }
        Ok(granted)
    }

    /// The first lock of another owner that would refuse `ask` (F_GETLK), if any.
    pub async fn test_lock(&self, ctx: &Ctx, ino: InodeId, ask: LockAsk) -> Result<Option<LockHolder>> {
        let q = TestLock { ino, owner: ask.owner, kind: ask.kind, start: ask.start, end: ask.end };
        self.meta(ctx, ino.shard(), &q).await
    }

    /// Whether `owner` took a lock on `ino` that its close must drop.
    pub fn holds_locks(&self, ino: InodeId, owner: u64) -> bool {
        self.inner.locks.holds(ino, owner)
    }

    /// Drops every lock of `owners` on `ino` (their close): no request when none took one.
    pub async fn drop_locks(&self, ctx: &Ctx, ino: InodeId, owners: &[u64]) -> Result<()> {
        let owners = self.inner.locks.take(ino, owners);
        if owners.is_empty() {
            return Ok(());
        }
        self.meta(ctx, ino.shard(), &DropLocks { ino, owners }).await
    }
}
