//! Create delegations, the client's side (docs/architecture.md, "Create delegations"): the
//! directories this client answers creates in itself, the inode ids and layouts metad reserved
//! for each, and the log of deferred changes (those creates, and the sizes published at the
//! close and the unlinks of files made under a delegation still held) that goes to metad in
//! batches, one batch in flight at a time. Every other request to metad waits until what was
//! logged before it is applied (`settle`), so metad sees this client's changes in the order its
//! callers made them.

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

/// Reserved ids older than this are dropped and new ones asked for: their layouts were chosen
/// from the targets of that time.
const IDS_FOR: Duration = Duration::from_secs(10);

/// While changes keep coming, a batch is sent at most this long after the last one began, so
/// that it carries what arrived meanwhile (sent as they came, creates in a tight loop made
/// batches of two or three, each a round trip's sends, receives and wake-ups at both ends).
/// A change logged after a quiet spell goes at once, and so does the log whenever a caller
/// waits for it (`settle`: another request, an fsync, a recall).
pub(crate) const GATHER: Duration = Duration::from_millis(1);

/// Entries sent in one `CreateBatch` at most (a log grown while metad was away goes in several).
const MAX_BATCH: usize = 512;

/// Files remembered as made under a delegation, at most, as many as the attribute cache holds
/// (beyond, all are forgotten: their sizes and unlinks go to metad as usual). About 40 MiB
/// when full.
const MAX_MADE: usize = 1 << 20;

/// What a create in a directory may do now.
pub(crate) enum Take {
    /// Answered here: the new file's id and layout (its entry is logged).
    Got(InodeId, Layout),
    /// Ask metad for a delegation first (this caller is the one asking), with this ticket.
    Ask(u64),
    /// Send it to metad as usual.
    No,
}

/// Reserved ids of one delegated directory.
struct Grant {
    ids: VecDeque<(InodeId, Layout)>,
    at: Instant,
}

#[derive(Default)]
struct State {
    /// Directory → the reserved ids (with layouts) not used yet.
    dirs: HashMap<InodeId, Grant>,
    /// Counts delegations ended (recalls, lost sessions): a grant asked for before one ended
    /// may have been recalled before its answer arrived, and is not used.
    ended: u64,
    /// Directories not asked about again before the instant.
    quiet: HashMap<InodeId, Instant>,
    /// Directories a delegation is being asked for.
    asking: HashSet<InodeId>,
    /// Deferred changes not sent yet, each with its sequence number.
    log: Vec<(u64, Deferred)>,
    /// Files created here under a delegation still held, with their directories: no other
    /// client can know them yet (any request about the directory ends the delegation), so
    /// their sizes may join the log too.
    made: HashMap<InodeId, InodeId>,
}

pub(crate) struct Delegations {
    st: Mutex<State>,
    /// Sequence number of the last change logged.
    logged: AtomicU64,
    /// Sequence number up to which metad has applied the log.
    applied: watch::Sender<u64>,
    /// Wakes the sender.
    pub(crate) kick: Notify,
    /// Sequence number up to which a caller waits for the log to be applied.
    wanted: AtomicU64,
    /// Wakes a sender gathering a batch: a caller waits for the log.
    pub(crate) hurry: Notify,
}

impl Delegations {
    pub fn new() -> Delegations {
        Delegations {
            st: Mutex::new(State::default()),
            logged: AtomicU64::new(0),
            applied: watch::channel(0).0,
            kick: Notify::new(),
            wanted: AtomicU64::new(0),
            hurry: Notify::new(),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.st.lock().expect("delegations lock")
    }

    /// A create of a new file in `dir`: answered here if a reserved id is at hand (`entry`
    /// builds its log entry from the id and layout; taken and logged under one lock, so a
    /// recall either finds the entry logged or the id not taken), else whether to ask for a
    /// delegation.
    pub fn create(&self, dir: InodeId, entry: impl FnOnce(InodeId, &Layout) -> Deferred) -> Take {
        let mut st = self.state();
        if let Some((ino, layout)) = self.take_logged(&mut st, dir, entry) {
            return Take::Got(ino, layout);
        }
        if st.asking.contains(&dir) || st.quiet.get(&dir).is_some_and(|t| Instant::now() < *t) {
            return Take::No;
        }
        st.asking.insert(dir);
        Take::Ask(st.ended)
    }

    /// The same once this caller's ask was answered: a reserved id, or None (refused, or
    /// crossed by a recall) and the create goes to metad.
    pub fn create_granted(
        &self,
        dir: InodeId,
        entry: impl FnOnce(InodeId, &Layout) -> Deferred,
    ) -> Option<(InodeId, Layout)> {
        self.take_logged(&mut self.state(), dir, entry)
    }

    /// Takes the next reserved id of `dir` (ids too old are dropped) and logs its entry.
    fn take_logged(
        &self,
        st: &mut State,
        dir: InodeId,
        entry: impl FnOnce(InodeId, &Layout) -> Deferred,
    ) -> Option<(InodeId, Layout)> {
        let g = st.dirs.get_mut(&dir)?;
        if g.at.elapsed() > IDS_FOR {
            // The delegation is still held; new ids (and layouts) are asked for.
            g.ids.clear();
            return None;
        }
        let (ino, layout) = g.ids.pop_front()?;
        let e = entry(ino, &layout);
        if st.made.len() >= MAX_MADE {
            st.made.clear();
        }
        st.made.insert(ino, dir);
        self.append(st, e);
        Some((ino, layout))
    }

    /// metad's answer to this client's ask for `dir` (made with `ticket`): the ids reserved,
    /// or a refusal. A grant that a recall may have crossed is not used.
    pub fn granted(&self, dir: InodeId, ticket: u64, ids: Option<Vec<(InodeId, Layout)>>) {
        let mut st = self.state();
        st.asking.remove(&dir);
        match ids {
            Some(ids) if st.ended == ticket => {
                st.quiet.remove(&dir);
                st.dirs.insert(dir, Grant { ids: ids.into(), at: Instant::now() });
            }
            Some(_) => {
                st.quiet.insert(dir, Instant::now() + QUIET);
            }
            None => {
                // Refused: whatever was held of `dir` is not counted on.
                st.dirs.remove(&dir);
                st.made.retain(|_, d| *d != dir);
                st.quiet.insert(dir, Instant::now() + QUIET);
            }
        }
    }

    /// The delegations on `dirs` end (recalled, or changed by this client): their unused ids
    /// are dropped.
    pub fn end(&self, dirs: &[InodeId]) {
        let mut st = self.state();
        st.ended += 1;
        let until = Instant::now() + QUIET;
        for d in dirs {
            st.dirs.remove(d);
            st.quiet.insert(*d, until);
        }
        st.made.retain(|_, d| !dirs.contains(d));
    }

    /// Every delegation of shard `shard` ends (its session was lost or it could not be
    /// reached: it may have restarted and know none of them).
    pub fn drop_shard(&self, shard: u16) {
        let mut st = self.state();
        st.ended += 1;
        st.dirs.retain(|d, _| d.shard() != shard);
        st.made.retain(|_, d| d.shard() != shard);
    }

    /// Logs the size published at the close of `ino` if the file was made here under its
    /// directory's delegation, still held (no other client can have seen the file yet); false
    /// if the size must go to metad as usual.
    pub fn log_size(&self, ino: InodeId, entry: impl FnOnce() -> Deferred) -> bool {
        let mut st = self.state();
        let held = st.made.get(&ino).is_some_and(|dir| st.dirs.contains_key(dir));
        if held {
            let e = entry();
            self.append(&mut st, e);
        }
        held
    }

    /// Logs the unlink of `ino`, named in `dir`, if the file was made here under the
    /// directory's delegation, still held: no other client can know it, so none can hold it
    /// open or cache it. False if the unlink must go to metad as usual.
    pub fn log_unlink(&self, dir: InodeId, ino: InodeId, entry: impl FnOnce() -> Deferred) -> bool {
        let mut st = self.state();
        let held = st.made.get(&ino) == Some(&dir) && st.dirs.contains_key(&dir);
        if held {
            st.made.remove(&ino);
            let e = entry();
            self.append(&mut st, e);
        }
        held
    }

    /// A file may get a name outside its directory (this client's rename or link): sizes go
    /// to metad as usual from now on, for every file made so far.
    pub fn forget_made(&self) {
        self.state().made.clear();
    }

    fn append(&self, st: &mut State, entry: Deferred) {
        let seq = self.logged.fetch_add(1, Ordering::AcqRel) + 1;
        st.log.push((seq, entry));
        self.kick.notify_one();
    }

    /// The changes to send next, oldest first, each with its sequence number.
    pub fn next_batch(&self) -> Vec<(u64, Deferred)> {
        let mut st = self.state();
        let n = st.log.len().min(MAX_BATCH);
        st.log.drain(..n).collect()
    }

    /// A batch could not be sent: its changes go back to the front of the log.
    pub fn unsent(&self, batch: Vec<(u64, Deferred)>) {
        self.state().log.splice(0..0, batch);
    }

    /// metad applied the log up to `last`.
    pub fn applied(&self, last: u64) {
        self.applied.send_if_modified(|a| {
            let newer = last > *a;
            *a = (*a).max(last);
            newer
        });
    }

    /// Whether a caller waits for changes metad has not applied yet (the sender stops
    /// gathering).
    pub fn hurried(&self) -> bool {
        self.wanted.load(Ordering::Acquire) > *self.applied.borrow()
    }

    /// Waits until metad has applied every change logged so far.
    pub async fn settle(&self) {
        let target = self.logged.load(Ordering::Acquire);
        if *self.applied.borrow() >= target {
            return;
        }
        self.wanted.fetch_max(target, Ordering::AcqRel);
        self.hurry.notify_one();
        self.kick.notify_one();
        let mut rx = self.applied.subscribe();
        let _ = rx.wait_for(|&a| a >= target).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use odfs_proto::{RequestHeader, Timespec};

    fn layout() -> Layout {
        Layout { chunk_size: 1 << 20, pool: "default".into(), targets: vec![1] }
    }

    fn ids(first: u64, n: u64) -> Vec<(InodeId, Layout)> {
        (first..first + n).map(|i| (InodeId::new(0, i), layout())).collect()
    }

    fn create_entry(ino: InodeId, l: &Layout) -> Deferred {
        Deferred::Create {
            caller: RequestHeader::default(),
            parent: InodeId(7),
            name: b"f".to_vec(),
            mode: 0o644,
            ino,
            layout: l.clone(),
            now: Timespec::default(),
        }
    }

    fn size_entry() -> Deferred {
        Deferred::Size { request_id: 1, ino: InodeId::new(0, 100), size: 1, mtime: Timespec::default() }
    }

    #[test]
    fn a_create_takes_the_next_reserved_id_and_is_logged_with_it() {
        let d = Delegations::new();
        let dir = InodeId(7);
        let Take::Ask(ticket) = d.create(dir, create_entry) else { panic!("no delegation yet: ask") };
        assert!(matches!(d.create(dir, create_entry), Take::No), "one ask at a time per directory");
        d.granted(dir, ticket, Some(ids(100, 2)));
        for want in [100, 101] {
            match d.create(dir, create_entry) {
                Take::Got(ino, _) => assert_eq!(ino, InodeId::new(0, want)),
                _ => panic!("a reserved id was at hand"),
            }
        }
        let batch = d.next_batch();
        let logged: Vec<_> = batch.iter().map(|(seq, e)| (*seq, e.clone())).collect();
        assert_eq!(logged.len(), 2);
        assert!(matches!(&logged[0].1, Deferred::Create { ino, .. } if *ino == InodeId::new(0, 100)));
        assert!(logged[0].0 < logged[1].0, "sequence numbers follow the log's order");
        // Used up: ask again.
        assert!(matches!(d.create(dir, create_entry), Take::Ask(_)));
    }

    #[test]
    fn a_grant_crossed_by_a_recall_is_not_used() {
        let d = Delegations::new();
        let dir = InodeId(7);
        let Take::Ask(ticket) = d.create(dir, create_entry) else { panic!("ask") };
        // The recall of the delegation arrives before the grant's answer is handled.
        d.end(&[dir]);
        d.granted(dir, ticket, Some(ids(100, 4)));
        assert!(matches!(d.create(dir, create_entry), Take::No), "the crossed grant answered a create");
        assert!(d.next_batch().is_empty());
    }

    #[test]
    fn sizes_join_the_log_only_for_files_made_under_a_delegation_still_held() {
        let d = Delegations::new();
        let dir = InodeId(7);
        let Take::Ask(ticket) = d.create(dir, create_entry) else { panic!("ask") };
        d.granted(dir, ticket, Some(ids(100, 4)));
        let Take::Got(made, _) = d.create(dir, create_entry) else { panic!("got") };
        assert!(d.log_size(made, size_entry), "made here, delegation held");
        assert!(!d.log_size(InodeId::new(0, 5), size_entry), "a file made elsewhere");
        d.forget_made();
        assert!(!d.log_size(made, size_entry), "after a rename or link by this client");
        let Take::Got(other, _) = d.create(dir, create_entry) else { panic!("got") };
        d.end(&[dir]);
        assert!(!d.log_size(other, size_entry), "after the delegation was recalled");
    }

    fn unlink_entry() -> Deferred {
        Deferred::Unlink {
            caller: RequestHeader::default(),
            parent: InodeId(7),
            name: b"f".to_vec(),
            ino: InodeId::new(0, 100),
            ctime: Timespec::default(),
            now: Timespec::default(),
        }
    }

    #[test]
    fn unlinks_join_the_log_only_for_files_made_in_that_directory_under_a_delegation_still_held() {
        let d = Delegations::new();
        let (dir, elsewhere) = (InodeId(7), InodeId(8));
        let Take::Ask(ticket) = d.create(dir, create_entry) else { panic!("ask") };
        d.granted(dir, ticket, Some(ids(100, 1)));
        let Take::Got(made, _) = d.create(dir, create_entry) else { panic!("got") };
        let Take::Got(second, _) = d.create(dir, create_entry).or_granted(&d, dir, ids(200, 2)) else { panic!("got") };
        assert!(!d.log_unlink(elsewhere, made, unlink_entry), "named in another directory");
        assert!(!d.log_unlink(dir, InodeId::new(0, 5), unlink_entry), "a file made elsewhere");
        // Its ids used up (a new grant came), the delegation is still held.
        assert!(d.log_unlink(dir, made, unlink_entry), "made here, delegation held");
        assert!(!d.log_unlink(dir, made, unlink_entry), "gone: a second unlink is metad's to refuse");
        let logged: Vec<_> = d.next_batch().into_iter().map(|(_, e)| e).collect();
        assert!(matches!(logged.last(), Some(Deferred::Unlink { .. })), "{logged:?}");
        d.end(&[dir]);
        assert!(!d.log_unlink(dir, second, unlink_entry), "after the delegation was recalled");
    }

    impl Take {
        /// This take, or, when it is an ask, the create after `ids` were granted for it.
        fn or_granted(self, d: &Delegations, dir: InodeId, ids: Vec<(InodeId, Layout)>) -> Take {
            match self {
                Take::Ask(ticket) => {
                    d.granted(dir, ticket, Some(ids));
                    d.create(dir, create_entry)
                }
                other => other,
            }
        }
    }

    #[tokio::test]
    async fn settle_waits_for_what_was_logged_before_it() {
        let d = std::sync::Arc::new(Delegations::new());
        let dir = InodeId(7);
        let Take::Ask(ticket) = d.create(dir, create_entry) else { panic!("ask") };
        d.granted(dir, ticket, Some(ids(100, 4)));
        d.settle().await; // nothing logged: at once
        let _ = d.create(dir, create_entry);
        let waiter = tokio::spawn({
            let d = d.clone();
            async move { d.settle().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "settled before the log was applied");
        assert!(d.hurried(), "a caller waits: the sender must not gather");
        let batch = d.next_batch();
        d.unsent(batch); // not sent: back in the log, still waited for
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        let batch = d.next_batch();
        d.applied(batch.last().unwrap().0);
        tokio::time::timeout(Duration::from_secs(5), waiter).await.expect("settled").unwrap();
        assert!(!d.hurried(), "nobody waits once the log is applied");
        let _ = d.create(dir, create_entry);
        assert!(!d.hurried(), "a create alone does not hurry the sender");
    }
}
