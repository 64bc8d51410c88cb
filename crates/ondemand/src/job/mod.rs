//! A job's filesystem on real nodes: `odfs start` and `odfs stop` (the Slurm prolog and
//! epilog, or any launcher that runs them on every node), `odfs recover` and `odfs cleanup`,
//! and the TaskProlog's `odfs task-env`.
//!
//! - `spec`, `hostlist`: which job, which nodes, which user, which features.
//! - `site`: the site config's `[ondemand]` table.
//! - `directives`: `#ODFS` lines of a batch script.
//! - `record`: what a node started for a job (`STATE_DIR/JOBID/`), and its teardown.
//! - `board`: the job board on node 0's mgmtd, through which the nodes agree.
//! - `start`, `stop`, `cleanup`: the protocols.
//! - `slurm`: the few Slurm commands used, and the message left in the job's output file.

pub mod board;
pub mod cleanup;
pub mod directives;
pub mod hostlist;
pub mod record;
pub mod site;
pub mod slurm;
pub mod spec;
pub mod start;
pub mod stop;

pub use site::SiteConfig;
pub use spec::{JobSpec, SpecArgs};
pub use start::{start, NodeContext, StartOutcome};
pub use stop::{recover, stop, StopOutcome};

/// `odfs task-env`: `export` lines for the job's tasks (Slurm's TaskProlog prints them into
/// the task environment): `ODFS_MOUNT`, `ODFS_JOB`. Nothing when the job has no odfs mount
/// on this node.
pub fn task_env(site: &SiteConfig, job: &str, user: &str, node: &str) -> Vec<String> {
    let mp = std::path::PathBuf::from(site::expand(&site.ondemand.mount, job, user, node));
    match crate::mount::mount_at(&mp) {
        Some(m) if m.fstype == "fuse.odfs" => {
            vec![format!("export ODFS_MOUNT={}", mp.display()), format!("export ODFS_JOB={job}")]
        }
        _ => Vec::new(),
    }
}
