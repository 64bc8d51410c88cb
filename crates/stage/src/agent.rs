//! The stage agent (`odfs-agent`): one per node, registered with mgmtd. It takes its share of
//! a stage from the coordinator (`StageStart`), moves it between the shared store (S3 or the
//! PFS) and odfs through the client library — straight to the storage targets, no FUSE — and
//! reports progress and per-item results (`StagePoll`).
//!
//! Owns: runs and their counters, item execution, limits. Must not decide what to move: the
//! coordinator plans, verifies across agents and writes manifests.

use crate::config::AgentConfig;
use crate::digest::Digests;
use crate::keys::{check_relative, join};
use crate::limit::{gated, Limits, NodeLoad, Share};
use crate::posix;
use crate::s3::{b64, is_md5_etag, multipart_etag, S3};
use bytes::Bytes;
use futures::channel::mpsc;
use futures::StreamExt;
use odfs_client::{Client, ClientConfig, Ctx, FileHandle};
use odfs_proto::meta::{SetAttr, SetTime};
use odfs_proto::mgmt::ServiceKind;
use odfs_proto::stage::{
    DrainList, DrainStart, DrainStop, ItemResult, StageAdd, StageCancel, StageCounters, StageEndpoint, StageLimits,
    StagePoll, StageStart, StageStatus, WorkItem,
};
use odfs_proto::{ErrorCode, RemoteError, Timespec};
use odfs_rpc::quic::QuicEndpoint;
use odfs_rpc::{Router, Shutdown};
use odfs_service::{announce, Daemon};
use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::OnceCell;
use tracing::{info, warn};

/// Bytes read or written per call.
const BLOCK: usize = 1 << 20;
/// Attempts of one item (each S3 request also has the SDK's own retries).
const ITEM_ATTEMPTS: u32 = 3;
/// How long one step of an item (an open, a block's read or write, a close) may wait before the
/// agent's log says where it waits.
const STUCK_AFTER: Duration = Duration::from_secs(60);

/// Awaits `fut`, one step of an item on `path`. A step still waiting after `STUCK_AFTER` is
/// logged, and again when it ends: a stage that stalls says where (the steps have no deadline
/// of their own: each request under them has its own, and the limits may rightly wait long).
async fn step<T>(what: &'static str, path: &str, fut: impl std::future::Future<Output = T>) -> T {
    tokio::pin!(fut);
    if let Ok(v) = tokio::time::timeout(STUCK_AFTER, &mut fut).await {
        return v;
    }
    warn!(path, step = what, waited_s = STUCK_AFTER.as_secs(), "a stage item is still waiting");
    let started = tokio::time::Instant::now() - STUCK_AFTER;
    let v = fut.await;
    info!(path, step = what, waited_s = started.elapsed().as_secs(), "the stage item waited and went on");
    v
}

/// One run on this agent.
#[derive(Default)]
struct Run {
    items_total: AtomicU64,
    items_done: AtomicU64,
    bytes: AtomicU64,
    errors: AtomicU64,
    retries: AtomicU64,
    finished: AtomicBool,
    /// The caller gave up on the run (`StageCancel`, a later run into the same odfs
    /// directory, or no poll for `ABANDONED_AFTER`): items not started fail.
    cancelled: AtomicBool,
    /// When the caller last asked about the run (`StagePoll`, `StageAdd`).
    last_heard: Mutex<Option<std::time::Instant>>,
    /// The odfs directory a stage-in run writes into.
    into_odfs: Option<String>,
    /// Earlier runs into the same directory, cancelled by this one, whose items in flight it
    /// waits for before it starts its own.
    superseded: Mutex<Vec<Arc<Run>>>,
    /// Wakes the polls waiting on the run: an item done, the run finished.
    changed: tokio::sync::Notify,
    /// Where a `StageAdd` puts more items while the run is open (`StageStart::open`).
    more: Mutex<Option<mpsc::UnboundedSender<WorkItem>>>,
    results: Mutex<Vec<ItemResult>>,
}

impl Run {
    /// Items not started fail from now on; nothing more is added.
    fn cancel(&self) {
        self.cancelled.store(true, Ordering::Release);
        self.more.lock().expect("more lock").take();
    }

    fn heard(&self) {
        *self.last_heard.lock().expect("last heard lock") = Some(std::time::Instant::now());
    }

    /// Waits until the run has finished (its items in flight ended).
    async fn ended(&self) {
        self.wait_until(|r| r.finished.load(Ordering::Acquire), None).await;
    }

    /// Waits until `ready` holds of the run, looked at after each change, or `deadline` passes.
    async fn wait_until(&self, ready: impl Fn(&Run) -> bool, deadline: Option<tokio::time::Instant>) {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            // Registered before the check, so a change in between is not missed.
            changed.as_mut().enable();
            if ready(self) {
                return;
            }
            match deadline {
                Some(d) => {
                    if tokio::time::timeout_at(d, changed).await.is_err() {
                        return;
                    }
                }
                None => changed.await,
            }
        }
    }

    /// Marks the run finished (its results recorded) and answers the polls waiting on it.
    fn finish(&self) {
        self.more.lock().expect("more lock").take();
        self.finished.store(true, Ordering::Release);
        self.changed.notify_waiters();
    }

    /// Whether a poll is answered now: the run finished, or it is open and has no more than
    /// `low_water` items left to finish (0: never).
    fn answer_now(&self, low_water: u32) -> bool {
        if self.finished.load(Ordering::Acquire) {
            return true;
        }
        let left = self.items_total.load(Ordering::Relaxed).saturating_sub(self.items_done.load(Ordering::Relaxed));
        low_water > 0 && left <= low_water as u64 && self.more.lock().expect("more lock").is_some()
    }

    /// Waits up to `wait` for a reason to answer a poll (`answer_now`).
    async fn wait_for_news(&self, wait: Duration, low_water: u32) {
        let deadline = tokio::time::Instant::now() + wait;
        self.wait_until(|r| r.answer_now(low_water), Some(deadline)).await;
    }

    fn counters(&self) -> StageCounters {
        StageCounters {
            items_total: self.items_total.load(Ordering::Relaxed),
            items_done: self.items_done.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
            retries: self.retries.load(Ordering::Relaxed),
        }
    }
}

pub struct Agent {
    cfg: AgentConfig,
    client: OnceCell<Client>,
    runs: Mutex<BTreeMap<u64, Arc<Run>>>,
    order: Mutex<VecDeque<u64>>,
    drains: crate::drain::Drains,
    /// The node's share gate for drain transfers, made with the first drain run.
    share: OnceCell<Arc<Share>>,
}

/// What every item of one run needs.
struct Env {
    client: Client,
    ctx: Ctx,
    src: StageEndpoint,
    dst: StageEndpoint,
    src_s3: Option<S3>,
    dst_s3: Option<S3>,
    limits: Limits,
    run: Arc<Run>,
}

type ItemResultOr = Result<ItemResult, String>;

impl Agent {
    pub fn new(cfg: AgentConfig) -> Arc<Agent> {
        Arc::new(Agent {
            cfg,
            client: OnceCell::new(),
            runs: Mutex::default(),
            order: Mutex::default(),
            drains: Default::default(),
            share: OnceCell::new(),
        })
    }

    async fn client(&self) -> Result<Client, String> {
        self.client
            .get_or_try_init(|| async {
                let cfg = ClientConfig {
                    job: self.cfg.job.clone(),
                    mgmtd: self.cfg.mgmtd,
                    node: self.cfg.node,
                    ..ClientConfig::default()
                };
                Client::connect(cfg).await
            })
            .await
            .cloned()
            .map_err(|e| format!("agent on node {} cannot reach the filesystem: {e}", self.cfg.node))
    }

    /// The gate of drain runs (those with a share): one per agent, watching this node's
    /// CPUs and the disks under its targets.
    async fn share_gate(&self, limits: &StageLimits, client: &Client) -> Option<Arc<Share>> {
        if !gated(limits.share) {
            return None;
        }
        let gate =
            self.share.get_or_init(|| async { Share::new(Box::new(NodeLoad::new(&client.local_target_dirs()))) }).await;
        Some(gate.clone())
    }

    pub fn router(self: &Arc<Self>) -> Router {
        let mut r = Router::new();
        let a = self.clone();
        r.add(move |_h, req: StageStart| {
            let a = a.clone();
            async move { a.start(req) }
        });
        let a = self.clone();
        r.add(move |_h, req: StageAdd| {
            let a = a.clone();
            async move { a.add(req) }
        });
        let a = self.clone();
        r.add(move |_h, req: StagePoll| {
            let a = a.clone();
            async move { a.poll(&req).await }
        });
        let a = self.clone();
        r.add(move |_h, req: StageCancel| {
            let a = a.clone();
            async move { a.cancel(&req) }
        });
        let a = self.clone();
        r.add(move |_h, req: DrainStart| {
            let a = a.clone();
            async move {
                let client = a.client().await.map_err(|e| RemoteError::new(ErrorCode::Unavailable, e))?;
                a.drains.start(client, req).await
            }
        });
        let a = self.clone();
        r.add(move |_h, req: DrainStop| {
            let a = a.clone();
            async move { Ok(a.drains.stop(req.src.as_deref())) }
        });
        let a = self.clone();
        r.add(move |_h, _req: DrainList| {
            let a = a.clone();
            async move { Ok(a.drains.list()) }
        });
        r
    }

    fn start(self: &Arc<Self>, req: StageStart) -> Result<(), RemoteError> {
        for it in &req.items {
            check_relative(it.rel()).map_err(|e| {
                RemoteError::new(ErrorCode::Invalid, format!("unsafe path {:?} in stage work: {e}", it.rel()))
            })?;
        }
        let into_odfs = match &req.dst {
            StageEndpoint::Odfs(root) => Some(root.clone()),
            _ => None,
        };
        let run = Arc::new(Run { into_odfs, ..Run::default() });
        run.heard();
        run.items_total.store(req.items.len() as u64, Ordering::Relaxed);
        let more = req.open.then(|| {
            let (tx, rx) = mpsc::unbounded();
            *run.more.lock().expect("more lock") = Some(tx);
            rx
        });
        {
            let mut runs = self.runs.lock().expect("runs lock");
            if runs.contains_key(&req.run) {
                return Err(RemoteError::new(ErrorCode::Exists, format!("stage run {} already started", req.run)));
            }
            // A stage-in into the same directory that still runs was given up by its caller
            // (killed, then run again): it starts no more items, and this run waits for those
            // in flight, so no file is written by both.
            let superseded: Vec<Arc<Run>> = runs
                .values()
                .filter(|r| run.into_odfs.is_some() && r.into_odfs == run.into_odfs)
                .filter(|r| !r.finished.load(Ordering::Acquire))
                .cloned()
                .collect();
            for old in &superseded {
                info!(
                    run = req.run,
                    dst = run.into_odfs.as_deref(),
                    "an earlier stage-in into the same directory is cancelled"
                );
                old.cancel();
            }
            *run.superseded.lock().expect("superseded lock") = superseded;
            runs.insert(req.run, run.clone());
            let mut order = self.order.lock().expect("order lock");
            order.push_back(req.run);
            while order.len() > self.cfg.keep_runs {
                if let Some(old) = order.pop_front() {
                    runs.remove(&old);
                }
            }
        }
        info!(run = req.run, items = req.items.len(), "stage share started");
        tokio::spawn(self.clone().execute(run, req, more));
        Ok(())
    }

    /// More items for an open run, numbered after those it has.
    fn add(&self, req: StageAdd) -> Result<(), RemoteError> {
        for it in &req.items {
            check_relative(it.rel()).map_err(|e| {
                RemoteError::new(ErrorCode::Invalid, format!("unsafe path {:?} in stage work: {e}", it.rel()))
            })?;
        }
        let run = self.run(req.run)?;
        run.heard();
        let mut more = run.more.lock().expect("more lock");
        if more.is_none() && req.items.is_empty() && req.last {
            // Closed already (a close sent again after its answer was lost): nothing to do.
            return Ok(());
        }
        let closed = || RemoteError::new(ErrorCode::Invalid, format!("stage run {} takes no more items", req.run));
        let tx = more.as_ref().ok_or_else(closed)?;
        let count = req.items.len() as u64;
        for it in req.items {
            // The run's executor holds the receiver until the sender goes (`last`, or its end).
            tx.unbounded_send(it).map_err(|_| closed())?;
        }
        run.items_total.fetch_add(count, Ordering::Relaxed);
        if req.last {
            more.take();
        }
        drop(more);
        run.changed.notify_waiters();
        Ok(())
    }

    async fn poll(&self, req: &StagePoll) -> Result<StageStatus, RemoteError> {
        let run = self.run(req.run)?;
        run.heard();
        let wait = req.wait_ms.min(odfs_proto::stage::MAX_POLL_WAIT_MS);
        if wait > 0 {
            run.wait_for_news(Duration::from_millis(wait.into()), req.low_water).await;
        }
        let finished = run.finished.load(Ordering::Acquire);
        let results = {
            let all = run.results.lock().expect("results lock");
            let from = if finished { 0 } else { (req.have as usize).min(all.len()) };
            all[from..].to_vec()
        };
        Ok(StageStatus { counters: run.counters(), finished, results })
    }

    /// `StageCancel`: no more items of the run start; it finishes once those in flight end.
    /// A run this agent no longer knows has nothing left to stop.
    fn cancel(&self, req: &StageCancel) -> Result<(), RemoteError> {
        if let Ok(run) = self.run(req.run) {
            info!(run = req.run, "stage run cancelled by its caller");
            run.cancel();
        }
        Ok(())
    }

    /// The run `id` of this agent.
    fn run(&self, id: u64) -> Result<Arc<Run>, RemoteError> {
        let run = self.runs.lock().expect("runs lock").get(&id).cloned();
        run.ok_or_else(|| RemoteError::new(ErrorCode::NotFound, format!("no stage run {id} on this agent")))
    }

    async fn execute(self: Arc<Self>, run: Arc<Run>, req: StageStart, more: Option<mpsc::UnboundedReceiver<WorkItem>>) {
        let items = req.items.clone();
        let fail_all = |msg: String| {
            // Closed first: every item added so far is counted, and any later add is refused.
            run.more.lock().expect("more lock").take();
            let n = run.items_total.load(Ordering::Relaxed);
            let mut r = run.results.lock().expect("results lock");
            for i in 0..n {
                r.push(ItemResult { index: i as u32, error: Some(msg.clone()), ..ItemResult::default() });
            }
            run.errors.store(n, Ordering::Relaxed);
            run.finish();
        };
        let earlier = std::mem::take(&mut *run.superseded.lock().expect("superseded lock"));
        for old in earlier {
            old.ended().await;
        }
        tokio::spawn(watch_caller(run.clone(), req.run));
        let client = match self.client().await {
            Ok(c) => c,
            Err(e) => return fail_all(e),
        };
        let s3_of = |e: &StageEndpoint| match e {
            StageEndpoint::S3(spec) => Some(S3::new(spec)),
            _ => None,
        };
        let concurrency = if req.limits.concurrency == 0 { self.cfg.concurrency } else { req.limits.concurrency };
        let share = self.share_gate(&req.limits, &client).await;
        let env = Arc::new(Env {
            client,
            ctx: Ctx { uid: req.uid, gid: req.gid, groups: req.groups.clone() },
            src_s3: s3_of(&req.src),
            dst_s3: s3_of(&req.dst),
            src: req.src,
            dst: req.dst,
            limits: Limits::new(&req.limits, share),
            run: run.clone(),
        });
        let added = match more {
            Some(rx) => rx.boxed(),
            None => futures::stream::empty().boxed(),
        };
        let mut results = futures::stream::iter(items)
            .chain(added)
            .enumerate()
            .map(|(i, item)| {
                let env = env.clone();
                async move {
                    if env.run.cancelled.load(Ordering::Acquire) {
                        return (i, Err("the stage was interrupted before this file was copied".to_string()));
                    }
                    (i, item_with_retries(&env, &item).await)
                }
            })
            .buffer_unordered(concurrency.max(1) as usize);
        while let Some((i, r)) = results.next().await {
            let res = match r {
                Ok(mut res) => {
                    res.index = i as u32;
                    run.bytes.fetch_add(res.bytes, Ordering::Relaxed);
                    res
                }
                Err(e) => {
                    run.errors.fetch_add(1, Ordering::Relaxed);
                    warn!(run = req.run, item = i, error = %e, "stage item failed");
                    ItemResult { index: i as u32, error: Some(e), ..ItemResult::default() }
                }
            };
            run.items_done.fetch_add(1, Ordering::Relaxed);
            run.results.lock().expect("results lock").push(res);
            run.changed.notify_waiters();
        }
        // The share is done once metad holds every file it created (creates this agent answered
        // under a delegation included); if it does not take them in time, no item counts as done.
        let wait = Duration::from_secs(env.client.config().retry_secs.max(1));
        if tokio::time::timeout(wait, env.client.sync_deferred()).await.is_err() {
            let why = format!("the metadata service did not take this share's new files within {} s", wait.as_secs());
            warn!(run = req.run, "{why}");
            let mut results = run.results.lock().expect("results lock");
            for r in results.iter_mut().filter(|r| r.error.is_none()) {
                r.error = Some(why.clone());
                run.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        let c = run.counters();
        info!(run = req.run, items = c.items_done, bytes = c.bytes, errors = c.errors, "stage share finished");
        run.finish();
    }
}

/// A run whose caller has not asked about it for this long is given up (its coordinator was
/// killed): as long as a coordinator waits before it gives up on a silent agent.
const ABANDONED_AFTER: Duration = Duration::from_secs(30);

/// Cancels `run` once its caller has been silent for `ABANDONED_AFTER`, so a killed `odfs
/// stage-in` leaves no copy running into the job's files.
async fn watch_caller(run: Arc<Run>, id: u64) {
    while !run.finished.load(Ordering::Acquire) {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let last = *run.last_heard.lock().expect("last heard lock");
        if last.is_some_and(|t| t.elapsed() > ABANDONED_AFTER) && !run.cancelled.load(Ordering::Acquire) {
            warn!(
                run = id,
                "no word from the stage's coordinator for {} s: the run is cancelled",
                ABANDONED_AFTER.as_secs()
            );
            run.cancel();
        }
    }
}

async fn item_with_retries(env: &Env, item: &WorkItem) -> ItemResultOr {
    let mut attempt = 1;
    loop {
        match run_item(env, item).await {
            Ok(r) => return Ok(r),
            Err(Failure::Final(e)) => return Err(e),
            Err(Failure::Transient(e)) if attempt >= ITEM_ATTEMPTS || env.run.cancelled.load(Ordering::Acquire) => {
                return Err(e)
            }
            Err(Failure::Transient(e)) => {
                env.run.retries.fetch_add(1, Ordering::Relaxed);
                warn!(rel = item.rel(), attempt, error = %e, "retrying stage item");
                let jitter = rand::random::<u64>() % 250;
                tokio::time::sleep(Duration::from_millis(250 * (1 << attempt) + jitter)).await;
                attempt += 1;
            }
        }
    }
}

/// A failed item: worth another attempt (the store or network failed) or not (a mismatch
/// with what the source says, a refused path, a missing file).
enum Failure {
    Transient(String),
    Final(String),
}

fn transient(e: impl std::fmt::Display) -> Failure {
    Failure::Transient(e.to_string())
}

/// An S3 failure: worth another attempt unless the endpoint is unreachable altogether.
fn s3_failure(e: crate::s3::S3Error) -> Failure {
    if e.unreachable {
        Failure::Final(e.msg)
    } else {
        Failure::Transient(e.msg)
    }
}

fn odfs_err(path: &str) -> impl Fn(odfs_client::ClientError) -> Failure + '_ {
    move |e| Failure::Final(format!("odfs:{path}: {e}"))
}

async fn run_item(env: &Env, item: &WorkItem) -> Result<ItemResult, Failure> {
    use StageEndpoint as E;
    match (item, &env.src, &env.dst) {
        (WorkItem::Whole { rel, size, mtime, mode }, E::S3(_) | E::Posix(_), E::Odfs(root)) => {
            whole_in(env, rel, *size, *mtime, *mode, &join(root, rel)).await
        }
        (WorkItem::Range { rel, offset, len }, E::S3(_) | E::Posix(_), E::Odfs(root)) => {
            range_in(env, rel, *offset, *len, &join(root, rel)).await
        }
        (WorkItem::Whole { rel, size, mtime, mode }, E::Odfs(root), E::S3(_)) => {
            let _ = (mtime, mode); // S3 keeps its own LastModified; modes have no place there.
            whole_out_s3(env, rel, *size, &join(root, rel)).await
        }
        (WorkItem::Whole { rel, size, mtime, mode }, E::Odfs(root), E::Posix(dst)) => {
            whole_out_posix(env, *size, *mtime, *mode, &join(root, rel), &std::path::Path::new(dst).join(rel)).await
        }
        (WorkItem::Part { rel, upload_id, part, offset, len }, E::Odfs(root), E::S3(_)) => {
            part_out(env, rel, upload_id, *part, *offset, *len, &join(root, rel)).await
        }
        (WorkItem::Digest { rel, size }, _, E::Odfs(root)) => digest_odfs(env, &join(root, rel), *size, 0).await,
        (WorkItem::SourceDigest { rel, size, part_size }, E::Odfs(root), _) => {
            digest_odfs(env, &join(root, rel), *size, *part_size).await
        }
        (it, src, dst) => Err(Failure::Final(format!(
            "{} from {src:?} to {dst:?} is not a stage this agent can do",
            match it {
                WorkItem::Whole { .. } => "a whole-object copy",
                WorkItem::Range { .. } => "a range copy",
                WorkItem::Part { .. } => "a part upload",
                WorkItem::Digest { .. } => "a digest of the destination",
                WorkItem::SourceDigest { .. } => "a digest of the source",
            }
        ))),
    }
}

/// Opens `path` in odfs for writing, creating it (mode) or truncating it.
async fn open_for_write(env: &Env, path: &str, mode: u32, truncate: bool) -> Result<FileHandle, Failure> {
    step("open for writing", path, async {
        let (parent, name) = env.client.resolve_parent(&env.ctx, path).await.map_err(odfs_err(path))?;
        let (r, h) =
            env.client.create_open(&env.ctx, parent.ino, &name, mode, false, None).await.map_err(odfs_err(path))?;
        if truncate && !r.created && r.attr.size > 0 {
            h.truncate(0).await.map_err(odfs_err(path))?;
        }
        Ok(h)
    })
    .await
}

async fn set_times(env: &Env, h: &FileHandle, path: &str, mtime: Timespec, mode: Option<u32>) -> Result<(), Failure> {
    let req = SetAttr { ino: h.ino(), mode, mtime: Some(SetTime::At(mtime)), ..SetAttr::default() };
    step("set times", path, env.client.setattr(&env.ctx, req)).await.map_err(odfs_err(path))?;
    Ok(())
}

/// Writes `data` at `off` through `h`, handing its buffer over (a failure is worth another
/// attempt of the item).
async fn put_block(h: &FileHandle, off: u64, data: Bytes, path: &str) -> Result<(), Failure> {
    step("write", path, h.write_bytes(off, data)).await.map_err(|e| transient(format!("odfs:{path}: {e}")))?;
    Ok(())
}

/// Copies bytes `offset..offset+len` of `rel` from the source (an S3 GET, whole or ranged, or
/// POSIX reads) into `h` at the same offsets, in blocks, within the limits. Returns the digests
/// of what was copied and, for a whole S3 object, its key, ETag and the server's CRC32C.
async fn copy_in(
    env: &Env,
    h: &FileHandle,
    rel: &str,
    path: &str,
    offset: u64,
    len: u64,
    whole: bool,
) -> Result<(Digests, Option<(String, String, Option<String>)>), Failure> {
    let mut off = offset;
    match (&env.src_s3, &env.src) {
        (Some(s3), _) => {
            let key = s3.key(rel);
            let range = (!whole).then_some((offset, len));
            let (mut body, etag, crc) = s3.get(&key, range).await.map_err(s3_failure)?;
            // MD5 (several times CRC32C's CPU per byte) only where it is the check: a whole
            // object whose server keeps no CRC32C of it. A range's MD5 would check nothing.
            // (A composite CRC32C of a multipart upload, "…-N", is no checksum of the bytes.)
            let full_crc = crc.as_deref().is_some_and(|c| !c.contains('-'));
            let mut d = if whole && !full_crc { Digests::default() } else { Digests::crc_only() };
            // Each piece of the body goes to the file as it comes, handed over: the client
            // sends a chunk's pieces as they are, so neither it nor a buffer here copies them.
            while let Some(chunk) = step("read from S3", path, body.next()).await {
                let chunk = chunk.map_err(|e| transient(format!("s3://{}/{key}: {e}", s3.spec.bucket)))?;
                env.limits.bytes(chunk.len() as u64).await;
                d.update(&chunk);
                let n = chunk.len() as u64;
                put_block(h, off, chunk, path).await?;
                off += n;
            }
            Ok((d, whole.then_some((key, etag, crc))))
        }
        (None, StageEndpoint::Posix(root)) => {
            // A POSIX source has no digest to compare an MD5 with.
            let mut d = Digests::crc_only();
            let file = std::path::Path::new(root).join(rel);
            while off < offset + len {
                let n = BLOCK.min((offset + len - off) as usize);
                env.limits.bytes(n as u64).await;
                let read = posix::read_at(&env.ctx, &file, off, n);
                let data = step("read the source", path, read).await.map_err(Failure::Final)?;
                if data.is_empty() {
                    break;
                }
                d.update(&data);
                let n = data.len() as u64;
                put_block(h, off, data.into(), path).await?;
                off += n;
            }
            Ok((d, None))
        }
        _ => Err(Failure::Final("no source to read".into())),
    }
}

/// A whole object or file into odfs, checked against the size and the source's digests.
async fn whole_in(
    env: &Env,
    rel: &str,
    size: u64,
    mtime: Timespec,
    mode: Option<u32>,
    path: &str,
) -> Result<ItemResult, Failure> {
    env.limits.request().await;
    let h = open_for_write(env, path, mode.unwrap_or(0o644) & 0o7777, true).await?;
    h.check_writes();
    let (d, source) = copy_in(env, &h, rel, path, 0, size, true).await?;
    let mut res = ItemResult { bytes: size, ..ItemResult::default() };
    let has_md5 = d.has_md5();
    let (md5, crc32c) = finish_check(d, size, rel)?;
    (res.md5, res.crc32c) = (has_md5.then_some(md5), Some(crc32c));
    res.written_checked = check_written(&h, 0, size, crc32c, path).await?;
    match source {
        // Checked against the server's own digests of the object.
        Some((key, etag, crc)) => {
            res.verified = Some(verify_in(&etag, crc.as_deref(), res.md5.as_ref(), crc32c, &key)?);
            res.etag = Some(etag);
        }
        None => res.verified = Some("size".into()),
    }
    step("flush", path, h.flush()).await.map_err(|e| transient(format!("odfs:{path}: {e}")))?;
    set_times(env, &h, path, mtime, mode.map(|m| m & 0o7777)).await?;
    step("close", path, h.close()).await.map_err(|e| transient(format!("odfs:{path}: {e}")))?;
    Ok(res)
}

fn finish_check(d: Digests, size: u64, what: &str) -> Result<([u8; 16], u32), Failure> {
    check_size(&d, size, what)?;
    Ok(d.finish())
}

fn check_size(d: &Digests, size: u64, what: &str) -> Result<(), Failure> {
    let got = d.bytes;
    if got != size {
        // The source changed or the transfer was cut: another attempt reads it again.
        return Err(Failure::Transient(format!("{what}: read {got} bytes, expected {size}")));
    }
    Ok(())
}

/// Checks what arrived against the server's own digests; names the check that was made.
fn verify_in(etag: &str, crc: Option<&str>, md5: Option<&[u8; 16]>, crc32c: u32, key: &str) -> Result<String, Failure> {
    let mut checks = Vec::new();
    if let Some(c) = crc.filter(|c| !c.contains('-')) {
        if c != b64(&crc32c.to_be_bytes()) {
            return Err(Failure::Transient(format!(
                "{key}: CRC32C mismatch (server {c}, received {})",
                b64(&crc32c.to_be_bytes())
            )));
        }
        checks.push("crc32c");
    }
    if let Some(md5) = md5.filter(|_| is_md5_etag(etag)) {
        if !etag.eq_ignore_ascii_case(&hex::encode(md5)) {
            return Err(Failure::Transient(format!(
                "{key}: MD5 mismatch (ETag {etag}, received {})",
                hex::encode(md5)
            )));
        }
        checks.push("md5");
    }
    if checks.is_empty() {
        checks.push("size");
    }
    Ok(checks.join("+"))
}

/// A byte range of a large object into its odfs file (created at full size by the coordinator).
async fn range_in(env: &Env, rel: &str, offset: u64, len: u64, path: &str) -> Result<ItemResult, Failure> {
    env.limits.request().await;
    let h = step("open for writing", path, async {
        let a = env.client.resolve(&env.ctx, path, true).await.map_err(odfs_err(path))?;
        env.client.open(&env.ctx, a.ino, false, true, false).await.map_err(odfs_err(path))
    })
    .await?;
    h.check_writes();
    let (d, _) = copy_in(env, &h, rel, path, offset, len, false).await?;
    check_size(&d, len, &format!("{rel} bytes {offset}..{}", offset + len))?;
    let crc = d.crc();
    let written_checked = check_written(&h, offset, len, crc, path).await?;
    step("close", path, h.close()).await.map_err(|e| transient(format!("odfs:{path}: {e}")))?;
    Ok(ItemResult { bytes: len, crc32c: Some(crc), written_checked, ..ItemResult::default() })
}

/// Compares the CRC32C stored acknowledged for bytes `offset..offset + len` of `h` with `crc`,
/// that of the bytes sent: true when they match, false when the writes do not tell (the range
/// is then checked by reading it back), a failure worth another attempt when they differ.
async fn check_written(h: &FileHandle, offset: u64, len: u64, crc: u32, path: &str) -> Result<bool, Failure> {
    step("wait for stored's acknowledgements", path, h.wait_written())
        .await
        .map_err(|e| transient(format!("odfs:{path}: {e}")))?;
    match h.written_crc(offset, len) {
        Some(got) if got != crc => Err(transient(format!(
            "odfs:{path}: stored wrote bytes {offset}..{} with CRC32C {got:08x}, but {crc:08x} was sent",
            offset + len
        ))),
        Some(_) => Ok(true),
        None => Ok(false),
    }
}

/// Reads `len` bytes at `offset` of an odfs file, each block in the run's turn (a drain's
/// share: see `limit::Share`).
async fn read_odfs(env: &Env, h: &FileHandle, path: &str, offset: u64, len: u64) -> Result<Vec<u8>, Failure> {
    let mut out = Vec::with_capacity(len as usize);
    while (out.len() as u64) < len {
        env.limits.turn().await;
        let want = BLOCK.min((len - out.len() as u64) as usize) as u32;
        let d = step("read", path, h.read(offset + out.len() as u64, want))
            .await
            .map_err(|e| transient(format!("odfs:{path}: {e}")))?;
        if d.is_empty() {
            return Err(Failure::Final(format!("odfs:{path}: ended at {} of {len} bytes", out.len())));
        }
        out.extend_from_slice(&d);
    }
    Ok(out)
}

async fn open_read(env: &Env, path: &str) -> Result<FileHandle, Failure> {
    step("open for reading", path, async {
        let a = env.client.resolve(&env.ctx, path, true).await.map_err(odfs_err(path))?;
        env.client.open(&env.ctx, a.ino, true, false, false).await.map_err(odfs_err(path))
    })
    .await
}

async fn whole_out_s3(env: &Env, rel: &str, size: u64, path: &str) -> Result<ItemResult, Failure> {
    let s3 = env.dst_s3.as_ref().ok_or_else(|| Failure::Final("no S3 destination".into()))?;
    let h = open_read(env, path).await?;
    let data = read_odfs(env, &h, path, 0, size).await?;
    let _ = h.close().await;
    let mut d = Digests::default();
    d.update(&data);
    let (md5, crc) = d.finish();
    env.limits.request().await;
    env.limits.bytes(size).await;
    let key = s3.key(rel);
    let etag = step("upload to S3", path, s3.put(&key, data, &md5, crc)).await.map_err(s3_failure)?;
    if is_md5_etag(&etag) && !etag.eq_ignore_ascii_case(&hex::encode(md5)) {
        return Err(Failure::Transient(format!(
            "s3://{}/{key}: ETag {etag} is not the MD5 of what was sent",
            s3.spec.bucket
        )));
    }
    Ok(ItemResult { bytes: size, md5: Some(md5), crc32c: Some(crc), etag: Some(etag), ..ItemResult::default() })
}

async fn part_out(
    env: &Env,
    rel: &str,
    upload_id: &str,
    part: i32,
    offset: u64,
    len: u64,
    path: &str,
) -> Result<ItemResult, Failure> {
    let s3 = env.dst_s3.as_ref().ok_or_else(|| Failure::Final("no S3 destination".into()))?;
    let h = open_read(env, path).await?;
    let data = read_odfs(env, &h, path, offset, len).await?;
    let _ = h.close().await;
    let mut d = Digests::default();
    d.update(&data);
    let (md5, crc) = d.finish();
    env.limits.request().await;
    env.limits.bytes(len).await;
    let key = s3.key(rel);
    let upload = s3.upload_part(&key, upload_id, part, data, &md5);
    let etag = step("upload a part to S3", path, upload).await.map_err(s3_failure)?;
    Ok(ItemResult { bytes: len, md5: Some(md5), crc32c: Some(crc), etag: Some(etag), ..ItemResult::default() })
}

async fn whole_out_posix(
    env: &Env,
    size: u64,
    mtime: Timespec,
    mode: Option<u32>,
    path: &str,
    dst: &std::path::Path,
) -> Result<ItemResult, Failure> {
    let h = open_read(env, path).await?;
    let mut d = Digests::default();
    let tmp = posix::Staged::create(&env.ctx, dst, mode.unwrap_or(0o644)).await.map_err(Failure::Final)?;
    let mut off = 0;
    while off < size {
        let n = BLOCK.min((size - off) as usize) as u64;
        let data = read_odfs(env, &h, path, off, n).await?;
        env.limits.bytes(n).await;
        d.update(&data);
        step("write the destination", path, tmp.write_at(off, data)).await.map_err(Failure::Final)?;
        off += n;
    }
    let _ = h.close().await;
    tmp.commit(mtime).await.map_err(Failure::Final)?;
    let (md5, crc) = d.finish();
    Ok(ItemResult { bytes: size, md5: Some(md5), crc32c: Some(crc), ..ItemResult::default() })
}

/// MD5 and CRC32C of a whole odfs file; with `part_size`, also its multipart ETag.
async fn digest_odfs(env: &Env, path: &str, size: u64, part_size: u64) -> Result<ItemResult, Failure> {
    let h = open_read(env, path).await?;
    let mut d = Digests::default();
    let mut parts = Vec::new();
    let mut part = Digests::default();
    let mut off = 0;
    while off < size {
        let n = BLOCK.min((size - off) as usize) as u64;
        let data = read_odfs(env, &h, path, off, n).await?;
        d.update(&data);
        if part_size > 0 {
            part.update(&data);
            if part.bytes == part_size {
                parts.push(std::mem::take(&mut part).finish().0);
            }
        }
        off += n;
    }
    let _ = h.close().await;
    if part.bytes > 0 {
        parts.push(part.finish().0);
    }
    let (md5, crc) = d.finish();
    Ok(ItemResult {
        bytes: 0,
        md5: Some(md5),
        crc32c: Some(crc),
        multipart_etag: (part_size > 0 && !parts.is_empty()).then(|| multipart_etag(&parts)),
        ..ItemResult::default()
    })
}

/// Runs the agent until `shutdown` fires.
pub async fn run(cfg: AgentConfig, shutdown: Shutdown) -> Result<(), crate::StageError> {
    let cred = cfg.job.credential()?;
    let endpoint = QuicEndpoint::server(&cred, cfg.listen)?;
    let addr = endpoint.local_addr()?;
    let register_timeout = Duration::from_secs(cfg.register_timeout_secs);
    let daemon = Daemon::new(cred, cfg.mgmtd, register_timeout, Duration::from_secs(2), shutdown)?;
    let agent = Agent::new(cfg.clone());
    let servers = daemon.serve(&endpoint, None, Arc::new(agent.router()));
    let register = announce(ServiceKind::Agent, cfg.node, addr);
    let served = daemon.run(servers, register, odfs_service::lifecycle::no_targets()).await;
    // The agent's client caches (and so holds leases): its goodbye lets no change wait for it.
    if let Some(client) = agent.client.get() {
        client.close().await;
    }
    Ok(served?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_poll_waits_for_the_end_of_its_run_or_its_low_water_and_no_longer() {
        let hour = Duration::from_secs(3600);
        let run = Arc::new(Run::default());
        run.items_total.store(10, Ordering::Relaxed);
        // Nothing happens: the wait ends when it runs out.
        run.wait_for_news(Duration::from_millis(200), 0).await;
        // An open run answers once no more than the low water are left, not before.
        let (tx, _rx) = mpsc::unbounded();
        *run.more.lock().unwrap() = Some(tx);
        let r = run.clone();
        let waiter = tokio::spawn(async move { r.wait_for_news(hour, 4).await });
        let t = tokio::time::Instant::now();
        for _ in 0..6 {
            tokio::task::yield_now().await;
            assert!(!waiter.is_finished(), "answered with more than the low water left");
            run.items_done.fetch_add(1, Ordering::Relaxed);
            run.changed.notify_waiters();
        }
        waiter.await.unwrap();
        assert!(t.elapsed() < hour, "woken by the items done, not by running out");
        // A closed run answers only at its end.
        run.more.lock().unwrap().take();
        let r = run.clone();
        let waiter = tokio::spawn(async move { r.wait_for_news(hour, 4).await });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        let t = tokio::time::Instant::now();
        run.finish();
        waiter.await.unwrap();
        assert!(t.elapsed() < hour, "woken by the finish, not by running out");
        // Finished already: answered without waiting.
        let t = tokio::time::Instant::now();
        run.wait_for_news(hour, 0).await;
        assert!(t.elapsed() < hour);
    }

    #[tokio::test(start_paused = true)]
    async fn a_step_that_waits_long_is_waited_for_not_dropped() {
        let t = tokio::time::Instant::now();
        let slow = async {
            tokio::time::sleep(STUCK_AFTER * 3).await;
            7
        };
        assert_eq!(step("write", "/x", slow).await, 7);
        assert!(t.elapsed() >= STUCK_AFTER * 3);
        assert_eq!(step("write", "/x", async { 8 }).await, 8);
    }

    #[test]
    fn verification_names_the_checks_and_refuses_mismatches() {
        let mut d = Digests::default();
        d.update(b"hello");
        let (md5, crc) = d.finish();
        let etag = hex::encode(md5);
        let crc_b64 = b64(&crc.to_be_bytes());
        assert_eq!(verify_in(&etag, Some(&crc_b64), Some(&md5), crc, "k").ok(), Some("crc32c+md5".into()));
        assert_eq!(verify_in("abc-2", None, Some(&md5), crc, "k").ok(), Some("size".into()));
        assert!(
            matches!(verify_in(&"0".repeat(32), None, Some(&md5), crc, "k"), Err(Failure::Transient(m)) if m.contains("MD5 mismatch"))
        );
        assert!(
            matches!(verify_in(&etag, Some("AAAAAA=="), Some(&md5), crc, "k"), Err(Failure::Transient(m)) if m.contains("CRC32C"))
        );
        // With the server's CRC32C no MD5 was computed: the CRC32C is the check.
        assert_eq!(verify_in(&etag, Some(&crc_b64), None, crc, "k").ok(), Some("crc32c".into()));
    }
}
