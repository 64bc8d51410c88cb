//! mgmtd: the job's registry.
//!
//! Owns: which services (metad, stored, clients) exist and where, the targets with their pools
//! and space, liveness by heartbeat, the filesystem state (forming → ready), and the default
//! layout. It keeps no file data or namespace and is small enough to hold in memory; a restarted
//! mgmtd is refilled by the services' re-registration.

pub mod config;
pub mod error;
pub mod registry;
pub mod service;

pub use config::MgmtdConfig;
pub use error::MgmtdError;

use odfs_rpc::quic::QuicEndpoint;
use odfs_rpc::Shutdown;
use std::sync::Arc;
use tracing::info;

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
    let router = Arc::new(service::router(registry));
    info!(%addr, job = %cfg.job.id, "mgmtd serving");
    endpoint.serve(router, shutdown).await;
    Ok(())
}
