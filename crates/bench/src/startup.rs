//! `odfs bench --startup`: how long a job waits for its filesystem, and for its teardown — the
//! prolog's part (`odfs start` on every node, until the last returns: every node's daemons up
//! and its mount ready, node 0's wait for all of them done) and the epilog's (`odfs stop` on
//! every node until the last returns: unmounted, stopped, wiped). Staging is excluded: the
//! job has no `#ODFS` lines. Nodes are loopback addresses (127.0.0.k) with directories of
//! their own, and every node's command is a separate process started at the same moment, as
//! pdsh (or slurmd) starts them. Needs root (it mounts).

use anyhow::{bail, Context, Result};
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

#[derive(Debug, Clone)]
pub struct StartupBenchOptions {
    pub root: PathBuf,
    pub nodes: u32,
    pub rounds: u32,
    pub keep: bool,
}

impl Default for StartupBenchOptions {
    fn default() -> Self {
        StartupBenchOptions { root: PathBuf::from("odfs-bench"), nodes: 4, rounds: 10, keep: false }
    }
}

/// Seconds of one round: (start, stop).
pub type Round = (f64, f64);

/// Runs `odfs ARGS --node-index k` on every node at once; the seconds until the last returns.
fn everywhere(site: &std::path::Path, nodes: u32, args: &[&str]) -> Result<f64> {
    let exe = std::env::current_exe().context("cannot find this executable")?;
    let t = Instant::now();
    let children: Vec<_> = (0..nodes)
        .map(|k| {
            let mut c = Command::new(&exe);
            c.args(args)
                .args(["--node-index", &k.to_string()])
                .env("ODFS_SITE_CONFIG", site)
                .env_remove("SLURM_JOB_ID");
            std::thread::spawn(move || c.output())
        })
        .collect();
    for (k, c) in children.into_iter().enumerate() {
        let out = c.join().map_err(|_| anyhow::anyhow!("node {k}: thread panicked"))??;
        if !out.status.success() {
            bail!("odfs {} on node {k} failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
        }
    }
    Ok(t.elapsed().as_secs_f64())
}

pub fn run(o: &StartupBenchOptions) -> Result<Vec<Round>> {
    // SAFETY: geteuid has no preconditions.
    anyhow::ensure!(unsafe { libc::geteuid() } == 0, "odfs bench --startup mounts filesystems: run it as root");
    anyhow::ensure!((1..=250).contains(&o.nodes), "--nodes must be 1 to 250");
    let root = o.root.join("startup");
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).with_context(|| format!("cannot create {}", root.display()))?;
    let root = root.canonicalize()?;
    let key = root.join("site.key");
    odfs_rpc::SiteKey::generate().write_new(&key)?;
    let d = root.display();
    let site = root.join("site.toml");
    std::fs::write(
        &site,
        format!(
            "[ondemand]\nsite_key = \"{}\"\ndata_paths = [\"{d}/%n/nvme\"]\nstate_dir = \"{d}/%n/state\"\nmount = \"{d}/%n/mnt/%j\"\n",
            key.display()
        ),
    )?;
    let nodes: Vec<String> = (1..=o.nodes).map(|k| format!("127.0.0.{k}")).collect();
    let list = nodes.join(",");
    let mut rounds = Vec::new();
    for r in 0..o.rounds {
        let job = format!("bench{r}");
        let start = everywhere(&site, o.nodes, &["start", "--job-id", &job, "--nodes", &list])?;
        let stop = everywhere(&site, o.nodes, &["stop", "--job-id", &job, "--nodes", &list])?;
        println!("round {r}: start {start:.2} s, stop {stop:.2} s");
        rounds.push((start, stop));
    }
    if !o.keep {
        let _ = std::fs::remove_dir_all(&root);
    }
    Ok(rounds)
}

fn stats(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[0], v[v.len() / 2], v[v.len() - 1])
}

pub fn render(nodes: u32, rounds: &[Round]) -> String {
    if rounds.is_empty() {
        return String::new();
    }
    let mut s =
        String::from("| phase | nodes | rounds | min s | median s | max s | aim s |\n|---|---|---|---|---|---|---|\n");
    for (name, v) in [
        ("start (prolog): every node up and mounted", rounds.iter().map(|r| r.0).collect::<Vec<_>>()),
        ("stop (epilog): every node unmounted, stopped, wiped", rounds.iter().map(|r| r.1).collect()),
    ] {
        let (lo, mid, hi) = stats(v);
        s += &format!("| {name} | {nodes} | {} | {lo:.2} | {mid:.2} | {hi:.2} | 2 |\n", rounds.len());
    }
    s
}
