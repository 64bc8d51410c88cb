//! Agent configuration; `Default` is the single source of defaults.

use odfs_service::JobSection;
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct AgentConfig {
    pub job: JobSection,
    /// QUIC address to serve on (the coordinator hands work here).
    pub listen: SocketAddr,
    /// mgmtd's address.
    pub mgmtd: SocketAddr,
    /// Index of this node in the job's node list.
    pub node: u32,
    /// Transfers in flight at once when the coordinator does not say.
    pub concurrency: u32,
    /// Seconds to keep trying to reach mgmtd at start.
    pub register_timeout_secs: u64,
    /// Finished runs kept for polling.
    pub keep_runs: usize,
}

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            job: JobSection::default(),
            listen: "0.0.0.0:7704".parse().expect("valid address"),
            mgmtd: "127.0.0.1:7700".parse().expect("valid address"),
            node: 0,
            concurrency: 16,
            register_timeout_secs: 30,
            keep_runs: 16,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn printed_defaults_parse_back() {
        let text = toml::to_string_pretty(&AgentConfig::default()).unwrap();
        assert_eq!(toml::from_str::<AgentConfig>(&text).unwrap(), AgentConfig::default());
        assert!(toml::from_str::<AgentConfig>("concurrency = \"x\"").is_err());
        assert!(toml::from_str::<AgentConfig>("unknown = 1").is_err());
    }
}
