//! `Unlink`: a name of a non-directory removed; the inode goes with its last link (its chunks
//! are the client's to remove, named in the reply), or stays as an orphan while a client holds
//! it open.

use crate::error::show;
use crate::namespace::{Applied, Held, MetaReply, Namespace};
use odfs_proto::error::{ErrorCode, RemoteError, RpcResult};
use odfs_proto::meta::{Unlink, UnlinkReply};
use odfs_proto::{RequestHeader, Timespec};

impl Namespace {
    pub(crate) fn unlink(&mut self, h: &RequestHeader, now: Timespec, req: &Unlink, held: Held) -> RpcResult<Applied> {
        let (ino, victim) = self.check_delete(h, req.parent, &req.name)?;
        if victim.is_dir() {
            return Err(RemoteError::new(ErrorCode::IsDir, format!("\"{}\" is a directory", show(&req.name))));
        }
        let p = self.node_mut(req.parent)?;
        p.touch_dir(now);
        p.dir_mut()?.remove(&req.name)?;
        let removed = self.drop_link(ino, now, held)?;
        let parent = Some(self.node(req.parent)?.attr(req.parent));
        Applied::changed(MetaReply::Unlink(UnlinkReply { removed, parent }))
    }
}
