//! The chunk store: one chunk file per (file inode, target), under each target's directory.
//!
//! Owns the on-disk layout of a target (`target.id`, `chunks/<low byte>/<inode>`, and `free/`
//! through `recycle`, where removed chunk files wait to be reused), opening and
//! caching chunk files, choosing the I/O backend, and wrapping OS errors with the path they concern.
//! Data transfer itself is delegated to `uring` (one ring per target) or `syscall`; metadata
//! calls (open, truncate, unlink, stat) run on tokio's blocking pool because they may wait for the
//! disk. A read or write of a chunk file that is not open yet is opened and done in one blocking
//! call: a small file is read or written once, and every hand-off between threads is a wake-up
//! (measured: 15-20% less stored CPU per cold 50 KiB read, 12% per 50 KiB file written). Knows
//! nothing of the wire: the RPC service maps requests onto these calls.
//!
//! A read first tries what needs no waiting, on the runtime worker itself: the cached descriptor
//! (or an open the dentry cache can resolve alone) and the bytes the page cache holds
//! (`RWF_NOWAIT`); only what would wait for the disk is handed to the engine. A warm read then
//! costs no hand-off at all: every hand-off is two wake-ups, which on a busy node cost more than
//! the copy itself.
//!
//! Chunk files use buffered I/O; writes past the end leave holes, which read back as zeros (or
//! short, past the end of the file).

use crate::error::StoreError;
use crate::fd_cache::{ChunkKey, FdCache};
use crate::precreate;
use crate::recycle::Recycler;
use crate::syscall::{self, blocking};
use crate::uring::{self, Ring};
use bytes::Bytes;
use odfs_proto::codec::FileSpan;
use odfs_proto::mgmt::TargetSpace;
use odfs_proto::storage::{ChunkRange, READ_MANY_BYTES, READ_MANY_ITEMS};
use odfs_proto::{InodeId, TargetId};
use serde::{Deserialize, Serialize};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use tracing::{info, warn};

/// Largest number of bytes one read or write may move. Above the wire's 4 MiB `MAX_IO` (clients
/// split larger I/O) and below its 20 MiB frame limit; it exists so that a bad request cannot
/// make the daemon allocate gigabytes.
pub const MAX_OP_BYTES: usize = 16 << 20;

/// Largest read tried on the runtime worker before the hand-off: a page-cache copy of this much
/// takes well under a millisecond, so the worker's other tasks wait no longer than that.
const READ_NOW_MAX: usize = 1 << 20;

pub use odfs_proto::layout::{CHUNKS_DIR, TARGET_ID_FILE};

/// One target to serve: a directory on local disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetConfig {
    pub id: TargetId,
    pub path: PathBuf,
}

/// Which data path to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IoBackend {
    /// io_uring where it can be set up, else plain system calls (with a warning).
    #[default]
    Auto,
    /// io_uring or fail to open.
    Uring,
    /// pread/pwrite/fdatasync on the blocking pool.
    Syscall,
}

/// Tuning of a store; `Default` holds the defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct StoreOptions {
    pub backend: IoBackend,
    /// Open chunk files kept cached (capped at half the process's descriptor limit).
    pub fd_cache: usize,
    /// Operations in flight per ring.
    pub ring_max_ops: usize,
    /// Bytes in flight per ring.
    pub ring_max_bytes: usize,
    /// Empty chunk files each target's pool is kept filled with, made in the background on idle
    /// CPU (0: none; the daemon's `precreate_chunk_files` sets it).
    pub precreate: usize,
    /// Share of the node's CPU time that must have been idle over the last half second for
    /// precreation to go on (0: whenever the store is quiet).
    pub precreate_min_idle: f64,
    /// Chunk writes of at least this many bytes, at a 4 KiB-aligned offset and length, go to
    /// the disk with `O_DIRECT`, past the page cache (0: never; docs/architecture.md, "Large
    /// chunk writes skip stored's page cache").
    pub direct_write_min: usize,
    /// Drop from the page cache what a single sequential reader has read of a chunk file, once
    /// sent (`drop_behind`; docs/architecture.md, "Stored drops what a single sequential reader
    /// has read").
    pub drop_behind: bool,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            backend: IoBackend::Auto,
            fd_cache: 4096,
            ring_max_ops: 32,
            ring_max_bytes: 8 << 20,
            precreate: 0,
            precreate_min_idle: 0.5,
            direct_write_min: crate::config::DEFAULT_DIRECT_WRITE_MIN_BYTES,
            drop_behind: true,
        }
    }
}

/// The chunk files of every target of this daemon. Cheap to clone; clones share everything.
/// Dropping the last clone waits for in-flight I/O and closes every file.
#[derive(Clone)]
pub struct ChunkStore {
    inner: Arc<Inner>,
}

struct Inner {
    // Targets drop first: their ring threads finish in-flight I/O before the cache closes files.
    targets: Vec<Target>,
    fds: FdCache,
    backend_name: &'static str,
    /// Chunk requests served (reads, writes, truncates, punches, syncs, removals): precreation
    /// runs only while it stands still.
    requests: Arc<AtomicU64>,
    /// `StoreOptions::drop_behind`.
    drop_behind: bool,
}

struct Target {
    id: TargetId,
    root: PathBuf,
    engine: Engine,
    /// Removed chunk files, reused for new ones.
    pool: Arc<Recycler>,
    /// Reads are tried without waiting first; cleared for good when the target's filesystem
    /// refuses `RWF_NOWAIT`.
    read_now: AtomicBool,
    /// Smallest chunk write sent past the page cache (0: none; also where the target's
    /// filesystem refuses `O_DIRECT`).
    direct_min: usize,
}

/// What [`ChunkStore::file_or`] found.
enum Found<T> {
    /// The cached open file: the caller does its operation through the engine.
    Cached(Arc<File>),
    /// Opened now (and cached), with the result of the first operation, done in the same
    /// blocking call.
    Opened(Arc<File>, io::Result<T>),
    Missing,
}

enum Engine {
    Uring(Ring),
    Syscall,
}

impl Target {
    /// Up to `len` bytes at `offset` of an open chunk file, through the target's engine.
    async fn read(&self, file: Arc<File>, offset: u64, len: usize) -> io::Result<Vec<u8>> {
        match &self.engine {
            Engine::Uring(ring) => ring.read(file, offset, len).await,
            Engine::Syscall => syscall::read(file, offset, len).await,
        }
    }

    fn chunk_path(&self, ino: InodeId) -> PathBuf {
        odfs_proto::layout::chunk_path(&self.root, ino)
    }

    fn err(&self, op: &'static str, ino: InodeId, e: io::Error) -> StoreError {
        StoreError::io(op, self.chunk_path(ino), e)
    }

    /// Whether a write of `len` bytes at `offset` goes past the page cache: large and aligned.
    fn writes_direct(&self, offset: u64, len: usize) -> bool {
        self.direct_min > 0
            && len >= self.direct_min
            && offset.is_multiple_of(syscall::DIRECT_ALIGN as u64)
            && len.is_multiple_of(syscall::DIRECT_ALIGN)
    }
}

impl std::fmt::Debug for ChunkStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkStore")
            .field("backend", &self.inner.backend_name)
            .field("targets", &self.targets())
            .finish()
    }
}

impl ChunkStore {
    /// Opens `targets` with default options and the given backend. See [`ChunkStore::open_with`].
    pub fn open(targets: &[TargetConfig], backend: IoBackend) -> Result<ChunkStore, StoreError> {
        Self::open_with(targets, StoreOptions { backend, ..StoreOptions::default() })
    }

    /// Opens `targets`: creates each directory (its parent must exist) and its `chunks/` tree,
    /// proves it writable, records the target id in `target.id` (refusing a directory that
    /// belongs to another target), and starts the I/O backend.
    pub fn open_with(targets: &[TargetConfig], opts: StoreOptions) -> Result<ChunkStore, StoreError> {
        for (i, t) in targets.iter().enumerate() {
            for u in &targets[..i] {
                if u.id == t.id {
                    return Err(StoreError::Config(format!("target {} is listed twice", t.id)));
                }
                if u.path == t.path {
                    return Err(StoreError::Config(format!(
                        "targets {} and {} share the directory {}",
                        u.id,
                        t.id,
                        t.path.display()
                    )));
                }
            }
        }
        let mut pools = Vec::with_capacity(targets.len());
        for t in targets {
            prepare_dir(t)?;
            let pool = Recycler::open(&t.path).map_err(|e| cfg_err(&t.path, "cannot prepare its free/ pool", e))?;
            pools.push(Arc::new(pool));
        }
        let limits = uring::Limits { max_ops: opts.ring_max_ops, max_bytes: opts.ring_max_bytes };
        let rings = choose_rings(opts.backend, || start_rings(targets, limits))?;
        let backend_name = if rings.is_some() { "io_uring" } else { "syscall" };
        let mut rings = rings.map(Vec::into_iter);
        let targets = targets
            .iter()
            .zip(pools)
            .map(|(t, pool)| Target {
                id: t.id,
                root: t.path.clone(),
                engine: match rings.as_mut().and_then(Iterator::next) {
                    Some(r) => Engine::Uring(r),
                    None => Engine::Syscall,
                },
                direct_min: if opts.direct_write_min > 0 && syscall::takes_direct(&t.path) {
                    opts.direct_write_min
                } else {
                    0
                },
                pool,
                read_now: AtomicBool::new(true),
            })
            .collect::<Vec<Target>>();
        let requests = Arc::new(AtomicU64::new(0));
        if opts.precreate > 0 {
            let pools = targets.iter().map(|t: &Target| (t.id, Arc::downgrade(&t.pool))).collect();
            precreate::start(pools, opts.precreate, opts.precreate_min_idle, requests.clone());
        }
        let fd_cap = opts.fd_cache.min(nofile_limit() / 2).max(1);
        info!(backend = backend_name, fd_cache = fd_cap, "chunk store opened");
        Ok(ChunkStore {
            inner: Arc::new(Inner {
                targets,
                fds: FdCache::new(fd_cap),
                backend_name,
                requests,
                drop_behind: opts.drop_behind,
            }),
        })
    }

    /// "io_uring" or "syscall".
    pub fn backend_name(&self) -> &'static str {
        self.inner.backend_name
    }

    /// Ids of the targets served, in configuration order.
    pub fn targets(&self) -> Vec<TargetId> {
        self.inner.targets.iter().map(|t| t.id).collect()
    }

    /// Where the chunk file of `ino` on `target` lives (whether or not it exists):
    /// `<target>/chunks/<low byte of ino, 2 hex digits>/<ino, 16 hex digits>`.
    pub fn chunk_path(&self, target: TargetId, ino: InodeId) -> Option<PathBuf> {
        self.target(target).ok().map(|t| t.chunk_path(ino))
    }

    /// The target of a chunk request, counting the request (see `Inner::requests`).
    fn target_busy(&self, id: TargetId) -> Result<&Target, StoreError> {
        self.inner.requests.fetch_add(1, Ordering::Relaxed);
        self.target(id)
    }

    fn target(&self, id: TargetId) -> Result<&Target, StoreError> {
        self.inner.targets.iter().find(|t| t.id == id).ok_or(StoreError::UnknownTarget(id))
    }

    /// Writes `data` at `offset` of the chunk file, creating it (sparse below `offset`) when
    /// missing; with `sync` the data is fdatasynced before returning. Returns the bytes written,
    /// always all of them. On a full disk returns `NoSpace` and leaves bytes outside this write's
    /// range untouched (a prefix of the range may have been written).
    pub async fn write(
        &self,
        target: TargetId,
        ino: InodeId,
        offset: u64,
        data: impl Into<Bytes>,
        sync: bool,
    ) -> Result<u32, StoreError> {
        let data: Bytes = data.into();
        let t = self.target_busy(target)?;
        check_range("write", offset, data.len())?;
        let len = data.len();
        // A chunk file not open yet (every small file's first write) is opened and written in
        // one blocking call: one hand-off between threads instead of two.
        let first = {
            let data = data.clone();
            move |f: &File| syscall::write_at(f, offset, &data, sync)
        };
        let file = match self.file_or(t, ino, true, first).await? {
            Found::Cached(file) => file,
            Found::Opened(_, r) => return r.map(|n| n as u32).map_err(|e| t.err("write", ino, e)),
            Found::Missing => return Err(t.err("open", ino, io::ErrorKind::NotFound.into())),
        };
        if len == 0 {
            if sync {
                self.fsync_file(t, ino, file).await?;
            }
            return Ok(0);
        }
        let r = if t.writes_direct(offset, len) {
            syscall::write_direct(t.chunk_path(ino), offset, data, sync).await
        } else {
            match &t.engine {
                Engine::Uring(ring) => ring.write(file, offset, data, sync).await,
                Engine::Syscall => syscall::write(file, offset, data, sync).await,
            }
        };
        let n = r.map_err(|e| t.err("write", ino, e))?;
        // `check_range` bounded the length by MAX_OP_BYTES.
        Ok(n as u32)
    }

    /// Reads up to `len` bytes at `offset`. Short where the chunk file ends; empty when the chunk
    /// file does not exist (a hole in the file, not an error). Holes inside the file read as zeros.
    pub async fn read(&self, target: TargetId, ino: InodeId, offset: u64, len: u32) -> Result<Vec<u8>, StoreError> {
        let t = self.target_busy(target)?;
        let len = len as usize;
        check_range("read", offset, len)?;
        if len == 0 {
            return Ok(Vec::new());
        }
        if let Some((file, now)) = self.read_now(t, ino, offset, len) {
            if now.complete {
                return Ok(now.data);
            }
            let got = now.data.len();
            let rest = t.read(file, offset + got as u64, len - got).await.map_err(|e| t.err("read", ino, e))?;
            if got == 0 {
                return Ok(rest);
            }
            let mut data = now.data;
            data.extend_from_slice(&rest);
            return Ok(data);
        }
        // As for writes: a chunk file not open yet is opened and read in one blocking call (a
        // cold small file is read once, so its open is almost always a miss).
        let file = match self.file_or(t, ino, false, move |f: &File| syscall::read_at(f, offset, len)).await? {
            Found::Cached(file) => file,
            Found::Opened(_, r) => return r.map_err(|e| t.err("read", ino, e)),
            Found::Missing => return Ok(Vec::new()),
        };
        t.read(file, offset, len).await.map_err(|e| t.err("read", ino, e))
    }

    /// Where the bytes of a read of up to `len` bytes at `offset` are, for the transport to
    /// send from the chunk file itself (`FileSpan`: sendfile on TCP) instead of through a
    /// buffer: shorter than asked where the file ends, `None` when there are no bytes (a missing
    /// file, or past its end). Holes read as zeros, as for `read`. The disk is left to the
    /// kernel's read-ahead on the chunk file's cached descriptor: `sendfile` reads through it,
    /// so a sequential reader's requests find its window already read and grown (up to the
    /// device's `read_ahead_kb`); asking for exactly the span would read that and no further.
    pub async fn read_span(
        &self,
        target: TargetId,
        ino: InodeId,
        offset: u64,
        len: u32,
    ) -> Result<Option<FileSpan>, StoreError> {
        let t = self.target_busy(target)?;
        check_range("read", offset, len as usize)?;
        if len == 0 {
            return Ok(None);
        }
        let Some(file) = self.file(t, ino, false).await? else { return Ok(None) };
        let span = span_of(file, offset, len).map_err(|e| t.err("read", ino, e))?;
        if let Some(s) = &span {
            self.drop_behind(t, ino, s);
        }
        Ok(span)
    }

    /// Drops from the page cache what a single sequential reader of this chunk file has left
    /// behind (`drop_behind`: far enough back that it has been sent), on the blocking pool and
    /// not waited for: it is advice, and the read does not depend on it.
    fn drop_behind(&self, t: &Target, ino: InodeId, s: &FileSpan) {
        if !self.inner.drop_behind {
            return;
        }
        if let Some(due) = self.inner.fds.read_behind((t.id, ino), s.offset, s.len as u64) {
            let file = s.file.clone();
            due.spawn(move |r| syscall::dont_need(&file, r.start, r.end - r.start));
        }
    }

    /// The spans of several chunk files' ranges of one target, found in a single blocking call
    /// (a directory's small files fetched ahead of their opens: one hand-off and one reply for
    /// the batch instead of one each). Each range is as `read_span` gives it: its length is
    /// `Some(0)` (and it has no span) for a missing file or one that ends before it, `None`
    /// when it failed (the others stand). Returns every range's length, and the spans of those
    /// with bytes, in order.
    pub async fn read_many(
        &self,
        target: TargetId,
        items: Vec<ChunkRange>,
    ) -> Result<(Vec<Option<u32>>, Vec<FileSpan>), StoreError> {
        let t = self.target_busy(target)?;
        check_many(&items)?;
        let Some(first) = items.first().map(|r| r.ino) else { return Ok((Vec::new(), Vec::new())) };
        // Chunk files open already are read through their descriptors; the others are opened
        // for this read only (a prefetched file is seldom read again).
        let open: Vec<Option<Arc<File>>> = items.iter().map(|r| self.inner.fds.get((t.id, r.ino)).ok()).collect();
        let root = t.root.clone();
        let spans_of = move || {
            let mut lens = Vec::with_capacity(items.len());
            let mut spans = Vec::with_capacity(items.len());
            for (r, f) in items.iter().zip(open) {
                match range_span(&root, r, f) {
                    Ok(Some(s)) => {
                        lens.push(Some(s.len));
                        spans.push(s);
                    }
                    Ok(None) => lens.push(Some(0)),
                    Err(_) => lens.push(None),
                }
            }
            Ok((lens, spans))
        };
        blocking(spans_of).await.map_err(|e| t.err("read", first, e))
    }

    /// The part of a read that needs no waiting, done on this worker: `None` when the chunk file
    /// is neither cached nor openable from the dentry cache (or the read is large), else the open
    /// file and what the page cache held of the range.
    fn read_now(&self, t: &Target, ino: InodeId, offset: u64, len: usize) -> Option<(Arc<File>, syscall::NoWait)> {
        if len > READ_NOW_MAX || !t.read_now.load(Ordering::Relaxed) {
            return None;
        }
        let key: ChunkKey = (t.id, ino);
        let file = match self.inner.fds.get(key) {
            Ok(f) => f,
            Err(miss) => self.inner.fds.insert(key, Arc::new(syscall::open_cached(&t.chunk_path(ino))?), miss),
        };
        match syscall::read_nowait(&file, offset, len) {
            Ok(now) => Some((file, now)),
            Err(e) => {
                if e.raw_os_error() == Some(libc::EOPNOTSUPP) {
                    info!(target = t.id, "the target's filesystem cannot read without waiting; reads hand off");
                    t.read_now.store(false, Ordering::Relaxed);
                }
                // Anything else is reported by the ordinary path, which runs next.
                None
            }
        }
    }

    /// Sets the chunk file's length: shrinking drops data, growing adds a hole. A missing file is
    /// left missing for `len == 0` and created sparse otherwise.
    pub async fn truncate(&self, target: TargetId, ino: InodeId, len: u64) -> Result<(), StoreError> {
        let t = self.target_busy(target)?;
        check_range("truncate", len, 0)?;
        let Some(file) = self.file(t, ino, len > 0).await? else {
            return Ok(());
        };
        blocking(move || file.set_len(len)).await.map_err(|e| t.err("truncate", ino, e))
    }

    /// Punches a hole into the chunk file (the range reads as zeros, the size stays); a missing
    /// file, or a range past its end, has nothing to punch.
    pub async fn punch(&self, target: TargetId, ino: InodeId, offset: u64, len: u64) -> Result<(), StoreError> {
        let t = self.target_busy(target)?;
        if offset.checked_add(len).is_none_or(|end| end > i64::MAX as u64) {
            return Err(StoreError::Invalid(format!(
                "punch of {len} bytes at offset {offset} ends past the largest file offset"
            )));
        }
        let Some(file) = self.file(t, ino, false).await? else {
            return Ok(());
        };
        let punch = move || {
            use std::os::fd::AsRawFd;
            let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
            // SAFETY: the descriptor is open for the closure's whole run (the Arc holds it).
            let r = unsafe { libc::fallocate(file.as_raw_fd(), mode, offset as i64, len as i64) };
            if r == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        };
        blocking(punch).await.map_err(|e| t.err("punch", ino, e))
    }

    /// fdatasyncs the chunk file; a missing file has nothing to sync.
    pub async fn sync(&self, target: TargetId, ino: InodeId) -> Result<(), StoreError> {
        let t = self.target_busy(target)?;
        match self.file(t, ino, false).await? {
            Some(file) => self.fsync_file(t, ino, file).await,
            None => Ok(()),
        }
    }

    async fn fsync_file(&self, t: &Target, ino: InodeId, file: Arc<File>) -> Result<(), StoreError> {
        let r = match &t.engine {
            Engine::Uring(ring) => ring.fsync(file).await,
            Engine::Syscall => syscall::fsync(file).await,
        };
        r.map_err(|e| t.err("fdatasync", ino, e))
    }

    /// Deletes the chunk file (into the target's pool of files to reuse) and closes its cached
    /// descriptor; a missing file is fine. Operations racing with a remove of the same chunk may
    /// land before or after it.
    pub async fn remove(&self, target: TargetId, ino: InodeId) -> Result<(), StoreError> {
        let t = self.target_busy(target)?;
        let key: ChunkKey = (target, ino);
        // Invalidate before and after unlinking so a miss that opened the old file in between
        // cannot leave it cached (see `fd_cache`).
        self.inner.fds.invalidate(key);
        let (path, pool) = (t.chunk_path(ino), t.pool.clone());
        let r = blocking(move || pool.put(&path)).await;
        self.inner.fds.invalidate(key);
        r.map_err(|e| t.err("unlink", ino, e))
    }

    /// Length of the chunk file, or `None` when it does not exist.
    pub async fn stat_chunk(&self, target: TargetId, ino: InodeId) -> Result<Option<u64>, StoreError> {
        let t = self.target(target)?;
        let path = t.chunk_path(ino);
        blocking(move || match fs::metadata(&path) {
            Ok(m) => Ok(Some(m.len())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        })
        .await
        .map_err(|e| t.err("stat", ino, e))
    }

    /// Space of the file system holding the target: capacity, bytes free to unprivileged writers
    /// (`f_bavail × f_frsize`), bytes used (`(f_blocks - f_bfree) × f_frsize`, as `df` counts
    /// them), inodes.
    pub fn space(&self, target: TargetId) -> Result<TargetSpace, StoreError> {
        let t = self.target(target)?;
        let s = nix::sys::statvfs::statvfs(&t.root).map_err(|e| StoreError::Io {
            op: "statvfs",
            path: t.root.clone(),
            source: e.into(),
        })?;
        let frsize = s.fragment_size() as u64;
        Ok(TargetSpace {
            capacity: (s.blocks() as u64).saturating_mul(frsize),
            free: (s.blocks_available() as u64).saturating_mul(frsize),
            used: (s.blocks() as u64).saturating_sub(s.blocks_free() as u64).saturating_mul(frsize),
            inodes_total: s.files() as u64,
            // Pooled chunk files are inodes odfs takes before any new one.
            inodes_free: (s.files_available() as u64).saturating_add(t.pool.len() as u64).min(s.files() as u64),
            device: device_id(&t.root, s.filesystem_id() as u64),
        })
    }

    /// The open chunk file, from the cache or opened now; `None` when missing and not `create`.
    async fn file(&self, t: &Target, ino: InodeId, create: bool) -> Result<Option<Arc<File>>, StoreError> {
        match self.file_or(t, ino, create, |_: &File| Ok(())).await? {
            Found::Cached(f) => Ok(Some(f)),
            Found::Opened(f, _) => Ok(Some(f)),
            Found::Missing => Ok(None),
        }
    }

    /// The chunk file from the cache, or, on a miss, opens it and does `first` on it in the same
    /// blocking call (the file is cached for later operations). `Missing` when the file does not
    /// exist and not `create`.
    async fn file_or<T, F>(&self, t: &Target, ino: InodeId, create: bool, first: F) -> Result<Found<T>, StoreError>
    where
        T: Send + 'static,
        F: Fn(&File) -> io::Result<T> + Send + Sync + 'static,
    {
        let key: ChunkKey = (t.id, ino);
        let miss = match self.inner.fds.get(key) {
            Ok(f) => return Ok(Found::Cached(f)),
            Err(miss) => miss,
        };
        let path = t.chunk_path(ino);
        let first = Arc::new(first);
        let mut shrunk = false;
        loop {
            let (p, first, pool) = (path.clone(), first.clone(), t.pool.clone());
            let opened = blocking(move || {
                Ok(match open_chunk(&p, create.then_some(&*pool))? {
                    Some(f) => {
                        let r = first(&f);
                        Some((f, r))
                    }
                    None => None,
                })
            });
            match opened.await {
                Ok(Some((f, r))) => return Ok(Found::Opened(self.inner.fds.insert(key, Arc::new(f), miss), r)),
                Ok(None) => return Ok(Found::Missing),
                // Out of descriptors: close the colder half of the cache and try once more.
                Err(e) if !shrunk && matches!(e.raw_os_error(), Some(libc::EMFILE) | Some(libc::ENFILE)) => {
                    warn!("out of file descriptors opening {}; shrinking the cache", path.display());
                    self.inner.fds.shrink();
                    shrunk = true;
                }
                Err(e) => return Err(t.err("open", ino, e)),
            }
        }
    }
}

/// Which filesystem `root` is on, the same on every node that sees it: the filesystem id
/// (ext4 and XFS derive it from the filesystem's UUID), else this host and the device number.
fn device_id(root: &Path, fsid: u64) -> u64 {
    use std::hash::{Hash, Hasher};
    if fsid != 0 {
        return fsid;
    }
    let dev = std::fs::metadata(root).map(|m| std::os::unix::fs::MetadataExt::dev(&m)).unwrap_or(0);
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (odfs_service::hostname(), dev).hash(&mut h);
    h.finish().max(1)
}

/// Rejects ranges that cannot be served: more than `MAX_OP_BYTES`, or ending past the largest
/// file offset (an io_uring offset of -1 would even mean "the current position").
fn check_range(what: &'static str, offset: u64, len: usize) -> Result<(), StoreError> {
    if len > MAX_OP_BYTES {
        return Err(StoreError::TooLarge { what, len: len as u64, max: MAX_OP_BYTES as u64 });
    }
    match offset.checked_add(len as u64) {
        Some(end) if end <= i64::MAX as u64 => Ok(()),
        _ => Err(StoreError::Invalid(format!(
            "{what} of {len} bytes at offset {offset} ends past the largest file offset"
        ))),
    }
}

/// Rejects a `read_many` larger than `READ_MANY_ITEMS` ranges or `READ_MANY_BYTES` bytes, or
/// with a range `check_range` rejects.
fn check_many(items: &[ChunkRange]) -> Result<(), StoreError> {
    if items.len() > READ_MANY_ITEMS {
        return Err(StoreError::Invalid(format!(
            "a read of {} ranges at once: at most {READ_MANY_ITEMS} are served",
            items.len()
        )));
    }
    let total: u64 = items.iter().map(|r| r.len as u64).sum();
    if total > READ_MANY_BYTES {
        return Err(StoreError::TooLarge { what: "read of many ranges", len: total, max: READ_MANY_BYTES });
    }
    items.iter().try_for_each(|r| check_range("read", r.offset, r.len as usize))
}

/// Range `r` of its chunk file under `root` as a span (`ChunkStore::read_span`), through
/// `open` when given, else opened read-only here (a missing file has no bytes).
fn range_span(root: &Path, r: &ChunkRange, open: Option<Arc<File>>) -> io::Result<Option<FileSpan>> {
    let file = match open {
        Some(f) => f,
        None => match odfs_service::fileio::open_existing(&odfs_proto::layout::chunk_path(root, r.ino))? {
            Some(f) => Arc::new(f),
            None => return Ok(None),
        },
    };
    let span = span_of(file, r.offset, r.len)?;
    // A batch's files are small and each read once: asked of the disk together, their reads
    // overlap while the stream sends them one after another.
    if let Some(s) = &span {
        syscall::will_need(&s.file, s.offset, s.len as u64);
    }
    Ok(span)
}

/// The span of up to `len` bytes of `file` at `offset` (`None`: none there).
fn span_of(file: Arc<File>, offset: u64, len: u32) -> io::Result<Option<FileSpan>> {
    let size = file.metadata()?.len();
    let n = size.saturating_sub(offset).min(len as u64) as u32;
    if n == 0 {
        return Ok(None);
    }
    Ok(Some(FileSpan { file, offset, len: n }))
}

/// Opens a chunk file read-write; `None` when it is missing and there is no `create` pool. A
/// missing file is made from the pool when it holds one, else created.
fn open_chunk(path: &Path, create: Option<&Recycler>) -> io::Result<Option<File>> {
    let open =
        |create: bool| OpenOptions::new().read(true).write(true).create(create).truncate(false).mode(0o644).open(path);
    // An existing chunk (most opens for writing) is opened without touching the pool.
    match open(false) {
        Ok(f) => return Ok(Some(f)),
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        Err(_) => {}
    }
    let Some(pool) = create else {
        return Ok(None);
    };
    if let Some(f) = pool.take_into(path)? {
        return Ok(Some(f));
    }
    match open(true) {
        Ok(f) => Ok(Some(f)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            // The fan-out directory is made at open; recreate it if someone removed it.
            if let Some(dir) = path.parent() {
                fs::create_dir_all(dir)?;
            }
            open(true).map(Some)
        }
        Err(e) => Err(e),
    }
}

/// Applies the backend choice: `None` means the syscall path. `start` sets up the rings.
fn choose_rings(
    backend: IoBackend,
    start: impl FnOnce() -> io::Result<Vec<Ring>>,
) -> Result<Option<Vec<Ring>>, StoreError> {
    match backend {
        IoBackend::Syscall => Ok(None),
        IoBackend::Uring => start().map(Some).map_err(|e| {
            StoreError::Config(format!(
                "io_backend uring was asked for but io_uring cannot be set up: {e} \
                 (check kernel.io_uring_disabled, seccomp filters and the kernel version, \
                 or use io_backend auto/syscall)"
            ))
        }),
        IoBackend::Auto => match start() {
            Ok(r) => Ok(Some(r)),
            Err(e) => {
                warn!("io_uring cannot be set up ({e}); falling back to pread/pwrite");
                Ok(None)
            }
        },
    }
}

/// Starts one ring per target, or a probe ring when there are none (so `Auto` still reports
/// which backend it would use).
fn start_rings(targets: &[TargetConfig], limits: uring::Limits) -> io::Result<Vec<Ring>> {
    if targets.is_empty() {
        Ring::start("probe", limits)?;
        return Ok(Vec::new());
    }
    targets.iter().map(|t| Ring::start(&t.id.to_string(), limits)).collect()
}

/// The soft limit on open descriptors (the cache takes at most half of it).
fn nofile_limit() -> usize {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes only into the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return 1024;
    }
    usize::try_from(lim.rlim_cur).unwrap_or(usize::MAX)
}

fn cfg_err(path: &Path, what: &str, e: impl std::fmt::Display) -> StoreError {
    StoreError::Config(format!("target directory {}: {what}: {e}", path.display()))
}

/// Makes a target directory ready: the directory itself (only its last component is created,
/// so a missing mount or a typo in a parent is an error rather than a new tree on the root file
/// system), the chunk fan-out, a write probe, and the `target.id` claim.
fn prepare_dir(t: &TargetConfig) -> Result<(), StoreError> {
    let root = &t.path;
    if root.as_os_str().is_empty() {
        return Err(StoreError::Config(format!("target {} has an empty path", t.id)));
    }
    match fs::metadata(root) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return Err(cfg_err(root, "not a directory", "exists as a file")),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            fs::DirBuilder::new().mode(0o755).create(root).map_err(|e| cfg_err(root, "cannot create it", e))?;
        }
        Err(e) => return Err(cfg_err(root, "cannot access it", e)),
    }
    claim_id(t)?;
    let chunks = root.join(CHUNKS_DIR);
    for b in 0..=255u8 {
        let d = chunks.join(format!("{b:02x}"));
        fs::create_dir_all(&d).map_err(|e| cfg_err(&d, "cannot create", e))?;
    }
    // Root bypasses permission bits, and a read-only mount can still allow metadata reads:
    // only an actual write and unlink prove the target usable.
    let probe = chunks.join(".write-probe");
    let r = (|| {
        let mut f = OpenOptions::new().write(true).create(true).truncate(true).mode(0o644).open(&probe)?;
        f.write_all(b"odfs")?;
        f.sync_data()?;
        fs::remove_file(&probe)
    })();
    r.map_err(|e| cfg_err(root, "is not writable", e))
}

/// Checks `target.id` names this target, or writes it when absent.
fn claim_id(t: &TargetConfig) -> Result<(), StoreError> {
    let path = t.path.join(TARGET_ID_FILE);
    match fs::read_to_string(&path) {
        Ok(s) => {
            let owner: TargetId =
                s.trim().parse().map_err(|_| cfg_err(&path, "does not hold a target id", format!("{:?}", s.trim())))?;
            if owner != t.id {
                return Err(StoreError::Config(format!(
                    "target directory {} belongs to target {owner} (per {}), not to target {}; \
                     refusing to mix their chunks",
                    t.path.display(),
                    path.display(),
                    t.id
                )));
            }
            Ok(())
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            // Write a temporary and rename it, so a crash never leaves an empty or partial id.
            let tmp = t.path.join(format!("{TARGET_ID_FILE}.tmp"));
            let r = (|| {
                let mut f = OpenOptions::new().write(true).create(true).truncate(true).mode(0o644).open(&tmp)?;
                f.write_all(format!("{}\n", t.id).as_bytes())?;
                f.sync_all()?;
                fs::rename(&tmp, &path)?;
                File::open(&t.path)?.sync_all()
            })();
            r.map_err(|e| cfg_err(&t.path, "cannot write target.id (is it writable?)", e))
        }
        Err(e) => Err(cfg_err(&path, "cannot read", e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_past_the_largest_offset_are_refused() {
        assert!(check_range("write", 0, MAX_OP_BYTES).is_ok());
        assert!(matches!(check_range("read", 0, MAX_OP_BYTES + 1), Err(StoreError::TooLarge { .. })));
        assert!(check_range("write", i64::MAX as u64 - 10, 10).is_ok());
        assert!(matches!(check_range("write", i64::MAX as u64 - 10, 11), Err(StoreError::Invalid(_))));
        assert!(matches!(check_range("read", u64::MAX, 1), Err(StoreError::Invalid(_))));
    }

    #[test]
    fn store_is_shareable_across_tasks() {
        fn shareable<T: Send + Sync + Clone + 'static>() {}
        shareable::<ChunkStore>();
    }

    #[test]
    fn auto_falls_back_and_uring_refuses_when_io_uring_is_missing() {
        let unavailable = || Err(io::Error::from_raw_os_error(libc::ENOSYS));
        assert!(matches!(choose_rings(IoBackend::Auto, unavailable), Ok(None)));
        assert!(matches!(choose_rings(IoBackend::Syscall, || panic!("not tried")), Ok(None)));
        let Err(e) = choose_rings(IoBackend::Uring, unavailable) else {
            panic!("uring must fail without io_uring");
        };
        let msg = e.to_string();
        assert!(matches!(e, StoreError::Config(_)), "{e:?}");
        assert!(msg.contains("io_uring cannot be set up") && msg.contains("(os error 38)"), "{msg}");
        assert!(matches!(choose_rings(IoBackend::Auto, || Ok(Vec::new())), Ok(Some(_))));
    }

    #[test]
    fn chunk_path_fans_out_by_low_byte() {
        // Target::chunk_path is the layout's.
        let p = odfs_proto::layout::chunk_path(Path::new("/t"), InodeId(0x0001_0000_0000_12ab));
        assert_eq!(p, PathBuf::from("/t/chunks/ab/00010000000012ab"));
    }
}
