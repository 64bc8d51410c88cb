//! The FUSE minimum: a synthetic, read-only, in-memory filesystem that answers every request
//! on the reader thread that read it, with the longest caching FUSE allows (an hour of TTL,
//! `FOPEN_KEEP_CACHE | FOPEN_NOFLUSH`, cached listings). It does no I/O and keeps no state, so
//! what a workload costs on it is what the FUSE protocol itself costs on this machine — the
//! bound under any FUSE filesystem, odfs included. `odfs bench --mount` reads its small files
//! on it, mounted the way odfs-fuse mounts (same reader threads, cloned descriptors).
//!
//! Its tree is the small-file tree of the benchmark: `/d{k}/s{i}` for `i < files`,
//! `k = i % dirs`, each file `template` with its first 8 bytes replaced by `i` (little-endian);
//! and, with [`MinimumFs::with_large`], fio's large files `/seq.{k}.0`, whose bytes are a fixed
//! pattern replied straight from one buffer (no copy but the kernel's), so that sequential and
//! 4 KiB random reads on it measure FUSE's own cost per byte and per request.
//! With `no_open` every OPEN is answered ENOSYS: the kernel then sends no OPEN or RELEASE for
//! any file again (FUSE's no-open mode, which has no per-open state), which shows what those
//! two requests cost.

use crate::mount::SESSION_THREADS;
use fuser::{
    BackgroundSession, Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    InitFlags, KernelConfig, LockOwner, MountOption, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty,
    ReplyEntry, ReplyOpen, Request, Session,
};
use std::ffi::OsStr;
use std::path::Path;
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
}

/// The large files repeat a pattern this long (a multiple of every read's alignment).
const LARGE_PERIOD: usize = 1 << 20;
/// Longest READ a kernel sends (FUSE's largest `max_pages`, 256 pages, is 1 MiB; kept wide).
const LARGE_MAX_READ: usize = 4 << 20;

/// What an inode number is.
enum Node {
    Root,
    Dir(u64),
    File(u64),
    Large(u64),
}

impl MinimumFs {
    /// The small-file tree only.
    pub fn new(files: u64, dirs: u64, template: Vec<u8>, no_open: bool) -> Self {
        MinimumFs { files, dirs, template, no_open, large: 0, large_size: 0, large_block: Vec::new() }
    }

    /// Adds `count` large files of `size` bytes each (`/seq.{k}.0`).
    pub fn with_large(mut self, count: u64, size: u64) -> Self {
        self.large = count;
        self.large_size = size;
        self.large_block = (0..LARGE_PERIOD + LARGE_MAX_READ).map(|i| (i % 251) as u8).collect();
        self
    }

    /// Mounts the tree at `at` (root only: `mount(2)`); unmounted when the session is dropped.
    pub fn mount(self, at: &Path) -> std::io::Result<BackgroundSession> {
        let mut cfg = Config::default();
        cfg.mount_options =
            vec![MountOption::FSName("odfs-minimum".into()), MountOption::RO, MountOption::DefaultPermissions];
        cfg.n_threads = Some(SESSION_THREADS);
        cfg.clone_fd = true;
        Session::new(self, at, &cfg)?.spawn()
    }

    fn node(&self, ino: INodeNo) -> Option<Node> {
        match ino.0 {
            1 => Some(Node::Root),
            n if n >= 2 && n < 2 + self.dirs => Some(Node::Dir(n - 2)),
            n if n >= 2 + self.dirs && n < 2 + self.dirs + self.files => Some(Node::File(n - 2 - self.dirs)),
            n if n >= self.first_large() && n < self.first_large() + self.large => {
                Some(Node::Large(n - self.first_large()))
            }
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
            Node::File(_) | Node::Large(_) => None,
        }
    }
}

impl MinimumFs {
    /// The bytes of a large file at `offset`, up to `size` and the file's end: a slice of the
    /// pattern block, so the reply is written to the kernel with no copy of ours.
    fn large_read(&self, offset: u64, size: u32) -> &[u8] {
        let n = (size as usize).min(LARGE_MAX_READ).min(self.large_size.saturating_sub(offset) as usize);
        let start = (offset % LARGE_PERIOD as u64) as usize;
        &self.large_block[start..start + n]
    }
}

impl Filesystem for MinimumFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // As odfs-fuse asks: an O_DIRECT or AIO reader's requests arrive together.
        let _ = config.add_capabilities(InitFlags::FUSE_ASYNC_DIO);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        match self.node(parent).and_then(|p| self.child(&p, name)) {
            Some(n) => reply.entry(&TTL, &self.attr(&n), Generation(0)),
            None => reply.error(Errno::ENOENT),
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

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let i = match self.node(ino) {
            Some(Node::File(i)) => i,
            Some(Node::Large(_)) => return reply.data(self.large_read(offset, size)),
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

    fn flush(&self, _req: &Request, _ino: INodeNo, _fh: FileHandle, _lock_owner: LockOwner, reply: ReplyEmpty) {
        reply.ok();
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        reply.ok();
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
