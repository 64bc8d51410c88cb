//! `SetSealed` and the rule it sets: a sealed inode refuses every change with EROFS. One check
//! before every mutation ([`Namespace::refuse_sealed`]) names the inodes the operation would
//! change, so no operation has to remember the rule itself and a refusal changes nothing.

use crate::namespace::{Applied, MetaOp, MetaReply, Namespace};
use crate::permission;
use odfs_proto::error::{ErrorCode, RemoteError, RpcResult};
use odfs_proto::meta::{SetSealed, StepChange, StepPhase};
use odfs_proto::{InodeId, RequestHeader, Timespec};

fn read_only(ino: InodeId) -> RemoteError {
    // metad knows inodes, not paths; the caller's error names the path it worked on.
    RemoteError::new(
        ErrorCode::ReadOnly,
        format!("read-only: inode {ino} is in a sealed tree (`odfs unseal` on the tree makes it writable)"),
    )
}

impl Namespace {
    pub(crate) fn set_sealed(&mut self, h: &RequestHeader, now: Timespec, req: &SetSealed) -> RpcResult<Applied> {
        let node = self.node(req.ino)?;
        if !permission::is_owner(h, node) {
            return Err(RemoteError::new(
                ErrorCode::Perm,
                format!("only the owner of inode {} or root may seal or unseal it", req.ino),
            ));
        }
        if node.sealed == req.sealed {
            return Applied::unchanged(MetaReply::Attr(node.attr(req.ino)));
        }
        let node = self.node_mut(req.ino)?;
        node.sealed = req.sealed;
        node.ctime = now;
        Applied::changed(MetaReply::Attr(node.attr(req.ino)))
    }

    /// EROFS when `op` would change a sealed inode of this shard; inodes of other shards are
    /// checked there (the steps of an operation spanning shards are, at prepare).
    pub(crate) fn refuse_sealed(&self, op: &MetaOp) -> RpcResult<()> {
        let named = |parent: InodeId, name: &[u8]| self.inodes.get(&parent).and_then(|n| n.dir()?.get(name));
        let mut inos: Vec<Option<InodeId>> = Vec::with_capacity(4);
        match op {
            MetaOp::Create(r) => inos.push(Some(r.parent)),
            MetaOp::Mkdir(r) => inos.push(Some(r.parent)),
            MetaOp::Mknod(r) => inos.push(Some(r.parent)),
            MetaOp::Symlink(r) => inos.push(Some(r.parent)),
            MetaOp::Unlink(r) => inos.extend([Some(r.parent), named(r.parent, &r.name)]),
            MetaOp::Rmdir(r) => inos.extend([Some(r.parent), named(r.parent, &r.name)]),
            MetaOp::Rename(r) => inos.extend([
                Some(r.parent),
                Some(r.new_parent),
                named(r.parent, &r.name),
                named(r.new_parent, &r.new_name),
            ]),
            MetaOp::Link(r) => inos.extend([Some(r.ino), Some(r.new_parent)]),
            MetaOp::SetAttr(r) => inos.push(Some(r.ino)),
            MetaOp::SetXattr(r) => inos.push(Some(r.ino)),
            MetaOp::RemoveXattr(r) => inos.push(Some(r.ino)),
            MetaOp::ExtendSize(r) => inos.push(Some(r.ino)),
            MetaOp::SetDirLayout(r) => inos.push(Some(r.ino)),
            MetaOp::SetFileLayout(r) => inos.push(Some(r.ino)),
            MetaOp::SetDirStripes { ino, .. } => inos.push(Some(*ino)),
            MetaOp::Step(s) if s.phase == StepPhase::Prepare => match &s.change {
                StepChange::RemoveName { parent, ino, .. } => inos.extend([Some(*parent), Some(*ino)]),
                StepChange::SetName { parent, ino, expect, .. } => {
                    inos.extend([Some(*parent), Some(*ino), expect.map(|e| e.0)])
                }
                StepChange::AddLink { ino }
                | StepChange::DropLink { ino }
                | StepChange::DropDir { ino }
                | StepChange::Reparent { ino, .. } => inos.push(Some(*ino)),
            },
            _ => {}
        }
        self.refuse_if_sealed(inos.into_iter().flatten())
    }

    /// EROFS naming the first of `inos` that is a sealed inode of this shard (a sealed file,
    /// for one, opens for reading only).
    pub(crate) fn refuse_if_sealed(&self, inos: impl IntoIterator<Item = InodeId>) -> RpcResult<()> {
        match inos.into_iter().find(|i| self.inodes.get(i).is_some_and(|n| n.sealed)) {
            Some(ino) => Err(read_only(ino)),
            None => Ok(()),
        }
    }
}
