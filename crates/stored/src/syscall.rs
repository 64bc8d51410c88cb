//! The fallback data path: plain `pwrite`/`pread`/`fdatasync` on tokio's blocking pool, and the
//! calls that never wait for the disk (`openat2` with `RESOLVE_CACHED`, `preadv2` with
//! `RWF_NOWAIT`, shared with the client as `odfs_service::fileio`), which the chunk store makes
//! on its runtime worker before it hands a read over; and large aligned writes past the page
//! cache (`O_DIRECT`), the path of bulk chunk writes on either engine.
//!
//! The blocking calls are used where io_uring cannot be set up (or when asked for), and, on the
//! calling thread, for the first operation on a chunk file the store opens in the same blocking
//! call. Owns nothing but these calls: opening policy, caching and error wrapping stay in the
//! chunk store.

use bytes::Bytes;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub(crate) use odfs_service::fileio::{dont_need, read_at, read_nowait, will_need, NoWait};

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

/// fdatasync.
pub(crate) async fn fsync(file: Arc<File>) -> io::Result<()> {
    blocking(move || file.sync_data()).await
}

/// A chunk file opened for reading and writing from the dentry cache alone, or `None` (see
/// [`odfs_service::fileio::open_cached`]).
pub(crate) fn open_cached(path: &Path) -> Option<File> {
    odfs_service::fileio::open_cached(path, libc::O_RDWR)
}
