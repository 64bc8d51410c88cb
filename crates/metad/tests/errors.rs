//! Namespace semantics and every error code the store returns, operation by operation.

mod common;

use common::*;
use odfs_metad::{MetaOp, MetaStore, StoreOptions, TargetChoice};
use odfs_proto::meta::*;
use odfs_proto::{DirLayout, ErrorCode, InodeId, RequestHeader, Timespec};
use tempfile::TempDir;

fn fresh() -> (TempDir, MetaStore) {
    let d = tempfile::tempdir().unwrap();
    let s = open(d.path());
    (d, s)
}

/// A fresh store whose root is world-writable, so unprivileged users can work in it.
fn open_root() -> (TempDir, MetaStore) {
    let (d, mut s) = fresh();
    s.set_root_owner(0, 0, 0o777).unwrap();
    (d, s)
}

use ErrorCode::*;

#[test]
fn root_exists_with_defaults() {
    let (_d, mut s) = fresh();
    let a = s.stat(ROOT).unwrap();
    assert_eq!((a.kind, a.mode, a.uid, a.gid, a.nlink), (FileKind::Dir, 0o755, 0, 0, 2));
    let a = s.set_root_owner(1000, 100, 0o1777).unwrap();
    assert_eq!((a.mode, a.uid, a.gid), (0o1777, 1000, 100));
}

#[test]
fn names_are_validated_before_anything_changes() {
    let (_d, mut s) = open_root();
    let h = root();
    let long = vec![b'x'; 256];
    let max = vec![b'y'; 255];
    assert_eq!(s.create(&h, ROOT, &long, 0o644), Err(NameTooLong));
    assert_eq!(s.mkdir(&h, ROOT, &long, 0o755), Err(NameTooLong));
    assert_eq!(s.symlink(&h, ROOT, &long, b"t"), Err(NameTooLong));
    assert_eq!(s.find(&h, ROOT, &long), Err(NameTooLong));
    let a = s.create(&h, ROOT, &max, 0o644).unwrap();
    assert_eq!(s.find(&h, ROOT, &max).unwrap().ino, a.ino);
    for bad in [&b""[..], b".", b"..", b"a/b", b"a\0b"] {
        assert_eq!(s.create(&h, ROOT, bad, 0o644), Err(Invalid), "{bad:?}");
        assert_eq!(s.mkdir(&h, ROOT, bad, 0o755), Err(Invalid), "{bad:?}");
        assert_eq!(s.symlink(&h, ROOT, bad, b"t"), Err(Invalid), "{bad:?}");
        assert_eq!(s.link(&h, a.ino, ROOT, bad), Err(Invalid), "{bad:?}");
        assert_eq!(s.unlink(&h, ROOT, bad), Err(Invalid), "{bad:?}");
        assert_eq!(s.rmdir(&h, ROOT, bad), Err(Invalid), "{bad:?}");
        assert_eq!(s.rename(&h, ROOT, &max, ROOT, bad, 0), Err(Invalid), "{bad:?}");
        assert_eq!(s.find(&h, ROOT, bad), Err(Invalid), "{bad:?}");
    }
    // Nothing changed: one entry, the root untouched apart from that create.
    assert_eq!(list(&s, ROOT, 10).len(), 1);
    assert_eq!(s.stat(a.ino).unwrap().nlink, 1);
    let e = s.mutate(&h, MetaOp::Mkdir(Mkdir { parent: ROOT, name: long, mode: 0o755 })).unwrap_err();
    assert_eq!(e.message, "name is 256 bytes; the limit is 255");
}

#[test]
fn create_exclusive_and_not() {
    let (_d, mut s) = open_root();
    let u = user(1000);
    let a = s.create(&u, ROOT, b"f", 0o644).unwrap();
    assert_eq!((a.kind, a.mode, a.uid, a.gid, a.nlink, a.size), (FileKind::File, 0o644, 1000, 1000, 1, 0));
    let layout = a.layout.clone().expect("a file has a layout");
    assert_eq!(layout.targets.len(), 4);
    assert_eq!(s.create(&u, ROOT, b"f", 0o644), Err(Exists));
    let again = s.create_full(&u, ROOT, b"f", 0o600, false, None).unwrap();
    assert!(!again.created);
    assert_eq!(again.attr, a);
    // Opening an existing file this way needs write permission on it.
    assert_eq!(s.create_full(&user(1001), ROOT, b"f", 0o644, false, None).map(|_| ()), Err(Access));
    s.mkdir(&u, ROOT, b"d", 0o755).unwrap();
    assert_eq!(s.create_full(&u, ROOT, b"d", 0o644, false, None).map(|_| ()), Err(IsDir));
    assert_eq!(s.create(&u, ROOT, b"d", 0o644), Err(Exists));
    // Parent problems.
    assert_eq!(s.create(&u, InodeId(999_999), b"x", 0o644), Err(NotFound));
    assert_eq!(s.create(&u, a.ino, b"x", 0o644), Err(NotDir));
    // Mode keeps 07777 only.
    let m = s.create(&u, ROOT, b"m", 0o100_4755).unwrap();
    assert_eq!(m.mode, 0o4755);
}

#[test]
fn permissions_on_parents() {
    let (_d, mut s) = open_root();
    let owner = user(1000);
    let other = user(1001);
    let d = s.mkdir(&owner, ROOT, b"d", 0o755).unwrap();
    s.create(&owner, d.ino, b"f", 0o644).unwrap();
    // A non-owner cannot add or remove entries in a 0755 directory of another uid.
    assert_eq!(s.create(&other, d.ino, b"g", 0o644), Err(Access));
    assert_eq!(s.mkdir(&other, d.ino, b"g", 0o755), Err(Access));
    assert_eq!(s.symlink(&other, d.ino, b"g", b"t"), Err(Access));
    assert_eq!(s.unlink(&other, d.ino, b"f"), Err(Access));
    assert_eq!(s.rename(&other, d.ino, b"f", d.ino, b"g", 0), Err(Access));
    // Existing names are reported before missing write permission (as Linux).
    assert_eq!(s.create(&other, d.ino, b"f", 0o644), Err(Exists));
    // But search permission comes first.
    let closed = s.mkdir(&owner, ROOT, b"closed", 0o700).unwrap();
    s.create(&owner, closed.ino, b"f", 0o644).unwrap();
    assert_eq!(s.find(&other, closed.ino, b"f"), Err(Access));
    assert_eq!(s.create(&other, closed.ino, b"f", 0o644), Err(Access));
    assert_eq!(s.find(&owner, closed.ino, b"f").map(|a| a.kind), Ok(FileKind::File));
    // Root bypasses read and write bits.
    s.create(&root(), closed.ino, b"byroot", 0o644).unwrap();
    // Readdir needs read permission.
    let noread = s.mkdir(&owner, ROOT, b"noread", 0o311).unwrap();
    let rd = ReadDir { ino: noread.ino, cookie: 0, max_entries: 0, plus: false };
    assert_eq!(code(s.readdir(&other, &rd)).map(|_| ()), Err(Access));
    assert_eq!(code(s.readdir(&owner, &rd)).map(|_| ()), Err(Access));
    assert!(s.readdir(&root(), &rd).is_ok());
    // Group class applies to group members, even when other bits would allow more.
    let mut member = user(1002);
    member.groups = vec![1000];
    let g = s.mkdir(&owner, ROOT, b"g", 0o707).unwrap();
    assert_eq!(s.create(&member, g.ino, b"x", 0o644), Err(Access));
    assert!(s.create(&other, g.ino, b"x", 0o644).is_ok());
}

#[test]
fn access_and_open_checks() {
    let (_d, mut s) = open_root();
    let owner = user(1000);
    let f = s.create(&owner, ROOT, b"f", 0o640).unwrap();
    let acc =
        |s: &MetaStore, h: &RequestHeader, mask| code(s.access(h, &odfs_proto::meta::Access { ino: f.ino, mask }));
    assert_eq!(acc(&s, &owner, 6), Ok(()));
    assert_eq!(acc(&s, &owner, 1), Err(Access));
    assert_eq!(acc(&s, &user(1001), 4), Err(Access));
    assert_eq!(acc(&s, &user(1001), 0), Ok(()));
    // Root: read/write always, execute only with some x bit.
    assert_eq!(acc(&s, &root(), 6), Ok(()));
    assert_eq!(acc(&s, &root(), 1), Err(Access));
    assert_eq!(acc(&s, &owner, 8), Err(Invalid));
    let open = |s: &MetaStore, h: &RequestHeader, ino, read, write| {
        code(s.open_file(h, &Open { ino, read, write, register: false })).map(|a| a.ino)
    };
    assert_eq!(open(&s, &owner, f.ino, true, true), Ok(f.ino));
    assert_eq!(open(&s, &user(1001), f.ino, true, false), Err(Access));
    assert_eq!(open(&s, &root(), ROOT, false, true), Err(IsDir));
    assert_eq!(open(&s, &root(), ROOT, true, false), Ok(ROOT));
    assert_eq!(open(&s, &root(), InodeId(12345), true, false), Err(NotFound));
}

#[test]
fn sticky_directories() {
    let (_d, mut s) = fresh();
    let dir_owner = user(1);
    let file_owner = user(2);
    let third = user(3);
    let t = s.mkdir(&root(), ROOT, b"tmp", 0o1777).unwrap();
    s.setattr(&root(), SetAttr { ino: t.ino, uid: Some(1), ..Default::default() }).unwrap();
    for n in [&b"a"[..], b"b", b"c", b"d", b"e"] {
        s.create(&file_owner, t.ino, n, 0o666).unwrap();
    }
    s.mkdir(&file_owner, t.ino, b"sub", 0o777).unwrap();
    s.create(&third, t.ino, b"mine", 0o666).unwrap();
    // A third user may not delete, rename away or rename over another's entry.
    assert_eq!(s.unlink(&third, t.ino, b"a"), Err(Perm));
    assert_eq!(s.rmdir(&third, t.ino, b"sub"), Err(Perm));
    assert_eq!(s.rename(&third, t.ino, b"a", t.ino, b"z", 0), Err(Perm));
    assert_eq!(s.rename(&third, t.ino, b"mine", t.ino, b"a", 0), Err(Perm));
    // The file's owner, the directory's owner and root may.
    assert!(s.unlink(&file_owner, t.ino, b"a").unwrap().is_some());
    assert!(s.unlink(&dir_owner, t.ino, b"b").unwrap().is_some());
    assert!(s.unlink(&root(), t.ino, b"c").unwrap().is_some());
    s.rename(&dir_owner, t.ino, b"d", t.ino, b"d2", 0).unwrap();
    s.rename(&file_owner, t.ino, b"e", t.ino, b"e2", 0).unwrap();
    s.rmdir(&dir_owner, t.ino, b"sub").unwrap();
    // And the third user may rename its own file over its own.
    s.create(&third, t.ino, b"mine2", 0o666).unwrap();
    s.rename(&third, t.ino, b"mine2", t.ino, b"mine", 0).unwrap();
    let names: Vec<_> = list(&s, t.ino, 100).into_iter().map(|e| e.name).collect();
    // "mine" was replaced in place, so it keeps its original listing position.
    assert_eq!(names, vec![b"mine".to_vec(), b"d2".to_vec(), b"e2".to_vec()]);
}

#[test]
fn unlink_rmdir_and_links() {
    let (_d, mut s) = open_root();
    let h = user(1000);
    let d = s.mkdir(&h, ROOT, b"d", 0o755).unwrap();
    assert_eq!(d.nlink, 2);
    assert_eq!(s.stat(ROOT).unwrap().nlink, 3);
    let f = s.create(&h, d.ino, b"f", 0o644).unwrap();
    assert_eq!(s.rmdir(&h, ROOT, b"d"), Err(NotEmpty));
    assert_eq!(s.rmdir(&h, d.ino, b"f"), Err(NotDir));
    assert_eq!(s.unlink(&h, ROOT, b"d"), Err(IsDir));
    assert_eq!(s.unlink(&h, ROOT, b"nope"), Err(NotFound));
    assert_eq!(s.rmdir(&h, ROOT, b"nope"), Err(NotFound));
    // Hard links.
    assert_eq!(s.link(&h, d.ino, ROOT, b"dl"), Err(Perm));
    assert_eq!(s.link(&h, f.ino, ROOT, b"d"), Err(Exists));
    assert_eq!(s.link(&h, InodeId(424242), ROOT, b"x"), Err(NotFound));
    let l = s.link(&h, f.ino, ROOT, b"f2").unwrap();
    assert_eq!((l.ino, l.nlink), (f.ino, 2));
    assert_eq!(s.unlink(&h, d.ino, b"f"), Ok(None));
    assert_eq!(s.stat(f.ino).unwrap().nlink, 1);
    let gone = s.unlink(&h, ROOT, b"f2").unwrap().expect("last link");
    assert_eq!(gone.ino, f.ino);
    assert_eq!(gone.nlink, 0);
    assert_eq!(gone.layout, f.layout);
    assert_eq!(s.stat(f.ino), Err(NotFound));
    s.rmdir(&h, ROOT, b"d").unwrap();
    assert_eq!(s.stat(ROOT).unwrap().nlink, 2);
    assert_eq!(s.stat(d.ino), Err(NotFound));
}

#[test]
fn unlink_updates_parent_times() {
    let (_d, mut s) = open_root();
    let h = user(1000);
    let d = s.mkdir(&h, ROOT, b"d", 0o755).unwrap();
    let old = Timespec { sec: 1, nsec: 0 };
    s.setattr(&h, SetAttr { ino: d.ino, mtime: Some(SetTime::At(old)), ..Default::default() }).unwrap();
    s.create(&h, d.ino, b"f", 0o644).unwrap();
    let a = s.stat(d.ino).unwrap();
    assert!(a.mtime > old && a.ctime >= a.mtime);
}

#[test]
fn link_count_limits() {
    let (_d, mut s) = open_root();
    let h = root();
    let f = s.create(&h, ROOT, b"f", 0o644).unwrap();
    let d = s.mkdir(&h, ROOT, b"links", 0o755).unwrap();
    for i in 1..odfs_metad::namespace::MAX_LINKS {
        s.link(&h, f.ino, d.ino, format!("l{i}").as_bytes()).unwrap();
    }
    assert_eq!(s.stat(f.ino).unwrap().nlink, 65000);
    assert_eq!(s.link(&h, f.ino, d.ino, b"one-more"), Err(TooManyLinks));
    let p = s.mkdir(&h, ROOT, b"parent", 0o755).unwrap();
    for i in 2..odfs_metad::namespace::MAX_LINKS {
        s.mkdir(&h, p.ino, format!("d{i}").as_bytes(), 0o755).unwrap();
    }
    assert_eq!(s.stat(p.ino).unwrap().nlink, 65000);
    assert_eq!(s.mkdir(&h, p.ino, b"one-more", 0o755), Err(TooManyLinks));
    // Moving a directory in is refused too; files are still fine.
    s.mkdir(&h, ROOT, b"outside", 0o755).unwrap();
    assert_eq!(s.rename(&h, ROOT, b"outside", p.ino, b"in", 0), Err(TooManyLinks));
    s.create(&h, p.ino, b"file", 0o644).unwrap();
}

#[test]
fn rename_rules() {
    let (_d, mut s) = open_root();
    let h = user(1000);
    let a = s.mkdir(&h, ROOT, b"a", 0o755).unwrap();
    let b = s.mkdir(&h, ROOT, b"b", 0o755).unwrap();
    let f = s.create(&h, a.ino, b"f", 0o644).unwrap();
    let g = s.create(&h, b.ino, b"g", 0o644).unwrap();
    // Over an existing file: atomic replace; the replaced file's last link is returned.
    let removed = s.rename(&h, a.ino, b"f", b.ino, b"g", 0).unwrap().expect("replaced");
    assert_eq!(removed.ino, g.ino);
    assert_eq!(removed.layout, g.layout);
    assert_eq!(s.find(&h, b.ino, b"g").unwrap().ino, f.ino);
    assert_eq!(s.find(&h, a.ino, b"f"), Err(NotFound));
    assert_eq!(s.stat(g.ino), Err(NotFound));
    // Over a file that keeps another link: nothing removed.
    let x = s.create(&h, a.ino, b"x", 0o644).unwrap();
    s.link(&h, x.ino, ROOT, b"xl").unwrap();
    s.create(&h, a.ino, b"y", 0o644).unwrap();
    assert_eq!(s.rename(&h, a.ino, b"y", a.ino, b"x", 0), Ok(None));
    assert_eq!(s.stat(x.ino).unwrap().nlink, 1);
    // Hard links of the same inode: no-op success, both names stay.
    s.link(&h, f.ino, a.ino, b"f-again").unwrap();
    assert_eq!(s.rename(&h, b.ino, b"g", a.ino, b"f-again", 0), Ok(None));
    assert_eq!(s.find(&h, b.ino, b"g").unwrap().ino, f.ino);
    assert_eq!(s.find(&h, a.ino, b"f-again").unwrap().ino, f.ino);
    // Same name onto itself.
    assert_eq!(s.rename(&h, b.ino, b"g", b.ino, b"g", 0), Ok(None));
    assert_eq!(s.rename(&h, b.ino, b"g", b.ino, b"g", RENAME_NOREPLACE), Err(Exists));
    // Directories.
    let d1 = s.mkdir(&h, a.ino, b"d1", 0o755).unwrap();
    let d2 = s.mkdir(&h, b.ino, b"d2", 0o755).unwrap();
    s.create(&h, d2.ino, b"inner", 0o644).unwrap();
    assert_eq!(s.rename(&h, a.ino, b"d1", b.ino, b"d2", 0), Err(NotEmpty));
    assert_eq!(s.rename(&h, a.ino, b"d1", b.ino, b"g", 0), Err(NotDir));
    assert_eq!(s.rename(&h, b.ino, b"g", b.ino, b"d2", 0), Err(IsDir));
    assert_eq!(s.rename(&h, ROOT, b"a", d1.ino, b"in", 0), Err(Invalid));
    assert_eq!(s.rename(&h, ROOT, b"a", a.ino, b"in", 0), Err(Invalid));
    assert_eq!(s.rename(&h, a.ino, b"d1", ROOT, b"a", 0), Err(NotEmpty));
    assert_eq!(s.rename(&h, a.ino, b"nope", ROOT, b"z", 0), Err(NotFound));
    assert_eq!(s.rename(&h, a.ino, b"d1", ROOT, b"z", 3), Err(Invalid));
    assert_eq!(s.rename(&h, a.ino, b"d1", ROOT, b"z", 8), Err(Invalid));
    // Directory over an empty directory, across parents: link counts follow.
    let empty = s.mkdir(&h, b.ino, b"empty", 0o755).unwrap();
    let (na, nb) = (s.stat(a.ino).unwrap().nlink, s.stat(b.ino).unwrap().nlink);
    assert_eq!(s.rename(&h, a.ino, b"d1", b.ino, b"empty", 0), Ok(None));
    assert_eq!(s.stat(empty.ino), Err(NotFound));
    assert_eq!(s.stat(a.ino).unwrap().nlink, na - 1);
    assert_eq!(s.stat(b.ino).unwrap().nlink, nb);
    assert_eq!(s.find(&h, b.ino, b"empty").unwrap().ino, d1.ino);
    // A moved directory's ".." follows: moving it under itself is refused from its new place.
    assert_eq!(s.rename(&h, ROOT, b"b", d1.ino, b"b", 0), Err(Invalid));
    // Moving a directory to a new parent.
    s.rename(&h, b.ino, b"empty", ROOT, b"top", 0).unwrap();
    assert_eq!(s.stat(b.ino).unwrap().nlink, nb - 1);
    assert_eq!(s.stat(ROOT).unwrap().nlink, 5);
    // RENAME_NOREPLACE.
    assert_eq!(s.rename(&h, ROOT, b"top", ROOT, b"a", RENAME_NOREPLACE), Err(Exists));
    s.rename(&h, ROOT, b"top", ROOT, b"top2", RENAME_NOREPLACE).unwrap();
    // RENAME_EXCHANGE: swap a file and a directory across parents.
    assert_eq!(s.rename(&h, ROOT, b"top2", a.ino, b"missing", RENAME_EXCHANGE), Err(NotFound));
    let (na, nr) = (s.stat(a.ino).unwrap().nlink, s.stat(ROOT).unwrap().nlink);
    let xa = s.find(&h, a.ino, b"x").unwrap();
    assert_eq!(s.rename(&h, ROOT, b"top2", a.ino, b"x", RENAME_EXCHANGE), Ok(None));
    assert_eq!(s.find(&h, ROOT, b"top2").unwrap().ino, xa.ino);
    assert_eq!(s.find(&h, a.ino, b"x").unwrap().ino, d1.ino);
    assert_eq!(s.stat(a.ino).unwrap().nlink, na + 1);
    assert_eq!(s.stat(ROOT).unwrap().nlink, nr - 1);
    // The exchanged directory's parent is now `a`: moving `a` into it is refused.
    assert_eq!(s.rename(&h, ROOT, b"a", d1.ino, b"a", 0), Err(Invalid));
}

#[test]
fn rename_moving_a_directory_needs_write_on_it() {
    let (_d, mut s) = open_root();
    let owner = user(1000);
    let other = user(1001);
    let dst = s.mkdir(&other, ROOT, b"dst", 0o777).unwrap();
    let src = s.mkdir(&other, ROOT, b"src", 0o777).unwrap();
    s.mkdir(&owner, src.ino, b"ro", 0o555).unwrap();
    // Within one parent no write on the directory itself is needed...
    s.rename(&other, src.ino, b"ro", src.ino, b"ro2", 0).unwrap();
    // ...but its ".." changes when it moves to another parent.
    assert_eq!(s.rename(&other, src.ino, b"ro2", dst.ino, b"ro", 0), Err(Access));
}

#[test]
fn symlinks() {
    let (_d, mut s) = open_root();
    let h = user(1000);
    let l = s.symlink(&h, ROOT, b"l", b"some/where").unwrap();
    assert_eq!((l.kind, l.mode, l.size, l.nlink), (FileKind::Symlink, 0o777, 10, 1));
    assert_eq!(s.readlink(&h, &Readlink { ino: l.ino }).unwrap(), b"some/where");
    let f = s.create(&h, ROOT, b"f", 0o644).unwrap();
    assert_eq!(code(s.readlink(&h, &Readlink { ino: f.ino })).map(|_| ()), Err(Invalid));
    assert_eq!(s.symlink(&h, ROOT, b"l", b"x"), Err(Exists));
    assert_eq!(s.symlink(&h, ROOT, b"e", b""), Err(NotFound));
    assert_eq!(s.symlink(&h, ROOT, b"e", &vec![b'a'; 4096]), Err(NameTooLong));
    assert_eq!(s.create_full(&h, ROOT, b"l", 0o644, false, None).map(|_| ()), Err(Exists));
    assert_eq!(s.unlink(&h, ROOT, b"l").unwrap().map(|a| a.ino), Some(l.ino));
}

#[test]
fn chmod_chown_rules() {
    let (_d, mut s) = open_root();
    let mut owner = user(1000);
    owner.groups = vec![50];
    let other = user(1001);
    let f = s.create(&owner, ROOT, b"f", 0o644).unwrap();
    let set = |mode: Option<u32>, uid: Option<u32>, gid: Option<u32>| SetAttr {
        ino: f.ino,
        mode,
        uid,
        gid,
        ..Default::default()
    };
    // chmod: owner or root only.
    assert_eq!(s.setattr(&other, set(Some(0o777), None, None)), Err(Perm));
    let a = s.setattr(&owner, set(Some(0o100_6755), None, None)).unwrap();
    assert_eq!(a.mode, 0o6755);
    assert!(a.ctime >= f.ctime);
    assert_eq!(s.setattr(&root(), set(Some(0o600), None, None)).unwrap().mode, 0o600);
    // chown uid: root only (the owner may only "change" it to itself).
    assert_eq!(s.setattr(&owner, set(None, Some(1001), None)), Err(Perm));
    assert_eq!(s.setattr(&owner, set(None, Some(1000), None)).unwrap().uid, 1000);
    assert_eq!(s.setattr(&other, set(None, Some(1001), None)), Err(Perm));
    // chgrp: owner to a group it is in; anyone else refused.
    assert_eq!(s.setattr(&owner, set(None, None, Some(50))).unwrap().gid, 50);
    assert_eq!(s.setattr(&owner, set(None, None, Some(51))), Err(Perm));
    assert_eq!(s.setattr(&other, set(None, None, Some(1001))), Err(Perm));
    // chown clears set-user-id and (group-executable) set-group-id.
    s.setattr(&owner, set(Some(0o6755), None, None)).unwrap();
    let a = s.setattr(&owner, set(None, None, Some(1000))).unwrap();
    assert_eq!(a.mode, 0o0755);
    s.setattr(&root(), set(Some(0o6755), None, None)).unwrap();
    assert_eq!(s.setattr(&root(), set(None, Some(7), None)).unwrap().mode, 0o0755);
    // Non-root chmod by the owner drops set-group-id unless it is in the file's group.
    s.setattr(&root(), set(None, Some(1000), Some(99))).unwrap();
    assert_eq!(s.setattr(&owner, set(Some(0o2755), None, None)).unwrap().mode, 0o0755);
    assert_eq!(s.setattr(&root(), set(Some(0o2755), None, None)).unwrap().mode, 0o2755);
}

#[test]
fn truncate_and_times() {
    let (_d, mut s) = open_root();
    let owner = user(1000);
    let other = user(1001);
    let f = s.create(&owner, ROOT, b"f", 0o644).unwrap();
    let size = |n| SetAttr { ino: f.ino, size: Some(n), ..Default::default() };
    assert_eq!(s.setattr(&owner, size(100)).unwrap().size, 100);
    assert_eq!(s.setattr(&owner, size(10)).unwrap().size, 10);
    assert_eq!(s.setattr(&other, size(0)), Err(Access));
    assert_eq!(s.setattr(&owner, SetAttr { ino: ROOT, size: Some(0), ..Default::default() }), Err(IsDir));
    let t = Timespec { sec: 1_000_000, nsec: 5 };
    let explicit =
        SetAttr { ino: f.ino, atime: Some(SetTime::At(t)), mtime: Some(SetTime::At(t)), ..Default::default() };
    let now = SetAttr { ino: f.ino, atime: Some(SetTime::Now), mtime: Some(SetTime::Now), ..Default::default() };
    assert_eq!(s.setattr(&other, explicit.clone()), Err(Perm));
    assert_eq!(s.setattr(&other, now.clone()), Err(Access));
    let a = s.setattr(&owner, explicit).unwrap();
    assert_eq!((a.atime, a.mtime), (t, t));
    // Write permission is enough for "now".
    s.setattr(&owner, SetAttr { ino: f.ino, mode: Some(0o666), ..Default::default() }).unwrap();
    let a = s.setattr(&other, now).unwrap();
    assert!(a.mtime > t && a.atime > t);
}

#[test]
fn extend_size() {
    let (_d, mut s) = open_root();
    let owner = user(1000);
    let f = s.create(&owner, ROOT, b"f", 0o644).unwrap();
    let t = Timespec { sec: 77, nsec: 0 };
    let ext = |ino, size| ExtendSize { ino, size, mtime: t };
    let a = s.mutate(&owner, ext(f.ino, 1000)).unwrap();
    assert_eq!((a.size, a.mtime, a.ctime), (1000, t, t));
    let a = s.mutate(&owner, ext(f.ino, 10)).unwrap();
    assert_eq!(a.size, 1000, "extend never shrinks");
    // Authorized by the open for writing (checked when the file was opened), not by the mode
    // now: a writer whose file became read-only since still publishes what it wrote.
    let a = s.mutate(&user(1001), ext(f.ino, 5000)).unwrap();
    assert_eq!((a.size, a.mode & 0o777), (5000, 0o644));
    assert_eq!(code(s.mutate(&root(), ext(ROOT, 5))).map(|_| ()), Err(IsDir));
    assert_eq!(code(s.mutate(&root(), ext(InodeId(99_999), 5))).map(|_| ()), Err(NotFound));
}

#[test]
fn xattrs() {
    let (_d, mut s) = open_root();
    let owner = user(1000);
    let f = s.create(&owner, ROOT, b"f", 0o644).unwrap();
    let set = |name: &[u8], value: &[u8], flags| {
        MetaOp::SetXattr(SetXattr { ino: f.ino, name: name.to_vec(), value: value.to_vec(), flags })
    };
    let get = |s: &MetaStore, name: &[u8]| code(s.getxattr(&owner, &GetXattr { ino: f.ino, name: name.to_vec() }));
    let rm = |name: &[u8]| MetaOp::RemoveXattr(RemoveXattr { ino: f.ino, name: name.to_vec() });
    assert_eq!(get(&s, b"user.a"), Err(NoData));
    assert_eq!(code(s.mutate(&owner, set(b"user.a", b"1", XATTR_REPLACE))).map(|_| ()), Err(NoData));
    s.mutate(&owner, set(b"user.a", b"1", XATTR_CREATE)).unwrap();
    assert_eq!(code(s.mutate(&owner, set(b"user.a", b"2", XATTR_CREATE))).map(|_| ()), Err(Exists));
    s.mutate(&owner, set(b"user.a", b"2", XATTR_REPLACE)).unwrap();
    s.mutate(&owner, set(b"user.b", b"", 0)).unwrap();
    assert_eq!(get(&s, b"user.a"), Ok(b"2".to_vec()));
    assert_eq!(get(&s, b"user.b"), Ok(vec![]));
    assert_eq!(s.listxattr(&owner, &ListXattr { ino: f.ino }).unwrap(), vec![b"user.a".to_vec(), b"user.b".to_vec()]);
    // Limits.
    assert_eq!(code(s.mutate(&owner, set(b"", b"1", 0))).map(|_| ()), Err(Range));
    let long = |len: usize| [b"user.".as_slice(), &vec![b'n'; len - 5]].concat();
    assert_eq!(code(s.mutate(&owner, set(&long(256), b"1", 0))).map(|_| ()), Err(Range));
    s.mutate(&owner, set(&long(255), b"1", 0)).unwrap();
    // A name in no namespace Linux knows, as Linux's own filesystems answer it.
    assert_eq!(code(s.mutate(&owner, set(b"foo.bar", b"1", 0))).map(|_| ()), Err(Unsupported));
    assert_eq!(get(&s, b"foo.bar"), Err(Unsupported));
    assert_eq!(code(s.mutate(&owner, rm(b"foo.bar"))).map(|_| ()), Err(Unsupported));
    let big = vec![0u8; odfs_proto::XATTR_VALUE_MAX + 1];
    assert_eq!(code(s.mutate(&owner, set(b"user.big", &big, 0))).map(|_| ()), Err(Range));
    s.mutate(&owner, set(b"user.big", &big[1..], 0)).unwrap();
    assert_eq!(code(s.mutate(&owner, set(b"user.c", b"1", 4))).map(|_| ()), Err(Invalid));
    // Permissions: writing needs write access, reading read access.
    assert_eq!(code(s.mutate(&user(1001), set(b"user.c", b"1", 0))).map(|_| ()), Err(Access));
    s.setattr(&owner, SetAttr { ino: f.ino, mode: Some(0o600), ..Default::default() }).unwrap();
    assert_eq!(code(s.getxattr(&user(1001), &GetXattr { ino: f.ino, name: b"user.a".to_vec() })), Err(Access));
    // Remove.
    s.mutate(&owner, rm(b"user.a")).unwrap();
    assert_eq!(code(s.mutate(&owner, rm(b"user.a"))).map(|_| ()), Err(NoData));
    assert_eq!(get(&s, b"user.a"), Err(NoData));
}

#[test]
fn layouts_of_new_files() {
    let d = tempfile::tempdir().unwrap();
    let mut s = open(d.path());
    let h = root();
    let f = s.create(&h, ROOT, b"f", 0o644).unwrap();
    let l = f.layout.unwrap();
    assert_eq!((l.pool.as_str(), l.chunk_size, l.targets.len()), ("default", 1 << 20, 4));
    let mut sorted = l.targets.clone();
    sorted.sort();
    assert_eq!(sorted, vec![1, 2, 3, 4]);
    // The rotating start spreads first targets.
    let firsts: std::collections::HashSet<_> = (0..8)
        .map(|i| s.create(&h, ROOT, format!("r{i}").as_bytes(), 0o644).unwrap().layout.unwrap().targets[0])
        .collect();
    assert_eq!(firsts.len(), 4);
    // A directory default, inherited by subdirectories made later.
    let dir = s.mkdir(&h, ROOT, b"fast", 0o755).unwrap();
    let fast =
        DirLayout { chunk_size: 1 << 16, stripe_count: -1, pool: "fast".into(), start_target: None, local: false };
    let sdl = |ino, layout| MetaOp::SetDirLayout(SetDirLayout { ino, layout });
    s.mutate(&h, sdl(dir.ino, fast.clone())).unwrap();
    assert_eq!(s.get_dir_layout(&h, &GetDirLayout { ino: dir.ino }).unwrap(), fast);
    let sub = s.mkdir(&h, dir.ino, b"sub", 0o755).unwrap();
    let l = s.create(&h, sub.ino, b"x", 0o644).unwrap().layout.unwrap();
    assert_eq!((l.pool.as_str(), l.chunk_size, l.targets.clone()), ("fast", 1 << 16, vec![10]));
    // Per-file layout, with a start target.
    let own =
        DirLayout { chunk_size: 1 << 20, stripe_count: 2, pool: "default".into(), start_target: Some(3), local: false };
    let c = s.create_full(&h, dir.ino, b"own", 0o644, true, Some(own)).unwrap();
    assert_eq!(c.attr.layout.unwrap().targets, vec![3, 4]);
    // More stripes than the pool has online: capped at the pool's size (as Lustre).
    let want = |n, pool: &str| DirLayout { stripe_count: n, pool: pool.into(), ..DirLayout::default() };
    let capped = s.create_full(&h, ROOT, b"wide", 0o644, true, Some(want(5, "default"))).unwrap();
    assert_eq!(capped.attr.layout.unwrap().targets.len(), 4);
    // Errors: unknown pool, invalid layout, no space.
    assert_eq!(s.create_full(&h, ROOT, b"e2", 0o644, true, Some(want(1, "nope"))).map(|_| ()), Err(Invalid));
    assert_eq!(s.create_full(&h, ROOT, b"e3", 0o644, true, Some(want(0, "default"))).map(|_| ()), Err(Invalid));
    assert_eq!(s.find(&h, ROOT, b"e2"), Err(NotFound), "a failed create leaves nothing");
    let mut full = targets();
    for t in &mut full {
        t.free = 0;
    }
    s.set_targets(full);
    assert_eq!(s.create(&h, ROOT, b"e4", 0o644), Err(NoSpace));
    // An existing file opens without a layout choice.
    assert!(s.create_full(&h, ROOT, b"f", 0o644, false, None).is_ok());
    // SetDirLayout errors.
    let f2 = s.find(&h, ROOT, b"f").unwrap();
    assert_eq!(code(s.mutate(&h, sdl(f2.ino, fast.clone()))).map(|_| ()), Err(NotDir));
    assert_eq!(code(s.mutate(&user(5), sdl(dir.ino, fast.clone()))).map(|_| ()), Err(Perm));
    let bad = DirLayout { chunk_size: 1000, ..fast };
    let e = s.mutate(&h, sdl(dir.ino, bad)).unwrap_err();
    assert_eq!(e.code, Invalid);
    assert!(e.message.contains("chunk size"), "{}", e.message);
}

#[test]
fn setgid_directories_pass_on_their_group() {
    let (_d, mut s) = open_root();
    let mut u = user(1000);
    u.groups = vec![500];
    let d = s.mkdir(&u, ROOT, b"shared", 0o2775).unwrap();
    assert_eq!(d.mode, 0o0775, "mkdir drops set-group-id from the mode it is given");
    s.setattr(&u, SetAttr { ino: d.ino, gid: Some(500), mode: Some(0o2775), ..Default::default() }).unwrap();
    let f = s.create(&u, d.ino, b"f", 0o644).unwrap();
    assert_eq!(f.gid, 500);
    let sub = s.mkdir(&u, d.ino, b"sub", 0o755).unwrap();
    assert_eq!((sub.gid, sub.mode), (500, 0o2755));
    // A creator outside the group may not keep set-group-id on a group-executable file.
    let outsider = user(1001);
    s.setattr(&u, SetAttr { ino: d.ino, mode: Some(0o2777), ..Default::default() }).unwrap();
    let g = s.create(&outsider, d.ino, b"g", 0o2755).unwrap();
    assert_eq!((g.gid, g.mode), (500, 0o0755));
}

#[test]
fn statfs_and_shard_ids() {
    let d = tempfile::tempdir().unwrap();
    let mut s =
        MetaStore::open(d.path(), StoreOptions { shard: 3, ..StoreOptions::default() }, DirLayout::default()).unwrap();
    let mut t = targets();
    t.push(TargetChoice { id: 20, pool: "default".into(), free: 5, capacity: 5, online: false, node: 0, device: 0 });
    s.set_targets(t);
    let f = s.create(&root(), ROOT, b"f", 0o644).unwrap();
    assert_eq!(f.ino.shard(), 3);
    let st = s.statfs(&root(), &StatFs {}).unwrap();
    assert_eq!(st.total_bytes, 4 * (1 << 31) + (1 << 21));
    assert_eq!(st.free_bytes, 4 * (1 << 30) + (1 << 20));
    // Targets that share a device count its space once.
    let mut shared = targets();
    for (i, t) in shared.iter_mut().enumerate() {
        t.device = if i < 2 { 7 } else { 100 + i as u64 };
    }
    s.set_targets(shared);
    let st2 = s.statfs(&root(), &StatFs {}).unwrap();
    assert_eq!(st2.total_bytes, st.total_bytes - (1 << 31));
    assert_eq!(st2.free_bytes, st.free_bytes - (1 << 30));
    // A shard counts its own inodes: the root belongs to shard 0 (this shard's copy of it is
    // not counted, so the shards' counts add up to the filesystem's).
    assert_eq!(st.used_inodes, 1);
    assert_eq!(st.free_inodes, st.total_inodes - 1);
    assert_eq!(st.block_size, 4096);
    let d = tempfile::tempdir().unwrap();
    let s0 = MetaStore::open(d.path(), StoreOptions::default(), DirLayout::default()).unwrap();
    assert_eq!(s0.statfs(&root(), &StatFs {}).unwrap().used_inodes, 1, "shard 0 counts the root");
}

#[test]
fn idempotent_retries_in_process() {
    let (_d, mut s) = open_root();
    let mut h = user(1000);
    h.client_id = 77;
    h.request_id = 5;
    let op = MetaOp::Create(Create {
        parent: ROOT,
        name: b"f".to_vec(),
        mode: 0o644,
        exclusive: true,
        layout: None,
        register: false,
        node: None,
    });
    let first = s.mutate(&h, op.clone()).unwrap();
    assert_eq!(s.mutate(&h, op.clone()).unwrap(), first);
    // request id 0 means no dedup.
    h.request_id = 0;
    assert_eq!(code(s.mutate(&h, op.clone())).map(|_| ()), Err(Exists));
    assert_eq!(code(s.mutate(&h, op)).map(|_| ()), Err(Exists));
}

#[test]
fn layouts_are_judged_against_the_pools_and_survive_a_restart() {
    let d = tempfile::tempdir().unwrap();
    let mut s = open(d.path());
    let u = user(1000);
    s.set_root_owner(0, 0, 0o777).unwrap();
    let dir = s.mkdir(&u, ROOT, b"d", 0o755).unwrap();
    let set = |s: &mut MetaStore, h: &RequestHeader, layout: DirLayout| {
        s.mutate(h, MetaOp::SetDirLayout(SetDirLayout { ino: dir.ino, layout }))
    };
    let dl = |count: i32, pool: &str, start: Option<u32>| DirLayout {
        chunk_size: 1 << 18,
        stripe_count: count,
        pool: pool.into(),
        start_target: start,
        local: false,
    };
    // Refused, naming the problem: unknown pool, more stripes than the pool has, a start
    // target outside the pool, another user's directory.
    for (layout, want) in [
        (dl(2, "gold", None), "pool \"gold\" does not exist"),
        (dl(5, "default", None), "more than the 4 targets"),
        (dl(1, "fast", Some(3)), "start target 3 is not in pool \"fast\""),
    ] {
        let e = set(&mut s, &u, layout).unwrap_err();
        assert!(e.code == Invalid && e.message.contains(want), "{e}");
    }
    assert_eq!(code(set(&mut s, &user(1001), dl(1, "fast", None))).map(|_| ()), Err(Perm));
    set(&mut s, &u, dl(-1, "default", None)).unwrap();
    // A new file takes every target of the pool; an empty file can be given another layout,
    // a file with data cannot.
    let f = s.create(&u, dir.ino, b"f", 0o644).unwrap();
    assert_eq!(f.layout.as_ref().unwrap().targets.len(), 4);
    let relayout = |s: &mut MetaStore, h: &RequestHeader, ino| {
        s.mutate(h, SetFileLayout { ino, layout: dl(1, "fast", None), node: None })
    };
    let a = relayout(&mut s, &u, f.ino).unwrap();
    assert_eq!(a.layout.as_ref().map(|l| (l.targets.clone(), l.pool.as_str())), Some((vec![10], "fast")));
    let g = s.create(&u, dir.ino, b"g", 0o644).unwrap();
    s.mutate(&u, MetaOp::ExtendSize(ExtendSize { ino: g.ino, size: 10, mtime: Timespec::now() })).unwrap();
    let e = relayout(&mut s, &u, g.ino).unwrap_err();
    assert!(e.code == Invalid && e.message.contains("only be set while a file is empty"), "{e}");
    assert_eq!(code(relayout(&mut s, &user(1001), f.ino)).map(|_| ()), Err(Perm));
    assert_eq!(code(relayout(&mut s, &u, dir.ino)).map(|_| ()), Err(Invalid));
    // The chosen layout is in the log: a restart replays it exactly.
    drop(s);
    let s = open(d.path());
    assert_eq!(s.getattr(&root(), &GetAttr { ino: f.ino }).unwrap().layout, a.layout);
    assert_eq!(s.get_dir_layout(&root(), &GetDirLayout { ino: dir.ino }).unwrap(), dl(-1, "default", None));
}

#[test]
fn a_site_can_keep_layouts_to_root() {
    let d = tempfile::tempdir().unwrap();
    let mut s = open_with(d.path(), StoreOptions { root_only_layouts: true, ..StoreOptions::default() });
    s.set_root_owner(1000, 1000, 0o755).unwrap();
    let layout = DirLayout { stripe_count: 1, ..DirLayout::default() };
    let e =
        s.mutate(&user(1000), MetaOp::SetDirLayout(SetDirLayout { ino: ROOT, layout: layout.clone() })).unwrap_err();
    assert!(e.code == Perm && e.message.contains("only root"), "{e}");
    s.mutate(&root(), MetaOp::SetDirLayout(SetDirLayout { ino: ROOT, layout })).unwrap();
}

#[test]
fn sealed_inodes_refuse_every_change_and_only_owners_seal() {
    let (_d, mut s) = open_root();
    let owner = user(1000);
    let dir = s.mkdir(&owner, ROOT, b"d", 0o755).unwrap();
    let f = s.create(&owner, dir.ino, b"f", 0o644).unwrap();
    let sub = s.mkdir(&owner, dir.ino, b"sub", 0o755).unwrap();
    let other = s.create(&owner, ROOT, b"other", 0o644).unwrap();
    let seal = |s: &mut MetaStore, h: &RequestHeader, ino, sealed| code(s.mutate(h, SetSealed { ino, sealed }));
    assert_eq!(seal(&mut s, &user(1001), dir.ino, true), Err(Perm));
    for ino in [dir.ino, f.ino, sub.ino] {
        assert!(seal(&mut s, &owner, ino, true).unwrap().sealed);
    }
    assert!(s.stat(f.ino).unwrap().sealed);
    let sa = SetAttr { ino: f.ino, mode: Some(0o600), ..Default::default() };
    assert_eq!(s.setattr(&root(), sa), Err(ReadOnly));
    assert_eq!(s.create(&owner, dir.ino, b"g", 0o644), Err(ReadOnly));
    assert_eq!(s.mkdir(&owner, dir.ino, b"g", 0o755), Err(ReadOnly));
    assert_eq!(s.symlink(&owner, dir.ino, b"g", b"t"), Err(ReadOnly));
    assert_eq!(s.unlink(&owner, dir.ino, b"f"), Err(ReadOnly));
    assert_eq!(s.rmdir(&owner, dir.ino, b"sub"), Err(ReadOnly));
    assert_eq!(s.link(&owner, f.ino, ROOT, b"g"), Err(ReadOnly));
    assert_eq!(s.rename(&owner, dir.ino, b"f", ROOT, b"g", 0), Err(ReadOnly));
    assert_eq!(s.rename(&owner, ROOT, b"d", ROOT, b"d2", 0), Err(ReadOnly), "the sealed directory itself moves");
    assert_eq!(s.rename(&owner, ROOT, b"other", dir.ino, b"sub", 0), Err(ReadOnly), "over a sealed entry");
    let x = SetXattr { ino: f.ino, name: b"user.k".to_vec(), value: b"v".to_vec(), flags: 0 };
    assert_eq!(code(s.mutate(&owner, MetaOp::SetXattr(x)).map(drop)), Err(ReadOnly));
    let open = Open { ino: f.ino, read: true, write: true, register: false };
    assert_eq!(code(s.open_file(&owner, &open).map(drop)), Err(ReadOnly));
    let open = Open { write: false, ..open };
    assert_eq!(code(s.open_file(&owner, &open)).map(|a| a.ino), Ok(f.ino), "a sealed file opens for reading");
    // Root refused too; unsealing lets changes through again.
    assert_eq!(s.unlink(&root(), dir.ino, b"f"), Err(ReadOnly));
    assert!(!seal(&mut s, &root(), dir.ino, false).unwrap().sealed);
    assert!(s.create(&owner, dir.ino, b"g", 0o644).is_ok());
    assert_eq!(s.unlink(&owner, dir.ino, b"f"), Err(ReadOnly), "f itself is still sealed");
    assert!(seal(&mut s, &owner, f.ino, false).is_ok());
    assert!(s.unlink(&owner, dir.ino, b"f").is_ok());
    assert!(s.stat(other.ino).is_ok());
}
