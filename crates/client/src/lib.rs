//! The odfs client library: the filesystem as seen by one process (the FUSE adapter, the CLI,
//! stage agents, benchmarks).
//!
//! Owns: finding services through mgmtd, namespace calls to metad, striping arithmetic applied to
//! parallel chunk I/O on stored (a node's own chunks read from their files, reads spliced into a
//! pipe for a FUSE daemon), read-ahead for sequential reads, write-behind with bounded memory,
//! per-inode state so that handles in one process see each other's writes, and close-to-open
//! consistency across processes. It never touches a mount; FUSE-specific behaviour lives in
//! client-fuse.

mod attr_cache;
pub mod cluster;
pub mod config;
mod delegation;
pub mod error;
pub mod file;
pub mod fs;
mod local_read;
pub mod locks;
pub mod path;
mod prefetch;
mod removing;
mod seal;
mod splice_read;
pub mod vxattr;

pub use attr_cache::Ticket;
pub use config::ClientConfig;
pub use error::ClientError;
pub use file::{FileHandle, ReadBuf};
pub use fs::{Client, Ctx, OpStats, RecallHook, Truncate};
/// Lets a thread with a runtime of its own call over connections of its own (odfs-fuse's reader threads).
pub use odfs_rpc::own_lane;
/// The pipe a spliced read fills (`FileHandle::read_into_pipe`).
pub use odfs_rpc::splice::Pipe;
pub use prefetch::{PrefetchCounts, PrefetchSkip};

pub type Result<T, E = ClientError> = std::result::Result<T, E>;
