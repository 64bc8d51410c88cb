//! Mount points of odfs FUSE clients: finding them, waiting for one to appear, and taking one
//! down without ever hanging.
//!
//! Nothing here stats a mount point: on a stuck or dead FUSE daemon that blocks or fails with
//! "Transport endpoint is not connected". Mounts are found by reading /proc/self/mountinfo.

use anyhow::{bail, Result};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// One line of /proc/self/mountinfo that matters here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    pub mount_point: PathBuf,
    pub fstype: String,
    /// Device minor number: the FUSE connection id under /sys/fs/fuse/connections.
    pub minor: u32,
}

/// Undoes the octal escapes mountinfo uses for spaces and the like.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() {
            if let Ok(v) = u8::from_str_radix(&s[i + 1..(i + 4).min(s.len())], 8) {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Parses mountinfo text.
pub fn parse_mountinfo(text: &str) -> Vec<MountEntry> {
    text.lines()
        .filter_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            let f: Vec<&str> = left.split(' ').collect();
            let dev = f.get(2)?;
            let minor = dev.split(':').nth(1)?.parse().ok()?;
            let mount_point = PathBuf::from(unescape(f.get(4)?));
            let fstype = right.split(' ').next()?.to_string();
            Some(MountEntry { mount_point, fstype, minor })
        })
        .collect()
}

/// The mount at exactly `path`, if any (the last one wins when stacked).
pub fn mount_at(path: &Path) -> Option<MountEntry> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    parse_mountinfo(&text).into_iter().rev().find(|m| m.mount_point == path)
}

/// Waits until a FUSE mount appears at `path`: Ok(true) once it is there, Ok(false) at
/// `deadline`. `check` runs at every poll; its error (the FUSE client died, the job was called
/// off) ends the wait.
pub fn wait_mounted(path: &Path, deadline: Instant, mut check: impl FnMut() -> Result<()>) -> Result<bool> {
    loop {
        if mount_at(path).is_some_and(|m| m.fstype.starts_with("fuse")) {
            return Ok(true);
        }
        check()?;
        if Instant::now() > deadline {
            return Ok(false);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Mounts a tmpfs of `size` (tmpfs syntax: `8G`, `25%`) at `dir` for a RAM-backed target.
pub fn mount_tmpfs(dir: &Path, size: &str) -> Result<()> {
    use anyhow::Context;
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    crate::interrupt::mounting(dir)?;
    nix::mount::mount(
        Some("odfs-ram"),
        dir,
        Some("tmpfs"),
        nix::mount::MsFlags::MS_NOSUID | nix::mount::MsFlags::MS_NODEV,
        Some(format!("size={size},mode=0700").as_str()),
    )
    .with_context(|| format!("cannot mount the RAM target (tmpfs size={size}) at {}", dir.display()))
}

/// Runs `f` on a helper thread and gives up waiting after `limit` (the thread is left behind
/// if the kernel never returns; the caller moves on to a stronger measure).
fn bounded<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit).ok()
}

fn umount2(path: &Path, flags: libc::c_int) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())?;
    // SAFETY: a valid NUL-terminated path.
    if unsafe { libc::umount2(c.as_ptr(), flags) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Mounts the FUSE control filesystem if it is not there (it holds the abort files).
fn ensure_fusectl() {
    let dir = Path::new("/sys/fs/fuse/connections");
    if mount_at(dir).is_none() {
        let _ = std::process::Command::new("mount").args(["-t", "fusectl", "fusectl"]).arg(dir).status();
    }
}

/// Takes the mount at `path` down, escalating: unmount; abort the FUSE connection and unmount;
/// lazy unmount. Then a FUSE connection that outlives its mount here is aborted (see
/// [`end_survivor`]). Returns what it did, one line per step; an error only if the mount is
/// still there after every step.
pub fn unmount(path: &Path) -> Result<Vec<String>> {
    let before = mount_at(path);
    let mut did = unmount_escalating(path)?;
    if let Some(m) = before.filter(|m| m.fstype.starts_with("fuse")) {
        did.extend(end_survivor(path, m.minor));
    }
    crate::interrupt::unmounted(path);
    Ok(did)
}

/// How long a FUSE connection may outlive its last mount in this namespace before it is taken
/// for one that a copy elsewhere keeps alive.
const SURVIVOR_GRACE: Duration = Duration::from_secs(1);

/// Whether FUSE connection `minor` still lives (its directory in the control filesystem).
pub fn connection_alive(minor: u32) -> bool {
    Path::new(&format!("/sys/fs/fuse/connections/{minor}")).exists()
}

/// Aborts FUSE connection `minor`: every request of it fails at once and its daemon's reads
/// end, wherever the mount is.
pub fn abort_connection(minor: u32) -> std::io::Result<()> {
    ensure_fusectl();
    std::fs::write(format!("/sys/fs/fuse/connections/{minor}/abort"), "1")
}

/// After `path`'s mount here is gone: a mount namespace made while it was mounted (`unshare
/// -m`, a container, a service with its own /tmp) holds a copy of it that the unmount did not
/// reach, and that copy keeps the FUSE connection and its daemon alive — a bindfs or a
/// session thread waiting for the end of a connection that never comes. Such a connection,
/// still alive after [`SURVIVOR_GRACE`] with no mount of it left here, is aborted: the copy
/// then fails with ENOTCONN, and the daemon ends. One line when it did.
fn end_survivor(path: &Path, minor: u32) -> Option<String> {
    ensure_fusectl();
    let t = Instant::now();
    while connection_alive(minor) {
        let here = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        if parse_mountinfo(&here).iter().any(|m| m.minor == minor && m.fstype.starts_with("fuse")) {
            return None;
        }
        if t.elapsed() >= SURVIVOR_GRACE {
            return Some(match abort_connection(minor) {
                Ok(()) => format!(
                    "aborted FUSE connection {minor}: a copy of {} in another mount namespace kept it open",
                    path.display()
                ),
                Err(e) => format!(
                    "cannot abort FUSE connection {minor}, which a copy of {} in another mount namespace keeps open: {e}",
                    path.display()
                ),
            });
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

/// The steps of [`unmount`].
fn unmount_escalating(path: &Path) -> Result<Vec<String>> {
    let mut did = Vec::new();
    let Some(m) = mount_at(path) else { return Ok(did) };
    let p = path.to_path_buf();
    match bounded(Duration::from_secs(2), move || umount2(&p, 0)) {
        Some(Ok(())) => {
            did.push(format!("unmounted {}", path.display()));
            return Ok(did);
        }
        Some(Err(e)) => did.push(format!("unmount of {} failed: {e}", path.display())),
        None => did.push(format!("unmount of {} did not return within 2 s", path.display())),
    }
    if m.fstype.starts_with("fuse") {
        match abort_connection(m.minor) {
            Ok(()) => did.push(format!("aborted FUSE connection {}", m.minor)),
            Err(e) => did.push(format!("cannot abort FUSE connection {}: {e}", m.minor)),
        }
        let p = path.to_path_buf();
        if let Some(Ok(())) = bounded(Duration::from_secs(2), move || umount2(&p, 0)) {
            did.push(format!("unmounted {}", path.display()));
            return Ok(did);
        }
    }
    let p = path.to_path_buf();
    match bounded(Duration::from_secs(2), move || umount2(&p, libc::MNT_DETACH)) {
        Some(Ok(())) => did.push(format!("lazily unmounted {} (detached; freed when no longer busy)", path.display())),
        Some(Err(e)) => did.push(format!("lazy unmount of {} failed: {e}", path.display())),
        None => did.push(format!("lazy unmount of {} did not return", path.display())),
    }
    if mount_at(path).is_some() {
        bail!("{} is still mounted after every attempt: {}", path.display(), did.join("; "));
    }
    Ok(did)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_mountinfo_lines() {
        let text = "36 35 98:0 / /mnt1 rw,noatime master:1 - ext3 /dev/root rw,errors=continue\n\
                    52 30 0:48 / /tmp/a\\040b rw,nosuid,nodev,relatime shared:1 - fuse.odfs odfs rw,user_id=0\n";
        let v = parse_mountinfo(text);
        assert_eq!(v.len(), 2);
        assert_eq!(v[1].mount_point, PathBuf::from("/tmp/a b"));
        assert_eq!(v[1].fstype, "fuse.odfs");
        assert_eq!(v[1].minor, 48);
        assert_eq!(v[0].fstype, "ext3");
    }

    #[test]
    fn unmounting_what_is_not_mounted_does_nothing() {
        let d = tempfile::tempdir().unwrap();
        assert!(unmount(d.path()).unwrap().is_empty());
    }
}
