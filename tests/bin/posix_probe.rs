//! `odfs-posix-probe`: runs filesystem calls given as JSON (one list of operations) as the
//! user it runs as, and prints one line per operation: `0` or the errno, then for `stat` the
//! fields the conformance table checks. The tests run it as root and as a user they create, on
//! a plain directory and on odfs mounts, so every expectation of the table is Linux's own.

use serde::Deserialize;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

#[derive(Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
enum Op {
    /// open(O_CREAT | O_EXCL | O_WRONLY, mode), close.
    Creat {
        path: PathBuf,
        mode: u32,
    },
    /// open(flags, 0644), close.
    Open {
        path: PathBuf,
        flags: i32,
    },
    Mkdir {
        path: PathBuf,
        mode: u32,
    },
    /// kind: 'p' FIFO, 's' socket, 'c' / 'b' device, 'f' regular.
    Mknod {
        path: PathBuf,
        kind: char,
        mode: u32,
        major: u32,
        minor: u32,
    },
    Symlink {
        target: PathBuf,
        path: PathBuf,
    },
    Link {
        from: PathBuf,
        to: PathBuf,
    },
    Unlink {
        path: PathBuf,
    },
    Rmdir {
        path: PathBuf,
    },
    Rename {
        from: PathBuf,
        to: PathBuf,
        flags: u32,
    },
    Chmod {
        path: PathBuf,
        mode: u32,
    },
    /// lchown (a symbolic link itself); -1 keeps the id.
    Chown {
        path: PathBuf,
        uid: i64,
        gid: i64,
    },
    Truncate {
        path: PathBuf,
        len: i64,
    },
    /// open(flags), write 10 bytes, ftruncate(len), close: what a descriptor opened for
    /// writing may do whatever the mode says.
    Ftruncate {
        path: PathBuf,
        flags: i32,
        mode: u32,
        len: i64,
    },
    /// utimensat(AT_SYMLINK_NOFOLLOW); a time is "now", "omit" or seconds.
    Utimens {
        path: PathBuf,
        atime: String,
        mtime: String,
    },
    /// Writes `data` into a new (mode 0644) or existing file.
    Write {
        path: PathBuf,
        data: String,
    },
    /// open(O_WRONLY) an existing file, write `data` at its start (no truncation), close.
    Rewrite {
        path: PathBuf,
        data: String,
    },
    /// lstat: prints `kind mode uid gid nlink size rdev`.
    Stat {
        path: PathBuf,
    },
}

fn c(p: &std::path::Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).expect("no NUL in a path")
}

/// The result of a libc call: 0, or the errno.
fn rc(r: libc::c_int) -> i32 {
    if r < 0 {
        std::io::Error::last_os_error().raw_os_error().unwrap_or(-1)
    } else {
        0
    }
}

fn ts(s: &str) -> libc::timespec {
    match s {
        "now" => libc::timespec { tv_sec: 0, tv_nsec: libc::UTIME_NOW },
        "omit" => libc::timespec { tv_sec: 0, tv_nsec: libc::UTIME_OMIT },
        n => libc::timespec { tv_sec: n.parse().expect("seconds"), tv_nsec: 0 },
    }
}

fn open_close(path: &std::path::Path, flags: i32, mode: u32) -> i32 {
    // SAFETY: plain libc calls on a NUL-terminated path.
    unsafe {
        let fd = libc::open(c(path).as_ptr(), flags, mode);
        if fd < 0 {
            return rc(fd);
        }
        libc::close(fd);
    }
    0
}

fn stat_line(path: &std::path::Path) -> String {
    // SAFETY: lstat fills the struct it is given.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    let r = rc(unsafe { libc::lstat(c(path).as_ptr(), &mut st) });
    if r != 0 {
        return r.to_string();
    }
    let kind = match st.st_mode & libc::S_IFMT {
        libc::S_IFREG => "f",
        libc::S_IFDIR => "d",
        libc::S_IFLNK => "l",
        libc::S_IFIFO => "p",
        libc::S_IFSOCK => "s",
        libc::S_IFCHR => "c",
        libc::S_IFBLK => "b",
        _ => "?",
    };
    let size = if kind == "d" { 0 } else { st.st_size };
    format!("0 {kind} {:o} {} {} {} {size} {}", st.st_mode & 0o7777, st.st_uid, st.st_gid, st.st_nlink, st.st_rdev)
}

fn run(op: &Op) -> String {
    // SAFETY (every call below): plain libc calls with NUL-terminated paths and owned buffers.
    unsafe {
        let r = match op {
            Op::Creat { path, mode } => open_close(path, libc::O_CREAT | libc::O_EXCL | libc::O_WRONLY, *mode),
            Op::Open { path, flags } => open_close(path, *flags, 0o644),
            Op::Mkdir { path, mode } => rc(libc::mkdir(c(path).as_ptr(), *mode)),
            Op::Mknod { path, kind, mode, major, minor } => {
                let t = match kind {
                    'p' => libc::S_IFIFO,
                    's' => libc::S_IFSOCK,
                    'c' => libc::S_IFCHR,
                    'b' => libc::S_IFBLK,
                    _ => libc::S_IFREG,
                };
                rc(libc::mknod(c(path).as_ptr(), t | *mode, libc::makedev(*major, *minor)))
            }
            Op::Symlink { target, path } => rc(libc::symlink(c(target).as_ptr(), c(path).as_ptr())),
            Op::Link { from, to } => rc(libc::link(c(from).as_ptr(), c(to).as_ptr())),
            Op::Unlink { path } => rc(libc::unlink(c(path).as_ptr())),
            Op::Rmdir { path } => rc(libc::rmdir(c(path).as_ptr())),
            Op::Rename { from, to, flags } => {
                rc(libc::renameat2(libc::AT_FDCWD, c(from).as_ptr(), libc::AT_FDCWD, c(to).as_ptr(), *flags))
            }
            Op::Chmod { path, mode } => rc(libc::chmod(c(path).as_ptr(), *mode)),
            Op::Chown { path, uid, gid } => rc(libc::lchown(c(path).as_ptr(), *uid as u32, *gid as u32)),
            Op::Truncate { path, len } => rc(libc::truncate(c(path).as_ptr(), *len)),
            Op::Ftruncate { path, flags, mode, len } => {
                let fd = libc::open(c(path).as_ptr(), *flags, *mode);
                if fd < 0 {
                    return rc(fd).to_string();
                }
                let data = b"0123456789";
                let mut r =
                    if libc::write(fd, data.as_ptr().cast(), data.len()) == data.len() as isize { 0 } else { rc(-1) };
                if r == 0 {
                    r = rc(libc::ftruncate(fd, *len));
                }
                libc::close(fd);
                r
            }
            Op::Utimens { path, atime, mtime } => {
                let t = [ts(atime), ts(mtime)];
                rc(libc::utimensat(libc::AT_FDCWD, c(path).as_ptr(), t.as_ptr(), libc::AT_SYMLINK_NOFOLLOW))
            }
            Op::Write { path, data } => {
                use std::io::Write;
                use std::os::unix::fs::OpenOptionsExt;
                let f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o644).open(path);
                match f.and_then(|mut f| f.write_all(data.as_bytes())) {
                    Ok(()) => 0,
                    Err(e) => e.raw_os_error().unwrap_or(-1),
                }
            }
            Op::Rewrite { path, data } => {
                use std::io::Write;
                match std::fs::OpenOptions::new().write(true).open(path).and_then(|mut f| f.write_all(data.as_bytes()))
                {
                    Ok(()) => 0,
                    Err(e) => e.raw_os_error().unwrap_or(-1),
                }
            }
            Op::Stat { path } => return stat_line(path),
        };
        r.to_string()
    }
}

fn main() {
    let script = std::env::args().nth(1).expect("usage: odfs-posix-probe JSON-LIST-OF-OPERATIONS");
    let ops: Vec<Op> = serde_json::from_str(&script).expect("a JSON list of operations");
    // SAFETY: umask has no preconditions; the table's modes are the modes it expects.
    unsafe { libc::umask(0) };
    for op in &ops {
        println!("{}", run(op));
    }
}
