//! `odfs stop` (the Slurm epilog) and `odfs recover`: one node's part of taking a job's
//! filesystem down without losing outputs.
//!
//! Stop: every node unmounts (so every write made through its mount is on the targets) and
//! reports `Unmounted`. Node 0 waits for them (or for a dead node's services to go offline),
//! runs the job's stage-outs as the job's user and posts the verdict: `Wipe` when every output
//! is verified in the store (or there is nothing to stage out), `Retain` otherwise. Every node
//! then stops its services and wipes its data — or, on `Retain`, keeps its targets, marks its
//! record retained and exits non-zero. Node 0 keeps mgmtd up until the others report
//! `Stopped` (bounded), since they learn the verdict from it.
//!
//! Recover: on every node of a retained job, restart the services from the kept targets
//! (same ports, same data), then finish exactly as stop does: stage-out, verdict, wipe.
//!
//! Owns the stop and recover protocols. Must not start what `start` starts beyond the
//! services of a retained job.

use crate::board::BoardLink;
use crate::launch::procs;
use crate::record::{Phase, Record, StateDir};
use crate::slurm;
use crate::spec::JobSpec;
use crate::start::{check_alive, run_stages, NodeContext};
use anyhow::{bail, Context, Result};
use odfs_proto::mgmt::{FsState, NodePhase, ServiceKind, Verdict};
use odfs_service::JobSection;
use std::time::{Duration, Instant};

/// How a stop (or recover) ended on this node.
#[derive(Debug, Clone, PartialEq)]
pub enum StopOutcome {
    /// Nothing of the job on this node.
    Nothing,
    /// Outputs verified (or none); everything wiped.
    Wiped { secs: f64, stage_secs: f64 },
}

/// `odfs stop` on this node.
pub(crate) fn stop_node(spec: &JobSpec, ctx: &NodeContext) -> Result<StopOutcome> {
    let o = &ctx.site.ondemand;
    let state = StateDir::new(&o.state_dir, spec.node_name());
    if !state.job_dir(&spec.job_id).exists() {
        return Ok(StopOutcome::Nothing);
    }
    let t0 = Instant::now();
    let _lock = state.lock(&spec.job_id, Duration::from_secs(30))?;
    let Some(mut rec) = state.load(&spec.job_id)? else {
        // A start that died before its first record: only directories to remove.
        state.forget(&spec.job_id)?;
        return Ok(StopOutcome::Nothing);
    };
    match &rec.phase {
        Phase::StartFailed { own, script, .. } => {
            // Node 0 of a start that was rolled back: nothing runs; return the batch host to
            // service if it was drained only to keep the batch script from running.
            if *script && spec.slurm {
                match slurm::cancel(&spec.job_id) {
                    Ok(()) => state.say(&spec.job_id, "cancelled: its batch script is invalid"),
                    Err(e) => state.say(&spec.job_id, &format!("cannot cancel the job: {e:#}")),
                }
            }
            if !own && spec.slurm && o.slurm_drain_reason {
                match slurm::resume_batch_host(spec.node_name()) {
                    Ok(true) => state.say(&spec.job_id, &format!("{} returned to service", spec.node_name())),
                    Ok(false) => {}
                    Err(e) => state.say(&spec.job_id, &format!("cannot return {} to service: {e:#}", spec.node_name())),
                }
            }
            state.wipe(&mut rec)?;
            return Ok(StopOutcome::Nothing);
        }
        Phase::Retained { reason } => {
            bail!(crate::line(
                &spec.job_id,
                &format!("data is kept on this node ({reason}); run `odfs recover --job {}`", spec.job_id)
            ))
        }
        _ => {}
    }
    for l in rec.unmount()? {
        state.say(&spec.job_id, &l);
    }
    state.save(&rec)?;
    let link = link_for(&rec, ctx)?;
    // One attempt: node 0 also learns of a node that stays silent (its services go offline).
    let _ = link.report(NodePhase::Unmounted);
    finish(&mut rec, &state, &link, ctx, t0)
}

fn link_for(rec: &Record, ctx: &NodeContext) -> Result<BoardLink> {
    let cred = JobSection { id: rec.spec.job_id.clone(), site_key: ctx.site.ondemand.site_key.clone() }.credential()?;
    BoardLink::new(cred, rec.mgmtd, rec.spec.index, rec.spec.node_name())
}

/// Waits until every other node reported one of `phases`, or its storage service went silent
/// (a dead node), or `limit` passes. Returns the nodes still missing.
fn wait_nodes(link: &BoardLink, spec: &JobSpec, phases: &[NodePhase], limit: Duration) -> Vec<String> {
    let t = Instant::now();
    loop {
        let mut missing = Vec::new();
        match (link.board(), link.cluster()) {
            (Ok(b), Ok(v)) => {
                for k in 1..spec.nodes.len() as u32 {
                    let reported = b.phase(k).is_some_and(|p| phases.contains(p));
                    // Dead: its stored is registered but silent. (One that unregistered stopped
                    // in order; its node's report follows within moments.)
                    let mut stored = v.services.iter().filter(|s| s.kind == ServiceKind::Storage && s.node == k);
                    let dead = stored.clone().next().is_some() && !stored.any(|s| s.online);
                    if !reported && !dead {
                        missing.push(spec.nodes[k as usize].clone());
                    }
                }
            }
            _ => missing.push("mgmtd".into()),
        }
        if missing.is_empty() || t.elapsed() > limit {
            return missing;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// Stop and recover from the point where this node's mount is gone.
fn finish(rec: &mut Record, state: &StateDir, link: &BoardLink, ctx: &NodeContext, t0: Instant) -> Result<StopOutcome> {
    let spec = rec.spec.clone();
    let grace = Duration::from_secs(ctx.site.ondemand.stop_grace_secs);
    let end = if spec.is_node0() {
        let (verdict, stage_secs) = lead_verdict(rec, state, link, ctx)?;
        Ending { verdict, heard: true, stage_secs }
    } else {
        let (verdict, heard) = follow_verdict(rec, state, link, ctx);
        Ending { verdict, heard, stage_secs: 0.0 }
    };
    if spec.is_node0() {
        let missing = wait_nodes(link, &spec, &[NodePhase::Stopped], grace);
        if !missing.is_empty() {
            state.say(
                &spec.job_id,
                &format!("{} did not report stopping within {} s", missing.join(", "), grace.as_secs()),
            );
        }
    }
    apply_verdict(rec, state, link, ctx, end, t0)
}

/// How the stop's decision came out on this node.
struct Ending {
    verdict: Verdict,
    /// Node 0's mgmtd still answers (no point saying goodbye to it otherwise).
    heard: bool,
    stage_secs: f64,
}

/// Node 0: waits for the other nodes' unmounts, stages the outputs out and posts the verdict.
/// Returns it with the stage-out's seconds.
fn lead_verdict(rec: &Record, state: &StateDir, link: &BoardLink, ctx: &NodeContext) -> Result<(Verdict, f64)> {
    let spec = &rec.spec;
    let grace = Duration::from_secs(ctx.site.ondemand.stop_grace_secs);
    let missing = wait_nodes(link, spec, &[NodePhase::Unmounted, NodePhase::Started, NodePhase::Stopped], grace);
    if !missing.is_empty() {
        state.say(
            &spec.job_id,
            &format!("going on without {} (no report within {} s)", missing.join(", "), grace.as_secs()),
        );
    }
    // Outputs exist only if the job ran; a job stopped before (or during) its stage-in has
    // nothing of its own to keep.
    let ran = matches!(rec.phase, Phase::Running | Phase::Retained { .. });
    let t1 = Instant::now();
    let v = if ran {
        match run_stages(link, state, rec, ctx, false, false) {
            Ok(_) => Verdict::Wipe,
            Err(reason) => Verdict::Retain { reason },
        }
    } else {
        Verdict::Wipe
    };
    let stage_secs = t1.elapsed().as_secs_f64();
    link.set_verdict(v.clone()).context("cannot post the verdict to mgmtd")?;
    Ok((v, stage_secs))
}

/// Other nodes: node 0's verdict, or what this node decides without one. Returns the verdict
/// and whether node 0 was heard.
fn follow_verdict(rec: &Record, state: &StateDir, link: &BoardLink, ctx: &NodeContext) -> (Verdict, bool) {
    let (spec, o) = (&rec.spec, &ctx.site.ondemand);
    match wait_stop_verdict(link, spec, Duration::from_secs(o.stage_timeout_secs + o.stop_grace_secs)) {
        Ok(v) => (v, true),
        // Only node 0 can say the outputs are safe; a job that stages nothing out has
        // nothing on this node anyone could need.
        Err(why) if rec.outputs => (Verdict::Retain { reason: why }, false),
        Err(why) => {
            state.say(&spec.job_id, &format!("{why}; the job stages nothing out, so this node's part is wiped"));
            (Verdict::Wipe, false)
        }
    }
}

/// Wipes on `Wipe`; keeps the data, marks the record retained and fails on `Retain`.
fn apply_verdict(
    rec: &mut Record,
    state: &StateDir,
    link: &BoardLink,
    ctx: &NodeContext,
    end: Ending,
    t0: Instant,
) -> Result<StopOutcome> {
    let o = &ctx.site.ondemand;
    let spec = rec.spec.clone();
    let Ending { verdict, heard, stage_secs } = end;
    match verdict {
        Verdict::Wipe => {
            for l in state.wipe(rec)? {
                state.say(&spec.job_id, &l);
            }
            if !spec.is_node0() && heard {
                let _ = link.report(NodePhase::Stopped);
            }
            state.say(
                &spec.job_id,
                &format!("stopped and wiped on {} in {:.2} s", spec.where_(), t0.elapsed().as_secs_f64()),
            );
            Ok(StopOutcome::Wiped { secs: t0.elapsed().as_secs_f64(), stage_secs })
        }
        Verdict::Retain { reason: now } | Verdict::Abort { reason: now } => {
            // A recovery that failed keeps the first cause and adds its own.
            let first = match &rec.phase {
                Phase::Retained { reason } => Some(first_cause(reason).to_string()),
                _ => None,
            };
            let reason = match &first {
                Some(first) => format!("{first}{RECOVERY_FAILED}{now}"),
                None => now.clone(),
            };
            rec.teardown(false)?;
            state.enter(rec, Phase::Retained { reason: reason.clone() })?;
            if !spec.is_node0() && heard {
                let _ = link.report(NodePhase::Stopped);
            }
            let kept: Vec<String> = rec.data_dirs.iter().map(|d| d.display().to_string()).collect();
            let msg = crate::line(
                &spec.job_id,
                &format!(
                    "outputs not verified ({reason}); data kept on {} in {}; once the cause is fixed run \
                     `odfs recover --job {}` on every node of the job",
                    spec.node_name(),
                    kept.join(", "),
                    spec.job_id
                ),
            );
            if spec.slurm {
                if spec.is_node0() {
                    slurm::tell_user(&spec, &msg);
                }
                if o.slurm_drain_reason {
                    let cause = first.as_deref().unwrap_or(&now);
                    let recovery = first.is_some().then_some(now.as_str());
                    slurm::drain(spec.node_name(), &slurm::kept_data_reason(&spec.job_id, cause, recovery));
                }
            }
            bail!(msg)
        }
        Verdict::Ready { .. } => bail!("node 0 posted no stop verdict"),
    }
}

/// Joins a kept job's first cause and the cause of the recovery that failed after it.
const RECOVERY_FAILED: &str = "; then `odfs recover` failed: ";

/// The first cause in a kept job's reason (an earlier failed recovery's cause is replaced by
/// the latest one's).
fn first_cause(kept: &str) -> &str {
    kept.split(RECOVERY_FAILED).next().unwrap_or(kept)
}

/// Other nodes: waits for node 0's stop verdict (`Wipe` or `Retain`). Err(why) when there is
/// none to be had: node 0's mgmtd is gone and Slurm says the job is no longer completing (node
/// 0's epilog is over, or this node came back after the job left it), or it stays silent.
fn wait_stop_verdict(link: &BoardLink, spec: &JobSpec, limit: Duration) -> Result<Verdict, String> {
    let t = Instant::now();
    let mut lost_since: Option<Instant> = None;
    loop {
        match link.board() {
            Ok(b) => {
                lost_since = None;
                if let Some(v @ (Verdict::Wipe | Verdict::Retain { .. })) = b.verdict {
                    return Ok(v);
                }
            }
            Err(_) => {
                let since = *lost_since.get_or_insert_with(Instant::now);
                let lost = since.elapsed();
                if lost > Duration::from_secs(3) && spec.slurm {
                    // Node 0's epilog is over when Slurm no longer counts node 0 among the job's
                    // completing nodes (this node's own epilog keeps the job completing).
                    if let Some((st, nodes)) = slurm::job_state(&spec.job_id) {
                        if st != "COMPLETING" || !nodes.contains(&spec.nodes[0]) {
                            return Err(format!(
                                "no verdict from node 0 ({}): its mgmtd is gone and Slurm has the job {st} on {:?}",
                                spec.nodes[0], nodes
                            ));
                        }
                    }
                }
                if lost > Duration::from_secs(30) {
                    return Err(format!("node 0 ({}) did not answer for 30 s during the stop", spec.nodes[0]));
                }
            }
        }
        if t.elapsed() > limit {
            return Err(format!("no verdict from node 0 ({}) within {} s", spec.nodes[0], limit.as_secs()));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `odfs recover --job ID` on this node: restarts the services of a retained job from its kept
/// targets and finishes its stop (stage-out, verify, wipe).
pub(crate) fn recover_node(job_id: &str, node: &str, ctx: &NodeContext) -> Result<StopOutcome> {
    let o = &ctx.site.ondemand;
    let state = StateDir::new(&o.state_dir, node);
    let t0 = Instant::now();
    let _lock = state.lock(job_id, Duration::from_secs(10))?;
    let mut rec = state
        .load(job_id)?
        .with_context(|| format!("no record of job {job_id} on this node ({})", state.0.display()))?;
    let Phase::Retained { reason } = rec.phase.clone() else {
        bail!("job {job_id} has no kept data on this node (its record says {:?})", rec.phase);
    };
    state.say(job_id, &format!("recovering (kept because: {reason})"));
    rec.procs.retain(|p| p.service != "fuse");
    for p in rec.procs.iter_mut() {
        let bin = procs::binary(&format!("odfs-{}", p.service))?;
        p.pid = procs::spawn_daemon(&bin, &p.config, &p.log)?;
    }
    state.save(&rec)?;
    let link = link_for(&rec, ctx)?;
    let spec = rec.spec.clone();
    let deadline = Instant::now() + Duration::from_secs(o.ready_timeout_secs);
    let up = (|| -> Result<()> {
        loop {
            check_alive(&rec)?;
            if link.report(NodePhase::Started).is_ok() {
                break;
            }
            anyhow::ensure!(Instant::now() < deadline, "node 0 ({}) did not answer at {}", spec.nodes[0], rec.mgmtd);
            std::thread::sleep(Duration::from_millis(50));
        }
        if spec.is_node0() {
            loop {
                check_alive(&rec)?;
                let b = link.board()?;
                let v = link.cluster()?;
                let agents = v.services.iter().filter(|s| s.kind == ServiceKind::Agent && s.online).count();
                let started = (0..spec.nodes.len() as u32).filter(|k| b.phase(*k) == Some(&NodePhase::Started)).count();
                if v.state == FsState::Ready && started == spec.nodes.len() && agents == spec.nodes.len() {
                    return Ok(());
                }
                anyhow::ensure!(
                    Instant::now() < deadline,
                    "only {started} of {} nodes joined the recovery in time (run `odfs recover --job {job_id}` on every node of the job)",
                    spec.nodes.len()
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Ok(())
    })();
    if let Err(e) = up {
        rec.stop_services(Duration::from_secs(3));
        if spec.is_node0() {
            let _ = link.set_verdict(Verdict::Retain { reason: format!("recovery failed: {e:#}") });
        }
        bail!(crate::line(job_id, &format!("recovery failed on {}: {e:#}; the data is still kept", spec.where_())));
    }
    let out = finish(&mut rec, &state, &link, ctx, t0)?;
    if spec.is_node0() && spec.slurm {
        slurm::tell_user(
            &spec,
            &crate::line(job_id, "recovered: outputs staged out and verified; the job's data is wiped"),
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_reason_keeps_its_first_cause_through_failed_recoveries() {
        let once = format!("{}{RECOVERY_FAILED}{}", first_cause("S3 down"), "n1 silent");
        assert_eq!(once, "S3 down; then `odfs recover` failed: n1 silent");
        let twice = format!("{}{RECOVERY_FAILED}{}", first_cause(&once), "S3 still down");
        assert_eq!(twice, "S3 down; then `odfs recover` failed: S3 still down");
    }
}
