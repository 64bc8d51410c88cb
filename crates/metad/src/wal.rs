//! The write-ahead log file: framing, appending, scanning, and the CRC-32C that guards it.
//!
//! A log is the magic `ODFSWAL1` followed by frames `[len: u32 LE][crc: u32 LE][payload]`,
//! where the CRC-32C covers the length bytes and the payload. Each frame goes to the file in
//! one `write(2)`. A scan stops at the first frame that is incomplete or fails its checksum:
//! that is the torn tail of a crash, and it is cut off before new frames are appended. What the
//! payload means is the store's business.

use crate::MetaError;
use serde::Serialize;
use std::fs::{File, OpenOptions};
use std::io::{self, BufReader, Read, Write};
use std::path::{Path, PathBuf};

/// File name of the log inside the store directory.
pub const LOG_FILE: &str = "wal";
const LOG_TMP: &str = "wal.tmp";
const MAGIC: &[u8; 8] = b"ODFSWAL1";
/// Largest frame payload accepted; a larger length is garbage.
const MAX_RECORD: usize = 16 << 20;
const FRAME_HEADER: usize = 8;

const fn crc_tables() -> [[u32; 256]; 8] {
    let mut t = [[0u32; 256]; 8];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 { (c >> 1) ^ 0x82F6_3B78 } else { c >> 1 };
            k += 1;
        }
        t[0][i] = c;
        i += 1;
    }
    let mut i = 0;
    while i < 256 {
        let mut s = 1;
        while s < 8 {
            t[s][i] = (t[s - 1][i] >> 8) ^ t[0][(t[s - 1][i] & 0xff) as usize];
            s += 1;
        }
        i += 1;
    }
    t
}

static CRC: [[u32; 256]; 8] = crc_tables();

/// Continues the CRC-32C (Castagnoli) `crc` over `data`; start from 0.
/// `crc32c(crc32c(0, a), b) == crc32c(0, a ++ b)`.
pub fn crc32c(crc: u32, data: &[u8]) -> u32 {
    let mut c = !crc;
    let mut chunks = data.chunks_exact(8);
    for ch in &mut chunks {
        let lo = u32::from_le_bytes([ch[0], ch[1], ch[2], ch[3]]) ^ c;
        let hi = u32::from_le_bytes([ch[4], ch[5], ch[6], ch[7]]);
        c = CRC[7][(lo & 0xff) as usize]
            ^ CRC[6][((lo >> 8) & 0xff) as usize]
            ^ CRC[5][((lo >> 16) & 0xff) as usize]
            ^ CRC[4][(lo >> 24) as usize]
            ^ CRC[3][(hi & 0xff) as usize]
            ^ CRC[2][((hi >> 8) & 0xff) as usize]
            ^ CRC[1][((hi >> 16) & 0xff) as usize]
            ^ CRC[0][(hi >> 24) as usize];
    }
    for &b in chunks.remainder() {
        c = CRC[0][((c ^ b as u32) & 0xff) as usize] ^ (c >> 8);
    }
    !c
}

/// fsyncs a directory so a rename or create inside it is durable.
pub(crate) fn sync_dir(dir: &Path) -> Result<(), MetaError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(|e| MetaError::io("sync directory", dir, e))
}

/// Removes a temporary log left by a crash while starting a new one.
pub(crate) fn remove_leftovers(dir: &Path) {
    let _ = std::fs::remove_file(dir.join(LOG_TMP));
}

/// The log open for appending.
pub(crate) struct Wal {
    file: File,
    path: PathBuf,
    len: u64,
    sync: bool,
    /// Reused frame buffer: no allocation per record once warm.
    buf: Vec<u8>,
    /// Records of an open group (`begin_group`), written together when it ends.
    group: Option<Vec<u8>>,
}

impl Wal {
    /// Replaces any log in `dir` by an empty one (written aside, synced, renamed into place).
    pub fn create(dir: &Path, sync: bool) -> Result<Wal, MetaError> {
        let tmp = dir.join(LOG_TMP);
        let path = dir.join(LOG_FILE);
        let mut f = File::create(&tmp).map_err(|e| MetaError::io("create", &tmp, e))?;
        f.write_all(MAGIC).and_then(|_| f.sync_all()).map_err(|e| MetaError::io("write", &tmp, e))?;
        drop(f);
        std::fs::rename(&tmp, &path).map_err(|e| MetaError::io("rename into place", &tmp, e))?;
        sync_dir(dir)?;
        Self::open(&path, MAGIC.len() as u64, sync)
    }

    /// Opens an existing log for appending after its first `valid_len` bytes; anything beyond
    /// (a torn tail) is cut off first.
    pub fn open(path: &Path, valid_len: u64, sync: bool) -> Result<Wal, MetaError> {
        let file = OpenOptions::new().append(true).open(path).map_err(|e| MetaError::io("open", path, e))?;
        let on_disk = file.metadata().map_err(|e| MetaError::io("stat", path, e))?.len();
        if on_disk != valid_len {
            file.set_len(valid_len)
                .and_then(|_| file.sync_all())
                .map_err(|e| MetaError::io("cut the torn tail of", path, e))?;
        }
        Ok(Wal { file, path: path.to_owned(), len: valid_len, sync, buf: Vec::with_capacity(4096), group: None })
    }

    /// Starts a group: records appended until `end_group` are written in one write (the
    /// entries of a client's `CreateBatch`, all answered together).
    pub fn begin_group(&mut self) {
        self.group = Some(Vec::new());
    }

    /// Writes the group's records (and an fdatasync when so configured).
    pub fn end_group(&mut self) -> Result<(), MetaError> {
        match self.group.take() {
            Some(g) if !g.is_empty() => self.write(&g),
            _ => Ok(()),
        }
    }

    /// Writes whole frames at the end of the log (and an fdatasync when so configured).
    fn write(&mut self, frames: &[u8]) -> Result<(), MetaError> {
        let r = self.file.write_all(frames).and_then(|_| if self.sync { self.file.sync_data() } else { Ok(()) });
        r.map_err(|e| MetaError::io("append to", &self.path, e))?;
        self.len += frames.len() as u64;
        Ok(())
    }

    /// Bytes in the log.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends one record in one write (and an fdatasync when so configured).
    pub fn append<T: Serialize>(&mut self, record: &T) -> Result<(), MetaError> {
        let mut buf = std::mem::take(&mut self.buf);
        buf.clear();
        buf.extend_from_slice(&[0; FRAME_HEADER]);
        let mut buf = postcard::to_extend(record, buf)
            .map_err(|e| MetaError::Encode { what: "a log record", reason: e.to_string() })?;
        let payload = buf.len() - FRAME_HEADER;
        if payload > MAX_RECORD {
            self.buf = buf;
            return Err(MetaError::Encode {
                what: "a log record",
                reason: format!("{payload} bytes exceed the limit of {MAX_RECORD}"),
            });
        }
        buf[0..4].copy_from_slice(&(payload as u32).to_le_bytes());
        let crc = crc32c(crc32c(0, &buf[0..4]), &buf[FRAME_HEADER..]);
        buf[4..8].copy_from_slice(&crc.to_le_bytes());
        if let Some(g) = &mut self.group {
            g.extend_from_slice(&buf);
            self.buf = buf;
            return Ok(());
        }
        let r = self.write(&buf);
        self.buf = buf;
        r
    }
}

/// What a scan found.
pub(crate) struct Scan {
    /// Bytes up to the end of the last good frame.
    pub valid_len: u64,
    /// Bytes after it (a torn or garbage tail), discarded.
    pub discarded: u64,
    pub records: u64,
}

/// Reads until `buf` is full or the file ends; returns the bytes read.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// Calls `each(offset, payload)` for every good frame of the log at `path`, in order, and stops
/// at the first bad one. A missing or header-less file scans as empty.
pub(crate) fn scan(path: &Path, mut each: impl FnMut(u64, &[u8]) -> Result<(), MetaError>) -> Result<Scan, MetaError> {
    let file = File::open(path).map_err(|e| MetaError::io("open", path, e))?;
    let file_len = file.metadata().map_err(|e| MetaError::io("stat", path, e))?.len();
    let mut r = BufReader::with_capacity(1 << 20, file);
    let rd = |e| MetaError::io("read", path, e);
    let mut magic = [0u8; 8];
    let n = read_full(&mut r, &mut magic).map_err(rd)?;
    if n < magic.len() {
        // A crash while the log was being created: nothing in it.
        return Ok(Scan { valid_len: 0, discarded: file_len, records: 0 });
    }
    if &magic != MAGIC {
        return Err(MetaError::CorruptLog {
            path: path.to_owned(),
            offset: 0,
            reason: "not an odfs write-ahead log (bad magic)".into(),
        });
    }
    let mut off = MAGIC.len() as u64;
    let mut records = 0;
    let mut payload = Vec::new();
    loop {
        let mut head = [0u8; FRAME_HEADER];
        if read_full(&mut r, &mut head).map_err(rd)? < FRAME_HEADER {
            break;
        }
        let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
        let crc = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
        if len > MAX_RECORD || len as u64 > file_len.saturating_sub(off + FRAME_HEADER as u64) {
            break;
        }
        payload.resize(len, 0);
        if read_full(&mut r, &mut payload).map_err(rd)? < len {
            break;
        }
        if crc32c(crc32c(0, &head[0..4]), &payload) != crc {
            break;
        }
        each(off, &payload)?;
        off += (FRAME_HEADER + len) as u64;
        records += 1;
    }
    Ok(Scan { valid_len: off, discarded: file_len.saturating_sub(off), records })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_reference_values() {
        assert_eq!(crc32c(0, b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(0, b""), 0);
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        let whole = crc32c(0, &data);
        for split in [0, 1, 7, 8, 9, 500, 999, 1000] {
            assert_eq!(crc32c(crc32c(0, &data[..split]), &data[split..]), whole);
        }
        // Byte-at-a-time reference.
        let mut c = !0u32;
        for &b in &data {
            c ^= b as u32;
            for _ in 0..8 {
                c = if c & 1 != 0 { (c >> 1) ^ 0x82F6_3B78 } else { c >> 1 };
            }
        }
        assert_eq!(!c, whole);
    }

    #[test]
    fn torn_tail_is_cut_and_appending_continues() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = Wal::create(dir.path(), false).unwrap();
        for i in 0..100u64 {
            w.append(&(i, format!("record {i}"))).unwrap();
        }
        let good = w.len();
        drop(w);
        let path = dir.path().join(LOG_FILE);
        // A torn frame: a header promising more bytes than follow.
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(&[40, 0, 0, 0, 1, 2, 3, 4, 9, 9]).unwrap();
        drop(f);
        let mut seen = Vec::new();
        let s = scan(&path, |_, p| {
            seen.push(postcard::from_bytes::<(u64, String)>(p).unwrap().0);
            Ok(())
        })
        .unwrap();
        assert_eq!(seen, (0..100).collect::<Vec<_>>());
        assert_eq!(s.valid_len, good);
        assert_eq!(s.discarded, 10);
        let mut w = Wal::open(&path, s.valid_len, false).unwrap();
        w.append(&(100u64, "after".to_string())).unwrap();
        drop(w);
        let s = scan(&path, |_, _| Ok(())).unwrap();
        assert_eq!((s.records, s.discarded), (101, 0));
    }

    #[test]
    fn flipped_byte_ends_the_log() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = Wal::create(dir.path(), true).unwrap();
        let mut ends = Vec::new();
        for i in 0..10u64 {
            w.append(&i).unwrap();
            ends.push(w.len());
        }
        drop(w);
        let path = dir.path().join(LOG_FILE);
        let mut bytes = std::fs::read(&path).unwrap();
        let at = ends[6] as usize + FRAME_HEADER; // record 7's payload
        bytes[at] ^= 0x40;
        std::fs::write(&path, &bytes).unwrap();
        let s = scan(&path, |_, _| Ok(())).unwrap();
        assert_eq!(s.records, 7);
        assert_eq!(s.valid_len, ends[6]);
    }
}
