//! Messages of the storage service (stored): chunk I/O on targets.
//!
//! A file has one chunk file per target of its layout; offsets here are offsets within that chunk
//! file (see `layout`).

use crate::codec::{FileSpan, Payload};
use crate::mgmt::TargetSpace;
use crate::{InodeId, TargetId};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteChunk {
    pub target: TargetId,
    pub ino: InodeId,
    pub offset: u64,
    /// Travels as the frame's payload, not in its body.
    #[serde(skip)]
    pub data: Payload,
    /// Make the write durable (fdatasync) before replying.
    pub sync: bool,
    /// Reply with the CRC32C of the bytes written, so the writer can check that what stored
    /// holds is what it sent without reading it back (stage-in's verification).
    pub crc: bool,
}

/// What a chunk write stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Written {
    pub len: u32,
    /// CRC32C of the bytes written, when the request asked for it.
    pub crc32c: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadChunk {
    pub target: TargetId,
    pub ino: InodeId,
    pub offset: u64,
    pub len: u32,
}

/// Bytes read; shorter than asked where the chunk file ends (a hole or the end of the file).
/// `data` travels as the frame's payload, not in its body; stored may send it from the chunk
/// file instead (`spans`), and the receiver finds it in `data` all the same.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ChunkData {
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
    #[serde(skip)]
    pub spans: Vec<FileSpan>,
}

/// Reads several chunk files' ranges in one request (a directory's small files fetched ahead of
/// their opens): at most `READ_MANY_ITEMS` ranges of `READ_MANY_BYTES` in all.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadChunks {
    pub target: TargetId,
    pub items: Vec<ChunkRange>,
}

/// One range of a `ReadChunks`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkRange {
    pub ino: InodeId,
    pub offset: u64,
    pub len: u32,
}

/// Most ranges in one `ReadChunks`.
pub const READ_MANY_ITEMS: usize = 256;
/// Most bytes one `ReadChunks` may ask for (the reply's frame stays under `MAX_FRAME`).
pub const READ_MANY_BYTES: u64 = 8 << 20;

/// What a `ReadChunks` read: range i's bytes are the `lens[i]` bytes after those of the ranges
/// before it in `data` (short or empty as for `ReadChunk`; `None`: that range failed, the
/// others stand). `data` travels as the frame's payload; stored sends it from the chunk files
/// (`spans`, one per range that read bytes, in order).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ChunksData {
    pub lens: Vec<Option<u32>>,
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
    #[serde(skip)]
    pub spans: Vec<FileSpan>,
}

/// Deallocate `[offset, offset + len)` of a chunk file, keeping its size: the range reads as
/// zeros (`fallocate(FALLOC_FL_PUNCH_HOLE)`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PunchChunk {
    pub target: TargetId,
    pub ino: InodeId,
    pub offset: u64,
    pub len: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TruncateChunk {
    pub target: TargetId,
    pub ino: InodeId,
    pub len: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyncChunk {
    pub target: TargetId,
    pub ino: InodeId,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoveChunk {
    pub target: TargetId,
    pub ino: InodeId,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatTarget {
    pub target: TargetId,
}

/// Length of a chunk file, or none when it does not exist.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatChunk {
    pub target: TargetId,
    pub ino: InodeId,
}

crate::rpc! {
    WriteChunk = 200 => Written {
        fn payload(&self) -> Option<&Payload> {
            Some(&self.data)
        }
        fn payload_mut(&mut self) -> Option<&mut Payload> {
            Some(&mut self.data)
        }
        fn stats_target(&self) -> Option<crate::TargetId> {
            Some(self.target)
        }
    },
    ReadChunk = 201 => ChunkData {
        fn reply_payload(reply: &mut ChunkData) -> Option<&mut Vec<u8>> {
            Some(&mut reply.data)
        }
        fn reply_spans(reply: &mut ChunkData) -> Option<&mut Vec<FileSpan>> {
            Some(&mut reply.spans)
        }
        fn stats_target(&self) -> Option<crate::TargetId> {
            Some(self.target)
        }
    },
    TruncateChunk = 202 => () { fn stats_target(&self) -> Option<crate::TargetId> {
            Some(self.target)
        } },
    SyncChunk = 203 => () { fn stats_target(&self) -> Option<crate::TargetId> {
            Some(self.target)
        } },
    RemoveChunk = 204 => () { fn stats_target(&self) -> Option<crate::TargetId> {
            Some(self.target)
        } },
    StatTarget = 205 => TargetSpace { fn stats_target(&self) -> Option<crate::TargetId> {
            Some(self.target)
        } },
    StatChunk = 206 => Option<u64> { fn stats_target(&self) -> Option<crate::TargetId> {
            Some(self.target)
        } },
    PunchChunk = 207 => () { fn stats_target(&self) -> Option<crate::TargetId> {
            Some(self.target)
        } },
    ReadChunks = 208 => ChunksData {
        fn reply_payload(reply: &mut ChunksData) -> Option<&mut Vec<u8>> {
            Some(&mut reply.data)
        }
        fn reply_spans(reply: &mut ChunksData) -> Option<&mut Vec<FileSpan>> {
            Some(&mut reply.spans)
        }
        fn stats_target(&self) -> Option<crate::TargetId> {
            Some(self.target)
        }
    },
}
