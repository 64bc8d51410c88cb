//! The FUSE minima of `odfs bench --mount` for creates, small files and networked large files,
//! mounted either in the benchmark's own process or served by a process of its own session
//! (`odfs fuse-minimum`).
//!
//! Why two: the kernel here schedules CPU time by session (autogroup), and with cgroups by
//! cgroup, so a FUSE daemon that runs as daemons do (odfs-fuse started by `odfs local up` or
//! the Slurm prolog, bindfs) is scheduled apart from the job that calls it, and every request
//! wakes a thread of another group. A minimum in the benchmark's process shares the workers'
//! group: the bound under any FUSE filesystem. A minimum in its own session pays what every
//! deployed FUSE daemon pays: the bound under any FUSE filesystem run apart from its callers.

use super::fill_pattern;
use crate::minimum_fs::{FileServer, MinimumFs, MinimumMount, WriteServer};
use anyhow::{bail, Context, Result};
use odfs_job::launch::{mount, procs};
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};

/// Which minimum to serve: its mount point and tree (`odfs fuse-minimum`'s arguments).
#[derive(clap::Args, Clone, Debug, Default)]
pub struct MinimumSpec {
    /// Where to mount it (made if missing).
    #[arg(long)]
    pub at: PathBuf,
    /// Mounted read-write, answering MKDIR, CREATE and WRITE at once.
    #[arg(long)]
    pub creates: bool,
    /// Small files of the benchmark's tree (`/d{k}/s{i}`).
    #[arg(long, default_value_t = 0)]
    pub small_files: u64,
    /// Directories the small files are spread over.
    #[arg(long, default_value_t = 0)]
    pub small_dirs: u64,
    /// Size of each small file in bytes.
    #[arg(long, default_value_t = 0)]
    pub small_size: usize,
    /// Every OPEN answered ENOSYS: FUSE's no-open mode (no OPEN or RELEASE sent).
    #[arg(long)]
    pub no_open: bool,
    /// Large files `/seq.{k}.0` whose every READ is fetched over loopback TCP from these files,
    /// served by this process too (`FileServer`): the FUSE + network minimum.
    #[arg(long, num_args = 1..)]
    pub remote_large: Vec<PathBuf>,
    /// Large files `/seq.{k}.0` whose every READ is an `O_DIRECT` read of these files into the
    /// buffer the reply is written from: the FUSE + disk minimum. With `--remote-large` as
    /// well (the same files), they are striped as the default layout stripes a file over four
    /// nodes, seen from one: one 1 MiB chunk in four read from the disk so, the other three
    /// fetched over TCP (the FUSE + striped minimum).
    #[arg(long, num_args = 1..)]
    pub disk_large: Vec<PathBuf>,
    /// Size of each large file in bytes (with `--remote-large` or `--disk-large`).
    #[arg(long, default_value_t = 0)]
    pub large_size: u64,
    /// With `--creates`: every WRITE is sent over loopback TCP to a server of this process that
    /// writes it into a file in this directory (`WriteServer`): the FUSE + network minimum for
    /// writes.
    #[arg(long)]
    pub remote_writes: Option<PathBuf>,
    /// Reader threads (default: 2, or 8 where a READ or WRITE waits on the network or disk);
    /// with `--uring`, ring entries per CPU queue (default 32).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Serve the striped large files (`--remote-large` and `--disk-large`, the same files)
    /// through the kernel's io_uring transport for FUSE instead of `/dev/fuse` reads and writes
    /// (`crate::uring_minimum`).
    #[arg(long)]
    pub uring: bool,
}

/// The servers behind a minimum's networked files, kept for as long as it is mounted.
#[derive(Default)]
pub struct Servers {
    _files: Option<FileServer>,
    _writes: Option<WriteServer>,
}

impl MinimumSpec {
    /// The tree to serve, with the servers of its networked files if it has any (kept for as
    /// long as the tree is mounted).
    fn fs(&self) -> Result<(MinimumFs, Servers)> {
        let mut template = vec![0u8; self.small_size];
        fill_pattern(&mut template, 5);
        let mut fs = MinimumFs::new(self.small_files, self.small_dirs, template, self.no_open);
        let mut servers = Servers::default();
        if self.creates {
            fs = fs.with_creates();
        }
        if !self.remote_large.is_empty() {
            let server = FileServer::start(&self.remote_large).context("serving the large files")?;
            fs = fs.with_remote_large(&server, self.large_size);
            servers._files = Some(server);
        }
        if !self.disk_large.is_empty() {
            fs = fs.with_disk_large(&self.disk_large, self.large_size).context("opening the large files")?;
        }
        if let Some(n) = self.threads {
            fs = fs.with_threads(n);
        }
        if let Some(dir) = &self.remote_writes {
            let server = WriteServer::start(dir).with_context(|| format!("serving writes into {}", dir.display()))?;
            fs = fs.with_remote_writes(&server);
            servers._writes = Some(server);
        }
        Ok((fs, servers))
    }

    fn args(&self) -> Vec<OsString> {
        let mut a: Vec<OsString> = vec![
            "fuse-minimum".into(),
            "--at".into(),
            self.at.clone().into(),
            format!("--small-files={}", self.small_files).into(),
            format!("--small-dirs={}", self.small_dirs).into(),
            format!("--small-size={}", self.small_size).into(),
        ];
        if self.creates {
            a.push("--creates".into());
        }
        if self.no_open {
            a.push("--no-open".into());
        }
        for (flag, files) in [("--remote-large", &self.remote_large), ("--disk-large", &self.disk_large)] {
            if !files.is_empty() {
                a.push(flag.into());
                a.extend(files.iter().map(|p| p.clone().into()));
            }
        }
        if !self.remote_large.is_empty() || !self.disk_large.is_empty() {
            a.push(format!("--large-size={}", self.large_size).into());
        }
        if let Some(dir) = &self.remote_writes {
            a.push("--remote-writes".into());
            a.push(dir.clone().into());
        }
        if let Some(n) = self.threads {
            a.push(format!("--threads={n}").into());
        }
        if self.uring {
            a.push("--uring".into());
        }
        a
    }
}

/// How long a minimum's session may take to end after its unmount.
const SESSION_END: std::time::Duration = std::time::Duration::from_secs(10);

/// What the serving process prints once its mount is up.
const READY: &str = "mounted";

/// `odfs fuse-minimum`: mounts the minimum, says so on standard output, serves it until
/// standard input ends (the benchmark closes it, or dies), then unmounts.
pub fn serve(spec: &MinimumSpec) -> Result<()> {
    std::fs::create_dir_all(&spec.at).with_context(|| format!("cannot create {}", spec.at.display()))?;
    if spec.uring {
        return serve_uring(spec);
    }
    let (fs, _server) = spec.fs()?;
    let session = fs.mount(&spec.at).with_context(|| format!("cannot mount at {}", spec.at.display()))?;
    println!("{READY}");
    std::io::stdout().flush()?;
    let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
    session.unmount().context("unmounting the FUSE minimum")
}

/// `odfs fuse-minimum --uring`: the striped large files over FUSE's io_uring transport.
fn serve_uring(spec: &MinimumSpec) -> Result<()> {
    anyhow::ensure!(
        !spec.remote_large.is_empty() && spec.remote_large.len() == spec.disk_large.len(),
        "--uring serves striped large files: give as many files to --remote-large as to --disk-large"
    );
    let (fs, _servers) = spec.fs()?;
    let entries = spec.threads.unwrap_or(32);
    let mounted = crate::uring_minimum::mount(fs, &spec.at, entries)
        .with_context(|| format!("cannot mount at {}", spec.at.display()))?;
    println!("{READY}");
    std::io::stdout().flush()?;
    let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
    mounted.unmount().context("unmounting the FUSE io_uring minimum").map(drop)
}

/// A mounted minimum.
pub enum Minimum {
    /// Served by reader threads of this process (and the servers of its networked files).
    Here(MinimumMount, Servers),
    /// Served by `odfs fuse-minimum` in a session of its own; closing `stdin` ends it.
    Apart { child: Child, stdin: ChildStdin },
}

impl Minimum {
    /// Mounts `spec` here or (`apart`) in a new process of its own session. `Err` inside is
    /// the note saying `name` was not measured because the minimum could not be mounted.
    pub fn mount(spec: &MinimumSpec, apart: bool, name: &str) -> Result<std::result::Result<Minimum, String>> {
        if !apart {
            let (fs, server) = spec.fs()?;
            return Ok(mount_here(fs, &spec.at, name)?.map(|s| Minimum::Here(s, server)));
        }
        std::fs::create_dir_all(&spec.at)?;
        let mut child = spawn_apart(spec)?;
        let (stdin, stdout) = (child.stdin.take(), child.stdout.take());
        let mut line = String::new();
        if let Some(out) = stdout {
            BufReader::new(out).read_line(&mut line)?;
        }
        match stdin {
            Some(stdin) if line.trim() == READY => Ok(Ok(Minimum::Apart { child, stdin })),
            _ => {
                let status = child.wait()?;
                let e = format!("odfs fuse-minimum ended ({status}); its error is printed above");
                Ok(Err(not_measured(name, &spec.at, &e)))
            }
        }
    }

    /// The serving process, whose CPU time is the minimum's.
    pub fn pid(&self) -> Option<u32> {
        match self {
            Minimum::Here(..) => None,
            Minimum::Apart { child, .. } => Some(child.id()),
        }
    }

    /// Unmounts and waits for the reader threads or the serving process, at most
    /// [`SESSION_END`]; a connection that outlives that (a copy of the mount in another mount
    /// namespace keeps it) is aborted, and its session ends then.
    pub fn unmount(self, at: &Path) -> Result<()> {
        let conn = mount::mount_at(at).map(|m| m.minor);
        let _waiting = crate::phase::waiting(format!("the FUSE minimum at {} to end after its unmount", at.display()));
        let (tx, rx) = std::sync::mpsc::channel();
        let pid = self.pid();
        std::thread::spawn(move || {
            let _ = tx.send(match self {
                Minimum::Here(session, _server) => session.unmount().context("unmounting the FUSE minimum"),
                Minimum::Apart { mut child, stdin } => {
                    drop(stdin);
                    child.wait().context("waiting for odfs fuse-minimum").and_then(|status| {
                        anyhow::ensure!(
                            status.success(),
                            "odfs fuse-minimum failed ({status}); its error is printed above"
                        );
                        Ok(())
                    })
                }
            });
        });
        if let Ok(r) = rx.recv_timeout(SESSION_END) {
            return r;
        }
        let Some(minor) = conn.filter(|&m| mount::connection_alive(m)) else {
            bail!("the FUSE minimum at {} did not end within {} s of its unmount", at.display(), SESSION_END.as_secs());
        };
        eprintln!(
            "bench: the FUSE minimum at {} still serves {} s after its unmount (a copy of the mount in another \
             mount namespace keeps its connection): aborting FUSE connection {minor}",
            at.display(),
            SESSION_END.as_secs()
        );
        mount::abort_connection(minor).with_context(|| format!("cannot abort FUSE connection {minor}"))?;
        match rx.recv_timeout(SESSION_END) {
            // An end after an abort may report the abort: the minimum is gone either way.
            Ok(_) => Ok(()),
            Err(_) => {
                if let Some(pid) = pid {
                    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::SIGKILL);
                }
                bail!("the FUSE minimum at {} did not end even after its connection was aborted", at.display())
            }
        }
    }
}

/// Mounts `fs` at `at` (made if missing), served by reader threads of this process; `Err`
/// inside is the note saying that `name` was not measured because it could not be mounted.
pub fn mount_here(fs: MinimumFs, at: &Path, name: &str) -> Result<std::result::Result<MinimumMount, String>> {
    std::fs::create_dir_all(at)?;
    // Its reader threads end with this process, leaving a dead mount unless unmounted.
    odfs_job::interrupt::mounting(at)?;
    Ok(fs.mount(at).map_err(|e| not_measured(name, at, &e)))
}

/// The note for a minimum that could not be mounted.
fn not_measured(name: &str, at: &Path, e: &dyn std::fmt::Display) -> String {
    format!("{name} not measured: cannot mount at {}: {e}", at.display())
}

/// Starts `odfs fuse-minimum` for `spec` in a new session, as daemons are started.
fn spawn_apart(spec: &MinimumSpec) -> Result<Child> {
    let exe = std::env::current_exe().context("cannot find this executable")?;
    let mut cmd = Command::new(&exe);
    // Its errors go where the benchmark's progress goes (a pipe nobody reads while it serves
    // could fill and stall it).
    cmd.args(spec.args()).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit());
    procs::in_new_session(&mut cmd);
    cmd.spawn().with_context(|| format!("cannot start {} fuse-minimum", exe.display()))
}
