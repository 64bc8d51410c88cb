//! Identifiers that appear on the wire.

use serde::{Deserialize, Serialize};
use std::fmt;

/// A 64-bit inode id. The top 16 bits name the metadata shard that owns the inode, so one
/// metad and many metads use the same ids and messages; the low 48 bits are a per-shard counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct InodeId(pub u64);

impl InodeId {
    /// The root directory, owned by shard 0.
    pub const ROOT: InodeId = InodeId(1);
    const SHARD_SHIFT: u32 = 48;

    pub fn new(shard: u16, local: u64) -> Self {
        debug_assert!(local < (1 << Self::SHARD_SHIFT));
        InodeId(((shard as u64) << Self::SHARD_SHIFT) | local)
    }
    pub fn shard(self) -> u16 {
        (self.0 >> Self::SHARD_SHIFT) as u16
    }
    pub fn local(self) -> u64 {
        self.0 & ((1 << Self::SHARD_SHIFT) - 1)
    }
}

impl fmt::Display for InodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

/// A storage target (one directory on one node's local disk), unique within a filesystem.
pub type TargetId = u32;
/// Index of a node in the job's node list (node 0 runs mgmtd).
pub type NodeIndex = u32;
/// Id that mgmtd hands a registered service or client.
pub type ServiceId = u64;
