//! The client's view of the cluster: which metad serves which shard, where each target lives.
//! Refreshed from mgmtd in the background and on demand.

use crate::{ClientError, Result};
use odfs_proto::mgmt::{ClusterView, FsState, GetCluster, ServiceInfo, ServiceKind};
use odfs_proto::{InodeId, NodeIndex, RequestHeader, TargetId};
use odfs_rpc::{Pool, Transport};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

pub struct Cluster {
    pool: Arc<Pool>,
    mgmtd: SocketAddr,
    view: RwLock<Arc<ClusterView>>,
}

impl Cluster {
    pub async fn fetch(pool: Arc<Pool>, mgmtd: SocketAddr) -> Result<Cluster> {
        let view = pool.call(mgmtd, Transport::Quic, &RequestHeader::default(), &GetCluster {}).await.map_err(|e| {
            match &e {
                // Another service of the job answered: it serves no cluster view.
                odfs_rpc::RpcError::Remote(r) if r.code == odfs_proto::ErrorCode::BadMethod => {
                    ClientError::Config(format!(
                        "{mgmtd} is not mgmtd: an odfs service there answered, but not as mgmtd does (another \
                     daemon's address?); `mgmtd =` in the client config names mgmtd's"
                    ))
                }
                _ => ClientError::Unavailable(format!("mgmtd at {mgmtd}: {e}")),
            }
        })?;
        Ok(Cluster { pool, mgmtd, view: RwLock::new(Arc::new(view)) })
    }

    pub fn view(&self) -> Arc<ClusterView> {
        self.view.read().expect("view lock").clone()
    }

    pub async fn refresh(&self) -> Result<Arc<ClusterView>> {
        let v = self
            .pool
            .call(self.mgmtd, Transport::Quic, &RequestHeader::default(), &GetCluster {})
            .await
            .map_err(|e| ClientError::Unavailable(format!("mgmtd at {}: {e}", self.mgmtd)))?;
        let v = Arc::new(v);
        *self.view.write().expect("view lock") = v.clone();
        Ok(v)
    }

    pub fn ready(&self) -> bool {
        self.view().state == FsState::Ready
    }

    /// Address (and transport: `want` if it serves it) of the metad serving `shard`.
    pub fn meta_addr(&self, shard: u16, want: Transport) -> Result<(SocketAddr, Transport)> {
        let v = self.view();
        v.meta_for_shard(shard)
            .and_then(|s| route(s, want))
            .ok_or_else(|| ClientError::Unavailable(format!("no metadata service for shard {shard}")))
    }

    /// The chunk file of `ino` on `target` when that target is on `node` and its stored told
    /// where it keeps its files (for FUSE passthrough on that node).
    pub fn local_chunk_path(&self, target: TargetId, node: NodeIndex, ino: InodeId) -> Option<PathBuf> {
        let v = self.view();
        let t = v.target(target).filter(|t| t.node == node && t.online)?;
        Some(odfs_proto::layout::chunk_path(Path::new(t.path.as_deref()?), ino))
    }

    /// Where the targets on `node` keep their files, for those whose stored told.
    pub fn target_dirs(&self, node: NodeIndex) -> Vec<PathBuf> {
        self.view()
            .targets
            .iter()
            .filter(|t| t.node == node)
            .filter_map(|t| t.path.as_deref().map(PathBuf::from))
            .collect()
    }

    /// Address (and transport) of the stored holding `target`.
    pub fn target_addr(&self, target: TargetId, bulk: Transport) -> Result<(SocketAddr, Transport)> {
        let v = self.view();
        let t =
            v.target(target).ok_or_else(|| ClientError::Unavailable(format!("target {target} is not registered")))?;
        let s = v
            .service(t.service_id)
            .filter(|s| s.kind == ServiceKind::Storage)
            .ok_or_else(|| ClientError::Unavailable(format!("storage service of target {target} is gone")))?;
        route(s, bulk).ok_or_else(|| ClientError::Unavailable(format!("target {target} has no address")))
    }
}

/// Where to reach service `s` over `want`: its TCP address when TCP is wanted and it serves
/// TCP, else its QUIC address.
pub(crate) fn route(s: &ServiceInfo, want: Transport) -> Option<(SocketAddr, Transport)> {
    match (want, s.bulk_addr, s.addr) {
        (Transport::Tcp, Some(a), _) => Some((a, Transport::Tcp)),
        (_, _, Some(a)) => Some((a, Transport::Quic)),
        _ => None,
    }
}
