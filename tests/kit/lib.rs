//! Test kit: starts a real odfs (mgmtd, metad, N stored as separate processes on loopback)
//! through the `odfs` binary, hands out clients, kills and restarts daemons, and tears
//! everything down on drop.

use odfs_client::{Client, ClientConfig, Ctx};
use odfs_proto::InodeId;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// Directory of the built binaries (the test executable lives in `<target>/<profile>/deps`).
pub fn bin_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("ODFS_BIN_DIR") {
        return PathBuf::from(d);
    }
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe.parent().and_then(|d| d.parent()).expect("target dir").to_path_buf();
    for b in ["odfs", "odfs-mgmtd", "odfs-metad", "odfs-stored"] {
        assert!(
            dir.join(b).is_file(),
            "{} is missing: build the workspace binaries first (cargo build --workspace --bins)",
            dir.join(b).display()
        );
    }
    dir
}

/// Runs the `odfs` binary.
pub fn odfs(args: &[&str]) -> Output {
    Command::new(bin_dir().join("odfs")).args(args).env("ODFS_BIN_DIR", bin_dir()).output().expect("run odfs")
}

/// Fails the test, naming `what` and showing the command's output, unless it succeeded;
/// returns its stdout.
pub fn stdout_ok(out: &Output, what: impl std::fmt::Display) -> String {
    assert!(
        out.status.success(),
        "{what} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `f(0)`, …, `f(n-1)` at once, one thread each (as the nodes of a job run a command); the
/// results in order.
pub fn each<T: Send>(n: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let f = &f;
        let hs: Vec<_> = (0..n).map(|k| s.spawn(move || f(k))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Names in a directory, sorted (empty if it does not exist).
pub fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| rd.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

/// Names of the directories in a directory, sorted.
pub fn subdirs(dir: &Path) -> Vec<String> {
    entries(dir).into_iter().filter(|e| dir.join(e).is_dir()).collect()
}

/// Polls `cond` (at least once) every 200 ms until it holds or `limit` has passed; whether it
/// held.
pub fn wait_until(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let t = Instant::now();
    loop {
        if cond() {
            return true;
        }
        if t.elapsed() >= limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Polls `cond` until it says done; fails the test after `limit`, showing what it saw last.
/// Returns what it saw when done.
pub fn wait_for<T: std::fmt::Debug>(what: &str, limit: Duration, mut cond: impl FnMut() -> (bool, T)) -> T {
    let mut last = None;
    let done = wait_until(limit, || {
        let (done, seen) = cond();
        last = Some(seen);
        done
    });
    let seen = last.expect("wait_until asks at least once");
    assert!(done, "{what}: not within {} s (last seen: {seen:?})", limit.as_secs());
    seen
}

/// The lines a successful command printed, sorted.
pub fn sorted_lines(out: &Output, what: impl std::fmt::Display) -> Vec<String> {
    let mut v: Vec<String> = stdout_ok(out, what).lines().map(str::to_string).collect();
    v.sort();
    v
}

/// `getfattr -n NAME --only-values PATH` (attr package); fails the test unless it succeeds.
pub fn getfattr(p: &Path, name: &str) -> String {
    let o = Command::new("getfattr")
        .args(["-n", name, "--only-values"])
        .arg(p)
        .output()
        .expect("run getfattr (attr package)");
    stdout_ok(&o, format_args!("getfattr {name} {}", p.display()))
}

/// Runs `odfs` and fails the test with its output unless it succeeds.
pub fn odfs_ok(args: &[&str]) -> String {
    stdout_ok(&odfs(args), format_args!("odfs {args:?}"))
}

/// A running local filesystem.
pub struct LocalFs {
    pub dir: tempfile::TempDir,
    pub nodes: u32,
}

impl LocalFs {
    /// `odfs local up --nodes N --root TMP --no-mount` plus `extra` flags.
    pub fn up(nodes: u32, extra: &[&str]) -> LocalFs {
        let dir = tempfile::Builder::new().prefix("odfs-test-").tempdir().expect("tempdir");
        Self::up_in(dir, nodes, extra)
    }

    /// Like `up`, in a directory the test prepared.
    pub fn up_in(dir: tempfile::TempDir, nodes: u32, extra: &[&str]) -> LocalFs {
        let root = dir.path().to_str().expect("utf-8 path").to_string();
        let n = nodes.to_string();
        let mut args = vec!["local", "up", "--no-mount", "--root", &root, "--nodes", &n];
        args.extend_from_slice(extra);
        odfs_ok(&args);
        LocalFs { dir, nodes }
    }

    pub fn root(&self) -> &Path {
        self.dir.path()
    }

    pub fn root_str(&self) -> &str {
        self.dir.path().to_str().expect("utf-8 path")
    }

    pub fn config_path(&self) -> PathBuf {
        self.root().join("odfs.toml")
    }

    pub fn config(&self) -> ClientConfig {
        ClientConfig::load(&self.config_path()).expect("client config")
    }

    pub async fn client(&self) -> Client {
        Client::connect(self.config()).await.expect("connect")
    }

    /// A one-shot client (it caches nothing and takes no leases) as node `node`'s: a client that
    /// took leases and went away would hold the mount's next changes until they ran out.
    pub async fn node_client(&self, node: u32) -> Client {
        let mut cfg = self.config().one_shot();
        cfg.node = node;
        Client::connect(cfg).await.expect("connect")
    }

    pub fn node_dir(&self, k: u32) -> PathBuf {
        self.root().join(format!("node{k}"))
    }

    /// Pids recorded for `service` (all nodes when `node` is None).
    pub fn pids(&self, service: &str, node: Option<u32>) -> Vec<u32> {
        let text = std::fs::read_to_string(self.root().join("local.state.toml")).expect("state file");
        let v: toml::Value = toml::from_str(&text).expect("state toml");
        v["procs"]
            .as_array()
            .expect("procs")
            .iter()
            .filter(|p| p["service"].as_str() == Some(service))
            .filter(|p| node.is_none_or(|n| p["node"].as_integer() == Some(n as i64)))
            .map(|p| p["pid"].as_integer().expect("pid") as u32)
            .collect()
    }

    pub fn all_pids(&self) -> Vec<u32> {
        ["mgmtd", "metad", "stored", "agent"].iter().flat_map(|s| self.pids(s, None)).collect()
    }

    /// `kill -9` of one daemon; waits until it is gone.
    pub fn kill9(&self, service: &str, node: u32) {
        for pid in self.pids(service, Some(node)) {
            kill9_gone(pid);
        }
    }

    /// Starts a killed daemon again with its config (same ports and data).
    pub fn restart(&self, service: &str, node: u32) {
        let n = node.to_string();
        odfs_ok(&["local", "restart", "--root", self.root_str(), "--service", service, "--node", &n]);
    }

    pub fn down(&self) -> String {
        odfs_ok(&["local", "down", "--root", self.root_str()])
    }
}

impl LocalFs {
    /// `odfs --fs ROOT/odfs.toml ARGS` (commands on `odfs:/` paths need the client config).
    pub fn cli(&self, args: &[&str]) -> Output {
        Command::new(bin_dir().join("odfs")).arg("--fs").arg(self.config_path()).args(args).output().expect("run odfs")
    }

    /// Like `cli`, failing the test unless the command succeeds; returns stdout.
    pub fn cli_ok(&self, args: &[&str]) -> String {
        stdout_ok(&self.cli(args), format_args!("odfs {args:?}"))
    }

    /// Like `cli`, failing the test unless the command fails; returns stderr.
    pub fn cli_err(&self, args: &[&str]) -> String {
        let o = self.cli(args);
        assert!(!o.status.success(), "odfs {args:?} must fail: {}", String::from_utf8_lossy(&o.stdout));
        String::from_utf8_lossy(&o.stderr).into_owned()
    }
}

impl Drop for LocalFs {
    fn drop(&mut self) {
        let _ = odfs(&["local", "down", "--root", self.root_str()]);
    }
}

/// True while `pid` exists and is not a zombie.
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => !matches!(s.rsplit(')').next().and_then(|x| x.split_whitespace().next()), Some("Z") | Some("X")),
        Err(_) => false,
    }
}

/// `kill -9 PID`, and fails the test unless the process is gone within 30 s (a process in
/// uninterruptible disk I/O goes only when the I/O ends).
/// A child process killed (and reaped) when the test ends, however it ends.
pub struct KillOnDrop(pub std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn kill9_gone(pid: u32) {
    // SAFETY: plain kill(2).
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    assert!(wait_gone(pid, Duration::from_secs(30)), "pid {pid} survived SIGKILL");
}

pub fn wait_gone(pid: u32, limit: Duration) -> bool {
    let t = Instant::now();
    while alive(pid) {
        if t.elapsed() > limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    true
}

/// Bytes a process moved through read(2)/write(2)-like calls (`rchar + wchar`, which
/// sendfile counts too).
pub fn io_bytes(pid: u32) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/io")).expect("/proc/PID/io");
    text.lines()
        .filter(|l| l.starts_with("rchar:") || l.starts_with("wchar:"))
        .map(|l| l.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap())
        .sum()
}

/// Deterministic pseudo-random bytes.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    v
}

pub fn sha256(data: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(data))
}

/// A tmpfs mounted for the life of the guard (tests run as root).
pub struct TmpfsMount(pub PathBuf);

impl TmpfsMount {
    pub fn new(path: &Path, size: &str) -> TmpfsMount {
        std::fs::create_dir_all(path).expect("mount point");
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(path)
            .output()
            .expect("run mount");
        assert!(
            out.status.success(),
            "mounting a tmpfs at {} failed (this test needs root and mount(8)): {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        TmpfsMount(path.to_path_buf())
    }
}

impl Drop for TmpfsMount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// Every regular file below `dir` (recursively), as path strings.
pub fn walk_files(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            } else {
                out.push(e.path().to_string_lossy().into_owned());
            }
        }
    }
    out
}

pub mod fuse;
pub use fuse::*;

pub mod s3;
pub use s3::*;

pub mod user;
pub use user::*;

pub mod slurm;

pub mod launch;

/// A whole file read through the client library (another "node"), by inode.
pub async fn read_all(c: &Client, ctx: &Ctx, ino: InodeId) -> Vec<u8> {
    let h = c.open(ctx, ino, true, false, false).await.expect("open");
    let mut out = Vec::new();
    loop {
        let d = h.read(out.len() as u64, 4 << 20).await.expect("read");
        if d.is_empty() {
            break;
        }
        out.extend_from_slice(&d);
    }
    h.close().await.expect("close");
    out
}

/// A whole file read through the client library, by path, as root.
pub async fn lib_read(c: &Client, path: &str) -> Vec<u8> {
    let ctx = Ctx::root();
    let a = c.resolve(&ctx, path, true).await.unwrap_or_else(|e| panic!("{path}: {e}"));
    read_all(c, &ctx, a.ino).await
}
