//! File locks across nodes, the client's side (docs/architecture.md, "Locks across nodes"):
//! lock requests to the inode's metad shard; which of this client's lock owners have taken
//! locks on which inodes, so that a close without locks costs no request; and a copy of the
//! locks granted, taken back from a shard that restarted.

use crate::fs::{Client, Ctx};
use crate::Result;
use odfs_proto::locks::{LockTable, Request};
use odfs_proto::meta::{DropLocks, LockHolder, LockKind, SetLock, TestLock};
use odfs_proto::InodeId;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;
use tracing::{info, warn};

/// A lock request: owner (the kernel's lock owner), kind and inclusive byte range.
#[derive(Debug, Clone, Copy)]
pub struct LockAsk {
    pub owner: u64,
    pub pid: u32,
    pub kind: LockKind,
    pub start: u64,
    pub end: u64,
}

impl LockAsk {
    /// The request to the inode's shard.
    fn message(&self, ino: InodeId, wait_ms: u32, reclaim: bool) -> SetLock {
        let (owner, pid, kind, start, end) = (self.owner, self.pid, self.kind, self.start, self.end);
        SetLock { ino, owner, pid, kind, start, end, wait_ms, reclaim }
    }

    /// As the client's copy of its grants holds it (every lock there is this client's: 0).
    fn mirrored(&self) -> Request {
        Request { client: 0, owner: self.owner, pid: self.pid, kind: self.kind, start: self.start, end: self.end }
    }
}

impl From<&Request> for LockAsk {
    fn from(r: &Request) -> LockAsk {
        LockAsk { owner: r.owner, pid: r.pid, kind: r.kind, start: r.start, end: r.end }
    }
}

/// The client's own locks (`client` 0 in `granted`: every lock there is this client's).
#[derive(Default)]
struct Held {
    /// Owners that asked for a lock on each inode, listed before the request goes (a close
    /// racing with the grant must drop it) and until their close.
    owners: HashMap<InodeId, HashSet<u64>>,
    /// The locks granted, as the shard holds them.
    granted: LockTable,
}

#[derive(Default)]
pub(crate) struct LockOwners {
    held: Mutex<Held>,
    /// Inodes in `held.owners`, read without the lock: every close asks, and almost none has
    /// locks.
    inodes: AtomicUsize,
}

impl LockOwners {
    fn with<T>(&self, f: impl FnOnce(&mut Held) -> T) -> T {
        let mut held = self.held.lock().expect("locks lock");
        let out = f(&mut held);
        self.inodes.store(held.owners.len(), Ordering::Relaxed);
        out
    }

    fn note(&self, ino: InodeId, owner: u64) {
        self.with(|h| h.owners.entry(ino).or_default().insert(owner));
    }

    fn granted(&self, ino: InodeId, ask: &LockAsk) {
        self.with(|h| h.granted.set(ino, &ask.mirrored()));
    }

    /// Forgets the owners of `ino` among `owners`; returns those that were listed.
    fn take(&self, ino: InodeId, owners: &[u64]) -> Vec<u64> {
        self.with(|h| {
            h.granted.drop_owners(0, ino, owners);
            let Some(set) = h.owners.get_mut(&ino) else { return Vec::new() };
            let gone: Vec<u64> = owners.iter().copied().filter(|o| set.remove(o)).collect();
            if set.is_empty() {
                h.owners.remove(&ino);
            }
            gone
        })
    }

    fn holds(&self, ino: InodeId, owner: u64) -> bool {
        if self.inodes.load(Ordering::Relaxed) == 0 {
            return false;
        }
        self.with(|h| h.owners.get(&ino).is_some_and(|s| s.contains(&owner)))
    }

    /// The locks granted on inodes of `shard`, to take back from it.
    fn on_shard(&self, shard: u16) -> Vec<(InodeId, Request)> {
        self.with(|h| h.granted.locks_where(|ino| ino.shard() == shard))
    }
}

impl Client {
    /// Asks `ino`'s shard for the lock (or unlock) `ask`, letting the shard wait up to `wait`
    /// for conflicting locks to go: true when granted.
    pub async fn set_lock(&self, ctx: &Ctx, ino: InodeId, ask: LockAsk, wait: Duration) -> Result<bool> {
        let wait_ms = wait.as_millis().min(u32::MAX as u128) as u32;
        let (owner, kind) = (ask.owner, ask.kind);
        let q = ask.message(ino, wait_ms, false);
        // Listed before the request, so a close racing with the grant drops it too, and again
        // after a grant, in case such a close took it off the list meanwhile.
        if kind != LockKind::Unlock {
            self.inner.locks.note(ino, owner);
        }
        let granted = self.meta(ctx, ino.shard(), &q).await?;
        if granted {
            if kind != LockKind::Unlock {
                self.inner.locks.note(ino, owner);
            }
            self.inner.locks.granted(ino, &ask);
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

    /// The shard forgot this client (it restarted, or the session lapsed): takes back every
    /// lock this client holds on the shard's inodes. A lock another client took meanwhile (a
    /// session that lapsed) is lost: said in the log, and its owner's locks on the file go.
    pub(crate) async fn reclaim_locks(&self, shard: u16) {
        let locks = self.inner.locks.on_shard(shard);
        if locks.is_empty() {
            return;
        }
        let (mut kept, ctx) = (0, Ctx::root());
        for (ino, r) in locks {
            let (owner, start, end) = (r.owner, r.start, r.end);
            let q = LockAsk::from(&r).message(ino, 0, true);
            match self.meta(&ctx, shard, &q).await {
                Ok(true) => kept += 1,
                Ok(false) => {
                    warn!(shard, %ino, owner, start, end, "a file lock held before the metadata shard forgot this node was taken by another meanwhile: lost");
                    if let Err(e) = self.drop_locks(&ctx, ino, &[owner]).await {
                        warn!(shard, %ino, error = %e, "cannot drop the locks of an owner that lost one");
                    }
                }
                Err(e) => {
                    warn!(shard, %ino, error = %e, "cannot take a file lock back from a restarted metadata shard")
                }
            }
        }
        info!(shard, locks = kept, "file locks taken back from a metadata shard that forgot this node");
    }
}
