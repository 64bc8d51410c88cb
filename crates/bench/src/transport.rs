//! The least CPU that moving bytes between two processes over loopback TCP costs on this
//! machine, for `odfs bench --mount`'s bound on reads of a striped file (docs/architecture.md,
//! "What a buffered read through the mount costs"): a default-stripe file's chunks on other
//! nodes reach the reading node over TCP whatever the filesystem does, so what their bytes cost
//! to move, measured the cheapest ways Linux offers, is spent on top of what serving all of the
//! file's bytes from a disk through FUSE costs.
//!
//! Owns the senders and receivers of that measurement. No disk and no filesystem: the bytes
//! come from one buffer per sender (the disk's DMA into it is counted by the FUSE + disk
//! minimum) and are spliced out of the socket into a pipe and from there into `/dev/null`,
//! with no copy on the receiving side (as odfs's spliced reads take them into the pipe they
//! splice into `/dev/fuse`). The bytes are neither checked nor kept: this bounds CPU from
//! below, it moves no data anyone uses.

use anyhow::{Context, Result};
use std::io::{self, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// Bytes a sender hands the kernel per call, and the pipes' size.
const BLOCK: usize = 1 << 20;

/// How a sender hands its bytes to the socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SendBy {
    /// `write(2)` from its buffer: the kernel copies them into socket buffers.
    Write,
    /// `vmsplice(2)` of its buffer's pages into a pipe, then `splice(2)` into the socket: the
    /// pages are referenced, not copied, on the sending side.
    Vmsplice,
}

impl SendBy {
    pub(crate) const ALL: [SendBy; 2] = [SendBy::Write, SendBy::Vmsplice];

    pub(crate) fn name(self) -> &'static str {
        match self {
            SendBy::Write => "write",
            SendBy::Vmsplice => "vmsplice",
        }
    }
}

/// Moves `bytes` in total over `streams` loopback connections at once (as `streams` readers of
/// as many files would), each spliced out on receipt; bytes received.
pub(crate) fn move_bytes(streams: usize, bytes: u64, how: SendBy) -> Result<u64> {
    let streams = streams.max(1);
    let each = bytes / streams as u64;
    over_loopback(
        streams,
        |k, conn| {
            let share = if k == 0 { each + bytes % streams as u64 } else { each };
            send(conn, share, how).with_context(|| format!("sending by {}", how.name()))
        },
        |conn| receive(&conn).context("splicing from the socket"),
    )
}

/// Runs `streams` loopback TCP connections at once, each with a sender thread running
/// `send(k, connection)` for stream `k` and a receiver thread running `receive(connection)`;
/// the bytes the receivers report, summed. Each connection is made before its threads start,
/// so a sender never waits in `accept` for a receiver that failed: a side that fails drops its
/// end, and the other's next call ends.
pub(crate) fn over_loopback<S, R>(streams: usize, send: S, receive: R) -> Result<u64>
where
    S: Fn(usize, TcpStream) -> Result<()> + Sync,
    R: Fn(TcpStream) -> Result<u64> + Sync,
{
    let (send, receive) = (&send, &receive);
    std::thread::scope(|s| {
        let (mut senders, mut receivers) = (Vec::new(), Vec::new());
        for k in 0..streams {
            let listener = TcpListener::bind("127.0.0.1:0").context("binding a loopback listener")?;
            let conn = TcpStream::connect(listener.local_addr()?).context("connecting to the sender")?;
            let (sending, _) = listener.accept().context("accepting the receiver")?;
            senders.push(s.spawn(move || send(k, sending)));
            receivers.push(s.spawn(move || receive(conn)));
        }
        for t in senders {
            t.join().map_err(|_| anyhow::anyhow!("a sender panicked"))??;
        }
        receivers.into_iter().map(|r| r.join().map_err(|_| anyhow::anyhow!("a receiver panicked"))?).sum()
    })
}

/// Sends `bytes` of one buffer's contents on `conn`, then closes it.
fn send(mut conn: TcpStream, bytes: u64, how: SendBy) -> io::Result<()> {
    // Not zeros: a page of zeros could be shared, which would make the copy cheaper.
    let buf: Vec<u8> = (0..BLOCK).map(|i| (i * 7 + 1) as u8).collect();
    let pipe = (how == SendBy::Vmsplice).then(pipe).transpose()?;
    let mut left = bytes;
    while left > 0 {
        let n = (left as usize).min(BLOCK);
        match &pipe {
            None => conn.write_all(&buf[..n])?,
            Some((r, w)) => vmsplice_to(&buf[..n], w.as_raw_fd(), r.as_raw_fd(), conn.as_raw_fd())?,
        }
        left -= n as u64;
    }
    conn.shutdown(std::net::Shutdown::Write)
}

/// Hands `buf`'s pages to pipe `w` and splices them from `r` into `sock`, all of them.
fn vmsplice_to(mut buf: &[u8], w: RawFd, r: RawFd, sock: RawFd) -> io::Result<()> {
    while !buf.is_empty() {
        let iov = libc::iovec { iov_base: buf.as_ptr() as *mut libc::c_void, iov_len: buf.len() };
        // SAFETY: the iovec describes `buf`, readable for its length; `w` is an open pipe.
        let n = retry(|| unsafe { libc::vmsplice(w, &iov, 1, 0) })?;
        splice_exactly(r, sock, n)?;
        buf = &buf[n..];
    }
    Ok(())
}

/// Splices everything `conn` receives into a pipe and out into `/dev/null`; bytes moved.
fn receive(conn: &TcpStream) -> io::Result<u64> {
    let (r, w) = pipe()?;
    let null = std::fs::OpenOptions::new().write(true).open("/dev/null")?;
    let mut total = 0u64;
    loop {
        // SAFETY: both descriptors are open for the call.
        let n = retry(|| unsafe {
            libc::splice(conn.as_raw_fd(), std::ptr::null_mut(), w.as_raw_fd(), std::ptr::null_mut(), BLOCK, 0)
        })?;
        if n == 0 {
            return Ok(total);
        }
        splice_exactly(r.as_raw_fd(), null.as_raw_fd(), n)?;
        total += n as u64;
    }
}

/// Splices exactly `len` bytes from pipe `from` into `to`.
fn splice_exactly(from: RawFd, to: RawFd, mut len: usize) -> io::Result<()> {
    while len > 0 {
        // SAFETY: both descriptors are open for the call.
        let n = retry(|| unsafe {
            libc::splice(from, std::ptr::null_mut(), to, std::ptr::null_mut(), len, libc::SPLICE_F_MOVE)
        })?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        len -= n;
    }
    Ok(())
}

/// A blocking pipe, `BLOCK` bytes where the system allows it (its default size where not:
/// every call then moves less, which only costs more calls).
fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just opened and are owned by nothing else.
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: `w` is an open pipe; a refusal leaves it as it was.
    unsafe { libc::fcntl(w.as_raw_fd(), libc::F_SETPIPE_SZ, BLOCK as libc::c_int) };
    Ok((r, w))
}

/// Runs a system call returning a count until it is not interrupted.
fn retry(mut call: impl FnMut() -> isize) -> io::Result<usize> {
    loop {
        let n = call();
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_byte_sent_is_received_either_way() {
        for how in SendBy::ALL {
            // Not a multiple of the streams or of a block: the remainders must arrive too.
            let bytes = 3 * BLOCK as u64 + 12_345;
            assert_eq!(move_bytes(3, bytes, how).unwrap(), bytes, "{how:?}");
        }
    }
}
