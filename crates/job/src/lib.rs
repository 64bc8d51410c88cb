//! The life cycle of a job's filesystem: on real nodes, `odfs start` and `odfs stop` (the
//! Slurm prolog and epilog, or any launcher that runs them on every node), `odfs recover`,
//! `odfs cleanup` and the TaskProlog's `odfs task-env`; on one machine, `odfs local up/down/
//! restart`. The `odfs` command parses arguments and calls this crate's API.
//!
//! - `launch`: one node's daemons and their configs, started and watched as processes, the
//!   FUSE mount, the locks (used by `start` and `local` alike).
//! - `local`: a whole multi-node filesystem on this machine.
//! - `spec`, `hostlist`: which job, which nodes, which user, which features.
//! - `site`: the site config's `[ondemand]` table.
//! - `directives`: `#ODFS` lines of a batch script.
//! - `record`: what a node started for a job (`STATE_DIR/JOBID/`), and its teardown.
//! - `board`: the job board on node 0's mgmtd, through which the nodes agree.
//! - `start`, `stop`, `cleanup`: the protocols.
//! - `slurm`: the few Slurm commands used, and the message left in the job's output file.
//! - `creds`: whose S3 credentials a job's stages use.
//! - `interrupt`: what `odfs local up`, `odfs demo` and `odfs bench` stop when interrupted.

pub mod board;
pub mod cleanup;
pub mod creds;
pub mod directives;
pub mod hostlist;
pub mod interrupt;
pub mod launch;
pub mod local;
pub mod record;
pub mod site;
pub mod site_check;
pub mod slurm;
pub mod spec;
pub mod start;
pub mod stop;

pub use site::SiteConfig;
pub use spec::{JobSpec, SpecArgs};
pub use start::{NodeContext, StartOutcome};
pub use stop::StopOutcome;

use anyhow::Result;
use record::StateDir;

/// A message about `job`, as the prolog, epilog and the job's output file show it — one line
/// for the user and the admin: "job 12: could not start: n3 (node 2 of 4): ...".
fn line(job: &str, msg: &str) -> String {
    format!("job {job}: {msg}")
}

/// Runs one node-local command; its error is also written to the node's event log.
fn logged<T>(ctx: &NodeContext, node: &str, job: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let r = f();
    if let Err(e) = &r {
        let state = StateDir::new(&ctx.site.ondemand.state_dir, node);
        if state.0.is_dir() {
            let e = format!("{e:#}");
            state.note(job, &format!("FAILED: {}", e.strip_prefix(&line(job, "")).unwrap_or(&e)));
        }
    }
    r
}

/// `odfs start` on this node (see `start`).
pub fn start(spec: &JobSpec, ctx: &NodeContext) -> Result<StartOutcome> {
    logged(ctx, spec.node_name(), &spec.job_id, || start::start_node(spec, ctx))
}

/// `odfs stop` on this node (see `stop`).
pub fn stop(spec: &JobSpec, ctx: &NodeContext) -> Result<StopOutcome> {
    logged(ctx, spec.node_name(), &spec.job_id, || stop::stop_node(spec, ctx))
}

/// `odfs recover --job ID` on this node (see `stop`).
pub fn recover(job: &str, node: &str, ctx: &NodeContext) -> Result<StopOutcome> {
    logged(ctx, node, job, || stop::recover_node(job, node, ctx))
}

/// `odfs task-env`: `export` lines for the job's tasks (Slurm's TaskProlog prints them into
/// the task environment): `ODFS_MOUNT`, `ODFS_JOB`. Nothing when the job has no odfs mount
/// on this node.
pub fn task_env(site: &SiteConfig, job: &str, user: &str, node: &str) -> Vec<String> {
    let mp = std::path::PathBuf::from(site::expand(&site.ondemand.mount, job, user, node));
    match crate::launch::mount::mount_at(&mp) {
        Some(m) if m.fstype == "fuse.odfs" => {
            vec![format!("export ODFS_MOUNT={}", mp.display()), format!("export ODFS_JOB={job}")]
        }
        _ => Vec::new(),
    }
}
