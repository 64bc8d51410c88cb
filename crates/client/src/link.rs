//! The request link: how a client reaches its services. Owns the connection pool (the
//! transport seam: real connections, or `odfs_rpc::Local` in one process), the cluster view it
//! locates services in, this client's id and request ids, and the calls themselves: metadata
//! requests by shard (after the changes this client deferred under its delegations), chunk
//! reads (this node's own targets from their files) and stored calls, each retried and
//! relocated as the view changes.

use crate::cluster::Cluster;
use crate::ctx::Ctx;
use crate::delegation::Delegations;
use crate::local_read;
use crate::{ClientConfig, ClientError, Result};
use odfs_proto::meta::*;
use odfs_proto::storage::{ChunkRange, ChunksData, ReadChunk, ReadChunks};
use odfs_proto::{ErrorCode, InodeId, RequestHeader, Rpc, TargetId};
use odfs_rpc::{Pool, Transport};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// One client's link to its services (see the module's documentation).
pub(crate) struct ServiceLink {
    pub cfg: ClientConfig,
    pub pool: Arc<Pool>,
    pub cluster: Cluster,
    pub client_id: u64,
    next_request: AtomicU64,
    /// The runtime the client was made on, for work started where none is current (a handle
    /// dropped on a FUSE reader thread).
    pub runtime: tokio::runtime::Handle,
    /// The directories this client answers creates in, and its log of deferred changes.
    pub delegations: Arc<Delegations>,
    /// This node's targets whose chunks are read from their files.
    pub local: local_read::LocalReads,
}

impl ServiceLink {
    pub(crate) fn new(cfg: ClientConfig, pool: Arc<Pool>, cluster: Cluster) -> ServiceLink {
        let (local_reads, node, drop_behind) = (cfg.local_reads, cfg.node, cfg.drop_behind_reads);
        ServiceLink {
            client_id: rand::random::<u64>() | 1,
            next_request: AtomicU64::new(1),
            runtime: tokio::runtime::Handle::current(),
            delegations: Arc::new(Delegations::new()),
            local: local_read::LocalReads::new(local_reads, node, drop_behind),
            cfg,
            pool,
            cluster,
        }
    }

    /// A request id of this client's, never used before.
    pub(crate) fn next_request_id(&self) -> u64 {
        self.next_request.fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) fn header(&self, ctx: &Ctx) -> RequestHeader {
        RequestHeader {
            request_id: self.next_request_id(),
            client_id: self.client_id,
            uid: ctx.uid,
            gid: ctx.gid,
            groups: ctx.groups.clone(),
        }
    }

    /// Calls metad for an inode's shard; the same header is reused on retry.
    pub(crate) async fn meta<R: Rpc>(&self, ctx: &Ctx, shard: u16, req: &R) -> Result<R::Reply> {
        self.meta_as(&self.header(ctx), shard, req).await
    }

    /// `meta` with a given header. Every request but the session's poll first waits until
    /// metad has applied the changes this client deferred before it (see `delegation`).
    pub(crate) async fn meta_as<R: Rpc>(&self, h: &RequestHeader, shard: u16, req: &R) -> Result<R::Reply> {
        if odfs_proto::meta::ends_delegation(R::METHOD) {
            // The reserved ids' layouts, or the directory's striping or seal, change.
            self.delegations.end(&req.inodes());
        }
        if R::METHOD == Rename::METHOD || R::METHOD == Link::METHOD {
            // Another client may find a file made here through its new name.
            self.delegations.forget_made();
        }
        if R::METHOD != SessionPoll::METHOD {
            self.delegations.settle().await;
        }
        self.meta_now(h, shard, req).await
    }

    /// Calls metad without waiting for deferred changes (the session's poll, the batches).
    pub(crate) async fn meta_now<R: Rpc>(&self, h: &RequestHeader, shard: u16, req: &R) -> Result<R::Reply> {
        let want = self.cfg.meta_transport;
        self.call_fresh(h, req, |c| c.meta_addr(shard, want)).await
    }

    /// Up to `len` bytes of `ino`'s chunk file on `target` at `offset`, short where it ends and
    /// empty where there is none (a hole): from the file itself when the target is this node's
    /// (short-circuit reads), else from its stored. A small local read that needs the disk is
    /// finished by stored too (`local_read::DISK_VIA_STORED_BELOW`).
    pub(crate) async fn read_chunk(&self, target: TargetId, ino: InodeId, offset: u64, len: u32) -> Result<Vec<u8>> {
        let Some(dir) = self.local.dir(&self.cluster, target) else {
            return self.read_chunk_from_store(target, ino, offset, len).await;
        };
        // Noted before the read, as every reader of a chunk file notes (`read_behind`); a read
        // short enough to be finished by stored is never followed.
        self.local.read_behind(target, ino, &dir, offset, len as u64);
        let now = local_read::read_now(&dir, ino, offset, len as usize);
        if !now.complete && (len as usize) < local_read::DISK_VIA_STORED_BELOW {
            let got = now.data.len() as u32;
            let rest = self.read_chunk_from_store(target, ino, offset + got as u64, len - got).await?;
            if got == 0 {
                return Ok(rest);
            }
            let mut data = now.data;
            data.extend_from_slice(&rest);
            return Ok(data);
        }
        match local_read::read_rest(&dir, ino, offset, len as usize, now).await {
            Ok(data) => Ok(data),
            Err(e) => {
                self.local.failed(target, &dir, &e);
                self.read_chunk_from_store(target, ino, offset, len).await
            }
        }
    }

    /// [`Self::read_chunk`] through the stored holding `target`.
    pub(crate) async fn read_chunk_from_store(
        &self,
        target: TargetId,
        ino: InodeId,
        offset: u64,
        len: u32,
    ) -> Result<Vec<u8>> {
        Ok(self.store_read(target, &ReadChunk { target, ino, offset, len }).await?.data)
    }

    /// Several chunk files' ranges on `target`, as a `ReadChunks` reply gives them: from the
    /// files themselves when the target is this node's, else from its stored.
    pub(crate) async fn read_chunks(&self, target: TargetId, items: Vec<ChunkRange>) -> Result<ChunksData> {
        if let Some(dir) = self.local.dir(&self.cluster, target) {
            match crate::local_read::read_many(dir.clone(), items.clone()).await {
                Ok((lens, data)) => return Ok(ChunksData { lens, data, ..ChunksData::default() }),
                Err(e) => self.local.failed(target, &dir, &e),
            }
        }
        self.store_read(target, &ReadChunks { target, items }).await
    }

    /// Calls the stored holding `target` for a read, which fails at once (EIO) when mgmtd
    /// reports the target offline: between tries (each retried for a second) the view is
    /// refreshed, so a reader learns of a stored that died within a second of mgmtd, instead
    /// of waiting out the retry deadline. Writes keep waiting (`store`): a stored restarting
    /// takes them when it is back.
    pub(crate) async fn store_read<R: Rpc>(&self, target: TargetId, req: &R) -> Result<R::Reply> {
        let bulk = self.cfg.bulk_transport;
        let h = self.header(&Ctx::root());
        let deadline = tokio::time::Instant::now() + Duration::from_secs(self.cfg.retry_secs);
        loop {
            let (addr, t) = self.located(&|c: &Cluster| c.target_addr(target, bulk)).await?;
            match self.pool.call_within(addr, t, &h, req, Duration::from_secs(1)).await {
                Err(e) if e.retryable() && tokio::time::Instant::now() < deadline => {
                    let view = self.cluster.refresh().await.unwrap_or_else(|_| self.cluster.view());
                    if let Some(t) = view.target(target).filter(|t| !t.online) {
                        return Err(ClientError::new(
                            ErrorCode::Io,
                            format!("target {target} on node {} is offline (mgmtd has not heard from its storage service): {e}", t.node),
                        ));
                    }
                }
                other => return other.map_err(Into::into),
            }
        }
    }

    /// Calls the stored holding `target`.
    pub(crate) async fn store<R: Rpc>(&self, target: TargetId, req: &R) -> Result<R::Reply> {
        let bulk = self.cfg.bulk_transport;
        self.call_fresh(&self.header(&Ctx::root()), req, |c| c.target_addr(target, bulk)).await
    }

    /// Calls the service `find` locates in the cluster view. A retryable failure refreshes the
    /// view once (the service may have moved) and tries again with the same header.
    pub(crate) async fn call_fresh<R: Rpc>(
        &self,
        h: &RequestHeader,
        req: &R,
        find: impl Fn(&Cluster) -> Result<(std::net::SocketAddr, Transport)>,
    ) -> Result<R::Reply> {
        let mut refreshed = false;
        loop {
            let (addr, t) = self.located(&find).await?;
            match self.pool.call(addr, t, h, req).await {
                Err(e) if e.retryable() && !refreshed => {
                    refreshed = true;
                    self.cluster.refresh().await?;
                }
                other => return other.map_err(Into::into),
            }
        }
    }

    /// Where `find` locates a service in the cluster view; while the view does not hold it (a
    /// restarted mgmtd knows only the services that registered again since), the view is asked
    /// for again, up to the retry deadline: a restart of mgmtd never fails a request.
    pub(crate) async fn located(
        &self,
        find: &impl Fn(&Cluster) -> Result<(std::net::SocketAddr, Transport)>,
    ) -> Result<(std::net::SocketAddr, Transport)> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(self.cfg.retry_secs);
        loop {
            match find(&self.cluster) {
                Err(ClientError::Unavailable(_)) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    // mgmtd itself may be down for the moment: the pool waits for it.
                    let _ = self.cluster.refresh().await;
                }
                other => return other,
            }
        }
    }

    /// Whether this client caches what metad tells it (and so takes leases); a one-shot
    /// client (`attr_cache_ms = 0`) does not.
    pub(crate) fn caching(&self) -> bool {
        self.cfg.attr_cache_ms > 0
    }
}
