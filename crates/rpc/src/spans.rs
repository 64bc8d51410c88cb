//! Sending a frame's file spans (`codec::FileSpan`: stored's chunk reads) after its payload.
//!
//! On a TCP stream the bytes go from the file to the socket by `sendfile`: no read into a
//! buffer of stored's, no copy from that buffer into the socket (two copies of every byte read
//! less). The call may wait for the disk, so it runs on a blocking thread, on a duplicate of
//! the socket's descriptor (the stream may be dropped meanwhile), while the stream's writer
//! task waits for it — frames stay whole and in order. Other streams (QUIC) get the spans'
//! bytes read into a buffer and written as any payload. A file that ends before its span
//! (shrunk since the span was taken) is sent as zeros for the rest: the frame keeps the length
//! it announced, and the stream stays framed.

use odfs_proto::codec::FileSpan;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::fs::FileExt;
use std::time::Duration;
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tracing::warn;

/// How long a socket may take no bytes at all before the stream is given up.
const STALL: Duration = Duration::from_secs(60);

/// The write half of a stream frames are written to.
pub trait FrameSink: AsyncWrite + Unpin + Send + 'static {
    /// The TCP socket under this stream, when spans can be sent to it with `sendfile`.
    fn socket(&self) -> Option<RawFd> {
        None
    }
}

impl FrameSink for tokio::net::tcp::OwnedWriteHalf {
    fn socket(&self) -> Option<RawFd> {
        Some(self.as_ref().as_raw_fd())
    }
}

impl FrameSink for quinn::SendStream {}

#[cfg(test)]
impl FrameSink for tokio::io::DuplexStream {}

/// Writes the bytes of `spans`, in order, to `w` (flushed of everything before them).
pub(crate) async fn send<W: FrameSink>(w: &mut W, spans: &[FileSpan]) -> io::Result<()> {
    match w.socket() {
        Some(fd) => {
            // SAFETY: `fd` is the open socket `w` owns, borrowed only for this dup.
            let sock = unsafe { BorrowedFd::borrow_raw(fd) }.try_clone_to_owned()?;
            let spans = spans.to_vec();
            tokio::task::spawn_blocking(move || spans.iter().try_for_each(|s| sendfile_span(&sock, s)))
                .await
                .map_err(io::Error::other)?
        }
        None => {
            // All of a frame's spans in one hand-off: a prefetch batch has one per file.
            let spans = spans.to_vec();
            let read_all = move || {
                let mut buf = Vec::with_capacity(spans.iter().map(|s| s.len as usize).sum());
                spans.iter().try_for_each(|s| read_span_into(s, &mut buf)).map(|()| buf)
            };
            let buf = tokio::task::spawn_blocking(read_all).await.map_err(io::Error::other)??;
            w.write_all(&buf).await
        }
    }
}

/// Sends one span from its file to the (non-blocking) socket, waiting for room as it goes.
fn sendfile_span(sock: &OwnedFd, s: &FileSpan) -> io::Result<()> {
    let mut offset = s.offset as libc::off_t;
    let mut left = s.len as usize;
    while left > 0 {
        // SAFETY: both descriptors are open for the call; `offset` is a valid out-pointer.
        let n = unsafe { libc::sendfile(sock.as_raw_fd(), s.file.as_raw_fd(), &mut offset, left) };
        match n {
            0 => return send_zeros(sock, left),
            n if n > 0 => left -= n as usize,
            _ => {
                let e = io::Error::last_os_error();
                if matches!(e.raw_os_error(), Some(libc::EINVAL) | Some(libc::ENOSYS) | Some(libc::EOPNOTSUPP)) {
                    // A file system that cannot splice: the rest through a buffer.
                    let rest = FileSpan { file: s.file.clone(), offset: offset as u64, len: left as u32 };
                    let mut buf = Vec::new();
                    read_span_into(&rest, &mut buf)?;
                    return send_buf(sock, &buf);
                }
                if e.raw_os_error() == Some(libc::EIO) {
                    // The frame's length is announced: the stream can only be closed (the
                    // caller's call fails over), never finished with wrong bytes.
                    warn!(offset, error = %e, "reading a file while sending it failed; closing the stream");
                }
                wait_or_fail(sock, e)?
            }
        }
    }
    Ok(())
}

/// Sends all of `buf`, waiting for room as it goes.
fn send_buf(sock: &OwnedFd, mut buf: &[u8]) -> io::Result<()> {
    while !buf.is_empty() {
        // SAFETY: `buf` is readable for its length; the socket is open.
        let n = unsafe { libc::write(sock.as_raw_fd(), buf.as_ptr().cast(), buf.len()) };
        if n > 0 {
            buf = &buf[n as usize..];
        } else if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        } else {
            wait_or_fail(sock, io::Error::last_os_error())?;
        }
    }
    Ok(())
}

/// Zeros sent or spliced for bytes a file does not have (a hole, a file that ended early).
pub(crate) static ZEROS: [u8; 64 << 10] = [0; 64 << 10];

/// Sends `left` zero bytes: the rest of a span whose file ended early.
fn send_zeros(sock: &OwnedFd, mut left: usize) -> io::Result<()> {
    while left > 0 {
        let len = left.min(ZEROS.len());
        send_buf(sock, &ZEROS[..len])?;
        left -= len;
    }
    Ok(())
}

/// After a failed send: waits for room when the socket was only full (or the call was
/// interrupted), else fails with `e`.
fn wait_or_fail(sock: &OwnedFd, e: io::Error) -> io::Result<()> {
    match e.kind() {
        io::ErrorKind::Interrupted => Ok(()),
        io::ErrorKind::WouldBlock => {
            let mut p = libc::pollfd { fd: sock.as_raw_fd(), events: libc::POLLOUT, revents: 0 };
            // SAFETY: one valid pollfd.
            match unsafe { libc::poll(&mut p, 1, STALL.as_millis() as libc::c_int) } {
                0 => Err(io::Error::new(io::ErrorKind::TimedOut, "the peer took no bytes for 60 s")),
                n if n > 0 => Ok(()), // writable, or an error the next send reports
                _ => {
                    let e = io::Error::last_os_error();
                    if e.kind() == io::ErrorKind::Interrupted {
                        Ok(())
                    } else {
                        Err(e)
                    }
                }
            }
        }
        _ => Err(e),
    }
}

/// Appends a span's bytes to `buf` (zeros past the file's end).
fn read_span_into(s: &FileSpan, buf: &mut Vec<u8>) -> io::Result<()> {
    let start = buf.len();
    buf.resize(start + s.len as usize, 0);
    let mut at = 0;
    while start + at < buf.len() {
        match s.file.read_at(&mut buf[start + at..], s.offset + at as u64) {
            Ok(0) => break,
            Ok(n) => at += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
