//! Property test: random operation sequences give the same outcomes on the store and on a
//! small reference model of POSIX semantics, and the store recovers to the same state; and the
//! same sequences, sent through two clients of the client library with their caches on (one
//! process: `in_process`), give the model's outcomes, and each client sees the model's tree
//! after every operation of either (its caches kept right by leases and recalls).
//!
//! The model is a plain tree (node id → node, directories map names to node ids). It keeps no
//! link counts: they are computed from the tree when comparing, which checks the store's
//! bookkeeping independently.

mod common;
mod in_process;

use common::*;
use odfs_metad::{MetaOp, MetaStore, StoreOptions};
use odfs_proto::meta::*;
use odfs_proto::{ErrorCode, InodeId, RequestHeader};
use proptest::prelude::*;
use std::collections::{BTreeMap, HashMap};

const NAMES: [&str; 6] = ["a", "b", "c", "d", "e", "f"];
/// Parent directories ops address, as paths from the root.
const DIRS: [&[&str]; 4] = [&[], &["a"], &["b"], &["a", "b"]];
const UIDS: [u32; 3] = [0, 1000, 1001];
const MODES: [u32; 9] = [0o755, 0o777, 0o700, 0o1777, 0o2775, 0o644, 0o555, 0o000, 0o2777];
const TARGET: &[u8] = b"tgt";

const S_ISGID: u32 = 0o2000;
const S_ISVTX: u32 = 0o1000;

#[derive(Debug, Clone)]
enum Op {
    Create { uid: usize, dir: usize, name: usize, mode: usize, excl: bool },
    Mkdir { uid: usize, dir: usize, name: usize, mode: usize },
    Unlink { uid: usize, dir: usize, name: usize },
    Rmdir { uid: usize, dir: usize, name: usize },
    Rename { uid: usize, dir: usize, name: usize, dir2: usize, name2: usize, flags: u32 },
    Link { uid: usize, dir: usize, name: usize, dir2: usize, name2: usize },
    Symlink { uid: usize, dir: usize, name: usize },
    SetSize { uid: usize, dir: usize, name: usize, size: u64 },
    Chmod { uid: usize, dir: usize, name: usize, mode: usize },
    Chown { uid: usize, dir: usize, name: usize, owner: Option<usize>, group: Option<usize> },
}

fn op() -> impl Strategy<Value = Op> {
    let u = 0..UIDS.len();
    let d = 0..DIRS.len();
    let n = 0..NAMES.len();
    let m = 0..MODES.len();
    let at = (u.clone(), d.clone(), n.clone());
    let two = (u.clone(), d.clone(), n.clone(), d, n);
    let flags = prop_oneof![Just(0), Just(RENAME_NOREPLACE), Just(RENAME_EXCHANGE)];
    let who = proptest::option::of(0..UIDS.len());
    prop_oneof![
        3 => (at.clone(), m.clone(), any::<bool>()).prop_map(|((uid, dir, name), mode, excl)| {
            Op::Create { uid, dir, name, mode, excl }
        }),
        3 => (at.clone(), m.clone())
            .prop_map(|((uid, dir, name), mode)| Op::Mkdir { uid, dir, name, mode }),
        2 => at.clone().prop_map(|(uid, dir, name)| Op::Unlink { uid, dir, name }),
        2 => at.clone().prop_map(|(uid, dir, name)| Op::Rmdir { uid, dir, name }),
        4 => (two.clone(), flags).prop_map(|((uid, dir, name, dir2, name2), flags)| {
            Op::Rename { uid, dir, name, dir2, name2, flags }
        }),
        2 => two.prop_map(|(uid, dir, name, dir2, name2)| {
            Op::Link { uid, dir, name, dir2, name2 }
        }),
        1 => at.clone().prop_map(|(uid, dir, name)| Op::Symlink { uid, dir, name }),
        1 => (at.clone(), 0u64..5000)
            .prop_map(|((uid, dir, name), size)| Op::SetSize { uid, dir, name, size }),
        2 => (at.clone(), m)
            .prop_map(|((uid, dir, name), mode)| Op::Chmod { uid, dir, name, mode }),
        1 => (at, who.clone(), who).prop_map(|((uid, dir, name), owner, group)| {
            Op::Chown { uid, dir, name, owner, group }
        }),
    ]
}

// ---- the reference model ----

#[derive(Debug, Clone)]
enum Body {
    File,
    Symlink,
    Dir { entries: BTreeMap<Vec<u8>, usize>, parent: usize },
}

#[derive(Debug, Clone)]
struct Node {
    body: Body,
    mode: u32,
    uid: u32,
    gid: u32,
    size: u64,
}

impl Node {
    fn is_dir(&self) -> bool {
        matches!(self.body, Body::Dir { .. })
    }
    fn entries(&self) -> &BTreeMap<Vec<u8>, usize> {
        match &self.body {
            Body::Dir { entries, .. } => entries,
            _ => panic!("not a directory"),
        }
    }
}

/// The caller: gid equals uid, no supplementary groups.
#[derive(Clone, Copy)]
struct Who(u32);

impl Who {
    fn root(self) -> bool {
        self.0 == 0
    }
    fn header(self) -> RequestHeader {
        user(self.0)
    }
}

struct Model {
    nodes: HashMap<usize, Node>,
    next: usize,
}

type Res<T> = Result<T, ErrorCode>;
use ErrorCode::*;

const ROOT_ID: usize = 0;

impl Model {
    fn new(root_mode: u32) -> Model {
        let root = Node {
            body: Body::Dir { entries: BTreeMap::new(), parent: ROOT_ID },
            mode: root_mode,
            uid: 0,
            gid: 0,
            size: 0,
        };
        Model { nodes: HashMap::from([(ROOT_ID, root)]), next: 1 }
    }

    fn n(&self, id: usize) -> &Node {
        &self.nodes[&id]
    }

    fn entries_mut(&mut self, id: usize) -> &mut BTreeMap<Vec<u8>, usize> {
        match &mut self.nodes.get_mut(&id).expect("node").body {
            Body::Dir { entries, .. } => entries,
            _ => panic!("not a directory"),
        }
    }

    fn set_parent(&mut self, id: usize, p: usize) {
        if let Body::Dir { parent, .. } = &mut self.nodes.get_mut(&id).expect("node").body {
            *parent = p;
        }
    }

    /// Linux generic_permission.
    fn may(&self, w: Who, id: usize, mask: u32) -> bool {
        let n = self.n(id);
        if w.root() {
            return mask & 1 == 0 || n.is_dir() || n.mode & 0o111 != 0;
        }
        let bits = if w.0 == n.uid {
            n.mode >> 6
        } else if w.0 == n.gid {
            n.mode >> 3
        } else {
            n.mode
        } & 7;
        bits & mask == mask
    }

    fn need(&self, w: Who, id: usize, mask: u32) -> Res<()> {
        if self.may(w, id, mask) {
            Ok(())
        } else {
            Err(Access)
        }
    }

    fn sticky_ok(&self, w: Who, dir: usize, victim: usize) -> Res<()> {
        let d = self.n(dir);
        if d.mode & S_ISVTX == 0 || w.root() || w.0 == self.n(victim).uid || w.0 == d.uid {
            Ok(())
        } else {
            Err(Perm)
        }
    }

    fn resolve(&self, path: &[&str]) -> Option<usize> {
        let mut cur = ROOT_ID;
        for c in path {
            let next = *self.n(cur).entries().get(c.as_bytes())?;
            if !self.n(next).is_dir() {
                return None;
            }
            cur = next;
        }
        Some(cur)
    }

    fn child(&self, dir: usize, name: &[u8]) -> Option<usize> {
        self.n(dir).entries().get(name).copied()
    }

    fn refs(&self, id: usize) -> usize {
        self.nodes
            .values()
            .filter_map(|n| match &n.body {
                Body::Dir { entries, .. } => Some(entries.values().filter(|&&v| v == id).count()),
                _ => None,
            })
            .sum()
    }

    fn is_ancestor(&self, anc: usize, mut d: usize) -> bool {
        loop {
            if d == anc {
                return true;
            }
            match &self.n(d).body {
                Body::Dir { parent, .. } if *parent != d => d = *parent,
                _ => return false,
            }
        }
    }

    fn new_entry_checks(&self, w: Who, dir: usize, name: &[u8]) -> Res<()> {
        self.need(w, dir, 1)?;
        if self.child(dir, name).is_some() {
            return Err(Exists);
        }
        self.need(w, dir, 3)
    }

    fn add(&mut self, w: Who, dir: usize, name: &[u8], mut mode: u32, body: Body) -> usize {
        let p = self.n(dir);
        let is_dir = matches!(body, Body::Dir { .. });
        let gid = if p.mode & S_ISGID != 0 {
            if is_dir {
                mode |= S_ISGID;
            } else if mode & (S_ISGID | 0o010) == (S_ISGID | 0o010) && !w.root() && w.0 != p.gid {
                mode &= !S_ISGID;
            }
            p.gid
        } else {
            w.0
        };
        let id = self.next;
        self.next += 1;
        self.nodes.insert(id, Node { body, mode, uid: w.0, gid, size: 0 });
        self.entries_mut(dir).insert(name.to_vec(), id);
        id
    }

    /// Removes a node that no entry references any more; says whether it went.
    fn collect(&mut self, id: usize) -> bool {
        if self.refs(id) == 0 {
            self.nodes.remove(&id);
            true
        } else {
            false
        }
    }

    fn create(&mut self, w: Who, dir: usize, name: &[u8], mode: u32, excl: bool) -> Res<bool> {
        self.need(w, dir, 1)?;
        if let Some(c) = self.child(dir, name) {
            if excl {
                return Err(Exists);
            }
            return match self.n(c).body {
                Body::Dir { .. } => Err(IsDir),
                Body::Symlink => Err(Exists),
                Body::File => self.need(w, c, 2).map(|_| false),
            };
        }
        self.need(w, dir, 3)?;
        self.add(w, dir, name, mode & 0o7777, Body::File);
        Ok(true)
    }

    fn mkdir(&mut self, w: Who, dir: usize, name: &[u8], mode: u32) -> Res<()> {
        self.new_entry_checks(w, dir, name)?;
        self.add(w, dir, name, mode & 0o1777, Body::Dir { entries: BTreeMap::new(), parent: dir });
        Ok(())
    }

    fn symlink(&mut self, w: Who, dir: usize, name: &[u8]) -> Res<()> {
        self.new_entry_checks(w, dir, name)?;
        let id = self.add(w, dir, name, 0o777, Body::Symlink);
        let n = self.nodes.get_mut(&id).expect("new node");
        n.mode = 0o777;
        n.size = TARGET.len() as u64;
        Ok(())
    }

    fn link(&mut self, w: Who, src: usize, dir: usize, name: &[u8]) -> Res<()> {
        self.new_entry_checks(w, dir, name)?;
        if self.n(src).is_dir() {
            return Err(Perm);
        }
        self.entries_mut(dir).insert(name.to_vec(), src);
        Ok(())
    }

    fn delete_checks(&self, w: Who, dir: usize, name: &[u8]) -> Res<usize> {
        self.need(w, dir, 1)?;
        let c = self.child(dir, name).ok_or(NotFound)?;
        self.need(w, dir, 3)?;
        self.sticky_ok(w, dir, c)?;
        Ok(c)
    }

    fn unlink(&mut self, w: Who, dir: usize, name: &[u8]) -> Res<bool> {
        let c = self.delete_checks(w, dir, name)?;
        if self.n(c).is_dir() {
            return Err(IsDir);
        }
        self.entries_mut(dir).remove(name);
        Ok(self.collect(c))
    }

    fn rmdir(&mut self, w: Who, dir: usize, name: &[u8]) -> Res<()> {
        let c = self.delete_checks(w, dir, name)?;
        if !self.n(c).is_dir() {
            return Err(NotDir);
        }
        if !self.n(c).entries().is_empty() {
            return Err(NotEmpty);
        }
        self.entries_mut(dir).remove(name);
        self.nodes.remove(&c);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn rename(&mut self, w: Who, od: usize, name: &[u8], nd: usize, new: &[u8], flags: u32) -> Res<bool> {
        let exchange = flags == RENAME_EXCHANGE;
        self.need(w, od, 1)?;
        self.need(w, nd, 1)?;
        let src = self.child(od, name).ok_or(NotFound)?;
        let dst = self.child(nd, new);
        if flags == RENAME_NOREPLACE && dst.is_some() {
            return Err(Exists);
        }
        if exchange && dst.is_none() {
            return Err(NotFound);
        }
        let src_dir = self.n(src).is_dir();
        let dst_dir = dst.is_some_and(|d| self.n(d).is_dir());
        if src_dir && self.is_ancestor(src, nd) {
            return Err(Invalid);
        }
        if let Some(d) = dst.filter(|_| dst_dir) {
            if self.is_ancestor(d, od) {
                return Err(if exchange { Invalid } else { NotEmpty });
            }
        }
        if dst == Some(src) {
            return Ok(false);
        }
        self.need(w, od, 3)?;
        self.sticky_ok(w, od, src)?;
        self.need(w, nd, 3)?;
        if let Some(d) = dst {
            self.sticky_ok(w, nd, d)?;
            if !exchange && src_dir && !dst_dir {
                return Err(NotDir);
            }
            if !exchange && !src_dir && dst_dir {
                return Err(IsDir);
            }
        }
        if od != nd {
            if src_dir {
                self.need(w, src, 2)?;
            }
            if let Some(d) = dst.filter(|_| exchange && dst_dir) {
                self.need(w, d, 2)?;
            }
        }
        if !exchange && dst_dir && !self.n(dst.expect("dst")).entries().is_empty() {
            return Err(NotEmpty);
        }
        if exchange {
            let d = dst.expect("dst");
            self.entries_mut(od).insert(name.to_vec(), d);
            self.entries_mut(nd).insert(new.to_vec(), src);
            self.set_parent(src, nd);
            self.set_parent(d, od);
            return Ok(false);
        }
        self.entries_mut(od).remove(name);
        self.entries_mut(nd).insert(new.to_vec(), src);
        self.set_parent(src, nd);
        Ok(match dst {
            Some(d) if dst_dir => {
                self.nodes.remove(&d);
                false
            }
            Some(d) => self.collect(d),
            None => false,
        })
    }

    fn set_size(&mut self, w: Who, id: usize, size: u64) -> Res<()> {
        match self.n(id).body {
            Body::Dir { .. } => return Err(IsDir),
            Body::Symlink => return Err(Invalid),
            Body::File => self.need(w, id, 2)?,
        }
        let n = self.nodes.get_mut(&id).expect("node");
        n.size = size;
        // A size change by anyone but root drops set-user-id, and set-group-id when
        // group-executable or the caller is not in the file's group.
        if !w.root() {
            n.mode &= !0o4000;
            if n.mode & 0o010 != 0 || w.0 != n.gid {
                n.mode &= !S_ISGID;
            }
        }
        Ok(())
    }

    fn chmod(&mut self, w: Who, id: usize, mode: u32) -> Res<()> {
        let n = self.n(id);
        if !w.root() && w.0 != n.uid {
            return Err(Perm);
        }
        let mut mode = mode & 0o7777;
        if !w.root() && w.0 != n.gid {
            mode &= !S_ISGID;
        }
        self.nodes.get_mut(&id).expect("node").mode = mode;
        Ok(())
    }

    fn chown(&mut self, w: Who, id: usize, uid: Option<u32>, gid: Option<u32>) -> Res<()> {
        let n = self.n(id);
        if uid.is_some_and(|u| !(w.root() || (w.0 == n.uid && u == n.uid))) {
            return Err(Perm);
        }
        if gid.is_some_and(|g| !(w.root() || (w.0 == n.uid && (g == n.gid || g == w.0)))) {
            return Err(Perm);
        }
        let keeps_sgid = n.mode & 0o010 == 0 && (w.root() || w.0 == n.gid);
        let n = self.nodes.get_mut(&id).expect("node");
        if let Some(u) = uid {
            n.uid = u;
        }
        if let Some(g) = gid {
            n.gid = g;
        }
        if (uid.is_some() || gid.is_some()) && !matches!(n.body, Body::Dir { .. }) {
            n.mode &= !0o4000;
            if !keeps_sgid {
                n.mode &= !S_ISGID;
            }
        }
        Ok(())
    }
}

// ---- comparing ----

/// Per path: kind, mode, uid, gid, size (not for directories), link count, and the first path
/// (in order) naming the same inode, which captures hard-link structure.
type Tree = BTreeMap<Vec<Vec<u8>>, (FileKind, u32, u32, u32, Option<u64>, u32, Vec<Vec<u8>>)>;

fn model_tree(m: &Model) -> Tree {
    let mut paths: Vec<(Vec<Vec<u8>>, usize)> = vec![(vec![], ROOT_ID)];
    let mut i = 0;
    while i < paths.len() {
        let (p, id) = paths[i].clone();
        if let Body::Dir { entries, .. } = &m.n(id).body {
            for (name, &c) in entries {
                let mut q = p.clone();
                q.push(name.clone());
                paths.push((q, c));
            }
        }
        i += 1;
    }
    let mut first: HashMap<usize, Vec<Vec<u8>>> = HashMap::new();
    let mut sorted = paths.clone();
    sorted.sort();
    for (p, id) in &sorted {
        first.entry(*id).or_insert_with(|| p.clone());
    }
    sorted
        .into_iter()
        .map(|(p, id)| {
            let n = m.n(id);
            let (kind, nlink, size) = match &n.body {
                Body::File => (FileKind::File, m.refs(id) as u32, Some(n.size)),
                Body::Symlink => (FileKind::Symlink, m.refs(id) as u32, Some(n.size)),
                Body::Dir { entries, .. } => {
                    let subdirs = entries.values().filter(|&&c| m.n(c).is_dir()).count();
                    (FileKind::Dir, 2 + subdirs as u32, None)
                }
            };
            (p, (kind, n.mode, n.uid, n.gid, size, nlink, first[&id].clone()))
        })
        .collect()
}

fn store_tree(s: &MetaStore) -> Tree {
    let d = dump(s);
    let mut first: HashMap<InodeId, Vec<Vec<u8>>> = HashMap::new();
    for (p, v) in &d {
        first.entry(v.attr.ino).or_insert_with(|| p.clone());
    }
    d.iter()
        .map(|(p, v)| {
            let a = &v.attr;
            let size = (a.kind != FileKind::Dir).then_some(a.size);
            (p.clone(), (a.kind, a.mode, a.uid, a.gid, size, a.nlink, first[&a.ino].clone()))
        })
        .collect()
}

// ---- running ----

/// The inode at `dir`/`name` in the store, looked up as root.
fn store_resolve(s: &MetaStore, path: &[&str]) -> Option<InodeId> {
    let mut cur = ROOT;
    for c in path {
        let a = s.lookup(&root(), &Lookup { parent: cur, name: c.as_bytes().to_vec() }).ok()?;
        if a.kind != FileKind::Dir {
            return None;
        }
        cur = a.ino;
    }
    Some(cur)
}

fn store_child(s: &MetaStore, dir: InodeId, name: &[u8]) -> Option<InodeId> {
    s.lookup(&root(), &Lookup { parent: dir, name: name.to_vec() }).ok().map(|a| a.ino)
}

/// Applies `op` to both; returns (model outcome, store outcome) as comparable values, or None
/// when the op's paths do not resolve (checked to agree).
fn run(m: &mut Model, s: &mut MetaStore, op: &Op) -> Option<(Res<String>, Res<String>)> {
    let dir_of = |m: &Model, s: &MetaStore, d: usize| -> Option<(usize, InodeId)> {
        let a = m.resolve(DIRS[d]);
        let b = store_resolve(s, DIRS[d]);
        assert_eq!(a.is_some(), b.is_some(), "directory {:?} resolves differently", DIRS[d]);
        Some((a?, b?))
    };
    let node_of = |m: &Model, s: &MetaStore, d: usize, n: usize| -> Option<(usize, InodeId)> {
        let (md, sd) = dir_of(m, s, d)?;
        let a = m.child(md, NAMES[n].as_bytes());
        let b = store_child(s, sd, NAMES[n].as_bytes());
        assert_eq!(a.is_some(), b.is_some(), "{:?}/{} exists differently", DIRS[d], NAMES[n]);
        Some((a?, b?))
    };
    let show = |r: Res<bool>| r.map(|b| b.to_string());
    let unit = |r: Res<()>| r.map(|_| String::new());
    let sunit = |r: R<Attr>| r.map(|_| String::new());
    Some(match *op {
        Op::Create { uid, dir, name, mode, excl } => {
            let w = Who(UIDS[uid]);
            let (md, sd) = dir_of(m, s, dir)?;
            let nm = NAMES[name].as_bytes();
            (
                show(m.create(w, md, nm, MODES[mode], excl)),
                s.create_full(&w.header(), sd, nm, MODES[mode], excl, None).map(|r| r.created.to_string()),
            )
        }
        Op::Mkdir { uid, dir, name, mode } => {
            let w = Who(UIDS[uid]);
            let (md, sd) = dir_of(m, s, dir)?;
            let nm = NAMES[name].as_bytes();
            (unit(m.mkdir(w, md, nm, MODES[mode])), sunit(s.mkdir(&w.header(), sd, nm, MODES[mode])))
        }
        Op::Unlink { uid, dir, name } => {
            let w = Who(UIDS[uid]);
            let (md, sd) = dir_of(m, s, dir)?;
            let nm = NAMES[name].as_bytes();
            (show(m.unlink(w, md, nm)), s.unlink(&w.header(), sd, nm).map(|r| r.is_some().to_string()))
        }
        Op::Rmdir { uid, dir, name } => {
            let w = Who(UIDS[uid]);
            let (md, sd) = dir_of(m, s, dir)?;
            let nm = NAMES[name].as_bytes();
            (unit(m.rmdir(w, md, nm)), s.rmdir(&w.header(), sd, nm).map(|_| String::new()))
        }
        Op::Rename { uid, dir, name, dir2, name2, flags } => {
            let w = Who(UIDS[uid]);
            let (md, sd) = dir_of(m, s, dir)?;
            let (md2, sd2) = dir_of(m, s, dir2)?;
            let (a, b) = (NAMES[name].as_bytes(), NAMES[name2].as_bytes());
            (
                show(m.rename(w, md, a, md2, b, flags)),
                s.rename(&w.header(), sd, a, sd2, b, flags).map(|r| r.is_some().to_string()),
            )
        }
        Op::Link { uid, dir, name, dir2, name2 } => {
            let w = Who(UIDS[uid]);
            let (mn, sn) = node_of(m, s, dir, name)?;
            let (md2, sd2) = dir_of(m, s, dir2)?;
            let b = NAMES[name2].as_bytes();
            (unit(m.link(w, mn, md2, b)), sunit(s.link(&w.header(), sn, sd2, b)))
        }
        Op::Symlink { uid, dir, name } => {
            let w = Who(UIDS[uid]);
            let (md, sd) = dir_of(m, s, dir)?;
            let nm = NAMES[name].as_bytes();
            (unit(m.symlink(w, md, nm)), sunit(s.symlink(&w.header(), sd, nm, TARGET)))
        }
        Op::SetSize { uid, dir, name, size } => {
            let w = Who(UIDS[uid]);
            let (mn, sn) = node_of(m, s, dir, name)?;
            let req = SetAttr { ino: sn, size: Some(size), ..Default::default() };
            (unit(m.set_size(w, mn, size)), sunit(s.setattr(&w.header(), req)))
        }
        Op::Chmod { uid, dir, name, mode } => {
            let w = Who(UIDS[uid]);
            let (mn, sn) = node_of(m, s, dir, name)?;
            let req = SetAttr { ino: sn, mode: Some(MODES[mode]), ..Default::default() };
            (unit(m.chmod(w, mn, MODES[mode])), sunit(s.setattr(&w.header(), req)))
        }
        Op::Chown { uid, dir, name, owner, group } => {
            let w = Who(UIDS[uid]);
            let (mn, sn) = node_of(m, s, dir, name)?;
            let (o, g) = (owner.map(|i| UIDS[i]), group.map(|i| UIDS[i]));
            let req = SetAttr { ino: sn, uid: o, gid: g, ..Default::default() };
            (unit(m.chown(w, mn, o, g)), sunit(s.setattr(&w.header(), req)))
        }
    })
}

/// Mode and owner of each starting directory (a, b, a/b).
fn skeleton() -> impl Strategy<Value = Vec<(u32, usize)>> {
    proptest::collection::vec((prop_oneof![Just(0o777u32), Just(0o1777), Just(0o755), Just(0o2777)], 0..UIDS.len()), 3)
}

/// The ops that make the starting directories a, b and a/b (by root, then given away) so that
/// most ops find their paths, from `skeleton`'s modes and owners.
fn skeleton_ops(dirs: &[(u32, usize)]) -> Vec<Op> {
    let mut ops = Vec::new();
    for (i, (dir, name)) in [(0, 0), (0, 1), (1, 1)].into_iter().enumerate() {
        let (mode, owner) = dirs[i];
        let mode = MODES.iter().position(|&m| m == mode).unwrap_or(1);
        ops.push(Op::Mkdir { uid: 0, dir, name, mode });
        ops.push(Op::Chown { uid: 0, dir, name, owner: Some(dirs[i].1), group: Some(owner) });
    }
    ops
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn store_matches_model_and_recovers(
        root_mode in prop_oneof![Just(0o777u32), Just(0o1777), Just(0o755)],
        dirs in skeleton(),
        small_snapshots in any::<bool>(),
        ops in proptest::collection::vec(op(), 1..100),
    ) {
        let tmp = tempfile::tempdir().unwrap();
        let opts = StoreOptions {
            // Tiny threshold: snapshots happen in the middle of the sequence.
            snapshot_every_bytes: if small_snapshots { 700 } else { 64 << 20 },
            ..StoreOptions::default()
        };
        let mut s = open_with(tmp.path(), opts.clone());
        s.mutate(&root(), MetaOp::SetRootOwner { uid: 0, gid: 0, mode: root_mode }).unwrap();
        let mut m = Model::new(root_mode);
        for o in skeleton_ops(&dirs) {
            let (want, got) = run(&mut m, &mut s, &o).expect("skeleton resolves");
            prop_assert_eq!(&got, &want);
            prop_assert!(got.is_ok());
        }
        for (i, o) in ops.iter().enumerate() {
            if let Some((want, got)) = run(&mut m, &mut s, o) {
                prop_assert_eq!(&got, &want, "op {} {:?}", i, o);
            }
            prop_assert_eq!(store_tree(&s), model_tree(&m), "after op {} {:?}", i, o);
        }
        let before = dump(&s);
        drop(s);
        let s = open_with(tmp.path(), opts);
        prop_assert_eq!(dump(&s), before);
    }
}

// ---- through the client library ----

fn ctx(w: Who) -> odfs_client::Ctx {
    odfs_client::Ctx { uid: w.0, gid: w.0, groups: vec![] }
}

fn ccode<T>(r: odfs_client::Result<T>) -> Res<T> {
    r.map_err(|e| e.code())
}

/// The directory at `path` as a client resolves it (as root, through its caches).
async fn client_resolve(c: &odfs_client::Client, path: &[&str]) -> Option<InodeId> {
    let mut cur = ROOT;
    for p in path {
        let a = c.lookup(&odfs_client::Ctx::root(), cur, p.as_bytes()).await.ok()?;
        if a.kind != FileKind::Dir {
            return None;
        }
        cur = a.ino;
    }
    Some(cur)
}

/// The whole tree as a client sees it: listings and lookups through its caches.
async fn client_tree(c: &odfs_client::Client) -> Tree {
    let root = odfs_client::Ctx::root();
    let mut seen: Vec<(Vec<Vec<u8>>, Attr)> = vec![(vec![], c.getattr(&root, ROOT).await.unwrap())];
    let mut i = 0;
    while i < seen.len() {
        let (p, a) = seen[i].clone();
        if a.kind == FileKind::Dir {
            for e in c.readdir_all(&root, a.ino, false).await.unwrap() {
                let child = c.lookup(&root, a.ino, &e.name).await.unwrap();
                let mut q = p.clone();
                q.push(e.name);
                seen.push((q, child));
            }
        }
        i += 1;
    }
    seen.sort_by(|x, y| x.0.cmp(&y.0));
    let mut first: HashMap<InodeId, Vec<Vec<u8>>> = HashMap::new();
    for (p, a) in &seen {
        first.entry(a.ino).or_insert_with(|| p.clone());
    }
    seen.iter()
        .map(|(p, a)| {
            let size = (a.kind != FileKind::Dir).then_some(a.size);
            (p.clone(), (a.kind, a.mode, a.uid, a.gid, size, a.nlink, first[&a.ino].clone()))
        })
        .collect()
}

/// Applies `op` to the model and through client `c`: (model outcome, client outcome), or None
/// when the op's paths do not resolve (checked to agree).
async fn run_client(m: &mut Model, c: &odfs_client::Client, op: &Op) -> Option<(Res<String>, Res<String>)> {
    async fn dir_of(m: &Model, c: &odfs_client::Client, d: usize) -> Option<(usize, InodeId)> {
        let (a, b) = (m.resolve(DIRS[d]), client_resolve(c, DIRS[d]).await);
        assert_eq!(a.is_some(), b.is_some(), "directory {:?} resolves differently", DIRS[d]);
        Some((a?, b?))
    }
    async fn node_of(m: &Model, c: &odfs_client::Client, d: usize, n: usize) -> Option<(usize, InodeId)> {
        let (md, cd) = dir_of(m, c, d).await?;
        let a = m.child(md, NAMES[n].as_bytes());
        let b = c.lookup(&odfs_client::Ctx::root(), cd, NAMES[n].as_bytes()).await.ok().map(|a| a.ino);
        assert_eq!(a.is_some(), b.is_some(), "{:?}/{} exists differently", DIRS[d], NAMES[n]);
        Some((a?, b?))
    }
    let done = |r: Res<bool>| r.map(|_| String::new());
    let unit = |r: Res<()>| r.map(|_| String::new());
    Some(match *op {
        Op::Create { uid, dir, name, mode, excl } => {
            let w = Who(UIDS[uid]);
            let (md, cd) = dir_of(m, c, dir).await?;
            let nm = NAMES[name].as_bytes();
            let got = ccode(c.create(&ctx(w), cd, nm, MODES[mode], excl, None).await).map(|r| r.created.to_string());
            (m.create(w, md, nm, MODES[mode], excl).map(|b| b.to_string()), got)
        }
        Op::Mkdir { uid, dir, name, mode } => {
            let w = Who(UIDS[uid]);
            let (md, cd) = dir_of(m, c, dir).await?;
            let nm = NAMES[name].as_bytes();
            (
                unit(m.mkdir(w, md, nm, MODES[mode])),
                ccode(c.mkdir(&ctx(w), cd, nm, MODES[mode]).await).map(|_| String::new()),
            )
        }
        Op::Unlink { uid, dir, name } => {
            let w = Who(UIDS[uid]);
            let (md, cd) = dir_of(m, c, dir).await?;
            let nm = NAMES[name].as_bytes();
            (done(m.unlink(w, md, nm)), ccode(c.unlink(&ctx(w), cd, nm).await).map(|_| String::new()))
        }
        Op::Rmdir { uid, dir, name } => {
            let w = Who(UIDS[uid]);
            let (md, cd) = dir_of(m, c, dir).await?;
            let nm = NAMES[name].as_bytes();
            (unit(m.rmdir(w, md, nm)), ccode(c.rmdir(&ctx(w), cd, nm).await).map(|_| String::new()))
        }
        Op::Rename { uid, dir, name, dir2, name2, flags } => {
            let w = Who(UIDS[uid]);
            let (md, cd) = dir_of(m, c, dir).await?;
            let (md2, cd2) = dir_of(m, c, dir2).await?;
            let (a, b) = (NAMES[name].as_bytes(), NAMES[name2].as_bytes());
            let got = ccode(c.rename(&ctx(w), cd, a, cd2, b, flags).await).map(|_| String::new());
            (done(m.rename(w, md, a, md2, b, flags)), got)
        }
        Op::Link { uid, dir, name, dir2, name2 } => {
            let w = Who(UIDS[uid]);
            let (mn, cn) = node_of(m, c, dir, name).await?;
            let (md2, cd2) = dir_of(m, c, dir2).await?;
            let b = NAMES[name2].as_bytes();
            (unit(m.link(w, mn, md2, b)), ccode(c.link(&ctx(w), cn, cd2, b).await).map(|_| String::new()))
        }
        Op::Symlink { uid, dir, name } => {
            let w = Who(UIDS[uid]);
            let (md, cd) = dir_of(m, c, dir).await?;
            let nm = NAMES[name].as_bytes();
            (unit(m.symlink(w, md, nm)), ccode(c.symlink(&ctx(w), cd, nm, TARGET).await).map(|_| String::new()))
        }
        Op::SetSize { uid, dir, name, size } => {
            let w = Who(UIDS[uid]);
            let (mn, cn) = node_of(m, c, dir, name).await?;
            let got = ccode(c.truncate(&ctx(w), cn, size, odfs_client::Truncate::CheckAccess).await);
            (unit(m.set_size(w, mn, size)), got.map(|_| String::new()))
        }
        Op::Chmod { uid, dir, name, mode } => {
            let w = Who(UIDS[uid]);
            let (mn, cn) = node_of(m, c, dir, name).await?;
            let req = SetAttr { ino: cn, mode: Some(MODES[mode]), ..Default::default() };
            (unit(m.chmod(w, mn, MODES[mode])), ccode(c.setattr(&ctx(w), req).await).map(|_| String::new()))
        }
        Op::Chown { uid, dir, name, owner, group } => {
            let w = Who(UIDS[uid]);
            let (mn, cn) = node_of(m, c, dir, name).await?;
            let (o, g) = (owner.map(|i| UIDS[i]), group.map(|i| UIDS[i]));
            let req = SetAttr { ino: cn, uid: o, gid: g, ..Default::default() };
            (unit(m.chown(w, mn, o, g)), ccode(c.setattr(&ctx(w), req).await).map(|_| String::new()))
        }
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 192, ..ProptestConfig::default() })]

    #[test]
    fn clients_with_caches_match_model(
        root_mode in prop_oneof![Just(0o777u32), Just(0o1777), Just(0o755)],
        dirs in skeleton(),
        ops in proptest::collection::vec(op(), 1..60),
    ) {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(async {
            let tmp = tempfile::tempdir().unwrap();
            let fs = in_process::InProcess::start(tmp.path(), root_mode).await;
            let clients = [fs.client().await, fs.client().await];
            let mut m = Model::new(root_mode);
            for o in skeleton_ops(&dirs) {
                let (want, got) = run_client(&mut m, &clients[0], &o).await.expect("skeleton resolves");
                prop_assert_eq!(&got, &want);
                prop_assert!(got.is_ok());
            }
            for (i, o) in ops.iter().enumerate() {
                // The clients take turns; each must see the other's changes at once.
                let (by, other) = (&clients[i % 2], &clients[(i + 1) % 2]);
                if let Some((want, got)) = run_client(&mut m, by, o).await {
                    prop_assert_eq!(&got, &want, "op {} {:?}", i, o);
                }
                let want = model_tree(&m);
                prop_assert_eq!(client_tree(other).await, want.clone(), "the other client, after op {} {:?}", i, o);
                prop_assert_eq!(client_tree(by).await, want, "the client that did op {} {:?}", i, o);
            }
            Ok(())
        })?;
    }
}
