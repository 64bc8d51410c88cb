//! metad configuration; `Default` is the single source of defaults.

use odfs_service::JobSection;
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::PathBuf;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct MetadConfig {
    pub job: JobSection,
    /// QUIC address to serve on.
    pub listen: SocketAddr,
    /// Also serve over authenticated TCP (the chunk path's transport, see `odfs_rpc::tcp`) on
    /// `listen`'s address and port; clients choose with their `meta_transport`.
    pub tcp: bool,
    /// Where to write the bound address once serving.
    pub addr_file: Option<PathBuf>,
    /// mgmtd's address.
    #[serde(deserialize_with = "odfs_service::config::address")]
    pub mgmtd: SocketAddr,
    /// Index of this node in the job's node list.
    pub node: u32,
    /// Metadata shard this service owns (0 holds the root).
    pub shard: u16,
    /// Directory on local disk for the write-ahead log and snapshots.
    pub data_dir: PathBuf,
    /// fdatasync every log record (survives power loss, not just a crashed process).
    pub sync_wal: bool,
    /// Write a snapshot and start a new log once the log exceeds this many bytes.
    pub snapshot_every_bytes: u64,
    /// Replies remembered for retried requests.
    pub dedup_capacity: usize,
    /// Seconds to keep trying to reach mgmtd at start.
    pub register_timeout_secs: u64,
    /// Async runtime worker threads (default 2; see docs/architecture.md for what was measured).
    pub worker_threads: usize,
    /// Only root may set layouts (`setstripe`); by default a directory's or file's owner may.
    pub root_only_layouts: bool,
    /// Owner, group and mode given to the root directory when the filesystem is new (the
    /// job's user in the Slurm mode); none keeps root 0:0 mode 0755.
    pub root_owner: Option<RootOwner>,
    /// Milliseconds a client may stay silent before its session ends: what it held open is
    /// released (orphans it held go), and a change waits at most this long for it. Clients and
    /// their kernels trust their caches for up to nine tenths of it (default 30 s: a training
    /// job's epoch or a metadata phase fits in what the kernel keeps; a frozen node delays
    /// changes to what it cached by at most this; after a restart, changes wait this long).
    pub lease_ms: u64,
}

/// The root directory's owner, group and mode.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct RootOwner {
    pub uid: u32,
    pub gid: u32,
    /// Permission bits, e.g. 0o700 (TOML: 448).
    pub mode: u32,
}

impl odfs_service::DaemonConfig for MetadConfig {
    fn worker_threads(&self) -> usize {
        self.worker_threads
    }
}

impl Default for MetadConfig {
    fn default() -> Self {
        MetadConfig {
            job: JobSection::default(),
            listen: "0.0.0.0:7701".parse().expect("valid address"),
            tcp: true,
            addr_file: None,
            mgmtd: "127.0.0.1:7700".parse().expect("valid address"),
            node: 0,
            shard: 0,
            data_dir: PathBuf::from("/var/lib/odfs/meta"),
            sync_wal: false,
            snapshot_every_bytes: 64 << 20,
            dedup_capacity: 262_144,
            register_timeout_secs: 30,
            worker_threads: odfs_service::DEFAULT_WORKER_THREADS,
            root_only_layouts: false,
            root_owner: None,
            lease_ms: 30_000,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn printed_defaults_parse_back() {
        let text = toml::to_string_pretty(&MetadConfig::default()).unwrap();
        assert_eq!(toml::from_str::<MetadConfig>(&text).unwrap(), MetadConfig::default());
        assert!(toml::from_str::<MetadConfig>("shard = \"x\"").is_err());
    }
}
