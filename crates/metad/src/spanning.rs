//! Operations that span shards, run by the shard that received them (the coordinator): a
//! rename between shards or onto a remote inode, a link to a remote inode, an unlink or rmdir
//! of a remote entry. Each is planned as steps (one name or inode on one shard each), logged as
//! an intent, prepared step by step (checked and pinned where they live), decided, committed in
//! order (the new name before the old one goes), and ended; see docs/architecture.md.
//!
//! Owns the plans and the two-phase drive, the redrive of intents a restart interrupted, the
//! filesystem's rename lock (on shard 0) and the ancestor walk across shards.

use crate::namespace::{IntentKind, MetaReply};
use crate::shards::Coordinator;
use odfs_proto::error::RpcResult;
use odfs_proto::meta::*;
use odfs_proto::{ErrorCode, InodeId, RemoteError, RequestHeader};
use std::time::{Duration, Instant};
use tracing::{debug, info, warn};

/// How long a coordinator keeps trying to commit a decided step before leaving it to the
/// redrive (a participant down for longer).
const COMMIT_PATIENCE: Duration = Duration::from_secs(30);
/// How long the rename lock is held at most: a coordinator that vanished loses it then.
const RENAME_LOCK_HOLD: Duration = Duration::from_secs(30);

/// One step as sent: who asks (the caller's identity), which intent, which step.
fn step_header(caller: &(u32, u32, Vec<u32>), intent: u64, index: usize, phase: StepPhase) -> RequestHeader {
    let p = match phase {
        StepPhase::Prepare => 1,
        StepPhase::Commit => 2,
        StepPhase::Abort => 3,
    };
    RequestHeader {
        client_id: intent,
        request_id: index as u64 * 4 + p,
        uid: caller.0,
        gid: caller.1,
        groups: caller.2.clone(),
    }
}

fn caller_of(h: &RequestHeader) -> (u32, u32, Vec<u32>) {
    (h.uid, h.gid, h.groups.clone())
}

impl Coordinator {
    fn own_shard(&self) -> u16 {
        self.store.lock().expect("store lock").shard()
    }

    /// Sends one step to the shard holding it (this one: straight to the store).
    async fn send_step(
        &self,
        shard: u16,
        caller: &(u32, u32, Vec<u32>),
        intent: u64,
        index: usize,
        phase: StepPhase,
        change: &StepChange,
    ) -> RpcResult<StepReply> {
        let h = step_header(caller, intent, index, phase);
        let client = self.running.lock().expect("running lock").get(&intent).copied().unwrap_or(0);
        let step = Step { intent, phase, change: change.clone(), client };
        if shard == self.own_shard() {
            let r = self.store.lock().expect("store lock").mutate(&h, step);
            self.recalls.wait(&h).await;
            return r;
        }
        self.peer_as(&h, shard, &step).await
    }

    /// Runs a planned operation: intent, prepares, decision, commits, end. Returns the commit
    /// replies, step by step.
    async fn run(
        &self,
        h: &RequestHeader,
        kind: IntentKind,
        steps: Vec<(u16, StepChange)>,
    ) -> RpcResult<Vec<StepReply>> {
        let id = self.store.lock().expect("store lock").begin_intent(h, kind, steps.clone())?;
        self.running.lock().expect("running lock").insert(id, h.client_id);
        let r = self.drive(id, &caller_of(h), &steps).await;
        if let Err(e) = &r {
            if self.store.lock().expect("store lock").intent_decided(id) {
                // Decided but a participant did not take its commit in time: the intent stays
                // open for the redrive to finish (ending it here would leave the operation
                // half done); the client's retries are answered `Busy` until it ends.
                warn!(intent = id, error = %e, "a decided operation spanning shards is left to the redrive");
                self.running.lock().expect("running lock").remove(&id);
                return r;
            }
        }
        let reply = r.as_ref().ok().map(|replies| final_reply(kind, replies));
        if let Err(e) = self.store.lock().expect("store lock").end_intent(id, reply) {
            warn!(intent = id, error = %e, "cannot log the end of an operation spanning shards");
        }
        self.running.lock().expect("running lock").remove(&id);
        r
    }

    /// Prepares every step (aborting the prepared ones at the first refusal), decides, commits.
    async fn drive(
        &self,
        id: u64,
        caller: &(u32, u32, Vec<u32>),
        steps: &[(u16, StepChange)],
    ) -> RpcResult<Vec<StepReply>> {
        for (i, (shard, change)) in steps.iter().enumerate() {
            if let Err(e) = self.send_step(*shard, caller, id, i, StepPhase::Prepare, change).await {
                debug!(intent = id, step = i, error = %e, "step refused; aborting");
                self.abort(id, caller, &steps[..=i]).await;
                return Err(e);
            }
        }
        self.store.lock().expect("store lock").decide_intent(id)?;
        self.commit(id, caller, steps).await
    }

    /// Commits every step in order, each retried until it lands (a decided intent must end).
    async fn commit(
        &self,
        id: u64,
        caller: &(u32, u32, Vec<u32>),
        steps: &[(u16, StepChange)],
    ) -> RpcResult<Vec<StepReply>> {
        let mut replies = Vec::with_capacity(steps.len());
        for (i, (shard, change)) in steps.iter().enumerate() {
            let until = Instant::now() + COMMIT_PATIENCE;
            loop {
                match self.send_step(*shard, caller, id, i, StepPhase::Commit, change).await {
                    Ok(r) => {
                        replies.push(r);
                        break;
                    }
                    Err(e) if Instant::now() < until => {
                        debug!(intent = id, step = i, error = %e, "commit not taken yet; trying again");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(replies)
    }

    /// Aborts steps (best effort: a step never prepared, or already aborted, answers anyway).
    async fn abort(&self, id: u64, caller: &(u32, u32, Vec<u32>), steps: &[(u16, StepChange)]) {
        for (i, (shard, change)) in steps.iter().enumerate().rev() {
            if let Err(e) = self.send_step(*shard, caller, id, i, StepPhase::Abort, change).await {
                warn!(intent = id, step = i, error = %e, "cannot abort a step; the redrive will");
            }
        }
    }

    /// Finishes the intents a restart interrupted (or a participant delayed): decided ones are
    /// committed to the end, the others aborted. Runs every few seconds until shutdown.
    pub async fn redrive(&self) {
        let open = self.store.lock().expect("store lock").intents();
        for (id, intent) in open {
            if self.running.lock().expect("running lock").insert(id, 0).is_some() {
                continue;
            }
            let reply = if intent.decided {
                match self.commit(id, &intent.caller, &intent.steps).await {
                    Ok(replies) => Some(final_reply(intent.kind, &replies)),
                    Err(e) => {
                        warn!(intent = id, error = %e, "a decided operation spanning shards is still waiting for a shard");
                        self.running.lock().expect("running lock").remove(&id);
                        continue;
                    }
                }
            } else {
                self.abort(id, &intent.caller, &intent.steps).await;
                None
            };
            info!(intent = id, committed = reply.is_some(), "finished an interrupted operation spanning shards");
            if let Err(e) = self.store.lock().expect("store lock").end_intent(id, reply) {
                warn!(intent = id, error = %e, "cannot log the end of an operation spanning shards");
            }
            self.running.lock().expect("running lock").remove(&id);
        }
    }

    // ---- what an operation needs to know before its plan ----

    /// The attributes of an inode, from its shard.
    async fn attr_of(&self, ino: InodeId) -> RpcResult<Attr> {
        if ino.shard() == self.own_shard() {
            return self.store.lock().expect("store lock").getattr(&RequestHeader::default(), &GetAttr { ino });
        }
        self.peer(ino.shard(), &GetAttr { ino }).await
    }

    /// What `name` in `parent` names, as `h` sees it (None: nothing), and the shard holding the
    /// name.
    async fn look(&self, h: &RequestHeader, parent: InodeId, name: &[u8]) -> RpcResult<(u16, Option<Attr>)> {
        let dir = self.attr_of(parent).await?;
        let shard = entry_shard(&dir.dir_stripes, name).unwrap_or(parent.shard());
        let q = Lookup { parent, name: name.to_vec() };
        let found = if shard == self.own_shard() {
            let f = self.store.lock().expect("store lock").resolve_name(h, &q);
            match f {
                Ok(f) => self.resolve(h, f).await,
                Err(e) => Err(e),
            }
        } else {
            self.peer_as(h, shard, &q).await
        };
        match found {
            Ok(a) => Ok((shard, Some(a))),
            Err(e) if e.code == ErrorCode::NotFound => Ok((shard, None)),
            Err(e) => Err(e),
        }
    }

    /// The parent of a directory, from a shard holding it.
    async fn parent_of(&self, dir: InodeId) -> RpcResult<InodeId> {
        let local = self.store.lock().expect("store lock").parent_of(&RequestHeader::default(), &ParentOf { ino: dir });
        match local {
            Ok(p) => Ok(p),
            Err(_) => self.peer(dir.shard(), &ParentOf { ino: dir }).await,
        }
    }

    /// Whether `ancestor` is `dir` or above it, walking ".." across shards (under the rename
    /// lock, so no directory changes parent meanwhile).
    async fn is_ancestor(&self, ancestor: InodeId, mut dir: InodeId) -> RpcResult<bool> {
        for _ in 0..4096 {
            if dir == ancestor {
                return Ok(true);
            }
            if dir == InodeId::ROOT {
                return Ok(false);
            }
            dir = self.parent_of(dir).await?;
        }
        Err(RemoteError::new(ErrorCode::Internal, "a directory is more than 4096 levels deep or in a loop"))
    }

    // ---- the rename lock (served by shard 0) ----

    /// `RenameLock` at shard 0: take (waiting while another intent holds it) or give back.
    pub async fn rename_lock(&self, q: RenameLock) -> RpcResult<()> {
        let until = Instant::now() + RENAME_LOCK_HOLD;
        loop {
            {
                let mut l = self.rename_lock.lock().expect("rename lock");
                let free = l.is_none_or(|(holder, until)| holder == q.intent || Instant::now() > until);
                match (q.take, free) {
                    (true, true) => {
                        *l = Some((q.intent, Instant::now() + Duration::from_millis(q.hold_ms as u64)));
                        return Ok(());
                    }
                    (false, _) => {
                        if l.is_some_and(|(holder, _)| holder == q.intent) {
                            *l = None;
                        }
                        return Ok(());
                    }
                    (true, false) => {}
                }
            }
            if Instant::now() > until {
                return Err(RemoteError::new(ErrorCode::Busy, "another directory is being moved; try again"));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    async fn lock_renames(&self, intent: u64, take: bool) -> RpcResult<()> {
        let q = RenameLock { intent, take, hold_ms: RENAME_LOCK_HOLD.as_millis() as u32 };
        if self.own_shard() == 0 {
            return self.rename_lock(q).await;
        }
        self.peer(0, &q).await
    }

    // ---- the operations ----

    /// `Unlink` of a name whose file lives on another shard.
    pub async fn unlink_spanning(&self, h: &RequestHeader, q: Unlink) -> RpcResult<UnlinkReply> {
        let (shard, found) = self.look(h, q.parent, &q.name).await?;
        let Some(a) = found else { return Err(RemoteError::new(ErrorCode::NotFound, "no such name")) };
        if a.kind == FileKind::Dir {
            return Err(RemoteError::new(ErrorCode::IsDir, "it is a directory"));
        }
        let steps = vec![
            (shard, StepChange::RemoveName { parent: q.parent, name: q.name, ino: a.ino, owner: a.uid, is_dir: false }),
            (a.ino.shard(), StepChange::DropLink { ino: a.ino }),
        ];
        let replies = self.run(h, IntentKind::Unlink, steps).await?;
        Ok(UnlinkReply { removed: replies.into_iter().find_map(|r| r.attr), parent: None })
    }

    /// `Rmdir` of a name whose directory lives on another shard.
    pub async fn rmdir_spanning(&self, h: &RequestHeader, q: Rmdir) -> RpcResult<()> {
        let (shard, found) = self.look(h, q.parent, &q.name).await?;
        let Some(a) = found else { return Err(RemoteError::new(ErrorCode::NotFound, "no such name")) };
        if a.kind != FileKind::Dir {
            return Err(RemoteError::new(ErrorCode::NotDir, "it is not a directory"));
        }
        let others = self.seal_other_parts(&a).await?;
        let steps = vec![
            (shard, StepChange::RemoveName { parent: q.parent, name: q.name, ino: a.ino, owner: a.uid, is_dir: true }),
            (a.ino.shard(), StepChange::DropDir { ino: a.ino }),
        ];
        self.end_parts(a.ino, &others, self.run(h, IntentKind::Rmdir, steps).await.map(drop)).await
    }

    /// `Link` of a file of another shard under a name of this one.
    pub async fn link_spanning(&self, h: &RequestHeader, q: Link) -> RpcResult<Attr> {
        let a = self.attr_of(q.ino).await?;
        if a.kind == FileKind::Dir {
            return Err(RemoteError::new(ErrorCode::Perm, "hard links to directories are not allowed"));
        }
        let (shard, found) = self.look(h, q.new_parent, &q.new_name).await?;
        if found.is_some() {
            return Err(RemoteError::new(
                ErrorCode::Exists,
                format!("\"{}\" already exists", String::from_utf8_lossy(&q.new_name)),
            ));
        }
        let steps = vec![
            (q.ino.shard(), StepChange::AddLink { ino: q.ino }),
            (
                shard,
                StepChange::SetName {
                    parent: q.new_parent,
                    name: q.new_name,
                    ino: q.ino,
                    kind: a.kind,
                    expect: None,
                    exchange: false,
                },
            ),
        ];
        let replies = self.run(h, IntentKind::Link, steps).await?;
        match final_reply(IntentKind::Link, &replies) {
            MetaReply::Attr(a) => Ok(a),
            _ => self.attr_of(q.ino).await,
        }
    }

    /// `Rename` between shards, onto a remote inode, or of a directory that changes parent in
    /// a filesystem of several shards.
    pub async fn rename_spanning(&self, h: &RequestHeader, q: Rename) -> RpcResult<RenameReply> {
        if q.flags & !(RENAME_NOREPLACE | RENAME_EXCHANGE) != 0 || q.flags == RENAME_NOREPLACE | RENAME_EXCHANGE {
            return Err(RemoteError::new(ErrorCode::Invalid, format!("rename flags {:#x} are invalid", q.flags)));
        }
        let exchange = q.flags & RENAME_EXCHANGE != 0;
        let (src_shard, src) = self.look(h, q.parent, &q.name).await?;
        let Some(src) = src else { return Err(RemoteError::new(ErrorCode::NotFound, "no such name")) };
        let (dst_shard, dst) = self.look(h, q.new_parent, &q.new_name).await?;
        match (&dst, q.flags) {
            (Some(_), RENAME_NOREPLACE) => return Err(RemoteError::new(ErrorCode::Exists, "the new name exists")),
            (None, _) if exchange => return Err(RemoteError::new(ErrorCode::NotFound, "the new name does not exist")),
            (Some(d), _) if d.ino == src.ino => return Ok(RenameReply { removed: None }),
            _ => {}
        }
        let moves = q.parent != q.new_parent;
        let dir_moves =
            moves && (src.kind == FileKind::Dir || exchange && dst.as_ref().is_some_and(|d| d.kind == FileKind::Dir));
        // A key of its own for the rename lock: the intent id is not known yet.
        let lock_key = h.client_id ^ h.request_id.rotate_left(32);
        if dir_moves {
            self.lock_renames(lock_key, true).await?;
        }
        let r = self.rename_locked(h, &q, exchange, (src_shard, &src), (dst_shard, dst.as_ref()), moves).await;
        if dir_moves {
            if let Err(e) = self.lock_renames(lock_key, false).await {
                warn!(error = %e, "cannot give the rename lock back; it lapses by itself");
            }
        }
        r
    }

    async fn rename_locked(
        &self,
        h: &RequestHeader,
        q: &Rename,
        exchange: bool,
        (src_shard, src): (u16, &Attr),
        (dst_shard, dst): (u16, Option<&Attr>),
        moves: bool,
    ) -> RpcResult<RenameReply> {
        if moves && src.kind == FileKind::Dir && self.is_ancestor(src.ino, q.new_parent).await? {
            return Err(RemoteError::new(ErrorCode::Invalid, "cannot move a directory into itself"));
        }
        if let Some(d) = dst.filter(|d| d.kind == FileKind::Dir) {
            if moves && self.is_ancestor(d.ino, q.parent).await? {
                let code = if exchange { ErrorCode::Invalid } else { ErrorCode::NotEmpty };
                return Err(RemoteError::new(code, "the destination is an ancestor of the source"));
            }
        }
        let victim_dir = dst.filter(|d| d.kind == FileKind::Dir && !exchange);
        let others = match victim_dir {
            Some(d) => self.seal_other_parts(d).await?,
            None => Vec::new(),
        };
        let steps = rename_steps(q, exchange, (src_shard, src), (dst_shard, dst), moves);
        let r = self.run(h, IntentKind::Rename, steps).await;
        let removed = r.as_ref().ok().and_then(|replies| replies.iter().find_map(|x| x.attr.clone()));
        match victim_dir {
            Some(d) => self.end_parts(d.ino, &others, r.map(drop)).await?,
            None => r.map(drop)?,
        }
        // A replaced directory goes with its parts; only a file's chunks are the client's.
        Ok(RenameReply { removed: removed.filter(|a| a.kind == FileKind::File) })
    }

    /// Seals the parts a striped directory has on other shards (each must be empty); returns
    /// the shards sealed.
    async fn seal_other_parts(&self, dir: &Attr) -> RpcResult<Vec<u16>> {
        let others: Vec<u16> = dir.dir_stripes.iter().copied().filter(|&s| s != dir.ino.shard()).collect();
        let mut sealed = Vec::new();
        for s in others {
            match self.peer(s, &SealShadow { ino: dir.ino, seal: true }).await {
                Ok(()) => sealed.push(s),
                Err(e) => {
                    self.unseal(dir.ino, &sealed).await;
                    return Err(e);
                }
            }
        }
        Ok(sealed)
    }

    /// After an operation that removed (or failed to remove) a directory: its sealed parts
    /// go, or are unsealed again.
    async fn end_parts(&self, ino: InodeId, sealed: &[u16], r: RpcResult<()>) -> RpcResult<()> {
        match &r {
            Ok(()) => self.drop_parts(ino, sealed).await,
            Err(_) => self.unseal(ino, sealed).await,
        }
        r
    }
}

/// The steps of a rename, in commit order: the new name first, then the old one goes (or, with
/// `RENAME_EXCHANGE`, points at the other inode), then the replaced inode loses its link, then
/// moved directories learn their new "..".
fn rename_steps(
    q: &Rename,
    exchange: bool,
    (src_shard, src): (u16, &Attr),
    (dst_shard, dst): (u16, Option<&Attr>),
    moves: bool,
) -> Vec<(u16, StepChange)> {
    let expect = |a: &Attr| (a.ino, a.kind, a.uid);
    let mut steps = vec![(
        dst_shard,
        StepChange::SetName {
            parent: q.new_parent,
            name: q.new_name.clone(),
            ino: src.ino,
            kind: src.kind,
            expect: dst.map(expect),
            exchange,
        },
    )];
    match (exchange, dst) {
        (true, Some(d)) => steps.push((
            src_shard,
            StepChange::SetName {
                parent: q.parent,
                name: q.name.clone(),
                ino: d.ino,
                kind: d.kind,
                expect: Some(expect(src)),
                exchange,
            },
        )),
        _ => steps.push((
            src_shard,
            StepChange::RemoveName {
                parent: q.parent,
                name: q.name.clone(),
                ino: src.ino,
                owner: src.uid,
                is_dir: src.kind == FileKind::Dir,
            },
        )),
    }
    if let (false, Some(d)) = (exchange, dst) {
        let drop = if d.kind == FileKind::Dir {
            StepChange::DropDir { ino: d.ino }
        } else {
            StepChange::DropLink { ino: d.ino }
        };
        steps.push((d.ino.shard(), drop));
    }
    if moves && src.kind == FileKind::Dir {
        steps.push((src.ino.shard(), StepChange::Reparent { ino: src.ino, to: q.new_parent }));
    }
    if let (true, true, Some(d)) = (moves, exchange, dst) {
        if d.kind == FileKind::Dir {
            steps.push((d.ino.shard(), StepChange::Reparent { ino: d.ino, to: q.parent }));
        }
    }
    steps
}

/// The reply an operation's client gets, from its steps' commit replies: what went (a rename
/// or unlink), the linked inode (a link).
fn final_reply(kind: IntentKind, replies: &[StepReply]) -> MetaReply {
    let first = replies.iter().find_map(|r| r.attr.clone());
    let removed = first.clone().filter(|a| a.kind == FileKind::File);
    match (kind, first) {
        (IntentKind::Rename, _) => MetaReply::Rename(RenameReply { removed }),
        (IntentKind::Unlink, _) => MetaReply::Unlink(UnlinkReply { removed, parent: None }),
        (IntentKind::Link, Some(a)) => MetaReply::Attr(a),
        (IntentKind::Rmdir | IntentKind::Link, _) => MetaReply::Unit,
    }
}
