//! The store's calls into client sessions (`crate::sessions`): leases of what a read
//! answered, registered opens and releases, session polls and their ends, file locks, create
//! delegations and recalls — each joined to the namespace's checks it needs (the inode exists,
//! an orphan is not leased, a lock's range is valid). Durability and idempotency stay in
//! `store`; what these calls change is the sessions' state, which is not logged (a restart
//! starts with a grace instead).

use super::{lock_request, MetaStore, PendingReplies};
use crate::namespace::Changes;
use crate::sessions::Wait;
use odfs_proto::error::{ErrorCode, RemoteError, RpcResult};
use odfs_proto::locks::SetOutcome;
use odfs_proto::meta::*;
use odfs_proto::{InodeId, RequestHeader};
use std::sync::Arc;
use tokio::sync::Notify;

impl MetaStore {
    /// Leases the attributes of `inos` to the caller's client (it caches what it was told).
    /// An orphan (no name left) is not leased: nothing about it can be looked up, and a lease
    /// would count as a hold on it.
    pub fn lease(&mut self, h: &RequestHeader, inos: impl IntoIterator<Item = InodeId>) {
        let ns = &self.ns;
        let named = inos.into_iter().filter(|&i| ns.node(i).is_ok_and(|n| n.is_dir() || n.nlink > 0));
        self.sessions.grant(h.client_id, named);
    }

    /// Leases the names of directory `dir` to the caller's client: found and missing names
    /// alike (the client may cache a miss).
    pub fn lease_names(&mut self, h: &RequestHeader, dir: InodeId) {
        if self.ns.dir_node(dir).is_ok() {
            self.sessions.grant_names(h.client_id, dir);
        }
    }

    /// `SetLock` as the table stands now: granted, or refused by another owner's lock or by a
    /// restart's grace (the caller may wait on `locks_freed` and ask again). ENOLCK when the
    /// inode's table is full.
    pub fn set_lock(&mut self, h: &RequestHeader, q: &SetLock) -> RpcResult<bool> {
        self.ns.node(q.ino)?;
        let r = lock_request(h, q.owner, q.pid, q.kind, q.start, q.end)?;
        // After a restart the table is empty: the clients take back what they held before
        // (`reclaim`) while the grace lasts, and no other lock is granted until it ends.
        if !q.reclaim && q.kind != LockKind::Unlock && self.sessions.grace_end().is_some() {
            return Ok(false);
        }
        match self.sessions.set_lock(q.ino, &r) {
            SetOutcome::Granted => Ok(true),
            SetOutcome::Conflict => Ok(false),
            SetOutcome::Full => Err(RemoteError::new(
                ErrorCode::NoLocks,
                format!(
                    "inode {} holds {} locks, the most one file may hold",
                    q.ino,
                    odfs_proto::locks::MAX_LOCKS_PER_INODE
                ),
            )),
        }
    }

    /// `TestLock`: the first lock of another owner that would refuse the asked one.
    pub fn test_lock(&self, h: &RequestHeader, q: &TestLock) -> RpcResult<Option<LockHolder>> {
        self.ns.node(q.ino)?;
        Ok(self.sessions.test_lock(q.ino, &lock_request(h, q.owner, 0, q.kind, q.start, q.end)?))
    }

    /// `DropLocks`: the caller's owners close the file.
    pub fn drop_locks(&mut self, h: &RequestHeader, q: &DropLocks) -> RpcResult<()> {
        self.sessions.drop_locks(h.client_id, q.ino, &q.owners);
        Ok(())
    }

    /// Woken whenever a lock of this shard goes.
    pub fn locks_freed(&self) -> Arc<Notify> {
        self.sessions.locks_freed()
    }

    /// Registers a file as held open by the caller's client (an `Open` or `Create` with
    /// `register`).
    pub fn register_open(&mut self, h: &RequestHeader, ino: InodeId) {
        self.sessions.register(h.client_id, ino, h.request_id);
    }

    /// The caller's client closed these files: each orphan it was the last holder of goes;
    /// returns their attributes (their chunks go next).
    pub fn release(&mut self, h: &RequestHeader, req: &Release) -> RpcResult<ReleaseReply> {
        let mut removed = Vec::new();
        for &(ino, seq) in &req.files {
            if self.sessions.release(h.client_id, ino, seq) && self.ns.orphans.contains(&ino) {
                removed.extend(self.drop_orphan(ino)?);
            }
        }
        Ok(ReleaseReply { removed })
    }

    /// Keeps the caller's session alive and takes its acknowledgements: the opens it reports
    /// are registered, the recalls it applied are done. Returns the reply (with the recalls
    /// still pending) and what wakes a parked poll.
    pub fn session_poll(&mut self, h: &RequestHeader, q: &SessionPoll) -> (SessionReply, Arc<Notify>) {
        let lease_ms = self.sessions.lease().as_millis() as u32;
        if self.sessions.departed(h.client_id) {
            // A poll that was on its way when its client said goodbye.
            return (SessionReply { new_session: false, lease_ms, recalls: Vec::new() }, Arc::new(Notify::new()));
        }
        let new_session = self.sessions.touch(h.client_id);
        self.sessions.set_caching(h.client_id, q.caching);
        for &(ino, seq) in &q.open {
            if self.ns.getattr(ino).is_ok() {
                self.sessions.register(h.client_id, ino, seq);
            }
        }
        let (recalls, wake) = self.sessions.acknowledge(h.client_id, q.acked);
        (SessionReply { new_session, lease_ms, recalls }, wake)
    }

    /// What the replies to changes wait for (each taken once, after its request).
    pub(crate) fn pending_replies(&self) -> PendingReplies {
        self.pending.clone()
    }

    /// Ends a client's session that did not acknowledge a recall within the lease.
    pub fn end_session(&mut self, client: u64) {
        let freed = self.sessions.end(client);
        tracing::info!(
            client,
            open_files = freed.len(),
            "a client did not answer a recall within the lease; its session ended"
        );
    }

    /// `EndSession`: the client (the caller's own, or a dead one of the caller's node) is gone;
    /// no change waits for it any more.
    pub fn depart(&mut self, h: &RequestHeader, q: &EndSession) -> RpcResult<()> {
        let freed = self.sessions.depart(q.client);
        let by = if h.client_id == q.client { "itself" } else { "its node" };
        tracing::info!(client = q.client, open_files = freed.len(), "a client's session ended by {by}");
        Ok(())
    }

    /// A client's lease time.
    pub fn lease_time(&self) -> std::time::Duration {
        self.sessions.lease()
    }

    /// After a new session, the caller's client registers what it holds open again; returns
    /// how many of those inodes exist.
    pub fn reopen(&mut self, h: &RequestHeader, req: &Reopen) -> RpcResult<u64> {
        let mut n = 0;
        for &(ino, seq) in &req.files {
            if self.ns.getattr(ino).is_ok() {
                self.sessions.register(h.client_id, ino, seq);
                n += 1;
            }
        }
        Ok(n)
    }

    /// How many create delegations this shard has granted and not recalled (shared: the
    /// service reads it without the store's lock).
    pub(crate) fn delegation_count(&self) -> std::sync::Arc<std::sync::atomic::AtomicUsize> {
        self.sessions.delegation_count()
    }

    /// Ends the create delegations of other clients than the caller's on `inos` or their
    /// child directories (see `Sessions::recall_delegations`); returns what to wait for.
    pub(crate) fn recall_delegations(&mut self, h: &RequestHeader, inos: &[InodeId]) -> Vec<Wait> {
        self.sessions.recall_delegations(h.client_id, inos)
    }

    /// Ends the caller's own create delegations on `inos` (it changes what they rely on).
    pub(crate) fn end_own_delegations(&mut self, h: &RequestHeader, inos: &[InodeId]) {
        self.sessions.end_delegations_of(h.client_id, inos);
    }

    /// Recalls every other client's lease on `ino` without changing it: a client that holds
    /// the file open registers it in its answer. The reply to `h` may then wait for the
    /// answers (`Recalls::wait`). First step of `UnlinkIdle`.
    pub fn recall_inode(&mut self, h: &RequestHeader, ino: InodeId) {
        let changes = Changes { inos: vec![ino], names: Vec::new() };
        self.recall(h, h.client_id, &changes);
    }
}
