//! The FUSE-over-io_uring minimum: the striped large files of [`crate::minimum_fs`] served
//! through the kernel's io_uring transport for FUSE (kernel 6.14+, `enable_uring`) instead of
//! reads and writes of `/dev/fuse`, so that the least a default-striped 4 KiB read costs
//! through FUSE is measured with the cheapest transport this kernel has too.
//!
//! It is the same [`MinimumFs`] on the same session (`odfs_fuse_kernel`), with its queues
//! served by [`StripedReads`]: every request but a large file's READ is dispatched as the
//! session dispatches it; a READ never leaves the queue's thread: one chunk in four (this
//! node's) is an `O_DIRECT` read of the plain directory's file straight into the ring entry's
//! payload buffer, the other three a range request to the [`FileServer`](crate::minimum_fs::FileServer)
//! and its bytes received into that same buffer, each submitted on the queue's own ring
//! (`Ops`) with the reply and the fetch of the next request. Before the rings are ready (and
//! for FORGET and INTERRUPT, which never use them) requests arrive on `/dev/fuse` and are
//! answered there, by the minimum's own reads.

use crate::minimum_fs::{range_request, MinimumFs, MinimumMount, StripedRead};
use io_uring::{opcode, squeue, types};
use odfs_fuse_kernel::abi::Op;
use odfs_fuse_kernel::ring::{Ops, QueueHandler, RingRequest, Slot};
use odfs_fuse_kernel::session::{Dispatch, RingOptions};
use std::fs::File;
use std::io::Read;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Mounts `fs` (striped large files: `with_remote_large` and `with_disk_large`) at `at`, its
/// queues holding `entries` requests each and reading on their rings. Fails when the kernel
/// offers no io_uring transport (`enable_uring` off, or too old).
pub fn mount(fs: MinimumFs, at: &Path, entries: usize) -> std::io::Result<UringMount> {
    if entries == 0 {
        return Err(std::io::Error::other("the io_uring minimum needs ring entries"));
    }
    let requests = Arc::new(AtomicU64::new(0));
    let counted = requests.clone();
    let handler: odfs_fuse_kernel::session::QueueMaker<MinimumFs> =
        Arc::new(move |dispatch| Box::new(StripedReads::new(dispatch, entries, counted.clone())));
    let mount = fs.mount_uring(at, RingOptions { entries: Some(entries), handler: Some(handler) })?;
    Ok(UringMount { mount, requests })
}

/// A mounted io_uring minimum.
pub struct UringMount {
    mount: MinimumMount,
    requests: Arc<AtomicU64>,
}

/// What a mount's rings answered.
#[derive(Debug, Default, Clone, Copy)]
pub struct Served {
    /// Requests (the rest came on `/dev/fuse`).
    pub requests: u64,
}

impl UringMount {
    /// Unmounts and waits for every serving thread; returns what the rings answered.
    pub fn unmount(self) -> std::io::Result<Served> {
        self.mount.unmount()?;
        Ok(Served { requests: self.requests.load(Ordering::Relaxed) })
    }
}

/// A queue's handler: large files' READs read on the queue's ring, the rest dispatched.
struct StripedReads {
    dispatch: Dispatch<MinimumFs>,
    /// Requests the mount's queues were given.
    requests: Arc<AtomicU64>,
    /// Per ring entry of the queue (never resized: its request buffers are named by
    /// operations on the ring).
    entries: Vec<Pending>,
}

/// A ring entry's READ in progress, and its connections to the file servers.
struct Pending {
    /// Where the READ in progress is answered.
    slot: Option<Slot>,
    /// Per file: a connection to its server (kept for the entry's next READs).
    conns: Vec<Option<TcpStream>>,
    /// The range request being sent.
    request: [u8; 16],
    /// Bytes the READ in progress asked for.
    want: usize,
    /// The file whose connection the READ in progress uses, if it is fetched over TCP.
    fetching: Option<usize>,
}

/// The low bit of an operation's token: its send (whose failure fails its linked receive
/// too, which answers); the entry index above it.
const SENT: u64 = 1;

impl StripedReads {
    fn new(dispatch: Dispatch<MinimumFs>, entries: usize, requests: Arc<AtomicU64>) -> StripedReads {
        let files = dispatch.fs().large_files();
        let entries = (0..entries)
            .map(|_| Pending {
                slot: None,
                conns: (0..files).map(|_| None).collect(),
                request: [0; 16],
                want: 0,
                fetching: None,
            })
            .collect();
        StripedReads { dispatch, requests, entries }
    }

    /// Starts `read` for the READ in `slot`'s entry: one operation (a disk read) or two (a
    /// send and its linked receive) on the ring, or the answer at once.
    fn start(&mut self, slot: Slot, read: StripedRead, ops: &mut Ops<'_>) {
        let room = slot.payload_len();
        match read {
            StripedRead::Empty => slot.answer_written(0, 0),
            StripedRead::Disk { fd, offset, want, len } if want <= room => {
                self.read_disk(slot, fd, offset, want, len, ops)
            }
            StripedRead::Remote { k, addr, offset, len } if len <= room => self.fetch(slot, k, addr, offset, len, ops),
            StripedRead::Disk { .. } | StripedRead::Remote { .. } => slot.answer_written(-libc::EIO, 0),
        }
    }

    /// `want` bytes of `fd` at `offset` read into the entry's payload; `len` of them answered.
    fn read_disk(&mut self, slot: Slot, fd: RawFd, offset: u64, want: usize, len: usize, ops: &mut Ops<'_>) {
        let (i, buf) = (slot.index(), slot.payload());
        let p = &mut self.entries[i];
        (p.want, p.fetching, p.slot) = (len, None, Some(slot));
        let sqe = opcode::Read::new(types::Fd(fd), buf, want as u32).offset(offset).build();
        // SAFETY: the payload stays this handler's until the slot is answered, at the read's
        // completion.
        answer_unpushed(p, unsafe { ops.push(sqe.into(), (i as u64) << 1) })
    }

    /// `len` bytes at `offset` asked of file `k`'s server and received into the entry's
    /// payload, on the entry's connection to it (made on first use).
    fn fetch(&mut self, slot: Slot, k: usize, addr: SocketAddr, offset: u64, len: usize, ops: &mut Ops<'_>) {
        let (i, buf) = (slot.index(), slot.payload());
        let p = &mut self.entries[i];
        let fd = match &p.conns[k] {
            Some(c) => c.as_raw_fd(),
            None => match crate::minimum_fs::connect(addr) {
                Ok(c) => p.conns[k].insert(c).as_raw_fd(),
                Err(e) => return slot.answer_written(-e.raw_os_error().unwrap_or(libc::EIO), 0),
            },
        };
        (p.want, p.fetching, p.slot) = (len, Some(k), Some(slot));
        p.request = range_request(offset, len);
        let send = opcode::Send::new(types::Fd(fd), p.request.as_ptr(), 16).build().flags(squeue::Flags::IO_LINK);
        let recv = opcode::Recv::new(types::Fd(fd), buf, len as u32).flags(libc::MSG_WAITALL).build();
        // SAFETY: the request buffer is this entry's and is not rewritten before the send
        // completes (the entry's next READ comes after this one's answer); the payload is as
        // in `read_disk`.
        let pushed = unsafe { ops.push(send.into(), ((i as u64) << 1) | SENT) }
            .and_then(|()| unsafe { ops.push(recv.into(), (i as u64) << 1) });
        answer_unpushed(p, pushed)
    }

    /// Entry `i`'s READ bytes arrived (`res` of them, or -errno): answers the READ. A fetch
    /// that failed or came short (the server closes at a range past its file's end) is an EIO,
    /// and its connection is dropped; a disk read comes short only at the file's end.
    fn filled(&mut self, i: usize, res: i32) {
        let p = &mut self.entries[i];
        let Some(slot) = p.slot.take() else { return };
        let fetched = p.fetching.take();
        if res < 0 || (fetched.is_some() && (res as usize) < p.want) {
            if let Some(k) = fetched {
                p.conns[k] = None;
            }
            let errno = if res < 0 && res != -libc::ECANCELED { -res } else { libc::EIO };
            return slot.answer_written(-errno, 0);
        }
        slot.answer_written(0, (res as usize).min(p.want))
    }
}

/// A READ whose operations could not be queued is answered with the error at once.
fn answer_unpushed(p: &mut Pending, pushed: std::io::Result<()>) {
    if let Err(e) = pushed {
        p.fetching = None;
        if let Some(slot) = p.slot.take() {
            slot.answer_written(-e.raw_os_error().unwrap_or(libc::EIO), 0);
        }
    }
}

impl QueueHandler for StripedReads {
    fn request(&mut self, slot: Slot, req: RingRequest<'_>, ops: &mut Ops<'_>) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        let read = match &req {
            Ok(r) => match r.op {
                Op::Read { offset, size, .. } => self.dispatch.fs().striped_read(r.header.nodeid, offset, size),
                _ => None,
            },
            Err(_) => None,
        };
        match read {
            Some(read) => self.start(slot, read, ops),
            None => self.dispatch.request(slot, req, ops),
        }
    }

    fn completed(&mut self, token: u64, result: i32, _ops: &mut Ops<'_>) {
        if token & SENT == 0 {
            self.filled((token >> 1) as usize, result);
        }
    }
}

/// The kernel's switch for FUSE's io_uring transport: a FUSE daemon may ask for it only while
/// this is `Y` (it changes nothing for daemons that do not ask for it).
pub const ENABLE_URING: &str = "/sys/module/fuse/parameters/enable_uring";

/// Where users of [`TransportAllowed`] on this machine meet: the first file is held exclusively
/// while the switch is changed and holds its value from before the first user; the second is
/// held shared by every user for as long as it needs the transport.
const SWITCH_LOCK: &str = "/tmp/.odfs-fuse-uring.switch";
const USERS_LOCK: &str = "/tmp/.odfs-fuse-uring.users";

/// The io_uring transport allowed for as long as this lives (`ENABLE_URING` set to `Y`), and
/// the switch put back as it was when the last such guard on the machine is dropped (a
/// benchmark and tests may hold one at once, in processes of their own).
pub struct TransportAllowed {
    switch: File,
    users: File,
}

impl TransportAllowed {
    /// Allows the transport; fails when this kernel has none (no `ENABLE_URING`) or it cannot
    /// be switched on (not root).
    pub fn new() -> std::io::Result<TransportAllowed> {
        let open = |p| std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(p);
        let (switch, users) = (open(SWITCH_LOCK)?, open(USERS_LOCK)?);
        flock(&switch, libc::LOCK_EX)?;
        flock(&users, libc::LOCK_SH)?;
        let allowed = Self::switch_on(&switch);
        flock(&switch, libc::LOCK_UN)?;
        allowed.map(|()| TransportAllowed { switch, users })
    }

    /// Sets the switch to `Y`, keeping what it was in `switch` unless a user before did.
    fn switch_on(switch: &File) -> std::io::Result<()> {
        let was = std::fs::read_to_string(ENABLE_URING).map_err(|e| {
            std::io::Error::new(e.kind(), format!("this kernel has no FUSE io_uring transport ({ENABLE_URING}: {e})"))
        })?;
        if was.trim() == "Y" {
            return Ok(());
        }
        std::fs::write(ENABLE_URING, "Y")
            .map_err(|e| std::io::Error::new(e.kind(), format!("cannot allow FUSE io_uring ({ENABLE_URING}: {e})")))?;
        switch.set_len(0)?;
        switch.write_all_at(was.trim().as_bytes(), 0)
    }
}

impl Drop for TransportAllowed {
    fn drop(&mut self) {
        if flock(&self.switch, libc::LOCK_EX).is_err() {
            return;
        }
        // The last user (no other holds `users`) puts the switch back and forgets its value.
        if flock(&self.users, libc::LOCK_EX | libc::LOCK_NB).is_ok() {
            let mut was = String::new();
            if self.switch.read_to_string(&mut was).is_ok() && !was.is_empty() {
                let _ = std::fs::write(ENABLE_URING, was.trim());
                let _ = self.switch.set_len(0);
            }
        }
    }
}

fn flock(f: &File, how: i32) -> std::io::Result<()> {
    // SAFETY: flock(2) on an open descriptor.
    if unsafe { libc::flock(f.as_raw_fd(), how) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
