//! `odfs cleanup`, and the same sweep at the start of every `odfs start`: removes what jobs
//! that no longer run left on this node — a node that died never runs its epilog, so its
//! daemons, mounts and data are found here when it comes back.
//!
//! A job's state is stale when nobody works on it (its lock is free) and none of its
//! processes is alive, or Slurm says it no longer runs on this node. Data kept for
//! `odfs recover` is never removed unless asked for by job id with `--discard`.

use crate::record::{Phase, StateDir};
use crate::slurm;
use anyhow::{bail, Result};

/// Removes one job's state on this node; `force` also stops live processes.
fn remove(state: &StateDir, job: &str, force: bool, discard: bool) -> Result<Vec<String>> {
    let Some(_lock) = state.try_lock(job)? else {
        bail!("job {job}: another odfs command is working on it");
    };
    let mut out = Vec::new();
    match state.load(job)? {
        Some(mut rec) => {
            if let Phase::Retained { reason } = &rec.phase {
                if !discard {
                    bail!("job {job}: data kept for `odfs recover` ({reason}); add --discard to drop it");
                }
            }
            if rec.alive() && !force {
                bail!("job {job}: its processes are alive");
            }
            out.extend(rec.teardown(true)?.into_iter().map(|l| format!("job {job}: {l}")));
        }
        None => out.push(format!("job {job}: removed a start that left no record")),
    }
    state.forget(job)?;
    out.push(format!("job {job}: cleaned up"));
    Ok(out)
}

/// Sweeps stale jobs (all but `except`); returns what it did, one line per step. Problems
/// with one job never stop the sweep; they are reported as lines.
pub fn stale(state: &StateDir, node: &str, except: Option<&str>) -> Vec<String> {
    let jobs: Vec<String> = state.jobs().into_iter().filter(|j| Some(j.as_str()) != except).collect();
    if jobs.is_empty() {
        return Vec::new();
    }
    let mut on_node: Option<Option<Vec<String>>> = None;
    let mut out = Vec::new();
    for job in jobs {
        let _probe = match state.try_lock(&job) {
            Ok(Some(l)) => l,
            // Typically the job's own epilog, run late on a node that came back: it finishes
            // the job's stop itself.
            Ok(None) => {
                out.push(format!("job {job}: left to the odfs command working on it (its epilog?)"));
                continue;
            }
            Err(e) => {
                out.push(format!("job {job}: {e:#}"));
                continue;
            }
        };
        let rec = match state.load(&job) {
            Ok(r) => r,
            Err(e) => {
                out.push(format!("job {job}: {e:#}"));
                continue;
            }
        };
        if matches!(rec.as_ref().map(|r| &r.phase), Some(Phase::Retained { .. })) {
            continue;
        }
        let alive = rec.as_ref().is_some_and(|r| r.alive());
        if alive {
            // Live daemons: stale only if Slurm says the job no longer runs here.
            let running = on_node.get_or_insert_with(|| slurm::jobs_on(node));
            match running {
                Some(list) if !list.contains(&job) => {}
                _ => continue,
            }
        }
        drop(_probe);
        match remove(state, &job, true, false) {
            Ok(lines) => out.extend(lines),
            Err(e) => out.push(format!("{e:#}")),
        }
    }
    out
}

/// `odfs cleanup [--job ID --discard]`: one job (its processes are stopped even if alive), or
/// every stale job on this node.
pub fn cleanup(state: &StateDir, node: &str, job: Option<&str>, discard: bool) -> Result<Vec<String>> {
    match job {
        Some(j) => {
            anyhow::ensure!(state.job_dir(j).exists(), "no state of job {j} on this node ({})", state.0.display());
            remove(state, j, true, discard)
        }
        None => Ok(stale(state, node, None)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_another_command_works_on_is_left_to_it_and_swept_after() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir(dir.path().to_path_buf());
        std::fs::create_dir(state.job_dir("7")).unwrap();
        let held = state.lock("7", std::time::Duration::from_secs(1)).unwrap();
        let lines = stale(&state, "n1", None);
        assert_eq!(lines, ["job 7: left to the odfs command working on it (its epilog?)"]);
        assert!(state.job_dir("7").exists(), "a job being worked on must be left alone");
        drop(held);
        let lines = stale(&state, "n1", None);
        assert_eq!(lines, ["job 7: removed a start that left no record", "job 7: cleaned up"]);
        assert!(!state.job_dir("7").exists());
        assert!(stale(&state, "n1", Some("8")).is_empty());
    }
}
