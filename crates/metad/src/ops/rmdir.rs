//! `Rmdir`: an empty directory removed (a striped one's parts are sealed first by the
//! coordinator in `shards`).

use crate::error::show;
use crate::namespace::{Applied, MetaReply, Namespace};
use odfs_proto::error::{ErrorCode, RemoteError, RpcResult};
use odfs_proto::meta::Rmdir;
use odfs_proto::{RequestHeader, Timespec};

impl Namespace {
    pub(crate) fn rmdir(&mut self, h: &RequestHeader, now: Timespec, req: &Rmdir) -> RpcResult<Applied> {
        let (ino, victim) = self.check_delete(h, req.parent, &req.name)?;
        match victim.dir() {
            None => {
                return Err(RemoteError::new(ErrorCode::NotDir, format!("\"{}\" is not a directory", show(&req.name))))
            }
            Some(d) if !d.is_empty() => {
                return Err(RemoteError::new(
                    ErrorCode::NotEmpty,
                    format!("directory \"{}\" has {} entries", show(&req.name), d.len()),
                ))
            }
            Some(_) => {}
        }
        let p = self.node_mut(req.parent)?;
        p.touch_dir(now);
        p.nlink -= 1;
        p.dir_mut()?.remove(&req.name)?;
        self.remove_inode(ino);
        Applied::changed(MetaReply::Unit)
    }
}
