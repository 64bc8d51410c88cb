//! A bounded, least-recently-used cache of open chunk files, keyed by (target, inode).
//!
//! Owns only the table of `Arc<File>`s and, with each, what its reads have looked like
//! (`drop_behind::Followed`, which lives as long as the cached descriptor and the drops it
//! decided): it never opens, unlinks or does I/O on a file (the chunk store does). An evicted
//! or invalidated file is closed when the last in-flight operation holding its `Arc` finishes,
//! so eviction never pulls a descriptor from under the kernel.
//!
//! Removal races: a miss opens the file outside the lock, so a concurrent remove could unlink the
//! path between that open and the insert, leaving a descriptor of a deleted file in the cache.
//! Every invalidation bumps a generation; a miss records the generation before opening and the
//! insert is refused when it moved. The store invalidates both before and after unlinking.

use odfs_proto::{InodeId, TargetId};
use odfs_service::drop_behind::{Due, Followed};
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::sync::{Arc, Mutex, MutexGuard};

/// Identifies one chunk file.
pub(crate) type ChunkKey = (TargetId, InodeId);

/// The cache; shared by every task of a store.
pub(crate) struct FdCache {
    capacity: usize,
    inner: Mutex<Inner>,
}

struct Inner {
    map: HashMap<ChunkKey, Entry>,
    /// Last-use tick → key, oldest first.
    order: BTreeMap<u64, ChunkKey>,
    tick: u64,
    generation: u64,
}

struct Entry {
    file: Arc<File>,
    tick: u64,
    stream: Followed,
}

/// A lookup that missed: open the file, then hand this back to [`FdCache::insert`].
pub(crate) struct Miss {
    generation: u64,
}

impl FdCache {
    /// A cache holding at most `capacity` (at least 1) open files.
    pub(crate) fn new(capacity: usize) -> FdCache {
        FdCache {
            capacity: capacity.max(1),
            inner: Mutex::new(Inner { map: HashMap::new(), order: BTreeMap::new(), tick: 0, generation: 0 }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // The table stays consistent across a panic elsewhere (no method panics half-way), so a
        // poisoned lock is still usable.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The open file of `key`, marking it most recently used, or a `Miss` to open it.
    pub(crate) fn get(&self, key: ChunkKey) -> Result<Arc<File>, Miss> {
        let mut g = self.lock();
        let inner = &mut *g;
        inner.tick += 1;
        let tick = inner.tick;
        match inner.map.get_mut(&key) {
            Some(e) => {
                inner.order.remove(&e.tick);
                e.tick = tick;
                inner.order.insert(tick, key);
                Ok(e.file.clone())
            }
            None => Err(Miss { generation: inner.generation }),
        }
    }

    /// Caches `file`, opened after `miss`, and returns the file to use: the one already cached if
    /// another task won the race, or `file` itself (uncached when an invalidation happened in
    /// between, see the module docs).
    pub(crate) fn insert(&self, key: ChunkKey, file: Arc<File>, miss: Miss) -> Arc<File> {
        let mut g = self.lock();
        let inner = &mut *g;
        if let Some(e) = inner.map.get(&key) {
            return e.file.clone();
        }
        if inner.generation != miss.generation {
            return file;
        }
        while inner.map.len() >= self.capacity {
            let Some((_, old)) = inner.order.pop_first() else {
                break;
            };
            inner.map.remove(&old);
        }
        inner.tick += 1;
        let tick = inner.tick;
        inner.order.insert(tick, key);
        inner.map.insert(key, Entry { file: file.clone(), tick, stream: Followed::default() });
        file
    }

    /// Notes a read of `len` bytes at `offset` of the cached file of `key`, about to be made:
    /// what its reader has left behind, to drop from the page cache now (`drop_behind`). `None`
    /// when there is none, or the file is not cached.
    pub(crate) fn read_behind(&self, key: ChunkKey, offset: u64, len: u64) -> Option<Due> {
        let followed = self.lock().map.get(&key)?.stream.clone();
        followed.read(offset, len)
    }

    /// Drops the cached file of `key`, if any, and refuses inserts of files opened before now.
    pub(crate) fn invalidate(&self, key: ChunkKey) {
        let mut g = self.lock();
        g.generation += 1;
        if let Some(e) = g.map.remove(&key) {
            g.order.remove(&e.tick);
        }
    }

    /// Closes the least recently used half of the cache (when the process runs out of file
    /// descriptors).
    pub(crate) fn shrink(&self) {
        let mut g = self.lock();
        let drop_n = g.map.len().div_ceil(2);
        for _ in 0..drop_n {
            let Some((_, old)) = g.order.pop_first() else {
                break;
            };
            g.map.remove(&old);
        }
    }

    /// Number of cached files.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().map.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file() -> Arc<File> {
        Arc::new(tempfile::tempfile().expect("tempfile"))
    }

    fn key(n: u64) -> ChunkKey {
        (1, InodeId(n))
    }

    fn cached(c: &FdCache, n: u64) -> bool {
        c.get(key(n)).is_ok()
    }

    #[test]
    fn evicts_least_recently_used() {
        let c = FdCache::new(3);
        for n in 0..3 {
            let m = c.get(key(n)).expect_err("miss");
            c.insert(key(n), file(), m);
        }
        // Touch 0 so that 1 is the oldest.
        assert!(cached(&c, 0));
        let m = c.get(key(3)).expect_err("miss");
        c.insert(key(3), file(), m);
        assert_eq!(c.len(), 3);
        assert!(!cached(&c, 1));
        assert!(cached(&c, 0) && cached(&c, 2) && cached(&c, 3));
    }

    #[test]
    fn racing_inserts_share_one_file() {
        let c = FdCache::new(4);
        let m1 = c.get(key(1)).expect_err("miss");
        let m2 = c.get(key(1)).expect_err("miss");
        let a = c.insert(key(1), file(), m1);
        let b = c.insert(key(1), file(), m2);
        assert!(Arc::ptr_eq(&a, &b));
    }

    #[test]
    fn insert_after_invalidation_is_not_cached() {
        let c = FdCache::new(4);
        let m = c.get(key(1)).expect_err("miss");
        c.invalidate(key(1));
        let f = file();
        let got = c.insert(key(1), f.clone(), m);
        assert!(Arc::ptr_eq(&got, &f), "the caller still gets its file");
        assert!(!cached(&c, 1));
    }

    #[test]
    fn invalidate_closes_when_last_user_finishes() {
        let c = FdCache::new(4);
        let m = c.get(key(1)).expect_err("miss");
        let f = c.insert(key(1), file(), m);
        assert_eq!(Arc::strong_count(&f), 2);
        c.invalidate(key(1));
        assert_eq!(Arc::strong_count(&f), 1, "only the in-flight user holds it");
    }

    #[test]
    fn shrink_halves() {
        let c = FdCache::new(10);
        for n in 0..10 {
            let m = c.get(key(n)).expect_err("miss");
            c.insert(key(n), file(), m);
        }
        c.shrink();
        assert_eq!(c.len(), 5);
        assert!(cached(&c, 9) && !cached(&c, 0));
    }
}
