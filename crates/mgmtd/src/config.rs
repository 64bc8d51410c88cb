//! mgmtd configuration; `Default` is the single source of defaults.

use odfs_proto::DirLayout;
use odfs_service::JobSection;
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::PathBuf;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct MgmtdConfig {
    pub job: JobSection,
    /// QUIC address to serve on (port 0 = any free port; see `addr_file`).
    pub listen: SocketAddr,
    /// Where to write the bound address once serving.
    pub addr_file: Option<PathBuf>,
    /// Storage nodes that must register before the filesystem is ready.
    pub expect_storage_nodes: u32,
    /// Metadata services that must register before the filesystem is ready.
    pub expect_meta: u32,
    /// Heartbeat interval asked of every service, in milliseconds.
    pub heartbeat_ms: u64,
    /// A service is offline after this many missed heartbeats.
    pub offline_after_missed: u32,
    /// Layout of the root directory, inherited by everything below unless changed.
    pub default_layout: DirLayout,
    /// Async runtime worker threads (default 2; see docs/architecture.md for what was measured).
    pub worker_threads: usize,
    /// Where to serve the job's Prometheus metrics (`GET /metrics`, plain HTTP); none by default.
    pub metrics_listen: Option<SocketAddr>,
}

impl Default for MgmtdConfig {
    fn default() -> Self {
        MgmtdConfig {
            job: JobSection::default(),
            listen: "0.0.0.0:7700".parse().expect("valid address"),
            addr_file: None,
            expect_storage_nodes: 1,
            expect_meta: 1,
            heartbeat_ms: 1000,
            offline_after_missed: 3,
            default_layout: DirLayout::default(),
            worker_threads: odfs_service::DEFAULT_WORKER_THREADS,
            metrics_listen: None,
        }
    }
}

impl odfs_service::DaemonConfig for MgmtdConfig {
    fn worker_threads(&self) -> usize {
        self.worker_threads
    }
}

impl MgmtdConfig {
    pub fn validate(&self) -> Result<(), crate::MgmtdError> {
        let bad = |m: &str| Err(crate::MgmtdError::Config(m.to_string()));
        self.default_layout.validate().map_err(|e| crate::MgmtdError::Config(format!("default_layout: {e}")))?;
        if self.heartbeat_ms < 10 {
            return bad("heartbeat_ms must be at least 10");
        }
        if self.offline_after_missed < 1 {
            return bad("offline_after_missed must be at least 1");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn printed_defaults_parse_back_and_validate() {
        let text = toml::to_string_pretty(&MgmtdConfig::default()).unwrap();
        let back: MgmtdConfig = toml::from_str(&text).unwrap();
        assert_eq!(back, MgmtdConfig::default());
        back.validate().unwrap();
        assert!(toml::from_str::<MgmtdConfig>("no_such_key = 1").is_err(), "unknown keys are errors");
    }
}
