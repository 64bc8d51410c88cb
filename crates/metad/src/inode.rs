//! One inode of the namespace and the entries of a directory: the in-memory shapes metad
//! keeps, logs and snapshots. No rules live here (those are `permission` and `ops`), only the
//! data and the few invariants of its own: a directory's name index and listing order stay in
//! step, and a listing resumes after its cookie in O(log n).

use crate::error::{internal, show};
use odfs_proto::error::{ErrorCode, RemoteError, RpcResult};
use odfs_proto::meta::{entry_shard, Attr, FileKind};
use odfs_proto::{DirLayout, InodeId, Layout, Timespec};
use serde::ser::{Error as _, SerializeSeq, SerializeStruct};
use serde::{Deserialize, Serialize, Serializer};
use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::ops::Bound;

/// Size reported for directories (as ext4 reports a small directory).
const DIR_SIZE: u64 = 4096;

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

pub(crate) type InodeMap = HashMap<InodeId, Inode, BuildHasherDefault<IdHasher>>;

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
    /// Part of a sealed tree: refuses every change (see `ops::seal`).
    pub sealed: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) enum Body {
    File(Layout),
    Dir(Box<Dir>),
    Symlink(Vec<u8>),
    /// A FIFO, socket or device node: no data, only its kind and device number.
    Special {
        kind: FileKind,
        rdev: u32,
    },
}

impl Inode {
    pub(crate) fn new(mode: u32, uid: u32, gid: u32, now: Timespec, body: Body) -> Inode {
        Inode {
            mode,
            nlink: 1,
            uid,
            gid,
            size: 0,
            atime: now,
            mtime: now,
            ctime: now,
            xattrs: BTreeMap::new(),
            body,
            sealed: false,
        }
    }

    pub(crate) fn kind(&self) -> FileKind {
        match self.body {
            Body::File(_) => FileKind::File,
            Body::Dir(_) => FileKind::Dir,
            Body::Symlink(_) => FileKind::Symlink,
            Body::Special { kind, .. } => kind,
        }
    }

    pub(crate) fn is_dir(&self) -> bool {
        matches!(self.body, Body::Dir(_))
    }

    pub(crate) fn dir(&self) -> Option<&Dir> {
        match &self.body {
            Body::Dir(d) => Some(d),
            _ => None,
        }
    }

    pub(crate) fn dir_mut(&mut self) -> RpcResult<&mut Dir> {
        match &mut self.body {
            Body::Dir(d) => Ok(d),
            _ => Err(internal("a parent inode is not a directory")),
        }
    }

    /// The wire attributes of this inode.
    pub(crate) fn attr(&self, ino: InodeId) -> Attr {
        let (size, layout, dir_stripes, rdev) = match &self.body {
            Body::File(l) => (self.size, Some(l.clone()), Vec::new(), 0),
            Body::Dir(d) => (DIR_SIZE, None, d.stripes.clone(), 0),
            Body::Symlink(_) => (self.size, None, Vec::new(), 0),
            Body::Special { rdev, .. } => (0, None, Vec::new(), *rdev),
        };
        // A directory striped over shards counts its subdirectories part by part: it reports
        // 1, the convention for a directory whose subdirectory count is not kept (as btrfs),
        // so no tool takes nlink - 2 for its number of subdirectories.
        let nlink = match &self.body {
            Body::Dir(d) if d.stripes.len() > 1 => 1,
            _ => self.nlink,
        };
        Attr {
            ino,
            kind: self.kind(),
            mode: self.mode,
            nlink,
            uid: self.uid,
            gid: self.gid,
            size,
            atime: self.atime,
            mtime: self.mtime,
            ctime: self.ctime,
            layout,
            dir_stripes,
            rdev,
            sealed: self.sealed,
        }
    }

    /// A directory's entries changed.
    pub(crate) fn touch_dir(&mut self, now: Timespec) {
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
    /// name → (sequence number, inode, its kind). The kind is kept with the name because the
    /// inode may live on another shard (a remote entry).
    names: HashMap<Box<[u8]>, (u64, InodeId, FileKind)>,
    /// sequence number → name, in insertion order: the readdir order and cookies.
    order: BTreeMap<u64, Box<[u8]>>,
    /// Shards holding the entries of a striped directory (see `entry_shard`); empty otherwise.
    pub stripes: Vec<u16>,
    /// A part of a striped directory being removed (`SealShadow`): it refuses new entries.
    pub closing: bool,
    /// Names added, removed or repointed since the namespace last collected them (for the
    /// recalls of the change being applied). Not stored.
    pub(crate) changed: Vec<Box<[u8]>>,
}

impl Dir {
    pub(crate) fn new(parent: InodeId, layout: DirLayout) -> Dir {
        Dir {
            parent,
            layout,
            next_seq: 1,
            names: HashMap::new(),
            order: BTreeMap::new(),
            stripes: Vec::new(),
            closing: false,
            changed: Vec::new(),
        }
    }

    /// Refuses a name that a striped directory keeps on another shard.
    pub(crate) fn holds_name(&self, name: &[u8], shard: u16) -> RpcResult<()> {
        match entry_shard(&self.stripes, name) {
            Some(s) if s != shard => Err(RemoteError::new(
                ErrorCode::WrongShard,
                format!("\"{}\" belongs to metadata shard {s}", show(name)),
            )),
            _ => Ok(()),
        }
    }

    /// Refuses new entries in a part being removed.
    pub(crate) fn accepts_entries(&self) -> RpcResult<()> {
        if self.closing {
            return Err(RemoteError::new(ErrorCode::NotFound, "the directory is being removed"));
        }
        Ok(())
    }

    pub(crate) fn get(&self, name: &[u8]) -> Option<InodeId> {
        self.names.get(name).map(|&(_, ino, _)| ino)
    }

    /// The inode a name points at, and its kind.
    pub(crate) fn entry(&self, name: &[u8]) -> Option<(InodeId, FileKind)> {
        self.names.get(name).map(|&(_, ino, kind)| (ino, kind))
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    pub(crate) fn len(&self) -> usize {
        self.names.len()
    }

    /// Adds a new name with the next sequence number.
    pub(crate) fn insert(&mut self, name: &[u8], ino: InodeId, kind: FileKind) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.names.insert(name.into(), (seq, ino, kind));
        self.order.insert(seq, name.into());
        self.changed.push(name.into());
    }

    /// Points an existing name at another inode, keeping its place in the listing order (a
    /// name present throughout a listing is returned exactly once).
    pub(crate) fn repoint(&mut self, name: &[u8], ino: InodeId, kind: FileKind) -> RpcResult<()> {
        match self.names.get_mut(name) {
            Some(e) => {
                (e.1, e.2) = (ino, kind);
                self.changed.push(name.into());
                Ok(())
            }
            None => Err(internal("a renamed entry vanished")),
        }
    }

    /// Entries after `cookie` in listing order: (cookie, name, inode, kind).
    pub(crate) fn after(&self, cookie: u64) -> impl Iterator<Item = (u64, &[u8], InodeId, FileKind)> {
        self.order.range((Bound::Excluded(cookie), Bound::Unbounded)).filter_map(|(&seq, name)| {
            let &(_, ino, kind) = self.names.get(name)?;
            Some((seq, &**name, ino, kind))
        })
    }

    pub(crate) fn remove(&mut self, name: &[u8]) -> RpcResult<InodeId> {
        let (seq, ino, _) = self.names.remove(name).ok_or_else(|| internal("a removed entry vanished"))?;
        self.order.remove(&seq);
        self.changed.push(name.into());
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
    entries: Vec<(u64, Vec<u8>, InodeId, FileKind)>,
    stripes: Vec<u16>,
    closing: bool,
}

impl From<DirImage> for Dir {
    fn from(img: DirImage) -> Dir {
        let mut names = HashMap::with_capacity(img.entries.len());
        let mut order = BTreeMap::new();
        for (seq, name, ino, kind) in img.entries {
            let name: Box<[u8]> = name.into_boxed_slice();
            names.insert(name.clone(), (seq, ino, kind));
            order.insert(seq, name);
        }
        Dir {
            parent: img.parent,
            layout: img.layout,
            next_seq: img.next_seq,
            names,
            order,
            stripes: img.stripes,
            closing: img.closing,
            changed: Vec::new(),
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
                    let (ino, kind) =
                        self.0.entry(name).ok_or_else(|| S::Error::custom("directory index out of step"))?;
                    seq.serialize_element(&(n, &**name, ino, kind))?;
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
        st.serialize_field("closing", &self.closing)?;
        st.end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dir_survives_serialization() {
        let mut d = Dir::new(InodeId::ROOT, DirLayout::default());
        for i in 0..10u64 {
            d.insert(format!("n{i}").as_bytes(), InodeId(100 + i), FileKind::File);
        }
        d.remove(b"n3").unwrap();
        let bytes = postcard::to_stdvec(&d).unwrap();
        let back: Dir = postcard::from_bytes(&bytes).unwrap();
        assert_eq!(back.names, d.names);
        assert_eq!(back.order, d.order);
        assert_eq!(back.next_seq, d.next_seq);
    }
}
