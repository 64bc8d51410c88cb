//! `Client`: one process's connection to a filesystem, and every namespace operation.

use crate::attr_cache::{AttrCache, Cached, Ticket};
use crate::cluster::Cluster;
use crate::delegation::{Delegations, Take, GATHER};
use crate::file::{FileHandle, InodeData};
use crate::local_read;
use crate::{ClientConfig, ClientError, Result};
use odfs_proto::meta::*;
use odfs_proto::mgmt::{Register, ServiceKind};
use odfs_proto::stats::{FsStats, GetStats, ServiceStats};
use odfs_proto::storage::{ChunkRange, ChunksData, ReadChunk, ReadChunks, RemoveChunk};
use odfs_proto::{DirLayout, ErrorCode, InodeId, Layout, RequestHeader, Rpc, TargetId};
use odfs_rpc::{Pool, PoolConfig, Transport};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{watch, Semaphore};
use tracing::{debug, warn};

/// How a truncation is allowed: by a permission check on the path (`truncate(2)`), through a
/// descriptor opened for writing (`ftruncate`: access was decided at open), or by the library
/// itself (an open with `O_TRUNC`, checked by the open).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Truncate {
    CheckAccess,
    OpenForWrite,
    Checked,
}

/// The caller of an operation: whose permissions apply.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Ctx {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
}

impl Ctx {
    /// The identity of this process.
    pub fn current() -> Ctx {
        // SAFETY: these calls have no preconditions and cannot fail.
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        let mut groups = vec![0 as libc::gid_t; 256];
        // SAFETY: the buffer holds 256 entries and its length is passed.
        let n = unsafe { libc::getgroups(groups.len() as i32, groups.as_mut_ptr()) };
        groups.truncate(n.max(0) as usize);
        Ctx { uid, gid, groups }
    }

    pub fn root() -> Ctx {
        Ctx::default()
    }
}

pub(crate) struct Inner {
    pub cfg: ClientConfig,
    pub pool: Arc<Pool>,
    pub cluster: Cluster,
    pub cache: AttrCache,
    pub client_id: u64,
    next_request: AtomicU64,
    /// Data state of inodes open in this process, shared by their handles.
    pub inodes: Mutex<HashMap<InodeId, Arc<InodeData>>>,
    /// Bounds bytes of written data in flight (units of 4 KiB).
    pub write_budget: Arc<Semaphore>,
    stop: watch::Sender<bool>,
    /// The runtime the client was made on, for work started where none is current (a handle
    /// dropped on a FUSE reader thread).
    pub runtime: tokio::runtime::Handle,
    /// Directories' metadata stripes as last seen (striping changes only while a directory is
    /// empty, and a shard asked about a name it does not hold says so: see `entry_call`).
    stripes: Mutex<HashMap<InodeId, Vec<u16>>>,
    /// odfs-fuse's part of every recall.
    recall_hook: std::sync::OnceLock<RecallHook>,
    /// Files this client's own unlink or rename just removed, whose chunks are kept a moment
    /// (see `reclaim`).
    removed: Mutex<HashMap<InodeId, Attr>>,
    /// When a write or create of this client was last refused for want of space.
    last_no_space: Mutex<Option<std::time::Instant>>,
    /// This client's unlinks and renames in flight, which opens of a removed file wait for.
    removals: crate::removing::Removals,
    /// What the program on top counted of its own operations (a mount: every FUSE request,
    /// those answered from the caches included), shown by `fs_stats` beside the services'.
    ops: std::sync::OnceLock<OpStats>,
    /// The directories this client answers creates in, and its log of deferred changes.
    delegations: Arc<Delegations>,
    /// Small files read ahead of their opens.
    pub prefetch: crate::prefetch::Prefetch,
    /// This node's targets whose chunks are read from their files.
    pub(crate) local: crate::local_read::LocalReads,
    /// Streams to stored that spliced reads take their replies from.
    pub(crate) splice: crate::splice_read::SpliceStreams,
    /// Which lock owners of this client took file locks on which inodes.
    pub(crate) locks: crate::locks::LockOwners,
}

/// Reads what the program on top of a client counted of its own operations (see
/// [`Client::on_stats`]).
pub type OpStats = Box<dyn Fn() -> odfs_proto::stats::StatsSnapshot + Send + Sync>;

/// How long a caching client keeps the chunks of a file its own unlink or rename removed, and
/// answers opens of it: its kernel may have resolved the old name just before the change (a
/// path walk runs ahead of an open), and such an open gets the old file, as on a local
/// filesystem, instead of ESTALE. Kept longer while this client still holds the file open.
const REMOVED_GRACE: Duration = Duration::from_secs(2);

/// A target with less than 1/`SHORT_OF_SPACE` of its capacity free is short of space: files
/// removed from it give their space back at once, without the `REMOVED_GRACE`.
const SHORT_OF_SPACE: u64 = 8;

/// How long an unlink short of space waits for the kernel's release of the file it removes.
const RELEASE_WAIT: Duration = Duration::from_millis(200);

/// How long a write or create refused for want of space is asked again before the caller
/// gets ENOSPC: another client's `REMOVED_GRACE` and a space report of the targets' stored
/// (a heartbeat, 1 s), so that space any node's unlink freed counts as on a local disk.
pub(crate) const SPACE_WAIT: Duration = Duration::from_secs(3);

/// How long a goodbye (`EndSession`) waits for each metadata shard.
const GOODBYE_WAIT: Duration = Duration::from_secs(2);

/// A connection to one odfs filesystem. Cheap to clone.
#[derive(Clone)]
pub struct Client {
    pub(crate) inner: Arc<Inner>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

/// Opens being registered with metad, and the guards holding their releases back until then.
#[derive(Default)]
struct Registering {
    files: Vec<(InodeId, u64)>,
    guards: Vec<tokio::sync::OwnedMutexGuard<()>>,
}

/// What odfs-fuse runs on every recall (it drops the kernel's caches).
pub type RecallHook = Arc<dyn Fn(&Recall) + Send + Sync>;

/// How long a recall waits for the hook before it is acknowledged anyway: a kernel
/// invalidation waits for the directory's lock, which a local operation waiting on metad may
/// hold.
const HOOK_WAIT: Duration = Duration::from_millis(20);

/// Sends the changes this client deferred under its create delegations, a batch at a time:
/// woken when the log grows, it sends all of it, and again what came meanwhile, gathered for
/// up to `GATHER` from the last send unless a caller waits for the log.
async fn send_deferred(weak: std::sync::Weak<Inner>, dels: Arc<Delegations>, mut stop: watch::Receiver<bool>) {
    let mut last_send: Option<std::time::Instant> = None;
    loop {
        tokio::select! {
            _ = dels.kick.notified() => {}
            _ = stop.changed() => return,
        }
        loop {
            let left = last_send.map_or(Duration::ZERO, |at| GATHER.saturating_sub(at.elapsed()));
            if !left.is_zero() && !dels.hurried() {
                tokio::select! {
                    _ = tokio::time::sleep(left) => {}
                    _ = dels.hurry.notified() => {}
                    _ = stop.changed() => return,
                }
            }
            let batch = dels.next_batch();
            if batch.is_empty() {
                break;
            }
            last_send = Some(std::time::Instant::now());
            let Some(inner) = weak.upgrade() else { return };
            let sent = Client { inner }.send_batch(batch).await;
            if !sent {
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    _ = stop.changed() => return,
                }
            }
        }
    }
}

/// One shard's session: polls, applies the recalls each answer brings, and acknowledges them
/// with the next poll. Trust in the shard's leases is renewed by every answer: until the
/// poll's send time plus nine tenths of the lease, before the shard could end the session.
async fn keep_session(weak: std::sync::Weak<Inner>, shard: u16, mut stop: watch::Receiver<bool>) {
    let (mut acked, mut open) = (0u64, Registering::default());
    loop {
        let Some(inner) = weak.upgrade() else { return };
        let client = Client { inner };
        let sent = std::time::Instant::now();
        // Opens to register: answered at once, so that their releases wait no longer.
        let wait_ms = if open.files.is_empty() { 60_000 } else { 0 };
        let poll = SessionPoll { wait_ms, acked, open: open.files.clone(), caching: client.caching() };
        let root = Ctx::root();
        let r = tokio::select! {
            r = client.meta(&root, shard, &poll) => r,
            _ = stop.changed() => return,
        };
        match r {
            Ok(reply) => {
                if reply.new_session {
                    client.inner.cache.drop_shard(shard);
                    client.inner.delegations.drop_shard(shard);
                    acked = 0;
                    client.reopen(shard).await;
                    client.reclaim_locks(shard).await;
                }
                open = Registering::default();
                for rc in &reply.recalls {
                    let reg = client.apply_recall(rc).await;
                    open.files.extend(reg.files);
                    open.guards.extend(reg.guards);
                    acked = acked.max(rc.seq);
                }
                let lease = Duration::from_millis(reply.lease_ms as u64);
                client.inner.cache.renew(shard, sent, lease - lease / 10);
            }
            Err(e) => {
                debug!(shard, error = %e, "session poll failed");
                // The shard may have restarted, knowing no delegation: creates go to it again.
                client.inner.delegations.drop_shard(shard);
                drop(client);
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    _ = stop.changed() => return,
                }
            }
        }
    }
}

impl Client {
    /// Connects to the filesystem described by `cfg` and waits (up to `cfg.retry_secs`) until it
    /// is ready.
    pub async fn connect(cfg: ClientConfig) -> Result<Client> {
        Client::connect_over(cfg.clone(), Arc::new(Client::pool(&cfg)?)).await
    }

    /// The connection pool a client of `cfg` calls its services through.
    pub fn pool(cfg: &ClientConfig) -> Result<Pool> {
        let cred = cfg.job.credential().map_err(|e| ClientError::Config(e.to_string()))?;
        let pcfg = PoolConfig {
            call_timeout: Duration::from_secs(cfg.call_timeout_secs),
            retry_deadline: Duration::from_secs(cfg.retry_secs),
            conns_per_peer: cfg.bulk_connections.max(1),
        };
        Pool::new(cred, pcfg).map_err(|e| ClientError::Config(e.to_string()))
    }

    /// [`Client::connect`] through `pool`: the transport seam (a pool with routers of this
    /// process, `odfs_rpc::Local`, runs a client and its services in one process).
    pub async fn connect_over(cfg: ClientConfig, pool: Arc<Pool>) -> Result<Client> {
        let cluster = Cluster::fetch(pool.clone(), cfg.mgmtd).await?;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(cfg.retry_secs);
        while !cluster.ready() {
            if tokio::time::Instant::now() > deadline {
                return Err(ClientError::Unavailable(format!("filesystem at {} is not ready", cfg.mgmtd)));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            cluster.refresh().await?;
        }
        let (stop, stop_rx) = watch::channel(false);
        let budget_units = (cfg.write_behind_bytes / 4096).max(256) as usize;
        // A prefetch reads what leases cover: a client that caches nothing prefetches nothing.
        let prefetch_limit = if cfg.attr_cache_ms > 0 { cfg.prefetch_limit() } else { 0 };
        let (local_reads, node, drop_behind) = (cfg.local_reads, cfg.node, cfg.drop_behind_reads);
        let inner = Arc::new(Inner {
            client_id: rand::random::<u64>() | 1,
            next_request: AtomicU64::new(1),
            inodes: Mutex::new(HashMap::new()),
            write_budget: Arc::new(Semaphore::new(budget_units)),
            cache: AttrCache::new(cfg.attr_cache_ms > 0, cluster.view().meta_shards()),
            recall_hook: std::sync::OnceLock::new(),
            cluster,
            pool,
            cfg,
            stop,
            runtime: tokio::runtime::Handle::current(),
            stripes: Mutex::new(HashMap::new()),
            removed: Mutex::new(HashMap::new()),
            last_no_space: Mutex::new(None),
            removals: Default::default(),
            ops: std::sync::OnceLock::new(),
            delegations: Arc::new(Delegations::new()),
            locks: Default::default(),
            prefetch: crate::prefetch::Prefetch::new(prefetch_limit),
            local: crate::local_read::LocalReads::new(local_reads, node, drop_behind),
            splice: Default::default(),
        });
        let client = Client { inner };
        client.keep_sessions(&stop_rx);
        tokio::spawn(send_deferred(Arc::downgrade(&client.inner), client.inner.delegations.clone(), stop_rx.clone()));
        client.spawn_background(stop_rx);
        Ok(client)
    }

    /// Keeps this client's session with every metadata shard alive: a long poll each, which
    /// brings the shard's recalls and carries their acknowledgements; after a shard restarted
    /// (a new session), what it leased is dropped and the files held open there are registered
    /// again.
    fn keep_sessions(&self, stop: &watch::Receiver<bool>) {
        for shard in 0..self.inner.cluster.view().meta_shards().max(1) {
            tokio::spawn(keep_session(Arc::downgrade(&self.inner), shard, stop.clone()));
        }
    }

    /// Lets odfs-fuse drop the kernel's caches on every recall (called before it is
    /// acknowledged; a hook still busy after `HOOK_WAIT` is not waited for).
    pub fn on_recall(&self, hook: RecallHook) {
        let _ = self.inner.recall_hook.set(hook);
    }

    /// Applies one recall: the client's caches, then the hook's. Returns the recalled files
    /// this client holds open without having registered them (the acknowledgement names them,
    /// so they outlive their last name while open here).
    async fn apply_recall(&self, r: &Recall) -> Registering {
        if !r.dirs.is_empty() {
            // Another client asks about these directories: what was answered here goes first.
            self.inner.delegations.end(&r.dirs);
            self.inner.delegations.settle().await;
            if r.inos.is_empty() && r.names.is_empty() {
                // Nothing cached changed.
                return Registering::default();
            }
        }
        self.inner.cache.apply(r);
        self.inner.prefetch.recalled(&r.inos);
        {
            let mut stripes = self.inner.stripes.lock().expect("stripes lock");
            for ino in &r.inos {
                stripes.remove(ino);
            }
        }
        if let Some(hook) = self.inner.recall_hook.get().cloned() {
            let r = r.clone();
            let job = tokio::task::spawn_blocking(move || hook(&r));
            if tokio::time::timeout(HOOK_WAIT, job).await.is_err() {
                debug!("a kernel invalidation is still waiting (a local operation holds the directory)");
            }
        }
        self.mark_registered(|d| r.inos.contains(&d.ino))
    }

    /// Marks the open files that `pick` selects and that metad does not know as registered,
    /// each under a new request id; returns them, with guards that hold their releases back
    /// until the registration has reached metad.
    fn mark_registered(&self, pick: impl Fn(&InodeData) -> bool) -> Registering {
        let map = self.inner.inodes.lock().expect("inodes lock");
        let mut out = Registering::default();
        for d in map.values().filter(|d| d.registered() == 0 && pick(d)) {
            let seq = self.next_request_id();
            d.mark_registered(seq);
            out.files.push((d.ino, seq));
            out.guards.extend(d.registering.clone().try_lock_owned().ok());
        }
        out
    }

    /// Registers the files opened from the cache (unknown to metad) before a change that may
    /// take a file's last name: metad keeps those as orphans for this client. Returns once
    /// every file open here is registered, also those another request began to register: the
    /// change must not reach metad before their registration does (a process unlinking its own
    /// files marked another's open temporary file as it registered it; that process's unlink,
    /// finding nothing left to register, reached metad first, and metad removed the file).
    async fn register_local_opens(&self) {
        let Registering { files, guards } = self.mark_registered(|_| true);
        let mut by_shard: HashMap<u16, Vec<(InodeId, u64)>> = HashMap::new();
        for f in files {
            by_shard.entry(f.0.shard()).or_default().push(f);
        }
        for (shard, files) in by_shard {
            if let Err(e) = self.meta(&Ctx::root(), shard, &Reopen { files }).await {
                warn!(shard, error = %e, "cannot register open files before a change");
            }
        }
        drop(guards);
        self.registrations_sent().await;
    }

    /// Waits until the registrations of files open here that other requests are sending have
    /// been answered (each holds its file's `registering` lock while it is on its way; only
    /// those held now are waited for, so an unlink with none on their way clones nothing).
    async fn registrations_sent(&self) {
        let on_their_way: Vec<_> = {
            let map = self.inner.inodes.lock().expect("inodes lock");
            map.values().filter(|d| d.registering.try_lock().is_err()).map(|d| d.registering.clone()).collect()
        };
        for registering in on_their_way {
            drop(registering.lock().await);
        }
    }

    /// Registers again the files this client holds open on `shard` (after a new session).
    /// Files opened from the cache get a request id of their own first: registered under none,
    /// their last close would send no release and metad would hold them until the session
    /// ends (an unlinked one's chunks with them). A client's first poll starts a new session,
    /// so this happens to any file opened before that poll is answered.
    async fn reopen(&self, shard: u16) {
        let _fresh = self.mark_registered(|d| d.ino.shard() == shard);
        let files: Vec<(InodeId, u64)> = {
            let map = self.inner.inodes.lock().expect("inodes lock");
            map.values().filter(|d| d.ino.shard() == shard).map(|d| (d.ino, d.registered())).collect()
        };
        if files.is_empty() {
            return;
        }
        if let Err(e) = self.meta(&Ctx::root(), shard, &Reopen { files }).await {
            warn!(shard, error = %e, "cannot register open files again after a metadata service restart");
        }
    }

    fn spawn_background(&self, mut stop: watch::Receiver<bool>) {
        let weak = Arc::downgrade(&self.inner);
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    _ = stop.changed() => return,
                }
                let Some(inner) = weak.upgrade() else { return };
                if let Err(e) = inner.cluster.refresh().await {
                    debug!(error = %e, "cluster refresh failed");
                }
            }
        });
    }

    /// Registers this client with mgmtd so `odfs status` lists it; heartbeats until dropped.
    pub async fn register(&self, node: u32) -> Result<()> {
        let hostname = odfs_service::hostname();
        let link = odfs_service::MgmtLink {
            pool: self.inner.pool.clone(),
            mgmtd: self.inner.cfg.mgmtd,
            register: Register {
                kind: ServiceKind::Client,
                node,
                hostname,
                addr: None,
                bulk_addr: None,
                shard: None,
                targets: vec![],
                pid: std::process::id(),
                client_id: self.inner.client_id,
            },
        };
        let first = link.register(Duration::from_secs(5)).await?;
        let stop = self.inner.stop.subscribe();
        tokio::spawn(link.run(first, Arc::new(Vec::new), stop));
        Ok(())
    }

    /// Where this node keeps all of a file's bytes, if it does: a layout of one target, on this
    /// client's node (the chunk file's offsets are then the file's; FUSE passthrough).
    pub fn local_chunk_path(&self, ino: InodeId, layout: &Layout) -> Option<std::path::PathBuf> {
        match layout.targets[..] {
            [t] => self.inner.cluster.local_chunk_path(t, self.node(), ino),
            _ => None,
        }
    }

    /// Where this node's targets keep their files (as their stored registered them).
    pub fn local_target_dirs(&self) -> Vec<std::path::PathBuf> {
        self.inner.cluster.target_dirs(self.node())
    }

    /// The node this client runs on (its config's `node`).
    /// This client's id, as metad knows its sessions by.
    pub fn id(&self) -> u64 {
        self.inner.client_id
    }

    pub fn node(&self) -> odfs_proto::NodeIndex {
        self.config().node
    }

    pub fn config(&self) -> &ClientConfig {
        &self.inner.cfg
    }

    pub fn cluster(&self) -> &Cluster {
        &self.inner.cluster
    }

    /// A request id of this client's, never used before.
    fn next_request_id(&self) -> u64 {
        self.inner.next_request.fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) fn header(&self, ctx: &Ctx) -> RequestHeader {
        RequestHeader {
            request_id: self.next_request_id(),
            client_id: self.inner.client_id,
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
    async fn meta_as<R: Rpc>(&self, h: &RequestHeader, shard: u16, req: &R) -> Result<R::Reply> {
        if odfs_proto::meta::ends_delegation(R::METHOD) {
            // The reserved ids' layouts, or the directory's striping or seal, change.
            self.inner.delegations.end(&req.inodes());
        }
        if R::METHOD == Rename::METHOD || R::METHOD == Link::METHOD {
            // Another client may find a file made here through its new name.
            self.inner.delegations.forget_made();
        }
        if R::METHOD != SessionPoll::METHOD {
            self.inner.delegations.settle().await;
        }
        self.meta_now(h, shard, req).await
    }

    /// Calls metad without waiting for deferred changes (the session's poll, the batches).
    async fn meta_now<R: Rpc>(&self, h: &RequestHeader, shard: u16, req: &R) -> Result<R::Reply> {
        let want = self.inner.cfg.meta_transport;
        self.call_fresh(h, req, |c| c.meta_addr(shard, want)).await
    }

    /// Up to `len` bytes of `ino`'s chunk file on `target` at `offset`, short where it ends and
    /// empty where there is none (a hole): from the file itself when the target is this node's
    /// (short-circuit reads), else from its stored. A small local read that needs the disk is
    /// finished by stored too (`local_read::DISK_VIA_STORED_BELOW`).
    pub(crate) async fn read_chunk(&self, target: TargetId, ino: InodeId, offset: u64, len: u32) -> Result<Vec<u8>> {
        let Some(dir) = self.inner.local.dir(&self.inner.cluster, target) else {
            return self.read_chunk_from_store(target, ino, offset, len).await;
        };
        // Noted before the read, as every reader of a chunk file notes (`read_behind`); a read
        // short enough to be finished by stored is never followed.
        self.inner.local.read_behind(target, ino, &dir, offset, len as u64);
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
                self.inner.local.failed(target, &dir, &e);
                self.read_chunk_from_store(target, ino, offset, len).await
            }
        }
    }

    /// [`Self::read_chunk`] through the stored holding `target`.
    async fn read_chunk_from_store(&self, target: TargetId, ino: InodeId, offset: u64, len: u32) -> Result<Vec<u8>> {
        Ok(self.store_read(target, &ReadChunk { target, ino, offset, len }).await?.data)
    }

    /// Several chunk files' ranges on `target`, as a `ReadChunks` reply gives them: from the
    /// files themselves when the target is this node's, else from its stored.
    pub(crate) async fn read_chunks(&self, target: TargetId, items: Vec<ChunkRange>) -> Result<ChunksData> {
        if let Some(dir) = self.inner.local.dir(&self.inner.cluster, target) {
            match crate::local_read::read_many(dir.clone(), items.clone()).await {
                Ok((lens, data)) => return Ok(ChunksData { lens, data, ..ChunksData::default() }),
                Err(e) => self.inner.local.failed(target, &dir, &e),
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
        let bulk = self.inner.cfg.bulk_transport;
        let h = self.header(&Ctx::root());
        let deadline = tokio::time::Instant::now() + Duration::from_secs(self.inner.cfg.retry_secs);
        loop {
            let (addr, t) = self.located(&|c: &Cluster| c.target_addr(target, bulk)).await?;
            match self.inner.pool.call_within(addr, t, &h, req, Duration::from_secs(1)).await {
                Err(e) if e.retryable() && tokio::time::Instant::now() < deadline => {
                    let view = self.inner.cluster.refresh().await.unwrap_or_else(|_| self.inner.cluster.view());
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
        let bulk = self.inner.cfg.bulk_transport;
        self.call_fresh(&self.header(&Ctx::root()), req, |c| c.target_addr(target, bulk)).await
    }

    /// Calls the service `find` locates in the cluster view. A retryable failure refreshes the
    /// view once (the service may have moved) and tries again with the same header.
    async fn call_fresh<R: Rpc>(
        &self,
        h: &RequestHeader,
        req: &R,
        find: impl Fn(&Cluster) -> Result<(std::net::SocketAddr, Transport)>,
    ) -> Result<R::Reply> {
        let mut refreshed = false;
        loop {
            let (addr, t) = self.located(&find).await?;
            match self.inner.pool.call(addr, t, h, req).await {
                Err(e) if e.retryable() && !refreshed => {
                    refreshed = true;
                    self.inner.cluster.refresh().await?;
                }
                other => return other.map_err(Into::into),
            }
        }
    }

    /// Where `find` locates a service in the cluster view; while the view does not hold it (a
    /// restarted mgmtd knows only the services that registered again since), the view is asked
    /// for again, up to the retry deadline: a restart of mgmtd never fails a request.
    async fn located(
        &self,
        find: &impl Fn(&Cluster) -> Result<(std::net::SocketAddr, Transport)>,
    ) -> Result<(std::net::SocketAddr, Transport)> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(self.inner.cfg.retry_secs);
        loop {
            match find(&self.inner.cluster) {
                Err(ClientError::Unavailable(_)) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    // mgmtd itself may be down for the moment: the pool waits for it.
                    let _ = self.inner.cluster.refresh().await;
                }
                other => return other,
            }
        }
    }

    /// Calls another service of this job (a stage agent) at `addr` over QUIC, as `ctx`.
    pub async fn call<R: Rpc>(&self, ctx: &Ctx, addr: std::net::SocketAddr, req: &R) -> Result<R::Reply> {
        self.inner.pool.call(addr, Transport::Quic, &self.header(ctx), req).await.map_err(Into::into)
    }

    /// Whether this client caches what metad tells it (and so takes leases); a one-shot
    /// client (`attr_cache_ms = 0`) does not.
    fn caching(&self) -> bool {
        self.inner.cfg.attr_cache_ms > 0
    }

    fn shard_of(ino: InodeId) -> u16 {
        ino.shard()
    }

    /// Attributes as this process knows them: its own unflushed writes count toward the size.
    fn merge_local(&self, mut attr: Attr) -> Attr {
        if let Some(d) = self.inner.inodes.lock().expect("inodes lock").get(&attr.ino) {
            attr.size = d.local_size(attr.size);
        }
        attr
    }

    /// What `name` in `parent` names; from the cache when a lease covers it (a name known not
    /// to exist answers `NotFound` there too).
    pub async fn lookup(&self, ctx: &Ctx, parent: InodeId, name: &[u8]) -> Result<Attr> {
        if let Some(found) = self.lookup_cached(ctx, parent, name) {
            return found;
        }
        let t = self.inner.cache.ticket();
        match self.entry_call(ctx, parent, name, &Lookup { parent, name: name.to_vec() }).await {
            Ok(a) => {
                self.cache_entry(ctx, parent, name, Some(&a), t);
                self.note_stripes(&a);
                Ok(self.merge_local(a))
            }
            Err(e) => {
                if e.code() == ErrorCode::NotFound {
                    self.cache_entry(ctx, parent, name, None, t);
                }
                Err(e)
            }
        }
    }

    /// A lookup answered from the cache alone, if a lease covers it. A name longer than
    /// `NAME_MAX` is refused here as metad would refuse it: a directory whose every name is
    /// known would otherwise answer it "not found" (the kernel leaves the limit to FUSE).
    pub fn lookup_cached(&self, ctx: &Ctx, parent: InodeId, name: &[u8]) -> Option<Result<Attr>> {
        if name.len() > odfs_proto::NAME_MAX {
            return Some(Err(odfs_proto::meta::check_name(name).expect_err("a name over NAME_MAX").into()));
        }
        match self.inner.cache.lookup(parent, name, (ctx.uid, ctx.gid))? {
            Cached::Found(a) => Some(Ok(self.merge_local(a))),
            Cached::Absent => Some(Err(ClientError::new(
                ErrorCode::NotFound,
                format!("\"{}\" does not exist", String::from_utf8_lossy(name)),
            ))),
        }
    }

    /// Mode and group from the cache alone, if a lease covers them (cheap: for every write).
    pub fn mode_cached(&self, ino: InodeId) -> Option<(u32, u32)> {
        self.inner.cache.mode(ino)
    }

    /// Attributes answered from the cache alone, if a lease covers them.
    pub fn getattr_cached(&self, ino: InodeId) -> Option<Attr> {
        self.inner.cache.attr(ino).map(|a| self.merge_local(a))
    }

    /// Taken before a request: with it, `kernel_ttl` tells whether its reply may be cached.
    pub fn ticket(&self) -> Ticket {
        self.inner.cache.ticket()
    }

    /// For the result of this client's own change sent with `before` (see `AttrCache::after`).
    pub fn ticket_after(&self, before: Ticket) -> Ticket {
        self.inner.cache.after(before)
    }

    /// How long the kernel may cache what a reply said of inode `ino` (the request was sent
    /// with `ticket`): until this client's lease could lapse; zero when a recall or a change
    /// of this client crossed it.
    pub fn kernel_ttl(&self, ino: InodeId, ticket: Ticket) -> Duration {
        self.inner.cache.ttl(ino, ticket)
    }

    /// The same for a name of `parent` (its lease is the shard's that holds the name).
    pub fn kernel_entry_ttl(&self, parent: InodeId, name: &[u8], ticket: Ticket) -> Duration {
        self.inner.cache.entry_ttl(parent, name, self.known_entry_shard(parent, name), ticket)
    }

    /// Caches a name (or its absence) from a reply to a request sent with `ticket`.
    fn cache_entry(&self, ctx: &Ctx, parent: InodeId, name: &[u8], attr: Option<&Attr>, ticket: Ticket) {
        let shard = self.known_entry_shard(parent, name);
        self.inner.cache.put_entry(parent, name, attr, (ctx.uid, ctx.gid), shard, ticket);
    }

    /// The shard holding `name` of `parent`, as far as this client knows the stripes.
    fn known_entry_shard(&self, parent: InodeId, name: &[u8]) -> u16 {
        let stripes = self.inner.stripes.lock().expect("stripes lock").get(&parent).cloned().unwrap_or_default();
        odfs_proto::meta::entry_shard(&stripes, name).unwrap_or(parent.shard())
    }

    pub async fn getattr(&self, ctx: &Ctx, ino: InodeId) -> Result<Attr> {
        let t = self.inner.cache.ticket();
        if let Some(a) = self.inner.cache.attr(ino) {
            return Ok(self.merge_local(a));
        }
        let a = self.meta(ctx, Self::shard_of(ino), &GetAttr { ino }).await?;
        self.cache_attr(&a, t);
        Ok(self.merge_local(a))
    }

    /// Forgets what this client cached of `ino` (after a change it cannot describe).
    pub fn invalidate(&self, ino: InodeId) {
        self.inner.cache.forget(ino);
    }

    /// This client made entry `name` of `parent` (`None`: removed it; sent with ticket `t`):
    /// the change is marked done (replies that crossed it are not cached), the parent's times
    /// changed, and the new entry (or the name's absence) is cached.
    fn made_entry(&self, ctx: &Ctx, parent: InodeId, name: &[u8], a: Option<&Attr>, t: Ticket) {
        self.inner.cache.forget_entry(parent, name);
        self.invalidate(parent);
        self.cache_entry(ctx, parent, name, a, self.ticket_after(t));
    }

    /// The attributes of a directory this client just changed, as its shard returned them
    /// (sent with ticket `t`): cached, so that the kernel's next permission check of the
    /// directory needs no request.
    fn cache_parent(&self, parent: Option<&Attr>, t: Ticket) {
        if let Some(p) = parent {
            self.inner.cache.put_newer(p, self.ticket_after(t));
        }
    }

    /// Sends `req`, a change of inode `ino`'s attributes, to shard `shard`: whatever comes of
    /// it, what this client cached of the inode is dropped; the new attributes are cached.
    pub(crate) async fn change_attr<R: Rpc<Reply = Attr>>(
        &self,
        ctx: &Ctx,
        shard: u16,
        ino: InodeId,
        req: &R,
    ) -> Result<Attr> {
        let t = self.ticket();
        let r = self.meta(ctx, shard, req).await;
        self.invalidate(ino);
        let a = r?;
        self.changed_attr(&a, t);
        Ok(a)
    }

    /// This client changed `a.ino` (sent with ticket `t`): marked done, then cached.
    pub(crate) fn changed_attr(&self, a: &Attr, t: Ticket) {
        self.invalidate(a.ino);
        self.cache_attr(a, self.ticket_after(t));
    }

    pub(crate) fn cache_attr(&self, a: &Attr, ticket: Ticket) {
        self.inner.cache.put_attr(a, ticket);
        self.note_stripes(a);
    }

    /// Remembers a directory's metadata stripes. Bounded as the attribute cache is: a long walk
    /// sees every directory, and forgetting is safe (a miss asks again, a stale entry is
    /// corrected by `WrongShard`).
    fn note_stripes(&self, a: &Attr) {
        const MAX_DIRS: usize = 1 << 20;
        if a.kind == FileKind::Dir && self.sharded() {
            let mut m = self.inner.stripes.lock().expect("stripes lock");
            if m.len() >= MAX_DIRS {
                m.clear();
            }
            m.insert(a.ino, a.dir_stripes.clone());
        }
    }

    /// More than one metadata shard: entries must be routed by their directory's stripes.
    fn sharded(&self) -> bool {
        self.inner.cluster.view().meta_shards() > 1
    }

    /// The metadata shards a directory's entries are spread over (empty: its own shard holds
    /// them all). Known stripes first, then the attributes (cached or asked for).
    async fn dir_stripes(&self, ctx: &Ctx, ino: InodeId) -> Result<Vec<u16>> {
        if !self.sharded() {
            return Ok(Vec::new());
        }
        let known = self.inner.stripes.lock().expect("stripes lock").get(&ino).cloned();
        match known {
            Some(s) => Ok(s),
            None => Ok(self.getattr(ctx, ino).await?.dir_stripes),
        }
    }

    /// The shard holding entry `name` of directory `parent`.
    async fn entry_shard(&self, ctx: &Ctx, parent: InodeId, name: &[u8]) -> Result<u16> {
        let stripes = self.dir_stripes(ctx, parent).await?;
        Ok(odfs_proto::meta::entry_shard(&stripes, name).unwrap_or(parent.shard()))
    }

    /// A request about entry `name` of `parent`, sent to the shard that holds it. A shard that
    /// does not (the directory was striped since this client looked) says so: the stripes are
    /// read again and the request goes once more.
    async fn entry_call<R: Rpc>(&self, ctx: &Ctx, parent: InodeId, name: &[u8], req: &R) -> Result<R::Reply> {
        self.entry_call_as(ctx, &self.header(ctx), parent, name, req).await
    }

    /// `entry_call` with a given header (whose request id the caller keeps).
    async fn entry_call_as<R: Rpc>(
        &self,
        ctx: &Ctx,
        h: &RequestHeader,
        parent: InodeId,
        name: &[u8],
        req: &R,
    ) -> Result<R::Reply> {
        let shard = self.entry_shard(ctx, parent, name).await?;
        match self.meta_as(h, shard, req).await {
            Err(e) if e.code() == ErrorCode::WrongShard => {
                self.inner.stripes.lock().expect("stripes lock").remove(&parent);
                self.invalidate(parent);
                let shard = self.entry_shard(ctx, parent, name).await?;
                self.meta_as(h, shard, req).await
            }
            other => other,
        }
    }

    pub async fn access(&self, ctx: &Ctx, ino: InodeId, mask: u32) -> Result<()> {
        self.meta(ctx, Self::shard_of(ino), &Access { ino, mask }).await
    }

    /// Changes attributes. A size change truncates the data first (after a permission check).
    pub async fn setattr(&self, ctx: &Ctx, req: SetAttr) -> Result<Attr> {
        let t = self.inner.cache.ticket();
        self.invalidate(req.ino);
        if req.mtime.is_some() {
            // Publish this process's writes first, or their mtime, sent at close, would replace
            // the one set here (tar and cp -a set times on the open descriptor, then close it).
            let local = self.inner.inodes.lock().expect("inodes lock").get(&req.ino).cloned();
            if let Some(d) = local {
                d.flush(self, ctx, false).await?;
            }
        }
        if let Some(size) = req.size {
            let how = if req.open_for_write { Truncate::OpenForWrite } else { Truncate::CheckAccess };
            self.truncate(ctx, req.ino, size, how).await?;
            if req.mode.is_none()
                && req.uid.is_none()
                && req.gid.is_none()
                && req.atime.is_none()
                && req.mtime.is_none()
            {
                return self.getattr(ctx, req.ino).await;
            }
            let rest = SetAttr { size: None, ..req };
            let a = self.meta(ctx, Self::shard_of(rest.ino), &rest).await?;
            self.changed_attr(&a, t);
            return Ok(self.merge_local(a));
        }
        let a = self.meta(ctx, Self::shard_of(req.ino), &req).await?;
        self.changed_attr(&a, t);
        Ok(self.merge_local(a))
    }

    /// Drops a regular file's set-id bits as a write by `ctx` (without CAP_FSETID) does on
    /// Linux; the caller has the file open for writing.
    pub async fn kill_setid(&self, ctx: &Ctx, ino: InodeId) -> Result<Attr> {
        self.setattr(ctx, SetAttr { ino, open_for_write: true, kill_setid: true, ..Default::default() }).await
    }

    /// Sets a file's size: chunks on every target, then the size at metad.
    pub async fn truncate(&self, ctx: &Ctx, ino: InodeId, size: u64, how: Truncate) -> Result<()> {
        odfs_proto::layout::check_file_size(size).map_err(|why| ClientError::new(ErrorCode::FileTooBig, why))?;
        // As truncate(2): a directory is EISDIR and another non-file EINVAL, before any
        // permission is looked at.
        let checked = match how {
            Truncate::CheckAccess => {
                let a = self.getattr(ctx, ino).await?;
                match a.kind {
                    FileKind::File => {}
                    FileKind::Dir => return Err(ErrorCode::IsDir.into()),
                    _ => return Err(ErrorCode::Invalid.into()),
                }
                self.access(ctx, ino, 2).await?;
                Some(a)
            }
            _ => None,
        };
        let local = self.inner.inodes.lock().expect("inodes lock").get(&ino).cloned();
        let layout = match &local {
            Some(d) => {
                d.drain(self).await?;
                d.layout.clone()
            }
            None => {
                let a = match checked {
                    Some(a) => a,
                    None => self.getattr(ctx, ino).await?,
                };
                match a.layout {
                    Some(l) => l,
                    None if a.kind == FileKind::Dir => return Err(ErrorCode::IsDir.into()),
                    None => return Err(ErrorCode::Invalid.into()),
                }
            }
        };
        self.truncate_chunks(&layout, ino, size).await?;
        let open_for_write = how != Truncate::CheckAccess;
        self.meta(ctx, Self::shard_of(ino), &SetAttr { ino, size: Some(size), open_for_write, ..Default::default() })
            .await?;
        self.invalidate(ino);
        if let Some(d) = local {
            d.set_size_after_truncate(size);
        }
        Ok(())
    }

    pub(crate) async fn truncate_chunks(&self, layout: &Layout, ino: InodeId, size: u64) -> Result<()> {
        let futs = layout.targets.iter().enumerate().map(|(i, &t)| {
            let len = layout.local_len(i, size);
            async move { self.store(t, &odfs_proto::storage::TruncateChunk { target: t, ino, len }).await }
        });
        for r in futures::future::join_all(futs).await {
            r?;
        }
        Ok(())
    }

    /// Removes an inode's chunk files: on every target of its layout, or, given the size of
    /// a file nobody has open, only on the targets that hold some of its bytes (a small
    /// file's data is on one target; the others are not asked).
    pub(crate) async fn remove_chunks(&self, layout: &Layout, ino: InodeId, size: Option<u64>) {
        let holding = |i: usize| size.is_none_or(|s| layout.local_len(i, s) > 0);
        let futs = layout
            .targets
            .iter()
            .enumerate()
            .filter(|(i, _)| holding(*i))
            .map(|(_, &t)| async move { (t, self.store(t, &RemoveChunk { target: t, ino }).await) });
        for (t, r) in futures::future::join_all(futs).await {
            if let Err(e) = r {
                warn!(target = t, %ino, error = %e, "could not remove chunk file");
            }
        }
    }

    /// Removes the data of an inode whose last link went away. metad says so only when no
    /// client holds it open; one held open stays an orphan until its last release.
    async fn reclaim(&self, removed: Option<Attr>) {
        let Some(attr) = removed else { return };
        if attr.layout.is_none() {
            return;
        }
        if !self.caching() {
            // A one-shot client has no kernel racing its changes: at once.
            return self.remove_data(&attr).await;
        }
        if self.short_of_space(&attr) && self.released_soon(attr.ino).await {
            // Space another node may be waiting for (its create or write refused for want of
            // it) counts more than an open racing this unlink: freed before the unlink returns.
            return self.remove_data(&attr).await;
        }
        self.inner.removed.lock().expect("removed lock").insert(attr.ino, attr.clone());
        let client = self.clone();
        self.inner.runtime.spawn(async move {
            loop {
                tokio::time::sleep(REMOVED_GRACE).await;
                if !client.inner.inodes.lock().expect("inodes lock").contains_key(&attr.ino) {
                    break;
                }
            }
            client.inner.removed.lock().expect("removed lock").remove(&attr.ino);
            client.remove_data(&attr).await;
        });
    }

    /// Whether a target holding the removed file's data is short of space: this client was
    /// refused for want of space a moment ago, or the last view of mgmtd (refreshed every
    /// second, so a pool filled within it may not show yet) has less than 1/`SHORT_OF_SPACE` of
    /// the target free.
    fn short_of_space(&self, attr: &Attr) -> bool {
        let Some(layout) = &attr.layout else { return false };
        let refused = *self.inner.last_no_space.lock().expect("no space lock");
        if refused.is_some_and(|t| t.elapsed() < SPACE_WAIT) {
            return true;
        }
        let view = self.inner.cluster.view();
        view.targets
            .iter()
            .filter(|t| layout.targets.contains(&t.id))
            .any(|t| t.space.free < t.space.capacity / SHORT_OF_SPACE)
    }

    /// Notes a request refused for want of space (see `short_of_space`).
    fn refused_for_space(&self) {
        *self.inner.last_no_space.lock().expect("no space lock") = Some(std::time::Instant::now());
    }

    /// Waits (up to `RELEASE_WAIT`) until no handle of this client holds `ino` open: the kernel
    /// sends a file's last release after close(2) has returned, so an unlink right after the
    /// close can arrive first. False when it is still open (kept, as any open file is).
    async fn released_soon(&self, ino: InodeId) -> bool {
        let until = std::time::Instant::now() + RELEASE_WAIT;
        loop {
            if !self.inner.inodes.lock().expect("inodes lock").contains_key(&ino) {
                return true;
            }
            if std::time::Instant::now() >= until {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// A write refused for want of space: the files this client removed a moment ago and
    /// keeps for `REMOVED_GRACE` (none of them open here) give their space back now, so that
    /// what an unlink freed counts at once for this client's writes. True when any did.
    async fn reclaim_removed_now(&self) -> bool {
        let gone: Vec<Attr> = {
            let open = self.inner.inodes.lock().expect("inodes lock");
            let mut removed = self.inner.removed.lock().expect("removed lock");
            let ids: Vec<InodeId> = removed.keys().filter(|i| !open.contains_key(i)).copied().collect();
            ids.iter().filter_map(|i| removed.remove(i)).collect()
        };
        for attr in &gone {
            self.remove_data(attr).await;
        }
        !gone.is_empty()
    }

    /// Removes the chunks of a file that is gone.
    async fn remove_data(&self, attr: &Attr) {
        let Some(layout) = &attr.layout else { return };
        // A file whose published size is 0 has no data worth a round trip to every target
        // (bytes of a writer that died before publishing its size stay until the wipe).
        if attr.size > 0 {
            self.remove_chunks(layout, attr.ino, Some(attr.size)).await;
        }
    }

    /// A write or create refused for want of space, first at `first`: frees this client's
    /// just-removed files' space now, and says whether to ask again (until `SPACE_WAIT` has
    /// passed since the first refusal).
    pub(crate) async fn space_may_come(&self, first: &mut Option<std::time::Instant>) -> bool {
        self.refused_for_space();
        let freed = self.reclaim_removed_now().await;
        let since = *first.get_or_insert_with(std::time::Instant::now);
        if !freed {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        since.elapsed() < SPACE_WAIT
    }

    pub async fn create(
        &self,
        ctx: &Ctx,
        parent: InodeId,
        name: &[u8],
        mode: u32,
        exclusive: bool,
        layout: Option<DirLayout>,
    ) -> Result<CreateReply> {
        if layout.is_none() {
            if let Some(r) = self.create_delegated(ctx, parent, name, mode).await {
                return Ok(r);
            }
        }
        let t = self.inner.cache.ticket();
        let req =
            Create { parent, name: name.to_vec(), mode, exclusive, layout, register: false, node: Some(self.node()) };
        self.inner.cache.forget_entry(parent, name);
        let r = self.entry_call(ctx, parent, name, &req).await?;
        self.made_entry(ctx, parent, name, Some(&r.attr), t);
        self.cache_parent(r.parent.as_ref(), t);
        Ok(r)
    }

    /// A create answered here, under a delegation on `parent` (see `delegation`): when this
    /// client caches, the name is known not to exist, the directory's attributes are cached
    /// and let the caller create, and a reserved id is at hand (asked for when none is). The
    /// new file is built as metad builds it, logged, and cached; metad applies it with the
    /// next batch. None: the create goes to metad as usual.
    async fn create_delegated(&self, ctx: &Ctx, parent: InodeId, name: &[u8], mode: u32) -> Option<CreateReply> {
        if !self.caching() || !self.inner.cfg.create_delegations || odfs_proto::meta::check_name(name).is_err() {
            return None;
        }
        let absent = || matches!(self.inner.cache.lookup(parent, name, (ctx.uid, ctx.gid)), Some(Cached::Absent));
        let dir = self.inner.cache.attr(parent)?;
        if !absent() || dir.sealed || dir.dir_stripes.len() > 1 || !may_create_in(ctx, &dir) {
            return None;
        }
        let t = self.inner.cache.ticket();
        let caller = self.header(ctx);
        let now = odfs_proto::Timespec::now();
        // Logged as it is taken: a request that finds the name once cached waits for the log.
        let entry = |ino, layout: &Layout| Deferred::Create {
            caller: caller.clone(),
            parent,
            name: name.to_vec(),
            mode,
            ino,
            layout: layout.clone(),
            now,
        };
        let (ino, layout) = match self.inner.delegations.create(parent, entry) {
            Take::Got(ino, layout) => (ino, layout),
            Take::No => return None,
            Take::Ask(ticket) => {
                self.ask_delegation(ctx, parent, ticket).await;
                self.inner.delegations.create_granted(parent, entry)?
            }
        };
        let (gid, file_mode) = odfs_proto::meta::new_owner(&caller, dir.mode, dir.gid, mode & 0o7777, false);
        let attr = Attr {
            ino,
            kind: FileKind::File,
            mode: file_mode,
            nlink: 1,
            uid: ctx.uid,
            gid,
            size: 0,
            atime: now,
            mtime: now,
            ctime: now,
            layout: Some(layout),
            dir_stripes: Vec::new(),
            rdev: 0,
            sealed: false,
        };
        let dir = Attr { mtime: now, ctime: now, ..dir };
        self.made_entry(ctx, parent, name, Some(&attr), t);
        self.cache_parent(Some(&dir), t);
        Some(CreateReply { attr, created: true, parent: Some(dir) })
    }

    /// An unlink answered here, under the delegation on `parent` (see `delegation`): the name
    /// is cached and names a file made here under the delegation, still held, with no other
    /// name, open nowhere here, which the caller may remove. Logged and dropped from the
    /// caches; metad applies it with the next batch and says whether its chunks go. False: the
    /// unlink goes to metad as usual.
    fn unlink_delegated(&self, ctx: &Ctx, parent: InodeId, name: &[u8]) -> bool {
        if !self.caching() || !self.inner.cfg.create_delegations {
            return false;
        }
        let Some(Cached::Found(file)) = self.inner.cache.lookup(parent, name, (ctx.uid, ctx.gid)) else {
            return false;
        };
        let Some(dir) = self.inner.cache.attr(parent) else { return false };
        if file.kind != FileKind::File
            || file.nlink != 1
            || file.sealed
            || dir.sealed
            || !may_create_in(ctx, &dir)
            || !odfs_proto::meta::sticky_allows(ctx.uid, dir.mode, dir.uid, file.uid)
        {
            return false;
        }
        // Open here: it stays an orphan at metad until its last close, as any.
        if self.inner.inodes.lock().expect("inodes lock").contains_key(&file.ino) {
            return false;
        }
        let t = self.inner.cache.ticket();
        let now = odfs_proto::Timespec::now();
        let entry = || Deferred::Unlink {
            caller: self.header(ctx),
            parent,
            name: name.to_vec(),
            ino: file.ino,
            ctime: file.ctime,
            now,
        };
        if !self.inner.delegations.log_unlink(parent, file.ino, entry) {
            return false;
        }
        self.made_entry(ctx, parent, name, None, t);
        self.invalidate(file.ino);
        self.cache_parent(Some(&Attr { mtime: now, ctime: now, ..dir }), t);
        true
    }

    /// Asks metad for a create delegation on `dir`; records the answer (a refusal too).
    async fn ask_delegation(&self, ctx: &Ctx, dir: InodeId, ticket: u64) {
        let req = DelegateCreates { dir, count: crate::delegation::BATCH_IDS, node: Some(self.node()) };
        let t = self.inner.cache.ticket();
        match self.meta(ctx, dir.shard(), &req).await {
            Ok(d) => {
                self.cache_parent(Some(&d.dir), t);
                self.inner.delegations.granted(dir, ticket, Some(d.inos));
            }
            Err(e) => {
                debug!(%dir, error = %e, "no create delegation");
                self.inner.delegations.granted(dir, ticket, None);
            }
        }
    }

    /// Publishes the size and mtime written to `ino` through this client (at close): logged
    /// when the file was made here under a delegation still held, sent to metad otherwise.
    pub(crate) async fn publish_size(
        &self,
        ctx: &Ctx,
        ino: InodeId,
        size: u64,
        mtime: odfs_proto::Timespec,
    ) -> Result<()> {
        let t = self.ticket();
        if let Some(a) = self.inner.cache.attr(ino) {
            let size_entry = || Deferred::Size { request_id: self.next_request_id(), ino, size, mtime };
            if self.inner.delegations.log_size(ino, size_entry) {
                self.changed_attr(&Attr { size: a.size.max(size), mtime, ctime: mtime, ..a }, t);
                return Ok(());
            }
        }
        self.invalidate(ino);
        // An unlinked file open here is an orphan at metad: its size is published as any.
        let a = self.meta(ctx, ino.shard(), &ExtendSize { ino, size, mtime }).await?;
        self.changed_attr(&a, t);
        Ok(())
    }

    /// Drops a refused create or unlink from this client's caches and, through the recall
    /// hook, the kernel's.
    fn forget_refused(&self, parent: InodeId, name: &[u8], ino: InodeId) {
        self.inner.cache.forget_entry(parent, name);
        // Its names are no longer all known here: a refused unlink's name exists.
        self.inner.cache.incomplete(parent);
        self.invalidate(ino);
        if let Some(hook) = self.inner.recall_hook.get().cloned() {
            let r = Recall { inos: vec![ino, parent], names: vec![(parent, name.to_vec())], ..Recall::default() };
            self.inner.runtime.spawn_blocking(move || hook(&r));
        }
    }

    /// Waits until metad has applied every change this client answered itself (an fsync of a
    /// directory, an unmount).
    pub async fn sync_deferred(&self) {
        self.inner.delegations.settle().await;
    }

    /// Sends one batch of deferred changes, per shard; false when it could not be sent (it
    /// went back to the log). Creates metad refused (a name taken by another client while
    /// this one was cut off) are reported and dropped from the caches.
    async fn send_batch(&self, batch: Vec<(u64, Deferred)>) -> bool {
        let _removal = self.inner.removals.begin();
        let Some(&(last, _)) = batch.last() else { return true };
        let mut by_shard: std::collections::BTreeMap<u16, Vec<Deferred>> = std::collections::BTreeMap::new();
        for (_, e) in &batch {
            by_shard.entry(e.shard()).or_default().push(e.clone());
        }
        let root = Ctx::root();
        let calls = by_shard.into_iter().map(|(shard, entries)| {
            let h = self.header(&root);
            async move {
                let req = CreateBatch { entries };
                let r = self.meta_now(&h, shard, &req).await;
                (req.entries, r)
            }
        });
        let results = futures::future::join_all(calls).await;
        // Sent again (entries applied already are answered from metad's dedup table) when a
        // shard could not be reached or failed for a reason that may pass (a full disk, a
        // store refusing changes until its restart).
        let transient = |e: &odfs_proto::RemoteError| {
            matches!(e.code, ErrorCode::Io | ErrorCode::NoSpace | ErrorCode::Busy | ErrorCode::Unavailable)
        };
        let again = results.iter().find_map(|(_, r)| match r {
            Err(e) => Some(e.to_string()),
            Ok(b) => b.failed.iter().find(|(_, e)| transient(e)).map(|(_, e)| e.to_string()),
        });
        if let Some(e) = again {
            warn!(error = %e, "cannot apply deferred changes at metad; trying again");
            self.inner.delegations.unsent(batch);
            return false;
        }
        let mut removed = Vec::new();
        for (entries, r) in results {
            let Ok(r) = r else { continue };
            removed.extend(r.removed);
            for (i, err) in r.failed {
                let (parent, name, ino, what) = match entries.get(i as usize) {
                    Some(Deferred::Create { parent, name, ino, .. }) => (parent, name, ino, "create: the file is gone"),
                    Some(Deferred::Unlink { parent, name, ino, .. }) => (parent, name, ino, "unlink: the file is kept"),
                    _ => continue,
                };
                warn!(%parent, name = %String::from_utf8_lossy(name), error = %err, change = what,
                    "metad refused a change this node had answered");
                self.forget_refused(*parent, name, *ino);
            }
        }
        // The files the batch's unlinks removed: their chunks go now, as after any unlink
        // (known as removed before a request waiting for the batch can ask about them).
        for attr in removed {
            self.reclaim(Some(attr)).await;
        }
        self.inner.delegations.applied(last);
        true
    }

    pub async fn mkdir(&self, ctx: &Ctx, parent: InodeId, name: &[u8], mode: u32) -> Result<Attr> {
        let t = self.inner.cache.ticket();
        self.inner.cache.forget_entry(parent, name);
        let a = self.entry_call(ctx, parent, name, &Mkdir { parent, name: name.to_vec(), mode }).await?;
        self.made_entry(ctx, parent, name, Some(&a), t);
        self.note_stripes(&a);
        if a.dir_stripes.len() <= 1 {
            self.inner.cache.made_dir(a.ino, self.ticket_after(t));
        }
        Ok(a)
    }

    pub async fn unlink(&self, ctx: &Ctx, parent: InodeId, name: &[u8]) -> Result<()> {
        if self.unlink_delegated(ctx, parent, name) {
            return Ok(());
        }
        self.register_local_opens().await;
        self.remove_name(ctx, parent, name, &Unlink { parent, name: name.to_vec() }).await
    }

    /// Removes `name` of `parent` only if it is still file `attr.ino`, unchanged (size, mtime)
    /// and open nowhere (metad's `UnlinkIdle`); `InUse` otherwise. A drain's delete after upload.
    pub async fn unlink_idle(&self, ctx: &Ctx, parent: InodeId, name: &[u8], attr: &Attr) -> Result<()> {
        let req = UnlinkIdle { parent, name: name.to_vec(), ino: attr.ino, size: attr.size, mtime: attr.mtime };
        self.remove_name(ctx, parent, name, &req).await
    }

    /// Sends a request that removes a file's name (`Unlink`, `UnlinkIdle`): the caches forget
    /// the name before and after, and the chunks of a file that went are removed.
    async fn remove_name<R: Rpc<Reply = UnlinkReply>>(
        &self,
        ctx: &Ctx,
        parent: InodeId,
        name: &[u8],
        req: &R,
    ) -> Result<()> {
        let _removal = self.inner.removals.begin();
        self.inner.cache.forget_entry(parent, name);
        let t = self.ticket();
        let r = self.entry_call(ctx, parent, name, req).await;
        self.inner.cache.forget_entry(parent, name);
        self.invalidate(parent);
        let r = r?;
        self.cache_parent(r.parent.as_ref(), t);
        self.reclaim(r.removed).await;
        Ok(())
    }

    pub async fn rmdir(&self, ctx: &Ctx, parent: InodeId, name: &[u8]) -> Result<()> {
        self.inner.cache.forget_entry(parent, name);
        let r = self.entry_call(ctx, parent, name, &Rmdir { parent, name: name.to_vec() }).await;
        self.inner.cache.forget_entry(parent, name);
        self.invalidate(parent);
        r
    }

    pub async fn rename(
        &self,
        ctx: &Ctx,
        parent: InodeId,
        name: &[u8],
        new_parent: InodeId,
        new_name: &[u8],
        flags: u32,
    ) -> Result<()> {
        self.register_local_opens().await;
        let _removal = self.inner.removals.begin();
        self.inner.cache.forget_entry(parent, name);
        self.inner.cache.forget_entry(new_parent, new_name);
        let req = Rename { parent, name: name.to_vec(), new_parent, new_name: new_name.to_vec(), flags };
        // Sent to the shard of the name that goes; it coordinates the other shards, if any.
        let r = self.entry_call(ctx, parent, name, &req).await;
        self.inner.cache.forget_entry(parent, name);
        self.inner.cache.forget_entry(new_parent, new_name);
        self.inner.cache.incomplete(new_parent);
        if flags & RENAME_EXCHANGE != 0 {
            self.inner.cache.incomplete(parent);
        }
        self.invalidate(parent);
        self.invalidate(new_parent);
        self.reclaim(r?.removed).await;
        Ok(())
    }

    /// Makes a FIFO, a socket's name or a device node.
    pub async fn mknod(
        &self,
        ctx: &Ctx,
        parent: InodeId,
        name: &[u8],
        kind: FileKind,
        mode: u32,
        rdev: u32,
    ) -> Result<Attr> {
        let t = self.inner.cache.ticket();
        let req = Mknod { parent, name: name.to_vec(), kind, mode, rdev };
        self.inner.cache.forget_entry(parent, name);
        let a = self.entry_call(ctx, parent, name, &req).await?;
        self.made_entry(ctx, parent, name, Some(&a), t);
        Ok(a)
    }

    pub async fn symlink(&self, ctx: &Ctx, parent: InodeId, name: &[u8], target: &[u8]) -> Result<Attr> {
        let t = self.inner.cache.ticket();
        let req = Symlink { parent, name: name.to_vec(), target: target.to_vec() };
        self.inner.cache.forget_entry(parent, name);
        let a = self.entry_call(ctx, parent, name, &req).await?;
        self.made_entry(ctx, parent, name, Some(&a), t);
        Ok(a)
    }

    pub async fn readlink(&self, ctx: &Ctx, ino: InodeId) -> Result<Vec<u8>> {
        self.meta(ctx, Self::shard_of(ino), &Readlink { ino }).await
    }

    pub async fn link(&self, ctx: &Ctx, ino: InodeId, new_parent: InodeId, new_name: &[u8]) -> Result<Attr> {
        let t = self.inner.cache.ticket();
        // Sent to the shard of the new name; it coordinates the file's shard, if another.
        let req = Link { ino, new_parent, new_name: new_name.to_vec() };
        self.inner.cache.forget_entry(new_parent, new_name);
        self.invalidate(ino);
        let a = self.entry_call(ctx, new_parent, new_name, &req).await?;
        self.invalidate(ino);
        self.made_entry(ctx, new_parent, new_name, Some(&a), t);
        Ok(self.merge_local(a))
    }

    pub async fn readdir(
        &self,
        ctx: &Ctx,
        ino: InodeId,
        cookie: u64,
        max_entries: u32,
        plus: bool,
    ) -> Result<ReadDirReply> {
        let t = self.inner.cache.ticket();
        let mut r = self.readdir_parts(ctx, ino, cookie, max_entries, plus).await?;
        for e in r.entries.iter_mut() {
            if let Some(a) = e.attr.take() {
                self.cache_entry(ctx, ino, &e.name, Some(&a), t);
                self.note_stripes(&a);
                e.attr = Some(self.merge_local(a));
            }
        }
        Ok(r)
    }

    /// A listing from `cookie`. A striped directory is listed part by part, shard after shard;
    /// its cookies carry the part's index in their top 16 bits, so one listing (and the
    /// kernel's readdir offsets) runs across every part, each entry exactly once.
    async fn readdir_parts(&self, ctx: &Ctx, ino: InodeId, cookie: u64, max: u32, plus: bool) -> Result<ReadDirReply> {
        const PART: u32 = 48;
        let stripes = self.dir_stripes(ctx, ino).await?;
        if stripes.len() < 2 {
            return self.meta(ctx, Self::shard_of(ino), &ReadDir { ino, cookie, max_entries: max, plus }).await;
        }
        let mut idx = (cookie >> PART) as usize;
        let mut c = cookie & ((1 << PART) - 1);
        loop {
            let Some(&shard) = stripes.get(idx) else {
                return Ok(ReadDirReply { entries: Vec::new(), eof: true });
            };
            let mut r = self.meta(ctx, shard, &ReadDir { ino, cookie: c, max_entries: max, plus }).await?;
            let last_part = idx + 1 == stripes.len();
            for e in r.entries.iter_mut() {
                e.cookie |= (idx as u64) << PART;
            }
            if r.eof && !last_part {
                // The next listing starts at the next part.
                if let Some(e) = r.entries.last_mut() {
                    e.cookie = ((idx + 1) as u64) << PART;
                }
                r.eof = false;
            }
            if !r.entries.is_empty() || last_part {
                return Ok(r);
            }
            idx += 1;
            c = 0;
        }
    }

    /// Every entry of a directory, the parts of a striped directory listed at once (one
    /// listing per shard, in parallel), in no particular order. For walks (`odfs find`).
    pub async fn list_dir(&self, ctx: &Ctx, ino: InodeId, plus: bool) -> Result<Vec<DirEntry>> {
        let stripes = if self.sharded() { self.getattr(ctx, ino).await?.dir_stripes } else { Vec::new() };
        if stripes.len() < 2 {
            return self.readdir_all(ctx, ino, plus).await;
        }
        let parts = futures::future::join_all(stripes.iter().map(|&shard| async move {
            let mut out = Vec::new();
            let mut cookie = 0;
            loop {
                let r = self.meta(ctx, shard, &ReadDir { ino, cookie, max_entries: 4096, plus }).await?;
                if let Some(last) = r.entries.last() {
                    cookie = last.cookie;
                }
                out.extend(r.entries);
                if r.eof {
                    return Ok::<_, ClientError>(out);
                }
            }
        }))
        .await;
        let mut all = Vec::new();
        for p in parts {
            all.extend(p?);
        }
        Ok(all)
    }

    /// Spreads an empty directory's entries over `count` metadata shards (-1 = every shard).
    pub async fn stripe_dir(&self, ctx: &Ctx, ino: InodeId, count: i32) -> Result<Attr> {
        let t = self.inner.cache.ticket();
        let a = self.meta(ctx, Self::shard_of(ino), &StripeDir { ino, count }).await;
        self.invalidate(ino);
        let a = a?;
        self.changed_attr(&a, t);
        Ok(a)
    }

    /// Entries of each part of a directory: (shard, entries), in stripe order.
    pub async fn dir_parts(&self, ctx: &Ctx, ino: InodeId) -> Result<Vec<(u16, u64)>> {
        let a = self.getattr(ctx, ino).await?;
        let shards = if a.dir_stripes.len() > 1 { a.dir_stripes } else { vec![ino.shard()] };
        let mut out = Vec::with_capacity(shards.len());
        for s in shards {
            out.push((s, self.meta(ctx, s, &CountEntries { ino }).await?));
        }
        Ok(out)
    }

    /// Every entry of a directory (following cookies to the end).
    pub async fn readdir_all(&self, ctx: &Ctx, ino: InodeId, plus: bool) -> Result<Vec<DirEntry>> {
        let mut out = Vec::new();
        let mut cookie = 0;
        loop {
            let r = self.readdir(ctx, ino, cookie, 4096, plus).await?;
            if let Some(last) = r.entries.last() {
                cookie = last.cookie;
            }
            out.extend(r.entries);
            if r.eof {
                return Ok(out);
            }
        }
    }

    pub async fn setxattr(&self, ctx: &Ctx, ino: InodeId, name: &[u8], value: &[u8], flags: u32) -> Result<()> {
        if name.starts_with(crate::vxattr::PREFIX) {
            return self.set_virtual(ctx, ino, name, value).await;
        }
        let req = SetXattr { ino, name: name.to_vec(), value: value.to_vec(), flags };
        let r = self.meta(ctx, Self::shard_of(ino), &req).await;
        self.invalidate(ino);
        r
    }

    pub async fn getxattr(&self, ctx: &Ctx, ino: InodeId, name: &[u8]) -> Result<Vec<u8>> {
        if name.starts_with(crate::vxattr::PREFIX) {
            return self.get_virtual(ctx, ino, name).await;
        }
        let who = (ctx.uid, ctx.gid);
        if let Some(v) = self.inner.cache.xattr(ino, name, who) {
            return v.ok_or_else(|| ClientError::new(ErrorCode::NoData, "no such extended attribute"));
        }
        let t = self.ticket();
        let r = self.meta(ctx, Self::shard_of(ino), &GetXattr { ino, name: name.to_vec() }).await;
        match &r {
            Ok(v) => self.inner.cache.put_xattr(ino, name, Some(v), who, t),
            Err(e) if e.code() == ErrorCode::NoData => self.inner.cache.put_xattr(ino, name, None, who, t),
            Err(_) => {}
        }
        r
    }

    pub async fn listxattr(&self, ctx: &Ctx, ino: InodeId) -> Result<Vec<Vec<u8>>> {
        self.meta(ctx, Self::shard_of(ino), &ListXattr { ino }).await
    }

    pub async fn removexattr(&self, ctx: &Ctx, ino: InodeId, name: &[u8]) -> Result<()> {
        if name.starts_with(crate::vxattr::PREFIX) {
            return Err(ClientError::new(
                odfs_proto::ErrorCode::Perm,
                "odfs.* attributes cannot be removed (set another layout instead)",
            ));
        }
        let r = self.meta(ctx, Self::shard_of(ino), &RemoveXattr { ino, name: name.to_vec() }).await;
        self.invalidate(ino);
        r
    }

    /// Space from shard 0 (every shard sees the same targets); inodes summed over the shards.
    pub async fn statfs(&self, ctx: &Ctx) -> Result<StatFsReply> {
        let shards = self.inner.cluster.view().meta_shards().max(1);
        let replies = futures::future::join_all((0..shards).map(|s| self.meta(ctx, s, &StatFs {}))).await;
        let mut replies = replies.into_iter();
        let mut st: StatFsReply = replies.next().expect("one shard at least")?;
        for o in replies {
            let o = o?;
            st.used_inodes += o.used_inodes;
            st.total_inodes = st.total_inodes.max(o.total_inodes).max(st.used_inodes);
        }
        st.free_inodes = st.total_inodes - st.used_inodes;
        Ok(st)
    }

    pub async fn set_dir_layout(&self, ctx: &Ctx, ino: InodeId, layout: DirLayout) -> Result<()> {
        self.meta(ctx, Self::shard_of(ino), &SetDirLayout { ino, layout }).await
    }

    pub async fn get_dir_layout(&self, ctx: &Ctx, ino: InodeId) -> Result<DirLayout> {
        self.meta(ctx, Self::shard_of(ino), &GetDirLayout { ino }).await
    }

    /// Creates, fills, empties or destroys a storage pool (at mgmtd; metad follows within a
    /// second, and looks again at once when a layout names a pool it does not know yet).
    pub async fn change_pool(&self, ctx: &Ctx, name: &str, change: odfs_proto::mgmt::PoolChange) -> Result<()> {
        let req = odfs_proto::mgmt::ChangePool { name: name.to_string(), change };
        let r = self.inner.pool.call(self.inner.cfg.mgmtd, Transport::Quic, &self.header(ctx), &req).await;
        let _ = self.inner.cluster.refresh().await;
        r.map_err(Into::into)
    }

    /// Opens an existing file. `truncate` empties it (O_TRUNC).
    pub async fn open(&self, ctx: &Ctx, ino: InodeId, read: bool, write: bool, truncate: bool) -> Result<FileHandle> {
        let t = self.inner.cache.ticket();
        // Always asked of metad: this is the "open" of close-to-open. The open is registered,
        // so the file outlives its last name while open.
        let h = self.header(ctx);
        let registered = h.request_id;
        let attr = match self.meta_as(&h, Self::shard_of(ino), &Open { ino, read, write, register: true }).await {
            // Removed by this client a moment ago (see `REMOVED_GRACE`): the old file, for reading.
            // The removal's reply may still be on its way (see `removing`): after it.
            Err(e) if e.code() == ErrorCode::NotFound && !write && !truncate => {
                self.inner.removals.settled(self.inner.removals.mark()).await;
                match self.removed_attr(ino) {
                    Some(a) => return self.handle_for(ctx, a, read, false, 0),
                    None => return Err(e),
                }
            }
            r => r?,
        };
        self.cache_attr(&attr, t);
        let handle = self.handle_for(ctx, attr, read, write, registered)?;
        if truncate && write {
            self.truncate(ctx, ino, 0, Truncate::Checked).await?;
        }
        Ok(handle)
    }

    /// The attributes of a file this client's own change removed a moment ago (see
    /// `REMOVED_GRACE`), while its chunks are kept.
    pub fn removed_attr(&self, ino: InodeId) -> Option<Attr> {
        self.inner.removed.lock().expect("removed lock").get(&ino).map(|a| Attr { nlink: 0, ..a.clone() })
    }

    /// Opens a file for reading from the cache alone, when a lease covers its attributes and
    /// they let the caller read: no request to metad (the open is registered only if its file
    /// is recalled or this client removes a name). `None`: ask metad (`open`).
    pub fn open_cached(&self, ctx: &Ctx, ino: InodeId) -> Option<Result<(FileHandle, Attr)>> {
        let attr = self.inner.cache.attr(ino)?;
        if attr.kind != FileKind::File || attr.layout.is_none() || !may_read(ctx, &attr) {
            return None;
        }
        Some(self.handle_for(ctx, attr.clone(), true, false, 0).map(|h| (h, self.merge_local(attr))))
    }

    /// Creates (or, without `exclusive`, opens) a file and returns a handle for writing.
    pub async fn create_open(
        &self,
        ctx: &Ctx,
        parent: InodeId,
        name: &[u8],
        mode: u32,
        exclusive: bool,
        layout: Option<DirLayout>,
    ) -> Result<(CreateReply, FileHandle)> {
        if layout.is_none() {
            if let Some(r) = self.create_delegated(ctx, parent, name, mode).await {
                let handle = self.handle_for(ctx, r.attr.clone(), true, true, 0)?;
                return Ok((r, handle));
            }
        }
        let t = self.inner.cache.ticket();
        // A caching client does not register: the new file is leased to it, and it registers
        // its opens before it removes a name (see `open_cached`). Others hold no lease.
        let register = !self.caching();
        let req = Create { parent, name: name.to_vec(), mode, exclusive, layout, register, node: Some(self.node()) };
        self.inner.cache.forget_entry(parent, name);
        let mut refused = None;
        let (r, registered) = loop {
            // Each try a new request: metad refuses a full pool from the space last reported.
            let h = self.header(ctx);
            let registered = if register { h.request_id } else { 0 };
            match self.entry_call_as(ctx, &h, parent, name, &req).await {
                Err(e) if e.code() == ErrorCode::NoSpace && self.space_may_come(&mut refused).await => {}
                r => break (r?, registered),
            }
        };
        self.made_entry(ctx, parent, name, Some(&r.attr), t);
        self.cache_parent(r.parent.as_ref(), t);
        let handle = self.handle_for(ctx, r.attr.clone(), true, true, registered)?;
        Ok((r, handle))
    }

    /// A handle on a file opened by request `registered` (its open is registered with metad).
    pub(crate) fn handle_for(
        &self,
        ctx: &Ctx,
        attr: Attr,
        read: bool,
        write: bool,
        registered: u64,
    ) -> Result<FileHandle> {
        let layout = match (attr.kind, attr.layout.clone()) {
            (FileKind::File, Some(l)) => l,
            (FileKind::Dir, _) => return Err(ErrorCode::IsDir.into()),
            _ => return Err(ClientError::new(ErrorCode::Invalid, "not a regular file")),
        };
        let data = {
            let mut map = self.inner.inodes.lock().expect("inodes lock");
            map.entry(attr.ino).or_insert_with(|| Arc::new(InodeData::new(attr.ino, layout))).clone()
        };
        data.opened(attr.size, registered);
        Ok(FileHandle::new(self.clone(), data, ctx.clone(), read, write))
    }

    /// A close that needs no request: the inode's opens here were never registered with metad
    /// (checked under the inodes lock, which registrations take too). True when done.
    pub(crate) fn release_without_request(&self, data: &Arc<InodeData>) -> bool {
        let mut map = self.inner.inodes.lock().expect("inodes lock");
        if data.registered() != 0 {
            return false;
        }
        if data.closed() {
            if let Some(cur) = map.get(&data.ino) {
                if Arc::ptr_eq(cur, data) {
                    map.remove(&data.ino);
                }
            }
        }
        true
    }

    /// Called by a handle's close: forget the inode's data state when its last handle goes.
    pub(crate) async fn release(&self, data: &Arc<InodeData>) {
        let last = {
            let mut map = self.inner.inodes.lock().expect("inodes lock");
            let last = data.closed();
            if last {
                if let Some(cur) = map.get(&data.ino) {
                    if Arc::ptr_eq(cur, data) {
                        map.remove(&data.ino);
                    }
                }
            }
            last
        };
        if !last {
            return;
        }
        // The last handle here: the file is no longer held open by this client. An orphan
        // (its last name went while open) is then gone, and its chunks with it: every target,
        // as writes of this process may lie beyond any published size.
        // A registration of an open answered from the cache may be on its way: after it.
        drop(data.registering.lock().await);
        if data.registered() == 0 {
            // Opened from the cache and never registered: metad has nothing to release.
            return;
        }
        let req = Release { files: vec![(data.ino, data.registered())] };
        match self.meta(&Ctx::root(), Self::shard_of(data.ino), &req).await {
            Ok(r) => {
                for a in r.removed {
                    self.remove_chunks(&data.layout, a.ino, None).await;
                }
            }
            Err(e) => {
                warn!(ino = %data.ino, error = %e, "release failed: metad frees the file when this client's session ends")
            }
        }
    }

    /// Requests each metadata shard has served since it started, by kind: (shard, kind, count).
    pub async fn meta_request_counts(&self) -> Result<Vec<(u16, String, u64)>> {
        let mut out = Vec::new();
        for shard in 0..self.inner.cluster.view().meta_shards().max(1) {
            let st = self.meta(&Ctx::root(), shard, &GetStats {}).await?;
            out.extend(st.methods.into_iter().map(|m| (shard, m.name, m.count)));
        }
        Ok(out)
    }

    /// What every service of the filesystem has served (`GetStats`): mgmtd, then each online
    /// metad, stored and stage agent, with the registered clients that name the client ids
    /// counted. A service that cannot be asked is listed with the reason.
    pub async fn fs_stats(&self) -> Result<FsStats> {
        let view = self.inner.cluster.refresh().await?;
        let h = self.header(&Ctx::root());
        let pool = &self.inner.pool;
        let mgmtd = pool.call(self.inner.cfg.mgmtd, Transport::Quic, &h, &GetStats {}).await.map_err(|e| e.to_string());
        let (meta, bulk) = (self.inner.cfg.meta_transport, self.inner.cfg.bulk_transport);
        let route = |s: &odfs_proto::mgmt::ServiceInfo| match s.kind {
            ServiceKind::Meta => crate::cluster::route(s, meta),
            ServiceKind::Storage => crate::cluster::route(s, bulk),
            _ => crate::cluster::route(s, Transport::Quic),
        };
        let mut all = odfs_rpc::stats::gather(pool, &h, mgmtd, &view.services, route).await;
        if let Some(ops) = self.inner.ops.get() {
            all.services.push(ServiceStats {
                name: format!("this mount, node {} pid {}", self.inner.cfg.node, std::process::id()),
                kind: Some(ServiceKind::Client),
                node: self.inner.cfg.node,
                stats: Some(ops()),
                error: None,
            });
        }
        Ok(all)
    }

    /// Lets `fs_stats` show what the program on top counted of its own operations (a mount:
    /// the FUSE requests it answered), as one more service. Set once; later calls are ignored.
    pub fn on_stats(&self, ops: OpStats) {
        let _ = self.inner.ops.set(ops);
    }

    /// Leaves the filesystem: sends what this client deferred under its create delegations,
    /// says goodbye to every metadata shard, which ends its session there at once (no change
    /// waits for its leases any more), and closes every connection. Handles still open are not
    /// flushed. Bounded: a shard that does not answer within `GOODBYE_WAIT` ends the session
    /// itself one lease later, as for a client that died.
    pub async fn close(&self) {
        let wait = Duration::from_secs(self.inner.cfg.retry_secs.max(1));
        if tokio::time::timeout(wait, self.sync_deferred()).await.is_err() {
            warn!("metad did not take this client's deferred creates and unlinks within {} s", wait.as_secs());
        }
        let _ = self.inner.stop.send(true);
        for (shard, e) in self.end_sessions_of(self.inner.client_id).await {
            warn!(shard, "could not end this client's session: {e}; it ends one lease after its last poll");
        }
        self.inner.pool.close_all();
    }

    /// Ends client `client`'s session on every metadata shard (this client's own, or that of
    /// a dead process of this node that did not say goodbye itself). Returns the shards that
    /// did not take it within `GOODBYE_WAIT`, each with why.
    pub async fn end_sessions_of(&self, client: u64) -> Vec<(u16, String)> {
        let h = self.header(&Ctx::root());
        let shards = self.inner.cluster.view().meta_shards().max(1);
        let byes = (0..shards).map(|shard| {
            let h = h.clone();
            async move {
                let bye = EndSession { client };
                match tokio::time::timeout(GOODBYE_WAIT, self.meta_now(&h, shard, &bye)).await {
                    Ok(Ok(())) => None,
                    Ok(Err(e)) => Some((shard, e.to_string())),
                    Err(_) => Some((shard, format!("no answer within {} s", GOODBYE_WAIT.as_secs()))),
                }
            }
        });
        futures::future::join_all(byes).await.into_iter().flatten().collect()
    }

    /// Closes every connection without a goodbye (see [`Client::close`]): the shards end this
    /// client's sessions one lease after its last poll. Handles still open are not flushed.
    pub fn shutdown(&self) {
        let _ = self.inner.stop.send(true);
        self.inner.pool.close_all();
    }
}

/// The permission bits of `a` that apply to `ctx` (owner's, group's or others'); None for
/// root, whom they do not limit here.
fn bits_for(ctx: &Ctx, a: &Attr) -> Option<u32> {
    if ctx.uid == 0 {
        return None;
    }
    let bits = if ctx.uid == a.uid {
        a.mode >> 6
    } else if ctx.gid == a.gid || ctx.groups.contains(&a.gid) {
        a.mode >> 3
    } else {
        a.mode
    };
    Some(bits & 7)
}

/// Whether the mode bits let `ctx` add a name to directory `dir` (write and search).
fn may_create_in(ctx: &Ctx, dir: &Attr) -> bool {
    bits_for(ctx, dir).is_none_or(|b| b & 0o3 == 0o3)
}

/// Whether the mode bits let `ctx` read a file (root reads anything).
fn may_read(ctx: &Ctx, a: &Attr) -> bool {
    bits_for(ctx, a).is_none_or(|b| b & 0o4 != 0)
}
