//! The fallback data path: plain `pwrite`/`pread`/`fdatasync` on tokio's blocking pool, and the
//! calls that never wait for the disk (`openat2` with `RESOLVE_CACHED`, `preadv2` with
//! `RWF_NOWAIT`), which the chunk store makes on its runtime worker before it hands a read over;
//! and large aligned writes past the page cache (`O_DIRECT`), the path of bulk chunk writes on
//! either engine.
//!
//! The blocking calls are used where io_uring cannot be set up (or when asked for), and, on the
//! calling thread, for the first operation on a chunk file the store opens in the same blocking
//! call. Owns nothing but these calls: opening policy, caching and error wrapping stay in the
//! chunk store.

use bytes::Bytes;
use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Alignment of `O_DIRECT` writes: offsets, lengths and buffers (the page size, a multiple of
/// any disk's logical block).
pub(crate) const DIRECT_ALIGN: usize = 4096;

/// Runs `f` on the blocking pool: these calls may wait for the disk, which must not stall a
/// runtime worker.
pub(crate) async fn blocking<T, F>(f: F) -> io::Result<T>
where
    F: FnOnce() -> io::Result<T> + Send + 'static,
    T: Send + 'static,
{
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r,
        Err(e) => Err(io::Error::other(format!("blocking I/O task failed: {e}"))),
    }
}

/// Writes all of `data` at `offset` (completing short writes), then fdatasyncs when `sync`.
pub(crate) async fn write(file: Arc<File>, offset: u64, data: Bytes, sync: bool) -> io::Result<usize> {
    blocking(move || write_at(&file, offset, &data, sync)).await
}

/// Reads up to `len` bytes at `offset`; fewer only where the file ends.
pub(crate) async fn read(file: Arc<File>, offset: u64, len: usize) -> io::Result<Vec<u8>> {
    blocking(move || read_at(&file, offset, len)).await
}

/// Writes all of `data` at `offset` of the file at `path` past the page cache (`O_DIRECT`,
/// through a descriptor of its own), then fdatasyncs when `sync`. `offset` and the length must
/// be multiples of `DIRECT_ALIGN`; so must the buffer's address, or the bytes are copied into
/// one that is (the transport aligns chunk data it receives, so that copy is the exception).
/// The kernel writes back and drops any cached pages of the range around the write, so
/// buffered reads and writes of the same file stay coherent.
pub(crate) async fn write_direct(path: PathBuf, offset: u64, data: Bytes, sync: bool) -> io::Result<usize> {
    blocking(move || {
        let f = OpenOptions::new().write(true).custom_flags(libc::O_DIRECT | libc::O_CLOEXEC).open(&path)?;
        if data.as_ptr().align_offset(DIRECT_ALIGN) == 0 {
            return write_at(&f, offset, &data, sync);
        }
        let mut buf: Vec<u8> = Vec::with_capacity(data.len() + DIRECT_ALIGN);
        let pad = buf.as_ptr().align_offset(DIRECT_ALIGN);
        buf.resize(pad, 0);
        buf.extend_from_slice(&data);
        write_at(&f, offset, &buf[pad..], sync)
    })
    .await
}

/// Whether the filesystem of `dir` takes `O_DIRECT` opens: a probe file is made, opened so and
/// removed. Any failure counts as no.
pub(crate) fn takes_direct(dir: &Path) -> bool {
    let probe = dir.join(".odfs-direct-probe");
    let ok = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
        .open(&probe)
        .is_ok();
    let _ = std::fs::remove_file(&probe);
    ok
}

/// [`write`] on the calling thread.
pub(crate) fn write_at(file: &File, offset: u64, data: &[u8], sync: bool) -> io::Result<usize> {
    // write_all_at loops over short writes and EINTR; a write that stops at ENOSPC returns the
    // error with the bytes before it written, never touching bytes outside the range.
    file.write_all_at(data, offset)?;
    if sync {
        file.sync_data()?;
    }
    Ok(data.len())
}

/// [`read`] on the calling thread, looping over short reads and EINTR: fewer than `len` bytes
/// only where the file ends.
pub(crate) fn read_at(file: &File, offset: u64, len: usize) -> io::Result<Vec<u8>> {
    // Read into the spare capacity: zeroing megabytes first only to overwrite them costs a
    // memset per read.
    let mut buf: Vec<u8> = Vec::with_capacity(len);
    while buf.len() < len {
        let have = buf.len();
        let at = offset + have as u64;
        let rest = &mut buf.spare_capacity_mut()[..len - have];
        // SAFETY: `rest` is writable memory of `rest.len()` bytes that nothing else uses.
        let n = unsafe { libc::pread(file.as_raw_fd(), rest.as_mut_ptr().cast(), rest.len(), at as libc::off_t) };
        match n {
            0 => break,
            // SAFETY: pread wrote these `n` bytes (at most the length it was given).
            n if n > 0 => unsafe { buf.set_len(have + n as usize) },
            _ => {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(buf)
}

/// Asks the kernel to read `len` bytes of `file` at `offset` into the page cache, without
/// waiting for them (`POSIX_FADV_WILLNEED`). Only advice: a failure is ignored, the read that
/// follows waits for the disk instead.
pub(crate) fn will_need(file: &File, offset: u64, len: u64) {
    // SAFETY: posix_fadvise takes no memory; the descriptor is open for the call.
    let _ = unsafe {
        libc::posix_fadvise(file.as_raw_fd(), offset as libc::off_t, len as libc::off_t, libc::POSIX_FADV_WILLNEED)
    };
}

/// fdatasync.
pub(crate) async fn fsync(file: Arc<File>) -> io::Result<()> {
    blocking(move || file.sync_data()).await
}

/// Opens `path` for reading and writing only if the kernel can resolve it from its dentry cache
/// alone (`openat2` with `RESOLVE_CACHED`, Linux ≥ 5.12): `None` when it would have to read a
/// directory from disk, and for every error (a missing file, an older kernel) — the caller then
/// takes the blocking path, which reports real errors.
pub(crate) fn open_cached(path: &Path) -> Option<File> {
    let c = CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: open_how is plain data; all-zero is its valid "no options" value.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (libc::O_RDWR | libc::O_CLOEXEC) as u64;
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
pub(crate) struct NoWait {
    /// The bytes the page cache held, from `offset` on.
    pub(crate) data: Vec<u8>,
    /// All `len` bytes were read, or the file ended: nothing is left to read from the disk.
    pub(crate) complete: bool,
}

/// Reads as much of `len` bytes at `offset` as the page cache holds, without waiting for the
/// disk (`preadv2` with `RWF_NOWAIT`): it stops at the first page that is not cached. Errors
/// other than "would block" are returned (`EOPNOTSUPP` where the filesystem cannot do it).
pub(crate) fn read_nowait(file: &File, offset: u64, len: usize) -> io::Result<NoWait> {
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
