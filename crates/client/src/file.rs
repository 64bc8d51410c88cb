//! Open files: per-inode data state shared by all handles of one process, write-behind with
//! bounded memory, read-ahead for sequential readers.
//!
//! Writes are coalesced per chunk and sent in the background; a later read, fsync, flush,
//! truncate or close waits for them. A background write that fails is never forgotten: every
//! open file learns of it at its next write and at its next fsync, flush or close, once each,
//! as a local filesystem's write-back errors reach every file description (`WriteErrors`).
//! A write that overlaps one still in flight waits for it first: stored may apply writes sent
//! together in any order, and the later of two writes to the same bytes must win.
//! The size grows locally and reaches metad on flush/fsync/close (close-to-open).

use crate::fs::Truncate;
use crate::{Client, ClientError, Ctx, Result};
use bytes::Bytes;
use futures::future::{BoxFuture, FutureExt, Shared};
use odfs_proto::codec::{Payload, MAX_IO};
use odfs_proto::meta::Attr;
use odfs_proto::storage::{PunchChunk, SyncChunk, WriteChunk, Written};
use odfs_proto::{InodeId, Layout, Timespec};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio::task::JoinHandle;

type ChunkFuture = Shared<BoxFuture<'static, Result<Arc<Vec<u8>>, ClientError>>>;

/// Bytes of one segment of a read: fetched for it, or a range of a read-ahead chunk.
enum Piece {
    Owned(Vec<u8>),
    Cached(Arc<Vec<u8>>, usize, usize),
}

/// The bytes a read returns: its own buffer, or a range of a read-ahead chunk that the read
/// falls wholly inside, handed over without a copy (a sequential reader's every read).
#[derive(Debug, Clone)]
pub enum ReadBuf {
    Owned(Vec<u8>),
    Shared(Arc<Vec<u8>>, std::ops::Range<usize>),
}

impl std::ops::Deref for ReadBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            ReadBuf::Owned(v) => v,
            ReadBuf::Shared(w, r) => &w[r.clone()],
        }
    }
}

impl PartialEq<Vec<u8>> for ReadBuf {
    fn eq(&self, other: &Vec<u8>) -> bool {
        **self == **other
    }
}

#[derive(Default)]
struct WriteState {
    /// Size including this process's writes.
    size: u64,
    /// The size at metad is behind `size`.
    size_dirty: bool,
    /// Coalescing buffer, always within one chunk.
    buf: Option<WriteBuf>,
    inflight: Vec<InFlight>,
    /// Stripe indices written since the last fsync.
    touched: BTreeSet<usize>,
    mtime: Timespec,
}

/// The background writes of one inode that failed. Each open file keeps the count it last
/// learned for its writes and for its syncs (fsync, flush, close), sampled at open: a failure
/// after that fails its next write and its next sync, once each, so that no error of a
/// write-behind is acknowledged away (a first ENOSPC taken by one call left the fsync and the
/// close after it to return 0 over lost bytes).
#[derive(Default)]
struct WriteErrors {
    seq: u64,
    /// The latest failure.
    last: Option<ClientError>,
}

/// Pieces handed over smaller than this are copied into the write buffer instead: an iovec
/// and a shared buffer kept alive cost more than copying a few pages.
const MIN_PIECE: usize = 16 << 10;

/// Bytes from file offset `off` waiting to be sent as one chunk write: pieces handed over whole
/// (an S3 body's, a FUSE write's), then bytes copied in (small writes), in file order.
struct WriteBuf {
    off: u64,
    pieces: Payload,
    tail: Vec<u8>,
    len: usize,
}

impl WriteBuf {
    fn new(off: u64) -> WriteBuf {
        WriteBuf { off, pieces: Payload::default(), tail: Vec::new(), len: 0 }
    }

    fn end(&self) -> u64 {
        self.off + self.len as u64
    }

    /// Appends a copy of `bytes`. A buffer that starts with a copy allocates for what may
    /// follow, up to `cap` bytes in all (or 1 MiB): small writes gather without reallocating.
    /// A copy after handed-over pieces (the small rest of an S3 body's piece) takes only its
    /// own room: more pieces are likely to follow it.
    fn copy_in(&mut self, bytes: &[u8], cap: usize) {
        if self.tail.capacity() == 0 {
            let room = cap.saturating_sub(self.len);
            let ahead = if self.pieces.is_empty() { room.min(1 << 20) } else { MIN_PIECE.min(room) };
            self.tail.reserve_exact(ahead.max(bytes.len()));
        }
        self.tail.extend_from_slice(bytes);
        self.len += bytes.len();
    }

    /// Appends `piece` as it is, without a copy unless it is small.
    fn hand_over(&mut self, piece: Bytes, cap: usize) {
        if piece.len() < MIN_PIECE {
            return self.copy_in(&piece, cap);
        }
        if !self.tail.is_empty() {
            let mut tail = std::mem::take(&mut self.tail);
            // A piece keeps its allocation until the write is acknowledged, and the write
            // budget counts bytes, not capacity: a few small bytes must not hold a megabyte.
            if tail.capacity() > 2 * tail.len() {
                tail.shrink_to_fit();
            }
            self.pieces.push(tail.into());
        }
        self.len += piece.len();
        self.pieces.push(piece);
    }

    fn into_payload(mut self) -> Payload {
        self.pieces.push(self.tail.into());
        self.pieces
    }
}

/// A chunk write sent and not known to have landed: its file range, and its end, which any
/// number of waiters may await (a drain, a later overlapping write).
struct InFlight {
    start: u64,
    end: u64,
    task: tokio::task::AbortHandle,
    done: Shared<BoxFuture<'static, ()>>,
}

impl InFlight {
    fn overlaps(&self, start: u64, end: u64) -> bool {
        self.start < end && start < self.end
    }
}

#[derive(Default)]
struct ReadAhead {
    /// End offset of the last read, to detect sequential access.
    last_end: u64,
    chunks: BTreeMap<u64, ChunkFuture>,
}

/// Data state of one inode open in this process.
pub struct InodeData {
    pub ino: InodeId,
    pub layout: Layout,
    ws: tokio::sync::Mutex<WriteState>,
    /// Background writes that failed, for every open file of the inode to learn of.
    error: Mutex<WriteErrors>,
    ra: Mutex<ReadAhead>,
    opens: AtomicUsize,
    /// Request id of the latest open registered with metad for this inode (its `Release`
    /// covers opens up to it).
    registered: std::sync::atomic::AtomicU64,
    /// Mirror of `WriteState::size` readable without the async lock (for getattr).
    size_hint: Mutex<(u64, bool)>,
    /// Held while an open answered from the cache is being registered with metad: the
    /// release waits for it, or it would overtake the registration and leave it behind.
    pub(crate) registering: Arc<tokio::sync::Mutex<()>>,
    /// Once a handle asked (`FileHandle::check_writes`): the CRC32C stored returned for each
    /// chunk write since, by file offset, with the write's length.
    written: Mutex<Option<BTreeMap<u64, (u32, u32)>>>,
}

impl InodeData {
    pub(crate) fn new(ino: InodeId, layout: Layout) -> InodeData {
        InodeData {
            ino,
            layout,
            ws: tokio::sync::Mutex::new(WriteState::default()),
            error: Mutex::new(WriteErrors::default()),
            ra: Mutex::new(ReadAhead::default()),
            opens: AtomicUsize::new(0),
            registered: std::sync::atomic::AtomicU64::new(0),
            size_hint: Mutex::new((0, false)),
            registering: Arc::new(tokio::sync::Mutex::new(())),
            written: Mutex::new(None),
        }
    }

    /// A new open of this inode, registered with metad by request `registered`.
    pub(crate) fn opened(&self, remote_size: u64, registered: u64) {
        self.opens.fetch_add(1, Ordering::AcqRel);
        self.registered.fetch_max(registered, Ordering::AcqRel);
        let mut h = self.size_hint.lock().expect("size lock");
        if !h.1 {
            h.0 = remote_size;
        } else {
            h.0 = h.0.max(remote_size);
        }
        if let Ok(mut ws) = self.ws.try_lock() {
            ws.size = if ws.size_dirty { ws.size.max(remote_size) } else { remote_size };
            *h = (ws.size, ws.size_dirty);
        }
    }

    /// Returns true when this was the last open.
    pub(crate) fn closed(&self) -> bool {
        self.opens.fetch_sub(1, Ordering::AcqRel) == 1
    }

    /// An open unknown to metad (answered from the cache) is registered under `seq`.
    pub(crate) fn mark_registered(&self, seq: u64) {
        self.registered.fetch_max(seq, Ordering::AcqRel);
    }

    /// Request id of the latest registered open.
    pub(crate) fn registered(&self) -> u64 {
        self.registered.load(Ordering::Acquire)
    }

    /// The size a local caller should see, given metad's.
    pub(crate) fn local_size(&self, remote: u64) -> u64 {
        let h = self.size_hint.lock().expect("size lock");
        if h.1 {
            h.0.max(remote)
        } else {
            remote
        }
    }

    pub(crate) fn set_size_after_truncate(&self, size: u64) {
        if let Ok(mut ws) = self.ws.try_lock() {
            ws.size = size;
            ws.size_dirty = false;
        }
        *self.size_hint.lock().expect("size lock") = (size, false);
        self.ra.lock().expect("ra lock").chunks.clear();
    }

    /// How many background writes of this inode have failed so far.
    fn error_seq(&self) -> u64 {
        self.error.lock().expect("error lock").seq
    }

    /// The latest failure of a background write if one came after `seen` (the count an open
    /// file last learned), which then learns it; else Ok.
    fn error_since(&self, seen: &AtomicU64) -> Result<()> {
        let g = self.error.lock().expect("error lock");
        if g.seq > seen.load(Ordering::Acquire) {
            seen.store(g.seq, Ordering::Release);
            return Err(g
                .last
                .clone()
                .unwrap_or_else(|| ClientError::new(odfs_proto::ErrorCode::Io, "a write failed")));
        }
        Ok(())
    }

    fn record_error(&self, e: ClientError) {
        let mut g = self.error.lock().expect("error lock");
        g.seq += 1;
        g.last = Some(e);
    }

    /// Sends the coalescing buffer in the background, within the client's write budget.
    async fn send_buf(self: &Arc<Self>, client: &Client, ws: &mut WriteState) {
        let Some(buf) = ws.buf.take() else {
            return;
        };
        let (off, end) = (buf.off, buf.end());
        let data = buf.into_payload();
        let Some(seg) = self.layout.segments(off, data.len() as u64).next() else {
            return;
        };
        self.wait_overlapping(ws, off, end).await;
        ws.touched.insert(seg.stripe_index);
        let units = data.len().div_ceil(4096).max(1) as u32;
        let permit = client.inner.write_budget.clone().acquire_many_owned(units).await.expect("budget never closes");
        let crc = self.written.lock().expect("written lock").is_some();
        let req = WriteChunk { target: seg.target, ino: self.ino, offset: seg.local_offset, data, sync: false, crc };
        let client = client.clone();
        let me = self.clone();
        ws.inflight.retain(|w| !w.task.is_finished());
        let rt = client.inner.runtime.clone();
        let task = rt.spawn(async move {
            // Refused for want of space: asked again while space freed by an unlink (this
            // client's or another's) may still come (`Client::space_may_come`).
            let mut refused = None;
            let r = loop {
                let r = client.store(req.target, &req).await;
                match &r {
                    Err(e)
                        if e.code() == odfs_proto::ErrorCode::NoSpace && client.space_may_come(&mut refused).await => {}
                    _ => break r,
                }
            };
            let r = r.map(|w| me.record_written(off, &w));
            drop(permit);
            if let Err(e) = &r {
                me.record_error(e.clone());
            }
        });
        ws.inflight.push(InFlight { start: off, end, task: task.abort_handle(), done: self.completion(task) });
    }

    /// A write task's end as a future any number of waiters can await; a task that panicked
    /// is recorded as a write error. (Weak: the future lives in this inode's own state.)
    fn completion(self: &Arc<Self>, task: JoinHandle<()>) -> Shared<BoxFuture<'static, ()>> {
        let me = Arc::downgrade(self);
        async move {
            if let (Err(e), Some(me)) = (task.await, me.upgrade()) {
                me.record_error(ClientError::new(odfs_proto::ErrorCode::Io, format!("write task: {e}")));
            }
        }
        .boxed()
        .shared()
    }

    /// Waits for the writes in flight that overlap `[start, end)` (the caller holds the write
    /// state, so no other write is sent meanwhile).
    async fn wait_overlapping(&self, ws: &mut WriteState, start: u64, end: u64) {
        let waits: Vec<_> = ws.inflight.iter().filter(|w| w.overlaps(start, end)).map(|w| w.done.clone()).collect();
        futures::future::join_all(waits).await;
    }

    /// Notes the CRC32C stored returned for a write at file offset `off`.
    fn record_written(&self, off: u64, w: &Written) {
        if let (Some(crc), Some(map)) = (w.crc32c, self.written.lock().expect("written lock").as_mut()) {
            map.insert(off, (w.len, crc));
        }
    }

    /// The CRC32C of bytes `offset..offset + len` as stored acknowledged them: the CRCs of the
    /// writes that cover the range combined, or None unless they cover it exactly, end to end
    /// (a gap, an overlap, a write sent before the CRCs were asked for). Forgets those writes.
    fn written_crc(&self, offset: u64, len: u64) -> Option<u32> {
        let end = offset.checked_add(len)?;
        let inside = {
            let mut guard = self.written.lock().expect("written lock");
            let map = guard.as_mut()?;
            // Take the writes starting in the range out of the map, keep the rest.
            let mut inside = map.split_off(&offset);
            map.append(&mut inside.split_off(&end));
            inside
        };
        let mut at = offset;
        let mut crc = 0u32;
        for (o, (l, c)) in inside {
            if o != at || o + l as u64 > end {
                return None;
            }
            crc = odfs_proto::crc::combine(crc, c, l as u64);
            at += l as u64;
        }
        (at == end).then_some(crc)
    }

    /// Writes `data` at `offset` (coalesced, sent in the background).
    pub(crate) async fn write(self: &Arc<Self>, client: &Client, offset: u64, data: &[u8]) -> Result<()> {
        self.write_with(client, offset, data.len(), |b, at, len, cap| b.copy_in(&data[at..at + len], cap)).await
    }

    /// [`Self::write`] of bytes the caller hands over: they join the write buffer as they are
    /// (in pieces, see [`WriteBuf`]), so a large write (a FUSE write's buffer, an S3 body's
    /// piece) reaches the socket with no copy of the client's.
    pub(crate) async fn write_bytes(self: &Arc<Self>, client: &Client, offset: u64, data: Bytes) -> Result<()> {
        self.write_with(client, offset, data.len(), |b, at, len, cap| b.hand_over(data.slice(at..at + len), cap)).await
    }

    /// A write of `len` bytes at `offset`, chunk by chunk: `put(buf, at, n, cap)` adds the
    /// caller's bytes `at..at + n` to the write buffer (capped at `cap` bytes), which is sent
    /// first when they cannot join it and after when it is full.
    async fn write_with(
        self: &Arc<Self>,
        client: &Client,
        offset: u64,
        len: usize,
        mut put: impl FnMut(&mut WriteBuf, usize, usize, usize),
    ) -> Result<()> {
        self.ra.lock().expect("ra lock").chunks.clear();
        let mut ws = self.ws.lock().await;
        for seg in self.layout.segments(offset, len as u64) {
            let (at, n) = ((seg.file_offset - offset) as usize, seg.len as usize);
            if !self.joins(&ws.buf, seg.file_offset, n) {
                self.send_buf(client, &mut ws).await;
            }
            let cap = self.buffer_cap();
            put(ws.buf.get_or_insert_with(|| WriteBuf::new(seg.file_offset)), at, n, cap);
            self.send_if_full(client, &mut ws).await;
        }
        self.note_write(&mut ws, offset + len as u64);
        Ok(())
    }

    /// Sends the write buffer when it reaches a chunk's end or the request cap.
    async fn send_if_full(self: &Arc<Self>, client: &Client, ws: &mut WriteState) {
        if ws.buf.as_ref().is_some_and(|b| self.fills(b.off, b.len)) {
            self.send_buf(client, ws).await;
        }
    }

    /// [`Self::write`] when it needs no waiting: the bytes join the write buffer (or start it)
    /// and leave it short of a chunk's end and of the request cap, as a small file's one write
    /// does. `None`, with nothing done, when [`Self::write`] must run instead. Lets the FUSE
    /// adapter answer such a write on its reader thread, without a task.
    pub(crate) fn try_write(&self, offset: u64, data: &[u8]) -> Option<Result<()>> {
        let end = offset + data.len() as u64;
        let cs = self.layout.chunk_size as u64;
        // Empty, or reaching into the next chunk: the general path.
        if data.is_empty() || (end - 1) / cs != offset / cs {
            return None;
        }
        let mut ws = self.ws.try_lock().ok()?;
        let start = match &ws.buf {
            None => offset,
            Some(b) if self.joins(&ws.buf, offset, data.len()) => b.off,
            Some(_) => return None,
        };
        if self.fills(start, (end - start) as usize) {
            return None;
        }
        self.ra.lock().expect("ra lock").chunks.clear();
        let cap = self.buffer_cap();
        ws.buf.get_or_insert_with(|| WriteBuf::new(offset)).copy_in(data, cap);
        self.note_write(&mut ws, end);
        Some(Ok(()))
    }

    /// Most bytes one buffered chunk write carries.
    fn buffer_cap(&self) -> usize {
        (self.layout.chunk_size as usize).min(MAX_IO)
    }

    /// Whether `len` bytes at file offset `at` extend the write buffer `buf`: they follow it, in
    /// the same chunk, and the total stays within the request cap.
    fn joins(&self, buf: &Option<WriteBuf>, at: u64, len: usize) -> bool {
        let cs = self.layout.chunk_size as u64;
        matches!(buf, Some(b) if b.end() == at && b.off / cs == at / cs && b.len + len <= self.buffer_cap())
    }

    /// Whether a write buffer of `len` bytes from file offset `start` reaches a chunk's end or
    /// the request cap: then it is sent.
    fn fills(&self, start: u64, len: usize) -> bool {
        (start + len as u64).is_multiple_of(self.layout.chunk_size as u64) || len >= self.buffer_cap()
    }

    /// Records a write ending at `end`: size, mtime, and that both await publishing.
    fn note_write(&self, ws: &mut WriteState, end: u64) {
        if end > ws.size {
            ws.size = end;
        }
        ws.size_dirty = true;
        ws.mtime = Timespec::now();
        *self.size_hint.lock().expect("size lock") = (ws.size, true);
    }

    /// Waits for every write of this inode to reach stored (or fail: each open file learns of
    /// a failure through `error_since`, not here).
    pub(crate) async fn drain(self: &Arc<Self>, client: &Client) -> Result<()> {
        // The writes stay listed while they are awaited, so a concurrent drain (parallel reads
        // of one file, as FUSE sends them) or an overlapping write waits for them too.
        let waits: Vec<_> = {
            let mut ws = self.ws.lock().await;
            self.send_buf(client, &mut ws).await;
            ws.inflight.iter().map(|w| w.done.clone()).collect()
        };
        futures::future::join_all(waits).await;
        Ok(())
    }

    /// Drains writes and publishes the size (close-to-open). With `sync`, data is made durable
    /// on every target written since the last sync.
    pub(crate) async fn flush(self: &Arc<Self>, client: &Client, ctx: &Ctx, sync: bool) -> Result<()> {
        self.drain(client).await?;
        let mut ws = self.ws.lock().await;
        if sync {
            // Durable: the file's create first, if it is still in this client's log.
            client.sync_deferred().await;
            let touched = std::mem::take(&mut ws.touched);
            let futs = touched.iter().map(|&i| {
                let t = self.layout.targets[i];
                let client = client.clone();
                let ino = self.ino;
                async move { client.store(t, &SyncChunk { target: t, ino }).await }
            });
            for r in futures::future::join_all(futs).await {
                r?;
            }
        }
        if ws.size_dirty {
            client.publish_size(ctx, self.ino, ws.size, ws.mtime).await?;
            ws.size_dirty = false;
            *self.size_hint.lock().expect("size lock") = (ws.size, false);
        }
        Ok(())
    }

    fn fetch_chunk(self: &Arc<Self>, client: &Client, chunk: u64, size: u64) -> ChunkFuture {
        let cs = self.layout.chunk_size as u64;
        let start = chunk * cs;
        let len = cs.min(size.saturating_sub(start));
        let seg = self.layout.segments(start, len).next();
        let client = client.clone();
        let ino = self.ino;
        async move {
            let Some(seg) = seg else {
                return Ok(Arc::new(Vec::new()));
            };
            let data = client.read_chunk(seg.target, ino, seg.local_offset, seg.len as u32).await?;
            Ok(Arc::new(data))
        }
        .boxed()
        .shared()
    }

    /// Reads up to `len` bytes at `offset`; holes read as zeros; short at end of file.
    pub(crate) async fn read(self: &Arc<Self>, client: &Client, offset: u64, len: u32) -> Result<ReadBuf> {
        let (end, size) = self.drained_end(client, offset, len).await?;
        if end == offset {
            return Ok(ReadBuf::Owned(Vec::new()));
        }
        let cached = self.read_ahead(client, offset, end, size);
        let cs = self.layout.chunk_size as u64;
        let futs = self.layout.segments(offset, end - offset).map(|seg| {
            let cached = cached.get(&seg.chunk).cloned();
            async move {
                let piece = match cached {
                    Some(f) => {
                        let whole = f.await?;
                        let from = ((seg.file_offset % cs) as usize).min(whole.len());
                        let to = (from + seg.len as usize).min(whole.len());
                        Piece::Cached(whole, from, to)
                    }
                    None => Piece::Owned(self.read_segment(client, &seg).await?),
                };
                Ok::<_, ClientError>((seg.len as usize, piece))
            }
        });
        Ok(assemble(futures::future::try_join_all(futs).await?, (end - offset) as usize))
    }

    /// Where a read of `len` bytes at `offset` ends (never before `offset`: at or past the end
    /// of the file it reads nothing), once this process's own writes have reached stored; and
    /// the file's size.
    async fn drained_end(self: &Arc<Self>, client: &Client, offset: u64, len: u32) -> Result<(u64, u64)> {
        self.drain(client).await?;
        let size = self.ws.lock().await.size;
        Ok(((offset + len as u64).min(size).max(offset), size))
    }

    /// [`Self::read`]'s bytes appended to `pipe` after `head(n)`, `n` the number of them, with
    /// no copy of this process's (see `splice_read`). `Err` leaves the pipe holding part of it.
    pub(crate) async fn read_into_pipe(
        self: &Arc<Self>,
        client: &Client,
        offset: u64,
        len: u32,
        pipe: &mut odfs_rpc::splice::Pipe,
        head: impl FnOnce(usize) -> [u8; 16],
    ) -> Result<usize> {
        let n = self.drained_end(client, offset, len).await?.0 - offset;
        pipe.write_all(&head(n as usize)).map_err(|e| ClientError::new(odfs_proto::ErrorCode::Io, e.to_string()))?;
        if n > 0 {
            client.splice_segments(self.ino, self.layout.segments(offset, n).collect(), pipe).await?;
        }
        Ok(n as usize)
    }

    /// The read-ahead chunks covering `[offset, end)`; for a sequential reader, more of them
    /// are started beyond `end`.
    fn read_ahead(self: &Arc<Self>, client: &Client, offset: u64, end: u64, size: u64) -> BTreeMap<u64, ChunkFuture> {
        let cs = self.layout.chunk_size as u64;
        let ra_chunks = client.config().readahead_chunks as u64;
        let mut ra = self.ra.lock().expect("ra lock");
        let sequential = offset == ra.last_end || offset == 0;
        ra.last_end = end;
        let first = offset / cs;
        ra.chunks = ra.chunks.split_off(&first);
        if sequential && ra_chunks > 0 {
            let last_needed = (end - 1) / cs;
            let max_chunk = (size - 1) / cs;
            for k in (last_needed + 1)..=(last_needed + ra_chunks).min(max_chunk) {
                if let std::collections::btree_map::Entry::Vacant(slot) = ra.chunks.entry(k) {
                    let f = self.fetch_chunk(client, k, size);
                    client.inner.runtime.spawn(f.clone());
                    slot.insert(f);
                }
            }
        }
        ra.chunks.range(first..=(end - 1) / cs).map(|(k, f)| (*k, f.clone())).collect()
    }

    /// One segment from its target, in requests of at most `MAX_IO` bytes; short at a hole.
    async fn read_segment(&self, client: &Client, seg: &odfs_proto::layout::Segment) -> Result<Vec<u8>> {
        let mut data = Vec::new();
        let mut done = 0u64;
        while done < seg.len {
            let n = (seg.len - done).min(MAX_IO as u64) as u32;
            let piece = client.read_chunk(seg.target, self.ino, seg.local_offset + done, n).await?;
            let got = piece.len() as u64;
            if data.is_empty() {
                data = piece;
            } else {
                data.extend_from_slice(&piece);
            }
            if got < n as u64 {
                break;
            }
            done += got;
        }
        Ok(data)
    }
}

/// The pieces of a read, in order, as one buffer of `total` bytes: short pieces are holes (or
/// a chunk file not yet extended) and read as zeros. One whole piece of a read-ahead chunk is
/// handed over as it is.
fn assemble(pieces: Vec<(usize, Piece)>, total: usize) -> ReadBuf {
    if pieces.len() == 1 {
        let (len, piece) = pieces.into_iter().next().expect("one piece");
        let mut v = match piece {
            Piece::Cached(w, from, to) if to - from == len => return ReadBuf::Shared(w, from..to),
            Piece::Owned(v) => v,
            Piece::Cached(w, from, to) => w[from..to].to_vec(),
        };
        v.resize(len, 0);
        return ReadBuf::Owned(v);
    }
    let mut out = Vec::with_capacity(total);
    for (len, piece) in pieces {
        let at = out.len();
        match piece {
            Piece::Owned(v) => out.extend_from_slice(&v[..v.len().min(len)]),
            Piece::Cached(w, from, to) => out.extend_from_slice(&w[from..to.min(from + len)]),
        }
        out.resize(at + len, 0);
    }
    ReadBuf::Owned(out)
}

/// How many of `len` bytes a write at `offset` may write: all of them, or those below
/// `MAX_FILE_SIZE` (a short write, as a local filesystem cuts one at its limit); EFBIG, with
/// nothing written, when it starts at or past it.
fn within_max_size(offset: u64, len: usize) -> Result<usize> {
    let max = odfs_proto::layout::MAX_FILE_SIZE;
    if len > 0 && offset >= max {
        let why = odfs_proto::layout::check_file_size(offset.saturating_add(len as u64)).unwrap_err();
        return Err(ClientError::new(odfs_proto::ErrorCode::FileTooBig, format!("a write at offset {offset}: {why}")));
    }
    Ok(len.min((max - offset.min(max)) as usize))
}

/// An open file of one process.
pub struct FileHandle {
    client: Client,
    data: Arc<InodeData>,
    ctx: Ctx,
    readable: bool,
    writable: bool,
    closed: bool,
    /// The inode's failed background writes this file's writes learned of (`WriteErrors`).
    write_seen: AtomicU64,
    /// Likewise for its fsyncs, flushes and close.
    sync_seen: AtomicU64,
}

impl FileHandle {
    /// True when this process wrote to the file since its size was last published: a flush
    /// has work to do (and may report a background write's error).
    pub fn has_unpublished_writes(&self) -> bool {
        self.data.size_hint.lock().expect("size lock").1
    }

    /// True when a background write failed since this file's last fsync, flush or close
    /// learned of the failures: its next one reports it.
    pub fn has_unreported_error(&self) -> bool {
        self.data.error_seq() > self.sync_seen.load(Ordering::Acquire)
    }

    pub(crate) fn new(client: Client, data: Arc<InodeData>, ctx: Ctx, readable: bool, writable: bool) -> FileHandle {
        let seen = data.error_seq();
        FileHandle {
            client,
            data,
            ctx,
            readable,
            writable,
            closed: false,
            write_seen: AtomicU64::new(seen),
            sync_seen: AtomicU64::new(seen),
        }
    }

    /// After the inode's writes were waited for: a failure this file's syncs have not learned.
    fn sync_error(&self) -> Result<()> {
        self.data.error_since(&self.sync_seen)
    }

    pub fn ino(&self) -> InodeId {
        self.data.ino
    }

    pub fn layout(&self) -> &Layout {
        &self.data.layout
    }

    /// The size including this process's writes.
    pub async fn size(&self) -> u64 {
        self.data.ws.lock().await.size
    }

    /// EACCES unless the file was opened for writing.
    fn check_writable(&self) -> Result<()> {
        if !self.writable {
            return Err(ClientError::new(odfs_proto::ErrorCode::Access, "file is not open for writing"));
        }
        Ok(())
    }

    pub async fn write(&self, offset: u64, data: &[u8]) -> Result<usize> {
        self.check_writable()?;
        let data = &data[..within_max_size(offset, data.len())?];
        self.data.error_since(&self.write_seen)?;
        self.data.write(&self.client, offset, data).await?;
        Ok(data.len())
    }

    /// [`Self::write`] of bytes handed over: pieces of 16 KiB or more are sent from their own
    /// buffer, not copied (which keeps that buffer, all of it, until the write is acknowledged;
    /// the write budget counts the bytes written); smaller ones are copied.
    pub async fn write_bytes(&self, offset: u64, data: Bytes) -> Result<usize> {
        self.check_writable()?;
        let data = data.slice(..within_max_size(offset, data.len())?);
        self.data.error_since(&self.write_seen)?;
        let n = data.len();
        self.data.write_bytes(&self.client, offset, data).await?;
        Ok(n)
    }

    /// [`Self::write`] when it can be done without waiting (see `InodeData::try_write`): `None`,
    /// with nothing done, when `write` must run instead.
    pub fn try_write(&self, offset: u64, data: &[u8]) -> Option<Result<usize>> {
        // A write at or past the largest file size: the general path refuses or cuts it.
        if !self.writable || within_max_size(offset, data.len()).ok() != Some(data.len()) {
            return None;
        }
        if let Err(e) = self.data.error_since(&self.write_seen) {
            return Some(Err(e));
        }
        Some(self.data.try_write(offset, data)?.map(|()| data.len()))
    }

    pub async fn read(&self, offset: u64, len: u32) -> Result<ReadBuf> {
        if !self.readable {
            return Err(ClientError::new(odfs_proto::ErrorCode::Access, "file is not open for reading"));
        }
        self.data.read(&self.client, offset, len).await
    }

    /// Like [`Self::read`], the bytes appended to `pipe` after `head(n)` (the FUSE reply's
    /// header: `n` is the reply's length) instead of returned; `Ok(n)`. A FUSE daemon then
    /// splices the pipe into `/dev/fuse`. `Err` leaves the pipe holding part of the reply: it
    /// must not be used again.
    pub async fn read_into_pipe(
        &self,
        offset: u64,
        len: u32,
        pipe: &mut odfs_rpc::splice::Pipe,
        head: impl FnOnce(usize) -> [u8; 16],
    ) -> Result<usize> {
        if !self.readable {
            return Err(ClientError::new(odfs_proto::ErrorCode::Access, "file is not open for reading"));
        }
        self.data.read_into_pipe(&self.client, offset, len, pipe, head).await
    }

    /// Writes made to the file's chunk file without this library (FUSE passthrough: the kernel
    /// writes it directly): the size and mtime the chunk file now has, published by the next
    /// flush or fsync as this process's own writes would be.
    pub async fn note_external_write(&self, size: u64, mtime: Timespec) {
        let mut ws = self.data.ws.lock().await;
        ws.size = size;
        ws.size_dirty = true;
        ws.mtime = mtime;
        *self.data.size_hint.lock().expect("size lock") = (size, true);
    }

    /// From now on, every chunk write of this file asks stored for the CRC32C of the bytes it
    /// wrote (see [`Self::written_crc`]).
    pub fn check_writes(&self) {
        self.data.written.lock().expect("written lock").get_or_insert_with(BTreeMap::new);
    }

    /// Waits until every write this process made to the file has reached stored (or failed:
    /// the first error is returned).
    pub async fn wait_written(&self) -> Result<()> {
        self.data.drain(&self.client).await?;
        self.sync_error()
    }

    /// After [`Self::wait_written`]: the CRC32C of bytes `offset..offset + len` as stored
    /// acknowledged writing them, combined from the CRCs its chunk writes returned since
    /// [`Self::check_writes`]; None when those writes do not cover exactly that range (a gap,
    /// an overlap). A writer compares it with the CRC32C of what it sent: the bytes odfs holds
    /// are then known without reading them back. The writes used are forgotten.
    pub fn written_crc(&self, offset: u64, len: u64) -> Option<u32> {
        self.data.written_crc(offset, len)
    }

    /// Makes written data durable on every target and publishes the size.
    /// A background write that failed since this file's last fsync, flush or close fails it.
    pub async fn fsync(&self) -> Result<()> {
        let r = self.data.flush(&self.client, &self.ctx, true).await;
        self.sync_error()?;
        r
    }

    /// Publishes written data and size to other nodes (what close does); fails as fsync does
    /// for a background write that failed.
    pub async fn flush(&self) -> Result<()> {
        let r = self.data.flush(&self.client, &self.ctx, false).await;
        self.sync_error()?;
        r
    }

    /// `ftruncate`: through a descriptor open for writing, access was decided at open.
    pub async fn truncate(&self, size: u64) -> Result<()> {
        let how = if self.writable { Truncate::OpenForWrite } else { Truncate::CheckAccess };
        self.client.truncate(&self.ctx, self.data.ino, size, how).await
    }

    /// `fallocate(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE)`: the range reads as zeros, the
    /// size stays.
    pub async fn punch_hole(&self, offset: u64, len: u64) -> Result<()> {
        self.check_writable()?;
        self.data.error_since(&self.write_seen)?;
        self.data.drain(&self.client).await?;
        let end = offset.saturating_add(len).min(self.size().await);
        if end <= offset {
            return Ok(());
        }
        self.data.ra.lock().expect("ra lock").chunks.clear();
        let punches = self.data.layout.segments(offset, end - offset).map(|seg| {
            let req = PunchChunk { target: seg.target, ino: self.data.ino, offset: seg.local_offset, len: seg.len };
            async move { self.client.store(seg.target, &req).await }
        });
        futures::future::try_join_all(punches).await?;
        Ok(())
    }

    /// Attributes with this process's view of the size.
    pub async fn getattr(&self) -> Result<Attr> {
        self.client.getattr(&self.ctx, self.data.ino).await
    }

    /// Closes a handle that needs no request to close — never registered with metad (opened
    /// from the cache, or created by a caching client) and with nothing to publish (read-only,
    /// or its writes published by a flush already): done at once. Otherwise the handle comes
    /// back, for `close`.
    pub fn close_if_clean(mut self) -> std::result::Result<(), FileHandle> {
        let unpublished = self.has_unpublished_writes() || self.has_unreported_error();
        if (self.writable && unpublished) || !self.client.release_without_request(&self.data) {
            return Err(self);
        }
        self.closed = true;
        Ok(())
    }

    /// Flushes and releases the handle. Errors of earlier background writes surface here.
    pub async fn close(mut self) -> Result<()> {
        self.closed = true;
        let r = if self.writable { self.flush().await } else { Ok(()) };
        self.client.release(&self.data).await;
        r
    }
}

impl Drop for FileHandle {
    fn drop(&mut self) {
        if !self.closed {
            // Dropped without close: flush in the background so nothing acknowledged is lost.
            let client = self.client.clone();
            let data = self.data.clone();
            let ctx = self.ctx.clone();
            let writable = self.writable;
            // On the client's own runtime: a handle can be dropped on a thread that has none
            // (or a reader thread's, which runs only while it serves a request), and skipping
            // the release would leave an unlinked file's chunks behind.
            let rt = client.inner.runtime.clone();
            rt.spawn(async move {
                if writable {
                    let _ = data.flush(&client, &ctx, false).await;
                }
                client.release(&data).await;
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_read_inside_a_read_ahead_chunk_shares_its_bytes_and_holes_read_as_zeros() {
        let chunk = Arc::new((0..=255u8).cycle().take(4096).collect::<Vec<u8>>());
        let got = assemble(vec![(1000, Piece::Cached(chunk.clone(), 100, 1100))], 1000);
        assert!(matches!(&got, ReadBuf::Shared(w, r) if Arc::ptr_eq(w, &chunk) && *r == (100..1100)));
        assert_eq!(got, chunk[100..1100].to_vec());
        // The chunk file ends before the read (a hole at the end): padded with zeros.
        let got = assemble(vec![(1000, Piece::Cached(chunk.clone(), 3596, 4096))], 1000);
        assert!(matches!(got, ReadBuf::Owned(_)));
        assert_eq!(&got[..500], &chunk[3596..]);
        assert!(got[500..].iter().all(|b| *b == 0));
        // Two pieces, one short: in order, the gap zeroed.
        let got = assemble(vec![(10, Piece::Owned(vec![7; 4])), (6, Piece::Cached(chunk.clone(), 0, 6))], 16);
        assert_eq!(got, [7, 7, 7, 7, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5].to_vec());
    }

    fn file() -> InodeData {
        let layout = Layout { chunk_size: 1 << 20, targets: vec![1], pool: String::new() };
        let d = InodeData::new(InodeId(7), layout);
        *d.written.lock().unwrap() = Some(BTreeMap::new());
        d
    }

    fn wrote(d: &InodeData, off: u64, bytes: &[u8]) {
        d.record_written(off, &Written { len: bytes.len() as u32, crc32c: Some(crc32c::crc32c(bytes)) });
    }

    #[test]
    fn written_crc_combines_writes_that_cover_the_range_exactly() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let d = file();
        // Out of order, as background writes complete.
        wrote(&d, 4096, &data[4096..9000]);
        wrote(&d, 0, &data[..4096]);
        wrote(&d, 9000, &data[9000..]);
        assert_eq!(d.written_crc(0, 10_000), Some(crc32c::crc32c(&data)));
        assert_eq!(d.written_crc(0, 10_000), None, "the writes used are forgotten");
        assert_eq!(d.written_crc(5, 0), Some(0), "nothing written, nothing to cover");
    }

    #[test]
    fn a_write_buffer_keeps_large_pieces_as_they_are_and_copies_small_ones_in_order() {
        let data: Vec<u8> = (0..200_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let whole = Bytes::from(data.clone());
        let mut b = WriteBuf::new(4096);
        b.copy_in(&data[..100], 1 << 20);
        b.hand_over(whole.slice(100..50_100), 1 << 20); // large: kept
        b.hand_over(whole.slice(50_100..50_200), 1 << 20); // small: copied
        b.copy_in(&data[50_200..60_000], 1 << 20);
        b.hand_over(whole.slice(60_000..200_000), 1 << 20);
        assert_eq!((b.len, b.end()), (200_000, 204_096));
        let p = b.into_payload();
        assert_eq!(p.pieces().len(), 4, "copied, kept, copied, kept");
        assert_eq!(p.pieces()[1].as_ptr(), whole[100..].as_ptr(), "a large piece is not copied");
        assert!(p == data, "the bytes in file order");
    }

    #[test]
    fn written_crc_tells_nothing_about_gaps_overlaps_and_unasked_writes() {
        let data = vec![3u8; 8192];
        let d = file();
        wrote(&d, 0, &data[..4096]);
        wrote(&d, 5000, &data[5000..]);
        assert_eq!(d.written_crc(0, 8192), None, "a gap");
        wrote(&d, 0, &data[..4096]);
        wrote(&d, 2048, &data[2048..8192]);
        assert_eq!(d.written_crc(0, 8192), None, "an overlap");
        wrote(&d, 0, &data);
        assert_eq!(d.written_crc(0, 4096), None, "a write reaching past the range");
        let unasked = InodeData::new(InodeId(8), d.layout.clone());
        wrote(&unasked, 0, &data);
        assert_eq!(unasked.written_crc(0, 8192), None, "no CRCs were asked for");
    }
}
