//! The snapshot file: the whole state at one log sequence number, written atomically.
//!
//! Layout: the magic `ODFSSNP1`, the postcard-encoded state, then a trailer of the payload
//! length (u64 LE) and its CRC-32C (u32 LE). It is written to a temporary file, fsynced and
//! renamed over the previous snapshot, so a crash leaves either the old or the new one whole.
//! What the state contains is the store's business.

use crate::wal::{crc32c, sync_dir};
use crate::MetaError;
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

/// File name of the snapshot inside the store directory.
pub const SNAPSHOT_FILE: &str = "snapshot";
const SNAPSHOT_TMP: &str = "snapshot.tmp";
const MAGIC: &[u8; 8] = b"ODFSSNP1";
const TRAILER: usize = 12;

/// Counts and checksums what passes through to the file.
struct Summing<W> {
    inner: W,
    len: u64,
    crc: u32,
}

impl<W: Write> Write for Summing<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.crc = crc32c(self.crc, &buf[..n]);
        self.len += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Writes `state` as the snapshot of `dir`, durably, replacing the previous one. Returns its
/// size in bytes.
pub(crate) fn write<T: Serialize>(dir: &Path, state: &T) -> Result<u64, MetaError> {
    let tmp = dir.join(SNAPSHOT_TMP);
    let path = dir.join(SNAPSHOT_FILE);
    let file = File::create(&tmp).map_err(|e| MetaError::io("create", &tmp, e))?;
    let mut out = BufWriter::with_capacity(1 << 20, file);
    out.write_all(MAGIC).map_err(|e| MetaError::io("write", &tmp, e))?;
    let summing = Summing { inner: out, len: 0, crc: 0 };
    // postcard reports an I/O failure as a serialization error; both mean "could not write".
    let mut summing = postcard::to_io(state, summing)
        .map_err(|e| MetaError::Encode { what: "the snapshot", reason: e.to_string() })?;
    let mut trailer = [0u8; TRAILER];
    trailer[0..8].copy_from_slice(&summing.len.to_le_bytes());
    trailer[8..12].copy_from_slice(&summing.crc.to_le_bytes());
    let size = MAGIC.len() as u64 + summing.len + TRAILER as u64;
    summing
        .inner
        .write_all(&trailer)
        .and_then(|_| summing.inner.flush())
        .map_err(|e| MetaError::io("write", &tmp, e))?;
    let file = summing.inner.into_inner().map_err(|e| MetaError::io("write", &tmp, e.into_error()))?;
    file.sync_all().map_err(|e| MetaError::io("sync", &tmp, e))?;
    drop(file);
    std::fs::rename(&tmp, &path).map_err(|e| MetaError::io("rename into place", &tmp, e))?;
    sync_dir(dir)?;
    Ok(size)
}

/// Reads the snapshot of `dir`, if there is one.
pub(crate) fn read<T: DeserializeOwned>(dir: &Path) -> Result<Option<T>, MetaError> {
    let path = dir.join(SNAPSHOT_FILE);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(MetaError::io("read", &path, e)),
    };
    let corrupt = |reason: String| MetaError::CorruptSnapshot { path: path.clone(), reason };
    if bytes.len() < MAGIC.len() + TRAILER || &bytes[..MAGIC.len()] != MAGIC {
        return Err(corrupt("not an odfs snapshot (bad magic or too short)".into()));
    }
    let (body, trailer) = bytes.split_at(bytes.len() - TRAILER);
    let payload = &body[MAGIC.len()..];
    let mut len = [0u8; 8];
    len.copy_from_slice(&trailer[0..8]);
    let mut crc = [0u8; 4];
    crc.copy_from_slice(&trailer[8..12]);
    if u64::from_le_bytes(len) != payload.len() as u64 {
        return Err(corrupt(format!(
            "trailer says {} payload bytes, the file has {}",
            u64::from_le_bytes(len),
            payload.len()
        )));
    }
    if crc32c(0, payload) != u32::from_le_bytes(crc) {
        return Err(corrupt("checksum mismatch".into()));
    }
    postcard::from_bytes(payload).map(Some).map_err(|e| corrupt(format!("cannot decode: {e}")))
}

/// Removes a temporary snapshot left by a crash while writing one.
pub(crate) fn remove_leftovers(dir: &Path) {
    let _ = std::fs::remove_file(dir.join(SNAPSHOT_TMP));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_damage_detection() {
        let dir = tempfile::tempdir().unwrap();
        assert!(read::<Vec<u64>>(dir.path()).unwrap().is_none());
        let state: Vec<u64> = (0..100_000).collect();
        write(dir.path(), &state).unwrap();
        assert_eq!(read::<Vec<u64>>(dir.path()).unwrap(), Some(state));
        let path = dir.path().join(SNAPSHOT_FILE);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[1000] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let err = read::<Vec<u64>>(dir.path()).unwrap_err();
        assert!(err.to_string().contains("checksum"), "{err}");
    }
}
