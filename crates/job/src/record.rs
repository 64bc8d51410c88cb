//! A node's record of one job: `STATE_DIR/JOBID/record.toml`, beside the daemons' configs and
//! logs. It says what this node started for the job (processes, mounts, data directories),
//! where the job stands, and — for a job whose outputs could not be verified — why its data is
//! kept. `odfs stop`, `recover` and `cleanup` act on it; a node that died and came back finds
//! its leftovers here.
//!
//! Owns the layout of STATE_DIR and the teardown of what a record lists. Must not decide when
//! to tear down: start, stop and cleanup do.

use crate::directives::Directives;
use crate::launch::lock::Lock;
use crate::launch::{self, mount, procs, ProcEntry};
use crate::spec::JobSpec;
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Where a job stands on this node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "phase", rename_all = "kebab-case")]
pub enum Phase {
    /// `odfs start` is bringing the node's part up.
    Starting,
    /// Every node is up (node 0: stage-in not begun).
    Started,
    /// Node 0: the stage-in runs.
    Staging,
    /// The job runs.
    Running,
    /// Node 0: the start failed after its services were stopped, or the stage-in failed; the
    /// epilog has only this record to remove (and the batch host to return to service when
    /// `own` is false: the failure was another node's or the job's). `script`: the job's batch
    /// script is invalid, so the epilog cancels the job rather than leave it held (it would
    /// fail the same way every time it starts).
    StartFailed {
        reason: String,
        own: bool,
        #[serde(default)]
        script: bool,
    },
    /// Node 0: the job was cancelled during its stage-in.
    Cancelled,
    /// Stage-out was not verified: services stopped, data kept for `odfs recover`.
    Retained { reason: String },
}

/// What one node started for one job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    pub spec: JobSpec,
    #[serde(flatten)]
    pub phase: Phase,
    /// Node 0: the job's `#ODFS` directives.
    pub directives: Directives,
    pub mgmtd: SocketAddr,
    /// The client config of this node (for the mount and for stages).
    pub client_config: PathBuf,
    pub procs: Vec<ProcEntry>,
    /// FUSE mount made for the job.
    pub mount: Option<PathBuf>,
    /// tmpfs mounted for the job's RAM target.
    pub ram_mount: Option<PathBuf>,
    /// Directories made for the job's data (wiped at the end).
    pub data_dirs: Vec<PathBuf>,
    /// Seconds since the epoch when the start began.
    pub since: u64,
    /// The job stages outputs out at its end (node 0's word at the start): without a verdict
    /// at the stop, this node's data must be kept.
    #[serde(default)]
    pub outputs: bool,
}

/// The state directory of this node (STATE_DIR with `%n` expanded).
#[derive(Debug, Clone)]
pub struct StateDir(pub PathBuf);

impl StateDir {
    pub fn new(pattern: &str, node: &str) -> StateDir {
        StateDir(PathBuf::from(crate::site::expand(pattern, "%j", "%u", node)))
    }

    /// Creates the directory (root-only: it holds the jobs' client configs and logs).
    pub fn create(&self) -> Result<()> {
        std::fs::create_dir_all(&self.0)
            .with_context(|| format!("cannot create state directory {}", self.0.display()))?;
        std::fs::set_permissions(&self.0, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("cannot set the mode of {}", self.0.display()))
    }

    pub fn job_dir(&self, job: &str) -> PathBuf {
        self.0.join(job)
    }

    fn record_path(&self, job: &str) -> PathBuf {
        self.job_dir(job).join("record.toml")
    }

    /// Locks the job's state on this node (start, stop, recover and cleanup take turns).
    pub fn lock(&self, job: &str, wait: Duration) -> Result<Lock> {
        Lock::wait(&self.0.join(format!("{job}.lock")), &format!("job {job} on this node"), wait)
    }

    /// The lock if nobody holds it.
    pub fn try_lock(&self, job: &str) -> Result<Option<Lock>> {
        Lock::try_take(&self.0.join(format!("{job}.lock")))
    }

    pub fn load(&self, job: &str) -> Result<Option<Record>> {
        let p = self.record_path(job);
        match std::fs::read_to_string(&p) {
            Ok(t) => Ok(Some(toml::from_str(&t).with_context(|| format!("job record {} is damaged", p.display()))?)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).with_context(|| format!("cannot read {}", p.display())),
        }
    }

    pub fn save(&self, r: &Record) -> Result<()> {
        let dir = self.job_dir(&r.spec.job_id);
        std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let p = self.record_path(&r.spec.job_id);
        let tmp = p.with_extension("tmp");
        std::fs::write(&tmp, toml::to_string_pretty(r)?).with_context(|| format!("cannot write {}", tmp.display()))?;
        std::fs::rename(&tmp, &p).with_context(|| format!("cannot write {}", p.display()))
    }

    /// Job ids with a directory here (records, or leftovers of a start that died early).
    pub fn jobs(&self) -> Vec<String> {
        let Ok(rd) = std::fs::read_dir(&self.0) else { return Vec::new() };
        let mut v: Vec<String> = rd
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .filter_map(|e| e.file_name().into_string().ok())
            .collect();
        v.sort();
        v
    }

    /// Prints a progress line (prolog and epilog output, which slurmd logs on failure) and
    /// appends it, timestamped, to `STATE_DIR/odfs.log`, which outlives the job's directory.
    pub fn say(&self, job: &str, msg: &str) {
        eprintln!("odfs: job {job}: {msg}");
        self.note(job, msg);
    }

    /// Appends a line to the event log only (details that would bury the one line a failing
    /// prolog prints).
    pub fn note(&self, job: &str, msg: &str) {
        let line = format!("{} job {job}: {msg}\n", utc_now());
        let _ = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.0.join("odfs.log"))
            .and_then(|mut f| std::io::Write::write_all(&mut f, line.as_bytes()));
    }

    /// Moves the job to `phase` on this node, durably.
    pub fn enter(&self, rec: &mut Record, phase: Phase) -> Result<()> {
        rec.phase = phase;
        self.save(rec)
    }

    /// Takes everything of the record down, wipes its data and forgets the job here. Returns
    /// one line per step.
    pub fn wipe(&self, rec: &mut Record) -> Result<Vec<String>> {
        let steps = rec.teardown(true)?;
        self.forget(&rec.spec.job_id)?;
        Ok(steps)
    }

    /// Removes the job's directory and lock file (after a wipe).
    pub fn forget(&self, job: &str) -> Result<()> {
        let d = self.job_dir(job);
        if d.exists() {
            std::fs::remove_dir_all(&d).with_context(|| format!("cannot remove {}", d.display()))?;
        }
        let _ = std::fs::remove_file(self.0.join(format!("{job}.lock")));
        Ok(())
    }
}

/// The time as `2026-11-23T14:18:21.812Z`.
fn utc_now() -> String {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let t = now.as_secs() as libc::time_t;
    // SAFETY: gmtime_r writes into the zeroed struct we own.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    unsafe { libc::gmtime_r(&t, &mut tm) };
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z",
        tm.tm_year + 1900,
        tm.tm_mon + 1,
        tm.tm_mday,
        tm.tm_hour,
        tm.tm_min,
        tm.tm_sec,
        now.subsec_millis()
    )
}

impl Record {
    /// True while any process this record started is alive.
    pub fn alive(&self) -> bool {
        self.procs.iter().any(|p| procs::runs(p.pid, &p.config))
    }

    /// Unmounts the job's FUSE mount (never hangs) and stops its FUSE client.
    pub fn unmount(&mut self) -> Result<Vec<String>> {
        let mut steps = Vec::new();
        if let Some(m) = &self.mount {
            steps.extend(mount::unmount(m)?);
        }
        let fuse: Vec<(u32, &Path)> =
            self.procs.iter().filter(|p| p.service == "fuse").map(|p| (p.pid, p.config.as_path())).collect();
        procs::stop_all(&fuse, Duration::from_secs(3));
        // One that died without its goodbye (or was killed above) has it said for it: no change
        // of the stage-out waits a lease for the leases it held.
        steps.extend(self.procs.iter().filter(|p| p.service == "fuse").filter_map(launch::end_fuse_sessions));
        self.procs.retain(|p| p.service != "fuse");
        Ok(steps)
    }

    /// Stops every process of the job on this node (TERM, then KILL after `grace`); mgmtd
    /// last, so the others' goodbyes to it are answered instead of timing out.
    pub fn stop_services(&mut self, grace: Duration) {
        for last in [false, true] {
            let some: Vec<(u32, &Path)> = self
                .procs
                .iter()
                .filter(|p| (p.service == "mgmtd") == last)
                .map(|p| (p.pid, p.config.as_path()))
                .collect();
            procs::stop_all(&some, grace);
        }
    }

    /// Takes everything down: mount, processes; with `wipe` also the RAM target, the data and the
    /// mount point. Returns one line per step.
    pub fn teardown(&mut self, wipe: bool) -> Result<Vec<String>> {
        let mut steps = self.unmount()?;
        self.stop_services(Duration::from_secs(3));
        if !wipe {
            return Ok(steps);
        }
        if let Some(r) = &self.ram_mount {
            steps.extend(mount::unmount(r)?);
        }
        for d in &self.data_dirs {
            match std::fs::remove_dir_all(d) {
                Ok(()) => steps.push(format!("wiped {}", d.display())),
                // Never created (its parent is missing or not a directory).
                Err(e) if matches!(e.kind(), std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory) => {}
                Err(e) => return Err(e).with_context(|| format!("cannot wipe {}", d.display())),
            }
        }
        if let Some(m) = &self.mount {
            // Only an empty directory goes: nothing of the user's is ever removed here.
            let _ = std::fs::remove_dir(m);
        }
        Ok(steps)
    }
}
