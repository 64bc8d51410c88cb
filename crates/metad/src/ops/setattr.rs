//! `SetAttr` (chmod, chown, truncate's size, utimensat), `ExtendSize` (the size and mtime a
//! writer publishes at close or fsync) and the administrative `SetRootOwner`.

use crate::inode::{Body, Inode};
use crate::namespace::{Applied, MetaReply, Namespace};
use crate::permission::{self, MAY_WRITE, S_ISGID};
use odfs_proto::error::{ErrorCode, RemoteError, RpcResult};
use odfs_proto::meta::{setid_dropped, ExtendSize, SetAttr, SetTime};
use odfs_proto::{InodeId, RequestHeader, Timespec};

/// Whether a request changes nothing.
fn is_empty(req: &SetAttr) -> bool {
    req.mode.is_none()
        && req.uid.is_none()
        && req.gid.is_none()
        && req.size.is_none()
        && req.atime.is_none()
        && req.mtime.is_none()
        && !req.kill_setid
}

/// Refuses a size for anything but a regular file.
fn require_regular(node: &Inode, ino: InodeId) -> RpcResult<()> {
    match node.body {
        Body::File(_) => Ok(()),
        Body::Dir(_) => Err(RemoteError::new(ErrorCode::IsDir, format!("inode {ino} is a directory"))),
        Body::Symlink(_) | Body::Special { .. } => {
            Err(RemoteError::new(ErrorCode::Invalid, format!("inode {ino} is not a regular file")))
        }
    }
}

/// Who may change what (Linux `setattr_prepare`): only root gives a file away, the owner
/// changes the mode and sets explicit times, write permission suffices for "now".
fn check_setattr(h: &RequestHeader, node: &Inode, req: &SetAttr) -> RpcResult<()> {
    if let Some(size) = req.size {
        odfs_proto::layout::check_file_size(size).map_err(|why| RemoteError::new(ErrorCode::FileTooBig, why))?;
    }
    if req.size.is_some() || req.kill_setid {
        require_regular(node, req.ino)?;
        // Through a descriptor opened for writing, access was decided at open (POSIX).
        if !req.open_for_write {
            permission::require(h, node, req.ino, MAY_WRITE)?;
        }
    }
    let owner = permission::is_owner(h, node);
    if let Some(uid) = req.uid {
        // Only root gives a file away; the owner may "change" it to itself.
        if !(h.is_root() || (h.uid == node.uid && uid == node.uid)) {
            return Err(RemoteError::new(ErrorCode::Perm, "only root may change the owner"));
        }
    }
    if let Some(gid) = req.gid {
        if !(h.is_root() || (h.uid == node.uid && (gid == node.gid || h.in_group(gid)))) {
            return Err(RemoteError::new(
                ErrorCode::Perm,
                format!("only root, or the owner in group {gid}, may set group {gid}"),
            ));
        }
    }
    if req.mode.is_some() && !owner {
        return Err(RemoteError::new(ErrorCode::Perm, "only the owner or root may change the mode"));
    }
    let explicit = matches!(req.atime, Some(SetTime::At(_))) || matches!(req.mtime, Some(SetTime::At(_)));
    if explicit && !owner {
        return Err(RemoteError::new(ErrorCode::Perm, "only the owner or root may set explicit times"));
    }
    if !explicit && (req.atime.is_some() || req.mtime.is_some()) && !owner && !permission::permits(h, node, MAY_WRITE) {
        return Err(RemoteError::new(
            ErrorCode::Access,
            "setting the times to now needs ownership or write permission",
        ));
    }
    Ok(())
}

/// The new owner, group and mode, with the set-id bits Linux drops.
fn set_ownership(h: &RequestHeader, node: &mut Inode, req: &SetAttr) {
    let dir = matches!(node.body, Body::Dir(_));
    // Judged by the file's group before the change.
    let dropped = setid_dropped(node.mode, h.is_root(), h.in_group(node.gid));
    if let Some(uid) = req.uid {
        node.uid = uid;
    }
    if let Some(gid) = req.gid {
        node.gid = gid;
    }
    if let Some(mode) = req.mode {
        let mut mode = mode & 0o7777;
        // Keeping set-group-id needs membership of the (new) group (Linux setattr_prepare).
        if !h.is_root() && !h.in_group(node.gid) {
            mode &= !S_ISGID;
        }
        node.mode = mode;
    } else if !dir && (req.uid.is_some() || req.gid.is_some()) {
        // chown of anything but a directory drops them (Linux `chown_common`, for every
        // caller, root included).
        node.mode &= !dropped;
    }
}

/// Drops the set-id bits a write or truncate by `h` drops on Linux (`setid_dropped`). Root
/// (CAP_FSETID) keeps them unless it asks.
fn kill_setid(h: &RequestHeader, node: &mut Inode, req: &SetAttr) {
    let by_write = req.kill_setid || (req.size.is_some() && !h.is_root());
    if by_write && matches!(node.body, Body::File(_)) {
        node.mode &= !setid_dropped(node.mode, h.is_root(), h.in_group(node.gid));
    }
}

/// The new size and times.
fn set_times(node: &mut Inode, req: &SetAttr, now: Timespec) {
    if let Some(size) = req.size {
        node.size = size;
        node.mtime = now;
    }
    let at = |t: SetTime| match t {
        SetTime::Now => now,
        SetTime::At(t) => t,
    };
    if let Some(t) = req.atime {
        node.atime = at(t);
    }
    if let Some(t) = req.mtime {
        node.mtime = at(t);
    }
    node.ctime = now;
}

impl Namespace {
    pub(crate) fn setattr(&mut self, h: &RequestHeader, now: Timespec, req: &SetAttr) -> RpcResult<Applied> {
        let node = self.node(req.ino)?;
        if is_empty(req) {
            return Applied::unchanged(MetaReply::Attr(node.attr(req.ino)));
        }
        check_setattr(h, node, req)?;
        let node = self.node_mut(req.ino)?;
        set_ownership(h, node, req);
        kill_setid(h, node, req);
        set_times(node, req, now);
        Applied::changed(MetaReply::Attr(node.attr(req.ino)))
    }

    pub(crate) fn extend_size(&mut self, req: &ExtendSize) -> RpcResult<Applied> {
        // Publishes data written through a descriptor opened for writing: the permission was
        // checked at open, and an open descriptor keeps its access after a chmod (a file
        // created with mode 0444, as git does for its objects, is written and closed).
        require_regular(self.node(req.ino)?, req.ino)?;
        odfs_proto::layout::check_file_size(req.size).map_err(|why| RemoteError::new(ErrorCode::FileTooBig, why))?;
        let node = self.node_mut(req.ino)?;
        node.size = node.size.max(req.size);
        node.mtime = req.mtime;
        node.ctime = req.mtime;
        Applied::changed(MetaReply::Attr(node.attr(req.ino)))
    }

    /// Sets the root directory's owner, group and mode. Administrative: no permission check.
    pub(crate) fn set_root_owner(&mut self, now: Timespec, uid: u32, gid: u32, mode: u32) -> RpcResult<Applied> {
        let root = self.node_mut(InodeId::ROOT)?;
        root.uid = uid;
        root.gid = gid;
        root.mode = mode & 0o7777;
        root.ctime = now;
        Applied::changed(MetaReply::Attr(root.attr(InodeId::ROOT)))
    }
}
