//! The job board on node 0's mgmtd, seen from one node: report this node's phase, read the
//! other nodes' phases and node 0's verdict, post the verdict (node 0). Every call is short and
//! bounded; the waiting loops live in `start` and `stop`.

use anyhow::Result;
use odfs_proto::mgmt::{Board, ClusterView, GetBoard, GetCluster, NodePhase, ReportNode, SetVerdict, Verdict};
use odfs_proto::RequestHeader;
use odfs_rpc::{JobCredential, Pool, PoolConfig, Transport};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Longest wait for one board call.
const CALL_LIMIT: Duration = Duration::from_secs(2);

pub struct BoardLink {
    rt: tokio::runtime::Runtime,
    pool: Pool,
    pub mgmtd: SocketAddr,
    node: u32,
    host: String,
}

impl BoardLink {
    pub fn new(cred: JobCredential, mgmtd: SocketAddr, node: u32, host: &str) -> Result<BoardLink> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let pool = rt.block_on(async {
            Pool::new(
                cred,
                PoolConfig { call_timeout: CALL_LIMIT, retry_deadline: Duration::from_millis(1), conns_per_peer: 1 },
            )
        })?;
        Ok(BoardLink { rt, pool, mgmtd, node, host: host.to_string() })
    }

    /// One call, bounded as a whole: a connection attempt to a host whose mgmtd is gone would
    /// otherwise wait for QUIC's idle timeout.
    fn call<R: odfs_proto::Rpc>(&self, req: &R) -> Result<R::Reply> {
        let header = RequestHeader::default();
        let call = self.pool.call(self.mgmtd, Transport::Quic, &header, req);
        match self.rt.block_on(async { tokio::time::timeout(CALL_LIMIT, call).await }) {
            Ok(r) => Ok(r?),
            Err(_) => anyhow::bail!("mgmtd at {} did not answer within {} s", self.mgmtd, CALL_LIMIT.as_secs()),
        }
    }

    pub fn board(&self) -> Result<Board> {
        self.call(&GetBoard {})
    }

    pub fn cluster(&self) -> Result<ClusterView> {
        self.call(&GetCluster {})
    }

    pub fn report(&self, phase: NodePhase) -> Result<()> {
        self.call(&ReportNode { node: self.node, hostname: self.host.clone(), phase })
    }

    /// Reports, retrying until `limit` (mgmtd may still be starting, or briefly away).
    pub fn report_within(&self, phase: NodePhase, limit: Duration) -> Result<()> {
        let t = Instant::now();
        loop {
            match self.report(phase.clone()) {
                Ok(()) => return Ok(()),
                Err(e) if t.elapsed() >= limit => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }

    pub fn set_verdict(&self, verdict: Verdict) -> Result<()> {
        self.call(&SetVerdict { verdict })
    }

    /// Runs an async future on this link's runtime (stages run here, over the job's network).
    pub fn block_on<F: std::future::Future>(&self, f: F) -> F::Output {
        self.rt.block_on(f)
    }
}
