//! Small files fetched ahead of their opens, a directory's at a time (docs/architecture.md,
//! "Cold small files: batched prefetch by directory").
//!
//! Owns the buffer of prefetched files, the directories prefetched lately and the prefetch
//! itself: when an open finds a small file neither in the kernel's page cache nor here, the
//! other small files of its directory that this client holds under a lease are read from
//! stored in batches (`ReadChunks`, one per target and up to `BATCH_FILES` files; a batch of
//! this node's own target is read from the chunk files), a few batches in flight per client.
//! One round trip and one hand-off at stored serve a batch instead of one file. A held file is
//! handed only to an open that finds the file's attributes unchanged since it was fetched (a
//! change elsewhere is recalled before it is acknowledged, and every change of a file's bytes
//! moves its change time); a recall drops it.

use crate::attr_cache::Ticket;
use crate::fs::{Client, Inner};
use odfs_proto::layout::Segment;
use odfs_proto::meta::Attr;
use odfs_proto::storage::{ChunkRange, READ_MANY_BYTES, READ_MANY_ITEMS};
use odfs_proto::{InodeId, TargetId, Timespec};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};
use tokio::sync::{watch, Notify, Semaphore};
use tracing::debug;

/// Files per batch: enough that a round trip is shared widely, few enough that the first
/// files of a directory arrive soon.
const BATCH_FILES: usize = 64;
/// Bytes per batch.
const BATCH_BYTES: u64 = 4 << 20;
/// Batches in flight per client: the disks see as many reads at once as eight readers give
/// them.
const IN_FLIGHT: usize = 8;
/// How long a prefetched file waits for its open, and how long a directory is not prefetched
/// again.
const AGE: Duration = Duration::from_secs(60);
/// Most files of one directory prefetched at once.
const DIR_FILES: usize = 1 << 16;
/// Directories remembered as prefetched before those older than `AGE` are swept.
const DIRS_SWEPT_AT: usize = 1 << 16;

const _: () = assert!(BATCH_FILES <= READ_MANY_ITEMS && BATCH_BYTES <= READ_MANY_BYTES);

/// Tells a prefetch which files the kernel holds already (odfs-fuse's record of fills).
pub type PrefetchSkip = Arc<dyn Fn(InodeId) -> bool + Send + Sync>;

/// A prefetched file and the attributes it was read under.
struct Held {
    size: u64,
    mtime: Timespec,
    ctime: Timespec,
    data: Vec<u8>,
    at: Instant,
}

impl Held {
    fn matches(&self, a: &Attr) -> bool {
        self.size == a.size && self.mtime == a.mtime && self.ctime == a.ctime
    }
}

#[derive(Default)]
struct State {
    files: HashMap<InodeId, Held>,
    /// Held files by age, oldest first (entries taken since are skipped).
    order: VecDeque<(InodeId, Instant)>,
    /// Bytes held and reserved by batches in flight.
    bytes: u64,
    /// Files in batches in flight: an open of one waits for its batch.
    pending: HashMap<InodeId, watch::Receiver<bool>>,
    /// Files in batches not sent yet, and how to hurry their batch (an open missed one).
    queued: HashMap<InodeId, Arc<Notify>>,
    /// Directories prefetched, and when.
    dirs: HashMap<InodeId, Instant>,
}

impl State {
    /// Drops files that waited longer than `AGE`.
    fn drop_aged(&mut self, now: Instant) {
        while let Some(&(ino, at)) = self.order.front() {
            if now.duration_since(at) < AGE {
                break;
            }
            self.order.pop_front();
            if self.files.get(&ino).is_some_and(|h| h.at == at) {
                let h = self.files.remove(&ino).expect("present");
                self.bytes -= h.data.len() as u64;
            }
        }
    }

    fn take(&mut self, ino: InodeId) -> Option<Held> {
        let h = self.files.remove(&ino)?;
        self.bytes -= h.data.len() as u64;
        Some(h)
    }
}

/// What the prefetch did, for `odfs stats` through the mount.
#[derive(Default, Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefetchCounts {
    /// Files read ahead into the buffer.
    pub fetched: u64,
    /// Opens served from the buffer.
    pub used: u64,
}

pub(crate) struct Prefetch {
    limit: u64,
    state: Mutex<State>,
    /// Signalled when bytes leave the buffer.
    room: Notify,
    slots: Semaphore,
    skip: OnceLock<PrefetchSkip>,
    fetched: AtomicU64,
    used: AtomicU64,
}

impl Prefetch {
    /// A buffer of at most `limit` bytes; 0 prefetches nothing.
    pub fn new(limit: u64) -> Prefetch {
        Prefetch {
            limit,
            state: Mutex::default(),
            room: Notify::new(),
            slots: Semaphore::new(IN_FLIGHT),
            skip: OnceLock::new(),
            fetched: AtomicU64::new(0),
            used: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("prefetch lock")
    }

    /// Takes the held copy of the file `attr` describes, if it was read under these same
    /// attributes; a copy read under others is dropped.
    fn take(&self, attr: &Attr) -> Option<Vec<u8>> {
        let h = self.lock().take(attr.ino)?;
        self.room.notify_waiters();
        if !h.matches(attr) || h.at.elapsed() >= AGE {
            return None;
        }
        self.used.fetch_add(1, Relaxed);
        Some(h.data)
    }

    /// The batch in flight that holds `ino`, if any.
    fn pending(&self, ino: InodeId) -> Option<watch::Receiver<bool>> {
        self.lock().pending.get(&ino).cloned()
    }

    /// Files of a batch made now: those neither held nor in another batch are entered as
    /// queued in it.
    fn queue(&self, items: Vec<Item>, urgent: &Arc<Notify>) -> Vec<Item> {
        let mut s = self.lock();
        let mine: Vec<Item> = items
            .into_iter()
            .filter(|i| {
                let ino = &i.attr.ino;
                !s.files.contains_key(ino) && !s.pending.contains_key(ino) && !s.queued.contains_key(ino)
            })
            .collect();
        for i in &mine {
            s.queued.insert(i.attr.ino, urgent.clone());
        }
        mine
    }

    /// The batch `items` were queued in is sent (or given up): they are queued no more.
    fn unqueue(&self, items: &[Item], urgent: &Arc<Notify>) {
        let mut s = self.lock();
        for i in items {
            if s.queued.get(&i.attr.ino).is_some_and(|u| Arc::ptr_eq(u, urgent)) {
                s.queued.remove(&i.attr.ino);
            }
        }
    }

    /// An open missed `ino`: hurries the batch it is queued in, if any; whether there was one.
    fn hurry(&self, ino: InodeId) -> bool {
        let Some(u) = self.lock().queued.get(&ino).cloned() else { return false };
        u.notify_one();
        true
    }

    /// Lets go of files that waited too long for their opens.
    fn drop_aged(&self) {
        self.lock().drop_aged(Instant::now());
        self.room.notify_waiters();
    }

    /// Drops what a recall names.
    pub fn recalled(&self, inos: &[InodeId]) {
        let mut s = self.lock();
        let before = s.bytes;
        for ino in inos {
            s.take(*ino);
        }
        if s.bytes != before {
            drop(s);
            self.room.notify_waiters();
        }
    }

    /// Whether directory `dir` should be prefetched now (not within `AGE`); marks it.
    fn start_dir(&self, dir: InodeId) -> bool {
        let now = Instant::now();
        let mut s = self.lock();
        if s.dirs.get(&dir).is_some_and(|t| now.duration_since(*t) < AGE) {
            return false;
        }
        if s.dirs.len() >= DIRS_SWEPT_AT {
            s.dirs.retain(|_, t| now.duration_since(*t) < AGE);
        }
        s.dirs.insert(dir, now);
        true
    }

    /// Waits until `bytes` more fit in the buffer and reserves them; false when no room
    /// came within `AGE`. A hurried batch (`hurried`, or `urgent` signalled meanwhile) may go
    /// a quarter over the bound: an open is waiting for one of its files.
    async fn reserve(&self, bytes: u64, mut hurried: bool, urgent: &Notify) -> bool {
        if bytes > self.limit {
            // Would never fit (a buffer set smaller than a batch).
            return false;
        }
        let deadline = tokio::time::Instant::now() + AGE;
        loop {
            let notified = self.room.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut s = self.lock();
                s.drop_aged(Instant::now());
                let bound = if hurried { self.limit + self.limit / 4 } else { self.limit };
                if s.bytes + bytes <= bound {
                    s.bytes += bytes;
                    return true;
                }
            }
            // Aged files leave without a signal: look again at least every second.
            let wait = tokio::time::Instant::now() + Duration::from_secs(1);
            tokio::select! {
                r = tokio::time::timeout_at(wait.min(deadline), notified) => {
                    if r.is_err() && tokio::time::Instant::now() >= deadline {
                        return false;
                    }
                }
                _ = urgent.notified(), if !hurried => hurried = true,
            }
        }
    }

    /// Files of a batch about to be sent: the ones neither held, nor in another batch, nor in
    /// the kernel's page cache, marked as in this one (`done` says when it is over).
    fn claim(&self, items: Vec<Item>, done: &watch::Receiver<bool>) -> Vec<Item> {
        let mut s = self.lock();
        // The kernel may have been handed some since the batch was made (their opens came
        // first).
        let mine: Vec<Item> = items
            .into_iter()
            .filter(|i| !s.files.contains_key(&i.attr.ino) && !s.pending.contains_key(&i.attr.ino))
            .filter(|i| !self.skipped(i.attr.ino))
            .collect();
        for i in &mine {
            s.pending.insert(i.attr.ino, done.clone());
        }
        mine
    }

    /// Enters a batch's files (those `fresh` accepts) and frees the rest of its reservation.
    fn settle(&self, items: &[Item], got: Vec<Option<Vec<u8>>>, reserved: u64, fresh: impl Fn(InodeId) -> bool) {
        let now = Instant::now();
        let mut s = self.lock();
        let (mut kept, mut files) = (0u64, 0u64);
        for (i, data) in items.iter().zip(got) {
            s.pending.remove(&i.attr.ino);
            let Some(data) = data.filter(|d| d.len() as u64 == i.attr.size) else { continue };
            if !fresh(i.attr.ino) {
                continue;
            }
            kept += data.len() as u64;
            files += 1;
            let a = &i.attr;
            let held = Held { size: a.size, mtime: a.mtime, ctime: a.ctime, data, at: now };
            if let Some(old) = s.files.insert(a.ino, held) {
                s.bytes -= old.data.len() as u64;
            }
            s.order.push_back((a.ino, now));
        }
        s.bytes -= reserved - kept;
        self.fetched.fetch_add(files, Relaxed);
        drop(s);
        self.room.notify_waiters();
    }

    fn skipped(&self, ino: InodeId) -> bool {
        self.skip.get().is_some_and(|f| f(ino))
    }
}

/// One file of a batch: its attributes and the range of its one chunk file.
#[derive(Clone)]
struct Item {
    attr: Attr,
    range: ChunkRange,
}

/// The one chunk-file range holding all of a file's bytes, when there is one.
fn whole_file(attr: &Attr) -> Option<(TargetId, ChunkRange)> {
    let layout = attr.layout.as_ref()?;
    let mut segs = layout.segments(0, attr.size);
    let Segment { target, local_offset, len, .. } = segs.next()?;
    (segs.next().is_none() && len == attr.size)
        .then_some((target, ChunkRange { ino: attr.ino, offset: local_offset, len: len as u32 }))
}

impl Client {
    /// Lets a prefetch leave out the files the kernel holds already.
    pub fn set_prefetch_skip(&self, skip: PrefetchSkip) {
        let _ = self.inner.prefetch.skip.set(skip);
    }

    /// What the prefetch did so far.
    pub fn prefetch_counts(&self) -> PrefetchCounts {
        let p = &self.inner.prefetch;
        PrefetchCounts { fetched: p.fetched.load(Relaxed), used: p.used.load(Relaxed) }
    }

    /// Reads `prefetch_counts` without keeping the client alive (for a closure the client
    /// itself holds, as `on_stats`'s).
    pub fn prefetch_counts_reader(&self) -> impl Fn() -> PrefetchCounts + Send + Sync + 'static {
        let inner = Arc::downgrade(&self.inner);
        move || inner.upgrade().map(|inner| Client { inner }.prefetch_counts()).unwrap_or_default()
    }

    /// The bytes of the file `attr` describes (a small file about to be filled at its open),
    /// if a prefetch holds them, without waiting. When none does and no batch in flight has
    /// the file, the batch it is queued in is sent next (with the file read alone meanwhile,
    /// the batch brings the others), or else its directory is prefetched (once per `AGE`).
    pub fn prefetched_now(&self, attr: &Attr) -> Option<Vec<u8>> {
        let p = &self.inner.prefetch;
        if p.limit == 0 {
            return None;
        }
        if let Some(d) = p.take(attr) {
            return Some(d);
        }
        if p.pending(attr.ino).is_none() && !p.hurry(attr.ino) {
            self.prefetch_parent(attr.ino);
        }
        None
    }

    /// The same, waiting for the batch in flight that holds the file, if one does.
    pub async fn prefetched(&self, attr: &Attr) -> Option<Vec<u8>> {
        let p = &self.inner.prefetch;
        if p.limit == 0 {
            return None;
        }
        if let Some(mut done) = p.pending(attr.ino) {
            // A batch that failed drops its sender: the wait ends either way.
            let _ = done.wait_for(|d| *d).await;
        }
        self.prefetched_now(attr)
    }

    /// Starts the prefetch of the directory `ino` was last cached under.
    fn prefetch_parent(&self, ino: InodeId) {
        let Some(dir) = self.inner.cache.parent(ino) else { return };
        if !self.inner.prefetch.start_dir(dir) {
            return;
        }
        let inner = Arc::downgrade(&self.inner);
        self.inner.runtime.spawn(prefetch_dir(inner, dir));
    }

    /// The files of `dir` worth prefetching, by target, in batches.
    fn prefetch_batches(&self, dir: InodeId) -> Vec<(TargetId, Vec<Item>)> {
        let limit = self.inner.cfg.fill_limit();
        let p = &self.inner.prefetch;
        let mut by_target: BTreeMap<TargetId, Vec<Item>> = BTreeMap::new();
        // Regular files only (`dir_files`).
        for attr in self.inner.cache.dir_files(dir, DIR_FILES) {
            if attr.size == 0 || attr.size > limit || p.skipped(attr.ino) {
                continue;
            }
            if let Some((target, range)) = whole_file(&attr) {
                by_target.entry(target).or_default().push(Item { attr, range });
            }
        }
        let mut batches = Vec::new();
        for (target, items) in by_target {
            let mut batch: Vec<Item> = Vec::new();
            let mut bytes = 0u64;
            for i in items {
                if !batch.is_empty() && (batch.len() == BATCH_FILES || bytes + i.attr.size > BATCH_BYTES) {
                    batches.push((target, std::mem::take(&mut batch)));
                    bytes = 0;
                }
                bytes += i.attr.size;
                batch.push(i);
            }
            if !batch.is_empty() {
                batches.push((target, batch));
            }
        }
        batches
    }

    /// Reads one batch into the buffer: when one of the client's slots is free, or at once
    /// when an open missed one of its files (`urgent`).
    async fn prefetch_batch(&self, target: TargetId, items: Vec<Item>, urgent: Arc<Notify>) {
        let p = &self.inner.prefetch;
        let (_slot, hurried) = tokio::select! {
            slot = p.slots.acquire() => (slot.ok(), false),
            _ = urgent.notified() => (None, true),
        };
        // Room first, then the files: an open waits for a batch that holds its file, so a
        // batch marks its files only once it can be sent.
        let reserved: u64 = items.iter().map(|i| i.attr.size).sum();
        let room = p.reserve(reserved, hurried, &urgent).await;
        p.unqueue(&items, &urgent);
        if !room {
            return;
        }
        let (tx, rx) = watch::channel(false);
        let items = p.claim(items, &rx);
        if items.is_empty() {
            p.settle(&[], Vec::new(), reserved, |_| false);
            return;
        }
        let ticket: Ticket = self.ticket();
        let got = match self.read_chunks(target, items.iter().map(|i| i.range).collect()).await {
            Ok(r) => split(r.lens, r.data, items.len()),
            Err(e) => {
                debug!(target, error = %e, "prefetch batch failed: its files are read at their opens");
                vec![None; items.len()]
            }
        };
        // A recall that crossed the read may have changed what it read.
        p.settle(&items, got, reserved, |ino| !self.kernel_ttl(ino, ticket).is_zero());
        let _ = tx.send(true);
    }
}

/// A `ReadChunks` reply's bytes, one buffer per range (`None`: failed or not all there).
fn split(lens: Vec<Option<u32>>, data: Vec<u8>, want: usize) -> Vec<Option<Vec<u8>>> {
    if lens.len() != want || lens.iter().map(|l| l.unwrap_or(0) as usize).sum::<usize>() != data.len() {
        return vec![None; want];
    }
    let mut at = 0;
    lens.into_iter()
        .map(|l| {
            l.map(|n| {
                let piece = data[at..at + n as usize].to_vec();
                at += n as usize;
                piece
            })
        })
        .collect()
}

/// Prefetches directory `dir`'s small files, every batch at once (the client's slots bound
/// how many are in flight).
async fn prefetch_dir(inner: Weak<Inner>, dir: InodeId) {
    let Some(inner) = inner.upgrade() else { return };
    let client = Client { inner };
    let p = &client.inner.prefetch;
    let batches: Vec<_> = client
        .prefetch_batches(dir)
        .into_iter()
        .map(|(t, items)| {
            let urgent = Arc::new(Notify::new());
            (t, p.queue(items, &urgent), urgent)
        })
        .filter(|(_, items, _)| !items.is_empty())
        .collect();
    debug!(%dir, batches = batches.len(), "prefetching a directory's small files");
    futures::future::join_all(batches.into_iter().map(|(t, items, u)| client.prefetch_batch(t, items, u))).await;
    // What no open took within `AGE` is let go of then, whether or not more prefetches come.
    let inner = Arc::downgrade(&client.inner);
    drop(client);
    tokio::time::sleep(AGE + Duration::from_secs(1)).await;
    if let Some(inner) = inner.upgrade() {
        inner.prefetch.drop_aged();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attr(ino: u64, size: u64, ctime: i64) -> Attr {
        crate::attr_cache::tests::file_attr(ino, size, ctime)
    }

    fn item(a: &Attr) -> Item {
        Item { attr: a.clone(), range: ChunkRange { ino: a.ino, offset: 0, len: a.size as u32 } }
    }

    #[test]
    fn a_held_file_is_handed_out_once_and_only_under_its_attributes() {
        let p = Prefetch::new(1 << 20);
        let (a, b, c) = (attr(1, 3, 10), attr(2, 4, 10), attr(3, 5, 10));
        let (_tx, rx) = watch::channel(false);
        let items = p.claim(vec![item(&a), item(&b), item(&c)], &rx);
        assert_eq!(items.len(), 3);
        p.lock().bytes += 12; // as `reserve` does
        assert!(p.claim(vec![item(&a)], &rx).is_empty(), "a file in a batch in flight is not claimed twice");
        assert!(p.pending(a.ino).is_some());
        // c came back short (changed since its attributes were read): not kept.
        let got = vec![Some(b"abc".to_vec()), Some(b"defg".to_vec()), Some(b"hi".to_vec())];
        p.settle(&items, got, 12, |_| true);
        assert!(p.pending(a.ino).is_none(), "settled");
        assert_eq!(p.lock().bytes, 7, "what is held, the rest of the reservation freed");
        assert_eq!(p.take(&a).as_deref(), Some(&b"abc"[..]));
        assert_eq!(p.take(&a), None, "handed out once");
        assert_eq!(p.take(&attr(2, 4, 11)), None, "changed since it was read: dropped");
        assert_eq!(p.take(&b), None, "and gone");
        assert_eq!(p.take(&c), None);
        assert_eq!(p.lock().bytes, 0);
    }

    #[test]
    fn a_recall_or_a_recall_crossing_the_read_drops_the_file() {
        let p = Prefetch::new(1 << 20);
        let (a, b) = (attr(1, 3, 10), attr(2, 3, 10));
        let (_tx, rx) = watch::channel(false);
        let items = p.claim(vec![item(&a), item(&b)], &rx);
        p.lock().bytes += 6;
        p.settle(&items, vec![Some(b"abc".to_vec()), Some(b"def".to_vec())], 6, |ino| ino != b.ino);
        assert_eq!(p.take(&b), None, "a recall crossed its read");
        p.recalled(&[a.ino]);
        assert_eq!(p.take(&a), None, "recalled after its read");
        assert_eq!(p.lock().bytes, 0);
    }

    #[tokio::test]
    async fn the_buffer_bound_holds_and_room_is_waited_for() {
        let p = Arc::new(Prefetch::new(10));
        let calm = Notify::new();
        assert!(p.reserve(8, false, &calm).await);
        assert!(!p.reserve(11, true, &calm).await, "larger than the whole buffer");
        let waiting = tokio::spawn({
            let p = p.clone();
            async move { p.reserve(5, false, &Notify::new()).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiting.is_finished(), "no room yet");
        // A batch of 8 reserved bytes kept 3: the rest is freed and the waiter goes on.
        let a = attr(1, 3, 10);
        let (_tx, rx) = watch::channel(false);
        let items = p.claim(vec![item(&a)], &rx);
        p.settle(&items, vec![Some(b"abc".to_vec())], 8, |_| true);
        assert!(waiting.await.unwrap());
        assert_eq!(p.lock().bytes, 8);
    }

    #[tokio::test]
    async fn a_missed_file_hurries_its_queued_batch_a_quarter_over_the_bound() {
        let p = Arc::new(Prefetch::new(8));
        let (a, b) = (attr(1, 2, 10), attr(2, 2, 10));
        let urgent = Arc::new(Notify::new());
        assert_eq!(p.queue(vec![item(&a), item(&b)], &urgent).len(), 2);
        assert!(p.queue(vec![item(&a)], &Arc::new(Notify::new())).is_empty(), "queued once");
        assert!(p.reserve(8, false, &Notify::new()).await, "the buffer is full");
        let batch = tokio::spawn({
            let (p, urgent) = (p.clone(), urgent.clone());
            async move { p.reserve(2, false, &urgent).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!batch.is_finished(), "no room");
        assert!(p.hurry(b.ino), "b's batch is queued");
        assert!(batch.await.unwrap(), "hurried: 8 + 2 bytes fit a quarter over the bound of 8");
        p.unqueue(&[item(&a), item(&b)], &urgent);
        assert!(!p.hurry(a.ino), "sent: queued no more");
        // A hurried batch that would go further over waits like any.
        assert!(tokio::time::timeout(Duration::from_millis(50), p.reserve(1, true, &urgent)).await.is_err());
    }

    #[test]
    fn a_reply_that_does_not_add_up_fails_every_range() {
        assert_eq!(
            split(vec![Some(2), None, Some(1)], b"abc".to_vec(), 3),
            vec![Some(b"ab".to_vec()), None, Some(b"c".to_vec())]
        );
        assert_eq!(split(vec![Some(2)], b"abc".to_vec(), 1), vec![None]);
        assert_eq!(split(vec![Some(3)], b"abc".to_vec(), 2), vec![None, None]);
    }

    #[test]
    fn a_directory_is_prefetched_once_per_age() {
        let p = Prefetch::new(1);
        assert!(p.start_dir(InodeId(7)));
        assert!(!p.start_dir(InodeId(7)));
        assert!(p.start_dir(InodeId(8)));
    }
}
