//! `Mkdir`: a new directory, inheriting its parent's default layout.

use crate::inode::{Body, Dir, Inode};
use crate::namespace::{Applied, Choice, MetaReply, Namespace, MAX_LINKS};
use crate::permission::new_owner;
use odfs_proto::error::{ErrorCode, RemoteError, RpcResult};
use odfs_proto::meta::{FileKind, Mkdir};
use odfs_proto::{RequestHeader, Timespec};

impl Namespace {
    pub(crate) fn mkdir(
        &mut self,
        h: &RequestHeader,
        now: Timespec,
        req: &Mkdir,
        choice: &mut Choice,
    ) -> RpcResult<Applied> {
        let (parent, dir) = self.check_new_entry(h, req.parent, &req.name)?;
        if parent.nlink >= MAX_LINKS {
            return Err(RemoteError::new(
                ErrorCode::TooManyLinks,
                format!("inode {} has {MAX_LINKS} subdirectories", req.parent),
            ));
        }
        // mkdir ignores set-user-id and set-group-id in the mode (Linux).
        let (gid, mode) = new_owner(h, parent, req.mode & 0o1777, true);
        let layout = dir.layout.clone();
        let ino = self.alloc(choice.ino)?;
        let mut node = Inode::new(mode, h.uid, gid, now, Body::Dir(Box::new(Dir::new(req.parent, layout))));
        node.nlink = 2;
        let attr = node.attr(ino);
        self.insert_inode(ino, node);
        self.add_entry(req.parent, &req.name, ino, FileKind::Dir, now)?;
        Applied::changed(MetaReply::Attr(attr))
    }
}
