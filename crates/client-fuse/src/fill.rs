//! Small files handed to the kernel's page cache at open (design: docs/architecture.md,
//! "Small files filled at open").
//!
//! Owns the hint of which inodes' pages odfs-fuse gave the kernel, and the fill itself: the
//! whole file — from what a prefetch read ahead (`Client::prefetched`), else through the open
//! handle — stored with `Notifier::store`, checked against recalls that crossed it. The hint
//! is only a hint: the kernel may evict pages without saying so, and then READs them as
//! usual; all a wrong hint costs is that READ.

use fuser::INodeNo;
use odfs_client::{Client, FileHandle, Ticket};
use odfs_fuse_kernel::reply::Notifier;
use odfs_proto::meta::Attr;
use odfs_proto::InodeId;
use std::collections::HashSet;
use std::sync::Mutex;
use tracing::debug;

/// Inodes whose whole content this mount stored in the kernel's page cache under a lease
/// still held.
#[derive(Default)]
pub struct Filled {
    inos: Mutex<HashSet<u64>>,
}

impl Filled {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashSet<u64>> {
        self.inos.lock().expect("filled lock")
    }

    /// Whether an open of a `size`-byte file should fill the kernel's cache first: small
    /// enough, not empty, and not filled already.
    pub fn wanted(&self, client: &Client, ino: u64, size: u64) -> bool {
        size > 0 && size <= client.config().fill_limit() && !self.lock().contains(&ino)
    }

    /// The kernel's pages of `ino` are gone or stale (recalled, forgotten, dropped).
    pub fn forget(&self, ino: u64) {
        self.lock().remove(&ino);
    }

    /// Whether the kernel holds `ino`'s pages as far as this mount knows.
    pub fn has(&self, ino: u64) -> bool {
        self.lock().contains(&ino)
    }

    /// Fetches the whole file behind `handle` (`attr` describes it) and stores it in the
    /// kernel's page cache: from what a prefetch holds, else from stored. True when the
    /// kernel may keep it (`FOPEN_KEEP_CACHE`): no recall crossed the fetch since `ticket`.
    /// Otherwise the stored pages are dropped again, and a failed fetch stores nothing (the
    /// kernel's READ meets the error instead).
    pub async fn fill(
        &self,
        client: &Client,
        notifier: &Notifier,
        handle: &FileHandle,
        attr: &Attr,
        ticket: Ticket,
    ) -> bool {
        let ino = handle.ino();
        let size = handle.size().await;
        if size == 0 || size > client.config().fill_limit() {
            return false;
        }
        if size == attr.size {
            if let Some(data) = client.prefetched(attr).await {
                return self.store(client, notifier, ino, &data, ticket);
            }
        }
        let data = match handle.read(0, size as u32).await {
            Ok(d) => d,
            Err(e) => {
                debug!(%ino, error = %e, "fill at open: read failed");
                return false;
            }
        };
        self.store(client, notifier, ino, &data, ticket)
    }

    /// Hands a file's whole bytes to the kernel's page cache, and records it; false (and
    /// nothing kept) when a recall crossed their fetch since `ticket`.
    pub fn store(&self, client: &Client, notifier: &Notifier, ino: InodeId, data: &[u8], ticket: Ticket) -> bool {
        if let Err(e) = notifier.store(INodeNo(ino.0), 0, data) {
            debug!(%ino, error = %e, "fill at open: store not delivered");
            return false;
        }
        if client.kernel_ttl(ino, ticket).is_zero() {
            // A recall crossed the fetch: the bytes may predate the change.
            if let Err(e) = notifier.inval_inode(INodeNo(ino.0), 0, 0) {
                debug!(%ino, error = %e, "fill at open: invalidation not delivered");
            }
            return false;
        }
        self.lock().insert(ino.0);
        true
    }
}
