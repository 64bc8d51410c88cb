//! Client configuration: the file `odfs local up` / `odfs start` writes (e.g. `DIR/odfs.toml`)
//! and every client command reads (`--fs FILE` or `ODFS_FS`). `Default` holds every default.

use odfs_rpc::Transport;
use odfs_service::JobSection;
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::Path;

/// Largest file filled at open whatever `fill_at_open_bytes` says: a fill holds the whole file
/// in memory until the kernel has it.
pub const FILL_MAX: u64 = 16 << 20;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ClientConfig {
    pub job: JobSection,
    /// mgmtd's QUIC address.
    #[serde(deserialize_with = "odfs_service::config::address")]
    pub mgmtd: SocketAddr,
    /// Transport for chunk data: "tcp" (authenticated, unencrypted, fastest) or "quic" (TLS).
    pub bulk_transport: Transport,
    /// Transport for metadata requests: "tcp" (authenticated, unencrypted; measured cheaper
    /// per request than QUIC, see BENCHMARKS.md) or "quic" (TLS; also where metad serves no TCP).
    pub meta_transport: Transport,
    /// Bytes of written data that may be in flight to stored per client before writers wait.
    pub write_behind_bytes: u64,
    /// 0 turns caching of attributes and names off (every request asks metad); any other
    /// value caches them for as long as this client's leases last (metad recalls them before
    /// any change; see docs/architecture.md, "client"). Default 1000.
    pub attr_cache_ms: u64,
    /// A caching client answers creates itself in a directory no other client uses (and
    /// unlinks of the files it made there), and sends them to metad in batches (a create
    /// delegation, docs/architecture.md "Create delegations"); false sends every create and
    /// unlink to metad. Default true.
    pub create_delegations: bool,
    /// Chunks read ahead of a sequential reader whose reads are copied (spliced reads, see
    /// `splice_reads`, ride the kernel's read-ahead instead).
    pub readahead_chunks: u32,
    /// Chunks on this node's own targets are read straight from their chunk files, with no
    /// request to stored (docs/decisions/0016-short-circuit-local-reads.md); a
    /// target whose directory this client cannot see or read is read through stored. Default
    /// true.
    pub local_reads: bool,
    /// A chunk file of this node's that one reader reads from start to end (a shard, a
    /// checkpoint) has the pages it left behind dropped from the page cache, since the mount's
    /// page cache holds what was read; a file read again, by a second reader or at random
    /// keeps them (docs/architecture.md, "Stored drops what a single sequential reader has
    /// read"; stored does the same for the reads it serves). Default true.
    pub drop_behind_reads: bool,
    /// Through the mount, a read of 128 KiB to 1 MiB is answered by splicing its bytes into
    /// `/dev/fuse`: a remote chunk's from the socket, a local one's from its chunk file, with
    /// no copy of odfs-fuse's (docs/decisions/0017-spliced-reads.md). Needs `bulk_transport`
    /// "tcp" and pipes of 2 MiB (root with `CAP_SYS_RESOURCE`, or `fs.pipe-max-size` at least
    /// 2097152); where either is missing the mount says why once and copies. Default true.
    pub splice_reads: bool,
    /// The mount takes its requests from the kernel by io_uring where the kernel offers it
    /// (Linux 6.14+ with the `fuse` module's `enable_uring` set by root; docs/architecture.md,
    /// "The FUSE transport"), else by reading `/dev/fuse`. Spliced reads need `/dev/fuse`: with
    /// io_uring, replies are written into the ring. Default true (the kernel's switch decides).
    pub fuse_io_uring: bool,
    /// Through the mount, a file whose bytes all sit in one chunk file on this node's own target
    /// (local placement, stripe count 1) is read, written and mapped by the kernel straight from
    /// that chunk file (FUSE passthrough, Linux 6.9+, odfs-fuse as root; docs/architecture.md,
    /// "FUSE mount"). False sends such files through odfs-fuse like any other, as on a kernel
    /// without passthrough. Default true.
    pub fuse_passthrough: bool,
    /// Through the mount, a read-only open of a file of at most this many bytes fetches the
    /// whole file and hands it to the kernel's page cache before it is answered, so its reads
    /// need no request (docs/decisions/0019-small-files-filled-at-open.md). 0: never;
    /// values above 16 MiB count as 16 MiB (a fill holds the whole file in memory). Default
    /// 1 MiB.
    pub fill_at_open_bytes: u64,
    /// Bytes of small files this client may hold read ahead of their opens: when an open
    /// through the mount finds a small file (see `fill_at_open_bytes`) neither in the page
    /// cache nor read ahead, the other small files of its directory that this client knows
    /// are read from stored in batches and held here until opened, for at most a minute
    /// (docs/decisions/0020-batched-prefetch-by-directory.md). 0: never.
    /// Default (unset): one eighth of the node's memory, at most 8 GiB (the bytes are held only
    /// until their opens hand them to the page cache, which would hold them anyway).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefetch_bytes: Option<u64>,
    /// Through the mount, `flock`, `fcntl` and OFD locks hold across every node of the job
    /// (metad keeps them; docs/architecture.md, "Locks across nodes"); false leaves them to
    /// each node's kernel, so a lock taken on one node is not seen on another. Default true.
    pub global_locks: bool,
    /// Connections per stored for chunk data.
    pub bulk_connections: usize,
    /// Seconds to wait for one reply.
    pub call_timeout_secs: u64,
    /// Seconds to retry a request whose service is unreachable before failing it.
    pub retry_secs: u64,
    /// Index of the node this client runs on (shown by `odfs status`).
    pub node: u32,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            job: JobSection::default(),
            mgmtd: "127.0.0.1:7700".parse().expect("valid address"),
            bulk_transport: Transport::Tcp,
            meta_transport: Transport::Tcp,
            write_behind_bytes: 64 << 20,
            attr_cache_ms: 1000,
            create_delegations: true,
            readahead_chunks: 4,
            local_reads: true,
            drop_behind_reads: true,
            splice_reads: true,
            fuse_io_uring: true,
            fuse_passthrough: true,
            fill_at_open_bytes: 1 << 20,
            prefetch_bytes: None,
            global_locks: true,
            bulk_connections: 2,
            call_timeout_secs: 60,
            retry_secs: 30,
            node: 0,
        }
    }
}

impl ClientConfig {
    /// The size up to which a file is filled at open (and read ahead): `fill_at_open_bytes`,
    /// capped at `FILL_MAX`.
    pub fn fill_limit(&self) -> u64 {
        self.fill_at_open_bytes.min(FILL_MAX)
    }

    /// The prefetch buffer's bound: `prefetch_bytes`, or one eighth of the node's memory
    /// (`/proc/meminfo`), at most 8 GiB; 1 GiB where the memory cannot be read.
    pub fn prefetch_limit(&self) -> u64 {
        self.prefetch_bytes.unwrap_or_else(|| {
            let total = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
                let line = m.lines().find(|l| l.starts_with("MemTotal:"))?.to_owned();
                line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kib| kib << 10)
            });
            total.map_or(1 << 30, |t| (t / 8).min(8 << 30))
        })
    }

    pub fn load(path: &Path) -> Result<ClientConfig, crate::ClientError> {
        odfs_service::load_config(Some(path)).map_err(|e| crate::ClientError::Config(e.to_string()))
    }

    /// The same for a one-shot client (a command, a job's stage): it caches nothing and so
    /// takes no leases — a lease outlives its holder by up to the lease time, and no change
    /// should wait for a client that has exited.
    pub fn one_shot(self) -> ClientConfig {
        ClientConfig { attr_cache_ms: 0, ..self }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn printed_defaults_parse_back() {
        let text = toml::to_string_pretty(&ClientConfig::default()).unwrap();
        assert_eq!(toml::from_str::<ClientConfig>(&text).unwrap(), ClientConfig::default());
        assert!(toml::from_str::<ClientConfig>("bulk_transport = \"carrier-pigeon\"").is_err());
    }

    #[test]
    fn the_prefetch_bound_is_the_setting_or_an_eighth_of_memory_up_to_8_gib() {
        let off: ClientConfig = toml::from_str("prefetch_bytes = 0").unwrap();
        assert_eq!(off.prefetch_limit(), 0);
        let set: ClientConfig = toml::from_str("prefetch_bytes = 12345").unwrap();
        assert_eq!(set.prefetch_limit(), 12345);
        let auto = ClientConfig::default().prefetch_limit();
        assert!(auto > 0 && auto <= 8 << 30, "{auto}");
        let mem = std::fs::read_to_string("/proc/meminfo").unwrap();
        let kib: u64 = mem
            .lines()
            .find(|l| l.starts_with("MemTotal:"))
            .unwrap()
            .split_whitespace()
            .nth(1)
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(auto, ((kib << 10) / 8).min(8 << 30));
    }
}
