//! The io_uring data path: one ring per target, driven by the runtime's own worker threads.
//!
//! Owns the ring and every buffer while the kernel may touch it: an operation's `Vec<u8>` or
//! `Bytes` and its `Arc<File>` sit in the ring's slots from submission until its completion is
//! reaped (or the ring is dropped, which waits for them), so a caller that gives up waiting can
//! never free memory the kernel is still writing into. Does not open, cache or unlink files, and
//! does not wrap errors with paths (the chunk store does both).
//!
//! The task that asks for an operation submits it itself, under the ring's lock, and reaps what
//! has completed right then (a read the page cache answers completes within the submit). The
//! kernel signals every completion on an eventfd registered with the ring; one reaper task on the
//! runtime waits for it and finishes the rest. No thread of its own: a hand-off to a ring thread
//! and back costs two wake-ups per operation, which on a busy node cost more than a 4 KiB read
//! itself (docs/decisions/0011-io-uring-submitted-from-the-runtime.md). At most `max_ops`
//! operations and `max_bytes` bytes are in flight; the rest wait in order. Short transfers are
//! resubmitted for the remainder, so callers see whole writes (or an error) and reads that are
//! short only where the file ends.

use bytes::Bytes;
use io_uring::{opcode, squeue, types, IoUring};
use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;
use tokio::io::unix::AsyncFd;
use tokio::sync::oneshot;
use tokio::task::AbortHandle;
use tracing::{debug, error};

/// How much one ring keeps in flight.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub(crate) max_ops: usize,
    pub(crate) max_bytes: usize,
}

/// Times an operation is resubmitted after EINTR/EAGAIN before its error is returned.
const MAX_RETRIES: u32 = 16;

/// Handle of one ring. Dropping it waits for what is in flight (the kernel may still be using
/// its buffers); operations not yet submitted fail with "stopped".
pub(crate) struct Ring {
    name: String,
    state: Arc<Mutex<State>>,
    /// The reaper task, started by the first operation (the ring is made before the runtime
    /// runs it).
    reaper: OnceLock<io::Result<AbortHandle>>,
}

impl Ring {
    /// Sets up a ring, or says why io_uring cannot be used here.
    pub(crate) fn start(name: &str, limits: Limits) -> io::Result<Ring> {
        let limits = Limits { max_ops: limits.max_ops.max(1), max_bytes: limits.max_bytes.max(1) };
        let ring = setup(limits)?;
        let done = eventfd()?;
        ring.submitter()
            .register_eventfd(done.as_raw_fd())
            .map_err(|e| io::Error::new(e.kind(), format!("io_uring eventfd registration: {e}")))?;
        Ok(Ring {
            name: name.to_string(),
            state: Arc::new(Mutex::new(State::new(ring, limits, done))),
            reaper: OnceLock::new(),
        })
    }

    /// Queues `op`, submits what the budget allows and finishes what has completed already.
    fn send(&self, op: Op) -> io::Result<()> {
        self.reaper_running()?;
        let mut s = lock(&self.state);
        s.waiting.push_back(op);
        s.run();
        Ok(())
    }

    /// Starts the reaper on the current runtime the first time it is needed.
    fn reaper_running(&self) -> io::Result<()> {
        let started = self.reaper.get_or_init(|| {
            let rt = tokio::runtime::Handle::try_current().map_err(io::Error::other)?;
            let _in_rt = rt.enter();
            // SAFETY: the File owns its descriptor and moves into the AsyncFd, which it stays
            // inside (open, the same eventfd) until the AsyncFd is dropped.
            let fd = unsafe { AsyncFd::register(lock(&self.state).done.try_clone()?) }?;
            let (state, name) = (self.state.clone(), self.name.clone());
            Ok(rt.spawn(reap_completions(state, fd, name)).abort_handle())
        });
        match started {
            Ok(_) => Ok(()),
            Err(e) => Err(io::Error::new(e.kind(), format!("io_uring completion reaper: {e}"))),
        }
    }

    /// Writes all of `data` at `offset`, then fdatasyncs when `sync`.
    pub(crate) async fn write(&self, file: Arc<File>, offset: u64, data: Bytes, sync: bool) -> io::Result<usize> {
        let (reply, rx) = oneshot::channel();
        self.send(Op { file, offset, retries: 0, work: Work::Write { data, done: 0, sync, syncing: false, reply } })?;
        rx.await.map_err(|_| stopped())?
    }

    /// Reads up to `len` bytes at `offset`; fewer only where the file ends.
    pub(crate) async fn read(&self, file: Arc<File>, offset: u64, len: usize) -> io::Result<Vec<u8>> {
        let (reply, rx) = oneshot::channel();
        self.send(Op {
            file,
            offset,
            retries: 0,
            work: Work::Read { buf: Vec::with_capacity(len), want: len, reply },
        })?;
        rx.await.map_err(|_| stopped())?
    }

    /// fdatasync.
    pub(crate) async fn fsync(&self, file: Arc<File>) -> io::Result<()> {
        let (reply, rx) = oneshot::channel();
        self.send(Op { file, offset: 0, retries: 0, work: Work::Fsync { reply } })?;
        rx.await.map_err(|_| stopped())?
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        if let Some(Ok(h)) = self.reaper.get() {
            h.abort();
        }
        // Waiting here means no buffer or descriptor outlives the store while the kernel may
        // still use it.
        let mut s = lock(&self.state);
        s.waiting.clear();
        while s.slots.len > 0 {
            if let Err(e) = s.ring.submit_and_wait(1) {
                if !matches!(e.raw_os_error(), Some(libc::EINTR) | Some(libc::EBUSY)) {
                    error!(ring = %self.name, "io_uring_enter while stopping: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
            s.reap();
        }
    }
}

/// The reaper: finishes operations as the kernel signals their completions.
async fn reap_completions(state: Arc<Mutex<State>>, done: AsyncFd<File>, name: String) {
    debug!(ring = %name, "io_uring reaper started");
    loop {
        if lock(&state).unsubmitted {
            // The last submit failed (the kernel short of memory, say); retry it shortly, even
            // if no completion comes.
            tokio::time::sleep(Duration::from_millis(10)).await;
            lock(&state).run();
            continue;
        }
        let ready = done.readable().await;
        match ready {
            Ok(mut guard) => {
                // Reset the counter before reaping, so a completion posted meanwhile signals
                // again. Nothing to read: a spurious wake-up (the readiness is cleared).
                let mut b = [0u8; 8];
                if guard.try_io(|fd| fd.get_ref().read(&mut b)).is_err() {
                    continue;
                }
            }
            // Only when the runtime is shutting down, which drops this task anyway.
            Err(e) => {
                error!(ring = %name, "io_uring completion eventfd: {e}");
                return;
            }
        }
        lock(&state).run();
    }
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    // No code under the lock panics on purpose; if one did, the slots still hold the truth.
    state.lock().unwrap_or_else(|p| p.into_inner())
}

fn stopped() -> io::Error {
    io::Error::other("the io_uring engine of this target has stopped")
}

fn eventfd() -> io::Result<File> {
    // SAFETY: eventfd has no memory arguments; a non-negative result is a new descriptor we own.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor owned by nobody else.
    Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// Creates the ring and checks the kernel knows every opcode used here.
fn setup(limits: Limits) -> io::Result<IoUring> {
    // Room for every in-flight operation, so a push never finds the submission queue full.
    let entries = limits.max_ops.next_power_of_two().max(8) as u32;
    let ring = IoUring::new(entries).map_err(|e| io::Error::new(e.kind(), format!("io_uring_setup: {e}")))?;
    let mut probe = io_uring::Probe::new();
    ring.submitter()
        .register_probe(&mut probe)
        .map_err(|e| io::Error::new(e.kind(), format!("io_uring probe: {e}")))?;
    for (code, name) in [(opcode::Read::CODE, "READ"), (opcode::Write::CODE, "WRITE"), (opcode::Fsync::CODE, "FSYNC")] {
        if !probe.is_supported(code) {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("io_uring opcode {name} is not supported by this kernel"),
            ));
        }
    }
    Ok(ring)
}

/// One operation, owned by the ring's slots from submission to completion.
struct Op {
    file: Arc<File>,
    offset: u64,
    retries: u32,
    work: Work,
}

enum Work {
    Write {
        data: Bytes,
        done: usize,
        sync: bool,
        /// The data is written and the fdatasync is in flight.
        syncing: bool,
        reply: oneshot::Sender<io::Result<usize>>,
    },
    Read {
        /// Filled so far (its length); the kernel writes the rest into its spare capacity, so
        /// megabytes are not zeroed first only to be overwritten.
        buf: Vec<u8>,
        want: usize,
        reply: oneshot::Sender<io::Result<Vec<u8>>>,
    },
    Fsync {
        reply: oneshot::Sender<io::Result<()>>,
    },
}

enum Step {
    /// Submit the next part (the rest of a short transfer, or the fdatasync after a write).
    Again,
    Done(io::Result<()>),
}

impl Op {
    /// Bytes this operation counts against the in-flight budget.
    fn bytes(&self) -> usize {
        match &self.work {
            Work::Write { data, .. } => data.len(),
            Work::Read { want, .. } => *want,
            Work::Fsync { .. } => 0,
        }
    }

    /// The submission entry for the operation's next part.
    fn entry(&mut self, user_data: u64) -> squeue::Entry {
        let fd = types::Fd(self.file.as_raw_fd());
        let e = match &mut self.work {
            Work::Write { data, done, syncing: false, .. } => {
                let rest = &data[*done..];
                // Lengths fit u32: the store caps one operation at MAX_OP_BYTES.
                opcode::Write::new(fd, rest.as_ptr(), rest.len() as u32).offset(self.offset + *done as u64).build()
            }
            Work::Write { syncing: true, .. } | Work::Fsync { .. } => {
                opcode::Fsync::new(fd).flags(types::FsyncFlags::DATASYNC).build()
            }
            Work::Read { buf, want, .. } => {
                let have = buf.len();
                let rest = &mut buf.spare_capacity_mut()[..*want - have];
                // The pointer stays valid until the completion: the buffer is neither moved nor
                // resized while the operation is in flight (the slot owns it).
                opcode::Read::new(fd, rest.as_mut_ptr().cast(), rest.len() as u32)
                    .offset(self.offset + have as u64)
                    .build()
            }
        };
        e.user_data(user_data)
    }

    /// Accounts for a completion with result `res`.
    fn step(&mut self, res: i32) -> Step {
        if res == -libc::EINTR || res == -libc::EAGAIN {
            self.retries += 1;
            if self.retries <= MAX_RETRIES {
                return Step::Again;
            }
        }
        if res < 0 {
            return Step::Done(Err(io::Error::from_raw_os_error(-res)));
        }
        let n = res as usize;
        match &mut self.work {
            Work::Write { syncing: true, .. } | Work::Fsync { .. } => Step::Done(Ok(())),
            Work::Write { data, done, sync, syncing, .. } => {
                if n == 0 {
                    // A regular file never accepts zero bytes of a non-empty write without an
                    // error; looping would spin forever.
                    return Step::Done(Err(io::Error::new(io::ErrorKind::WriteZero, "write accepted no bytes")));
                }
                *done += n;
                if *done < data.len() {
                    Step::Again
                } else if *sync {
                    *syncing = true;
                    Step::Again
                } else {
                    Step::Done(Ok(()))
                }
            }
            Work::Read { buf, want, .. } => {
                let filled = buf.len() + n.min(*want - buf.len());
                // SAFETY: the kernel wrote these `n` bytes of the spare capacity (a read
                // returns at most the length it was given).
                unsafe { buf.set_len(filled) };
                if n == 0 || filled >= *want {
                    Step::Done(Ok(()))
                } else {
                    Step::Again
                }
            }
        }
    }

    /// Sends the outcome to the waiting task.
    fn finish(self, r: io::Result<()>) {
        let Op { file, work, .. } = self;
        // Close our reference before replying: a caller that then removes the chunk finds no
        // descriptor of it left open.
        drop(file);
        // A send fails only when the caller stopped waiting; the outcome is then nobody's.
        match work {
            Work::Write { data, reply, .. } => {
                let _ = reply.send(r.map(|()| data.len()));
            }
            Work::Read { buf, reply, .. } => {
                let _ = reply.send(r.map(|()| buf));
            }
            Work::Fsync { reply } => {
                let _ = reply.send(r);
            }
        }
    }
}

/// In-flight operations by slot index (the completion's user_data).
struct Slots {
    slots: Vec<Option<Op>>,
    free: Vec<usize>,
    len: usize,
}

impl Slots {
    fn insert(&mut self, op: Op) -> usize {
        self.len += 1;
        match self.free.pop() {
            Some(i) => {
                self.slots[i] = Some(op);
                i
            }
            None => {
                self.slots.push(Some(op));
                self.slots.len() - 1
            }
        }
    }

    fn take(&mut self, i: usize) -> Option<Op> {
        let op = self.slots.get_mut(i)?.take()?;
        self.free.push(i);
        self.len -= 1;
        Some(op)
    }
}

impl Drop for Slots {
    fn drop(&mut self) {
        // Reached with operations still present only if `Ring::drop` could not wait for them: the
        // kernel may still write into their buffers, so leak them rather than free them.
        for op in self.slots.drain(..).flatten() {
            std::mem::forget(op);
        }
    }
}

/// The ring and its bookkeeping, behind the handle's lock.
struct State {
    ring: IoUring,
    limits: Limits,
    slots: Slots,
    /// Bytes of the operations in `slots`.
    bytes: usize,
    /// Asked for but over budget; submitted in order as room frees up.
    waiting: VecDeque<Op>,
    /// Entries are in the submission queue that the kernel has not taken yet.
    unsubmitted: bool,
    /// The eventfd the kernel signals completions on (registered with the ring); also written
    /// here to wake the reaper after a failed submit.
    done: File,
    completions: Vec<(u64, i32)>,
}

impl State {
    fn new(ring: IoUring, limits: Limits, done: File) -> State {
        State {
            ring,
            limits,
            slots: Slots { slots: Vec::with_capacity(limits.max_ops), free: Vec::new(), len: 0 },
            bytes: 0,
            waiting: VecDeque::new(),
            unsubmitted: false,
            done,
            completions: Vec::new(),
        }
    }

    /// One round: finish what completed, admit what waits, hand the new entries to the kernel,
    /// then finish what completed during that submit (reads the page cache answers).
    fn run(&mut self) {
        self.reap();
        self.admit();
        self.submit();
        self.reap();
    }

    fn submit(&mut self) {
        match self.ring.submit() {
            Ok(_) => self.unsubmitted = false,
            // EINTR: interrupted; EBUSY/EAGAIN: completions to reap first, or the kernel short
            // of memory. The entries stay queued; the reaper, woken here, retries them.
            Err(e) => {
                if !matches!(e.raw_os_error(), Some(libc::EINTR) | Some(libc::EBUSY) | Some(libc::EAGAIN)) {
                    error!("io_uring_enter: {e}");
                }
                self.unsubmitted = true;
                let _ = (&self.done).write_all(&1u64.to_ne_bytes());
            }
        }
    }

    /// Moves waiting operations into the ring while the budget allows.
    fn admit(&mut self) {
        while let Some(op) = self.waiting.front() {
            let need = op.bytes();
            // An operation larger than the whole budget still goes, alone.
            let full = self.slots.len >= self.limits.max_ops || self.bytes + need > self.limits.max_bytes;
            if self.slots.len > 0 && full {
                break;
            }
            let Some(op) = self.waiting.pop_front() else { break };
            self.bytes += need;
            let i = self.slots.insert(op);
            self.issue(i);
        }
    }

    /// Submits the next part of the operation in slot `i`.
    fn issue(&mut self, i: usize) {
        let Some(op) = self.slots.slots.get_mut(i).and_then(Option::as_mut) else {
            return;
        };
        let e = op.entry(i as u64);
        if let Err(err) = self.push(&e) {
            self.finish(i, Err(err));
        }
    }

    fn push(&mut self, e: &squeue::Entry) -> io::Result<()> {
        for _ in 0..2 {
            // SAFETY: every buffer an entry points into belongs to an operation held in
            // `self.slots` until its completion is reaped (or leaked, see `Slots::drop`), and the
            // file it names is kept open by the operation's `Arc<File>`.
            if unsafe { self.ring.submission().push(e) }.is_ok() {
                return Ok(());
            }
            // The queue is sized for everything in flight, so this is not expected; hand the
            // queued entries to the kernel and try once more.
            self.ring.submit()?;
        }
        Err(io::Error::other("io_uring submission queue is full"))
    }

    fn reap(&mut self) {
        // Copy completions out first: follow-up submissions need the ring again.
        let mut done = std::mem::take(&mut self.completions);
        done.extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
        for &(user_data, res) in &done {
            let i = user_data as usize;
            let Some(op) = self.slots.slots.get_mut(i).and_then(Option::as_mut) else {
                error!("io_uring completion for unknown slot {i}");
                continue;
            };
            match op.step(res) {
                Step::Again => self.issue(i),
                Step::Done(r) => self.finish(i, r),
            }
        }
        done.clear();
        self.completions = done;
    }

    fn finish(&mut self, i: usize, r: io::Result<()>) {
        if let Some(op) = self.slots.take(i) {
            self.bytes -= op.bytes();
            op.finish(r);
        }
    }
}
