//! Mount life cycle through `odfs local up` / `odfs local down`: the mount appears, teardown
//! never hangs (also with a dead or stopped odfs-fuse, or dead daemons), and a mount left
//! behind is cleaned by the next `up` or `down`; an interrupted command leaves nothing running.

use odfs_tests::*;
use std::path::Path;
use std::time::{Duration, Instant};

fn mounted(p: &Path) -> bool {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(p.to_str().unwrap()) && l.contains(" - fuse.odfs "))
}

fn up(dir: &Path) -> String {
    assert!(Path::new("/dev/fuse").exists(), "/dev/fuse is missing: these tests need FUSE (modprobe fuse)");
    odfs_ok(&["local", "up", "--root", dir.to_str().unwrap(), "--nodes", "2"])
}

fn pids(dir: &Path, service: Option<&str>) -> Vec<u32> {
    let v: toml::Value = toml::from_str(&std::fs::read_to_string(dir.join("local.state.toml")).unwrap()).unwrap();
    v["procs"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| service.is_none_or(|s| p["service"].as_str() == Some(s)))
        .map(|p| p["pid"].as_integer().unwrap() as u32)
        .collect()
}

/// `odfs local down`, which must not hang (it gives a stuck FUSE client 3 s before SIGKILL;
/// 15 s leaves room for a loaded machine) and must leave no mount and no process.
fn down_without_hanging(dir: &Path, all: &[u32]) -> String {
    let t = Instant::now();
    let out = odfs_ok(&["local", "down", "--root", dir.to_str().unwrap()]);
    assert!(t.elapsed() < Duration::from_secs(15), "down took {:?}: {out}", t.elapsed());
    assert!(!mounted(&dir.join("mnt")), "still mounted after down: {out}");
    for &p in all {
        assert!(!alive(p), "pid {p} alive after down");
    }
    out
}

#[test]
fn up_mounts_and_down_unmounts() {
    let dir = tempfile::tempdir().unwrap();
    let out = up(dir.path());
    let mnt = dir.path().join("mnt");
    assert!(mounted(&mnt), "{out}");
    // Data written through the mount is the filesystem's.
    let data = pattern(3 << 20, 5);
    std::fs::write(mnt.join("f"), &data).unwrap();
    assert_eq!(std::fs::read(mnt.join("f")).unwrap(), data);
    let procs = std::fs::read_to_string("/proc/mounts").unwrap();
    assert!(procs.lines().any(|l| l.contains(mnt.to_str().unwrap()) && l.contains("fuse.odfs")), "{procs}");
    let all = pids(dir.path(), None);
    assert_eq!(all.len(), 7, "mgmtd, metad, 2 stored, 2 stage agents, odfs-fuse");
    down_without_hanging(dir.path(), &all);
}

#[test]
fn down_after_kill9_of_fuse_or_of_every_daemon() {
    let dir = tempfile::tempdir().unwrap();
    up(dir.path());
    let all = pids(dir.path(), None);
    for p in pids(dir.path(), Some("fuse")) {
        kill9_gone(p);
    }
    // The dead mount fails with ENOTCONN until down cleans it.
    // (ENOTCONN, "Transport endpoint is not connected", or ECONNABORTED, by kernel version).
    let e = std::fs::metadata(dir.path().join("mnt/x")).unwrap_err();
    assert!(matches!(e.raw_os_error(), Some(libc::ENOTCONN) | Some(libc::ECONNABORTED)), "{e}");
    down_without_hanging(dir.path(), &all);

    up(dir.path());
    let all = pids(dir.path(), None);
    for s in ["mgmtd", "metad", "stored"] {
        for p in pids(dir.path(), Some(s)) {
            // SAFETY: plain kill(2).
            unsafe { libc::kill(p as i32, libc::SIGKILL) };
        }
    }
    down_without_hanging(dir.path(), &all);
}

#[test]
fn down_does_not_hang_on_a_stopped_fuse_daemon() {
    let dir = tempfile::tempdir().unwrap();
    up(dir.path());
    let all = pids(dir.path(), None);
    let fuse = pids(dir.path(), Some("fuse"))[0];
    // A daemon that never answers: every request to the mount would block.
    // SAFETY: plain kill(2).
    unsafe { libc::kill(fuse as i32, libc::SIGSTOP) };
    let out = down_without_hanging(dir.path(), &all);
    assert!(out.contains("abort") || out.contains("unmounted"), "{out}");
}

#[test]
fn next_up_cleans_a_mount_left_by_a_dead_run() {
    let dir = tempfile::tempdir().unwrap();
    up(dir.path());
    for p in pids(dir.path(), None) {
        kill9_gone(p);
    }
    assert!(mounted(&dir.path().join("mnt")), "the dead mount stays until cleaned");
    let out = odfs(&["local", "up", "--root", dir.path().to_str().unwrap(), "--nodes", "2"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let data = b"fresh".to_vec();
    std::fs::write(dir.path().join("mnt/g"), &data).unwrap();
    assert_eq!(std::fs::read(dir.path().join("mnt/g")).unwrap(), data);
    let all = pids(dir.path(), None);
    down_without_hanging(dir.path(), &all);
}

/// The processes (other than this test's) whose command line names `dir`: a local
/// filesystem's daemons and odfs-fuse all take their configs from under its root.
fn processes_naming(dir: &Path) -> Vec<String> {
    let needle = dir.as_os_str().as_encoded_bytes();
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) else { continue };
        if pid != std::process::id() && cmd.windows(needle.len()).any(|w| w == needle) {
            found.push(format!("{pid}: {}", String::from_utf8_lossy(&cmd).replace('\0', " ")));
        }
    }
    found
}

/// Mount points at or under `dir`.
fn mounts_under(dir: &Path) -> Vec<String> {
    let dir = dir.to_str().unwrap();
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    info.lines().filter_map(|l| l.split(' ').nth(4)).filter(|m| m.starts_with(dir)).map(String::from).collect()
}

/// Ctrl-C during `odfs demo`, once its filesystem is up and mounted: the demo unmounts and
/// stops everything it started and exits 130, as an interrupted command does; no daemon (they
/// run in sessions of their own, out of the terminal's reach) and no mount is left.
#[test]
fn an_interrupted_demo_leaves_no_process_and_no_mount() {
    use std::io::{BufRead, Read};
    assert!(Path::new("/dev/fuse").exists(), "/dev/fuse is missing: this test mounts a FUSE filesystem");
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("demo");
    let mut child = std::process::Command::new(bin_dir().join("odfs"))
        .args(["demo", "--root", root.to_str().unwrap(), "--nodes", "2", "--dataset-mib", "64", "--no-bench"])
        .env("ODFS_BIN_DIR", bin_dir())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Read all along, so the demo never blocks on a full pipe while it is torn down.
    let mut stderr_pipe = child.stderr.take().unwrap();
    let stderr = std::thread::spawn(move || {
        let mut s = String::new();
        stderr_pipe.read_to_string(&mut s).unwrap();
        s
    });
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut said = String::new();
    while !said.contains("ready in") {
        let n = stdout.read_line(&mut said).unwrap();
        assert!(n > 0, "the demo ended before its filesystem was up: {said}");
    }
    let mnt = root.join("fs/mnt");
    assert!(mounted(&mnt), "{said}");
    let running = processes_naming(&root);
    assert!(running.len() > 2, "the demo's daemons are not running: {running:?}");

    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(t.elapsed() < Duration::from_secs(60), "the demo did not end within 60 s of SIGINT");
        std::thread::sleep(Duration::from_millis(50));
    };
    let stderr = stderr.join().unwrap();
    assert_eq!(status.code(), Some(130), "exit status after SIGINT: {status}; stderr: {stderr}");
    // The teardown itself, not the demo's own ending, took them down: the mount and the
    // 2 nodes' daemons (mgmtd, metad, 2 stored, 2 agents, odfs-fuse).
    assert!(stderr.contains("interrupted (SIGINT): unmounting 1 mount(s) and stopping 7 process(es)"), "{stderr}");
    assert_eq!(processes_naming(&root), Vec::<String>::new(), "left running after SIGINT; stderr: {stderr}");
    assert_eq!(mounts_under(&root), Vec::<String>::new(), "left mounted after SIGINT; stderr: {stderr}");
}

/// A node count meant for a cluster is refused before anything starts.
#[test]
fn local_up_refuses_more_nodes_than_one_machine_runs() {
    let dir = tempfile::tempdir().unwrap();
    let out = odfs(&["local", "up", "--root", dir.path().to_str().unwrap(), "--nodes", "100000", "--no-mount"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "100,000 local nodes were accepted: {stderr}");
    assert!(stderr.contains("--nodes 100000") && stderr.contains("at most 64"), "{stderr}");
    assert!(!dir.path().join("local.state.toml").exists(), "state written for a refused start");
    assert_eq!(processes_naming(dir.path()), Vec::<String>::new());
}

/// Private mount namespaces made one after the other while it lives, each holding copies of
/// every mount there is at its making (as `unshare -m`, a container or a service with its own
/// /tmp does): an unmount here does not reach those copies, which keep FUSE connections and
/// their daemons alive.
struct NamespaceCopies {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    maker: Option<std::thread::JoinHandle<Vec<std::process::Child>>>,
}

impl NamespaceCopies {
    fn start() -> NamespaceCopies {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let s = stop.clone();
        let maker = std::thread::spawn(move || {
            // One every 2 s, each kept to the end: copies of every mount the demo makes
            // outlive its unmount, whatever waits follow it.
            let mut held = Vec::new();
            while !s.load(std::sync::atomic::Ordering::SeqCst) {
                let c = std::process::Command::new("unshare")
                    .args(["--mount", "--propagation", "private", "sleep", "900"])
                    .spawn()
                    .expect("unshare (util-linux)");
                held.push(c);
                for _ in 0..20 {
                    if s.load(std::sync::atomic::Ordering::SeqCst) {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
            held
        });
        NamespaceCopies { stop, maker: Some(maker) }
    }
}

impl Drop for NamespaceCopies {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        for mut c in self.maker.take().and_then(|m| m.join().ok()).unwrap_or_default() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Runs `odfs demo` with `args` from `cwd` with TMPDIR `tmp`; (status, stdout, stderr).
fn demo(cwd: &Path, tmp: &Path, args: &[&str]) -> (std::process::ExitStatus, String, String) {
    let out = std::process::Command::new(bin_dir().join("odfs"))
        .arg("demo")
        .args(args)
        .current_dir(cwd)
        .env("TMPDIR", tmp)
        .env("ODFS_BIN_DIR", bin_dir())
        .output()
        .unwrap();
    (out.status, String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// The user's name, as the default roots under TMPDIR carry it.
fn user_name() -> String {
    let out = std::process::Command::new("id").arg("-un").output().unwrap();
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// `odfs demo` three times in a row from a fresh directory while other mount namespaces keep
/// copies of its mounts: each run works under TMPDIR (not the directory it is run from), ends,
/// and leaves no process, mount or data. (Its benchmark's mounts, under the same copies: the
/// next test.)
#[test]
fn three_demos_in_a_row_leave_no_process_mount_or_data_even_with_copies_of_their_mounts() {
    assert!(Path::new("/dev/fuse").exists(), "/dev/fuse is missing: this test mounts a FUSE filesystem");
    let (here, tmp) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let root = tmp.path().join(format!("odfs-demo-{}", user_name()));
    let _copies = NamespaceCopies::start();
    for run in 1..=3 {
        let (status, out, err) = demo(here.path(), tmp.path(), &["--nodes", "2", "--dataset-mib", "16", "--no-bench"]);
        let said = format!("run {run}: {status}\nstdout:\n{out}\nstderr:\n{err}");
        assert!(status.success(), "{said}");
        assert!(out.contains(&format!("under {}", root.join("fs").display())), "works under TMPDIR: {said}");
        assert!(out.contains(" files identical ("), "{said}");
        assert!(out.contains(&format!("removed {} (", root.display())), "{said}");
        assert!(out.trim_end().ends_with("demo finished: filesystem stopped, no process or mount left"), "{said}");
        assert_eq!(entries(here.path()), Vec::<String>::new(), "the demo wrote into the directory it ran from: {said}");
        assert!(!root.exists(), "{} is left: {said}", root.display());
        assert_eq!(entries(tmp.path()), Vec::<String>::new(), "{said}");
        assert_eq!(processes_naming(tmp.path()), Vec::<String>::new(), "left running: {said}");
        assert_eq!(mounts_under(tmp.path()), Vec::<String>::new(), "left mounted: {said}");
    }
}

/// `odfs bench --mount` (the demo's closing benchmark, at a smaller size) while other mount
/// namespaces keep copies of every mount it makes — odfs's, bindfs's FUSE floor, each FUSE
/// minimum — ends, and leaves no process (bindfs included), mount or data: the copies kept the
/// FUSE connections alive after their unmounts, and a minimum's session or bindfs waited for
/// an end that never came (the demo hung 13 minutes so).
#[test]
fn a_benchmark_through_the_mount_ends_and_leaves_nothing_while_other_namespaces_copy_its_mounts() {
    assert!(Path::new("/dev/fuse").exists(), "/dev/fuse is missing: this test mounts a FUSE filesystem");
    let (here, tmp) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let _copies = NamespaceCopies::start();
    let out = std::process::Command::new(bin_dir().join("odfs"))
        .args(["bench", "--mount", "--scale", "small", "--nodes", "2", "--file-mib", "16", "--randread-secs", "1"])
        .args(["--files-per-thread", "200", "--shared-files-per-thread", "100", "--small-files", "500"])
        .current_dir(here.path())
        .env("TMPDIR", tmp.path())
        .env("ODFS_BIN_DIR", bin_dir())
        .output()
        .unwrap();
    let said = format!(
        "{}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{said}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    for line in ["FUSE + disk minimum, large files", "FUSE minimum in its own session, with opens: small read cold"] {
        assert!(stdout.contains(line), "{line:?} measured: {said}");
    }
    assert!(String::from_utf8_lossy(&out.stderr).contains("bench: FUSE floor: bindfs"), "with the FUSE floor: {said}");
    assert_eq!(
        entries(here.path()),
        Vec::<String>::new(),
        "the benchmark wrote into the directory it ran from: {said}"
    );
    assert_eq!(entries(tmp.path()), Vec::<String>::new(), "{said}");
    assert_eq!(processes_naming(tmp.path()), Vec::<String>::new(), "left running: {said}");
    assert_eq!(mounts_under(tmp.path()), Vec::<String>::new(), "left mounted: {said}");
}

/// A demo whose benchmark stalls (the benchmark's odfs-fuse stopped while fio writes through
/// its mount) ends once the phase passes its bound, with a line naming the phase and what it
/// waited for, and leaves no process, mount or data.
#[test]
fn a_demo_whose_benchmark_stalls_ends_at_its_bound_and_leaves_nothing() {
    use std::io::{BufRead, Read};
    assert!(Path::new("/dev/fuse").exists(), "/dev/fuse is missing: this test mounts a FUSE filesystem");
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("demo");
    let mut child = std::process::Command::new(bin_dir().join("odfs"))
        .args(["demo", "--root", root.to_str().unwrap(), "--nodes", "2", "--dataset-mib", "16"])
        .args(["--phase-timeout", "15"])
        .env("ODFS_BIN_DIR", bin_dir())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout_pipe = child.stdout.take().unwrap();
    let stdout = std::thread::spawn(move || {
        let mut s = String::new();
        stdout_pipe.read_to_string(&mut s).unwrap();
        s
    });
    let mut stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut said = String::new();
    let phase = "fio sequential write, 4 jobs x 64 MiB";
    while !said.contains(&format!("bench: {phase}")) {
        let n = stderr.read_line(&mut said).unwrap();
        assert!(n > 0, "the demo ended before its benchmark wrote: {said}");
    }
    // The benchmark's own filesystem: its odfs-fuse stops answering.
    let fuse: Vec<u32> = processes_naming(&root.join("bench"))
        .iter()
        .filter(|p| p.contains("odfs-fuse"))
        .map(|p| p.split(':').next().unwrap().parse().unwrap())
        .collect();
    assert_eq!(fuse.len(), 1, "the benchmark's odfs-fuse: {fuse:?}\n{said}");
    assert_eq!(unsafe { libc::kill(fuse[0] as i32, libc::SIGSTOP) }, 0);
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t.elapsed() > Duration::from_secs(180) {
            let _ = child.kill();
            panic!("the stalled demo did not end within 180 s of a 15 s bound: {said}");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    stderr.read_to_string(&mut said).unwrap();
    let out = stdout.join().unwrap();
    let all = format!("{status}\nstdout:\n{out}\nstderr:\n{said}");
    assert_eq!(status.code(), Some(1), "{all}");
    // What it waited for: the stopped mount (its side's work there, the sync(2) before the
    // write, or fio's write itself).
    let line =
        format!("odfs: odfs demo: phase \"{phase}\" did not end within 15 s (--phase-timeout); it was waiting for ");
    let waited = said.split(&line).nth(1).unwrap_or_else(|| panic!("no line {line:?}: {all}"));
    let mnt = root.join("bench/fs/mnt");
    assert!(
        [format!("the odfs side's work in {}:", mnt.display()), "sync(2)".into(), "fio (pid ".into()]
            .iter()
            .any(|w| waited.starts_with(w.as_str())),
        "{all}"
    );
    assert!(said.contains(&format!("odfs: removed {}", root.display())), "{all}");
    assert_eq!(processes_naming(dir.path()), Vec::<String>::new(), "left running: {all}");
    assert_eq!(mounts_under(dir.path()), Vec::<String>::new(), "left mounted: {all}");
    assert!(!root.exists(), "{} is left: {all}", root.display());
}

/// A stripe count wider than the pool is refused before anything starts (files would silently
/// get fewer stripes), as `setstripe -c 100` is.
#[test]
fn local_up_refuses_a_stripe_count_wider_than_its_targets() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_str().unwrap();
    let out = odfs(&["local", "up", "--root", root, "--nodes", "2", "--stripe-count", "9", "--no-mount"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "--stripe-count 9 over 2 targets was accepted: {stderr}");
    assert!(stderr.contains("--stripe-count 9 is more than the 2 targets of pool default"), "{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    assert!(!dir.path().join("local.state.toml").exists(), "state written for a refused start");
    assert_eq!(processes_naming(dir.path()), Vec::<String>::new());
}
