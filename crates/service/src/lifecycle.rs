//! The life of a registered daemon (metad, stored, the stage agent), written once: a client
//! pool of its own, its servers, registration with mgmtd (given up at shutdown), heartbeats,
//! and the teardown order.
//!
//! Teardown, in this order: shutdown fires → the heartbeat loop stops and says goodbye to
//! mgmtd (unregister) on the daemon's own client endpoint → the servers finish → the caller's
//! last work (metad's snapshot). The client endpoint is separate from the server endpoint
//! because the server endpoint closes at shutdown, before the goodbye has gone out.

use crate::mgmt_link::{MgmtLink, SpaceProbe};
use odfs_proto::mgmt::{Register, ServiceKind};
use odfs_rpc::quic::QuicEndpoint;
use odfs_rpc::{JobCredential, Pool, PoolConfig, Router, RpcError, Shutdown};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tracing::info;

/// A daemon of one job between start-up and exit.
pub struct Daemon {
    /// Calls the daemon makes (to mgmtd, to other services).
    pub pool: Arc<Pool>,
    pub cred: JobCredential,
    pub mgmtd: SocketAddr,
    pub shutdown: Shutdown,
    register_timeout: Duration,
}

/// The tasks serving a daemon's router; they end when shutdown fires.
pub struct Servers(Vec<JoinHandle<()>>);

/// What a daemon tells mgmtd about itself (the host name and pid are filled in).
pub fn announce(kind: ServiceKind, node: u32, addr: SocketAddr) -> Register {
    Register {
        kind,
        node,
        hostname: crate::hostname(),
        addr: Some(addr),
        bulk_addr: None,
        shard: None,
        targets: Vec::new(),
        pid: std::process::id(),
        client_id: 0,
    }
}

impl Daemon {
    /// `retry_deadline`: how long the daemon's own calls retry an unreachable peer.
    pub fn new(
        cred: JobCredential,
        mgmtd: SocketAddr,
        register_timeout: Duration,
        retry_deadline: Duration,
        shutdown: Shutdown,
    ) -> Result<Daemon, RpcError> {
        let pool = Arc::new(Pool::new(cred.clone(), PoolConfig { retry_deadline, ..PoolConfig::default() })?);
        Ok(Daemon { pool, cred, mgmtd, shutdown, register_timeout })
    }

    /// Serves `router` on the QUIC endpoint and, if given, on the authenticated TCP listener.
    pub fn serve(&self, quic: &QuicEndpoint, bulk: Option<TcpListener>, router: Arc<Router>) -> Servers {
        let mut tasks = vec![tokio::spawn({
            let (ep, router, sd) = (quic.clone(), router.clone(), self.shutdown.clone());
            async move { ep.serve(router, sd).await }
        })];
        if let Some(l) = bulk {
            tasks.push(tokio::spawn(odfs_rpc::tcp::serve(l, self.cred.clone(), router, self.shutdown.clone())));
        }
        Servers(tasks)
    }

    /// Registers (retrying until the register timeout; shutdown ends the wait), heartbeats with
    /// `probe`'s target space until shutdown, unregisters, and waits for the servers.
    pub async fn run(self, servers: Servers, register: Register, probe: SpaceProbe) -> Result<(), RpcError> {
        let (kind, node, addr, bulk, shard) =
            (register.kind, register.node, register.addr, register.bulk_addr, register.shard);
        let link = MgmtLink { pool: self.pool, mgmtd: self.mgmtd, register };
        let registered = crate::until_shutdown(&self.shutdown, link.register(self.register_timeout)).await;
        if let Some(first) = registered.transpose()? {
            info!(?kind, node, ?addr, ?bulk, ?shard, service_id = first.service_id, "serving");
            link.run(first, probe, self.shutdown).await;
        }
        for t in servers.0 {
            let _ = t.await;
        }
        Ok(())
    }
}

/// A probe for daemons without targets.
pub fn no_targets() -> SpaceProbe {
    Arc::new(Vec::new)
}
