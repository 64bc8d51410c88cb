//! `Rename`: a name moved within this shard, replacing (or, with `RENAME_EXCHANGE`, swapping
//! with) the destination, with Linux's checks in Linux's order.

use crate::error::{exists, internal, not_found, show};
use crate::inode::Inode;
use crate::namespace::{check_name, spans_shards, Applied, Held, MetaReply, Namespace, MAX_LINKS};
use crate::permission::{self, MAY_EXEC, MAY_WRITE};
use odfs_proto::error::{ErrorCode, RemoteError, RpcResult};
use odfs_proto::meta::{Attr, Rename, RenameReply, RENAME_EXCHANGE, RENAME_NOREPLACE};
use odfs_proto::{InodeId, RequestHeader, Timespec};

/// What a checked rename changes.
struct Move {
    src: InodeId,
    dst: Option<InodeId>,
    src_is_dir: bool,
    dst_is_dir: bool,
    /// The name changes directory.
    moves: bool,
    exchange: bool,
}

/// Whether `flags` ask for an exchange; refuses unknown and contradictory flags.
fn exchange_asked(flags: u32) -> RpcResult<bool> {
    if flags & !(RENAME_NOREPLACE | RENAME_EXCHANGE) != 0 || flags == RENAME_NOREPLACE | RENAME_EXCHANGE {
        return Err(RemoteError::new(ErrorCode::Invalid, format!("rename flags {flags:#x} are invalid")));
    }
    Ok(flags & RENAME_EXCHANGE != 0)
}

impl Namespace {
    pub(crate) fn rename(&mut self, h: &RequestHeader, now: Timespec, req: &Rename, held: Held) -> RpcResult<Applied> {
        let exchange = exchange_asked(req.flags)?;
        let Some(m) = self.check_rename(h, req, exchange)? else {
            // Two names of one inode: POSIX says do nothing.
            return Applied::unchanged(MetaReply::Rename(RenameReply { removed: None }));
        };
        let removed = if m.exchange {
            self.swap_names(req, &m, now)?;
            None
        } else {
            self.move_name(req, &m, now, held)?
        };
        self.node_mut(m.src)?.ctime = now;
        self.node_mut(req.parent)?.touch_dir(now);
        self.node_mut(req.new_parent)?.touch_dir(now);
        Applied::changed(MetaReply::Rename(RenameReply { removed }))
    }

    /// Every check, in Linux's order; None when both names are one inode's.
    fn check_rename(&self, h: &RequestHeader, req: &Rename, exchange: bool) -> RpcResult<Option<Move>> {
        check_name(&req.name)?;
        check_name(&req.new_name)?;
        let (old_parent, old_dir) = self.dir_node(req.parent)?;
        permission::require(h, old_parent, req.parent, MAY_EXEC)?;
        old_dir.holds_name(&req.name, self.shard)?;
        // The new name is this shard's only if its directory (part) is here and holds it.
        if !self.inodes.contains_key(&req.new_parent) {
            return Err(spans_shards(req.new_parent));
        }
        let (new_parent, new_dir) = self.dir_node(req.new_parent)?;
        permission::require(h, new_parent, req.new_parent, MAY_EXEC)?;
        match new_dir.holds_name(&req.new_name, self.shard) {
            Err(e) if e.code == ErrorCode::WrongShard => return Err(spans_shards(req.new_parent)),
            other => other?,
        }
        new_dir.accepts_entries()?;
        let src_ino = old_dir.get(&req.name).ok_or_else(|| not_found(&req.name))?;
        let dst_ino = new_dir.get(&req.new_name);
        if req.flags & RENAME_NOREPLACE != 0 && dst_ino.is_some() {
            return Err(exists(&req.new_name));
        }
        if exchange && dst_ino.is_none() {
            return Err(not_found(&req.new_name));
        }
        let src = self.target(src_ino)?;
        let dst = dst_ino.map(|i| self.target(i)).transpose()?;
        let m = Move {
            src: src_ino,
            dst: dst_ino,
            src_is_dir: src.is_dir(),
            dst_is_dir: dst.is_some_and(Inode::is_dir),
            moves: req.parent != req.new_parent,
            exchange,
        };
        // With several shards, a directory changing parent takes the filesystem's rename lock
        // and checks its ancestors across shards.
        let dir_moves = m.moves && (m.src_is_dir || (exchange && m.dst_is_dir));
        if dir_moves && self.shards_total > 1 {
            return Err(spans_shards(src_ino));
        }
        self.unpinned_name(req.parent, &req.name)?;
        self.unpinned_name(req.new_parent, &req.new_name)?;
        self.unpinned_node(src_ino)?;
        if let Some(d) = dst_ino {
            self.unpinned_node(d)?;
        }
        self.check_no_loop(req, &m)?;
        if dst_ino == Some(src_ino) {
            return Ok(None);
        }
        permission::require(h, old_parent, req.parent, MAY_WRITE | MAY_EXEC)?;
        permission::require_sticky(h, old_parent, src, &req.name)?;
        permission::require(h, new_parent, req.new_parent, MAY_WRITE | MAY_EXEC)?;
        if let Some(d) = dst {
            permission::require_sticky(h, new_parent, d, &req.new_name)?;
            check_types(req, &m)?;
        }
        if m.moves {
            self.check_reparent(h, &m, src, dst, old_parent.nlink, new_parent.nlink)?;
        }
        if !exchange {
            if let Some(d) = dst.and_then(Inode::dir).filter(|d| !d.is_empty()) {
                return Err(RemoteError::new(
                    ErrorCode::NotEmpty,
                    format!("directory \"{}\" has {} entries", show(&req.new_name), d.len()),
                ));
            }
        }
        Ok(Some(m))
    }

    /// A directory may not move under itself, nor replace one of its ancestors.
    fn check_no_loop(&self, req: &Rename, m: &Move) -> RpcResult<()> {
        if m.src_is_dir && self.is_ancestor(m.src, req.new_parent) {
            return Err(RemoteError::new(ErrorCode::Invalid, "cannot move a directory into itself"));
        }
        if let Some(d) = m.dst.filter(|_| m.dst_is_dir) {
            if self.is_ancestor(d, req.parent) {
                let code = if m.exchange { ErrorCode::Invalid } else { ErrorCode::NotEmpty };
                return Err(RemoteError::new(code, "the destination is an ancestor of the source"));
            }
        }
        Ok(())
    }

    /// A directory changing parent has its ".." rewritten (Linux asks for write on it), and
    /// its new parent must have room for one more subdirectory.
    fn check_reparent(
        &self,
        h: &RequestHeader,
        m: &Move,
        src: &Inode,
        dst: Option<&Inode>,
        old_parent_links: u32,
        new_parent_links: u32,
    ) -> RpcResult<()> {
        if m.src_is_dir {
            permission::require(h, src, m.src, MAY_WRITE)?;
        }
        if let (true, Some(d), Some(di)) = (m.exchange && m.dst_is_dir, dst, m.dst) {
            permission::require(h, d, di, MAY_WRITE)?;
        }
        if m.src_is_dir && !m.dst_is_dir && new_parent_links >= MAX_LINKS
            || m.exchange && m.dst_is_dir && !m.src_is_dir && old_parent_links >= MAX_LINKS
        {
            return Err(RemoteError::new(
                ErrorCode::TooManyLinks,
                format!("the destination has {MAX_LINKS} subdirectories"),
            ));
        }
        Ok(())
    }

    /// `RENAME_EXCHANGE`: each name points at the other's inode.
    fn swap_names(&mut self, req: &Rename, m: &Move, now: Timespec) -> RpcResult<()> {
        let dst = m.dst.ok_or_else(|| internal("exchange without a destination"))?;
        let (src_kind, dst_kind) = (self.node(m.src)?.kind(), self.node(dst)?.kind());
        self.node_mut(req.parent)?.dir_mut()?.repoint(&req.name, dst, dst_kind)?;
        self.node_mut(req.new_parent)?.dir_mut()?.repoint(&req.new_name, m.src, src_kind)?;
        if m.moves {
            if m.src_is_dir {
                self.reparent(m.src, req.parent, req.new_parent)?;
            }
            if m.dst_is_dir {
                self.reparent(dst, req.new_parent, req.parent)?;
            }
        }
        self.node_mut(dst)?.ctime = now;
        Ok(())
    }

    /// A plain rename: the old name goes, the new one points at the source (replacing what it
    /// named). Returns the replaced file's attributes if that was its last link.
    fn move_name(&mut self, req: &Rename, m: &Move, now: Timespec, held: Held) -> RpcResult<Option<Attr>> {
        let mut removed = None;
        let kind = self.node(m.src)?.kind();
        self.node_mut(req.parent)?.dir_mut()?.remove(&req.name)?;
        match m.dst {
            Some(d) => {
                self.node_mut(req.new_parent)?.dir_mut()?.repoint(&req.new_name, m.src, kind)?;
                if m.dst_is_dir {
                    self.remove_inode(d);
                    self.node_mut(req.new_parent)?.nlink -= 1;
                } else {
                    removed = self.drop_link(d, now, held)?;
                }
            }
            None => self.node_mut(req.new_parent)?.dir_mut()?.insert(&req.new_name, m.src, kind),
        }
        if m.src_is_dir {
            if m.moves {
                self.reparent(m.src, req.parent, req.new_parent)?;
            } else {
                self.node_mut(m.src)?.dir_mut()?.parent = req.new_parent;
            }
        }
        Ok(removed)
    }

    /// Directory `dir` moves from `from` to `to`: its ".." and both parents' link counts.
    fn reparent(&mut self, dir: InodeId, from: InodeId, to: InodeId) -> RpcResult<()> {
        self.node_mut(dir)?.dir_mut()?.parent = to;
        self.node_mut(from)?.nlink -= 1;
        self.node_mut(to)?.nlink += 1;
        Ok(())
    }
}

/// Without an exchange, a directory replaces only a directory and a non-directory only a
/// non-directory.
fn check_types(req: &Rename, m: &Move) -> RpcResult<()> {
    if !m.exchange && m.src_is_dir && !m.dst_is_dir {
        return Err(RemoteError::new(ErrorCode::NotDir, format!("\"{}\" is not a directory", show(&req.new_name))));
    }
    if !m.exchange && !m.src_is_dir && m.dst_is_dir {
        return Err(RemoteError::new(ErrorCode::IsDir, format!("\"{}\" is a directory", show(&req.new_name))));
    }
    Ok(())
}
