//! Running a mount: checks before mounting, connecting the client, the session and its
//! options, post-mount tuning, and a clean stop on SIGTERM/SIGINT or unmount.
//!
//! Mount options: fsname `odfs:<job id>` and subtype `odfs` (so /proc/mounts shows
//! `odfs:<job> <mnt> fuse.odfs`), `default_permissions` (the kernel checks mode bits against
//! the attributes metad gave; metad checks again with the caller's groups), nosuid, nodev and
//! noatime, `allow_other` only when asked (`--allow-other`).
//!
//! Without `allow_other` only the mounting user may enter the mount (the kernel's rule, which
//! the session enforces again). The Slurm mode runs `odfs-fuse` as root for the job's user with
//! `--allow-other` and a mount point of mode 0700 owned by that user. Note that once mounted,
//! the mount point shows the filesystem's root directory, so it is that directory's owner and
//! mode (set for the job's user, 0700) that keep other users out; the underlying directory's
//! mode only guards the path while nothing is mounted.
//!
//! nosuid and nodev are always set; `session::Session::mount` mounts by `mount(2)` where it
//! may, by `fusermount3` otherwise.
//!
//! This module must not hold filesystem state: it hands everything to `fs::OdfsFuse`.

use crate::fs::{OdfsFuse, Shared, MAX_READAHEAD};
use crate::FuseError;
use odfs_client::{Client, ClientConfig, ClientError};
use odfs_fuse_kernel::session::{Acl, MountOptions, Session, Unmounter};
use std::io::ErrorKind;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::signal::unix::{signal, Signal, SignalKind};
use tracing::{info, warn};

/// The kernel's FUSE device.
pub const DEV_FUSE: &str = "/dev/fuse";
/// Threads reading requests from /dev/fuse (each with its own cloned descriptor unless reads
/// are spliced), one per core of the machines measured. A thread waits out the round trip of
/// a metadata request it runs itself (`reader`); four threads kept more of those in flight
/// (creates +6%, unlinks +5-10%) but cost a third of the cached small-file reads (each
/// request then woke an idle thread instead of finding one about to read: epochs 55-71k ->
/// 45-49k files/s).
pub const SESSION_THREADS: usize = 2;
/// Workers of the adapter's tokio runtime, where every request runs.
pub(crate) const RUNTIME_WORKERS: usize = 2;

/// What `odfs-fuse` is asked to do.
#[derive(Debug, Clone)]
pub struct MountArgs {
    /// The client config (`ROOT/odfs.toml`).
    pub fs: PathBuf,
    /// Where to mount.
    pub mountpoint: PathBuf,
    /// Mount with `allow_other`.
    pub allow_other: bool,
    /// Where to keep the client id while its metadata sessions last (see
    /// `odfs_job`'s `end_fuse_sessions`).
    pub session_file: Option<PathBuf>,
}

/// How the filesystem of job `job_id` is mounted.
pub fn mount_options(job_id: &str, allow_other: bool) -> (MountOptions, Acl) {
    // fusermount3 splits options at commas; keep the job id from breaking the list.
    let job: String = job_id.chars().map(|c| if c == ',' || c.is_whitespace() { '_' } else { c }).collect();
    let options = MountOptions {
        fsname: format!("odfs:{job}"),
        subtype: "odfs".into(),
        allow_other,
        default_permissions: true,
        // Reads do not update access times (metad is not told of reads); the mount says so.
        noatime: true,
        read_only: false,
    };
    (options, if allow_other { Acl::All } else { Acl::Owner })
}

/// Fails with a one-line reason unless `path` is an existing directory.
pub fn check_mount_point(path: &Path) -> Result<(), FuseError> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(FuseError::MountPointNotDir(path.into())),
        Err(e) if e.kind() == ErrorKind::NotFound => Err(FuseError::MountPointMissing(path.into())),
        Err(e) => Err(FuseError::MountPoint { path: path.into(), source: e }),
    }
}

/// Mounts the filesystem and serves it until it is unmounted or the process gets SIGTERM or
/// SIGINT (then open files are flushed and the mount is taken down).
pub fn run(args: &MountArgs) -> Result<(), FuseError> {
    let cfg = ClientConfig::load(&args.fs).map_err(|e| match e {
        ClientError::Config(msg) => FuseError::Config(msg),
        other => FuseError::Config(other.to_string()),
    })?;
    check_mount_point(&args.mountpoint)?;
    if !Path::new(DEV_FUSE).exists() {
        return Err(FuseError::NoDevFuse);
    }
    let mountpoint = args
        .mountpoint
        .canonicalize()
        .map_err(|e| FuseError::MountPoint { path: args.mountpoint.clone(), source: e })?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(RUNTIME_WORKERS)
        .thread_name("odfs-fuse-rt")
        .enable_all()
        .build()
        .map_err(FuseError::Runtime)?;
    // Signal handlers go in before the mount, so a SIGTERM during mounting still unmounts.
    let mut signals = {
        let _guard = rt.enter();
        let term = signal(SignalKind::terminate()).map_err(FuseError::Runtime)?;
        let int = signal(SignalKind::interrupt()).map_err(FuseError::Runtime)?;
        (term, int)
    };
    // A signal while the filesystem is still forming (a job's start being rolled back) ends the
    // wait at once: nothing is mounted yet.
    let connected = rt.block_on(async {
        tokio::select! {
            c = Client::connect(cfg.clone()) => Some(c),
            _ = signals.0.recv() => None,
            _ = signals.1.recv() => None,
        }
    });
    let Some(client) = connected else {
        info!("stopped before the filesystem was ready; nothing mounted");
        return Ok(());
    };
    let client = client.map_err(|e| FuseError::Connect { addr: cfg.mgmtd, source: e })?;
    rt.block_on(client.register(cfg.node)).map_err(FuseError::Register)?;
    if let Some(f) = &args.session_file {
        if let Err(e) = std::fs::write(f, format!("{:x}\n", client.id())) {
            warn!(file = %f.display(), error = %e, "cannot record this mount's client id; if this process dies, other nodes' changes may wait one lease for it");
        }
    }

    let fs = OdfsFuse::new(client.clone(), rt.handle().clone());
    let shared = fs.shared();
    let splice = shared.splicer.check(&client);
    let (options, acl) = mount_options(&cfg.job.id, args.allow_other);
    // A spliced reply goes to the descriptor its request was read from: with every reader
    // thread reading the session's own (no clones), that is the one descriptor kept.
    let clone_fd = splice.is_err();
    let mount_err = |e| FuseError::Mount { path: mountpoint.clone(), source: e };
    let mut session = Session::mount(&mountpoint, &options, acl).map_err(mount_err)?;
    session.init(&fs).map_err(mount_err)?;
    shared.set_notifier(session.notifier());
    let splice = match splice {
        Ok(()) if session.uses_rings() => Err("requests come by io_uring, whose replies go into the ring".into()),
        other => other,
    };
    match splice.map(|()| shared.splicer.enable(session.as_fd())) {
        Ok(Ok(())) => {}
        Ok(Err(e)) => warn!(error = %e, "reads are not spliced: the FUSE device cannot be duplicated"),
        Err(why) => info!("reads are not spliced: {why}"),
    }
    info!(mountpoint = %mountpoint.display(), job = %cfg.job.id, "mounted");
    tune_readahead(&mountpoint);
    rt.spawn(stop_on_signal(signals, shared.clone(), session.unmounter(), mountpoint.clone()));

    let served = session_end(session.run(fs, SESSION_THREADS, clone_fd)).map(|aborted| {
        if aborted {
            warn!(mountpoint = %mountpoint.display(), "the kernel aborted the FUSE connection");
        }
    });
    info!(mountpoint = %mountpoint.display(), "session ended");
    rt.block_on(shared.close_all());
    // Creates and unlinks this node answered itself reach metad before the connections go.
    if rt.block_on(async { tokio::time::timeout(DEFERRED_WAIT, client.sync_deferred()).await }).is_err() {
        warn!(
            "metad did not take this node's last creates and unlinks within {} s; they are lost",
            DEFERRED_WAIT.as_secs()
        );
    }
    // Its leases end now, not one lease from now: no other node's change waits for this one.
    rt.block_on(client.close());
    if let Some(f) = &args.session_file {
        let _ = std::fs::remove_file(f);
    }
    rt.shutdown_timeout(Duration::from_secs(2));
    served.map_err(FuseError::Session)
}

/// How long an unmount waits for metad to apply the creates and unlinks this node answered
/// itself.
const DEFERRED_WAIT: Duration = Duration::from_secs(30);

/// How a FUSE session ended, from its reader loop's result: `Ok(true)` when the kernel aborted
/// the connection rather than closing it. Reading /dev/fuse then fails with ECONNABORTED
/// instead of ENODEV (seen when a lazily detached mount is torn down at its last close, and
/// in reads racing an unmount; only ENODEV is taken as the end there). Either way the mount is gone.
pub fn session_end(r: std::io::Result<()>) -> std::io::Result<bool> {
    match r {
        Err(e) if e.raw_os_error() == Some(libc::ECONNABORTED) => Ok(true),
        other => other.map(|()| false),
    }
}

/// On SIGTERM or SIGINT: publish open files' data, then unmount. A busy mount (a process still
/// has a file open or its working directory inside) is detached lazily: it disappears from
/// the namespace at once and the session ends when its last user lets go.
async fn stop_on_signal(
    (mut term, mut int): (Signal, Signal),
    shared: Arc<Shared>,
    mut unmounter: Unmounter,
    mountpoint: PathBuf,
) {
    tokio::select! {
        _ = term.recv() => info!("SIGTERM: flushing open files and unmounting"),
        _ = int.recv() => info!("SIGINT: flushing open files and unmounting"),
    }
    shared.flush_all().await;
    let unmounted = tokio::task::spawn_blocking(move || unmounter.unmount()).await;
    match unmounted {
        Ok(Ok(())) => info!(mountpoint = %mountpoint.display(), "unmounted"),
        Ok(Err(e)) => {
            warn!(mountpoint = %mountpoint.display(), error = %e, "unmount failed; detaching lazily");
            if let Err(e) = lazy_unmount(&mountpoint) {
                warn!(mountpoint = %mountpoint.display(), error = %e, "lazy unmount failed");
            }
        }
        Err(e) => warn!(error = %e, "unmount task failed"),
    }
}

fn lazy_unmount(path: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())?;
    // SAFETY: a valid NUL-terminated path.
    if unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The FUSE connection number (device minor) of the FUSE mount at `path`, from mountinfo text.
/// Never stats the mount point: that would be a request to this very process.
pub fn fuse_minor(mountinfo: &str, path: &Path) -> Option<u32> {
    // The last matching line is the mount on top.
    mountinfo.lines().rev().find_map(|l| {
        let (left, right) = l.split_once(" - ")?;
        let f: Vec<&str> = left.split(' ').collect();
        let minor = f.get(2)?.split(':').nth(1)?.parse().ok()?;
        let mp = f.get(4)?.replace("\\040", " ");
        (Path::new(&mp) == path && right.starts_with("fuse")).then_some(minor)
    })
}

/// Raises the mount's kernel read-ahead to `MAX_READAHEAD`. The kernel caps what a FUSE
/// daemon may ask at init to its current default (128 KiB); the per-mount value lives in
/// sysfs under the mount's backing device "0:<minor>". Needs root; otherwise the default stays.
pub fn tune_readahead(mountpoint: &Path) {
    let Some(minor) = std::fs::read_to_string("/proc/self/mountinfo").ok().and_then(|t| fuse_minor(&t, mountpoint))
    else {
        warn!(mountpoint = %mountpoint.display(), "mount not found in /proc/self/mountinfo; read-ahead left as is");
        return;
    };
    let knob = format!("/sys/class/bdi/0:{minor}/read_ahead_kb");
    match std::fs::write(&knob, format!("{}", MAX_READAHEAD / 1024)) {
        Ok(()) => info!(read_ahead_kb = MAX_READAHEAD / 1024, "kernel read-ahead set"),
        Err(e) => info!(knob, error = %e, "kernel read-ahead left at its default"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_name_the_job_and_the_subtype() {
        let (o, acl) = mount_options("job 1,2", false);
        assert_eq!((o.fsname.as_str(), o.subtype.as_str()), ("odfs:job_1_2", "odfs"));
        assert!(o.default_permissions && o.noatime && !o.allow_other);
        assert_eq!(acl, Acl::Owner);
        let (o, acl) = mount_options("j", true);
        assert!(o.allow_other);
        assert_eq!(acl, Acl::All);
    }

    #[test]
    fn mount_point_checks_name_the_problem() {
        let d = std::env::temp_dir().join(format!("odfs-fuse-mp-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        assert!(check_mount_point(&d).is_ok());
        let f = d.join("file");
        std::fs::write(&f, b"x").unwrap();
        assert!(matches!(check_mount_point(&f), Err(FuseError::MountPointNotDir(_))));
        assert!(matches!(check_mount_point(&d.join("nope")), Err(FuseError::MountPointMissing(_))));
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn finds_the_fuse_minor_of_a_mount_point() {
        let text = "36 35 98:0 / /mnt rw - ext4 /dev/root rw\n\
                    52 30 0:48 / /tmp/a\\040b rw,nosuid - fuse.odfs odfs:j rw,user_id=0\n";
        assert_eq!(fuse_minor(text, Path::new("/tmp/a b")), Some(48));
        assert_eq!(fuse_minor(text, Path::new("/mnt")), None);
    }
}
