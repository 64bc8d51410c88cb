//! Chunk bytes moved into a pipe without passing through a buffer of the receiver's
//! (docs/decisions/0017-spliced-reads.md).
//!
//! Owns the pipe a spliced reply is gathered in and the one exchange of a [`SpliceStream`]:
//! a request written as any frame, the reply's fixed part and body read as usual, and its
//! payload moved from the socket into the pipe by `splice(2)`, the kernel handing over the
//! pages it received (on loopback, stored's page-cache pages that `sendfile` sent) instead of
//! copying them out. A FUSE daemon then splices the pipe into `/dev/fuse`, where the kernel
//! copies the bytes once, into the page cache of the reader: one copy where a read into a
//! buffer makes two.
//!
//! A stream carries one exchange at a time (the reply's payload must be the next bytes on it),
//! so these streams are not multiplexed: a caller takes one, uses it, and gives it back only
//! after a whole exchange. Any failure leaves stream and pipe in an unknown state: both are
//! then dropped, never reused.

use crate::RpcError;
use odfs_proto::codec::{self, FrameHead, FRAME_FIXED, KIND_REPLY_ERR, KIND_REPLY_OK, MAX_FRAME};
use odfs_proto::{RequestHeader, Rpc};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::TcpStream;

/// Longest an exchange may take before it is given up (the caller falls back to a read that
/// retries); a payload that stops halfway is the only way it gets near this.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(30);

/// A pipe a reply is gathered in: its read end is what a consumer splices out.
pub struct Pipe {
    r: OwnedFd,
    w: OwnedFd,
    /// Bytes in it not yet spliced out.
    held: usize,
    /// Its capacity in bytes (`F_SETPIPE_SZ`).
    cap: usize,
}

impl Pipe {
    /// A pipe of at least `cap` bytes; fails as the kernel does (EPERM: `cap` is above
    /// `fs.pipe-max-size` for a process without `CAP_SYS_RESOURCE`).
    pub fn new(cap: usize) -> io::Result<Pipe> {
        let mut fds = [0; 2];
        // SAFETY: `fds` has room for the two descriptors pipe2 writes.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: both descriptors were just opened and are owned by nothing else.
        let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // SAFETY: `w` is an open pipe.
        let got = unsafe { libc::fcntl(w.as_raw_fd(), libc::F_SETPIPE_SZ, cap as libc::c_int) };
        if got < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Pipe { r, w, held: 0, cap: got as usize })
    }

    /// Bytes in the pipe.
    pub fn held(&self) -> usize {
        self.held
    }

    /// Whether `bytes` more, arriving in page-sized pieces or smaller, surely fit: each
    /// piece takes a slot of its own, so a page of slack is kept per `pieces` boundary.
    pub fn fits(&self, bytes: usize, pieces: usize) -> bool {
        let page = 4096;
        let slots = self.cap / page;
        let used = self.held.div_ceil(page) + 1;
        used + bytes.div_ceil(page) + pieces + 2 <= slots
    }

    /// Appends `buf` (a header, zeros for a hole) by copying it in.
    pub fn write_all(&mut self, mut buf: &[u8]) -> io::Result<()> {
        while !buf.is_empty() {
            // SAFETY: `buf` is readable for its length; the pipe is open.
            let n = unsafe { libc::write(self.w.as_raw_fd(), buf.as_ptr().cast(), buf.len()) };
            if n <= 0 {
                // Non-blocking and sized by `fits`: a full pipe is a caller's mistake.
                return Err(io::Error::last_os_error());
            }
            buf = &buf[n as usize..];
            self.held += n as usize;
        }
        Ok(())
    }

    /// Appends `len` zero bytes.
    pub fn write_zeros(&mut self, mut len: usize) -> io::Result<()> {
        use crate::spans::ZEROS;
        while len > 0 {
            let n = len.min(ZEROS.len());
            self.write_all(&ZEROS[..n])?;
            len -= n;
        }
        Ok(())
    }

    /// Appends up to `len` bytes of the file at `path` from `offset` (its page-cache pages, no
    /// copy; no file is a hole) and returns how many: fewer where the file ends. Runs on the
    /// blocking pool: the pages may have to come from the disk first.
    pub async fn splice_path(&mut self, path: std::path::PathBuf, offset: u64, len: usize) -> io::Result<usize> {
        let w = self.w.try_clone()?;
        let splice = move || match File::open(&path) {
            Ok(f) => splice_file(&f, &w, offset, len),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(0),
            Err(e) => Err(e),
        };
        let n = tokio::task::spawn_blocking(splice).await.map_err(io::Error::other)??;
        self.held += n;
        Ok(n)
    }

    /// Moves exactly `len` bytes from `sock` into the pipe, waiting for them as they arrive.
    async fn splice_socket(&mut self, sock: &TcpStream, len: usize) -> io::Result<()> {
        let mut left = len;
        while left > 0 {
            sock.readable().await?;
            let moved = sock.try_io(Interest::READABLE, || {
                // SAFETY: both descriptors are open for the call.
                let n = unsafe {
                    libc::splice(
                        sock.as_raw_fd(),
                        std::ptr::null_mut(),
                        self.w.as_raw_fd(),
                        std::ptr::null_mut(),
                        left,
                        libc::SPLICE_F_MOVE | libc::SPLICE_F_NONBLOCK,
                    )
                };
                if n < 0 {
                    Err(io::Error::last_os_error())
                } else {
                    Ok(n as usize)
                }
            });
            match moved {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => {
                    left -= n;
                    self.held += n;
                }
                Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Moves everything the pipe holds into `fd` in one call (a FUSE reply must arrive as one
    /// write); an error unless all of it went.
    pub fn splice_all_into(&mut self, fd: RawFd) -> io::Result<()> {
        let len = self.held;
        loop {
            // SAFETY: both descriptors are open for the call.
            let n = unsafe {
                libc::splice(
                    self.r.as_raw_fd(),
                    std::ptr::null_mut(),
                    fd,
                    std::ptr::null_mut(),
                    len,
                    libc::SPLICE_F_MOVE,
                )
            };
            if n >= 0 {
                self.held -= n as usize;
                return if n as usize == len { Ok(()) } else { Err(io::ErrorKind::WriteZero.into()) };
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

/// A bulk TCP stream used for one exchange at a time, its reply's payload spliced.
pub struct SpliceStream {
    sock: TcpStream,
    next_call: u64,
}

impl SpliceStream {
    /// Connects to a bulk listener and proves the job credential (as `tcp::connect` does).
    pub async fn connect(cred: &crate::JobCredential, addr: std::net::SocketAddr) -> Result<SpliceStream, RpcError> {
        Ok(SpliceStream { sock: crate::tcp::connect_stream(cred, addr).await?, next_call: 1 })
    }

    /// Sends `req`; [`Self::receive_into`] then takes its reply. `Err` leaves the stream
    /// unusable.
    pub async fn send<R: Rpc>(&mut self, header: &RequestHeader, req: &R) -> Result<u64, RpcError> {
        let call_id = self.next_call;
        self.next_call += 1;
        let frame = codec::encode_request(call_id, header, req)?;
        let write = async {
            self.sock.write_all(&frame.head).await?;
            for piece in frame.payload.pieces() {
                self.sock.write_all(piece).await?;
            }
            Ok::<_, io::Error>(())
        };
        tokio::time::timeout(EXCHANGE_TIMEOUT, write).await.map_err(|_| timed_out::<R>())??;
        Ok(call_id)
    }

    /// Appends the payload of the reply to call `call_id` (the last one sent) to `pipe` and
    /// returns its length. The reply's body is not decoded: whoever splices a reply wants its
    /// payload only (a chunk read's bytes). A remote error comes back as itself; any other
    /// `Err` leaves the stream and the pipe unusable.
    pub async fn receive_into<R: Rpc>(&mut self, call_id: u64, pipe: &mut Pipe) -> Result<usize, RpcError> {
        let receive = self.receive::<R>(call_id, pipe);
        tokio::time::timeout(EXCHANGE_TIMEOUT, receive).await.map_err(|_| timed_out::<R>())?
    }

    async fn receive<R: Rpc>(&mut self, call_id: u64, pipe: &mut Pipe) -> Result<usize, RpcError> {
        let mut prefix = [0u8; 4 + FRAME_FIXED];
        self.sock.read_exact(&mut prefix).await?;
        let len = u32::from_le_bytes(prefix[..4].try_into().expect("4 bytes")) as usize;
        if len > MAX_FRAME {
            return Err(odfs_proto::ProtoError::FrameTooLarge(len, MAX_FRAME).into());
        }
        let head = FrameHead::parse(&prefix[4..], len)?;
        if head.call_id != call_id || !matches!(head.kind, KIND_REPLY_OK | KIND_REPLY_ERR) {
            return Err(RpcError::Closed("a spliced stream answered out of turn".into()));
        }
        let mut body = vec![0u8; head.body_len(len)];
        self.sock.read_exact(&mut body).await?;
        if head.kind == KIND_REPLY_ERR {
            // An error reply always decodes to an error (a malformed one to a protocol error).
            let e = codec::decode_reply::<R>(head.kind, &body, Vec::new()).err();
            return Err(RpcError::Remote(e.unwrap_or_else(|| odfs_proto::ProtoError::Truncated.into())));
        }
        let n = head.payload as usize;
        if !pipe.fits(n, n.div_ceil(64 << 10) + 2) {
            return Err(io::Error::other(format!("a reply of {n} bytes does not fit the pipe")).into());
        }
        pipe.splice_socket(&self.sock, n).await?;
        Ok(n)
    }
}

/// Splices up to `len` bytes of `file` at `offset` into the pipe end `w`; how many (fewer
/// where the file ends).
fn splice_file(file: &File, w: &OwnedFd, offset: u64, len: usize) -> io::Result<usize> {
    let mut off = offset as libc::loff_t;
    let mut done = 0;
    while done < len {
        // SAFETY: both descriptors are open; `off` is a valid in/out offset.
        let n = unsafe {
            libc::splice(
                file.as_raw_fd(),
                &mut off,
                w.as_raw_fd(),
                std::ptr::null_mut(),
                len - done,
                libc::SPLICE_F_MOVE | libc::SPLICE_F_NONBLOCK,
            )
        };
        match n {
            0 => break,
            n if n > 0 => done += n as usize,
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(done)
}

fn timed_out<R: Rpc>() -> RpcError {
    RpcError::Timeout { method: R::NAME, addr: "a spliced stream".into(), secs: EXCHANGE_TIMEOUT.as_secs() }
}
