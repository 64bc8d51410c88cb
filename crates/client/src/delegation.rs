//! Create delegations, the client's side (docs/architecture.md, "Create delegations"): the
//! directories this client answers creates in itself, the inode ids and layouts metad reserved
//! for each, and the log of deferred changes (those creates, and the sizes published at the
//! close of files created in the log) that goes to metad in batches, one batch in flight at a
//! time. Every other request to metad waits until what was logged before it is applied
//! (`settle`), so metad sees this client's changes in the order its callers made them.

use odfs_proto::meta::Deferred;
use odfs_proto::{InodeId, Layout};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tokio::sync::{watch, Notify};

/// After a refusal or a recall, a directory is not asked about again for this long: another
/// client caches it, and asking at every create would cost the round trip delegations save.
const QUIET: Duration = Duration::from_secs(1);

/// Inode ids asked for at once.
pub(crate) const BATCH_IDS: u32 = 1024;

/// What a create in a directory may do now.
pub(crate) enum Take {
    /// Answer it here, as this new file (id and layout).
    Got(InodeId, Layout),
    /// Ask metad for a delegation first (this caller is the one asking).
    Ask,
    /// Send it to metad as usual.
    No,
}

#[derive(Default)]
struct State {
    /// Directory → the reserved ids (with layouts) not used yet.
    dirs: HashMap<InodeId, VecDeque<(InodeId, Layout)>>,
    /// Directories not asked about again before the instant.
    quiet: HashMap<InodeId, Instant>,
    /// Directories a delegation is being asked for.
    asking: HashSet<InodeId>,
    /// Deferred changes not sent yet, each with its sequence number.
    log: Vec<(u64, Deferred)>,
    /// Files whose create is logged and not yet applied, with their directories.
    unapplied: HashMap<InodeId, InodeId>,
}

pub(crate) struct Delegations {
    st: Mutex<State>,
    /// Sequence number of the last change logged.
    logged: AtomicU64,
    /// Sequence number up to which metad has applied the log.
    applied: watch::Sender<u64>,
    /// Wakes the sender.
    pub(crate) kick: Notify,
}

impl Delegations {
    pub fn new() -> Delegations {
        Delegations {
            st: Mutex::new(State::default()),
            logged: AtomicU64::new(0),
            applied: watch::channel(0).0,
            kick: Notify::new(),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.st.lock().expect("delegations lock")
    }

    /// A reserved id for a new file in `dir`, or whether to ask for a delegation.
    pub fn take(&self, dir: InodeId) -> Take {
        let mut st = self.state();
        if let Some(ids) = st.dirs.get_mut(&dir) {
            if let Some((ino, layout)) = ids.pop_front() {
                return Take::Got(ino, layout);
            }
        }
        if st.asking.contains(&dir) || st.quiet.get(&dir).is_some_and(|t| Instant::now() < *t) {
            return Take::No;
        }
        st.asking.insert(dir);
        Take::Ask
    }

    /// metad's answer to this client's ask for `dir`: the ids reserved, or a refusal.
    pub fn granted(&self, dir: InodeId, ids: Option<Vec<(InodeId, Layout)>>) {
        let mut st = self.state();
        st.asking.remove(&dir);
        match ids {
            Some(ids) => {
                st.quiet.remove(&dir);
                st.dirs.entry(dir).or_default().extend(ids);
            }
            None => {
                st.quiet.insert(dir, Instant::now() + QUIET);
            }
        }
    }

    /// The delegations on `dirs` end (recalled): their unused ids are dropped.
    pub fn end(&self, dirs: &[InodeId]) {
        let mut st = self.state();
        let until = Instant::now() + QUIET;
        for d in dirs {
            st.dirs.remove(d);
            st.quiet.insert(*d, until);
        }
    }

    /// Every delegation of shard `shard` ends (its session was lost: it knows none of them).
    pub fn drop_shard(&self, shard: u16) {
        self.state().dirs.retain(|d, _| d.shard() != shard);
    }

    /// Logs a create answered here (file `ino` in `dir`); sent with the next batch.
    pub fn log_create(&self, entry: Deferred, ino: InodeId, dir: InodeId) {
        let mut st = self.state();
        st.unapplied.insert(ino, dir);
        self.append(&mut st, entry);
    }

    /// Logs the size published at the close of `ino` if its create is in the log and its
    /// directory still delegated (no other client can have seen the file yet); false if the
    /// size must go to metad as usual.
    pub fn log_size(&self, ino: InodeId, entry: impl FnOnce() -> Deferred) -> bool {
        let mut st = self.state();
        let held = st.unapplied.get(&ino).is_some_and(|dir| st.dirs.contains_key(dir));
        if held {
            let e = entry();
            self.append(&mut st, e);
        }
        held
    }

    fn append(&self, st: &mut State, entry: Deferred) {
        let seq = self.logged.fetch_add(1, Ordering::AcqRel) + 1;
        st.log.push((seq, entry));
        self.kick.notify_one();
    }

    /// The changes to send next: all of the log, each with its sequence number.
    pub fn next_batch(&self) -> Vec<(u64, Deferred)> {
        std::mem::take(&mut self.state().log)
    }

    /// A batch could not be sent: its changes go back to the front of the log.
    pub fn unsent(&self, batch: Vec<(u64, Deferred)>) {
        self.state().log.splice(0..0, batch);
    }

    /// metad applied the log up to `last` (the files of `done` are created).
    pub fn applied(&self, done: impl IntoIterator<Item = InodeId>, last: u64) {
        {
            let mut st = self.state();
            for ino in done {
                st.unapplied.remove(&ino);
            }
        }
        self.applied.send_if_modified(|a| {
            let newer = last > *a;
            *a = (*a).max(last);
            newer
        });
    }

    /// Waits until metad has applied every change logged so far.
    pub async fn settle(&self) {
        let target = self.logged.load(Ordering::Acquire);
        if *self.applied.borrow() >= target {
            return;
        }
        self.kick.notify_one();
        let mut rx = self.applied.subscribe();
        let _ = rx.wait_for(|&a| a >= target).await;
    }
}
