//! Exclusive advisory locks on files (`flock`), held while one odfs command works on a
//! filesystem root or a job's state on a node; released on drop (or when the process dies).

use anyhow::{bail, Context, Result};
use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::{Duration, Instant};

pub struct Lock {
    _file: std::fs::File,
}

impl Lock {
    fn open(path: &Path) -> Result<std::fs::File> {
        std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .with_context(|| format!("cannot open lock file {}", path.display()))
    }

    fn try_flock(f: &std::fs::File) -> bool {
        // SAFETY: the fd is valid for the life of `f`.
        unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
    }

    /// Takes the lock or fails at once; `what` names the holder's work in the error.
    pub fn take(path: &Path, what: &str) -> Result<Lock> {
        let f = Self::open(path)?;
        if !Self::try_flock(&f) {
            bail!("another odfs command is working on {what} right now");
        }
        Ok(Lock { _file: f })
    }

    /// Takes the lock, waiting up to `limit` for its holder.
    pub fn wait(path: &Path, what: &str, limit: Duration) -> Result<Lock> {
        let f = Self::open(path)?;
        let t = Instant::now();
        while !Self::try_flock(&f) {
            if t.elapsed() > limit {
                bail!("another odfs command kept working on {what} for {} s", limit.as_secs());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(Lock { _file: f })
    }

    /// Tries once; None when someone else holds it.
    pub fn try_take(path: &Path) -> Result<Option<Lock>> {
        let f = Self::open(path)?;
        Ok(Self::try_flock(&f).then_some(Lock { _file: f }))
    }
}
