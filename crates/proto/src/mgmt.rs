//! Messages of the management service (mgmtd): registration, heartbeats, the cluster view.

use crate::{DirLayout, NodeIndex, ServiceId, TargetId, Timespec};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ServiceKind {
    Meta,
    Storage,
    Client,
    /// A stage agent (moves its node's share of stage-in and stage-out).
    Agent,
}

impl ServiceKind {
    pub const ALL: [ServiceKind; 4] =
        [ServiceKind::Meta, ServiceKind::Storage, ServiceKind::Client, ServiceKind::Agent];

    /// How people and the process tables name it: its daemon ("metad", "stored", "agent"), or
    /// "client" (a mount).
    pub fn name(self) -> &'static str {
        match self {
            ServiceKind::Meta => "metad",
            ServiceKind::Storage => "stored",
            ServiceKind::Client => "client",
            ServiceKind::Agent => "agent",
        }
    }
}

/// Filesystem life cycle as mgmtd sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FsState {
    /// Waiting for the expected services and targets.
    Forming,
    /// Every expected service and target is registered.
    Ready,
    /// Shutting down; no new clients.
    Draining,
}

/// Space of one target as its stored reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct TargetSpace {
    /// The size of the filesystem holding the target (`f_blocks`), as `df` shows it.
    pub capacity: u64,
    /// Bytes free to unprivileged writers (`f_bavail`): what `df` shows as available.
    pub free: u64,
    /// Bytes in use (`f_blocks - f_bfree`), as `df` counts them: what is neither used nor free
    /// is reserved for root.
    #[serde(default)]
    pub used: u64,
    pub inodes_total: u64,
    pub inodes_free: u64,
    /// The filesystem the target lives on (0: unknown). Targets with the same device share
    /// their space: totals count it once (see [`first_on_device`]).
    pub device: u64,
}

/// True the first time `device` is seen in `seen`: several targets on one disk count its space
/// once in a total. An unknown device (0) always counts.
pub fn first_on_device(seen: &mut std::collections::BTreeSet<u64>, device: u64) -> bool {
    device == 0 || seen.insert(device)
}

/// A target offered by a storage service at registration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TargetOffer {
    pub id: TargetId,
    pub pool: String,
    pub space: TargetSpace,
    /// The target's directory on its node, for clients on that node that open chunk files
    /// themselves (FUSE passthrough); `None` when the stored does not offer it.
    pub path: Option<String>,
}

/// A service introduces itself. Re-registering with the same kind and node replaces the old
/// entry (a restarted daemon).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Register {
    pub kind: ServiceKind,
    pub node: NodeIndex,
    pub hostname: String,
    /// Address of its QUIC endpoint (none for clients).
    pub addr: Option<SocketAddr>,
    /// Address of its bulk-data TCP listener, if any.
    pub bulk_addr: Option<SocketAddr>,
    /// Metadata shard served (metad only).
    pub shard: Option<u16>,
    pub targets: Vec<TargetOffer>,
    pub pid: u32,
    /// A client's id, as its requests' headers carry it (0 for a daemon).
    pub client_id: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterReply {
    pub service_id: ServiceId,
    pub heartbeat_ms: u64,
    /// Which run of mgmtd gave the id: a restarted mgmtd (which numbers services from 1 again)
    /// does not take an earlier run's id for one of its own.
    #[serde(default)]
    pub incarnation: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    pub service_id: ServiceId,
    pub targets: Vec<(TargetId, TargetSpace)>,
    /// The `RegisterReply::incarnation` the id came with.
    #[serde(default)]
    pub incarnation: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeartbeatReply {
    /// False when mgmtd does not know the service (it must register again).
    pub known: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unregister {
    pub service_id: ServiceId,
}

/// Ask for the whole cluster view.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GetCluster {}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServiceInfo {
    pub id: ServiceId,
    pub kind: ServiceKind,
    pub node: NodeIndex,
    pub hostname: String,
    pub addr: Option<SocketAddr>,
    pub bulk_addr: Option<SocketAddr>,
    pub shard: Option<u16>,
    pub online: bool,
    /// Milliseconds since the last heartbeat.
    pub last_seen_ms: u64,
    pub pid: u32,
    /// A client's id, as its requests' headers carry it (0 for a daemon).
    pub client_id: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TargetInfo {
    pub id: TargetId,
    pub node: NodeIndex,
    pub service_id: ServiceId,
    pub pool: String,
    pub space: TargetSpace,
    pub online: bool,
    /// See [`TargetOffer::path`].
    pub path: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterView {
    pub job_id: String,
    pub state: FsState,
    pub created: Timespec,
    pub expected_storage_nodes: u32,
    pub expected_meta: u32,
    pub services: Vec<ServiceInfo>,
    pub targets: Vec<TargetInfo>,
    pub default_layout: DirLayout,
    /// Grows whenever services or targets change.
    pub version: u64,
    /// Every pool: those targets name and those created empty (sorted).
    pub pools: Vec<String>,
}

impl ClusterView {
    pub fn service(&self, id: ServiceId) -> Option<&ServiceInfo> {
        self.services.iter().find(|s| s.id == id)
    }
    pub fn target(&self, id: TargetId) -> Option<&TargetInfo> {
        self.targets.iter().find(|t| t.id == id)
    }
    /// The online metad serving `shard`.
    pub fn meta_for_shard(&self, shard: u16) -> Option<&ServiceInfo> {
        self.services
            .iter()
            .filter(|s| s.kind == ServiceKind::Meta && s.shard == Some(shard))
            .max_by_key(|s| (s.online, s.id))
    }
    pub fn meta_shards(&self) -> u16 {
        self.services.iter().filter(|s| s.kind == ServiceKind::Meta).filter_map(|s| s.shard).max().map_or(0, |m| m + 1)
    }
}

/// Where one node stands in its part of the job's start or stop, as that node's `odfs start`,
/// `odfs stop` or `odfs recover` reports it. The job board on mgmtd is how the nodes of a job
/// agree without talking to each other.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodePhase {
    /// Its services run and its mount (if any) is up.
    Started,
    /// Its start failed; it is rolling back what it started.
    StartFailed { reason: String },
    /// It saw an `Abort` verdict and rolled back.
    Aborted,
    /// Stop: its mount is gone, so every write made through it has reached the targets.
    Unmounted,
    /// Stop: its services are stopped and its data wiped or kept, as the verdict said.
    Stopped,
}

/// Node 0's decision for the whole job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Verdict {
    /// Every node started: the job may run. `outputs`: the job stages outputs out when it
    /// ends, so a node that cannot learn the stop's verdict keeps its data.
    Ready { outputs: bool },
    /// The start failed: every node rolls back.
    Abort { reason: String },
    /// Stop: outputs verified (or nothing to keep): wipe everything.
    Wipe,
    /// Stop: outputs could not be verified: keep every target for `odfs recover`.
    Retain { reason: String },
}

/// A node reports its phase (the latest report of a node replaces the earlier one).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReportNode {
    pub node: NodeIndex,
    pub hostname: String,
    pub phase: NodePhase,
}

/// Node 0 posts the job's verdict (a later verdict replaces the earlier one).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetVerdict {
    pub verdict: Verdict,
}

/// Ask for the job board.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GetBoard {}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Board {
    /// Each node's latest report.
    pub nodes: Vec<ReportNode>,
    pub verdict: Option<Verdict>,
}

impl Board {
    pub fn phase(&self, node: NodeIndex) -> Option<&NodePhase> {
        self.nodes.iter().find(|r| r.node == node).map(|r| &r.phase)
    }
}

/// A change to the storage pools. A target belongs to exactly one pool: the one its stored
/// names at registration, until it is moved.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum PoolChange {
    /// A new, empty pool.
    Create,
    /// Move targets into the pool.
    Add(Vec<TargetId>),
    /// Move targets of the pool back to the pool they registered with.
    Remove(Vec<TargetId>),
    /// Forget an empty pool.
    Destroy,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChangePool {
    pub name: String,
    pub change: PoolChange,
}

/// A pool name: 1-64 letters, digits, '-', '_' or '.'.
pub fn valid_pool_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > 64 || !name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
        return Err(format!("pool name {name:?} must be 1-64 letters, digits, '-', '_' or '.'"));
    }
    Ok(())
}

impl ClusterView {
    /// Targets of a pool, in id order.
    pub fn pool_targets(&self, pool: &str) -> Vec<&TargetInfo> {
        let mut v: Vec<&TargetInfo> = self.targets.iter().filter(|t| t.pool == pool).collect();
        v.sort_by_key(|t| t.id);
        v
    }
}

crate::rpc! {
    Register = 1 => RegisterReply,
    Heartbeat = 2 => HeartbeatReply,
    Unregister = 3 => (),
    GetCluster = 4 => ClusterView,
    ReportNode = 5 => (),
    SetVerdict = 6 => (),
    GetBoard = 7 => Board,
    ChangePool = 8 => (),
}
