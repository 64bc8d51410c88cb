//! `SetDirLayout`, `SetFileLayout`: a directory's default layout for new children, and a new
//! layout for a file that is still empty.

use crate::inode::Body;
use crate::namespace::{Applied, Choice, Chooser, MetaReply, Namespace};
use crate::permission;
use odfs_proto::error::{ErrorCode, RemoteError, RpcResult};
use odfs_proto::meta::{SetDirLayout, SetFileLayout};
use odfs_proto::{RequestHeader, Timespec};

impl Namespace {
    pub(crate) fn set_file_layout(
        &mut self,
        h: &RequestHeader,
        now: Timespec,
        req: &SetFileLayout,
        choice: &mut Choice,
        choose: Chooser,
    ) -> RpcResult<Applied> {
        let node = self.node(req.ino)?;
        if !matches!(node.body, Body::File(_)) {
            return Err(RemoteError::new(ErrorCode::Invalid, format!("inode {} is not a regular file", req.ino)));
        }
        if !permission::is_owner(h, node) {
            return Err(RemoteError::new(ErrorCode::Perm, "only the owner or root may set a file's layout"));
        }
        if node.size > 0 {
            return Err(RemoteError::new(
                ErrorCode::Invalid,
                format!("the file has {} bytes: a layout can only be set while a file is empty", node.size),
            ));
        }
        req.layout.validate().map_err(|m| RemoteError::new(ErrorCode::Invalid, m))?;
        let layout = match choice.layout.take() {
            Some(l) => l,
            None => choose(&req.layout, req.node)?,
        };
        let node = self.node_mut(req.ino)?;
        node.ctime = now;
        node.body = Body::File(layout);
        Applied::changed(MetaReply::Attr(node.attr(req.ino)))
    }

    pub(crate) fn set_dir_layout(
        &mut self,
        h: &RequestHeader,
        now: Timespec,
        req: &SetDirLayout,
    ) -> RpcResult<Applied> {
        let (node, _) = self.dir_node(req.ino)?;
        if !permission::is_owner(h, node) {
            return Err(RemoteError::new(ErrorCode::Perm, "only the owner or root may set a directory's layout"));
        }
        req.layout.validate().map_err(|m| RemoteError::new(ErrorCode::Invalid, m))?;
        let node = self.node_mut(req.ino)?;
        node.ctime = now;
        node.dir_mut()?.layout = req.layout.clone();
        Applied::changed(MetaReply::Unit)
    }
}
