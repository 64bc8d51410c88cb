//! FUSE over io_uring (kernel 6.14+, the `fuse` module's `enable_uring`): the session's second
//! transport (docs/architecture.md, "fuse-kernel"). After INIT agrees on it, one thread
//! per possible CPU owns an io_uring and registers ring entries on that CPU's queue (a header
//! buffer and a payload buffer each); a request made on that CPU lands in a free entry and
//! completes the thread's fetch of it; the answer is written into the same entry and committed
//! together with the fetch of the next request, in one submission.
//!
//! Owns the rings, their entries and who may write an entry when. A request is decoded from its
//! entry in place and dispatched like one from `/dev/fuse` ([`crate::session`]); its reply (a
//! [`Slot`]) may come from any thread: written into the entry once dispatch has returned (while
//! dispatch runs, the request's arguments still borrow the entry, so an early reply is kept
//! aside until then), then handed to the queue's thread, woken by an eventfd, to commit.
//! FORGET and INTERRUPT keep arriving on `/dev/fuse`, and notifications and backing-file
//! ioctls stay on it.
//!
//! What serves a queue's requests is a [`QueueHandler`]: the session's dispatches each to its
//! `Filesystem`; a handler may also submit operations of its own on the queue's ring
//! ([`Ops`]: a read from a disk or a socket straight into the entry's payload buffer) and
//! answer when they complete, on the queue's thread, without a thread between.

use crate::abi;
use crate::reply::Dev;
use io_uring::{opcode, squeue, types, IoUring};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;
use tracing::warn;

/// The io_uring commands of FUSE.
const CMD_REGISTER: u32 = 1;
const CMD_COMMIT_AND_FETCH: u32 = 2;
/// `struct fuse_uring_req_header`: `in_out` (128), `op_in` (128), `ring_ent_in_out` (32).
const RING_HEADER: usize = 288;
const OP_IN: usize = 128;
const ENT_COMMIT_ID: usize = 264;
const ENT_PAYLOAD_SZ: usize = 272;
/// Page size: buffers are page-aligned (`O_DIRECT` reads may land in them).
pub const PAGE: usize = 4096;

/// A page-aligned buffer the kernel reads and writes through a ring entry.
pub(crate) struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: owned memory; who may touch it when is the owner's protocol (see `Entry`).
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    fn layout(len: usize) -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(len.next_multiple_of(PAGE), PAGE).expect("a valid layout")
    }
    fn new(len: usize) -> AlignedBuf {
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(Self::layout(len)) };
        assert!(!ptr.is_null(), "out of memory for a ring buffer");
        AlignedBuf { ptr, len }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated by `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, Self::layout(self.len)) }
    }
}

/// The kernel's CPU queues: one per possible CPU (`/sys/devices/system/cpu/possible`).
pub fn possible_cpus() -> io::Result<usize> {
    let text = std::fs::read_to_string("/sys/devices/system/cpu/possible")?;
    let last = text.trim().rsplit(['-', ',']).next().and_then(|n| n.parse::<usize>().ok());
    last.map(|n| n + 1).ok_or_else(|| io::Error::other(format!("cannot read possible CPUs from {text:?}")))
}

/// Pushes `sqe`, submitting what is queued first when the submission queue is full.
fn push(ring: &mut IoUring<squeue::Entry128>, sqe: &squeue::Entry128) -> io::Result<()> {
    // SAFETY: every buffer an entry names lives as long as the ring.
    while unsafe { ring.submission().push(sqe) }.is_err() {
        ring.submit()?;
    }
    Ok(())
}

/// A FUSE io_uring command (`IORING_OP_URING_CMD` on `/dev/fuse`): REGISTER with the entry's
/// iovecs at `iov`, or COMMIT_AND_FETCH of `commit_id`.
fn ring_cmd(dev: RawFd, cmd: u32, commit_id: u64, qid: u16, iov: Option<u64>) -> squeue::Entry128 {
    // struct fuse_uring_cmd_req: flags, commit_id, qid.
    let mut area = [0u8; 80];
    area[8..16].copy_from_slice(&commit_id.to_le_bytes());
    area[16..18].copy_from_slice(&qid.to_le_bytes());
    let mut op = opcode::UringCmd80::new(types::Fd(dev), cmd).cmd(area);
    if iov.is_some() {
        op = op.addr(iov);
    }
    let sqe = op.build();
    if iov.is_none() {
        return sqe;
    }
    // REGISTER's `len` is the number of iovecs (2), a field the builder does not set.
    // SAFETY: an `Entry128` is a `repr(C)` 128-byte SQE; `len` is the u32 at byte 24.
    let mut raw: [u8; 128] = unsafe { std::mem::transmute(sqe) };
    raw[24..28].copy_from_slice(&2u32.to_le_bytes());
    // SAFETY: the same bytes back, with a valid `len`.
    unsafe { std::mem::transmute::<[u8; 128], squeue::Entry128>(raw) }
}

/// A reply made while its request was still being dispatched, written once dispatch returns.
enum Early {
    /// Its out error and bytes.
    Copied(i32, Vec<u8>),
    /// Its out error and the length of the bytes already in the payload buffer.
    Written(i32, usize),
}

/// Who holds an entry.
enum Held {
    /// The kernel: registered or committed, waiting for a request.
    Kernel,
    /// The queue's thread, dispatching the request in it; a reply made meanwhile waits here.
    Dispatching(Option<Early>),
    /// Dispatched, its reply not made yet: the replier writes the entry.
    Waiting,
}

/// One ring entry.
struct Entry {
    header: AlignedBuf,
    payload: AlignedBuf,
    iov: [libc::iovec; 2],
    held: Mutex<Held>,
}

// SAFETY: the iovecs point into the entry's own buffers; the rest is Send + Sync.
unsafe impl Send for Entry {}
unsafe impl Sync for Entry {}

/// A queue's state shared with whoever replies to its requests.
struct Queue {
    qid: u16,
    dev: Dev,
    entries: Vec<Entry>,
    /// Entries whose replies are written, to commit.
    ready: Mutex<Vec<u16>>,
    /// Wakes the queue's thread for `ready`.
    wake: OwnedFd,
    /// Set while the queue's thread waits for completions with `ready` seen empty: only then
    /// does a replier write `wake` (a thread that is awake finds `ready` before it waits).
    sleeping: AtomicBool,
    thread: ThreadId,
}

/// Where a reply to a request that came by ring goes: its entry.
#[derive(Clone)]
pub struct Slot {
    queue: Arc<Queue>,
    entry: u16,
}

impl Slot {
    /// The session's device (for ioctls such as backing-file registration).
    pub(crate) fn dev(&self) -> &Dev {
        &self.queue.dev
    }

    /// The entry's index in its queue (`0..entries`): a handler's key for per-entry state.
    pub fn index(&self) -> usize {
        self.entry as usize
    }

    /// The entry's payload buffer: page-aligned, [`Slot::payload_len`] bytes. A handler may
    /// have its own operations fill it from the time it is given the request until it answers
    /// with [`Slot::answer_written`]; the request's own payload (a WRITE's bytes) is gone then.
    pub fn payload(&self) -> *mut u8 {
        self.queue.entries[self.entry as usize].payload.ptr
    }

    /// Bytes the payload buffer holds.
    pub fn payload_len(&self) -> usize {
        self.queue.entries[self.entry as usize].payload.len
    }

    /// Answers the request: `error` (0 or -errno) and the reply's bytes, `parts` in order.
    pub fn answer(self, error: i32, parts: &[&[u8]]) {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let room = self.payload_len();
        let (error, parts) = if len > room {
            warn!(len, room, "a reply larger than its ring entry; answering EIO");
            (-libc::EIO, &[][..])
        } else {
            (error, parts)
        };
        // SAFETY (the second closure): `settle` calls it only while the entry's buffers are
        // this replier's.
        self.settle(|| Early::Copied(error, parts.concat()), |e| unsafe { write_reply(e, error, parts) })
    }

    /// Answers the request with the first `len` bytes of the payload buffer, which the
    /// handler's operations wrote there (see [`Slot::payload`]), or with `error` (-errno).
    pub fn answer_written(self, error: i32, len: usize) {
        let len = len.min(self.payload_len());
        // SAFETY (the second closure): as in `answer`.
        self.settle(|| Early::Written(error, len), |e| unsafe { write_header(e, error, len) })
    }

    /// Writes the reply by `write` where dispatch has returned, else keeps it as `early` for
    /// the queue's thread to write then; hands the entry to the queue's thread to commit.
    fn settle(self, early: impl FnOnce() -> Early, write: impl FnOnce(&Entry)) {
        let q = &self.queue;
        let e = &q.entries[self.entry as usize];
        let mut held = e.held.lock().expect("entry lock");
        match &mut *held {
            Held::Dispatching(slot @ None) => {
                *slot = Some(early());
                return;
            }
            Held::Waiting => {}
            _ => {
                warn!(qid = q.qid, entry = self.entry, "a second reply to one request; dropped");
                return;
            }
        }
        // `Waiting`: the request is dispatched and nothing else touches the entry's buffers
        // until it is committed.
        write(e);
        *held = Held::Kernel;
        drop(held);
        q.ready.lock().expect("ready lock").push(self.entry);
        if std::thread::current().id() != q.thread && q.sleeping.swap(false, Ordering::SeqCst) {
            let one = 1u64.to_ne_bytes();
            // SAFETY: writing 8 bytes to the queue's eventfd.
            let _ = unsafe { libc::write(q.wake.as_raw_fd(), one.as_ptr().cast(), 8) };
        }
    }
}

/// Writes a reply into entry `e`: its bytes into the payload, the out header into the header.
///
/// # Safety
/// No one else may touch the entry's buffers meanwhile.
unsafe fn write_reply(e: &Entry, error: i32, parts: &[&[u8]]) {
    let payload = std::slice::from_raw_parts_mut(e.payload.ptr, e.payload.len);
    let mut at = 0;
    if error == 0 {
        for p in parts {
            payload[at..at + p.len()].copy_from_slice(p);
            at += p.len();
        }
    }
    write_header(e, error, at);
}

/// Writes the out header of a reply of `len` payload bytes (none where `error` is set).
///
/// # Safety
/// No one else may touch the entry's buffers meanwhile.
unsafe fn write_header(e: &Entry, error: i32, len: usize) {
    let len = if error == 0 { len } else { 0 };
    let header = std::slice::from_raw_parts_mut(e.header.ptr, e.header.len);
    let unique = u64::from_le_bytes(header[8..16].try_into().expect("8 bytes"));
    header[..abi::OUT_HEADER].copy_from_slice(&abi::out_header(unique, len, -error));
    header[ENT_PAYLOAD_SZ..ENT_PAYLOAD_SZ + 4].copy_from_slice(&(len as u32).to_le_bytes());
}

/// What completed (low bits of a completion's `user_data`; the entry index, or the handler's
/// token, above them).
const FETCHED: u64 = 0;
const WOKEN: u64 = 1;
const OWN: u64 = 2;
const TAG_BITS: u32 = 2;

fn tag(entry: usize, what: u64) -> u64 {
    ((entry as u64) << TAG_BITS) | what
}

/// A request found in a ring entry: decoded in place (it borrows the entry until the call
/// returns), or the `unique` of one whose arguments did not decode.
pub type RingRequest<'a> = Result<abi::Request<'a>, (u64, abi::AbiError)>;

/// What serves the requests of one queue, on the queue's thread.
pub trait QueueHandler {
    /// A request arrived in `slot`'s entry; its answer goes to `slot`, now or later, from any
    /// thread.
    fn request(&mut self, slot: Slot, req: RingRequest<'_>, ops: &mut Ops<'_>);

    /// An operation this handler submitted with `token` completed with `result` (its CQE's).
    fn completed(&mut self, token: u64, result: i32, ops: &mut Ops<'_>) {
        let _ = (token, result, ops);
        warn!("a ring operation completed for a handler that submits none");
    }
}

/// A queue's ring, for the operations of its handler.
pub struct Ops<'r> {
    ring: &'r mut IoUring<squeue::Entry128>,
}

impl Ops<'_> {
    /// Queues `sqe` on the queue's ring (submitted with the queue's next wait); its completion
    /// comes to [`QueueHandler::completed`] with `token` (below 2^62). Flags such as
    /// `IO_LINK` are the caller's.
    ///
    /// # Safety
    /// Every buffer `sqe` names must stay valid until its completion (a slot's payload does,
    /// until the slot is answered).
    pub unsafe fn push(&mut self, sqe: squeue::Entry128, token: u64) -> io::Result<()> {
        push(self.ring, &sqe.user_data(tag(token as usize, OWN)))
    }
}

/// Registers `entries` entries of `payload` bytes on queue `qid` of the connection behind
/// `dev` and serves them with `handler` until the connection ends; returns how many requests
/// came. Every entry's registration failing is the error (the kernel then keeps using
/// `/dev/fuse`); an entry the kernel refuses later is given up with a warning while others are
/// left.
pub(crate) fn serve_queue(
    dev: &Dev,
    qid: u16,
    entries: usize,
    payload: usize,
    handler: &mut dyn QueueHandler,
) -> io::Result<u64> {
    let (mut ring, q) = register_queue(dev, qid, entries, payload)?;
    run_queue(&mut ring, &q, handler)
}

/// Sets queue `qid` up: its ring, its eventfd, `entries` entries of `payload` bytes, each
/// registered with the kernel (the registrations are submitted with the queue's first wait).
fn register_queue(
    dev: &Dev,
    qid: u16,
    entries: usize,
    payload: usize,
) -> io::Result<(IoUring<squeue::Entry128>, Arc<Queue>)> {
    // Room for every entry's fetch and two operations of its handler's, and the wake.
    let mut ring: IoUring<squeue::Entry128> =
        IoUring::builder().setup_single_issuer().setup_defer_taskrun().build((entries * 4 + 8) as u32)?;
    // SAFETY: eventfd(2) has no memory preconditions; the descriptor is owned from here.
    let wake = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    if wake < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor just made and owned by nobody else.
    let wake = unsafe { OwnedFd::from_raw_fd(wake) };
    let mut ents: Vec<Entry> = (0..entries)
        .map(|_| Entry {
            header: AlignedBuf::new(RING_HEADER),
            payload: AlignedBuf::new(payload),
            iov: [libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 }; 2],
            held: Mutex::new(Held::Kernel),
        })
        .collect();
    for e in &mut ents {
        e.iov = [
            libc::iovec { iov_base: e.header.ptr.cast(), iov_len: RING_HEADER },
            libc::iovec { iov_base: e.payload.ptr.cast(), iov_len: payload },
        ];
    }
    let q = Arc::new(Queue {
        qid,
        dev: dev.clone(),
        entries: ents,
        ready: Mutex::new(Vec::new()),
        wake,
        sleeping: AtomicBool::new(false),
        thread: std::thread::current().id(),
    });
    let fd = dev.as_raw_fd();
    for (i, e) in q.entries.iter().enumerate() {
        push(&mut ring, &ring_cmd(fd, CMD_REGISTER, 0, qid, Some(e.iov.as_ptr() as u64)).user_data(tag(i, FETCHED)))?;
    }
    Ok((ring, q))
}

/// Serves queue `q` on `ring` until the connection ends: submits, waits, hands each request
/// and each of the handler's completions to `handler`, commits the replies written meanwhile;
/// returns how many requests came.
fn run_queue(ring: &mut IoUring<squeue::Entry128>, q: &Arc<Queue>, handler: &mut dyn QueueHandler) -> io::Result<u64> {
    let (qid, entries, fd) = (q.qid, q.entries.len(), q.dev.as_raw_fd());
    let mut counter = [0u8; 8];
    let wake_sqe = |counter: &mut [u8; 8]| {
        squeue::Entry128::from(
            opcode::Read::new(types::Fd(q.wake.as_raw_fd()), counter.as_mut_ptr(), 8).build().user_data(tag(0, WOKEN)),
        )
    };
    push(ring, &wake_sqe(&mut counter))?;
    let mut served = 0u64;
    // Kept across passes: the loop allocates nothing per request.
    let (mut completions, mut committing) = (Vec::with_capacity(entries * 2 + 1), Vec::with_capacity(entries));
    // Entries the kernel holds or this thread serves: one the kernel refuses is lost to the
    // queue, which serves on with the others while any is left.
    let mut live = entries;
    loop {
        // Asleep only with nothing to commit; a reply pushed after this look finds the flag
        // set and writes the eventfd.
        q.sleeping.store(true, Ordering::SeqCst);
        let idle = q.ready.lock().expect("ready lock").is_empty();
        let waited = if idle { ring.submit_and_wait(1) } else { ring.submit() };
        q.sleeping.store(false, Ordering::SeqCst);
        match waited {
            // A signal, or completions to reap before more can be submitted: go on.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR) | Some(libc::EBUSY)) => {}
            r => drop(r?),
        }
        completions.clear();
        completions.extend(ring.completion().map(|c| (c.user_data(), c.result())));
        for &(data, res) in &completions {
            let (i, what) = ((data >> TAG_BITS) as usize, data & ((1 << TAG_BITS) - 1));
            match what {
                FETCHED if res < 0 => match -res {
                    // The connection ended (unmount, or aborted).
                    libc::ENOTCONN | libc::ENODEV | libc::ECANCELED | libc::ECONNABORTED => return Ok(served),
                    e => {
                        live -= 1;
                        let error = io::Error::from_raw_os_error(e);
                        if live == 0 {
                            return Err(error);
                        }
                        warn!(qid, entry = i, %error, "the kernel refused a ring entry; the queue serves on without it");
                    }
                },
                FETCHED => {
                    served += 1;
                    on_request(q, i, handler, &mut Ops { ring })
                }
                OWN => handler.completed(i as u64, res, &mut Ops { ring }),
                _ => push(ring, &wake_sqe(&mut counter))?,
            }
        }
        std::mem::swap(&mut committing, &mut *q.ready.lock().expect("ready lock"));
        for i in committing.drain(..) {
            let e = &q.entries[i as usize];
            // SAFETY: the entry is written and handed to this thread to commit.
            let header = unsafe { std::slice::from_raw_parts(e.header.ptr, RING_HEADER) };
            let commit_id = u64::from_le_bytes(header[ENT_COMMIT_ID..ENT_COMMIT_ID + 8].try_into().expect("8 bytes"));
            push(ring, &ring_cmd(fd, CMD_COMMIT_AND_FETCH, commit_id, qid, None).user_data(tag(i as usize, FETCHED)))?;
        }
    }
}

/// A request arrived in entry `i`: decoded in place and dispatched; a reply made during the
/// dispatch is written once it has returned.
fn on_request(q: &Arc<Queue>, i: usize, handler: &mut dyn QueueHandler, ops: &mut Ops<'_>) {
    let e = &q.entries[i];
    *e.held.lock().expect("entry lock") = Held::Dispatching(None);
    {
        // SAFETY: the kernel filled the entry and holds it no more; repliers write it only
        // once `held` says `Waiting`, after this borrow ends.
        let (header, payload) = unsafe {
            (
                std::slice::from_raw_parts(e.header.ptr, RING_HEADER),
                std::slice::from_raw_parts(e.payload.ptr, e.payload.len),
            )
        };
        let payload_sz = u32::from_le_bytes(header[ENT_PAYLOAD_SZ..ENT_PAYLOAD_SZ + 4].try_into().expect("4 bytes"));
        let payload = &payload[..(payload_sz as usize).min(payload.len())];
        let req = abi::Request::parse_parts(&header[..abi::IN_HEADER], &header[OP_IN..2 * OP_IN], payload);
        let unique = u64::from_le_bytes(header[8..16].try_into().expect("8 bytes"));
        handler.request(Slot { queue: q.clone(), entry: i as u16 }, req.map_err(|err| (unique, err)), ops);
    }
    let mut held = e.held.lock().expect("entry lock");
    match std::mem::replace(&mut *held, Held::Waiting) {
        Held::Dispatching(Some(early)) => {
            // SAFETY: dispatch has returned; the reply is this thread's to write.
            unsafe {
                match early {
                    Early::Copied(error, bytes) => write_reply(e, error, &[&bytes]),
                    Early::Written(error, len) => write_header(e, error, len),
                }
            }
            *held = Held::Kernel;
            q.ready.lock().expect("ready lock").push(i as u16);
        }
        Held::Dispatching(None) => {}
        other => *held = other,
    }
}
