//! Short-circuit reads: the chunks on this node's own targets are read straight from their
//! chunk files, with no request to stored — save the disk part of a small read, which the
//! node's stored does for less (docs/decisions/0016-short-circuit-local-reads.md).
//!
//! Owns which of the node's targets may be read so — each checked once: the cluster view puts
//! it on this node and its directory's `target.id` names it, so a client that cannot see the
//! directory stored sees never reads a missing chunk file as a hole — the reads themselves, and
//! dropping from the page cache what a single sequential reader of a chunk file has left behind
//! (as stored does for the reads it serves, `odfs_service::drop_behind`).

use crate::cluster::Cluster;
use odfs_proto::layout::{chunk_path, TARGET_ID_FILE};
use odfs_proto::storage::ChunkRange;
use odfs_proto::{InodeId, NodeIndex, TargetId};
use odfs_service::drop_behind::Followed;
use odfs_service::fileio;
use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use tracing::{info, warn};

/// Reads this large are followed for drop-behind, as stored follows those it sends from the
/// chunk file; smaller ones (a small file's, a random reader's) keep their pages.
const FOLLOWED_MIN: u64 = 64 << 10;

/// Chunk files whose reads are followed at once; past this, one is forgotten (it starts
/// afresh if read again, as a chunk file whose descriptor stored's cache closed).
const STREAMS_MAX: usize = 4096;

/// The targets whose chunks this client reads itself.
pub(crate) struct LocalReads {
    /// The client config's `local_reads`.
    on: bool,
    node: NodeIndex,
    /// Targets decided on: their directory when their chunks are read here, `None` when they
    /// are read through stored (another node's target, a directory this client cannot see, a
    /// read that failed).
    decided: Mutex<HashMap<TargetId, Option<PathBuf>>>,
    /// The client config's `drop_behind_reads`.
    drop_behind: bool,
    /// What the reads of each chunk file read here looked like so far.
    streams: Mutex<HashMap<(TargetId, InodeId), Followed>>,
}

impl LocalReads {
    pub(crate) fn new(on: bool, node: NodeIndex, drop_behind: bool) -> LocalReads {
        LocalReads { on, node, decided: Mutex::new(HashMap::new()), drop_behind, streams: Mutex::default() }
    }

    /// The directory of `target` when its chunks are read straight from their files.
    pub(crate) fn dir(&self, cluster: &Cluster, target: TargetId) -> Option<PathBuf> {
        if !self.on {
            return None;
        }
        let known = self.decided.lock().expect("local reads lock").get(&target).cloned();
        match known {
            Some(dir) => dir,
            None => self.decide(cluster, target)?,
        }
    }

    /// Decides (and remembers) whether `target`'s chunks are read here; `None` without deciding
    /// while the target is not registered or offline (that may change).
    fn decide(&self, cluster: &Cluster, target: TargetId) -> Option<Option<PathBuf>> {
        let view = cluster.view();
        let t = view.target(target).filter(|t| t.online)?;
        let dir = match t.path.as_deref().map(PathBuf::from) {
            Some(dir) if t.node == self.node => match names_target(&dir, target) {
                Ok(()) => {
                    info!(target, dir = %dir.display(), "chunks on this node's target are read from its directory");
                    Some(dir)
                }
                Err(why) => {
                    info!(target, dir = %dir.display(), "chunks on this node's target are read through stored: {why}");
                    None
                }
            },
            _ => None,
        };
        self.decided.lock().expect("local reads lock").insert(target, dir.clone());
        Some(dir)
    }

    /// A read in `target`'s directory `dir` failed: its chunks are read through stored from now
    /// on (which reports the failure properly if it is the disk's).
    pub(crate) fn failed(&self, target: TargetId, dir: &Path, e: &io::Error) {
        warn!(target, dir = %dir.display(), error = %e, "reading a chunk file of this node failed; its target's chunks are read through stored");
        self.decided.lock().expect("local reads lock").insert(target, None);
    }

    /// Notes a read of `len` bytes at `offset` of `ino`'s chunk file on `target` (directory
    /// `dir`), about to be made here, and drops from the page cache what a single sequential
    /// reader has left behind of it (docs/architecture.md, "Stored drops what a single
    /// sequential reader has read": the mount's page cache holds the bytes read). Noted before
    /// the bytes are read, so that a drop decided earlier never takes pages a second reader has
    /// just read (`drop_behind::Followed`).
    pub(crate) fn read_behind(&self, target: TargetId, ino: InodeId, dir: &Path, offset: u64, len: u64) {
        if !self.drop_behind || len < FOLLOWED_MIN {
            return;
        }
        let followed = {
            let mut streams = self.streams.lock().expect("drop-behind streams lock");
            if streams.len() >= STREAMS_MAX && !streams.contains_key(&(target, ino)) {
                let any = *streams.keys().next().expect("a full table has a key");
                streams.remove(&any);
            }
            streams.entry((target, ino)).or_default().clone()
        };
        if let Some(due) = followed.read(offset, len) {
            let path = chunk_path(dir, ino);
            due.spawn(move |r| {
                if let Ok(Some(f)) = fileio::open_existing(&path) {
                    fileio::dont_need(&f, r.start, r.end - r.start);
                }
            });
        }
    }
}

/// Whether `dir/target.id` names `target`, or why not.
fn names_target(dir: &Path, target: TargetId) -> Result<(), String> {
    let path = dir.join(TARGET_ID_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    match text.trim().parse::<TargetId>() {
        Ok(id) if id == target => Ok(()),
        _ => Err(format!("{} holds {:?}, not this target's id", path.display(), text.trim())),
    }
}

/// Reads shorter than this that the page cache cannot answer whole are sent to the node's
/// stored rather than finished on the blocking pool: for a small read the hand-off to a pool
/// thread and back costs more than the request to stored, whose io_uring waits for the disk
/// with no thread per read (docs/decisions/0016-short-circuit-local-reads.md).
/// Measured on 4 local nodes, O_DIRECT random reads, the local path against stored's: 4 KiB
/// 19.2k/19.0k against 23.2k/23.3k IOPS, 16 KiB 231/240 against 270/293 MiB/s, 32 KiB about
/// even (454/420 against 405/446), 64 KiB 583/642 against 494/566.
pub(crate) const DISK_VIA_STORED_BELOW: usize = 32 << 10;
// `Client::read_chunk` notes only the reads it makes here: those it sends to stored are too
// short to follow.
const _: () = assert!(DISK_VIA_STORED_BELOW as u64 <= FOLLOWED_MIN);

/// What [`read_now`] got without waiting.
pub(crate) struct Now {
    /// The bytes the page cache held, from the read's offset on.
    pub(crate) data: Vec<u8>,
    /// All the bytes asked for are in `data`, or the file ended: nothing is left to read.
    pub(crate) complete: bool,
    /// The chunk file, when it could be opened from the dentry cache.
    file: Option<File>,
}

/// The part of a read of up to `len` bytes at `offset` of `ino`'s chunk file in target
/// directory `dir` that needs no waiting, read on the calling worker: what the page cache holds
/// of it, through a descriptor opened from the dentry cache alone.
pub(crate) fn read_now(dir: &Path, ino: InodeId, offset: u64, len: usize) -> Now {
    let Some(f) = fileio::open_cached(&chunk_path(dir, ino), libc::O_RDONLY) else {
        return Now { data: Vec::new(), complete: false, file: None };
    };
    match fileio::read_nowait(&f, offset, len) {
        Ok(now) => Now { data: now.data, complete: now.complete, file: Some(f) },
        // A filesystem that cannot read without waiting, say: the blocking read reports what
        // is a real error.
        Err(_) => Now { data: Vec::new(), complete: false, file: Some(f) },
    }
}

/// Finishes a read that [`read_now`] began (`now`, of `len` bytes at `offset` of `ino`'s chunk
/// file in `dir`) as stored would: short where the file ends, empty when there is no file (a
/// hole). The rest, and an open that needs the disk, on the blocking pool, appended to what the
/// page cache gave, in the same buffer.
pub(crate) async fn read_rest(dir: &Path, ino: InodeId, offset: u64, len: usize, now: Now) -> io::Result<Vec<u8>> {
    if now.complete {
        return Ok(now.data);
    }
    let path = chunk_path(dir, ino);
    tokio::task::spawn_blocking(move || {
        let mut data = now.data;
        let got = data.len();
        if let Some(f) = now.file.map_or_else(|| fileio::open_existing(&path), |f| Ok(Some(f)))? {
            fileio::read_append(&f, offset + got as u64, len - got, &mut data)?;
        }
        Ok(data)
    })
    .await
    .map_err(|e| io::Error::other(format!("blocking read task failed: {e}")))?
}

/// Reads several chunk files' ranges in target directory `dir` as stored's `ReadChunks` does:
/// range i's bytes are the `lens[i]` bytes after those of the ranges before it in the data,
/// short or empty as for [`read`], `None` where that range failed. One blocking call for them
/// all; every range is asked of the disk before the first is read, so cold reads overlap.
pub(crate) async fn read_many(dir: PathBuf, items: Vec<ChunkRange>) -> io::Result<(Vec<Option<u32>>, Vec<u8>)> {
    tokio::task::spawn_blocking(move || {
        let files: Vec<io::Result<Option<File>>> =
            items.iter().map(|r| fileio::open_existing(&chunk_path(&dir, r.ino))).collect();
        for (f, r) in files.iter().zip(&items) {
            if let Ok(Some(f)) = f {
                fileio::will_need(f, r.offset, r.len as u64);
            }
        }
        let (mut lens, mut data) = (Vec::with_capacity(items.len()), Vec::new());
        for (f, r) in files.into_iter().zip(&items) {
            lens.push(match f {
                Ok(None) => Some(0),
                Ok(Some(f)) => fileio::read_append(&f, r.offset, r.len as usize, &mut data).ok().map(|n| n as u32),
                Err(_) => None,
            });
        }
        (lens, data)
    })
    .await
    .map_err(|e| io::Error::other(format!("blocking read task failed: {e}")))
}
