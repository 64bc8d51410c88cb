//! The namespace: every inode of one shard held in memory, the reads, and the dispatch of one
//! mutation to its operation in `ops`.
//!
//! [`Namespace::apply`] is the only way the state changes. Each operation checks everything
//! before it changes anything, so a failed request leaves no trace; and given the same state,
//! caller, time and [`Choice`] it produces the same result, which is what lets the write-ahead
//! log replay it. Checks follow Linux's order (search permission on the parent, existence, write
//! permission, sticky bit, type) so callers see the errno Linux would give; the checks several
//! operations share (a new entry, a deletion) are here.

use crate::error::{exists, internal, not_found, show};
use crate::inode::{Body, Dir, Inode, InodeMap};
use crate::permission::{self, MAY_EXEC, MAY_READ, MAY_WRITE};
use odfs_proto::error::{ErrorCode, RemoteError, RpcResult};
use odfs_proto::meta::*;
use odfs_proto::{DirLayout, InodeId, Layout, RequestHeader, Timespec, NAME_MAX};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};

/// Most hard links to one inode, and most subdirectories of one directory (as ext4).
pub const MAX_LINKS: u32 = 65000;
/// Longest symbolic link target, in bytes (`PATH_MAX` less the NUL).
pub const SYMLINK_MAX: usize = 4095;
/// Largest readdir batch, whatever the caller asks, so a reply stays well inside a frame.
pub const READDIR_MAX_BATCH: usize = 4096;
/// Readdir batch when the caller asks for 0 entries.
pub const READDIR_DEFAULT_BATCH: usize = 1024;
/// Approximate reply size at which a readdir batch stops early.
const READDIR_MAX_BYTES: usize = 4 << 20;
/// Most bytes of extended attributes (names and values) one inode may hold.
pub const XATTR_TOTAL_MAX: usize = 1 << 20;
/// Largest local part of an inode id.
const MAX_LOCAL: u64 = (1 << 48) - 1;

/// One mutation of the namespace: what [`crate::MetaStore::mutate`] accepts.
///
/// Log records and snapshots encode variants by position: add new ones at the end only.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MetaOp {
    Create(Create),
    Mkdir(Mkdir),
    Unlink(Unlink),
    Rmdir(Rmdir),
    Rename(Rename),
    Symlink(Symlink),
    Link(Link),
    SetAttr(SetAttr),
    SetXattr(SetXattr),
    RemoveXattr(RemoveXattr),
    ExtendSize(ExtendSize),
    SetDirLayout(SetDirLayout),
    /// Sets the root directory's owner, group and mode. Administrative: no permission check,
    /// so the service must not offer it to clients.
    SetRootOwner {
        uid: u32,
        gid: u32,
        mode: u32,
    },
    SetFileLayout(SetFileLayout),
    CreateShadow(CreateShadow),
    SyncShadow(SyncShadow),
    SealShadow(SealShadow),
    DropShadow(DropShadow),
    /// Marks an empty directory of this shard striped over `stripes` (the other shards' parts
    /// exist by now: its shard's service made them first).
    SetDirStripes {
        ino: InodeId,
        stripes: Vec<u16>,
    },
    Mknod(Mknod),
    /// Removes an orphan (nlink 0) that no client holds open any more.
    DropOrphan {
        ino: InodeId,
    },
    /// One step of an operation spanning shards, on the shard holding it.
    Step(Step),
    /// The coordinator of an operation spanning shards logs it before its first step...
    BeginIntent {
        id: u64,
        intent: Intent,
    },
    /// ... its decision to commit before the first commit...
    DecideIntent {
        id: u64,
    },
    /// ... and its end, with the reply its client gets (None: it failed).
    EndIntent {
        id: u64,
        reply: Option<Box<MetaReply>>,
    },
    SetSealed(SetSealed),
    /// Reserves the next `count` inode ids of this shard for a client's create delegation:
    /// logged, so that a restarted shard never gives them out again.
    ReserveInodes {
        count: u32,
    },
}

/// The successful reply of a [`MetaOp`]. Stored in snapshots: add variants at the end only.
///
/// `Create` → `Create`; `Unlink` → `Unlink`; `Rename` → `Rename`; `Mkdir`, `Mknod`, `Symlink`,
/// `Link`, `SetAttr`, `ExtendSize`, `SetRootOwner` → `Attr`; `DropOrphan` → `Orphan`; the rest
/// → `Unit`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MetaReply {
    Attr(Attr),
    Create(CreateReply),
    Unlink(UnlinkReply),
    Rename(RenameReply),
    Unit,
    /// `DropOrphan`: the removed orphan's attributes (its chunks go next), if it was removed.
    Orphan(Option<Attr>),
    Step(StepReply),
    /// `ReserveInodes`: the first id reserved (the others follow it).
    Reserved(InodeId),
}

/// The error for a mutation `what` that got a reply of another kind (a bug: each op has one).
pub(crate) fn wrong_reply(what: &str, got: &MetaReply) -> RemoteError {
    RemoteError::new(ErrorCode::Internal, format!("a {what} mutation got a {got:?} reply"))
}

/// A mutation and the type of its reply: [`crate::MetaStore::mutate`] takes any and answers
/// `Self::Reply`. [`MetaOp`] is one too, answering the untyped [`MetaReply`] (log replay,
/// intents, and tests that hold any op).
pub trait Mutation {
    /// What a successful mutation answers.
    type Reply;
    /// The op as logged.
    fn into_op(self) -> MetaOp;
    /// The typed reply; a reply of another kind is an internal error (each op has one kind:
    /// another is a bug).
    fn reply(r: MetaReply) -> RpcResult<Self::Reply>;
}

impl Mutation for MetaOp {
    type Reply = MetaReply;
    fn into_op(self) -> MetaOp {
        self
    }
    fn reply(r: MetaReply) -> RpcResult<MetaReply> {
        Ok(r)
    }
}

/// `impl Mutation` for each request that is a mutation of its own: its `MetaOp` variant, and
/// the `MetaReply` variant that carries its reply.
macro_rules! mutations {
    ($($req:ident => $reply:ty, $pat:pat => $out:expr;)*) => {$(
        impl Mutation for $req {
            type Reply = $reply;
            fn into_op(self) -> MetaOp {
                MetaOp::$req(self)
            }
            fn reply(r: MetaReply) -> RpcResult<$reply> {
                match r {
                    $pat => Ok($out),
                    other => Err(wrong_reply(stringify!($req), &other)),
                }
            }
        }
    )*};
}

mutations! {
    Create => CreateReply, MetaReply::Create(c) => c;
    Mkdir => Attr, MetaReply::Attr(a) => a;
    Mknod => Attr, MetaReply::Attr(a) => a;
    Symlink => Attr, MetaReply::Attr(a) => a;
    Link => Attr, MetaReply::Attr(a) => a;
    SetAttr => Attr, MetaReply::Attr(a) => a;
    ExtendSize => Attr, MetaReply::Attr(a) => a;
    SetFileLayout => Attr, MetaReply::Attr(a) => a;
    SetSealed => Attr, MetaReply::Attr(a) => a;
    Unlink => UnlinkReply, MetaReply::Unlink(u) => u;
    Rename => RenameReply, MetaReply::Rename(r) => r;
    Step => StepReply, MetaReply::Step(r) => r;
    Rmdir => (), MetaReply::Unit => ();
    SetXattr => (), MetaReply::Unit => ();
    RemoveXattr => (), MetaReply::Unit => ();
    SetDirLayout => (), MetaReply::Unit => ();
    CreateShadow => (), MetaReply::Unit => ();
    SyncShadow => (), MetaReply::Unit => ();
    SealShadow => (), MetaReply::Unit => ();
    DropShadow => (), MetaReply::Unit => ();
}

/// The non-deterministic choices of a mutation. Live, they are `None` and the namespace decides
/// (next inode id, layout from the chooser, whether a client holds an unlinked inode open); at
/// replay they come from the log record.
#[derive(Debug, Default, Serialize, Deserialize)]
pub(crate) struct Choice {
    pub ino: Option<InodeId>,
    pub layout: Option<Layout>,
}

/// Picks the targets of a new file from a directory layout.
/// Picks a new file's targets for a layout; the node is the creating client's (local placement).
pub(crate) type Chooser<'a> = &'a mut dyn FnMut(&DirLayout, Option<odfs_proto::NodeIndex>) -> RpcResult<Layout>;

/// Whether a client holds an inode open (its last link going then makes it an orphan). Live it
/// asks the sessions; at replay it answers from the log record's list of kept orphans.
pub(crate) type Held<'a> = &'a dyn Fn(InodeId) -> bool;

/// The outcome of a successful `apply`.
pub(crate) struct Applied {
    pub reply: MetaReply,
    /// False when nothing changed (an existing file opened by `Create`, a rename onto the same
    /// inode): such outcomes need no log record.
    pub changed: bool,
    /// Inodes whose last link went while a client held them open: kept as orphans.
    pub kept: Vec<InodeId>,
    /// What changed, for the recalls of clients' caches: inodes, and names (directory, name).
    pub changes: Changes,
}

/// What a mutation changed (see `sessions::recall`).
#[derive(Debug, Default)]
pub(crate) struct Changes {
    pub inos: Vec<InodeId>,
    pub names: Vec<(InodeId, Vec<u8>)>,
}

impl Applied {
    pub(crate) fn changed(reply: MetaReply) -> RpcResult<Applied> {
        Ok(Applied { reply, changed: true, kept: Vec::new(), changes: Changes::default() })
    }
    pub(crate) fn unchanged(reply: MetaReply) -> RpcResult<Applied> {
        Ok(Applied { reply, changed: false, kept: Vec::new(), changes: Changes::default() })
    }
}

/// What a name resolves to: an inode of this shard (with its attributes), or one of another
/// shard (a remote entry, whose attributes that shard has).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    Here(Attr),
    Remote(InodeId),
}

/// The refusal of a local operation that would touch an inode of another shard: the service
/// runs it as an operation that spans shards.
pub(crate) fn spans_shards(ino: InodeId) -> RemoteError {
    RemoteError::new(ErrorCode::SpansShards, format!("inode {ino} lives on metadata shard {}", ino.shard()))
}

pub use odfs_proto::meta::check_name;

/// The namespaces of extended attribute names Linux knows; the kernel leaves other names to a
/// FUSE filesystem, and Linux's local filesystems refuse them with `EOPNOTSUPP`.
const XATTR_NAMESPACES: [&[u8]; 4] = [b"user.", b"trusted.", b"security.", b"system."];

/// Extended attribute names: not empty, at most `NAME_MAX` bytes (Linux answers `ERANGE`), in
/// a namespace Linux knows.
pub(crate) fn check_xattr_name(name: &[u8]) -> RpcResult<()> {
    if name.is_empty() || name.len() > NAME_MAX {
        return Err(RemoteError::new(
            ErrorCode::Range,
            format!("extended attribute name is {} bytes; it must be 1 to {NAME_MAX}", name.len()),
        ));
    }
    if !XATTR_NAMESPACES.iter().any(|ns| name.starts_with(ns)) {
        return Err(RemoteError::new(
            ErrorCode::Unsupported,
            format!(
                "extended attribute \"{}\" is in no namespace ({})",
                show(name),
                XATTR_NAMESPACES.map(String::from_utf8_lossy).join(", ")
            ),
        ));
    }
    Ok(())
}

/// Every inode of one shard.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Namespace {
    pub(crate) shard: u16,
    /// Local part of the next inode id to hand out.
    next_local: u64,
    pub(crate) inodes: InodeMap,
    /// Inodes held here for other shards (parts of their striped directories), counted apart
    /// so that statfs need not scan every inode. Not in snapshots: [`Namespace::recount`].
    #[serde(skip)]
    pub(crate) foreign: u64,
    /// Inodes without a name that a client held open when their last link went (nlink 0).
    /// Rebuilt at load by [`Namespace::recount`].
    #[serde(skip)]
    pub(crate) orphans: std::collections::BTreeSet<InodeId>,
    /// Orphans kept by the mutation being applied (moved into its `Applied`).
    #[serde(skip)]
    kept: Vec<InodeId>,
    /// Inodes changed by the mutation being applied (moved into its `Applied`, for recalls).
    #[serde(skip)]
    touched: Vec<InodeId>,
    /// Names and inodes prepared by operations that span shards, by intent: until the step
    /// commits or aborts, other changes to them answer `Busy` (clients retry).
    pub(crate) pins: HashMap<Pin, u64>,
    /// Operations that span shards this shard coordinates, from intent to end.
    pub(crate) intents: BTreeMap<u64, Intent>,
    /// Metadata shards of the filesystem (from mgmtd; not logged). With more than one, a
    /// directory changing parent takes the rename lock and runs as an operation spanning shards.
    #[serde(skip)]
    pub(crate) shards_total: u16,
}

/// What a pin holds.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Pin {
    Name(InodeId, Vec<u8>),
    Node(InodeId),
}

/// An operation spanning shards, as its coordinator logs it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Intent {
    /// The client's request: (client id, request id), for its retries.
    pub request: (u64, u64),
    /// The caller's identity, for the steps' permission checks.
    pub caller: (u32, u32, Vec<u32>),
    /// Each step with the shard that holds it, in commit order.
    pub steps: Vec<(u16, StepChange)>,
    /// The coordinator decided to commit: a restart finishes it instead of aborting it.
    pub decided: bool,
    /// Which operation, for the reply a restart's redrive gives.
    pub kind: IntentKind,
}

/// The operation an intent runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum IntentKind {
    Rename,
    Unlink,
    Rmdir,
    Link,
}

impl Namespace {
    pub fn new(shard: u16) -> Namespace {
        Namespace {
            shard,
            // Local id 1 of shard 0 is the root.
            next_local: 2,
            inodes: InodeMap::default(),
            foreign: 0,
            orphans: Default::default(),
            kept: Vec::new(),
            touched: Vec::new(),
            pins: HashMap::new(),
            intents: BTreeMap::new(),
            shards_total: 1,
        }
    }

    /// Counts the other shards' inodes and finds the orphans again (after loading a snapshot).
    pub fn recount(&mut self) {
        self.foreign = self.inodes.keys().filter(|i| i.shard() != self.shard).count() as u64;
        self.orphans = self.inodes.iter().filter(|(_, n)| n.nlink == 0 && !n.is_dir()).map(|(i, _)| *i).collect();
    }

    pub fn shard(&self) -> u16 {
        self.shard
    }

    /// Inodes of this shard (parts of other shards' striped directories not counted).
    pub fn inode_count(&self) -> u64 {
        debug_assert_eq!(
            self.foreign,
            self.inodes.keys().filter(|i| i.shard() != self.shard).count() as u64,
            "count of other shards' inodes"
        );
        self.inodes.len() as u64 - self.foreign
    }

    pub fn has_root(&self) -> bool {
        self.inodes.contains_key(&InodeId::ROOT)
    }

    /// Creates the root directory: mode 0755, owned by root, giving children `layout`.
    pub fn create_root(&mut self, now: Timespec, layout: DirLayout) -> RpcResult<Attr> {
        if self.has_root() {
            return Err(internal("the root directory exists already"));
        }
        let mut node = Inode::new(0o755, 0, 0, now, Body::Dir(Box::new(Dir::new(InodeId::ROOT, layout))));
        node.nlink = 2;
        let attr = node.attr(InodeId::ROOT);
        self.inodes.insert(InodeId::ROOT, node);
        // Every shard keeps a root; it is shard 0's inode.
        if InodeId::ROOT.shard() != self.shard {
            self.foreign += 1;
        }
        Ok(attr)
    }

    pub(crate) fn node(&self, ino: InodeId) -> RpcResult<&Inode> {
        self.inodes
            .get(&ino)
            .ok_or_else(|| RemoteError::new(ErrorCode::NotFound, format!("inode {ino} does not exist")))
    }

    /// The inode a name of this shard points at: `SpansShards` when it lives on another shard.
    pub(crate) fn target(&self, ino: InodeId) -> RpcResult<&Inode> {
        match self.inodes.get(&ino) {
            Some(n) => Ok(n),
            None if ino.shard() != self.shard => Err(spans_shards(ino)),
            None => Err(RemoteError::new(ErrorCode::NotFound, format!("inode {ino} does not exist"))),
        }
    }

    pub(crate) fn node_mut(&mut self, ino: InodeId) -> RpcResult<&mut Inode> {
        self.touched.push(ino);
        self.inodes
            .get_mut(&ino)
            .ok_or_else(|| RemoteError::new(ErrorCode::NotFound, format!("inode {ino} does not exist")))
    }

    /// A directory inode and its entries: `NotFound` or `NotDir` otherwise.
    pub(crate) fn dir_node(&self, ino: InodeId) -> RpcResult<(&Inode, &Dir)> {
        let node = self.node(ino)?;
        match node.dir() {
            Some(d) => Ok((node, d)),
            None => Err(RemoteError::new(ErrorCode::NotDir, format!("inode {ino} is not a directory"))),
        }
    }

    /// The next inode id, or the one recorded in the log.
    pub(crate) fn alloc(&mut self, recorded: Option<InodeId>) -> RpcResult<InodeId> {
        if let Some(ino) = recorded {
            if self.inodes.contains_key(&ino) {
                return Err(internal("the recorded inode id is in use"));
            }
            if ino.shard() == self.shard {
                self.next_local = self.next_local.max(ino.local() + 1);
            }
            return Ok(ino);
        }
        if self.next_local > MAX_LOCAL {
            return Err(RemoteError::new(ErrorCode::NoSpace, "this shard has used every inode id"));
        }
        let ino = InodeId::new(self.shard, self.next_local);
        self.next_local += 1;
        Ok(ino)
    }

    /// Reserves the next `count` inode ids (a create delegation's); returns the first.
    pub(crate) fn reserve(&mut self, count: u32) -> RpcResult<Applied> {
        let end = self.next_local + count as u64;
        if end > MAX_LOCAL + 1 {
            return Err(RemoteError::new(ErrorCode::NoSpace, "this shard has used every inode id"));
        }
        let first = InodeId::new(self.shard, self.next_local);
        self.next_local = end;
        Applied::changed(MetaReply::Reserved(first))
    }

    /// Whether `ino` is an id of this shard given out already (to an inode or a reservation).
    pub(crate) fn allocated(&self, ino: InodeId) -> bool {
        ino.shard() == self.shard && ino.local() < self.next_local
    }

    /// Whether `ancestor` is `dir` or one of the directories above it.
    pub(crate) fn is_ancestor(&self, ancestor: InodeId, mut dir: InodeId) -> bool {
        loop {
            if dir == ancestor {
                return true;
            }
            match self.inodes.get(&dir).and_then(Inode::dir) {
                Some(d) if d.parent != dir => dir = d.parent,
                _ => return false,
            }
        }
    }

    // ---- reads ----

    pub fn lookup(&self, h: &RequestHeader, req: &Lookup) -> RpcResult<Found> {
        check_name(&req.name)?;
        let (parent, dir) = self.dir_node(req.parent)?;
        permission::require(h, parent, req.parent, MAY_EXEC)?;
        dir.holds_name(&req.name, self.shard)?;
        let ino = dir.get(&req.name).ok_or_else(|| not_found(&req.name))?;
        match self.target(ino) {
            Ok(n) => Ok(Found::Here(n.attr(ino))),
            Err(e) if e.code == ErrorCode::SpansShards => Ok(Found::Remote(ino)),
            Err(e) => Err(e),
        }
    }

    pub fn getattr(&self, ino: InodeId) -> RpcResult<Attr> {
        Ok(self.node(ino)?.attr(ino))
    }

    pub fn access(&self, h: &RequestHeader, req: &Access) -> RpcResult<()> {
        if req.mask & !7 != 0 {
            return Err(RemoteError::new(ErrorCode::Invalid, format!("access mask {:#o} has unknown bits", req.mask)));
        }
        let node = self.node(req.ino)?;
        permission::require(h, node, req.ino, req.mask)
    }

    pub fn open(&self, h: &RequestHeader, req: &Open) -> RpcResult<Attr> {
        let node = self.node(req.ino)?;
        if req.write && node.is_dir() {
            return Err(RemoteError::new(ErrorCode::IsDir, format!("inode {} is a directory", req.ino)));
        }
        if node.kind().is_special() {
            // The kernel opens FIFOs, sockets and devices itself; only odfs's own clients ask.
            return Err(RemoteError::new(ErrorCode::Invalid, format!("inode {} has no data in odfs", req.ino)));
        }
        let mask = if req.read { MAY_READ } else { 0 } | if req.write { MAY_WRITE } else { 0 };
        permission::require(h, node, req.ino, mask)?;
        if req.write {
            self.refuse_if_sealed([req.ino])?;
        }
        Ok(node.attr(req.ino))
    }

    pub fn readdir(&self, h: &RequestHeader, req: &ReadDir) -> RpcResult<ReadDirReply> {
        let (node, dir) = self.dir_node(req.ino)?;
        permission::require(h, node, req.ino, MAY_READ)?;
        let max = match req.max_entries {
            0 => READDIR_DEFAULT_BATCH,
            n => (n as usize).min(READDIR_MAX_BATCH),
        };
        let mut it = dir.after(req.cookie).peekable();
        let mut entries = Vec::with_capacity(max.min(dir.len()));
        let mut bytes = 0;
        while entries.len() < max && bytes < READDIR_MAX_BYTES {
            let Some((seq, name, ino, kind)) = it.next() else { break };
            // A remote entry's attributes are its shard's: the service adds them.
            let attr = if req.plus { self.inodes.get(&ino).map(|n| n.attr(ino)) } else { None };
            bytes += 32 + name.len() + attr.as_ref().map_or(0, |a| 96 + 5 * layout_len(a));
            entries.push(DirEntry { name: name.to_vec(), ino, kind, cookie: seq, attr });
        }
        Ok(ReadDirReply { entries, eof: it.peek().is_none() })
    }

    pub fn readlink(&self, ino: InodeId) -> RpcResult<Vec<u8>> {
        match &self.node(ino)?.body {
            Body::Symlink(t) => Ok(t.clone()),
            _ => Err(RemoteError::new(ErrorCode::Invalid, format!("inode {ino} is not a symbolic link"))),
        }
    }

    pub fn getxattr(&self, h: &RequestHeader, req: &GetXattr) -> RpcResult<Vec<u8>> {
        check_xattr_name(&req.name)?;
        let node = self.node(req.ino)?;
        permission::require(h, node, req.ino, MAY_READ)?;
        node.xattrs.get(&req.name).cloned().ok_or_else(|| {
            RemoteError::new(ErrorCode::NoData, format!("no extended attribute \"{}\"", show(&req.name)))
        })
    }

    pub fn listxattr(&self, req: &ListXattr) -> RpcResult<Vec<Vec<u8>>> {
        Ok(self.node(req.ino)?.xattrs.keys().cloned().collect())
    }

    pub fn get_dir_layout(&self, ino: InodeId) -> RpcResult<DirLayout> {
        Ok(self.dir_node(ino)?.1.layout.clone())
    }

    // ---- mutations ----

    /// Applies one mutation: all or nothing. `choice` supplies recorded choices at replay;
    /// `choose` picks targets live.
    pub fn apply(
        &mut self,
        h: &RequestHeader,
        now: Timespec,
        op: &MetaOp,
        choice: &mut Choice,
        choose: Chooser,
        held: Held,
    ) -> RpcResult<Applied> {
        self.kept.clear();
        self.touched.clear();
        self.refuse_sealed(op)?;
        let r = self.dispatch(h, now, op, choice, choose, held);
        let changes = self.collect_changes();
        let mut applied = r?;
        applied.kept = std::mem::take(&mut self.kept);
        applied.changes = changes;
        Ok(applied)
    }

    /// The inodes the mutation touched and the names changed in the directories among them.
    fn collect_changes(&mut self) -> Changes {
        let mut inos = std::mem::take(&mut self.touched);
        inos.sort_unstable();
        inos.dedup();
        let mut names = Vec::new();
        for &ino in &inos {
            if let Some(d) = self.inodes.get_mut(&ino).and_then(|n| n.dir_mut().ok()) {
                names.extend(std::mem::take(&mut d.changed).into_iter().map(|n| (ino, n.into_vec())));
            }
        }
        Changes { inos, names }
    }

    /// Records that `ino` changes (node_mut, insert_inode and remove_inode do it; so must code
    /// changing inodes directly).
    pub(crate) fn touch(&mut self, ino: InodeId) {
        self.touched.push(ino);
    }

    /// Adds a new inode (its creator is leased it).
    pub(crate) fn insert_inode(&mut self, ino: InodeId, node: Inode) {
        self.touch(ino);
        self.inodes.insert(ino, node);
    }

    /// Removes an inode (whoever cached it is recalled).
    pub(crate) fn remove_inode(&mut self, ino: InodeId) -> Option<Inode> {
        self.touch(ino);
        self.inodes.remove(&ino)
    }

    fn dispatch(
        &mut self,
        h: &RequestHeader,
        now: Timespec,
        op: &MetaOp,
        choice: &mut Choice,
        choose: Chooser,
        held: Held,
    ) -> RpcResult<Applied> {
        match op {
            MetaOp::Create(r) => self.create(h, now, r, choice, choose),
            MetaOp::Mkdir(r) => self.mkdir(h, now, r, choice),
            MetaOp::Mknod(r) => self.mknod(h, now, r, choice),
            MetaOp::Unlink(r) => self.unlink(h, now, r, held),
            MetaOp::Rmdir(r) => self.rmdir(h, now, r),
            MetaOp::Rename(r) => self.rename(h, now, r, held),
            MetaOp::DropOrphan { ino } => self.drop_orphan(*ino, held),
            MetaOp::Step(s) => self.step(h, now, s, held),
            MetaOp::BeginIntent { id, intent } => self.begin_intent(*id, intent),
            MetaOp::DecideIntent { id } => self.decide_intent(*id),
            MetaOp::EndIntent { id, reply } => self.end_intent(*id, reply),
            MetaOp::Symlink(r) => self.symlink(h, now, r, choice),
            MetaOp::Link(r) => self.link(h, now, r),
            MetaOp::SetAttr(r) => self.setattr(h, now, r),
            MetaOp::SetXattr(r) => self.setxattr(h, now, r),
            MetaOp::RemoveXattr(r) => self.removexattr(h, now, r),
            MetaOp::ExtendSize(r) => self.extend_size(r),
            MetaOp::SetDirLayout(r) => self.set_dir_layout(h, now, r),
            MetaOp::SetFileLayout(r) => self.set_file_layout(h, now, r, choice, choose),
            MetaOp::CreateShadow(r) => self.create_shadow(now, r),
            MetaOp::SyncShadow(r) => self.sync_shadow(r),
            MetaOp::SealShadow(r) => self.seal_shadow(r),
            MetaOp::DropShadow(r) => self.drop_shadow(r),
            MetaOp::SetDirStripes { ino, stripes } => self.set_dir_stripes(now, *ino, stripes),
            MetaOp::SetRootOwner { uid, gid, mode } => self.set_root_owner(now, *uid, *gid, *mode),
            MetaOp::SetSealed(r) => self.set_sealed(h, now, r),
            MetaOp::ReserveInodes { count } => self.reserve(*count),
        }
    }

    // ---- what several operations share ----

    /// Adds the entry `name` → `ino` to `parent` and updates the parent's times and, for a new
    /// subdirectory, its link count.
    pub(crate) fn add_entry(
        &mut self,
        parent: InodeId,
        name: &[u8],
        ino: InodeId,
        kind: FileKind,
        now: Timespec,
    ) -> RpcResult<()> {
        let p = self.node_mut(parent)?;
        p.touch_dir(now);
        if kind == FileKind::Dir {
            p.nlink += 1;
        }
        p.dir_mut()?.insert(name, ino, kind);
        Ok(())
    }

    /// The checks every new entry needs: a valid name, a searchable parent directory without
    /// that name, write permission on it. Returns the parent.
    pub(crate) fn check_new_entry(
        &self,
        h: &RequestHeader,
        parent_ino: InodeId,
        name: &[u8],
    ) -> RpcResult<(&Inode, &Dir)> {
        check_name(name)?;
        let (parent, dir) = self.dir_node(parent_ino)?;
        dir.holds_name(name, self.shard)?;
        dir.accepts_entries()?;
        permission::require(h, parent, parent_ino, MAY_EXEC)?;
        if dir.get(name).is_some() {
            return Err(exists(name));
        }
        permission::require(h, parent, parent_ino, MAY_WRITE | MAY_EXEC)?;
        self.unpinned_name(parent_ino, name)?;
        Ok((parent, dir))
    }

    /// The checks shared by unlink and rmdir (Linux `may_delete`, less the type check): a valid
    /// name that exists in a searchable, writable parent, and the sticky bit. Returns the
    /// victim.
    pub(crate) fn check_delete(
        &self,
        h: &RequestHeader,
        parent_ino: InodeId,
        name: &[u8],
    ) -> RpcResult<(InodeId, &Inode)> {
        check_name(name)?;
        let (parent, dir) = self.dir_node(parent_ino)?;
        permission::require(h, parent, parent_ino, MAY_EXEC)?;
        dir.holds_name(name, self.shard)?;
        let ino = dir.get(name).ok_or_else(|| not_found(name))?;
        let victim = self.target(ino)?;
        permission::require(h, parent, parent_ino, MAY_WRITE | MAY_EXEC)?;
        permission::require_sticky(h, parent, victim, name)?;
        self.unpinned_name(parent_ino, name)?;
        self.unpinned_node(ino)?;
        Ok((ino, victim))
    }

    /// Drops one link of a non-directory; returns its attributes if that was the last and no
    /// client holds it open (it is then gone; its chunks are the caller's to remove). One held
    /// open stays as an orphan.
    pub(crate) fn drop_link(&mut self, ino: InodeId, now: Timespec, held: Held) -> RpcResult<Option<Attr>> {
        let node = self.node_mut(ino)?;
        node.nlink = node.nlink.saturating_sub(1);
        node.ctime = now;
        if node.nlink > 0 {
            return Ok(None);
        }
        if held(ino) {
            self.orphans.insert(ino);
            self.kept.push(ino);
            return Ok(None);
        }
        let attr = node.attr(ino);
        self.remove_inode(ino);
        Ok(Some(attr))
    }

    /// Removes an orphan no client holds open any more; returns its attributes (for its
    /// chunks). Unchanged when it is gone already or has a name again.
    fn drop_orphan(&mut self, ino: InodeId, held: Held) -> RpcResult<Applied> {
        let removable = self.inodes.get(&ino).is_some_and(|n| n.nlink == 0 && !n.is_dir()) && !held(ino);
        if !removable {
            return Applied::unchanged(MetaReply::Orphan(None));
        }
        self.orphans.remove(&ino);
        let attr = self.remove_inode(ino).map(|n| n.attr(ino));
        Applied::changed(MetaReply::Orphan(attr))
    }

    /// `Busy` while an operation spanning shards has prepared this name.
    pub(crate) fn unpinned_name(&self, parent: InodeId, name: &[u8]) -> RpcResult<()> {
        if self.pins.is_empty() || !self.pins.contains_key(&Pin::Name(parent, name.to_vec())) {
            return Ok(());
        }
        Err(RemoteError::new(ErrorCode::Busy, format!("\"{}\" is being renamed or linked; try again", show(name))))
    }

    /// `Busy` while an operation spanning shards has prepared this inode.
    pub(crate) fn unpinned_node(&self, ino: InodeId) -> RpcResult<()> {
        if self.pins.is_empty() || !self.pins.contains_key(&Pin::Node(ino)) {
            return Ok(());
        }
        Err(RemoteError::new(ErrorCode::Busy, format!("inode {ino} is being renamed or linked; try again")))
    }

    /// The parent of a directory held here (its "..").
    pub fn parent_of(&self, ino: InodeId) -> RpcResult<InodeId> {
        Ok(self.dir_node(ino)?.1.parent)
    }

    /// Entries of the part of a directory held here.
    pub fn count_entries(&self, ino: InodeId) -> RpcResult<u64> {
        Ok(self.dir_node(ino)?.1.len() as u64)
    }

    /// What a directory's parts on other shards copy: (attributes, parent, default layout,
    /// entries here).
    pub fn dir_info(&self, ino: InodeId) -> RpcResult<(Attr, InodeId, DirLayout, usize)> {
        let (node, d) = self.dir_node(ino)?;
        Ok((node.attr(ino), d.parent, d.layout.clone(), d.len()))
    }
}

fn layout_len(a: &Attr) -> usize {
    a.layout.as_ref().map_or(0, |l| l.targets.len() + l.pool.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        assert!(check_name(b"a").is_ok());
        assert!(check_name(&[b'x'; 255]).is_ok());
        assert_eq!(check_name(&[b'x'; 256]).unwrap_err().code, ErrorCode::NameTooLong);
        for bad in [&b""[..], b".", b"..", b"a/b", b"a\0b"] {
            assert_eq!(check_name(bad).unwrap_err().code, ErrorCode::Invalid);
        }
    }
}
