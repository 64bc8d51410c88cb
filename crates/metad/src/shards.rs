//! Work that spans metadata shards, coordinated by a directory's own shard ([`Coordinator`],
//! which also keeps mgmtd's view of the targets and the other shards fresh): striping an empty
//! directory over several shards (the other shards' parts are made first, then the directory
//! is marked striped, so no entry can land on a shard without its part), removing a striped
//! directory (every part is sealed while empty, then the directory goes, then the parts), and
//! keeping the parts' permissions and default layout in step with the directory.
//!
//! Every change is a logged mutation of one store; what spans shards is ordered so that a
//! failure midway leaves, at worst, an unused empty part behind — never an entry without its
//! directory. Owns no namespace state.

use crate::namespace::wrong_reply;
use crate::store::{Found, MetaOp, MetaReply, MetaStore, TargetChoice};
use odfs_proto::error::RpcResult;
use odfs_proto::meta::*;
use odfs_proto::mgmt::{ClusterView, GetCluster};
use odfs_proto::{ErrorCode, InodeId, RemoteError, RequestHeader};
use odfs_rpc::{Pool, Transport};
use std::sync::{Arc, Mutex};
use tracing::{info, warn};

/// This shard's link to the rest of the job: mgmtd's view (the target list layouts are chosen
/// from, the other shards' addresses), kept fresh, and the operations that span shards.
#[derive(Clone)]
pub struct Coordinator {
    pub pool: Arc<Pool>,
    pub mgmtd: std::net::SocketAddr,
    pub store: Arc<Mutex<MetaStore>>,
    /// mgmtd reported the filesystem ready in the last refresh: every expected target is known.
    pub ready: Arc<std::sync::atomic::AtomicBool>,
    /// mgmtd's view at the last refresh: where the other shards' metads are.
    pub view: Arc<std::sync::RwLock<Option<Arc<ClusterView>>>>,
    /// Intents this process is running now (the others, after a restart, are redriven), each
    /// with the client that asked for it (0 when redriven): that client is not sent recalls
    /// of its own operation's steps.
    pub(crate) running: Arc<Mutex<std::collections::HashMap<u64, u64>>>,
    /// Replies to changes waiting for their recalls (this shard's own steps wait there too).
    pub(crate) recalls: Arc<crate::requests::Recalls>,
    /// Shard 0 only: the filesystem's rename lock (intent, held until), see `RenameLock`.
    pub(crate) rename_lock: Arc<Mutex<Option<(u64, std::time::Instant)>>>,
}

impl Coordinator {
    pub fn new(pool: Arc<Pool>, mgmtd: std::net::SocketAddr, store: Arc<Mutex<MetaStore>>) -> Coordinator {
        Coordinator {
            pool,
            mgmtd,
            recalls: Arc::new(crate::requests::Recalls::new(&store)),
            store,
            ready: Default::default(),
            view: Default::default(),
            running: Default::default(),
            rename_lock: Default::default(),
        }
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
                node: t.node,
                device: t.space.device,
            })
            .collect();
        let shards = v.expected_meta.max(v.meta_shards() as u32).max(1) as u16;
        let mut st = self.store.lock().expect("store lock");
        st.set_targets(t);
        st.set_shards_total(shards);
        drop(st);
        self.ready.store(v.state != odfs_proto::mgmt::FsState::Forming, std::sync::atomic::Ordering::Release);
        *self.view.write().expect("view lock") = Some(Arc::new(v));
        Ok(())
    }
}

impl Coordinator {
    /// Sends a request to the metad of `shard`.
    pub(crate) async fn peer<R: odfs_proto::Rpc>(&self, shard: u16, req: &R) -> RpcResult<R::Reply> {
        self.peer_as(&RequestHeader::default(), shard, req).await
    }

    /// Sends a request to the metad of `shard` on behalf of the caller of `h` (its identity
    /// for permission checks, its client id for registrations, its request id for retries).
    pub(crate) async fn peer_as<R: odfs_proto::Rpc>(
        &self,
        h: &RequestHeader,
        shard: u16,
        req: &R,
    ) -> RpcResult<R::Reply> {
        let addr = self.peer_addr(shard).await?;
        self.pool.call(addr, Transport::Quic, h, req).await.map_err(|e| match e {
            odfs_rpc::RpcError::Remote(r) => r,
            other => RemoteError::new(ErrorCode::Unavailable, format!("metadata shard {shard}: {other}")),
        })
    }

    /// The attributes a lookup answers: a remote entry's come from its inode's shard.
    /// Asked on behalf of the caller of `h`, so that its shard leases the inode to the client.
    pub async fn resolve(&self, h: &RequestHeader, found: Found) -> RpcResult<Attr> {
        match found {
            Found::Here(a) => Ok(a),
            Found::Remote(ino) => self.peer_as(h, ino.shard(), &GetAttr { ino }).await,
        }
    }

    /// Adds the attributes of remote entries to a readdirplus listing (asked of their shards).
    pub async fn fill_remote_attrs(&self, h: &RequestHeader, entries: &mut [DirEntry]) -> RpcResult<()> {
        let missing: Vec<usize> = (0..entries.len()).filter(|&i| entries[i].attr.is_none()).collect();
        let got = futures::future::join_all(missing.iter().map(|&i| {
            let ino = entries[i].ino;
            async move { self.peer_as(h, ino.shard(), &GetAttr { ino }).await }
        }))
        .await;
        for (i, a) in missing.into_iter().zip(got) {
            entries[i].attr = Some(a?);
        }
        Ok(())
    }

    /// A non-exclusive create of a name that already names a file of another shard: that shard
    /// checks write permission (and registers the open) as for an open for writing.
    pub async fn open_remote_existing(&self, h: &RequestHeader, q: Lookup, register: bool) -> RpcResult<CreateReply> {
        let found = self.store.lock().expect("store lock").resolve_name(h, &q)?;
        let ino = match found {
            Found::Remote(ino) => ino,
            Found::Here(a) => a.ino,
        };
        if ino.shard() == self.store.lock().expect("store lock").shard() {
            return Err(RemoteError::new(ErrorCode::Busy, "the name changed meanwhile; try again"));
        }
        let attr = self.peer_as(h, ino.shard(), &Open { ino, read: false, write: true, register }).await?;
        if attr.kind != FileKind::File {
            return Err(RemoteError::new(ErrorCode::Exists, "the name exists and is not a regular file"));
        }
        Ok(CreateReply { attr, created: false, parent: None })
    }

    /// Removes the chunks of an inode metad removed itself (an orphan whose holders went away).
    pub async fn remove_chunks(&self, a: &Attr) {
        let Some(layout) = &a.layout else { return };
        let view = self.view.read().expect("view lock").clone();
        let Some(view) = view else { return };
        for &t in &layout.targets {
            let addr = view.target(t).and_then(|t| view.service(t.service_id)).and_then(|s| s.addr);
            let Some(addr) = addr else {
                warn!(target = t, ino = %a.ino, "no address for a target: an orphan's chunk stays until the wipe");
                continue;
            };
            let req = odfs_proto::storage::RemoveChunk { target: t, ino: a.ino };
            if let Err(e) = self.pool.call(addr, Transport::Quic, &RequestHeader::default(), &req).await {
                warn!(target = t, ino = %a.ino, error = %e, "cannot remove an orphan's chunk file");
            }
        }
    }

    /// `StripeDir`: spreads an empty directory of this shard over `count` shards.
    pub async fn stripe_dir(&self, h: &RequestHeader, q: StripeDir) -> RpcResult<Attr> {
        let own = self.store.lock().expect("store lock").shard();
        if q.ino.shard() != own {
            return Err(RemoteError::new(ErrorCode::Invalid, "ask the directory's own shard"));
        }
        let shards = self.shard_count().await?;
        let (attr, parent, layout, entries) = self.store.lock().expect("store lock").dir_info(q.ino)?;
        if !(h.is_root() || h.uid == attr.uid) {
            return Err(RemoteError::new(ErrorCode::Perm, "only the owner or root may stripe a directory"));
        }
        let count = match q.count {
            -1 => shards,
            n if n >= 1 && n as u32 <= shards as u32 => n as u16,
            n => {
                return Err(RemoteError::new(
                    ErrorCode::Invalid,
                    format!("stripe count {n} is invalid: this filesystem has {shards} metadata shards (-1 = all)"),
                ))
            }
        };
        let current = attr.dir_stripes.len().max(1) as u16;
        if current == count {
            return Ok(attr);
        }
        if current > 1 {
            return Err(RemoteError::new(ErrorCode::Invalid, "the directory is striped already"));
        }
        if entries > 0 {
            return Err(RemoteError::new(
                ErrorCode::NotEmpty,
                "only an empty directory can be striped over metadata shards",
            ));
        }
        let stripes: Vec<u16> = (0..count).map(|i| (own + i) % shards).collect();
        let part = CreateShadow {
            ino: q.ino,
            parent,
            mode: attr.mode,
            uid: attr.uid,
            gid: attr.gid,
            layout,
            stripes: stripes.clone(),
        };
        let mut made = Vec::new();
        for &s in &stripes[1..] {
            if let Err(e) = self.peer(s, &part).await {
                self.drop_parts(q.ino, &made).await;
                return Err(e);
            }
            made.push(s);
        }
        let op = MetaOp::SetDirStripes { ino: q.ino, stripes: stripes.clone() };
        let r = self.store.lock().expect("store lock").mutate(h, op);
        match r {
            Ok(MetaReply::Attr(a)) => {
                info!(ino = %q.ino, ?stripes, "directory striped over metadata shards");
                Ok(a)
            }
            Ok(other) => Err(wrong_reply("SetDirStripes", &other)),
            Err(e) => {
                self.drop_parts(q.ino, &made).await;
                Err(e)
            }
        }
    }

    pub(crate) async fn drop_parts(&self, ino: InodeId, shards: &[u16]) {
        for &s in shards {
            if let Err(e) = self.peer(s, &DropShadow { ino }).await {
                warn!(%ino, shard = s, error = %e, "an empty part of a directory stays behind");
            }
        }
    }

    /// `Rmdir`, for a striped directory among others: its parts are sealed (each must be
    /// empty) before the directory goes, and dropped after.
    pub async fn rmdir(&self, h: &RequestHeader, q: Rmdir) -> RpcResult<()> {
        let (ino, others): (InodeId, Vec<u16>) = {
            let mut st = self.store.lock().expect("store lock");
            match st.resolve_name(h, &Lookup { parent: q.parent, name: q.name.clone() }) {
                Ok(Found::Here(a)) if a.kind == FileKind::Dir && a.dir_stripes.len() > 1 => {
                    (a.ino, a.dir_stripes.iter().copied().filter(|&s| s != a.ino.shard()).collect())
                }
                // Not striped: removed (or refused) under the same lock, no part to seal.
                _ => {
                    return st.mutate(h, q);
                }
            }
        };
        let mut sealed = Vec::new();
        for &s in &others {
            match self.peer(s, &SealShadow { ino, seal: true }).await {
                Ok(()) => sealed.push(s),
                Err(e) => {
                    self.unseal(ino, &sealed).await;
                    return Err(if e.code == ErrorCode::NotEmpty {
                        RemoteError::new(
                            ErrorCode::NotEmpty,
                            format!("directory \"{}\" is not empty", String::from_utf8_lossy(&q.name)),
                        )
                    } else {
                        e
                    });
                }
            }
        }
        let r = self.store.lock().expect("store lock").mutate(h, q);
        match r {
            Ok(()) => {
                self.drop_parts(ino, &sealed).await;
                Ok(())
            }
            Err(e) => {
                self.unseal(ino, &sealed).await;
                Err(e)
            }
        }
    }

    pub(crate) async fn unseal(&self, ino: InodeId, shards: &[u16]) {
        for &s in shards {
            if let Err(e) = self.peer(s, &SealShadow { ino, seal: false }).await {
                warn!(%ino, shard = s, error = %e, "a part of a directory stays sealed");
            }
        }
    }

    /// After a change of a striped directory's permissions or layout: the parts follow.
    pub async fn sync_parts(&self, ino: InodeId) {
        let (info, own) = {
            let st = self.store.lock().expect("store lock");
            (st.dir_info(ino), st.shard())
        };
        let Ok((a, _, layout, _)) = info else { return };
        if a.dir_stripes.len() < 2 || ino.shard() != own {
            return;
        }
        let req = SyncShadow { ino, mode: a.mode, uid: a.uid, gid: a.gid, layout };
        for &s in a.dir_stripes.iter().filter(|&&s| s != ino.shard()) {
            if let Err(e) = self.peer(s, &req).await {
                warn!(%ino, shard = s, error = %e, "a part of a striped directory did not follow a change");
            }
        }
    }
}
