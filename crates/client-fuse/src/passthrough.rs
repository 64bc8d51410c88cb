//! FUSE passthrough: files whose bytes all sit in one chunk file on this node's own target are
//! read, written and mapped by the kernel straight from that chunk file (docs/architecture.md,
//! "FUSE mount").
//!
//! Owns the backing files: which inode has one registered with the kernel (every open of an
//! inode must share it; it is unregistered when the last open goes), whether passthrough is on
//! for this mount (off for good, logged once, when the kernel or the process's privileges
//! refuse it), and reading a backing file's size and mtime for publishing and for getattr.
//! Which files qualify is the client library's answer ([`Client::local_chunk_path`]).

use odfs_client::Client;
use odfs_fuse_kernel::reply::BackingId;
use odfs_proto::meta::{Attr, FileKind};
use odfs_proto::Timespec;
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use tracing::{info, warn};

/// A chunk file registered with the kernel as an inode's backing file. Dropping it (with the
/// last open of the inode) unregisters it; the kernel keeps its own reference while it needs one.
pub struct Backing {
    file: File,
    id: BackingId,
}

impl Backing {
    /// The chunk file's size and mtime: what the kernel's writes made of the file.
    pub fn stat(&self) -> io::Result<(u64, Timespec)> {
        let m = self.file.metadata()?;
        Ok((m.len(), Timespec { sec: m.mtime(), nsec: m.mtime_nsec() as u32 }))
    }

    /// The id the kernel knows this backing file by.
    pub fn id(&self) -> &BackingId {
        &self.id
    }

    /// This backing file as an open handle keeps it, with the size and mtime it has now.
    pub fn for_handle(self: &Arc<Self>) -> HandleBacking {
        HandleBacking { backing: self.clone(), seen: Mutex::new(self.stat().unwrap_or_default()) }
    }

    /// fdatasync of the chunk file.
    pub fn sync(&self) -> io::Result<()> {
        self.file.sync_data()
    }
}

/// An open handle's backing file, with its size and mtime when the handle last looked.
pub struct HandleBacking {
    pub backing: Arc<Backing>,
    seen: Mutex<(u64, Timespec)>,
}

impl HandleBacking {
    /// The backing file's size and mtime if the kernel wrote to it since the last look.
    pub fn changed(&self) -> io::Result<Option<(u64, Timespec)>> {
        let now = self.backing.stat()?;
        let before = std::mem::replace(&mut *self.seen.lock().expect("seen lock"), now);
        Ok((before != now).then_some(now))
    }
}

/// What an open found for an inode: the backing file it already has, or a chunk file opened for
/// it, to register with the open's reply.
pub enum Candidate {
    Live(Arc<Backing>),
    Opened(File),
}

/// The backing files of this mount.
pub struct Backings {
    on: AtomicBool,
    /// Set with the first backing file: until then no lookup takes the table's lock (every
    /// cached open and getattr asks).
    used: AtomicBool,
    live: Mutex<HashMap<u64, Weak<Backing>>>,
}

impl Backings {
    /// Passthrough on (the kernel offered it at init) or off.
    pub fn new(on: bool) -> Backings {
        Backings { on: AtomicBool::new(on), used: AtomicBool::new(false), live: Mutex::new(HashMap::new()) }
    }

    pub fn set_on(&self, on: bool) {
        self.on.store(on, Ordering::Relaxed);
    }

    /// The backing file inode `ino` has while it is open here, if any.
    pub fn live(&self, ino: u64) -> Option<Arc<Backing>> {
        if !self.used.load(Ordering::Relaxed) {
            return None;
        }
        self.live.lock().expect("backings lock").get(&ino).and_then(Weak::upgrade)
    }

    /// The file `attr` names, if it qualifies: its live backing file, or its chunk file opened
    /// now. `None` (the normal path) when passthrough is off, the file is not a regular file
    /// whose bytes are all on this node, or its chunk file is missing although it has bytes.
    pub fn candidate(&self, client: &Client, attr: &Attr) -> Option<Candidate> {
        if !self.on.load(Ordering::Relaxed) || attr.kind != FileKind::File {
            return None;
        }
        // Only a file of one stripe can qualify: the common striped file stops here. A live
        // backing file is taken before asking the cluster view: while one is open, every open
        // of the inode must share it, whatever became of its target since.
        let layout = attr.layout.as_ref().filter(|l| l.targets.len() == 1)?;
        if let Some(b) = self.live(attr.ino.0) {
            return Some(Candidate::Live(b));
        }
        // A set-id file's writes must clear its set-id bits, which the kernel leaves to
        // odfs-fuse's write (kill-priv v2): a passthrough write would never reach it.
        if attr.mode & 0o6000 != 0 {
            return None;
        }
        let path = client.local_chunk_path(attr.ino, layout)?;
        // An empty file may have no chunk file yet: made here as stored would at its first write.
        let open = |create: bool| OpenOptions::new().read(true).write(true).create(create).mode(0o644).open(&path);
        let file = match open(false) {
            Err(e) if e.kind() == io::ErrorKind::NotFound && attr.size == 0 => {
                if let Some(dir) = path.parent() {
                    let _ = std::fs::create_dir_all(dir);
                }
                open(true)
            }
            r => r,
        };
        match file {
            Ok(f) => Some(Candidate::Opened(f)),
            Err(e) => {
                info!(ino = %attr.ino, path = %path.display(), error = %e, "no passthrough for this file");
                None
            }
        }
    }

    /// The backing file to give the kernel for `c`, registering an opened chunk file with
    /// `register` (the open's reply) unless another open of the inode got there first. `None`
    /// when registering fails: then passthrough is turned off for the mount if the failure is
    /// the kernel's or the privileges' (logged once), and the open takes the normal path.
    pub fn register(
        &self,
        ino: u64,
        c: Candidate,
        register: impl FnOnce(&File) -> io::Result<BackingId>,
    ) -> Option<Arc<Backing>> {
        let file = match c {
            Candidate::Live(b) => return Some(b),
            Candidate::Opened(f) => f,
        };
        let mut live = self.live.lock().expect("backings lock");
        if let Some(b) = live.get(&ino).and_then(Weak::upgrade) {
            return Some(b);
        }
        match register(&file) {
            Ok(id) => {
                let b = Arc::new(Backing { file, id });
                live.retain(|_, w| w.strong_count() > 0);
                live.insert(ino, Arc::downgrade(&b));
                self.used.store(true, Ordering::Relaxed);
                Some(b)
            }
            Err(e) => {
                let why = match e.raw_os_error() {
                    Some(libc::EPERM) => Some("registering a backing file needs CAP_SYS_ADMIN (odfs-fuse is not root)"),
                    Some(libc::ENOTTY) | Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) => {
                        Some("the kernel does not support FUSE passthrough")
                    }
                    _ => None,
                };
                match why {
                    Some(why) if self.on.swap(false, Ordering::Relaxed) => {
                        warn!(reason = why, error = %e, "FUSE passthrough off for this mount")
                    }
                    Some(_) => {}
                    None => warn!(%ino, error = %e, "could not register a backing file; normal path"),
                }
                None
            }
        }
    }

    /// `attr` with the size and mtime of its backing file where that is larger: the kernel's
    /// writes through passthrough are not published until close, and a stat on this node must
    /// see them (the kernel would otherwise take the smaller size from the reply).
    pub fn merge(&self, attr: &mut Attr) {
        if let Some((size, mtime)) = self.live(attr.ino.0).and_then(|b| b.stat().ok()) {
            if size > attr.size {
                attr.size = size;
                attr.mtime = mtime;
            }
        }
    }
}
