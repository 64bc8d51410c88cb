//! `Link`: a new name for an existing non-directory.

use crate::namespace::{check_name, Applied, MetaReply, Namespace, MAX_LINKS};
use odfs_proto::error::{ErrorCode, RemoteError, RpcResult};
use odfs_proto::meta::Link;
use odfs_proto::{RequestHeader, Timespec};

impl Namespace {
    pub(crate) fn link(&mut self, h: &RequestHeader, now: Timespec, req: &Link) -> RpcResult<Applied> {
        check_name(&req.new_name)?;
        self.check_new_entry(h, req.new_parent, &req.new_name)?;
        let src = self.target(req.ino)?;
        self.unpinned_node(req.ino)?;
        if src.is_dir() {
            return Err(RemoteError::new(ErrorCode::Perm, "hard links to directories are not allowed"));
        }
        if src.nlink >= MAX_LINKS {
            return Err(RemoteError::new(ErrorCode::TooManyLinks, format!("inode {} has {MAX_LINKS} links", req.ino)));
        }
        let kind = src.kind();
        self.add_entry(req.new_parent, &req.new_name, req.ino, kind, now)?;
        let node = self.node_mut(req.ino)?;
        node.nlink += 1;
        node.ctime = now;
        Applied::changed(MetaReply::Attr(node.attr(req.ino)))
    }
}
