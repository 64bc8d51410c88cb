//! The FUSE minimum: a synthetic, read-only, in-memory filesystem that answers every request
//! on the reader thread that read it, with the longest caching FUSE allows (an hour of TTL,
//! `FOPEN_KEEP_CACHE | FOPEN_NOFLUSH`, cached listings). It does no I/O and keeps no state, so
//! what a workload costs on it is what the FUSE protocol itself costs on this machine — the
//! bound under any FUSE filesystem, odfs included. `odfs bench --mount` reads its small files
//! on it, mounted the way odfs-fuse mounts (same reader threads; cloned descriptors, as
//! odfs-fuse has them where it does not splice its reads).
//!
//! Its tree is the small-file tree of the benchmark: `/d{k}/s{i}` for `i < files`,
//! `k = i % dirs`, each file `template` with its first 8 bytes replaced by `i` (little-endian);
//! and, with [`MinimumFs::with_large`], fio's large files `/seq.{k}.0`, whose bytes are a fixed
//! pattern replied straight from one buffer (no copy but the kernel's), so that sequential and
//! 4 KiB random reads on it measure FUSE's own cost per byte and per request.
//! With [`MinimumFs::with_remote_large`] the large files' bytes are instead fetched for each
//! READ over loopback TCP from a [`FileServer`] that `sendfile`s them from real files: one
//! request and one reply per READ, received into a buffer the reply is written from. That is
//! the least any filesystem whose bytes reach its FUSE daemon over a network can do per READ
//! (no protocol, no metadata, no daemon between), so it bounds every such read path of odfs.
//! With [`MinimumFs::with_disk_large`] they are instead read for each READ from real files on
//! the disk, `O_DIRECT` into a buffer of the reader thread that the reply is written from: the
//! disk's DMA fills it, no page cache but the mount's holds the bytes, and the only copy is
//! the kernel's into the mount's page cache. That is the least any filesystem whose FUSE daemon
//! serves bytes from a disk can do per READ (no network, protocol or daemon between), so it
//! bounds every buffered read through a FUSE mount of data on disk, odfs's included.
//! With both (`with_remote_large` and `with_disk_large`) the large files are striped as odfs's
//! default layout stripes a file over four nodes, seen from one of them: of every four
//! [`STRIPE_UNIT`] chunks, the first is read from the disk and the other three are fetched over
//! TCP. A READ costs what it must cost there at least, so this minimum bounds every read of a
//! default-striped file through the mount of one of its four nodes.
//! With [`MinimumFs::with_remote_writes`] a WRITE to a file it made is instead sent over
//! loopback TCP to a [`WriteServer`], which writes the bytes into a file of a real directory
//! (`O_DIRECT` where aligned, as stored writes chunk data), and answered once the server has:
//! the least any filesystem whose daemon sends written bytes over a network to a disk can do
//! per WRITE, which bounds odfs's writes to remote chunks.
//! With `no_open` every OPEN is answered ENOSYS: the kernel then sends no OPEN or RELEASE for
//! any file again (FUSE's no-open mode, which has no per-open state), which shows what those
//! two requests cost.
//! With [`MinimumFs::with_creates`] it is mounted read-write and makes directories and empty
//! files anywhere: each MKDIR or CREATE gets a new inode number and its attributes at once;
//! directories are remembered by name (a path to them is looked up again), files are not (a
//! LOOKUP of a file's name is answered "no such name", as an exclusive create's always is).
//! An mdtest-style create through it costs what FUSE's own requests for a create cost
//! (LOOKUP, CREATE, FLUSH, RELEASE): the bound under any FUSE filesystem's creates. A WRITE
//! to a file it made is answered at once as written (the bytes are dropped), so a small
//! file's create, write and close cost FUSE's requests alone too.

use fuser::{Errno, FileAttr, FileHandle, FileType, FopenFlags, Generation, INodeNo, LockOwner, OpenFlags, WriteFlags};
use odfs_client_fuse::fs::{MAX_BACKGROUND, MAX_READAHEAD, MAX_WRITE};
use odfs_client_fuse::mount::SESSION_THREADS;
use odfs_fuse_kernel::abi::init;
use odfs_fuse_kernel::reply::{
    ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyWrite,
};
use odfs_fuse_kernel::session::{
    Acl, Filesystem, KernelConfig, MountOptions, Request, RingOptions, Session, Unmounter,
};
use std::ffi::OsStr;
use std::fs::File;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, UNIX_EPOCH};

const TTL: Duration = Duration::from_secs(3600);

/// The synthetic tree (see the module's documentation).
pub struct MinimumFs {
    files: u64,
    dirs: u64,
    template: Vec<u8>,
    no_open: bool,
    large: u64,
    large_size: u64,
    /// The large files' bytes: `LARGE_PERIOD` bytes of pattern, then room for the longest read.
    large_block: Vec<u8>,
    /// Set when the large files' bytes come over TCP instead (`with_remote_large`).
    remote: Option<Remote>,
    /// Set when the large files' bytes come from files on the disk instead (`with_disk_large`).
    disk: Option<Vec<DiskFile>>,
    /// Set when made files' WRITEs go over TCP to a disk (`with_remote_writes`).
    remote_writes: Option<Remote>,
    /// Set when MKDIR and CREATE are answered (`with_creates`).
    made: Option<Made>,
    /// Reader threads, when not the default for the tree (`with_threads`).
    threads: Option<usize>,
    /// Asks for FUSE's io_uring transport at INIT (`mount_uring`).
    uring: bool,
}

/// A mounted minimum (what [`MinimumFs::mount`] returns); unmounted when dropped.
pub struct MinimumMount {
    unmounter: Unmounter,
    thread: Option<std::thread::JoinHandle<std::io::Result<()>>>,
}

impl MinimumMount {
    /// Unmounts and waits for the session's threads (a connection the kernel aborted is an
    /// end like any: `session_end`).
    pub fn unmount(mut self) -> std::io::Result<()> {
        let unmounted = self.unmounter.unmount();
        let thread = self.thread.take().expect("a mounted minimum's session thread");
        let ended = thread.join().unwrap_or_else(|_| Err(std::io::Error::other("a FUSE minimum thread panicked")));
        unmounted?;
        odfs_client_fuse::mount::session_end(ended).map(drop)
    }
}

impl Drop for MinimumMount {
    fn drop(&mut self) {
        let _ = self.unmounter.unmount();
    }
}

/// What MKDIR and CREATE made: how many inodes, and the directories by parent and name.
#[derive(Default)]
struct Made {
    count: AtomicU64,
    dirs: Mutex<std::collections::HashMap<(u64, std::ffi::OsString), u64>>,
}

/// Reader threads of the networked minimum: each waits out its READ's round trip, so there are
/// as many as keep the sender busy (odfs-fuse's reads wait on tasks, not on its reader threads).
const REMOTE_THREADS: usize = 8;

/// The chunk of the striped minimum (odfs's default chunk size).
pub const STRIPE_UNIT: u64 = odfs_proto::layout::DEFAULT_CHUNK_SIZE as u64;
/// Nodes a striped minimum's file is spread over (odfs's default stripe count); this node
/// holds the first chunk of every such many.
const STRIPE_NODES: u64 = odfs_proto::layout::DEFAULT_STRIPE_COUNT as u64;

/// The large files repeat a pattern this long (a multiple of every read's alignment).
const LARGE_PERIOD: usize = 1 << 20;
/// Longest READ a kernel sends (FUSE's largest `max_pages`, 256 pages, is 1 MiB; kept wide).
const LARGE_MAX_READ: usize = 4 << 20;

/// Inode numbers of what MKDIR and CREATE made start here: `MADE_BASE + 2 * n`, plus one for a
/// directory (far above any tree the benchmark asks for).
const MADE_BASE: u64 = 1 << 40;

/// What an inode number is.
enum Node {
    Root,
    Dir(u64),
    File(u64),
    Large(u64),
    /// Made by MKDIR (`dir`) or CREATE: its inode number.
    Made {
        ino: u64,
        dir: bool,
    },
}

impl MinimumFs {
    /// The small-file tree only.
    pub fn new(files: u64, dirs: u64, template: Vec<u8>, no_open: bool) -> Self {
        MinimumFs {
            files,
            dirs,
            template,
            no_open,
            large: 0,
            large_size: 0,
            large_block: Vec::new(),
            remote: None,
            disk: None,
            remote_writes: None,
            made: None,
            threads: None,
            uring: false,
        }
    }

    /// Mounted read-write, making directories and empty files (see the module's documentation).
    pub fn with_creates(mut self) -> Self {
        self.made = Some(Made::default());
        self
    }

    /// Adds `count` large files of `size` bytes each (`/seq.{k}.0`).
    pub fn with_large(mut self, count: u64, size: u64) -> Self {
        self.large = count;
        self.large_size = size;
        self.large_block = (0..LARGE_PERIOD + LARGE_MAX_READ).map(|i| (i % 251) as u8).collect();
        self
    }

    /// Adds large files `/seq.{k}.0` of `size` bytes each whose bytes are those of `server`'s
    /// k-th file, fetched for each READ over TCP.
    pub fn with_remote_large(mut self, server: &FileServer, size: u64) -> Self {
        self.large = server.addrs.len() as u64;
        self.large_size = size;
        self.remote = Some(Remote { idle: server.addrs.iter().map(|a| (*a, Mutex::new(Vec::new()))).collect() });
        self
    }

    /// Adds large files `/seq.{k}.0` of `size` bytes each whose bytes are those of the k-th of
    /// `files`, read for each READ from the disk (see the module's documentation).
    pub fn with_disk_large(mut self, files: &[PathBuf], size: u64) -> std::io::Result<Self> {
        self.large = files.len() as u64;
        self.large_size = size;
        self.disk = Some(files.iter().map(|f| DiskFile::open(f)).collect::<std::io::Result<_>>()?);
        Ok(self)
    }

    /// Made files' WRITEs are sent to `server`, which writes them to disk, and answered once
    /// it has (see the module's documentation).
    pub fn with_remote_writes(mut self, server: &WriteServer) -> Self {
        self.remote_writes = Some(Remote { idle: vec![(server.listener.addr, Mutex::new(Vec::new()))] });
        self
    }

    /// Served by `n` reader threads instead of the default (`SESSION_THREADS`, or
    /// `REMOTE_THREADS` where a READ or WRITE waits on the network or the disk): a minimum whose
    /// threads wait out round trips reaches its best rate only with enough of them.
    pub fn with_threads(mut self, n: usize) -> Self {
        self.threads = Some(n.max(1));
        self
    }

    /// Mounts the tree at `at` (root only: `mount(2)`), served by reader threads of this
    /// process on `/dev/fuse` until [`MinimumMount::unmount`].
    pub fn mount(self, at: &Path) -> std::io::Result<MinimumMount> {
        // Threads that wait out a round trip or the disk: as many as keep it busy.
        let remote = self.remote.is_some() || self.remote_writes.is_some() || self.disk.is_some();
        let threads = self.threads.unwrap_or(if remote { REMOTE_THREADS } else { SESSION_THREADS });
        self.serve(at, threads, RingOptions::default())
    }

    /// Mounts the tree at `at` as [`MinimumFs::mount`] does, but asking the kernel for its
    /// io_uring transport: `rings` says how the queues are served. Fails at INIT when the
    /// kernel offers none (`enable_uring` off, or older than 6.14).
    pub(crate) fn mount_uring(mut self, at: &Path, rings: RingOptions<MinimumFs>) -> std::io::Result<MinimumMount> {
        self.uring = true;
        self.serve(at, SESSION_THREADS, rings)
    }

    /// Mounts, answers INIT and serves on `threads` reader threads (each its own clone of
    /// the device, as odfs-fuse reads where it does not splice).
    fn serve(self, at: &Path, threads: usize, rings: RingOptions<MinimumFs>) -> std::io::Result<MinimumMount> {
        let options = MountOptions {
            fsname: "odfs-minimum".into(),
            subtype: "odfs-minimum".into(),
            allow_other: false,
            default_permissions: true,
            noatime: false,
            read_only: self.made.is_none(),
        };
        let mut session = Session::mount(at, &options, Acl::All)?;
        session.init(&self)?;
        let unmounter = session.unmounter();
        let thread = std::thread::Builder::new()
            .name("minimum-session".into())
            .spawn(move || session.run_with(self, threads, true, rings))?;
        // Read-ahead as odfs-fuse's mount has it (READs of up to 1 MiB, not 128 KiB).
        odfs_client_fuse::mount::tune_readahead(&at.canonicalize()?);
        Ok(MinimumMount { unmounter, thread: Some(thread) })
    }

    fn node(&self, ino: INodeNo) -> Option<Node> {
        match ino.0 {
            1 => Some(Node::Root),
            n if n >= 2 && n < 2 + self.dirs => Some(Node::Dir(n - 2)),
            n if n >= 2 + self.dirs && n < 2 + self.dirs + self.files => Some(Node::File(n - 2 - self.dirs)),
            n if n >= self.first_large() && n < self.first_large() + self.large => {
                Some(Node::Large(n - self.first_large()))
            }
            n if n >= MADE_BASE && self.made.is_some() => Some(Node::Made { ino: n, dir: n % 2 == 1 }),
            _ => None,
        }
    }

    fn first_large(&self) -> u64 {
        2 + self.dirs + self.files
    }

    fn attr(&self, node: &Node) -> FileAttr {
        let (ino, kind, size, perm) = match *node {
            Node::Root => (1, FileType::Directory, 4096, 0o755),
            Node::Dir(k) => (2 + k, FileType::Directory, 4096, 0o755),
            Node::File(i) => (2 + self.dirs + i, FileType::RegularFile, self.template.len() as u64, 0o644),
            Node::Large(k) => (self.first_large() + k, FileType::RegularFile, self.large_size, 0o644),
            Node::Made { ino, dir: true } => (ino, FileType::Directory, 4096, 0o777),
            Node::Made { ino, dir: false } => (ino, FileType::RegularFile, 0, 0o666),
        };
        FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: size.div_ceil(512),
            atime: UNIX_EPOCH,
            mtime: UNIX_EPOCH,
            ctime: UNIX_EPOCH,
            crtime: UNIX_EPOCH,
            kind,
            perm,
            nlink: if kind == FileType::Directory { 2 } else { 1 },
            uid: 0,
            gid: 0,
            rdev: 0,
            flags: 0,
            blksize: 4096,
        }
    }

    /// The child `name` of `parent`, if it exists.
    fn child(&self, parent: &Node, name: &OsStr) -> Option<Node> {
        let name = name.to_str()?;
        match *parent {
            Node::Root if name.starts_with("seq.") => {
                let k = name.strip_prefix("seq.")?.strip_suffix(".0")?.parse().ok()?;
                (k < self.large).then_some(Node::Large(k))
            }
            Node::Root => name.strip_prefix('d')?.parse().ok().filter(|&k| k < self.dirs).map(Node::Dir),
            Node::Dir(k) => {
                name.strip_prefix('s')?.parse().ok().filter(|&i| i < self.files && i % self.dirs == k).map(Node::File)
            }
            Node::File(_) | Node::Large(_) | Node::Made { .. } => None,
        }
    }

    /// A new directory's or file's inode number, if this minimum makes them and `parent` is a
    /// directory; a directory is remembered under `name`.
    fn make(&self, parent: INodeNo, name: &OsStr, dir: bool) -> Result<Node, Errno> {
        let made = self.made.as_ref().ok_or(Errno::EROFS)?;
        match self.node(parent) {
            Some(Node::Root | Node::Dir(_) | Node::Made { dir: true, .. }) => {
                let ino = MADE_BASE + 2 * made.count.fetch_add(1, Ordering::Relaxed) + dir as u64;
                if dir {
                    made.dirs.lock().expect("made dirs lock").insert((parent.0, name.to_os_string()), ino);
                }
                Ok(Node::Made { ino, dir })
            }
            Some(_) => Err(Errno::ENOTDIR),
            None => Err(Errno::ENOENT),
        }
    }
}

impl MinimumFs {
    /// How many bytes a READ of a large file at `offset` gets: up to `size`, the longest read
    /// and the file's end.
    fn large_len(&self, offset: u64, size: u32) -> usize {
        (size as usize).min(LARGE_MAX_READ).min(self.large_size.saturating_sub(offset) as usize)
    }

    /// The bytes of a large file at `offset`, up to `size` and the file's end: a slice of the
    /// pattern block, so the reply is written to the kernel with no copy of ours.
    fn large_read(&self, offset: u64, size: u32) -> &[u8] {
        let n = self.large_len(offset, size);
        let start = (offset % LARGE_PERIOD as u64) as usize;
        &self.large_block[start..start + n]
    }
}

/// Where a READ of a striped large file gets its bytes (see [`MinimumFs::striped_read`]).
pub(crate) enum StripedRead {
    /// None: the READ is at or past the file's end.
    Empty,
    /// `want` bytes (`len` rounded up to a page where `O_DIRECT`) read at `offset` from `fd`.
    Disk { fd: std::os::fd::RawFd, offset: u64, want: usize, len: usize },
    /// `len` bytes at `offset` fetched from the server of file `k` at `addr`.
    Remote { k: usize, addr: SocketAddr, offset: u64, len: usize },
}

impl MinimumFs {
    /// How many large files the tree has.
    pub(crate) fn large_files(&self) -> usize {
        self.large as usize
    }

    /// Where a READ of `size` bytes at `offset` of inode `ino` gets its bytes, where `ino` is
    /// a large file of the striped minimum (`with_remote_large` and `with_disk_large`).
    pub(crate) fn striped_read(&self, ino: u64, offset: u64, size: u32) -> Option<StripedRead> {
        let (Some(Node::Large(k)), Some(remote), Some(disk)) = (self.node(INodeNo(ino)), &self.remote, &self.disk)
        else {
            return None;
        };
        let (k, len) = (k as usize, self.large_len(offset, size));
        if len == 0 {
            return Some(StripedRead::Empty);
        }
        if !local_chunk(offset) {
            return Some(StripedRead::Remote { k, addr: remote.idle[k].0, offset, len });
        }
        // O_DIRECT wherever the offset allows (its length rounded up to a page; the file's end
        // makes it short), else buffered.
        let f = &disk[k];
        Some(match &f.direct {
            Some(d) if offset.is_multiple_of(PAGE as u64) => {
                StripedRead::Disk { fd: d.as_raw_fd(), offset, want: len.next_multiple_of(PAGE), len }
            }
            _ => StripedRead::Disk { fd: f.buffered.as_raw_fd(), offset, want: len, len },
        })
    }
}

impl Filesystem for MinimumFs {
    fn init(&self, config: &mut KernelConfig) -> std::io::Result<()> {
        // As odfs-fuse asks: an O_DIRECT or AIO reader's requests arrive together, as many
        // background requests in flight, the same read-ahead, WRITEs as large, no larger.
        let _ = config.want(init::ASYNC_DIO);
        if self.uring {
            config.want(init::OVER_IO_URING).map_err(|_| {
                std::io::Error::other(format!(
                    "the kernel offers no FUSE io_uring transport ({} is not Y, or the kernel is older than 6.14)",
                    crate::uring_minimum::ENABLE_URING
                ))
            })?;
        }
        let _ = config.set_max_background(MAX_BACKGROUND);
        config.set_congestion_threshold(MAX_BACKGROUND / 4 * 3);
        if let Err(max) = config.set_max_readahead(MAX_READAHEAD) {
            let _ = config.set_max_readahead(max);
        }
        if let Err(max) = config.set_max_write(MAX_WRITE) {
            let _ = config.set_max_write(max);
        }
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let made_dir = || {
            let dirs = self.made.as_ref()?.dirs.lock().expect("made dirs lock");
            dirs.get(&(parent.0, name.to_os_string())).map(|&ino| Node::Made { ino, dir: true })
        };
        match self.node(parent).and_then(|p| self.child(&p, name)).or_else(made_dir) {
            Some(n) => reply.entry(&TTL, &self.attr(&n), Generation(0)),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn mkdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, _mode: u32, _umask: u32, reply: ReplyEntry) {
        match self.make(parent, name, true) {
            Ok(n) => reply.entry(&TTL, &self.attr(&n), Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn create(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        _mode: u32,
        _umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        match self.make(parent, name, false) {
            Ok(n) => reply.created(&TTL, &self.attr(&n), Generation(0), FileHandle(0), FopenFlags::empty()),
            Err(e) => reply.error(e),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.node(ino) {
            Some(n) => reply.attr(&TTL, &self.attr(&n)),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn open(&self, _req: &Request, _ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        if self.no_open {
            return reply.error(Errno::ENOSYS);
        }
        reply.opened(FileHandle(0), FopenFlags::FOPEN_KEEP_CACHE | FopenFlags::FOPEN_NOFLUSH);
    }

    fn read(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, size: u32, reply: ReplyData) {
        let i = match self.node(ino) {
            Some(Node::File(i)) => i,
            Some(Node::Large(k)) => {
                let len = self.large_len(offset, size);
                return match (&self.remote, &self.disk) {
                    (Some(_), Some(files)) if local_chunk(offset) => files[k as usize].read(offset, len, reply),
                    (Some(r), _) => r.read(k as usize, offset, len, reply),
                    (None, Some(files)) => files[k as usize].read(offset, len, reply),
                    (None, None) => reply.data(self.large_read(offset, size)),
                };
            }
            Some(Node::Made { dir: false, .. }) => return reply.data(&[]),
            _ => return reply.error(Errno::EISDIR),
        };
        let len = self.template.len() as u64;
        let (start, end) = (offset.min(len), (offset + size as u64).min(len));
        let mut data = self.template[start as usize..end as usize].to_vec();
        // The index over bytes 0..8, where this read covers them.
        let index = i.to_le_bytes();
        for (k, b) in data.iter_mut().enumerate().take(8usize.saturating_sub(start as usize)) {
            *b = index[start as usize + k];
        }
        reply.data(&data);
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        reply: ReplyWrite,
    ) {
        match self.node(ino) {
            Some(Node::Made { dir: false, ino }) => match &self.remote_writes {
                Some(r) => r.write(ino, offset, data, reply),
                None => reply.written(data.len() as u32),
            },
            Some(Node::Made { dir: true, .. }) => reply.error(Errno::EISDIR),
            Some(_) => reply.error(Errno::EROFS),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn flush(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _lock_owner: LockOwner, reply: ReplyEmpty) {
        reply.ok();
    }

    fn release(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _owner: Option<LockOwner>, reply: ReplyEmpty) {
        reply.ok();
    }

    // What fio asks of the files it lays out and writes (xattrs, fallocate) is refused by the
    // trait's defaults (ENOSYS, so the kernel stops asking).

    fn fsync(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, _datasync: bool, reply: ReplyEmpty) {
        // Written files' bytes made durable, as odfs's fsync does (fio's end_fsync).
        match (self.node(ino), &self.remote_writes) {
            (Some(Node::Made { dir: false, ino }), Some(r)) => r.sync(ino, reply),
            _ => reply.error(Errno::ENOSYS),
        }
    }

    fn opendir(&self, _req: &Request, _ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        reply.opened(FileHandle(0), FopenFlags::FOPEN_CACHE_DIR | FopenFlags::FOPEN_KEEP_CACHE);
    }

    fn readdir(&self, _req: &Request, ino: INodeNo, _fh: FileHandle, offset: u64, mut reply: ReplyDirectory) {
        let children: Box<dyn Iterator<Item = (Node, String)>> = match self.node(ino) {
            Some(Node::Root) => Box::new(
                (0..self.dirs)
                    .map(|k| (Node::Dir(k), format!("d{k}")))
                    .chain((0..self.large).map(|k| (Node::Large(k), format!("seq.{k}.0")))),
            ),
            Some(Node::Dir(k)) => {
                Box::new((k..self.files).step_by(self.dirs as usize).map(|i| (Node::File(i), format!("s{i}"))))
            }
            // Nothing made is kept: a made directory lists empty.
            Some(Node::Made { dir: true, .. }) => Box::new(std::iter::empty()),
            _ => return reply.error(Errno::ENOTDIR),
        };
        for (n, (node, name)) in children.enumerate().skip(offset as usize) {
            let a = self.attr(&node);
            if reply.add(a.ino, n as u64 + 1, a.kind, name) {
                break;
            }
        }
        reply.ok();
    }
}

/// The client side of the networked minimum: per file, connections to its server not in use
/// (a READ takes one, or opens one, and puts it back), each with its receive buffer.
struct Remote {
    idle: Vec<(SocketAddr, Mutex<Vec<Conn>>)>,
}

struct Conn {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Remote {
    /// A connection to server `k` not in use, or a new one (with a receive buffer when `buf`).
    fn take(&self, k: usize, buf: bool) -> std::io::Result<Conn> {
        let (addr, idle) = &self.idle[k];
        let conn = idle.lock().expect("connection pool").pop();
        match conn {
            Some(c) => Ok(c),
            None => {
                connect(*addr).map(|s| Conn { stream: s, buf: if buf { vec![0; LARGE_MAX_READ] } else { Vec::new() } })
            }
        }
    }

    /// Replies to a READ of `len` bytes at `offset` of file `k` with the server's bytes.
    fn read(&self, k: usize, offset: u64, len: usize, reply: ReplyData) {
        let idle = &self.idle[k].1;
        let fetched = self.take(k, true).and_then(|mut c| {
            c.stream.write_all(&range_request(offset, len))?;
            c.stream.read_exact(&mut c.buf[..len])?;
            Ok(c)
        });
        match fetched {
            Ok(c) => {
                reply.data(&c.buf[..len]);
                idle.lock().expect("connection pool").push(c);
            }
            Err(_) => reply.error(Errno::EIO),
        }
    }

    /// Sends a WRITE of `data` at `offset` of made file `ino` to the write server; replies
    /// once the server has written it.
    fn write(&self, ino: u64, offset: u64, data: &[u8], reply: ReplyWrite) {
        match self.ask_writer(ino, offset, data.len() as u64, data) {
            Ok(()) => reply.written(data.len() as u32),
            Err(_) => reply.error(Errno::EIO),
        }
    }

    /// Asks the write server to make made file `ino`'s bytes durable (`fdatasync`).
    fn sync(&self, ino: u64, reply: ReplyEmpty) {
        match self.ask_writer(ino, 0, SYNC, &[]) {
            Ok(()) => reply.ok(),
            Err(_) => reply.error(Errno::EIO),
        }
    }

    /// One request to the write server and its answer, on a pooled connection.
    fn ask_writer(&self, ino: u64, offset: u64, len: u64, data: &[u8]) -> std::io::Result<()> {
        let mut c = self.take(0, false)?;
        let mut req = [0u8; 24];
        req[..8].copy_from_slice(&ino.to_le_bytes());
        req[8..16].copy_from_slice(&offset.to_le_bytes());
        req[16..].copy_from_slice(&len.to_le_bytes());
        c.stream.write_all(&req)?;
        c.stream.write_all(data)?;
        let mut ack = [0u8; 1];
        c.stream.read_exact(&mut ack)?;
        self.idle[0].1.lock().expect("connection pool").push(c);
        match ack[0] {
            0 => Ok(()),
            _ => Err(std::io::ErrorKind::Other.into()),
        }
    }
}

/// A connection to a minimum's server, without Nagle's delay (every request is one small write).
pub(crate) fn connect(addr: SocketAddr) -> std::io::Result<TcpStream> {
    let s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    Ok(s)
}

/// The [`FileServer`]'s request for `len` bytes at `offset`.
pub(crate) fn range_request(offset: u64, len: usize) -> [u8; 16] {
    let mut req = [0u8; 16];
    req[..8].copy_from_slice(&offset.to_le_bytes());
    req[8..].copy_from_slice(&(len as u64).to_le_bytes());
    req
}

/// Whether the striped minimum's bytes at `offset` are in this node's chunk (read from the
/// disk) or another node's (fetched over TCP).
pub(crate) fn local_chunk(offset: u64) -> bool {
    (offset / STRIPE_UNIT).is_multiple_of(STRIPE_NODES)
}

/// Serves byte ranges of files over loopback TCP to the networked minimum: a request is the
/// offset and length (two little-endian u64), the reply those bytes, sent with `sendfile` from
/// the file (no copy of the server's own). One listener per file, one thread per connection.
pub struct FileServer {
    addrs: Vec<SocketAddr>,
    _listeners: Vec<Listener>,
}

impl FileServer {
    /// The loopback port serving each file, in the order given to [`FileServer::start`].
    pub fn addrs(&self) -> &[SocketAddr] {
        &self.addrs
    }

    /// Serves `files`, each on a loopback port of its own.
    pub fn start(files: &[PathBuf]) -> std::io::Result<FileServer> {
        let mut listeners = Vec::new();
        for f in files {
            let file = Arc::new(File::open(f)?);
            listeners.push(Listener::start(move |conn| serve_ranges(conn, &file))?);
        }
        Ok(FileServer { addrs: listeners.iter().map(|l| l.addr).collect(), _listeners: listeners })
    }
}

/// A loopback port whose every connection is served by `serve` on a thread of its own; stops
/// accepting when dropped.
struct Listener {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Listener {
    fn start(serve: impl Fn(TcpStream) + Send + Sync + 'static) -> std::io::Result<Listener> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let (flag, serve) = (stop.clone(), Arc::new(serve));
        let thread = std::thread::spawn(move || {
            for conn in listener.incoming() {
                if flag.load(Ordering::Relaxed) {
                    return;
                }
                let (Ok(conn), serve) = (conn, serve.clone()) else { continue };
                // Named, so that a profile tells the server's CPU from the FUSE daemon's.
                let _ = std::thread::Builder::new().name("minimum-server".into()).spawn(move || serve(conn));
            }
        });
        Ok(Listener { addr, stop, thread: Some(thread) })
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wakes the accept; it sees `stop` and returns. Joined only once woken.
        if TcpStream::connect(self.addr).is_ok() {
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
    }
}

/// Answers one connection's requests until it closes (or a range runs past the file's end).
fn serve_ranges(mut conn: TcpStream, file: &File) {
    let _ = conn.set_nodelay(true);
    let mut req = [0u8; 16];
    while conn.read_exact(&mut req).is_ok() {
        let mut off = i64::from_le_bytes(req[..8].try_into().expect("8 bytes"));
        let mut left = u64::from_le_bytes(req[8..].try_into().expect("8 bytes")) as usize;
        while left > 0 {
            // SAFETY: both descriptors are open for the call; `off` is a valid off_t.
            let n = unsafe { libc::sendfile(conn.as_raw_fd(), file.as_raw_fd(), &mut off, left) };
            if n <= 0 {
                return;
            }
            left -= n as usize;
        }
    }
}

/// A write server request's length that asks for an `fdatasync` of the file instead.
const SYNC: u64 = u64::MAX;

/// Writes what the networked minimum's WRITEs send into files of a directory (`w{ino}`, made
/// when first written): a request is the inode, offset and length (three little-endian u64)
/// and the bytes, the reply one byte (0: written); a length of [`SYNC`] asks for an
/// `fdatasync` of the file. Bytes are received into a page-aligned
/// buffer and written `O_DIRECT` when offset and length are aligned, as stored writes chunk
/// data, else through the page cache. One listener, one thread per connection.
pub struct WriteServer {
    listener: Listener,
}

impl WriteServer {
    /// Serves writes into `dir` (made if missing) on a loopback port.
    pub fn start(dir: &Path) -> std::io::Result<WriteServer> {
        std::fs::create_dir_all(dir)?;
        let dir = dir.to_path_buf();
        Ok(WriteServer { listener: Listener::start(move |conn| serve_writes(conn, &dir))? })
    }
}

/// Page size: `O_DIRECT`'s alignment of offsets, lengths and buffers.
const PAGE: usize = 4096;

/// A large file of the disk-backed minimum: its descriptors, buffered and `O_DIRECT`.
struct DiskFile {
    buffered: File,
    /// `None` where the file system refuses `O_DIRECT` (the reads are then buffered).
    direct: Option<File>,
}

thread_local! {
    /// A reader thread's buffer for disk-backed READs: the longest read, from a page boundary.
    static DISK_BUF: std::cell::RefCell<Vec<u8>> = std::cell::RefCell::new(vec![0; LARGE_MAX_READ + PAGE]);
}

/// Reads into all of `buf` from `offset`, short only at the file's end (a short reply would
/// read as the file's end to the kernel).
fn read_full(f: &File, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    use std::os::unix::fs::FileExt;
    let mut done = 0;
    while done < buf.len() {
        match f.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

impl DiskFile {
    fn open(path: &Path) -> std::io::Result<DiskFile> {
        use std::os::unix::fs::OpenOptionsExt;
        let buffered = File::open(path)?;
        let direct = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path).ok();
        Ok(DiskFile { buffered, direct })
    }

    /// Replies to a READ of `len` bytes at `offset` with the file's bytes, read for it.
    fn read(&self, offset: u64, len: usize, reply: ReplyData) {
        DISK_BUF.with_borrow_mut(|space| {
            let pad = space.as_ptr().align_offset(PAGE);
            // O_DIRECT needs the length aligned too: a READ ending in the file's last partial
            // page asks for the whole page and gets what there is.
            let want = len.next_multiple_of(PAGE);
            let buf = &mut space[pad..pad + want];
            let read = match &self.direct {
                Some(f) if offset.is_multiple_of(PAGE as u64) => read_full(f, buf, offset),
                _ => read_full(&self.buffered, &mut buf[..len], offset),
            };
            match read {
                Ok(n) => reply.data(&buf[..n.min(len)]),
                Err(e) => reply.error(Errno::from_i32(e.raw_os_error().unwrap_or(libc::EIO))),
            }
        });
    }
}

/// Answers one connection's writes until it closes.
fn serve_writes(mut conn: TcpStream, dir: &Path) {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let _ = conn.set_nodelay(true);
    // Receive buffer starting on a page boundary.
    let mut space = vec![0u8; LARGE_MAX_READ + PAGE];
    let pad = space.as_ptr().align_offset(PAGE);
    let mut files: std::collections::HashMap<u64, (File, Option<File>)> = std::collections::HashMap::new();
    let mut req = [0u8; 24];
    while conn.read_exact(&mut req).is_ok() {
        let word = |i: usize| u64::from_le_bytes(req[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
        let (ino, offset, len) = (word(0), word(1), word(2));
        let path = || dir.join(format!("w{ino}"));
        if len == SYNC {
            // The file may have been written through other connections only: any descriptor
            // of it syncs what all of them wrote.
            let synced = match files.get(&ino) {
                Some((f, _)) => f.sync_data(),
                None => match File::open(path()) {
                    Ok(f) => f.sync_data(),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                    Err(e) => Err(e),
                },
            };
            if conn.write_all(&[u8::from(synced.is_err())]).is_err() {
                return;
            }
            continue;
        }
        let len = len as usize;
        if len > LARGE_MAX_READ {
            return;
        }
        let buf = &mut space[pad..pad + len];
        if conn.read_exact(buf).is_err() {
            return;
        }
        let written = (|| -> std::io::Result<()> {
            let (buffered, direct) = match files.entry(ino) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(v) => {
                    let path = path();
                    let open =
                        |flags| std::fs::OpenOptions::new().write(true).create(true).custom_flags(flags).open(&path);
                    v.insert((open(0)?, open(libc::O_DIRECT).ok()))
                }
            };
            let aligned = offset.is_multiple_of(PAGE as u64) && len.is_multiple_of(PAGE);
            match direct {
                Some(f) if aligned => match f.write_all_at(buf, offset) {
                    // The filesystem opens O_DIRECT but refuses the write: buffered from now on.
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                        *direct = None;
                        buffered.write_all_at(buf, offset)
                    }
                    r => r,
                },
                _ => buffered.write_all_at(buf, offset),
            }
        })();
        if conn.write_all(&[u8::from(written.is_err())]).is_err() {
            return;
        }
    }
}
