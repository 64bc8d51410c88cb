//! What a FUSE file system sends the kernel: the answer to each request (one type per kind of answer,
//! so a request can only be answered the way the protocol allows), the notifications that drop
//! or fill the kernel's caches, and the backing files of passthrough.
//!
//! Owns sending, not deciding: every answer is the out header and the encoded arguments
//! ([`crate::abi`]), in one `writev` to the descriptor its request was read from (the kernel
//! finds a reply only on that one), or written into the ring entry it came in
//! ([`crate::ring`]). Notifications and backing-file ioctls always use the device. A reply dropped unanswered sends EIO, so a request is never
//! left waiting. A reply the kernel no longer wants (its request was interrupted) is not an
//! error.

use crate::abi::{self, Writer};
use fuser::{Errno, FileAttr, FileHandle, FileType, FopenFlags, Generation, INodeNo};
use std::ffi::OsStr;
use std::fs::File;
use std::io::{self, IoSlice, Write};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::ffi::OsStrExt;
use std::sync::Arc;
#[cfg(test)]
use std::time::UNIX_EPOCH;
use std::time::{Duration, SystemTime};
use tracing::{debug, warn};

/// A descriptor of the session's connection to the kernel (the session's own, or a reader
/// thread's clone).
pub type Dev = Arc<File>;

/// Where a request's reply goes: the descriptor it was read from, or the ring entry it came in.
#[derive(Clone)]
pub(crate) enum Sink {
    Dev(Dev),
    Ring(crate::ring::Slot),
}

impl Sink {
    /// The connection's device, for ioctls.
    fn dev(&self) -> &Dev {
        match self {
            Sink::Dev(d) => d,
            Sink::Ring(s) => s.dev(),
        }
    }
}

/// Sends one message: the out header for `unique` (0 for a notification, whose code then
/// goes where a reply's error does) and `parts`, in one write.
pub(crate) fn send(dev: &File, unique: u64, error: i32, parts: &[&[u8]]) -> io::Result<()> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let head = abi::out_header(unique, len, -error);
    let mut iov = Vec::with_capacity(parts.len() + 1);
    iov.push(IoSlice::new(&head));
    iov.extend(parts.iter().filter(|p| !p.is_empty()).map(|p| IoSlice::new(p)));
    // The device takes a message in one write or not at all.
    let n = (&*dev).write_vectored(&iov)?;
    if n != abi::OUT_HEADER + len {
        return Err(io::Error::other(format!("the FUSE device took {n} of {} bytes", abi::OUT_HEADER + len)));
    }
    Ok(())
}

/// `errno` as a reply may carry it (0 is success): the kernel refuses an error outside
/// 1..=511 on `/dev/fuse`, and its caller would wait for good (a ring turns it into EIO).
fn wire_errno(errno: i32) -> i32 {
    if (0..512).contains(&errno) {
        errno
    } else {
        libc::EIO
    }
}

/// The answer to one request, sent once. Dropped unsent, it answers EIO.
struct Reply {
    unique: u64,
    to: Option<Sink>,
}

impl Reply {
    fn send(mut self, parts: &[&[u8]]) {
        self.send_errno(0, parts);
    }

    fn error(mut self, errno: Errno) {
        self.send_errno(errno.code(), &[]);
    }

    fn send_errno(&mut self, errno: i32, parts: &[&[u8]]) {
        let errno = wire_errno(errno);
        let dev = match self.to.take() {
            None => return,
            Some(Sink::Ring(slot)) => return slot.answer(-errno, parts),
            Some(Sink::Dev(dev)) => dev,
        };
        match send(&dev, self.unique, -errno, parts) {
            Ok(()) => {}
            // The request is gone (interrupted, or the connection aborted): nobody waits.
            Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::ENODEV)) => {
                debug!(unique = self.unique, error = %e, "reply not taken")
            }
            Err(e) => warn!(unique = self.unique, error = %e, "reply not sent"),
        }
    }
}

impl Drop for Reply {
    fn drop(&mut self) {
        if self.to.is_some() {
            warn!(unique = self.unique, "request dropped unanswered; answering EIO");
            self.send_errno(libc::EIO, &[]);
        }
    }
}

/// What every reply type can do: fail its request with an errno (for code generic over the
/// kind of reply).
pub trait ErrorReply: Send + 'static {
    fn fail(self, errno: Errno);
}

macro_rules! replies {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {
        $(
            $(#[$doc])*
            pub struct $name(Reply);

            impl $name {
                pub(crate) fn new(unique: u64, to: Sink) -> $name {
                    $name(Reply { unique, to: Some(to) })
                }

                /// Fails the request with `errno`.
                pub fn error(self, errno: Errno) {
                    self.0.error(errno)
                }
            }

            impl ErrorReply for $name {
                fn fail(self, errno: Errno) {
                    self.error(errno)
                }
            }
        )*
    };
}

replies!(
    /// LOOKUP, MKNOD, MKDIR, SYMLINK, LINK: an entry.
    ReplyEntry,
    /// GETATTR, SETATTR: attributes.
    ReplyAttr,
    /// READ, READLINK: bytes.
    ReplyData,
    /// Requests answered with success alone.
    ReplyEmpty,
    /// OPEN, OPENDIR: a handle.
    ReplyOpen,
    /// WRITE: how much was written.
    ReplyWrite,
    /// STATFS.
    ReplyStatfs,
    /// GETLK: the lock in the way, or none.
    ReplyLock,
    /// CREATE: an entry and a handle.
    ReplyCreate,
    /// GETXATTR, LISTXATTR: a size, or the bytes.
    ReplyXattr,
);

/// `struct fuse_attr` of `a`.
fn kernel_attr(a: &FileAttr) -> abi::Attr {
    abi::Attr {
        ino: a.ino.0,
        size: a.size,
        blocks: a.blocks,
        atime: kernel_time(a.atime),
        mtime: kernel_time(a.mtime),
        ctime: kernel_time(a.ctime),
        mode: type_bits(a.kind) | u32::from(a.perm),
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        rdev: a.rdev,
        blksize: a.blksize,
    }
}

/// Seconds (two's complement before 1970, as the kernel reads them) and nanoseconds.
fn kernel_time(t: SystemTime) -> (u64, u32) {
    match t.duration_since(std::time::UNIX_EPOCH) {
        Ok(d) => (d.as_secs(), d.subsec_nanos()),
        Err(e) => {
            // Before 1970: the whole seconds below, then the nanoseconds up from there.
            let d = e.duration();
            let (sec, nsec) = (-(d.as_secs() as i64), d.subsec_nanos());
            if nsec > 0 {
                ((sec - 1) as u64, 1_000_000_000 - nsec)
            } else {
                (sec as u64, 0)
            }
        }
    }
}

/// The `S_IFMT` bits of a file type.
fn type_bits(kind: FileType) -> u32 {
    match kind {
        FileType::NamedPipe => libc::S_IFIFO,
        FileType::CharDevice => libc::S_IFCHR,
        FileType::BlockDevice => libc::S_IFBLK,
        FileType::Directory => libc::S_IFDIR,
        FileType::RegularFile => libc::S_IFREG,
        FileType::Symlink => libc::S_IFLNK,
        FileType::Socket => libc::S_IFSOCK,
    }
}

fn entry_bytes(ttl: &Duration, attr: &FileAttr, generation: Generation) -> [u8; abi::ENTRY_OUT] {
    let mut o = [0u8; abi::ENTRY_OUT];
    abi::entry_out(&mut o, &kernel_attr(attr), generation.0, *ttl);
    o
}

fn open_bytes(fh: FileHandle, flags: u32, backing_id: u32) -> [u8; abi::OPEN_OUT] {
    let mut o = [0u8; abi::OPEN_OUT];
    abi::open_out(&mut o, fh.0, flags, backing_id);
    o
}

impl ReplyEntry {
    /// The entry `attr` (node 0: the name is known missing), both valid for `ttl`.
    pub fn entry(self, ttl: &Duration, attr: &FileAttr, generation: Generation) {
        self.0.send(&[&entry_bytes(ttl, attr, generation)]);
    }
}

impl ReplyAttr {
    pub fn attr(self, ttl: &Duration, attr: &FileAttr) {
        let mut o = [0u8; abi::ATTR_OUT];
        abi::attr_out(&mut o, &kernel_attr(attr), *ttl);
        self.0.send(&[&o]);
    }
}

impl ReplyData {
    pub fn data(self, data: &[u8]) {
        self.0.send(&[data]);
    }

    /// The request was answered on the device by other means (a spliced READ): nothing more
    /// is sent.
    pub fn sent_elsewhere(mut self) {
        self.0.to = None;
    }
}

impl ReplyEmpty {
    pub fn ok(self) {
        self.0.send(&[]);
    }
}

impl ReplyOpen {
    pub fn opened(self, fh: FileHandle, flags: FopenFlags) {
        self.0.send(&[&open_bytes(fh, flags.bits(), 0)]);
    }

    /// Registers `file` as a backing file with the kernel (passthrough).
    pub fn open_backing(&self, file: impl AsFd) -> io::Result<BackingId> {
        BackingId::create(self.0.to.as_ref().expect("an unanswered reply has its sink").dev(), file)
    }

    /// Opened with the kernel reading and writing `backing` itself.
    pub fn opened_passthrough(self, fh: FileHandle, flags: FopenFlags, backing: &BackingId) {
        self.0.send(&[&open_bytes(fh, flags.bits() | abi::FOPEN_PASSTHROUGH, backing.id)]);
    }
}

impl ReplyWrite {
    pub fn written(self, size: u32) {
        let mut o = [0u8; abi::WRITE_OUT];
        abi::write_out(&mut o, size);
        self.0.send(&[&o]);
    }
}

impl ReplyStatfs {
    #[allow(clippy::too_many_arguments)]
    pub fn statfs(
        self,
        blocks: u64,
        bfree: u64,
        bavail: u64,
        files: u64,
        ffree: u64,
        bsize: u32,
        namelen: u32,
        frsize: u32,
    ) {
        let mut o = [0u8; abi::STATFS_OUT];
        abi::Statfs { blocks, bfree, bavail, files, ffree, bsize, namelen, frsize }.encode(&mut o);
        self.0.send(&[&o]);
    }
}

impl ReplyLock {
    pub fn locked(self, start: u64, end: u64, typ: i32, pid: u32) {
        let mut o = [0u8; abi::LK_OUT];
        abi::lk_out(&mut o, start, end, typ, pid);
        self.0.send(&[&o]);
    }
}

impl ReplyCreate {
    pub fn created(self, ttl: &Duration, attr: &FileAttr, generation: Generation, fh: FileHandle, flags: FopenFlags) {
        self.0.send(&[&entry_bytes(ttl, attr, generation), &open_bytes(fh, flags.bits(), 0)]);
    }

    /// Registers `file` as a backing file with the kernel (passthrough).
    pub fn open_backing(&self, file: impl AsFd) -> io::Result<BackingId> {
        BackingId::create(self.0.to.as_ref().expect("an unanswered reply has its sink").dev(), file)
    }

    pub fn created_passthrough(
        self,
        ttl: &Duration,
        attr: &FileAttr,
        generation: Generation,
        fh: FileHandle,
        flags: FopenFlags,
        backing: &BackingId,
    ) {
        let open = open_bytes(fh, flags.bits() | abi::FOPEN_PASSTHROUGH, backing.id);
        self.0.send(&[&entry_bytes(ttl, attr, generation), &open]);
    }
}

impl ReplyXattr {
    /// The size the caller's buffer needs (a probe with size 0).
    pub fn size(self, size: u32) {
        let mut o = [0u8; abi::GETXATTR_OUT];
        abi::getxattr_out(&mut o, size);
        self.0.send(&[&o]);
    }

    pub fn data(self, data: &[u8]) {
        self.0.send(&[data]);
    }
}

/// READDIR's answer: entries packed until the kernel's buffer (`size` bytes) is full.
pub struct ReplyDirectory {
    reply: Reply,
    size: usize,
    buf: Vec<u8>,
}

impl ReplyDirectory {
    pub(crate) fn new(unique: u64, to: Sink, size: u32) -> ReplyDirectory {
        ReplyDirectory { reply: Reply { unique, to: Some(to) }, size: size as usize, buf: Vec::new() }
    }

    /// Adds entry `name`; `offset` is where the next listing resumes after it. True when it
    /// does not fit (the buffer is full; it was not added).
    pub fn add(&mut self, ino: INodeNo, offset: u64, kind: FileType, name: impl AsRef<OsStr>) -> bool {
        let name = name.as_ref().as_bytes();
        let len = abi::dirent_len(name.len());
        if self.buf.len() + len > self.size {
            return true;
        }
        let at = self.buf.len();
        self.buf.resize(at + len, 0);
        abi::dirent(&mut self.buf[at..], ino.0, offset, type_bits(kind) >> 12, name);
        false
    }

    pub fn ok(self) {
        self.reply.send(&[&self.buf]);
    }

    pub fn error(self, errno: Errno) {
        self.reply.error(errno)
    }
}

impl ErrorReply for ReplyDirectory {
    fn fail(self, errno: Errno) {
        self.error(errno)
    }
}

/// READDIRPLUS's answer: entries with their attributes, packed until the kernel's buffer is
/// full.
pub struct ReplyDirectoryPlus {
    reply: Reply,
    size: usize,
    buf: Vec<u8>,
}

impl ReplyDirectoryPlus {
    pub(crate) fn new(unique: u64, to: Sink, size: u32) -> ReplyDirectoryPlus {
        ReplyDirectoryPlus { reply: Reply { unique, to: Some(to) }, size: size as usize, buf: Vec::new() }
    }

    /// Adds entry `name` with its attributes, valid for `ttl`. True when it does not fit.
    pub fn add(
        &mut self,
        ino: INodeNo,
        offset: u64,
        name: impl AsRef<OsStr>,
        ttl: &Duration,
        attr: &FileAttr,
        generation: Generation,
    ) -> bool {
        let name = name.as_ref().as_bytes();
        let len = abi::ENTRY_OUT + abi::dirent_len(name.len());
        if self.buf.len() + len > self.size {
            return true;
        }
        let at = self.buf.len();
        self.buf.resize(at + len, 0);
        abi::entry_out(&mut self.buf[at..], &kernel_attr(attr), generation.0, *ttl);
        abi::dirent(&mut self.buf[at + abi::ENTRY_OUT..], ino.0, offset, type_bits(attr.kind) >> 12, name);
        false
    }

    pub fn ok(self) {
        self.reply.send(&[&self.buf]);
    }

    pub fn error(self, errno: Errno) {
        self.reply.error(errno)
    }
}

impl ErrorReply for ReplyDirectoryPlus {
    fn fail(self, errno: Errno) {
        self.error(errno)
    }
}

/// Tells the kernel to drop or take cached names, attributes and pages. Errors are the
/// kernel's: ENOENT when it holds nothing of the inode.
#[derive(Clone)]
pub struct Notifier {
    dev: Dev,
}

impl Notifier {
    pub(crate) fn new(dev: Dev) -> Notifier {
        Notifier { dev }
    }

    /// Drops `ino`'s attributes, and its pages from `offset` for `len` bytes (0: to the end;
    /// a negative offset: the attributes only).
    pub fn inval_inode(&self, ino: INodeNo, offset: i64, len: i64) -> io::Result<()> {
        let mut o = [0u8; 24];
        Writer::new(&mut o).u64(ino.0).u64(offset as u64).u64(len as u64);
        send(&self.dev, 0, abi::notify::INVAL_INODE, &[&o])
    }

    /// Drops the name `name` in directory `parent`, found or known missing.
    pub fn inval_entry(&self, parent: INodeNo, name: &OsStr) -> io::Result<()> {
        let name = name.as_bytes();
        let mut o = [0u8; 16];
        Writer::new(&mut o).u64(parent.0).u32(name.len() as u32).u32(0);
        send(&self.dev, 0, abi::notify::INVAL_ENTRY, &[&o, name, &[0]])
    }

    /// Puts `data` into `ino`'s page cache at `offset`.
    pub fn store(&self, ino: INodeNo, offset: u64, data: &[u8]) -> io::Result<()> {
        let mut o = [0u8; 24];
        Writer::new(&mut o).u64(ino.0).u64(offset).u32(data.len() as u32).u32(0);
        send(&self.dev, 0, abi::notify::STORE, &[&o, data])
    }
}

/// `FUSE_DEV_IOC_BACKING_OPEN`: `_IOW(229, 1, struct fuse_backing_map)`.
const IOC_BACKING_OPEN: libc::c_ulong = 0x4010_e501;
/// `FUSE_DEV_IOC_BACKING_CLOSE`: `_IOW(229, 2, uint32_t)`.
const IOC_BACKING_CLOSE: libc::c_ulong = 0x4004_e502;

/// A file registered with the kernel as a backing file; unregistered when dropped (files
/// opened on it keep it until they close).
#[derive(Debug)]
pub struct BackingId {
    id: u32,
    dev: Dev,
}

impl BackingId {
    fn create(dev: &Dev, file: impl AsFd) -> io::Result<BackingId> {
        // `struct fuse_backing_map`: fd, flags, padding.
        let map: [u64; 2] = [file.as_fd().as_raw_fd() as u32 as u64, 0];
        // SAFETY: the ioctl reads a `fuse_backing_map` (16 bytes) from a live buffer.
        let id = unsafe { libc::ioctl(dev.as_raw_fd(), IOC_BACKING_OPEN, map.as_ptr()) };
        if id < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(BackingId { id: id as u32, dev: dev.clone() })
    }
}

impl Drop for BackingId {
    fn drop(&mut self) {
        // SAFETY: the ioctl reads a u32 from a live variable.
        if unsafe { libc::ioctl(self.dev.as_raw_fd(), IOC_BACKING_CLOSE, &self.id) } < 0 {
            debug!(id = self.id, error = %io::Error::last_os_error(), "backing file not unregistered");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_before_1970_are_twos_complement_seconds_and_positive_nanoseconds() {
        assert_eq!(kernel_time(UNIX_EPOCH + Duration::new(5, 7)), (5, 7));
        assert_eq!(kernel_time(UNIX_EPOCH - Duration::new(2, 0)), ((-2i64) as u64, 0));
        assert_eq!(kernel_time(UNIX_EPOCH - Duration::new(1, 250_000_000)), ((-2i64) as u64, 750_000_000));
    }

    #[test]
    fn an_errno_the_kernel_would_refuse_goes_as_eio() {
        assert_eq!((wire_errno(0), wire_errno(libc::ENOENT), wire_errno(511)), (0, libc::ENOENT, 511));
        assert_eq!((wire_errno(512), wire_errno(-5), wire_errno(i32::MAX)), (libc::EIO, libc::EIO, libc::EIO));
    }

    #[test]
    fn attributes_carry_the_type_in_the_mode() {
        let a = FileAttr {
            ino: INodeNo(9),
            size: 1,
            blocks: 1,
            atime: UNIX_EPOCH,
            mtime: UNIX_EPOCH,
            ctime: UNIX_EPOCH,
            crtime: UNIX_EPOCH,
            kind: FileType::Symlink,
            perm: 0o777,
            nlink: 1,
            uid: 3,
            gid: 4,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        };
        let k = kernel_attr(&a);
        assert_eq!(k.mode, libc::S_IFLNK | 0o777);
        assert_eq!((k.ino, k.uid, k.gid, k.blksize), (9, 3, 4, 4096));
    }
}
