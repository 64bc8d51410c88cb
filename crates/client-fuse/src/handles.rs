//! The state FUSE makes the adapter keep: open files by FUSE file handle, and the parent of
//! every directory the kernel knows (the inode number of its ".." entry).
//!
//! Data, sizes and caching belong to the client library's `FileHandle`; this table only maps
//! the kernel's numbers to those handles and remembers the open flags the adapter acts on.

use crate::passthrough::HandleBacking;
use crate::FuseError;
use odfs_client::FileHandle;
use odfs_proto::meta::Attr;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// One open file of the mount.
pub struct OpenFile {
    /// The client library's handle: reads, writes, flush, fsync, truncate, close.
    pub handle: FileHandle,
    /// Opened for writing (O_WRONLY or O_RDWR).
    pub writable: bool,
    /// Opened with O_APPEND: every write goes to the current end of the file.
    pub append: bool,
    /// Attributes at open, to answer getattr while the file is open but no longer named
    /// (unlinked): metad has forgotten the inode, the kernel still asks.
    pub attr: Attr,
    /// The chunk file the kernel reads and writes directly (FUSE passthrough).
    pub backing: Option<HandleBacking>,
    /// Lock owners that took file locks through this open file: its release drops their
    /// locks (a `flock` or OFD lock goes with its open file; a read-only open sends no FLUSH).
    pub lock_owners: Mutex<Vec<u64>>,
}

impl OpenFile {
    /// An open file as the adapter keeps it, with no lock taken through it yet.
    pub fn new(
        handle: FileHandle,
        writable: bool,
        append: bool,
        attr: Attr,
        backing: Option<HandleBacking>,
    ) -> OpenFile {
        OpenFile { handle, writable, append, attr, backing, lock_owners: Mutex::new(Vec::new()) }
    }

    /// `owner` takes a lock through this open file.
    pub fn note_lock_owner(&self, owner: u64) {
        let mut owners = self.lock_owners.lock().expect("lock owners lock");
        if !owners.contains(&owner) {
            owners.push(owner);
        }
    }

    /// Whether any lock owner took a lock through this open file.
    pub fn has_lock_owners(&self) -> bool {
        !self.lock_owners.lock().expect("lock owners lock").is_empty()
    }

    /// The lock owners that took locks through this open file.
    pub fn lock_owners(&self) -> Vec<u64> {
        self.lock_owners.lock().expect("lock owners lock").clone()
    }

    /// A writer passed through to its chunk file: the kernel writes it (through mmap too)
    /// without telling the library, so its flush, fsync and release must look at the file.
    pub fn kernel_writes(&self) -> bool {
        self.writable && self.backing.is_some()
    }

    /// Tells the library what the kernel wrote through passthrough since this handle last
    /// looked, so its flush publishes it. True when there was something.
    pub async fn note_passthrough_writes(&self) -> std::io::Result<bool> {
        let Some(b) = self.backing.as_ref().filter(|_| self.kernel_writes()) else { return Ok(false) };
        let Some((size, mtime)) = b.changed()? else { return Ok(false) };
        self.handle.note_external_write(size, mtime).await;
        Ok(true)
    }

    /// Whether this handle has writes to publish (a read-only one never has: the inode's data
    /// state is shared with this process's writers, whose own close publishes their writes).
    pub fn has_writes_to_publish(&self) -> bool {
        self.kernel_writes()
            || (self.writable && (self.handle.has_unpublished_writes() || self.handle.has_unreported_error()))
    }

    /// Publishes what this handle wrote, if anything: at its FLUSH, before its locks go.
    pub async fn publish_writes(&self) -> Result<(), FuseError> {
        if self.kernel_writes() {
            // What the kernel wrote to the chunk file is published as the library's own writes.
            return self.publish().await;
        }
        if self.has_writes_to_publish() {
            self.handle.flush().await?;
        }
        Ok(())
    }

    /// Publishes this handle's writes (close-to-open), the kernel's through passthrough included.
    pub async fn publish(&self) -> Result<(), FuseError> {
        self.note_passthrough_writes().await?;
        Ok(self.handle.flush().await?)
    }
}

/// Open files by FUSE file handle. Handle 0 is never given out (directories use it).
pub struct Handles {
    next: AtomicU64,
    files: Mutex<HashMap<u64, Arc<OpenFile>>>,
}

impl Default for Handles {
    fn default() -> Self {
        Handles { next: AtomicU64::new(1), files: Mutex::new(HashMap::new()) }
    }
}

impl Handles {
    /// Registers an open file and returns its FUSE file handle.
    pub fn insert(&self, file: OpenFile) -> u64 {
        let fh = self.next.fetch_add(1, Ordering::Relaxed);
        self.files.lock().expect("handles lock").insert(fh, Arc::new(file));
        fh
    }

    /// The open file behind `fh`, if any.
    pub fn get(&self, fh: u64) -> Option<Arc<OpenFile>> {
        self.files.lock().expect("handles lock").get(&fh).cloned()
    }

    /// Takes a handle out of the table (release).
    pub fn remove(&self, fh: u64) -> Option<Arc<OpenFile>> {
        self.files.lock().expect("handles lock").remove(&fh)
    }

    /// Any open file of inode `ino`.
    pub fn by_ino(&self, ino: u64) -> Option<Arc<OpenFile>> {
        self.files.lock().expect("handles lock").values().find(|f| f.handle.ino().0 == ino).cloned()
    }

    /// Every open file, left in the table.
    pub fn all(&self) -> Vec<Arc<OpenFile>> {
        self.files.lock().expect("handles lock").values().cloned().collect()
    }

    /// Every open file, taken out of the table.
    pub fn take_all(&self) -> Vec<Arc<OpenFile>> {
        self.files.lock().expect("handles lock").drain().map(|(_, f)| f).collect()
    }
}

/// The parent of each directory the kernel has looked up, for the ".." entry of readdir.
/// Learned from lookup, mkdir and readdirplus; dropped when the kernel forgets the inode (it
/// must look the directory up again before opening it). After a directory moves, ".." shows
/// the old parent until the kernel looks the directory up again.
#[derive(Default)]
pub struct Parents {
    map: Mutex<HashMap<u64, u64>>,
}

impl Parents {
    /// `dir` was seen in `parent`.
    pub fn record(&self, dir: u64, parent: u64) {
        self.map.lock().expect("parents lock").insert(dir, parent);
    }

    /// The kernel dropped `dir`.
    pub fn forget(&self, dir: u64) {
        self.map.lock().expect("parents lock").remove(&dir);
    }

    /// The parent of `dir`: the root is its own parent; an unknown directory answers itself.
    pub fn parent_of(&self, dir: u64) -> u64 {
        self.map.lock().expect("parents lock").get(&dir).copied().unwrap_or(dir)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parents_default_to_the_directory_itself() {
        let p = Parents::default();
        assert_eq!(p.parent_of(1), 1);
        p.record(7, 1);
        p.record(9, 7);
        assert_eq!((p.parent_of(7), p.parent_of(9)), (1, 7));
        p.forget(9);
        assert_eq!(p.parent_of(9), 9);
    }
}
