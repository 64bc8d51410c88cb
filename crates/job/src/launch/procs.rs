//! Processes this tool starts and stops: spawning detached daemons, checking that a pid still
//! names one of ours, and stopping with TERM then KILL.

use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Directory holding the odfs binaries: `ODFS_BIN_DIR`, else the directory of this executable.
pub fn bin_dir() -> Result<PathBuf> {
    if let Some(d) = std::env::var_os("ODFS_BIN_DIR") {
        return Ok(PathBuf::from(d));
    }
    let exe = std::env::current_exe().context("cannot find this executable")?;
    Ok(exe.parent().context("executable has no directory")?.to_path_buf())
}

/// Path of one of the odfs binaries, checked to exist.
pub fn binary(name: &str) -> Result<PathBuf> {
    let p = bin_dir()?.join(name);
    anyhow::ensure!(p.is_file(), "{} not found (build the workspace, or set ODFS_BIN_DIR)", p.display());
    Ok(p)
}

/// Starts `bin --config cfg` in its own session, output appended to `log`. Returns its pid.
pub fn spawn_daemon(bin: &Path, cfg: &Path, log: &Path) -> Result<u32> {
    spawn_detached(bin, &[std::ffi::OsStr::new("--config"), cfg.as_os_str()], cfg, log)
}

/// Starts `bin args…` in its own session, output appended to `log`; `marker` is the argument
/// [`runs`] knows it by. Returns its pid. The process is recorded for `crate::interrupt`.
pub fn spawn_detached(bin: &Path, args: &[&std::ffi::OsStr], marker: &Path, log: &Path) -> Result<u32> {
    // Recorded only once its command line shows, which is how `runs` (and so a teardown on a
    // signal) knows it.
    crate::interrupt::spawn_recorded(marker, || {
        let pid = spawn_in_session(bin, args, log)?;
        wait_command_line(pid);
        Ok(pid)
    })
}

/// Starts `bin args…` in its own session, output appended to `log`, reaped by a thread.
fn spawn_in_session(bin: &Path, args: &[&std::ffi::OsStr], log: &Path) -> Result<u32> {
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .with_context(|| format!("cannot open log {}", log.display()))?;
    let err = out.try_clone()?;
    let mut cmd = Command::new(bin);
    cmd.args(args).stdin(Stdio::null()).stdout(out).stderr(err);
    // The daemon must not die with this tool's terminal.
    in_new_session(&mut cmd);
    let child = cmd.spawn().with_context(|| format!("cannot start {}", bin.display()))?;
    let pid = child.id();
    // The child is reaped by a thread so it never lingers as a zombie while this tool runs.
    std::thread::spawn(move || {
        let mut child = child;
        let _ = child.wait();
    });
    Ok(pid)
}

/// Makes `cmd` start its process in a session of its own (`setsid`), as a daemon runs: apart
/// from this tool's terminal and, where the kernel groups CPU time by session (autogroup),
/// scheduled apart from it.
pub fn in_new_session(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: setsid is async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
}

/// Waits (at most 2 s) until a just-started process shows its command line. `spawn` returns
/// once the new program has replaced this one's image, but the kernel fills in the new command
/// line a moment later; until then /proc/PID/cmdline is empty, and `runs` would take a daemon
/// that is starting for one that exited (seen as "odfs-fuse exited before ... was mounted" on a
/// busy machine).
fn wait_command_line(pid: u32) {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(2) {
        match std::fs::read(format!("/proc/{pid}/cmdline")) {
            Ok(c) if c.is_empty() => std::thread::sleep(Duration::from_millis(1)),
            _ => return,
        }
    }
}

/// True if `pid` is alive, runs one of the odfs binaries, and has `marker` (its config path,
/// unique per filesystem) among its arguments — so a recycled pid is never taken for ours.
pub fn runs(pid: u32, marker: &Path) -> bool {
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else { return false };
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    // A zombie has exited; only its parent's wait is missing.
    let state = stat.rsplit(')').next().and_then(|s| s.split_whitespace().next()).unwrap_or("");
    if state == "Z" || state == "X" {
        return false;
    }
    let mut args = cmdline.split(|&b| b == 0);
    let first = args.next().unwrap_or(&[]);
    let name = Path::new(std::str::from_utf8(first).unwrap_or("")).file_name().and_then(|n| n.to_str()).unwrap_or("");
    let marker = marker.as_os_str().as_encoded_bytes();
    name.starts_with("odfs-") && args.any(|a| a == marker)
}

/// Stops processes (pid, marker): SIGTERM, wait up to `grace`, then SIGKILL what is left.
/// Returns the pids killed.
pub fn stop_all(procs: &[(u32, &Path)], grace: Duration) -> Vec<u32> {
    let live: Vec<(u32, &Path)> = procs.iter().copied().filter(|&(p, m)| runs(p, m)).collect();
    for &(p, _) in &live {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(p as i32), nix::sys::signal::Signal::SIGTERM);
    }
    let start = Instant::now();
    while start.elapsed() < grace && live.iter().any(|&(p, m)| runs(p, m)) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut killed = Vec::new();
    for &(p, m) in &live {
        if runs(p, m) {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(p as i32), nix::sys::signal::Signal::SIGKILL);
            killed.push((p, m));
        }
    }
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(2) && killed.iter().any(|&(p, m)| runs(p, m)) {
        std::thread::sleep(Duration::from_millis(10));
    }
    crate::interrupt::stopped(&procs.iter().map(|&(p, _)| p).collect::<Vec<_>>());
    killed.into_iter().map(|(p, _)| p).collect()
}

/// CPU seconds (user + system) a process has used so far.
pub fn cpu_seconds(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
    // After the command name: state is field 3, utime 14 and stime 15 (1-based).
    let ticks = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    (ticks(11) + ticks(12)) / hz.max(1.0)
}

/// CPU seconds this process has used (user + system, all threads).
pub fn self_cpu_seconds() -> f64 {
    cpu_seconds(std::process::id())
}
