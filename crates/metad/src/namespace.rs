//! The namespace: every inode of one shard held in memory, the reads, and the deterministic
//! application of one mutation.
//!
//! [`Namespace::apply`] is the only way the state changes. Each operation checks everything
//! before it changes anything, so a failed request leaves no trace; and given the same state,
//! caller, time and [`Choice`] it produces the same result, which is what lets the write-ahead
//! log replay it. Checks follow Linux's order (search permission on the parent, existence, write
//! permission, sticky bit, type) so callers see the errno Linux would give.
//!
//! Directories keep their entries twice: a hash index by name, and an ordered map by a
//! per-directory insertion sequence number that doubles as the readdir cookie. A listing resumes
//! after its cookie in O(log n), and an entry present for the whole listing is seen exactly once
//! however the directory changes meanwhile.

use crate::permission::{self, MAY_EXEC, MAY_READ, MAY_WRITE, S_ISGID, S_ISUID};
use odfs_proto::error::{ErrorCode, RemoteError, RpcResult};
use odfs_proto::meta::*;
use odfs_proto::{DirLayout, InodeId, Layout, RequestHeader, Timespec, NAME_MAX, XATTR_VALUE_MAX};
use serde::ser::{Error as _, SerializeSeq, SerializeStruct};
use serde::{Deserialize, Serialize, Serializer};
use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::ops::Bound;

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
/// Size reported for directories (as ext4 reports a small directory).
const DIR_SIZE: u64 = 4096;
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
}

/// The successful reply of a [`MetaOp`]. Stored in snapshots: add variants at the end only.
///
/// `Create` → `Create`; `Unlink` → `Unlink`; `Rename` → `Rename`; `Mkdir`, `Symlink`, `Link`,
/// `SetAttr`, `ExtendSize`, `SetRootOwner` → `Attr`; the rest → `Unit`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MetaReply {
    Attr(Attr),
    Create(CreateReply),
    Unlink(UnlinkReply),
    Rename(RenameReply),
    Unit,
}

fn wrong_reply(want: &str, got: &MetaReply) -> RemoteError {
    RemoteError::new(ErrorCode::Internal, format!("expected a {want} reply, got {got:?}"))
}

impl MetaReply {
    /// The `Attr` of an `Attr` reply.
    pub fn into_attr(self) -> RpcResult<Attr> {
        match self {
            MetaReply::Attr(a) => Ok(a),
            other => Err(wrong_reply("Attr", &other)),
        }
    }
    /// The `CreateReply` of a `Create` reply.
    pub fn into_create(self) -> RpcResult<CreateReply> {
        match self {
            MetaReply::Create(r) => Ok(r),
            other => Err(wrong_reply("Create", &other)),
        }
    }
    /// The `UnlinkReply` of an `Unlink` reply.
    pub fn into_unlink(self) -> RpcResult<UnlinkReply> {
        match self {
            MetaReply::Unlink(r) => Ok(r),
            other => Err(wrong_reply("Unlink", &other)),
        }
    }
    /// The `RenameReply` of a `Rename` reply.
    pub fn into_rename(self) -> RpcResult<RenameReply> {
        match self {
            MetaReply::Rename(r) => Ok(r),
            other => Err(wrong_reply("Rename", &other)),
        }
    }
    /// `()` for a `Unit` reply.
    pub fn into_unit(self) -> RpcResult<()> {
        match self {
            MetaReply::Unit => Ok(()),
            other => Err(wrong_reply("Unit", &other)),
        }
    }
}

/// The non-deterministic choices of a mutation. Live, both are `None` and the namespace decides
/// (next inode id, layout from the chooser); at replay they come from the log record.
#[derive(Debug, Default, Serialize, Deserialize)]
pub(crate) struct Choice {
    pub ino: Option<InodeId>,
    pub layout: Option<Layout>,
}

/// Picks the targets of a new file from a directory layout.
pub(crate) type Chooser<'a> = &'a mut dyn FnMut(&DirLayout) -> RpcResult<Layout>;

/// The outcome of a successful `apply`.
pub(crate) struct Applied {
    pub reply: MetaReply,
    /// False when nothing changed (an existing file opened by `Create`, a rename onto the same
    /// inode): such outcomes need no log record.
    pub changed: bool,
}

impl Applied {
    fn changed(reply: MetaReply) -> RpcResult<Applied> {
        Ok(Applied { reply, changed: true })
    }
    fn unchanged(reply: MetaReply) -> RpcResult<Applied> {
        Ok(Applied { reply, changed: false })
    }
}

/// Hasher for inode ids: one multiply (as rustc's FxHash). Ids are not attacker-chosen.
#[derive(Default)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(b as u64);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

type InodeMap = HashMap<InodeId, Inode, BuildHasherDefault<IdHasher>>;

/// One inode. `mode` holds the permission bits only; the kind is the body's.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Inode {
    pub mode: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    /// File size; symlink target length; unused for directories.
    pub size: u64,
    pub atime: Timespec,
    pub mtime: Timespec,
    pub ctime: Timespec,
    pub xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
    pub body: Body,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) enum Body {
    File(Layout),
    Dir(Box<Dir>),
    Symlink(Vec<u8>),
}

impl Inode {
    fn new(mode: u32, uid: u32, gid: u32, now: Timespec, body: Body) -> Inode {
        Inode { mode, nlink: 1, uid, gid, size: 0, atime: now, mtime: now, ctime: now, xattrs: BTreeMap::new(), body }
    }

    pub fn kind(&self) -> FileKind {
        match self.body {
            Body::File(_) => FileKind::File,
            Body::Dir(_) => FileKind::Dir,
            Body::Symlink(_) => FileKind::Symlink,
        }
    }

    pub fn is_dir(&self) -> bool {
        matches!(self.body, Body::Dir(_))
    }

    fn dir(&self) -> Option<&Dir> {
        match &self.body {
            Body::Dir(d) => Some(d),
            _ => None,
        }
    }

    fn dir_mut(&mut self) -> RpcResult<&mut Dir> {
        match &mut self.body {
            Body::Dir(d) => Ok(d),
            _ => Err(internal("a parent inode is not a directory")),
        }
    }

    /// The wire attributes of this inode.
    pub fn attr(&self, ino: InodeId) -> Attr {
        let (size, layout, dir_stripes) = match &self.body {
            Body::File(l) => (self.size, Some(l.clone()), Vec::new()),
            Body::Dir(d) => (DIR_SIZE, None, d.stripes.clone()),
            Body::Symlink(_) => (self.size, None, Vec::new()),
        };
        Attr {
            ino,
            kind: self.kind(),
            mode: self.mode,
            nlink: self.nlink,
            uid: self.uid,
            gid: self.gid,
            size,
            atime: self.atime,
            mtime: self.mtime,
            ctime: self.ctime,
            layout,
            dir_stripes,
        }
    }

    /// A directory's entries changed.
    fn touch_dir(&mut self, now: Timespec) {
        self.mtime = now;
        self.ctime = now;
    }
}

/// The entries of a directory.
#[derive(Debug, Clone, Deserialize)]
#[serde(from = "DirImage")]
pub(crate) struct Dir {
    /// The directory holding this one (the root holds itself): its "..".
    pub parent: InodeId,
    /// Default layout of new children.
    pub layout: DirLayout,
    next_seq: u64,
    /// name → (sequence number, inode).
    names: HashMap<Box<[u8]>, (u64, InodeId)>,
    /// sequence number → name, in insertion order: the readdir order and cookies.
    order: BTreeMap<u64, Box<[u8]>>,
    /// Shards holding the entries of a striped directory (see `entry_shard`); empty otherwise.
    pub stripes: Vec<u16>,
    /// A part of a striped directory being removed: it refuses new entries.
    pub sealed: bool,
}

impl Dir {
    fn new(parent: InodeId, layout: DirLayout) -> Dir {
        Dir {
            parent,
            layout,
            next_seq: 1,
            names: HashMap::new(),
            order: BTreeMap::new(),
            stripes: Vec::new(),
            sealed: false,
        }
    }

    /// Refuses a name that a striped directory keeps on another shard.
    fn holds_name(&self, name: &[u8], shard: u16) -> RpcResult<()> {
        match entry_shard(&self.stripes, name) {
            Some(s) if s != shard => Err(RemoteError::new(
                ErrorCode::WrongShard,
                format!("\"{}\" belongs to metadata shard {s}", show(name)),
            )),
            _ => Ok(()),
        }
    }

    /// Refuses new entries in a part being removed.
    fn accepts_entries(&self) -> RpcResult<()> {
        if self.sealed {
            return Err(RemoteError::new(ErrorCode::NotFound, "the directory is being removed"));
        }
        Ok(())
    }

    fn get(&self, name: &[u8]) -> Option<InodeId> {
        self.names.get(name).map(|&(_, ino)| ino)
    }

    fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    pub fn len(&self) -> usize {
        self.names.len()
    }

    /// Adds a new name with the next sequence number.
    fn insert(&mut self, name: &[u8], ino: InodeId) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.names.insert(name.into(), (seq, ino));
        self.order.insert(seq, name.into());
    }

    /// Points an existing name at another inode, keeping its place in the listing order (a
    /// name present throughout a listing is returned exactly once).
    fn repoint(&mut self, name: &[u8], ino: InodeId) -> RpcResult<()> {
        match self.names.get_mut(name) {
            Some(e) => {
                e.1 = ino;
                Ok(())
            }
            None => Err(internal("a renamed entry vanished")),
        }
    }

    fn remove(&mut self, name: &[u8]) -> RpcResult<InodeId> {
        let (seq, ino) = self.names.remove(name).ok_or_else(|| internal("a removed entry vanished"))?;
        self.order.remove(&seq);
        Ok(ino)
    }
}

/// How a directory is stored in a snapshot: the ordered entries only; the name index is
/// rebuilt at load.
#[derive(Deserialize)]
struct DirImage {
    parent: InodeId,
    layout: DirLayout,
    next_seq: u64,
    entries: Vec<(u64, Vec<u8>, InodeId)>,
    stripes: Vec<u16>,
    sealed: bool,
}

impl From<DirImage> for Dir {
    fn from(img: DirImage) -> Dir {
        let mut names = HashMap::with_capacity(img.entries.len());
        let mut order = BTreeMap::new();
        for (seq, name, ino) in img.entries {
            let name: Box<[u8]> = name.into_boxed_slice();
            names.insert(name.clone(), (seq, ino));
            order.insert(seq, name);
        }
        Dir {
            parent: img.parent,
            layout: img.layout,
            next_seq: img.next_seq,
            names,
            order,
            stripes: img.stripes,
            sealed: img.sealed,
        }
    }
}

impl Serialize for Dir {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        struct Entries<'a>(&'a Dir);
        impl Serialize for Entries<'_> {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                let mut seq = s.serialize_seq(Some(self.0.order.len()))?;
                for (n, name) in &self.0.order {
                    let ino = self.0.get(name).ok_or_else(|| S::Error::custom("directory index out of step"))?;
                    seq.serialize_element(&(n, &**name, ino))?;
                }
                seq.end()
            }
        }
        // Field order must match `DirImage`: the encoding is positional.
        let mut st = s.serialize_struct("Dir", 6)?;
        st.serialize_field("parent", &self.parent)?;
        st.serialize_field("layout", &self.layout)?;
        st.serialize_field("next_seq", &self.next_seq)?;
        st.serialize_field("entries", &Entries(self))?;
        st.serialize_field("stripes", &self.stripes)?;
        st.serialize_field("sealed", &self.sealed)?;
        st.end()
    }
}

fn internal(msg: &str) -> RemoteError {
    RemoteError::new(ErrorCode::Internal, msg)
}

fn show(name: &[u8]) -> String {
    String::from_utf8_lossy(name).into_owned()
}

fn not_found(name: &[u8]) -> RemoteError {
    RemoteError::new(ErrorCode::NotFound, format!("\"{}\" does not exist", show(name)))
}

fn exists(name: &[u8]) -> RemoteError {
    RemoteError::new(ErrorCode::Exists, format!("\"{}\" already exists", show(name)))
}

/// Checks one directory entry name: not empty, not "." or "..", no '/' or NUL, at most
/// `NAME_MAX` bytes.
pub fn check_name(name: &[u8]) -> RpcResult<()> {
    if name.is_empty() {
        return Err(RemoteError::new(ErrorCode::Invalid, "name is empty"));
    }
    if name.len() > NAME_MAX {
        return Err(RemoteError::new(
            ErrorCode::NameTooLong,
            format!("name is {} bytes; the limit is {NAME_MAX}", name.len()),
        ));
    }
    if name == b"." || name == b".." {
        return Err(RemoteError::new(ErrorCode::Invalid, format!("name \"{}\" is reserved", show(name))));
    }
    if name.contains(&b'/') {
        return Err(RemoteError::new(ErrorCode::Invalid, format!("name \"{}\" contains '/'", show(name))));
    }
    if name.contains(&0) {
        return Err(RemoteError::new(ErrorCode::Invalid, "name contains a NUL byte"));
    }
    Ok(())
}

/// Extended attribute names: not empty, at most `NAME_MAX` bytes (Linux answers `ERANGE`).
fn check_xattr_name(name: &[u8]) -> RpcResult<()> {
    if name.is_empty() || name.len() > NAME_MAX {
        return Err(RemoteError::new(
            ErrorCode::Range,
            format!("extended attribute name is {} bytes; it must be 1 to {NAME_MAX}", name.len()),
        ));
    }
    Ok(())
}

/// Group and mode of a new inode in `parent`: a set-group-id directory passes on its group,
/// and to subdirectories its set-group-id bit. A new file keeps set-group-id only if its
/// creator belongs to the inherited group (Linux `mode_strip_sgid`).
fn new_owner(h: &RequestHeader, parent: &Inode, mode: u32, is_dir: bool) -> (u32, u32) {
    if parent.mode & S_ISGID == 0 {
        return (h.gid, mode);
    }
    let gid = parent.gid;
    let mode = if is_dir {
        mode | S_ISGID
    } else if mode & (S_ISGID | 0o010) == (S_ISGID | 0o010) && !h.is_root() && !h.in_group(gid) {
        mode & !S_ISGID
    } else {
        mode
    };
    (gid, mode)
}

/// Every inode of one shard.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Namespace {
    shard: u16,
    /// Local part of the next inode id to hand out.
    next_local: u64,
    inodes: InodeMap,
    /// Inodes held here for other shards (parts of their striped directories), counted apart
    /// so that statfs need not scan every inode. Not in snapshots: [`Namespace::recount`].
    #[serde(skip)]
    foreign: u64,
}

impl Namespace {
    pub fn new(shard: u16) -> Namespace {
        Namespace {
            shard,
            // Local id 1 of shard 0 is the root.
            next_local: 2,
            inodes: InodeMap::default(),
            foreign: 0,
        }
    }

    /// Counts the other shards' inodes again (after loading a snapshot).
    pub fn recount(&mut self) {
        self.foreign = self.inodes.keys().filter(|i| i.shard() != self.shard).count() as u64;
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

    fn node(&self, ino: InodeId) -> RpcResult<&Inode> {
        self.inodes
            .get(&ino)
            .ok_or_else(|| RemoteError::new(ErrorCode::NotFound, format!("inode {ino} does not exist")))
    }

    fn node_mut(&mut self, ino: InodeId) -> RpcResult<&mut Inode> {
        self.inodes
            .get_mut(&ino)
            .ok_or_else(|| RemoteError::new(ErrorCode::NotFound, format!("inode {ino} does not exist")))
    }

    /// A directory inode and its entries: `NotFound` or `NotDir` otherwise.
    fn dir_node(&self, ino: InodeId) -> RpcResult<(&Inode, &Dir)> {
        let node = self.node(ino)?;
        match node.dir() {
            Some(d) => Ok((node, d)),
            None => Err(RemoteError::new(ErrorCode::NotDir, format!("inode {ino} is not a directory"))),
        }
    }

    /// The next inode id, or the one recorded in the log.
    fn alloc(&mut self, recorded: Option<InodeId>) -> RpcResult<InodeId> {
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

    /// Whether `ancestor` is `dir` or one of the directories above it.
    fn is_ancestor(&self, ancestor: InodeId, mut dir: InodeId) -> bool {
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

    pub fn lookup(&self, h: &RequestHeader, req: &Lookup) -> RpcResult<Attr> {
        check_name(&req.name)?;
        let (parent, dir) = self.dir_node(req.parent)?;
        permission::require(h, parent, req.parent, MAY_EXEC)?;
        dir.holds_name(&req.name, self.shard)?;
        let ino = dir.get(&req.name).ok_or_else(|| not_found(&req.name))?;
        Ok(self.node(ino)?.attr(ino))
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
        let mask = if req.read { MAY_READ } else { 0 } | if req.write { MAY_WRITE } else { 0 };
        permission::require(h, node, req.ino, mask)?;
        Ok(node.attr(req.ino))
    }

    pub fn readdir(&self, h: &RequestHeader, req: &ReadDir) -> RpcResult<ReadDirReply> {
        let (node, dir) = self.dir_node(req.ino)?;
        permission::require(h, node, req.ino, MAY_READ)?;
        let max = match req.max_entries {
            0 => READDIR_DEFAULT_BATCH,
            n => (n as usize).min(READDIR_MAX_BATCH),
        };
        let mut it = dir.order.range((Bound::Excluded(req.cookie), Bound::Unbounded)).peekable();
        let mut entries = Vec::with_capacity(max.min(dir.len()));
        let mut bytes = 0;
        while entries.len() < max && bytes < READDIR_MAX_BYTES {
            let Some((&seq, name)) = it.next() else { break };
            let ino = dir.get(name).ok_or_else(|| internal("directory index out of step"))?;
            let child = self.node(ino)?;
            let attr = req.plus.then(|| child.attr(ino));
            bytes += 32 + name.len() + attr.as_ref().map_or(0, |a| 96 + 5 * layout_len(a));
            entries.push(DirEntry { name: name.to_vec(), ino, kind: child.kind(), cookie: seq, attr });
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
    ) -> RpcResult<Applied> {
        match op {
            MetaOp::Create(r) => self.create(h, now, r, choice, choose),
            MetaOp::Mkdir(r) => self.mkdir(h, now, r, choice),
            MetaOp::Unlink(r) => self.unlink(h, now, r),
            MetaOp::Rmdir(r) => self.rmdir(h, now, r),
            MetaOp::Rename(r) => self.rename(h, now, r),
            MetaOp::Symlink(r) => self.symlink(h, now, r, choice),
            MetaOp::Link(r) => self.link(h, now, r),
            MetaOp::SetAttr(r) => self.setattr(h, now, r),
            MetaOp::SetXattr(r) => self.setxattr(h, now, r),
            MetaOp::RemoveXattr(r) => self.removexattr(h, now, r),
            MetaOp::ExtendSize(r) => self.extend_size(r),
            MetaOp::SetDirLayout(r) => self.set_dir_layout(h, now, r),
            MetaOp::SetFileLayout(r) => self.set_file_layout(h, now, r, choice, choose),
            MetaOp::CreateShadow(r) => self.create_shadow(now, r),
            MetaOp::SyncShadow(r) => {
                let node = self.shadow_mut(r.ino)?;
                (node.mode, node.uid, node.gid) = (r.mode, r.uid, r.gid);
                node.dir_mut()?.layout = r.layout.clone();
                Applied::changed(MetaReply::Unit)
            }
            MetaOp::SealShadow(r) => {
                let d = self.shadow_mut(r.ino)?.dir_mut()?;
                if r.seal && !d.is_empty() {
                    return Err(RemoteError::new(ErrorCode::NotEmpty, "the directory is not empty"));
                }
                d.sealed = r.seal;
                Applied::changed(MetaReply::Unit)
            }
            MetaOp::DropShadow(r) => {
                if !self.inodes.contains_key(&r.ino) {
                    return Applied::unchanged(MetaReply::Unit);
                }
                if !self.shadow_mut(r.ino)?.dir_mut()?.is_empty() {
                    return Err(RemoteError::new(ErrorCode::NotEmpty, "the directory part is not empty"));
                }
                self.inodes.remove(&r.ino);
                self.foreign -= 1;
                Applied::changed(MetaReply::Unit)
            }
            MetaOp::SetDirStripes { ino, stripes } => {
                if ino.shard() != self.shard {
                    return Err(internal("a directory is striped by its own shard"));
                }
                let node = self.node_mut(*ino)?;
                let d = node.dir_mut().map_err(|_| RemoteError::new(ErrorCode::NotDir, "not a directory"))?;
                if !d.is_empty() {
                    return Err(RemoteError::new(
                        ErrorCode::NotEmpty,
                        "only an empty directory can be striped over metadata shards",
                    ));
                }
                d.stripes = stripes.clone();
                node.ctime = now;
                Applied::changed(MetaReply::Attr(node.attr(*ino)))
            }
            MetaOp::SetRootOwner { uid, gid, mode } => {
                let root = self.node_mut(InodeId::ROOT)?;
                root.uid = *uid;
                root.gid = *gid;
                root.mode = mode & 0o7777;
                root.ctime = now;
                Applied::changed(MetaReply::Attr(root.attr(InodeId::ROOT)))
            }
        }
    }

    /// Adds the entry `name` → `ino` to `parent` and updates the parent's times and, for a new
    /// subdirectory, its link count.
    fn add_entry(&mut self, parent: InodeId, name: &[u8], ino: InodeId, now: Timespec, subdir: bool) -> RpcResult<()> {
        let p = self.node_mut(parent)?;
        p.touch_dir(now);
        if subdir {
            p.nlink += 1;
        }
        p.dir_mut()?.insert(name, ino);
        Ok(())
    }

    fn create(
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
            let node = self.node(ino)?;
            return match node.body {
                Body::File(_) => {
                    permission::require(h, node, ino, MAY_WRITE)?;
                    Applied::unchanged(MetaReply::Create(CreateReply { attr: node.attr(ino), created: false }))
                }
                Body::Dir(_) => {
                    Err(RemoteError::new(ErrorCode::IsDir, format!("\"{}\" is a directory", show(&req.name))))
                }
                Body::Symlink(_) => {
                    Err(RemoteError::new(ErrorCode::Exists, format!("\"{}\" is a symbolic link", show(&req.name))))
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
                    choose(dl)?
                }
                None => choose(&dir.layout)?,
            },
        };
        let ino = self.alloc(choice.ino)?;
        let node = Inode::new(mode, h.uid, gid, now, Body::File(layout));
        let attr = node.attr(ino);
        self.inodes.insert(ino, node);
        self.add_entry(req.parent, &req.name, ino, now, false)?;
        Applied::changed(MetaReply::Create(CreateReply { attr, created: true }))
    }

    /// The checks every new entry needs: a valid name, a searchable parent directory without
    /// that name, write permission on it. Returns the parent.
    fn check_new_entry(&self, h: &RequestHeader, parent_ino: InodeId, name: &[u8]) -> RpcResult<(&Inode, &Dir)> {
        check_name(name)?;
        let (parent, dir) = self.dir_node(parent_ino)?;
        dir.holds_name(name, self.shard)?;
        dir.accepts_entries()?;
        permission::require(h, parent, parent_ino, MAY_EXEC)?;
        if dir.get(name).is_some() {
            return Err(exists(name));
        }
        permission::require(h, parent, parent_ino, MAY_WRITE | MAY_EXEC)?;
        Ok((parent, dir))
    }

    fn mkdir(&mut self, h: &RequestHeader, now: Timespec, req: &Mkdir, choice: &mut Choice) -> RpcResult<Applied> {
        let (parent, dir) = self.check_new_entry(h, req.parent, &req.name)?;
        if parent.nlink >= MAX_LINKS {
            return Err(RemoteError::new(
                ErrorCode::TooManyLinks,
                format!("inode {} has {MAX_LINKS} subdirectories", req.parent),
            ));
        }
        // mkdir ignores set-user-id and set-group-id in the mode (Linux).
        let (gid, mode) = new_owner(h, parent, req.mode & 0o1777, true);
        let layout = dir.layout.clone();
        let ino = self.alloc(choice.ino)?;
        let mut node = Inode::new(mode, h.uid, gid, now, Body::Dir(Box::new(Dir::new(req.parent, layout))));
        node.nlink = 2;
        let attr = node.attr(ino);
        self.inodes.insert(ino, node);
        self.add_entry(req.parent, &req.name, ino, now, true)?;
        Applied::changed(MetaReply::Attr(attr))
    }

    fn symlink(&mut self, h: &RequestHeader, now: Timespec, req: &Symlink, choice: &mut Choice) -> RpcResult<Applied> {
        if req.target.is_empty() {
            return Err(RemoteError::new(ErrorCode::NotFound, "symbolic link target is empty"));
        }
        if req.target.len() > SYMLINK_MAX {
            return Err(RemoteError::new(
                ErrorCode::NameTooLong,
                format!("symbolic link target is {} bytes; the limit is {SYMLINK_MAX}", req.target.len()),
            ));
        }
        if req.target.contains(&0) {
            return Err(RemoteError::new(ErrorCode::Invalid, "symbolic link target contains a NUL byte"));
        }
        let (parent, _) = self.check_new_entry(h, req.parent, &req.name)?;
        let (gid, _) = new_owner(h, parent, 0o777, false);
        let ino = self.alloc(choice.ino)?;
        let mut node = Inode::new(0o777, h.uid, gid, now, Body::Symlink(req.target.clone()));
        node.size = req.target.len() as u64;
        let attr = node.attr(ino);
        self.inodes.insert(ino, node);
        self.add_entry(req.parent, &req.name, ino, now, false)?;
        Applied::changed(MetaReply::Attr(attr))
    }

    fn link(&mut self, h: &RequestHeader, now: Timespec, req: &Link) -> RpcResult<Applied> {
        check_name(&req.new_name)?;
        let src = self.node(req.ino)?;
        self.check_new_entry(h, req.new_parent, &req.new_name)?;
        if src.is_dir() {
            return Err(RemoteError::new(ErrorCode::Perm, "hard links to directories are not allowed"));
        }
        if src.nlink >= MAX_LINKS {
            return Err(RemoteError::new(ErrorCode::TooManyLinks, format!("inode {} has {MAX_LINKS} links", req.ino)));
        }
        self.add_entry(req.new_parent, &req.new_name, req.ino, now, false)?;
        let node = self.node_mut(req.ino)?;
        node.nlink += 1;
        node.ctime = now;
        Applied::changed(MetaReply::Attr(node.attr(req.ino)))
    }

    /// The checks shared by unlink and rmdir (Linux `may_delete`, less the type check): a valid
    /// name that exists in a searchable, writable parent, and the sticky bit. Returns the
    /// victim.
    fn check_delete(&self, h: &RequestHeader, parent_ino: InodeId, name: &[u8]) -> RpcResult<(InodeId, &Inode)> {
        check_name(name)?;
        let (parent, dir) = self.dir_node(parent_ino)?;
        permission::require(h, parent, parent_ino, MAY_EXEC)?;
        dir.holds_name(name, self.shard)?;
        let ino = dir.get(name).ok_or_else(|| not_found(name))?;
        let victim = self.node(ino)?;
        permission::require(h, parent, parent_ino, MAY_WRITE | MAY_EXEC)?;
        permission::require_sticky(h, parent, victim, name)?;
        Ok((ino, victim))
    }

    /// Drops one link of a non-directory; returns its attributes if that was the last.
    fn drop_link(&mut self, ino: InodeId, now: Timespec) -> RpcResult<Option<Attr>> {
        let node = self.node_mut(ino)?;
        node.nlink = node.nlink.saturating_sub(1);
        node.ctime = now;
        if node.nlink > 0 {
            return Ok(None);
        }
        let attr = node.attr(ino);
        self.inodes.remove(&ino);
        Ok(Some(attr))
    }

    fn unlink(&mut self, h: &RequestHeader, now: Timespec, req: &Unlink) -> RpcResult<Applied> {
        let (ino, victim) = self.check_delete(h, req.parent, &req.name)?;
        if victim.is_dir() {
            return Err(RemoteError::new(ErrorCode::IsDir, format!("\"{}\" is a directory", show(&req.name))));
        }
        let p = self.node_mut(req.parent)?;
        p.touch_dir(now);
        p.dir_mut()?.remove(&req.name)?;
        let removed = self.drop_link(ino, now)?;
        Applied::changed(MetaReply::Unlink(UnlinkReply { removed }))
    }

    fn rmdir(&mut self, h: &RequestHeader, now: Timespec, req: &Rmdir) -> RpcResult<Applied> {
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
        self.inodes.remove(&ino);
        Applied::changed(MetaReply::Unit)
    }

    fn rename(&mut self, h: &RequestHeader, now: Timespec, req: &Rename) -> RpcResult<Applied> {
        let flags = req.flags;
        if flags & !(RENAME_NOREPLACE | RENAME_EXCHANGE) != 0 || flags == RENAME_NOREPLACE | RENAME_EXCHANGE {
            return Err(RemoteError::new(ErrorCode::Invalid, format!("rename flags {flags:#x} are invalid")));
        }
        let exchange = flags & RENAME_EXCHANGE != 0;
        check_name(&req.name)?;
        check_name(&req.new_name)?;
        let (old_parent, old_dir) = self.dir_node(req.parent)?;
        permission::require(h, old_parent, req.parent, MAY_EXEC)?;
        old_dir.holds_name(&req.name, self.shard)?;
        let (new_parent, new_dir) = self.dir_node(req.new_parent)?;
        permission::require(h, new_parent, req.new_parent, MAY_EXEC)?;
        new_dir.holds_name(&req.new_name, self.shard)?;
        new_dir.accepts_entries()?;
        let src_ino = old_dir.get(&req.name).ok_or_else(|| not_found(&req.name))?;
        let dst_ino = new_dir.get(&req.new_name);
        if flags & RENAME_NOREPLACE != 0 && dst_ino.is_some() {
            return Err(exists(&req.new_name));
        }
        if exchange && dst_ino.is_none() {
            return Err(not_found(&req.new_name));
        }
        let src = self.node(src_ino)?;
        let dst = match dst_ino {
            Some(i) => Some(self.node(i)?),
            None => None,
        };
        let src_is_dir = src.is_dir();
        let dst_is_dir = dst.is_some_and(Inode::is_dir);
        if src_is_dir && self.is_ancestor(src_ino, req.new_parent) {
            return Err(RemoteError::new(ErrorCode::Invalid, "cannot move a directory into itself"));
        }
        if let Some(d) = dst_ino.filter(|_| dst_is_dir) {
            if self.is_ancestor(d, req.parent) {
                let code = if exchange { ErrorCode::Invalid } else { ErrorCode::NotEmpty };
                return Err(RemoteError::new(code, "the destination is an ancestor of the source"));
            }
        }
        if dst_ino == Some(src_ino) {
            // Two names of one inode: POSIX says do nothing.
            return Applied::unchanged(MetaReply::Rename(RenameReply { removed: None }));
        }
        permission::require(h, old_parent, req.parent, MAY_WRITE | MAY_EXEC)?;
        permission::require_sticky(h, old_parent, src, &req.name)?;
        permission::require(h, new_parent, req.new_parent, MAY_WRITE | MAY_EXEC)?;
        if let Some(d) = dst {
            permission::require_sticky(h, new_parent, d, &req.new_name)?;
            if !exchange && src_is_dir && !dst_is_dir {
                return Err(RemoteError::new(
                    ErrorCode::NotDir,
                    format!("\"{}\" is not a directory", show(&req.new_name)),
                ));
            }
            if !exchange && !src_is_dir && dst_is_dir {
                return Err(RemoteError::new(ErrorCode::IsDir, format!("\"{}\" is a directory", show(&req.new_name))));
            }
        }
        let moves = req.parent != req.new_parent;
        if moves {
            // A directory changing parent has its ".." rewritten (Linux asks for write on it).
            if src_is_dir {
                permission::require(h, src, src_ino, MAY_WRITE)?;
            }
            if let (true, Some(d), Some(di)) = (exchange && dst_is_dir, dst, dst_ino) {
                permission::require(h, d, di, MAY_WRITE)?;
            }
            if src_is_dir && !dst_is_dir && new_parent.nlink >= MAX_LINKS
                || exchange && dst_is_dir && !src_is_dir && old_parent.nlink >= MAX_LINKS
            {
                return Err(RemoteError::new(
                    ErrorCode::TooManyLinks,
                    format!("the destination has {MAX_LINKS} subdirectories"),
                ));
            }
        }
        if !exchange {
            if let Some(d) = dst.and_then(Inode::dir).filter(|d| !d.is_empty()) {
                return Err(RemoteError::new(
                    ErrorCode::NotEmpty,
                    format!("directory \"{}\" has {} entries", show(&req.new_name), d.len()),
                ));
            }
        }

        // Every check passed: change the state.
        let mut removed = None;
        if exchange {
            let dst_ino = dst_ino.ok_or_else(|| internal("exchange without a destination"))?;
            self.node_mut(req.parent)?.dir_mut()?.repoint(&req.name, dst_ino)?;
            self.node_mut(req.new_parent)?.dir_mut()?.repoint(&req.new_name, src_ino)?;
            if moves {
                if src_is_dir {
                    self.node_mut(src_ino)?.dir_mut()?.parent = req.new_parent;
                    self.node_mut(req.parent)?.nlink -= 1;
                    self.node_mut(req.new_parent)?.nlink += 1;
                }
                if dst_is_dir {
                    self.node_mut(dst_ino)?.dir_mut()?.parent = req.parent;
                    self.node_mut(req.new_parent)?.nlink -= 1;
                    self.node_mut(req.parent)?.nlink += 1;
                }
            }
            self.node_mut(dst_ino)?.ctime = now;
        } else {
            self.node_mut(req.parent)?.dir_mut()?.remove(&req.name)?;
            match dst_ino {
                Some(d) => {
                    self.node_mut(req.new_parent)?.dir_mut()?.repoint(&req.new_name, src_ino)?;
                    if dst_is_dir {
                        self.inodes.remove(&d);
                        self.node_mut(req.new_parent)?.nlink -= 1;
                    } else {
                        removed = self.drop_link(d, now)?;
                    }
                }
                None => self.node_mut(req.new_parent)?.dir_mut()?.insert(&req.new_name, src_ino),
            }
            if src_is_dir {
                self.node_mut(src_ino)?.dir_mut()?.parent = req.new_parent;
                if moves {
                    self.node_mut(req.parent)?.nlink -= 1;
                    self.node_mut(req.new_parent)?.nlink += 1;
                }
            }
        }
        self.node_mut(src_ino)?.ctime = now;
        self.node_mut(req.parent)?.touch_dir(now);
        self.node_mut(req.new_parent)?.touch_dir(now);
        Applied::changed(MetaReply::Rename(RenameReply { removed }))
    }

    fn setattr(&mut self, h: &RequestHeader, now: Timespec, req: &SetAttr) -> RpcResult<Applied> {
        let node = self.node(req.ino)?;
        if req.mode.is_none()
            && req.uid.is_none()
            && req.gid.is_none()
            && req.size.is_none()
            && req.atime.is_none()
            && req.mtime.is_none()
        {
            return Applied::unchanged(MetaReply::Attr(node.attr(req.ino)));
        }
        if req.size.is_some() {
            match node.body {
                Body::File(_) => permission::require(h, node, req.ino, MAY_WRITE)?,
                Body::Dir(_) => {
                    return Err(RemoteError::new(ErrorCode::IsDir, format!("inode {} is a directory", req.ino)))
                }
                Body::Symlink(_) => {
                    return Err(RemoteError::new(ErrorCode::Invalid, format!("inode {} is a symbolic link", req.ino)))
                }
            }
        }
        let owner = permission::is_owner(h, node);
        if let Some(uid) = req.uid {
            // Only root gives a file away; the owner may "change" it to itself.
            if !(h.is_root() || (h.uid == node.uid && uid == node.uid)) {
                return Err(RemoteError::new(ErrorCode::Perm, "only root may change the owner"));
            }
        }
        if let Some(gid) = req.gid {
            if !(h.is_root() || (h.uid == node.uid && (gid == node.gid || h.in_group(gid)))) {
                return Err(RemoteError::new(
                    ErrorCode::Perm,
                    format!("only root, or the owner in group {gid}, may set group {gid}"),
                ));
            }
        }
        if req.mode.is_some() && !owner {
            return Err(RemoteError::new(ErrorCode::Perm, "only the owner or root may change the mode"));
        }
        let explicit = matches!(req.atime, Some(SetTime::At(_))) || matches!(req.mtime, Some(SetTime::At(_)));
        if explicit && !owner {
            return Err(RemoteError::new(ErrorCode::Perm, "only the owner or root may set explicit times"));
        }
        if !explicit
            && (req.atime.is_some() || req.mtime.is_some())
            && !owner
            && !permission::permits(h, node, MAY_WRITE)
        {
            return Err(RemoteError::new(
                ErrorCode::Access,
                "setting the times to now needs ownership or write permission",
            ));
        }

        let node = self.node_mut(req.ino)?;
        let regular = matches!(node.body, Body::File(_));
        if let Some(uid) = req.uid {
            node.uid = uid;
        }
        if let Some(gid) = req.gid {
            node.gid = gid;
        }
        if let Some(mode) = req.mode {
            let mut mode = mode & 0o7777;
            // Keeping set-group-id needs membership of the (new) group (Linux setattr_prepare).
            if !h.is_root() && !h.in_group(node.gid) {
                mode &= !S_ISGID;
            }
            node.mode = mode;
        } else if regular && (req.uid.is_some() || req.gid.is_some()) {
            // chown of a regular file drops set-user-id, and set-group-id when group-executable
            // (Linux, for every caller since 2.2.13).
            node.mode &= !S_ISUID;
            if node.mode & 0o010 != 0 {
                node.mode &= !S_ISGID;
            }
        }
        if let Some(size) = req.size {
            node.size = size;
            node.mtime = now;
        }
        let at = |t: SetTime| match t {
            SetTime::Now => now,
            SetTime::At(t) => t,
        };
        if let Some(t) = req.atime {
            node.atime = at(t);
        }
        if let Some(t) = req.mtime {
            node.mtime = at(t);
        }
        node.ctime = now;
        Applied::changed(MetaReply::Attr(node.attr(req.ino)))
    }

    fn setxattr(&mut self, h: &RequestHeader, now: Timespec, req: &SetXattr) -> RpcResult<Applied> {
        if req.flags & !(XATTR_CREATE | XATTR_REPLACE) != 0 {
            return Err(RemoteError::new(
                ErrorCode::Invalid,
                format!("extended attribute flags {:#x} are invalid", req.flags),
            ));
        }
        check_xattr_name(&req.name)?;
        if req.value.len() > XATTR_VALUE_MAX {
            return Err(RemoteError::new(
                ErrorCode::Range,
                format!("extended attribute value is {} bytes; the limit is {XATTR_VALUE_MAX}", req.value.len()),
            ));
        }
        let node = self.node(req.ino)?;
        permission::require(h, node, req.ino, MAY_WRITE)?;
        let present = node.xattrs.contains_key(&req.name);
        if present && req.flags & XATTR_CREATE != 0 {
            return Err(RemoteError::new(
                ErrorCode::Exists,
                format!("extended attribute \"{}\" exists", show(&req.name)),
            ));
        }
        if !present && req.flags & XATTR_REPLACE != 0 {
            return Err(RemoteError::new(ErrorCode::NoData, format!("no extended attribute \"{}\"", show(&req.name))));
        }
        let used: usize = node.xattrs.iter().filter(|(k, _)| **k != req.name).map(|(k, v)| k.len() + v.len()).sum();
        if used + req.name.len() + req.value.len() > XATTR_TOTAL_MAX {
            return Err(RemoteError::new(
                ErrorCode::NoSpace,
                format!("inode {} would hold more than {XATTR_TOTAL_MAX} bytes of extended attributes", req.ino),
            ));
        }
        let node = self.node_mut(req.ino)?;
        node.xattrs.insert(req.name.clone(), req.value.clone());
        node.ctime = now;
        Applied::changed(MetaReply::Unit)
    }

    fn removexattr(&mut self, h: &RequestHeader, now: Timespec, req: &RemoveXattr) -> RpcResult<Applied> {
        check_xattr_name(&req.name)?;
        let node = self.node(req.ino)?;
        permission::require(h, node, req.ino, MAY_WRITE)?;
        let node = self.node_mut(req.ino)?;
        if node.xattrs.remove(&req.name).is_none() {
            return Err(RemoteError::new(ErrorCode::NoData, format!("no extended attribute \"{}\"", show(&req.name))));
        }
        node.ctime = now;
        Applied::changed(MetaReply::Unit)
    }

    fn extend_size(&mut self, req: &ExtendSize) -> RpcResult<Applied> {
        let node = self.node(req.ino)?;
        match node.body {
            // Publishes data written through a descriptor opened for writing: the permission
            // was checked at open, and an open descriptor keeps its access after a chmod (a
            // file created with mode 0444, as git does for its objects, is written and closed).
            Body::File(_) => {}
            Body::Dir(_) => {
                return Err(RemoteError::new(ErrorCode::IsDir, format!("inode {} is a directory", req.ino)))
            }
            Body::Symlink(_) => {
                return Err(RemoteError::new(ErrorCode::Invalid, format!("inode {} is a symbolic link", req.ino)))
            }
        }
        let node = self.node_mut(req.ino)?;
        node.size = node.size.max(req.size);
        node.mtime = req.mtime;
        node.ctime = req.mtime;
        Applied::changed(MetaReply::Attr(node.attr(req.ino)))
    }

    /// The part of another shard's striped directory kept here.
    fn shadow_mut(&mut self, ino: InodeId) -> RpcResult<&mut Inode> {
        if ino.shard() == self.shard {
            return Err(internal("a directory's own shard holds no part of it"));
        }
        self.node_mut(ino)
    }

    fn create_shadow(&mut self, now: Timespec, r: &CreateShadow) -> RpcResult<Applied> {
        if r.ino.shard() == self.shard {
            return Err(internal("a directory's own shard holds no part of it"));
        }
        if let Some(node) = self.inodes.get_mut(&r.ino) {
            (node.mode, node.uid, node.gid) = (r.mode, r.uid, r.gid);
            let d = node.dir_mut()?;
            d.layout = r.layout.clone();
            d.stripes = r.stripes.clone();
            d.sealed = false;
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

    /// A new layout for an empty regular file (`setstripe` on a file that has no data yet).
    fn set_file_layout(
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
            None => choose(&req.layout)?,
        };
        let node = self.node_mut(req.ino)?;
        node.ctime = now;
        node.body = Body::File(layout);
        Applied::changed(MetaReply::Attr(node.attr(req.ino)))
    }

    fn set_dir_layout(&mut self, h: &RequestHeader, now: Timespec, req: &SetDirLayout) -> RpcResult<Applied> {
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

    #[test]
    fn dir_survives_serialization() {
        let mut d = Dir::new(InodeId::ROOT, DirLayout::default());
        for i in 0..10u64 {
            d.insert(format!("n{i}").as_bytes(), InodeId(100 + i));
        }
        d.remove(b"n3").unwrap();
        let bytes = postcard::to_stdvec(&d).unwrap();
        let back: Dir = postcard::from_bytes(&bytes).unwrap();
        assert_eq!(back.names, d.names);
        assert_eq!(back.order, d.order);
        assert_eq!(back.next_seq, d.next_seq);
    }
}
