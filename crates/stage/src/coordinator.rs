//! The coordinator of one stage-in or stage-out: lists the source, refuses unsafe names, skips
//! what a previous run completed, plans the work over every node's agent (whole files
//! balanced by bytes, large files split into ranges or multipart parts), drives the agents,
//! verifies what they report against the source, and writes the manifest (and, for
//! stage-out, the completion marker, last).
//!
//! Owns planning, cross-agent verification and manifests. Must not move file data itself:
//! the agents do, on their nodes.
//!
//! - this module: settings, the report, passes of work over the agents, progress, and the
//!   odfs and S3 helpers both directions use;
//! - `stage_in`: list → skip what is done → plan → transfer → verify ranged files → manifest;
//! - `stage_out`: walk odfs → (S3: skip unchanged objects) → transfer → complete uploads →
//!   verify against the bucket → manifest → completion marker.

mod stage_in;
pub(crate) mod stage_out;

pub use stage_in::stage_in;
pub use stage_out::stage_out;

use crate::error::{invalid, During, Result};
use crate::keys::join;
use crate::s3::{self, S3};
use odfs_client::{Client, Ctx};
use odfs_proto::mgmt::ServiceKind;
use odfs_proto::stage::{
    ItemResult, S3Spec, StageCounters, StageEndpoint, StageLimits, StagePoll, StageStart, WorkItem,
};
use odfs_proto::{units, Timespec};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tracing::warn;

/// Settings of a stage; `Default` holds the documented defaults.
#[derive(Debug, Clone)]
pub struct StageOptions {
    pub endpoint_url: Option<String>,
    pub region: Option<String>,
    /// Path-style addressing (MinIO, Ceph RGW and most S3-compatible stores need it).
    pub path_style: bool,
    /// Transfers in flight per agent.
    pub concurrency: u32,
    /// Job-wide limits toward the shared store; 0 = none. Split evenly over the agents.
    pub max_requests_per_sec: f64,
    pub max_bandwidth: u64,
    /// Attempts per S3 request, first included.
    pub max_attempts: u32,
    /// Seconds an unreachable S3 endpoint is tried again before a request fails.
    pub unreachable_secs: u32,
    /// Files at least this large are split over agents (ranges in, multipart parts out).
    pub split_threshold: u64,
    /// Size of one range (stage-in) or multipart part (stage-out).
    pub part_size: u64,
    /// Report progress as plain lines (no terminal), every this often.
    pub log_every: Duration,
    /// A drain's share of each node's time while the job is busy (0 = none: stages).
    pub share: f64,
}

impl Default for StageOptions {
    fn default() -> Self {
        StageOptions {
            endpoint_url: None,
            region: None,
            path_style: false,
            concurrency: 16,
            max_requests_per_sec: 0.0,
            max_bandwidth: 0,
            max_attempts: 8,
            unreachable_secs: 60,
            split_threshold: 64 << 20,
            part_size: 16 << 20,
            log_every: Duration::from_secs(5),
            share: 0.0,
        }
    }
}

/// What a stage did.
#[derive(Debug, Default)]
pub struct StageReport {
    pub kind: &'static str,
    /// Files copied in this run (not counting skipped ones) and their bytes.
    pub files: u64,
    pub bytes: u64,
    /// Files found complete and correct from a previous run.
    pub skipped: u64,
    /// Stage-out: files a drain uploaded and verified while the job ran, unchanged since (not
    /// read or sent again); and drained files whose objects its `--keep` deleted.
    pub drained: u64,
    pub retired: u64,
    pub directories: u64,
    /// Counters per agent: (node, counters).
    pub agents: Vec<(u32, StageCounters)>,
    /// Files that could not be copied or verified, with the reason.
    pub failed: BTreeMap<String, String>,
    /// Source names refused as unsafe paths, with the reason.
    pub refused: BTreeMap<String, String>,
    pub manifest: String,
    pub elapsed: Duration,
    /// Stage-in with `--seal`: the inodes of the destination tree sealed after verification.
    pub sealed: Option<u64>,
    /// Stage-in: split files verified by the CRC32C stored returned for their writes, and split
    /// files read back to be verified (to check an MD5 ETag, or where the writes did not tell).
    pub split_verified_as_written: u64,
    pub split_read_back: u64,
}

impl StageReport {
    /// The one-paragraph summary printed at the end.
    pub fn summary(&self) -> String {
        let secs = self.elapsed.as_secs_f64().max(1e-6);
        let mut s = format!(
            "{}: {} files ({}) copied in {:.1} s ({:.0} MiB/s), {} already complete, {} directories; manifest {}",
            self.kind,
            self.files,
            units::bytes(self.bytes),
            secs,
            units::mib_per_sec(self.bytes, secs),
            self.skipped,
            self.directories,
            self.manifest
        );
        if self.drained + self.retired > 0 {
            s += &format!(
                "\n  drained while the job ran, unchanged since: {} files not sent again, {} retired by --keep",
                self.drained, self.retired
            );
        }
        let total: u64 = self.agents.iter().map(|(_, c)| c.bytes).sum();
        for (node, c) in &self.agents {
            let share = if total > 0 { 100.0 * c.bytes as f64 / total as f64 } else { 0.0 };
            s += &format!(
                "\n  node {node}: {} items, {} ({share:.0}%), {} errors, {} retries",
                c.items_done,
                units::bytes(c.bytes),
                c.errors,
                c.retries
            );
        }
        if self.split_verified_as_written + self.split_read_back > 0 {
            s += &format!(
                "\n  split files: {} verified as written (stored's CRC32C), {} read back",
                self.split_verified_as_written, self.split_read_back
            );
        }
        if let Some(n) = self.sealed {
            s += &format!("\n  sealed read-only: {n} files and directories (odfs unseal makes them writable)");
        }
        for (k, why) in &self.refused {
            s += &format!("\n  refused {k:?}: {why}");
        }
        for (k, why) in &self.failed {
            s += &format!("\n  FAILED {k}: {why}");
        }
        s
    }
}

/// A file of the source.
#[derive(Debug, Clone)]
pub(crate) struct SrcFile {
    pub rel: String,
    pub size: u64,
    pub mtime: Timespec,
    pub mode: Option<u32>,
    pub etag: Option<String>,
}

/// The stage agents of the filesystem, by node.
pub(crate) async fn agents(client: &Client) -> Result<Vec<(u32, SocketAddr)>> {
    let view = client.cluster().refresh().await?;
    let mut a: Vec<(u32, SocketAddr)> = view
        .services
        .iter()
        .filter(|s| s.kind == ServiceKind::Agent && s.online)
        .filter_map(|s| Some((s.node, s.addr?)))
        .collect();
    a.sort();
    if a.is_empty() {
        return invalid!("no stage agent is running in this filesystem (every node starts one with its daemons)");
    }
    Ok(a)
}

/// How long an agent holds a progress poll when its share is not done: the coordinator learns
/// of a share's end at once and of progress this often.
const POLL_WAIT_MS: u32 = 200;
const POLL_WAIT: Duration = Duration::from_millis(POLL_WAIT_MS as u64);

/// Splits items over `n` agents: those `prefer` names an agent for go to it; the rest largest
/// first onto the least-loaded agent (by bytes, then by count), so every agent moves about the
/// same share.
fn assign(items: &[WorkItem], n: usize, prefer: impl Fn(&WorkItem) -> Option<usize>) -> Vec<Vec<usize>> {
    let mut out = vec![Vec::new(); n];
    let mut load = vec![(0u64, 0usize); n];
    let mut order = Vec::new();
    for (i, it) in items.iter().enumerate() {
        match prefer(it).filter(|&a| a < n) {
            Some(a) => {
                load[a].0 += it.bytes();
                load[a].1 += 1;
                out[a].push(i);
            }
            None => order.push(i),
        }
    }
    order.sort_by_key(|&i| std::cmp::Reverse(items[i].bytes()));
    for i in order {
        let a = (0..n).min_by_key(|&a| load[a]).expect("at least one agent");
        load[a].0 += items[i].bytes();
        load[a].1 += 1;
        out[a].push(i);
    }
    out
}

/// Progress on a terminal (a bar), else a line every `every`.
pub(crate) struct Progress {
    bar: Option<indicatif::ProgressBar>,
    kind: &'static str,
    total: u64,
    last_log: Instant,
    every: Duration,
    start: Instant,
}

impl Progress {
    pub(crate) fn new(kind: &'static str, total: u64, every: Duration) -> Progress {
        use std::io::IsTerminal;
        let bar = std::io::stderr().is_terminal().then(|| {
            let b = indicatif::ProgressBar::new(total);
            b.set_style(
                indicatif::ProgressStyle::with_template(
                    "{prefix} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} ETA {eta} {msg}",
                )
                .expect("valid template")
                .progress_chars("=> "),
            );
            b.set_prefix(kind);
            b
        });
        Progress { bar, kind, total, last_log: Instant::now(), every, start: Instant::now() }
    }

    pub(crate) fn update(&mut self, per_agent: &[(u32, StageCounters)]) {
        let bytes: u64 = per_agent.iter().map(|(_, c)| c.bytes).sum();
        let done: u64 = per_agent.iter().map(|(_, c)| c.items_done).sum();
        let items: u64 = per_agent.iter().map(|(_, c)| c.items_total).sum();
        let shares: Vec<String> = per_agent
            .iter()
            .map(|(n, c)| format!("n{n}:{:.0}%", if bytes > 0 { 100.0 * c.bytes as f64 / bytes as f64 } else { 0.0 }))
            .collect();
        let msg = format!("{done}/{items} items {}", shares.join(" "));
        match &self.bar {
            Some(b) => {
                b.set_position(bytes);
                b.set_message(msg);
            }
            None if self.last_log.elapsed() >= self.every => {
                self.last_log = Instant::now();
                eprintln!(
                    "odfs {}: {} of {}, {msg}, {:.0} MiB/s",
                    self.kind,
                    units::bytes(bytes),
                    units::bytes(self.total),
                    units::mib_per_sec(bytes, self.start.elapsed().as_secs_f64())
                );
            }
            None => {}
        }
    }

    pub(crate) fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}

/// Everything one pass of work needs.
pub(crate) struct Pass<'a> {
    client: &'a Client,
    ctx: &'a Ctx,
    agents: &'a [(u32, SocketAddr)],
    src: &'a StageEndpoint,
    dst: &'a StageEndpoint,
    limits: StageLimits,
    /// The node whose agent must move a file's items (by relative path); empty: balanced.
    node_of: &'a HashMap<String, u32>,
}

/// Runs `items` on the agents and returns each item's result (in order) and the counters of
/// every agent.
pub(crate) async fn run_pass(
    p: &Pass<'_>,
    items: Vec<WorkItem>,
    progress: &mut Progress,
) -> Result<(Vec<ItemResult>, Vec<(u32, StageCounters)>)> {
    let n = p.agents.len();
    let plan = assign(&items, n, |it| {
        let node = p.node_of.get(it.rel())?;
        p.agents.iter().position(|(k, _)| k == node)
    });
    let run: u64 = rand::random();
    let mut started = Vec::new();
    for (a, idx) in plan.iter().enumerate() {
        if idx.is_empty() {
            continue;
        }
        let req = StageStart {
            run,
            uid: p.ctx.uid,
            gid: p.ctx.gid,
            groups: p.ctx.groups.clone(),
            src: p.src.clone(),
            dst: p.dst.clone(),
            limits: p.limits,
            items: idx.iter().map(|&i| items[i].clone()).collect(),
        };
        let (node, addr) = p.agents[a];
        p.client
            .call(p.ctx, addr, &req)
            .await
            .during(|| format!("cannot hand work to the stage agent of node {node} ({addr})"))?;
        started.push(a);
    }
    let mut results: Vec<ItemResult> = vec![ItemResult::default(); items.len()];
    let mut counters: HashMap<usize, StageCounters> = HashMap::new();
    let mut finished: BTreeSet<usize> = BTreeSet::new();
    let mut silent_since: HashMap<usize, Instant> = HashMap::new();
    while finished.len() < started.len() {
        let round = Instant::now();
        let waiting: Vec<usize> = started.iter().copied().filter(|a| !finished.contains(a)).collect();
        let polls = waiting.iter().map(|&a| {
            let addr = p.agents[a].1;
            async move { (a, p.client.call(p.ctx, addr, &StagePoll { run, wait_ms: POLL_WAIT_MS }).await) }
        });
        let mut ended = false;
        for (a, reply) in futures::future::join_all(polls).await {
            let node = p.agents[a].0;
            match reply {
                Ok(st) => {
                    silent_since.remove(&a);
                    counters.insert(a, st.counters);
                    if st.finished {
                        for r in st.results {
                            let global = plan[a][r.index as usize];
                            results[global] = ItemResult { index: global as u32, ..r };
                        }
                        finished.insert(a);
                        ended = true;
                    }
                }
                Err(e) => {
                    let since = *silent_since.entry(a).or_insert_with(Instant::now);
                    if since.elapsed() > Duration::from_secs(30) {
                        for &i in &plan[a] {
                            results[i] = ItemResult {
                                index: i as u32,
                                error: Some(format!("the stage agent of node {node} stopped answering: {e}")),
                                ..ItemResult::default()
                            };
                        }
                        finished.insert(a);
                    }
                }
            }
        }
        let snapshot: Vec<(u32, StageCounters)> =
            started.iter().map(|a| (p.agents[*a].0, counters.get(a).copied().unwrap_or_default())).collect();
        progress.update(&snapshot);
        // Polls answered at once (a failing agent) are not repeated sooner than a wait apart.
        if !ended {
            tokio::time::sleep(POLL_WAIT.saturating_sub(round.elapsed())).await;
        }
    }
    let per_agent = p
        .agents
        .iter()
        .enumerate()
        .map(|(a, (node, _))| (*node, counters.get(&a).copied().unwrap_or_default()))
        .collect();
    Ok((results, per_agent))
}

pub(crate) fn add_counters(into: &mut Vec<(u32, StageCounters)>, more: &[(u32, StageCounters)]) {
    for (node, c) in more {
        match into.iter_mut().find(|(n, _)| n == node) {
            Some((_, t)) => {
                t.items_total += c.items_total;
                t.items_done += c.items_done;
                t.bytes += c.bytes;
                t.errors += c.errors;
                t.retries += c.retries;
            }
            None => into.push((*node, *c)),
        }
    }
}

pub(crate) fn s3_spec(
    bucket: &str,
    prefix: &str,
    o: &StageOptions,
    creds: odfs_proto::stage::S3Credentials,
    region: String,
) -> S3Spec {
    S3Spec {
        bucket: bucket.to_string(),
        prefix: prefix.to_string(),
        endpoint_url: o.endpoint_url.clone(),
        region,
        path_style: o.path_style,
        credentials: Some(creds),
        max_attempts: o.max_attempts,
        unreachable_secs: o.unreachable_secs,
    }
}

pub(crate) async fn s3_for(bucket: &str, prefix: &str, o: &StageOptions) -> Result<S3> {
    let creds = s3::resolve_credentials(None).await?;
    let region = s3::resolve_region(o.region.clone()).await;
    let s3 = S3::new(&s3_spec(bucket, prefix, o, creds, region));
    s3.check_bucket().await?;
    Ok(s3)
}

pub(crate) fn limits(o: &StageOptions, agents: usize) -> StageLimits {
    StageLimits {
        concurrency: o.concurrency,
        requests_per_sec: o.max_requests_per_sec / agents as f64,
        bytes_per_sec: o.max_bandwidth / agents as u64,
        share: o.share,
    }
}

/// Reads a whole small odfs file, if it exists.
pub(crate) async fn read_odfs_file(client: &Client, ctx: &Ctx, path: &str) -> Result<Option<Vec<u8>>> {
    let a = match client.resolve(ctx, path, true).await {
        Ok(a) => a,
        Err(e) if e.code() == odfs_proto::ErrorCode::NotFound => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let h = client.open(ctx, a.ino, true, false, false).await?;
    let mut out = Vec::new();
    loop {
        let d = h.read(out.len() as u64, 1 << 20).await?;
        if d.is_empty() {
            break;
        }
        out.extend_from_slice(&d);
    }
    h.close().await?;
    Ok(Some(out))
}

pub(crate) async fn write_odfs_file(client: &Client, ctx: &Ctx, path: &str, data: &[u8]) -> Result<()> {
    let (parent, name) = client.resolve_parent(ctx, path).await?;
    let (r, h) = client.create_open(ctx, parent.ino, &name, 0o644, false, None).await?;
    if !r.created {
        h.truncate(0).await?;
    }
    h.write(0, data).await?;
    h.fsync().await?;
    h.close().await?;
    Ok(())
}

/// Makes every directory (parents first, one depth level at a time in parallel).
pub(crate) async fn make_dirs(client: &Client, ctx: &Ctx, root: &str, dirs: &BTreeSet<String>) -> Result<()> {
    let top = client.mkdir_all(ctx, root, 0o755).await.during(|| format!("cannot create odfs:{root}"))?;
    // A dataset's top directory is spread over every metadata shard, so its files and
    // subdirectories (and whatever reads them) are too. Only a new, empty one: an existing
    // directory keeps its layout.
    if client.cluster().view().meta_shards() > 1 && top.dir_stripes.is_empty() {
        // The shard refuses a directory that has entries already (NotEmpty): it stays as it is.
        match client.stripe_dir(ctx, top.ino, -1).await {
            Ok(_) => {}
            Err(e) if e.code() == odfs_proto::ErrorCode::NotEmpty => {}
            Err(e) => warn!(dir = root, error = %e, "cannot stripe the stage-in directory over the metadata shards"),
        }
    }
    let mut by_depth: BTreeMap<usize, Vec<&String>> = BTreeMap::new();
    for d in dirs {
        by_depth.entry(d.matches('/').count()).or_default().push(d);
    }
    for level in by_depth.values() {
        let results = futures::future::join_all(level.iter().map(|d| async move {
            let path = join(root, d);
            client.mkdir_all(ctx, &path, 0o755).await.during(|| format!("cannot create odfs:{path}"))
        }))
        .await;
        for r in results {
            r?;
        }
    }
    Ok(())
}

pub(crate) fn digests(data: &[u8]) -> ([u8; 16], u32) {
    let mut d = crate::digest::Digests::default();
    d.update(data);
    d.finish()
}

pub(crate) fn md5_of(data: &[u8]) -> [u8; 16] {
    digests(data).0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn assignment_balances_bytes_over_agents() {
        let mut items: Vec<WorkItem> = (0..1000)
            .map(|i| WorkItem::Whole {
                rel: format!("s{i}"),
                size: 1000 + (i * 7919 % 60_000),
                mtime: Timespec::now(),
                mode: None,
            })
            .collect();
        for (k, n) in [(0, 13), (1, 13), (2, 14)] {
            for j in 0..n {
                items.push(WorkItem::Range { rel: format!("big{k}"), offset: j * (16 << 20), len: 16 << 20 });
            }
        }
        let plan = assign(&items, 4, |_| None);
        let loads: Vec<u64> = plan.iter().map(|idx| idx.iter().map(|&i| items[i].bytes()).sum()).collect();
        let mean = loads.iter().sum::<u64>() as f64 / 4.0;
        for l in &loads {
            assert!((*l as f64 - mean).abs() / mean < 0.05, "{loads:?}");
        }
        let mut all: Vec<usize> = plan.concat();
        all.sort();
        assert_eq!(all, (0..items.len()).collect::<Vec<_>>(), "every item exactly once");
    }
}
