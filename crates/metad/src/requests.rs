//! What metad's requests do beyond one call of the store, for the service to route to: the
//! coordinator decides whether a change is this shard's alone or runs as an operation spanning
//! shards ([`Coordinated`]), refreshes mgmtd's target list where a placement needs it, leases
//! what a read answered, parks lock and session-poll requests, applies delegated batches, and
//! holds each change's reply until the recalls it caused are acknowledged ([`Recalls`]).
//!
//! Owns no state of its own: the store's, the sessions' and the coordinator's are used.

use crate::namespace::Found;
use crate::shards::Coordinator;
use crate::store::{MetaReply, Mutation, PendingReplies};
use odfs_proto::error::RpcResult;
use odfs_proto::meta::*;
use odfs_proto::{ErrorCode, RequestHeader, Rpc};
use odfs_rpc::stats::Stats;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tracing::warn;

use crate::store::Shared;

/// A change tried as this shard's own first; what touches another shard (`SpansShards`) runs as
/// an operation spanning shards. [`Coordinator::coordinate`] is the one place that decides.
pub(crate) trait Coordinated: Clone + Send + Sync + 'static {
    type Reply: Send;
    /// This shard's own attempt.
    fn here(c: &Coordinator, h: &RequestHeader, q: Self) -> impl Future<Output = RpcResult<Self::Reply>> + Send;
    /// The same change as an operation spanning shards.
    fn spanning(c: &Coordinator, h: &RequestHeader, q: Self) -> impl Future<Output = RpcResult<Self::Reply>> + Send;
}

/// A change whose own attempt is one mutation of this shard's store.
macro_rules! coordinated {
    ($($req:ident => $spanning:ident;)*) => {$(
        impl Coordinated for $req {
            type Reply = <$req as Mutation>::Reply;
            async fn here(c: &Coordinator, h: &RequestHeader, q: Self) -> RpcResult<Self::Reply> {
                c.store.lock().expect("store lock").mutate(h, q)
            }
            async fn spanning(c: &Coordinator, h: &RequestHeader, q: Self) -> RpcResult<Self::Reply> {
                c.$spanning(h, q).await
            }
        }
    )*};
}

coordinated! {
    Unlink => unlink_spanning;
    Rename => rename_spanning;
    Link => link_spanning;
}

impl Coordinated for Rmdir {
    type Reply = ();
    // A striped directory's parts are sealed first (`Coordinator::rmdir`).
    async fn here(c: &Coordinator, h: &RequestHeader, q: Self) -> RpcResult<()> {
        c.rmdir(h, q).await
    }
    async fn spanning(c: &Coordinator, h: &RequestHeader, q: Self) -> RpcResult<()> {
        c.rmdir_spanning(h, q).await
    }
}

/// The longest a lock request waits at the shard before it is answered "not granted" (the
/// client asks again): waits stay short requests (docs/architecture.md, "Locks across nodes").
const MAX_LOCK_WAIT: Duration = Duration::from_secs(2);

/// Longest a create waits for a pool's targets to come online again (mgmtd restarted).
const TARGETS_WAIT: Duration = Duration::from_secs(10);

impl Coordinator {
    /// Runs change `q` here or, if it touches another shard, as an operation spanning shards.
    pub(crate) async fn coordinate<Q: Coordinated>(&self, h: &RequestHeader, q: Q) -> RpcResult<Q::Reply> {
        match Q::here(self, h, q.clone()).await {
            Err(e) if e.code == ErrorCode::SpansShards => Q::spanning(self, h, q).await,
            other => other,
        }
    }

    /// Refreshes mgmtd's target list unless mgmtd has reported every expected target (a layout
    /// would otherwise be chosen from a partial list).
    async fn targets_known(&self) {
        if !self.ready.load(Ordering::Acquire) {
            if let Err(err) = self.refresh().await {
                warn!(error = %err, "cannot refresh targets from mgmtd");
            }
        }
    }

    /// Applies `m` with every target known; if it fails with one of the codes in `again`,
    /// refreshes the target list from mgmtd once and tries again.
    async fn mutate_fresh<M: Mutation + Clone>(
        &self,
        h: &RequestHeader,
        m: M,
        again: &[ErrorCode],
    ) -> RpcResult<M::Reply> {
        self.targets_known().await;
        let first = self.store.lock().expect("store lock").mutate(h, m.clone());
        let Err(e) = &first else { return first };
        if !again.contains(&e.code) {
            return first;
        }
        // A pool with no target online right after mgmtd restarted: its stored have not
        // registered again yet (they do within a heartbeat or two). Waited for, bounded.
        let until = std::time::Instant::now() + TARGETS_WAIT;
        loop {
            if let Err(err) = self.refresh().await {
                warn!(error = %err, "cannot refresh targets from mgmtd");
                return first;
            }
            let r = self.store.lock().expect("store lock").mutate(h, m.clone());
            match r {
                Err(e) if e.message.ends_with(crate::store::NO_ONLINE_TARGETS) && std::time::Instant::now() < until => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                other => return other,
            }
        }
    }

    /// `Create`, judged against mgmtd's current target list: a failure a fresher list could
    /// change (a target registering, a space report, a pool just changed) is tried once more.
    /// An existing name of a file of another shard is opened by that shard.
    pub(crate) async fn create(&self, h: &RequestHeader, q: Create) -> RpcResult<CreateReply> {
        let (register, lookup) = (q.register, Lookup { parent: q.parent, name: q.name.clone() });
        let c = match self.mutate_fresh(h, q, &[ErrorCode::Invalid, ErrorCode::NoSpace]).await {
            Ok(c) => c,
            Err(e) if e.code == ErrorCode::SpansShards => return self.open_remote_existing(h, lookup, register).await,
            Err(e) => return Err(e),
        };
        let mut st = self.store.lock().expect("store lock");
        // Leased also when the file existed (nothing changed, nothing leased yet): a client
        // that does not register the open holds it through the lease.
        st.lease(h, [c.attr.ino]);
        if register {
            st.register_open(h, c.attr.ino);
        }
        Ok(c)
    }

    /// `SetDirLayout` against the current target list; a striped directory's parts follow.
    pub(crate) async fn set_dir_layout(&self, h: &RequestHeader, q: SetDirLayout) -> RpcResult<()> {
        let ino = q.ino;
        self.mutate_fresh(h, q, &[ErrorCode::Invalid]).await?;
        self.sync_parts(ino).await;
        Ok(())
    }

    /// `SetFileLayout` against the current target list.
    pub(crate) async fn set_file_layout(&self, h: &RequestHeader, q: SetFileLayout) -> RpcResult<Attr> {
        self.mutate_fresh(h, q, &[ErrorCode::Invalid, ErrorCode::NoSpace]).await
    }

    /// `SetAttr`; a striped directory's parts follow its new permissions.
    pub(crate) async fn set_attr(&self, h: &RequestHeader, q: SetAttr) -> RpcResult<Attr> {
        let a = self.store.lock().expect("store lock").mutate(h, q)?;
        if a.dir_stripes.len() > 1 {
            self.sync_parts(a.ino).await;
        }
        Ok(a)
    }

    /// `DelegateCreates`: layouts are chosen here, as a create chooses them, from every target.
    pub(crate) async fn delegate_creates(&self, h: &RequestHeader, q: DelegateCreates) -> RpcResult<CreateDelegation> {
        self.targets_known().await;
        self.store.lock().expect("store lock").delegate_creates(h, &q)
    }

    /// `CreateBatch`: a delegation holder's deferred changes, in one log write, each counted as
    /// the operation it is (`odfs stats`: creates by client); the answer waits for the recalls
    /// of every change in it.
    pub(crate) async fn create_batch(&self, h: &RequestHeader, q: CreateBatch, stats: &Stats) -> RpcResult<BatchReply> {
        let mut reply = BatchReply::default();
        let mut applied = Vec::with_capacity(q.entries.len());
        {
            let mut st = self.store.lock().expect("store lock");
            st.begin_log_group();
            for (i, e) in q.entries.iter().enumerate() {
                let t = std::time::Instant::now();
                let r = st.apply_deferred(h, e);
                let (took, failed) = (t.elapsed(), r.is_err());
                match e {
                    Deferred::Create { .. } => stats.record_carried::<Create>(h.client_id, took, failed),
                    Deferred::Size { .. } => stats.record_carried::<ExtendSize>(h.client_id, took, failed),
                    Deferred::Unlink { .. } => stats.record_carried::<Unlink>(h.client_id, took, failed),
                }
                match r {
                    Ok((entry, done)) => {
                        if let MetaReply::Unlink(UnlinkReply { removed: Some(gone), .. }) = done {
                            reply.removed.push(gone);
                        }
                        applied.push(entry);
                    }
                    Err(err) => reply.failed.push((i as u32, err)),
                }
            }
            st.end_log_group()?;
        }
        for entry in &applied {
            self.recalls.wait(entry).await;
        }
        Ok(reply)
    }

    /// `UnlinkIdle`: recalls first (whoever holds the file open registers it), then checks and
    /// unlinks under one lock; the router then waits for the recalls the unlink caused.
    pub(crate) async fn unlink_idle(&self, h: &RequestHeader, q: UnlinkIdle) -> RpcResult<UnlinkReply> {
        self.store.lock().expect("store lock").recall_inode(h, q.ino);
        self.recalls.wait(h).await;
        self.store.lock().expect("store lock").unlink_idle(h, &q)
    }

    /// `Lookup`, leasing the name and what it names; a name of another shard's inode is asked
    /// of that shard.
    pub(crate) async fn lookup(&self, h: &RequestHeader, q: Lookup) -> RpcResult<Attr> {
        let found = {
            let mut st = self.store.lock().expect("store lock");
            st.lease_names(h, q.parent);
            let found = st.resolve_name(h, &q)?;
            if let Found::Here(a) = &found {
                st.lease(h, [a.ino]);
            }
            found
        };
        self.resolve(h, found).await
    }

    /// `ReadDir`, leasing the names and the attributes it answers; with `plus`, other shards'
    /// entries get their attributes from their shards.
    pub(crate) async fn readdir(&self, h: &RequestHeader, q: ReadDir) -> RpcResult<ReadDirReply> {
        let mut listing = {
            let mut st = self.store.lock().expect("store lock");
            let listing = st.readdir(h, &q)?;
            st.lease_names(h, q.ino);
            st.lease(h, listing.entries.iter().filter_map(|e| e.attr.as_ref().map(|a| a.ino)));
            listing
        };
        if q.plus {
            self.fill_remote_attrs(h, &mut listing.entries).await?;
        }
        Ok(listing)
    }

    /// `GetAttr`, leased.
    pub(crate) fn getattr(&self, h: &RequestHeader, q: GetAttr) -> RpcResult<Attr> {
        let mut st = self.store.lock().expect("store lock");
        let a = st.getattr(h, &q)?;
        st.lease(h, [a.ino]);
        Ok(a)
    }

    /// `Open`, leased, and registered when asked.
    pub(crate) fn open(&self, h: &RequestHeader, q: Open) -> RpcResult<Attr> {
        let mut st = self.store.lock().expect("store lock");
        let a = st.open_file(h, &q)?;
        st.lease(h, [a.ino]);
        if q.register {
            st.register_open(h, q.ino);
        }
        Ok(a)
    }

    /// `SessionPoll`: answered at once with news, else parked until recalls come, at most a
    /// tenth of the lease. The client trusts its leases from the send time of its last answered
    /// poll, so what it hands the kernel just before an answer is good for 0.9 - 2 x 0.1 = 0.7
    /// of the lease (with a third, a quarter: a metadata phase's first entries lapsed before it
    /// ended).
    pub(crate) async fn session_poll(&self, h: &RequestHeader, q: SessionPoll) -> RpcResult<SessionReply> {
        let (reply, wake) = self.store.lock().expect("store lock").session_poll(h, &q);
        if reply.new_session || !reply.recalls.is_empty() {
            return Ok(reply);
        }
        let wait = Duration::from_millis(q.wait_ms.min(reply.lease_ms / 10) as u64);
        let _ = tokio::time::timeout(wait, wake.notified()).await;
        let acked = SessionPoll { open: Vec::new(), ..q };
        Ok(self.store.lock().expect("store lock").session_poll(h, &acked).0)
    }

    /// `SetLock`: a request that may wait is parked until a lock of the shard goes, at most
    /// [`MAX_LOCK_WAIT`].
    pub(crate) async fn set_lock(&self, h: &RequestHeader, q: SetLock) -> RpcResult<bool> {
        let until = tokio::time::Instant::now() + Duration::from_millis(q.wait_ms as u64).min(MAX_LOCK_WAIT);
        let freed = self.store.lock().expect("store lock").locks_freed();
        loop {
            // Registered before the look, so a lock that goes after it wakes this request.
            let woken = freed.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            if self.store.lock().expect("store lock").set_lock(h, &q)? {
                return Ok(true);
            }
            if tokio::time::timeout_at(until, woken).await.is_err() {
                return Ok(false);
            }
        }
    }
}

/// The replies to changes, held until the recalls the changes caused are acknowledged; and
/// requests about a directory another client holds a create delegation on, held until it has
/// been recalled.
pub(crate) struct Recalls {
    store: Shared,
    pending: PendingReplies,
    lease: Duration,
    delegations: Arc<AtomicUsize>,
}

impl Recalls {
    pub(crate) fn new(store: &Shared) -> Recalls {
        let s = store.lock().expect("store lock");
        Recalls {
            store: store.clone(),
            pending: s.pending_replies(),
            lease: s.lease_time(),
            delegations: s.delegation_count(),
        }
    }

    /// Before request `q` is answered: recalls the create delegations another client holds on
    /// what it names (or on child directories of it) and waits until the holder has sent its
    /// deferred creates and acknowledged, or its session has ended. The answer then includes
    /// every create the holder answered.
    pub(crate) async fn delegations_before<R: Rpc>(&self, h: &RequestHeader, q: &R) {
        if self.delegations.load(Ordering::Relaxed) == 0 {
            return;
        }
        let inos = q.inodes();
        if inos.is_empty() {
            return;
        }
        if odfs_proto::meta::ends_delegation(R::METHOD) {
            // The holder's own change of the directory: its client ended the delegation.
            self.store.lock().expect("store lock").end_own_delegations(h, &inos);
        }
        // Until none is left: the holder may have been granted one again meanwhile.
        loop {
            let waits = self.store.lock().expect("store lock").recall_delegations(h, &inos);
            if waits.is_empty() {
                return;
            }
            self.wait_all(waits).await;
        }
    }

    /// Waits until every client that cached what request `h` changed has dropped it, or until
    /// its session ends (at most a lease: then it is ended here). After a restart, changes also
    /// wait out the grace, when every client's caches from before have lapsed.
    pub(crate) async fn wait(&self, h: &RequestHeader) {
        let pending = self.pending.lock().expect("pending lock").remove(&(h.client_id, h.request_id));
        let Some(pending) = pending else { return };
        if let Some(t) = pending.grace {
            tokio::time::sleep_until(t.into()).await;
        }
        self.wait_all(pending.waits).await;
    }

    /// Waits for each client's acknowledgement, at most a lease: a client that does not answer
    /// in time loses its session (and its leases and delegations).
    async fn wait_all(&self, waits: Vec<crate::sessions::Wait>) {
        if waits.is_empty() {
            return;
        }
        let lease = self.lease;
        let waits = waits.into_iter().map(|mut w| async move {
            let acked = tokio::time::timeout(lease, w.acked.wait_for(|&a| a >= w.seq)).await;
            // Err(Elapsed): no answer within the lease. Ok(Err): the session ended meanwhile.
            acked.is_err().then_some(w.client)
        });
        for client in futures::future::join_all(waits).await.into_iter().flatten() {
            self.store.lock().expect("store lock").end_session(client);
        }
    }
}
