//! Helpers shared by the integration tests: a store in a temporary directory, callers, thin
//! wrappers over `mutate`, and a full dump of the namespace through the public API.

#![allow(dead_code)]

use odfs_metad::{MetaStore, StoreOptions, TargetChoice};
use odfs_proto::meta::*;
use odfs_proto::{DirLayout, ErrorCode, InodeId, RequestHeader};
use std::collections::BTreeMap;
use std::path::Path;

pub const ROOT: InodeId = InodeId::ROOT;

/// Four online targets with space in the default pool, one more in pool "fast".
pub fn targets() -> Vec<TargetChoice> {
    let mut t: Vec<TargetChoice> = (1..=4)
        .map(|id| TargetChoice {
            id,
            pool: "default".into(),
            free: 1 << 30,
            capacity: 1 << 31,
            online: true,
            node: 0,
            device: 0,
        })
        .collect();
    t.push(TargetChoice {
        id: 10,
        pool: "fast".into(),
        free: 1 << 20,
        capacity: 1 << 21,
        online: true,
        node: 0,
        device: 0,
    });
    t
}

pub fn options() -> StoreOptions {
    StoreOptions::default()
}

/// Opens (or recovers) the store in `dir` and gives it the test targets.
pub fn open_with(dir: &Path, opts: StoreOptions) -> MetaStore {
    let mut s = MetaStore::open(dir, opts, DirLayout::default()).expect("open store");
    s.set_targets(targets());
    s
}

pub fn open(dir: &Path) -> MetaStore {
    open_with(dir, options())
}

/// A caller whose group is its uid, with no request id (no dedup).
pub fn user(uid: u32) -> RequestHeader {
    RequestHeader { request_id: 0, client_id: 1, uid, gid: uid, groups: vec![] }
}

pub fn root() -> RequestHeader {
    user(0)
}

pub type R<T> = Result<T, ErrorCode>;

/// Thin wrappers: each returns the reply or the error code.
pub trait Ops {
    fn store(&mut self) -> &mut MetaStore;

    fn create(&mut self, h: &RequestHeader, parent: InodeId, name: &[u8], mode: u32) -> R<Attr> {
        self.create_full(h, parent, name, mode, true, None).map(|r| r.attr)
    }
    fn create_full(
        &mut self,
        h: &RequestHeader,
        parent: InodeId,
        name: &[u8],
        mode: u32,
        exclusive: bool,
        layout: Option<DirLayout>,
    ) -> R<CreateReply> {
        let op = Create { parent, name: name.to_vec(), mode, exclusive, layout, register: false, node: None };
        code(self.store().mutate(h, op))
    }
    fn mkdir(&mut self, h: &RequestHeader, parent: InodeId, name: &[u8], mode: u32) -> R<Attr> {
        let op = Mkdir { parent, name: name.to_vec(), mode };
        code(self.store().mutate(h, op))
    }
    fn unlink(&mut self, h: &RequestHeader, parent: InodeId, name: &[u8]) -> R<Option<Attr>> {
        let op = Unlink { parent, name: name.to_vec() };
        code(self.store().mutate(h, op).map(|u| u.removed))
    }
    fn rmdir(&mut self, h: &RequestHeader, parent: InodeId, name: &[u8]) -> R<()> {
        let op = Rmdir { parent, name: name.to_vec() };
        code(self.store().mutate(h, op))
    }
    #[allow(clippy::too_many_arguments)]
    fn rename(
        &mut self,
        h: &RequestHeader,
        parent: InodeId,
        name: &[u8],
        new_parent: InodeId,
        new_name: &[u8],
        flags: u32,
    ) -> R<Option<Attr>> {
        let op = Rename { parent, name: name.to_vec(), new_parent, new_name: new_name.to_vec(), flags };
        code(self.store().mutate(h, op).map(|r| r.removed))
    }
    fn symlink(&mut self, h: &RequestHeader, parent: InodeId, name: &[u8], target: &[u8]) -> R<Attr> {
        let op = Symlink { parent, name: name.to_vec(), target: target.to_vec() };
        code(self.store().mutate(h, op))
    }
    fn link(&mut self, h: &RequestHeader, ino: InodeId, new_parent: InodeId, new_name: &[u8]) -> R<Attr> {
        let op = Link { ino, new_parent, new_name: new_name.to_vec() };
        code(self.store().mutate(h, op))
    }
    fn setattr(&mut self, h: &RequestHeader, req: SetAttr) -> R<Attr> {
        code(self.store().mutate(h, req))
    }
    fn find(&mut self, h: &RequestHeader, parent: InodeId, name: &[u8]) -> R<Attr> {
        code(self.store().lookup(h, &Lookup { parent, name: name.to_vec() }))
    }
    fn stat(&mut self, ino: InodeId) -> R<Attr> {
        code(self.store().getattr(&root(), &GetAttr { ino }))
    }
}

impl Ops for MetaStore {
    fn store(&mut self) -> &mut MetaStore {
        self
    }
}

pub fn code<T>(r: odfs_proto::error::RpcResult<T>) -> R<T> {
    r.map_err(|e| e.code)
}

/// Everything observable about one directory entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub cookie: u64,
    pub attr: Attr,
    pub target: Option<Vec<u8>>,
    pub xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    pub dir_layout: Option<DirLayout>,
}

/// The whole namespace through the public API: path → what is there, including readdir
/// cookies, symlink targets, extended attributes and directory layouts.
pub fn dump(s: &MetaStore) -> BTreeMap<Vec<Vec<u8>>, Seen> {
    let h = root();
    let mut out = BTreeMap::new();
    let root_attr = s.getattr(&h, &GetAttr { ino: ROOT }).expect("root");
    out.insert(vec![], seen(s, 0, root_attr));
    let mut todo = vec![(Vec::<Vec<u8>>::new(), ROOT)];
    while let Some((path, dir)) = todo.pop() {
        for e in list(s, dir, 1000) {
            let mut p = path.clone();
            p.push(e.name.clone());
            let attr = e.attr.clone().expect("plus listing has attrs");
            assert_eq!(attr.kind, e.kind);
            if attr.kind == FileKind::Dir {
                todo.push((p.clone(), attr.ino));
            }
            out.insert(p, seen(s, e.cookie, attr));
        }
    }
    out
}

fn seen(s: &MetaStore, cookie: u64, attr: Attr) -> Seen {
    let h = root();
    let target =
        (attr.kind == FileKind::Symlink).then(|| s.readlink(&h, &Readlink { ino: attr.ino }).expect("readlink"));
    let xattrs = s
        .listxattr(&h, &ListXattr { ino: attr.ino })
        .expect("listxattr")
        .into_iter()
        .map(|n| {
            let v = s.getxattr(&h, &GetXattr { ino: attr.ino, name: n.clone() }).expect("getxattr");
            (n, v)
        })
        .collect();
    let dir_layout = (attr.kind == FileKind::Dir)
        .then(|| s.get_dir_layout(&h, &GetDirLayout { ino: attr.ino }).expect("dir layout"));
    Seen { cookie, attr, target, xattrs, dir_layout }
}

/// A whole directory listing (readdirplus, as root), following cookies.
pub fn list(s: &MetaStore, dir: InodeId, batch: u32) -> Vec<DirEntry> {
    let mut out = Vec::new();
    let mut cookie = 0;
    loop {
        let r = s.readdir(&root(), &ReadDir { ino: dir, cookie, max_entries: batch, plus: true }).expect("readdir");
        if let Some(last) = r.entries.last() {
            cookie = last.cookie;
        }
        out.extend(r.entries);
        if r.eof {
            return out;
        }
    }
}
