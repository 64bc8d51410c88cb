//! `OdfsFuse`: the session's `Filesystem` (the FUSE requests odfs answers) over an odfs `Client`.
//!
//! Every callback translates its arguments and either answers at once — from what the client
//! library holds under its leases (lookup, getattr, read-only open), or where nothing needs
//! waiting for (a write that only joins the write buffer, a flush with nothing to publish) —
//! or calls the client library and replies with the result or with `errno()` of the error:
//! on the reader thread itself (`reader`) for metadata requests (all their work ends with the
//! reply, and it is one short round trip to metad), as a task on the adapter's tokio runtime
//! for opens and data (a disk read at stored would hold a reader thread, and reads and writes
//! leave read-ahead and write-behind running after their reply). All filesystem behaviour (permissions, caching, striping, write-behind,
//! consistency) is the client library's and metad's; this module owns only what FUSE itself
//! needs: the file-handle table, the ".." inode numbers, reply TTLs, and the kernel settings
//! negotiated at init.

use crate::attr::{
    file_attr, file_type, name_bytes, set_time, special_kind, statfs_blocks, xattr_list, NAMELEN, STATFS_BSIZE,
};
use crate::callers::Callers;
use crate::counts::Counts;
use crate::fill::Filled;
use crate::handles::{Handles, OpenFile, Parents};
use crate::passthrough::{Backing, Backings, Candidate};
use crate::FuseError;
use fuser::{
    AccessFlags, Errno, FileHandle, FopenFlags, Generation, INodeNo, LockOwner, OpenAccMode, OpenFlags, RenameFlags,
    TimeOrNow, WriteFlags,
};
use odfs_client::locks::LockAsk;
use odfs_client::{vxattr, Client, Ctx, Ticket};
use odfs_fuse_kernel::abi::init;
use odfs_fuse_kernel::reply::{
    BackingId, ErrorReply, Notifier, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty,
    ReplyEntry, ReplyLock, ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr,
};
use odfs_fuse_kernel::session::{Filesystem, KernelConfig, Request};
use odfs_proto::meta::{
    setid_dropped, Attr, LockKind, SetAttr, RENAME_EXCHANGE, RENAME_NOREPLACE, XATTR_CREATE, XATTR_REPLACE,
};
use odfs_proto::{ErrorCode, InodeId};
use std::ffi::OsStr;
use std::future::Future;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime};
use tracing::{debug, info, warn};

/// Largest write request: one default chunk.
pub const MAX_WRITE: u32 = 1 << 20;
/// Kernel read-ahead asked for at init (the kernel may cap it; see `mount::tune_readahead`).
pub const MAX_READAHEAD: u32 = 1 << 20;
/// Background requests (async direct I/O, read-ahead) the kernel keeps in flight to the mount,
/// asked for at init; the default is 16, and from 12 in flight the kernel counts the mount
/// congested and skips async read-ahead. fio's 4 KiB direct reads at depth 16 x 4 reached
/// odfs-fuse 16 at a time: with 64 all of them do (alternated, 4 KiB IOPS 18.7k -> 20.4k on
/// average; docs/architecture.md, "FUSE mount"). The kernel caps it for a mount made without
/// CAP_SYS_ADMIN (`fs.fuse.max_user_bgreq`).
pub const MAX_BACKGROUND: u16 = 64;
/// Entries asked of metad per readdir request, before the kernel's buffer size is known (the
/// reply packs what fits); glibc sizes its buffer from the directory's `st_blksize` (1 MiB here) and
/// the kernel then asks for up to 1 MiB, room for thousands of entries. Entries that do not
/// fit a smaller buffer are asked again from their cookie by the next request.
const READDIR_BATCH: u32 = 1024;
/// The same for readdirplus, whose entries carry attributes (about 160 bytes each).
const READDIRPLUS_BATCH: u32 = 256;
/// The extended attribute holding file capabilities.
const FILE_CAPS: &[u8] = b"security.capability";
/// Extended attributes the kernel interprets itself (POSIX ACLs); refused.
const SYSTEM_XATTRS: &[u8] = b"system.";
/// Offset of the "." entry, and of ".." (client cookies are shifted past them).
const DOT_OFFSET: u64 = 1;
const DOTDOT_OFFSET: u64 = 2;

/// State shared by the callbacks, the tasks they spawn and the mount runner.
pub struct Shared {
    /// The client library: everything the filesystem does.
    pub client: Client,
    /// The adapter's runtime, where every request runs.
    pub rt: tokio::runtime::Handle,
    /// Open files by FUSE file handle.
    pub handles: Handles,
    /// Parents of directories, for "..".
    pub parents: Parents,
    /// Backing files of files passed through to the kernel.
    pub backings: Backings,
    /// Set once the session exists (the notifier comes from it).
    notifier: OnceLock<Notifier>,
    /// Which inodes' pages were handed to the kernel at open.
    filled: Arc<Filled>,
    /// Callers' supplementary groups, memoised.
    callers: Callers,
    /// What the mount answered, by kind (`odfs stats` through the mount).
    counts: Arc<Counts>,
    /// READ replies spliced into the FUSE device.
    pub splicer: crate::splice::Splicer,
}

impl Shared {
    /// Counts a request answered (`odfs stats` through the mount shows them): its kind, the
    /// time since `since` (when it was read), whether it failed.
    fn count(&self, op: &'static str, since: Instant, failed: bool) {
        self.counts.count(op, since.elapsed(), failed);
    }

    /// Lets the kernel be told to drop what it caches, and has every recall tell it.
    pub fn set_notifier(&self, n: Notifier) {
        let _ = self.notifier.set(n.clone());
        let filled = self.filled.clone();
        let held = self.filled.clone();
        self.client.set_prefetch_skip(Arc::new(move |i| held.has(i.0)));
        self.client.on_recall(Arc::new(move |r| {
            for i in &r.inos {
                filled.forget(i.0);
            }
            invalidate_kernel(&n, r)
        }));
    }

    /// For a read-only open of `file`: fills the kernel's page cache with the whole file when
    /// it is small and not filled already (see `fill`). True when the kernel may keep the pages.
    /// `fresh`: the open asked metad (close-to-open), so whatever the kernel holds of the
    /// file, pages and attributes, is dropped first.
    async fn fill(&self, file: &OpenFile, ticket: Ticket, fresh: bool) -> bool {
        let Some(n) = self.notifier.get() else { return false };
        let i = file.handle.ino();
        if fresh {
            self.filled.forget(i.0);
            if let Err(e) = n.inval_inode(INodeNo(i.0), 0, 0) {
                debug!(ino = %i, error = %e, "invalidation before a fill not delivered");
            }
        }
        self.filled.fill(&self.client, n, &file.handle, &file.attr, ticket).await
    }

    /// For a read-only open answered from the caches: hands the kernel the file's bytes on
    /// this thread when a prefetch holds them. None when none does (the open then fills from
    /// stored), else whether the kernel may keep the pages.
    fn fill_now(&self, file: &OpenFile, ticket: Ticket) -> Option<bool> {
        let n = self.notifier.get()?;
        let data = self.client.prefetched_now(&file.attr)?;
        Some(self.filled.store(&self.client, n, file.handle.ino(), &data, ticket))
    }

    /// Whether a read-only open of `file` should fill the kernel's page cache first.
    fn fill_wanted(&self, file: &OpenFile, candidate: &Option<Candidate>) -> bool {
        candidate.is_none()
            && self.notifier.get().is_some()
            && !file.handle.has_unpublished_writes()
            && self.filled.wanted(&self.client, file.handle.ino().0, file.attr.size)
    }

    /// Makes the kernel ask for attributes again before it trusts a size. Called at open:
    /// metad's answer to the open is fresh (close-to-open); the kernel's cached size may predate it
    /// (the open asked metad because no lease covered the file), and the kernel clips reads to it.
    fn invalidate_kernel_attrs(&self, ino: InodeId) {
        if let Some(n) = self.notifier.get() {
            // The kernel may already have dropped the inode (ENOENT): nothing to invalidate.
            if let Err(e) = n.inval_inode(INodeNo(ino.0), -1, 0) {
                debug!(%ino, error = %e, "attribute invalidation not delivered");
            }
        }
    }

    /// Publishes the data of every open file (written data and sizes reach stored and metad),
    /// leaving the files open. Used before unmounting on SIGTERM.
    pub async fn flush_all(&self) {
        // Read-only handles hold nothing to publish (and their owner may not write).
        let files: Vec<_> = self.handles.all().into_iter().filter(|f| f.writable).collect();
        let n = files.len();
        let results = futures::future::join_all(files.iter().map(|f| f.publish())).await;
        for (f, r) in files.iter().zip(results) {
            if let Err(e) = r {
                warn!(ino = %f.handle.ino(), error = %e, "flushing an open file failed");
            }
        }
        if n > 0 {
            info!(files = n, "flushed open files");
        }
    }

    /// Closes every file still open (the session ended without releasing them).
    pub async fn close_all(&self) {
        let files = self.handles.take_all();
        if !files.is_empty() {
            info!(files = files.len(), "closing files left open when the session ended");
        }
        futures::future::join_all(files.into_iter().map(close_file)).await;
    }
}

/// Drops from the kernel's caches what a recall names: attributes and pages of inodes, and
/// names (positive or negative). The kernel may have dropped them already (ENOENT).
fn invalidate_kernel(n: &Notifier, r: &odfs_proto::meta::Recall) {
    for i in &r.inos {
        if let Err(e) = n.inval_inode(INodeNo(i.0), 0, 0) {
            debug!(ino = %i, error = %e, "inode invalidation not delivered");
        }
    }
    for (dir, name) in &r.names {
        if let Err(e) = n.inval_entry(INodeNo(dir.0), OsStr::from_bytes(name)) {
            debug!(dir = %dir, error = %e, "entry invalidation not delivered");
        }
    }
}

/// Closes a file taken out of the handle table. If a request still holds it, that request's
/// drop of the last reference flushes and releases it (`FileHandle`'s drop).
async fn close_file(f: Arc<OpenFile>) {
    if let Ok(f) = Arc::try_unwrap(f) {
        let ino = f.handle.ino();
        // A passthrough writer may have been written (through mmap too) after its last flush.
        if let Err(e) = f.note_passthrough_writes().await {
            warn!(%ino, error = %e, "cannot read the size of a passthrough file");
        }
        if let Err(e) = f.handle.close().await {
            warn!(%ino, error = %e, "close failed");
        }
    }
}

/// The FUSE filesystem: cheap handle over [`Shared`].
pub struct OdfsFuse {
    shared: Arc<Shared>,
}

type OpResult<T> = Result<T, FuseError>;

fn ino(i: INodeNo) -> InodeId {
    InodeId(i.0)
}

/// The caller without its supplementary groups, for what is answered from the cache on the
/// reader thread: reading them (/proc/PID/status) would cost more than the answer. Enough
/// where the kernel has checked permissions already (`default_permissions`) or only uid and
/// gid matter; a check that would need the groups falls through to the full path.
fn quick_ctx(req: &Request) -> Ctx {
    Ctx { uid: req.uid(), gid: req.gid(), groups: Vec::new() }
}

/// For requests that name an inode the kernel got from a cached name: if metad no longer knows
/// it (removed, or replaced by a rename on another node), the client library's cached
/// attributes of it are dropped (its cached names then miss too) and the kernel gets ESTALE,
/// on which it looks the path up again and retries (open, stat) instead of failing with ENOENT.
fn gone(s: &Shared, i: InodeId, e: odfs_client::ClientError) -> FuseError {
    if e.code() == ErrorCode::NotFound {
        s.client.invalidate(i);
        FuseError::Errno(libc::ESTALE)
    } else {
        FuseError::Client(e)
    }
}

/// A refused `odfs.*` setting (`setfattr -n odfs.layout ...`) reaches its caller as a bare
/// errno; the reason, as the CLI would give it, goes to the log where an admin finds it.
fn refused_setting(i: InodeId, name: &[u8], e: &odfs_client::ClientError) {
    if name.starts_with(vxattr::PREFIX) && e.errno() != libc::EIO {
        let attr = String::from_utf8_lossy(name);
        warn!(inode = %i, errno = e.errno(), "setting {attr} refused: {e}");
    }
}

/// Attributes with how long the kernel may keep them (and the name that led to them).
struct Timed {
    attr: Attr,
    ttl: Duration,
}

/// Runs a request that answers attributes and says how long the kernel may keep them: as
/// long as the client's lease, zero if a recall crossed the reply (the ticket is taken before
/// the request is sent). With `own_change` the request is a change this client makes, which
/// does not cross its own reply.
async fn timed(s: &Shared, own_change: bool, work: impl Future<Output = OpResult<Attr>>) -> OpResult<Timed> {
    let mut ticket = s.client.ticket();
    let attr = work.await?;
    if own_change {
        ticket = s.client.ticket_after(ticket);
    }
    Ok(Timed { ttl: s.client.kernel_ttl(attr.ino, ticket), attr })
}

/// What the kernel gets for lookup result `r` (asked with `ticket`): the entry with how long
/// it may keep it, or, for a miss a lease covers, how long it may remember the name missing.
fn looked_up(
    s: &Shared,
    parent: INodeNo,
    name: &[u8],
    r: odfs_client::Result<Attr>,
    ticket: odfs_client::Ticket,
) -> OpResult<Result<Timed, Duration>> {
    let ttl = s.client.kernel_entry_ttl(ino(parent), name, ticket);
    match r {
        Ok(a) => {
            if a.kind == odfs_proto::meta::FileKind::Dir {
                s.parents.record(a.ino.0, parent.0);
            }
            let ttl = ttl.min(s.client.kernel_ttl(a.ino, ticket));
            Ok(Ok(Timed { attr: a, ttl }))
        }
        Err(e) if e.code() == ErrorCode::NotFound && !ttl.is_zero() => Ok(Err(ttl)),
        Err(e) => Err(e.into()),
    }
}

fn lookup_reply(reply: ReplyEntry, t: Result<Timed, Duration>) {
    match t {
        Ok(t) => entry(reply, &t),
        Err(ttl) => absent(reply, ttl),
    }
}

fn entry(reply: ReplyEntry, t: &Timed) {
    reply.entry(&t.ttl, &file_attr(&t.attr), Generation(0));
}

/// A negative entry: the kernel remembers for `ttl` that the name does not exist.
fn absent(reply: ReplyEntry, ttl: Duration) {
    let none = fuser::FileAttr {
        ino: INodeNo(0),
        size: 0,
        blocks: 0,
        atime: SystemTime::UNIX_EPOCH,
        mtime: SystemTime::UNIX_EPOCH,
        ctime: SystemTime::UNIX_EPOCH,
        crtime: SystemTime::UNIX_EPOCH,
        kind: fuser::FileType::RegularFile,
        perm: 0,
        nlink: 0,
        uid: 0,
        gid: 0,
        rdev: 0,
        blksize: 0,
        flags: 0,
    };
    reply.entry(&ttl, &none, Generation(0));
}

/// Registers `file` in the handle table, passed through to its chunk file when `candidate`
/// says it can be (`register` is the open's or create's reply registering the backing file).
/// Its FUSE file handle, and the backing file to name in the reply.
fn insert_open(
    s: &Shared,
    mut file: OpenFile,
    candidate: Option<Candidate>,
    register: impl FnOnce(&std::fs::File) -> std::io::Result<BackingId>,
) -> (FileHandle, Option<Arc<Backing>>) {
    let backing = candidate.and_then(|c| s.backings.register(file.handle.ino().0, c, register));
    file.backing = backing.as_ref().map(Backing::for_handle);
    (FileHandle(s.handles.insert(file)), backing)
}

/// Open flags of a handle that is not passed through: a write-only one goes around the page
/// cache (`FOPEN_DIRECT_IO`). Without the writeback cache every write reaches odfs-fuse anyway,
/// and kept in the mount's page cache too, a checkpoint's bytes would take the page cache twice
/// (there and in the chunk files): reclaim that its writer pays for. Nothing can read or map
/// through a write-only descriptor, so nothing loses a cache.
fn write_only_flags(write_only: bool) -> FopenFlags {
    if write_only {
        FopenFlags::FOPEN_DIRECT_IO
    } else {
        FopenFlags::empty()
    }
}

/// Answers an open with `file`: passed through to its chunk file when `candidate` says it can
/// be, else the normal way with `flags`.
fn opened(s: &Shared, reply: ReplyOpen, file: OpenFile, candidate: Option<Candidate>, flags: FopenFlags) {
    match insert_open(s, file, candidate, |f| reply.open_backing(f)) {
        // Readers still need no FLUSH; writers' FLUSH publishes what the kernel wrote.
        (fh, Some(b)) => reply.opened_passthrough(fh, flags & FopenFlags::FOPEN_NOFLUSH, b.id()),
        (fh, None) => reply.opened(fh, flags),
    }
}

impl OdfsFuse {
    /// A filesystem over `client`, running its requests on `rt`.
    pub fn new(client: Client, rt: tokio::runtime::Handle) -> OdfsFuse {
        let counts = Arc::new(Counts::default());
        let (c, prefetch) = (counts.clone(), client.prefetch_counts_reader());
        client.on_stats(Box::new(move || c.snapshot_with(prefetch())));
        OdfsFuse {
            shared: Arc::new(Shared {
                client,
                rt,
                handles: Handles::default(),
                parents: Parents::default(),
                backings: Backings::new(false),
                notifier: OnceLock::new(),
                filled: Arc::new(Filled::default()),
                callers: Callers::default(),
                counts,
                splicer: Default::default(),
            }),
        }
    }

    /// The state the mount runner needs after the filesystem moves into the session.
    pub fn shared(&self) -> Arc<Shared> {
        self.shared.clone()
    }

    /// Runs `work` as a task and replies with `done` on success or the error's errno.
    fn spawn<R: ErrorReply, T: Send + 'static>(
        &self,
        op: &'static str,
        reply: R,
        work: impl Future<Output = OpResult<T>> + Send + 'static,
        done: impl FnOnce(R, T) + Send + 'static,
    ) {
        let (s, t0) = (self.shared.clone(), Instant::now());
        self.shared.rt.spawn(async move {
            let failed = answer(reply, op, work.await, done);
            s.count(op, t0, failed);
        });
    }

    /// Runs `work` on this reader thread (see `reader`) and replies with `done` on success or
    /// the error's errno. For requests whose work all ends with the reply.
    fn here<R: ErrorReply, T>(
        &self,
        op: &'static str,
        reply: R,
        work: impl Future<Output = OpResult<T>>,
        done: impl FnOnce(R, T),
    ) {
        let t0 = Instant::now();
        let failed = answer(reply, op, crate::reader::block_on(work), done);
        self.shared.count(op, t0, failed);
    }

    /// The caller of a request, with its supplementary groups (see `callers`).
    fn ctx(&self, req: &Request) -> Ctx {
        self.shared.callers.ctx(req.uid(), req.gid(), req.pid())
    }

    /// The caller, if the file open as `f` has set-id bits its write drops (metad's rule,
    /// `setid_dropped`; the mode as cached under a lease, or as seen at open). Asked for every
    /// write of a caller without CAP_FSETID, so the common answer costs one cache look.
    fn setid_to_kill(&self, req: &Request, f: &OpenFile) -> Option<Ctx> {
        let (mode, gid) = self.shared.client.mode_cached(f.attr.ino).unwrap_or((f.attr.mode, f.attr.gid));
        if mode & 0o6000 == 0 {
            return None;
        }
        let ctx = self.ctx(req);
        let in_group = ctx.gid == gid || ctx.groups.contains(&gid);
        (setid_dropped(mode, ctx.uid == 0, in_group) != 0).then_some(ctx)
    }

    /// The open file and the lock request of a GETLK or SETLK (range, `l_type`, pid); `None`
    /// once refused (an unknown handle: EBADF; an unknown lock type: EINVAL).
    fn lock_ask<R: ErrorReply>(
        &self,
        fh: FileHandle,
        owner: LockOwner,
        (start, end, typ, pid): (u64, u64, i32, u32),
        reply: R,
    ) -> Option<(Arc<OpenFile>, LockAsk, R)> {
        let (f, reply) = self.open_file(fh, reply)?;
        let Some(kind) = lock_kind(typ) else {
            reply.fail(Errno::EINVAL);
            return None;
        };
        Some((f, LockAsk { owner: owner.0, pid, kind, start, end }, reply))
    }

    /// The open file behind a FUSE file handle; `None` after replying EBADF.
    fn open_file<R: ErrorReply>(&self, fh: FileHandle, reply: R) -> Option<(Arc<OpenFile>, R)> {
        match self.shared.handles.get(fh.0) {
            Some(f) => Some((f, reply)),
            None => {
                reply.fail(Errno::EBADF);
                None
            }
        }
    }
}

/// How long one lock request may wait at metad before it is asked again (a waiting `flock` or
/// F_SETLKW is a chain of these; between them the adapter looks for a signal to the waiter).
const LOCK_WAIT: Duration = Duration::from_millis(250);

/// A SETLK or SETLKW of thread `tid`: an unlock publishes the file's writes first (the next
/// holder, on any node, reads them); a lock that may wait asks again until granted, or until
/// its caller has a signal to take or its file is closed.
async fn take_lock(
    s: Arc<Shared>,
    ctx: Ctx,
    (fh, tid): (u64, u32),
    f: Arc<OpenFile>,
    ask: LockAsk,
    sleep: bool,
) -> OpResult<()> {
    let ino = f.handle.ino();
    if ask.kind == LockKind::Unlock {
        f.publish_writes().await?;
        s.client.set_lock(&ctx, ino, ask, Duration::ZERO).await?;
        return Ok(());
    }
    loop {
        let granted = s.client.set_lock(&ctx, ino, ask, if sleep { LOCK_WAIT } else { Duration::ZERO }).await?;
        if s.handles.get(fh).is_none() {
            // Closed while the request was out (its caller was killed): nobody keeps the lock.
            s.client.drop_locks(&ctx, ino, &[ask.owner]).await?;
            return Err(FuseError::Errno(libc::EINTR));
        }
        if granted {
            return Ok(());
        }
        if !sleep {
            return Err(FuseError::Errno(libc::EAGAIN));
        }
        if signalled(tid) {
            // The kernel makes this a restart or an EINTR through the handler, as locally.
            return Err(FuseError::Errno(libc::EINTR));
        }
    }
}

/// Whether thread `tid` will take a signal when its request is answered: one pending on the
/// thread and not blocked (a fatal signal leaves SIGKILL pending on every thread), or one
/// pending on the process that the thread does not block, when it is the process's main
/// thread (the kernel hands a signal sent to a process to its main thread first, if that
/// thread does not block it) or its only one. Not a signal another thread may take: the
/// thread would return with no signal, and the kernel's restart code with it. Read from
/// /proc; where that fails, nothing is pending. See "Locks across nodes".
fn signalled(tid: u32) -> bool {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{tid}/status")) else { return false };
    signal_to_take(&status)
}

/// `signalled`'s rule on the text of a `/proc/TID/status`.
fn signal_to_take(status: &str) -> bool {
    let field = |name: &str| status.lines().find_map(|l| l.strip_prefix(name)).map(str::trim);
    let mask = |name: &str| field(name).and_then(|v| u64::from_str_radix(v, 16).ok()).unwrap_or(0);
    // SIGKILL cannot be blocked.
    let blocked = mask("SigBlk:") & !(1 << (libc::SIGKILL - 1));
    let first = field("Threads:") == Some("1") || (field("Pid:").is_some() && field("Tgid:") == field("Pid:"));
    mask("SigPnd:") & !blocked != 0 || (first && mask("ShdPnd:") & !blocked != 0)
}

/// A lock request's kind from the kernel's `l_type`.
fn lock_kind(typ: i32) -> Option<LockKind> {
    match typ {
        libc::F_RDLCK => Some(LockKind::Read),
        libc::F_WRLCK => Some(LockKind::Write),
        libc::F_UNLCK => Some(LockKind::Unlock),
        _ => None,
    }
}

fn lock_type(kind: LockKind) -> i32 {
    match kind {
        LockKind::Read => libc::F_RDLCK,
        LockKind::Write => libc::F_WRLCK,
        LockKind::Unlock => libc::F_UNLCK,
    }
}

/// Replies with `done` on success or the error's errno; true when it failed (a missing name
/// looked up or a missing attribute asked for is an answer: `stats::counts_as_error`).
fn answer<R: ErrorReply, T>(reply: R, op: &'static str, r: OpResult<T>, done: impl FnOnce(R, T)) -> bool {
    match r {
        Ok(v) => {
            done(reply, v);
            false
        }
        Err(e) => {
            let failed = odfs_proto::stats::counts_as_error(op, e.errno());
            fail(reply, op, e);
            failed
        }
    }
}

/// Replies with the error's errno; an I/O error is logged as a warning, a refusal at debug.
fn fail<R: ErrorReply>(reply: R, op: &'static str, e: FuseError) {
    let errno = e.errno();
    if errno == libc::EIO {
        warn!(op, error = %e, "request failed");
    } else {
        debug!(op, errno, error = %e, "request refused");
    }
    reply.fail(Errno::from_i32(errno));
}

/// Attributes of `ino`, answered for open files even once metad has forgotten the inode (the
/// last name went away while the file stays open, as POSIX allows).
async fn getattr_any(s: &Shared, ctx: &Ctx, i: InodeId, fh: Option<u64>) -> OpResult<Attr> {
    let open = fh.and_then(|fh| s.handles.get(fh));
    let r = match &open {
        Some(f) => f.handle.getattr().await,
        None => s.client.getattr(ctx, i).await,
    };
    match r {
        Ok(a) => Ok(a),
        Err(e) if e.code() == ErrorCode::NotFound => match open.or_else(|| s.handles.by_ino(i.0)) {
            Some(f) => {
                let mut a = f.attr.clone();
                a.nlink = 0;
                a.size = f.handle.size().await;
                Ok(a)
            }
            None => Err(gone(s, i, e)),
        },
        Err(e) => Err(e.into()),
    }
}

/// What reads need of the kernel, asked at init (the FUSE minimum asks the same):
/// `MAX_BACKGROUND` background requests in flight, congested at three quarters of them (the
/// kernel's own default ratio), and `MAX_READAHEAD` of read-ahead.
fn ask_io(config: &mut KernelConfig) {
    let _ = config.set_max_background(MAX_BACKGROUND);
    config.set_congestion_threshold(MAX_BACKGROUND / 4 * 3);
    if let Err(max) = config.set_max_readahead(MAX_READAHEAD) {
        // The kernel offers its current read-ahead as the maximum (128 KiB by default); the
        // mount runner raises it through sysfs after mounting.
        debug!(asked = MAX_READAHEAD, max, "kernel caps read-ahead at init");
        let _ = config.set_max_readahead(max);
    }
}

impl Filesystem for OdfsFuse {
    fn init(&self, config: &mut KernelConfig) -> std::io::Result<()> {
        if let Err(max) = config.set_max_write(MAX_WRITE) {
            warn!(asked = MAX_WRITE, max, "kernel caps the write size");
            let _ = config.set_max_write(max);
        }
        ask_io(config);
        // Readdirplus: the kernel chooses per directory (AUTO) between plain listings and
        // listings with attributes, saving a lookup per entry for `ls -l`-style walks.
        // Atomic O_TRUNC: open(O_TRUNC) arrives as one open request instead of open + setattr.
        // Parallel dirops: lookups and creates in one directory run concurrently (metad
        // serialises what must be serialised).
        // Cached symlinks: a symlink's target never changes, so the kernel keeps it (a recall's
        // inval_inode drops it with the inode).
        // Async direct I/O: an O_DIRECT or AIO reader's requests reach us all at once rather than
        // one at a time per submitting thread (without it, fio at queue depth 16 has one read in
        // flight: measured 13k 4 KiB IOPS over four files).
        // Kill-priv v2: a write, truncate or chown by a caller without CAP_FSETID clears set-id
        // bits in the filesystem, which knows the caller (without it the kernel sends a chmod
        // as the writer, which a writer who is not the owner may not do: EPERM on write).
        // Not asked: writeback cache (the kernel would hold written data and sizes, outside the
        // client library's close-to-open accounting).
        // Locks: with `global_locks`, every `fcntl`, OFD and `flock` lock is sent here and held
        // at metad, across nodes; without, the kernel keeps them, per node.
        if self.shared.client.config().global_locks {
            for (cap, name) in [(init::POSIX_LOCKS, "POSIX_LOCKS"), (init::FLOCK_LOCKS, "FLOCK_LOCKS")] {
                if config.want(cap).is_err() {
                    warn!(
                        capability = name,
                        "kernel does not offer this FUSE capability: its locks hold on this node only"
                    );
                }
            }
        }
        for (cap, name) in [
            (init::DO_READDIRPLUS, "DO_READDIRPLUS"),
            (init::READDIRPLUS_AUTO, "READDIRPLUS_AUTO"),
            (init::ATOMIC_O_TRUNC, "ATOMIC_O_TRUNC"),
            (init::PARALLEL_DIROPS, "PARALLEL_DIROPS"),
            (init::CACHE_SYMLINKS, "CACHE_SYMLINKS"),
            (init::ASYNC_DIO, "ASYNC_DIO"),
            (init::HANDLE_KILLPRIV_V2, "HANDLE_KILLPRIV_V2"),
        ] {
            if config.want(cap).is_err() {
                info!(capability = name, "kernel does not offer this FUSE capability");
            }
        }
        // The io_uring transport, where the kernel offers it and the config allows.
        if self.shared.client.config().fuse_io_uring && config.want(init::OVER_IO_URING).is_err() {
            info!("kernel does not offer FUSE over io_uring (6.14+, fuse module's enable_uring): requests come by /dev/fuse");
        }
        // Passthrough: backing files on a plain local filesystem (stack depth 1).
        let passthrough = if !self.shared.client.config().fuse_passthrough {
            info!("FUSE passthrough off by the client config (fuse_passthrough = false): every file takes the normal path");
            false
        } else if config.want(init::PASSTHROUGH).is_ok() && config.set_max_stack_depth(1).is_ok() {
            true
        } else {
            info!("kernel does not offer FUSE passthrough: every file takes the normal path");
            false
        };
        self.shared.backings.set_on(passthrough);
        Ok(())
    }

    fn lookup(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let (s, name) = (self.shared.clone(), name_bytes(name));
        // What a lease covers is answered on this thread: no task, no network.
        let ticket = s.client.ticket();
        let t0 = Instant::now();
        if let Some(r) = s.client.lookup_cached(&quick_ctx(req), ino(parent), &name) {
            let failed = match looked_up(&s, parent, &name, r, ticket) {
                Ok(t) => {
                    lookup_reply(reply, t);
                    false
                }
                Err(e) => {
                    reply.fail(Errno::from_i32(e.errno()));
                    odfs_proto::stats::counts_as_error("lookup", e.errno())
                }
            };
            return s.count("lookup (no request)", t0, failed);
        }
        let ctx = self.ctx(req);
        self.here(
            "lookup",
            reply,
            async move {
                let ticket = s.client.ticket();
                let r = s.client.lookup(&ctx, ino(parent), &name).await;
                looked_up(&s, parent, &name, r, ticket)
            },
            lookup_reply,
        );
    }

    fn forget(&self, i: INodeNo, _nlookup: u64) {
        // The kernel dropped the inode (and its pages); it looks it up again before any
        // further use.
        self.shared.parents.forget(i.0);
        self.shared.filled.forget(i.0);
    }

    fn getattr(&self, req: &Request, i: INodeNo, fh: Option<FileHandle>, reply: ReplyAttr) {
        let s = self.shared.clone();
        let ticket = s.client.ticket();
        let t0 = Instant::now();
        if let Some(mut a) = s.client.getattr_cached(ino(i)) {
            s.backings.merge(&mut a);
            reply.attr(&s.client.kernel_ttl(a.ino, ticket), &file_attr(&a));
            return s.count("getattr (no request)", t0, false);
        }
        let ctx = self.ctx(req);
        self.here(
            "getattr",
            reply,
            async move {
                let s2 = s.clone();
                let mut t =
                    timed(&s2, false, async move { getattr_any(&s, &ctx, ino(i), fh.map(|f| f.0)).await }).await?;
                s2.backings.merge(&mut t.attr);
                Ok(t)
            },
            |reply, t| reply.attr(&t.ttl, &file_attr(&t.attr)),
        );
    }

    fn setattr(
        &self,
        req: &Request,
        i: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        fh: Option<FileHandle>,
        reply: ReplyAttr,
    ) {
        let (s, ctx) = (self.shared.clone(), self.ctx(req));
        self.here(
            "setattr",
            reply,
            async move {
                let mut size = size;
                // ftruncate (and O_TRUNC without atomic truncation) names the handle: truncate
                // through it so the open file's write-behind and size stay in step.
                if let (Some(n), Some(f)) = (size, fh.and_then(|f| s.handles.get(f.0))) {
                    f.handle.truncate(n).await?;
                    size = None;
                }
                let req = SetAttr {
                    ino: ino(i),
                    mode: mode.map(|m| m & 0o7777),
                    uid,
                    gid,
                    size,
                    atime: atime.map(set_time),
                    mtime: mtime.map(set_time),
                    open_for_write: false,
                    kill_setid: false,
                };
                let s2 = s.clone();
                let mut t =
                    timed(&s2, true, async move { s.client.setattr(&ctx, req).await.map_err(|e| gone(&s, ino(i), e)) })
                        .await?;
                s2.backings.merge(&mut t.attr);
                Ok(t)
            },
            |reply, t| reply.attr(&t.ttl, &file_attr(&t.attr)),
        );
    }

    fn readlink(&self, req: &Request, i: INodeNo, reply: ReplyData) {
        let (s, ctx) = (self.shared.clone(), self.ctx(req));
        self.here(
            "readlink",
            reply,
            async move { s.client.readlink(&ctx, ino(i)).await.map_err(|e| gone(&s, ino(i), e)) },
            |reply, t| reply.data(&t),
        );
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        rdev: u32,
        reply: ReplyEntry,
    ) {
        // FIFOs, sockets and device nodes are inodes of their own (their I/O is the kernel's);
        // a regular file made by mknod(2) is an ordinary create.
        let (s, ctx, name) = (self.shared.clone(), self.ctx(req), name_bytes(name));
        let special = special_kind(mode);
        let regular = matches!(mode & libc::S_IFMT, 0 | libc::S_IFREG);
        if special.is_none() && !regular {
            reply.error(Errno::EINVAL);
            return;
        }
        self.here(
            "mknod",
            reply,
            async move {
                let (parent, perm) = (ino(parent), mode & 0o7777);
                timed(&s, true, async {
                    Ok(match special {
                        Some(kind) => s.client.mknod(&ctx, parent, &name, kind, perm, rdev).await?,
                        None => s.client.create(&ctx, parent, &name, perm, true, None).await?.attr,
                    })
                })
                .await
            },
            |reply, a| entry(reply, &a),
        );
    }

    fn mkdir(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, _umask: u32, reply: ReplyEntry) {
        let (s, ctx, name) = (self.shared.clone(), self.ctx(req), name_bytes(name));
        self.here(
            "mkdir",
            reply,
            async move {
                let t = timed(&s, true, async { Ok(s.client.mkdir(&ctx, ino(parent), &name, mode & 0o7777).await?) })
                    .await?;
                s.parents.record(t.attr.ino.0, parent.0);
                Ok(t)
            },
            |reply, a| entry(reply, &a),
        );
    }

    fn unlink(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let (s, ctx, name) = (self.shared.clone(), self.ctx(req), name_bytes(name));
        self.here("unlink", reply, async move { Ok(s.client.unlink(&ctx, ino(parent), &name).await?) }, |reply, ()| {
            reply.ok()
        });
    }

    fn rmdir(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let (s, ctx, name) = (self.shared.clone(), self.ctx(req), name_bytes(name));
        self.here("rmdir", reply, async move { Ok(s.client.rmdir(&ctx, ino(parent), &name).await?) }, |reply, ()| {
            reply.ok()
        });
    }

    fn symlink(&self, req: &Request, parent: INodeNo, link_name: &OsStr, target: &Path, reply: ReplyEntry) {
        let (s, ctx, name) = (self.shared.clone(), self.ctx(req), name_bytes(link_name));
        let target = target.as_os_str().as_bytes().to_vec();
        self.here(
            "symlink",
            reply,
            async move { timed(&s, true, async { Ok(s.client.symlink(&ctx, ino(parent), &name, &target).await?) }).await },
            |reply, a| entry(reply, &a),
        );
    }

    fn rename(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let known = RenameFlags::RENAME_NOREPLACE | RenameFlags::RENAME_EXCHANGE;
        if !(flags - known).is_empty() {
            // RENAME_WHITEOUT is for overlay filesystems' upper layers; odfs has no whiteouts.
            reply.error(Errno::EINVAL);
            return;
        }
        let mut pflags = 0;
        if flags.contains(RenameFlags::RENAME_NOREPLACE) {
            pflags |= RENAME_NOREPLACE;
        }
        if flags.contains(RenameFlags::RENAME_EXCHANGE) {
            pflags |= RENAME_EXCHANGE;
        }
        let (s, ctx) = (self.shared.clone(), self.ctx(req));
        let (name, newname) = (name_bytes(name), name_bytes(newname));
        self.here(
            "rename",
            reply,
            async move { Ok(s.client.rename(&ctx, ino(parent), &name, ino(newparent), &newname, pflags).await?) },
            |reply, ()| reply.ok(),
        );
    }

    fn link(&self, req: &Request, i: INodeNo, newparent: INodeNo, newname: &OsStr, reply: ReplyEntry) {
        let (s, ctx, name) = (self.shared.clone(), self.ctx(req), name_bytes(newname));
        self.here(
            "link",
            reply,
            async move { timed(&s, true, async { Ok(s.client.link(&ctx, ino(i), ino(newparent), &name).await?) }).await },
            |reply, a| entry(reply, &a),
        );
    }

    fn open(&self, req: &Request, i: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let acc = flags.acc_mode();
        let read = acc != OpenAccMode::O_WRONLY;
        let write = acc != OpenAccMode::O_RDONLY;
        let truncate = flags.0 & libc::O_TRUNC != 0;
        let append = flags.0 & libc::O_APPEND != 0;
        let s = self.shared.clone();
        let ticket = s.client.ticket();
        if !write && !truncate {
            // A lease on the file: answered here, and the kernel keeps the file's pages (a
            // change to the file would have recalled the lease and dropped them). No FLUSH:
            // a reader has nothing to publish.
            if let Some(Ok((handle, attr))) = s.client.open_cached(&quick_ctx(req), ino(i)) {
                let candidate = s.backings.candidate(&s.client, &attr);
                let file = OpenFile::new(handle, false, append, attr, None);
                let keep = FopenFlags::FOPEN_KEEP_CACHE | FopenFlags::FOPEN_NOFLUSH;
                if !s.fill_wanted(&file, &candidate) {
                    let t0 = Instant::now();
                    opened(&s, reply, file, candidate, keep);
                    return s.count("open (no request)", t0, false);
                }
                // A small file whose pages the kernel lacks: they are handed over first, so
                // no READ follows; from what a prefetch read ahead on this thread, else from
                // stored in a task.
                let t0 = Instant::now();
                if let Some(kept) = s.fill_now(&file, ticket) {
                    let flags = if kept { keep } else { FopenFlags::FOPEN_NOFLUSH };
                    opened(&s, reply, file, candidate, flags);
                    return s.count("open (prefetched)", t0, false);
                }
                return self.spawn(
                    "open",
                    reply,
                    async move {
                        let kept = s.fill(&file, ticket, false).await;
                        Ok((s, file, candidate, kept))
                    },
                    move |reply, (s, file, candidate, kept)| {
                        let flags = if kept { keep } else { FopenFlags::FOPEN_NOFLUSH };
                        opened(&s, reply, file, candidate, flags)
                    },
                );
            }
        }
        let ctx = self.ctx(req);
        self.spawn(
            "open",
            reply,
            async move {
                let handle =
                    s.client.open(&ctx, ino(i), read, write, truncate).await.map_err(|e| gone(&s, ino(i), e))?;
                // A file this client removed a moment ago is known by its last attributes (metad
                // has forgotten it); any other from the client's cache filled by the open (one
                // round trip after O_TRUNC).
                let attr = match s.client.removed_attr(ino(i)) {
                    Some(a) => a,
                    None => handle.getattr().await?,
                };
                let candidate = s.backings.candidate(&s.client, &attr);
                let file = OpenFile::new(handle, write, append, attr, None);
                // A fill drops the kernel's pages and attributes itself; otherwise its
                // attributes only.
                let kept = if !write && s.fill_wanted(&file, &candidate) {
                    s.fill(&file, ticket, true).await
                } else {
                    s.invalidate_kernel_attrs(ino(i));
                    false
                };
                Ok((s, file, candidate, kept))
            },
            // Without FOPEN_KEEP_CACHE the kernel drops its cached pages at the open, which is
            // what makes close-to-open hold for data read through the page cache; a filled
            // file's pages were dropped before the fill and are the file as it is now. A
            // reader has nothing to publish: no FLUSH at its close.
            move |reply, (s, file, candidate, kept)| {
                let mut flags = if kept { FopenFlags::FOPEN_KEEP_CACHE } else { write_only_flags(!read) };
                if !write {
                    flags |= FopenFlags::FOPEN_NOFLUSH;
                }
                opened(&s, reply, file, candidate, flags)
            },
        );
    }

    fn read(&self, req: &Request, _ino: INodeNo, fh: FileHandle, offset: u64, size: u32, reply: ReplyData) {
        let Some((f, reply)) = self.open_file(fh, reply) else { return };
        if self.shared.splicer.wants(size) {
            let (s, t0, unique) = (self.shared.clone(), Instant::now(), req.unique());
            self.shared.rt.spawn(async move {
                if s.splicer.reply(unique, &f.handle, offset, size).await {
                    // Answered through the device: the reply object must not answer again.
                    reply.sent_elsewhere();
                    return s.count("read (spliced)", t0, false);
                }
                let failed =
                    answer(reply, "read", f.handle.read(offset, size).await.map_err(Into::into), |reply, d| {
                        reply.data(&d)
                    });
                s.count("read", t0, failed);
            });
            return;
        }
        self.spawn("read", reply, async move { Ok(f.handle.read(offset, size).await?) }, |reply, d| reply.data(&d));
    }

    fn write(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        reply: ReplyWrite,
    ) {
        let Some((f, reply)) = self.open_file(fh, reply) else { return };
        // A writer without CAP_FSETID clears a set-id file's set-id bits (the kernel leaves that
        // to us, `FUSE_HANDLE_KILLPRIV_V2`): once per file, before its first such write.
        let kill = write_flags
            .contains(WriteFlags::FUSE_WRITE_KILL_SUIDGID)
            .then(|| self.setid_to_kill(req, &f))
            .flatten()
            .map(|ctx| (self.shared.clone(), ctx));
        // A write that only joins the write buffer (a small file's one write) is answered here.
        if !f.append && kill.is_none() {
            let t0 = Instant::now();
            if let Some(r) = f.handle.try_write(offset, data) {
                let failed = answer(reply, "write", r.map_err(FuseError::from), |reply, n| reply.written(n as u32));
                return self.shared.count("write (no request)", t0, failed);
            }
        }
        let data = data.to_vec();
        self.spawn(
            "write",
            reply,
            async move {
                if let Some((s, ctx)) = kill {
                    s.client.kill_setid(&ctx, f.attr.ino).await?;
                }
                // O_APPEND: the end of the file as this process sees it (its own unflushed
                // writes included). The kernel runs one write per inode at a time, so appends
                // through different descriptors of this mount do not interleave.
                let offset = if f.append { f.handle.size().await } else { offset };
                Ok(f.handle.write_bytes(offset, data.into()).await?)
            },
            |reply, n| reply.written(n as u32),
        );
    }

    fn flush(&self, req: &Request, _ino: INodeNo, fh: FileHandle, lock_owner: LockOwner, reply: ReplyEmpty) {
        let Some((f, reply)) = self.open_file(fh, reply) else { return };
        if self.shared.client.holds_locks(f.handle.ino(), lock_owner.0) {
            // POSIX: the close of any descriptor drops the process's locks on the file; its
            // writes are published first, so the next holder reads them.
            let (s, ctx) = (self.shared.clone(), self.ctx(req));
            let work = async move {
                // The locks go even if the publish failed (its error is the close's).
                let published = f.publish_writes().await;
                s.client.drop_locks(&ctx, f.handle.ino(), &[lock_owner.0]).await?;
                published
            };
            return self.spawn("flush", reply, work, |reply, ()| reply.ok());
        }
        if !f.has_writes_to_publish() {
            // Nothing to publish: answered here, without a task and a thread hop (close(2) of
            // a file opened for writing but not written, as mdtest's creates are, or of any
            // read-only handle). The reference goes before the reply: the kernel's RELEASE can
            // follow at once, and its close must hold the last one.
            drop(f);
            reply.ok();
            return self.shared.count("flush (no request)", Instant::now(), false);
        }
        self.spawn("flush", reply, async move { f.publish_writes().await }, |reply, ()| reply.ok());
    }

    fn release(&self, req: &Request, _ino: INodeNo, fh: FileHandle, lock_owner: Option<LockOwner>, reply: ReplyEmpty) {
        let file = self.shared.handles.remove(fh.0);
        if let Some(f) = file.as_ref().filter(|f| f.has_lock_owners() || lock_owner.is_some()) {
            // Locks taken through this open file go with it (`flock`, OFD locks, and a reader's
            // `fcntl` locks, whose close sends no FLUSH), after its writes are published.
            let (s, ctx, f) = (self.shared.clone(), self.ctx(req), f.clone());
            let mut owners = f.lock_owners();
            owners.extend(lock_owner.map(|o| o.0));
            drop(file);
            let work = async move {
                let published = f.publish_writes().await;
                s.client.drop_locks(&ctx, f.handle.ino(), &owners).await?;
                close_file(f).await;
                published
            };
            return self.spawn("release", reply, work, |reply, ()| reply.ok());
        }
        // A handle with nothing to publish and no registration to release (a reader's opened
        // from the cache; a new file of a caching client, flushed or never written) closes
        // here, without a task.
        let file = match file.map(Arc::try_unwrap) {
            // A passthrough writer may have been written through mmap after its last flush.
            Some(Ok(f)) if f.kernel_writes() => Some(Arc::new(f)),
            Some(Ok(f)) => match f.handle.close_if_clean() {
                Ok(()) => {
                    reply.ok();
                    return self.shared.count("release (no request)", Instant::now(), false);
                }
                Err(handle) => Some(Arc::new(OpenFile { handle, ..f })),
            },
            Some(Err(shared)) => Some(shared),
            None => None,
        };
        self.spawn(
            "release",
            reply,
            async move {
                if let Some(f) = file {
                    close_file(f).await;
                }
                Ok(())
            },
            |reply, ()| reply.ok(),
        );
    }

    fn getlk(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        lock_owner: LockOwner,
        start: u64,
        end: u64,
        typ: i32,
        pid: u32,
        reply: ReplyLock,
    ) {
        let Some((f, ask, reply)) = self.lock_ask(fh, lock_owner, (start, end, typ, pid), reply) else { return };
        let (s, ctx) = (self.shared.clone(), self.ctx(req));
        let work = async move { Ok(s.client.test_lock(&ctx, f.handle.ino(), ask).await?) };
        self.spawn("getlk", reply, work, move |reply, held| match held {
            Some(h) => reply.locked(h.start, h.end, lock_type(h.kind), h.pid),
            None => reply.locked(start, end, libc::F_UNLCK, 0),
        });
    }

    fn setlk(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        lock_owner: LockOwner,
        start: u64,
        end: u64,
        typ: i32,
        pid: u32,
        sleep: bool,
        reply: ReplyEmpty,
    ) {
        let Some((f, ask, reply)) = self.lock_ask(fh, lock_owner, (start, end, typ, pid), reply) else { return };
        let (s, ctx) = (self.shared.clone(), self.ctx(req));
        if ask.kind != LockKind::Unlock {
            f.note_lock_owner(ask.owner);
        }
        self.spawn("setlk", reply, take_lock(s, ctx, (fh.0, req.pid()), f, ask, sleep), |reply, ()| reply.ok());
    }

    fn fsync(&self, _req: &Request, _ino: INodeNo, fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        // fdatasync does the same: odfs has no metadata to skip that fsync would write (the
        // size is part of what must be durable for the data to be readable).
        let Some((f, reply)) = self.open_file(fh, reply) else { return };
        self.spawn(
            "fsync",
            reply,
            async move {
                if let Some(hb) = &f.backing {
                    let b = hb.backing.clone();
                    tokio::task::spawn_blocking(move || b.sync())
                        .await
                        .map_err(|e| std::io::Error::other(format!("fsync task: {e}")))??;
                    f.note_passthrough_writes().await?;
                }
                Ok(f.handle.fsync().await?)
            },
            |reply, ()| reply.ok(),
        );
    }

    fn opendir(&self, _req: &Request, i: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        // Listings are stateless (offsets map to metad's stable cookies), so no handle is kept.
        // The kernel keeps a listing across opens while this client holds the directory's
        // attributes under a lease: every name change in it touches the directory, whose
        // recall is an inval_inode that drops the kernel's copy (this node's own changes it
        // drops itself). A striped directory's names change on its other shards' parts, which
        // recall names only: only a sealed one's listing is kept.
        let keep = self.shared.client.getattr_cached(ino(i)).is_some_and(|a| a.sealed || a.dir_stripes.len() < 2);
        let flags = if keep { FopenFlags::FOPEN_CACHE_DIR | FopenFlags::FOPEN_KEEP_CACHE } else { FopenFlags::empty() };
        reply.opened(FileHandle(0), flags);
    }

    fn readdir(&self, req: &Request, i: INodeNo, _fh: FileHandle, offset: u64, reply: ReplyDirectory) {
        let (s, ctx) = (self.shared.clone(), self.ctx(req));
        let parent = INodeNo(self.shared.parents.parent_of(i.0));
        self.here(
            "readdir",
            reply,
            async move {
                let cookie = offset.saturating_sub(DOTDOT_OFFSET);
                Ok(s.client.readdir(&ctx, ino(i), cookie, READDIR_BATCH, false).await?)
            },
            move |mut reply, r| {
                // Offsets: "." 1, ".." 2, the entry with client cookie c at c + 2 (metad's
                // cookies start at 1), so an offset always resumes right after its entry.
                if offset < DOT_OFFSET && reply.add(i, DOT_OFFSET, fuser::FileType::Directory, ".") {
                    return reply.ok();
                }
                if offset < DOTDOT_OFFSET && reply.add(parent, DOTDOT_OFFSET, fuser::FileType::Directory, "..") {
                    return reply.ok();
                }
                for e in r.entries {
                    let off = e.cookie + DOTDOT_OFFSET;
                    if reply.add(INodeNo(e.ino.0), off, file_type(e.kind), OsStr::from_bytes(&e.name)) {
                        break;
                    }
                }
                reply.ok()
            },
        );
    }

    fn readdirplus(&self, req: &Request, i: INodeNo, _fh: FileHandle, offset: u64, reply: ReplyDirectoryPlus) {
        let (s, ctx) = (self.shared.clone(), self.ctx(req));
        let parent = self.shared.parents.parent_of(i.0);
        let s2 = self.shared.clone();
        self.here(
            "readdirplus",
            reply,
            async move {
                // A listing cannot be retried by the kernel: errors go out as they are (a
                // removed directory answers ENOENT, as Linux does).
                let ticket = s.client.ticket();
                let me = if offset < DOTDOT_OFFSET { Some(s.client.getattr(&ctx, ino(i)).await?) } else { None };
                let cookie = offset.saturating_sub(DOTDOT_OFFSET);
                let r = s.client.readdir(&ctx, ino(i), cookie, READDIRPLUS_BATCH, true).await?;
                if r.entries.iter().any(|e| e.attr.is_none()) {
                    return Err(FuseError::Errno(libc::EIO));
                }
                Ok((me, r, ticket))
            },
            move |mut reply, (me, r, ticket)| {
                let ttl = |a: InodeId| s2.client.kernel_ttl(a, ticket);
                if let Some(me) = me {
                    let me = file_attr(&me);
                    let me_ttl = ttl(ino(i));
                    if offset < DOT_OFFSET && reply.add(i, DOT_OFFSET, ".", &me_ttl, &me, Generation(0)) {
                        return reply.ok();
                    }
                    // The kernel takes no attributes from "." and ".." entries, only the inode
                    // number that readdir shows; the entry's part takes it from the attributes.
                    let up = fuser::FileAttr { ino: INodeNo(parent), ..me };
                    if reply.add(INodeNo(parent), DOTDOT_OFFSET, "..", &Duration::ZERO, &up, Generation(0)) {
                        return reply.ok();
                    }
                }
                for e in r.entries {
                    let Some(a) = &e.attr else { break };
                    let off = e.cookie + DOTDOT_OFFSET;
                    let fa = file_attr(a);
                    let t = ttl(e.ino).min(s2.client.kernel_entry_ttl(ino(i), &e.name, ticket));
                    if reply.add(INodeNo(e.ino.0), off, OsStr::from_bytes(&e.name), &t, &fa, Generation(0)) {
                        break;
                    }
                    if fa.kind == fuser::FileType::Directory {
                        s2.parents.record(e.ino.0, i.0);
                    }
                }
                reply.ok()
            },
        );
    }

    fn releasedir(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, reply: ReplyEmpty) {
        reply.ok();
    }

    fn fsyncdir(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        // metad logs every namespace change before acknowledging it; what is pending is the
        // creates this node answered under its delegations, sent now.
        let s = self.shared.clone();
        self.spawn(
            "fsyncdir",
            reply,
            async move {
                s.client.sync_deferred().await;
                Ok(())
            },
            |reply, ()| reply.ok(),
        );
    }

    fn statfs(&self, req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let (s, ctx) = (self.shared.clone(), self.ctx(req));
        self.here("statfs", reply, async move { Ok(s.client.statfs(&ctx).await?) }, |reply, st| {
            let (blocks, bfree, bavail, files, ffree) = statfs_blocks(&st);
            reply.statfs(blocks, bfree, bavail, files, ffree, STATFS_BSIZE, NAMELEN, STATFS_BSIZE)
        });
    }

    fn setxattr(&self, req: &Request, i: INodeNo, name: &OsStr, value: &[u8], flags: i32, reply: ReplyEmpty) {
        if name.as_bytes() == FILE_CAPS || name.as_bytes().starts_with(SYSTEM_XATTRS) {
            // File capabilities are ignored by exec on a nosuid mount; refusing them keeps the
            // answer of getxattr (which never asks metad for them) true. POSIX ACLs
            // (system.posix_acl_*) are not supported: stored as plain values they would not
            // change the mode, and tools (cp -a, tar --acls) that see them refused fall back
            // to chmod.
            reply.error(Errno::from_i32(libc::EOPNOTSUPP));
            return;
        }
        let mut pflags = 0;
        if flags & libc::XATTR_CREATE != 0 {
            pflags |= XATTR_CREATE;
        }
        if flags & libc::XATTR_REPLACE != 0 {
            pflags |= XATTR_REPLACE;
        }
        let (s, ctx, name, value) = (self.shared.clone(), self.ctx(req), name_bytes(name), value.to_vec());
        self.here(
            "setxattr",
            reply,
            async move {
                let r = s.client.setxattr(&ctx, ino(i), &name, &value, pflags).await;
                if let Err(e) = &r {
                    refused_setting(ino(i), &name, e);
                }
                r.map_err(|e| gone(&s, ino(i), e))
            },
            |reply, ()| reply.ok(),
        );
    }

    fn getxattr(&self, req: &Request, i: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        if name.as_bytes() == FILE_CAPS {
            // Asked by the kernel before every write(2) (to drop capabilities of a modified
            // file). File capabilities have no effect on this nosuid mount and cannot be set
            // (see setxattr): answer without a metad round trip.
            reply.error(Errno::from_i32(libc::ENODATA));
            return;
        }
        let (s, ctx, name) = (self.shared.clone(), self.ctx(req), name_bytes(name));
        self.here(
            "getxattr",
            reply,
            async move {
                let v = s.client.getxattr(&ctx, ino(i), &name).await.map_err(|e| gone(&s, ino(i), e))?;
                Ok((vxattr::probe_size(&name, v.len()), v))
            },
            move |reply, (probe, v)| sized_reply(reply, size, probe, &v),
        );
    }

    fn listxattr(&self, req: &Request, i: INodeNo, size: u32, reply: ReplyXattr) {
        let (s, ctx) = (self.shared.clone(), self.ctx(req));
        self.here(
            "listxattr",
            reply,
            async move { s.client.listxattr(&ctx, ino(i)).await.map_err(|e| gone(&s, ino(i), e)) },
            move |reply, names| {
                let list = xattr_list(&names);
                sized_reply(reply, size, list.len(), &list)
            },
        );
    }

    fn removexattr(&self, req: &Request, i: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let (s, ctx, name) = (self.shared.clone(), self.ctx(req), name_bytes(name));
        self.here(
            "removexattr",
            reply,
            async move { s.client.removexattr(&ctx, ino(i), &name).await.map_err(|e| gone(&s, ino(i), e)) },
            |reply, ()| reply.ok(),
        );
    }

    fn access(&self, req: &Request, i: INodeNo, mask: AccessFlags, reply: ReplyEmpty) {
        // Only called without default_permissions; kept so such a mount still checks at metad.
        let (s, ctx) = (self.shared.clone(), self.ctx(req));
        let mask = (mask.bits() & 7) as u32;
        self.here(
            "access",
            reply,
            async move { s.client.access(&ctx, ino(i), mask).await.map_err(|e| gone(&s, ino(i), e)) },
            |reply, ()| reply.ok(),
        );
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        _umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let exclusive = flags & libc::O_EXCL != 0;
        let truncate = flags & libc::O_TRUNC != 0;
        let append = flags & libc::O_APPEND != 0;
        let open_flags = write_only_flags(flags & libc::O_ACCMODE == libc::O_WRONLY);
        let (s, ctx, name) = (self.shared.clone(), self.ctx(req), name_bytes(name));
        self.here(
            "create",
            reply,
            async move {
                let ticket = s.client.ticket();
                let (r, handle) =
                    s.client.create_open(&ctx, ino(parent), &name, mode & 0o7777, exclusive, None).await?;
                let mut attr = r.attr;
                // The name appeared (another node) between the kernel's lookup and this create:
                // the existing file was opened, and O_TRUNC still applies to it.
                if !r.created && truncate {
                    handle.truncate(0).await?;
                    attr = handle.getattr().await?;
                }
                let candidate = s.backings.candidate(&s.client, &attr);
                let file = OpenFile::new(handle, true, append, attr.clone(), None);
                let ttl = s.client.kernel_ttl(attr.ino, s.client.ticket_after(ticket));
                Ok((s, file, candidate, Timed { attr, ttl }))
            },
            move |reply, (s, file, candidate, t)| {
                let a = file_attr(&t.attr);
                match insert_open(&s, file, candidate, |f| reply.open_backing(f)) {
                    (fh, Some(b)) => {
                        reply.created_passthrough(&t.ttl, &a, Generation(0), fh, FopenFlags::empty(), b.id())
                    }
                    (fh, None) => reply.created(&t.ttl, &a, Generation(0), fh, open_flags),
                }
            },
        );
    }

    fn fallocate(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        // odfs does not reserve space: allocating means making the size cover the range (mode
        // 0), or nothing at all (KEEP_SIZE). Punching a hole deallocates the range on the
        // targets. Collapsing, inserting and zeroing ranges are not supported.
        const PUNCH: i32 = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        if ![0, libc::FALLOC_FL_KEEP_SIZE, PUNCH].contains(&mode) {
            reply.error(Errno::from_i32(libc::EOPNOTSUPP));
            return;
        }
        let Some((f, reply)) = self.open_file(fh, reply) else { return };
        self.spawn(
            "fallocate",
            reply,
            async move {
                let end = offset.checked_add(length).ok_or(FuseError::Errno(libc::EFBIG))?;
                // A passed-through writer's bytes reached the chunk file without the library:
                // its size must count, or an allocation would truncate the file to a stale
                // size and a hole would be clipped to it.
                f.note_passthrough_writes().await?;
                match mode {
                    0 if end > f.handle.size().await => f.handle.truncate(end).await?,
                    PUNCH => f.handle.punch_hole(offset, length).await?,
                    _ => {}
                }
                Ok(())
            },
            |reply, ()| reply.ok(),
        );
    }
}

/// Replies to getxattr/listxattr: `probe` for a size-0 probe, ERANGE when the caller's buffer
/// is too small, the bytes otherwise.
fn sized_reply(reply: ReplyXattr, size: u32, probe: usize, bytes: &[u8]) {
    if size == 0 {
        reply.size(probe as u32);
    } else if bytes.len() > size as usize {
        reply.error(Errno::ERANGE);
    } else {
        reply.data(bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::signal_to_take;

    /// A `/proc/TID/status` of thread `tid` of process `tgid`.
    fn status((tid, tgid, threads): (u32, u32, u32), sig_pnd: u64, shd_pnd: u64, sig_blk: u64) -> String {
        format!(
            "Name:\tflock\nTgid:\t{tgid}\nPid:\t{tid}\nThreads:\t{threads}\nSigQ:\t0/95519\n\
             SigPnd:\t{sig_pnd:016x}\nShdPnd:\t{shd_pnd:016x}\nSigBlk:\t{sig_blk:016x}\n\
             SigIgn:\t0000000000000000\n"
        )
    }

    #[test]
    fn a_waiter_ends_its_wait_only_for_a_signal_it_will_take() {
        let bit = |sig: i32| 1u64 << (sig - 1);
        let (kill, alrm) = (bit(libc::SIGKILL), bit(libc::SIGALRM));
        let (alone, main, other) = ((7, 7, 1), (7, 7, 4), (9, 7, 4));
        assert!(!signal_to_take(&status(alone, 0, 0, 0)), "nothing pending");
        assert!(signal_to_take(&status(other, kill, 0, !kill)), "a fatal signal, whatever is blocked");
        assert!(signal_to_take(&status(other, alrm, 0, 0)), "sent to the thread");
        assert!(!signal_to_take(&status(alone, alrm, 0, alrm)), "blocked on the thread");
        assert!(signal_to_take(&status(alone, 0, alrm, 0)), "sent to a process of one thread");
        assert!(!signal_to_take(&status(alone, 0, alrm, alrm)), "blocked by its only thread");
        assert!(signal_to_take(&status(main, 0, alrm, 0)), "sent to the process, its main thread waits");
        assert!(!signal_to_take(&status(main, 0, alrm, alrm)), "blocked by the main thread");
        assert!(!signal_to_take(&status(other, 0, alrm, 0)), "another thread may take it");
        assert!(!signal_to_take(""), "an unreadable status");
    }
}
