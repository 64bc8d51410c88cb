//! The FUSE side of the test kit: `odfs-fuse` mounted on a temporary directory for the life of
//! a guard, mountinfo lookups, running commands as another user, errno and byte assertions.

use crate::{bin_dir, LocalFs};
use std::ffi::CString;
use std::fs::{self, File};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One line of /proc/self/mountinfo.
pub struct MountLine {
    pub minor: u32,
    pub fstype: String,
    pub source: String,
    pub options: String,
}

pub fn mount_line(path: &Path) -> Option<MountLine> {
    let text = fs::read_to_string("/proc/self/mountinfo").expect("read mountinfo");
    text.lines().rev().find_map(|l| {
        let (left, right) = l.split_once(" - ")?;
        let f: Vec<&str> = left.split(' ').collect();
        if Path::new(&f.get(4)?.replace("\\040", " ")) != path {
            return None;
        }
        let r: Vec<&str> = right.split(' ').collect();
        Some(MountLine {
            minor: f.get(2)?.split(':').nth(1)?.parse().ok()?,
            fstype: r.first()?.to_string(),
            source: r.get(1)?.to_string(),
            options: r.get(2).unwrap_or(&"").to_string(),
        })
    })
}

pub fn odfs_fuse_bin() -> PathBuf {
    let bin = bin_dir().join("odfs-fuse");
    assert!(bin.is_file(), "{} is missing: build it first (cargo build -p odfs-client-fuse)", bin.display());
    bin
}

/// `odfs-fuse` mounted for the life of the guard; drop unmounts (fusermount3 -u, else a lazy
/// umount) and makes sure the process is gone.
pub struct FuseMount {
    pub child: Child,
    pub path: PathBuf,
    pub log: PathBuf,
}

impl FuseMount {
    pub fn start(fs: &LocalFs) -> FuseMount {
        Self::start_with(fs, &[])
    }

    pub fn start_with(fs: &LocalFs, extra: &[&str]) -> FuseMount {
        Self::start_at(fs, "mnt", extra)
    }

    /// A mount at `ROOT/{name}`, its log `ROOT/{name}.log`: with another name than the first's
    /// (`mnt`), a second client of the same filesystem, with caches of its own.
    pub fn start_at(fs: &LocalFs, name: &str, extra: &[&str]) -> FuseMount {
        assert!(
            Path::new("/dev/fuse").exists(),
            "/dev/fuse is missing: these tests mount a FUSE filesystem and need the fuse kernel module \
             (modprobe fuse) and, in a container, the device (--device /dev/fuse)"
        );
        let path = fs.root().join(name);
        fs::create_dir_all(&path).expect("mount point");
        let path = path.canonicalize().expect("canonical mount point");
        let log = fs.root().join(format!("{name}.log"));
        let out = File::create(&log).expect("fuse log");
        let child = Command::new(odfs_fuse_bin())
            .arg("--fs")
            .arg(fs.config_path())
            .arg("--mountpoint")
            .arg(&path)
            .args(extra)
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("log fd"))
            .stderr(out)
            .spawn()
            .expect("start odfs-fuse");
        let mut m = FuseMount { child, path, log };
        let start = Instant::now();
        loop {
            if let Some(l) = mount_line(&m.path) {
                if l.fstype == "fuse.odfs" {
                    return m;
                }
            }
            if let Ok(Some(st)) = m.child.try_wait() {
                panic!("odfs-fuse exited ({st}) before mounting:\n{}", m.log_text());
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "{} was not mounted as fuse.odfs within 10 s:\n{}",
                m.path.display(),
                m.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn p(&self, rel: &str) -> PathBuf {
        self.path.join(rel)
    }

    /// Waits (bounded) for the process to exit and returns its status.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let start = Instant::now();
        while start.elapsed() < limit {
            if let Ok(Some(st)) = self.child.try_wait() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for FuseMount {
    fn drop(&mut self) {
        if mount_line(&self.path).is_some_and(|l| l.fstype.starts_with("fuse")) {
            let ok = Command::new("fusermount3").arg("-u").arg(&self.path).status().is_ok_and(|s| s.success());
            if !ok {
                let _ = Command::new("umount").arg("-l").arg(&self.path).status();
            }
        }
        if self.wait_exit(Duration::from_secs(5)).is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

pub fn errno<T: std::fmt::Debug>(r: std::io::Result<T>) -> i32 {
    r.expect_err("expected an error").raw_os_error().expect("an OS error")
}

pub fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).expect("no NUL in path")
}

/// Fails with the first differing offset instead of printing megabytes.
pub fn assert_bytes(got: &[u8], want: &[u8], what: &str) {
    if got != want {
        let at = got.iter().zip(want).position(|(a, b)| a != b).unwrap_or(got.len().min(want.len()));
        panic!("{what}: {} bytes read, {} expected; first difference at offset {at}", got.len(), want.len());
    }
}

/// Runs `cmd` as `uid`/`gid` with exactly the supplementary `groups`.
pub fn as_user(uid: u32, gid: u32, groups: &[u32], cmd: &str, args: &[&Path]) -> std::process::Output {
    use std::os::unix::process::CommandExt;
    let groups: Vec<libc::gid_t> = groups.to_vec();
    let mut c = Command::new(cmd);
    c.args(args);
    // SAFETY: only async-signal-safe libc calls between fork and exec.
    unsafe {
        c.pre_exec(move || {
            if libc::setgroups(groups.len(), groups.as_ptr()) != 0 || libc::setgid(gid) != 0 || libc::setuid(uid) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    c.output().expect("run as user")
}
