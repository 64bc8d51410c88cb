//! An interrupted command leaves nothing running: `odfs local up`, `odfs demo` and `odfs bench`
//! call [`stop_started_on_signals`], and then SIGINT (Ctrl-C), SIGTERM or SIGHUP unmounts every
//! mount this process made, stops every daemon it started and removes its work directories,
//! and the process exits with 128 + the signal's number (docs/architecture.md, "Failure
//! handling"). A command that gives up ([`give_up`]: a phase past its bound) takes the same
//! way out, with status 1. `odfs bench --startup`
//! is the exception: its filesystems are started by `odfs start` processes, as a job's are.
//!
//! Owns the record of what this process started and has not stopped or unmounted yet (every
//! spawn of `launch::procs`, every mount announced with [`mounting`], every helper child
//! announced with [`child_started`]), and the thread that acts on those signals. Daemons run
//! in sessions of their own, so no terminal signal reaches them: without this record a Ctrl-C
//! during `odfs demo` left eleven daemons and a mount behind.

use crate::launch::{mount, procs};
use anyhow::{bail, Context, Result};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

/// What this process started and has not stopped yet.
#[derive(Default)]
struct Started {
    /// Processes: pid and the marker `procs::runs` knows them by.
    procs: Vec<(u32, PathBuf)>,
    /// Other children of this process not yet waited for (so their pids are still theirs).
    children: Vec<u32>,
    mounts: Vec<PathBuf>,
    /// Work directories removed at a teardown, once nothing runs or is mounted there.
    dirs: Vec<PathBuf>,
    /// The command is ending on its own ([`disarm`]): a signal now ends the process at once.
    disarmed: bool,
}

static STARTED: Mutex<Started> = Mutex::new(Started {
    procs: Vec::new(),
    children: Vec::new(),
    mounts: Vec::new(),
    dirs: Vec::new(),
    disarmed: false,
});

/// Why the command gave up ([`give_up`]), for the teardown's first line.
static GAVE_UP: Mutex<Option<String>> = Mutex::new(None);

/// The byte [`give_up`] writes to the signal pipe: no signal's number.
const GIVE_UP: u8 = 0;

/// Set (under the record's lock) once a signal's teardown has begun: nothing new is started or
/// mounted after it, and no other thread ends the process under it ([`disarm`], and the panic
/// hook of [`stop_started_on_signals`]).
static STOPPING: AtomicBool = AtomicBool::new(false);

/// The name of the thread that acts on the signals.
const SIGNAL_THREAD: &str = "odfs-signals";

/// Longest a thread waits for a teardown to end the process before going on (every step of a
/// teardown is bounded, together well within this).
const HOLD_LIMIT: Duration = Duration::from_secs(60);

/// The write end of the pipe the signal handler writes the signal's number to (-1: none).
static SIGNAL_PIPE: AtomicI32 = AtomicI32::new(-1);

/// How long stopped daemons get to exit on SIGTERM before they are killed.
const GRACE: Duration = Duration::from_secs(2);

fn started() -> MutexGuard<'static, Started> {
    // The record stays usable after a panic elsewhere: teardown needs it most then.
    STARTED.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs `spawn` (which starts one process and returns its pid) and records the process under
/// `marker`; refused once a teardown has begun, so nothing it could miss starts after it.
pub(crate) fn spawn_recorded(marker: &Path, spawn: impl FnOnce() -> Result<u32>) -> Result<u32> {
    let mut s = started();
    if STOPPING.load(Ordering::SeqCst) {
        bail!("interrupted: no more processes are started");
    }
    let pid = spawn()?;
    s.procs.push((pid, marker.to_path_buf()));
    Ok(pid)
}

/// Forgets processes that were stopped.
pub(crate) fn stopped(pids: &[u32]) {
    started().procs.retain(|(p, _)| !pids.contains(p));
}

/// Records a child process (a helper server of a benchmark), killed on a signal (at once if a
/// teardown has begun). It must not be waited for before [`child_ended`], or its pid could
/// name another process by the time it is killed.
pub fn child_started(pid: u32) {
    let mut s = started();
    if STOPPING.load(Ordering::SeqCst) {
        kill(pid);
    } else {
        s.children.push(pid);
    }
}

/// Forgets a child about to be killed and waited for.
pub fn child_ended(pid: u32) {
    started().children.retain(|&p| p != pid);
}

/// Records a mount about to be made at `path`, to be unmounted on a signal; refused once a
/// teardown has begun. Recorded before it exists, so no mount is made unseen by a teardown: a
/// path with no mount (one never made, or taken down some other way than
/// `launch::mount::unmount`) is not unmounted.
pub fn mounting(path: &Path) -> Result<()> {
    let mut s = started();
    if STOPPING.load(Ordering::SeqCst) {
        bail!("interrupted: nothing more is mounted");
    }
    if !s.mounts.iter().any(|m| m == path) {
        s.mounts.push(path.to_path_buf());
    }
    Ok(())
}

/// Forgets a mount that was taken down (`launch::mount::unmount` does so itself).
pub fn unmounted(path: &Path) {
    started().mounts.retain(|m| m != path);
}

/// Records a work directory of the command (a demo's or benchmark's data), removed by a
/// teardown after its mounts and processes are gone; never while anything is mounted below it.
pub fn removing(dir: &Path) {
    let mut s = started();
    if !s.dirs.iter().any(|d| d == dir) {
        s.dirs.push(dir.to_path_buf());
    }
}

/// Forgets a work directory the command removed (or keeps) itself.
pub fn removed(dir: &Path) {
    started().dirs.retain(|d| d != dir);
}

/// The command cannot go on (a phase that never ends): tears down what it started as a signal
/// does, its first line saying `why`, and ends the process with status 1. Without
/// [`stop_started_on_signals`] armed it only says why and exits.
pub fn give_up(why: &str) {
    *GAVE_UP.lock().unwrap_or_else(|e| e.into_inner()) = Some(why.to_string());
    let fd = SIGNAL_PIPE.load(Ordering::SeqCst);
    if fd < 0 {
        say(format_args!("odfs: {why}"));
        std::process::exit(1);
    }
    // SAFETY: write(2) of one byte from a live local.
    unsafe { libc::write(fd, (&GIVE_UP as *const u8).cast(), 1) };
}

/// From now on SIGINT, SIGTERM and SIGHUP stop what this process started (mounts first, as
/// `odfs local down` does, then processes) and exit with 128 + the signal. Idempotent.
pub fn stop_started_on_signals() -> Result<()> {
    if SIGNAL_PIPE.load(Ordering::SeqCst) >= 0 {
        return Ok(());
    }
    let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).context("cannot make the signal pipe")?;
    SIGNAL_PIPE.store(std::os::fd::IntoRawFd::into_raw_fd(write), Ordering::SeqCst);
    std::thread::Builder::new()
        .name(SIGNAL_THREAD.into())
        .spawn(move || wait_and_tear_down(read))
        .context("cannot start the signal thread")?;
    // A thread that fails because the teardown took its mount or daemons away, or cannot print
    // once the terminal hung up (SIGHUP), must not end the process before the teardown does.
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if STOPPING.load(Ordering::SeqCst) && std::thread::current().name() != Some(SIGNAL_THREAD) {
            hold();
        }
        previous(info);
    }));
    // SA_RESTART: the main thread's system calls go on while the teardown runs, rather than
    // failing with EINTR and ending the process before it is done.
    let action = nix::sys::signal::SigAction::new(
        nix::sys::signal::SigHandler::Handler(on_signal),
        nix::sys::signal::SaFlags::SA_RESTART,
        nix::sys::signal::SigSet::empty(),
    );
    for sig in [nix::sys::signal::SIGINT, nix::sys::signal::SIGTERM, nix::sys::signal::SIGHUP] {
        // SAFETY: the handler only loads an atomic and calls write(2), both async-signal-safe.
        unsafe { nix::sys::signal::sigaction(sig, &action) }.with_context(|| format!("cannot handle {sig}"))?;
    }
    Ok(())
}

extern "C" fn on_signal(sig: libc::c_int) {
    let fd = SIGNAL_PIPE.load(Ordering::SeqCst);
    if fd >= 0 {
        let b = sig as u8;
        // SAFETY: write(2) of one byte from a live local; async-signal-safe.
        unsafe { libc::write(fd, (&b as *const u8).cast(), 1) };
    }
}

/// The signal thread: waits for the first signal, tears down, exits.
fn wait_and_tear_down(read: OwnedFd) {
    let mut b = [0u8; 1];
    loop {
        // SAFETY: reads one byte into a live buffer from a descriptor this thread owns.
        let n = unsafe { libc::read(read.as_raw_fd(), b.as_mut_ptr().cast(), 1) };
        if n == 1 {
            break;
        }
        if n == 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return;
        }
    }
    let sig = b[0] as i32;
    let why = match b[0] {
        GIVE_UP => GAVE_UP.lock().unwrap_or_else(|e| e.into_inner()).clone().unwrap_or_else(|| "gave up".into()),
        _ => {
            let name = nix::sys::signal::Signal::try_from(sig).map(|s| s.as_str()).unwrap_or("a signal");
            format!("interrupted ({name})")
        }
    };
    if let Some(s) = take_for_teardown() {
        say(format_args!(
            "odfs: {why}: unmounting {} mount(s) and stopping {} process(es) this command started",
            s.mounts.len(),
            s.procs.len() + s.children.len()
        ));
        // Whatever fails in it, the process still ends here, with the signal's status.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| tear_down(&s)));
    }
    std::process::exit(if b[0] == GIVE_UP { 1 } else { 128 + sig });
}

/// Marks the teardown begun and takes the record (None once [`disarm`]ed); a spawn under way
/// finishes first (it holds the record's lock), and none starts after. The helper children
/// are killed here, under the lock: one whose owner is about to wait for it is then either
/// forgotten already or still unwaited, so its pid is still its own.
fn take_for_teardown() -> Option<Started> {
    let mut s = started();
    if s.disarmed {
        return None;
    }
    STOPPING.store(true, Ordering::SeqCst);
    s.children.iter().for_each(|&pid| kill(pid));
    Some(std::mem::take(&mut *s))
}

fn kill(pid: u32) {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::SIGKILL);
}

/// Unmounts the FUSE mounts (newest first: a daemon stopped under its mount would leave a dead
/// one), stops the daemons, then unmounts the rest (RAM targets, which the stopped daemons held
/// open); says what went wrong.
fn tear_down(s: &Started) {
    let (fuse, other): (Vec<&PathBuf>, Vec<&PathBuf>) =
        s.mounts.iter().rev().partition(|m| mount::mount_at(m).is_some_and(|e| e.fstype.starts_with("fuse")));
    fuse.into_iter().for_each(|m| unmount(m));
    let pids: Vec<(u32, &Path)> = s.procs.iter().map(|(p, m)| (*p, m.as_path())).collect();
    let killed = procs::stop_all(&pids, GRACE);
    if !killed.is_empty() {
        say(format_args!("odfs: killed {killed:?} after they ignored SIGTERM"));
    }
    other.into_iter().for_each(|m| unmount(m));
    s.dirs.iter().for_each(|d| remove_dir(d));
}

/// Removes a work directory, or says why it stays.
fn remove_dir(d: &Path) {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    if let Some(m) = mount::parse_mountinfo(&text).into_iter().find(|m| m.mount_point.starts_with(d)) {
        say(format_args!("odfs: left {}: {} is still mounted", d.display(), m.mount_point.display()));
        return;
    }
    match std::fs::remove_dir_all(d) {
        Ok(()) => say(format_args!("odfs: removed {}", d.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => say(format_args!("odfs: left {}: cannot remove it: {e}", d.display())),
    }
}

fn unmount(m: &Path) {
    match mount::unmount(m) {
        Ok(steps) => steps.iter().filter(|s| !s.starts_with("unmounted ")).for_each(|s| say(format_args!("odfs: {s}"))),
        Err(e) => say(format_args!("odfs: cannot unmount {}: {e:#}", m.display())),
    }
}

/// One line on stderr, or nothing if it cannot be written (a terminal that hung up): unlike
/// `eprintln!`, never a panic in the middle of a teardown.
fn say(line: std::fmt::Arguments) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// The main thread's last step, and `odfs local up`'s once it is up: while a signal's teardown
/// runs, waits for it to end the process (with the signal's status) rather than ending it
/// first with the teardown half done; otherwise a later signal ends the process at once, what
/// it started left as it is (the command is done with it).
pub fn disarm() {
    {
        let mut s = started();
        if !STOPPING.load(Ordering::SeqCst) {
            s.disarmed = true;
            return;
        }
    }
    hold();
}

/// Waits for the teardown under way to end the process (at most [`HOLD_LIMIT`]).
fn hold() {
    let t = std::time::Instant::now();
    while t.elapsed() < HOLD_LIMIT {
        std::thread::park_timeout(Duration::from_secs(1));
    }
}
