//! Crash recovery: state survives a dropped store (as after `kill -9`), with and without
//! snapshots, a damaged log tail is discarded, and retried requests stay idempotent.

mod common;

use common::*;
use odfs_metad::{MetaError, MetaOp, MetaReply, MetaStore, StoreOptions};
use odfs_proto::meta::*;
use odfs_proto::{DirLayout, ErrorCode, InodeId, RequestHeader, Timespec};
use std::io::Write;
use std::path::Path;

/// Runs a varied workload touching every kind of mutation; returns how many succeeded.
fn workload(s: &mut MetaStore, round: u32) -> usize {
    let h = root();
    let u = user(1000);
    s.set_root_owner(0, 0, 0o777).unwrap();
    let mut ok = 0;
    let mut count = |r: bool| ok += r as usize;
    let top = format!("r{round}");
    let d = s.mkdir(&h, ROOT, top.as_bytes(), 0o777).unwrap().ino;
    for i in 0..200u32 {
        let sub = s.mkdir(&u, d, format!("d{i}").as_bytes(), 0o755).unwrap().ino;
        for j in 0..5u32 {
            let f = s.create(&u, sub, format!("f{j}").as_bytes(), 0o644).unwrap();
            if j == 0 {
                count(s.link(&u, f.ino, d, format!("link{i}").as_bytes()).is_ok());
            }
            if j == 1 {
                let ext = ExtendSize { ino: f.ino, size: 4096 * i as u64, mtime: Timespec { sec: i as i64, nsec: j } };
                count(s.mutate(&u, MetaOp::ExtendSize(ext)).is_ok());
            }
            if j == 2 {
                let x = SetXattr { ino: f.ino, name: b"user.k".to_vec(), value: vec![i as u8; 10], flags: 0 };
                count(s.mutate(&u, MetaOp::SetXattr(x)).is_ok());
            }
        }
        count(s.symlink(&u, sub, b"sym", format!("../d{i}/f0").as_bytes()).is_ok());
        count(s.unlink(&u, sub, b"f3").is_ok());
        count(s.rename(&u, sub, b"f4", d, format!("moved{i}").as_bytes(), 0).is_ok());
        count(s.setattr(&u, SetAttr { ino: sub, mode: Some(0o750), ..Default::default() }).is_ok());
        if i % 3 == 0 {
            count(s.rename(&u, d, format!("d{i}").as_bytes(), ROOT, format!("top{round}-{i}").as_bytes(), 0).is_ok());
        }
        if i % 7 == 0 {
            let x = RemoveXattr { ino: s.find(&u, sub, b"f2").unwrap().ino, name: b"user.k".to_vec() };
            count(s.mutate(&u, MetaOp::RemoveXattr(x)).is_ok());
        }
        // Failures change nothing and are not logged.
        assert!(s.create(&u, sub, b"f0", 0o644).is_err());
        assert!(s.rmdir(&u, d, b"nope").is_err());
    }
    let empty = s.mkdir(&u, d, b"empty", 0o700).unwrap().ino;
    let layout = DirLayout { stripe_count: 2, ..DirLayout::default() };
    count(s.mutate(&u, MetaOp::SetDirLayout(SetDirLayout { ino: empty, layout })).is_ok());
    count(s.rmdir(&u, d, b"empty").is_ok());
    ok
}

#[test]
fn state_survives_a_dropped_store() {
    let tmp = tempfile::tempdir().unwrap();
    let mut s = open(tmp.path());
    workload(&mut s, 0);
    let before = dump(&s);
    let (seq, inodes) = (s.seq(), s.inode_count());
    assert!(before.len() > 1300, "{}", before.len());
    drop(s); // no snapshot: as if killed
    let mut s = open(tmp.path());
    assert_eq!(dump(&s), before);
    assert_eq!((s.seq(), s.inode_count()), (seq, inodes));
    // New inode ids continue after the recovered ones.
    let max = before.values().map(|v| v.attr.ino.0).max().unwrap();
    let n = s.create(&root(), ROOT, b"new", 0o644).unwrap();
    assert!(n.ino.0 > max);
}

#[test]
fn snapshot_then_more_mutations() {
    let tmp = tempfile::tempdir().unwrap();
    let mut s = open(tmp.path());
    workload(&mut s, 0);
    s.snapshot().unwrap();
    assert!(s.log_len() <= 8, "a snapshot starts an empty log");
    workload(&mut s, 1);
    let before = dump(&s);
    drop(s);
    let mut s = open(tmp.path());
    assert_eq!(dump(&s), before);
    // Snapshot at "clean shutdown": reopen replays nothing and still matches.
    workload(&mut s, 2);
    let before = dump(&s);
    s.snapshot().unwrap();
    drop(s);
    let s = open(tmp.path());
    assert_eq!(dump(&s), before);
    assert!(s.log_len() <= 8);
}

#[test]
fn automatic_snapshots_as_the_log_grows() {
    let tmp = tempfile::tempdir().unwrap();
    let opts = StoreOptions { snapshot_every_bytes: 64 << 10, ..StoreOptions::default() };
    let mut s = open_with(tmp.path(), opts.clone());
    workload(&mut s, 0);
    workload(&mut s, 1);
    assert!(tmp.path().join("snapshot").exists());
    assert!(s.log_len() < 64 << 10);
    let before = dump(&s);
    drop(s);
    let s = open_with(tmp.path(), opts);
    assert_eq!(dump(&s), before);
}

#[test]
fn synced_log_recovers_too() {
    let tmp = tempfile::tempdir().unwrap();
    let opts = StoreOptions { sync_wal: true, ..StoreOptions::default() };
    let mut s = open_with(tmp.path(), opts.clone());
    for i in 0..50 {
        s.create(&root(), ROOT, format!("f{i}").as_bytes(), 0o644).unwrap();
    }
    let before = dump(&s);
    drop(s);
    assert_eq!(dump(&open_with(tmp.path(), opts)), before);
}

fn append(path: &Path, bytes: &[u8]) {
    let mut f = std::fs::OpenOptions::new().append(true).open(path).unwrap();
    f.write_all(bytes).unwrap();
}

#[test]
fn garbage_or_torn_tail_is_ignored() {
    let tmp = tempfile::tempdir().unwrap();
    let log = tmp.path().join("wal");
    let mut s = open(tmp.path());
    workload(&mut s, 0);
    let before = dump(&s);
    drop(s);
    // Garbage after the last record.
    let garbage: Vec<u8> = (0..1000u32).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
    append(&log, &garbage);
    let mut s = open(tmp.path());
    assert_eq!(dump(&s), before);
    // The garbage was cut off: later records are not hidden behind it.
    s.create(&root(), ROOT, b"after-garbage", 0o644).unwrap();
    let before = dump(&s);
    let len_before_last = s.log_len();
    s.create(&root(), ROOT, b"torn", 0o644).unwrap();
    let with_torn = dump(&s);
    drop(s);
    assert_eq!(dump(&open(tmp.path())), with_torn);
    // A torn last record (cut mid-frame) is discarded: the state is as before that create.
    let f = std::fs::OpenOptions::new().write(true).open(&log).unwrap();
    let full = f.metadata().unwrap().len();
    assert!(full > len_before_last + 3);
    f.set_len(full - 3).unwrap();
    drop(f);
    let mut s = open(tmp.path());
    assert_eq!(dump(&s), before);
    // And the store keeps working after the cut.
    s.create(&root(), ROOT, b"torn", 0o644).unwrap();
    let before = dump(&s);
    drop(s);
    assert_eq!(dump(&open(tmp.path())), before);
}

#[test]
fn damaged_snapshot_is_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    let mut s = open(tmp.path());
    workload(&mut s, 0);
    s.snapshot().unwrap();
    drop(s);
    let path = tmp.path().join("snapshot");
    let mut bytes = std::fs::read(&path).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    std::fs::write(&path, bytes).unwrap();
    match MetaStore::open(tmp.path(), StoreOptions::default(), DirLayout::default()) {
        Err(MetaError::CorruptSnapshot { .. }) => {}
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("a damaged snapshot was accepted"),
    }
}

#[test]
fn another_shard_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let mut s = open(tmp.path());
    s.snapshot().unwrap();
    drop(s);
    let opts = StoreOptions { shard: 2, ..StoreOptions::default() };
    let e = MetaStore::open(tmp.path(), opts, DirLayout::default()).err().expect("refused");
    assert!(matches!(e, MetaError::ShardMismatch { found: 0, expected: 2, .. }), "{e}");
}

fn req(client: u64, id: u64) -> RequestHeader {
    RequestHeader { request_id: id, client_id: client, uid: 0, gid: 0, groups: vec![] }
}

#[test]
fn retried_requests_after_reopen_are_not_applied_twice() {
    let tmp = tempfile::tempdir().unwrap();
    let mut s = open(tmp.path());
    let create = MetaOp::Create(Create {
        parent: ROOT,
        name: b"f".to_vec(),
        mode: 0o644,
        exclusive: true,
        layout: None,
        register: false,
        node: None,
    });
    let unlink = MetaOp::Unlink(Unlink { parent: ROOT, name: b"g".to_vec() });
    let mkdir = MetaOp::Mkdir(Mkdir { parent: ROOT, name: b"d".to_vec(), mode: 0o755 });
    s.create(&root(), ROOT, b"g", 0o644).unwrap();
    let r_create = s.mutate(&req(9, 1), create.clone()).unwrap();
    let r_unlink = s.mutate(&req(9, 2), unlink.clone()).unwrap();
    assert!(matches!(&r_unlink, MetaReply::Unlink(u) if u.removed.is_some()));
    let before = dump(&s);
    drop(s);

    let mut s = open(tmp.path());
    assert_eq!(s.mutate(&req(9, 1), create.clone()).unwrap(), r_create);
    assert_eq!(s.mutate(&req(9, 2), unlink.clone()).unwrap(), r_unlink);
    assert_eq!(dump(&s), before, "retries changed nothing");
    // Another client's identical request ids are distinct requests.
    assert_eq!(code(s.mutate(&req(10, 1), create.clone())).map(|_| ()), Err(ErrorCode::Exists));
    // Through a snapshot, too.
    let r_mkdir = s.mutate(&req(9, 3), mkdir.clone()).unwrap();
    s.snapshot().unwrap();
    drop(s);
    let mut s = open(tmp.path());
    assert_eq!(s.mutate(&req(9, 3), mkdir).unwrap(), r_mkdir);
    assert_eq!(s.mutate(&req(9, 1), create).unwrap(), r_create);
    assert_eq!(s.mutate(&req(9, 2), unlink).unwrap(), r_unlink);
    assert_eq!(list(&s, ROOT, 100).len(), 2);
}

#[test]
fn dedup_table_is_bounded() {
    let tmp = tempfile::tempdir().unwrap();
    let opts = StoreOptions { dedup_capacity: 3, ..StoreOptions::default() };
    let mut s = open_with(tmp.path(), opts.clone());
    let mk = |i: u32| MetaOp::Mkdir(Mkdir { parent: ROOT, name: format!("d{i}").into_bytes(), mode: 0o755 });
    for i in 0..5 {
        s.mutate(&req(1, i as u64 + 1), mk(i)).unwrap();
    }
    drop(s);
    let mut s = open_with(tmp.path(), opts);
    // The three newest are remembered, the oldest two were evicted.
    for i in 2..5 {
        assert!(s.mutate(&req(1, i as u64 + 1), mk(i)).is_ok());
    }
    assert_eq!(code(s.mutate(&req(1, 1), mk(0))).map(|_| ()), Err(ErrorCode::Exists));
}

#[test]
fn replayed_state_matches_in_every_detail_of_a_create() {
    let tmp = tempfile::tempdir().unwrap();
    let mut s = open(tmp.path());
    // Layout choice depends on targets and a rotating counter: replay must not re-choose.
    let mut seen = Vec::new();
    for i in 0..20 {
        let a = s.create(&root(), ROOT, format!("f{i}").as_bytes(), 0o644).unwrap();
        seen.push(a);
    }
    drop(s);
    let mut s = MetaStore::open(tmp.path(), StoreOptions::default(), DirLayout::default()).unwrap();
    // No targets set: a re-choice at replay would have failed.
    for a in &seen {
        assert_eq!(&s.stat(a.ino).unwrap(), a);
    }
    assert_eq!(s.stat(InodeId(1)).unwrap().kind, FileKind::Dir);
}

/// A shard's part of an operation spanning shards, and a coordinator's intent, survive a crash:
/// a prepared step keeps its pin (other changes wait), a repeated step is answered as the
/// first, and the intent comes back with its decision.
#[test]
fn steps_and_intents_of_operations_spanning_shards_survive_a_crash() {
    let tmp = tempfile::tempdir().unwrap();
    let mut s = open(tmp.path());
    let f = s.create(&root(), ROOT, b"f", 0o644).unwrap();
    let step = |phase| {
        MetaOp::Step(Step {
            intent: 77,
            phase,
            change: StepChange::RemoveName { parent: ROOT, name: b"f".to_vec(), ino: f.ino, owner: 0, is_dir: false },
            client: 0,
        })
    };
    s.mutate(&req(77, 1), step(StepPhase::Prepare)).unwrap();
    let intent = odfs_metad::namespace::Intent {
        request: (5, 6),
        caller: (0, 0, vec![]),
        steps: vec![(0, StepChange::DropLink { ino: f.ino })],
        decided: false,
        kind: odfs_metad::namespace::IntentKind::Unlink,
    };
    s.mutate(&root(), MetaOp::BeginIntent { id: 99, intent }).unwrap();
    s.mutate(&root(), MetaOp::DecideIntent { id: 99 }).unwrap();
    drop(s);

    let mut s = open(tmp.path());
    // The pinned name refuses other changes until its step commits.
    assert_eq!(
        code(s.mutate(&root(), MetaOp::Unlink(Unlink { parent: ROOT, name: b"f".to_vec() }))).map(|_| ()),
        Err(ErrorCode::Busy)
    );
    assert_eq!(s.mutate(&req(77, 1), step(StepPhase::Prepare)).unwrap(), MetaReply::Step(StepReply::default()));
    s.mutate(&req(77, 2), step(StepPhase::Commit)).unwrap();
    assert_eq!(
        code(s.lookup(&root(), &Lookup { parent: ROOT, name: b"f".to_vec() })).map(|_| ()),
        Err(ErrorCode::NotFound)
    );
    // A repeated commit changes nothing more.
    s.mutate(&req(77, 2), step(StepPhase::Commit)).unwrap();
    drop(s);
    let mut s = open(tmp.path());
    let reply = MetaReply::Unlink(UnlinkReply { removed: None, parent: None });
    let end = MetaOp::EndIntent { id: 99, reply: Some(Box::new(reply.clone())) };
    // The intent came back decided; its end answers the client's retry from then on.
    assert_eq!(s.mutate(&req(5, 6), end).unwrap(), reply);
    assert_eq!(s.mutate(&req(5, 6), MetaOp::Unlink(Unlink { parent: ROOT, name: b"zz".to_vec() })).unwrap(), reply);
}

/// A client with a caching session (a create delegation needs one).
fn caching_client(s: &mut MetaStore, client_id: u64) -> RequestHeader {
    let h = RequestHeader { client_id, request_id: 1, ..root() };
    s.session_poll(&h, &SessionPoll { wait_ms: 0, acked: 0, open: Vec::new(), caching: true });
    h
}

/// A shard in `dir` with client 77 caching and a directory `d` it made under the root.
fn holder_and_dir(dir: &Path) -> (MetaStore, RequestHeader, InodeId) {
    let mut s = open(dir);
    s.set_root_owner(0, 0, 0o777).unwrap();
    let holder = caching_client(&mut s, 77);
    let d = s.mkdir(&RequestHeader { request_id: 2, ..holder.clone() }, ROOT, b"d", 0o777).unwrap().ino;
    (s, holder, d)
}

#[test]
fn reserved_inode_ids_survive_a_restart_and_deferred_creates_apply_after_it() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut s, holder, d) = holder_and_dir(tmp.path());

    // Another client caching the directory's names: no delegation (the holder creates as usual).
    let other = caching_client(&mut s, 88);
    s.lease_names(&other, d);
    let ask = DelegateCreates { dir: d, count: 8, node: None };
    let refused = s.delegate_creates(&RequestHeader { request_id: 3, ..holder.clone() }, &ask).unwrap_err();
    assert_eq!(refused.code, ErrorCode::InUse, "{refused}");
    s.end_session(88);

    let grant = s.delegate_creates(&RequestHeader { request_id: 4, ..holder.clone() }, &ask).unwrap();
    assert_eq!(grant.inos.len(), 8);
    assert_eq!(grant.dir.ino, d);
    let last_reserved = grant.inos.last().unwrap().0;
    drop(s); // as if killed: the reservation is in the log only

    let mut s = open(tmp.path());
    let n = s.create(&root(), ROOT, b"other", 0o644).unwrap();
    assert!(n.ino.0 > last_reserved.0, "a restarted shard gave out reserved id {} again", n.ino);

    // The holder's deferred create, sent after the restart: applied with its own id, layout,
    // time and caller, exactly once however often it is sent.
    let batch = RequestHeader { client_id: 77, request_id: 100, ..root() };
    let (ino, layout) = grant.inos[0].clone();
    let now = Timespec { sec: 1_700_000_000, nsec: 5 };
    let caller = RequestHeader { request_id: 101, client_id: 0, uid: 1000, gid: 1000, groups: vec![] };
    let create = Deferred::Create {
        caller: caller.clone(),
        parent: d,
        name: b"f".to_vec(),
        mode: 0o640,
        ino,
        layout: layout.clone(),
        now,
    };
    s.apply_deferred(&batch, &create).unwrap();
    s.apply_deferred(&batch, &create).unwrap();
    let f = s.find(&root(), d, b"f").unwrap();
    assert_eq!((f.ino, f.layout.as_ref(), f.mtime, f.uid, f.gid, f.mode), (ino, Some(&layout), now, 1000, 1000, 0o640));
    assert_eq!(list(&s, d, 100).len(), 1, "one file, however often its create was sent");

    // Its size, published at close and logged after the create.
    let mtime = Timespec { sec: 1_700_000_001, nsec: 0 };
    s.apply_deferred(&batch, &Deferred::Size { request_id: 102, ino, size: 3901, mtime }).unwrap();
    assert_eq!(s.find(&root(), d, b"f").unwrap().size, 3901);

    // Refused: an id that is not an unused reserved one, and a name taken meanwhile.
    let with = |name: &[u8], ino: InodeId, request_id: u64| Deferred::Create {
        caller: RequestHeader { request_id, ..caller.clone() },
        parent: d,
        name: name.to_vec(),
        mode: 0o644,
        ino,
        layout: layout.clone(),
        now,
    };
    let used = s.apply_deferred(&batch, &with(b"g", n.ino, 103)).unwrap_err();
    assert_eq!(used.code, ErrorCode::Invalid, "{used}");
    let unreserved = InodeId::new(0, last_reserved.local() + 1_000_000);
    assert_eq!(s.apply_deferred(&batch, &with(b"g", unreserved, 104)).unwrap_err().code, ErrorCode::Invalid);
    s.create(&root(), d, b"taken", 0o644).unwrap();
    let taken = s.apply_deferred(&batch, &with(b"taken", grant.inos[1].0, 105)).unwrap_err();
    assert_eq!(taken.code, ErrorCode::Exists, "{taken}");

    // A deferred unlink in the restarted shard's grace (it cannot yet know which clients hold
    // files open): the name goes, the file stays an orphan until the orphans are collected.
    let (h_ino, _) = grant.inos[2].clone();
    s.apply_deferred(&batch, &with(b"h", h_ino, 106)).unwrap();
    let unlink = Deferred::Unlink {
        caller: RequestHeader { request_id: 107, ..caller.clone() },
        parent: d,
        name: b"h".to_vec(),
        ino: h_ino,
        ctime: now,
        now: mtime,
    };
    let (_, reply) = s.apply_deferred(&batch, &unlink).unwrap();
    assert!(matches!(reply, MetaReply::Unlink(UnlinkReply { removed: None, .. })), "{reply:?}");
    assert_eq!(s.find(&root(), d, b"h").unwrap_err(), ErrorCode::NotFound);

    // Logged as the requests they are: all of it survives the next restart.
    let before = dump(&s);
    drop(s);
    let s = open(tmp.path());
    assert_eq!(dump(&s), before);
}

#[test]
fn a_deferred_unlink_removes_the_file_it_named_and_returns_it_for_its_chunks() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut s, holder, d) = holder_and_dir(tmp.path());
    let ask = DelegateCreates { dir: d, count: 2, node: None };
    let grant = s.delegate_creates(&RequestHeader { request_id: 3, ..holder.clone() }, &ask).unwrap();
    let batch = RequestHeader { client_id: 77, request_id: 100, ..root() };
    let caller = RequestHeader { request_id: 0, client_id: 0, uid: 1000, gid: 1000, groups: vec![] };
    let now = Timespec { sec: 1_700_000_000, nsec: 0 };
    let create = |name: &[u8], i: usize, request_id: u64| Deferred::Create {
        caller: RequestHeader { request_id, ..caller.clone() },
        parent: d,
        name: name.to_vec(),
        mode: 0o644,
        ino: grant.inos[i].0,
        layout: grant.inos[i].1.clone(),
        now,
    };
    let unlink = |name: &[u8], i: usize, request_id: u64| Deferred::Unlink {
        caller: RequestHeader { request_id, ..caller.clone() },
        parent: d,
        name: name.to_vec(),
        ino: grant.inos[i].0,
        ctime: now,
        now: Timespec { sec: 1_700_000_002, nsec: 0 },
    };
    s.apply_deferred(&batch, &create(b"f", 0, 101)).unwrap();
    s.apply_deferred(&batch, &create(b"g", 1, 102)).unwrap();
    let f = grant.inos[0].0;
    s.apply_deferred(&batch, &Deferred::Size { request_id: 103, ino: f, size: 3901, mtime: now }).unwrap();

    // Refused: a name that names another file by now. Nothing changes.
    let other = s.apply_deferred(&batch, &unlink(b"g", 0, 104)).unwrap_err();
    assert_eq!(other.code, ErrorCode::NotFound, "{other}");
    assert_eq!(s.find(&root(), d, b"g").unwrap().ino, grant.inos[1].0);
    // Refused: a file changed since the client saw it (another client wrote it while this one
    // was cut off; here its size published later). It is kept.
    let later = Timespec { sec: 1_700_000_001, nsec: 0 };
    let g = grant.inos[1].0;
    s.mutate(&root(), MetaOp::ExtendSize(ExtendSize { ino: g, size: 10, mtime: later })).unwrap();
    let changed = s.apply_deferred(&batch, &unlink(b"g", 1, 106)).unwrap_err();
    assert_eq!(changed.code, ErrorCode::InUse, "{changed}");
    assert_eq!(s.find(&root(), d, b"g").unwrap().size, 10);

    // Applied: the file is gone, its attributes come back for its chunks, the directory's
    // times are the client's; the same reply when the batch is sent again.
    for _ in 0..2 {
        let (_, reply) = s.apply_deferred(&batch, &unlink(b"f", 0, 105)).unwrap();
        let MetaReply::Unlink(UnlinkReply { removed: Some(gone), parent: Some(dir) }) = reply else {
            panic!("a deferred unlink of a file's last name answered {reply:?}")
        };
        assert_eq!((gone.ino, gone.size, gone.layout.as_ref()), (f, 3901, Some(&grant.inos[0].1)));
        assert_eq!(dir.mtime, Timespec { sec: 1_700_000_002, nsec: 0 });
    }
    assert_eq!(s.find(&root(), d, b"f").unwrap_err(), ErrorCode::NotFound);
    assert_eq!(list(&s, d, 100).len(), 1);

    // Logged as the unlink it is: the same after a restart.
    let before = dump(&s);
    drop(s);
    assert_eq!(dump(&open(tmp.path())), before);
}
