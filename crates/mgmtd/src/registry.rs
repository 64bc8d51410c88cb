//! The registry: services, targets, liveness, filesystem state.

use crate::MgmtdConfig;
use odfs_proto::error::RpcResult;
use odfs_proto::mgmt::*;
use odfs_proto::{DirLayout, ErrorCode, RemoteError, ServiceId, TargetId, Timespec};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tracing::info;

struct Service {
    info: ServiceInfo,
    last_seen: Instant,
}

struct Target {
    info: TargetInfo,
}

struct State {
    services: BTreeMap<ServiceId, Service>,
    targets: BTreeMap<TargetId, Target>,
    next_id: ServiceId,
    state: FsState,
    version: u64,
    /// The job board: each node's latest phase and node 0's verdict.
    board: BTreeMap<u32, ReportNode>,
    verdict: Option<Verdict>,
    /// Pools created empty (pools that targets name exist without this).
    created_pools: BTreeSet<String>,
    /// Targets moved out of the pool they registered with (kept across re-registration).
    moved: BTreeMap<TargetId, String>,
    /// The pool each target registered with.
    home_pool: BTreeMap<TargetId, String>,
}

pub struct Registry {
    /// This run of mgmtd (`RegisterReply::incarnation`).
    incarnation: u64,
    job_id: String,
    created: Timespec,
    expect_storage_nodes: u32,
    expect_meta: u32,
    heartbeat: Duration,
    offline_after: Duration,
    default_layout: DirLayout,
    state: Mutex<State>,
}

impl Registry {
    pub fn new(cfg: &MgmtdConfig) -> Registry {
        let heartbeat = Duration::from_millis(cfg.heartbeat_ms);
        Registry {
            // When this run started, to the nanosecond: no two runs share it.
            incarnation: {
                let t = Timespec::now();
                ((t.sec as u64) << 30 | t.nsec as u64) | 1
            },
            job_id: cfg.job.id.clone(),
            created: Timespec::now(),
            expect_storage_nodes: cfg.expect_storage_nodes,
            expect_meta: cfg.expect_meta,
            heartbeat,
            offline_after: heartbeat * cfg.offline_after_missed,
            default_layout: cfg.default_layout.clone(),
            state: Mutex::new(State {
                services: BTreeMap::new(),
                targets: BTreeMap::new(),
                next_id: 1,
                state: FsState::Forming,
                version: 1,
                board: BTreeMap::new(),
                verdict: None,
                created_pools: BTreeSet::new(),
                moved: BTreeMap::new(),
                home_pool: BTreeMap::new(),
            }),
        }
    }

    pub fn heartbeat_ms(&self) -> u64 {
        self.heartbeat.as_millis() as u64
    }

    pub fn register(&self, r: Register) -> RegisterReply {
        let mut st = self.state.lock().expect("registry lock");
        // A restarted daemon replaces its previous incarnation.
        let stale: Vec<ServiceId> = st
            .services
            .iter()
            .filter(|(_, s)| {
                s.info.kind == r.kind
                    && s.info.node == r.node
                    && s.info.shard == r.shard
                    && r.kind != ServiceKind::Client
            })
            .map(|(id, _)| *id)
            .collect();
        for id in stale {
            st.services.remove(&id);
        }
        let id = st.next_id;
        st.next_id += 1;
        for t in &r.targets {
            st.home_pool.insert(t.id, t.pool.clone());
            let pool = st.moved.get(&t.id).cloned().unwrap_or_else(|| t.pool.clone());
            st.targets.insert(
                t.id,
                Target {
                    info: TargetInfo {
                        id: t.id,
                        node: r.node,
                        service_id: id,
                        pool,
                        space: t.space,
                        online: true,
                        path: t.path.clone(),
                    },
                },
            );
        }
        info!(id, kind = ?r.kind, node = r.node, addr = ?r.addr, targets = r.targets.len(), "service registered");
        st.services.insert(
            id,
            Service {
                info: ServiceInfo {
                    id,
                    kind: r.kind,
                    node: r.node,
                    hostname: r.hostname,
                    addr: r.addr,
                    bulk_addr: r.bulk_addr,
                    shard: r.shard,
                    online: true,
                    last_seen_ms: 0,
                    pid: r.pid,
                    client_id: r.client_id,
                },
                last_seen: Instant::now(),
            },
        );
        st.version += 1;
        self.update_state(&mut st);
        RegisterReply { service_id: id, heartbeat_ms: self.heartbeat_ms(), incarnation: self.incarnation }
    }

    pub fn heartbeat(&self, hb: Heartbeat) -> HeartbeatReply {
        let mut st = self.state.lock().expect("registry lock");
        // An id an earlier run of mgmtd gave may be one of this run's for another service.
        let Some(s) = st.services.get_mut(&hb.service_id).filter(|_| hb.incarnation == self.incarnation) else {
            return HeartbeatReply { known: false };
        };
        s.last_seen = Instant::now();
        for (tid, space) in hb.targets {
            if let Some(t) = st.targets.get_mut(&tid) {
                if t.info.service_id == hb.service_id {
                    t.info.space = space;
                }
            }
        }
        HeartbeatReply { known: true }
    }

    pub fn unregister(&self, id: ServiceId) {
        let mut st = self.state.lock().expect("registry lock");
        if st.services.remove(&id).is_some() {
            info!(id, "service unregistered");
            st.version += 1;
        }
    }

    fn online(&self, s: &Service) -> bool {
        s.last_seen.elapsed() < self.offline_after
    }

    fn update_state(&self, st: &mut State) {
        if st.state != FsState::Forming {
            return;
        }
        let mut storage_nodes: Vec<u32> = st
            .services
            .values()
            .filter(|s| s.info.kind == ServiceKind::Storage && self.online(s))
            .map(|s| s.info.node)
            .collect();
        storage_nodes.sort();
        storage_nodes.dedup();
        let metas = st.services.values().filter(|s| s.info.kind == ServiceKind::Meta && self.online(s)).count();
        if storage_nodes.len() as u32 >= self.expect_storage_nodes && metas as u32 >= self.expect_meta {
            st.state = FsState::Ready;
            st.version += 1;
            info!(storage_nodes = storage_nodes.len(), metas, "filesystem ready");
        }
    }

    /// Every pool: created ones and those targets are in.
    fn pools(st: &State) -> Vec<String> {
        let mut v: BTreeSet<String> = st.created_pools.clone();
        v.extend(st.targets.values().map(|t| t.info.pool.clone()));
        v.into_iter().collect()
    }

    pub fn change_pool(&self, c: ChangePool) -> RpcResult<()> {
        let invalid = |m: String| RemoteError::new(ErrorCode::Invalid, m);
        valid_pool_name(&c.name).map_err(invalid)?;
        let mut st = self.state.lock().expect("registry lock");
        let exists = Self::pools(&st).contains(&c.name);
        match c.change {
            PoolChange::Create => {
                if exists {
                    return Err(RemoteError::new(ErrorCode::Exists, format!("pool {} exists already", c.name)));
                }
                st.created_pools.insert(c.name.clone());
            }
            PoolChange::Destroy => {
                if !exists {
                    return Err(RemoteError::new(ErrorCode::NotFound, format!("no pool {}", c.name)));
                }
                if st.targets.values().any(|t| t.info.pool == c.name) {
                    return Err(RemoteError::new(
                        ErrorCode::NotEmpty,
                        format!("pool {} still has targets; move them out first", c.name),
                    ));
                }
                st.created_pools.remove(&c.name);
            }
            PoolChange::Add(ref ids) | PoolChange::Remove(ref ids) => {
                if !exists {
                    return Err(RemoteError::new(ErrorCode::NotFound, format!("no pool {} (create it first)", c.name)));
                }
                if ids.is_empty() {
                    return Err(invalid("name at least one target".into()));
                }
                let add = matches!(c.change, PoolChange::Add(_));
                // Check every target before moving any: a bad list changes nothing.
                let mut to = Vec::new();
                for id in ids {
                    let t = st
                        .targets
                        .get(id)
                        .ok_or_else(|| RemoteError::new(ErrorCode::NotFound, format!("no target {id}")))?;
                    if add {
                        to.push((*id, c.name.clone()));
                    } else {
                        if t.info.pool != c.name {
                            return Err(invalid(format!("target {id} is in pool {}, not {}", t.info.pool, c.name)));
                        }
                        let home = st.home_pool.get(id).cloned().unwrap_or_default();
                        if home == c.name {
                            return Err(invalid(format!(
                                "target {id} belongs to pool {} by its configuration; add it to another pool instead",
                                c.name
                            )));
                        }
                        to.push((*id, home));
                    }
                }
                for (id, pool) in to {
                    if st.home_pool.get(&id) == Some(&pool) {
                        st.moved.remove(&id);
                    } else {
                        st.moved.insert(id, pool.clone());
                    }
                    if let Some(t) = st.targets.get_mut(&id) {
                        t.info.pool = pool;
                    }
                }
            }
        }
        st.version += 1;
        info!(pool = %c.name, change = ?c.change, "pools changed");
        Ok(())
    }

    pub fn report_node(&self, r: ReportNode) {
        let mut st = self.state.lock().expect("registry lock");
        info!(node = r.node, host = %r.hostname, phase = ?r.phase, "node report");
        st.board.insert(r.node, r);
    }

    pub fn set_verdict(&self, v: Verdict) {
        let mut st = self.state.lock().expect("registry lock");
        info!(verdict = ?v, "job verdict");
        st.verdict = Some(v);
    }

    pub fn board(&self) -> Board {
        let st = self.state.lock().expect("registry lock");
        Board { nodes: st.board.values().cloned().collect(), verdict: st.verdict.clone() }
    }

    pub fn view(&self) -> ClusterView {
        let mut st = self.state.lock().expect("registry lock");
        self.update_state(&mut st);
        let services: Vec<ServiceInfo> = st
            .services
            .values()
            .map(|s| {
                let mut i = s.info.clone();
                i.online = self.online(s);
                i.last_seen_ms = s.last_seen.elapsed().as_millis() as u64;
                i
            })
            .collect();
        let targets = st
            .targets
            .values()
            .map(|t| {
                let mut i = t.info.clone();
                i.online = services.iter().any(|s| s.id == i.service_id && s.online);
                i
            })
            .collect();
        ClusterView {
            job_id: self.job_id.clone(),
            state: st.state,
            created: self.created,
            expected_storage_nodes: self.expect_storage_nodes,
            expected_meta: self.expect_meta,
            services,
            targets,
            default_layout: self.default_layout.clone(),
            version: st.version,
            pools: Self::pools(&st),
        }
    }
}
