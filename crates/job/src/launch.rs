//! Launching a node's part of a filesystem, for `odfs local up` and `odfs start` alike: the
//! one plan of a node's daemons and their configs ([`NodeLaunch`]), starting them as detached
//! processes, the FUSE client, and the record of what was started ([`ProcEntry`]).
//!
//! - `procs`: spawning, recognising (a recycled pid is never taken for ours) and stopping them.
//! - `mount`: finding, waiting for and taking down mounts (FUSE and tmpfs) without hanging.
//! - `lock`: the flock a command holds while it works on a filesystem root or a job.

pub mod lock;
pub mod mount;
pub mod procs;

use anyhow::{Context, Result};
use odfs_client::ClientConfig;
use odfs_metad::config::{MetadConfig, RootOwner};
use odfs_mgmtd::MgmtdConfig;
use odfs_proto::DirLayout;
use odfs_rpc::Transport;
use odfs_service::JobSection;
use odfs_stage::AgentConfig;
use odfs_stored::config::{StoredConfig, TargetSection};
use serde::{Deserialize, Serialize};
use std::ffi::OsStr;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// One process started for a filesystem.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ProcEntry {
    /// "mgmtd", "metad", "stored", "agent" or "fuse".
    pub service: String,
    pub node: u32,
    pub pid: u32,
    pub config: PathBuf,
    pub log: PathBuf,
}

/// Node 0's mgmtd: what makes the filesystem ready, and its default layout.
#[derive(Debug, Clone)]
pub struct Registry {
    pub listen: SocketAddr,
    pub storage_nodes: u32,
    pub metas: u32,
    pub layout: DirLayout,
}

/// A metadata service (shard k on node k).
#[derive(Debug, Clone)]
pub struct MetaPlan {
    pub listen: SocketAddr,
    pub data_dir: PathBuf,
    /// Owner and mode of a new root (a job's filesystem belongs to its user).
    pub root_owner: Option<RootOwner>,
    pub root_only_layouts: bool,
}

/// Everything one node runs and where, before anything is started.
#[derive(Debug, Clone)]
pub struct NodeLaunch {
    pub job: JobSection,
    pub node: u32,
    pub mgmtd: SocketAddr,
    /// Node 0 only.
    pub registry: Option<Registry>,
    /// Nodes that serve a metadata shard.
    pub meta: Option<MetaPlan>,
    pub stored: SocketAddr,
    pub bulk: SocketAddr,
    pub agent: SocketAddr,
    pub targets: Vec<TargetSection>,
    pub io_backend: String,
    /// Empty chunk files each of stored's targets keeps ready.
    pub precreate_chunk_files: usize,
    /// Chunk writes of at least this many bytes bypass stored's page cache (0: none).
    pub direct_write_min_bytes: usize,
    /// stored, and the client for its node's own chunks, drop what a single sequential reader
    /// has read from the page cache.
    pub drop_behind_reads: bool,
    /// How long each daemon waits for mgmtd (None: the daemons' default).
    pub register_timeout_secs: Option<u64>,
    /// stored's runtime threads (None: stored's default).
    pub stored_worker_threads: Option<usize>,
    /// Node 0's mgmtd serves the job's Prometheus metrics here (None: not at all).
    pub metrics: Option<SocketAddr>,
}

/// Storage targets of node `node`: one per data directory (`DIR/target<ID>`) in `pool`, then
/// the RAM target `(dir, pool)` if any. Node k owns ids `k*per+1 ..= k*per+per`, so every node
/// can number its targets without asking.
pub fn node_targets(
    node: u32,
    data_dirs: &[PathBuf],
    pool: &str,
    ram: Option<(PathBuf, String)>,
) -> Vec<TargetSection> {
    let per = data_dirs.len() as u32 + u32::from(ram.is_some());
    let mut targets: Vec<TargetSection> = data_dirs
        .iter()
        .enumerate()
        .map(|(j, d)| {
            let id = node * per + j as u32 + 1;
            TargetSection { id, path: d.join(format!("target{id}")), pool: pool.to_string() }
        })
        .collect();
    if let Some((path, pool)) = ram {
        targets.push(TargetSection { id: node * per + per, path, pool });
    }
    targets
}

impl NodeLaunch {
    fn mgmtd_config(&self, r: &Registry) -> MgmtdConfig {
        MgmtdConfig {
            job: self.job.clone(),
            listen: r.listen,
            addr_file: None,
            expect_storage_nodes: r.storage_nodes,
            expect_meta: r.metas,
            default_layout: r.layout.clone(),
            metrics_listen: self.metrics,
            ..MgmtdConfig::default()
        }
    }

    fn metad_config(&self, m: &MetaPlan) -> MetadConfig {
        let d = MetadConfig::default();
        MetadConfig {
            job: self.job.clone(),
            listen: m.listen,
            mgmtd: self.mgmtd,
            node: self.node,
            shard: self.node as u16,
            data_dir: m.data_dir.clone(),
            register_timeout_secs: self.register_timeout_secs.unwrap_or(d.register_timeout_secs),
            root_owner: m.root_owner,
            root_only_layouts: m.root_only_layouts,
            ..d
        }
    }

    pub(crate) fn stored_config(&self) -> StoredConfig {
        let d = StoredConfig::default();
        StoredConfig {
            job: self.job.clone(),
            listen: self.stored,
            bulk_listen: Some(self.bulk),
            addr_file: None,
            mgmtd: self.mgmtd,
            node: self.node,
            targets: self.targets.clone(),
            io_backend: self.io_backend.clone(),
            precreate_chunk_files: self.precreate_chunk_files,
            direct_write_min_bytes: self.direct_write_min_bytes,
            drop_behind_reads: self.drop_behind_reads,
            register_timeout_secs: self.register_timeout_secs.unwrap_or(d.register_timeout_secs),
            worker_threads: self.stored_worker_threads.unwrap_or(d.worker_threads),
        }
    }

    fn agent_config(&self) -> AgentConfig {
        let d = AgentConfig::default();
        AgentConfig {
            job: self.job.clone(),
            listen: self.agent,
            mgmtd: self.mgmtd,
            node: self.node,
            register_timeout_secs: self.register_timeout_secs.unwrap_or(d.register_timeout_secs),
            ..d
        }
    }

    /// The config of this node's clients (its mount, its stages, the CLI).
    pub fn client_config(&self, bulk: Transport, retry_secs: Option<u64>) -> ClientConfig {
        let d = ClientConfig::default();
        ClientConfig {
            job: self.job.clone(),
            mgmtd: self.mgmtd,
            bulk_transport: bulk,
            node: self.node,
            retry_secs: retry_secs.unwrap_or(d.retry_secs),
            drop_behind_reads: self.drop_behind_reads,
            ..d
        }
    }

    /// Writes each daemon's config into `dir` and starts it: mgmtd (node 0), metad (a shard's
    /// node), stored, the stage agent. `started` records each process before the next starts,
    /// so a failure part-way leaves a record of everything to stop.
    pub fn start(&self, dir: &Path, mut started: impl FnMut(ProcEntry) -> Result<()>) -> Result<()> {
        if let Some(r) = &self.registry {
            started(launch(dir, "mgmtd", self.node, &self.mgmtd_config(r))?)?;
        }
        if let Some(m) = &self.meta {
            started(launch(dir, "metad", self.node, &self.metad_config(m))?)?;
        }
        started(launch(dir, "stored", self.node, &self.stored_config())?)?;
        started(launch(dir, "agent", self.node, &self.agent_config())?)
    }
}

/// Writes `DIR/SERVICE.toml` and starts `odfs-SERVICE` with it (log `DIR/SERVICE.log`).
fn launch<T: Serialize>(dir: &Path, service: &str, node: u32, cfg: &T) -> Result<ProcEntry> {
    let (config, log) = (dir.join(format!("{service}.toml")), dir.join(format!("{service}.log")));
    write_toml(&config, cfg)?;
    let bin = procs::binary(&format!("odfs-{service}"))?;
    let pid = procs::spawn_daemon(&bin, &config, &log)?;
    Ok(ProcEntry { service: service.into(), node, pid, config, log })
}

/// Starts the FUSE client (`odfs-fuse`) of `client_config` on `mount_point`, log `log`;
/// `allow_other` lets users other than root in (the mount's own permissions still apply).
pub fn spawn_fuse(
    client_config: &Path,
    mount_point: &Path,
    allow_other: bool,
    log: &Path,
    node: u32,
) -> Result<ProcEntry> {
    let bin = procs::binary("odfs-fuse")?;
    let mut args =
        vec![OsStr::new("--fs"), client_config.as_os_str(), OsStr::new("--mountpoint"), mount_point.as_os_str()];
    if allow_other {
        args.push(OsStr::new("--allow-other"));
    }
    let session = fuse_session_file(log);
    // A file left by an odfs-fuse of an earlier mount on the same log is no longer anyone's.
    let _ = std::fs::remove_file(&session);
    args.extend([OsStr::new("--session-file"), session.as_os_str()]);
    let pid = procs::spawn_detached(&bin, &args, client_config, log)?;
    Ok(ProcEntry { service: "fuse".into(), node, pid, config: client_config.to_path_buf(), log: log.to_path_buf() })
}

/// Where the `odfs-fuse` logging to `log` keeps its client id while its metadata sessions
/// last: it removes the file once it has said goodbye (see [`end_fuse_sessions`]).
pub fn fuse_session_file(log: &Path) -> PathBuf {
    log.with_extension("session")
}

/// How long ending a dead `odfs-fuse`'s sessions may take, connecting included.
const END_SESSIONS_LIMIT: Duration = Duration::from_secs(10);

/// For an `odfs-fuse` that is gone without its goodbye (killed, crashed, stopped before it
/// finished): ends its metadata sessions for it, so that no change of another node waits a
/// lease for the leases it held. Returns a line saying what was done, or None when there was
/// nothing to do (it said goodbye, or it still runs).
pub fn end_fuse_sessions(p: &ProcEntry) -> Option<String> {
    let file = fuse_session_file(&p.log);
    let text = std::fs::read_to_string(&file).ok()?;
    if procs::runs(p.pid, &p.config) {
        return None;
    }
    let line = match u64::from_str_radix(text.trim(), 16) {
        Ok(id) => match end_sessions_of(&p.config, id) {
            Ok(()) => format!("ended the metadata sessions of odfs-fuse (pid {}), which exited without ending them", p.pid),
            Err(e) => format!(
                "could not end the metadata sessions of odfs-fuse (pid {}): {e}; metad ends them one lease after its last poll",
                p.pid
            ),
        },
        Err(_) => format!("ignored {}: it holds no client id", file.display()),
    };
    let _ = std::fs::remove_file(&file);
    Some(line)
}

/// Ends client `id`'s sessions on every metadata shard of the filesystem `client_config`
/// names, through a one-shot client of its own.
fn end_sessions_of(client_config: &Path, id: u64) -> Result<()> {
    let cfg = ClientConfig::load(client_config).map_err(|e| anyhow::anyhow!("{e}"))?.one_shot();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let work = async {
            let client = odfs_client::Client::connect(cfg).await.map_err(|e| anyhow::anyhow!("{e}"))?;
            let failed = client.end_sessions_of(id).await;
            client.close().await;
            match failed.first() {
                None => Ok(()),
                Some((shard, e)) => anyhow::bail!("metadata shard {shard}: {e}"),
            }
        };
        tokio::time::timeout(END_SESSIONS_LIMIT, work)
            .await
            .map_err(|_| anyhow::anyhow!("the filesystem did not answer within {} s", END_SESSIONS_LIMIT.as_secs()))?
    })
}

/// Writes `v` as TOML to `path`.
pub fn write_toml<T: Serialize>(path: &Path, v: &T) -> Result<()> {
    std::fs::write(path, toml::to_string_pretty(v)?).with_context(|| format!("cannot write {}", path.display()))
}

/// The last `lines` lines of a log file (empty if it cannot be read), and a note when the disk
/// holding it is full: a daemon that cannot write its log or its state dies without a word,
/// and a launcher's "exited before it was ready" would otherwise be all anyone sees.
pub fn log_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let v: Vec<&str> = text.lines().collect();
    let tail = v[v.len().saturating_sub(lines)..].join("\n");
    match path.parent().and_then(full_disk) {
        Some(note) if tail.is_empty() => note,
        Some(note) => format!("{tail}\n{note}"),
        None => tail,
    }
}

/// Less free space than this on a daemon's disk is named as the likely cause of its failure.
const LOW_SPACE: u64 = 64 << 20;

/// A note naming `dir`'s filesystem when it has less than `LOW_SPACE` free (pseudo
/// filesystems, with no blocks at all, are never full).
fn full_disk(dir: &Path) -> Option<String> {
    let s = nix::sys::statvfs::statvfs(dir).ok()?;
    let free = s.blocks_available() as u64 * s.fragment_size() as u64;
    (s.blocks() > 0).then_some(())?;
    low_space_note(dir, free)
}

fn low_space_note(dir: &Path, free: u64) -> Option<String> {
    (free < LOW_SPACE).then(|| {
        format!(
            "no space left: the filesystem holding {} has {} KiB free; free some and try again",
            dir.display(),
            free >> 10
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_node_numbers_its_own_targets() {
        let dirs = [PathBuf::from("/a"), PathBuf::from("/b")];
        let t = node_targets(2, &dirs, "default", Some((PathBuf::from("/r"), "ram".into())));
        let ids: Vec<u32> = t.iter().map(|t| t.id).collect();
        assert_eq!(ids, [7, 8, 9]);
        assert_eq!(t[1].path, PathBuf::from("/b/target8"));
        assert_eq!((t[2].path.as_path(), t[2].pool.as_str()), (Path::new("/r"), "ram"));
        let t = node_targets(0, &dirs[..1], "p", None);
        assert_eq!((t[0].id, t[0].path.as_path(), t[0].pool.as_str()), (1, Path::new("/a/target1"), "p"));
    }

    #[test]
    fn a_full_disk_is_named_beside_a_log_tail() {
        let note = low_space_note(Path::new("/var/odfs"), 4096).expect("4 KiB free is full");
        assert_eq!(note, "no space left: the filesystem holding /var/odfs has 4 KiB free; free some and try again");
        assert_eq!(low_space_note(Path::new("/var/odfs"), 1 << 30), None);
        assert_eq!(full_disk(Path::new("/proc")), None, "a pseudo filesystem is never full");
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("x.log");
        std::fs::write(&log, "one\ntwo\nthree\n").unwrap();
        // The test machine's temporary directory has room: only the lines.
        assert_eq!(log_tail(&log, 2), "two\nthree");
    }
}
