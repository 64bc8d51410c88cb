//! `odfs local`: a whole multi-node filesystem on this machine, every daemon a separate process
//! on loopback, node k's data under `ROOT/node<k>/`.
//!
//! Owns the layout of ROOT (configs, logs, data, `odfs.toml`, `local.state.toml`) and the life
//! cycle of the processes it starts. It must not leave a process behind on failure.

use crate::lock::Lock;
use crate::{mount, procs};
use anyhow::{bail, Context, Result};
use odfs_client::ClientConfig;
use odfs_metad::config::MetadConfig;
use odfs_mgmtd::MgmtdConfig;
use odfs_proto::mgmt::{FsState, GetCluster};
use odfs_proto::{DirLayout, RequestHeader};
use odfs_rpc::{JobCredential, Pool, PoolConfig, SiteKey, Transport};
use odfs_service::JobSection;
use odfs_stage::AgentConfig;
use odfs_stored::config::{StoredConfig, TargetSection};
use serde::{Deserialize, Serialize};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

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
    pub job_id: Option<String>,
    pub site_key: Option<PathBuf>,
    pub timeout: Duration,
    pub io_backend: String,
    /// Address the daemons listen on and advertise.
    pub bind: IpAddr,
    /// Where to mount the filesystem (None: no mount).
    pub mount: Option<PathBuf>,
    /// Give every node a RAM target of this size (a tmpfs; tmpfs `size=` syntax) in pool `ram`.
    pub ram_pool: Option<String>,
    /// Metadata services: shard k on node k, for k < meta (0 = one on every node).
    pub meta: u32,
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
            job_id: None,
            site_key: None,
            timeout: Duration::from_secs(30),
            io_backend: "auto".into(),
            bind: IpAddr::from([127, 0, 0, 1]),
            mount: None,
            ram_pool: None,
            meta: 1,
        }
    }
}

/// One process started by `local up`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ProcEntry {
    /// "mgmtd", "metad" or "stored".
    pub service: String,
    pub node: u32,
    pub pid: u32,
    pub config: PathBuf,
    pub log: PathBuf,
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

fn free_port(ip: IpAddr, udp: bool) -> Result<u16> {
    let addr = SocketAddr::new(ip, 0);
    Ok(if udp {
        std::net::UdpSocket::bind(addr)?.local_addr()?.port()
    } else {
        std::net::TcpListener::bind(addr)?.local_addr()?.port()
    })
}

pub(crate) fn write_toml<T: Serialize>(path: &Path, v: &T) -> Result<()> {
    std::fs::write(path, toml::to_string_pretty(v)?).with_context(|| format!("cannot write {}", path.display()))
}

pub(crate) fn log_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let v: Vec<&str> = text.lines().collect();
    v[v.len().saturating_sub(lines)..].join("\n")
}

/// Starts a local filesystem and waits until it is ready. On failure everything started is
/// stopped again and the error says why.
pub fn up(opts: &UpOptions) -> Result<LocalState> {
    anyhow::ensure!(opts.nodes >= 1, "--nodes must be at least 1");
    anyhow::ensure!(opts.targets_per_node >= 1, "--targets-per-node must be at least 1");
    let layout = DirLayout {
        chunk_size: opts.chunk_size,
        stripe_count: opts.stripe_count,
        pool: opts.pool.clone(),
        start_target: None,
    };
    layout.validate().map_err(|e| anyhow::anyhow!(e))?;
    std::fs::create_dir_all(&opts.root).with_context(|| format!("cannot create {}", opts.root.display()))?;
    let root = opts.root.canonicalize()?;
    let _lock = Lock::take(&root.join(".odfs.lock"), &root.display().to_string())?;
    if let Some(st) = LocalState::load(&root)? {
        let live = st.live_pids();
        if !live.is_empty() {
            bail!(
                "odfs is already running on {} (pids {:?}); run `odfs local down --root {}` first",
                root.display(),
                live,
                root.display()
            );
        }
        // Left behind by processes that died: a dead mount fails every access under it.
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

    let site_key = match &opts.site_key {
        Some(p) => p.clone(),
        None => {
            let p = root.join("site.key");
            if !p.exists() {
                SiteKey::generate().write_new(&p)?;
            }
            p
        }
    };
    SiteKey::load(&site_key)?;
    let job_id = opts.job_id.clone().unwrap_or_else(|| format!("local-{:08x}", rand::random::<u32>()));
    let job = JobSection { id: job_id.clone(), site_key: site_key.clone() };
    let addr = |udp: bool| -> Result<SocketAddr> {
        let port = free_port(opts.bind, udp).with_context(|| format!("cannot bind to {}", opts.bind))?;
        Ok(SocketAddr::new(opts.bind, port))
    };
    let mgmtd_addr = addr(true)?;

    let metas = if opts.meta == 0 { opts.nodes } else { opts.meta };
    anyhow::ensure!(
        metas <= opts.nodes && metas <= u16::MAX as u32,
        "--meta {} is more than the {} nodes",
        opts.meta,
        opts.nodes
    );
    let mut plan: Vec<(String, u32, PathBuf, PathBuf)> = Vec::new();
    let mut tmpfs: Vec<PathBuf> = Vec::new();
    let n0 = node_dir(&root, 0);
    std::fs::create_dir_all(&n0)?;
    let mcfg = MgmtdConfig {
        job: job.clone(),
        listen: mgmtd_addr,
        addr_file: None,
        expect_storage_nodes: opts.nodes,
        expect_meta: metas,
        default_layout: layout,
        ..MgmtdConfig::default()
    };
    write_toml(&n0.join("mgmtd.toml"), &mcfg)?;
    plan.push(("mgmtd".into(), 0, n0.join("mgmtd.toml"), n0.join("mgmtd.log")));
    for k in 0..metas {
        let nd = node_dir(&root, k);
        std::fs::create_dir_all(&nd)?;
        let meta_cfg = MetadConfig {
            job: job.clone(),
            listen: addr(true)?,
            mgmtd: mgmtd_addr,
            node: k,
            shard: k as u16,
            data_dir: nd.join("meta"),
            ..MetadConfig::default()
        };
        write_toml(&nd.join("metad.toml"), &meta_cfg)?;
        plan.push(("metad".into(), k, nd.join("metad.toml"), nd.join("metad.log")));
    }
    for k in 0..opts.nodes {
        let nd = node_dir(&root, k);
        std::fs::create_dir_all(&nd)?;
        let per = opts.targets_per_node + u32::from(opts.ram_pool.is_some());
        let mut targets: Vec<TargetSection> = (0..opts.targets_per_node)
            .map(|j| TargetSection {
                id: k * per + j + 1,
                path: nd.join(format!("target{}", k * per + j + 1)),
                pool: opts.pool.clone(),
            })
            .collect();
        if let Some(size) = &opts.ram_pool {
            let dir = nd.join("ram");
            if let Err(e) = mount::mount_tmpfs(&dir, size) {
                for t in &tmpfs {
                    let _ = mount::unmount(t);
                }
                return Err(e);
            }
            tmpfs.push(dir.clone());
            targets.push(TargetSection { id: k * per + per, path: dir, pool: "ram".into() });
        }
        let scfg = StoredConfig {
            job: job.clone(),
            listen: addr(true)?,
            bulk_listen: Some(addr(false)?),
            addr_file: None,
            mgmtd: mgmtd_addr,
            node: k,
            targets,
            io_backend: opts.io_backend.clone(),
            ..StoredConfig::default()
        };
        write_toml(&nd.join("stored.toml"), &scfg)?;
        plan.push(("stored".into(), k, nd.join("stored.toml"), nd.join("stored.log")));
        let acfg =
            AgentConfig { job: job.clone(), listen: addr(true)?, mgmtd: mgmtd_addr, node: k, ..AgentConfig::default() };
        write_toml(&nd.join("agent.toml"), &acfg)?;
        plan.push(("agent".into(), k, nd.join("agent.toml"), nd.join("agent.log")));
    }

    let mut state =
        LocalState { job_id: job_id.clone(), nodes: opts.nodes, procs: Vec::new(), mounts: Vec::new(), tmpfs };
    let started = (|| -> Result<()> {
        for (service, node, config, log) in &plan {
            let bin = procs::binary(&format!("odfs-{service}"))?;
            let pid = procs::spawn_daemon(&bin, config, log)?;
            state.procs.push(ProcEntry {
                service: service.clone(),
                node: *node,
                pid,
                config: config.clone(),
                log: log.clone(),
            });
        }
        state.save(&root)?;
        wait_ready(&job, mgmtd_addr, &state, opts.timeout)
    })();
    let started = started.and_then(|()| {
        let ccfg = ClientConfig { job, mgmtd: mgmtd_addr, bulk_transport: opts.bulk, ..ClientConfig::default() };
        write_toml(&client_config_path(&root), &ccfg)?;
        match &opts.mount {
            Some(mp) => start_mount(&root, mp, &mut state, opts.timeout),
            None => Ok(()),
        }
    });
    if let Err(e) = started {
        for m in &state.mounts {
            let _ = mount::unmount(m);
        }
        let pids: Vec<(u32, &Path)> = state.procs.iter().map(|p| (p.pid, p.config.as_path())).collect();
        procs::stop_all(&pids, Duration::from_secs(2));
        for t in &state.tmpfs {
            let _ = mount::unmount(t);
        }
        let _ = std::fs::remove_file(state_path(&root));
        return Err(e.context(format!("odfs local up on {} failed; everything it started was stopped", root.display())));
    }
    Ok(state)
}

/// Starts `odfs-fuse` for node 0 and waits until the mount is there.
fn start_mount(root: &Path, mp: &Path, state: &mut LocalState, timeout: Duration) -> Result<()> {
    std::fs::create_dir_all(mp).with_context(|| format!("cannot create mount point {}", mp.display()))?;
    let mp = mp.canonicalize()?;
    let bin = procs::binary("odfs-fuse")?;
    let cfg = client_config_path(root);
    let log = node_dir(root, 0).join("fuse.log");
    let args = [std::ffi::OsStr::new("--fs"), cfg.as_os_str(), std::ffi::OsStr::new("--mountpoint"), mp.as_os_str()];
    let pid = procs::spawn_detached(&bin, &args, &log)?;
    state.procs.push(ProcEntry { service: "fuse".into(), node: 0, pid, config: cfg, log: log.clone() });
    state.mounts.push(mp.clone());
    state.save(root)?;
    let marker = client_config_path(root);
    mount::wait_mounted(&mp, timeout, || procs::runs(pid, &marker)).with_context(|| {
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
        let pool = Pool::new(
            cred,
            PoolConfig {
                call_timeout: Duration::from_secs(2),
                retry_deadline: Duration::from_millis(1),
                conns_per_peer: 1,
            },
        )?;
        let start = Instant::now();
        loop {
            for p in &state.procs {
                if !procs::runs(p.pid, &p.config) {
                    bail!(
                        "{} on node {} exited during start-up; last log lines of {}:\n{}",
                        p.service,
                        p.node,
                        p.log.display(),
                        log_tail(&p.log, 5)
                    );
                }
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
    let pids: Vec<(u32, &Path)> = state.procs.iter().map(|p| (p.pid, p.config.as_path())).collect();
    let live = state.live_pids().len();
    let killed = procs::stop_all(&pids, Duration::from_secs(3));
    for t in &state.tmpfs {
        unmount_steps.extend(mount::unmount(t)?);
    }
    std::fs::remove_file(state_path(root))?;
    Ok(DownReport { stopped: live, killed, unmount_steps })
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
    let pid = entry.pid;
    state.save(root)?;
    Ok(pid)
}

/// The credential of a local filesystem, for tools that speak to it directly.
pub fn credential(root: &Path) -> Result<JobCredential> {
    let cfg = ClientConfig::load(&client_config_path(root))?;
    Ok(cfg.job.credential()?)
}
