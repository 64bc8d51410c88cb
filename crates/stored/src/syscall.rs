//! The fallback data path: plain `pwrite`/`pread`/`fdatasync` on tokio's blocking pool, and the
//! calls that never wait for the disk (`openat2` with `RESOLVE_CACHED`, `preadv2` with
//! `RWF_NOWAIT`, the latter with `pread` in `odfs_service::file_io`), which the chunk store makes
//! on its runtime worker before it hands a read over.
//!
//! The blocking calls are used where io_uring cannot be set up (or when asked for), and, on the
//! calling thread, for the first operation on a chunk file the store opens in the same blocking
//! call. Owns nothing but these calls: opening policy, caching and error wrapping stay in the
//! chunk store.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

pub(crate) use odfs_service::file_io::{read_at, read_nowait, NoWait};

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
pub(crate) async fn write(file: Arc<File>, offset: u64, data: Vec<u8>, sync: bool) -> io::Result<usize> {
    blocking(move || write_at(&file, offset, &data, sync)).await
}

/// Reads up to `len` bytes at `offset`; fewer only where the file ends.
pub(crate) async fn read(file: Arc<File>, offset: u64, len: usize) -> io::Result<Vec<u8>> {
    blocking(move || read_at(&file, offset, len)).await
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
