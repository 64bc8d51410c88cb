//! metad's wire adapter and process life: serve namespace requests over QUIC, keep the target
//! list fresh from mgmtd (for layouts and statfs), register the shard, snapshot at shutdown.

use crate::config::MetadConfig;
use crate::store::{MetaOp, MetaReply, MetaStore, StoreOptions, TargetChoice};
use odfs_proto::meta::*;
use odfs_proto::mgmt::{ClusterView, GetCluster, Register, ServiceKind};
use odfs_proto::{ErrorCode, RemoteError, RequestHeader};
use odfs_rpc::quic::QuicEndpoint;
use odfs_rpc::{Pool, PoolConfig, Router, Shutdown, Transport};
use odfs_service::MgmtLink;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tracing::{info, warn};

type Shared = Arc<Mutex<MetaStore>>;

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

/// Keeps the store's target list (and the other shards' addresses) in step with mgmtd.
#[derive(Clone)]
pub struct TargetSync {
    pub pool: Arc<Pool>,
    pub mgmtd: std::net::SocketAddr,
    pub store: Shared,
    /// mgmtd reported the filesystem ready in the last refresh: every expected target is known.
    pub ready: Arc<std::sync::atomic::AtomicBool>,
    /// mgmtd's view at the last refresh: where the other shards' metads are.
    pub view: Arc<std::sync::RwLock<Option<Arc<ClusterView>>>>,
}

impl TargetSync {
    pub fn new(pool: Arc<Pool>, mgmtd: std::net::SocketAddr, store: Shared) -> TargetSync {
        TargetSync { pool, mgmtd, store, ready: Default::default(), view: Default::default() }
    }

    /// The address of the metad serving `shard` (looking at mgmtd again if it is not known).
    pub(crate) async fn peer_addr(&self, shard: u16) -> Result<std::net::SocketAddr, RemoteError> {
        for attempt in 0..2 {
            let known = self
                .view
                .read()
                .expect("view lock")
                .as_ref()
                .and_then(|v| v.meta_for_shard(shard).filter(|s| s.online).and_then(|s| s.addr));
            if let Some(a) = known {
                return Ok(a);
            }
            if attempt == 0 {
                let _ = self.refresh().await;
            }
        }
        Err(RemoteError::new(ErrorCode::Unavailable, format!("no metadata service for shard {shard}")))
    }

    /// The number of metadata shards (at least this one).
    pub(crate) async fn shard_count(&self) -> Result<u16, RemoteError> {
        self.refresh().await.map_err(|e| RemoteError::new(ErrorCode::Unavailable, format!("mgmtd: {e}")))?;
        let v = self.view.read().expect("view lock").clone();
        Ok(v.map_or(1, |v| v.expected_meta.max(v.meta_shards() as u32).max(1) as u16))
    }

    pub async fn refresh(&self) -> Result<(), odfs_rpc::RpcError> {
        let v = self.pool.call(self.mgmtd, Transport::Quic, &RequestHeader::default(), &GetCluster {}).await?;
        let t = v
            .targets
            .iter()
            .map(|t| TargetChoice {
                id: t.id,
                pool: t.pool.clone(),
                free: t.space.free,
                capacity: t.space.capacity,
                online: t.online,
            })
            .collect();
        self.store.lock().expect("store lock").set_targets(t);
        self.ready.store(v.state != odfs_proto::mgmt::FsState::Forming, std::sync::atomic::Ordering::Release);
        *self.view.write().expect("view lock") = Some(Arc::new(v));
        Ok(())
    }
}

/// Applies `op`; if it fails with one of the codes in `again`, refreshes the target list from
/// mgmtd once and tries again. Until mgmtd has reported every expected target, it refreshes
/// first (a layout would otherwise be chosen from a partial list).
async fn mutate_fresh(
    sync: &TargetSync,
    h: &RequestHeader,
    op: MetaOp,
    again: &[ErrorCode],
) -> odfs_proto::error::RpcResult<MetaReply> {
    if !sync.ready.load(std::sync::atomic::Ordering::Acquire) {
        if let Err(err) = sync.refresh().await {
            warn!(error = %err, "cannot refresh targets from mgmtd");
        }
    }
    let first = sync.store.lock().expect("store lock").mutate(h, op.clone());
    match first {
        Err(e) if again.contains(&e.code) => {
            if let Err(err) = sync.refresh().await {
                warn!(error = %err, "cannot refresh targets from mgmtd");
                return Err(e);
            }
            sync.store.lock().expect("store lock").mutate(h, op)
        }
        other => other,
    }
}

/// Maps metad's requests to the store.
pub fn router(store: Shared, sync: TargetSync) -> Router {
    let mut r = Router::new();
    // Creates and layout changes judge against mgmtd's target list: a failure that a fresher
    // list could change (a target registering, a space report, a pool just changed) is tried
    // once more after looking at mgmtd's current view.
    let s = sync.clone();
    r.add::<Create, _, _>(move |h: RequestHeader, q: Create| {
        let s = s.clone();
        async move {
            match mutate_fresh(&s, &h, MetaOp::Create(q), &[ErrorCode::Invalid, ErrorCode::NoSpace]).await? {
                MetaReply::Create(c) => Ok(c),
                other => Err(unexpected(other)),
            }
        }
    });
    let s = sync.clone();
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
    let s = sync.clone();
    r.add::<StripeDir, _, _>(move |h: RequestHeader, q: StripeDir| {
        let s = s.clone();
        async move { s.stripe_dir(&h, q).await }
    });
    let s = sync.clone();
    r.add::<Rmdir, _, _>(move |h: RequestHeader, q: Rmdir| {
        let s = s.clone();
        async move { s.rmdir(&h, q).await }
    });
    let s = sync.clone();
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
    let s = sync.clone();
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
    read_op!(r, store, Lookup, lookup);
    read_op!(r, store, GetAttr, getattr);
    read_op!(r, store, Access, access);
    read_op!(r, store, Open, open_file);
    read_op!(r, store, ReadDir, readdir);
    read_op!(r, store, Readlink, readlink);
    read_op!(r, store, GetXattr, getxattr);
    read_op!(r, store, ListXattr, listxattr);
    read_op!(r, store, StatFs, statfs);
    read_op!(r, store, GetDirLayout, get_dir_layout);
    read_op!(r, store, CountEntries, count_entries);
    mutation!(r, store, Mkdir, MetaReply::Attr(a) => a);
    mutation!(r, store, Unlink, MetaReply::Unlink(u) => u);
    mutation!(r, store, Rename, MetaReply::Rename(x) => x);
    mutation!(r, store, Symlink, MetaReply::Attr(a) => a);
    mutation!(r, store, Link, MetaReply::Attr(a) => a);
    mutation!(r, store, CreateShadow, MetaReply::Unit => ());
    mutation!(r, store, SyncShadow, MetaReply::Unit => ());
    mutation!(r, store, SealShadow, MetaReply::Unit => ());
    mutation!(r, store, DropShadow, MetaReply::Unit => ());
    mutation!(r, store, SetXattr, MetaReply::Unit => ());
    mutation!(r, store, RemoveXattr, MetaReply::Unit => ());
    mutation!(r, store, ExtendSize, MetaReply::Attr(a) => a);

    r
}

/// Runs metad until `shutdown` fires.
pub async fn run(cfg: MetadConfig, shutdown: Shutdown) -> anyhow::Result<()> {
    let cred = cfg.job.credential()?;
    let endpoint = QuicEndpoint::server(&cred, cfg.listen)?;
    let addr = endpoint.local_addr()?;
    // Its own client endpoint: the server endpoint closes at shutdown, before the goodbye to
    // mgmtd (unregister) has gone out.
    let pool = Arc::new(Pool::new(
        cred,
        PoolConfig { retry_deadline: Duration::from_secs(cfg.register_timeout_secs), ..PoolConfig::default() },
    )?);
    // The root's default layout comes from mgmtd, so every metad of the job agrees on it.
    let header = RequestHeader::default();
    let view = pool.call(cfg.mgmtd, Transport::Quic, &header, &GetCluster {});
    let Some(view) = odfs_service::until_shutdown(&shutdown, view).await.transpose()? else { return Ok(()) };
    std::fs::create_dir_all(&cfg.data_dir)
        .map_err(|e| anyhow::anyhow!("cannot create metadata directory {}: {e}", cfg.data_dir.display()))?;
    let opts = StoreOptions {
        shard: cfg.shard,
        sync_wal: cfg.sync_wal,
        snapshot_every_bytes: cfg.snapshot_every_bytes,
        dedup_capacity: cfg.dedup_capacity,
        root_only_layouts: cfg.root_only_layouts,
    };
    let mut store = MetaStore::open(&cfg.data_dir, opts, view.default_layout.clone())?;
    if let (true, Some(o)) = (store.root_created(), cfg.root_owner) {
        store.set_root_owner(o.uid, o.gid, o.mode).map_err(|e| anyhow::anyhow!("cannot set the root's owner: {e}"))?;
    }
    let store: Shared = Arc::new(Mutex::new(store));
    let sync = TargetSync::new(pool.clone(), cfg.mgmtd, store.clone());
    sync.refresh().await?;
    if let Some(p) = &cfg.addr_file {
        odfs_service::write_addr_file(p, &[("metad", addr)])?;
    }
    let router = Arc::new(router(store.clone(), sync.clone()));
    let serve = tokio::spawn({
        let ep = endpoint.clone();
        let sd = shutdown.clone();
        async move { ep.serve(router, sd).await }
    });
    // Keep the target list fresh for layouts and statfs.
    tokio::spawn({
        let mut sd = shutdown.clone();
        async move {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                    _ = sd.changed() => return,
                }
                if let Err(e) = sync.refresh().await {
                    warn!(error = %e, "cannot refresh targets from mgmtd");
                }
            }
        }
    });
    let link = MgmtLink {
        pool,
        mgmtd: cfg.mgmtd,
        register: Register {
            kind: ServiceKind::Meta,
            node: cfg.node,
            hostname: odfs_service::hostname(),
            addr: Some(addr),
            bulk_addr: None,
            shard: Some(cfg.shard),
            targets: vec![],
            pid: std::process::id(),
        },
    };
    let registered =
        odfs_service::until_shutdown(&shutdown, link.register(Duration::from_secs(cfg.register_timeout_secs)));
    let Some(first) = registered.await.transpose()? else { return Ok(()) };
    info!(%addr, shard = cfg.shard, service_id = first.service_id, "metad serving");
    link.run(first, Arc::new(Vec::new), shutdown).await;
    let _ = serve.await;
    if let Err(e) = store.lock().expect("store lock").snapshot() {
        warn!(error = %e, "snapshot at shutdown failed; the log will be replayed at next start");
    }
    Ok(())
}
