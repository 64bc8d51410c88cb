//! `Symlink`: a new symbolic link.

use crate::inode::{Body, Inode};
use crate::namespace::{Applied, Choice, MetaReply, Namespace, SYMLINK_MAX};
use crate::permission::new_owner;
use odfs_proto::error::{ErrorCode, RemoteError, RpcResult};
use odfs_proto::meta::{FileKind, Symlink};
use odfs_proto::{RequestHeader, Timespec};

impl Namespace {
    pub(crate) fn symlink(
        &mut self,
        h: &RequestHeader,
        now: Timespec,
        req: &Symlink,
        choice: &mut Choice,
    ) -> RpcResult<Applied> {
        if req.target.is_empty() {
            return Err(RemoteError::new(ErrorCode::NotFound, "symbolic link target is empty"));
        }
        if req.target.len() > SYMLINK_MAX {
            return Err(RemoteError::new(
                ErrorCode::NameTooLong,
                format!("symbolic link target is {} bytes; the limit is {SYMLINK_MAX}", req.target.len()),
            ));
        }
        if req.target.contains(&0) {
            return Err(RemoteError::new(ErrorCode::Invalid, "symbolic link target contains a NUL byte"));
        }
        let (parent, _) = self.check_new_entry(h, req.parent, &req.name)?;
        let (gid, _) = new_owner(h, parent, 0o777, false);
        let ino = self.alloc(choice.ino)?;
        let mut node = Inode::new(0o777, h.uid, gid, now, Body::Symlink(req.target.clone()));
        node.size = req.target.len() as u64;
        let attr = node.attr(ino);
        self.insert_inode(ino, node);
        self.add_entry(req.parent, &req.name, ino, FileKind::Symlink, now)?;
        Applied::changed(MetaReply::Attr(attr))
    }
}
