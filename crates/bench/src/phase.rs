//! Bounds on the phases of `odfs demo` and `odfs bench`: each phase (a step of the demo, a
//! measurement of the benchmark) begins with the line that names it, and none may run longer
//! than the command's `--phase-timeout`. While one runs long, a line every [`HEARTBEAT`] says
//! what it is waiting for; past its bound the command gives up through
//! `odfs_job::interrupt::give_up`, which tears down what it started (mounts, daemons, work
//! directory) as Ctrl-C does and names the phase and its wait in its first line.
//!
//! Owns the current phase and the one watchdog thread that looks at it. A phase ends when the
//! next begins or at [`end`]; nothing here times a phase that has no bound set ([`bound`]).

use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

/// How often a phase that runs long says what it waits for.
pub const HEARTBEAT: Duration = Duration::from_secs(30);

/// The default `--phase-timeout`: well above any phase at the demo's and benchmark's own
/// sizes on a slow machine, far below "hung".
pub const DEFAULT_BOUND_SECS: u64 = 600;

struct Current {
    name: String,
    since: Instant,
    /// What the phase waits for right now (a process, the end of a mount), when known.
    waiting: Option<String>,
    /// Heartbeats said so far.
    said: u64,
}

static CURRENT: Mutex<Option<Current>> = Mutex::new(None);
static BOUND: OnceLock<(Duration, &'static str)> = OnceLock::new();

fn current() -> MutexGuard<'static, Option<Current>> {
    CURRENT.lock().unwrap_or_else(|e| e.into_inner())
}

/// From now on no phase of this command runs longer than `limit`; lines start with `prefix`
/// (`odfs demo`). Starts the watchdog (once).
pub fn bound(limit: Duration, prefix: &'static str) -> anyhow::Result<()> {
    anyhow::ensure!(!limit.is_zero(), "--phase-timeout must be at least 1 second");
    if BOUND.set((limit, prefix)).is_ok() {
        std::thread::Builder::new().name("odfs-phases".into()).spawn(move || watch(limit, prefix))?;
    }
    Ok(())
}

/// A phase begins: `name` is the line that announced it.
pub fn begin(name: impl Into<String>) {
    *current() = Some(Current { name: name.into(), since: Instant::now(), waiting: None, said: 0 });
}

/// No phase runs (the command is between phases or done).
pub fn end() {
    *current() = None;
}

/// While the guard lives, the current phase waits for `what` (its heartbeat and its bound's
/// line say so); the wait it was in before comes back when the guard goes.
pub fn waiting(what: impl Into<String>) -> Waiting {
    let before = current().as_mut().and_then(|c| c.waiting.replace(what.into()));
    Waiting { before }
}

/// See [`waiting`].
pub struct Waiting {
    before: Option<String>,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if let Some(c) = current().as_mut() {
            c.waiting = self.before.take();
        }
    }
}

/// What a phase waits for, for its lines.
fn waits_for(c: &Current) -> String {
    c.waiting.clone().unwrap_or_else(|| "the phase's own work (no process or mount to name)".into())
}

/// The watchdog: heartbeats, then the bound.
fn watch(limit: Duration, prefix: &'static str) {
    loop {
        std::thread::sleep(Duration::from_millis(250));
        let mut cur = current();
        let Some(c) = cur.as_mut() else { continue };
        let ran = c.since.elapsed();
        if ran >= limit {
            let why = format!(
                "{prefix}: phase \"{}\" did not end within {} s (--phase-timeout); it was waiting for {}",
                c.name,
                limit.as_secs(),
                waits_for(c)
            );
            *cur = None;
            drop(cur);
            odfs_job::interrupt::give_up(&why);
            return;
        }
        let due = (ran.as_secs() / HEARTBEAT.as_secs()).min(u64::MAX - 1);
        if due > c.said {
            c.said = due;
            eprintln!(
                "{prefix}: still in \"{}\" after {} s (bound {} s): waiting for {}",
                c.name,
                ran.as_secs(),
                limit.as_secs(),
                waits_for(c)
            );
        }
    }
}

/// Prints `prefix: line` on stderr, where a command's progress goes, and begins the phase it
/// names.
pub fn say(prefix: &str, line: String) {
    eprintln!("{prefix}: {line}");
    begin(line);
}
