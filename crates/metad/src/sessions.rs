//! Which clients are alive, which inodes each holds open, what each may cache (its leases) and
//! which file locks it holds, on this shard; the recalls queued for each client and their
//! acknowledgements.
//!
//! A lease lets a client cache an inode's attributes (for a file, its data; for a directory,
//! its names) until it is recalled. A change recalls the leases it breaks from every holder
//! but the client that made it; the change's reply waits for the holders' acknowledgements
//! (`Wait`), or for their sessions to end. Leases are not logged: a restarted shard knows none
//! and lets no change through until its clients' caches have lapsed (the grace below).
//!
//! A client's session lives while it polls (`SessionPoll`) at least once a lease; it holds an
//! inode open from its registration (`Open`/`Create` with `register`) to its `Release`. The
//! table is not logged: after a restart with existing state every client that polls gets a new
//! session and registers its open files again (`Reopen`), and until one lease has passed, no
//! inode is taken for unheld.
//!
//! A create delegation (docs/architecture.md, "Create delegations") lets one caching client
//! answer creates in a directory itself. It is held while no other client asks about the
//! directory or changes a name of its parent: any such request recalls it first, and waits for
//! the holder's acknowledgement, which the holder sends after its deferred creates.
//!
//! A session ends when its client says goodbye (`EndSession`, at unmount or exit, or sent for
//! it by its node's teardown), when it does not acknowledge a recall within the lease, or when
//! it is silent for a lease. A goodbye is final: the client id is remembered as departed, so a
//! poll still in flight cannot start the session again.
//!
//! Registrations carry the client's sequence number of the open: a release only undoes a
//! registration as old as itself, so a release that overtakes a later open of the same file
//! (both in flight at once) leaves that open registered.

use odfs_proto::locks::{LockTable, Request as LockRequest, SetOutcome};
use odfs_proto::meta::{LockHolder, Recall};
use odfs_proto::InodeId;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{watch, Notify};

/// A client's recalls in flight: queued until acknowledged.
struct Queue {
    next: u64,
    pending: VecDeque<Recall>,
    /// The highest acknowledged sequence number, watched by the changes waiting for it.
    acked: watch::Sender<u64>,
    /// Wakes the client's parked poll.
    wake: Arc<Notify>,
}

impl Queue {
    fn new() -> Queue {
        Queue { next: 1, pending: VecDeque::new(), acked: watch::channel(0).0, wake: Arc::new(Notify::new()) }
    }
}

/// Leases of one kind: inode → holders, and client → inodes. A recalled lease lasts until the
/// holder acknowledges the recall (it may hold the file open until it says otherwise); a new
/// grant meanwhile renews it.
#[derive(Default)]
struct LeaseTable {
    /// Holders, each with whether its lease is being recalled.
    holders: HashMap<InodeId, Vec<(u64, bool)>>,
    of: HashMap<u64, HashSet<InodeId>>,
}

impl LeaseTable {
    fn grant(&mut self, client: u64, ino: InodeId) {
        let hs = self.holders.entry(ino).or_default();
        match hs.iter_mut().find(|(c, _)| *c == client) {
            Some(h) => h.1 = false,
            None => {
                hs.push((client, false));
                self.of.entry(client).or_default().insert(ino);
            }
        }
    }

    fn holders(&self, ino: InodeId) -> impl Iterator<Item = u64> + '_ {
        self.holders.get(&ino).into_iter().flatten().map(|(c, _)| *c)
    }

    /// Marks the leases on `ino` of every holder but `except` as recalled; returns them.
    fn recall(&mut self, ino: InodeId, except: u64) -> Vec<u64> {
        let Some(hs) = self.holders.get_mut(&ino) else { return Vec::new() };
        hs.iter_mut()
            .filter(|(c, _)| *c != except)
            .map(|h| {
                h.1 = true;
                h.0
            })
            .collect()
    }

    /// `client` acknowledged a recall of `ino`: its lease ends unless granted again since.
    fn end_recalled(&mut self, client: u64, ino: InodeId) {
        if let Some(hs) = self.holders.get_mut(&ino) {
            if hs.iter().any(|&(c, recalled)| c == client && recalled) {
                self.remove(client, ino);
            }
        }
    }

    fn remove(&mut self, client: u64, ino: InodeId) {
        if let Some(hs) = self.holders.get_mut(&ino) {
            hs.retain(|(c, _)| *c != client);
            if hs.is_empty() {
                self.holders.remove(&ino);
            }
        }
        if let Some(s) = self.of.get_mut(&client) {
            s.remove(&ino);
        }
    }

    fn drop_client(&mut self, client: u64) {
        for ino in self.of.get(&client).cloned().unwrap_or_default() {
            self.remove(client, ino);
        }
        self.of.remove(&client);
    }
}

/// What a change waits for: `client` acknowledging recall `seq`.
pub(crate) struct Wait {
    pub client: u64,
    pub seq: u64,
    pub acked: watch::Receiver<u64>,
}

pub(crate) struct Sessions {
    lease: Duration,
    /// Until then, every inode counts as held: the shard restarted with existing state and its
    /// clients are registering their open files again.
    grace_until: Option<Instant>,
    /// Client id → when it was last heard from.
    clients: HashMap<u64, Instant>,
    /// Clients that said goodbye: never given a session again.
    departed: HashSet<u64>,
    /// Inode → client → sequence number of its latest registration.
    holders: HashMap<InodeId, HashMap<u64, u64>>,
    /// Client → the inodes it holds.
    held_by: HashMap<u64, HashSet<InodeId>>,
    /// Leases on inodes' attributes (and files' data): ended by a recall.
    attrs: LeaseTable,
    /// Leases on directories' names: a change of a name recalls that name only.
    names: LeaseTable,
    /// Client → its recalls not yet acknowledged.
    queues: HashMap<u64, Queue>,
    /// Clients that cache, and so take leases (they said so in their polls).
    caching: HashSet<u64>,
    /// Create delegations: directory → (holder, the directory's parent when granted).
    delegated: HashMap<InodeId, (u64, InodeId)>,
    /// How many delegations are held (read without the store lock: most requests need not
    /// look for one).
    delegations: Arc<AtomicUsize>,
    /// File locks (`flock`, `fcntl`): they go with their holder's session.
    locks: LockTable,
    /// Woken whenever a lock goes: the lock requests that may wait look again.
    locks_freed: Arc<Notify>,
}

impl Sessions {
    pub fn new(lease: Duration) -> Sessions {
        Sessions {
            lease,
            grace_until: None,
            clients: HashMap::new(),
            departed: HashSet::new(),
            holders: HashMap::new(),
            held_by: HashMap::new(),
            attrs: LeaseTable::default(),
            names: LeaseTable::default(),
            queues: HashMap::new(),
            caching: HashSet::new(),
            delegated: HashMap::new(),
            delegations: Arc::new(AtomicUsize::new(0)),
            locks: LockTable::default(),
            locks_freed: Arc::new(Notify::new()),
        }
    }

    /// Woken whenever a lock of the shard goes (a lock request that may wait parks on it).
    pub fn locks_freed(&self) -> Arc<Notify> {
        self.locks_freed.clone()
    }

    /// A lock request of a client (see `locks`): its session counts as heard from.
    pub fn set_lock(&mut self, ino: InodeId, q: &LockRequest) -> SetOutcome {
        self.touch(q.client);
        let (outcome, freed) = self.locks.set(ino, q);
        self.wake_lock_waiters(freed);
        outcome
    }

    /// The first lock of another owner that would refuse `q` (F_GETLK).
    pub fn test_lock(&self, ino: InodeId, q: &LockRequest) -> Option<LockHolder> {
        self.locks.test(ino, q)
    }

    /// Drops every lock of `client`'s `owners` on `ino`.
    pub fn drop_locks(&mut self, client: u64, ino: InodeId, owners: &[u64]) {
        let freed = self.locks.drop_owners(client, ino, owners);
        self.wake_lock_waiters(freed);
    }

    fn wake_lock_waiters(&self, freed: bool) {
        if freed {
            self.locks_freed.notify_waiters();
        }
    }

    /// How many create delegations are held, readable without the store's lock.
    pub fn delegation_count(&self) -> Arc<AtomicUsize> {
        self.delegations.clone()
    }

    /// Whether `client` may be given a create delegation on `dir`: it caches, has a session,
    /// and no other client holds a lease on the directory's names or attributes or a
    /// delegation on it.
    pub fn may_delegate(&self, client: u64, dir: InodeId) -> bool {
        self.caching.contains(&client)
            && self.clients.contains_key(&client)
            && self.names.holders(dir).all(|c| c == client)
            && self.attrs.holders(dir).all(|c| c == client)
            && self.delegated.get(&dir).is_none_or(|&(c, _)| c == client)
    }

    /// `client` holds a create delegation on `dir`, a child of `parent`.
    pub fn delegate(&mut self, client: u64, dir: InodeId, parent: InodeId) {
        self.delegated.insert(dir, (client, parent));
        self.delegations_changed();
    }

    /// Directory `dir` may have moved (a change by its holder touched it): its parent is now
    /// `parent`.
    pub fn delegated_moved(&mut self, dir: InodeId, parent: InodeId) {
        if let Some(d) = self.delegated.get_mut(&dir) {
            d.1 = parent;
        }
    }

    /// Ends every create delegation of another client than `except` on one of `inos` or on a
    /// child directory of one of them (its name may be what the request changes); queues the
    /// recalls and returns what to wait for.
    pub fn recall_delegations(&mut self, except: u64, inos: &[InodeId]) -> Vec<Wait> {
        self.recall_delegations_where(except, |dir, parent| inos.contains(&dir) || inos.contains(&parent))
    }

    /// Ends the delegations of other clients than `except` on the directories (child of a
    /// parent) that `ends` picks.
    fn recall_delegations_where(&mut self, except: u64, ends: impl Fn(InodeId, InodeId) -> bool) -> Vec<Wait> {
        let ended: Vec<(InodeId, u64)> = self
            .delegated
            .iter()
            .filter(|(dir, (c, parent))| *c != except && ends(**dir, *parent))
            .map(|(dir, (c, _))| (*dir, *c))
            .collect();
        let mut per_client: HashMap<u64, Recall> = HashMap::new();
        for (dir, client) in ended {
            self.delegated.remove(&dir);
            per_client.entry(client).or_default().dirs.push(dir);
        }
        self.delegations_changed();
        self.queue(per_client)
    }

    /// Ends `client`'s own delegations on `dirs` (no recall: it asked, or they are gone).
    pub fn end_delegations_of(&mut self, client: u64, dirs: &[InodeId]) {
        self.delegated.retain(|d, (c, _)| *c != client || !dirs.contains(d));
        self.delegations_changed();
    }

    /// Publishes how many delegations are held (see `delegation_count`).
    fn delegations_changed(&self) {
        self.delegations.store(self.delegated.len(), Ordering::Relaxed);
    }

    fn drop_delegations(&mut self, client: u64) {
        self.delegated.retain(|_, (c, _)| *c != client);
        self.delegations_changed();
    }

    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// The shard restarted with existing state: for one lease, nothing is taken for unheld.
    pub fn start_grace(&mut self) {
        self.grace_until = Some(Instant::now() + self.lease);
    }

    /// Until when a restarted shard lets no change through (clients may still cache what the
    /// shard before the restart leased them).
    pub fn grace_end(&self) -> Option<Instant> {
        self.grace_until.filter(|t| Instant::now() < *t)
    }

    /// The client was heard from; true when its session is new. A departed client gets none.
    pub fn touch(&mut self, client: u64) -> bool {
        if self.departed.contains(&client) {
            return false;
        }
        self.clients.insert(client, Instant::now()).is_none()
    }

    /// Whether `client` said goodbye.
    pub fn departed(&self, client: u64) -> bool {
        self.departed.contains(&client)
    }

    /// `client` said goodbye (see the module doc): its session ends for good. Returns the
    /// inodes it held open.
    pub fn depart(&mut self, client: u64) -> Vec<InodeId> {
        self.departed.insert(client);
        self.end(client)
    }

    /// `client` may cache the attributes of `inos` until they are recalled. Only clients with
    /// a session get leases (a client trusts its caches only while its session lasts).
    pub fn grant(&mut self, client: u64, inos: impl IntoIterator<Item = InodeId>) {
        if !self.caching.contains(&client) || !self.clients.contains_key(&client) {
            return;
        }
        for ino in inos {
            self.end_other_delegation(ino, client);
            self.attrs.grant(client, ino);
        }
    }

    /// A lease on `dir` goes to `client`: another client's create delegation on it ends (it
    /// is recalled without waiting). Only a request that raced the grant gets here; every
    /// other request about the directory recalled the delegation before it was answered.
    fn end_other_delegation(&mut self, dir: InodeId, client: u64) {
        if self.delegated.get(&dir).is_some_and(|&(c, _)| c != client) {
            self.recall_delegations_where(client, |d, _| d == dir);
        }
    }

    /// `client` may cache names of directory `dir`, and their absence.
    pub fn grant_names(&mut self, client: u64, dir: InodeId) {
        if self.caching.contains(&client) && self.clients.contains_key(&client) {
            self.end_other_delegation(dir, client);
            self.names.grant(client, dir);
        }
    }

    /// Whether a client other than `except` holds a lease on `ino`: it may hold the file open
    /// without having registered the open (opens answered from its cache).
    pub fn leased_by_other(&self, ino: InodeId, except: u64) -> bool {
        self.attrs.holders(ino).any(|c| c != except)
    }

    /// `client`'s own lease on `ino` ends (the inode lost its last name by the client's own
    /// change: what it holds open there it registered before).
    pub fn end_lease(&mut self, client: u64, ino: InodeId) {
        self.attrs.remove(client, ino);
        self.names.remove(client, ino);
    }

    /// Recalls the leases that a change of `inos` breaks and the changed `names`
    /// (directory, name) from every holder but `except`; queues the recalls. Returns what to
    /// wait for.
    pub fn recall(&mut self, except: u64, inos: &[InodeId], names: &[(InodeId, Vec<u8>)]) -> Vec<Wait> {
        fn of(m: &mut HashMap<u64, Recall>, c: u64) -> &mut Recall {
            m.entry(c).or_default()
        }
        let mut per_client: HashMap<u64, Recall> = HashMap::new();
        for (dir, name) in names {
            for c in self.names.holders(*dir).filter(|&c| c != except) {
                of(&mut per_client, c).names.push((*dir, name.clone()));
            }
        }
        for &ino in inos {
            for c in self.attrs.recall(ino, except) {
                of(&mut per_client, c).inos.push(ino);
            }
        }
        self.queue(per_client)
    }

    /// Queues one recall for each client; returns what to wait for.
    fn queue(&mut self, per_client: HashMap<u64, Recall>) -> Vec<Wait> {
        let mut waits = Vec::with_capacity(per_client.len());
        for (client, mut r) in per_client {
            let q = self.queues.entry(client).or_insert_with(Queue::new);
            r.seq = q.next;
            q.next += 1;
            waits.push(Wait { client, seq: r.seq, acked: q.acked.subscribe() });
            q.pending.push_back(r);
            q.wake.notify_one();
        }
        waits
    }

    /// Whether `client` caches (its latest poll says); only caching clients get leases.
    pub fn set_caching(&mut self, client: u64, caching: bool) {
        if caching {
            self.caching.insert(client);
        } else {
            self.caching.remove(&client);
            self.drop_leases(client);
        }
    }

    /// A poll from `client` acknowledging every recall up to `acked`: the recalls still
    /// pending, and what wakes the poll when more come.
    pub fn acknowledge(&mut self, client: u64, acked: u64) -> (Vec<Recall>, Arc<Notify>) {
        let q = self.queues.entry(client).or_insert_with(Queue::new);
        while q.pending.front().is_some_and(|r| r.seq <= acked) {
            if let Some(r) = q.pending.pop_front() {
                for ino in r.inos {
                    self.attrs.end_recalled(client, ino);
                }
            }
        }
        q.acked.send_if_modified(|a| {
            let newer = acked > *a;
            *a = (*a).max(acked);
            newer
        });
        (q.pending.iter().cloned().collect(), q.wake.clone())
    }

    /// Ends `client`'s session (it did not acknowledge a recall within the lease, was silent
    /// for one, or departed). Returns the inodes it held open.
    pub fn end(&mut self, client: u64) -> Vec<InodeId> {
        if let Some(q) = self.queues.get(&client) {
            // Its parked poll answers now instead of holding the session's last word.
            q.wake.notify_one();
        }
        self.clients.remove(&client);
        self.caching.remove(&client);
        self.drop_leases(client);
        let freed = self.locks.drop_client(client);
        self.wake_lock_waiters(freed);
        let mut freed = Vec::new();
        for ino in self.held_by.remove(&client).unwrap_or_default() {
            if let Some(h) = self.holders.get_mut(&ino) {
                h.remove(&client);
                if h.is_empty() {
                    self.holders.remove(&ino);
                }
            }
            freed.push(ino);
        }
        freed
    }

    fn drop_leases(&mut self, client: u64) {
        self.attrs.drop_client(client);
        self.names.drop_client(client);
        self.drop_delegations(client);
        // Waiters see the sender go (the session ended): they stop waiting.
        self.queues.remove(&client);
    }

    /// `client` holds `ino` open, as of its open number `seq`.
    pub fn register(&mut self, client: u64, ino: InodeId, seq: u64) {
        if self.departed.contains(&client) {
            return;
        }
        self.touch(client);
        let e = self.holders.entry(ino).or_default().entry(client).or_insert(seq);
        *e = (*e).max(seq);
        self.held_by.entry(client).or_default().insert(ino);
    }

    /// `client` closed `ino` (its opens up to `seq`): true when that ended its hold.
    pub fn release(&mut self, client: u64, ino: InodeId, seq: u64) -> bool {
        let Some(h) = self.holders.get_mut(&ino) else { return false };
        match h.get(&client) {
            Some(&latest) if latest <= seq => {
                h.remove(&client);
                if h.is_empty() {
                    self.holders.remove(&ino);
                }
                if let Some(s) = self.held_by.get_mut(&client) {
                    s.remove(&ino);
                }
                true
            }
            _ => false,
        }
    }

    /// Whether any client holds `ino` open (during the grace after a restart: every inode).
    pub fn held(&self, ino: InodeId) -> bool {
        self.holders.contains_key(&ino) || self.grace_until.is_some_and(|t| Instant::now() < t)
    }

    /// Ends the sessions not heard from for a lease; returns the inodes they held.
    pub fn expire(&mut self) -> Vec<InodeId> {
        let lease = self.lease;
        let gone: Vec<u64> = self.clients.iter().filter(|(_, t)| t.elapsed() > lease).map(|(c, _)| *c).collect();
        gone.into_iter().flat_map(|c| self.end(c)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_late_release_does_not_undo_a_newer_open() {
        let mut s = Sessions::new(Duration::ZERO);
        let f = InodeId(9);
        s.register(1, f, 5);
        s.register(1, f, 7);
        assert!(!s.release(1, f, 5), "the open numbered 7 still holds it");
        assert!(s.held(f));
        assert!(s.release(1, f, 7));
        assert!(!s.held(f));
    }

    #[test]
    fn a_goodbye_ends_the_session_for_good_and_frees_its_waiters() {
        let mut s = Sessions::new(Duration::from_secs(30));
        let (a, b, f, d) = (1, 2, InodeId(9), InodeId(1));
        for c in [a, b] {
            s.touch(c);
            s.set_caching(c, true);
        }
        s.register(a, f, 1);
        s.grant(a, [f]);
        s.grant_names(a, d);
        let waits = s.recall(b, &[f], &[(d, b"x".to_vec())]);
        assert_eq!(waits.len(), 1, "a holds what b changes");
        let acked = waits.into_iter().next().unwrap().acked;
        assert_eq!(s.depart(a), vec![f]);
        assert!(!s.held(f), "a's registration went with it");
        assert!(acked.has_changed().is_err(), "the change's wait ends: the queue's sender is gone");
        // A poll or open still on its way after the goodbye starts nothing again.
        assert!(!s.touch(a));
        s.register(a, f, 2);
        s.grant(a, [f]);
        assert!(!s.held(f));
        assert!(s.recall(b, &[f], &[]).is_empty(), "a departed client holds no lease");
    }

    #[test]
    fn expired_sessions_free_what_they_held() {
        let mut s = Sessions::new(Duration::from_millis(1));
        s.register(1, InodeId(3), 1);
        s.register(2, InodeId(3), 1);
        std::thread::sleep(Duration::from_millis(5));
        s.touch(2);
        assert_eq!(s.expire(), vec![InodeId(3)]);
        assert!(s.held(InodeId(3)), "client 2 still holds it");
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(s.expire(), vec![InodeId(3)]);
        assert!(!s.held(InodeId(3)));
    }
}
