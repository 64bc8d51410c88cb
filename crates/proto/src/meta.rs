//! Messages of the metadata service (metad): the namespace.
//!
//! Names are raw bytes, as on Linux. Every mutating request is idempotent under retry: metad
//! records its reply under the header's `(client_id, request_id)`.

use crate::{DirLayout, InodeId, Layout, NodeIndex, Timespec};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum FileKind {
    File,
    Dir,
    Symlink,
    /// A named pipe; its I/O is the kernel's on the node that opens it.
    Fifo,
    /// A Unix socket's name; connections are the kernel's on the node that binds it.
    Socket,
    /// Device nodes (made by root; a `nodev` mount does not open them as devices).
    CharDev,
    BlockDev,
}

impl FileKind {
    /// FIFOs, sockets and device nodes: inodes without data whose I/O is never odfs's.
    pub fn is_special(self) -> bool {
        matches!(self, FileKind::Fifo | FileKind::Socket | FileKind::CharDev | FileKind::BlockDev)
    }
}

/// Attributes of an inode. `mode` holds the permission bits (07777) only; `kind` the type.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attr {
    pub ino: InodeId,
    pub kind: FileKind,
    pub mode: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    pub atime: Timespec,
    pub mtime: Timespec,
    pub ctime: Timespec,
    /// Regular files: where the data lives.
    pub layout: Option<Layout>,
    /// Directories striped over metadata shards: the shards holding their entries, in order
    /// (an entry's shard is `stripes[hash(name) % len]`); empty when the directory's own shard
    /// holds every entry.
    pub dir_stripes: Vec<u16>,
    /// Device nodes: the device number (`st_rdev`, the kernel's encoding); 0 otherwise.
    pub rdev: u32,
    /// Part of a sealed tree: every change is refused (EROFS) until it is unsealed, and
    /// clients may cache everything about it while their session lasts.
    pub sealed: bool,
}

/// The shard holding entry `name` of a directory striped over `stripes`; None for a directory
/// that is not striped. FNV-1a 64 of the name's [`hash_stem`] (as Lustre's `fnv_1a_64`), then
/// mixed: FNV's low bits depend only on the low bits of each byte, so names like `f1` and `r1`
/// would always share a shard of a power-of-two count.
pub fn entry_shard(stripes: &[u16], name: &[u8]) -> Option<u16> {
    if stripes.len() < 2 {
        return None;
    }
    let stem = hash_stem(name);
    let mut h = stem.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3));
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    Some(stripes[(h % stripes.len() as u64) as usize])
}

/// Suffixes of temporary names written before a rename to the name without them.
const TEMP_SUFFIXES: [&[u8]; 6] = [b".tmp", b".temp", b".part", b".partial", b".incomplete", b".new"];

/// The part of a name its shard is chosen by: the name without the decorations of a temporary
/// file, so that writing `NAME.tmp` (or rsync's `.NAME.Xa9qZ2`, or `NAME~`) and renaming it to
/// `NAME` stays within one shard — a rename between shards is a spanning operation, coordinated
/// across both and slower. As Lustre's
/// `crush` directory hash, it strips:
/// - a random suffix `.XXXXXX` of 6 to 8 letters and digits with both upper- and lower-case
///   letters (mkstemp's alphabet; hex ids and extensions like `.sha256` never qualify), or of
///   any 6 letters and digits after a name with a leading dot (rsync's `.NAME.XXXXXX`), and
///   then one leading dot;
/// - `.tmp`, `.temp`, `.part`, `.partial`, `.incomplete` or `.new`, each optionally followed by
///   digits or `.` and digits (a pid or counter), and a trailing `~`.
///
/// Repeated until nothing more goes; never down to an empty stem.
pub fn hash_stem(name: &[u8]) -> &[u8] {
    let mut stem = name;
    for _ in 0..4 {
        let next = strip_random_suffix(stem).or_else(|| strip_temp_suffix(stem));
        match next {
            Some(n) if !n.is_empty() && n != b"." => stem = n,
            _ => break,
        }
    }
    stem
}

fn strip_random_suffix(name: &[u8]) -> Option<&[u8]> {
    let dot = name.iter().rposition(|&b| b == b'.')?;
    let suffix = &name[dot + 1..];
    let mixed = suffix.iter().any(u8::is_ascii_uppercase) && suffix.iter().any(u8::is_ascii_lowercase);
    // rsync's `.NAME.XXXXXX` is known by its shape, whatever letters mkstemp drew.
    let rsync = name.first() == Some(&b'.') && suffix.len() == 6;
    let random = (6..=8).contains(&suffix.len()) && suffix.iter().all(u8::is_ascii_alphanumeric) && (mixed || rsync);
    if !random || dot == 0 {
        return None;
    }
    let rest = &name[..dot];
    Some(match rest.strip_prefix(b".") {
        Some(r) if !r.is_empty() => r,
        _ => rest,
    })
}

fn strip_temp_suffix(name: &[u8]) -> Option<&[u8]> {
    if let Some(r) = name.strip_suffix(b"~") {
        return Some(r);
    }
    // A pid or counter after the suffix: `.tmp123`, `.tmp.123`.
    let digits = name.iter().rev().take_while(|b| b.is_ascii_digit()).count();
    let mut cut = &name[..name.len() - digits];
    if digits > 0 {
        cut = cut.strip_suffix(b".").unwrap_or(cut);
    }
    TEMP_SUFFIXES.iter().find_map(|s| cut.strip_suffix(*s)).filter(|r| !r.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_spread_evenly_over_the_shards() {
        let stripes = [0u16, 1, 2, 3];
        assert_eq!(entry_shard(&[5], b"x"), None, "a plain directory");
        let mut n = [0u32; 4];
        for i in 0..40_000 {
            n[entry_shard(&stripes, format!("f{i}").as_bytes()).unwrap() as usize] += 1;
        }
        assert!(n.iter().all(|&c| (9_000..=11_000).contains(&c)), "{n:?}");
        // Names that differ only in bytes equal modulo 4 still spread.
        let s: std::collections::HashSet<u16> = [&b"f1"[..], b"r1", b"b1", b"n1", b"j1", b"v1"]
            .iter()
            .map(|nm| entry_shard(&stripes, nm).unwrap())
            .collect();
        assert!(s.len() > 1, "{s:?}");
    }

    #[test]
    fn temporary_names_share_their_final_names_shard() {
        let stripes = [0u16, 1, 2, 3, 4, 5, 6, 7];
        for i in 0..2_000 {
            let name = format!("ckpt-{i}.pt");
            let want = entry_shard(&stripes, name.as_bytes());
            for tmp in [
                format!("{name}.tmp"),
                format!("{name}.tmp.{}", 4000 + i),
                format!("{name}.tmp{i}"),
                format!("{name}.part"),
                format!("{name}.incomplete"),
                format!("{name}~"),
                format!(".{name}.Xa9qZ2"),
                format!(".{name}.abc123"),
                format!("{name}.Qz81kLmA"),
                format!("{name}.tmp.aB3dEf"),
            ] {
                assert_eq!(entry_shard(&stripes, tmp.as_bytes()), want, "{tmp} and {name}");
            }
        }
        assert_eq!(hash_stem(b"..bashrc.Xa9qZ2"), b".bashrc", "rsync's temporary name of a dot file");
        for kept in
            [&b"model.sha256"[..], b"blob.a1b2c3d4", b"x.ABCDEF", b"notes.txt", b".tmp", b"~", b".Xa9qZ2", b"v.tmp"]
        {
            let want: &[u8] = if kept == b"v.tmp" { b"v" } else { kept };
            assert_eq!(hash_stem(kept), want, "{}", String::from_utf8_lossy(kept));
        }
        // Ids after a dot still spread: hex ids are not taken for random suffixes.
        let mut n = [0u32; 4];
        for i in 0..40_000u32 {
            n[entry_shard(&stripes[..4], format!("blob.{:08x}", i.wrapping_mul(2_654_435_761)).as_bytes()).unwrap()
                as usize] += 1;
        }
        assert!(n.iter().all(|&c| (9_000..=11_000).contains(&c)), "{n:?}");
    }
}

/// A time to set: the server's clock, or a given time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SetTime {
    Now,
    At(Timespec),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lookup {
    pub parent: InodeId,
    #[serde(with = "serde_bytes")]
    pub name: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GetAttr {
    pub ino: InodeId,
}

/// Check `mask` (R_OK=4, W_OK=2, X_OK=1; 0 = existence) for the caller.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Access {
    pub ino: InodeId,
    pub mask: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct SetAttr {
    pub ino: InodeId,
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime: Option<SetTime>,
    pub mtime: Option<SetTime>,
    /// The size changes through a descriptor the caller opened for writing (`ftruncate`,
    /// `fallocate`): access was decided at open, so write permission is not checked again.
    pub open_for_write: bool,
    /// Drop set-user-id, and set-group-id when group-executable, as Linux does when a caller
    /// without CAP_FSETID writes to a regular file. Needs write access (or `open_for_write`),
    /// not ownership. (A size change by a caller other than root drops them without asking.)
    pub kill_setid: bool,
}

/// The set-id bits of a non-directory's `mode` that a write, a truncate or a chown by a caller
/// drops (Linux `setattr_should_drop_suidgid`): set-user-id always; set-group-id when
/// group-executable, or when the caller is neither root nor in the file's group (without
/// group-execute the bit marks mandatory locking, which such a caller keeps).
pub fn setid_dropped(mode: u32, caller_root: bool, caller_in_group: bool) -> u32 {
    let sgid = mode & 0o2000 != 0 && (mode & 0o010 != 0 || !(caller_root || caller_in_group));
    (mode & 0o4000) | if sgid { 0o2000 } else { 0 }
}

/// Checks one directory entry name: not empty, not "." or "..", no '/' or NUL, at most
/// `NAME_MAX` bytes. metad checks every new name; a client answering a create itself does too.
pub fn check_name(name: &[u8]) -> Result<(), crate::RemoteError> {
    use crate::{ErrorCode, RemoteError, NAME_MAX};
    let show = || String::from_utf8_lossy(name);
    if name.is_empty() {
        return Err(RemoteError::new(ErrorCode::Invalid, "name is empty"));
    }
    if name.len() > NAME_MAX {
        return Err(RemoteError::new(
            ErrorCode::NameTooLong,
            format!("name is {} bytes; the limit is {NAME_MAX}", name.len()),
        ));
    }
    if name == b"." || name == b".." {
        return Err(RemoteError::new(ErrorCode::Invalid, format!("name \"{}\" is reserved", show())));
    }
    if name.contains(&b'/') {
        return Err(RemoteError::new(ErrorCode::Invalid, format!("name \"{}\" contains '/'", show())));
    }
    if name.contains(&0) {
        return Err(RemoteError::new(ErrorCode::Invalid, "name contains a NUL byte"));
    }
    Ok(())
}

/// Whether the sticky bit lets user `uid` remove a name of a directory of mode `dir_mode` owned
/// by `dir_uid` that names an inode owned by `victim_uid`: always in a directory without it,
/// else only for root and the owners of the directory or the inode. metad applies it to every
/// removal; a client answering an unlink under a delegation applies it too.
pub fn sticky_allows(uid: u32, dir_mode: u32, dir_uid: u32, victim_uid: u32) -> bool {
    dir_mode & 0o1000 == 0 || uid == 0 || uid == victim_uid || uid == dir_uid
}

/// Group and mode of a new inode made by `caller` in a directory of mode `parent_mode` and
/// group `parent_gid`: a set-group-id directory passes on its group, and to subdirectories its
/// set-group-id bit. A new file keeps set-group-id only if its creator belongs to the inherited
/// group (Linux `mode_strip_sgid`). metad applies it to every new inode; a client answering a
/// create under a delegation applies it too, so both build the same attributes.
pub fn new_owner(
    caller: &crate::RequestHeader,
    parent_mode: u32,
    parent_gid: u32,
    mode: u32,
    is_dir: bool,
) -> (u32, u32) {
    const S_ISGID: u32 = 0o2000;
    if parent_mode & S_ISGID == 0 {
        return (caller.gid, mode);
    }
    let mode = if is_dir {
        mode | S_ISGID
    } else if mode & (S_ISGID | 0o010) == (S_ISGID | 0o010) && !caller.is_root() && !caller.in_group(parent_gid) {
        mode & !S_ISGID
    } else {
        mode
    };
    (parent_gid, mode)
}

impl Default for InodeId {
    fn default() -> Self {
        InodeId::ROOT
    }
}

/// Create a regular file. With `exclusive` an existing name fails with `Exists`; without it the
/// existing file is returned (`created = false`) after a permission check for `open_write`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Create {
    pub parent: InodeId,
    #[serde(with = "serde_bytes")]
    pub name: Vec<u8>,
    pub mode: u32,
    pub exclusive: bool,
    /// Layout for the new file instead of the directory default.
    pub layout: Option<DirLayout>,
    /// The caller opens the file: register it as held open by this client (see `Open`).
    pub register: bool,
    /// The creating client's node, for local placement.
    pub node: Option<NodeIndex>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreateReply {
    pub attr: Attr,
    pub created: bool,
    /// The directory's attributes after the create, when its shard made it (the client
    /// caches them instead of asking again).
    pub parent: Option<Attr>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mkdir {
    pub parent: InodeId,
    #[serde(with = "serde_bytes")]
    pub name: Vec<u8>,
    pub mode: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unlink {
    pub parent: InodeId,
    #[serde(with = "serde_bytes")]
    pub name: Vec<u8>,
}

/// The inode whose last link went away, if any: its chunks may now be removed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnlinkReply {
    pub removed: Option<Attr>,
    /// The directory's attributes after the unlink, when its shard did it alone.
    pub parent: Option<Attr>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rmdir {
    pub parent: InodeId,
    #[serde(with = "serde_bytes")]
    pub name: Vec<u8>,
}

/// `RENAME_NOREPLACE`: fail with `Exists` if the destination exists.
pub const RENAME_NOREPLACE: u32 = 1;
/// `RENAME_EXCHANGE`: swap source and destination atomically.
pub const RENAME_EXCHANGE: u32 = 2;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rename {
    pub parent: InodeId,
    #[serde(with = "serde_bytes")]
    pub name: Vec<u8>,
    pub new_parent: InodeId,
    #[serde(with = "serde_bytes")]
    pub new_name: Vec<u8>,
    pub flags: u32,
}

/// A replaced destination whose last link went away.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RenameReply {
    pub removed: Option<Attr>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Symlink {
    pub parent: InodeId,
    #[serde(with = "serde_bytes")]
    pub name: Vec<u8>,
    #[serde(with = "serde_bytes")]
    pub target: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Readlink {
    pub ino: InodeId,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Link {
    pub ino: InodeId,
    pub new_parent: InodeId,
    #[serde(with = "serde_bytes")]
    pub new_name: Vec<u8>,
}

/// List a directory from `cookie` (0 = start). Cookies are stable: an entry present for the
/// whole listing is returned exactly once, however the directory changes meanwhile.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadDir {
    pub ino: InodeId,
    pub cookie: u64,
    pub max_entries: u32,
    /// Include attributes (readdirplus).
    pub plus: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirEntry {
    #[serde(with = "serde_bytes")]
    pub name: Vec<u8>,
    pub ino: InodeId,
    pub kind: FileKind,
    /// Pass back to continue after this entry.
    pub cookie: u64,
    pub attr: Option<Attr>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadDirReply {
    pub entries: Vec<DirEntry>,
    pub eof: bool,
}

/// `XATTR_CREATE`: fail if the attribute exists.
pub const XATTR_CREATE: u32 = 1;
/// `XATTR_REPLACE`: fail if the attribute does not exist.
pub const XATTR_REPLACE: u32 = 2;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetXattr {
    pub ino: InodeId,
    #[serde(with = "serde_bytes")]
    pub name: Vec<u8>,
    #[serde(with = "serde_bytes")]
    pub value: Vec<u8>,
    pub flags: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GetXattr {
    pub ino: InodeId,
    #[serde(with = "serde_bytes")]
    pub name: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListXattr {
    pub ino: InodeId,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoveXattr {
    pub ino: InodeId,
    #[serde(with = "serde_bytes")]
    pub name: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatFs {}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct StatFsReply {
    pub total_bytes: u64,
    pub free_bytes: u64,
    pub total_inodes: u64,
    pub free_inodes: u64,
    pub used_inodes: u64,
    pub block_size: u32,
}

/// Record that data was written up to `size` (grows the size, never shrinks it) and set mtime.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExtendSize {
    pub ino: InodeId,
    pub size: u64,
    pub mtime: Timespec,
}

/// Check that the caller may open the file with these access bits and return its attributes.
/// With `register`, the file is held open by this client until its `Release`: if its last name
/// goes meanwhile, it stays as an orphan (nlink 0, reachable by inode id) for this client.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Open {
    pub ino: InodeId,
    pub read: bool,
    pub write: bool,
    pub register: bool,
}

/// The client no longer holds these files open: each with the request id of the latest open it
/// releases (an open sent later, still in flight, stays registered). An orphan whose last holder
/// this was is removed; the reply lists them, so the client removes their chunks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Release {
    pub files: Vec<(InodeId, u64)>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleaseReply {
    pub removed: Vec<Attr>,
}

/// Seals one inode (`sealed`) or unseals it: its owner or root only. A sealed inode refuses
/// every change with `ReadOnly` (EROFS): of its attributes, extended attributes, data and
/// layout, and for a directory of its names. Sealing a tree is done inode by inode from the top
/// (a sealed directory takes no new name, so its listing is final when it is walked); a striped
/// directory is sealed on each of its shards.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetSealed {
    pub ino: InodeId,
    pub sealed: bool,
}

/// What a lock request asks for: a shared (read) lock, an exclusive (write) lock, or none
/// (unlock) on its range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LockKind {
    Read,
    Write,
    Unlock,
}

/// Takes, changes or drops the caller's lock on bytes `start..=end` of `ino` (docs/
/// architecture.md, "Locks across nodes"). `owner` is the kernel's lock owner on the client (a
/// process for `fcntl` locks, an open file for `flock` and OFD locks); its own locks in the
/// range are replaced. A conflicting lock of another owner refuses it; with `wait_ms` > 0 the
/// shard waits up to that long for the conflicting locks to go before refusing. Reply: granted.
/// `reclaim`: a lock the client held before the shard restarted, taken back during the
/// restart's grace, when the shard grants no other lock.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetLock {
    pub ino: InodeId,
    pub owner: u64,
    pub pid: u32,
    pub kind: LockKind,
    pub start: u64,
    pub end: u64,
    pub wait_ms: u32,
    pub reclaim: bool,
}

/// The first lock of another owner that would refuse `kind` on `start..=end` (F_GETLK).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TestLock {
    pub ino: InodeId,
    pub owner: u64,
    pub kind: LockKind,
    pub start: u64,
    pub end: u64,
}

/// A lock held, as `TestLock` reports it: `pid` is the holder's when it is the asking client's,
/// 0 when it is another node's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LockHolder {
    pub kind: LockKind,
    pub start: u64,
    pub end: u64,
    pub pid: u32,
}

/// Drops every lock the caller's `owners` hold on `ino` (their close, or their open file's).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DropLocks {
    pub ino: InodeId,
    pub owners: Vec<u64>,
}

/// Keeps this client's session with the shard alive and carries its acknowledgements of
/// recalls: answered after at most `wait_ms`, or at once when recalls are queued for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionPoll {
    pub wait_ms: u32,
    /// Every recall up to this sequence number has been applied (0: none yet).
    pub acked: u64,
    /// Inodes among the recalled ones that this client holds open, each with the request id
    /// it registers the open under: they stay orphans for it if their last name went.
    pub open: Vec<(InodeId, u64)>,
    /// The client caches what it is told (and so takes leases). A one-shot client (a command
    /// that exits when done) does not: a change never waits for it.
    pub caching: bool,
}

/// Ends client `client`'s session with the shard at once: its leases, create delegations,
/// registrations and locks go, and no change waits for it any more. A client sends it for
/// itself when it unmounts or exits (after its deferred creates); a node's teardown sends it
/// for a client of that node that died without saying so. The session never comes back: a
/// later request under that client id gets no lease and registers nothing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndSession {
    pub client: u64,
}

/// What a client must stop caching: attributes (and, for files, data) of `inos`, and the
/// names `names` (directory, name), positive or negative.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Recall {
    pub seq: u64,
    pub inos: Vec<InodeId>,
    pub names: Vec<(InodeId, Vec<u8>)>,
    /// Directories whose create delegation ends: the client stops answering creates there,
    /// sends its deferred changes (`CreateBatch`) and only then acknowledges.
    pub dirs: Vec<InodeId>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionReply {
    /// The shard did not know this client (it restarted, or the session lapsed): the client
    /// drops everything it cached from the shard and registers its open files again (`Reopen`).
    pub new_session: bool,
    /// A client silent for this long has lost its session, and every lease with it.
    pub lease_ms: u32,
    /// Recalls not yet acknowledged, oldest first.
    pub recalls: Vec<Recall>,
}

/// After a new session: the files this client holds open on the shard, each with the request id
/// of its latest open. Inodes that no longer exist are left out of the reply's count.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reopen {
    pub files: Vec<(InodeId, u64)>,
}

/// Make a FIFO, a socket's name or a device node (`mknod(2)`). Only root makes devices.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mknod {
    pub parent: InodeId,
    #[serde(with = "serde_bytes")]
    pub name: Vec<u8>,
    pub kind: FileKind,
    pub mode: u32,
    pub rdev: u32,
}

/// Set the default layout a directory gives new children.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetDirLayout {
    pub ino: InodeId,
    pub layout: DirLayout,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GetDirLayout {
    pub ino: InodeId,
}

/// Spread an empty directory's entries over `count` metadata shards (-1 = every shard):
/// asked of the directory's own shard, which sets up the parts on the other shards first
/// (`odfs mkdir -c N`, the `odfs.dir_layout` attribute).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StripeDir {
    pub ino: InodeId,
    pub count: i32,
}

/// Between metadata services: a striped directory's part on another shard, with the
/// directory's permissions and default layout (for the checks and the new files made there).
/// Creating an existing part updates it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreateShadow {
    pub ino: InodeId,
    pub parent: InodeId,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub layout: DirLayout,
    pub stripes: Vec<u16>,
}

/// Between metadata services: a striped directory's permissions or layout changed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyncShadow {
    pub ino: InodeId,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub layout: DirLayout,
}

/// Between metadata services, removing a striped directory: `seal` an empty part (it then
/// refuses new entries) or fail with `NotEmpty`; or unseal it again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SealShadow {
    pub ino: InodeId,
    pub seal: bool,
}

/// Between metadata services: forget an empty part of a removed striped directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DropShadow {
    pub ino: InodeId,
}

/// Entries of the part of a directory on the shard asked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CountEntries {
    pub ino: InodeId,
}

/// Give an empty regular file a new layout (targets chosen from `layout` as for a create).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetFileLayout {
    pub ino: InodeId,
    pub layout: DirLayout,
    /// The asking client's node, for local placement.
    pub node: Option<NodeIndex>,
}

/// Between metadata services: one step of an operation that spans shards, for the shard that
/// holds the step's name or inode (see docs/architecture.md, "Operations that span shards").
/// The header carries the caller's identity (for permission checks) and a request id unique to
/// the step and phase, so a repeated step is answered as the first time.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Step {
    pub intent: u64,
    pub phase: StepPhase,
    pub change: StepChange,
    /// The client whose operation this step is part of (0: unknown, after a restart): its
    /// own caches are its business, it is sent no recalls for the step.
    pub client: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum StepPhase {
    /// Check the change as the local operation would and pin what it touches.
    Prepare,
    /// Make the change and unpin.
    Commit,
    /// Unpin without changing anything.
    Abort,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum StepChange {
    /// `name` in directory `parent` (its part on this shard) goes; it names `ino`, owned by
    /// `owner` (for the sticky bit), a directory if `is_dir`.
    RemoveName {
        parent: InodeId,
        #[serde(with = "serde_bytes")]
        name: Vec<u8>,
        ino: InodeId,
        owner: u32,
        is_dir: bool,
    },
    /// `name` in `parent` names `ino` (of kind `kind`) from now on. `expect` is what it names
    /// now: nothing, or an inode and its owner (replaced, or exchanged with `RENAME_EXCHANGE`).
    SetName {
        parent: InodeId,
        #[serde(with = "serde_bytes")]
        name: Vec<u8>,
        ino: InodeId,
        kind: FileKind,
        expect: Option<(InodeId, FileKind, u32)>,
        exchange: bool,
    },
    /// One more link to a non-directory of this shard.
    AddLink { ino: InodeId },
    /// One link fewer; at none the inode goes, or stays as an orphan while a client holds it.
    DropLink { ino: InodeId },
    /// An empty directory of this shard goes (sealed from prepare on: it takes no entry).
    DropDir { ino: InodeId },
    /// A directory of this shard moved: its ".." is now `to`. Prepare checks write permission
    /// on it, as Linux does.
    Reparent { ino: InodeId, to: InodeId },
}

/// What a step's prepare or commit reports.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct StepReply {
    /// Prepare of an inode step: the inode's attributes; commit of `DropLink`/`DropDir`: the
    /// attributes of the inode that went (its chunks go next), if it went.
    pub attr: Option<Attr>,
}

/// Between metadata services: the parent of a directory (its ".."), from the shard holding it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParentOf {
    pub ino: InodeId,
}

/// Between metadata services, to shard 0: take or give back the filesystem's rename lock, under
/// which directories change parent (as Linux's `s_vfs_rename_mutex`). Taking it waits while
/// another intent holds it; a holder that vanishes loses it after `hold_ms`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RenameLock {
    pub intent: u64,
    pub take: bool,
    pub hold_ms: u32,
}

/// Removes name `name` of `parent` only if it still names file `ino`, with one link, the size
/// and mtime given (unchanged since a drain uploaded it), and no client holds the file open or
/// caches it once every client's lease on it has been recalled (an open file's client
/// registers it in its answer). Refused with `InUse` otherwise. A drain's
/// `--delete-after-upload`: a file still being written is never deleted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnlinkIdle {
    pub parent: InodeId,
    #[serde(with = "serde_bytes")]
    pub name: Vec<u8>,
    pub ino: InodeId,
    pub size: u64,
    pub mtime: Timespec,
}

/// A caching client asks to answer creates in directory `dir` itself, for `count` new files (a
/// create delegation; docs/architecture.md, "Create delegations"). Granted on a directory of
/// this shard that is not striped or sealed, where the caller may create, and whose names and
/// attributes no other client caches; refused with `InUse` otherwise. Any other client's request
/// about the directory recalls the delegation first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DelegateCreates {
    pub dir: InodeId,
    pub count: u32,
    /// The asking client's node, for local placement.
    pub node: Option<NodeIndex>,
}

/// A create delegation: inode ids reserved for the client (logged: never given out again),
/// each with the layout a create would have chosen, and the directory's attributes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreateDelegation {
    pub inos: Vec<(InodeId, Layout)>,
    pub dir: Attr,
}

/// A client's deferred changes, applied in order, each as its own request would be (logged,
/// deduplicated by its own request id, checked: a name taken meanwhile fails that create).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreateBatch {
    pub entries: Vec<Deferred>,
}

/// One deferred change of a client holding a create delegation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Deferred {
    /// A create answered by the client: the new file `ino` (one of its reserved ids) with
    /// `layout`, made at `now` by `caller` (its uid, gid and groups; `request_id` is the
    /// entry's own) with `mode` as asked.
    Create {
        caller: crate::RequestHeader,
        parent: InodeId,
        #[serde(with = "serde_bytes")]
        name: Vec<u8>,
        mode: u32,
        ino: InodeId,
        layout: Layout,
        now: Timespec,
    },
    /// The size and mtime published at the close of a file made under a delegation still held
    /// (as `ExtendSize`).
    Size { request_id: u64, ino: InodeId, size: u64, mtime: Timespec },
    /// An unlink answered by the client, at `now`, of name `name` of `parent`, which named
    /// file `ino` with change time `ctime`: one made under the delegation still held, with no
    /// other name, open nowhere. Refused if the name no longer names `ino` or the file changed
    /// since (another client got to it while this one was cut off).
    Unlink {
        caller: crate::RequestHeader,
        parent: InodeId,
        #[serde(with = "serde_bytes")]
        name: Vec<u8>,
        ino: InodeId,
        ctime: Timespec,
        now: Timespec,
    },
}

impl Deferred {
    /// The shard that applies the entry.
    pub fn shard(&self) -> u16 {
        match self {
            Deferred::Create { parent, .. } | Deferred::Unlink { parent, .. } => parent.shard(),
            Deferred::Size { ino, .. } => ino.shard(),
        }
    }
}

/// The entries of a batch that failed (index in the batch, why); the rest were applied. The
/// files its unlinks removed, whose chunks are the client's to remove.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct BatchReply {
    pub failed: Vec<(u32, crate::RemoteError)>,
    pub removed: Vec<Attr>,
}

crate::rpc! {
    Lookup = 100 => Attr { fn inodes(&self) -> Vec<InodeId> { vec![self.parent] } },
    GetAttr = 101 => Attr { fn inodes(&self) -> Vec<InodeId> { vec![self.ino] } },
    SetAttr = 102 => Attr { fn inodes(&self) -> Vec<InodeId> { vec![self.ino] } },
    Create = 103 => CreateReply { fn inodes(&self) -> Vec<InodeId> { vec![self.parent] } },
    Mkdir = 104 => Attr { fn inodes(&self) -> Vec<InodeId> { vec![self.parent] } },
    Unlink = 105 => UnlinkReply { fn inodes(&self) -> Vec<InodeId> { vec![self.parent] } },
    Rmdir = 106 => () { fn inodes(&self) -> Vec<InodeId> { vec![self.parent] } },
    Rename = 107 => RenameReply { fn inodes(&self) -> Vec<InodeId> { vec![self.parent, self.new_parent] } },
    Symlink = 108 => Attr { fn inodes(&self) -> Vec<InodeId> { vec![self.parent] } },
    Readlink = 109 => Vec<u8>,
    Link = 110 => Attr { fn inodes(&self) -> Vec<InodeId> { vec![self.ino, self.new_parent] } },
    ReadDir = 111 => ReadDirReply { fn inodes(&self) -> Vec<InodeId> { vec![self.ino] } },
    SetXattr = 112 => () { fn inodes(&self) -> Vec<InodeId> { vec![self.ino] } },
    GetXattr = 113 => Vec<u8> { fn inodes(&self) -> Vec<InodeId> { vec![self.ino] } },
    ListXattr = 114 => Vec<Vec<u8>> { fn inodes(&self) -> Vec<InodeId> { vec![self.ino] } },
    RemoveXattr = 115 => () { fn inodes(&self) -> Vec<InodeId> { vec![self.ino] } },
    StatFs = 116 => StatFsReply,
    ExtendSize = 117 => Attr,
    Open = 118 => Attr { fn inodes(&self) -> Vec<InodeId> { vec![self.ino] } },
    Access = 119 => () { fn inodes(&self) -> Vec<InodeId> { vec![self.ino] } },
    SetDirLayout = 120 => () { fn inodes(&self) -> Vec<InodeId> { vec![self.ino] } },
    GetDirLayout = 121 => DirLayout { fn inodes(&self) -> Vec<InodeId> { vec![self.ino] } },
    SetFileLayout = 122 => Attr,
    StripeDir = 123 => Attr { fn inodes(&self) -> Vec<InodeId> { vec![self.ino] } },
    CreateShadow = 124 => (),
    SyncShadow = 125 => (),
    SealShadow = 126 => (),
    DropShadow = 127 => (),
    CountEntries = 128 => u64 { fn inodes(&self) -> Vec<InodeId> { vec![self.ino] } },
    Mknod = 129 => Attr { fn inodes(&self) -> Vec<InodeId> { vec![self.parent] } },
    Release = 130 => ReleaseReply,
    SessionPoll = 131 => SessionReply,
    Reopen = 132 => u64,
    Step = 133 => StepReply { fn inodes(&self) -> Vec<InodeId> { self.change.inodes() } },
    ParentOf = 134 => InodeId,
    RenameLock = 135 => (),
    // 136 retired (OpCounts: every service's GetStats counts requests by kind).
    SetSealed = 137 => Attr { fn inodes(&self) -> Vec<InodeId> { vec![self.ino] } },
    UnlinkIdle = 138 => UnlinkReply { fn inodes(&self) -> Vec<InodeId> { vec![self.parent] } },
    DelegateCreates = 139 => CreateDelegation { fn inodes(&self) -> Vec<InodeId> { vec![self.dir] } },
    CreateBatch = 140 => BatchReply,
    SetLock = 141 => bool,
    TestLock = 142 => Option<LockHolder>,
    DropLocks = 143 => (),
    EndSession = 144 => (),
}

/// Whether a request of method `method` changes what a create delegation on the directory it
/// names relies on (its default layout, striping, seal): its holder's delegation ends when it
/// sends one, at the client and at metad.
pub fn ends_delegation(method: u16) -> bool {
    use crate::Rpc;
    [SetDirLayout::METHOD, StripeDir::METHOD, SetSealed::METHOD].contains(&method)
}

impl StepChange {
    /// The inodes a step reads or changes by id (see [`crate::Rpc::inodes`]).
    fn inodes(&self) -> Vec<InodeId> {
        match self {
            StepChange::RemoveName { parent, .. } | StepChange::SetName { parent, .. } => vec![*parent],
            StepChange::AddLink { ino } | StepChange::DropLink { ino } | StepChange::DropDir { ino } => vec![*ino],
            StepChange::Reparent { ino, to } => vec![*ino, *to],
        }
    }
}
