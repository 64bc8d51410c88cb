//! The pool of emptied chunk files of one target (`<target>/free/<n>`), reused for new chunks.
//!
//! Owns the `free/` directory and the list of the names in it. A removed chunk file is renamed in
//! here and truncated; a new chunk file is a pooled one renamed into place, so creating and
//! removing chunk files allocates and frees no inodes (why: docs/architecture.md "Data path").
//! Knows nothing of chunk keys or the descriptor cache: the chunk store calls it with paths,
//! from its blocking calls.

use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Directory of a target holding its pooled chunk files.
pub const FREE_DIR: &str = "free";

/// Most emptied chunk files kept per target; removals beyond it unlink. An empty file costs an
/// inode and a directory entry, and the pool is taken before any new inode is made.
pub const RECYCLE_MAX: usize = 262_144;

/// A target's pool.
pub(crate) struct Recycler {
    dir: PathBuf,
    state: Mutex<Pool>,
}

struct Pool {
    /// Names (numbers) of the files in the pool.
    names: Vec<u64>,
    /// The next name to give a file moving in.
    next: u64,
    /// Cleared when the file system refuses `RENAME_NOREPLACE`: chunk files are then created
    /// and unlinked as usual.
    enabled: bool,
}

impl Recycler {
    /// The pool in `<root>/free`, created if missing; files a previous run left there are
    /// emptied and kept, anything else there is removed.
    pub(crate) fn open(root: &Path) -> io::Result<Recycler> {
        let dir = root.join(FREE_DIR);
        match fs::DirBuilder::new().mode(0o755).create(&dir) {
            Err(e) if e.kind() != io::ErrorKind::AlreadyExists => return Err(e),
            _ => {}
        }
        let mut names = Vec::new();
        for entry in fs::read_dir(&dir)? {
            let entry = entry?;
            let name = entry.file_name().to_str().and_then(|s| s.parse::<u64>().ok());
            match name {
                Some(n) if entry.file_type()?.is_file() => {
                    if entry.metadata()?.size() != 0 {
                        truncate(&entry.path())?;
                    }
                    names.push(n);
                }
                _ => remove_any(&entry.path())?,
            }
        }
        let next = names.iter().max().map_or(0, |m| m + 1);
        Ok(Recycler { dir, state: Mutex::new(Pool { names, next, enabled: true }) })
    }

    /// The `free/` directory.
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    /// Files in the pool.
    pub(crate) fn len(&self) -> usize {
        self.lock().names.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pool> {
        self.state.lock().expect("recycle pool lock")
    }

    fn path(&self, name: u64) -> PathBuf {
        self.dir.join(name.to_string())
    }

    /// Moves a pooled file to `dest` when `dest` does not exist, and returns it open for
    /// reading and writing, empty. `None`: nothing was moved (the pool is empty, `dest` exists,
    /// or its directory is missing) and the caller creates or opens `dest` itself.
    ///
    /// The pooled file is emptied (if a write from a client that died mid-request landed in it
    /// since it moved in) before it takes the chunk's name, never after: once it has the name,
    /// a concurrent request for the same new chunk may open it and write, and those bytes are
    /// acknowledged.
    pub(crate) fn take_into(&self, dest: &Path) -> io::Result<Option<fs::File>> {
        let name = {
            let mut p = self.lock();
            if !p.enabled {
                return Ok(None);
            }
            match p.names.pop() {
                Some(n) => n,
                None => return Ok(None),
            }
        };
        let from = self.path(name);
        let file = match fs::OpenOptions::new().read(true).write(true).open(&from) {
            Ok(f) => f,
            // Gone from under the pool (removed by hand): forget it.
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => {
                self.lock().names.push(name);
                return Err(e);
            }
        };
        if let Err(e) = empty(&file) {
            self.lock().names.push(name);
            return Err(e);
        }
        match rename_noreplace(&from, dest) {
            Ok(()) => Ok(Some(file)),
            // `dest` exists (made meanwhile by a concurrent request), or its directory is
            // missing: the file stays pooled.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EEXIST) | Some(libc::ENOENT)) => {
                self.lock().names.push(name);
                Ok(None)
            }
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL) | Some(libc::ENOSYS)) => {
                let mut p = self.lock();
                p.enabled = false;
                p.names.push(name);
                tracing::warn!(
                    dir = %self.dir.display(),
                    "the file system does not support RENAME_NOREPLACE; chunk files are not recycled"
                );
                Ok(None)
            }
            Err(e) => {
                self.lock().names.push(name);
                Err(e)
            }
        }
    }

    /// Adds up to `n` new empty files to the pool (fewer when it would pass `RECYCLE_MAX`);
    /// returns how many. Each allocates an inode now, so that a chunk file made later need not.
    pub(crate) fn precreate(&self, n: usize) -> io::Result<usize> {
        let mut made = 0;
        while made < n {
            let name = {
                let mut p = self.lock();
                if !p.enabled || p.names.len() >= RECYCLE_MAX {
                    break;
                }
                p.next += 1;
                p.next - 1
            };
            fs::OpenOptions::new().write(true).create_new(true).mode(0o644).open(self.path(name))?;
            self.lock().names.push(name);
            made += 1;
        }
        Ok(made)
    }

    /// Removes the chunk file at `path`: into the pool, emptied, or unlinked when the pool is
    /// full. A missing file is fine.
    pub(crate) fn put(&self, path: &Path) -> io::Result<()> {
        let name = {
            let mut p = self.lock();
            if !p.enabled || p.names.len() >= RECYCLE_MAX {
                None
            } else {
                p.next += 1;
                Some(p.next - 1)
            }
        };
        let Some(name) = name else {
            return ignore_missing(fs::remove_file(path));
        };
        let to = self.path(name);
        // Renamed first, so the chunk's name is gone at once; emptied after, so no write to the
        // old name can land in a file that is already empty.
        match fs::rename(path, &to) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        }
        if let Err(e) = truncate(&to) {
            let _ = fs::remove_file(&to);
            return Err(e);
        }
        self.lock().names.push(name);
        Ok(())
    }
}

fn ignore_missing(r: io::Result<()>) -> io::Result<()> {
    match r {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        r => r,
    }
}

fn remove_any(path: &Path) -> io::Result<()> {
    if fs::symlink_metadata(path)?.is_dir() {
        fs::remove_dir_all(path)
    } else {
        fs::remove_file(path)
    }
}

/// Truncates an open file to nothing unless it already is empty.
fn empty(file: &fs::File) -> io::Result<()> {
    if file.metadata()?.len() != 0 {
        file.set_len(0)?;
    }
    Ok(())
}

/// Truncates the file at `path` to nothing through a descriptor it then closes. ext4 marks a
/// file truncated to nothing so that its next close writes its new data out at once (for
/// programs that replace a file by truncating and rewriting it); closing it here, with nothing
/// to write, clears the mark, so the chunk later written into this file is not flushed at its
/// close, synchronously on stored's request path.
fn truncate(path: &Path) -> io::Result<()> {
    empty(&fs::OpenOptions::new().write(true).open(path)?)
}

fn rename_noreplace(from: &Path, to: &Path) -> io::Result<()> {
    nix::fcntl::renameat2(None, from, None, to, nix::fcntl::RenameFlags::RENAME_NOREPLACE).map_err(io::Error::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("odfs-recycle-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(d.join("chunks")).unwrap();
        d
    }

    #[test]
    fn a_removed_file_is_emptied_and_becomes_the_next_new_one() {
        let root = scratch("reuse");
        let pool = Recycler::open(&root).unwrap();
        let a = root.join("chunks/a");
        fs::write(&a, b"old chunk bytes").unwrap();
        let ino = fs::metadata(&a).unwrap().ino();
        pool.put(&a).unwrap();
        assert!(!a.exists(), "the chunk's name is gone");
        assert_eq!(pool.len(), 1);
        let pooled = fs::read_dir(root.join(FREE_DIR)).unwrap().next().unwrap().unwrap().path();
        assert_eq!(fs::metadata(&pooled).unwrap().len(), 0, "emptied in the pool");

        let b = root.join("chunks/b");
        assert!(pool.take_into(&b).unwrap().is_some());
        assert_eq!(fs::metadata(&b).unwrap().ino(), ino, "the same inode, reused");
        assert_eq!(fs::read(&b).unwrap(), b"", "and empty");
        assert_eq!(pool.len(), 0);
        assert!(pool.take_into(&root.join("chunks/c")).unwrap().is_none(), "an empty pool moves nothing");
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn an_existing_chunk_is_never_replaced() {
        let root = scratch("noreplace");
        let pool = Recycler::open(&root).unwrap();
        let a = root.join("chunks/a");
        fs::write(&a, b"x").unwrap();
        pool.put(&a).unwrap();
        let b = root.join("chunks/b");
        fs::write(&b, b"live data").unwrap();
        assert!(pool.take_into(&b).unwrap().is_none());
        assert_eq!(fs::read(&b).unwrap(), b"live data");
        assert_eq!(pool.len(), 1, "the pooled file stays pooled");
        // A missing directory is not an error either: the caller creates it.
        assert!(pool.take_into(&root.join("gone/c")).unwrap().is_none());
        assert_eq!(pool.len(), 1);
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_pooled_file_written_late_is_emptied_when_taken() {
        let root = scratch("late");
        let pool = Recycler::open(&root).unwrap();
        let a = root.join("chunks/a");
        fs::write(&a, b"x").unwrap();
        let stale = fs::OpenOptions::new().write(true).open(&a).unwrap();
        pool.put(&a).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&stale, b"late write", 0).unwrap();
        let b = root.join("chunks/b");
        assert!(pool.take_into(&b).unwrap().is_some());
        assert_eq!(fs::read(&b).unwrap(), b"");
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_restart_keeps_the_pool_and_clears_what_does_not_belong() {
        let root = scratch("restart");
        let free = root.join(FREE_DIR);
        fs::create_dir_all(free.join("junkdir")).unwrap();
        fs::write(free.join("7"), b"left over").unwrap();
        fs::write(free.join("notanumber"), b"").unwrap();
        let pool = Recycler::open(&root).unwrap();
        assert_eq!(pool.len(), 1);
        assert_eq!(fs::metadata(free.join("7")).unwrap().len(), 0);
        assert!(!free.join("junkdir").exists() && !free.join("notanumber").exists());
        // New names never collide with the kept ones.
        let a = root.join("chunks/a");
        fs::write(&a, b"x").unwrap();
        pool.put(&a).unwrap();
        assert!(free.join("8").exists());
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn precreated_files_are_taken_first_and_never_collide() {
        let root = scratch("precreate");
        let pool = Recycler::open(&root).unwrap();
        let a = root.join("chunks/a");
        fs::write(&a, b"x").unwrap();
        pool.put(&a).unwrap();
        assert_eq!(pool.precreate(3).unwrap(), 3);
        assert_eq!(pool.len(), 4);
        let names: Vec<_> = fs::read_dir(root.join(FREE_DIR)).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 4, "four distinct files: {names:?}");
        for c in ["b", "c", "d", "e"] {
            let dest = root.join("chunks").join(c);
            assert!(pool.take_into(&dest).unwrap().is_some());
            assert_eq!(fs::read(&dest).unwrap(), b"");
        }
        assert!(pool.take_into(&root.join("chunks/f")).unwrap().is_none(), "all four taken");
        // A restart keeps precreated files like recycled ones.
        pool.precreate(2).unwrap();
        drop(pool);
        assert_eq!(Recycler::open(&root).unwrap().len(), 2);
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn removing_a_missing_chunk_is_fine() {
        let root = scratch("missing");
        let pool = Recycler::open(&root).unwrap();
        pool.put(&root.join("chunks/none")).unwrap();
        assert_eq!(pool.len(), 0);
        fs::remove_dir_all(&root).unwrap();
    }
}
