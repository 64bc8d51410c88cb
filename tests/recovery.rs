//! Crash recovery: `kill -9` of metad or of one stored during a storm of creates and writes from
//! four client tasks, then restart. Every operation that returned success must be there intact.

use odfs_client::Ctx;
use odfs_proto::InodeId;
use odfs_tests::*;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Four tasks create files and write them until `stop`; returns name → sha256 of every file whose
/// create, write and close all succeeded, and the number of failed attempts.
async fn storm(fs: &LocalFs, stop: Arc<AtomicBool>) -> (BTreeMap<String, String>, usize) {
    let mut tasks = Vec::new();
    for t in 0..4u64 {
        let c = fs.client().await;
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let ctx = Ctx::root();
            let mut ok = BTreeMap::new();
            let mut failed = 0;
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let name = format!("t{t}-{i}");
                let data = pattern(1000 + ((i * 7919) % 200_000) as usize, t * 1_000_000 + i);
                let r = async {
                    let (_, h) = c.create_open(&ctx, InodeId::ROOT, name.as_bytes(), 0o644, true, None).await?;
                    h.write(0, &data).await?;
                    h.close().await
                }
                .await;
                match r {
                    Ok(()) => {
                        ok.insert(name, sha256(&data));
                    }
                    Err(e) => {
                        if failed == 0 {
                            eprintln!("storm: the first failure, {name}: {e}");
                        }
                        failed += 1
                    }
                }
                i += 1;
            }
            (ok, failed)
        }));
    }
    let mut all = BTreeMap::new();
    let mut failed = 0;
    for t in tasks {
        let (ok, f) = t.await.unwrap();
        all.extend(ok);
        failed += f;
    }
    (all, failed)
}

async fn verify(fs: &LocalFs, ok: &BTreeMap<String, String>) {
    let c = fs.client().await;
    let ctx = Ctx::root();
    let listed: Vec<String> = c
        .readdir_all(&ctx, InodeId::ROOT, true)
        .await
        .unwrap()
        .into_iter()
        .map(|e| String::from_utf8(e.name).unwrap())
        .collect();
    for (name, want) in ok {
        assert!(listed.contains(name), "{name} was acknowledged but is missing");
        let a = c.lookup(&ctx, InodeId::ROOT, name.as_bytes()).await.unwrap();
        let h = c.open(&ctx, a.ino, true, false, false).await.unwrap();
        let d = h.read(0, a.size as u32 + 1).await.unwrap();
        assert_eq!(&sha256(&d), want, "{name} content differs after recovery");
    }
    // Every listed entry resolves (no half-applied entries).
    for name in &listed {
        c.lookup(&ctx, InodeId::ROOT, name.as_bytes()).await.unwrap();
    }
}

/// Runs the storm, `kill -9`s `service` on `node` after 1.5 s, restarts it 0.3 s later, lets the
/// storm go on for 1.5 s more, and checks every acknowledged file.
async fn kill9_during_storm(fs: &LocalFs, service: &str, node: u32) -> BTreeMap<String, String> {
    kill9_during_storm_counting(fs, service, node).await.0
}

/// [`kill9_during_storm`], with the number of creates, writes or closes that failed.
async fn kill9_during_storm_counting(fs: &LocalFs, service: &str, node: u32) -> (BTreeMap<String, String>, usize) {
    let stop = Arc::new(AtomicBool::new(false));
    let chaos = async {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        fs.kill9(service, node);
        tokio::time::sleep(Duration::from_millis(300)).await;
        fs.restart(service, node);
        tokio::time::sleep(Duration::from_millis(1500)).await;
        stop.store(true, Ordering::Relaxed);
    };
    let ((ok, failed), ()) = tokio::join!(storm(fs, stop.clone()), chaos);
    assert!(ok.len() > 50, "storm made too little progress: {} ok, {failed} failed", ok.len());
    verify(fs, &ok).await;
    (ok, failed)
}

/// mgmtd holds no data: its restart (kill -9, then up again on its address) must cost the
/// writers nothing. Their clients wait, bounded by their retry deadline, for the services to
/// register again rather than fail a close with "target N is not registered".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mgmtd_restart_under_writers_fails_no_create_write_or_close() {
    let fs = LocalFs::up(4, &[]);
    let (ok, failed) = kill9_during_storm_counting(&fs, "mgmtd", 0).await;
    assert_eq!(failed, 0, "{failed} creates, writes or closes failed across mgmtd's restart ({} succeeded)", ok.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metad_kill9_loses_nothing_acknowledged() {
    let fs = LocalFs::up(2, &[]);
    let ok = kill9_during_storm(&fs, "metad", 0).await;
    // And once more after a clean restart (snapshot + log).
    fs.kill9("metad", 0);
    fs.restart("metad", 0);
    verify(&fs, &ok).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_kill9_loses_nothing_acknowledged() {
    let fs = LocalFs::up(2, &["--stripe-count", "2", "--chunk-size", "65536"]);
    kill9_during_storm(&fs, "stored", 1).await;
}

/// A file a caching client opened from its cache (unregistered at metad) is registered when
/// the client's session starts anew (a client's first poll, or metad's restart); its close must
/// then release it, or metad holds it for the client's whole session and an unlinked file's
/// chunks are never freed. Liveness, not speed: the wait covers metad's restart grace (the
/// lease, 30 s) and its orphan sweep.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_open_across_a_metad_restart_is_released_at_close_and_freed_after_unlink() {
    let fs = LocalFs::up(1, &[]);
    let c = fs.client().await;
    let ctx = Ctx::root();
    let (r, h) = c.create_open(&ctx, InodeId::ROOT, b"held", 0o644, true, None).await.unwrap();
    h.write(0, &pattern(10_000, 3)).await.unwrap();
    h.flush().await.unwrap();
    let ino = r.attr.ino;
    fs.kill9("metad", 0);
    fs.restart("metad", 0);
    // The client's next poll finds a new session and registers what it holds open.
    let reopened = || async {
        let counts = c.meta_request_counts().await.unwrap_or_default();
        counts.iter().any(|(_, kind, n)| kind == "Reopen" && *n > 0)
    };
    let t = std::time::Instant::now();
    while !reopened().await {
        // Generous: the client reconnects with backoff, and a loaded test machine (the whole
        // suite on two cores) once took longer than 20 s.
        if t.elapsed() > Duration::from_secs(60) {
            // Say what metad did: a failed restart (a port taken meanwhile) reads differently
            // from a slow reconnect.
            let log = std::fs::read_to_string(fs.node_dir(0).join("metad.log")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(15).collect();
            panic!(
                "the client never registered its open file again; metad.log ends:\n{}",
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    h.close().await.unwrap();
    c.unlink(&ctx, InodeId::ROOT, b"held").await.unwrap();
    let name = format!("{:016x}", ino.0);
    let t = std::time::Instant::now();
    while walk_files(&fs.node_dir(0)).iter().any(|p| p.ends_with(&name)) {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the unlinked file's chunk was never freed: metad still holds it"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let gone = c.lookup(&ctx, InodeId::ROOT, b"held").await.expect_err("the name is gone");
    assert_eq!(gone.code(), odfs_proto::ErrorCode::NotFound);
}

/// Takes an exclusive `flock` on argv[1] and an `fcntl` write lock on bytes 10..20 of argv[2],
/// says "held", and sleeps until killed.
const HOLD_LOCKS: &str = "import fcntl,os,sys,time\n\
    a=os.open(sys.argv[1],os.O_RDWR)\n\
    b=os.open(sys.argv[2],os.O_RDWR)\n\
    fcntl.flock(a,fcntl.LOCK_EX)\n\
    fcntl.lockf(b,fcntl.LOCK_EX,10,10)\n\
    print('held',flush=True)\n\
    time.sleep(600)\n";

/// Whether another process gets the flock on argv[1] and the write lock on bytes 10..20 of
/// argv[2] at once (LOCK_NB, F_SETLK): "got" or "busy" for each.
const TRY_LOCKS: &str = "import fcntl,os,sys\n\
    def try_(f):\n\
    \x20   try:\n\
    \x20       f(); return 'got'\n\
    \x20   except BlockingIOError: return 'busy'\n\
    a=os.open(sys.argv[1],os.O_RDWR)\n\
    b=os.open(sys.argv[2],os.O_RDWR)\n\
    print(try_(lambda: fcntl.flock(a,fcntl.LOCK_EX|fcntl.LOCK_NB)),try_(lambda: fcntl.lockf(b,fcntl.LOCK_EX|fcntl.LOCK_NB,10,10)))\n";

/// Locks held through the mount outlive a restart of metad, whose lock table is not logged:
/// the mount takes them back during the restart's grace, when metad grants no other lock, so
/// another process still finds them held after the grace, and free once their holder exits.
/// Liveness, not speed: the waits cover the grace (the lease, 30 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_held_through_the_mount_are_taken_back_after_a_metad_restart() {
    use std::process::{Command, Stdio};
    let fs = LocalFs::up(1, &[]);
    let m = FuseMount::start(&fs);
    let (lf, lr) = (m.p("lf"), m.p("lr"));
    std::fs::write(&lf, b"f").unwrap();
    std::fs::write(&lr, vec![0u8; 100]).unwrap();
    let try_locks = || {
        let out = Command::new("python3").arg("-c").arg(TRY_LOCKS).arg(&lf).arg(&lr).output().expect("run python3");
        assert!(out.status.success(), "probe: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    let mut holder = KillOnDrop(
        Command::new("python3")
            .arg("-c")
            .arg(HOLD_LOCKS)
            .arg(&lf)
            .arg(&lr)
            .stdout(Stdio::piped())
            .spawn()
            .expect("run python3"),
    );
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(holder.0.stdout.take().unwrap()), &mut line).unwrap();
    assert_eq!(line.trim(), "held");
    assert_eq!(try_locks(), "busy busy", "before the restart");

    fs.kill9("metad", 0);
    fs.restart("metad", 0);
    // The mount takes both locks back as soon as it finds its session gone.
    let c = fs.client().await;
    let set_locks = || async {
        let counts = c.meta_request_counts().await.unwrap_or_default();
        counts.iter().filter(|(_, kind, _)| kind == "SetLock").map(|(_, _, n)| *n).sum::<u64>()
    };
    let t = std::time::Instant::now();
    while set_locks().await < 2 {
        assert!(t.elapsed() < Duration::from_secs(60), "the mount took no lock back within 60 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A change waits out the grace: once it is through, metad grants locks to anyone again.
    let ino = InodeId(std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&lf).unwrap()));
    let chmod = odfs_proto::meta::SetAttr { ino, mode: Some(0o640), ..Default::default() };
    c.setattr(&Ctx::root(), chmod).await.unwrap();
    assert_eq!(try_locks(), "busy busy", "after the grace: the holder's locks were taken back");

    drop(holder);
    let t = std::time::Instant::now();
    while try_locks() != "got got" {
        assert!(t.elapsed() < Duration::from_secs(10), "the killed holder's locks did not go");
        std::thread::sleep(Duration::from_millis(50));
    }
}
