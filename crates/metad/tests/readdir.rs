//! Readdir cookies: large directories listed in batches, exactly once, while they change.

mod common;

use common::*;
use odfs_metad::{MetaOp, MetaStore};
use odfs_proto::meta::*;
use odfs_proto::{ErrorCode, InodeId};
use std::collections::{HashMap, HashSet};

const N: usize = 100_000;

fn name(i: usize) -> Vec<u8> {
    format!("entry-{i:07}").into_bytes()
}

fn batch(s: &MetaStore, dir: InodeId, cookie: u64, max: u32) -> ReadDirReply {
    s.readdir(&root(), &ReadDir { ino: dir, cookie, max_entries: max, plus: false }).unwrap()
}

fn fill(s: &mut MetaStore, n: usize) -> InodeId {
    let d = s.mkdir(&root(), ROOT, b"big", 0o755).unwrap().ino;
    for i in 0..n {
        s.create(&root(), d, &name(i), 0o644).unwrap();
    }
    d
}

#[test]
fn hundred_thousand_entries_in_batches_of_a_thousand() {
    let tmp = tempfile::tempdir().unwrap();
    let mut s = open(tmp.path());
    let d = fill(&mut s, N);
    let mut seen = HashSet::new();
    let mut cookie = 0;
    let mut batches = 0;
    loop {
        let r = batch(&s, d, cookie, 1000);
        batches += 1;
        assert!(r.entries.len() <= 1000);
        for e in &r.entries {
            assert!(e.cookie > cookie, "cookies increase");
            assert!(seen.insert(e.name.clone()), "{:?} listed twice", e.name);
            assert_eq!(e.kind, FileKind::File);
            assert!(e.attr.is_none());
        }
        if let Some(l) = r.entries.last() {
            cookie = l.cookie;
        }
        if r.eof {
            break;
        }
        assert_eq!(r.entries.len(), 1000, "only the last batch is short");
    }
    assert_eq!(seen.len(), N);
    assert_eq!(batches, N / 1000);
    for i in 0..N {
        assert!(seen.contains(&name(i)));
    }
    // Past the end: empty and eof.
    let r = batch(&s, d, cookie, 1000);
    assert!(r.entries.is_empty() && r.eof);
    // 0 means the default batch; plus fills attributes that match getattr.
    let r = s.readdir(&root(), &ReadDir { ino: d, cookie: 0, max_entries: 0, plus: true }).unwrap();
    assert_eq!(r.entries.len(), 1024);
    assert!(!r.eof);
    let e = &r.entries[17];
    assert_eq!(e.attr.as_ref(), Some(&s.stat(e.ino).unwrap()));
    // Errors.
    let f = s.find(&root(), d, &name(0)).unwrap().ino;
    let rd = |ino| ReadDir { ino, cookie: 0, max_entries: 10, plus: false };
    assert_eq!(code(s.readdir(&root(), &rd(f))).map(|_| ()), Err(ErrorCode::NotDir));
    assert_eq!(code(s.readdir(&root(), &rd(InodeId(1 << 40)))).map(|_| ()), Err(ErrorCode::NotFound));
}

/// A small deterministic generator, so the test needs no seed plumbing.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 33) as usize) % n
    }
}

#[test]
fn entries_present_throughout_appear_exactly_once_despite_changes() {
    let tmp = tempfile::tempdir().unwrap();
    let mut s = open(tmp.path());
    let d = fill(&mut s, N);
    let h = root();
    let mut rng = Lcg(7);
    // Names touched during the listing: deleted, renamed away, or created. Everything else is
    // present throughout and must be seen exactly once.
    let mut touched: HashSet<Vec<u8>> = HashSet::new();
    let mut live: Vec<Vec<u8>> = (0..N).map(name).collect();
    let mut next_new = N;
    let mut count: HashMap<Vec<u8>, usize> = HashMap::new();
    let mut cookie = 0;
    loop {
        let r = batch(&s, d, cookie, 1000);
        for e in &r.entries {
            *count.entry(e.name.clone()).or_default() += 1;
        }
        if let Some(l) = r.entries.last() {
            cookie = l.cookie;
        }
        if r.eof {
            break;
        }
        // Between batches: deletes, inserts, renames to new names, and renames over existing
        // names (the replaced name stays present and keeps its place).
        for _ in 0..50 {
            let i = rng.next(live.len());
            let victim = live.swap_remove(i);
            s.unlink(&h, d, &victim).unwrap();
            touched.insert(victim);
        }
        for _ in 0..50 {
            let n = name(next_new);
            next_new += 1;
            s.create(&h, d, &n, 0o644).unwrap();
            touched.insert(n.clone());
            live.push(n);
        }
        for _ in 0..20 {
            let i = rng.next(live.len());
            let from = live.swap_remove(i);
            let to = name(next_new);
            next_new += 1;
            s.rename(&h, d, &from, d, &to, 0).unwrap();
            touched.insert(from);
            touched.insert(to.clone());
            live.push(to);
        }
        for _ in 0..20 {
            let i = rng.next(live.len());
            let from = live.swap_remove(i);
            let over = live[rng.next(live.len())].clone();
            s.rename(&h, d, &from, d, &over, 0).unwrap();
            touched.insert(from);
        }
    }
    let mut steady = 0;
    for n in &live {
        if !touched.contains(n) {
            steady += 1;
            assert_eq!(count.get(n), Some(&1), "{:?} seen {:?} times", n, count.get(n));
        }
    }
    assert!(steady > N / 2, "the test kept most names steady ({steady})");
    for (n, c) in &count {
        assert_eq!(*c, 1, "{n:?} listed {c} times");
    }
    // A fresh listing now shows exactly the live names.
    let now: HashSet<Vec<u8>> = list(&s, d, 1000).into_iter().map(|e| e.name).collect();
    assert_eq!(now, live.into_iter().collect::<HashSet<_>>());
}

#[test]
fn exchange_keeps_both_names_in_place() {
    let tmp = tempfile::tempdir().unwrap();
    let mut s = open(tmp.path());
    let h = root();
    for n in [&b"a"[..], b"b", b"c"] {
        s.create(&h, ROOT, n, 0o644).unwrap();
    }
    let before: Vec<_> = list(&s, ROOT, 10).into_iter().map(|e| (e.cookie, e.name)).collect();
    let a = s.find(&h, ROOT, b"a").unwrap().ino;
    let c = s.find(&h, ROOT, b"c").unwrap().ino;
    s.mutate(
        &h,
        MetaOp::Rename(Rename {
            parent: ROOT,
            name: b"a".to_vec(),
            new_parent: ROOT,
            new_name: b"c".to_vec(),
            flags: RENAME_EXCHANGE,
        }),
    )
    .unwrap();
    let after: Vec<_> = list(&s, ROOT, 10).into_iter().map(|e| (e.cookie, e.name)).collect();
    assert_eq!(before, after);
    assert_eq!(s.find(&h, ROOT, b"a").unwrap().ino, c);
    assert_eq!(s.find(&h, ROOT, b"c").unwrap().ino, a);
}
