//! The FUSE minimum: a synthetic, read-only, in-memory filesystem that answers every request
//! on the reader thread that read it, with the longest caching FUSE allows (an hour of TTL,
//! `FOPEN_KEEP_CACHE | FOPEN_NOFLUSH`, cached listings). It does no I/O and keeps no state, so
//! what a workload costs on it is what the FUSE protocol itself costs on this machine — the
//! bound under any FUSE filesystem, odfs included. `odfs bench --mount` reads its small files
//! on it, mounted the way odfs-fuse mounts (same reader threads, cloned descriptors).
//!
//! Its tree is the small-file tree of the benchmark: `/d{k}/s{i}` for `i < files`,
//! `k = i % dirs`, each file `template` with its first 8 bytes replaced by `i` (little-endian).
//! With `no_open` every OPEN is answered ENOSYS: the kernel then sends no OPEN or RELEASE for
//! any file again (FUSE's no-open mode, which has no per-open state), which shows what those
//! two requests cost.

use crate::mount::SESSION_THREADS;
use fuser::{
    BackgroundSession, Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    LockOwner, MountOption, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen,
    Request, Session,
};
use std::ffi::OsStr;
use std::path::Path;
use std::time::{Duration, UNIX_EPOCH};

const TTL: Duration = Duration::from_secs(3600);

/// The synthetic tree (see the module's documentation).
pub struct MinimumFs {
    pub files: u64,
    pub dirs: u64,
    pub template: Vec<u8>,
    pub no_open: bool,
}

/// What an inode number is.
enum Node {
    Root,
    Dir(u64),
    File(u64),
}

impl MinimumFs {
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
            _ => None,
        }
    }

    fn attr(&self, node: &Node) -> FileAttr {
        let (ino, kind, size, perm) = match *node {
            Node::Root => (1, FileType::Directory, 4096, 0o755),
            Node::Dir(k) => (2 + k, FileType::Directory, 4096, 0o755),
            Node::File(i) => (2 + self.dirs + i, FileType::RegularFile, self.template.len() as u64, 0o644),
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
            Node::Root => name.strip_prefix('d')?.parse().ok().filter(|&k| k < self.dirs).map(Node::Dir),
            Node::Dir(k) => {
                name.strip_prefix('s')?.parse().ok().filter(|&i| i < self.files && i % self.dirs == k).map(Node::File)
            }
            Node::File(_) => None,
        }
    }
}

impl Filesystem for MinimumFs {
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
        let Some(Node::File(i)) = self.node(ino) else { return reply.error(Errno::EISDIR) };
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
            Some(Node::Root) => Box::new((0..self.dirs).map(|k| (Node::Dir(k), format!("d{k}")))),
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
