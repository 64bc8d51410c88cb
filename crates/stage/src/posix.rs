//! The POSIX side of a stage (the site's global PFS), accessed with the identity of the user
//! who asked for the stage: the agent runs as root, so every access switches the calling
//! thread's filesystem uid, gid and groups (Linux keeps them per thread) for its duration and
//! the kernel checks permissions as it would for that user.
//!
//! Owns: reads, writes into a temporary file renamed into place, walking a tree. Must not
//! touch odfs.

use odfs_client::Ctx;
use odfs_proto::Timespec;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// Runs `f` on a blocking thread whose filesystem identity is `ctx`'s.
pub async fn as_user<T: Send + 'static>(
    ctx: &Ctx,
    f: impl FnOnce() -> std::io::Result<T> + Send + 'static,
) -> std::io::Result<T> {
    let ctx = ctx.clone();
    tokio::task::spawn_blocking(move || with_identity(&ctx, f)).await.map_err(std::io::Error::other)?
}

/// Runs `f` on a new thread whose filesystem identity is `ctx`'s, for callers without a
/// runtime; the calling thread's identity never changes.
pub fn as_user_blocking<T: Send + 'static>(
    ctx: &Ctx,
    f: impl FnOnce() -> std::io::Result<T> + Send + 'static,
) -> std::io::Result<T> {
    let ctx = ctx.clone();
    std::thread::spawn(move || with_identity(&ctx, f))
        .join()
        .map_err(|_| std::io::Error::other("worker thread panicked"))?
}

/// Switches this thread to `ctx`'s filesystem identity (when running as root), runs `f`, and
/// switches back.
fn with_identity<T>(ctx: &Ctx, f: impl FnOnce() -> std::io::Result<T>) -> std::io::Result<T> {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let switch = root && ctx.uid != 0;
    if switch {
        set_identity(ctx.uid, ctx.gid, &ctx.groups)?;
    }
    let r = f();
    if switch {
        set_identity(0, 0, &[])?;
    }
    r
}

/// Sets this thread's groups, fsgid and fsuid with raw syscalls: glibc's wrappers would
/// change every thread of the process.
fn set_identity(uid: u32, gid: u32, groups: &[u32]) -> std::io::Result<()> {
    // SAFETY: raw syscalls with a valid buffer and its length.
    unsafe {
        if libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        libc::syscall(libc::SYS_setfsgid, gid);
        libc::syscall(libc::SYS_setfsuid, uid);
        // setfsuid/setfsgid return the previous value; read back to confirm the change.
        if libc::syscall(libc::SYS_setfsuid, u32::MAX) as u32 != uid
            || libc::syscall(libc::SYS_setfsgid, u32::MAX) as u32 != gid
        {
            return Err(std::io::Error::other("cannot switch the filesystem identity"));
        }
    }
    Ok(())
}

/// Reads up to `len` bytes at `off` of `path` as the user.
pub async fn read_at(ctx: &Ctx, path: &Path, off: u64, len: usize) -> Result<Vec<u8>, String> {
    let p = path.to_path_buf();
    as_user(ctx, move || {
        let f = std::fs::File::open(&p)?;
        let mut buf = vec![0u8; len];
        let mut got = 0;
        while got < len {
            let n = f.read_at(&mut buf[got..], off + got as u64)?;
            if n == 0 {
                break;
            }
            got += n;
        }
        buf.truncate(got);
        Ok(buf)
    })
    .await
    .map_err(|e| format!("{}: {e}", path.display()))
}

/// A file being written: a temporary name beside its destination, renamed into place by
/// `commit` so a reader never sees half a file.
pub struct Staged {
    ctx: Ctx,
    tmp: PathBuf,
    dst: PathBuf,
    mode: u32,
}

impl Staged {
    pub async fn create(ctx: &Ctx, dst: &Path, mode: u32) -> Result<Staged, String> {
        let name = dst.file_name().ok_or_else(|| format!("{}: no file name", dst.display()))?;
        let tmp = dst.with_file_name(format!(".{}.odfs-part", name.to_string_lossy()));
        let (t, d) = (tmp.clone(), dst.to_path_buf());
        as_user(ctx, move || {
            if let Some(parent) = d.parent() {
                std::fs::create_dir_all(parent)?;
            }
            std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&t).map(|_| ())
        })
        .await
        .map_err(|e| format!("{}: {e}", tmp.display()))?;
        Ok(Staged { ctx: ctx.clone(), tmp, dst: dst.to_path_buf(), mode: mode & 0o7777 })
    }

    pub async fn write_at(&self, off: u64, data: Vec<u8>) -> Result<(), String> {
        let t = self.tmp.clone();
        as_user(&self.ctx, move || std::fs::OpenOptions::new().write(true).open(&t)?.write_all_at(&data, off))
            .await
            .map_err(|e| format!("{}: {e}", self.tmp.display()))
    }

    pub async fn commit(self, mtime: Timespec) -> Result<(), String> {
        let (t, d, mode) = (self.tmp.clone(), self.dst.clone(), self.mode);
        as_user(&self.ctx, move || {
            let f = std::fs::OpenOptions::new().write(true).open(&t)?;
            f.sync_all()?;
            f.set_permissions(std::fs::Permissions::from_mode(mode))?;
            let times = std::fs::FileTimes::new().set_modified(to_system_time(mtime));
            f.set_times(times)?;
            std::fs::rename(&t, &d)
        })
        .await
        .map_err(|e| format!("{}: {e}", self.dst.display()))
    }
}

fn to_system_time(t: Timespec) -> std::time::SystemTime {
    if t.sec >= 0 {
        std::time::UNIX_EPOCH + std::time::Duration::new(t.sec as u64, t.nsec)
    } else {
        std::time::UNIX_EPOCH
    }
}

/// One entry of a POSIX tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Relative path ('/'-separated).
    pub rel: String,
    pub dir: bool,
    pub size: u64,
    pub mtime: Timespec,
    pub mode: u32,
}

/// Every directory and regular file below `root` as the user (symlinks and special files are
/// reported in `skipped`).
pub async fn walk(ctx: &Ctx, root: &Path) -> Result<(Vec<Entry>, Vec<(String, String)>), String> {
    let r = root.to_path_buf();
    as_user(ctx, move || {
        let mut out = Vec::new();
        let mut skipped = Vec::new();
        let meta = std::fs::metadata(&r).map_err(named(&r))?;
        if !meta.is_dir() {
            return Err(std::io::Error::other(format!("{}: is not a directory", r.display())));
        }
        let mut stack = vec![String::new()];
        while let Some(rel) = stack.pop() {
            let dir = if rel.is_empty() { r.clone() } else { r.join(&rel) };
            for e in std::fs::read_dir(&dir).map_err(named(&dir))? {
                let e = e.map_err(named(&dir))?;
                let name = e.file_name().to_string_lossy().into_owned();
                let child = if rel.is_empty() { name } else { format!("{rel}/{name}") };
                let path = e.path();
                if let Some(why) = too_long(&path) {
                    skipped.push((child, why));
                    continue;
                }
                let m = std::fs::symlink_metadata(&path).map_err(named(&path))?;
                let entry = Entry {
                    rel: child.clone(),
                    dir: m.is_dir(),
                    size: m.len(),
                    mtime: Timespec { sec: m.mtime(), nsec: m.mtime_nsec() as u32 },
                    mode: m.mode() & 0o7777,
                };
                if m.is_dir() {
                    stack.push(child);
                    out.push(entry);
                } else if m.is_file() {
                    out.push(entry);
                } else {
                    skipped
                        .push((child, "not a regular file or directory (symlinks and devices are not staged)".into()));
                }
            }
        }
        Ok((out, skipped))
    })
    .await
    .map_err(|e| e.to_string())
}

/// An I/O error with the path it concerns in front.
fn named(p: &Path) -> impl Fn(std::io::Error) -> std::io::Error + '_ {
    move |e| std::io::Error::new(e.kind(), format!("{}: {e}", p.display()))
}

/// Why a path is longer than a program can open (PATH_MAX, with its NUL), if it is: it and
/// all below it are refused rather than failing the walk.
fn too_long(path: &Path) -> Option<String> {
    let len = path.as_os_str().len();
    (len >= libc::PATH_MAX as usize)
        .then(|| format!("its path is {len} bytes long, more than the {} bytes a program can open", libc::PATH_MAX - 1))
}
