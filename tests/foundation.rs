//! Foundation end-to-end tests: real mgmtd, metad and stored processes on loopback, driven
//! through the `odfs` CLI and the client library.

use odfs_client::{Client, ClientError, Ctx};
use odfs_proto::meta::{FileKind, SetAttr, RENAME_NOREPLACE};
use odfs_proto::{ErrorCode, InodeId};
use odfs_tests::*;
use std::collections::HashSet;

fn code<T: std::fmt::Debug>(r: Result<T, ClientError>) -> ErrorCode {
    r.expect_err("expected an error").code()
}

async fn write_file(c: &Client, ctx: &Ctx, parent: InodeId, name: &str, data: &[u8]) -> InodeId {
    let (r, h) = c.create_open(ctx, parent, name.as_bytes(), 0o644, false, None).await.unwrap();
    h.write(0, data).await.unwrap();
    h.close().await.unwrap();
    r.attr.ino
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gigabyte_file_is_striped_evenly_and_reads_back_identical() {
    let fs = LocalFs::up(4, &["--stripe-count", "4", "--chunk-size", "1048576"]);
    let c = fs.client().await;
    let ctx = Ctx::current();
    let size: u64 = 1 << 30;
    let piece = 8 << 20;
    let (r, h) = c.create_open(&ctx, InodeId::ROOT, b"big", 0o644, true, None).await.unwrap();
    assert_eq!(r.attr.layout.as_ref().unwrap().targets.len(), 4);
    let mut want = Vec::new();
    let mut off = 0u64;
    while off < size {
        let d = pattern(piece, off / piece as u64 + 7);
        want.push(sha256(&d));
        h.write(off, &d).await.unwrap();
        off += piece as u64;
    }
    h.fsync().await.unwrap();
    h.close().await.unwrap();
    // Fresh client: nothing cached.
    let c2 = fs.client().await;
    let a = c2.lookup(&ctx, InodeId::ROOT, b"big").await.unwrap();
    assert_eq!(a.size, size);
    let h = c2.open(&ctx, a.ino, true, false, false).await.unwrap();
    let mut off = 0u64;
    let mut i = 0;
    while off < size {
        let d = h.read(off, piece as u32).await.unwrap();
        assert_eq!(d.len(), piece, "short read at {off}");
        assert_eq!(sha256(&d), want[i], "piece {i} differs");
        off += piece as u64;
        i += 1;
    }
    h.close().await.unwrap();
    // Each node's data directory holds a quarter of the chunks (chunk file of 256 MiB ± 1 chunk).
    for k in 0..4 {
        let chunks = walk_files(&fs.node_dir(k));
        let total: u64 =
            chunks.iter().filter(|p| p.contains("/chunks/")).map(|p| std::fs::metadata(p).unwrap().len()).sum();
        let quarter = size / 4;
        assert!(total.abs_diff(quarter) <= 1 << 20, "node {k} holds {total} bytes, expected {quarter} ± 1 MiB");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn namespace_operations_and_their_errors() {
    let fs = LocalFs::up(2, &[]);
    let c = fs.client().await;
    let root = Ctx::root();
    let dir = c.mkdir(&root, InodeId::ROOT, b"d", 0o755).await.unwrap();
    // Create with O_EXCL of an existing name.
    let f = write_file(&c, &root, dir.ino, "a", b"first").await;
    assert_eq!(code(c.create(&root, dir.ino, b"a", 0o644, true, None).await), ErrorCode::Exists);
    // Rename over an existing file replaces it atomically.
    let g = write_file(&c, &root, dir.ino, "b", b"second").await;
    c.rename(&root, dir.ino, b"b", dir.ino, b"a", 0).await.unwrap();
    let a = c.lookup(&root, dir.ino, b"a").await.unwrap();
    assert_eq!(a.ino, g);
    assert_ne!(a.ino, f);
    assert_eq!(read_all(&c, &root, a.ino).await, b"second");
    assert_eq!(code(c.lookup(&root, dir.ino, b"b").await), ErrorCode::NotFound);
    // The replaced file's chunks go from every target (after the moment a caching client keeps
    // them for an open that resolved the old name just before: 2 s).
    let name = format!("{:016x}", f.0);
    let remain = || (0..2).any(|k| walk_files(&fs.node_dir(k)).iter().any(|p| p.ends_with(&name)));
    let t = std::time::Instant::now();
    while remain() {
        assert!(t.elapsed() < std::time::Duration::from_secs(15), "chunks of the replaced file remain");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    // NOREPLACE.
    write_file(&c, &root, dir.ino, "c", b"x").await;
    assert_eq!(code(c.rename(&root, dir.ino, b"c", dir.ino, b"a", RENAME_NOREPLACE).await), ErrorCode::Exists);
    // Rename across directories.
    let d2 = c.mkdir(&root, InodeId::ROOT, b"d2", 0o755).await.unwrap();
    c.rename(&root, dir.ino, b"c", d2.ino, b"c2", 0).await.unwrap();
    assert_eq!(read_all(&c, &root, c.lookup(&root, d2.ino, b"c2").await.unwrap().ino).await, b"x");
    // rmdir of a non-empty directory.
    assert_eq!(code(c.rmdir(&root, InodeId::ROOT, b"d").await), ErrorCode::NotEmpty);
    assert_eq!(code(c.rmdir(&root, dir.ino, b"a").await), ErrorCode::NotDir);
    assert_eq!(code(c.unlink(&root, InodeId::ROOT, b"d").await), ErrorCode::IsDir);
    // Names: 255 bytes fine, 256 too long, bad names invalid.
    let long = vec![b'n'; 255];
    c.create(&root, dir.ino, &long, 0o644, true, None).await.unwrap();
    assert_eq!(code(c.create(&root, dir.ino, &[b'n'; 256], 0o644, true, None).await), ErrorCode::NameTooLong);
    for bad in [&b""[..], b".", b"..", b"x/y", b"x\0y"] {
        assert_eq!(code(c.create(&root, dir.ino, bad, 0o644, true, None).await), ErrorCode::Invalid, "{bad:?}");
    }
    // Symlink, hard link, xattrs.
    let s = c.symlink(&root, dir.ino, b"s", b"a").await.unwrap();
    assert_eq!(s.kind, FileKind::Symlink);
    assert_eq!(c.readlink(&root, s.ino).await.unwrap(), b"a");
    let l = c.link(&root, a.ino, d2.ino, b"hard").await.unwrap();
    assert_eq!(l.nlink, 2);
    c.unlink(&root, dir.ino, b"a").await.unwrap();
    assert_eq!(read_all(&c, &root, l.ino).await, b"second", "data must survive while a link remains");
    c.setxattr(&root, l.ino, b"user.k", b"v", 0).await.unwrap();
    assert_eq!(c.getxattr(&root, l.ino, b"user.k").await.unwrap(), b"v");
    assert_eq!(code(c.getxattr(&root, l.ino, b"user.none").await), ErrorCode::NoData);

    // Permissions: uid 1000 may not create in a 0755 directory owned by root.
    let user = Ctx { uid: 1000, gid: 1000, groups: vec![] };
    assert_eq!(code(c.create(&user, dir.ino, b"u", 0o644, true, None).await), ErrorCode::Access);
    assert_eq!(code(c.mkdir(&user, dir.ino, b"u", 0o755).await), ErrorCode::Access);
    // Sticky bit: in a 1777 directory, another user cannot delete someone else's file.
    let tmp = c.mkdir(&root, InodeId::ROOT, b"tmp", 0o1777).await.unwrap();
    let other = Ctx { uid: 2000, gid: 2000, groups: vec![] };
    c.create(&user, tmp.ino, b"mine", 0o666, true, None).await.unwrap();
    assert_eq!(code(c.unlink(&other, tmp.ino, b"mine").await), ErrorCode::Perm);
    assert_eq!(code(c.rename(&other, tmp.ino, b"mine", tmp.ino, b"stolen", 0).await), ErrorCode::Perm);
    c.unlink(&user, tmp.ino, b"mine").await.unwrap();
    // chmod by a non-owner.
    assert_eq!(
        code(c.setattr(&other, SetAttr { ino: tmp.ino, mode: Some(0o777), ..Default::default() }).await),
        ErrorCode::Perm
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_thousand_entries_listed_exactly_once() {
    let fs = LocalFs::up(1, &[]);
    let c = fs.client().await;
    let ctx = Ctx::root();
    let dir = c.mkdir(&ctx, InodeId::ROOT, b"many", 0o755).await.unwrap();
    let n = 100_000;
    let mut tasks = Vec::new();
    for t in 0..16 {
        let c = c.clone();
        let ctx = ctx.clone();
        tasks.push(tokio::spawn(async move {
            for i in (t..n).step_by(16) {
                c.create(&ctx, dir.ino, format!("e{i}").as_bytes(), 0o644, true, None).await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let mut seen = HashSet::new();
    let mut cookie = 0;
    loop {
        let r = c.readdir(&ctx, dir.ino, cookie, 1000, false).await.unwrap();
        for e in &r.entries {
            assert!(seen.insert(e.name.clone()), "{:?} listed twice", String::from_utf8_lossy(&e.name));
        }
        if let Some(l) = r.entries.last() {
            cookie = l.cookie;
        }
        if r.eof {
            break;
        }
    }
    assert_eq!(seen.len(), n);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sparse_files_holes_and_truncate() {
    let fs = LocalFs::up(3, &["--stripe-count", "3", "--chunk-size", "65536"]);
    let c = fs.client().await;
    let ctx = Ctx::root();
    let (r, h) = c.create_open(&ctx, InodeId::ROOT, b"sparse", 0o644, true, None).await.unwrap();
    // Data at 0 and at 1 MiB + 5 (a hole between, spanning several chunks and targets).
    h.write(0, b"head").await.unwrap();
    h.write((1 << 20) + 5, b"tail").await.unwrap();
    h.close().await.unwrap();
    let ino = r.attr.ino;
    let data = read_all(&c, &ctx, ino).await;
    assert_eq!(data.len(), (1 << 20) + 9);
    assert_eq!(&data[..4], b"head");
    assert!(data[4..(1 << 20) + 5].iter().all(|&b| b == 0), "hole must read as zeros");
    assert_eq!(&data[(1 << 20) + 5..], b"tail");
    // Truncate down into the first chunk, then up again: the old bytes must not come back.
    c.truncate(&ctx, ino, 2, odfs_client::Truncate::CheckAccess).await.unwrap();
    assert_eq!(read_all(&c, &ctx, ino).await, b"he");
    c.truncate(&ctx, ino, 200_000, odfs_client::Truncate::CheckAccess).await.unwrap();
    let d = read_all(&c, &ctx, ino).await;
    assert_eq!(d.len(), 200_000);
    assert_eq!(&d[..2], b"he");
    assert!(d[2..].iter().all(|&b| b == 0));
    assert_eq!(c.getattr(&ctx, ino).await.unwrap().size, 200_000);
    // Writes at odd offsets across chunk boundaries.
    let h = c.open(&ctx, ino, true, true, false).await.unwrap();
    let blob = pattern(300_001, 3);
    h.write(65_535, &blob).await.unwrap();
    assert_eq!(h.read(65_535, 300_001).await.unwrap(), blob, "read-your-writes before close");
    h.close().await.unwrap();
    let d = read_all(&c, &ctx, ino).await;
    assert_eq!(&d[65_535..65_535 + 300_001], &blob[..]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_target_returns_enospc_and_keeps_earlier_data() {
    let dir = tempfile::Builder::new().prefix("odfs-enospc-").tempdir().unwrap();
    let mount = TmpfsMount::new(&dir.path().join("node0/target1"), "8m");
    let fs = LocalFs::up_in(dir, 1, &["--stripe-count", "1"]);
    let c = fs.client().await;
    let ctx = Ctx::root();
    let keep = pattern(1 << 20, 11);
    let kept = write_file(&c, &ctx, InodeId::ROOT, "kept", &keep).await;
    let (_, h) = c.create_open(&ctx, InodeId::ROOT, b"filler", 0o644, true, None).await.unwrap();
    let block = pattern(1 << 20, 12);
    let mut err = None;
    for i in 0..32u64 {
        if let Err(e) = h.write(i << 20, &block).await {
            err = Some(e);
            break;
        }
        if let Err(e) = h.flush().await {
            err = Some(e);
            break;
        }
    }
    let e = err.expect("writing 32 MiB to an 8 MiB target must fail");
    assert_eq!(e.code(), ErrorCode::NoSpace, "{e}");
    assert_eq!(e.errno(), libc::ENOSPC);
    drop(h);
    assert_eq!(read_all(&c, &ctx, kept).await, keep, "earlier data must stay intact");
    fs.down();
    drop(mount);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_job_credential_is_refused_and_changes_nothing() {
    let fs = LocalFs::up(1, &[]);
    let good = fs.config();
    let c = fs.client().await;
    let ctx = Ctx::root();
    let before = c.readdir_all(&ctx, InodeId::ROOT, false).await.unwrap().len();
    // Same site key, another job id.
    // Refused at once, with its reason: no retry makes another job's credential this one's
    // (the client's 30 s retry deadline is its default here).
    let mut other = good.clone();
    other.job.id = "some-other-job".into();
    let t = std::time::Instant::now();
    let e = Client::connect(other).await.err().expect("another job's client must be refused");
    let took = t.elapsed();
    assert!(e.to_string().contains("mgmtd") && e.to_string().contains("credential"), "{e}");
    assert!(took.as_secs() < 2, "a refused credential was retried for {took:?}: {e}");
    // Another site key, same job id.
    let key = fs.root().join("other.key");
    odfs_rpc::SiteKey::generate().write_new(&key).unwrap();
    let mut other = good.clone();
    other.job.site_key = key;
    other.retry_secs = 1;
    assert!(Client::connect(other).await.is_err());
    // A raw TCP connection with the wrong credential is refused by every TCP server: stored's
    // (chunks) and metad's (metadata).
    let view = c.cluster().refresh().await.unwrap();
    let wrong = odfs_rpc::JobCredential::derive(&odfs_rpc::SiteKey::from_bytes([9; 32]), &good.job.id).unwrap();
    let tcp: Vec<_> = view.services.iter().filter_map(|s| Some((s.kind, s.bulk_addr?))).collect();
    for kind in [odfs_proto::mgmt::ServiceKind::Storage, odfs_proto::mgmt::ServiceKind::Meta] {
        assert!(tcp.iter().any(|(k, _)| *k == kind), "no {kind:?} service serves TCP: {tcp:?}");
    }
    for (kind, addr) in tcp {
        match odfs_rpc::tcp::connect(&wrong, addr).await {
            Err(e @ odfs_rpc::RpcError::Credential(_)) => {
                assert!(!e.retryable() && e.to_string().contains("credential"))
            }
            Err(e) => panic!("{kind:?} at {addr}: not a credential refusal: {e}"),
            Ok(_) => panic!("{kind:?} at {addr} took a wrong credential"),
        }
    }
    assert_eq!(c.readdir_all(&ctx, InodeId::ROOT, false).await.unwrap().len(), before);
}

#[test]
fn local_up_down_leaves_nothing_and_refuses_a_second_up() {
    let fs = LocalFs::up(2, &[]);
    let pids = fs.all_pids();
    assert_eq!(pids.len(), 6, "mgmtd, metad, 2 stored and 2 stage agents");
    assert!(pids.iter().all(|&p| alive(p)));
    let out = odfs(&["local", "up", "--no-mount", "--root", fs.root_str(), "--nodes", "2"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("already running"), "{err}");
    assert!(pids.iter().all(|&p| alive(p)), "a refused up must not disturb the running filesystem");
    let status = odfs_ok(&["--fs", fs.config_path().to_str().unwrap(), "status"]);
    assert!(status.contains("Ready"), "{status}");
    assert_eq!(status.matches("online").count(), 2 + 1 + 2 + 2, "2 stored, metad, 2 agents, 2 targets: {status}");
    fs.down();
    for p in pids {
        assert!(!alive(p), "pid {p} still running after down");
    }
    // No lock is held: the root can be brought up again at once.
    let out = odfs(&["local", "up", "--no-mount", "--root", fs.root_str(), "--nodes", "1"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    fs.down();
}

/// Bytes in a size as `odfs` prints it ("8.0 MiB", "512 B").
fn printed_bytes(text: &str) -> u64 {
    let mut f = text.split_whitespace();
    let v: f64 = f.next().unwrap().parse().unwrap();
    let unit = f.next().unwrap();
    let unit = ["B", "KiB", "MiB", "GiB", "TiB"].iter().position(|u| *u == unit).unwrap_or_else(|| panic!("{text}"));
    (v * (1u64 << (10 * unit)) as f64) as u64
}

#[test]
fn local_down_says_what_it_left_and_wipe_removes_the_data() {
    let dir = tempfile::Builder::new().prefix("odfs-test-").tempdir().unwrap();
    std::fs::write(dir.path().join("notes.txt"), b"the user's own").unwrap();
    let fs = LocalFs::up_in(dir, 2, &[]);
    let src = tempfile::tempdir().unwrap();
    std::fs::write(src.path().join("big"), pattern(8 << 20, 11)).unwrap();
    fs.cli_ok(&["cp", src.path().join("big").to_str().unwrap(), "odfs:/big"]);
    let root = fs.root_str();
    // Without --wipe the data stays, and the last line says how much and how to remove it.
    let out = fs.down();
    let last = out.lines().last().unwrap();
    let left = last.strip_prefix("odfs local down: left ").unwrap_or_else(|| panic!("{out}"));
    assert!(printed_bytes(left) >= 8 << 20, "8 MiB of chunks stay: {last}");
    assert!(last.contains(&format!("under {root} ")) && last.contains("--wipe"), "{last}");
    assert!(fs.node_dir(0).is_dir() && fs.node_dir(1).is_dir());
    // --wipe (after the processes are gone, or with them) removes what up made, and keeps the
    // rest; then ROOT goes with the last of it.
    let out = odfs_ok(&["local", "down", "--root", root, "--wipe"]);
    let last = out.lines().last().unwrap();
    assert!(last.starts_with(&format!("odfs local down: wiped what odfs made under {root} (")), "{out}");
    assert!(last.ends_with("left only what it did not make: notes.txt"), "{last}");
    assert_eq!(entries(fs.root()), ["notes.txt"]);
    std::fs::remove_file(fs.root().join("notes.txt")).unwrap();

    // A running filesystem: --wipe stops it and removes everything, ROOT included.
    let fs = LocalFs::up(2, &[]);
    fs.cli_ok(&["cp", src.path().join("big").to_str().unwrap(), "odfs:/big"]);
    let pids = fs.all_pids();
    let out = odfs_ok(&["local", "down", "--root", fs.root_str(), "--wipe"]);
    let last = out.lines().last().unwrap();
    let wiped =
        last.strip_prefix(&format!("odfs local down: wiped {} (", fs.root_str())).unwrap_or_else(|| panic!("{out}"));
    assert!(wiped.ends_with("): nothing left"), "{last}");
    assert!(printed_bytes(wiped.trim_end_matches("): nothing left")) >= 8 << 20, "{last}");
    assert!(!fs.root().exists(), "{} is still there", fs.root_str());
    assert!(pids.iter().all(|&p| !alive(p)), "a process outlived down --wipe");
    let out = odfs_ok(&["local", "down", "--root", fs.root_str(), "--wipe"]);
    assert!(out.trim_end().ends_with("does not exist: nothing left"), "{out}");
}

#[test]
fn failed_start_stops_everything_and_says_why() {
    let dir = tempfile::tempdir().unwrap();
    // A node directory that is a file makes that node's stored fail to start.
    std::fs::create_dir_all(dir.path().join("node1")).unwrap();
    std::fs::write(dir.path().join("node1/target2"), b"not a directory").unwrap();
    let out =
        odfs(&["local", "up", "--no-mount", "--root", dir.path().to_str().unwrap(), "--nodes", "2", "--timeout", "10"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("stored on node 1"), "{err}");
    assert!(err.contains("everything it started was stopped"), "{err}");
    assert!(!dir.path().join("local.state.toml").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_storage_node_goes_offline_and_comes_back() {
    let fs = LocalFs::up(2, &[]);
    let c = fs.client().await;
    let target_of_node1 = |v: &odfs_proto::mgmt::ClusterView| v.targets.iter().find(|t| t.node == 1).unwrap().online;
    assert!(target_of_node1(&c.cluster().refresh().await.unwrap()));
    // 4 MiB over both nodes' targets.
    let striped = write_file(&c, &Ctx::root(), InodeId::ROOT, "striped", &pattern(4 << 20, 3)).await;
    fs.kill9("stored", 1);
    let t = std::time::Instant::now();
    loop {
        let v = c.cluster().refresh().await.unwrap();
        if !target_of_node1(&v) {
            let s =
                v.services.iter().find(|s| s.node == 1 && s.kind == odfs_proto::mgmt::ServiceKind::Storage).unwrap();
            assert!(!s.online);
            break;
        }
        assert!(t.elapsed().as_secs() < 10, "node 1 still online 10 s after its stored died");
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    // `odfs status` says so too, and counts only the storage service that still serves.
    let status = odfs_ok(&["--fs", fs.config_path().to_str().unwrap(), "status"]);
    assert!(status.contains("OFFLINE"), "{status}");
    assert!(status.contains("storage services 1/2  meta 1/1"), "{status}");
    // A read of a chunk on the offline target fails with EIO at once — through a mount that
    // has none of it cached, and through the library — instead of waiting out the 30 s the
    // client retries a stored that may come back.
    let mount = FuseMount::start(&fs);
    let t = std::time::Instant::now();
    let e = std::fs::read(mount.p("striped")).unwrap_err();
    let through_mount = t.elapsed();
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    let t = std::time::Instant::now();
    let h = c.open(&Ctx::root(), striped, true, false, false).await.unwrap();
    let e = h.read(0, 4 << 20).await.unwrap_err();
    let through_lib = t.elapsed();
    assert_eq!(e.errno(), libc::EIO, "{e}");
    assert!(e.to_string().contains("is offline"), "{e}");
    h.close().await.unwrap();
    eprintln!("EIO after {through_mount:?} through the mount, {through_lib:?} through the library");
    assert!(
        through_mount.as_secs() < 10 && through_lib.as_secs() < 10,
        "reads of an offline target waited: {through_mount:?} through the mount, {through_lib:?} through the library"
    );
    drop(mount);
    // A restart whose daemon cannot come back (its target is not a directory) fails and says
    // why, rather than leaving a filesystem that looks up.
    let target = fs.root().join("node1/target2");
    let away = fs.root().join("node1/target2.away");
    std::fs::rename(&target, &away).unwrap();
    std::fs::write(&target, b"not a directory").unwrap();
    let out = odfs(&["local", "restart", "--root", fs.root_str(), "--service", "stored", "--node", "1"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("stored on node 1 exited after its restart"), "{err}");
    assert!(err.contains("target2"), "the log tail names the target: {err}");
    std::fs::remove_file(&target).unwrap();
    std::fs::rename(&away, &target).unwrap();
    fs.restart("stored", 1);
    let t = std::time::Instant::now();
    while !target_of_node1(&c.cluster().refresh().await.unwrap()) {
        assert!(t.elapsed().as_secs() < 10, "restarted stored did not come back online");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let status = odfs_ok(&["--fs", fs.config_path().to_str().unwrap(), "status"]);
    assert!(status.contains("storage services 2/2"), "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_to_open_between_two_clients() {
    let fs = LocalFs::up(2, &["--stripe-count", "2", "--chunk-size", "65536"]);
    let a = fs.client().await;
    let b = fs.client().await;
    let ctx = Ctx::root();
    let ino = write_file(&a, &ctx, InodeId::ROOT, "shared", &pattern(100_000, 1)).await;
    assert_eq!(b.lookup(&ctx, InodeId::ROOT, b"shared").await.unwrap().size, 100_000);
    // A grows the file and closes; B's next open sees all of it, whatever B cached.
    let h = a.open(&ctx, ino, true, true, false).await.unwrap();
    h.write(100_000, &pattern(50_000, 2)).await.unwrap();
    h.close().await.unwrap();
    let data = read_all(&b, &ctx, ino).await;
    assert_eq!(data.len(), 150_000);
    assert_eq!(&data[100_000..], &pattern(50_000, 2)[..]);
    // A rename on A is seen by B once its cached name expires (attr_cache_ms, 1 s by default).
    a.rename(&ctx, InodeId::ROOT, b"shared", InodeId::ROOT, b"moved", 0).await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    assert_eq!(code(b.lookup(&ctx, InodeId::ROOT, b"shared").await), ErrorCode::NotFound);
    assert_eq!(b.lookup(&ctx, InodeId::ROOT, b"moved").await.unwrap().ino, ino);
}

/// Everything below `dir`: relative path → (kind, mode, mtime, sha256 of the bytes or the link).
fn tree(dir: &std::path::Path) -> std::collections::BTreeMap<String, (char, u32, i64, String)> {
    use std::os::unix::fs::MetadataExt;
    let mut out = std::collections::BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(p) = stack.pop() {
        let m = std::fs::symlink_metadata(&p).unwrap();
        let rel = p.strip_prefix(dir).unwrap().display().to_string();
        let row = if m.is_dir() {
            for e in std::fs::read_dir(&p).unwrap() {
                stack.push(e.unwrap().path());
            }
            ('d', m.mode() & 0o7777, m.mtime(), String::new())
        } else if m.is_symlink() {
            // cp keeps a link's target, not its own time.
            ('l', 0, 0, std::fs::read_link(&p).unwrap().display().to_string())
        } else {
            ('f', m.mode() & 0o7777, m.mtime(), sha256(&std::fs::read(&p).unwrap()))
        };
        out.insert(rel, row);
    }
    out
}

#[test]
fn odfs_cp_copies_trees_in_and_out_keeping_bytes_modes_times_and_links() {
    use std::fs;
    let fs_ = LocalFs::up(3, &["--stripe-count", "3", "--chunk-size", "65536"]);
    let work = tempfile::tempdir().unwrap();
    let ds = work.path().join("ds");
    fs::create_dir_all(ds.join("a/b")).unwrap();
    // Files of several 4 MiB copy pieces, odd sizes, empty; modes and times of their own.
    fs::write(ds.join("big"), pattern((9 << 20) + 3, 1)).unwrap();
    fs::write(ds.join("a/small"), pattern(1000, 2)).unwrap();
    fs::write(ds.join("a/b/empty"), b"").unwrap();
    fs::write(ds.join("a/b/x"), pattern(70_000, 3)).unwrap();
    std::os::unix::fs::symlink("b/x", ds.join("a/link")).unwrap();
    fs::set_permissions(ds.join("a/small"), std::os::unix::fs::PermissionsExt::from_mode(0o640)).unwrap();
    fs::set_permissions(ds.join("a/b"), std::os::unix::fs::PermissionsExt::from_mode(0o750)).unwrap();
    for (p, at) in [("big", "@1600000000"), ("a/b/x", "@1650000000"), ("a/b", "@1610000000"), ("a", "@1620000000")] {
        assert!(std::process::Command::new("touch")
            .args(["-m", "-h", "-d", at])
            .arg(ds.join(p))
            .status()
            .unwrap()
            .success());
    }
    let want = tree(&ds);
    let s = |p: &std::path::Path| p.display().to_string();

    // In: into an existing directory the source keeps its name; out: to a new name.
    fs_.cli_ok(&["cp", "-r", &s(&ds), "odfs:/"]);
    let back = work.path().join("back");
    let out = fs_.cli_ok(&["cp", "-r", "odfs:/ds", &s(&back)]);
    assert!(out.contains("copied 4 files, 1 links, 3 directories, 9508187 bytes"), "{out}");
    assert_eq!(tree(&back), want, "ds -> odfs:/ds -> back");

    // SRC/. copies the contents into DST itself, beside what DST holds already.
    fs_.cli_ok(&["mkdir", "odfs:/merged"]);
    fs_.cli_ok(&["cp", &s(&ds.join("a/small")), "odfs:/merged/keep"]);
    fs_.cli_ok(&["cp", "-r", &format!("{}/.", s(&ds)), "odfs:/merged"]);
    let local = work.path().join("merged");
    fs::create_dir(&local).unwrap();
    fs_.cli_ok(&["cp", "-r", "odfs:/merged/.", &s(&local)]);
    let mut got = tree(&local);
    assert_eq!(got.remove("keep").map(|r| r.3), Some(sha256(&pattern(1000, 2))));
    assert!(!got.contains_key("ds"), "SRC/. must not make DST/SRC");
    assert_eq!(got, want, "ds/. -> odfs:/merged -> merged/.");

    // Refusals name the problem and copy nothing.
    for (args, msg) in [
        (vec!["cp", "odfs:/ds", "/tmp"], "odfs:/ds is a directory (use -r)"),
        (vec!["cp", "odfs:/nothing", "/tmp/x"], "odfs:/nothing: no such file or directory"),
        (vec!["cp", "/etc/hostname", "/tmp/x"], "one side of odfs cp must be inside odfs"),
    ] {
        let e = fs_.cli_err(&args);
        assert!(e.contains(msg), "odfs {args:?}: {e}");
        assert!(!e.contains("Odfs(") && !e.contains("Local("), "odfs {args:?} shows a Debug dump: {e}");
    }
    let e = fs_.cli_err(&["cp", &s(&ds), "odfs:/elsewhere"]);
    assert!(e.contains(&format!("{} is a directory (use -r)", s(&ds))), "a local source is named as written: {e}");
    assert!(!std::path::Path::new("/tmp/x").exists());
}

#[test]
fn daemon_configs_print_their_defaults_and_refuse_bad_values_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    for daemon in ["odfs-mgmtd", "odfs-metad", "odfs-stored", "odfs-agent"] {
        let bin = bin_dir().join(daemon);
        let out = std::process::Command::new(&bin).arg("--print-default-config").output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success() && text.contains("worker_threads = 2"), "{daemon}: {text}");
        for (bad, why) in [("worker_threads = 0\n", "worker_threads = 0"), ("frobnicate = 1\n", "frobnicate")] {
            let cfg = dir.path().join(format!("{daemon}.toml"));
            std::fs::write(&cfg, bad).unwrap();
            let out = std::process::Command::new(&bin).arg("--config").arg(&cfg).output().unwrap();
            let err = String::from_utf8_lossy(&out.stderr).into_owned();
            assert!(!out.status.success(), "{daemon} started with {bad:?}");
            assert!(err.contains(why) && err.trim().lines().count() == 1, "{daemon} with {bad:?}: {err}");
        }
    }
}

/// A rewrite of bytes whose first write is still in flight lands after it: the later write
/// wins, as POSIX says (an mmap'd page written back over a region just written, a header
/// rewritten in place). Sent together, stored could apply the two in either order; each round
/// writes 256 KiB of one byte, then 52 KiB of another inside it, then reads back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rewrite_of_bytes_still_in_flight_wins() {
    let fs = LocalFs::up(2, &["--stripe-count", "2"]);
    let c = fs.client().await;
    let ctx = Ctx::root();
    let (r, h) = c.create_open(&ctx, InodeId::ROOT, b"rewritten", 0o644, true, None).await.unwrap();
    let (first, second) = (0..0x40000usize, 0x5370..0x1130busize);
    let bytes = |round: u32| ((round % 250) as u8, (round % 250) as u8 + 1);
    for round in 0..300u32 {
        let (a, b) = bytes(round);
        h.write(0, &vec![a; first.len()]).await.unwrap();
        h.write(second.start as u64, &vec![b; second.len()]).await.unwrap();
        let got = h.read(0, first.len() as u32).await.unwrap();
        let mut want = vec![a; first.len()];
        want[second.clone()].fill(b);
        if let Some(at) = got.iter().zip(&want).position(|(g, w)| g != w) {
            panic!("round {round}: byte {at:#x} is {} where {} was written last", got[at], want[at]);
        }
    }
    h.close().await.unwrap();
    let d = read_all(&c, &ctx, r.attr.ino).await;
    let (a, b) = bytes(299);
    assert!(d[second.clone()].iter().all(|&x| x == b), "after close: the last rewrite is what stays");
    assert!(d[..second.start].iter().all(|&x| x == a));
}

/// A copy onto a file as if it were a directory fails with a sentence: the system's words for
/// the errno, no Rust names of codes.
#[test]
fn a_copy_into_a_file_as_a_directory_says_so_in_words() {
    let fs = LocalFs::up(1, &[]);
    let src = tempfile::tempdir().unwrap();
    std::fs::create_dir(src.path().join("d")).unwrap();
    std::fs::write(src.path().join("d/a"), b"a").unwrap();
    std::fs::write(src.path().join("ref.bin"), b"r").unwrap();
    fs.cli_ok(&["cp", src.path().join("ref.bin").to_str().unwrap(), "odfs:/ref.bin"]);
    for args in [
        vec!["cp", "-r", src.path().join("d").to_str().unwrap(), "odfs:/ref.bin"],
        vec!["cp", src.path().join("d/a").to_str().unwrap(), "odfs:/ref.bin/x"],
    ] {
        let err = fs.cli_err(&args);
        assert!(err.contains("Not a directory"), "{args:?}: {err}");
        assert!(!err.contains("NotDir") && !err.contains("os error"), "{args:?}: Rust names in: {err}");
    }
}

/// `odfs check-script` reports every bad `#ODFS` line, each with its number, not only the
/// first; the prolog's one-line reason names the first and counts the rest.
#[test]
fn check_script_reports_every_bad_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("job.sh");
    let script = "#!/bin/sh\n#SBATCH -N 2\n#ODFS stripe-count four\n#ODFS pool\n#ODFS stage-in s3:/data/ds /data\n\
                  #ODFS frobnicate\n#ODFS stage-out /out s3://runs/x\necho ran\n";
    std::fs::write(&path, script).unwrap();
    let o = odfs(&["check-script", path.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    for ln in [3, 4, 5, 6] {
        assert_eq!(err.matches(&format!(": line {ln}: `#ODFS")).count(), 1, "line {ln} reported once: {err}");
    }
    assert!(!err.contains("line 7"), "a good line is not reported: {err}");
    assert!(err.contains("\"s3:/data/ds\" is neither s3://BUCKET/PREFIX nor an absolute path"), "{err}");
    assert!(err.contains("unknown directive \"frobnicate\""), "{err}");
    assert!(
        err.trim_end().ends_with("1 script(s) with invalid #ODFS lines: the job would be refused when it starts"),
        "{err}"
    );
    let one = odfs_job::directives::parse(script, "1", "u").unwrap_err();
    assert!(
        one.starts_with("line 3: ") && one.ends_with("(and 3 more bad #ODFS lines: `odfs check-script` lists them)"),
        "{one}"
    );
}

/// What a client config's `mgmtd =` may say, in words: a host name is taken, one that does not
/// resolve is named, and another service's address is said not to be mgmtd's (it was `unknown
/// method 4`). And `odfs cp` of things that hold no data says it skipped them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mgmtd_addresses_and_skipped_copies_are_told_in_words() {
    let fs = LocalFs::up(1, &[]);
    let dir = tempfile::tempdir().unwrap();
    let cfg = std::fs::read_to_string(fs.config_path()).unwrap();
    let mgmtd = fs.config().mgmtd;
    let metad = {
        let c = fs.client().await;
        let v = c.cluster().refresh().await.unwrap();
        v.services.iter().find(|s| s.kind == odfs_proto::mgmt::ServiceKind::Meta).unwrap().addr.unwrap()
    };
    let with_mgmtd = |name: &str, addr: &str| {
        let line = cfg.lines().find(|l| l.starts_with("mgmtd")).unwrap();
        let p = dir.path().join(name);
        std::fs::write(&p, cfg.replace(line, &format!("mgmtd = \"{addr}\""))).unwrap();
        p
    };
    let status = |p: &std::path::Path| odfs(&["--fs", p.to_str().unwrap(), "status"]);
    let o = status(&with_mgmtd("byname.toml", &format!("localhost:{}", mgmtd.port())));
    assert!(o.status.success(), "a host name is taken: {}", String::from_utf8_lossy(&o.stderr));
    let o = status(&with_mgmtd("nosuch.toml", "nosuchhost.invalid:7700"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("the host name \"nosuchhost.invalid\" does not resolve"), "{err}");
    let o = status(&with_mgmtd("noport.toml", "node0"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("\"node0\" is not an address: write IP:PORT or HOST:PORT"), "{err}");
    let o = status(&with_mgmtd("metad.toml", &metad.to_string()));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains(&format!("{metad} is not mgmtd")), "{err}");
    assert!(!err.contains("method") && err.trim_end().lines().count() == 1, "{err}");

    // A FIFO, and /dev/null: nothing copied, and the reason said.
    let fifo = dir.path().join("pipe");
    // SAFETY: mkfifo(3) with a NUL-terminated path that lives for the call.
    assert_eq!(unsafe { libc::mkfifo(std::ffi::CString::new(fifo.to_str().unwrap()).unwrap().as_ptr(), 0o644) }, 0);
    for src in [fifo.to_str().unwrap(), "/dev/null"] {
        let out = fs.cli_ok(&["cp", src, "odfs:/copied"]);
        assert!(out.contains("skipped 1 FIFOs, sockets or device nodes (they hold no data to copy)"), "{src}: {out}");
    }
}
