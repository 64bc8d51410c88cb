//! Which clients are alive and which inodes each holds open, on this shard.
//!
//! A client's session lives while it polls (`SessionPoll`) at least once a lease; it holds an
//! inode open from its registration (`Open`/`Create` with `register`) to its `Release`. The
//! table is not logged: after a restart with existing state every client that polls gets a new
//! session and registers its open files again (`Reopen`), and until one lease has passed, no
//! inode is taken for unheld.
//!
//! Registrations carry the client's sequence number of the open: a release only undoes a
//! registration as old as itself, so a release that overtakes a later open of the same file
//! (both in flight at once) leaves that open registered.

use odfs_proto::InodeId;
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

pub(crate) struct Sessions {
    lease: Duration,
    /// Until then, every inode counts as held: the shard restarted with existing state and its
    /// clients are registering their open files again.
    grace_until: Option<Instant>,
    /// Client id → when it was last heard from.
    clients: HashMap<u64, Instant>,
    /// Inode → client → sequence number of its latest registration.
    holders: HashMap<InodeId, HashMap<u64, u64>>,
    /// Client → the inodes it holds.
    held_by: HashMap<u64, HashSet<InodeId>>,
}

impl Sessions {
    pub fn new(lease: Duration) -> Sessions {
        Sessions { lease, grace_until: None, clients: HashMap::new(), holders: HashMap::new(), held_by: HashMap::new() }
    }

    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// The shard restarted with existing state: for one lease, nothing is taken for unheld.
    pub fn start_grace(&mut self) {
        self.grace_until = Some(Instant::now() + self.lease);
    }

    /// The client was heard from; true when its session is new.
    pub fn touch(&mut self, client: u64) -> bool {
        self.clients.insert(client, Instant::now()).is_none()
    }

    /// `client` holds `ino` open, as of its open number `seq`.
    pub fn register(&mut self, client: u64, ino: InodeId, seq: u64) {
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
        let mut freed = Vec::new();
        for c in gone {
            self.clients.remove(&c);
            for ino in self.held_by.remove(&c).unwrap_or_default() {
                if let Some(h) = self.holders.get_mut(&ino) {
                    h.remove(&c);
                    if h.is_empty() {
                        self.holders.remove(&ino);
                    }
                }
                freed.push(ino);
            }
        }
        freed
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
