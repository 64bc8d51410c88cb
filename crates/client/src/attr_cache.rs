//! Short-lived cache of attributes and names, so repeated `stat`s and path walks do not each
//! cost a metad round trip.
//!
//! Entries live for `attr_cache_ms` (default 1 s) and are dropped or refreshed by every
//! mutation this client makes. `open` always asks metad (close-to-open). A cached name is only
//! served to the uid/gid that looked it up, so a lookup never skips another caller's
//! permission check.

use odfs_proto::meta::Attr;
use odfs_proto::InodeId;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Above this many entries the cache is emptied rather than grown.
const MAX_ENTRIES: usize = 1 << 20;

/// A cached name: the inode it names, who looked it up (uid, gid), and when.
type NameEntry = (InodeId, (u32, u32), Instant);

#[derive(Default)]
struct Maps {
    attrs: HashMap<InodeId, (Attr, Instant)>,
    names: HashMap<(InodeId, Vec<u8>), NameEntry>,
}

pub(crate) struct AttrCache {
    ttl: Duration,
    maps: Mutex<Maps>,
}

impl AttrCache {
    pub fn new(ttl: Duration) -> AttrCache {
        AttrCache { ttl, maps: Mutex::new(Maps::default()) }
    }

    fn on(&self) -> bool {
        !self.ttl.is_zero()
    }

    pub fn attr(&self, ino: InodeId) -> Option<Attr> {
        if !self.on() {
            return None;
        }
        let m = self.maps.lock().expect("cache lock");
        m.attrs.get(&ino).filter(|(_, t)| t.elapsed() < self.ttl).map(|(a, _)| a.clone())
    }

    pub fn lookup(&self, parent: InodeId, name: &[u8], who: (u32, u32)) -> Option<Attr> {
        if !self.on() {
            return None;
        }
        let m = self.maps.lock().expect("cache lock");
        let (ino, owner, t) = m.names.get(&(parent, name.to_vec()))?;
        if *owner != who || t.elapsed() >= self.ttl {
            return None;
        }
        m.attrs.get(ino).filter(|(_, t)| t.elapsed() < self.ttl).map(|(a, _)| a.clone())
    }

    pub fn put_attr(&self, attr: &Attr) {
        if !self.on() {
            return;
        }
        let mut m = self.maps.lock().expect("cache lock");
        if m.attrs.len() >= MAX_ENTRIES {
            m.attrs.clear();
        }
        m.attrs.insert(attr.ino, (attr.clone(), Instant::now()));
    }

    pub fn put_entry(&self, parent: InodeId, name: &[u8], attr: &Attr, who: (u32, u32)) {
        if !self.on() {
            return;
        }
        let mut m = self.maps.lock().expect("cache lock");
        if m.names.len() >= MAX_ENTRIES || m.attrs.len() >= MAX_ENTRIES {
            m.names.clear();
            m.attrs.clear();
        }
        let now = Instant::now();
        m.names.insert((parent, name.to_vec()), (attr.ino, who, now));
        m.attrs.insert(attr.ino, (attr.clone(), now));
    }

    /// Forgets a name and the attributes of the inode it named.
    pub fn forget_entry(&self, parent: InodeId, name: &[u8]) {
        let mut m = self.maps.lock().expect("cache lock");
        if let Some((ino, _, _)) = m.names.remove(&(parent, name.to_vec())) {
            m.attrs.remove(&ino);
        }
    }

    pub fn forget(&self, ino: InodeId) {
        self.maps.lock().expect("cache lock").attrs.remove(&ino);
    }
}
