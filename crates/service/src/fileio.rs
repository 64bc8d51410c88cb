//! Reads of local files that never stall an async runtime for long: opens the dentry cache
//! alone can resolve (`openat2` with `RESOLVE_CACHED`), reads of what the page cache holds
//! (`preadv2` with `RWF_NOWAIT`), read-ahead advice, and the whole-range `pread` loop for the
//! blocking pool. stored reads its chunk files with them, and a client the chunk files of its
//! own node's targets (short-circuit reads). Owns nothing but these calls.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// Reads up to `len` bytes of `file` at `offset` on the calling thread, looping over short reads
/// and EINTR: fewer than `len` bytes only where the file ends.
pub fn read_at(file: &File, offset: u64, len: usize) -> io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    read_append(file, offset, len, &mut buf)?;
    Ok(buf)
}

/// [`read_at`] appending to `buf`; the bytes read.
pub fn read_append(file: &File, offset: u64, len: usize, buf: &mut Vec<u8>) -> io::Result<usize> {
    // Read into the spare capacity: zeroing megabytes first only to overwrite them costs a
    // memset per read.
    let start = buf.len();
    buf.reserve(len);
    while buf.len() - start < len {
        let have = buf.len() - start;
        let at = offset + have as u64;
        let rest = &mut buf.spare_capacity_mut()[..len - have];
        // SAFETY: `rest` is writable memory of `rest.len()` bytes that nothing else uses.
        let n = unsafe { libc::pread(file.as_raw_fd(), rest.as_mut_ptr().cast(), rest.len(), at as libc::off_t) };
        match n {
            0 => break,
            // SAFETY: pread wrote these `n` bytes (at most the length it was given).
            n if n > 0 => unsafe { buf.set_len(start + have + n as usize) },
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

/// Asks the kernel to read `len` bytes of `file` at `offset` into the page cache, without
/// waiting for them (`POSIX_FADV_WILLNEED`). Only advice: a failure is ignored, the read that
/// follows waits for the disk instead.
pub fn will_need(file: &File, offset: u64, len: u64) {
    // SAFETY: posix_fadvise takes no memory; the descriptor is open for the call.
    let _ = unsafe {
        libc::posix_fadvise(file.as_raw_fd(), offset as libc::off_t, len as libc::off_t, libc::POSIX_FADV_WILLNEED)
    };
}

/// Asks the kernel to drop the cached pages of `len` bytes of `file` at `offset`
/// (`POSIX_FADV_DONTNEED`; whole folios only, and none still in use). Only advice: a failure
/// is ignored, the pages stay cached.
pub fn dont_need(file: &File, offset: u64, len: u64) {
    // SAFETY: posix_fadvise takes no memory; the descriptor is open for the call.
    let _ = unsafe {
        libc::posix_fadvise(file.as_raw_fd(), offset as libc::off_t, len as libc::off_t, libc::POSIX_FADV_DONTNEED)
    };
}

/// Opens `path` read-only; `None` when there is no such file (a chunk file not written yet, a
/// hole to its readers), an error for anything else.
pub fn open_existing(path: &Path) -> io::Result<Option<File>> {
    match File::open(path) {
        Ok(f) => Ok(Some(f)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Opens `path` with `flags` (`O_CLOEXEC` is added) only if the kernel can resolve it from its
/// dentry cache alone (`openat2` with `RESOLVE_CACHED`, Linux ≥ 5.12): `None` when it would
/// have to read a directory from disk, and for every error (a missing file, an older kernel) —
/// the caller then takes the blocking path, which reports real errors.
pub fn open_cached(path: &Path, flags: libc::c_int) -> Option<File> {
    let c = CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: open_how is plain data; all-zero is its valid "no options" value.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (flags | libc::O_CLOEXEC) as u64;
    how.resolve = libc::RESOLVE_CACHED;
    // SAFETY: `c` is a NUL-terminated path and `how` a valid open_how of the size passed; both
    // outlive the call. A non-negative result is a new descriptor that nothing else owns.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            libc::AT_FDCWD,
            c.as_ptr(),
            &how as *const libc::open_how,
            size_of::<libc::open_how>(),
        )
    };
    // SAFETY: see above: `fd` is ours alone.
    (fd >= 0).then(|| unsafe { File::from_raw_fd(fd as i32) })
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
