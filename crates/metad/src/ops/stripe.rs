//! The parts of a directory striped over metadata shards, as one shard sees them: the
//! directory's own shard marks it striped (`SetDirStripes`); the other shards hold its parts
//! (`CreateShadow`, kept in step by `SyncShadow`, sealed while empty by `SealShadow` before an
//! rmdir, dropped by `DropShadow`). The order across shards is `shards`'s work.

use crate::error::internal;
use crate::inode::{Body, Dir, Inode};
use crate::namespace::{Applied, MetaReply, Namespace};
use odfs_proto::error::{ErrorCode, RemoteError, RpcResult};
use odfs_proto::meta::{CreateShadow, DropShadow, SealShadow, SyncShadow};
use odfs_proto::{InodeId, Timespec};

impl Namespace {
    /// The part of another shard's striped directory kept here.
    fn shadow_mut(&mut self, ino: InodeId) -> RpcResult<&mut Inode> {
        if ino.shard() == self.shard {
            return Err(internal("a directory's own shard holds no part of it"));
        }
        self.node_mut(ino)
    }

    pub(crate) fn create_shadow(&mut self, now: Timespec, r: &CreateShadow) -> RpcResult<Applied> {
        if r.ino.shard() == self.shard {
            return Err(internal("a directory's own shard holds no part of it"));
        }
        self.touch(r.ino);
        if let Some(node) = self.inodes.get_mut(&r.ino) {
            (node.mode, node.uid, node.gid) = (r.mode, r.uid, r.gid);
            let d = node.dir_mut()?;
            d.layout = r.layout.clone();
            d.stripes = r.stripes.clone();
            d.closing = false;
            return Applied::changed(MetaReply::Unit);
        }
        let mut dir = Dir::new(r.parent, r.layout.clone());
        dir.stripes = r.stripes.clone();
        let mut node = Inode::new(r.mode, r.uid, r.gid, now, Body::Dir(Box::new(dir)));
        node.nlink = 2;
        self.inodes.insert(r.ino, node);
        self.foreign += 1;
        Applied::changed(MetaReply::Unit)
    }

    pub(crate) fn sync_shadow(&mut self, r: &SyncShadow) -> RpcResult<Applied> {
        let node = self.shadow_mut(r.ino)?;
        (node.mode, node.uid, node.gid) = (r.mode, r.uid, r.gid);
        node.dir_mut()?.layout = r.layout.clone();
        Applied::changed(MetaReply::Unit)
    }

    pub(crate) fn seal_shadow(&mut self, r: &SealShadow) -> RpcResult<Applied> {
        let d = self.shadow_mut(r.ino)?.dir_mut()?;
        if r.seal && !d.is_empty() {
            return Err(RemoteError::new(ErrorCode::NotEmpty, "the directory is not empty"));
        }
        d.closing = r.seal;
        Applied::changed(MetaReply::Unit)
    }

    pub(crate) fn drop_shadow(&mut self, r: &DropShadow) -> RpcResult<Applied> {
        if !self.inodes.contains_key(&r.ino) {
            return Applied::unchanged(MetaReply::Unit);
        }
        if !self.shadow_mut(r.ino)?.dir_mut()?.is_empty() {
            return Err(RemoteError::new(ErrorCode::NotEmpty, "the directory part is not empty"));
        }
        self.remove_inode(r.ino);
        self.foreign -= 1;
        Applied::changed(MetaReply::Unit)
    }

    /// Marks an empty directory of this shard striped over `stripes` (the other shards' parts
    /// exist by now: its shard's coordinator made them first).
    pub(crate) fn set_dir_stripes(&mut self, now: Timespec, ino: InodeId, stripes: &[u16]) -> RpcResult<Applied> {
        if ino.shard() != self.shard {
            return Err(internal("a directory is striped by its own shard"));
        }
        let node = self.node_mut(ino)?;
        let d = node.dir_mut().map_err(|_| RemoteError::new(ErrorCode::NotDir, "not a directory"))?;
        if !d.is_empty() {
            return Err(RemoteError::new(
                ErrorCode::NotEmpty,
                "only an empty directory can be striped over metadata shards",
            ));
        }
        d.stripes = stripes.to_vec();
        node.ctime = now;
        Applied::changed(MetaReply::Attr(node.attr(ino)))
    }
}
