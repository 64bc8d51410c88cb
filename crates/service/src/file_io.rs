//! Reading a file at an offset into a new buffer: all of it (waiting for the disk), or only
//! what the page cache holds (never waiting). Shared by stored, which serves chunk reads, and
//! the client library, which reads this node's own chunk files itself (docs/architecture.md,
//! "Reads of this node's own chunks"), and the process's limit on open descriptors, which bounds
//! how many chunk files either keeps open. Owns nothing but these calls.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

/// Largest read tried on a runtime worker with [`read_nowait`] before the hand-off to the
/// blocking pool: a page-cache copy of this much takes well under a millisecond, so the
/// worker's other tasks wait no longer than that.
pub const READ_NOW_MAX: usize = 1 << 20;

/// Reads up to `len` bytes at `offset`; fewer only where the file ends. May wait for the
/// disk: not for a runtime worker.
pub fn read_at(file: &File, offset: u64, len: usize) -> io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    read_append(file, offset, len, &mut buf)?;
    Ok(buf)
}

/// Appends up to `len` bytes at `offset` to `buf` (fewer where the file ends), looping over
/// short reads and EINTR; returns how many. On an error `buf` is as it was.
fn read_append(file: &File, offset: u64, len: usize, buf: &mut Vec<u8>) -> io::Result<usize> {
    let start = buf.len();
    // Read into the spare capacity: zeroing megabytes first only to overwrite them costs a
    // memset per read.
    buf.reserve(len);
    while buf.len() < start + len {
        let (have, want) = (buf.len(), start + len);
        let at = offset + (have - start) as u64;
        let rest = &mut buf.spare_capacity_mut()[..want - have];
        // SAFETY: `rest` is writable memory of `rest.len()` bytes that nothing else uses.
        let n = unsafe { libc::pread(file.as_raw_fd(), rest.as_mut_ptr().cast(), rest.len(), at as libc::off_t) };
        match n {
            0 => break,
            // SAFETY: pread wrote these `n` bytes (at most the length it was given).
            n if n > 0 => unsafe { buf.set_len(have + n as usize) },
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    buf.truncate(start);
                    return Err(e);
                }
            }
        }
    }
    Ok(buf.len() - start)
}

/// What [`read_nowait`] read.
pub struct NoWait {
    /// The bytes the page cache held, from `offset` on.
    pub data: Vec<u8>,
    /// All `len` bytes were read, or the file ended: nothing is left to read from the disk.
    pub complete: bool,
}

/// Reads as much of `len` bytes at `offset` as the page cache holds, without waiting for the
/// disk (`preadv2` with `RWF_NOWAIT`): it stops at the first page that is not cached. Errors
/// other than "would block" are returned (`EOPNOTSUPP` where the filesystem cannot do it).
pub fn read_nowait(file: &File, offset: u64, len: usize) -> io::Result<NoWait> {
    let mut data: Vec<u8> = Vec::with_capacity(len);
    loop {
        let filled = data.len();
        if filled == len {
            return Ok(NoWait { data, complete: true });
        }
        let spare = data.spare_capacity_mut();
        let iov = libc::iovec { iov_base: spare.as_mut_ptr().cast(), iov_len: len - filled };
        // SAFETY: the iovec points into `data`'s spare capacity, `len - filled` bytes long, which
        // nothing else references during the call; the descriptor is open (borrowed `file`).
        let n = unsafe {
            libc::preadv2(file.as_raw_fd(), &iov, 1, (offset + filled as u64) as libc::off_t, libc::RWF_NOWAIT)
        };
        match n {
            0 => return Ok(NoWait { data, complete: true }),
            n if n > 0 => {
                // SAFETY: the kernel initialised exactly `n` more bytes (n ≤ len - filled).
                unsafe { data.set_len(filled + n as usize) };
            }
            _ => {
                let e = io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EINTR) => {}
                    Some(libc::EAGAIN) => return Ok(NoWait { data, complete: false }),
                    _ => return Err(e),
                }
            }
        }
    }
}

/// The soft limit on this process's open descriptors (1024 where it cannot be read).
pub fn nofile_limit() -> usize {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes only into the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return 1024;
    }
    usize::try_from(lim.rlim_cur).unwrap_or(usize::MAX)
}

/// Raises the soft limit on open descriptors to the hard one (systemd and most shells start
/// processes at 1024, far below what a daemon holding files open for many callers needs).
/// Only advice: where it fails the limit stays as it was.
pub fn raise_nofile_limit() {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit and setrlimit read and write only the struct they are given.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}
