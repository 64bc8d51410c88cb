//! One shard's part of an operation that spans shards: its steps (prepare checks as the local
//! operation would and pins; commit changes and unpins; abort unpins), and, on the
//! coordinator, the intent's record (begun, decided, ended). The order across shards is
//! `spanning`'s.

use crate::error::{exists, internal, not_found, show};
use crate::inode::Inode;
use crate::namespace::{check_name, Applied, Held, Intent, MetaReply, Namespace, Pin, MAX_LINKS};
use crate::permission::{self, MAY_EXEC, MAY_WRITE};
use odfs_proto::error::{ErrorCode, RemoteError, RpcResult};
use odfs_proto::meta::{Attr, FileKind, Step, StepChange, StepPhase, StepReply};
use odfs_proto::{InodeId, RequestHeader, Timespec};

/// What a step pins.
fn pin_of(c: &StepChange) -> Pin {
    match c {
        StepChange::RemoveName { parent, name, .. } | StepChange::SetName { parent, name, .. } => {
            Pin::Name(*parent, name.clone())
        }
        StepChange::AddLink { ino }
        | StepChange::DropLink { ino }
        | StepChange::DropDir { ino }
        | StepChange::Reparent { ino, .. } => Pin::Node(*ino),
    }
}

fn changed_meanwhile(what: &str) -> RemoteError {
    RemoteError::new(ErrorCode::Busy, format!("{what} changed meanwhile; try again"))
}

fn reply(attr: Option<Attr>) -> RpcResult<Applied> {
    Applied::changed(MetaReply::Step(StepReply { attr }))
}

impl Namespace {
    pub(crate) fn step(&mut self, h: &RequestHeader, now: Timespec, s: &Step, held: Held) -> RpcResult<Applied> {
        let pin = pin_of(&s.change);
        match (s.phase, self.pins.get(&pin).copied()) {
            // Prepared already by this intent (a repeated prepare): the same answer.
            (StepPhase::Prepare, Some(i)) if i == s.intent => reply(self.step_attr(&s.change)),
            (StepPhase::Prepare, Some(_)) => Err(changed_meanwhile("the name or inode is in another operation: it")),
            (StepPhase::Prepare, None) => {
                let attr = self.prepare(h, &s.change)?;
                self.pins.insert(pin, s.intent);
                reply(attr)
            }
            (StepPhase::Commit, Some(i)) if i == s.intent => {
                let attr = self.commit(now, &s.change, held)?;
                self.pins.remove(&pin);
                reply(attr)
            }
            (StepPhase::Abort, Some(i)) if i == s.intent => {
                if let StepChange::DropDir { ino } = &s.change {
                    if let Some(d) = self.inodes.get_mut(ino).and_then(|n| n.dir_mut().ok()) {
                        d.closing = false;
                    }
                }
                self.pins.remove(&pin);
                reply(None)
            }
            // Committed or aborted already (a repeat after a restart), or never prepared.
            (StepPhase::Commit | StepPhase::Abort, _) => Applied::unchanged(MetaReply::Step(StepReply::default())),
        }
    }

    /// The attributes an inode step reports.
    fn step_attr(&self, c: &StepChange) -> Option<Attr> {
        match c {
            StepChange::AddLink { ino }
            | StepChange::DropLink { ino }
            | StepChange::DropDir { ino }
            | StepChange::Reparent { ino, .. } => self.inodes.get(ino).map(|n| n.attr(*ino)),
            _ => None,
        }
    }

    /// Checks a step as the local operation would; seals a directory about to go.
    fn prepare(&mut self, h: &RequestHeader, c: &StepChange) -> RpcResult<Option<Attr>> {
        match c {
            StepChange::RemoveName { parent, name, ino, owner, .. } => {
                let (dir, current) = self.name_step(h, *parent, name)?;
                if current.map(|(i, _)| i) != Some(*ino) {
                    return Err(match current {
                        None => not_found(name),
                        Some(_) => changed_meanwhile(&format!("\"{}\"", show(name))),
                    });
                }
                permission::require_sticky_owner(h, dir, *owner, name)?;
            }
            StepChange::SetName { parent, name, kind, expect, exchange, .. } => {
                self.check_set_name(h, *parent, name, *kind, *expect, *exchange)?;
            }
            StepChange::AddLink { ino } => {
                let n = self.node(*ino)?;
                if n.is_dir() {
                    return Err(RemoteError::new(ErrorCode::Perm, "hard links to directories are not allowed"));
                }
                if n.nlink == 0 {
                    return Err(RemoteError::new(ErrorCode::NotFound, format!("inode {ino} has no name any more")));
                }
                if n.nlink >= MAX_LINKS {
                    return Err(RemoteError::new(
                        ErrorCode::TooManyLinks,
                        format!("inode {ino} has {MAX_LINKS} links"),
                    ));
                }
            }
            StepChange::DropLink { ino } => {
                self.node(*ino)?;
            }
            StepChange::DropDir { ino } => {
                let d = self
                    .node_mut(*ino)?
                    .dir_mut()
                    .map_err(|_| RemoteError::new(ErrorCode::NotDir, "not a directory"))?;
                if !d.is_empty() {
                    return Err(RemoteError::new(
                        ErrorCode::NotEmpty,
                        format!("directory {ino} has {} entries", d.len()),
                    ));
                }
                d.closing = true;
            }
            StepChange::Reparent { ino, .. } => {
                // Its ".." is rewritten: Linux asks for write permission on the directory.
                let n = self.node(*ino)?;
                permission::require(h, n, *ino, MAY_WRITE)?;
            }
        }
        Ok(self.step_attr(c))
    }

    /// The checks every name step needs: a valid name of a searchable, writable directory part
    /// of this shard, unpinned. Returns the directory and what the name names now.
    fn name_step(
        &self,
        h: &RequestHeader,
        parent: InodeId,
        name: &[u8],
    ) -> RpcResult<(&Inode, Option<(InodeId, FileKind)>)> {
        check_name(name)?;
        let (node, dir) = self.dir_node(parent)?;
        dir.holds_name(name, self.shard)?;
        permission::require(h, node, parent, MAY_EXEC)?;
        permission::require(h, node, parent, MAY_WRITE | MAY_EXEC)?;
        self.unpinned_name(parent, name)?;
        Ok((node, dir.entry(name)))
    }

    /// `SetName`'s checks: the name names what the coordinator saw, the sticky bit lets the
    /// caller replace it, the kinds agree (a directory replaces only a directory), and a
    /// directory arriving finds room.
    fn check_set_name(
        &self,
        h: &RequestHeader,
        parent: InodeId,
        name: &[u8],
        kind: FileKind,
        expect: Option<(InodeId, FileKind, u32)>,
        exchange: bool,
    ) -> RpcResult<()> {
        let (dir, current) = self.name_step(h, parent, name)?;
        if let Some((_, d)) = self.inodes.get(&parent).and_then(|n| n.dir().map(|d| (n, d))) {
            if expect.is_none() {
                d.accepts_entries()?;
            }
        }
        match (current, expect) {
            (None, None) => {}
            (Some(_), None) => return Err(exists(name)),
            (None, Some(_)) => return Err(changed_meanwhile(&format!("\"{}\"", show(name)))),
            (Some((now, _)), Some((want, _, _))) if now != want => {
                return Err(changed_meanwhile(&format!("\"{}\"", show(name))))
            }
            (Some(_), Some((_, vkind, owner))) => {
                permission::require_sticky_owner(h, dir, owner, name)?;
                if !exchange && kind == FileKind::Dir && vkind != FileKind::Dir {
                    return Err(RemoteError::new(ErrorCode::NotDir, format!("\"{}\" is not a directory", show(name))));
                }
                if !exchange && kind != FileKind::Dir && vkind == FileKind::Dir {
                    return Err(RemoteError::new(ErrorCode::IsDir, format!("\"{}\" is a directory", show(name))));
                }
            }
        }
        let replaces_dir = expect.is_some_and(|(_, k, _)| k == FileKind::Dir);
        if kind == FileKind::Dir && !replaces_dir && dir.nlink >= MAX_LINKS {
            return Err(RemoteError::new(
                ErrorCode::TooManyLinks,
                format!("the destination has {MAX_LINKS} subdirectories"),
            ));
        }
        Ok(())
    }

    /// Makes a prepared step's change. Returns the attributes of an inode that went.
    fn commit(&mut self, now: Timespec, c: &StepChange, held: Held) -> RpcResult<Option<Attr>> {
        match c {
            StepChange::RemoveName { parent, name, is_dir, .. } => {
                let p = self.node_mut(*parent)?;
                p.touch_dir(now);
                if *is_dir {
                    p.nlink = p.nlink.saturating_sub(1);
                }
                p.dir_mut()?.remove(name)?;
                Ok(None)
            }
            StepChange::SetName { parent, name, ino, kind, .. } => {
                let p = self.node_mut(*parent)?;
                p.touch_dir(now);
                let d = p.dir_mut()?;
                let before = d.entry(name).map(|(_, k)| k);
                match before {
                    Some(_) => d.repoint(name, *ino, *kind)?,
                    None => d.insert(name, *ino, *kind),
                }
                let (arrives, leaves) = (*kind == FileKind::Dir, before == Some(FileKind::Dir));
                p.nlink = (p.nlink + arrives as u32).saturating_sub(leaves as u32);
                Ok(None)
            }
            StepChange::AddLink { ino } => {
                let n = self.node_mut(*ino)?;
                n.nlink += 1;
                n.ctime = now;
                Ok(Some(n.attr(*ino)))
            }
            StepChange::DropLink { ino } => match self.inodes.contains_key(ino) {
                true => self.drop_link(*ino, now, held),
                false => Ok(None),
            },
            StepChange::DropDir { ino } => Ok(self.remove_inode(*ino).map(|n| n.attr(*ino))),
            StepChange::Reparent { ino, to } => {
                let n = self.node_mut(*ino)?;
                n.dir_mut()?.parent = *to;
                n.ctime = now;
                Ok(None)
            }
        }
    }

    // ---- the coordinator's record ----

    pub(crate) fn begin_intent(&mut self, id: u64, intent: &Intent) -> RpcResult<Applied> {
        if self.intents.contains_key(&id) {
            return Err(internal("an intent id is in use"));
        }
        self.intents.insert(id, intent.clone());
        Applied::changed(MetaReply::Unit)
    }

    pub(crate) fn decide_intent(&mut self, id: u64) -> RpcResult<Applied> {
        let i = self.intents.get_mut(&id).ok_or_else(|| internal("no such intent"))?;
        i.decided = true;
        Applied::changed(MetaReply::Unit)
    }

    /// Forgets a finished intent; its reply becomes the answer to the client's retries.
    pub(crate) fn end_intent(&mut self, id: u64, reply: &Option<Box<MetaReply>>) -> RpcResult<Applied> {
        self.intents.remove(&id);
        Applied::changed(reply.as_deref().cloned().unwrap_or(MetaReply::Unit))
    }
}
