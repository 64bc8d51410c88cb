//! stored configuration; `Default` is the single source of defaults.

use odfs_service::JobSection;
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::PathBuf;

/// One storage target: a directory on local disk.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TargetSection {
    /// Target id, unique within the filesystem.
    pub id: u32,
    /// Directory holding the target's chunk files.
    pub path: PathBuf,
    /// Pool the target belongs to.
    #[serde(default = "default_pool")]
    pub pool: String,
}

fn default_pool() -> String {
    odfs_proto::layout::DEFAULT_POOL.to_string()
}

/// Empty chunk files each target keeps ready by default (`precreate_chunk_files`).
pub const DEFAULT_PRECREATE_CHUNK_FILES: usize = 32_768;

/// Smallest chunk write sent past the page cache by default (`direct_write_min_bytes`, and the
/// chunk store's `StoreOptions::direct_write_min`).
pub const DEFAULT_DIRECT_WRITE_MIN_BYTES: usize = 1 << 20;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct StoredConfig {
    pub job: JobSection,
    /// QUIC address to serve on.
    pub listen: SocketAddr,
    /// TCP address for authenticated bulk data; none disables it.
    pub bulk_listen: Option<SocketAddr>,
    /// Where to write the bound addresses once serving.
    pub addr_file: Option<PathBuf>,
    /// mgmtd's address.
    #[serde(deserialize_with = "odfs_service::config::address")]
    pub mgmtd: SocketAddr,
    /// Index of this node in the job's node list.
    pub node: u32,
    /// Targets served by this daemon.
    pub targets: Vec<TargetSection>,
    /// I/O engine: "auto" (io_uring, else plain syscalls with a warning), "uring" or "syscall".
    pub io_backend: String,
    /// Seconds to keep trying to reach mgmtd at start.
    pub register_timeout_secs: u64,
    /// Async runtime worker threads (default 2; see docs/architecture.md for what was measured).
    pub worker_threads: usize,
    /// Empty chunk files each target keeps ready for new files, made while the node's CPU and disks are idle (default
    /// 32768; 0 turns precreation off). See docs/architecture.md "Data path".
    pub precreate_chunk_files: usize,
    /// Chunk writes of at least this many bytes, at 4 KiB-aligned offsets and lengths, go to the
    /// disk with `O_DIRECT`, past this node's page cache (default 1048576; 0 writes everything
    /// through the page cache). See docs/architecture.md "Large chunk writes skip stored's page
    /// cache".
    pub direct_write_min_bytes: usize,
    /// Drop from this node's page cache what a single sequential reader has read of a chunk
    /// file, once sent: the reader's own node caches it (default true; false leaves every page
    /// to the kernel). See docs/architecture.md "Stored drops what a single sequential reader
    /// has read".
    pub drop_behind_reads: bool,
}

impl odfs_service::DaemonConfig for StoredConfig {
    fn worker_threads(&self) -> usize {
        self.worker_threads
    }
}

impl Default for StoredConfig {
    fn default() -> Self {
        StoredConfig {
            job: JobSection::default(),
            listen: "0.0.0.0:7702".parse().expect("valid address"),
            bulk_listen: Some("0.0.0.0:7703".parse().expect("valid address")),
            addr_file: None,
            mgmtd: "127.0.0.1:7700".parse().expect("valid address"),
            node: 0,
            targets: vec![TargetSection { id: 1, path: PathBuf::from("/var/lib/odfs/target1"), pool: default_pool() }],
            io_backend: "auto".into(),
            register_timeout_secs: 30,
            worker_threads: odfs_service::DEFAULT_WORKER_THREADS,
            precreate_chunk_files: DEFAULT_PRECREATE_CHUNK_FILES,
            direct_write_min_bytes: DEFAULT_DIRECT_WRITE_MIN_BYTES,
            drop_behind_reads: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn printed_defaults_parse_back() {
        let text = toml::to_string_pretty(&StoredConfig::default()).unwrap();
        assert_eq!(toml::from_str::<StoredConfig>(&text).unwrap(), StoredConfig::default());
        assert!(toml::from_str::<StoredConfig>("[[targets]]\npath = \"/x\"").is_err(), "a target needs an id");
    }
}
