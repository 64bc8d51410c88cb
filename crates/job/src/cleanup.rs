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

/// One step of a cleanup: the job it concerns and what was done (or why not).
type Step = (String, String);

fn lines(steps: Vec<Step>) -> Vec<String> {
    steps.into_iter().map(|(job, l)| format!("job {job}: {l}")).collect()
}

/// Removes one job's state on this node; `force` also stops live processes.
fn remove(state: &StateDir, job: &str, force: bool, discard: bool) -> Result<Vec<Step>> {
    let Some(_lock) = state.try_lock(job)? else {
        bail!("job {job}: another odfs command is working on it");
    };
    let step = |l: String| (job.to_string(), l);
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
            out.extend(rec.teardown(true)?.into_iter().map(step));
        }
        None => out.push(step("removed a start that left no record".into())),
    }
    state.forget(job)?;
    out.push(step("cleaned up".into()));
    Ok(out)
}

/// Sweeps stale jobs (all but `except`); returns what it did, one line per step. Problems
/// with one job never stop the sweep; they are reported as lines.
pub fn stale(state: &StateDir, node: &str, except: Option<&str>) -> Vec<String> {
    lines(stale_steps(state, node, except))
}

fn stale_steps(state: &StateDir, node: &str, except: Option<&str>) -> Vec<Step> {
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
                out.push((job, "left to the odfs command working on it (its epilog?)".into()));
                continue;
            }
            Err(e) => {
                out.push((job, format!("{e:#}")));
                continue;
            }
        };
        let rec = match state.load(&job) {
            Ok(r) => r,
            Err(e) => {
                out.push((job, format!("{e:#}")));
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
            Ok(steps) => out.extend(steps),
            Err(e) => out.push((job.clone(), unprefixed(&job, &format!("{e:#}")))),
        }
    }
    out
}

/// An error's text without the "job N: " it starts with.
fn unprefixed(job: &str, e: &str) -> String {
    e.strip_prefix(&format!("job {job}: ")).unwrap_or(e).to_string()
}

/// `odfs cleanup [--job ID --discard]`: one job (its processes are stopped even if alive), or
/// every stale job on this node. Every step, and a refusal, also goes to the node's event log
/// (`odfs.log`), marked as this command's.
pub fn cleanup(state: &StateDir, node: &str, job: Option<&str>, discard: bool) -> Result<Vec<String>> {
    let cmd = if discard { "odfs cleanup --discard" } else { "odfs cleanup" };
    let steps = match job {
        Some(j) => {
            let r = if state.job_dir(j).exists() {
                remove(state, j, true, discard)
            } else {
                Err(anyhow::anyhow!("no state of job {j} on this node ({})", state.0.display()))
            };
            if let Err(e) = &r {
                state.note(j, &format!("{cmd}: refused: {}", unprefixed(j, &format!("{e:#}"))));
            }
            r?
        }
        None => stale_steps(state, node, None),
    };
    for (j, l) in &steps {
        state.note(j, &format!("{cmd}: {l}"));
    }
    Ok(lines(steps))
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

    /// A record of job `job` on this node holding `data`, kept for `odfs recover`.
    fn retained(state: &StateDir, job: &str, data: &std::path::Path) {
        let spec = crate::spec::JobSpec {
            job_id: job.into(),
            nodes: vec!["n1".into()],
            index: 0,
            user: crate::spec::JobUser { name: "ana".into(), uid: 1000, gid: 1000, groups: vec![] },
            features: vec!["odfs".into()],
            stdout: None,
            slurm: false,
        };
        let rec = crate::record::Record {
            spec,
            phase: Phase::Retained { reason: "stage-out: S3 down".into() },
            directives: Default::default(),
            mgmtd: "127.0.0.1:1".parse().unwrap(),
            client_config: state.job_dir(job).join("odfs.toml"),
            procs: Vec::new(),
            mount: None,
            ram_mount: None,
            data_dirs: vec![data.to_path_buf()],
            since: 0,
            outputs: true,
        };
        state.save(&rec).unwrap();
    }

    #[test]
    fn every_manual_cleanup_and_refusal_is_in_the_event_log() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir(dir.path().join("state"));
        state.create().unwrap();
        let log = || std::fs::read_to_string(state.0.join("odfs.log")).unwrap_or_default();
        let data = dir.path().join("nvme/odfs.9");
        std::fs::create_dir_all(&data).unwrap();
        std::fs::write(data.join("chunk"), b"kept").unwrap();
        retained(&state, "9", &data);

        // Kept data is refused without --discard, and the refusal is logged.
        let e = cleanup(&state, "n1", Some("9"), false).unwrap_err();
        assert!(format!("{e:#}").contains("add --discard"), "{e:#}");
        assert!(
            log().contains("job 9: odfs cleanup: refused: data kept for `odfs recover` (stage-out: S3 down)"),
            "{}",
            log()
        );
        assert!(data.join("chunk").exists());

        let said = cleanup(&state, "n1", Some("9"), true).unwrap();
        assert_eq!(said, [format!("job 9: wiped {}", data.display()), "job 9: cleaned up".to_string()]);
        let text = log();
        assert!(text.contains(&format!("job 9: odfs cleanup --discard: wiped {}\n", data.display())), "{text}");
        assert!(text.contains("job 9: odfs cleanup --discard: cleaned up\n"), "{text}");
        assert!(!data.exists() && !state.job_dir("9").exists());

        // The sweep (no --job) logs what it removed too.
        std::fs::create_dir(state.job_dir("10")).unwrap();
        cleanup(&state, "n1", None, false).unwrap();
        assert!(log().contains("job 10: odfs cleanup: removed a start that left no record\n"), "{}", log());
        assert!(log().contains("job 10: odfs cleanup: cleaned up\n"), "{}", log());
        // A job with no state here: refused, and logged.
        assert!(cleanup(&state, "n1", Some("11"), false).is_err());
        assert!(log().contains("job 11: odfs cleanup: refused: no state of job 11 on this node"), "{}", log());
    }
}
