//! Opens: a process's open files (`FileHandle`) and the calls that make and end them (open,
//! open from the cache, create-and-open, the handle's close and release). A handle reads and
//! writes through its inode's data state (`file::InodeData`), which every handle of the inode in
//! this process shares; its close publishes what it wrote and, the last one, releases the inode
//! at metad.

use crate::ctx::{Ctx, Truncate};
use crate::file::{within_max_size, InodeData, Owner, ReadBuf};
use crate::fs::may_read;
use crate::link::ServiceLink;
use crate::{Client, ClientError, Result};
use bytes::Bytes;
use odfs_proto::meta::*;
use odfs_proto::storage::PunchChunk;
use odfs_proto::{DirLayout, ErrorCode, InodeId, Layout, Timespec};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tracing::warn;

impl Owner for Client {
    fn link(&self) -> &ServiceLink {
        &self.inner.link
    }
    fn write_budget(&self) -> &Arc<tokio::sync::Semaphore> {
        &self.inner.write_budget
    }
    async fn splice_segments(
        &self,
        ino: InodeId,
        segs: Vec<odfs_proto::layout::Segment>,
        pipe: &mut odfs_rpc::splice::Pipe,
    ) -> Result<()> {
        Client::splice_segments(self, ino, segs, pipe).await
    }
    async fn space_may_come(&self, first: &mut Option<std::time::Instant>) -> bool {
        Client::space_may_come(self, first).await
    }
    async fn sync_deferred(&self) {
        Client::sync_deferred(self).await
    }
    async fn publish_size(&self, ctx: &Ctx, ino: InodeId, size: u64, mtime: Timespec) -> Result<()> {
        Client::publish_size(self, ctx, ino, size, mtime).await
    }
}

impl Client {
    /// Opens an existing file. `truncate` empties it (O_TRUNC).
    pub async fn open(&self, ctx: &Ctx, ino: InodeId, read: bool, write: bool, truncate: bool) -> Result<FileHandle> {
        let t = self.inner.cache.ticket();
        // Always asked of metad: this is the "open" of close-to-open. The open is registered,
        // so the file outlives its last name while open.
        let h = self.header(ctx);
        let registered = h.request_id;
        let attr = match self.meta_as(&h, Self::shard_of(ino), &Open { ino, read, write, register: true }).await {
            // Removed by this client a moment ago (see `REMOVED_GRACE`): the old file, for reading.
            // The removal's reply may still be on its way (see `removing`): after it.
            Err(e) if e.code() == ErrorCode::NotFound && !write && !truncate => {
                self.inner.removals.settled(self.inner.removals.mark()).await;
                match self.removed_attr(ino) {
                    Some(a) => return self.handle_for(ctx, a, read, false, 0),
                    None => return Err(e),
                }
            }
            r => r?,
        };
        self.cache_attr(&attr, t);
        let handle = self.handle_for(ctx, attr, read, write, registered)?;
        if truncate && write {
            self.truncate(ctx, ino, 0, Truncate::Checked).await?;
        }
        Ok(handle)
    }

    /// Opens a file for reading from the cache alone, when a lease covers its attributes and
    /// they let the caller read: no request to metad (the open is registered only if its file
    /// is recalled or this client removes a name). `None`: ask metad (`open`).
    pub fn open_cached(&self, ctx: &Ctx, ino: InodeId) -> Option<Result<(FileHandle, Attr)>> {
        let attr = self.inner.cache.attr(ino)?;
        if attr.kind != FileKind::File || attr.layout.is_none() || !may_read(ctx, &attr) {
            return None;
        }
        Some(self.handle_for(ctx, attr.clone(), true, false, 0).map(|h| (h, self.merge_local(attr))))
    }

    /// Creates (or, without `exclusive`, opens) a file and returns a handle for writing.
    pub async fn create_open(
        &self,
        ctx: &Ctx,
        parent: InodeId,
        name: &[u8],
        mode: u32,
        exclusive: bool,
        layout: Option<DirLayout>,
    ) -> Result<(CreateReply, FileHandle)> {
        if layout.is_none() {
            if let Some(r) = self.create_delegated(ctx, parent, name, mode).await {
                let handle = self.handle_for(ctx, r.attr.clone(), true, true, 0)?;
                return Ok((r, handle));
            }
        }
        let t = self.inner.cache.ticket();
        // A caching client does not register: the new file is leased to it, and it registers
        // its opens before it removes a name (see `open_cached`). Others hold no lease.
        let register = !self.caching();
        let req = Create { parent, name: name.to_vec(), mode, exclusive, layout, register, node: Some(self.node()) };
        self.inner.cache.forget_entry(parent, name);
        let mut refused = None;
        let (r, registered) = loop {
            // Each try a new request: metad refuses a full pool from the space last reported.
            let h = self.header(ctx);
            let registered = if register { h.request_id } else { 0 };
            match self.entry_call_as(ctx, &h, parent, name, &req).await {
                Err(e) if e.code() == ErrorCode::NoSpace && self.space_may_come(&mut refused).await => {}
                r => break (r?, registered),
            }
        };
        self.made_entry(ctx, parent, name, Some(&r.attr), t);
        self.cache_parent(r.parent.as_ref(), t);
        let handle = self.handle_for(ctx, r.attr.clone(), true, true, registered)?;
        Ok((r, handle))
    }

    /// A handle on a file opened by request `registered` (its open is registered with metad).
    pub(crate) fn handle_for(
        &self,
        ctx: &Ctx,
        attr: Attr,
        read: bool,
        write: bool,
        registered: u64,
    ) -> Result<FileHandle> {
        let layout = match (attr.kind, attr.layout.clone()) {
            (FileKind::File, Some(l)) => l,
            (FileKind::Dir, _) => return Err(ErrorCode::IsDir.into()),
            _ => return Err(ClientError::new(ErrorCode::Invalid, "not a regular file")),
        };
        let data = {
            let mut map = self.inner.inodes.lock().expect("inodes lock");
            map.entry(attr.ino).or_insert_with(|| Arc::new(InodeData::new(attr.ino, layout))).clone()
        };
        data.opened(attr.size, registered);
        Ok(FileHandle::new(self.clone(), data, ctx.clone(), read, write))
    }

    /// A close that needs no request: the inode's opens here were never registered with metad
    /// (checked under the inodes lock, which registrations take too). True when done.
    pub(crate) fn release_without_request(&self, data: &Arc<InodeData>) -> bool {
        let mut map = self.inner.inodes.lock().expect("inodes lock");
        if data.registered() != 0 {
            return false;
        }
        if data.closed() {
            if let Some(cur) = map.get(&data.ino) {
                if Arc::ptr_eq(cur, data) {
                    map.remove(&data.ino);
                }
            }
        }
        true
    }

    /// Called by a handle's close: forget the inode's data state when its last handle goes.
    pub(crate) async fn release(&self, data: &Arc<InodeData>) {
        let last = {
            let mut map = self.inner.inodes.lock().expect("inodes lock");
            let last = data.closed();
            if last {
                if let Some(cur) = map.get(&data.ino) {
                    if Arc::ptr_eq(cur, data) {
                        map.remove(&data.ino);
                    }
                }
            }
            last
        };
        if !last {
            return;
        }
        // The last handle here: the file is no longer held open by this client. An orphan
        // (its last name went while open) is then gone, and its chunks with it: every target,
        // as writes of this process may lie beyond any published size.
        // A registration of an open answered from the cache may be on its way: after it.
        drop(data.registering.lock().await);
        if data.registered() == 0 {
            // Opened from the cache and never registered: metad has nothing to release.
            return;
        }
        let req = Release { files: vec![(data.ino, data.registered())] };
        match self.meta(&Ctx::root(), Self::shard_of(data.ino), &req).await {
            Ok(r) => {
                for a in r.removed {
                    self.remove_chunks(&data.layout, a.ino, None).await;
                }
            }
            Err(e) => {
                warn!(ino = %data.ino, error = %e, "release failed: metad frees the file when this client's session ends")
            }
        }
    }
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
        self.data.size().await
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
        self.data.note_external_write(size, mtime).await
    }

    /// From now on, every chunk write of this file asks stored for the CRC32C of the bytes it
    /// wrote (see [`Self::written_crc`]).
    pub fn check_writes(&self) {
        self.data.check_writes();
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
        self.data.forget_read_ahead();
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
            let rt = client.inner.link.runtime.clone();
            rt.spawn(async move {
                if writable {
                    let _ = data.flush(&client, &ctx, false).await;
                }
                client.release(&data).await;
            });
        }
    }
}
