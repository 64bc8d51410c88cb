//! A job's nodes outside Slurm, the way pdsh or clush would drive them: every "node" is an
//! address of the loopback network (127.0.0.1, 127.0.0.2, ...) with its own data, state and
//! mount directories (the site config's `%n`), and `odfs start` / `odfs stop` run once per
//! node, at the same time, as separate processes with explicit flags.

use crate::bin_dir;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::{Command, Output};

pub struct Launch {
    pub dir: tempfile::TempDir,
    pub nodes: Vec<String>,
    pub site: PathBuf,
    _ports: PortBlock,
}

/// Job slots per block of test ports: every launch's `port_slots` (job ids this far apart
/// share a port range).
pub const PORT_SLOTS: u16 = 50;

/// The ports a launch's jobs use (its site config's `port_base`): a block that no other test
/// running on this machine holds and whose every port was free when taken, so tests that run at
/// once never clash over a job's fixed ports. Block k is held by an flock on a file named after
/// it, for as long as the launch lives.
struct PortBlock {
    base: u16,
    _lock: fs::File,
}

impl PortBlock {
    fn reserve(nodes: &[String]) -> PortBlock {
        let dir = std::env::temp_dir().join("odfs-test-ports");
        fs::create_dir_all(&dir).expect("create the test port lock directory");
        let size = PORT_SLOTS * odfs_job::site::PORTS_PER_JOB;
        for k in 0..(20_000 / size) {
            let lock = fs::OpenOptions::new().create(true).truncate(false).write(true).open(dir.join(k.to_string()));
            let lock = lock.expect("open a test port lock");
            // SAFETY: flock(2) on a descriptor this function owns.
            if unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                continue;
            }
            let base = 10_000 + k * size;
            if (base..base + size).all(|p| nodes.iter().all(|n| port_free(n, p))) {
                return PortBlock { base, _lock: lock };
            }
        }
        panic!("no block of {size} free ports in 10000-30000 for this test's jobs");
    }
}

fn port_free(ip: &str, port: u16) -> bool {
    let ip: std::net::IpAddr = ip.parse().unwrap();
    std::net::UdpSocket::bind((ip, port)).is_ok() && std::net::TcpListener::bind((ip, port)).is_ok()
}

impl Launch {
    /// `n` nodes; `ondemand` adds lines to the site config's `[ondemand]` table.
    pub fn new(n: usize, ondemand: &str) -> Launch {
        // SAFETY: geteuid has no preconditions.
        assert!(unsafe { libc::geteuid() } == 0, "odfs start mounts filesystems: run this test as root");
        let dir = tempfile::Builder::new().prefix("odfs-launch-").tempdir().expect("tempdir");
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
        let d = dir.path().display().to_string();
        let nodes: Vec<String> = (1..=n).map(|k| format!("127.0.0.{k}")).collect();
        for node in &nodes {
            fs::create_dir_all(dir.path().join(node).join("nvme")).unwrap();
        }
        let key = dir.path().join("site.key");
        crate::odfs_ok(&["keygen", "--out", &key.display().to_string()]);
        let site = dir.path().join("site.toml");
        let ports = PortBlock::reserve(&nodes);
        fs::write(
            &site,
            format!(
                "[ondemand]\nsite_key = \"{d}/site.key\"\ndata_paths = [\"{d}/%n/nvme\"]\nstate_dir = \"{d}/%n/state\"\n\
                 mount = \"{d}/%n/mnt/%j\"\nram_size = \"64M\"\nready_timeout_secs = 20\nstop_grace_secs = 10\n\
                 port_base = {}\nport_slots = {PORT_SLOTS}\n{ondemand}\n",
                ports.base
            ),
        )
        .unwrap();
        Launch { dir, nodes, site, _ports: ports }
    }

    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(bin_dir().join("odfs"));
        c.args(args).env("ODFS_SITE_CONFIG", &self.site).env("ODFS_BIN_DIR", bin_dir());
        // Nothing of a Slurm environment leaks in from the caller.
        for k in ["SLURM_JOB_ID", "SLURM_NODELIST", "SLURMD_NODENAME", "SLURM_JOB_UID", "SLURM_JOB_CONSTRAINTS"] {
            c.env_remove(k);
        }
        c
    }

    /// `odfs ARGS --node-index k` on node k.
    pub fn on(&self, k: usize, args: &[&str]) -> Output {
        let i = k.to_string();
        let mut a = args.to_vec();
        a.extend(["--node-index", &i]);
        self.cmd(&a).output().expect("run odfs")
    }

    /// `odfs ARGS --node-index k` on every node at once; the outputs in node order.
    pub fn all(&self, args: &[&str]) -> Vec<Output> {
        crate::each(self.nodes.len(), |k| self.on(k, args))
    }

    /// `odfs ARGS` without node flags (recover, cleanup).
    pub fn plain(&self, args: &[&str]) -> Output {
        self.cmd(args).output().expect("run odfs")
    }

    /// The node list as `--nodes` takes it.
    pub fn node_list(&self) -> String {
        self.nodes.join(",")
    }

    pub fn mount(&self, k: usize, job: &str) -> PathBuf {
        self.dir.path().join(&self.nodes[k]).join("mnt").join(job)
    }

    pub fn nvme(&self, k: usize) -> PathBuf {
        self.dir.path().join(&self.nodes[k]).join("nvme")
    }

    pub fn state(&self, k: usize) -> PathBuf {
        self.dir.path().join(&self.nodes[k]).join("state")
    }

    pub fn event_log(&self, k: usize) -> String {
        fs::read_to_string(self.state(k).join("odfs.log")).unwrap_or_default()
    }

    /// Job directories in node k's state directory.
    pub fn records(&self, k: usize) -> Vec<String> {
        crate::subdirs(&self.state(k))
    }

    /// Appends text to the site config (bare keys land in its `[ondemand]` table, the last one
    /// until a table is appended).
    pub fn site_append(&self, text: &str) {
        let mut site = fs::read_to_string(&self.site).unwrap();
        site += text;
        fs::write(&self.site, site).unwrap();
    }

    /// Pids of odfs processes whose command line mentions this launch's directory.
    pub fn processes(&self) -> Vec<u32> {
        let marker = self.dir.path().display().to_string();
        let mut v = Vec::new();
        for e in fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
            let cmd = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            let exe = cmd.split(' ').next().unwrap_or("").rsplit('/').next().unwrap_or("");
            if exe.starts_with("odfs-") && cmd.contains(&marker) && crate::alive(pid) {
                v.push(pid);
            }
        }
        v
    }

    /// Asserts that nothing of any job is left: processes, mounts, data, records.
    pub fn assert_clean(&self) {
        assert!(self.processes().is_empty(), "odfs processes left: {:?}", self.processes());
        let mounts = fs::read_to_string("/proc/self/mountinfo").unwrap();
        let d = self.dir.path().display().to_string();
        let left: Vec<&str> = mounts.lines().filter(|l| l.contains(&d)).collect();
        assert!(left.is_empty(), "mounts left: {left:?}");
        for k in 0..self.nodes.len() {
            assert!(
                crate::entries(&self.nvme(k)).is_empty(),
                "{}: data left: {:?}",
                self.nodes[k],
                crate::entries(&self.nvme(k))
            );
            assert!(self.records(k).is_empty(), "{}: records left: {:?}", self.nodes[k], self.records(k));
        }
    }
}

impl Drop for Launch {
    fn drop(&mut self) {
        let d = self.dir.path().display().to_string();
        let mounts = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        for l in mounts.lines().filter(|l| l.contains(&d)) {
            if let Some(mp) = l.split(' ').nth(4) {
                let _ = Command::new("umount").arg("-l").arg(mp).output();
            }
        }
        for pid in self.processes() {
            // SAFETY: plain kill(2) of a process this test started.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
    }
}

/// Fails the test unless every output is a success; returns their stdouts.
pub fn all_ok(outs: &[Output], what: &str) -> Vec<String> {
    outs.iter().enumerate().map(|(k, o)| crate::stdout_ok(o, format_args!("{what} on node {k}"))).collect()
}
