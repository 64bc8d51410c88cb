//! Translation between odfs's types and FUSE's: attributes, file kinds, times, names, statfs,
//! Pure functions; no state and no I/O.

use fuser::{FileAttr, FileType, INodeNo, TimeOrNow};
use odfs_proto::meta::{Attr, FileKind, SetTime, StatFsReply};
use odfs_proto::Timespec;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
#[cfg(test)]
use std::time::UNIX_EPOCH;

/// `st_blksize` of inodes without a layout (directories, symbolic links): the default chunk size,
/// so tools that size their buffers from it move whole chunks.
pub const DEFAULT_BLKSIZE: u32 = 1 << 20;
/// Block size reported by statfs (`f_bsize` and `f_frsize`).
pub const STATFS_BSIZE: u32 = 4096;
/// Longest name reported by statfs (metad's limit).
pub const NAMELEN: u32 = odfs_proto::NAME_MAX as u32;

/// The FUSE file type of an odfs inode kind.
pub fn file_type(kind: FileKind) -> FileType {
    match kind {
        FileKind::File => FileType::RegularFile,
        FileKind::Dir => FileType::Directory,
        FileKind::Symlink => FileType::Symlink,
        FileKind::Fifo => FileType::NamedPipe,
        FileKind::Socket => FileType::Socket,
        FileKind::CharDev => FileType::CharDevice,
        FileKind::BlockDev => FileType::BlockDevice,
    }
}

/// The odfs kind of a special file's `mknod` mode (`S_IFIFO`, ...); None for other types.
pub fn special_kind(mode: u32) -> Option<FileKind> {
    match mode & libc::S_IFMT {
        libc::S_IFIFO => Some(FileKind::Fifo),
        libc::S_IFSOCK => Some(FileKind::Socket),
        libc::S_IFCHR => Some(FileKind::CharDev),
        libc::S_IFBLK => Some(FileKind::BlockDev),
        _ => None,
    }
}

/// FUSE attributes of an odfs inode. The FUSE inode number is the odfs inode id.
pub fn file_attr(a: &Attr) -> FileAttr {
    FileAttr {
        ino: INodeNo(a.ino.0),
        size: a.size,
        // odfs does not track allocation (sparse regions included): report the size, rounded
        // up, so `du` and `ls -s` show what a dense file of that size would use.
        blocks: a.size.div_ceil(512),
        atime: a.atime.into(),
        mtime: a.mtime.into(),
        ctime: a.ctime.into(),
        crtime: a.ctime.into(),
        kind: file_type(a.kind),
        perm: (a.mode & 0o7777) as u16,
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        rdev: a.rdev,
        blksize: a.layout.as_ref().map_or(DEFAULT_BLKSIZE, |l| l.chunk_size),
        flags: 0,
    }
}

/// A time to set, as odfs's protocol carries it.
pub fn set_time(t: TimeOrNow) -> SetTime {
    match t {
        TimeOrNow::Now => SetTime::Now,
        TimeOrNow::SpecificTime(t) => SetTime::At(Timespec::from(t)),
    }
}

/// A name as the raw bytes odfs uses.
pub fn name_bytes(name: &OsStr) -> Vec<u8> {
    name.as_bytes().to_vec()
}

/// statfs numbers in FUSE's units: (blocks, bfree, bavail, files, ffree).
pub fn statfs_blocks(s: &StatFsReply) -> (u64, u64, u64, u64, u64) {
    let bs = STATFS_BSIZE as u64;
    let free = s.free_bytes / bs;
    (s.total_bytes / bs, free, free, s.total_inodes, s.free_inodes)
}

/// The NUL-terminated list `listxattr` returns.
pub fn xattr_list(names: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::with_capacity(names.iter().map(|n| n.len() + 1).sum());
    for n in names {
        out.extend_from_slice(n);
        out.push(0);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use odfs_proto::{InodeId, Layout};
    use std::time::Duration;

    fn attr(kind: FileKind, size: u64, layout: Option<Layout>) -> Attr {
        Attr {
            ino: InodeId(0x0001_0000_0000_0042),
            kind,
            mode: 0o4755,
            nlink: 3,
            uid: 1000,
            gid: 100,
            size,
            atime: Timespec { sec: 10, nsec: 5 },
            mtime: Timespec { sec: 20, nsec: 6 },
            ctime: Timespec { sec: 30, nsec: 7 },
            layout,
            dir_stripes: Vec::new(),
            rdev: 0,
            sealed: false,
        }
    }

    #[test]
    fn attributes_translate_field_by_field() {
        let l = Layout { chunk_size: 65536, pool: "default".into(), targets: vec![1, 2] };
        let f = file_attr(&attr(FileKind::File, 1025, Some(l)));
        assert_eq!(f.ino, INodeNo(0x0001_0000_0000_0042));
        assert_eq!(f.kind, FileType::RegularFile);
        assert_eq!(f.perm, 0o4755);
        assert_eq!((f.nlink, f.uid, f.gid, f.size), (3, 1000, 100, 1025));
        assert_eq!(f.blocks, 3);
        assert_eq!(f.blksize, 65536);
        assert_eq!(f.atime, UNIX_EPOCH + Duration::new(10, 5));
        assert_eq!(f.mtime, UNIX_EPOCH + Duration::new(20, 6));
        assert_eq!(f.ctime, UNIX_EPOCH + Duration::new(30, 7));
        let d = file_attr(&attr(FileKind::Dir, 4096, None));
        assert_eq!((d.kind, d.blocks, d.blksize), (FileType::Directory, 8, DEFAULT_BLKSIZE));
        assert_eq!(file_attr(&attr(FileKind::Symlink, 0, None)).blocks, 0);
    }

    #[test]
    fn xattr_lists_and_statfs_units() {
        assert_eq!(xattr_list(&[b"user.a".to_vec(), b"user.bc".to_vec()]), b"user.a\0user.bc\0".to_vec());
        assert!(xattr_list(&[]).is_empty());
        let s = StatFsReply {
            total_bytes: 10 * 4096 + 100,
            free_bytes: 4 * 4096,
            total_inodes: 50,
            free_inodes: 40,
            used_inodes: 10,
            block_size: 4096,
        };
        assert_eq!(statfs_blocks(&s), (10, 4, 4, 50, 40));
        let t = UNIX_EPOCH + Duration::new(5, 9);
        assert_eq!(set_time(TimeOrNow::SpecificTime(t)), SetTime::At(Timespec { sec: 5, nsec: 9 }));
        assert_eq!(set_time(TimeOrNow::Now), SetTime::Now);
        // What the session hands over for the kernel's (-1, 999_999_995) and (-3, 0).
        let t = UNIX_EPOCH - Duration::from_nanos(5);
        assert_eq!(set_time(TimeOrNow::SpecificTime(t)), SetTime::At(Timespec { sec: -1, nsec: 999_999_995 }));
        let t = UNIX_EPOCH - Duration::new(3, 0);
        assert_eq!(set_time(TimeOrNow::SpecificTime(t)), SetTime::At(Timespec { sec: -3, nsec: 0 }));
    }
}
