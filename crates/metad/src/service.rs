//! metad's wire adapter and process life: decode and route namespace requests (to the store,
//! or to the coordinator for what needs more: `requests`), keep the target list fresh from
//! mgmtd (for layouts and statfs), register the shard, snapshot at shutdown.

use crate::config::MetadConfig;
use crate::shards::Coordinator;
use crate::store::{MetaStore, StoreOptions};
use crate::MetaError;
use odfs_proto::error::RpcResult;
use odfs_proto::meta::*;
use odfs_proto::mgmt::{GetCluster, Register, ServiceKind};
use odfs_proto::RequestHeader;
use odfs_proto::Rpc;
use odfs_rpc::quic::QuicEndpoint;
use odfs_rpc::{Router, Shutdown, Transport};
use odfs_service::{announce, Daemon};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tracing::warn;

use crate::store::Shared;

/// metad's router: the reply to a change waits for the recalls the change caused (see
/// `sessions`).
struct Routes {
    r: Router,
    recalls: Arc<crate::requests::Recalls>,
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

macro_rules! read_op {
    ($r:expr, $store:expr, $req:ty, $method:ident) => {{
        let s = $store.clone();
        $r.add::<$req, _, _>(move |h: RequestHeader, q: $req| {
            let s = s.clone();
            async move { s.lock().expect("store lock").$method(&h, &q) }
        });
    }};
}

/// A request that is one typed mutation of this shard's store.
macro_rules! mutation {
    ($r:expr, $store:expr, $($req:ident),*) => {$({
        let s = $store.clone();
        $r.add::<$req, _, _>(move |h: RequestHeader, q: $req| {
            let s = s.clone();
            async move { s.lock().expect("store lock").mutate(&h, q) }
        });
    })*};
}

/// A request the coordinator carries out: `$call` on it with the header and the request.
macro_rules! to_coordinator {
    ($r:expr, $coord:expr, $($req:ident => $method:ident),*) => {$({
        let c = $coord.clone();
        $r.add::<$req, _, _>(move |h: RequestHeader, q: $req| {
            let c = c.clone();
            async move { c.$method(&h, q).await }
        });
    })*};
}

/// Maps metad's requests to the store (reads and mutations of this shard alone) or to the
/// coordinator (what needs more than one store call: `requests`).
pub fn router(store: Shared, coord: Coordinator) -> Router {
    let mut r = Routes { r: Router::new(), recalls: coord.recalls.clone() };
    to_coordinator!(r, coord,
        Create => create, SetDirLayout => set_dir_layout, SetFileLayout => set_file_layout,
        DelegateCreates => delegate_creates, StripeDir => stripe_dir, UnlinkIdle => unlink_idle,
        SetAttr => set_attr, Lookup => lookup, ReadDir => readdir, SessionPoll => session_poll,
        SetLock => set_lock);
    to_coordinator!(r, coord, Rmdir => coordinate, Unlink => coordinate, Rename => coordinate, Link => coordinate);
    let (c, stats) = (coord.clone(), r.r.stats());
    r.add::<CreateBatch, _, _>(move |h: RequestHeader, q: CreateBatch| {
        let (c, stats) = (c.clone(), stats.clone());
        async move { c.create_batch(&h, q, &stats).await }
    });
    let c = coord.clone();
    r.add::<RenameLock, _, _>(move |_h: RequestHeader, q: RenameLock| {
        let c = c.clone();
        async move { c.rename_lock(q).await }
    });
    let c = coord.clone();
    r.add::<GetAttr, _, _>(move |h: RequestHeader, q: GetAttr| std::future::ready(c.getattr(&h, q)));
    let c = coord.clone();
    r.add::<Open, _, _>(move |h: RequestHeader, q: Open| std::future::ready(c.open(&h, q)));
    read_op!(r, store, Release, release);
    read_op!(r, store, TestLock, test_lock);
    read_op!(r, store, DropLocks, drop_locks);
    read_op!(r, store, EndSession, depart);
    read_op!(r, store, Access, access);
    read_op!(r, store, Reopen, reopen);
    read_op!(r, store, Readlink, readlink);
    read_op!(r, store, GetXattr, getxattr);
    read_op!(r, store, ListXattr, listxattr);
    read_op!(r, store, StatFs, statfs);
    read_op!(r, store, GetDirLayout, get_dir_layout);
    read_op!(r, store, CountEntries, count_entries);
    read_op!(r, store, ParentOf, parent_of);
    mutation!(
        r,
        store,
        Mkdir,
        Mknod,
        Symlink,
        Step,
        CreateShadow,
        SyncShadow,
        SealShadow,
        DropShadow,
        SetXattr,
        RemoveXattr,
        ExtendSize,
        SetSealed
    );
    r.r
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
