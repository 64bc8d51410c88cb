//! mgmtd: the job's registry.
//!
//! Owns: which services (metad, stored, clients) exist and where, the targets with their pools
//! and space, liveness by heartbeat, the filesystem state (forming → ready), and the default
//! layout; and, when asked to, the job's Prometheus endpoint (`metrics`). It keeps no file data or namespace and is small enough to hold in memory; a restarted
//! mgmtd is refilled by the services' re-registration.

pub mod config;
pub mod error;
pub mod metrics;
pub mod registry;
pub mod service;

pub use config::MgmtdConfig;
pub use error::MgmtdError;

use odfs_proto::mgmt::ServiceInfo;
use odfs_proto::RequestHeader;
use odfs_rpc::quic::QuicEndpoint;
use odfs_rpc::stats::gather;
use odfs_rpc::{Pool, PoolConfig, Shutdown, Transport};
use std::sync::Arc;
use tracing::{info, warn};

/// Runs mgmtd until `shutdown` fires.
pub async fn run(cfg: MgmtdConfig, shutdown: Shutdown) -> Result<(), MgmtdError> {
    cfg.validate()?;
    let cred = cfg.job.credential()?;
    let endpoint = QuicEndpoint::server(&cred, cfg.listen)?;
    let addr = endpoint.local_addr()?;
    if let Some(p) = &cfg.addr_file {
        odfs_service::write_addr_file(p, &[("mgmtd", addr)])?;
    }
    let registry = Arc::new(registry::Registry::new(&cfg));
    let router = Arc::new(service::router(registry.clone()));
    if let Some(at) = cfg.metrics_listen {
        serve_metrics(at, &cred, &endpoint, registry.clone(), router.stats(), shutdown.clone()).await;
    }
    info!(%addr, job = %cfg.job.id, "mgmtd serving");
    endpoint.serve(router, shutdown).await;
    Ok(())
}

/// Serves the job's Prometheus metrics at `at` (see `metrics`). Monitoring is optional: a port
/// that is taken (another job's mgmtd on this node) is logged and the job runs without it,
/// rather than failing a job's start over it.
async fn serve_metrics(
    at: std::net::SocketAddr,
    cred: &odfs_rpc::JobCredential,
    endpoint: &QuicEndpoint,
    registry: Arc<registry::Registry>,
    own: Arc<odfs_rpc::stats::Stats>,
    shutdown: Shutdown,
) {
    let listener = match tokio::net::TcpListener::bind(at).await {
        Ok(l) => l,
        Err(e) => {
            warn!(%at, error = %e, "cannot serve Prometheus metrics there; this job runs without them");
            return;
        }
    };
    info!(%at, "Prometheus metrics at /metrics");
    let pool = Arc::new(Pool::with_endpoint(cred.clone(), endpoint.clone(), PoolConfig::default()));
    let gather = move || {
        let (pool, registry, own) = (pool.clone(), registry.clone(), own.clone());
        async move {
            let services = registry.view().services;
            let route = |s: &ServiceInfo| s.addr.map(|a| (a, Transport::Quic));
            gather(&pool, &RequestHeader::default(), Ok(own.snapshot()), &services, route).await
        }
    };
    tokio::spawn(metrics::serve(listener, gather, shutdown));
}
