//! The FUSE kernel interface as bytes (`include/uapi/linux/fuse.h`, protocol 7.x): a request's
//! header and arguments decoded from the buffer it arrived in, and the reply structures encoded
//! into the buffer they leave from.
//!
//! Owns the layout knowledge of the protocol and nothing else: no file system behaviour, no
//! transport. It is the first layer of the crate (docs/architecture.md, "fuse-kernel"): the same decoding serves a request read from `/dev/fuse` and one
//! found in an io_uring ring entry (header and arguments in separate buffers there, hence
//! [`Request::parse_parts`]). Every read is bounds-checked: a short or malformed request is an
//! [`AbiError`], never a panic.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::time::Duration;

/// `struct fuse_in_header`.
pub const IN_HEADER: usize = 40;
/// `struct fuse_out_header`.
pub const OUT_HEADER: usize = 16;
/// `struct fuse_attr`.
pub const ATTR: usize = 88;
/// `struct fuse_entry_out`: node id, generation, two validities and their nanoseconds, attr.
pub const ENTRY_OUT: usize = 40 + ATTR;
/// `struct fuse_attr_out`: validity, its nanoseconds, padding, attr.
pub const ATTR_OUT: usize = 16 + ATTR;
/// `struct fuse_open_out`.
pub const OPEN_OUT: usize = 16;
/// `struct fuse_statfs_out`.
pub const STATFS_OUT: usize = 80;
/// `struct fuse_init_out`.
pub const INIT_OUT: usize = 64;
/// `struct fuse_write_out`.
pub const WRITE_OUT: usize = 8;
/// `struct fuse_getxattr_out`.
pub const GETXATTR_OUT: usize = 8;
/// `struct fuse_lk_out`.
pub const LK_OUT: usize = 24;
/// `struct fuse_dirent` without its name.
pub const DIRENT: usize = 24;

/// Opcodes (`enum fuse_opcode`).
pub mod op {
    pub const LOOKUP: u32 = 1;
    pub const FORGET: u32 = 2;
    pub const GETATTR: u32 = 3;
    pub const SETATTR: u32 = 4;
    pub const READLINK: u32 = 5;
    pub const SYMLINK: u32 = 6;
    pub const MKNOD: u32 = 8;
    pub const MKDIR: u32 = 9;
    pub const UNLINK: u32 = 10;
    pub const RMDIR: u32 = 11;
    pub const RENAME: u32 = 12;
    pub const LINK: u32 = 13;
    pub const OPEN: u32 = 14;
    pub const READ: u32 = 15;
    pub const WRITE: u32 = 16;
    pub const STATFS: u32 = 17;
    pub const RELEASE: u32 = 18;
    pub const FSYNC: u32 = 20;
    pub const SETXATTR: u32 = 21;
    pub const GETXATTR: u32 = 22;
    pub const LISTXATTR: u32 = 23;
    pub const REMOVEXATTR: u32 = 24;
    pub const FLUSH: u32 = 25;
    pub const INIT: u32 = 26;
    pub const OPENDIR: u32 = 27;
    pub const READDIR: u32 = 28;
    pub const RELEASEDIR: u32 = 29;
    pub const FSYNCDIR: u32 = 30;
    pub const GETLK: u32 = 31;
    pub const SETLK: u32 = 32;
    pub const SETLKW: u32 = 33;
    pub const ACCESS: u32 = 34;
    pub const CREATE: u32 = 35;
    pub const INTERRUPT: u32 = 36;
    pub const BMAP: u32 = 37;
    pub const DESTROY: u32 = 38;
    pub const IOCTL: u32 = 39;
    pub const BATCH_FORGET: u32 = 42;
    pub const FALLOCATE: u32 = 43;
    pub const READDIRPLUS: u32 = 44;
    pub const RENAME2: u32 = 45;
    pub const LSEEK: u32 = 46;
    pub const COPY_FILE_RANGE: u32 = 47;
}

/// Notification codes (`enum fuse_notify_code`), sent in the out header's error field of a
/// message with unique 0.
pub mod notify {
    pub const INVAL_INODE: i32 = 2;
    pub const INVAL_ENTRY: i32 = 3;
    pub const STORE: i32 = 4;
}

/// INIT flags: the first word, then `flags2` (bits 32 and up), as one `u64`.
pub mod init {
    pub const ASYNC_READ: u64 = 1 << 0;
    pub const BIG_WRITES: u64 = 1 << 5;
    pub const ASYNC_DIO: u64 = 1 << 15;
    pub const MAX_PAGES: u64 = 1 << 22;
    pub const INIT_EXT: u64 = 1 << 30;
    pub const OVER_IO_URING: u64 = 1 << 41;
    pub const POSIX_LOCKS: u64 = 1 << 1;
    pub const ATOMIC_O_TRUNC: u64 = 1 << 3;
    pub const FLOCK_LOCKS: u64 = 1 << 10;
    pub const DO_READDIRPLUS: u64 = 1 << 13;
    pub const READDIRPLUS_AUTO: u64 = 1 << 14;
    pub const PARALLEL_DIROPS: u64 = 1 << 18;
    pub const CACHE_SYMLINKS: u64 = 1 << 23;
    pub const HANDLE_KILLPRIV_V2: u64 = 1 << 28;
    pub const PASSTHROUGH: u64 = 1 << 37;
}

/// `FOPEN_KEEP_CACHE`: the kernel keeps the file's cached pages at this open.
pub const FOPEN_KEEP_CACHE: u32 = 1 << 1;
/// `FOPEN_PASSTHROUGH`: the open's reads and writes go to its backing file.
pub const FOPEN_PASSTHROUGH: u32 = 1 << 7;

/// `struct fuse_setattr_in`'s `valid` bits.
pub mod fattr {
    pub const MODE: u32 = 1 << 0;
    pub const UID: u32 = 1 << 1;
    pub const GID: u32 = 1 << 2;
    pub const SIZE: u32 = 1 << 3;
    pub const ATIME: u32 = 1 << 4;
    pub const MTIME: u32 = 1 << 5;
    pub const FH: u32 = 1 << 6;
    pub const ATIME_NOW: u32 = 1 << 7;
    pub const MTIME_NOW: u32 = 1 << 8;
}

/// `struct fuse_release_in`'s `release_flags` bit: a `flock` lock goes with this release.
pub const RELEASE_FLOCK_UNLOCK: u32 = 1 << 1;
/// `struct fuse_fsync_in`'s flag: only the data (fdatasync).
pub const FSYNC_FDATASYNC: u32 = 1 << 0;

/// A request the protocol does not allow: too short for its header or its opcode's arguments,
/// or a name without its terminating NUL.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AbiError {
    #[error("FUSE request of {got} bytes, shorter than its {need}-byte {what}")]
    Short { what: &'static str, need: usize, got: usize },
    #[error("FUSE request's {0} is not NUL-terminated")]
    Unterminated(&'static str),
}

/// `struct fuse_in_header`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InHeader {
    pub len: u32,
    pub opcode: u32,
    pub unique: u64,
    pub nodeid: u64,
    pub uid: u32,
    pub gid: u32,
    pub pid: u32,
}

impl InHeader {
    pub fn parse(b: &[u8]) -> Result<InHeader, AbiError> {
        let mut r = Reader::new(b, "header");
        r.need(IN_HEADER)?;
        Ok(InHeader {
            len: r.u32()?,
            opcode: r.u32()?,
            unique: r.u64()?,
            nodeid: r.u64()?,
            uid: r.u32()?,
            gid: r.u32()?,
            pid: r.u32()?,
        })
    }
}

/// A request's arguments, by opcode. Names and data borrow the request's buffer.
#[derive(Debug, PartialEq, Eq)]
pub enum Op<'a> {
    Lookup {
        name: &'a OsStr,
    },
    Forget {
        nlookup: u64,
    },
    BatchForget {
        nodes: Vec<(u64, u64)>,
    },
    Getattr {
        fh: Option<u64>,
    },
    Open {
        flags: u32,
    },
    Opendir {
        flags: u32,
    },
    Read {
        fh: u64,
        offset: u64,
        size: u32,
        flags: u32,
        lock_owner: Option<u64>,
    },
    Write {
        fh: u64,
        offset: u64,
        write_flags: u32,
        flags: u32,
        lock_owner: Option<u64>,
        data: &'a [u8],
    },
    Release {
        fh: u64,
        flags: u32,
        release_flags: u32,
        lock_owner: u64,
    },
    Releasedir {
        fh: u64,
        flags: u32,
    },
    Flush {
        fh: u64,
        lock_owner: u64,
    },
    Readdir {
        fh: u64,
        offset: u64,
        size: u32,
        plus: bool,
    },
    Statfs,
    Init {
        major: u32,
        minor: u32,
        max_readahead: u32,
        flags: u64,
    },
    Interrupt {
        unique: u64,
    },
    Destroy,
    Setattr(SetattrIn),
    Readlink,
    Symlink {
        name: &'a OsStr,
        target: &'a OsStr,
    },
    Mknod {
        name: &'a OsStr,
        mode: u32,
        rdev: u32,
        umask: u32,
    },
    Mkdir {
        name: &'a OsStr,
        mode: u32,
        umask: u32,
    },
    Unlink {
        name: &'a OsStr,
    },
    Rmdir {
        name: &'a OsStr,
    },
    /// RENAME (flags 0) and RENAME2.
    Rename {
        newdir: u64,
        flags: u32,
        name: &'a OsStr,
        newname: &'a OsStr,
    },
    Link {
        oldnodeid: u64,
        name: &'a OsStr,
    },
    /// FSYNC, and FSYNCDIR (`dir`).
    Fsync {
        fh: u64,
        datasync: bool,
        dir: bool,
    },
    Setxattr {
        name: &'a OsStr,
        value: &'a [u8],
        flags: i32,
    },
    Getxattr {
        name: &'a OsStr,
        size: u32,
    },
    Listxattr {
        size: u32,
    },
    Removexattr {
        name: &'a OsStr,
    },
    /// GETLK, SETLK and SETLKW (`opcode` says which).
    Lock {
        opcode: u32,
        fh: u64,
        owner: u64,
        start: u64,
        end: u64,
        typ: i32,
        pid: u32,
    },
    Access {
        mask: u32,
    },
    Create {
        name: &'a OsStr,
        flags: u32,
        mode: u32,
        umask: u32,
    },
    Fallocate {
        fh: u64,
        offset: u64,
        length: u64,
        mode: i32,
    },
    /// An opcode decoded by its own handler (or answered `ENOSYS`): its argument bytes (from
    /// `/dev/fuse` all of them; from a ring entry its fixed ones) and, from a ring entry, its
    /// payload.
    Other {
        opcode: u32,
        args: &'a [u8],
        payload: Option<&'a [u8]>,
    },
}

/// `struct fuse_setattr_in`: which fields are set (`valid`, [`fattr`] bits) and their values.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SetattrIn {
    pub valid: u32,
    pub fh: u64,
    pub size: u64,
    pub atime: (u64, u32),
    pub mtime: (u64, u32),
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
}

/// `struct fuse_read_in`'s `read_flags` bit saying `lock_owner` is set.
const READ_LOCKOWNER: u32 = 1 << 1;
/// `struct fuse_write_in`'s `write_flags` bit saying `lock_owner` is set.
const WRITE_LOCKOWNER: u32 = 1 << 1;
/// `struct fuse_getattr_in`'s flag saying `fh` is set.
const GETATTR_FH: u32 = 1 << 0;

/// A request: its header and decoded arguments.
#[derive(Debug, PartialEq, Eq)]
pub struct Request<'a> {
    pub header: InHeader,
    pub op: Op<'a>,
}

impl<'a> Request<'a> {
    /// A request as read from `/dev/fuse`: header, then arguments, in one buffer.
    pub fn parse(b: &'a [u8]) -> Result<Request<'a>, AbiError> {
        let header = InHeader::parse(b)?;
        let end = (header.len as usize).min(b.len());
        let args = b.get(IN_HEADER..end).unwrap_or(&[]);
        Ok(Request { header, op: parse_op(header.opcode, args, None)? })
    }

    /// A request as an io_uring ring entry holds it: the header and the opcode's fixed
    /// arguments in the entry's header buffer (`in_out`, `op_in`), variable ones (names, a
    /// WRITE's data) in its payload buffer.
    pub fn parse_parts(header: &[u8], op_in: &'a [u8], payload: &'a [u8]) -> Result<Request<'a>, AbiError> {
        let header = InHeader::parse(header)?;
        Ok(Request { header, op: parse_op(header.opcode, op_in, Some(payload))? })
    }
}

/// Decodes `opcode`'s arguments: `fixed` its fixed-size struct, followed by the variable part
/// when both arrive in one buffer (`var` is `None`), else `var` is the variable part.
fn parse_op<'a>(opcode: u32, fixed: &'a [u8], var: Option<&'a [u8]>) -> Result<Op<'a>, AbiError> {
    let mut r = Reader::new(fixed, "arguments");
    // The variable part: after the fixed struct in the same buffer, or its own buffer.
    let rest = |r: &Reader<'a>| var.unwrap_or_else(|| r.rest());
    Ok(match opcode {
        op::LOOKUP => Op::Lookup { name: name(rest(&r), "name")? },
        op::FORGET => Op::Forget { nlookup: r.u64()? },
        op::BATCH_FORGET => {
            let count = r.u32()? as usize;
            r.skip(4)?;
            let mut items = Reader::new(rest(&r), "forget list");
            items.need(count.saturating_mul(16))?;
            Op::BatchForget { nodes: (0..count).map(|_| Ok((items.u64()?, items.u64()?))).collect::<Result<_, _>>()? }
        }
        op::GETATTR => {
            // Protocol 7.9 on; an older kernel sends no arguments.
            if fixed.is_empty() {
                Op::Getattr { fh: None }
            } else {
                let flags = r.u32()?;
                r.skip(4)?;
                let fh = r.u64()?;
                Op::Getattr { fh: (flags & GETATTR_FH != 0).then_some(fh) }
            }
        }
        op::OPEN | op::OPENDIR => {
            let flags = r.u32()?;
            if opcode == op::OPEN {
                Op::Open { flags }
            } else {
                Op::Opendir { flags }
            }
        }
        op::READ => {
            let (fh, offset, size, read_flags, lock_owner) = (r.u64()?, r.u64()?, r.u32()?, r.u32()?, r.u64()?);
            let flags = r.u32()?;
            let lock_owner = (read_flags & READ_LOCKOWNER != 0).then_some(lock_owner);
            Op::Read { fh, offset, size, flags, lock_owner }
        }
        op::WRITE => {
            let (fh, offset, size, write_flags, lock_owner) = (r.u64()?, r.u64()?, r.u32()?, r.u32()?, r.u64()?);
            let flags = r.u32()?;
            r.skip(4)?;
            let all = rest(&r);
            let data = all.get(..size as usize).ok_or(AbiError::Short {
                what: "write data",
                need: size as usize,
                got: all.len(),
            })?;
            let lock_owner = (write_flags & WRITE_LOCKOWNER != 0).then_some(lock_owner);
            Op::Write { fh, offset, write_flags, flags, lock_owner, data }
        }
        op::RELEASE | op::RELEASEDIR => {
            let (fh, flags, release_flags, lock_owner) = (r.u64()?, r.u32()?, r.u32()?, r.u64()?);
            if opcode == op::RELEASE {
                Op::Release { fh, flags, release_flags, lock_owner }
            } else {
                Op::Releasedir { fh, flags }
            }
        }
        op::FLUSH => {
            let fh = r.u64()?;
            r.skip(8)?;
            Op::Flush { fh, lock_owner: r.u64()? }
        }
        op::READDIR | op::READDIRPLUS => {
            let (fh, offset, size) = (r.u64()?, r.u64()?, r.u32()?);
            Op::Readdir { fh, offset, size, plus: opcode == op::READDIRPLUS }
        }
        op::STATFS => Op::Statfs,
        op::INIT => {
            let (major, minor, max_readahead) = (r.u32()?, r.u32()?, r.u32()?);
            let mut flags = r.u32()? as u64;
            // `flags2` exists from protocol 7.36, and counts only when INIT_EXT says so.
            if flags & init::INIT_EXT != 0 && r.left() >= 4 {
                flags |= (r.u32()? as u64) << 32;
            }
            Op::Init { major, minor, max_readahead, flags }
        }
        op::INTERRUPT => Op::Interrupt { unique: r.u64()? },
        op::DESTROY => Op::Destroy,
        op::SETATTR => {
            let valid = r.u32()?;
            r.skip(4)?;
            let (fh, size) = (r.u64()?, r.u64()?);
            r.skip(8)?; // lock_owner
            let (atime, mtime) = (r.u64()?, r.u64()?);
            r.skip(8)?; // ctime
            let (atimensec, mtimensec) = (r.u32()?, r.u32()?);
            r.skip(4)?; // ctimensec
            let mode = r.u32()?;
            r.skip(4)?;
            let (uid, gid) = (r.u32()?, r.u32()?);
            Op::Setattr(SetattrIn {
                valid,
                fh,
                size,
                atime: (atime, atimensec),
                mtime: (mtime, mtimensec),
                mode,
                uid,
                gid,
            })
        }
        op::READLINK => Op::Readlink,
        op::SYMLINK => {
            let (name, target) = two_names(rest(&r), "symlink name", "symlink target")?;
            Op::Symlink { name, target }
        }
        op::MKNOD => {
            let (mode, rdev, umask) = (r.u32()?, r.u32()?, r.u32()?);
            r.skip(4)?;
            Op::Mknod { name: name(rest(&r), "name")?, mode, rdev, umask }
        }
        op::MKDIR => {
            let (mode, umask) = (r.u32()?, r.u32()?);
            Op::Mkdir { name: name(rest(&r), "name")?, mode, umask }
        }
        op::UNLINK => Op::Unlink { name: name(rest(&r), "name")? },
        op::RMDIR => Op::Rmdir { name: name(rest(&r), "name")? },
        op::RENAME | op::RENAME2 => {
            let newdir = r.u64()?;
            let flags = if opcode == op::RENAME2 {
                let f = r.u32()?;
                r.skip(4)?;
                f
            } else {
                0
            };
            let (name, newname) = two_names(rest(&r), "old name", "new name")?;
            Op::Rename { newdir, flags, name, newname }
        }
        op::LINK => {
            let oldnodeid = r.u64()?;
            Op::Link { oldnodeid, name: name(rest(&r), "name")? }
        }
        op::FSYNC | op::FSYNCDIR => {
            let (fh, flags) = (r.u64()?, r.u32()?);
            Op::Fsync { fh, datasync: flags & FSYNC_FDATASYNC != 0, dir: opcode == op::FSYNCDIR }
        }
        op::SETXATTR => {
            let (size, flags) = (r.u32()?, r.u32()? as i32);
            let all = rest(&r);
            let n = name(all, "xattr name")?;
            let value_at = n.len() + 1;
            let value = all.get(value_at..value_at + size as usize).ok_or(AbiError::Short {
                what: "xattr value",
                need: value_at + size as usize,
                got: all.len(),
            })?;
            Op::Setxattr { name: n, value, flags }
        }
        op::GETXATTR => {
            let size = r.u32()?;
            r.skip(4)?;
            Op::Getxattr { name: name(rest(&r), "xattr name")?, size }
        }
        op::LISTXATTR => Op::Listxattr { size: r.u32()? },
        op::REMOVEXATTR => Op::Removexattr { name: name(rest(&r), "xattr name")? },
        op::GETLK | op::SETLK | op::SETLKW => {
            let (fh, owner, start, end) = (r.u64()?, r.u64()?, r.u64()?, r.u64()?);
            let (typ, pid) = (r.u32()? as i32, r.u32()?);
            Op::Lock { opcode, fh, owner, start, end, typ, pid }
        }
        op::ACCESS => Op::Access { mask: r.u32()? },
        op::CREATE => {
            let (flags, mode, umask) = (r.u32()?, r.u32()?, r.u32()?);
            r.skip(4)?;
            Op::Create { name: name(rest(&r), "name")?, flags, mode, umask }
        }
        op::FALLOCATE => {
            let (fh, offset, length, mode) = (r.u64()?, r.u64()?, r.u64()?, r.u32()? as i32);
            Op::Fallocate { fh, offset, length, mode }
        }
        _ => Op::Other { opcode, args: fixed, payload: var },
    })
}

/// The NUL-terminated name at the start of `b`.
fn name<'a>(b: &'a [u8], what: &'static str) -> Result<&'a OsStr, AbiError> {
    let end = b.iter().position(|&c| c == 0).ok_or(AbiError::Unterminated(what))?;
    Ok(OsStr::from_bytes(&b[..end]))
}

/// Two NUL-terminated names, one after the other (rename's, symlink's).
fn two_names<'a>(b: &'a [u8], first: &'static str, second: &'static str) -> Result<(&'a OsStr, &'a OsStr), AbiError> {
    let a = name(b, first)?;
    Ok((a, name(&b[a.len() + 1..], second)?))
}

/// Little-endian fields read in order from a buffer, each bounds-checked.
struct Reader<'a> {
    b: &'a [u8],
    at: usize,
    what: &'static str,
}

impl<'a> Reader<'a> {
    fn new(b: &'a [u8], what: &'static str) -> Reader<'a> {
        Reader { b, at: 0, what }
    }

    fn need(&self, n: usize) -> Result<(), AbiError> {
        if self.left() < n {
            return Err(AbiError::Short { what: self.what, need: self.at + n, got: self.b.len() });
        }
        Ok(())
    }

    fn left(&self) -> usize {
        self.b.len() - self.at
    }

    fn take<const N: usize>(&mut self) -> Result<[u8; N], AbiError> {
        self.need(N)?;
        let v = self.b[self.at..self.at + N].try_into().expect("N bytes");
        self.at += N;
        Ok(v)
    }

    fn skip(&mut self, n: usize) -> Result<(), AbiError> {
        self.need(n)?;
        self.at += n;
        Ok(())
    }

    fn u32(&mut self) -> Result<u32, AbiError> {
        Ok(u32::from_le_bytes(self.take()?))
    }

    fn u64(&mut self) -> Result<u64, AbiError> {
        Ok(u64::from_le_bytes(self.take()?))
    }

    fn rest(&self) -> &'a [u8] {
        &self.b[self.at..]
    }
}

/// Fields written in order into a reply buffer. The caller sizes the buffer for the struct
/// (the constants above); writing past it is a bug in this module, hence the panic.
pub struct Writer<'a> {
    b: &'a mut [u8],
    at: usize,
}

impl<'a> Writer<'a> {
    pub fn new(b: &'a mut [u8]) -> Writer<'a> {
        Writer { b, at: 0 }
    }

    fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.b[self.at..self.at + v.len()].copy_from_slice(v);
        self.at += v.len();
        self
    }

    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.bytes(&v.to_le_bytes())
    }

    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.bytes(&v.to_le_bytes())
    }

    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.bytes(&v.to_le_bytes())
    }

    /// `n` zero bytes (padding, unused fields).
    pub fn zeros(&mut self, n: usize) -> &mut Self {
        self.b[self.at..self.at + n].fill(0);
        self.at += n;
        self
    }

    /// Bytes written so far.
    pub fn len(&self) -> usize {
        self.at
    }

    pub fn is_empty(&self) -> bool {
        self.at == 0
    }
}

/// `struct fuse_out_header` of a reply carrying `n` bytes of arguments, or of error `errno`
/// (positive; sent negated) when it is not 0.
pub fn out_header(unique: u64, n: usize, errno: i32) -> [u8; OUT_HEADER] {
    let mut h = [0u8; OUT_HEADER];
    Writer::new(&mut h).u32((OUT_HEADER + n) as u32).u32((-errno) as u32).u64(unique);
    h
}

/// A file's attributes as `struct fuse_attr` carries them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Attr {
    pub ino: u64,
    pub size: u64,
    pub blocks: u64,
    /// Seconds and nanoseconds of atime, mtime, ctime.
    pub atime: (u64, u32),
    pub mtime: (u64, u32),
    pub ctime: (u64, u32),
    /// Type and permission bits (`S_IFREG | 0o644`, say).
    pub mode: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub rdev: u32,
    pub blksize: u32,
}

impl Attr {
    /// `struct fuse_attr`, [`ATTR`] bytes.
    pub fn encode(&self, w: &mut Writer<'_>) {
        w.u64(self.ino).u64(self.size).u64(self.blocks);
        w.u64(self.atime.0).u64(self.mtime.0).u64(self.ctime.0);
        w.u32(self.atime.1).u32(self.mtime.1).u32(self.ctime.1);
        w.u32(self.mode).u32(self.nlink).u32(self.uid).u32(self.gid).u32(self.rdev).u32(self.blksize);
        w.zeros(4); // flags
    }
}

/// A TTL as the kernel takes it: seconds and nanoseconds.
fn valid(ttl: Duration) -> (u64, u32) {
    (ttl.as_secs(), ttl.subsec_nanos())
}

/// `struct fuse_entry_out` ([`ENTRY_OUT`] bytes): node `attr.ino` of `generation`, the entry and
/// its attributes valid for `ttl`. A negative entry (the name is known missing for `ttl`) is
/// node 0.
pub fn entry_out(o: &mut [u8], attr: &Attr, generation: u64, ttl: Duration) -> usize {
    let (secs, nanos) = valid(ttl);
    let mut w = Writer::new(o);
    w.u64(attr.ino).u64(generation).u64(secs).u64(secs).u32(nanos).u32(nanos);
    attr.encode(&mut w);
    w.len()
}

/// `struct fuse_attr_out` ([`ATTR_OUT`] bytes): `attr` valid for `ttl`.
pub fn attr_out(o: &mut [u8], attr: &Attr, ttl: Duration) -> usize {
    let (secs, nanos) = valid(ttl);
    let mut w = Writer::new(o);
    w.u64(secs).u32(nanos).zeros(4);
    attr.encode(&mut w);
    w.len()
}

/// `struct fuse_write_out` ([`WRITE_OUT`] bytes): `size` bytes written.
pub fn write_out(o: &mut [u8], size: u32) -> usize {
    Writer::new(o).u32(size).zeros(4).len()
}

/// `struct fuse_getxattr_out` ([`GETXATTR_OUT`] bytes): the size a value or list needs.
pub fn getxattr_out(o: &mut [u8], size: u32) -> usize {
    Writer::new(o).u32(size).zeros(4).len()
}

/// `struct fuse_lk_out` ([`LK_OUT`] bytes): a lock's range, `l_type` and holder.
pub fn lk_out(o: &mut [u8], start: u64, end: u64, typ: i32, pid: u32) -> usize {
    Writer::new(o).u64(start).u64(end).u32(typ as u32).u32(pid).len()
}

/// Bytes a `struct fuse_dirent` of a `name_len`-byte name takes, padded to 8.
pub fn dirent_len(name_len: usize) -> usize {
    (DIRENT + name_len).next_multiple_of(8)
}

/// `struct fuse_dirent` ([`dirent_len`] bytes): entry `name` of node `ino`, `typ` its
/// `DT_*` type, `off` the offset the next listing resumes after it.
pub fn dirent(o: &mut [u8], ino: u64, off: u64, typ: u32, name: &[u8]) -> usize {
    let len = dirent_len(name.len());
    let mut w = Writer::new(o);
    w.u64(ino).u64(off).u32(name.len() as u32).u32(typ).bytes(name).zeros(len - DIRENT - name.len());
    w.len()
}

/// `struct fuse_open_out` ([`OPEN_OUT`] bytes): handle `fh`, `FOPEN_*` flags, backing id (0:
/// none).
pub fn open_out(o: &mut [u8], fh: u64, open_flags: u32, backing_id: u32) -> usize {
    Writer::new(o).u64(fh).u32(open_flags).u32(backing_id).len()
}

/// `struct fuse_statfs_out` ([`STATFS_OUT`] bytes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Statfs {
    pub blocks: u64,
    pub bfree: u64,
    pub bavail: u64,
    pub files: u64,
    pub ffree: u64,
    pub bsize: u32,
    pub namelen: u32,
    pub frsize: u32,
}

impl Statfs {
    pub fn encode(&self, o: &mut [u8]) -> usize {
        let mut w = Writer::new(o);
        w.u64(self.blocks).u64(self.bfree).u64(self.bavail).u64(self.files).u64(self.ffree);
        w.u32(self.bsize).u32(self.namelen).u32(self.frsize).zeros(4 + 24);
        w.len()
    }
}

/// What a file system answers to INIT (`struct fuse_init_out`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InitOut {
    pub major: u32,
    pub minor: u32,
    pub max_readahead: u32,
    /// Both words: bits 32 and up go to `flags2`.
    pub flags: u64,
    pub max_background: u16,
    pub congestion_threshold: u16,
    pub max_write: u32,
    pub time_gran: u32,
    pub max_pages: u16,
    /// How deep backing files may stack (passthrough); 0 without passthrough.
    pub max_stack_depth: u32,
}

impl InitOut {
    /// [`INIT_OUT`] bytes.
    pub fn encode(&self, o: &mut [u8]) -> usize {
        let mut w = Writer::new(o);
        w.u32(self.major).u32(self.minor).u32(self.max_readahead).u32(self.flags as u32);
        w.u16(self.max_background).u16(self.congestion_threshold).u32(self.max_write).u32(self.time_gran);
        w.u16(self.max_pages).u16(0).u32((self.flags >> 32) as u32).u32(self.max_stack_depth).zeros(24);
        w.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(opcode: u32, unique: u64, nodeid: u64, args: usize) -> Vec<u8> {
        let mut b = vec![0u8; IN_HEADER];
        let mut w = Writer::new(&mut b);
        w.u32((IN_HEADER + args) as u32).u32(opcode).u64(unique).u64(nodeid).u32(1000).u32(100).u32(4242);
        b
    }

    #[test]
    fn a_header_and_a_lookup_decode_from_one_buffer() {
        let mut b = header(op::LOOKUP, 7, 1, 6);
        b.extend_from_slice(b"seq.0\0");
        let r = Request::parse(&b).unwrap();
        assert_eq!(
            r.header,
            InHeader { len: 46, opcode: op::LOOKUP, unique: 7, nodeid: 1, uid: 1000, gid: 100, pid: 4242 }
        );
        assert_eq!(r.op, Op::Lookup { name: OsStr::new("seq.0") });
    }

    #[test]
    fn a_read_and_a_write_decode_their_fields_and_lock_owners() {
        let mut b = header(op::READ, 9, 5, 40);
        let mut a = [0u8; 40];
        Writer::new(&mut a).u64(3).u64(1 << 20).u32(4096).u32(READ_LOCKOWNER).u64(77).u32(0o2).u32(0);
        b.extend_from_slice(&a);
        let r = Request::parse(&b).unwrap();
        assert_eq!(r.op, Op::Read { fh: 3, offset: 1 << 20, size: 4096, flags: 0o2, lock_owner: Some(77) });

        // A ring entry: the header and write_in in one buffer each, the data in the payload.
        let h = header(op::WRITE, 10, 5, 40 + 5);
        let mut a = [0u8; 40];
        Writer::new(&mut a).u64(3).u64(8).u32(5).u32(0).u64(77).u32(0o1).u32(0);
        let r = Request::parse_parts(&h, &a, b"hello").unwrap();
        assert_eq!(r.op, Op::Write { fh: 3, offset: 8, write_flags: 0, flags: 0o1, lock_owner: None, data: b"hello" });
    }

    #[test]
    fn init_takes_flags2_only_with_init_ext() {
        let mut a = [0u8; 64];
        Writer::new(&mut a).u32(7).u32(44).u32(1 << 17).u32(init::INIT_EXT as u32).u32(1 << 9);
        let mut b = header(op::INIT, 1, 0, 64);
        b.extend_from_slice(&a);
        let Op::Init { major, minor, flags, .. } = Request::parse(&b).unwrap().op else { panic!("not INIT") };
        assert_eq!((major, minor), (7, 44));
        assert_eq!(flags, init::INIT_EXT | init::OVER_IO_URING);

        Writer::new(&mut a).u32(7).u32(44).u32(1 << 17).u32(0).u32(1 << 9);
        let mut b = header(op::INIT, 1, 0, 64);
        b.extend_from_slice(&a);
        let Op::Init { flags, .. } = Request::parse(&b).unwrap().op else { panic!("not INIT") };
        assert_eq!(flags, 0, "flags2 ignored without INIT_EXT");
    }

    #[test]
    fn metadata_requests_decode_their_arguments_and_names() {
        // SETATTR: mode and a size through a handle.
        let mut a = [0u8; 88];
        Writer::new(&mut a).u32(fattr::MODE | fattr::SIZE | fattr::FH).u32(0).u64(4).u64(1000).u64(0);
        a[68..72].copy_from_slice(&0o640u32.to_le_bytes());
        let mut b = header(op::SETATTR, 2, 9, 88);
        b.extend_from_slice(&a);
        let Op::Setattr(s) = Request::parse(&b).unwrap().op else { panic!("not SETATTR") };
        assert_eq!((s.valid, s.fh, s.size, s.mode), (fattr::MODE | fattr::SIZE | fattr::FH, 4, 1000, 0o640));

        // RENAME2 from a ring entry: rename2_in in op_in, both names in the payload.
        let h = header(op::RENAME2, 3, 1, 16 + 4);
        let mut a = [0u8; 16];
        Writer::new(&mut a).u64(7).u32(1).u32(0);
        let r = Request::parse_parts(&h, &a, b"a\0bc\0").unwrap();
        assert_eq!(r.op, Op::Rename { newdir: 7, flags: 1, name: OsStr::new("a"), newname: OsStr::new("bc") });

        // SETXATTR from /dev/fuse: setxattr_in, the name, the value (not NUL-terminated).
        let mut b = header(op::SETXATTR, 4, 1, 8 + 7 + 3);
        let mut a = [0u8; 8];
        Writer::new(&mut a).u32(3).u32(libc::XATTR_CREATE as u32);
        b.extend_from_slice(&a);
        b.extend_from_slice(b"user.k\0v\0w");
        let r = Request::parse(&b).unwrap();
        assert_eq!(r.op, Op::Setxattr { name: OsStr::new("user.k"), value: b"v\0w", flags: libc::XATTR_CREATE });

        // SETLKW and CREATE.
        let mut b = header(op::SETLKW, 5, 9, 48);
        let mut a = [0u8; 48];
        Writer::new(&mut a).u64(3).u64(99).u64(0).u64(u64::MAX).u32(libc::F_WRLCK as u32).u32(42);
        b.extend_from_slice(&a);
        let r = Request::parse(&b).unwrap();
        let want =
            Op::Lock { opcode: op::SETLKW, fh: 3, owner: 99, start: 0, end: u64::MAX, typ: libc::F_WRLCK, pid: 42 };
        assert_eq!(r.op, want);
        let mut b = header(op::CREATE, 6, 1, 16 + 2);
        let mut a = [0u8; 16];
        Writer::new(&mut a).u32(libc::O_WRONLY as u32).u32(0o100644).u32(0o022).u32(0);
        b.extend_from_slice(&a);
        b.extend_from_slice(b"f\0");
        let r = Request::parse(&b).unwrap();
        let want = Op::Create { name: OsStr::new("f"), flags: libc::O_WRONLY as u32, mode: 0o100644, umask: 0o022 };
        assert_eq!(r.op, want);

        // A symlink whose target lacks its NUL, and a value shorter than its size.
        let mut b = header(op::SYMLINK, 7, 1, 4);
        b.extend_from_slice(b"l\0tg");
        assert_eq!(Request::parse(&b), Err(AbiError::Unterminated("symlink target")));
        let mut b = header(op::SETXATTR, 8, 1, 8 + 3);
        let mut a = [0u8; 8];
        Writer::new(&mut a).u32(9).u32(0);
        b.extend_from_slice(&a);
        b.extend_from_slice(b"k\0v");
        assert!(matches!(Request::parse(&b), Err(AbiError::Short { what: "xattr value", .. })));
    }

    #[test]
    fn directory_entries_are_padded_to_eight_bytes() {
        assert_eq!((dirent_len(1), dirent_len(8), dirent_len(9)), (32, 32, 40));
        let mut o = [0xffu8; 40];
        assert_eq!(dirent(&mut o, 5, 3, libc::DT_DIR as u32, b"abcdefghi"), 40);
        assert_eq!(u64::from_le_bytes(o[0..8].try_into().unwrap()), 5);
        assert_eq!(u64::from_le_bytes(o[8..16].try_into().unwrap()), 3);
        assert_eq!(u32::from_le_bytes(o[16..20].try_into().unwrap()), 9);
        assert_eq!(u32::from_le_bytes(o[20..24].try_into().unwrap()), libc::DT_DIR as u32);
        assert_eq!(&o[24..33], b"abcdefghi");
        assert_eq!(o[33..40], [0; 7], "padding");
    }

    #[test]
    fn short_and_unterminated_requests_are_errors_not_panics() {
        assert_eq!(InHeader::parse(&[0u8; 39]), Err(AbiError::Short { what: "header", need: 40, got: 39 }));
        let mut b = header(op::LOOKUP, 7, 1, 5);
        b.extend_from_slice(b"seq.0");
        assert_eq!(Request::parse(&b), Err(AbiError::Unterminated("name")));
        let mut b = header(op::READ, 9, 5, 12);
        b.extend_from_slice(&[0u8; 12]);
        assert!(matches!(Request::parse(&b), Err(AbiError::Short { what: "arguments", .. })));
        // A WRITE whose size is more than its data.
        let h = header(op::WRITE, 10, 5, 40);
        let mut a = [0u8; 40];
        Writer::new(&mut a).u64(3).u64(0).u32(4096);
        let got = Request::parse_parts(&h, &a, b"abc");
        assert_eq!(got, Err(AbiError::Short { what: "write data", need: 4096, got: 3 }));
        // A batch forget that claims more nodes than it carries.
        let mut b = header(op::BATCH_FORGET, 11, 0, 8 + 16);
        let mut a = [0u8; 8 + 16];
        Writer::new(&mut a).u32(2).u32(0).u64(5).u64(1);
        b.extend_from_slice(&a);
        assert!(matches!(Request::parse(&b), Err(AbiError::Short { what: "forget list", .. })));
    }

    #[test]
    fn replies_have_the_kernels_sizes_and_field_places() {
        let attr = Attr { ino: 9, size: 4096, mode: libc::S_IFREG | 0o644, nlink: 1, blksize: 4096, ..Attr::default() };
        let mut o = [0xffu8; 256];
        assert_eq!(entry_out(&mut o, &attr, 0, Duration::from_secs(3600)), ENTRY_OUT);
        assert_eq!(u64::from_le_bytes(o[0..8].try_into().unwrap()), 9, "nodeid");
        assert_eq!(u64::from_le_bytes(o[16..24].try_into().unwrap()), 3600, "entry_valid");
        assert_eq!(u64::from_le_bytes(o[48..56].try_into().unwrap()), 4096, "attr.size");
        assert_eq!(u32::from_le_bytes(o[40 + 60..40 + 64].try_into().unwrap()), libc::S_IFREG | 0o644, "attr.mode");
        assert_eq!(u32::from_le_bytes(o[40 + 80..40 + 84].try_into().unwrap()), 4096, "attr.blksize");
        assert_eq!(o[40 + 84..ENTRY_OUT], [0; 4], "attr.flags");
        assert_eq!(attr_out(&mut o, &attr, Duration::from_secs(1)), ATTR_OUT);
        assert_eq!(u64::from_le_bytes(o[16..24].try_into().unwrap()), 9, "attr.ino after the validity");
        assert_eq!(open_out(&mut o, 5, FOPEN_KEEP_CACHE, 0), OPEN_OUT);
        assert_eq!(Statfs { bsize: 4096, namelen: 255, ..Statfs::default() }.encode(&mut o), STATFS_OUT);
        assert_eq!(u32::from_le_bytes(o[44..48].try_into().unwrap()), 255, "namelen");
        let init = InitOut {
            major: 7,
            minor: 44,
            max_readahead: 1 << 20,
            flags: init::ASYNC_READ | init::OVER_IO_URING,
            max_background: 64,
            congestion_threshold: 48,
            max_write: 1 << 20,
            time_gran: 1,
            max_pages: 256,
            max_stack_depth: 1,
        };
        assert_eq!(init.encode(&mut o), INIT_OUT);
        assert_eq!(u32::from_le_bytes(o[12..16].try_into().unwrap()), 1, "flags");
        assert_eq!(u16::from_le_bytes(o[28..30].try_into().unwrap()), 256, "max_pages");
        assert_eq!(u32::from_le_bytes(o[32..36].try_into().unwrap()), 1 << 9, "flags2");
        assert_eq!(u32::from_le_bytes(o[36..40].try_into().unwrap()), 1, "max_stack_depth");
        let h = out_header(12, 8, libc::ENOENT);
        assert_eq!(u32::from_le_bytes(h[0..4].try_into().unwrap()), 24);
        assert_eq!(i32::from_le_bytes(h[4..8].try_into().unwrap()), -libc::ENOENT);
        assert_eq!(u64::from_le_bytes(h[8..16].try_into().unwrap()), 12);
    }
}
