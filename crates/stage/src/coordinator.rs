//! The coordinator of one stage-in or stage-out: lists the source, refuses unsafe names, skips
//! what a previous run completed, plans the work over every node's agent (whole files
//! balanced by bytes, large files split into ranges or multipart parts), drives the agents,
//! verifies what they report against the source, and writes the manifest (and, for
//! stage-out, the completion marker, last).
//!
//! Owns planning, cross-agent verification and manifests. Must not move file data itself:
//! the agents do, on their nodes.
//!
//! - this module: settings, the report, passes of work over the agents, and the odfs and S3
//!   helpers both directions use;
//! - `progress`: what a stage says while it lists and transfers;
//! - `stage_in`: list → skip what is done → plan → transfer → verify ranged files → manifest;
//! - `stage_out`: walk odfs → (S3: skip unchanged objects) → transfer → complete uploads →
//!   verify against the bucket → manifest → completion marker.

mod progress;
mod stage_in;
pub(crate) mod stage_out;

pub(crate) use progress::{ListingProgress, Progress};

pub use stage_in::stage_in;
pub use stage_out::stage_out;

use crate::config::DEFAULT_CONCURRENCY;
use crate::error::{invalid, During, Result, StageError};
use crate::keys::join;
use crate::s3::{self, S3};
use futures::{FutureExt, StreamExt};
use odfs_client::{Client, Ctx};
use odfs_proto::mgmt::ServiceKind;
use odfs_proto::stage::{
    ItemResult, S3Spec, StageAdd, StageCounters, StageEndpoint, StageLimits, StagePoll, StageStart, StageStatus,
    WorkItem,
};
use odfs_proto::{units, Timespec};
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tracing::{debug, warn};

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
    /// Turns true when the stage is to stop (the command got SIGINT or SIGTERM): a stage-in
    /// then records what it verified and ends with `StageError::Interrupted`.
    pub interrupted: Option<tokio::sync::watch::Receiver<bool>>,
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
            interrupted: None,
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
    /// Stage-in: the source named (bucket and prefix, or directory) held no file at all,
    /// which is almost always a wrong prefix; the source as given.
    pub empty_source: Option<String>,
}

impl StageReport {
    /// A warning to show beside the summary: a stage-in of a source with no file in it.
    pub fn warning(&self) -> Option<String> {
        self.empty_source.as_ref().map(|src| {
            format!("{src} holds no files: nothing was staged; check the bucket and the prefix (or the directory)")
        })
    }

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

/// What an item costs beside its bytes (a request, a create), in bytes, when the pool's share
/// is weighed.
const ITEM_COST: u64 = 64 << 10;
/// The pool holds back at most this fraction (1/n) of the balanced work.
const POOL_DIVISOR: u64 = 4;

/// An item's weight when the pool is filled and emptied: its bytes and `ITEM_COST`.
fn weight(it: &WorkItem) -> u64 {
    it.bytes() + ITEM_COST
}

/// Splits items into each of `n` agents' first share and a pool handed out as agents run low
/// (`run_pass`). Items `prefer` names an agent for go to it. Of the rest, the smallest, up to
/// a quarter of their weight, wait in the pool, largest first: enough to even out agents that
/// run at different speeds (a node busier than the others, a slower path to the store), small
/// enough that each agent starts with plenty; the others go largest first onto the
/// least-loaded agent (by bytes, then by count), so every agent starts with about the same
/// share.
fn split_work(
    items: &[WorkItem],
    n: usize,
    prefer: impl Fn(&WorkItem) -> Option<usize>,
) -> (Vec<Vec<usize>>, VecDeque<usize>) {
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
    let total: u64 = order.iter().map(|&i| weight(&items[i])).sum();
    let (mut pool, mut held) = (VecDeque::new(), 0u64);
    while let Some(&i) = order.last() {
        if (held + weight(&items[i])) * POOL_DIVISOR > total {
            break;
        }
        held += weight(&items[i]);
        pool.push_front(i);
        order.pop();
    }
    for i in order {
        let a = (0..n).min_by_key(|&a| load[a]).expect("at least one agent");
        load[a].0 += items[i].bytes();
        load[a].1 += 1;
        out[a].push(i);
    }
    (out, pool)
}

/// The next items from the pool for an agent running low: about 1/(2n) of what the pool holds
/// (guided self-scheduling: large batches while much is left, small ones at the end, so the
/// agents end together), at least one.
fn take_batch(pool: &mut VecDeque<usize>, items: &[WorkItem], n: usize) -> Vec<usize> {
    let left: u64 = pool.iter().map(|&i| weight(&items[i])).sum();
    let want = left / (2 * n as u64).max(1);
    let (mut batch, mut got) = (Vec::new(), 0u64);
    while let Some(i) = pool.pop_front() {
        got += weight(&items[i]);
        batch.push(i);
        if got >= want {
            break;
        }
    }
    batch
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

/// What a pass waits on (`run_pass`): an agent's poll answered, or more work (or the close)
/// handed to it.
enum Event {
    Polled { a: usize, asked: Instant, reply: odfs_client::Result<StageStatus> },
    Added { a: usize, add: Vec<usize>, last: bool, sent: odfs_client::Result<()> },
}

/// Runs `items` on the agents and returns each item's result (in order) and the counters of
/// every agent. Each agent starts with its share (`split_work`); the pool is handed out in
/// batches (`StageAdd`) to agents whose polls say they are running low, and when it is empty
/// every agent is told that nothing more comes.
pub(crate) async fn run_pass(
    p: &Pass<'_>,
    items: Vec<WorkItem>,
    progress: &mut Progress,
) -> Result<(Vec<ItemResult>, Vec<(u32, StageCounters)>)> {
    run_pass_noting(p, items, progress, &mut |_, _| {}, None).await
}

/// One agent's part of a pass, as the coordinator follows it.
#[derive(Default)]
struct Share {
    /// The pass's items handed to the agent, in the order it numbers them.
    plan: Vec<usize>,
    /// More items may be added (the run was started open and not closed yet).
    open: bool,
    /// A `StageAdd` or a `StagePoll` of the agent is in flight.
    adding: bool,
    polling: bool,
    /// The agent reported its share ended (or stopped answering for good).
    finished: bool,
    /// The agent's counters as last reported.
    counters: Option<StageCounters>,
    /// Since when its polls have failed.
    silent_since: Option<Instant>,
    /// How many of its results are held here (those reported before its share ends).
    have: u32,
}

/// [`run_pass`], telling `noted` of each item's result as its agent reports it (by the item's
/// index; a result an agent reports before its share ends is provisional, and is noted again
/// when the share ends), and giving up when `interrupted` turns true: the agents are told to
/// start no more of the pass's items (`StageCancel`), and the pass ends with
/// `StageError::Interrupted`.
pub(crate) async fn run_pass_noting(
    p: &Pass<'_>,
    items: Vec<WorkItem>,
    progress: &mut Progress,
    noted: &mut (dyn FnMut(usize, &ItemResult) + Send),
    mut interrupted: Option<tokio::sync::watch::Receiver<bool>>,
) -> Result<(Vec<ItemResult>, Vec<(u32, StageCounters)>)> {
    let n = p.agents.len();
    progress.set_items(items.len() as u64);
    let (plan, mut pool) = split_work(&items, n, |it| {
        let node = p.node_of.get(it.rel())?;
        p.agents.iter().position(|(k, _)| k == node)
    });
    let run: u64 = rand::random();
    let mut shares: Vec<Share> = plan.into_iter().map(|plan| Share { plan, ..Share::default() }).collect();
    let mut started = Vec::new();
    for (a, share) in shares.iter_mut().enumerate() {
        if share.plan.is_empty() && pool.is_empty() {
            continue;
        }
        share.open = !pool.is_empty();
        let req = StageStart {
            run,
            uid: p.ctx.uid,
            gid: p.ctx.gid,
            groups: p.ctx.groups.clone(),
            src: p.src.clone(),
            dst: p.dst.clone(),
            limits: p.limits,
            items: share.plan.iter().map(|&i| items[i].clone()).collect(),
            open: share.open,
        };
        let (node, addr) = p.agents[a];
        p.client
            .call(p.ctx, addr, &req)
            .await
            .during(|| format!("cannot hand work to the stage agent of node {node} ({addr})"))?;
        started.push(a);
    }
    // An agent is topped up while it still has this many items to finish, so it never runs dry.
    let low_water = 2 * if p.limits.concurrency == 0 { DEFAULT_CONCURRENCY } else { p.limits.concurrency };
    // An item counts as done only on its agent's word: one no agent reported on (never handed
    // out, or lost with its agent) has failed.
    let mut results: Vec<ItemResult> = (0..items.len())
        .map(|i| ItemResult {
            index: i as u32,
            error: Some("no stage agent reported a result for it".into()),
            ..ItemResult::default()
        })
        .collect();
    let mut failed: Vec<(usize, String)> = Vec::new();
    // Polls and adds run side by side, never one awaited while the others wait unpolled: a
    // call parked in a stream nobody polls must not be what another call waits for (a parked
    // connect once held the rpc pool's slot so, and the coordinator waited for ever).
    // An open agent's poll is also answered at its low water (for a batch); a closed one's
    // only at its end.
    let poll = |a: usize, after: Duration, open: bool, have: u32| {
        let low_water = if open { low_water } else { 0 };
        async move {
            tokio::time::sleep(after).await;
            let asked = Instant::now();
            let req = StagePoll { run, wait_ms: POLL_WAIT_MS, low_water, have };
            Event::Polled { a, asked, reply: p.client.call(p.ctx, p.agents[a].1, &req).await }
        }
        .boxed()
    };
    let add = |a: usize, batch: Vec<usize>, last: bool| {
        let req = StageAdd { run, items: batch.iter().map(|&i| items[i].clone()).collect(), last };
        async move { Event::Added { a, sent: p.client.call(p.ctx, p.agents[a].1, &req).await, add: batch, last } }
            .boxed()
    };
    // An unfinished agent has a poll or an add in flight, at most one of each: the poll that
    // asks for a batch goes again only once the batch is answered (so it sees the items
    // added); a close may cross an agent's poll.
    let mut calls = futures::stream::FuturesUnordered::new();
    for &a in &started {
        shares[a].polling = true;
        calls.push(poll(a, Duration::ZERO, shares[a].open, 0));
    }
    loop {
        let event = tokio::select! {
            e = calls.next() => match e {
                Some(e) => e,
                None => break,
            },
            _ = turns_true(&mut interrupted) => {
                cancel_run(p, run, &started).await;
                return Err(StageError::Interrupted("interrupted".into()));
            }
        };
        match event {
            Event::Polled { a, asked, reply } => {
                shares[a].polling = false;
                let node = p.agents[a].0;
                match reply {
                    Ok(st) => {
                        let share = &mut shares[a];
                        share.silent_since = None;
                        share.counters = Some(st.counters);
                        if st.finished {
                            for r in st.results {
                                if let Some(&global) = share.plan.get(r.index as usize) {
                                    results[global] = ItemResult { index: global as u32, ..r };
                                    noted(global, &results[global]);
                                }
                            }
                            share.finished = true;
                        } else {
                            // Provisional: an item of a batch whose add is not answered yet
                            // is asked for again, with those after it.
                            for r in st.results {
                                let Some(&global) = share.plan.get(r.index as usize) else { break };
                                noted(global, &ItemResult { index: global as u32, ..r });
                                share.have += 1;
                            }
                        }
                        if !st.finished
                            && share.open
                            && !share.adding
                            && st.counters.items_total.saturating_sub(st.counters.items_done) <= low_water as u64
                        {
                            // A batch for this agent; once the pool is empty, a close for every
                            // open agent with no add in flight (the others are closed when
                            // their add is answered).
                            let batch = take_batch(&mut pool, &items, n);
                            let last = pool.is_empty();
                            let to: Vec<usize> = if last {
                                (0..n).filter(|&b| shares[b].open && !shares[b].adding).collect()
                            } else {
                                vec![a]
                            };
                            for b in to {
                                shares[b].adding = true;
                                calls.push(add(b, if b == a { batch.clone() } else { Vec::new() }, last));
                            }
                        }
                    }
                    Err(e) => {
                        let share = &mut shares[a];
                        let since = *share.silent_since.get_or_insert_with(Instant::now);
                        if since.elapsed() > Duration::from_secs(30) {
                            let why = format!("the stage agent of node {node} stopped answering: {e}");
                            failed.extend(share.plan.iter().map(|&i| (i, why.clone())));
                            share.finished = true;
                        }
                    }
                }
                // An agent given a batch (or a close) is polled again when it is answered.
                let share = &mut shares[a];
                if !share.finished && !share.adding {
                    // A poll answered early without news (a failing agent, a close refused) is
                    // not repeated at once.
                    let early = asked.elapsed() < POLL_WAIT / 2;
                    let after = if early { POLL_WAIT.saturating_sub(asked.elapsed()) } else { Duration::ZERO };
                    share.polling = true;
                    calls.push(poll(a, after, share.open, share.have));
                }
            }
            Event::Added { a, add: batch, last, sent } => {
                let share = &mut shares[a];
                share.adding = false;
                let refused = sent.is_err();
                debug!(node = p.agents[a].0, items = batch.len(), last, ok = sent.is_ok(), "stage add answered");
                match sent {
                    Ok(()) => {
                        // Numbered by the agent in the order they arrive: one add in flight
                        // per agent keeps that order.
                        share.plan.extend(&batch);
                        share.open = !last;
                    }
                    // The items fail; a close that failed is sent again at the agent's next
                    // low-water poll (it stays open).
                    Err(e) => {
                        let why = format!("cannot hand more work to the stage agent of node {}: {e}", p.agents[a].0);
                        warn!("{why}");
                        failed.extend(batch.iter().map(|&i| (i, why.clone())));
                    }
                }
                if pool.is_empty() && share.open && !last {
                    // The pool ran out while this agent's batch was on its way.
                    share.adding = true;
                    calls.push(add(a, Vec::new(), true));
                } else if !share.finished && !share.polling {
                    // After a refusal, not at once: its poll would ask for the same again.
                    let after = if refused { POLL_WAIT } else { Duration::ZERO };
                    share.polling = true;
                    calls.push(poll(a, after, share.open, share.have));
                }
            }
        }
        let snapshot: Vec<(u32, StageCounters)> =
            started.iter().map(|&a| (p.agents[a].0, shares[a].counters.unwrap_or_default())).collect();
        progress.update(&snapshot);
    }
    for (i, why) in failed {
        results[i] = ItemResult { index: i as u32, error: Some(why), ..ItemResult::default() };
    }
    let per_agent =
        p.agents.iter().zip(&shares).map(|((node, _), share)| (*node, share.counters.unwrap_or_default())).collect();
    Ok((results, per_agent))
}

/// Resolves once `flag` is true; never without one (or once its sender is gone).
async fn turns_true(flag: &mut Option<tokio::sync::watch::Receiver<bool>>) {
    if let Some(rx) = flag {
        if rx.wait_for(|v| *v).await.is_ok() {
            return;
        }
    }
    futures::future::pending().await
}

/// Tells the agents given a share of the run to start no more of its items; each is asked
/// once, briefly: an agent that does not answer finishes its share on its own.
async fn cancel_run(p: &Pass<'_>, run: u64, started: &[usize]) {
    let asks = started.iter().map(|&a| {
        let (node, addr) = p.agents[a];
        async move {
            let req = odfs_proto::stage::StageCancel { run };
            match tokio::time::timeout(Duration::from_secs(2), p.client.call(p.ctx, addr, &req)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => warn!(node, error = %e, "cannot tell a stage agent the stage was interrupted"),
                Err(_) => warn!(node, "the stage agent did not answer the interruption within 2 s"),
            }
        }
    });
    futures::future::join_all(asks).await;
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

/// Writes `data` as the file at `path`, whole or not at all: into a temporary name beside it
/// (`manifest::writing_name`), synced, then renamed over it — a stage interrupted while it
/// writes its manifest leaves the last one whole.
pub(crate) async fn write_odfs_file(client: &Client, ctx: &Ctx, path: &str, data: &[u8]) -> Result<()> {
    let (parent, name) = client.resolve_parent(ctx, path).await?;
    let tmp = crate::manifest::writing_name(&name);
    let (r, h) = client.create_open(ctx, parent.ino, &tmp, 0o644, false, None).await?;
    if !r.created {
        h.truncate(0).await?;
    }
    h.write(0, data).await?;
    h.fsync().await?;
    h.close().await?;
    client.rename(ctx, parent.ino, &tmp, parent.ino, &name, 0).await?;
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
        let (plan, mut pool) = split_work(&items, 4, |_| None);
        // The first shares differ by no more than one item (the largest, a 16 MiB range).
        let loads: Vec<u64> = plan.iter().map(|idx| idx.iter().map(|&i| items[i].bytes()).sum()).collect();
        let (lo, hi) = (*loads.iter().min().unwrap(), *loads.iter().max().unwrap());
        assert!(lo > 0 && hi - lo <= 16 << 20, "{loads:?}");
        // The pool: the smallest items, about a quarter of the weight, handed out in batches
        // that shrink as it empties.
        let held: u64 = pool.iter().map(|&i| weight(&items[i])).sum();
        let all_weight: u64 = items.iter().map(weight).sum();
        assert!(held * 4 <= all_weight && held * 5 >= all_weight, "{held} of {all_weight}");
        let smallest_assigned = plan.iter().flatten().map(|&i| items[i].bytes()).min().unwrap();
        assert!(pool.iter().all(|&i| items[i].bytes() <= smallest_assigned));
        let mut batches = Vec::new();
        while !pool.is_empty() {
            batches.push(take_batch(&mut pool, &items, 4));
        }
        assert!(batches.len() > 4 && batches.iter().all(|b| !b.is_empty()), "{}", batches.len());
        assert!(batches.first().unwrap().len() > batches.last().unwrap().len());
        let mut all: Vec<usize> = plan.concat();
        all.extend(batches.concat());
        all.sort();
        assert_eq!(all, (0..items.len()).collect::<Vec<_>>(), "every item exactly once");
    }
}
