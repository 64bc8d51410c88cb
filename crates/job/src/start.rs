//! `odfs start`: one node's part of bringing a job's filesystem up — the Slurm prolog, or any
//! launcher that runs it on every node (pdsh, clush, srun).
//!
//! Every node starts its stored and stage agent over its data paths (node 0 first starts mgmtd
//! and metad), mounts the filesystem for the job's user and reports `Started` on the job board.
//! Node 0 waits until every node has, posts the verdict `Ready`, runs the job's stage-ins and
//! returns only when they are complete and verified: the batch script starts as soon as node
//! 0's prolog returns. Any failure anywhere: the failing node reports it and rolls back, node 0
//! posts `Abort`, every other node rolls back too, and the failing node and node 0 exit
//! non-zero with one line naming the node and the cause. Every wait is bounded.
//!
//! Owns the plan of a job on a node (addresses, ports, paths, configs) and the start protocol.
//! Must not tear down a started job: that is `stop`'s (the epilog's) work once `Ready` is posted.

use crate::board::BoardLink;
use crate::directives::{self, Directives, Transfer};
use crate::launch::{self, log_tail, mount, procs, MetaPlan, NodeLaunch, Registry};
use crate::record::{Phase, Record, StateDir};
use crate::site::{expand, SiteConfig};
use crate::slurm;
use crate::spec::JobSpec;
use anyhow::{anyhow, bail, Context, Result};
use odfs_metad::config::RootOwner;
use odfs_proto::mgmt::{FsState, NodePhase, ServiceKind, Verdict};
use odfs_service::JobSection;
use odfs_stage::Direction;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tracing::debug;

/// What a node-local command needs besides the job.
#[derive(Debug, Clone)]
pub struct NodeContext {
    pub site: SiteConfig,
    /// The site config file (stages read their `[stage]` settings from it).
    pub site_path: PathBuf,
    /// Outside Slurm: a batch script (or any file) whose `#ODFS` lines apply.
    pub script: Option<PathBuf>,
    /// Metadata services on the first N nodes (0 = every node); default: the site's, or every
    /// node for a job with the metadata feature.
    pub meta: Option<u32>,
}

impl NodeContext {
    /// How many nodes of `spec` run a metadata service (shard k on node k).
    pub fn metas(&self, spec: &JobSpec) -> u32 {
        let o = &self.site.ondemand;
        let n = self.meta.unwrap_or(if spec.has_feature(&o.meta_feature) { 0 } else { o.meta });
        let nodes = spec.nodes.len() as u32;
        if n == 0 {
            nodes
        } else {
            n.min(nodes)
        }
    }
}

/// How a start ended (errors aside).
#[derive(Debug, Clone, PartialEq)]
pub enum StartOutcome {
    /// The job did not ask for odfs.
    NotAsked,
    /// The filesystem is up on every node (and, on node 0, staged in).
    Ready { secs: f64, stage_secs: f64, mount: PathBuf },
    /// Another node's start failed; this node rolled back (it is not at fault).
    Aborted { reason: String },
    /// Node 0: the job was cancelled during its stage-in.
    Cancelled,
}

/// Addresses, ports and paths of one job on one node.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    pub mgmtd: SocketAddr,
    pub metad: SocketAddr,
    pub stored: SocketAddr,
    pub bulk: SocketAddr,
    pub agent: SocketAddr,
    pub data_dirs: Vec<PathBuf>,
    pub ram_dir: Option<PathBuf>,
    pub mount: PathBuf,
    pub job_dir: PathBuf,
}

/// A node name's address: an IP literal as it is, else the resolver's first IPv4 address (or
/// IPv6 if it has none).
pub(crate) fn resolve(name: &str) -> Result<IpAddr> {
    if let Ok(ip) = name.parse() {
        return Ok(ip);
    }
    let found = (name, 0).to_socket_addrs().with_context(|| {
        format!(
            "cannot resolve node name {name} (every node name, with [ondemand] resolve_suffix, must resolve \
             on every node to the address the job's filesystem uses)"
        )
    })?;
    odfs_service::config::preferred(found)
        .map(|a| a.ip())
        .with_context(|| format!("node name {name} resolves to no address"))
}

impl Plan {
    pub(crate) fn new(spec: &JobSpec, site: &SiteConfig, state: &StateDir) -> Result<Plan> {
        let o = &site.ondemand;
        let node = spec.node_name();
        let me = resolve(&format!("{node}{}", o.resolve_suffix))?;
        let node0 = resolve(&format!("{}{}", spec.nodes[0], o.resolve_suffix))?;
        let p = o.first_port(&spec.job_id);
        let job = &spec.job_id;
        let user = &spec.user.name;
        let job_dir = state.job_dir(job);
        Ok(Plan {
            mgmtd: SocketAddr::new(node0, p),
            metad: SocketAddr::new(me, p + 1),
            stored: SocketAddr::new(me, p + 2),
            bulk: SocketAddr::new(me, p + 3),
            agent: SocketAddr::new(me, p + 4),
            data_dirs: o
                .data_paths
                .iter()
                .map(|d| PathBuf::from(expand(d, job, user, node)).join(format!("odfs.{job}")))
                .collect(),
            ram_dir: spec.has_feature(&o.ram_feature).then(|| job_dir.join("ram")),
            mount: PathBuf::from(expand(&o.mount, job, user, node)),
            job_dir,
        })
    }

    /// This node's (service, address, udp) list, for the port check.
    fn ports(&self, node0: bool, meta: bool) -> Vec<(&'static str, SocketAddr, bool)> {
        let mut v = vec![("stored", self.stored, true), ("stored bulk", self.bulk, false), ("agent", self.agent, true)];
        if meta {
            v.insert(0, ("metad", self.metad, true));
        }
        if node0 {
            v.insert(0, ("mgmtd", self.mgmtd, true));
        }
        v
    }
}

/// Fails with a clear line if a port this node needs is taken.
fn check_ports(plan: &Plan, spec: &JobSpec, site: &SiteConfig, metas: u32) -> Result<()> {
    for (what, addr, udp) in plan.ports(spec.is_node0(), spec.index < metas) {
        let r =
            if udp { std::net::UdpSocket::bind(addr).map(drop) } else { std::net::TcpListener::bind(addr).map(drop) };
        if let Err(e) = r {
            bail!(
                "port {}/{} for {what} is not free on {} ({e}): another odfs job whose id equals {} modulo {} \
                 (port_slots), or another service, holds it",
                addr.port(),
                if udp { "udp" } else { "tcp" },
                addr.ip(),
                spec.job_id,
                site.ondemand.port_slots
            );
        }
    }
    Ok(())
}

/// Creates a data directory (root-only) and proves it takes a write.
fn prepare_data_dir(d: &Path) -> Result<()> {
    let probe = || -> std::io::Result<()> {
        std::fs::create_dir_all(d)?;
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o700))?;
        let p = d.join(".odfs-write-probe");
        std::fs::write(&p, b"odfs")?;
        std::fs::remove_file(&p)
    };
    probe().with_context(|| format!("data path {} is not writable", d.display()))
}

/// Prepares the mount point: parents as root, the point itself the user's with mode 0700.
fn prepare_mount_point(mp: &Path, uid: u32, gid: u32) -> Result<()> {
    for line in mount::unmount(mp)? {
        eprintln!("odfs: cleaning up a stale mount: {line}");
    }
    std::fs::create_dir_all(mp).with_context(|| format!("cannot create mount point {}", mp.display()))?;
    std::os::unix::fs::chown(mp, Some(uid), Some(gid))
        .with_context(|| format!("cannot give mount point {} to uid {uid}", mp.display()))?;
    std::fs::set_permissions(mp, std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("cannot set the mode of {}", mp.display()))
}

/// The job's directives (node 0): from Slurm's copy of the batch script, or `--script`.
fn read_directives(spec: &JobSpec, ctx: &NodeContext) -> Result<Directives, String> {
    let text = match &ctx.script {
        Some(p) => Some(std::fs::read_to_string(p).map_err(|e| format!("cannot read {}: {e}", p.display()))?),
        None if spec.slurm => slurm::batch_script(&spec.job_id).map_err(|e| format!("{e:#}"))?,
        None => None,
    };
    let Some(text) = text else { return Ok(Directives::default()) };
    directives::parse(&text, &spec.job_id, &spec.user.name).map_err(|e| format!("batch script {e}"))
}

/// The filesystem's default layout: the site's, changed by the job's directives.
fn job_layout(site: &SiteConfig, spec: &JobSpec, d: &Directives) -> Result<odfs_proto::DirLayout, String> {
    let o = &site.ondemand;
    let mut l = o.layout();
    if let Some(n) = d.stripe_count {
        l.stripe_count = n;
    }
    if let Some(c) = d.chunk_size {
        l.chunk_size = c;
    }
    if let Some(local) = d.local_placement {
        l.local = local;
    }
    if let Some(p) = &d.pool {
        let ram = spec.has_feature(&o.ram_feature);
        if *p != o.pool && !(ram && *p == o.ram_pool) {
            return Err(if *p == o.ram_pool {
                format!("pool {p}: this job has no RAM pool (ask for it with --constraint={})", o.ram_feature)
            } else {
                format!(
                    "pool {p}: no such pool (this job has {}{})",
                    o.pool,
                    if ram { format!(", {}", o.ram_pool) } else { String::new() }
                )
            });
        }
        l.pool = p.clone();
    }
    l.validate().map_err(|e| format!("layout: {e}"))?;
    Ok(l)
}

fn now_unix() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Fails naming the process if one of ours died, with the end of its log.
pub(crate) fn check_alive(rec: &Record) -> Result<()> {
    for p in &rec.procs {
        if !procs::runs(p.pid, &p.config) {
            bail!(
                "odfs-{} exited; last log lines of {}: {}",
                p.service,
                p.log.display(),
                log_tail(&p.log, 3).replace('\n', " | ")
            );
        }
    }
    Ok(())
}

/// This node's daemons as the plan and the site lay them out.
fn node_launch(
    plan: &Plan,
    spec: &JobSpec,
    site: &SiteConfig,
    layout: odfs_proto::DirLayout,
    metas: u32,
) -> NodeLaunch {
    let o = &site.ondemand;
    let k = spec.index;
    NodeLaunch {
        job: JobSection { id: spec.job_id.clone(), site_key: o.site_key.clone() },
        node: k,
        mgmtd: plan.mgmtd,
        registry: spec.is_node0().then_some(Registry {
            listen: plan.mgmtd,
            storage_nodes: spec.nodes.len() as u32,
            metas,
            layout,
        }),
        meta: (k < metas).then(|| MetaPlan {
            listen: plan.metad,
            data_dir: plan.data_dirs[0].join("meta"),
            root_owner: Some(RootOwner { uid: spec.user.uid, gid: spec.user.gid, mode: 0o700 }),
            root_only_layouts: !o.user_layouts,
        }),
        stored: plan.stored,
        bulk: plan.bulk,
        agent: plan.agent,
        targets: launch::node_targets(
            k,
            &plan.data_dirs,
            &o.pool,
            plan.ram_dir.clone().map(|r| (r, o.ram_pool.clone())),
        ),
        io_backend: o.io_backend.clone(),
        precreate_chunk_files: o.precreate_chunk_files,
        direct_write_min_bytes: o.direct_write_min_bytes,
        drop_behind_reads: o.drop_behind_reads,
        register_timeout_secs: Some(o.ready_timeout_secs),
        stored_worker_threads: None,
        metrics: o.metrics_port.map(|p| std::net::SocketAddr::new(std::net::Ipv4Addr::UNSPECIFIED.into(), p)),
    }
}

/// Another node's failure, seen on the job board while this node was starting.
#[derive(Debug)]
pub(crate) struct AbortedBy(pub String);

impl std::fmt::Display for AbortedBy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for AbortedBy {}

/// What the board says against going on: node 0 sees another node's `StartFailed`, the others
/// see node 0's `Abort`.
fn board_objection(link: &BoardLink, spec: &JobSpec) -> Option<String> {
    let b = link.board().ok()?;
    if spec.is_node0() {
        b.nodes.iter().find_map(|r| match &r.phase {
            NodePhase::StartFailed { reason } => Some(reason.clone()),
            _ => None,
        })
    } else {
        match b.verdict {
            Some(Verdict::Abort { reason }) => Some(reason),
            _ => None,
        }
    }
}

/// Mounts the filesystem for the job's user and waits until the mount is there (the FUSE
/// client waits for the filesystem to be ready, so for every node's stored), watching the
/// board: another node's failure ends the wait at once.
fn start_mount(
    rec: &mut Record,
    state: &StateDir,
    plan: &Plan,
    spec: &JobSpec,
    link: &BoardLink,
    deadline: Instant,
) -> Result<()> {
    prepare_mount_point(&plan.mount, spec.user.uid, spec.user.gid)?;
    let log = plan.job_dir.join("fuse.log");
    let spawned = Instant::now();
    rec.procs.push(launch::spawn_fuse(&rec.client_config, &plan.mount, true, &log, spec.index)?);
    rec.mount = Some(plan.mount.clone());
    state.save(rec)?;
    let mut polls = 0u32;
    let watch = || {
        check_alive(rec)?;
        polls += 1;
        if polls.is_multiple_of(5) {
            if let Some(reason) = board_objection(link, spec) {
                debug!(node = spec.index, %reason, "start objected to");
                return Err(AbortedBy(reason).into());
            }
        }
        Ok(())
    };
    if !mount::wait_mounted(&plan.mount, deadline, watch)? {
        // The mount waits for every node's storage service: one that never came is the
        // cause, not this node.
        let silent = silent_nodes(link, spec);
        if !silent.is_empty() && !silent.contains(&spec.index) {
            return Err(SilentNodes(silent).into());
        }
        fuse_last_words(rec, spawned);
        bail!(
            "{} was not mounted in time; last log lines of {}: {}",
            plan.mount.display(),
            log.display(),
            match log_tail(&log, 3) {
                t if t.is_empty() => "(none: odfs-fuse still waits for the filesystem to be ready)".to_string(),
                t => t.replace('\n', " | "),
            }
        );
    }
    Ok(())
}

/// After a mount that did not come in time: lets this start's `odfs-fuse` end its own wait
/// for the filesystem (it began a little after this node's start, so it ends a little later),
/// so that its log says why; bounded.
fn fuse_last_words(rec: &Record, spawned: Instant) {
    let Some(fuse) = rec.procs.iter().rev().find(|p| p.service == "fuse") else { return };
    let own_wait = odfs_client::ClientConfig::load(&fuse.config).map_or(0, |c| c.retry_secs);
    let until = (spawned + Duration::from_secs(own_wait) + FUSE_LAST_WORDS).min(Instant::now() + FUSE_LAST_WORDS);
    while procs::runs(fuse.pid, &fuse.config) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Longest wait for a timed-out mount's `odfs-fuse` to say why in its log.
const FUSE_LAST_WORDS: Duration = Duration::from_secs(5);

/// The nodes of the job that never showed up: neither a storage service of theirs registered
/// with node 0's mgmtd nor a report of theirs on the board (their prolog did not run `odfs
/// start`, or is stuck before its services). Empty when mgmtd cannot be asked.
fn silent_nodes(link: &BoardLink, spec: &JobSpec) -> Vec<u32> {
    let (Ok(b), Ok(v)) = (link.board(), link.cluster()) else { return Vec::new() };
    (0..spec.nodes.len() as u32)
        .filter(|&k| b.phase(k).is_none())
        .filter(|&k| !v.services.iter().any(|s| s.kind == ServiceKind::Storage && s.node == k))
        .collect()
}

/// Nodes that never showed up during the start (see `silent_nodes`): the start fails for
/// them, and the nodes that did start are not at fault.
#[derive(Debug)]
pub(crate) struct SilentNodes(pub Vec<u32>);

impl std::fmt::Display for SilentNodes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} nodes never reported", self.0.len())
    }
}

impl std::error::Error for SilentNodes {}

/// The start's failure when `silent` never showed up within `secs`: names them, for the
/// user's output and every node's log and drain reason.
fn silent_reason(spec: &JobSpec, silent: &[u32], secs: u64) -> String {
    let names: Vec<String> = silent.iter().map(|&k| spec.where_of(k)).collect();
    let (prolog, stored) = if silent.len() == 1 {
        ("its prolog", "its storage service")
    } else {
        ("their prologs", "their storage services")
    };
    format!(
        "{} never reported within {secs} s (ready_timeout_secs): {prolog} did not start odfs there \
         ({stored} never registered)",
        names.join(", ")
    )
}

/// This node's services, up to (not including) the mount: its data directories (and RAM
/// target), then each daemon's config written and the daemon started (node 0's mgmtd first),
/// every step recorded before the next.
fn start_node_services(
    rec: &mut Record,
    state: &StateDir,
    plan: &Plan,
    spec: &JobSpec,
    site: &SiteConfig,
    layout: odfs_proto::DirLayout,
    metas: u32,
) -> Result<()> {
    check_ports(plan, spec, site, metas)?;
    for d in &plan.data_dirs {
        rec.data_dirs.push(d.clone());
        state.save(rec)?;
        prepare_data_dir(d)?;
    }
    if let Some(r) = &plan.ram_dir {
        mount::mount_tmpfs(r, &site.ondemand.ram_size)?;
        rec.ram_mount = Some(r.clone());
        state.save(rec)?;
    }
    let o = &site.ondemand;
    let node = node_launch(plan, spec, site, layout, metas);
    node.start(&plan.job_dir, |p| {
        rec.procs.push(p);
        state.save(rec)
    })?;
    launch::write_toml(&rec.client_config, &node.client_config(o.bulk, Some(o.ready_timeout_secs.max(30))))
}

/// Node 0: waits until every node reported `Started`, the filesystem is ready and every stage
/// agent is registered. Err(reason) names the node that failed or is missing; `SilentNodes`
/// when nodes never showed up at all.
fn wait_all_started(link: &BoardLink, rec: &Record, spec: &JobSpec, deadline: Instant) -> Result<()> {
    let n = spec.nodes.len();
    let mut last = String::from("mgmtd did not answer");
    loop {
        check_alive(rec).map_err(|e| anyhow!("{}: {e:#}", spec.where_()))?;
        if let (Ok(b), Ok(v)) = (link.board(), link.cluster()) {
            if let Some(r) = b.nodes.iter().find_map(|r| match &r.phase {
                NodePhase::StartFailed { reason } => Some(reason.clone()),
                _ => None,
            }) {
                bail!(r);
            }
            let started: Vec<u32> = b.nodes.iter().filter(|r| r.phase == NodePhase::Started).map(|r| r.node).collect();
            let agents = v.services.iter().filter(|s| s.kind == ServiceKind::Agent && s.online).count();
            if started.len() == n && v.state == FsState::Ready && agents >= n {
                return Ok(());
            }
            let missing: Vec<&str> =
                (0..n as u32).filter(|k| !started.contains(k)).map(|k| spec.nodes[k as usize].as_str()).collect();
            last = format!("no word from {} ({agents} of {n} stage agents registered)", missing.join(", "));
        }
        if Instant::now() > deadline {
            let silent = silent_nodes(link, spec);
            if !silent.is_empty() && !silent.contains(&spec.index) {
                return Err(SilentNodes(silent).into());
            }
            bail!("the filesystem was not up on every node in time: {last}");
        }
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// How long a node that did start waits for node 0's `Abort` once it sees that another node
/// never showed up: node 0 gives up on it at about the same moment (its start began within
/// moments of this one's).
const SILENT_VERDICT_WAIT: Duration = Duration::from_secs(20);

/// Other nodes: waits for node 0's verdict. Ok(Ok(outputs)) = Ready; Ok(Err(reason)) = Abort.
fn wait_verdict(link: &BoardLink, spec: &JobSpec, deadline: Instant) -> Result<Result<bool, String>> {
    let mut reached = false;
    let mut lost_since: Option<Instant> = None;
    loop {
        match link.board() {
            Ok(b) => {
                reached = true;
                lost_since = None;
                match b.verdict {
                    Some(Verdict::Ready { outputs }) => return Ok(Ok(outputs)),
                    Some(Verdict::Abort { reason }) => return Ok(Err(reason)),
                    _ => {}
                }
            }
            // Node 0 stops mgmtd soon after an Abort; a board that vanishes after answering is
            // that, not a fault of this node.
            Err(_) if reached => {
                let since = *lost_since.get_or_insert_with(Instant::now);
                if since.elapsed() > Duration::from_secs(3) {
                    return Ok(Err(format!("node 0 ({}) went away during the start", spec.nodes[0])));
                }
            }
            Err(_) => {}
        }
        if Instant::now() > deadline {
            bail!("no word from node 0 ({}, mgmtd {}) in time", spec.nodes[0], link.mgmtd);
        }
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// Node 0 after `Abort`: gives the other nodes a moment to see it before mgmtd goes.
fn wait_others_rolled_back(link: &BoardLink, spec: &JobSpec) {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(5) {
        if let Ok(b) = link.board() {
            let done = (1..spec.nodes.len() as u32)
                .all(|k| matches!(b.phase(k), Some(NodePhase::Aborted | NodePhase::StartFailed { .. })));
            if done {
                return;
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Runs stage transfers as the job's user; Err(reason) on the first that is not verified.
pub(crate) fn run_stages(
    link: &BoardLink,
    state: &StateDir,
    rec: &Record,
    ctx: &NodeContext,
    inward: bool,
    cancel_watch: bool,
) -> Result<bool, String> {
    let d = &rec.directives;
    let list: &[Transfer] = if inward { &d.stage_in } else { &d.stage_out };
    if list.is_empty() {
        return Ok(true);
    }
    let (kind, way) = if inward { ("stage-in", Direction::In) } else { ("stage-out", Direction::Out) };
    let job = rec.spec.job_id.clone();
    let limit = Duration::from_secs(ctx.site.ondemand.stage_timeout_secs.max(1));
    use_stage_credentials(state, rec, ctx, kind)?;
    link.block_on(async {
        let client = stage_client(rec, kind).await?;
        let work = async {
            if !inward && !d.drain.is_empty() {
                // The drains' last passes end before the stage-out reads what they recorded.
                match odfs_stage::drain::stop(&client, &rec.spec.user.ctx(), None).await {
                    Ok(states) => states
                        .iter()
                        .for_each(|s| state.say(&job, &format!("drain stopped: {}", odfs_stage::drain::describe(s)))),
                    Err(e) => {
                        state.say(&job, &format!("cannot stop the drains ({e}); the stage-out checks every file"))
                    }
                }
            }
            for t in list {
                if !inward && source_missing(&client, &rec.spec.user.ctx(), &t.src).await {
                    missing_output(state, rec, t);
                    continue;
                }
                let req = odfs_stage::StageRequest {
                    src: t.src.clone(),
                    dst: t.dst.clone(),
                    store: store_args(d, ctx),
                    concurrency: d.concurrency,
                    max_bandwidth: d.max_bandwidth,
                    seal: t.seal,
                    ..Default::default()
                };
                let report = odfs_stage::request::run(&client, &rec.spec.user.ctx(), &req, way)
                    .await
                    .map_err(|e| format!("{kind} {} -> {}: {e:#}", t.src, t.dst))?;
                state.say(&job, &report.summary());
                odfs_stage::request::check(&report).map_err(|e| format!("{kind} {} -> {}: {e:#}", t.src, t.dst))?;
                if let Some(w) = report.warning() {
                    // A job's dataset that is empty is a wrong prefix, not a dataset.
                    return Err(format!(
                        "{kind} {} -> {}: {w}; an #ODFS stage-in of no files is refused",
                        t.src, t.dst
                    ));
                }
            }
            Ok::<(), String>(())
        };
        let cancelled = async {
            if !cancel_watch {
                return std::future::pending::<()>().await;
            }
            loop {
                tokio::time::sleep(Duration::from_secs(2)).await;
                let j = job.clone();
                if tokio::task::spawn_blocking(move || slurm::job_active(&j)).await.ok().flatten() == Some(false) {
                    return;
                }
            }
        };
        let r = tokio::select! {
            r = tokio::time::timeout(limit, work) => match r {
                Ok(r) => r.map(|()| true),
                Err(_) => Err(format!("{kind} did not finish within {} s (stage_timeout_secs)", limit.as_secs())),
            },
            () = cancelled => Ok(false),
        };
        client.close().await;
        r
    })
}

/// Points this process's S3 client at the credentials the job's stages and drains use (see
/// `creds`), and says which.
fn use_stage_credentials(state: &StateDir, rec: &Record, ctx: &NodeContext, kind: &str) -> Result<(), String> {
    let job_dir = rec.client_config.parent().unwrap_or(Path::new("/"));
    let d = &rec.directives;
    let said = crate::creds::prepare(&ctx.site, &rec.spec.user, job_dir, d.profile.as_deref())
        .map_err(|e| format!("{kind}: {e:#}"))?;
    state.say(&rec.spec.job_id, &said);
    Ok(())
}

/// A one-shot client of the job's filesystem for a stage or drain request.
async fn stage_client(rec: &Record, kind: &str) -> Result<odfs_client::Client, String> {
    let cfg = odfs_client::ClientConfig::load(&rec.client_config).map_err(|e| e.to_string())?.one_shot();
    odfs_client::Client::connect(cfg).await.map_err(|e| format!("{kind}: cannot reach the filesystem: {e}"))
}

/// The S3 settings of a job's stages and drains: its directives', then the site config's.
fn store_args(d: &Directives, ctx: &NodeContext) -> odfs_stage::request::StoreArgs {
    odfs_stage::request::StoreArgs {
        endpoint_url: d.endpoint_url.clone(),
        region: d.region.clone(),
        path_style: d.path_style,
        site_config: Some(ctx.site_path.clone()),
    }
}

/// Node 0, once the job's data is in: starts the job's drains on node 0's agent, as the job's
/// user. Err(reason) if one cannot start (its bucket or credentials are refused).
fn start_drains(link: &BoardLink, state: &StateDir, rec: &Record, ctx: &NodeContext) -> Result<(), String> {
    let d = &rec.directives;
    if d.drain.is_empty() {
        return Ok(());
    }
    let job = rec.spec.job_id.clone();
    use_stage_credentials(state, rec, ctx, "drain")?;
    link.block_on(async {
        let client = stage_client(rec, "drain").await?;
        let mut r = Ok(());
        for dr in &d.drain {
            let req = odfs_stage::drain::DrainRequest {
                src: dr.src.clone(),
                dst: dr.dst.clone(),
                settle: dr.settle,
                keep: dr.keep,
                marker: dr.marker.clone(),
                concurrency: dr.concurrency,
                max_bandwidth: dr.max_bandwidth,
                share: dr.share,
                delete_after_upload: dr.delete_after_upload,
                store: store_args(d, ctx),
            };
            match odfs_stage::drain::start(&client, &rec.spec.user.ctx(), &req).await {
                Ok(s) => state.say(
                    &job,
                    &format!("drain started: {} -> {} (settle {:.1} s)", dr.src, dr.dst, s.settle_ms as f64 / 1000.0),
                ),
                Err(e) => {
                    r = Err(format!("drain {} -> {}: {e:#}", dr.src, dr.dst));
                    break;
                }
            }
        }
        client.close().await;
        r
    })
}

/// True when a stage-out's source does not exist in the job's filesystem: the job never made
/// it (exited early, wrote elsewhere). Any other answer goes on to the stage-out, which reports
/// what it finds.
async fn source_missing(client: &odfs_client::Client, ctx: &odfs_client::Ctx, src: &str) -> bool {
    let Ok(odfs_stage::Location::Odfs(path)) = odfs_stage::location::parse(src, &[]) else { return false };
    matches!(client.resolve(ctx, &path, false).await, Err(e) if e.code() == odfs_proto::ErrorCode::NotFound)
}

/// A stage-out whose source the job never made: the job's own outcome, not a failure to keep
/// data for (there is none). The user is told in the job's output; nothing is retained, so the
/// stop goes on to wipe and the nodes stay in service.
fn missing_output(state: &StateDir, rec: &Record, t: &Transfer) {
    let msg = format!(
        "stage-out {} -> {}: {} does not exist in the job's filesystem (the job did not create it), \
         so nothing was staged out from it",
        t.src, t.dst, t.src
    );
    state.say(&rec.spec.job_id, &msg);
    if rec.spec.slurm {
        slurm::tell_user(&rec.spec, &crate::line(&rec.spec.job_id, &msg));
    }
}

/// `odfs start` on this node: the checks, the sweep of stale jobs and the lock, then [`Start`].
pub(crate) fn start_node(spec: &JobSpec, ctx: &NodeContext) -> Result<StartOutcome> {
    let o = &ctx.site.ondemand;
    if spec.slurm && !o.wanted(&spec.features) {
        return Ok(StartOutcome::NotAsked);
    }
    // SAFETY: geteuid has no preconditions.
    anyhow::ensure!(
        unsafe { libc::geteuid() } == 0,
        "odfs start must run as root (it mounts the filesystem for the job's user)"
    );
    let t0 = Instant::now();
    let state = StateDir::new(&o.state_dir, spec.node_name());
    state.create()?;
    for l in crate::cleanup::stale(&state, spec.node_name(), Some(&spec.job_id)) {
        state.say(&spec.job_id, &format!("cleanup: {l}"));
    }
    let _lock = state.lock(&spec.job_id, Duration::from_secs(10))?;
    clear_earlier_start(&state, spec)?;
    match Start::new(spec, ctx, state.clone(), t0) {
        Ok(start) => start.run(),
        Err(e) => Err(early_failure(spec, ctx, &state, e)),
    }
}

/// A start that failed before this node joined the job (a node name that does not resolve, a
/// site key that cannot be read): reported as every other start failure is — the event log,
/// the user's output file (node 0), the drain reason — and nothing of the job left behind. The
/// other nodes roll back when node 0 gives up waiting for this one.
fn early_failure(spec: &JobSpec, ctx: &NodeContext, state: &StateDir, e: anyhow::Error) -> anyhow::Error {
    let reason = format!("{}: {e:#}", spec.where_());
    state.say(&spec.job_id, &format!("rolled back: {reason}"));
    if let Err(e) = state.forget(&spec.job_id) {
        state.say(&spec.job_id, &format!("rollback incomplete: {e:#}"));
    }
    let msg = crate::line(&spec.job_id, &format!("could not start: {reason}"));
    if spec.is_node0() && spec.slurm {
        slurm::tell_user(spec, &format!("{msg}. The job is requeued and held."));
    }
    slurm_failure(spec, &ctx.site, &msg, true);
    anyhow!(msg)
}

/// Removes what an earlier start of the same job left here; refuses when it kept data.
fn clear_earlier_start(state: &StateDir, spec: &JobSpec) -> Result<()> {
    let Some(mut prev) = state.load(&spec.job_id)? else { return Ok(()) };
    if let Phase::Retained { reason } = &prev.phase {
        bail!(
            "job {} has data kept on this node from an earlier run ({reason}); finish it with `odfs recover --job {}` \
             or drop it with `odfs cleanup --job {} --discard`",
            spec.job_id,
            spec.job_id,
            spec.job_id
        );
    }
    state.say(&spec.job_id, "removing what an earlier start left on this node");
    state.wipe(&mut prev)?;
    Ok(())
}

/// One node's start of one job, from its first record to its outcome.
struct Start<'a> {
    spec: &'a JobSpec,
    ctx: &'a NodeContext,
    state: StateDir,
    plan: Plan,
    link: BoardLink,
    rec: Record,
    /// Node 0: the job's directives, or why they are invalid (the job's fault, not the node's).
    directives: Result<Directives, String>,
    t0: Instant,
    deadline: Instant,
}

impl<'a> Start<'a> {
    /// Plans the node, reaches for the board and writes the first record.
    fn new(spec: &'a JobSpec, ctx: &'a NodeContext, state: StateDir, t0: Instant) -> Result<Start<'a>> {
        let o = &ctx.site.ondemand;
        let plan = Plan::new(spec, &ctx.site, &state)?;
        let cred = JobSection { id: spec.job_id.clone(), site_key: o.site_key.clone() }
            .credential()
            .map_err(|e| anyhow!("{e} (odfs keygen makes one; every node needs the same file)"))?;
        let link = BoardLink::new(cred, plan.mgmtd, spec.index, spec.node_name())?;
        let directives = if spec.is_node0() { read_directives(spec, ctx) } else { Ok(Directives::default()) };
        let rec = Record {
            spec: spec.clone(),
            phase: Phase::Starting,
            directives: directives.clone().unwrap_or_default(),
            mgmtd: plan.mgmtd,
            client_config: plan.job_dir.join("odfs.toml"),
            procs: Vec::new(),
            mount: None,
            ram_mount: None,
            data_dirs: Vec::new(),
            since: now_unix(),
            outputs: false,
        };
        std::fs::create_dir_all(&plan.job_dir)?;
        std::fs::set_permissions(&plan.job_dir, std::fs::Permissions::from_mode(0o700))?;
        state.save(&rec)?;
        let deadline = t0 + Duration::from_secs(o.ready_timeout_secs);
        Ok(Start { spec, ctx, state, plan, link, rec, directives, t0, deadline })
    }

    fn run(mut self) -> Result<StartOutcome> {
        if let Err((e, own)) = self.bring_up() {
            return self.up_failed(e, own);
        }
        let left = self.deadline.saturating_duration_since(Instant::now());
        let _ = self.link.report_within(NodePhase::Started, left);
        if self.spec.is_node0() {
            self.lead()
        } else {
            self.follow()
        }
    }

    /// Services, then the mount. Err((error, whether the fault is this node's)).
    fn bring_up(&mut self) -> Result<(), (anyhow::Error, bool)> {
        let (spec, site) = (self.spec, &self.ctx.site);
        // The layout the job asked for (node 0); an invalid one is the job's fault, not the node's.
        let layout = match &self.directives {
            Ok(d) => job_layout(site, spec, d),
            Err(e) => Err(e.clone()),
        };
        let default = layout.clone().unwrap_or_else(|_| site.ondemand.layout());
        let metas = self.ctx.metas(spec);
        let services = start_node_services(&mut self.rec, &self.state, &self.plan, spec, site, default, metas);
        let up = match (services, &layout) {
            (Err(e), _) => Err((e, true)),
            (Ok(()), Err(e)) if spec.is_node0() => Err((anyhow!(e.clone()), false)),
            (Ok(()), _) => start_mount(&mut self.rec, &self.state, &self.plan, spec, &self.link, self.deadline)
                .and_then(|()| check_alive(&self.rec))
                .map_err(|e| (e, true)),
        };
        debug!(node = spec.index, ok = up.is_ok(), "services and mount");
        up
    }

    /// Node 0's board exists once its mgmtd runs; before that, nobody can be told.
    fn has_board(&self) -> bool {
        !self.spec.is_node0() || self.rec.procs.iter().any(|p| p.service == "mgmtd")
    }

    /// The start failed here, or another node's failure reached this one while it was starting.
    fn up_failed(self, e: anyhow::Error, own: bool) -> Result<StartOutcome> {
        let spec = self.spec;
        if let Some(AbortedBy(reason)) = e.downcast_ref::<AbortedBy>() {
            if spec.is_node0() {
                return self.fail(reason.clone(), false);
            }
            return self.roll_back(reason.clone());
        }
        if let Some(SilentNodes(silent)) = e.downcast_ref::<SilentNodes>() {
            return self.silent_failed(silent.clone());
        }
        let reason = if own { format!("{}: {e:#}", spec.where_()) } else { format!("{e:#}") }.replace('\n', " | ");
        if self.has_board() {
            let failed = NodePhase::StartFailed { reason: reason.clone() };
            let r = self.link.report_within(failed, Duration::from_secs(3));
            debug!(node = spec.index, reported = r.is_ok(), "start failed");
        }
        self.fail(reason, own)
    }

    /// The start cannot succeed because `silent` never showed up. Node 0 drains them with a
    /// reason naming them and fails the start as not its own (its epilog returns it to
    /// service); the other nodes wait (bounded) for node 0's `Abort` and roll back, so that no
    /// node that did start stays drained.
    fn silent_failed(self, silent: Vec<u32>) -> Result<StartOutcome> {
        let (spec, o) = (self.spec, &self.ctx.site.ondemand);
        let reason = silent_reason(spec, &silent, o.ready_timeout_secs);
        if !spec.is_node0() {
            return match wait_verdict(&self.link, spec, Instant::now() + SILENT_VERDICT_WAIT) {
                Ok(Err(abort)) => self.roll_back(abort),
                _ => {
                    let why = format!("{}: {reason}; no verdict from node 0 ({})", spec.where_(), spec.nodes[0]);
                    self.fail(why, true)
                }
            };
        }
        if spec.slurm && o.slurm_drain_reason {
            let msg = crate::line(&spec.job_id, &format!("could not start: {reason}"));
            for &k in &silent {
                slurm::drain(&spec.nodes[k as usize], &msg);
            }
            let names: Vec<&str> = silent.iter().map(|&k| spec.nodes[k as usize].as_str()).collect();
            self.state.say(&spec.job_id, &format!("drained {}, which never reported", names.join(", ")));
        }
        self.fail(reason, false)
    }

    /// This node rolls back because another failed; it is not at fault.
    fn roll_back(mut self, reason: String) -> Result<StartOutcome> {
        let _ = self.link.report(NodePhase::Aborted);
        self.state.wipe(&mut self.rec)?;
        self.state.say(&self.spec.job_id, &format!("rolled back: {reason}"));
        Ok(StartOutcome::Aborted { reason })
    }

    /// Rolls every node back (node 0 posts `Abort`) and fails with one line naming the cause.
    fn fail(mut self, reason: String, own: bool) -> Result<StartOutcome> {
        let (spec, state) = (self.spec, &self.state);
        if spec.is_node0() && self.has_board() {
            let _ = self.link.set_verdict(Verdict::Abort { reason: reason.clone() });
            wait_others_rolled_back(&self.link, spec);
        }
        match self.rec.teardown(true) {
            Ok(lines) => lines.iter().for_each(|l| state.note(&spec.job_id, &format!("rollback: {l}"))),
            Err(e) => state.say(&spec.job_id, &format!("rollback incomplete: {e:#}")),
        }
        let msg = crate::line(&spec.job_id, &format!("could not start: {reason}"));
        if spec.is_node0() && spec.slurm {
            // The epilog returns the batch host to service when the failure was not its own,
            // and cancels a job whose script is invalid.
            let script = !own && self.directives.is_err();
            // Slurm requeues the job; it holds it after a failed prolog, but not when it gave
            // up on the batch host first (a start longer than its BatchStartTimeout).
            let requeued = format!(
                "Slurm requeues the job (held after a failed prolog: `scontrol release {}` once the cause is fixed)",
                spec.job_id
            );
            self.rec.procs.clear();
            state.enter(&mut self.rec, Phase::StartFailed { reason: reason.clone(), own, script })?;
            let next = if script {
                "the job is cancelled: fix its #ODFS lines (`odfs check-script` checks them) and submit it again"
            } else {
                &requeued
            };
            slurm::tell_user(spec, &format!("{msg}. Every node rolled back; {next}."));
        } else if let Err(e) = state.forget(&spec.job_id) {
            state.say(&spec.job_id, &format!("rollback incomplete: {e:#}"));
        }
        slurm_failure(spec, &self.ctx.site, &msg, own);
        bail!(msg)
    }

    /// Other nodes: run once node 0 says `Ready`, roll back on its `Abort`.
    fn follow(mut self) -> Result<StartOutcome> {
        match wait_verdict(&self.link, self.spec, self.deadline) {
            Ok(Ok(outputs)) => {
                self.rec.outputs = outputs;
                self.state.enter(&mut self.rec, Phase::Running)?;
                let secs = self.t0.elapsed().as_secs_f64();
                let (at, mp) = (self.spec.where_(), self.plan.mount.display());
                self.state.say(&self.spec.job_id, &format!("{at}: filesystem ready in {secs:.2} s, mounted at {mp}"));
                Ok(StartOutcome::Ready { secs, stage_secs: 0.0, mount: self.plan.mount })
            }
            Ok(Err(reason)) => self.roll_back(reason),
            Err(e) => {
                let reason = format!("{}: {e:#}", self.spec.where_());
                self.fail(reason, true)
            }
        }
    }

    /// Node 0: waits for every node, posts `Ready`, and stages the job's data in.
    fn lead(mut self) -> Result<StartOutcome> {
        let spec = self.spec;
        if let Err(e) = wait_all_started(&self.link, &self.rec, spec, self.deadline) {
            if let Some(SilentNodes(silent)) = e.downcast_ref::<SilentNodes>() {
                return self.silent_failed(silent.clone());
            }
            let reason = format!("{e:#}");
            let own = reason.starts_with(&spec.where_());
            return self.fail(reason, own);
        }
        self.rec.outputs = !self.rec.directives.stage_out.is_empty();
        let verdict = Verdict::Ready { outputs: self.rec.outputs };
        self.link.set_verdict(verdict).context("cannot post the verdict to mgmtd")?;
        let ready = self.t0.elapsed().as_secs_f64();
        let (n, mp) = (spec.nodes.len(), self.plan.mount.display());
        self.state.say(&spec.job_id, &format!("filesystem ready on {n} nodes in {ready:.2} s, mounted at {mp}"));
        self.stage_in(ready)
    }

    /// Node 0: the job's stage-ins; the job must not run without its data.
    fn stage_in(mut self, ready: f64) -> Result<StartOutcome> {
        let (spec, state) = (self.spec, &self.state);
        state.enter(&mut self.rec, Phase::Staging)?;
        let t1 = Instant::now();
        let staged = run_stages(&self.link, state, &self.rec, self.ctx, true, spec.slurm);
        let staged = staged.and_then(|ran| {
            if ran {
                start_drains(&self.link, state, &self.rec, self.ctx).map(|()| true)
            } else {
                Ok(false)
            }
        });
        match staged {
            Ok(true) => {
                state.enter(&mut self.rec, Phase::Running)?;
                let stage_secs = t1.elapsed().as_secs_f64();
                Ok(StartOutcome::Ready { secs: ready, stage_secs, mount: self.plan.mount })
            }
            Ok(false) => {
                state.enter(&mut self.rec, Phase::Cancelled)?;
                state.say(&spec.job_id, "cancelled during the stage-in; the epilog tears the filesystem down");
                Ok(StartOutcome::Cancelled)
            }
            Err(reason) => {
                // Every node's services stay up until the epilog tears them down (Slurm runs it
                // after requeueing the job).
                let msg = crate::line(&spec.job_id, &format!("could not start: {reason}"));
                state.enter(&mut self.rec, Phase::StartFailed { reason, own: false, script: false })?;
                slurm_failure(spec, &self.ctx.site, &msg, false);
                if spec.slurm {
                    slurm::tell_user(spec, &format!("{msg}. {}", held_after_stage_in(&spec.job_id)));
                }
                bail!(msg)
            }
        }
    }
}

/// What the user can do about a job held after its stage-in failed (the job's output file).
fn held_after_stage_in(job: &str) -> String {
    format!(
        "The job is requeued and held. Once the data is where its `#ODFS stage-in` line says (the bucket \
         or directory exists and the job's credentials may read it), release the job: `scontrol release {job}`. \
         If the line itself is wrong, cancel the job (`scancel {job}`), fix the line in the batch script \
         (`odfs check-script` checks it) and submit it again: a held job keeps the script it was submitted with."
    )
}

/// After a failure in a Slurm prolog: the node's drain reason becomes odfs's line (marked as
/// the batch host's when the fault is not this node's, so its epilog can return it).
fn slurm_failure(spec: &JobSpec, site: &SiteConfig, msg: &str, own: bool) {
    if !spec.slurm || !site.ondemand.slurm_drain_reason {
        return;
    }
    let reason = if own { msg.to_string() } else { format!("{} {msg}", slurm::BATCH_HOST_MARK) };
    slurm::drain(spec.node_name(), &reason);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::JobUser;

    fn one_node_spec() -> JobSpec {
        JobSpec {
            job_id: "7".into(),
            nodes: vec!["n0".into()],
            index: 0,
            user: JobUser { name: "ana".into(), uid: 1000, gid: 1000, groups: vec![] },
            features: vec!["odfs".into()],
            stdout: None,
            slurm: false,
        }
    }

    #[test]
    fn the_sites_drop_behind_setting_reaches_stored_and_the_mount() {
        let mut site = SiteConfig::default();
        let (spec, addr) = (one_node_spec(), SocketAddr::from(([127, 0, 0, 1], 1)));
        let plan = Plan {
            mgmtd: addr,
            metad: addr,
            stored: addr,
            bulk: addr,
            agent: addr,
            data_dirs: vec![PathBuf::from("/nvme")],
            ram_dir: None,
            mount: PathBuf::from("/mnt/odfs/7"),
            job_dir: PathBuf::from("/var/lib/odfs/jobs/7"),
        };
        for on in [true, false] {
            site.ondemand.drop_behind_reads = on;
            let node = node_launch(&plan, &spec, &site, site.ondemand.layout(), 1);
            assert_eq!(node.stored_config().drop_behind_reads, on, "stored's config");
            assert_eq!(node.client_config(odfs_rpc::Transport::Tcp, None).drop_behind_reads, on, "the mount's config");
        }
    }

    #[test]
    fn directives_change_the_sites_default_layout() {
        let site = SiteConfig::default();
        let spec = one_node_spec();
        let none = job_layout(&site, &spec, &Directives::default()).unwrap();
        assert_eq!(none, site.ondemand.layout());
        assert!(!none.local);
        let d = Directives { stripe_count: Some(1), local_placement: Some(true), ..Directives::default() };
        let l = job_layout(&site, &spec, &d).unwrap();
        assert_eq!((l.stripe_count, l.local), (1, true));
        let bad = Directives { pool: Some("tape".into()), ..Directives::default() };
        assert!(job_layout(&site, &spec, &bad).unwrap_err().contains("no such pool"), "pool is checked");
    }
}
