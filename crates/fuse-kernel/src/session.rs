//! A FUSE session with the kernel (docs/architecture.md, "fuse-kernel"): mounting
//! (`mount(2)`, or `fusermount3` where that is refused) and unmounting, the INIT handshake, the
//! threads that read requests from `/dev/fuse` and, where INIT agreed on it, those that take
//! them from io_uring ([`crate::ring`]), and the dispatch of each request, decoded by
//! [`crate::abi`], to the [`Filesystem`] method that answers it through [`crate::reply`].
//!
//! Owns the protocol's rules, not the file system's: which requests need an answer (FORGET and
//! INTERRUPT do not), which callers a mount without `allow_other` serves, what is answered
//! without the file system (ENOSYS for what no file system here implements, so the kernel stops
//! asking), and that a request whose arguments do not decode gets EIO and the session serves on.

use crate::abi::{self, fattr, op, Op};
use crate::reply::{
    Dev, Notifier, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry,
    ReplyLock, ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr, Sink,
};
use crate::ring::{Ops, QueueHandler, RingRequest, Slot};
use fuser::{AccessFlags, Errno, FileHandle, INodeNo, LockOwner, OpenFlags, RenameFlags, TimeOrNow, WriteFlags};
use std::ffi::{CString, OsStr};
use std::fs::{File, OpenOptions};
use std::io::{self, Read};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};
use tracing::{debug, info, warn};

/// The kernel's FUSE device.
const DEV_FUSE: &str = "/dev/fuse";
/// The protocol version answered at INIT (the kernel's, where older): 7.40, passthrough's.
const MAJOR: u32 = 7;
const MINOR: u32 = 40;
/// The oldest protocol spoken: 7.12 (umask in create and mknod, the request layouts decoded).
const OLDEST_MINOR: u32 = 12;
/// Room a read of `/dev/fuse` needs beyond `max_write` (the kernel refuses smaller buffers:
/// the header, WRITE's arguments, and at least 8 KiB in all).
const READ_SLACK: usize = 8192;
/// Largest `max_write` a file system may ask for (the kernel's own limit).
const MAX_WRITE_LIMIT: u32 = 16 << 20;
/// Ring entries per CPU queue with the io_uring transport (requests of one CPU in flight at
/// once), at most: 64, where the FUSE io_uring minimum read 4 KiB fastest (bench/history/,
/// mount runs 66: 34.0k IOPS with 32, 35.7k with 64; and 67: 22.1k, 26.0k).
const RING_ENTRIES_MAX: usize = 64;
/// Each entry holds a payload buffer of the largest request or reply (1 MiB): the entries of
/// all queues together stay within this, down to `RING_ENTRIES_MIN` a queue on machines with
/// many CPUs.
const RING_MEMORY: usize = 256 << 20;
const RING_ENTRIES_MIN: usize = 8;

/// Entries per queue for `queues` queues of `payload`-byte entries.
fn ring_entries(queues: usize, payload: usize) -> usize {
    (RING_MEMORY / (queues.max(1) * payload.max(1))).clamp(RING_ENTRIES_MIN, RING_ENTRIES_MAX)
}

/// A request's caller and identity, as its header gives them.
pub struct Request {
    header: abi::InHeader,
}

impl Request {
    pub fn uid(&self) -> u32 {
        self.header.uid
    }
    pub fn gid(&self) -> u32 {
        self.header.gid
    }
    pub fn pid(&self) -> u32 {
        self.header.pid
    }
    pub fn unique(&self) -> u64 {
        self.header.unique
    }
}

/// What a FUSE file system answers, one method per request kind. Every method must answer
/// through its reply (now, or later from another thread); FORGET needs none. What a file
/// system leaves out is answered ENOSYS, so the kernel stops asking (or does the call itself).
#[allow(clippy::too_many_arguments, unused_variables)]
pub trait Filesystem: Send + Sync + 'static {
    /// Says what the mount asks of the kernel, before any other request. An error refuses
    /// the mount.
    fn init(&self, config: &mut KernelConfig) -> io::Result<()> {
        Ok(())
    }
    fn lookup(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        reply.error(Errno::ENOSYS)
    }
    fn forget(&self, ino: INodeNo, nlookup: u64) {}
    fn getattr(&self, req: &Request, ino: INodeNo, fh: Option<FileHandle>, reply: ReplyAttr) {
        reply.error(Errno::ENOSYS)
    }
    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        fh: Option<FileHandle>,
        reply: ReplyAttr,
    ) {
        reply.error(Errno::ENOSYS)
    }
    fn readlink(&self, req: &Request, ino: INodeNo, reply: ReplyData) {
        reply.error(Errno::ENOSYS)
    }
    fn mknod(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, rdev: u32, reply: ReplyEntry) {
        reply.error(Errno::ENOSYS)
    }
    fn mkdir(&self, req: &Request, parent: INodeNo, name: &OsStr, mode: u32, umask: u32, reply: ReplyEntry) {
        reply.error(Errno::ENOSYS)
    }
    fn unlink(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        reply.error(Errno::ENOSYS)
    }
    fn rmdir(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        reply.error(Errno::ENOSYS)
    }
    fn symlink(&self, req: &Request, parent: INodeNo, link_name: &OsStr, target: &Path, reply: ReplyEntry) {
        reply.error(Errno::ENOSYS)
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
        reply.error(Errno::ENOSYS)
    }
    fn link(&self, req: &Request, ino: INodeNo, newparent: INodeNo, newname: &OsStr, reply: ReplyEntry) {
        reply.error(Errno::ENOSYS)
    }
    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        reply.error(Errno::ENOSYS)
    }
    fn read(&self, req: &Request, ino: INodeNo, fh: FileHandle, offset: u64, size: u32, reply: ReplyData) {
        reply.error(Errno::ENOSYS)
    }
    fn write(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        write_flags: WriteFlags,
        reply: ReplyWrite,
    ) {
        reply.error(Errno::ENOSYS)
    }
    fn flush(&self, req: &Request, ino: INodeNo, fh: FileHandle, lock_owner: LockOwner, reply: ReplyEmpty) {
        reply.error(Errno::ENOSYS)
    }
    /// `lock_owner`: the owner whose `flock` locks go with this release, if any.
    fn release(&self, req: &Request, ino: INodeNo, fh: FileHandle, lock_owner: Option<LockOwner>, reply: ReplyEmpty) {
        reply.error(Errno::ENOSYS)
    }
    fn getlk(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        lock_owner: LockOwner,
        start: u64,
        end: u64,
        typ: i32,
        pid: u32,
        reply: ReplyLock,
    ) {
        reply.error(Errno::ENOSYS)
    }
    fn setlk(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        lock_owner: LockOwner,
        start: u64,
        end: u64,
        typ: i32,
        pid: u32,
        sleep: bool,
        reply: ReplyEmpty,
    ) {
        reply.error(Errno::ENOSYS)
    }
    fn fsync(&self, req: &Request, ino: INodeNo, fh: FileHandle, datasync: bool, reply: ReplyEmpty) {
        reply.error(Errno::ENOSYS)
    }
    fn opendir(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        reply.error(Errno::ENOSYS)
    }
    fn readdir(&self, req: &Request, ino: INodeNo, fh: FileHandle, offset: u64, reply: ReplyDirectory) {
        reply.error(Errno::ENOSYS)
    }
    fn readdirplus(&self, req: &Request, ino: INodeNo, fh: FileHandle, offset: u64, reply: ReplyDirectoryPlus) {
        reply.error(Errno::ENOSYS)
    }
    fn releasedir(&self, req: &Request, ino: INodeNo, fh: FileHandle, reply: ReplyEmpty) {
        reply.error(Errno::ENOSYS)
    }
    fn fsyncdir(&self, req: &Request, ino: INodeNo, fh: FileHandle, datasync: bool, reply: ReplyEmpty) {
        reply.error(Errno::ENOSYS)
    }
    fn statfs(&self, req: &Request, ino: INodeNo, reply: ReplyStatfs) {
        reply.error(Errno::ENOSYS)
    }
    fn setxattr(&self, req: &Request, ino: INodeNo, name: &OsStr, value: &[u8], flags: i32, reply: ReplyEmpty) {
        reply.error(Errno::ENOSYS)
    }
    fn getxattr(&self, req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        reply.error(Errno::ENOSYS)
    }
    fn listxattr(&self, req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        reply.error(Errno::ENOSYS)
    }
    fn removexattr(&self, req: &Request, ino: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        reply.error(Errno::ENOSYS)
    }
    fn access(&self, req: &Request, ino: INodeNo, mask: AccessFlags, reply: ReplyEmpty) {
        reply.error(Errno::ENOSYS)
    }
    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        reply.error(Errno::ENOSYS)
    }
    fn fallocate(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        reply.error(Errno::ENOSYS)
    }
}

/// What the kernel offered at INIT and what the mount asks of it.
pub struct KernelConfig {
    offered: u64,
    wanted: u64,
    kernel_readahead: u32,
    max_readahead: u32,
    max_write: u32,
    max_background: u16,
    congestion_threshold: Option<u16>,
    max_stack_depth: u32,
}

impl KernelConfig {
    fn new(offered: u64, max_readahead: u32) -> KernelConfig {
        use abi::init::*;
        KernelConfig {
            offered,
            // Reads in parallel, WRITEs up to max_write, as many pages a request as that takes.
            wanted: (ASYNC_READ | BIG_WRITES | MAX_PAGES) & offered,
            kernel_readahead: max_readahead,
            max_readahead,
            max_write: 128 << 10,
            max_background: 16,
            congestion_threshold: None,
            max_stack_depth: 0,
        }
    }

    /// Asks for `flags` (`abi::init` bits); the ones the kernel does not offer are the error.
    pub fn want(&mut self, flags: u64) -> Result<(), u64> {
        if flags & !self.offered != 0 {
            return Err(flags & !self.offered);
        }
        self.wanted |= flags;
        Ok(())
    }

    /// Largest WRITE; the kernel's limit is the error.
    pub fn set_max_write(&mut self, v: u32) -> Result<(), u32> {
        if !(4096..=MAX_WRITE_LIMIT).contains(&v) {
            return Err(v.clamp(4096, MAX_WRITE_LIMIT));
        }
        self.max_write = v;
        Ok(())
    }

    /// Read-ahead; at most what the kernel offered (the error).
    pub fn set_max_readahead(&mut self, v: u32) -> Result<(), u32> {
        if v > self.kernel_readahead {
            return Err(self.kernel_readahead);
        }
        self.max_readahead = v;
        Ok(())
    }

    /// Background requests (read-ahead, async direct I/O) in flight at once.
    pub fn set_max_background(&mut self, v: u16) -> Result<(), u16> {
        if v == 0 {
            return Err(1);
        }
        self.max_background = v;
        Ok(())
    }

    /// How many background requests in flight count as congested (3/4 of them unless set).
    pub fn set_congestion_threshold(&mut self, v: u16) {
        self.congestion_threshold = Some(v);
    }

    /// How deep backing files may stack (passthrough): at most 2, the kernel's limit.
    pub fn set_max_stack_depth(&mut self, v: u32) -> Result<(), u32> {
        if v > 2 {
            return Err(2);
        }
        self.max_stack_depth = v;
        Ok(())
    }

    /// The INIT answer, for a kernel speaking protocol 7.`minor`.
    fn answer(&self, minor: u32) -> abi::InitOut {
        let flags = (self.wanted | abi::init::INIT_EXT) & self.offered;
        let pages = self.max_write.max(self.max_readahead).div_ceil(page_size()).max(1);
        abi::InitOut {
            major: MAJOR,
            minor: minor.min(MINOR),
            max_readahead: self.max_readahead,
            flags,
            max_background: self.max_background,
            congestion_threshold: self
                .congestion_threshold
                .unwrap_or((u32::from(self.max_background) * 3 / 4) as u16)
                .min(self.max_background),
            max_write: self.max_write,
            time_gran: 1,
            max_pages: pages.min(u32::from(u16::MAX)) as u16,
            max_stack_depth: if flags & abi::init::PASSTHROUGH != 0 { self.max_stack_depth } else { 0 },
        }
    }
}

/// How a mount is made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountOptions {
    /// The mount's source in /proc/mounts.
    pub fsname: String,
    /// Its type there is `fuse.<subtype>`.
    pub subtype: String,
    /// Other users may enter the mount (the kernel's `allow_other`).
    pub allow_other: bool,
    /// The kernel checks permission bits itself (`default_permissions`).
    pub default_permissions: bool,
    /// Reads do not update access times.
    pub noatime: bool,
    /// Mounted read-only (`ro`): the kernel refuses every change before asking.
    pub read_only: bool,
}

impl MountOptions {
    /// The options as `fusermount3 -o` takes them.
    fn fusermount_options(&self) -> String {
        let mut o = vec![format!("fsname={}", self.fsname), format!("subtype={}", self.subtype)];
        o.push(if self.read_only { "ro" } else { "rw" }.into());
        o.extend(["nosuid", "nodev"].map(String::from));
        for (on, name) in [
            (self.default_permissions, "default_permissions"),
            (self.allow_other, "allow_other"),
            (self.noatime, "noatime"),
        ] {
            if on {
                o.push(name.into());
            }
        }
        o.join(",")
    }
}

/// A mount this session made, until it is unmounted.
struct Mounted {
    path: PathBuf,
    by_fusermount: bool,
    dev: Dev,
}

impl Mounted {
    /// Unmounts, unless the connection has ended already (a second unmount could hit another
    /// mount made since on the same path).
    fn unmount(self) -> io::Result<()> {
        if !connected(&self.dev) {
            return Ok(());
        }
        let c = CString::new(self.path.as_os_str().as_bytes())?;
        if !self.by_fusermount {
            // SAFETY: a NUL-terminated path alive for the call.
            if unsafe { libc::umount2(c.as_ptr(), 0) } == 0 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EPERM) {
                return Err(e);
            }
        }
        let out = Command::new("fusermount3").args(["-u", "-q", "-z", "--"]).arg(&self.path).output()?;
        if !out.status.success() {
            return Err(io::Error::other(format!(
                "fusermount3 -u failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        Ok(())
    }
}

/// Whether the kernel still holds the connection behind `dev` (it reports an error on it once
/// the mount is gone).
fn connected(dev: &File) -> bool {
    let mut p = libc::pollfd { fd: dev.as_raw_fd(), events: 0, revents: 0 };
    // SAFETY: one valid pollfd, no wait.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    !(n == 1 && p.revents & libc::POLLERR != 0)
}

/// Unmounts the session's mount from another thread (on SIGTERM).
pub struct Unmounter {
    mount: Arc<Mutex<Option<Mounted>>>,
}

impl Unmounter {
    pub fn unmount(&mut self) -> io::Result<()> {
        let m = self.mount.lock().expect("mount lock").take();
        m.map_or(Ok(()), Mounted::unmount)
    }
}

/// Whom a mount serves: its owner only (the kernel's rule without `allow_other`, kept here too),
/// or everyone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Acl {
    Owner,
    All,
}

/// A mounted FUSE connection, from mount to its end.
pub struct Session {
    dev: Dev,
    mount: Arc<Mutex<Option<Mounted>>>,
    acl: Acl,
    owner: u32,
    /// Read buffer size, from the `max_write` agreed at INIT.
    buf_size: usize,
    /// Payload bytes of a ring entry, when INIT agreed on io_uring.
    rings: Option<usize>,
}

impl AsFd for Session {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.dev.as_fd()
    }
}

impl Session {
    /// Mounts a FUSE file system at `mountpoint`: by `mount(2)` where this process may
    /// (root, or root of a user namespace owning the mount namespace), else by `fusermount3`.
    /// Nothing is served until [`Session::init`].
    pub fn mount(mountpoint: &Path, options: &MountOptions, acl: Acl) -> io::Result<Session> {
        let (dev, by_fusermount) = match mount_sys(mountpoint, options)? {
            Some(dev) => (dev, false),
            None => (mount_fusermount(mountpoint, options)?, true),
        };
        let dev = Arc::new(dev);
        let mounted = Mounted { path: mountpoint.to_path_buf(), by_fusermount, dev: dev.clone() };
        Ok(Session {
            dev,
            mount: Arc::new(Mutex::new(Some(mounted))),
            acl,
            // SAFETY: geteuid cannot fail.
            owner: unsafe { libc::geteuid() },
            buf_size: 0,
            rings: None,
        })
    }

    /// Answers the kernel's INIT with what `fs` asks (`Filesystem::init`).
    pub fn init<F: Filesystem>(&mut self, fs: &F) -> io::Result<()> {
        let mut buf = vec![0u8; MAX_WRITE_LIMIT as usize + READ_SLACK];
        loop {
            let n = match receive(&self.dev, &mut buf)? {
                Some(n) => n,
                None => return Err(io::Error::new(io::ErrorKind::NotConnected, "FUSE connection ended before INIT")),
            };
            let req = abi::Request::parse(&buf[..n]).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            let unique = req.header.unique;
            let Op::Init { major, minor, max_readahead, flags } = req.op else {
                ReplyEmpty::new(unique, Sink::Dev(self.dev.clone())).error(Errno::EIO);
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("the kernel's first request was opcode {}, not INIT", req.header.opcode),
                ));
            };
            if major > MAJOR {
                // A newer kernel: it asks again with the version answered.
                let mut o = [0u8; abi::INIT_OUT];
                let v = abi::InitOut { major: MAJOR, minor: MINOR, ..KernelConfig::new(0, 0).answer(MINOR) };
                let len = v.encode(&mut o);
                reply_raw(&self.dev, unique, &o[..len]);
                continue;
            }
            if major < MAJOR || minor < OLDEST_MINOR {
                ReplyEmpty::new(unique, Sink::Dev(self.dev.clone())).error(Errno::from_i32(libc::EPROTO));
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    format!("the kernel speaks FUSE {major}.{minor}; this file system needs {MAJOR}.{OLDEST_MINOR} or later"),
                ));
            }
            let mut config = KernelConfig::new(flags, max_readahead);
            if let Err(e) = fs.init(&mut config) {
                ReplyEmpty::new(unique, Sink::Dev(self.dev.clone()))
                    .error(Errno::from_i32(e.raw_os_error().unwrap_or(libc::EIO)));
                return Err(e);
            }
            let answer = config.answer(minor);
            debug!(flags = format_args!("{:#x}", answer.flags), max_write = answer.max_write, "INIT answered");
            let mut o = [0u8; abi::INIT_OUT];
            let len = answer.encode(&mut o);
            reply_raw(&self.dev, unique, &o[..len]);
            self.buf_size = answer.max_write as usize + READ_SLACK;
            if answer.flags & abi::init::OVER_IO_URING != 0 {
                // The kernel refuses an entry smaller than any request it may put there.
                let largest = (answer.max_write as usize).max(usize::from(answer.max_pages) * page_size() as usize);
                self.rings = Some(largest.max(FUSE_MIN_READ_BUFFER));
            }
            return Ok(());
        }
    }

    /// Whether requests come by io_uring (agreed at INIT).
    pub fn uses_rings(&self) -> bool {
        self.rings.is_some()
    }

    /// Sends the kernel notifications (cache invalidations, stores).
    pub fn notifier(&self) -> Notifier {
        Notifier::new(self.dev.clone())
    }

    /// Unmounts from another thread.
    pub fn unmounter(&self) -> Unmounter {
        Unmounter { mount: self.mount.clone() }
    }

    /// Serves requests on `threads` threads until the connection ends (unmounted: `Ok`; the
    /// kernel aborted it: ECONNABORTED), then unmounts if still mounted. With `clone_fd` each
    /// thread reads a clone of the device of its own (the kernel then hands each its share of
    /// requests without waking the others); replies go to the descriptor their request came
    /// from either way.
    pub fn run<F: Filesystem>(self, fs: F, threads: usize, clone_fd: bool) -> io::Result<()> {
        self.run_with(fs, threads, clone_fd, RingOptions::default())
    }

    /// [`Session::run`], with the io_uring queues (where INIT agreed on them) served as `rings`
    /// says.
    pub fn run_with<F: Filesystem>(
        self,
        fs: F,
        threads: usize,
        clone_fd: bool,
        rings: RingOptions<F>,
    ) -> io::Result<()> {
        let fs = Arc::new(fs);
        let mut devs = vec![self.dev.clone()];
        for _ in 1..threads.max(1) {
            devs.push(if clone_fd { Arc::new(clone_dev(&self.dev)?) } else { self.dev.clone() });
        }
        let serve = Serve { acl: self.acl, owner: self.owner, buf_size: self.buf_size };
        let handles = devs
            .into_iter()
            .enumerate()
            .map(|(i, dev)| {
                let fs = fs.clone();
                std::thread::Builder::new().name(format!("fuse-{i}")).spawn(move || serve.serve(&*fs, &dev))
            })
            .collect::<io::Result<Vec<_>>>()?;
        // Rings that cannot start leave the requests on /dev/fuse: the kernel uses the rings only
        // once every queue has entries.
        let rings = match self.rings.map(|payload| start_rings(&fs, &self.dev, serve, payload, rings)) {
            Some(Ok(rings)) => rings,
            Some(Err(e)) => {
                warn!(error = %e, "the io_uring queues did not start; requests come by /dev/fuse");
                Vec::new()
            }
            None => Vec::new(),
        };
        let mut result = Ok(());
        for h in rings {
            if h.join().is_err() {
                warn!("an io_uring queue thread of the FUSE connection panicked");
            }
        }
        for h in handles {
            let r = h.join().unwrap_or_else(|_| Err(io::Error::other("a FUSE reader thread panicked")));
            if result.is_ok() {
                result = r;
            }
        }
        let m = self.mount.lock().expect("mount lock").take();
        if let Some(Err(e)) = m.map(Mounted::unmount) {
            warn!(error = %e, "unmount at the session's end failed");
        }
        result
    }
}

/// How a session serves its io_uring queues, where INIT agreed on them.
pub struct RingOptions<F> {
    /// Entries per queue (requests it may hold at once); by default [`ring_entries`].
    pub entries: Option<usize>,
    /// Makes each queue's handler, on the queue's thread, from the session's [`Dispatch`]; by
    /// default the dispatch itself serves.
    pub handler: Option<QueueMaker<F>>,
}

/// Makes a queue's handler from the session's dispatch (see [`RingOptions`]).
pub type QueueMaker<F> = Arc<dyn Fn(Dispatch<F>) -> Box<dyn QueueHandler> + Send + Sync>;

impl<F> Default for RingOptions<F> {
    fn default() -> Self {
        RingOptions { entries: None, handler: None }
    }
}

/// The session's handler of a ring queue: each request dispatched to the file system as one
/// from `/dev/fuse` is.
pub struct Dispatch<F> {
    fs: Arc<F>,
    serve: Serve,
}

impl<F: Filesystem> Dispatch<F> {
    /// The file system the session serves.
    pub fn fs(&self) -> &F {
        &self.fs
    }
}

impl<F: Filesystem> QueueHandler for Dispatch<F> {
    fn request(&mut self, slot: Slot, req: RingRequest<'_>, _ops: &mut Ops<'_>) {
        match req {
            Ok(req) => {
                self.serve.handle(&*self.fs, Sink::Ring(slot), req);
            }
            Err((unique, e)) => {
                warn!(error = %e, "request not understood; answering EIO");
                ReplyEmpty::new(unique, Sink::Ring(slot)).error(Errno::EIO);
            }
        }
    }
}

/// Starts a thread per CPU queue, each registering its entries of `payload` bytes (`rings`'
/// count, or [`ring_entries`]) and serving the requests that arrive in them.
fn start_rings<F: Filesystem>(
    fs: &Arc<F>,
    dev: &Dev,
    serve: Serve,
    payload: usize,
    rings: RingOptions<F>,
) -> io::Result<Vec<std::thread::JoinHandle<()>>> {
    let queues = crate::ring::possible_cpus()?;
    let entries = rings.entries.unwrap_or_else(|| ring_entries(queues, payload)).max(1);
    info!(queues, entries, "FUSE requests come by io_uring");
    (0..queues)
        .map(|qid| {
            let (fs, dev, maker) = (fs.clone(), dev.clone(), rings.handler.clone());
            std::thread::Builder::new().name(format!("fuse-ring-{qid}")).spawn(move || {
                let dispatch = Dispatch { fs, serve };
                let mut handler: Box<dyn QueueHandler> = match maker {
                    Some(make) => make(dispatch),
                    None => Box::new(dispatch),
                };
                match crate::ring::serve_queue(&dev, qid as u16, entries, payload, &mut *handler) {
                    Ok(requests) => info!(qid, requests, "io_uring queue ended"),
                    // Before registration: the queue's requests stay on /dev/fuse; after, they
                    // wait for the unmount.
                    Err(e) => warn!(qid, error = %e, "an io_uring queue of the FUSE connection failed"),
                }
            })
        })
        .collect()
}

/// A session dropped before it ran (its INIT failed, or the mount runner stopped) takes its
/// mount with it.
impl Drop for Session {
    fn drop(&mut self) {
        let m = self.mount.lock().expect("mount lock").take();
        if let Some(Err(e)) = m.map(Mounted::unmount) {
            warn!(error = %e, "unmount of an unused FUSE session failed");
        }
    }
}

/// Reads one request; `None` once the connection has ended (unmounted).
fn receive(dev: &File, buf: &mut [u8]) -> io::Result<Option<usize>> {
    loop {
        match (&*dev).read(buf) {
            Ok(n) => return Ok(Some(n)),
            Err(e) => match e.raw_os_error() {
                // ENOENT: the request was interrupted before it was read.
                Some(libc::ENOENT) | Some(libc::EINTR) | Some(libc::EAGAIN) => continue,
                Some(libc::ENODEV) => return Ok(None),
                _ => return Err(e),
            },
        }
    }
}

/// Sends a reply with no reply object (INIT's).
fn reply_raw(dev: &Dev, unique: u64, bytes: &[u8]) {
    if let Err(e) = crate::reply::send(dev, unique, 0, &[bytes]) {
        warn!(unique, error = %e, "reply not sent");
    }
}

/// `FUSE_DEV_IOC_CLONE`: `_IOR(229, 0, uint32_t)`.
const IOC_CLONE: libc::c_ulong = 0x8004_e500;

/// A new descriptor on the same connection as `dev`.
fn clone_dev(dev: &File) -> io::Result<File> {
    let clone = OpenOptions::new().read(true).write(true).custom_flags(libc::O_CLOEXEC).open(DEV_FUSE)?;
    let fd = dev.as_raw_fd() as u32;
    // SAFETY: the ioctl reads a u32 from a live variable.
    if unsafe { libc::ioctl(clone.as_raw_fd(), IOC_CLONE, &fd) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(clone)
}

/// What every reader thread needs to serve.
#[derive(Clone, Copy)]
struct Serve {
    acl: Acl,
    owner: u32,
    buf_size: usize,
}

impl Serve {
    /// Reads and dispatches requests until the connection ends or DESTROY.
    fn serve<F: Filesystem>(self, fs: &F, dev: &Dev) -> io::Result<()> {
        let mut buf = vec![0u8; self.buf_size];
        while let Some(n) = receive(dev, &mut buf)? {
            let b = &buf[..n];
            let req = match abi::Request::parse(b) {
                Ok(r) => r,
                Err(e) => {
                    let h = abi::InHeader::parse(b).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
                    warn!(opcode = h.opcode, error = %e, "request not understood; answering EIO");
                    ReplyEmpty::new(h.unique, Sink::Dev(dev.clone())).error(Errno::EIO);
                    continue;
                }
            };
            if !self.handle(fs, Sink::Dev(dev.clone()), req) {
                return Ok(());
            }
        }
        Ok(())
    }

    /// Answers one request, from either transport; false after DESTROY (the session ends).
    fn handle<F: Filesystem>(&self, fs: &F, to: Sink, req: abi::Request<'_>) -> bool {
        if req.header.opcode == op::DESTROY {
            ReplyEmpty::new(req.header.unique, to).ok();
            return false;
        }
        if !self.allowed(&req) {
            ReplyEmpty::new(req.header.unique, to).error(Errno::EACCES);
            return true;
        }
        dispatch(fs, to, req);
        true
    }

    /// Whether a mount without `allow_other` serves this request: its owner's, or one on an
    /// open file, whoever holds it (the kernel checked the caller at the open: I/O, flush,
    /// locks, fallocate, fsync, releases), or one on nobody's behalf (forgets, interrupts).
    fn allowed(&self, req: &abi::Request<'_>) -> bool {
        self.acl == Acl::All
            || req.header.uid == self.owner
            || matches!(
                req.header.opcode,
                op::READ
                    | op::WRITE
                    | op::FLUSH
                    | op::GETLK
                    | op::SETLK
                    | op::SETLKW
                    | op::FALLOCATE
                    | op::READDIR
                    | op::READDIRPLUS
                    | op::FORGET
                    | op::BATCH_FORGET
                    | op::FSYNC
                    | op::FSYNCDIR
                    | op::RELEASE
                    | op::RELEASEDIR
                    | op::INTERRUPT
            )
    }
}

/// `FUSE_MIN_READ_BUFFER`: the least buffer the kernel lets a daemon read requests into.
const FUSE_MIN_READ_BUFFER: usize = 8192;

/// The kernel's page size: `max_pages` counts pages of it.
fn page_size() -> u32 {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if n > 0 {
        n as u32
    } else {
        4096
    }
}

/// A time to set, from SETATTR's fields.
fn set_time(valid: u32, given: u32, now: u32, (secs, nanos): (u64, u32)) -> Option<TimeOrNow> {
    if valid & now != 0 {
        Some(TimeOrNow::Now)
    } else if valid & given != 0 {
        let t = secs as i64;
        let at = if t >= 0 {
            UNIX_EPOCH + Duration::new(t as u64, nanos)
        } else {
            UNIX_EPOCH - Duration::from_secs(t.unsigned_abs()) + Duration::from_nanos(nanos.into())
        };
        Some(TimeOrNow::SpecificTime(at))
    } else {
        None
    }
}

/// Hands one request to the method that answers it.
fn dispatch<F: Filesystem>(fs: &F, d: Sink, r: abi::Request<'_>) {
    let u = r.header.unique;
    let i = INodeNo(r.header.nodeid);
    let req = Request { header: r.header };
    match r.op {
        Op::Lookup { name } => fs.lookup(&req, i, name, ReplyEntry::new(u, d)),
        Op::Forget { nlookup } => fs.forget(i, nlookup),
        Op::BatchForget { nodes } => nodes.into_iter().for_each(|(n, k)| fs.forget(INodeNo(n), k)),
        Op::Getattr { fh } => fs.getattr(&req, i, fh.map(FileHandle), ReplyAttr::new(u, d)),
        Op::Setattr(s) => {
            let has = |bit| s.valid & bit != 0;
            fs.setattr(
                &req,
                i,
                has(fattr::MODE).then_some(s.mode),
                has(fattr::UID).then_some(s.uid),
                has(fattr::GID).then_some(s.gid),
                has(fattr::SIZE).then_some(s.size),
                set_time(s.valid, fattr::ATIME, fattr::ATIME_NOW, s.atime),
                set_time(s.valid, fattr::MTIME, fattr::MTIME_NOW, s.mtime),
                has(fattr::FH).then_some(FileHandle(s.fh)),
                ReplyAttr::new(u, d),
            )
        }
        Op::Readlink => fs.readlink(&req, i, ReplyData::new(u, d)),
        Op::Symlink { name, target } => fs.symlink(&req, i, name, Path::new(target), ReplyEntry::new(u, d)),
        Op::Mknod { name, mode, rdev, umask } => fs.mknod(&req, i, name, mode, umask, rdev, ReplyEntry::new(u, d)),
        Op::Mkdir { name, mode, umask } => fs.mkdir(&req, i, name, mode, umask, ReplyEntry::new(u, d)),
        Op::Unlink { name } => fs.unlink(&req, i, name, ReplyEmpty::new(u, d)),
        Op::Rmdir { name } => fs.rmdir(&req, i, name, ReplyEmpty::new(u, d)),
        Op::Rename { newdir, flags, name, newname } => fs.rename(
            &req,
            i,
            name,
            INodeNo(newdir),
            newname,
            RenameFlags::from_bits_retain(flags),
            ReplyEmpty::new(u, d),
        ),
        Op::Link { oldnodeid, name } => fs.link(&req, INodeNo(oldnodeid), i, name, ReplyEntry::new(u, d)),
        Op::Open { flags } => fs.open(&req, i, OpenFlags(flags as i32), ReplyOpen::new(u, d)),
        Op::Read { fh, offset, size, .. } => fs.read(&req, i, FileHandle(fh), offset, size, ReplyData::new(u, d)),
        Op::Write { fh, offset, write_flags, data, .. } => fs.write(
            &req,
            i,
            FileHandle(fh),
            offset,
            data,
            WriteFlags::from_bits_retain(write_flags),
            ReplyWrite::new(u, d),
        ),
        Op::Flush { fh, lock_owner } => fs.flush(&req, i, FileHandle(fh), LockOwner(lock_owner), ReplyEmpty::new(u, d)),
        Op::Release { fh, release_flags, lock_owner, .. } => {
            let flock = (release_flags & abi::RELEASE_FLOCK_UNLOCK != 0).then_some(LockOwner(lock_owner));
            fs.release(&req, i, FileHandle(fh), flock, ReplyEmpty::new(u, d))
        }
        Op::Fsync { fh, datasync, dir: false } => fs.fsync(&req, i, FileHandle(fh), datasync, ReplyEmpty::new(u, d)),
        Op::Fsync { fh, datasync, dir: true } => fs.fsyncdir(&req, i, FileHandle(fh), datasync, ReplyEmpty::new(u, d)),
        Op::Opendir { flags } => fs.opendir(&req, i, OpenFlags(flags as i32), ReplyOpen::new(u, d)),
        Op::Readdir { fh, offset, size, plus: false } => {
            fs.readdir(&req, i, FileHandle(fh), offset, ReplyDirectory::new(u, d, size))
        }
        Op::Readdir { fh, offset, size, plus: true } => {
            fs.readdirplus(&req, i, FileHandle(fh), offset, ReplyDirectoryPlus::new(u, d, size))
        }
        Op::Releasedir { fh, .. } => fs.releasedir(&req, i, FileHandle(fh), ReplyEmpty::new(u, d)),
        Op::Statfs => fs.statfs(&req, i, ReplyStatfs::new(u, d)),
        Op::Setxattr { name, value, flags } => fs.setxattr(&req, i, name, value, flags, ReplyEmpty::new(u, d)),
        Op::Getxattr { name, size } => fs.getxattr(&req, i, name, size, ReplyXattr::new(u, d)),
        Op::Listxattr { size } => fs.listxattr(&req, i, size, ReplyXattr::new(u, d)),
        Op::Removexattr { name } => fs.removexattr(&req, i, name, ReplyEmpty::new(u, d)),
        Op::Lock { opcode: op::GETLK, fh, owner, start, end, typ, pid } => {
            fs.getlk(&req, i, FileHandle(fh), LockOwner(owner), start, end, typ, pid, ReplyLock::new(u, d))
        }
        Op::Lock { opcode, fh, owner, start, end, typ, pid } => fs.setlk(
            &req,
            i,
            FileHandle(fh),
            LockOwner(owner),
            start,
            end,
            typ,
            pid,
            opcode == op::SETLKW,
            ReplyEmpty::new(u, d),
        ),
        Op::Access { mask } => fs.access(&req, i, AccessFlags::from_bits_retain(mask as i32), ReplyEmpty::new(u, d)),
        Op::Create { name, flags, mode, umask } => {
            fs.create(&req, i, name, mode, umask, flags as i32, ReplyCreate::new(u, d))
        }
        Op::Fallocate { fh, offset, length, mode } => {
            fs.fallocate(&req, i, FileHandle(fh), offset, length, mode, ReplyEmpty::new(u, d))
        }
        // Needs no answer: a file system's long requests (lock waits) end at their callers'
        // signals by themselves, the rest are short.
        Op::Interrupt { .. } => {}
        Op::Init { .. } => {
            warn!("INIT after the handshake; answering EIO");
            ReplyEmpty::new(u, d).error(Errno::EIO)
        }
        Op::Destroy => ReplyEmpty::new(u, d).ok(),
        // No ioctls on these files: ENOTTY is a file's answer without them (isatty(3) asks at
        // many opens).
        Op::Other { opcode: op::IOCTL, .. } => ReplyEmpty::new(u, d).error(Errno::from_i32(libc::ENOTTY)),
        // At ENOSYS the kernel stops asking and does the call itself (poll: always ready;
        // lseek: SEEK_DATA and SEEK_HOLE see one extent of data; copy_file_range: a copy
        // through the page cache; bmap: no block map, as on any network file system).
        Op::Other { .. } => ReplyEmpty::new(u, d).error(Errno::ENOSYS),
    }
}

/// `mount(2)` of a FUSE connection at `mountpoint`; `None` when this process may not (EPERM).
fn mount_sys(mountpoint: &Path, o: &MountOptions) -> io::Result<Option<File>> {
    let mode = std::fs::metadata(mountpoint)?.mode();
    let dev = match OpenOptions::new().read(true).write(true).custom_flags(libc::O_CLOEXEC).open(DEV_FUSE) {
        Ok(dev) => dev,
        // The device may be root's only: fusermount3 opens it itself.
        Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
            info!("{DEV_FUSE} is not open to this user; mounting with fusermount3");
            return Ok(None);
        }
        Err(e) => return Err(e),
    };
    // SAFETY: getuid/getgid cannot fail.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    let mut data = format!("fd={},rootmode={:o},user_id={uid},group_id={gid}", dev.as_raw_fd(), mode);
    if o.default_permissions {
        data.push_str(",default_permissions");
    }
    if o.allow_other {
        data.push_str(",allow_other");
    }
    let mut flags = libc::MS_NOSUID | libc::MS_NODEV;
    if o.noatime {
        flags |= libc::MS_NOATIME;
    }
    if o.read_only {
        flags |= libc::MS_RDONLY;
    }
    let c = |s: &[u8]| CString::new(s).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e));
    let (src, target) = (c(o.fsname.as_bytes())?, c(mountpoint.as_os_str().as_bytes())?);
    let (fstype, data) = (c(format!("fuse.{}", o.subtype).as_bytes())?, c(data.as_bytes())?);
    // SAFETY: every pointer is a NUL-terminated string alive for the call.
    let r = unsafe { libc::mount(src.as_ptr(), target.as_ptr(), fstype.as_ptr(), flags, data.as_ptr().cast()) };
    if r == 0 {
        return Ok(Some(dev));
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EPERM) {
        info!("mount(2) refused (not privileged); mounting with fusermount3");
        return Ok(None);
    }
    Err(e)
}

/// A mount by `fusermount3` (set-uid root), which hands back the connection's descriptor over
/// a socket (`_FUSE_COMMFD`).
fn mount_fusermount(mountpoint: &Path, o: &MountOptions) -> io::Result<File> {
    let (ours, theirs) = UnixStream::pair()?;
    let theirs_fd = theirs.as_raw_fd();
    let mut cmd = Command::new("fusermount3");
    cmd.arg("-o").arg(o.fusermount_options()).arg("--").arg(mountpoint);
    cmd.env("_FUSE_COMMFD", theirs_fd.to_string()).stdout(Stdio::null()).stderr(Stdio::piped());
    // SAFETY: only fcntl between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::fcntl(theirs_fd, libc::F_SETFD, 0) < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn().map_err(|e| io::Error::new(e.kind(), format!("cannot run fusermount3: {e}")))?;
    drop(theirs);
    let got = receive_fd(&ours);
    drop(ours);
    let out = child.wait_with_output()?;
    match got {
        Ok(fd) => Ok(File::from(fd)),
        Err(e) => {
            let said = String::from_utf8_lossy(&out.stderr);
            Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("fusermount3 did not mount ({e}): {}", said.trim()),
            ))
        }
    }
}

/// The descriptor sent over `sock` (`SCM_RIGHTS`).
fn receive_fd(sock: &UnixStream) -> io::Result<OwnedFd> {
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec { iov_base: byte.as_mut_ptr().cast(), iov_len: 1 };
    // Room for one control message carrying one descriptor, aligned for cmsghdr.
    let mut control = [0u64; 8];
    // SAFETY: zeroed msghdr is valid; its pointers are set to live buffers below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control);
    loop {
        // SAFETY: `msg` points at live buffers of the sizes it says.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "no descriptor received"));
        }
        break;
    }
    // SAFETY: the control buffer was filled by recvmsg; the macros walk it within its length.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        if cmsg.is_null() || (*cmsg).cmsg_level != libc::SOL_SOCKET || (*cmsg).cmsg_type != libc::SCM_RIGHTS {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "no descriptor received"));
        }
        let fd = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg) as *const libc::c_int);
        Ok(OwnedFd::from_raw_fd(fd))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_answers_what_was_asked_and_offered() {
        use abi::init::*;
        let mut c = KernelConfig::new(ASYNC_READ | MAX_PAGES | INIT_EXT | PASSTHROUGH | POSIX_LOCKS, 128 << 10);
        assert_eq!(c.want(FLOCK_LOCKS), Err(FLOCK_LOCKS), "not offered");
        c.want(POSIX_LOCKS | PASSTHROUGH).unwrap();
        c.set_max_write(1 << 20).unwrap();
        assert_eq!(c.set_max_readahead(1 << 20), Err(128 << 10), "more than the kernel offered");
        c.set_max_background(64).unwrap();
        c.set_max_stack_depth(1).unwrap();
        let a = c.answer(44);
        assert_eq!((a.major, a.minor), (7, MINOR));
        assert_eq!(a.flags, ASYNC_READ | MAX_PAGES | INIT_EXT | PASSTHROUGH | POSIX_LOCKS);
        assert_eq!((a.max_write, a.max_pages, a.max_background, a.congestion_threshold), (1 << 20, 256, 64, 48));
        assert_eq!(a.max_stack_depth, 1);
        assert_eq!(c.answer(31).minor, 31, "an older kernel's minor");
    }

    #[test]
    fn rings_hold_at_most_their_memory_but_never_too_few_entries() {
        assert_eq!(ring_entries(2, 1 << 20), 64);
        assert_eq!(ring_entries(16, 1 << 20), 16);
        assert_eq!(ring_entries(128, 1 << 20), 8);
    }

    #[test]
    fn fusermount_gets_the_options_it_understands() {
        let o = MountOptions {
            fsname: "odfs:7".into(),
            subtype: "odfs".into(),
            allow_other: true,
            default_permissions: true,
            noatime: true,
            read_only: false,
        };
        assert_eq!(
            o.fusermount_options(),
            "fsname=odfs:7,subtype=odfs,rw,nosuid,nodev,default_permissions,allow_other,noatime"
        );
    }

    #[test]
    fn setattr_times_are_given_now_or_absent() {
        use fattr::*;
        assert!(matches!(set_time(ATIME | ATIME_NOW, ATIME, ATIME_NOW, (5, 0)), Some(TimeOrNow::Now)));
        let Some(TimeOrNow::SpecificTime(t)) = set_time(MTIME, MTIME, MTIME_NOW, (5, 9)) else { panic!() };
        assert_eq!(t, UNIX_EPOCH + Duration::new(5, 9));
        let Some(TimeOrNow::SpecificTime(t)) = set_time(MTIME, MTIME, MTIME_NOW, ((-2i64) as u64, 500)) else {
            panic!()
        };
        assert_eq!(t, UNIX_EPOCH - Duration::from_secs(2) + Duration::from_nanos(500));
        assert!(set_time(MODE, ATIME, ATIME_NOW, (5, 0)).is_none());
    }
}
