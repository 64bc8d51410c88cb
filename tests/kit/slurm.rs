//! A real Slurm cluster on this machine for end-to-end tests: munged, slurmctld, and one
//! slurmd per node, each node in a network namespace of its own (its own address on a bridge)
//! and a mount namespace of its own (its mounts invisible to the other nodes and to the
//! test), as on separate machines. slurm.conf includes the project's `slurm/slurm.conf.odfs`,
//! and every node's /etc/odfs is a bind mount of the cluster's own directory holding the
//! project's prolog, epilog and TaskProlog scripts, a site config and a site key; /etc/hosts
//! names the nodes. An S3 server (s3s-fs) listens on the bridge. Everything is removed on drop.
//!
//! Needs root, iproute2, util-linux, munge and Slurm (slurmctld, slurmd, the client
//! commands); scripts/test installs them.

use crate::{bin_dir, stdout_ok, S3Server};
use std::fs;
use std::net::IpAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Bucket the cluster's S3 server starts with.
pub const BUCKET: &str = "odfs";

fn run(cmd: &str, args: &[&str]) -> Output {
    Command::new(cmd).args(args).output().unwrap_or_else(|e| panic!("cannot run {cmd}: {e}"))
}

fn ok(cmd: &str, args: &[&str]) -> String {
    stdout_ok(&run(cmd, args), format_args!("{cmd} {args:?}"))
}

/// Starts munged once per machine (tests share it); every cluster authenticates through it.
fn ensure_munge() {
    let lock = fs::File::create("/tmp/odfs-test-munge.lock").expect("munge lock file");
    // SAFETY: flock on a valid fd; released when `lock` is dropped.
    unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX) };
    let works =
        || Command::new("sh").args(["-c", "munge -n | unmunge >/dev/null 2>&1"]).status().is_ok_and(|s| s.success());
    if works() {
        return;
    }
    assert!(
        Path::new("/usr/sbin/munged").exists() && Path::new("/etc/munge/munge.key").exists(),
        "munge is not installed (apt-get install munge; scripts/test does)"
    );
    ok("install", &["-d", "-o", "munge", "-g", "munge", "-m", "0755", "/run/munge"]);
    // It outlives this test (every cluster of the run shares it): setsid --fork detaches it.
    let st = Command::new("setsid")
        .args(["--fork", "setpriv", "--reuid=munge", "--regid=munge", "--init-groups", "/usr/sbin/munged", "-F"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("start munged");
    assert!(st.success(), "cannot start munged: {st}");
    let t = Instant::now();
    while !works() {
        assert!(t.elapsed() < Duration::from_secs(10), "munged did not come up within 10 s");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A slot (1..=200) held for the life of a cluster: its subnet, bridge, namespace names and
/// slurmctld port, so clusters of tests running at once never meet.
fn take_slot() -> (u32, fs::File) {
    fs::create_dir_all("/tmp/odfs-test-slots").expect("slot dir");
    for s in 1..=200u32 {
        let f = fs::File::create(format!("/tmp/odfs-test-slots/{s}.lock")).expect("slot file");
        // SAFETY: flock on a valid fd.
        if unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&f), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return (s, f);
        }
    }
    panic!("no free test cluster slot");
}

/// The cluster's network: a bridge on the host with the head address (slurmctld, S3), and one
/// network namespace per node joined to it by a veth pair.
struct Net {
    slot: u32,
    subnet: String,
    bridge: String,
    netns: Vec<String>,
}

impl Net {
    fn head_ip(&self) -> IpAddr {
        format!("{}.1", self.subnet).parse().unwrap()
    }

    fn node_ip(&self, k: usize) -> String {
        format!("{}.{}", self.subnet, 11 + k)
    }

    fn create(&self) {
        self.remove();
        ok("ip", &["link", "add", &self.bridge, "type", "bridge"]);
        ok("ip", &["addr", "add", &format!("{}.1/24", self.subnet), "dev", &self.bridge]);
        ok("ip", &["link", "set", &self.bridge, "up"]);
        for (k, ns) in self.netns.iter().enumerate() {
            let (host_end, node_end) = (format!("odfs{}v{}", self.slot, k + 1), format!("odfs{}e{}", self.slot, k + 1));
            ok("ip", &["netns", "add", ns]);
            ok("ip", &["-n", ns, "link", "set", "lo", "up"]);
            ok("ip", &["link", "add", &host_end, "type", "veth", "peer", "name", &node_end]);
            ok("ip", &["link", "set", &node_end, "netns", ns]);
            ok("ip", &["-n", ns, "link", "set", &node_end, "name", "eth0"]);
            ok("ip", &["link", "set", &host_end, "master", &self.bridge, "up"]);
            ok("ip", &["-n", ns, "addr", "add", &format!("{}/24", self.node_ip(k)), "dev", "eth0"]);
            ok("ip", &["-n", ns, "link", "set", "eth0", "up"]);
        }
    }

    fn remove(&self) {
        for ns in &self.netns {
            let _ = run("ip", &["netns", "del", ns]);
        }
        for k in 0..self.netns.len() {
            let _ = run("ip", &["link", "del", &format!("odfs{}v{}", self.slot, k + 1)]);
        }
        let _ = run("ip", &["link", "del", &self.bridge]);
    }
}

/// Settings of a test cluster.
#[derive(Clone)]
pub struct ClusterOptions {
    pub nodes: usize,
    /// Extra lines for the `[ondemand]` table of the site config.
    pub ondemand: String,
    /// Install slurm/job_submit.lua (JobSubmitPlugins=lua): scripts are checked at sbatch.
    pub job_submit: bool,
}

impl Default for ClusterOptions {
    fn default() -> Self {
        ClusterOptions { nodes: 4, ondemand: String::new(), job_submit: false }
    }
}

/// The state of a job as `scontrol show job` tells it.
#[derive(Debug, Clone, Default)]
pub struct JobInfo {
    pub state: String,
    pub reason: String,
    pub nodes: String,
    pub restarts: u32,
    pub exit_code: String,
}

pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub slot: u32,
    pub nodes: Vec<String>,
    pub s3: S3Server,
    net: Net,
    conf: PathBuf,
    ctld: Option<Child>,
    slurmd: Vec<Option<Child>>,
    _slot: fs::File,
}

impl Cluster {
    pub fn new(o: ClusterOptions) -> Cluster {
        // SAFETY: geteuid has no preconditions.
        assert!(
            unsafe { libc::geteuid() } == 0,
            "the Slurm tests start slurmd and mount filesystems: run them as root"
        );
        for b in ["slurmctld", "slurmd", "sbatch", "scontrol", "ip", "nsenter", "unshare", "runuser"] {
            assert!(
                run("sh", &["-c", &format!("command -v {b}")]).status.success(),
                "{b} is missing (scripts/test installs Slurm, munge, iproute2 and util-linux)"
            );
        }
        ensure_munge();
        let (slot, lock) = take_slot();
        let dir = tempfile::Builder::new().prefix("odfs-slurm-").tempdir().expect("tempdir");
        // Job users write their output files under it.
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
        let subnet = format!("10.214.{slot}");
        let nodes: Vec<String> = (1..=o.nodes).map(|k| format!("n{k}")).collect();
        let netns: Vec<String> = (1..=o.nodes).map(|k| format!("odfss{slot}n{k}")).collect();
        let bridge = format!("odfsbr{slot}");
        let d = dir.path().to_path_buf();
        for sub in ["etc-odfs", "log", "spool", "ctld", "out", "jobs", "s3"] {
            fs::create_dir_all(d.join(sub)).unwrap();
        }
        for p in ["out", "jobs"] {
            fs::set_permissions(d.join(p), fs::Permissions::from_mode(0o1777)).unwrap();
        }
        let net = Net { slot, subnet: subnet.clone(), bridge, netns };
        net.create();
        let s3 = S3Server::s3s_on(&d.join("s3"), &[BUCKET], net.head_ip());
        let mut c = Cluster {
            dir,
            slot,
            nodes,
            s3,
            net,
            conf: d.join("slurm.conf"),
            ctld: None,
            slurmd: Vec::new(),
            _slot: lock,
        };
        c.write_files(&o);
        c.start_ctld();
        for k in 0..o.nodes {
            let child = c.spawn_slurmd(k);
            c.slurmd.push(Some(child));
        }
        c.wait_nodes_idle(&c.nodes.clone(), Duration::from_secs(30));
        c
    }

    pub fn node_ip(&self, k: usize) -> String {
        self.net.node_ip(k)
    }

    /// slurm.conf, /etc/hosts, and the /etc/odfs every node sees.
    fn write_files(&self, o: &ClusterOptions) {
        let d = self.dir.path();
        let repo = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("repository root");
        let etc = d.join("etc-odfs");
        for f in ["prolog.sh", "epilog.sh", "task_prolog.sh", "slurm.conf.odfs"] {
            fs::copy(repo.join("slurm").join(f), etc.join(f)).unwrap_or_else(|e| panic!("copy slurm/{f}: {e}"));
        }
        let key = etc.join("site.key");
        crate::odfs_ok(&["keygen", "--out", &key.display().to_string()]);
        fs::write(etc.join("slurm.env"), format!("ODFS_BIN={}\n", bin_dir().join("odfs").display())).unwrap();
        let creds = etc.join("s3.credentials");
        fs::write(&creds, crate::credentials_file_text()).unwrap();
        fs::set_permissions(&creds, fs::Permissions::from_mode(0o600)).unwrap();
        // The shipped example, edited as docs/admin.md says an admin edits it: this cluster's
        // paths, shorter timeouts for tests, its S3 server and the site's staging account.
        let ondemand = format!(
            "data_paths = [\"{d}/%n/nvme\"]\nstate_dir = \"{d}/%n/state\"\nmount = \"{d}/%n/mnt/%j\"\n\
             ram_size = \"64M\"\nready_timeout_secs = 30\nstage_timeout_secs = 300\nstop_grace_secs = 20\n{}",
            o.ondemand,
            d = d.display()
        );
        let stage = format!(
            "endpoint_url = \"{}\"\ncredentials_file = \"/etc/odfs/s3.credentials\"\nmax_attempts = 3\n",
            self.s3.url()
        );
        let example = fs::read_to_string(repo.join("slurm/site.toml")).unwrap();
        let site = set_keys(&set_keys(&example, "ondemand", &ondemand), "stage", &stage);
        fs::write(etc.join("site.toml"), site).unwrap();
        for n in &self.nodes {
            fs::create_dir_all(d.join(n).join("nvme")).unwrap();
        }
        let mut hosts = String::from("127.0.0.1 localhost\n");
        hosts += &format!("{}.1 head\n", self.net.subnet);
        for (k, n) in self.nodes.iter().enumerate() {
            hosts += &format!("{} {n}\n", self.node_ip(k));
        }
        fs::write(d.join("hosts"), hosts).unwrap();
        // The bind mounts need these to exist in the host's view (they stay empty here).
        fs::create_dir_all("/etc/odfs").unwrap();
        let host = ok("hostname", &["-s"]).trim().to_string();
        let node_lines: String = (0..self.nodes.len())
            .map(|k| {
                format!(
                    "NodeName={} NodeAddr={} CPUs=2 Feature=odfs,odfs_ram State=UNKNOWN\n",
                    self.nodes[k],
                    self.node_ip(k)
                )
            })
            .collect();
        let conf = format!(
            "ClusterName=odfs{slot}\nSlurmctldHost={host}({subnet}.1)\nSlurmctldPort={port}\nSlurmdPort=6818\n\
             SlurmUser=root\nAuthType=auth/munge\nStateSaveLocation={d}/ctld\nSlurmdSpoolDir={d}/spool/%n\n\
             SlurmctldPidFile={d}/slurmctld.pid\nSlurmdPidFile={d}/slurmd.%n.pid\n\
             SlurmctldLogFile={d}/log/slurmctld.log\nSlurmdLogFile={d}/log/slurmd.%n.log\n\
             ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nSelectType=select/cons_tres\n\
             SelectTypeParameters=CR_Core\nSchedulerType=sched/backfill\nSchedulerParameters=bf_interval=1\n\
             AccountingStorageType=accounting_storage/none\nJobAcctGatherType=jobacct_gather/none\n\
             JobCompType=jobcomp/none\nMpiDefault=none\nMailProg=/bin/true\nReturnToService=2\n\
             SlurmdParameters=config_overrides\nSlurmdTimeout=5\nKillWait=5\nMinJobAge=600\n\
             {job_submit}Include {d}/etc-odfs/slurm.conf.odfs\n{node_lines}\
             PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n",
            slot = self.slot,
            subnet = self.net.subnet,
            port = 17100 + self.slot,
            d = d.display(),
            job_submit = if o.job_submit { "JobSubmitPlugins=lua\n" } else { "" },
        );
        fs::write(&self.conf, conf).unwrap();
        if o.job_submit {
            // Next to slurm.conf, with this build's odfs.
            let lua = include_str!("../../slurm/job_submit.lua").replace(
                "local ODFS = \"/usr/local/bin/odfs\"",
                &format!("local ODFS = \"{}\"", bin_dir().join("odfs").display()),
            );
            assert!(lua.contains(&bin_dir().display().to_string()), "job_submit.lua names odfs on one line");
            fs::write(d.join("job_submit.lua"), lua).unwrap();
        }
    }

    fn start_ctld(&mut self) {
        let log = fs::File::create(self.dir.path().join("log/slurmctld.out")).unwrap();
        let child = Command::new("slurmctld")
            .args(["-D", "-i", "-f"])
            .arg(&self.conf)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start slurmctld");
        self.ctld = Some(child);
    }

    /// slurmd of node k in its network namespace, a new mount and UTS namespace, with the
    /// cluster's /etc/odfs and /etc/hosts bound in.
    fn spawn_slurmd(&self, k: usize) -> Child {
        let d = self.dir.path();
        let log = fs::File::create(d.join(format!("log/slurmd.{}.out", self.nodes[k]))).unwrap();
        let script = format!(
            "hostname {n} && mount --bind {d}/etc-odfs /etc/odfs && mount --bind {d}/hosts /etc/hosts && \
             exec slurmd -D -f {conf} -N {n}",
            n = self.nodes[k],
            d = d.display(),
            conf = self.conf.display()
        );
        Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", self.net.netns[k]))
            .args(["unshare", "--mount", "--uts", "--propagation", "slave", "sh", "-c", &script])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start slurmd")
    }

    /// Runs a Slurm client command (as root) against this cluster.
    pub fn slurm(&self, cmd: &str, args: &[&str]) -> Output {
        Command::new(cmd).args(args).env("SLURM_CONF", &self.conf).output().unwrap_or_else(|e| panic!("run {cmd}: {e}"))
    }

    pub fn slurm_ok(&self, cmd: &str, args: &[&str]) -> String {
        stdout_ok(&self.slurm(cmd, args), format_args!("{cmd} {args:?}"))
    }

    /// Writes `script` and submits it as `user` with `args`; returns the job id.
    pub fn sbatch(&self, user: &str, name: &str, script: &str, args: &[&str]) -> String {
        let out = self.sbatch_output(user, name, script, args);
        assert!(out.status.success(), "sbatch {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).trim().split(';').next().unwrap().to_string()
    }

    /// Writes `script` and runs sbatch on it as `user` with `args`: what sbatch said.
    pub fn sbatch_output(&self, user: &str, name: &str, script: &str, args: &[&str]) -> Output {
        let path = self.dir.path().join("jobs").join(format!("{name}.sh"));
        fs::write(&path, script).unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).unwrap();
        Command::new("runuser")
            .args(["-u", user, "--", "sbatch", "--parsable"])
            .args(["-o", &format!("{}/out/%j.out", self.dir.path().display())])
            .args(args)
            .arg(&path)
            .current_dir(self.dir.path().join("jobs"))
            .env("SLURM_CONF", &self.conf)
            .output()
            .expect("run sbatch")
    }

    /// The job's output file.
    pub fn output(&self, job: &str) -> String {
        fs::read_to_string(self.dir.path().join("out").join(format!("{job}.out"))).unwrap_or_default()
    }

    pub fn job(&self, job: &str) -> JobInfo {
        let out = self.slurm("scontrol", &["show", "job", "-o", job]);
        let text = String::from_utf8_lossy(&out.stdout);
        let field =
            |k: &str| text.split_whitespace().find_map(|w| w.strip_prefix(&format!("{k}="))).unwrap_or("").to_string();
        JobInfo {
            state: field("JobState"),
            reason: field("Reason"),
            nodes: field("NodeList"),
            restarts: field("Restarts").parse().unwrap_or(0),
            exit_code: field("ExitCode"),
        }
    }

    /// (state, reason) of a node; an empty state when scontrol fails (a busy slurmctld), which
    /// the waits then ask again.
    pub fn node_state(&self, node: &str) -> (String, String) {
        let out = self.slurm("scontrol", &["show", "node", "-o", node]);
        let text = String::from_utf8_lossy(&out.stdout);
        let state = text.split_whitespace().find_map(|w| w.strip_prefix("State=")).unwrap_or("").to_string();
        let reason = text.split(" Reason=").nth(1).map(|r| r.trim().to_string()).unwrap_or_default();
        (state, reason)
    }

    /// Waits until the job has ended and every epilog is done.
    pub fn wait_ended(&self, job: &str, limit: Duration) -> JobInfo {
        crate::wait_for(&format!("job {job} to end"), limit, || {
            let j = self.job(job);
            let done = matches!(
                j.state.as_str(),
                "COMPLETED" | "FAILED" | "CANCELLED" | "TIMEOUT" | "NODE_FAIL" | "OUT_OF_MEMORY" | "BOOT_FAIL"
            );
            (done, j)
        })
    }

    pub fn wait_nodes_idle(&self, nodes: &[String], limit: Duration) {
        for n in nodes {
            crate::wait_for(&format!("node {n} idle"), limit, || {
                let (s, r) = self.node_state(n);
                (s == "IDLE", (s, r))
            });
        }
    }

    /// Pid of a process living in node k's namespaces (its slurmd).
    pub fn node_pid(&self, k: usize) -> u32 {
        self.slurmd[k].as_ref().map(|c| c.id()).unwrap_or_else(|| panic!("node {} is down", self.nodes[k]))
    }

    /// Runs `sh -c cmd` in node k's mount and network namespaces, as root.
    pub fn node_sh(&self, k: usize, cmd: &str) -> Output {
        Command::new("nsenter")
            .args(["-t", &self.node_pid(k).to_string(), "-m", "-n", "--", "sh", "-c", cmd])
            .output()
            .expect("run nsenter")
    }

    /// Like `node_sh`, failing the test unless the command succeeds; returns stdout.
    pub fn node_ok(&self, k: usize, cmd: &str) -> String {
        stdout_ok(&self.node_sh(k, cmd), format_args!("{}: `{cmd}`", self.nodes[k]))
    }

    fn netns_inode(&self, k: usize) -> Option<u64> {
        use std::os::unix::fs::MetadataExt;
        fs::metadata(format!("/run/netns/{}", self.net.netns[k])).ok().map(|m| m.ino())
    }

    /// Every process in node k's network namespace: (pid, command name).
    pub fn node_processes(&self, k: usize) -> Vec<(u32, String)> {
        use std::os::unix::fs::MetadataExt;
        let Some(ino) = self.netns_inode(k) else { return Vec::new() };
        let mut out = Vec::new();
        for e in fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
            if fs::metadata(format!("/proc/{pid}/ns/net")).is_ok_and(|m| m.ino() == ino) {
                let comm = fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default().trim().to_string();
                out.push((pid, comm));
            }
        }
        out
    }

    /// odfs processes left in node k's namespaces.
    pub fn odfs_processes(&self, k: usize) -> Vec<(u32, String)> {
        self.node_processes(k).into_iter().filter(|(_, c)| c.starts_with("odfs")).collect()
    }

    /// Waits until no odfs process runs on node k (an epilog or prolog still finishing).
    pub fn wait_no_odfs(&self, k: usize, limit: Duration) {
        crate::wait_for(&format!("no odfs process on {}", self.nodes[k]), limit, || {
            let p = self.odfs_processes(k);
            (p.is_empty(), p)
        });
    }

    /// This cluster's odfs mounts in node k's mount namespace (lines of its mountinfo; the
    /// host's own mounts show there too and are not the cluster's).
    pub fn odfs_mounts(&self, k: usize) -> Vec<String> {
        let info = fs::read_to_string(format!("/proc/{}/mountinfo", self.node_pid(k))).unwrap_or_default();
        let d = self.dir.path().display().to_string();
        info.lines()
            .filter(|l| l.contains(&d) && (l.contains("fuse.odfs") || l.contains(" odfs-ram ")))
            .map(str::to_string)
            .collect()
    }

    /// What a node keeps under its data path (job data directories).
    pub fn data_entries(&self, k: usize) -> Vec<String> {
        crate::entries(&self.nvme(k))
    }

    /// Job records in a node's state directory.
    pub fn state_entries(&self, k: usize) -> Vec<String> {
        crate::subdirs(&self.dir.path().join(&self.nodes[k]).join("state"))
    }

    /// A node's event log (odfs start/stop/cleanup lines).
    pub fn event_log(&self, k: usize) -> String {
        fs::read_to_string(self.dir.path().join(&self.nodes[k]).join("state/odfs.log")).unwrap_or_default()
    }

    /// The data path of node k, as the site config names it.
    pub fn nvme(&self, k: usize) -> PathBuf {
        self.dir.path().join(&self.nodes[k]).join("nvme")
    }

    /// Asserts that node k holds nothing of any job: no odfs process, no mount, no data, no record.
    pub fn assert_clean(&self, k: usize) {
        let n = &self.nodes[k];
        assert!(self.odfs_processes(k).is_empty(), "{n}: odfs processes left: {:?}", self.odfs_processes(k));
        assert!(self.odfs_mounts(k).is_empty(), "{n}: mounts left: {:?}", self.odfs_mounts(k));
        assert!(self.data_entries(k).is_empty(), "{n}: data left: {:?}", self.data_entries(k));
        assert!(self.state_entries(k).is_empty(), "{n}: job records left: {:?}", self.state_entries(k));
    }

    /// Kills every process of node k (slurmd, job steps, odfs daemons) with SIGKILL, as a node
    /// that loses power. Its mount namespace goes with them; its disks stay.
    pub fn kill_node(&mut self, k: usize) {
        // Up to 30 s: a killed process in uninterruptible disk I/O goes only when the I/O ends.
        for _ in 0..300 {
            let procs = self.node_processes(k);
            if procs.is_empty() {
                break;
            }
            for (pid, _) in procs {
                // SAFETY: plain kill(2).
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        if let Some(mut c) = self.slurmd[k].take() {
            let _ = c.wait();
        }
        assert!(self.node_processes(k).is_empty(), "{}: processes survived SIGKILL", self.nodes[k]);
    }

    /// Starts node k's slurmd again (fresh mount namespace, same network namespace and disks).
    pub fn restart_node(&mut self, k: usize) {
        let c = self.spawn_slurmd(k);
        self.slurmd[k] = Some(c);
    }

    /// Sets `key = value` lines in the `[stage]` table of the site config every node reads.
    pub fn site_config_set_stage(&self, lines: &str) {
        let p = self.dir.path().join("etc-odfs/site.toml");
        let text = fs::read_to_string(&p).unwrap();
        fs::write(&p, set_keys(&text, "stage", lines)).unwrap();
    }

    /// The tail of every log a failing test wants to see.
    pub fn logs(&self) -> String {
        let mut s = String::new();
        for (k, n) in self.nodes.iter().enumerate() {
            s += &format!("--- {n} event log:\n{}", self.event_log(k));
        }
        if let Ok(t) = fs::read_to_string(self.dir.path().join("log/slurmctld.log")) {
            let lines: Vec<&str> = t.lines().collect();
            s += &format!("--- slurmctld.log (tail):\n{}\n", lines[lines.len().saturating_sub(30)..].join("\n"));
        }
        s
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for k in 0..self.net.netns.len() {
            if self.slurmd.get(k).is_some_and(|c| c.is_some()) {
                self.kill_node(k);
            }
        }
        if let Some(mut c) = self.ctld.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.s3.kill();
        self.net.remove();
        if std::env::var_os("ODFS_TEST_KEEP").is_some() {
            let d = std::mem::replace(&mut self.dir, tempfile::tempdir().expect("tempdir"));
            eprintln!("ODFS_TEST_KEEP: the cluster's files stay in {}", d.keep().display());
        }
    }
}

/// `text` (TOML) with each `key = value` of `lines` set in `[table]`: a line of that key there,
/// set or commented out (`# key = …`), is replaced; otherwise the line goes at the table's end.
/// The result must parse.
fn set_keys(text: &str, table: &str, lines: &str) -> String {
    let mut out: Vec<String> = text.lines().map(str::to_string).collect();
    for line in lines.lines().filter(|l| !l.trim().is_empty()) {
        let key = line.split('=').next().unwrap().trim();
        let start = out.iter().position(|l| l.trim() == format!("[{table}]")).unwrap_or_else(|| panic!("no [{table}]"));
        let end = out.iter().skip(start + 1).position(|l| l.starts_with('[')).map_or(out.len(), |i| start + 1 + i);
        let is_key = |l: &String| {
            let l = l.trim_start_matches('#').trim_start();
            l.split('=').next().is_some_and(|k| k.trim() == key) && l.contains('=')
        };
        match (start + 1..end).find(|&i| is_key(&out[i])) {
            Some(i) => out[i] = line.to_string(),
            None => out.insert(end, line.to_string()),
        }
    }
    let text = out.join("\n") + "\n";
    toml::from_str::<toml::Value>(&text).unwrap_or_else(|e| panic!("site config does not parse: {e}\n{text}"));
    text
}
