//! The io_uring data path: one thread per target owning an `IoUring`, fed over a channel.
//!
//! Owns the ring, its thread and every buffer while the kernel may touch it: an operation's
//! `Vec<u8>` and `Arc<File>` move into the thread and come back (or are dropped) only after its
//! completion is reaped, so a caller that gives up waiting can never free memory the kernel is
//! still writing into. Does not open, cache or unlink files, and does not wrap errors with paths
//! (the chunk store does both).
//!
//! Tasks send operations over a std channel and kick an eventfd; the thread keeps a one-shot poll
//! on that eventfd in the ring, so `submit_and_wait(1)` returns for a new submission as well as for
//! a completion and nothing queued waits behind slow I/O. At most `max_ops` operations and
//! `max_bytes` bytes are in flight; the rest wait in the channel. Short transfers are resubmitted
//! for the remainder, so callers see whole writes (or an error) and reads that are short only
//! where the file ends.

use bytes::Bytes;
use io_uring::{opcode, squeue, types, IoUring};
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::mpsc::{self, TryRecvError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;
use tokio::sync::oneshot;
use tracing::{debug, error};

/// How much one ring keeps in flight.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub(crate) max_ops: usize,
    pub(crate) max_bytes: usize,
}

/// user_data of the poll on the wake eventfd; operations use their slot index.
const WAKE: u64 = u64::MAX;
/// Times an operation is resubmitted after EINTR/EAGAIN before its error is returned.
const MAX_RETRIES: u32 = 16;

/// Handle of one ring thread. Dropping it lets the thread finish what is in flight, then joins it.
pub(crate) struct Ring {
    tx: Option<mpsc::Sender<Op>>,
    wake: Arc<File>,
    thread: Option<JoinHandle<()>>,
}

impl Ring {
    /// Sets up a ring and starts its thread, or says why io_uring cannot be used here.
    pub(crate) fn start(name: &str, limits: Limits) -> io::Result<Ring> {
        let limits = Limits { max_ops: limits.max_ops.max(1), max_bytes: limits.max_bytes.max(1) };
        let wake = Arc::new(eventfd()?);
        let (tx, rx) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        let thread_wake = wake.clone();
        // The ring is created on its own thread, which is the only one ever to submit to it.
        let thread = std::thread::Builder::new().name(format!("uring-{name}")).spawn(move || {
            let ring = match setup(limits) {
                Ok(r) => r,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            let _ = ready_tx.send(Ok(()));
            Worker::new(ring, rx, thread_wake, limits).run();
        })?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(Ring { tx: Some(tx), wake, thread: Some(thread) }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => {
                let _ = thread.join();
                Err(io::Error::other("io_uring thread exited during setup"))
            }
        }
    }

    fn send(&self, op: Op) -> io::Result<()> {
        let tx = self.tx.as_ref().ok_or_else(stopped)?;
        tx.send(op).map_err(|_| stopped())?;
        // The thread resets the counter before draining the channel, so this kick is never lost.
        (&*self.wake).write_all(&1u64.to_ne_bytes())
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
        // Closing the channel and kicking the thread makes it finish in-flight operations and
        // exit; joining means no buffer or descriptor outlives the store.
        drop(self.tx.take());
        let _ = (&*self.wake).write_all(&1u64.to_ne_bytes());
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                error!("io_uring thread panicked");
            }
        }
    }
}

fn stopped() -> io::Error {
    io::Error::other("the io_uring thread of this target has stopped")
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
    // Room for every in-flight operation plus the wake poll, so a push never finds the
    // submission queue full.
    let entries = (limits.max_ops + 1).next_power_of_two().max(8) as u32;
    let ring = IoUring::new(entries).map_err(|e| io::Error::new(e.kind(), format!("io_uring_setup: {e}")))?;
    let mut probe = io_uring::Probe::new();
    ring.submitter()
        .register_probe(&mut probe)
        .map_err(|e| io::Error::new(e.kind(), format!("io_uring probe: {e}")))?;
    for (code, name) in [
        (opcode::Read::CODE, "READ"),
        (opcode::Write::CODE, "WRITE"),
        (opcode::Fsync::CODE, "FSYNC"),
        (opcode::PollAdd::CODE, "POLL_ADD"),
    ] {
        if !probe.is_supported(code) {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("io_uring opcode {name} is not supported by this kernel"),
            ));
        }
    }
    Ok(ring)
}

/// One operation, owned by the ring thread from submission to completion.
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
        // Reached with operations still present only if the thread unwinds: the kernel may still
        // write into their buffers, so leak them rather than free them.
        for op in self.slots.drain(..).flatten() {
            std::mem::forget(op);
        }
    }
}

struct Worker {
    ring: IoUring,
    rx: mpsc::Receiver<Op>,
    wake: Arc<File>,
    limits: Limits,
    slots: Slots,
    /// Bytes of the operations in `slots`.
    bytes: usize,
    /// Received but over budget; goes first when room frees up.
    waiting: Option<Op>,
    /// The channel still has senders.
    open: bool,
    poll_armed: bool,
    completions: Vec<(u64, i32)>,
}

impl Worker {
    fn new(ring: IoUring, rx: mpsc::Receiver<Op>, wake: Arc<File>, limits: Limits) -> Worker {
        Worker {
            ring,
            rx,
            wake,
            limits,
            slots: Slots { slots: Vec::with_capacity(limits.max_ops), free: Vec::new(), len: 0 },
            bytes: 0,
            waiting: None,
            open: true,
            poll_armed: false,
            completions: Vec::new(),
        }
    }

    fn run(mut self) {
        debug!("io_uring thread started");
        loop {
            self.admit();
            if self.open && !self.poll_armed {
                let e =
                    opcode::PollAdd::new(types::Fd(self.wake.as_raw_fd()), libc::POLLIN as u32).build().user_data(WAKE);
                match self.push(&e) {
                    Ok(()) => self.poll_armed = true,
                    Err(e) => error!("io_uring: cannot arm the wake poll: {e}"),
                }
            }
            if !self.open && self.slots.len == 0 && self.waiting.is_none() {
                debug!("io_uring thread stopped");
                return;
            }
            if self.slots.len == 0 && !self.poll_armed {
                // Nothing could complete, so waiting would hang; retry arming shortly.
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            if let Err(e) = self.ring.submit_and_wait(1) {
                match e.raw_os_error() {
                    // Interrupted, or completions must be reaped first: reap below, go round.
                    Some(libc::EINTR) | Some(libc::EBUSY) => {}
                    _ => {
                        // EAGAIN/ENOMEM: the kernel is short of memory; back off, then retry.
                        error!("io_uring_enter: {e}");
                        std::thread::sleep(Duration::from_millis(10));
                    }
                }
            }
            self.reap();
        }
    }

    /// Moves operations from the channel into the ring while the budget allows.
    fn admit(&mut self) {
        loop {
            let op = match self.waiting.take() {
                Some(op) => op,
                None if !self.open => break,
                None => match self.rx.try_recv() {
                    Ok(op) => op,
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        self.open = false;
                        break;
                    }
                },
            };
            let need = op.bytes();
            // An operation larger than the whole budget still goes, alone.
            let full = self.slots.len >= self.limits.max_ops || self.bytes + need > self.limits.max_bytes;
            if self.slots.len > 0 && full {
                self.waiting = Some(op);
                break;
            }
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
            if user_data == WAKE {
                self.poll_armed = false;
                self.reset_wake();
                continue;
            }
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

    fn reset_wake(&mut self) {
        let mut b = [0u8; 8];
        // EAGAIN (counter already zero) is fine: the point is only to clear it.
        let _ = (&*self.wake).read(&mut b);
    }

    fn finish(&mut self, i: usize, r: io::Result<()>) {
        if let Some(op) = self.slots.take(i) {
            self.bytes -= op.bytes();
            op.finish(r);
        }
    }
}
