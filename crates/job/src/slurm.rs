//! The few things odfs asks of Slurm, each only on a path that needs it: a job's batch script
//! (for `#ODFS` lines, node 0 only), whether a job still runs (during a stage-in, and for
//! cleanup), and a node's drain reason. Plus the one message odfs leaves for the user in the
//! job's output file. Every call is bounded; a Slurm that does not answer never blocks a
//! prolog or epilog beyond a few seconds.

use crate::spec::JobSpec;
use anyhow::{bail, Context, Result};
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Runs a Slurm command with a time limit; (status ok, stdout, stderr).
fn run(cmd: &str, args: &[&str], limit: Duration) -> Result<(bool, String, String)> {
    let mut child = Command::new(cmd)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot run {cmd} (is Slurm's client installed and on PATH?)"))?;
    let t = Instant::now();
    loop {
        if let Some(st) = child.try_wait()? {
            let out = child.wait_with_output()?;
            return Ok((
                st.success(),
                String::from_utf8_lossy(&out.stdout).into_owned(),
                String::from_utf8_lossy(&out.stderr).trim().to_string(),
            ));
        }
        if t.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            bail!("{cmd} {} did not finish within {} s", args.join(" "), limit.as_secs());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The job's batch script (`scontrol write batch_script JOB -`); None for jobs without one
/// (`salloc`, `srun`).
pub fn batch_script(job: &str) -> Result<Option<String>> {
    let (ok, out, err) = run("scontrol", &["write", "batch_script", job, "-"], Duration::from_secs(20))?;
    if !ok {
        bail!("scontrol write batch_script {job}: {err}");
    }
    // sbatch insists on a first line "#!"; salloc/srun jobs print "Job script not specified".
    if !out.starts_with("#!") {
        return Ok(None);
    }
    Ok(Some(out))
}

/// The job's state as squeue names it ("RUNNING", "COMPLETING", "PENDING", ...; "GONE" once
/// Slurm has forgotten it) and its nodes (for a completing job: those still completing); None
/// when Slurm cannot be asked.
pub fn job_state(job: &str) -> Option<(String, Vec<String>)> {
    let (ok, out, err) = run("squeue", &["-h", "-j", job, "-o", "%T %N"], Duration::from_secs(10)).ok()?;
    if !ok {
        return err.contains("Invalid job id").then(|| ("GONE".to_string(), Vec::new()));
    }
    let mut w = out.split_whitespace();
    let state = w.next().unwrap_or("GONE").to_string();
    let nodes = w.next().and_then(|l| crate::hostlist::expand(l).ok()).unwrap_or_default();
    Some((state, nodes))
}

/// Whether Slurm still runs the job: Some(false) once it is cancelled, completing, requeued or
/// gone; None when Slurm cannot be asked.
pub fn job_active(job: &str) -> Option<bool> {
    job_state(job).map(|(s, _)| matches!(s.as_str(), "RUNNING" | "CONFIGURING"))
}

/// Jobs Slurm runs (or is completing) on `node`; None when Slurm cannot be asked.
pub fn jobs_on(node: &str) -> Option<Vec<String>> {
    let (ok, out, _) = run("squeue", &["-h", "-w", node, "-o", "%i"], Duration::from_secs(10)).ok()?;
    ok.then(|| out.lines().map(|l| l.trim().to_string()).filter(|l| !l.is_empty()).collect())
}

/// Start of every drain reason odfs sets.
const DRAIN_PREFIX: &str = "odfs: ";

/// Start of a drain reason set on the batch host only to keep the batch script from running.
pub const BATCH_HOST_MARK: &str = "batch host:";

/// Longest drain reason odfs sets: what `sinfo -R` shows whole. Callers put the action first;
/// the whole message is in the node's event log.
const DRAIN_REASON_MAX: usize = 200;

/// The drain reason for `reason`: odfs's prefix, one line, cut to `DRAIN_REASON_MAX`
/// characters with an ellipsis where it was cut.
fn drain_reason(reason: &str) -> String {
    let line: String = format!("{DRAIN_PREFIX}{reason}").chars().map(|c| if c == '\n' { ' ' } else { c }).collect();
    if line.chars().count() <= DRAIN_REASON_MAX {
        return line;
    }
    line.chars().take(DRAIN_REASON_MAX - 1).chain(std::iter::once('…')).collect()
}

/// The drain reason of a node whose job's outputs were not verified (its data kept): what to
/// do first, then as much of the cause as fits — the first cause, then (`recovery`) that of an
/// `odfs recover` that failed after it.
pub fn kept_data_reason(job: &str, cause: &str, recovery: Option<&str>) -> String {
    let (too, then) = match recovery {
        Some(r) => (", `odfs recover` failed too", format!("; recover: {r}")),
        None => ("", String::new()),
    };
    format!(
        "job {job}: outputs not verified, data kept{too}; once fixed run `odfs recover --job {job}` on every node \
         (details in odfs.log): {cause}{then}"
    )
}

/// Drains `node` with `reason` (Slurm drains a node whose prolog or epilog fails; this makes
/// its reason odfs's one line instead of "Prolog error"). Best effort.
pub fn drain(node: &str, reason: &str) {
    let r = format!("reason={}", drain_reason(reason));
    if let Err(e) =
        run("scontrol", &["update", &format!("nodename={node}"), "state=drain", &r], Duration::from_secs(10))
    {
        eprintln!("odfs: cannot set the drain reason of {node}: {e:#}");
    }
}

/// Cancels `job` (requeued and held after a start that can never succeed).
pub fn cancel(job: &str) -> Result<()> {
    let (ok, _, err) = run("scancel", &[job], Duration::from_secs(10))?;
    anyhow::ensure!(ok, "scancel {job}: {err}");
    Ok(())
}

/// Returns `node` to service if it is drained with a reason carrying `BATCH_HOST_MARK`.
pub fn resume_batch_host(node: &str) -> Result<bool> {
    let (ok, out, err) = run("scontrol", &["show", "node", node], Duration::from_secs(10))?;
    anyhow::ensure!(ok, "scontrol show node {node}: {err}");
    if !out.contains(&format!("Reason={DRAIN_PREFIX}{BATCH_HOST_MARK}")) {
        return Ok(false);
    }
    let (ok, _, err) =
        run("scontrol", &["update", &format!("nodename={node}"), "state=resume"], Duration::from_secs(10))?;
    anyhow::ensure!(ok, "scontrol update nodename={node} state=resume: {err}");
    Ok(true)
}

/// Appends `odfs: LINE` to the job's output file, written as the job's user (a user cannot make
/// root write to a file they could not write themselves).
pub fn tell_user(spec: &JobSpec, line: &str) {
    let Some(path) = spec.stdout.clone() else { return };
    let text = format!("odfs: {line}\n");
    let r = odfs_stage::posix::as_user_blocking(&spec.user.ctx(), move || {
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o644)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)?;
        f.write_all(text.as_bytes())
    });
    if let Err(e) = r {
        eprintln!(
            "odfs: cannot write to the job's output file {}: {e}",
            spec.stdout.as_ref().map(|p| p.display().to_string()).unwrap_or_default()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drain_reasons_put_the_action_first_and_fit_in_one_line() {
        let cause = format!("connection refused\nretried: stage-out odfs:/results -> s3://b/{}", "x".repeat(300));
        let r = drain_reason(&kept_data_reason("42", &cause, None));
        let action =
            "odfs: job 42: outputs not verified, data kept; once fixed run `odfs recover --job 42` on every node";
        assert!(r.starts_with(action), "{r}");
        assert!(r.contains("connection refused retried"), "newlines become spaces: {r}");
        assert_eq!(r.chars().count(), DRAIN_REASON_MAX);
        assert!(r.ends_with('…') && !r.contains('\n'), "{r}");
        assert_eq!(drain_reason("short"), "odfs: short");
    }

    #[test]
    fn a_failed_recovery_keeps_the_first_cause_in_the_drain_reason() {
        let r = drain_reason(&kept_data_reason("7", "S3 down", Some("n1 silent")));
        assert_eq!(
            r,
            "odfs: job 7: outputs not verified, data kept, `odfs recover` failed too; once fixed run \
             `odfs recover --job 7` on every node (details in odfs.log): S3 down; recover: n1 silent"
        );
    }
}
