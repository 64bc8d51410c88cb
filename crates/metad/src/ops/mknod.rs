//! `Mknod`: a FIFO, a socket's name or a device node. Only root makes device nodes (the
//! kernel checks `CAP_MKNOD` before a mount asks; odfs's own clients are checked here).

use crate::inode::{Body, Inode};
use crate::namespace::{Applied, Choice, MetaReply, Namespace};
use crate::permission::new_owner;
use odfs_proto::error::{ErrorCode, RemoteError, RpcResult};
use odfs_proto::meta::{FileKind, Mknod};
use odfs_proto::{RequestHeader, Timespec};

impl Namespace {
    pub(crate) fn mknod(
        &mut self,
        h: &RequestHeader,
        now: Timespec,
        req: &Mknod,
        choice: &mut Choice,
    ) -> RpcResult<Applied> {
        if !req.kind.is_special() {
            return Err(RemoteError::new(
                ErrorCode::Invalid,
                "mknod makes FIFOs, sockets and device nodes; files, directories and links have their own calls",
            ));
        }
        let device = matches!(req.kind, FileKind::CharDev | FileKind::BlockDev);
        if device && !h.is_root() {
            return Err(RemoteError::new(ErrorCode::Perm, "only root makes device nodes"));
        }
        let (parent, _) = self.check_new_entry(h, req.parent, &req.name)?;
        let (gid, mode) = new_owner(h, parent, req.mode & 0o7777, false);
        let rdev = if device { req.rdev } else { 0 };
        let ino = self.alloc(choice.ino)?;
        let node = Inode::new(mode, h.uid, gid, now, Body::Special { kind: req.kind, rdev });
        let attr = node.attr(ino);
        self.insert_inode(ino, node);
        self.add_entry(req.parent, &req.name, ino, req.kind, now)?;
        Applied::changed(MetaReply::Attr(attr))
    }
}
