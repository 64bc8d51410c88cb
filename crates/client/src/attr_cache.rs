//! What this client caches of metad's answers — attributes, names and the absence of names,
//! extended attributes — and for how long it may trust them: for as long as its leases last
//! (see docs/architecture.md, "client").
//!
//! Entries do not age: metad recalls them before any change is acknowledged, and the client
//! trusts a shard's entries only until its session with that shard could have lapsed (the
//! send time of the last poll the shard answered, plus nine tenths of the lease). A reply that
//! was on its way while a recall was applied, or while this client itself changed what it
//! describes, is not cached (`Ticket`): metad recalls nothing from the client that made a
//! change, so the client keeps its own caches right. A cached name is only
//! served to the uid/gid that looked it up, so a lookup never skips another caller's
//! permission check.

use odfs_proto::meta::{Attr, FileKind, Recall};
use odfs_proto::{InodeId, Timespec};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Above this many entries the cache is emptied rather than grown (metad's recalls reach the
/// kernel's caches whatever this cache holds).
const MAX_ENTRIES: usize = 1 << 20;

/// A cached name: the inode it names (`None`: it does not exist), who looked it up (uid,
/// gid), and the shard whose lease covers it.
#[derive(Clone, Copy)]
struct NameEntry {
    ino: Option<InodeId>,
    who: (u32, u32),
    shard: u16,
}

/// What this client's own changes touch: a name, or an inode.
#[derive(Clone, PartialEq, Eq, Hash)]
enum Key {
    Name(InodeId, Vec<u8>),
    Ino(InodeId),
}

/// Taken before a request is sent; says whether its reply may still be cached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ticket {
    epoch: u64,
    stamp: u64,
}

/// A cached extended attribute (`value: None`: absent), read under attributes of change time
/// `ctime` by `who`. Every change of an extended attribute moves the inode's ctime and recalls
/// its attributes, so the value holds while attributes of that ctime are cached.
struct XattrEntry {
    ctime: Timespec,
    who: (u32, u32),
    value: Option<Vec<u8>>,
}

#[derive(Default)]
struct Maps {
    attrs: HashMap<InodeId, Attr>,
    xattrs: HashMap<InodeId, HashMap<Vec<u8>, XattrEntry>>,
    names: BTreeMap<(InodeId, Vec<u8>), NameEntry>,
    /// Counts recalls applied and sessions renewed: a reply to a request sent before the
    /// latest one may be older than what the recall dropped.
    epoch: u64,
    /// Counts this client's own changes; `changed` has the count at each key's latest.
    stamp: u64,
    changed: HashMap<Key, u64>,
    /// Directories whose every name is cached (this client made them and its name lease has
    /// held since): a name not cached there does not exist.
    complete: std::collections::HashSet<InodeId>,
    /// The directory each regular file was last cached under (where a prefetch for it looks).
    parents: HashMap<InodeId, InodeId>,
}

impl Maps {
    /// Whether a reply to a request sent with `t` may be older than what is known of `key`.
    fn stale(&self, t: Ticket, key: &Key) -> bool {
        t.epoch != self.epoch || self.changed.get(key).is_some_and(|&s| s > t.stamp)
    }

    fn mark(&mut self, key: Key) {
        if self.changed.len() >= MAX_ENTRIES {
            // Forgetting what changed when: no reply in flight may be cached.
            self.changed.clear();
            self.epoch += 1;
        }
        self.stamp += 1;
        let stamp = self.stamp;
        self.changed.insert(key, stamp);
    }
}

/// The cached answer to a lookup.
pub enum Cached {
    /// The name names this inode.
    Found(Attr),
    /// The name does not exist.
    Absent,
}

pub(crate) struct AttrCache {
    on: bool,
    maps: Mutex<Maps>,
    /// Per metadata shard: until when its leases are trusted, in nanoseconds after `base`.
    trusted: Vec<AtomicU64>,
    base: Instant,
}

impl AttrCache {
    /// A cache for a filesystem of `shards` metadata shards; `on: false` caches nothing.
    pub fn new(on: bool, shards: u16) -> AttrCache {
        AttrCache {
            on,
            maps: Mutex::new(Maps::default()),
            trusted: (0..shards.max(1)).map(|_| AtomicU64::new(0)).collect(),
            base: Instant::now(),
        }
    }

    /// Taken before a request is sent, given back with what its reply should cache.
    pub fn ticket(&self) -> Ticket {
        let m = self.maps.lock().expect("cache lock");
        Ticket { epoch: m.epoch, stamp: m.stamp }
    }

    /// For the result of this client's own change, sent with `before`: recalls since still
    /// count, the client's own changes (this one included) do not.
    pub fn after(&self, before: Ticket) -> Ticket {
        Ticket { epoch: before.epoch, stamp: self.maps.lock().expect("cache lock").stamp }
    }

    /// How long what shard `shard` answered may still be trusted.
    pub fn trust_left(&self, shard: u16) -> Duration {
        let Some(t) = self.trusted.get(shard as usize) else { return Duration::ZERO };
        let until = Duration::from_nanos(t.load(Ordering::Acquire));
        until.saturating_sub(self.base.elapsed())
    }

    /// How long the kernel may keep what a reply told about inode `ino`: zero when a recall
    /// or a change of this client crossed the reply, or caching is off.
    pub fn ttl(&self, ino: InodeId, ticket: Ticket) -> Duration {
        if !self.on || self.maps.lock().expect("cache lock").stale(ticket, &Key::Ino(ino)) {
            return Duration::ZERO;
        }
        self.trust_left(ino.shard())
    }

    /// The same for name `name` of `parent`, whose lease is shard `shard`'s.
    pub fn entry_ttl(&self, parent: InodeId, name: &[u8], shard: u16, ticket: Ticket) -> Duration {
        let key = Key::Name(parent, name.to_vec());
        if !self.on || self.maps.lock().expect("cache lock").stale(ticket, &key) {
            return Duration::ZERO;
        }
        self.trust_left(shard)
    }

    fn trusted(&self, shard: u16) -> bool {
        self.on && !self.trust_left(shard).is_zero()
    }

    /// The shard answered a poll sent at `sent`: its leases hold until `sent + trust`.
    pub fn renew(&self, shard: u16, sent: Instant, trust: Duration) {
        if let Some(t) = self.trusted.get(shard as usize) {
            let until = (sent + trust).saturating_duration_since(self.base).as_nanos() as u64;
            t.store(until, Ordering::Release);
        }
    }

    /// Mode and group of a cached inode, without copying its attributes.
    pub fn mode(&self, ino: InodeId) -> Option<(u32, u32)> {
        if !self.trusted(ino.shard()) {
            return None;
        }
        self.maps.lock().expect("cache lock").attrs.get(&ino).map(|a| (a.mode, a.gid))
    }

    pub fn attr(&self, ino: InodeId) -> Option<Attr> {
        if !self.trusted(ino.shard()) {
            return None;
        }
        self.maps.lock().expect("cache lock").attrs.get(&ino).cloned()
    }

    pub fn lookup(&self, parent: InodeId, name: &[u8], who: (u32, u32)) -> Option<Cached> {
        if !self.on {
            return None;
        }
        let m = self.maps.lock().expect("cache lock");
        let Some(&e) = m.names.get(&(parent, name.to_vec())) else {
            // Not for a name this client changes or changed: its change may be in flight (a
            // mkdir that another of its tasks found existing, say).
            let known_absent = m.complete.contains(&parent)
                && !m.changed.contains_key(&Key::Name(parent, name.to_vec()))
                && self.trusted(parent.shard());
            return known_absent.then_some(Cached::Absent);
        };
        if e.who != who || !self.trusted(e.shard) {
            return None;
        }
        match e.ino {
            None => Some(Cached::Absent),
            Some(ino) if self.trusted(ino.shard()) => m.attrs.get(&ino).cloned().map(Cached::Found),
            Some(_) => None,
        }
    }

    /// A cached extended attribute of `ino` (`Some(None)`: it is absent), if the attributes it
    /// was read under are still cached and it was read by `who`.
    pub fn xattr(&self, ino: InodeId, name: &[u8], who: (u32, u32)) -> Option<Option<Vec<u8>>> {
        if !self.trusted(ino.shard()) {
            return None;
        }
        let m = self.maps.lock().expect("cache lock");
        let ctime = m.attrs.get(&ino)?.ctime;
        let e = m.xattrs.get(&ino)?.get(name)?;
        (e.ctime == ctime && e.who == who).then(|| e.value.clone())
    }

    /// The directory regular file `ino` was last cached under.
    pub fn parent(&self, ino: InodeId) -> Option<InodeId> {
        self.maps.lock().expect("cache lock").parents.get(&ino).copied()
    }

    /// Attributes of the regular files of `dir` whose names and attributes are cached under
    /// leases still held, in name order, at most `max`. Whoever looked them up: what is read
    /// with this list is handed only to opens that pass their own permission checks.
    pub fn dir_files(&self, dir: InodeId, max: usize) -> Vec<Attr> {
        if !self.on {
            return Vec::new();
        }
        let m = self.maps.lock().expect("cache lock");
        m.names
            .range((dir, Vec::new())..)
            .take_while(|((d, _), _)| *d == dir)
            .filter(|(_, e)| self.trusted(e.shard))
            .filter_map(|(_, e)| e.ino.filter(|i| self.trusted(i.shard())).and_then(|i| m.attrs.get(&i)))
            .filter(|a| a.kind == FileKind::File)
            .take(max)
            .cloned()
            .collect()
    }

    /// Caches an extended attribute (`None`: absent) from a reply to a request sent with
    /// `ticket`, under the attributes cached for `ino` (none cached: nothing is).
    pub fn put_xattr(&self, ino: InodeId, name: &[u8], value: Option<&[u8]>, who: (u32, u32), ticket: Ticket) {
        if !self.on {
            return;
        }
        let mut m = self.maps.lock().expect("cache lock");
        if m.stale(ticket, &Key::Ino(ino)) {
            return;
        }
        let Some(ctime) = m.attrs.get(&ino).map(|a| a.ctime) else { return };
        if m.xattrs.len() >= MAX_ENTRIES {
            m.xattrs.clear();
        }
        let e = XattrEntry { ctime, who, value: value.map(<[u8]>::to_vec) };
        m.xattrs.entry(ino).or_default().insert(name.to_vec(), e);
    }

    /// Caches attributes from a reply to a request sent with `ticket`.
    pub fn put_attr(&self, attr: &Attr, ticket: Ticket) {
        self.put(attr, ticket, false);
    }

    fn put(&self, attr: &Attr, ticket: Ticket, newer_only: bool) {
        if !self.on {
            return;
        }
        let mut m = self.maps.lock().expect("cache lock");
        if newer_only && m.attrs.get(&attr.ino).is_some_and(|a| a.ctime > attr.ctime) {
            return;
        }
        if m.stale(ticket, &Key::Ino(attr.ino)) {
            // A recall crossed the reply: what is cached may be older still.
            m.attrs.remove(&attr.ino);
            return;
        }
        if m.attrs.len() >= MAX_ENTRIES {
            m.attrs.clear();
        }
        m.attrs.insert(attr.ino, attr.clone());
    }

    /// Caches a directory's attributes that a change of this client's returned, unless those
    /// cached are newer (replies to concurrent changes may arrive in any order).
    pub fn put_newer(&self, attr: &Attr, ticket: Ticket) {
        self.put(attr, ticket, true);
    }

    /// Caches a name (`attr: None`: its absence) that shard `shard` answered.
    pub fn put_entry(
        &self,
        parent: InodeId,
        name: &[u8],
        attr: Option<&Attr>,
        who: (u32, u32),
        shard: u16,
        ticket: Ticket,
    ) {
        if !self.on {
            return;
        }
        let mut m = self.maps.lock().expect("cache lock");
        if m.stale(ticket, &Key::Name(parent, name.to_vec())) || attr.is_some_and(|a| m.stale(ticket, &Key::Ino(a.ino)))
        {
            m.names.remove(&(parent, name.to_vec()));
            if let Some(a) = attr {
                m.attrs.remove(&a.ino);
            }
            return;
        }
        // The parents map too: its entries outlive the names forgotten one by one (a file
        // made and removed leaves one behind).
        if m.names.len() >= MAX_ENTRIES || m.attrs.len() >= MAX_ENTRIES || m.parents.len() >= MAX_ENTRIES {
            m.names.clear();
            m.attrs.clear();
            m.complete.clear();
            m.parents.clear();
        }
        m.names.insert((parent, name.to_vec()), NameEntry { ino: attr.map(|a| a.ino), who, shard });
        if let Some(a) = attr {
            if a.kind == FileKind::File {
                m.parents.insert(a.ino, parent);
            }
            m.attrs.insert(a.ino, a.clone());
        }
    }

    /// This client changes (or changed) a name: forgets it and the attributes of the inode
    /// it named; replies in flight about it are not cached. Called before the change is sent
    /// and again when it is done.
    pub fn forget_entry(&self, parent: InodeId, name: &[u8]) {
        let mut m = self.maps.lock().expect("cache lock");
        m.mark(Key::Name(parent, name.to_vec()));
        if let Some(NameEntry { ino: Some(ino), .. }) = m.names.remove(&(parent, name.to_vec())) {
            m.attrs.remove(&ino);
            m.mark(Key::Ino(ino));
        }
    }

    /// The same for an inode's attributes.
    pub fn forget(&self, ino: InodeId) {
        let mut m = self.maps.lock().expect("cache lock");
        m.mark(Key::Ino(ino));
        m.attrs.remove(&ino);
        m.xattrs.remove(&ino);
    }

    /// This client made directory `dir` (one shard holds all its names) and leases its names:
    /// until another client changes a name there, a name not cached does not exist.
    pub fn made_dir(&self, dir: InodeId, ticket: Ticket) {
        let mut m = self.maps.lock().expect("cache lock");
        if self.on && !m.stale(ticket, &Key::Ino(dir)) {
            m.complete.insert(dir);
        }
    }

    /// Names of `dir` may exist that are not cached (this client's own rename into it).
    pub fn incomplete(&self, dir: InodeId) {
        self.maps.lock().expect("cache lock").complete.remove(&dir);
    }

    /// Drops what a recall names; replies in flight are not cached.
    pub fn apply(&self, r: &Recall) {
        let mut m = self.maps.lock().expect("cache lock");
        m.epoch += 1;
        for ino in &r.inos {
            m.attrs.remove(ino);
            m.xattrs.remove(ino);
        }
        for (dir, name) in &r.names {
            m.names.remove(&(*dir, name.clone()));
            // Another client changed a name there: which ones exist is no longer all known.
            m.complete.remove(dir);
        }
    }

    /// Drops everything shard `shard` leased (its session was lost: recalls may be missed).
    pub fn drop_shard(&self, shard: u16) {
        if let Some(t) = self.trusted.get(shard as usize) {
            t.store(0, Ordering::Release);
        }
        let mut m = self.maps.lock().expect("cache lock");
        m.epoch += 1;
        m.attrs.retain(|ino, _| ino.shard() != shard);
        m.xattrs.retain(|ino, _| ino.shard() != shard);
        m.names.retain(|_, e| e.shard != shard);
        m.complete.retain(|d| d.shard() != shard);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A regular file's attributes for tests: `size` bytes, every time `ctime` s, no layout.
    pub(crate) fn file_attr(ino: u64, size: u64, ctime: i64) -> Attr {
        let t = Timespec { sec: ctime, nsec: 0 };
        Attr {
            ino: InodeId(ino),
            kind: FileKind::File,
            mode: 0o644,
            nlink: 1,
            uid: 0,
            gid: 0,
            size,
            atime: t,
            mtime: t,
            ctime: t,
            layout: None,
            dir_stripes: Vec::new(),
            rdev: 0,
            sealed: false,
        }
    }

    #[test]
    fn files_made_and_removed_leave_the_cache_bounded() {
        let c = AttrCache::new(true, 1);
        let dir = InodeId(1);
        for i in 0..MAX_ENTRIES as u64 + 2 {
            let name = i.to_le_bytes();
            c.put_entry(dir, &name, Some(&file_attr(i + 2, 1, 1)), (0, 0), 0, c.ticket());
            c.forget_entry(dir, &name);
        }
        let m = c.maps.lock().unwrap();
        assert!(m.names.is_empty());
        assert!(m.parents.len() < MAX_ENTRIES, "{} parents kept", m.parents.len());
    }
}
