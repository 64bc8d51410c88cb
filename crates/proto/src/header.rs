//! The header every request carries.

use serde::{Deserialize, Serialize};

/// Who asks, and which request this is. `(client_id, request_id)` is unique per request and
/// stays the same when a request is retried, which is what makes mutations idempotent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct RequestHeader {
    pub request_id: u64,
    pub client_id: u64,
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups of the caller.
    pub groups: Vec<u32>,
}

impl RequestHeader {
    pub fn is_root(&self) -> bool {
        self.uid == 0
    }
    pub fn in_group(&self, gid: u32) -> bool {
        self.gid == gid || self.groups.contains(&gid)
    }
}
