//! `odfs local`: a whole multi-node filesystem on this machine, every daemon a separate process
//! on loopback, node k's data under `ROOT/node<k>/`.
//!
//! Owns the layout of ROOT (configs, logs, data, `odfs.toml`, `local.state.toml`) and the life
//! cycle of the processes it starts. It must not leave a process behind on failure.

use crate::launch::lock::Lock;
use crate::launch::{self, log_tail, mount, procs, write_toml, MetaPlan, NodeLaunch, ProcEntry, Registry};
use anyhow::{bail, Context, Result};
use odfs_client::ClientConfig;
use odfs_proto::mgmt::{FsState, GetCluster};
use odfs_proto::{DirLayout, RequestHeader};
use odfs_rpc::{JobCredential, Pool, PoolConfig, SiteKey, Transport};
use odfs_service::JobSection;
use serde::{Deserialize, Serialize};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Empty chunk files each target keeps ready unless `odfs local up` is told otherwise.
pub use odfs_stored::config::{DEFAULT_DIRECT_WRITE_MIN_BYTES, DEFAULT_PRECREATE_CHUNK_FILES};

/// Options of `odfs local up`.
#[derive(Debug, Clone)]
pub struct UpOptions {
    pub root: PathBuf,
    pub nodes: u32,
    pub targets_per_node: u32,
    pub pool: String,
    pub chunk_size: u32,
    pub stripe_count: i32,
    pub bulk: Transport,
    /// Transport of the clients' metadata requests.
    pub meta_transport: Transport,
    pub job_id: Option<String>,
    pub site_key: Option<PathBuf>,
    pub timeout: Duration,
    pub io_backend: String,
    /// Empty chunk files each target keeps ready for new files (0: off).
    pub precreate_chunk_files: usize,
    /// Chunk writes of at least this many bytes bypass stored's page cache (0: none).
    pub direct_write_min_bytes: usize,
    /// Address the daemons listen on and advertise.
    pub bind: IpAddr,
    /// Where to mount the filesystem (None: no mount).
    pub mount: Option<PathBuf>,
    /// Give every node a RAM target of this size (a tmpfs; tmpfs `size=` syntax) in pool `ram`.
    pub ram_pool: Option<String>,
    /// Metadata services: shard k on node k, for k < meta (0 = one on every node).
    pub meta: u32,
    /// Serve the job's Prometheus metrics on this port of `bind` (node 0's mgmtd).
    pub metrics_port: Option<u16>,
}

impl Default for UpOptions {
    fn default() -> Self {
        UpOptions {
            root: PathBuf::from("odfs-local"),
            nodes: 4,
            targets_per_node: 1,
            pool: odfs_proto::layout::DEFAULT_POOL.into(),
            chunk_size: odfs_proto::layout::DEFAULT_CHUNK_SIZE,
            stripe_count: odfs_proto::layout::DEFAULT_STRIPE_COUNT,
            bulk: Transport::Tcp,
            meta_transport: ClientConfig::default().meta_transport,
            job_id: None,
            site_key: None,
            timeout: Duration::from_secs(30),
            io_backend: "auto".into(),
            precreate_chunk_files: DEFAULT_PRECREATE_CHUNK_FILES,
            direct_write_min_bytes: DEFAULT_DIRECT_WRITE_MIN_BYTES,
            bind: IpAddr::from([127, 0, 0, 1]),
            mount: None,
            ram_pool: None,
            meta: 1,
            metrics_port: None,
        }
    }
}

/// What `local up` started, for `down`, `restart` and `status`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
pub struct LocalState {
    pub job_id: String,
    pub nodes: u32,
    pub procs: Vec<ProcEntry>,
    /// FUSE mount points made by `up`.
    #[serde(default)]
    pub mounts: Vec<PathBuf>,
    /// tmpfs mounts of RAM targets, unmounted after the daemons stop.
    #[serde(default)]
    pub tmpfs: Vec<PathBuf>,
}

pub fn state_path(root: &Path) -> PathBuf {
    root.join("local.state.toml")
}

pub fn client_config_path(root: &Path) -> PathBuf {
    root.join("odfs.toml")
}

pub fn node_dir(root: &Path, node: u32) -> PathBuf {
    root.join(format!("node{node}"))
}

impl LocalState {
    pub fn load(root: &Path) -> Result<Option<LocalState>> {
        let p = state_path(root);
        match std::fs::read_to_string(&p) {
            Ok(t) => Ok(Some(toml::from_str(&t).with_context(|| format!("{} is damaged", p.display()))?)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).with_context(|| format!("cannot read {}", p.display())),
        }
    }

    fn save(&self, root: &Path) -> Result<()> {
        let p = state_path(root);
        let tmp = p.with_extension("tmp");
        std::fs::write(&tmp, toml::to_string_pretty(self)?)?;
        std::fs::rename(&tmp, &p)?;
        Ok(())
    }

    pub fn live_pids(&self) -> Vec<u32> {
        self.procs.iter().filter(|p| procs::runs(p.pid, &p.config)).map(|p| p.pid).collect()
    }
}

/// A port of `ip` that is free now, below the kernel's ephemeral range: the daemons bind their
/// listening ports some time after they are chosen, and meanwhile every daemon's own client
/// endpoint takes an ephemeral port, which must not be one of them.
fn free_port(ip: IpAddr, udp: bool) -> Result<u16> {
    let free = |port: u16| {
        let addr = SocketAddr::new(ip, port);
        let bound = if udp {
            std::net::UdpSocket::bind(addr).and_then(|s| s.local_addr())
        } else {
            std::net::TcpListener::bind(addr).and_then(|s| s.local_addr())
        };
        bound.map(|a| a.port())
    };
    let low = ephemeral_low().unwrap_or(32768);
    if low > 11000 {
        for _ in 0..200 {
            if let Ok(p) = free(rand::Rng::gen_range(&mut rand::thread_rng(), 10000..low)) {
                return Ok(p);
            }
        }
    }
    Ok(free(0)?)
}

/// The first port of the kernel's ephemeral range.
fn ephemeral_low() -> Option<u16> {
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    range.split_whitespace().next()?.parse().ok()
}

/// Starts a local filesystem and waits until it is ready. On failure everything started is
/// stopped again and the error says why.
pub fn up(opts: &UpOptions) -> Result<LocalState> {
    let layout = check_options(opts)?;
    std::fs::create_dir_all(&opts.root).with_context(|| format!("cannot create {}", opts.root.display()))?;
    let root = opts.root.canonicalize()?;
    let _lock = Lock::take(&root.join(".odfs.lock"), &root.display().to_string())?;
    let mut attempt = 1;
    loop {
        clear_leftovers(&root, opts)?;
        match up_once(opts, &root, layout.clone()) {
            // A port found free was taken before its daemon bound it (another process chose it
            // at the same moment): the next attempt chooses new ports.
            Err(e) if attempt < PORT_RACE_ATTEMPTS && format!("{e:#}").contains("is already in use") => {
                attempt += 1;
            }
            r => return r,
        }
    }
}

/// Start-up attempts of `odfs local up` when a chosen port is taken under it.
const PORT_RACE_ATTEMPTS: u32 = 3;

/// One attempt of [`up`]: every daemon on new ports; on failure, everything it started is stopped.
fn up_once(opts: &UpOptions, root: &Path, layout: DirLayout) -> Result<LocalState> {
    let root = root.to_path_buf();
    let site_key = site_key(opts, &root)?;
    let job_id = opts.job_id.clone().unwrap_or_else(|| format!("local-{:08x}", rand::random::<u32>()));
    let job = JobSection { id: job_id.clone(), site_key };
    let mgmtd = free_addr(opts.bind, true)?;
    let mut state = LocalState { job_id, nodes: opts.nodes, ..LocalState::default() };
    let started = plan_nodes(opts, &root, &job, mgmtd, layout, &mut state.tmpfs)
        .and_then(|nodes| start_nodes(&root, &nodes, &mut state))
        .and_then(|()| wait_ready(&job, mgmtd, &state, opts.timeout))
        .and_then(|()| {
            let ccfg = ClientConfig {
                job,
                mgmtd,
                bulk_transport: opts.bulk,
                meta_transport: opts.meta_transport,
                ..ClientConfig::default()
            };
            write_toml(&client_config_path(&root), &ccfg)?;
            match &opts.mount {
                Some(mp) => start_mount(&root, mp, &mut state, opts.timeout),
                None => Ok(()),
            }
        });
    if let Err(e) = started {
        roll_back(&root, &state);
        return Err(e.context(format!("odfs local up on {} failed; everything it started was stopped", root.display())));
    }
    Ok(state)
}

/// Most nodes `odfs local up` starts: each is two or three daemons with runtimes of their own on
/// one machine, and more than this is a typo (a count meant for a real cluster) rather than a
/// test.
pub const MAX_NODES: u32 = 64;

/// The options' own sense; returns the default layout they ask for.
fn check_options(opts: &UpOptions) -> Result<DirLayout> {
    anyhow::ensure!(opts.nodes >= 1, "--nodes must be at least 1");
    anyhow::ensure!(
        opts.nodes <= MAX_NODES,
        "--nodes {}: odfs local runs every node's daemons on this machine, at most {MAX_NODES} nodes",
        opts.nodes
    );
    anyhow::ensure!(opts.targets_per_node >= 1, "--targets-per-node must be at least 1");
    let metas = metas(opts);
    anyhow::ensure!(
        metas <= opts.nodes && metas <= u16::MAX as u32,
        "--meta {} is more than the {} nodes",
        opts.meta,
        opts.nodes
    );
    let layout = DirLayout {
        chunk_size: opts.chunk_size,
        stripe_count: opts.stripe_count,
        pool: opts.pool.clone(),
        start_target: None,
        local: false,
    };
    layout.validate().map_err(|e| anyhow::anyhow!(e))?;
    Ok(layout)
}

/// Metadata services asked for (0 = one on every node).
fn metas(opts: &UpOptions) -> u32 {
    if opts.meta == 0 {
        opts.nodes
    } else {
        opts.meta
    }
}

/// Refuses a root where odfs still runs; unmounts what processes that died left behind (a dead
/// mount fails every access under it).
fn clear_leftovers(root: &Path, opts: &UpOptions) -> Result<()> {
    if let Some(st) = LocalState::load(root)? {
        let live = st.live_pids();
        if !live.is_empty() {
            bail!(
                "odfs is already running on {} (pids {:?}); run `odfs local down --root {}` first",
                root.display(),
                live,
                root.display()
            );
        }
        for m in &st.mounts {
            for line in mount::unmount(m)? {
                eprintln!("odfs: cleaning up after a previous run: {line}");
            }
        }
    }
    if let Some(mp) = &opts.mount {
        for line in mount::unmount(mp)? {
            eprintln!("odfs: cleaning up a stale mount: {line}");
        }
    }
    Ok(())
}

/// The site key file: `--site-key`, else `ROOT/site.key` (made on first use); checked.
fn site_key(opts: &UpOptions, root: &Path) -> Result<PathBuf> {
    let p = match &opts.site_key {
        Some(p) => p.clone(),
        None => {
            let p = root.join("site.key");
            if !p.exists() {
                SiteKey::generate().write_new(&p)?;
            }
            p
        }
    };
    SiteKey::load(&p)?;
    Ok(p)
}

/// A free address of `ip` (UDP for QUIC, else TCP).
fn free_addr(ip: IpAddr, udp: bool) -> Result<SocketAddr> {
    let port = free_port(ip, udp).with_context(|| format!("cannot bind to {ip}"))?;
    Ok(SocketAddr::new(ip, port))
}

/// Every node's daemons with free ports; node k's RAM target is mounted here (into `tmpfs`).
fn plan_nodes(
    opts: &UpOptions,
    root: &Path,
    job: &JobSection,
    mgmtd: SocketAddr,
    layout: DirLayout,
    tmpfs: &mut Vec<PathBuf>,
) -> Result<Vec<NodeLaunch>> {
    let metas = metas(opts);
    let mut nodes = Vec::new();
    for k in 0..opts.nodes {
        let nd = node_dir(root, k);
        std::fs::create_dir_all(&nd)?;
        let ram = match &opts.ram_pool {
            Some(size) => {
                let dir = nd.join("ram");
                mount::mount_tmpfs(&dir, size)?;
                tmpfs.push(dir.clone());
                Some((dir, "ram".to_string()))
            }
            None => None,
        };
        let data_dirs = vec![nd.clone(); opts.targets_per_node as usize];
        nodes.push(NodeLaunch {
            job: job.clone(),
            node: k,
            mgmtd,
            registry: (k == 0).then(|| Registry {
                listen: mgmtd,
                storage_nodes: opts.nodes,
                metas,
                layout: layout.clone(),
            }),
            meta: (k < metas)
                .then(|| -> Result<MetaPlan> {
                    Ok(MetaPlan {
                        listen: free_addr(opts.bind, true)?,
                        data_dir: nd.join("meta"),
                        root_owner: None,
                        root_only_layouts: false,
                    })
                })
                .transpose()?,
            stored: free_addr(opts.bind, true)?,
            bulk: free_addr(opts.bind, false)?,
            agent: free_addr(opts.bind, true)?,
            targets: launch::node_targets(k, &data_dirs, &opts.pool, ram),
            io_backend: opts.io_backend.clone(),
            precreate_chunk_files: opts.precreate_chunk_files,
            direct_write_min_bytes: opts.direct_write_min_bytes,
            drop_behind_reads: true,
            register_timeout_secs: None,
            stored_worker_threads: Some(stored_workers(opts.nodes)),
            metrics: opts.metrics_port.map(|p| std::net::SocketAddr::new(opts.bind, p)),
        });
    }
    Ok(nodes)
}

/// Runtime threads of each node's stored: the node's share of this machine's cores, never more
/// than stored's default. The nodes share the machine, so the default's threads for every one of
/// them would be more runtime threads than cores, and each request they serve would more often
/// wake one that sleeps (docs/decisions/0001-stored-threads-on-a-shared-machine.md).
fn stored_workers(nodes: u32) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / nodes.max(1) as usize).clamp(1, odfs_service::DEFAULT_WORKER_THREADS)
}

/// Starts every node's daemons, each in its node's directory, recording them in `state`, saved
/// after each one: `odfs local down` then finds every process even of an `up` killed half way.
fn start_nodes(root: &Path, nodes: &[NodeLaunch], state: &mut LocalState) -> Result<()> {
    for n in nodes {
        n.start(&node_dir(root, n.node), |p| {
            state.procs.push(p);
            state.save(root)
        })?;
    }
    Ok(())
}

/// After a failed `up`: unmounts, stops every process and removes the state file.
fn roll_back(root: &Path, state: &LocalState) {
    for m in &state.mounts {
        let _ = mount::unmount(m);
    }
    let pids: Vec<(u32, &Path)> = state.procs.iter().map(|p| (p.pid, p.config.as_path())).collect();
    procs::stop_all(&pids, Duration::from_secs(2));
    for t in &state.tmpfs {
        let _ = mount::unmount(t);
    }
    let _ = std::fs::remove_file(state_path(root));
}

/// Starts `odfs-fuse` for node 0 and waits until the mount is there.
fn start_mount(root: &Path, mp: &Path, state: &mut LocalState, timeout: Duration) -> Result<()> {
    std::fs::create_dir_all(mp).with_context(|| format!("cannot create mount point {}", mp.display()))?;
    let mp = mp.canonicalize()?;
    let cfg = client_config_path(root);
    let log = node_dir(root, 0).join("fuse.log");
    crate::interrupt::mounting(&mp)?;
    let fuse = launch::spawn_fuse(&cfg, &mp, false, &log, 0)?;
    let pid = fuse.pid;
    state.procs.push(fuse);
    state.mounts.push(mp.clone());
    state.save(root)?;
    let alive = || {
        anyhow::ensure!(procs::runs(pid, &cfg), "odfs-fuse exited before {} was mounted", mp.display());
        Ok(())
    };
    let mounted = mount::wait_mounted(&mp, Instant::now() + timeout, alive).and_then(|ok| {
        anyhow::ensure!(ok, "{} was not mounted after {} s", mp.display(), timeout.as_secs());
        Ok(())
    });
    mounted.with_context(|| {
        format!("mounting {}; last log lines of {}:\n{}", mp.display(), log.display(), log_tail(&log, 5))
    })
}

/// Stage agents registered with mgmtd.
fn agents(v: &odfs_proto::mgmt::ClusterView) -> usize {
    v.services.iter().filter(|s| s.kind == odfs_proto::mgmt::ServiceKind::Agent && s.online).count()
}

/// Waits until mgmtd calls the filesystem ready and every node's stage agent is registered.
fn wait_ready(job: &JobSection, mgmtd: SocketAddr, state: &LocalState, timeout: Duration) -> Result<()> {
    let expect_agents = state.procs.iter().filter(|p| p.service == "agent").count();
    let cred = job.credential()?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let pool = probe_pool(cred)?;
        let start = Instant::now();
        loop {
            for p in &state.procs {
                ensure_runs(p, "during start-up")?;
            }
            let last = match pool.call(mgmtd, Transport::Quic, &RequestHeader::default(), &GetCluster {}).await {
                Ok(v) if v.state == FsState::Ready && agents(&v) >= expect_agents => return Ok(()),
                Ok(v) => {
                    let storage =
                        v.services.iter().filter(|s| s.kind == odfs_proto::mgmt::ServiceKind::Storage).count();
                    let meta = v.services.iter().filter(|s| s.kind == odfs_proto::mgmt::ServiceKind::Meta).count();
                    format!(
                        "{storage} of {} storage nodes, {meta} of {} metadata services and {} of \
                         {expect_agents} stage agents registered",
                        v.expected_storage_nodes,
                        v.expected_meta,
                        agents(&v)
                    )
                }
                Err(e) => format!("mgmtd at {mgmtd}: {e}"),
            };
            if start.elapsed() > timeout {
                bail!("filesystem not ready after {} s: {last}", timeout.as_secs());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
}

/// A pool for asking mgmtd whether the filesystem is up: one try per call, 2 s each.
fn probe_pool(cred: JobCredential) -> Result<Pool> {
    let cfg = PoolConfig {
        call_timeout: Duration::from_secs(2),
        retry_deadline: Duration::from_millis(1),
        conns_per_peer: 1,
    };
    Ok(Pool::new(cred, cfg)?)
}

/// Fails, with the end of its log, when a daemon started for the filesystem has exited.
fn ensure_runs(p: &ProcEntry, when: &str) -> Result<()> {
    if !procs::runs(p.pid, &p.config) {
        bail!(
            "{} on node {} exited {when}; last log lines of {}:\n{}",
            p.service,
            p.node,
            p.log.display(),
            log_tail(&p.log, 5)
        );
    }
    Ok(())
}

/// What `down` did.
#[derive(Debug, Default)]
pub struct DownReport {
    pub stopped: usize,
    pub killed: Vec<u32>,
    /// One line per unmount step taken.
    pub unmount_steps: Vec<String>,
}

/// Stops everything `up` started on ROOT. Safe to run twice.
pub fn down(root: &Path) -> Result<DownReport> {
    anyhow::ensure!(root.is_dir(), "{} does not exist", root.display());
    let _lock = Lock::take(&root.join(".odfs.lock"), &root.display().to_string())?;
    let Some(state) = LocalState::load(root)? else {
        return Ok(DownReport::default());
    };
    // Unmount first: a FUSE daemon stopped under its mount leaves a dead mount behind
    // ("Transport endpoint is not connected"); `mount::unmount` never waits on a stuck daemon.
    let mut unmount_steps = Vec::new();
    for m in &state.mounts {
        unmount_steps.extend(mount::unmount(m)?);
    }
    let live = state.live_pids().len();
    // The FUSE clients first, while metad still answers their goodbyes (or the goodbye said for
    // one that died: no change waits a lease for a client that is gone).
    let (fuse, daemons): (Vec<&ProcEntry>, Vec<&ProcEntry>) = state.procs.iter().partition(|p| p.service == "fuse");
    let pids = |ps: &[&ProcEntry]| -> Vec<(u32, PathBuf)> { ps.iter().map(|p| (p.pid, p.config.clone())).collect() };
    let mut killed = stop_each(&pids(&fuse));
    unmount_steps.extend(fuse.iter().filter_map(|p| launch::end_fuse_sessions(p)));
    killed.extend(stop_each(&pids(&daemons)));
    for t in &state.tmpfs {
        unmount_steps.extend(mount::unmount(t)?);
    }
    std::fs::remove_file(state_path(root))?;
    Ok(DownReport { stopped: live, killed, unmount_steps })
}

/// Stops processes (pid, marker) as `procs::stop_all` does, with `down`'s grace.
fn stop_each(procs: &[(u32, PathBuf)]) -> Vec<u32> {
    let refs: Vec<(u32, &Path)> = procs.iter().map(|(p, m)| (*p, m.as_path())).collect();
    procs::stop_all(&refs, Duration::from_secs(3))
}

/// What `wipe` removed, and what it left under ROOT.
#[derive(Debug, Default)]
pub struct Wiped {
    /// Bytes on disk removed (chunk files, metadata, logs, configs).
    pub bytes: u64,
    /// Entries of ROOT that `up` did not make, left as they were (ROOT itself goes when none).
    pub kept: Vec<String>,
}

/// Whether `name`, an entry of ROOT, is one `up` makes: the nodes' directories (data, logs,
/// configs), the client config, the site key made when none was given, the state and lock
/// files and the default mount point.
fn made_by_up(name: &str) -> bool {
    let node = name.strip_prefix("node").is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
    node || ["odfs.toml", "site.key", "local.state.toml", "local.state.tmp", ".odfs.lock", "mnt"].contains(&name)
}

/// Removes what `up` made under ROOT (`odfs local down --wipe`), once nothing runs there: then
/// ROOT itself if nothing else is in it. Refuses while a mount lies under ROOT, rather than
/// removing what a filesystem mounted there holds.
pub fn wipe(root: &Path) -> Result<Wiped> {
    anyhow::ensure!(root.is_dir(), "{} does not exist", root.display());
    let root = root.canonicalize()?;
    let lock = Lock::take(&root.join(".odfs.lock"), &root.display().to_string())?;
    if let Some(st) = LocalState::load(&root)? {
        bail!(
            "odfs still runs on {} (pids {:?}): nothing was wiped; run `odfs local down --root {}` first",
            root.display(),
            st.live_pids(),
            root.display()
        );
    }
    let text = std::fs::read_to_string("/proc/self/mountinfo").context("cannot read /proc/self/mountinfo")?;
    if let Some(m) = mount::parse_mountinfo(&text).into_iter().find(|m| m.mount_point.starts_with(&root)) {
        bail!(
            "{} is still mounted ({}): nothing under {} was wiped; unmount it first",
            m.mount_point.display(),
            m.fstype,
            root.display()
        );
    }
    let mut w = Wiped::default();
    let entries = std::fs::read_dir(&root).with_context(|| format!("cannot list {}", root.display()))?;
    for e in entries {
        let e = e.with_context(|| format!("cannot list {}", root.display()))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if !made_by_up(&name) {
            w.kept.push(name);
            continue;
        }
        let p = e.path();
        w.bytes += disk_usage(&p);
        let gone = if e.file_type()?.is_dir() { std::fs::remove_dir_all(&p) } else { std::fs::remove_file(&p) };
        gone.with_context(|| format!("cannot remove {}", p.display()))?;
    }
    drop(lock);
    w.kept.sort();
    if w.kept.is_empty() {
        std::fs::remove_dir(&root).with_context(|| format!("cannot remove {}", root.display()))?;
    }
    Ok(w)
}

/// Bytes on disk under `p` (allocated blocks, as du counts them), not following links.
pub fn disk_usage(p: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(m) = std::fs::symlink_metadata(p) else { return 0 };
    let own = m.blocks() * 512;
    if !m.is_dir() {
        return own;
    }
    let children = std::fs::read_dir(p).into_iter().flatten().flatten();
    own + children.map(|e| disk_usage(&e.path())).sum::<u64>()
}

/// Restarts one daemon of a running local filesystem (after a crash, or to test recovery).
pub fn restart(root: &Path, service: &str, node: u32) -> Result<u32> {
    let _lock = Lock::take(&root.join(".odfs.lock"), &root.display().to_string())?;
    let mut state = LocalState::load(root)?.with_context(|| format!("nothing runs on {}", root.display()))?;
    let entry = state
        .procs
        .iter_mut()
        .find(|p| p.service == service && p.node == node)
        .with_context(|| format!("no {service} on node {node}"))?;
    anyhow::ensure!(service != "fuse", "restart the mount with `odfs local down` and `odfs local up`");
    procs::stop_all(&[(entry.pid, &entry.config)], Duration::from_secs(3));
    let bin = procs::binary(&format!("odfs-{service}"))?;
    entry.pid = procs::spawn_daemon(&bin, &entry.config, &entry.log)?;
    let restarted = entry.clone();
    state.save(root)?;
    wait_restarted(root, &restarted, RESTART_TIMEOUT)?;
    Ok(restarted.pid)
}

/// How long `restart` waits for the new daemon to serve.
const RESTART_TIMEOUT: Duration = Duration::from_secs(30);

/// Waits until a restarted daemon serves: mgmtd answers (when it is the one restarted) or
/// lists the daemon registered under its new pid. A daemon that exits meanwhile (its port
/// taken, its data refused) fails the restart with the end of its log, rather than leaving a
/// filesystem that looks up but is not.
fn wait_restarted(root: &Path, p: &ProcEntry, timeout: Duration) -> Result<()> {
    let cfg = ClientConfig::load(&client_config_path(root))?;
    // mgmtd is not a registered service: for it, answering is enough.
    let kind = odfs_proto::mgmt::ServiceKind::ALL.into_iter().find(|k| k.name() == p.service);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let pool = probe_pool(cfg.job.credential()?)?;
        let start = Instant::now();
        loop {
            ensure_runs(p, "after its restart")?;
            let last = match pool.call(cfg.mgmtd, Transport::Quic, &RequestHeader::default(), &GetCluster {}).await {
                Ok(v) => match kind {
                    None => return Ok(()),
                    Some(kind) if v.services.iter().any(|s| s.kind == kind && s.pid == p.pid && s.online) => {
                        return Ok(())
                    }
                    Some(_) => format!("mgmtd does not list it under pid {} yet", p.pid),
                },
                Err(e) => format!("mgmtd at {}: {e}", cfg.mgmtd),
            };
            if start.elapsed() > timeout {
                bail!(
                    "{} on node {} did not come back within {} s ({last}); last log lines of {}:\n{}",
                    p.service,
                    p.node,
                    timeout.as_secs(),
                    p.log.display(),
                    log_tail(&p.log, 5)
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
}

/// The credential of a local filesystem, for tools that speak to it directly.
pub fn credential(root: &Path) -> Result<JobCredential> {
    let cfg = ClientConfig::load(&client_config_path(root))?;
    Ok(cfg.job.credential()?)
}

#[cfg(test)]
mod tests {
    use super::stored_workers;
    use odfs_service::DEFAULT_WORKER_THREADS;

    #[test]
    fn each_node_s_stored_gets_its_share_of_the_cores_and_never_more_than_the_default() {
        let cores = std::thread::available_parallelism().unwrap().get();
        assert_eq!(stored_workers(1), cores.min(DEFAULT_WORKER_THREADS));
        assert_eq!(stored_workers(u32::MAX), 1, "nodes beyond the cores still get one thread");
        assert_eq!(stored_workers(0), cores.min(DEFAULT_WORKER_THREADS), "no nodes reads as one");
        for nodes in 1..=16 {
            let w = stored_workers(nodes);
            assert!((1..=DEFAULT_WORKER_THREADS).contains(&w), "{nodes} nodes: {w} threads");
            assert!(w == 1 || w * nodes as usize <= cores, "{nodes} nodes x {w} threads > {cores} cores");
        }
    }
}
