//! Which job a node-local command serves: its id, its nodes, this node's place among them, the
//! job's user and the odfs features it asked for. Read from the Slurm prolog/epilog
//! environment, or given as flags by any other launcher (pdsh, clush, srun, by hand).

use crate::hostlist;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// The job's user, whose filesystem it is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobUser {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups (from the group database).
    pub groups: Vec<u32>,
}

impl JobUser {
    /// Looks a user up by name.
    pub fn by_name(name: &str) -> Result<JobUser> {
        let u = nix::unistd::User::from_name(name)
            .with_context(|| format!("cannot look up user {name:?}"))?
            .with_context(|| format!("no user {name:?} on this node"))?;
        Ok(JobUser::from_entry(u))
    }

    /// Looks a user up by uid.
    pub fn by_uid(uid: u32) -> Result<JobUser> {
        let u = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid))
            .with_context(|| format!("cannot look up uid {uid}"))?
            .with_context(|| format!("no user with uid {uid} on this node"))?;
        Ok(JobUser::from_entry(u))
    }

    fn from_entry(u: nix::unistd::User) -> JobUser {
        let name = std::ffi::CString::new(u.name.as_bytes()).unwrap_or_default();
        let groups = nix::unistd::getgrouplist(&name, u.gid)
            .map(|g| g.into_iter().map(|g| g.as_raw()).collect())
            .unwrap_or_else(|_| vec![u.gid.as_raw()]);
        JobUser { name: u.name, uid: u.uid.as_raw(), gid: u.gid.as_raw(), groups }
    }

    pub fn ctx(&self) -> odfs_client::Ctx {
        odfs_client::Ctx { uid: self.uid, gid: self.gid, groups: self.groups.clone() }
    }
}

/// The feature names a Slurm constraint expression mentions: `odfs`, `odfs|x`, `odfs&gpu`,
/// `[odfs*2&big]`, `(a|b)&c`, `a,b`. Counts (`*2`) and operators are dropped.
pub fn constraint_features(expr: &str) -> Vec<String> {
    expr.split(|c: char| "&|,()[]!".contains(c) || c.is_whitespace())
        .map(|t| t.split('*').next().unwrap_or("").trim())
        .filter(|t| !t.is_empty())
        .map(str::to_string)
        .collect()
}

/// A job as one node sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobSpec {
    pub job_id: String,
    /// Every node of the job; node 0 (the first) runs mgmtd and metad.
    pub nodes: Vec<String>,
    /// This node's index in `nodes`.
    pub index: u32,
    pub user: JobUser,
    /// Feature names the job asked for (from its constraints, or `--features`).
    pub features: Vec<String>,
    /// The job's standard output file (Slurm's pattern expanded), where messages for the user go.
    pub stdout: Option<PathBuf>,
    /// True when the job comes from a Slurm prolog or epilog environment.
    pub slurm: bool,
}

impl JobSpec {
    pub fn node_name(&self) -> &str {
        &self.nodes[self.index as usize]
    }

    pub fn is_node0(&self) -> bool {
        self.index == 0
    }

    pub fn has_feature(&self, f: &str) -> bool {
        self.features.iter().any(|x| x == f)
    }

    /// `what@node` for messages: "n3 (node 2 of 4)".
    pub fn where_(&self) -> String {
        self.where_of(self.index)
    }

    /// Node `k` of the job as messages name it: "n3 (node 2 of 4)".
    pub fn where_of(&self, k: u32) -> String {
        format!("{} (node {k} of {})", self.nodes[k as usize], self.nodes.len())
    }
}

/// What the command line says about the job; unset fields come from Slurm's environment.
#[derive(Debug, Clone, Default)]
pub struct SpecArgs {
    pub job_id: Option<String>,
    /// Comma-separated names or a Slurm host list.
    pub nodes: Option<String>,
    /// File with one node name per line (`#` comments), like BeeOND's node file.
    pub nodefile: Option<PathBuf>,
    pub node_index: Option<u32>,
    pub user: Option<String>,
    /// Extra features, comma separated (e.g. `odfs_ram`).
    pub features: Option<String>,
}

/// Expands Slurm's `--output` pattern for messages written before (or instead of) the job.
/// Handles `%j`/`%J`/`%A` (job id), `%u` (user), `%N` (node 0), `%n`/`%t` (0) and `%%`; other
/// patterns are left as they are. A relative path is taken from `workdir`.
pub fn expand_stdout(pattern: &str, job_id: &str, user: &str, node0: &str, workdir: Option<&str>) -> PathBuf {
    let mut out = String::new();
    let mut it = pattern.chars().peekable();
    while let Some(c) = it.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        // Slurm allows a zero-padding width between % and the letter (%4j); it is dropped here.
        while it.peek().is_some_and(|d| d.is_ascii_digit()) {
            it.next();
        }
        match it.next() {
            Some('j' | 'J' | 'A') => out.push_str(job_id),
            Some('u') => out.push_str(user),
            Some('N') => out.push_str(node0),
            Some('n' | 't') => out.push('0'),
            Some('%') => out.push('%'),
            Some(o) => {
                out.push('%');
                out.push(o);
            }
            None => out.push('%'),
        }
    }
    let p = PathBuf::from(out);
    match workdir {
        Some(w) if p.is_relative() => PathBuf::from(w).join(p),
        _ => p,
    }
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// The job from flags, then Slurm's environment (`SLURM_JOB_ID`, `SLURM_NODELIST`,
/// `SLURMD_NODENAME`, `SLURM_JOB_UID`/`GID`/`USER`, `SLURM_JOB_CONSTRAINTS`,
/// `SLURM_JOB_STDOUT`), then this machine (hostname, the calling user).
pub fn resolve(a: &SpecArgs) -> Result<JobSpec> {
    let slurm = env("SLURM_JOB_ID").is_some();
    let job_id = a
        .job_id
        .clone()
        .or_else(|| env("SLURM_JOB_ID"))
        .context("which job? pass --job-id ID (or run from a Slurm prolog/epilog, which sets SLURM_JOB_ID)")?;
    if job_id.is_empty()
        || job_id.len() > 64
        || !job_id.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        || job_id.starts_with('.')
    {
        bail!("job id {job_id:?} must be 1-64 letters, digits, '-', '_' or '.'");
    }
    let nodes = if let Some(f) = &a.nodefile {
        let text = std::fs::read_to_string(f).with_context(|| format!("cannot read node file {}", f.display()))?;
        let v: Vec<String> = text
            .lines()
            .map(|l| l.split('#').next().unwrap_or("").trim().to_string())
            .filter(|l| !l.is_empty())
            .collect();
        anyhow::ensure!(!v.is_empty(), "node file {} names no node", f.display());
        v
    } else {
        let list = a.nodes.clone().or_else(|| env("SLURM_NODELIST")).or_else(|| env("SLURM_JOB_NODELIST")).context(
            "which nodes? pass --nodes LIST or --nodefile FILE (or run from a Slurm prolog/epilog, which sets SLURM_NODELIST)",
        )?;
        hostlist::expand(&list).map_err(anyhow::Error::msg)?
    };
    for (i, n) in nodes.iter().enumerate() {
        if nodes[..i].contains(n) {
            bail!("node {n} is listed twice");
        }
    }
    let index = match a.node_index {
        Some(k) => {
            anyhow::ensure!((k as usize) < nodes.len(), "--node-index {k} is beyond the {} nodes listed", nodes.len());
            k
        }
        None => {
            let me = env("SLURMD_NODENAME").unwrap_or_else(odfs_service::hostname);
            let short = me.split('.').next().unwrap_or(&me).to_string();
            nodes
                .iter()
                .position(|n| *n == me || *n == short)
                .with_context(|| format!("this node ({me}) is not in the node list {nodes:?}; pass --node-index K"))?
                as u32
        }
    };
    let user = match (&a.user, env("SLURM_JOB_UID")) {
        (Some(name), _) => JobUser::by_name(name)?,
        (None, Some(uid)) => {
            let uid: u32 = uid.parse().with_context(|| format!("SLURM_JOB_UID={uid:?} is not a number"))?;
            let mut u = JobUser::by_uid(uid)?;
            if let Some(gid) = env("SLURM_JOB_GID").and_then(|g| g.parse().ok()) {
                u.gid = gid;
            }
            u
        }
        // SAFETY: geteuid has no preconditions.
        (None, None) => JobUser::by_uid(unsafe { libc::geteuid() })?,
    };
    let mut features = env("SLURM_JOB_CONSTRAINTS").map(|c| constraint_features(&c)).unwrap_or_default();
    if let Some(f) = &a.features {
        features.extend(f.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()));
    }
    let stdout = env("SLURM_JOB_STDOUT")
        .map(|p| expand_stdout(&p, &job_id, &user.name, &nodes[0], env("SLURM_JOB_WORK_DIR").as_deref()));
    Ok(JobSpec { job_id, nodes, index, user, features, stdout, slurm })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constraint_expressions_name_their_features() {
        assert_eq!(constraint_features("odfs"), ["odfs"]);
        assert_eq!(constraint_features("odfs|other"), ["odfs", "other"]);
        assert_eq!(constraint_features("odfs&gpu"), ["odfs", "gpu"]);
        assert_eq!(constraint_features("[odfs*2&big*2]"), ["odfs", "big"]);
        assert_eq!(constraint_features("(odfs_ram|x)&y,z"), ["odfs_ram", "x", "y", "z"]);
        assert!(constraint_features("").is_empty());
        assert!(!constraint_features("odfsx").contains(&"odfs".to_string()));
    }

    #[test]
    fn stdout_patterns_expand() {
        let p = expand_stdout("/out/%j-%u.%N.%%.%x.out", "42", "ana", "n1", None);
        assert_eq!(p, PathBuf::from("/out/42-ana.n1.%.%x.out"));
        assert_eq!(
            expand_stdout("slurm-%4j.out", "7", "u", "n1", Some("/home/u")),
            PathBuf::from("/home/u/slurm-7.out")
        );
    }
}
