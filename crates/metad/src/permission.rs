//! Who may do what: POSIX permission bits, ownership and the sticky bit, applied as Linux's
//! `generic_permission` and `may_delete` apply them.
//!
//! Pure functions of the caller's header and an inode's mode, uid and gid (and the owner and
//! mode a new inode inherits); each operation in `ops` decides which check it needs and in which
//! order.

use crate::inode::Inode;
use odfs_proto::error::{ErrorCode, RemoteError, RpcResult};
use odfs_proto::{InodeId, RequestHeader};

/// Read permission (`R_OK`).
pub const MAY_READ: u32 = 4;
/// Write permission (`W_OK`).
pub const MAY_WRITE: u32 = 2;
/// Execute, or search for a directory (`X_OK`).
pub const MAY_EXEC: u32 = 1;

/// Set-user-id bit.
pub const S_ISUID: u32 = 0o4000;
/// Set-group-id bit; on a directory, new children inherit its group.
pub const S_ISGID: u32 = 0o2000;
/// Sticky bit; on a directory, only owners may remove or rename entries.
pub const S_ISVTX: u32 = 0o1000;

/// Whether the caller holds every permission in `mask` on `node`.
///
/// Root reads and writes anything, and executes a file only if some execute bit is set (Linux).
/// Otherwise exactly one class applies: owner, else group, else other — an owner denied by the
/// owner bits is denied even if the group or other bits would allow.
pub(crate) fn permits(h: &RequestHeader, node: &Inode, mask: u32) -> bool {
    let mask = mask & 7;
    if h.is_root() {
        return mask & MAY_EXEC == 0 || node.is_dir() || node.mode & 0o111 != 0;
    }
    let bits = if h.uid == node.uid {
        node.mode >> 6
    } else if h.in_group(node.gid) {
        node.mode >> 3
    } else {
        node.mode
    } & 7;
    bits & mask == mask
}

/// `permits`, as a result whose error names the refused access and the inode.
pub(crate) fn require(h: &RequestHeader, node: &Inode, ino: InodeId, mask: u32) -> RpcResult<()> {
    if permits(h, node, mask) {
        return Ok(());
    }
    let what = match (mask & 7, node.is_dir()) {
        (MAY_READ, _) => "read",
        (MAY_WRITE, _) => "write",
        (MAY_EXEC, true) => "search",
        (MAY_EXEC, false) => "execute",
        (3, true) => "write and search",
        _ => "the requested",
    };
    Err(RemoteError::new(ErrorCode::Access, format!("{what} permission denied on inode {ino}")))
}

/// Root or the inode's owner: who may chmod, set explicit times, change a directory layout.
pub(crate) fn is_owner(h: &RequestHeader, node: &Inode) -> bool {
    h.is_root() || h.uid == node.uid
}

/// Whether the sticky bit of `dir` (if set) lets the caller remove or replace `victim`: only
/// root, the victim's owner and the directory's owner may.
pub(crate) fn require_sticky(h: &RequestHeader, dir: &Inode, victim: &Inode, name: &[u8]) -> RpcResult<()> {
    require_sticky_owner(h, dir, victim.uid, name)
}

/// `require_sticky` for a victim known by its owner only (an inode of another shard).
pub(crate) fn require_sticky_owner(h: &RequestHeader, dir: &Inode, victim_uid: u32, name: &[u8]) -> RpcResult<()> {
    if odfs_proto::meta::sticky_allows(h.uid, dir.mode, dir.uid, victim_uid) {
        return Ok(());
    }
    Err(RemoteError::new(
        ErrorCode::Perm,
        format!("\"{}\" is in a sticky directory and belongs to another user", String::from_utf8_lossy(name)),
    ))
}

/// Group and mode of a new inode in `parent` (see [`odfs_proto::meta::new_owner`]).
pub(crate) fn new_owner(h: &RequestHeader, parent: &Inode, mode: u32, is_dir: bool) -> (u32, u32) {
    odfs_proto::meta::new_owner(h, parent.mode, parent.gid, mode, is_dir)
}
