//! READ replies spliced into `/dev/fuse` (docs/decisions/0017-spliced-reads.md).
//!
//! Owns whether this mount splices its replies (decided once, at mount, and said why not when
//! it does not), the duplicate of the session's `/dev/fuse` descriptor the replies go to, the
//! pipes they are gathered in, and the reply itself: the FUSE header, then the read's bytes
//! (`FileHandle::read_into_pipe`), spliced into the device in one call, which the kernel
//! copies once into the reader's page cache. A read that cannot be spliced (the pipe or a
//! stream failed midway) is answered by a copied reply as before, so a failure here costs a
//! copy, never a read.

use odfs_client::{Client, FileHandle, Pipe};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::sync::{Mutex, OnceLock};
use tracing::info;

/// Reads shorter than this are answered by a copied reply: a 4 KiB random read gains nothing
/// from a pipe and a stream of its own, and keeps the multiplexed connections' batching.
pub const MIN_SPLICED: u32 = 128 << 10;
/// Longest READ spliced: what the kernel sends at most (`max_pages` of 256 pages); a longer
/// one (a raised `fs.fuse.max_pages_limit`) would not fit the pipe and is copied.
pub const MAX_SPLICED: u32 = 1 << 20;
/// Bytes each pipe is made to hold: a whole `MAX_SPLICED` READ with its header, whatever
/// pieces the socket hands it in (each takes a slot of a page).
const PIPE_BYTES: usize = 2 << 20;
/// Pipes kept between reads.
const IDLE_PIPES: usize = 64;

/// The mount's spliced replies.
#[derive(Default)]
pub struct Splicer {
    /// Set at mount when replies are spliced: the session's device.
    fuse: OnceLock<OwnedFd>,
    idle: Mutex<Vec<Pipe>>,
}

impl Splicer {
    /// Whether this mount can splice, or why not: the client's settings and transport, and a
    /// pipe of `PIPE_BYTES` made as a trial (kept for the first read).
    pub fn check(&self, client: &Client) -> Result<(), String> {
        if !client.config().splice_reads {
            return Err("splice_reads is off in the client config".into());
        }
        if !client.can_splice() {
            return Err("chunk data travels over QUIC (bulk_transport), which cannot be spliced".into());
        }
        let pipe = Pipe::new(PIPE_BYTES).map_err(|e| {
            format!("a pipe of {PIPE_BYTES} bytes cannot be made ({e}): raise fs.pipe-max-size to {PIPE_BYTES} or run odfs-fuse with CAP_SYS_RESOURCE")
        })?;
        self.idle.lock().expect("pipes lock").push(pipe);
        Ok(())
    }

    /// Replies from now on go to `fuse` (the session's device, which every reader thread
    /// reads: a reply must reach the descriptor its request came from).
    pub fn enable(&self, fuse: BorrowedFd<'_>) -> std::io::Result<()> {
        let _ = self.fuse.set(fuse.try_clone_to_owned()?);
        info!("reads of {} KiB to {} MiB are spliced into /dev/fuse", MIN_SPLICED >> 10, MAX_SPLICED >> 20);
        Ok(())
    }

    /// Whether a READ of `size` bytes is to be spliced.
    pub fn wants(&self, size: u32) -> bool {
        (MIN_SPLICED..=MAX_SPLICED).contains(&size) && self.fuse.get().is_some()
    }

    /// Answers READ `unique` with `size` bytes of `handle` at `offset` by splicing them into
    /// the device. `false` when nothing was sent and the caller must answer it itself.
    pub async fn reply(&self, unique: u64, handle: &FileHandle, offset: u64, size: u32) -> bool {
        let Some(fuse) = self.fuse.get() else { return false };
        let pipe = self.idle.lock().expect("pipes lock").pop();
        let Some(mut pipe) = pipe.map_or_else(|| Pipe::new(PIPE_BYTES).ok(), Some) else { return false };
        let head = |n: usize| out_header(unique, n);
        if handle.read_into_pipe(offset, size, &mut pipe, head).await.is_err() {
            return false;
        }
        if pipe.splice_all_into(fuse.as_raw_fd()).is_err() {
            // The kernel took none of it or dropped the request (interrupted): an answer
            // copied is either the reply or ignored.
            return false;
        }
        let mut idle = self.idle.lock().expect("pipes lock");
        if idle.len() < IDLE_PIPES {
            idle.push(pipe);
        }
        true
    }
}

/// The `fuse_out_header` of a successful reply carrying `n` bytes: length, error 0, unique.
fn out_header(unique: u64, n: usize) -> [u8; 16] {
    let mut h = [0u8; 16];
    h[..4].copy_from_slice(&((16 + n) as u32).to_ne_bytes());
    h[8..].copy_from_slice(&unique.to_ne_bytes());
    h
}
