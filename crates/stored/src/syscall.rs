//! The fallback data path: plain `pwrite`/`pread`/`fdatasync` on tokio's blocking pool.
//!
//! Used where io_uring cannot be set up (or when asked for), and, on the calling thread, for the
//! first operation on a chunk file the store opens in the same blocking call. Owns nothing but
//! these three calls on an already open file: opening, caching and error wrapping stay in the
//! chunk store.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

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

/// [`read`] on the calling thread.
pub(crate) fn read_at(file: &File, offset: u64, len: usize) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; len];
    let mut filled = 0;
    while filled < len {
        match file.read_at(&mut buf[filled..], offset + filled as u64) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    buf.truncate(filled);
    Ok(buf)
}

/// fdatasync.
pub(crate) async fn fsync(file: Arc<File>) -> io::Result<()> {
    blocking(move || file.sync_data()).await
}
