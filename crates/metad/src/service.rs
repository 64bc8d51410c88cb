//! metad's wire adapter and process life: serve namespace requests over QUIC, keep the target
//! list fresh from mgmtd (for layouts and statfs), register the shard, snapshot at shutdown.

use crate::config::MetadConfig;
use crate::namespace::Found;
use crate::shards::Coordinator;
use crate::store::{MetaOp, MetaReply, MetaStore, PendingReplies, StoreOptions};
use crate::MetaError;
use odfs_proto::error::RpcResult;
use odfs_proto::meta::*;
use odfs_proto::mgmt::{GetCluster, Register, ServiceKind};
use odfs_proto::Rpc;
use odfs_proto::{ErrorCode, RemoteError, RequestHeader};
use odfs_rpc::quic::QuicEndpoint;
use odfs_rpc::{Router, Shutdown, Transport};
use odfs_service::{announce, Daemon};
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tracing::warn;

type Shared = Arc<Mutex<MetaStore>>;

/// metad's router: the reply to a change waits for the recalls the change caused (see
/// `sessions`).
struct Routes {
    r: Router,
    recalls: Arc<Recalls>,
}

impl Routes {
    fn add<R, F, Fut>(&mut self, f: F) -> &mut Self
    where
        R: Rpc,
        F: Fn(RequestHeader, R) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = RpcResult<R::Reply>> + Send + 'static,
    {
        let (recalls, f) = (self.recalls.clone(), Arc::new(f));
        self.r.add::<R, _, _>(move |h: RequestHeader, q: R| {
            let (recalls, f) = (recalls.clone(), f.clone());
            async move {
                recalls.delegations_before(&h, &q).await;
                let out = f(h.clone(), q).await;
                recalls.wait(&h).await;
                out
            }
        });
        self
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

pub(crate) fn unexpected(r: MetaReply) -> RemoteError {
    RemoteError::new(ErrorCode::Internal, format!("unexpected reply {r:?}"))
}

macro_rules! read_op {
    ($r:expr, $store:expr, $req:ty, $method:ident) => {{
        let s = $store.clone();
        $r.add::<$req, _, _>(move |h: RequestHeader, q: $req| {
            let s = s.clone();
            async move { s.lock().expect("store lock").$method(&h, &q) }
        });
    }};
}

macro_rules! mutation {
    ($r:expr, $store:expr, $req:ident, $reply:pat => $out:expr) => {{
        let s = $store.clone();
        $r.add::<$req, _, _>(move |h: RequestHeader, q: $req| {
            let s = s.clone();
            async move {
                match s.lock().expect("store lock").mutate(&h, MetaOp::$req(q))? {
                    $reply => Ok($out),
                    other => Err(unexpected(other)),
                }
            }
        });
    }};
}

/// Applies `op`; if it fails with one of the codes in `again`, refreshes the target list from
/// mgmtd once and tries again. Until mgmtd has reported every expected target, it refreshes
/// first (a layout would otherwise be chosen from a partial list).
async fn mutate_fresh(
    coord: &Coordinator,
    h: &RequestHeader,
    op: MetaOp,
    again: &[ErrorCode],
) -> odfs_proto::error::RpcResult<MetaReply> {
    if !coord.ready.load(std::sync::atomic::Ordering::Acquire) {
        if let Err(err) = coord.refresh().await {
            warn!(error = %err, "cannot refresh targets from mgmtd");
        }
    }
    let first = coord.store.lock().expect("store lock").mutate(h, op.clone());
    let Err(e) = &first else { return first };
    if !again.contains(&e.code) {
        return first;
    }
    // A pool with no target online right after mgmtd restarted: its stored have not
    // registered again yet (they do within a heartbeat or two). Waited for, bounded.
    let until = std::time::Instant::now() + TARGETS_WAIT;
    loop {
        if let Err(err) = coord.refresh().await {
            warn!(error = %err, "cannot refresh targets from mgmtd");
            return first;
        }
        let r = coord.store.lock().expect("store lock").mutate(h, op.clone());
        match r {
            Err(e) if e.message.ends_with(crate::store::NO_ONLINE_TARGETS) && std::time::Instant::now() < until => {
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
            other => return other,
        }
    }
}

/// Longest a create waits for a pool's targets to come online again (mgmtd restarted).
const TARGETS_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Maps metad's requests to the store.
pub fn router(store: Shared, coord: Coordinator) -> Router {
    let mut r = Routes { r: Router::new(), recalls: coord.recalls.clone() };
    add_placing(&mut r, &coord);
    add_delegations(&mut r, &coord);
    add_coordinated(&mut r, &coord);
    add_reads(&mut r, &coord);
    add_locks(&mut r, &store);
    add_plain(&mut r, &store);
    r.r
}

/// The longest a lock request waits at the shard before it is answered "not granted" (the
/// client asks again): waits stay short requests (docs/architecture.md, "Locks across nodes").
const MAX_LOCK_WAIT: Duration = Duration::from_secs(2);

/// File locks: a request that may wait is parked until a lock of the shard goes.
fn add_locks(r: &mut Routes, store: &Shared) {
    let s = store.clone();
    r.add::<SetLock, _, _>(move |h: RequestHeader, q: SetLock| {
        let s = s.clone();
        async move {
            let until = tokio::time::Instant::now() + Duration::from_millis(q.wait_ms as u64).min(MAX_LOCK_WAIT);
            let freed = s.lock().expect("store lock").locks_freed();
            loop {
                // Registered before the look, so a lock that goes after it wakes this request.
                let woken = freed.notified();
                tokio::pin!(woken);
                woken.as_mut().enable();
                if s.lock().expect("store lock").set_lock(&h, &q)? {
                    return Ok(true);
                }
                if tokio::time::timeout_at(until, woken).await.is_err() {
                    return Ok(false);
                }
            }
        }
    });
    read_op!(r, store, TestLock, test_lock);
    read_op!(r, store, DropLocks, drop_locks);
    read_op!(r, store, EndSession, depart);
}

/// Requests that place data on targets: they judge against mgmtd's target list.
fn add_placing(r: &mut Routes, coord: &Coordinator) {
    // Creates and layout changes judge against mgmtd's target list: a failure that a fresher
    // list could change (a target registering, a space report, a pool just changed) is tried
    // once more after looking at mgmtd's current view.
    let s = coord.clone();
    r.add::<Create, _, _>(move |h: RequestHeader, q: Create| {
        let s = s.clone();
        async move {
            let (register, lookup) = (q.register, Lookup { parent: q.parent, name: q.name.clone() });
            let c = match mutate_fresh(&s, &h, MetaOp::Create(q), &[ErrorCode::Invalid, ErrorCode::NoSpace]).await {
                Ok(MetaReply::Create(c)) => c,
                Ok(other) => return Err(unexpected(other)),
                // The name exists and names a file of another shard: that shard opens it.
                Err(e) if e.code == ErrorCode::SpansShards => {
                    return s.open_remote_existing(&h, lookup, register).await
                }
                Err(e) => return Err(e),
            };
            let mut st = s.store.lock().expect("store lock");
            // Leased also when the file existed (nothing changed, nothing leased yet): a client
            // that does not register the open holds it through the lease.
            st.lease(&h, [c.attr.ino]);
            if register {
                st.register_open(&h, c.attr.ino);
            }
            Ok(c)
        }
    });
    let s = coord.clone();
    r.add::<SetDirLayout, _, _>(move |h: RequestHeader, q: SetDirLayout| {
        let s = s.clone();
        async move {
            let ino = q.ino;
            match mutate_fresh(&s, &h, MetaOp::SetDirLayout(q), &[ErrorCode::Invalid]).await? {
                MetaReply::Unit => {
                    s.sync_parts(ino).await;
                    Ok(())
                }
                other => Err(unexpected(other)),
            }
        }
    });
    let s = coord.clone();
    r.add::<SetFileLayout, _, _>(move |h: RequestHeader, q: SetFileLayout| {
        let s = s.clone();
        async move {
            let again = [ErrorCode::Invalid, ErrorCode::NoSpace];
            match mutate_fresh(&s, &h, MetaOp::SetFileLayout(q), &again).await? {
                MetaReply::Attr(a) => Ok(a),
                other => Err(unexpected(other)),
            }
        }
    });
}

/// Create delegations: granted, and the deferred changes of their holders applied.
fn add_delegations(r: &mut Routes, coord: &Coordinator) {
    let stats = r.r.stats();
    let s = coord.clone();
    r.add::<DelegateCreates, _, _>(move |h: RequestHeader, q: DelegateCreates| {
        let s = s.clone();
        async move {
            // Layouts are chosen here, as a create chooses them: from every target.
            if !s.ready.load(std::sync::atomic::Ordering::Acquire) {
                if let Err(err) = s.refresh().await {
                    warn!(error = %err, "cannot refresh targets from mgmtd");
                }
            }
            s.store.lock().expect("store lock").delegate_creates(&h, &q)
        }
    });
    let s = coord.clone();
    r.add::<CreateBatch, _, _>(move |h: RequestHeader, q: CreateBatch| {
        let (s, stats) = (s.clone(), stats.clone());
        async move {
            let mut reply = BatchReply::default();
            let mut applied = Vec::with_capacity(q.entries.len());
            {
                let mut st = s.store.lock().expect("store lock");
                // One log write for the batch: its entries are answered together.
                st.begin_log_group();
                for (i, e) in q.entries.iter().enumerate() {
                    let t = std::time::Instant::now();
                    let r = st.apply_deferred(&h, e);
                    // Counted as the operations they are (odfs stats: creates by client).
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
            // Each entry is a change of its own: the batch's answer waits for their recalls.
            for entry in &applied {
                s.recalls.wait(entry).await;
            }
            Ok(reply)
        }
    });
}

/// Requests whose work may span metadata shards (the coordinator's).
fn add_coordinated(r: &mut Routes, coord: &Coordinator) {
    let s = coord.clone();
    r.add::<StripeDir, _, _>(move |h: RequestHeader, q: StripeDir| {
        let s = s.clone();
        async move { s.stripe_dir(&h, q).await }
    });
    let s = coord.clone();
    r.add::<Rmdir, _, _>(move |h: RequestHeader, q: Rmdir| {
        let s = s.clone();
        async move {
            match s.rmdir(&h, q.clone()).await {
                Err(e) if e.code == ErrorCode::SpansShards => s.rmdir_spanning(&h, q).await,
                other => other,
            }
        }
    });
    // Tried as this shard's own first; what touches another shard runs as an operation
    // spanning shards.
    let s = coord.clone();
    r.add::<Unlink, _, _>(move |h: RequestHeader, q: Unlink| {
        let s = s.clone();
        async move {
            match s.store.lock().expect("store lock").mutate(&h, MetaOp::Unlink(q.clone())) {
                Ok(MetaReply::Unlink(u)) => return Ok(u),
                Ok(other) => return Err(unexpected(other)),
                Err(e) if e.code != ErrorCode::SpansShards => return Err(e),
                Err(_) => {}
            }
            s.unlink_spanning(&h, q).await
        }
    });
    // Recall first (whoever holds the file open registers it), then check and unlink under one
    // lock; the wrapper then waits for the recalls the unlink caused.
    let s = coord.clone();
    r.add::<UnlinkIdle, _, _>(move |h: RequestHeader, q: UnlinkIdle| {
        let s = s.clone();
        async move {
            s.store.lock().expect("store lock").recall_inode(&h, q.ino);
            s.recalls.wait(&h).await;
            match s.store.lock().expect("store lock").unlink_idle(&h, &q)? {
                MetaReply::Unlink(u) => Ok(u),
                other => Err(unexpected(other)),
            }
        }
    });
    let s = coord.clone();
    r.add::<Rename, _, _>(move |h: RequestHeader, q: Rename| {
        let s = s.clone();
        async move {
            match s.store.lock().expect("store lock").mutate(&h, MetaOp::Rename(q.clone())) {
                Ok(MetaReply::Rename(x)) => return Ok(x),
                Ok(other) => return Err(unexpected(other)),
                Err(e) if e.code != ErrorCode::SpansShards => return Err(e),
                Err(_) => {}
            }
            s.rename_spanning(&h, q).await
        }
    });
    let s = coord.clone();
    r.add::<Link, _, _>(move |h: RequestHeader, q: Link| {
        let s = s.clone();
        async move {
            match s.store.lock().expect("store lock").mutate(&h, MetaOp::Link(q.clone())) {
                Ok(MetaReply::Attr(a)) => return Ok(a),
                Ok(other) => return Err(unexpected(other)),
                Err(e) if e.code != ErrorCode::SpansShards => return Err(e),
                Err(_) => {}
            }
            s.link_spanning(&h, q).await
        }
    });
    let s = coord.clone();
    r.add::<RenameLock, _, _>(move |_h: RequestHeader, q: RenameLock| {
        let s = s.clone();
        async move { s.rename_lock(q).await }
    });
    let s = coord.clone();
    r.add::<SetAttr, _, _>(move |h: RequestHeader, q: SetAttr| {
        let s = s.clone();
        async move {
            let r = s.store.lock().expect("store lock").mutate(&h, MetaOp::SetAttr(q));
            match r? {
                MetaReply::Attr(a) => {
                    if a.dir_stripes.len() > 1 {
                        s.sync_parts(a.ino).await;
                    }
                    Ok(a)
                }
                other => Err(unexpected(other)),
            }
        }
    });
}

/// Reads that may need another shard (a remote entry's attributes), open files and sessions.
fn add_reads(r: &mut Routes, coord: &Coordinator) {
    let s = coord.clone();
    r.add::<Lookup, _, _>(move |h: RequestHeader, q: Lookup| {
        let s = s.clone();
        async move {
            let found = {
                let mut st = s.store.lock().expect("store lock");
                st.lease_names(&h, q.parent);
                let found = st.resolve_name(&h, &q)?;
                if let Found::Here(a) = &found {
                    st.lease(&h, [a.ino]);
                }
                found
            };
            s.resolve(&h, found).await
        }
    });
    let s = coord.clone();
    r.add::<ReadDir, _, _>(move |h: RequestHeader, q: ReadDir| {
        let s = s.clone();
        async move {
            let mut listing = {
                let mut st = s.store.lock().expect("store lock");
                let listing = st.readdir(&h, &q)?;
                st.lease_names(&h, q.ino);
                st.lease(&h, listing.entries.iter().filter_map(|e| e.attr.as_ref().map(|a| a.ino)));
                listing
            };
            if q.plus {
                s.fill_remote_attrs(&h, &mut listing.entries).await?;
            }
            Ok(listing)
        }
    });
    let s = coord.clone();
    r.add::<Release, _, _>(move |h: RequestHeader, q: Release| {
        let s = s.clone();
        async move { s.store.lock().expect("store lock").release(&h, &q) }
    });
    let s = coord.clone();
    r.add::<SessionPoll, _, _>(move |h: RequestHeader, q: SessionPoll| {
        let s = s.clone();
        async move {
            let (reply, wake) = s.store.lock().expect("store lock").session_poll(&h, &q);
            if reply.new_session || !reply.recalls.is_empty() {
                return Ok(reply);
            }
            // Parked until recalls come, at most a tenth of the lease. The client trusts its
            // leases from the send time of its last answered poll, so what it hands the kernel
            // just before an answer is good for 0.9 - 2 x 0.1 = 0.7 of the lease (with a third,
            // a quarter: a metadata phase's first entries lapsed before it ended).
            let wait = Duration::from_millis(q.wait_ms.min(reply.lease_ms / 10) as u64);
            let _ = tokio::time::timeout(wait, wake.notified()).await;
            let acked = SessionPoll { open: Vec::new(), ..q };
            Ok(s.store.lock().expect("store lock").session_poll(&h, &acked).0)
        }
    });
}

/// Reads, and mutations of this shard alone: straight to the store.
fn add_plain(r: &mut Routes, store: &Shared) {
    let s = store.clone();
    r.add::<GetAttr, _, _>(move |h: RequestHeader, q: GetAttr| {
        let s = s.clone();
        async move {
            let mut st = s.lock().expect("store lock");
            let a = st.getattr(&h, &q)?;
            st.lease(&h, [a.ino]);
            Ok(a)
        }
    });
    read_op!(r, store, Access, access);
    let s = store.clone();
    r.add::<Open, _, _>(move |h: RequestHeader, q: Open| {
        let s = s.clone();
        async move {
            let mut st = s.lock().expect("store lock");
            let a = st.open_file(&h, &q)?;
            st.lease(&h, [a.ino]);
            if q.register {
                st.register_open(&h, q.ino);
            }
            Ok(a)
        }
    });
    read_op!(r, store, Reopen, reopen);
    read_op!(r, store, Readlink, readlink);
    read_op!(r, store, GetXattr, getxattr);
    read_op!(r, store, ListXattr, listxattr);
    read_op!(r, store, StatFs, statfs);
    read_op!(r, store, GetDirLayout, get_dir_layout);
    read_op!(r, store, CountEntries, count_entries);
    mutation!(r, store, Mkdir, MetaReply::Attr(a) => a);
    mutation!(r, store, Mknod, MetaReply::Attr(a) => a);
    mutation!(r, store, Symlink, MetaReply::Attr(a) => a);
    mutation!(r, store, Step, MetaReply::Step(x) => x);
    read_op!(r, store, ParentOf, parent_of);
    mutation!(r, store, CreateShadow, MetaReply::Unit => ());
    mutation!(r, store, SyncShadow, MetaReply::Unit => ());
    mutation!(r, store, SealShadow, MetaReply::Unit => ());
    mutation!(r, store, DropShadow, MetaReply::Unit => ());
    mutation!(r, store, SetXattr, MetaReply::Unit => ());
    mutation!(r, store, RemoveXattr, MetaReply::Unit => ());
    mutation!(r, store, ExtendSize, MetaReply::Attr(a) => a);
    mutation!(r, store, SetSealed, MetaReply::Attr(a) => a);
}

/// Runs metad until `shutdown` fires.
pub async fn run(cfg: MetadConfig, shutdown: Shutdown) -> Result<(), MetaError> {
    let cred = cfg.job.credential()?;
    let endpoint = QuicEndpoint::server(&cred, cfg.listen)?;
    let addr = endpoint.local_addr()?;
    let register_timeout = Duration::from_secs(cfg.register_timeout_secs);
    let daemon = Daemon::new(cred, cfg.mgmtd, register_timeout, register_timeout, shutdown)?;
    // The root's default layout comes from mgmtd, so every metad of the job agrees on it.
    let header = RequestHeader::default();
    let view = daemon.pool.call(cfg.mgmtd, Transport::Quic, &header, &GetCluster {});
    let Some(view) = odfs_service::until_shutdown(&daemon.shutdown, view).await.transpose()? else { return Ok(()) };
    let store: Shared = Arc::new(Mutex::new(open_store(&cfg, view.default_layout.clone())?));
    let coord = Coordinator::new(daemon.pool.clone(), cfg.mgmtd, store.clone());
    coord.refresh().await?;
    let tcp = if cfg.tcp { Some(bind_tcp(addr, cfg.listen.port() == 0).await?) } else { None };
    let tcp_addr = tcp.as_ref().map(|l| l.local_addr()).transpose().map_err(odfs_rpc::RpcError::Io)?;
    if let Some(p) = &cfg.addr_file {
        let mut v = vec![("metad", addr)];
        v.extend(tcp_addr.map(|a| ("tcp", a)));
        odfs_service::write_addr_file(p, &v).map_err(|e| MetaError::io("write", p, e))?;
    }
    let servers = daemon.serve(&endpoint, tcp, Arc::new(router(store.clone(), coord.clone())));
    keep_targets_fresh(coord.clone(), daemon.shutdown.clone());
    collect_orphans(coord.clone(), Duration::from_millis(cfg.lease_ms), daemon.shutdown.clone());
    redrive_intents(coord, daemon.shutdown.clone());
    let register =
        Register { shard: Some(cfg.shard), bulk_addr: tcp_addr, ..announce(ServiceKind::Meta, cfg.node, addr) };
    daemon.run(servers, register, odfs_service::lifecycle::no_targets()).await?;
    if let Err(e) = store.lock().expect("store lock").snapshot() {
        warn!(error = %e, "snapshot at shutdown failed; the log will be replayed at next start");
    }
    Ok(())
}

/// The TCP listener beside QUIC's `quic` address: the same port, or any when the port was
/// chosen by the system (it may be taken over TCP).
async fn bind_tcp(quic: std::net::SocketAddr, any_port: bool) -> Result<tokio::net::TcpListener, MetaError> {
    match odfs_rpc::tcp::bind(quic).await {
        Err(_) if any_port => Ok(odfs_rpc::tcp::bind(std::net::SocketAddr::new(quic.ip(), 0)).await?),
        r => Ok(r?),
    }
}

/// Opens (or creates) the shard's store under its data directory; a new root gets the owner
/// the config names.
fn open_store(cfg: &MetadConfig, default_layout: odfs_proto::DirLayout) -> Result<MetaStore, MetaError> {
    std::fs::create_dir_all(&cfg.data_dir).map_err(|e| MetaError::io("create metadata directory", &cfg.data_dir, e))?;
    let opts = StoreOptions {
        shard: cfg.shard,
        sync_wal: cfg.sync_wal,
        snapshot_every_bytes: cfg.snapshot_every_bytes,
        dedup_capacity: cfg.dedup_capacity,
        root_only_layouts: cfg.root_only_layouts,
        lease: Duration::from_millis(cfg.lease_ms),
    };
    let mut store = MetaStore::open(&cfg.data_dir, opts, default_layout)?;
    if let (true, Some(o)) = (store.root_created(), cfg.root_owner) {
        let set = store.set_root_owner(o.uid, o.gid, o.mode);
        set.map_err(|err| MetaError::Refused { what: "cannot set the root's owner", err })?;
    }
    Ok(store)
}

/// Refreshes the target list (for layouts and statfs) every half second until shutdown.
fn keep_targets_fresh(coord: Coordinator, mut shutdown: Shutdown) {
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                _ = shutdown.changed() => return,
            }
            if let Err(e) = coord.refresh().await {
                warn!(error = %e, "cannot refresh targets from mgmtd");
            }
        }
    });
}

/// Every quarter lease: ends the sessions of silent clients and removes the orphans nobody
/// holds open any more, chunks included.
fn collect_orphans(coord: Coordinator, lease: Duration, mut shutdown: Shutdown) {
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(lease / 4) => {}
                _ = shutdown.changed() => return,
            }
            let removed = coord.store.lock().expect("store lock").collect_orphans();
            for a in removed {
                coord.remove_chunks(&a).await;
            }
        }
    });
}

/// Every two seconds: finishes the operations spanning shards that a restart interrupted or a
/// shard delayed.
fn redrive_intents(coord: Coordinator, mut shutdown: Shutdown) {
    tokio::spawn(async move {
        loop {
            coord.redrive().await;
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(2)) => {}
                _ = shutdown.changed() => return,
            }
        }
    });
}
