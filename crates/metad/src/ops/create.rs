//! `Create`: a new regular file (or, without `exclusive`, the existing one opened for writing),
//! its targets chosen from the request's layout or the directory's default.

use crate::error::{exists, show};
use crate::inode::{Body, Inode};
use crate::namespace::{check_name, Applied, Choice, Chooser, MetaReply, Namespace};
use crate::permission::{self, new_owner, MAY_EXEC, MAY_WRITE};
use odfs_proto::error::{ErrorCode, RemoteError, RpcResult};
use odfs_proto::meta::{Create, CreateReply, FileKind};
use odfs_proto::{RequestHeader, Timespec};

impl Namespace {
    pub(crate) fn create(
        &mut self,
        h: &RequestHeader,
        now: Timespec,
        req: &Create,
        choice: &mut Choice,
        choose: Chooser,
    ) -> RpcResult<Applied> {
        check_name(&req.name)?;
        let (parent, dir) = self.dir_node(req.parent)?;
        permission::require(h, parent, req.parent, MAY_EXEC)?;
        dir.holds_name(&req.name, self.shard)?;
        dir.accepts_entries()?;
        if let Some(ino) = dir.get(&req.name) {
            if req.exclusive {
                return Err(exists(&req.name));
            }
            // A remote file is opened by its shard (the service asks it).
            let node = self.target(ino)?;
            return match &node.body {
                Body::File(_) => {
                    permission::require(h, node, ino, MAY_WRITE)?;
                    Applied::unchanged(MetaReply::Create(CreateReply {
                        attr: node.attr(ino),
                        created: false,
                        parent: None,
                    }))
                }
                Body::Dir(_) => {
                    Err(RemoteError::new(ErrorCode::IsDir, format!("\"{}\" is a directory", show(&req.name))))
                }
                Body::Symlink(_) | Body::Special { .. } => {
                    Err(RemoteError::new(ErrorCode::Exists, format!("\"{}\" is not a regular file", show(&req.name))))
                }
            };
        }
        permission::require(h, parent, req.parent, MAY_WRITE | MAY_EXEC)?;
        let (gid, mode) = new_owner(h, parent, req.mode & 0o7777, false);
        let layout = match choice.layout.take() {
            Some(l) => l,
            None => match &req.layout {
                Some(dl) => {
                    dl.validate().map_err(|m| RemoteError::new(ErrorCode::Invalid, m))?;
                    choose(dl, req.node)?
                }
                None => choose(&dir.layout, req.node)?,
            },
        };
        let ino = self.alloc(choice.ino)?;
        let node = Inode::new(mode, h.uid, gid, now, Body::File(layout));
        let attr = node.attr(ino);
        self.insert_inode(ino, node);
        self.add_entry(req.parent, &req.name, ino, FileKind::File, now)?;
        let parent = Some(self.node(req.parent)?.attr(req.parent));
        Applied::changed(MetaReply::Create(CreateReply { attr, created: true, parent }))
    }
}
