//! Continuous drain: while a job runs, the files under an odfs directory that have settled are
//! uploaded to S3, verified, and recorded in the destination's stage-out manifest, so that the
//! epilog's stage-out sends only what changed since (docs/architecture.md, "Continuous
//! drain").
//!
//! Owns the drainers of one agent (node 0's): their scans, the settle rule, their passes, the
//! manifest they keep, `--keep` retirement, `--delete-after-upload` and their counters. Must
//! not change the job's files beyond that opt-in deletion (done by metad's `UnlinkIdle`, which
//! refuses a file open anywhere); the agents move the bytes, as for any stage-out.

use crate::coordinator::stage_out::{drain_pass, drained_entries, put_manifest, src_file, walk_odfs_attrs};
use crate::coordinator::StageOptions;
use crate::manifest::{checkpoint_of, FileEntry, Manifest};
use crate::s3::S3;
use odfs_client::{Client, Ctx};
use odfs_proto::meta::Attr;
use odfs_proto::stage::{DrainList, DrainStart, DrainState, DrainStop, StageEndpoint};
use odfs_proto::{ErrorCode, InodeId, RemoteError, Timespec};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tracing::{info, warn};

/// How often a drainer walks its directory.
const SCAN_EVERY: Duration = Duration::from_secs(1);
/// Longest wait before a failed upload is tried again (the wait doubles from one scan).
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// The drains of one agent, by source directory.
#[derive(Default)]
pub struct Drains {
    map: Mutex<BTreeMap<String, Arc<Drain>>>,
}

/// One running (or finished) drain.
struct Drain {
    state: Mutex<DrainState>,
    stop: watch::Sender<bool>,
    /// True once the drainer has ended (its last manifest written).
    ended: watch::Receiver<bool>,
}

impl Drains {
    /// Starts draining `req.src`; a drain of the same directory that runs is stopped first.
    pub async fn start(&self, client: Client, req: DrainStart) -> Result<(), RemoteError> {
        let StageEndpoint::S3(spec) = &req.dst else {
            return Err(RemoteError::new(ErrorCode::Invalid, "a drain uploads to s3://BUCKET/PREFIX".to_string()));
        };
        if !req.src.starts_with('/') {
            return Err(RemoteError::new(
                ErrorCode::Invalid,
                format!("drain source {:?} is not a path in the job's filesystem", req.src),
            ));
        }
        self.stop_and_wait(&req.src).await;
        let s3 = S3::new(spec);
        let (stop, stop_rx) = watch::channel(false);
        let (ended_tx, ended) = watch::channel(false);
        let state = DrainState {
            src: req.src.clone(),
            dst: format!("s3://{}/{}", spec.bucket, spec.prefix),
            running: true,
            ..DrainState::default()
        };
        let drain = Arc::new(Drain { state: Mutex::new(state), stop, ended });
        self.map.lock().expect("drains lock").insert(req.src.clone(), drain.clone());
        info!(src = %req.src, dst = %drain.snapshot().dst, settle_ms = req.settle_ms, keep = req.keep, "drain started");
        let mut drainer = Drainer::new(client, s3, req, drain);
        tokio::spawn(async move {
            drainer.run(stop_rx).await;
            drainer.drain.state.lock().expect("drain state").running = false;
            let _ = ended_tx.send(true);
        });
        Ok(())
    }

    /// Tells the drain of `src` (every drain if None) to stop after its pass in flight and its
    /// last manifest; returns their states now. A pass may take long (a large file, a store
    /// down): callers poll `list` until they report not running, rather than wait in one
    /// request.
    pub fn stop(&self, src: Option<&str>) -> Vec<DrainState> {
        let map = self.map.lock().expect("drains lock");
        map.iter()
            .filter(|(k, _)| src.is_none_or(|s| s == k.as_str()))
            .map(|(_, d)| {
                let _ = d.stop.send(true);
                d.snapshot()
            })
            .collect()
    }

    /// Stops the drain of `src` and waits until it has ended (a drain replaced by a new one).
    async fn stop_and_wait(&self, src: &str) {
        let old = self.map.lock().expect("drains lock").get(src).cloned();
        if let Some(d) = old {
            let _ = d.stop.send(true);
            let mut ended = d.ended.clone();
            let _ = ended.wait_for(|e| *e).await;
        }
    }

    pub fn list(&self) -> Vec<DrainState> {
        self.map.lock().expect("drains lock").values().map(|d| d.snapshot()).collect()
    }
}

impl Drain {
    fn snapshot(&self) -> DrainState {
        self.state.lock().expect("drain state").clone()
    }

    fn update(&self, f: impl FnOnce(&mut DrainState)) {
        f(&mut self.state.lock().expect("drain state"));
    }
}

/// What identifies a file's present contents at metad: any close, fsync, truncate or change
/// moves one of these.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Identity {
    ino: InodeId,
    size: u64,
    mtime: Timespec,
    ctime: Timespec,
}

impl Identity {
    fn of(a: &Attr) -> Identity {
        Identity { ino: a.ino, size: a.size, mtime: a.mtime, ctime: a.ctime }
    }
}

/// The settle rule: a file is settled once its identity has been the same in scans spanning
/// `settle`, and its last change (ctime) and write (mtime) are at least `settle` old.
#[derive(Debug, Clone, Copy)]
struct Watch {
    id: Identity,
    /// First scan that saw this identity.
    since: Instant,
}

fn settled(w: &Watch, now: Instant, wall: Timespec, settle: Duration) -> bool {
    let age = |t: Timespec| {
        let ns = (wall.sec - t.sec) as i128 * 1_000_000_000 + wall.nsec as i128 - t.nsec as i128;
        Duration::from_nanos(ns.clamp(0, u64::MAX as i128) as u64)
    };
    now.duration_since(w.since) >= settle && age(w.id.ctime) >= settle && age(w.id.mtime) >= settle
}

/// A failed file's next attempt.
#[derive(Debug, Clone, Copy)]
struct Retry {
    at: Instant,
    wait: Duration,
}

struct Drainer {
    client: Client,
    s3: S3,
    ctx: Ctx,
    req: DrainStart,
    drain: Arc<Drain>,
    opts: StageOptions,
    manifest: Manifest,
    watching: HashMap<String, Watch>,
    retry: HashMap<String, Retry>,
    /// `--delete-after-upload`: files drained and recorded in a manifest written to the
    /// destination, not yet deleted (open somewhere, or not tried yet), with their attributes
    /// when they were uploaded; and those drained but not yet in a written manifest.
    to_delete: BTreeMap<String, Attr>,
    unrecorded: BTreeMap<String, Attr>,
    /// The destination's manifest was read (or found absent): until then nothing is uploaded,
    /// so an earlier record is never overwritten.
    loaded: bool,
    /// Files of the last scan, and those of them not drained as they are now (for `--keep`).
    present: BTreeSet<String>,
    pending: BTreeSet<String>,
    /// The manifest changed since it was last written.
    dirty: bool,
}

impl Drainer {
    fn new(client: Client, s3: S3, req: DrainStart, drain: Arc<Drain>) -> Drainer {
        let shared = crate::limit::gated(req.limits.share);
        let part_size = if shared { req.part_size.min(crate::limit::DRAIN_PART) } else { req.part_size };
        let split_threshold = if shared { part_size } else { req.split_threshold.max(req.part_size) };
        let opts = StageOptions {
            concurrency: req.limits.concurrency.max(1),
            max_requests_per_sec: req.limits.requests_per_sec,
            max_bandwidth: req.limits.bytes_per_sec,
            split_threshold,
            part_size,
            share: req.limits.share,
            ..StageOptions::default()
        };
        let manifest = Manifest {
            version: 1,
            kind: "stage-out".into(),
            source: format!("odfs:{}", req.src),
            destination: drain.snapshot().dst,
            ..Manifest::default()
        };
        Drainer {
            client,
            s3,
            ctx: Ctx { uid: req.uid, gid: req.gid, groups: req.groups.clone() },
            req,
            drain,
            opts,
            manifest,
            watching: HashMap::new(),
            retry: HashMap::new(),
            to_delete: BTreeMap::new(),
            unrecorded: BTreeMap::new(),
            loaded: false,
            present: BTreeSet::new(),
            pending: BTreeSet::new(),
            dirty: false,
        }
    }

    fn settle(&self) -> Duration {
        Duration::from_millis(self.req.settle_ms)
    }

    async fn run(&mut self, mut stop: watch::Receiver<bool>) {
        loop {
            if *stop.borrow() {
                break;
            }
            if self.load_manifest().await {
                match self.scan().await {
                    Ok(ready) if !ready.is_empty() => self.pass(ready).await,
                    Ok(_) => {}
                    Err(e) => self.drain.update(|s| s.last_error = Some(e)),
                }
                // After every scan, not only a pass's: a checkpoint may become whole with no
                // upload (a pending file deleted), and a deletion that failed is tried again.
                self.retire().await;
                // Deleted only once the manifest that records the upload is in the store.
                self.write_manifest().await;
                self.delete_uploaded().await;
                self.write_manifest().await;
            }
            tokio::select! {
                _ = tokio::time::sleep(SCAN_EVERY) => {}
                _ = stop.changed() => {}
            }
        }
        self.write_manifest().await;
        let s = self.drain.snapshot();
        info!(src = %s.src, uploaded = s.uploaded, failed = s.failed, pending = s.pending, "drain stopped");
    }

    /// A drain started again (a recovered job, a second `odfs drain start`) goes on from what
    /// the destination's manifest says is there. False while it cannot be read.
    async fn load_manifest(&mut self) -> bool {
        if self.loaded {
            return true;
        }
        match drained_entries(&self.s3).await {
            Ok(files) => {
                self.manifest.files = files;
                self.loaded = true;
            }
            Err(e) => self.drain.update(|s| s.last_error = Some(e.to_string())),
        }
        self.loaded
    }

    /// Walks the source; returns the files that settled and are due (their attributes).
    async fn scan(&mut self) -> Result<Vec<(String, Attr)>, String> {
        match self.client.resolve(&self.ctx, &self.req.src, true).await {
            Ok(_) => {}
            // The job has not made it yet.
            Err(e) if e.code() == ErrorCode::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(format!("odfs:{}: {e}", self.req.src)),
        }
        let walk = walk_odfs_attrs(&self.client, &self.ctx, &self.req.src).await.map_err(|e| e.to_string())?;
        if let Some(bad) = walk.not_utf8.first() {
            // The rest drains; these wait for a rename (the epilog's stage-out refuses them too).
            let n = walk.not_utf8.len();
            let msg = format!(
                "odfs:{}/{bad}: a name that is not UTF-8 cannot be an S3 key ({n} such name(s) not drained)",
                self.req.src
            );
            self.drain.update(|s| s.last_error = Some(msg));
        }
        let files = walk.files;
        let (now, wall, settle) = (Instant::now(), Timespec::now(), self.settle());
        let mut ready = Vec::new();
        let mut pending = BTreeSet::new();
        let mut present = HashMap::new();
        for (rel, a) in files {
            // What stages write themselves (a stage-in's manifest, the stage-out's marker).
            if crate::manifest::reserved(&rel) {
                continue;
            }
            let id = Identity::of(&a);
            present.insert(rel.clone(), ());
            let moved = |d: &Attr| (d.ino, d.size, d.mtime) != (a.ino, a.size, a.mtime);
            if self.to_delete.get(&rel).is_some_and(moved) || self.unrecorded.get(&rel).is_some_and(moved) {
                // Changed since its upload: the new contents are uploaded (and deleted) in turn.
                self.to_delete.remove(&rel);
                self.unrecorded.remove(&rel);
            }
            if self.manifest.files.get(&rel).is_some_and(|e| e.drained.is_some() && e.same_file(a.size, a.mtime)) {
                continue;
            }
            pending.insert(rel.clone());
            let w = self.watching.entry(rel.clone()).or_insert(Watch { id, since: now });
            if w.id != id {
                *w = Watch { id, since: now };
            }
            let due = self.retry.get(&rel).is_none_or(|r| r.at <= now);
            if settled(w, now, wall, settle) && due {
                ready.push((rel, a));
            }
        }
        self.watching.retain(|k, _| present.contains_key(k));
        self.to_delete.retain(|k, _| present.contains_key(k));
        self.unrecorded.retain(|k, _| present.contains_key(k));
        if let Some(marker) = &self.req.marker {
            // A marker goes last: once every other file of its checkpoint is drained.
            ready.retain(|(rel, _)| !held_marker(rel, marker, &pending));
        }
        self.present = present.into_keys().collect();
        self.drain.update(|s| s.pending = pending.len() as u64);
        self.pending = pending;
        Ok(ready)
    }

    /// Uploads the settled files, records those verified and unchanged since, retries the rest.
    async fn pass(&mut self, ready: Vec<(String, Attr)>) {
        let view = self.client.cluster().view();
        let node_of: HashMap<String, u32> = ready
            .iter()
            .filter_map(|(rel, a)| {
                let t = *a.layout.as_ref()?.targets.first()?;
                Some((rel.clone(), view.target(t)?.node))
            })
            .collect();
        let files = ready.iter().map(|(rel, a)| src_file(rel, a)).collect();
        self.drain.update(|s| s.in_flight = ready.len() as u64);
        let r = drain_pass(&self.client, &self.ctx, &self.req.src, &self.s3, files, node_of, &self.opts).await;
        self.drain.update(|s| {
            s.in_flight = 0;
            s.passes += 1;
        });
        let out = match r {
            Ok(out) => out,
            Err(e) => {
                let why = e.to_string();
                for (rel, _) in &ready {
                    self.failed(rel, &why);
                }
                return;
            }
        };
        for (rel, why) in &out.failed {
            self.failed(rel, why);
        }
        for (rel, a) in ready {
            let Some(entry) = out.verified.get(&rel) else { continue };
            self.record(rel, &a, entry.clone()).await;
        }
    }

    /// Records a verified upload, unless the file changed while it was sent.
    async fn record(&mut self, rel: String, before: &Attr, mut entry: FileEntry) {
        let now = match self.client.getattr(&self.ctx, before.ino).await {
            Ok(a) => a,
            Err(e) => {
                warn!(rel, error = %e, "drained file vanished or cannot be read; not recorded");
                return;
            }
        };
        if Identity::of(&now) != Identity::of(before) {
            info!(rel, "file changed during its upload; it is sent again once it settles");
            self.watching.remove(&rel);
            return;
        }
        let t = Timespec::now();
        entry.drained = Some(t.sec * 1000 + (t.nsec / 1_000_000) as i64);
        let again = self.manifest.files.get(&rel).is_some_and(|e| e.drained.is_some());
        self.drain.update(|s| {
            s.uploaded += 1;
            s.uploaded_bytes += entry.size;
            s.reuploaded += again as u64;
        });
        info!(rel, size = entry.size, "drained");
        self.retry.remove(&rel);
        self.pending.remove(&rel);
        if self.req.delete_after_upload {
            self.unrecorded.insert(rel.clone(), now);
        }
        self.manifest.files.insert(rel, entry);
        self.dirty = true;
    }

    fn failed(&mut self, rel: &str, why: &str) {
        warn!(rel, error = why, "drain upload failed; tried again later");
        let wait = self.retry.get(rel).map_or(SCAN_EVERY, |r| (r.wait * 2).min(MAX_BACKOFF));
        self.retry.insert(rel.to_string(), Retry { at: Instant::now() + wait, wait });
        self.drain.update(|s| {
            s.failed += 1;
            s.last_error = Some(format!("{rel}: {why}"));
        });
    }

    /// `--delete-after-upload`: deletes each drained file from odfs, unless it changed since
    /// its upload or is open on any node (metad's `UnlinkIdle` refuses: tried again on the
    /// next scan).
    async fn delete_uploaded(&mut self) {
        let todo: Vec<(String, Attr)> = self.to_delete.iter().map(|(k, a)| (k.clone(), a.clone())).collect();
        for (rel, a) in todo {
            let (dir, name) = match rel.rsplit_once('/') {
                Some((d, n)) => (crate::keys::join(&self.req.src, d), n.to_string()),
                None => (self.req.src.clone(), rel.clone()),
            };
            let r = match self.client.resolve(&self.ctx, &dir, true).await {
                Ok(parent) => self.client.unlink_idle(&self.ctx, parent.ino, name.as_bytes(), &a).await,
                Err(e) => Err(e),
            };
            match r {
                Ok(()) => {
                    info!(rel, "deleted from odfs after its upload (--delete-after-upload)");
                    self.to_delete.remove(&rel);
                    self.watching.remove(&rel);
                    if let Some(e) = self.manifest.files.get_mut(&rel) {
                        e.deleted_local = true;
                    }
                    self.dirty = true;
                    self.drain.update(|s| s.deleted += 1);
                }
                // Open on some node or changed (InUse), or metad busy or slow: not now.
                Err(e) if matches!(e.code(), ErrorCode::InUse | ErrorCode::Busy | ErrorCode::TimedOut) => {}
                Err(e) if e.code() == ErrorCode::NotFound => {
                    self.to_delete.remove(&rel);
                }
                Err(e) => {
                    warn!(rel, error = %e, "cannot delete a drained file; it stays");
                    self.to_delete.remove(&rel);
                    self.drain.update(|s| s.last_error = Some(format!("{rel}: cannot delete after upload: {e}")));
                }
            }
        }
        let waiting = self.to_delete.len() as u64;
        self.drain.update(|s| s.delete_waiting = waiting);
    }

    /// `--keep K`: deletes the objects of the whole checkpoints older than the last K held
    /// whole (docs/architecture.md, "stage").
    async fn retire(&mut self) {
        let keep = self.req.keep as usize;
        if keep == 0 {
            return;
        }
        let plan = to_retire(&self.manifest.files, &self.present, &self.pending, self.req.marker.as_deref(), keep);
        for (checkpoint, files) in plan {
            let mut all = true;
            for rel in files {
                match self.s3.delete(&self.s3.key(&rel)).await {
                    Ok(()) => {
                        if let Some(e) = self.manifest.files.get_mut(&rel) {
                            e.retired = true;
                        }
                        self.dirty = true;
                        self.drain.update(|s| s.retired += 1);
                    }
                    Err(e) => {
                        all = false;
                        warn!(rel, error = %e, "cannot retire a drained object; tried again after the next scan");
                    }
                }
            }
            if all {
                self.drain.update(|s| s.retired_checkpoints += 1);
                info!(checkpoint, keep, "checkpoint retired from the destination (--keep)");
            }
        }
    }

    async fn write_manifest(&mut self) {
        if !self.dirty {
            return;
        }
        self.manifest.written = Timespec::now().sec;
        match put_manifest(&self.s3, &self.manifest).await {
            Ok(()) => {
                self.dirty = false;
                self.to_delete.append(&mut self.unrecorded);
            }
            Err(e) => {
                warn!(error = %e, "cannot write the drain's manifest; tried again after the next scan");
                self.drain.update(|s| s.last_error = Some(e.to_string()));
            }
        }
    }
}

/// Whether `rel` is the `--marker` file of a checkpoint directory with other files pending.
fn held_marker(rel: &str, marker: &str, pending: &BTreeSet<String>) -> bool {
    is_marker(rel, marker) && pending.iter().any(|p| p != rel && checkpoint_of(p) == checkpoint_of(rel))
}

/// Whether `rel` is the `--marker` file of its checkpoint directory (right below it).
fn is_marker(rel: &str, marker: &str) -> bool {
    rel.split_once('/').is_some_and(|(_, inside)| inside == marker)
}

/// One checkpoint of a drained tree, as its manifest and the last scan see it.
#[derive(Default)]
struct Checkpoint<'a> {
    /// The newest modification time among its drained files.
    newest: (i64, u32),
    /// Its drained files whose objects DST holds, and how many were retired.
    held: Vec<&'a str>,
    retired: usize,
    /// A file of it is not drained as it is now.
    pending: bool,
    /// It is a directory, and it holds its `--marker`, drained.
    dir: bool,
    marked: bool,
}

/// `--keep K`: the files to delete from DST, by checkpoint — every whole checkpoint older than
/// the K newest held whole in DST. Only files drained and recorded, and still in SRC (or
/// deleted from it by the drain), are considered; a checkpoint that is not whole is never in
/// the plan.
fn to_retire(
    files: &BTreeMap<String, FileEntry>,
    present: &BTreeSet<String>,
    pending: &BTreeSet<String>,
    marker: Option<&str>,
    keep: usize,
) -> Vec<(String, Vec<String>)> {
    let mut all: BTreeMap<&str, Checkpoint> = BTreeMap::new();
    for (rel, e) in files {
        if e.drained.is_none() || !(e.deleted_local || present.contains(rel)) {
            continue;
        }
        let top = checkpoint_of(rel);
        let c = all.entry(top).or_default();
        c.newest = c.newest.max((e.mtime, e.mtime_nsec));
        c.dir |= top.len() < rel.len();
        c.marked |= marker.is_some_and(|m| is_marker(rel, m));
        match e.retired {
            true => c.retired += 1,
            false => c.held.push(rel),
        }
    }
    for rel in pending {
        if let Some(c) = all.get_mut(checkpoint_of(rel)) {
            c.pending = true;
        }
    }
    let mut order: Vec<(&str, Checkpoint)> = all.into_iter().collect();
    order.sort_by(|(a, x), (b, y)| (y.newest, *b).cmp(&(x.newest, *a)));
    let mut kept = 0;
    let mut plan = Vec::new();
    for (name, c) in order {
        let whole = !c.pending && (marker.is_none() || !c.dir || c.marked);
        if kept < keep {
            kept += (whole && c.retired == 0) as usize;
        } else if whole && !c.held.is_empty() {
            plan.push((name.to_string(), c.held.iter().map(|r| r.to_string()).collect()));
        }
    }
    plan
}

/// A drain as a caller asks for it: `odfs drain start` or an `#ODFS drain` directive.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct DrainRequest {
    /// The directory to drain: odfs:/PATH or a path in the mount.
    pub src: String,
    /// Where its files go: s3://BUCKET/PREFIX (the same place the epilog's stage-out writes).
    pub dst: String,
    /// Seconds a file must stay unchanged (no close, fsync or change) before it is uploaded
    /// [default 3].
    #[arg(long)]
    pub settle: Option<f64>,
    /// Keep only the last K whole checkpoints in the destination, deleting the objects of older
    /// ones the drain uploaded (0 = keep all). A checkpoint is each entry at the top of the
    /// drained directory: a directory with everything below it, or a single file; it is whole
    /// once every file in it is drained, and never partly deleted.
    #[arg(long, default_value_t = 0)]
    pub keep: u32,
    /// A checkpoint directory is whole only once it holds a file of this name (e.g. COMPLETE),
    /// which is uploaded only after the rest of its directory.
    #[arg(long, value_name = "NAME")]
    pub marker: Option<String>,
    /// Drain uploads in flight per node [default 2].
    #[arg(long)]
    pub concurrency: Option<u32>,
    /// Job-wide bandwidth of the drain, bytes per second with an optional K/M/G suffix
    /// [default: a quarter of the stage's max-bandwidth when it has one, else none].
    #[arg(long, value_parser = odfs_proto::units::parse_size)]
    pub max_bandwidth: Option<u64>,
    /// The most of each node's time the drain may take while the job is busy there (its
    /// CPUs or the disks under its targets), in percent, e.g. 20 or 20%: a drain then slows
    /// the job's own I/O by at most about that much. Time goes in 5 s cycles; while the job is
    /// idle the drain pauses only the last half second of each, to look again. 100 turns the
    /// share off [default 20].
    #[arg(long, value_parser = parse_share)]
    pub share: Option<f64>,
    /// Delete each file from odfs once its upload is verified, unless it changed since or is
    /// open on any node (checkpoints whose only needed copy is in S3). Never the default.
    #[arg(long)]
    pub delete_after_upload: bool,
    /// S3 settings, as for `odfs stage-out`.
    #[command(flatten)]
    pub store: crate::request::StoreArgs,
}

/// Default settle time: a checkpoint's writer has closed it and not touched it since.
pub const DEFAULT_SETTLE_SECS: f64 = 3.0;

/// Default share of a busy node's time a drain may take: an uncapped drain halved a
/// checkpoint round written beside it (bench/history/2026-11-26-18-continuous-drain-checkpoint-cost.md).
pub const DEFAULT_SHARE: f64 = 0.2;

/// A drain's share as `--share` and the `#ODFS drain` directive take it: a percentage from 1
/// to 100, with or without `%`; the fraction it stands for.
pub fn parse_share(text: &str) -> Result<f64, String> {
    let digits = text.trim().trim_end_matches('%');
    match digits.parse::<f64>() {
        Ok(p) if (1.0..=100.0).contains(&p) => Ok(p / 100.0),
        _ => Err(format!("share {text:?} is not a percentage from 1 to 100 (e.g. 20 or 20%)")),
    }
}

impl DrainRequest {
    /// The `DrainStart` for node 0's agent: places checked, S3 credentials resolved (as the
    /// stage-out's), the bucket checked, limits settled.
    pub async fn resolve(&self, ctx: &Ctx) -> crate::error::Result<DrainStart> {
        use crate::error::invalid;
        use crate::location::{self, Location};
        let stage = crate::StageRequest {
            src: self.src.clone(),
            dst: self.dst.clone(),
            store: self.store.clone(),
            ..Default::default()
        };
        let o = stage.options()?;
        let mounts = location::odfs_mounts();
        let Location::Odfs(src) = location::parse(&self.src, &mounts)? else {
            return invalid!("drain: {:?} is not a directory of the job's filesystem (odfs:/PATH)", self.src);
        };
        let Location::S3 { bucket, prefix } = location::parse(&self.dst, &mounts)? else {
            return invalid!("drain: {:?} is not s3://BUCKET/PREFIX (a drain uploads to S3)", self.dst);
        };
        let settle = self.settle.unwrap_or(DEFAULT_SETTLE_SECS);
        if !(0.0..=86_400.0).contains(&settle) {
            return invalid!("drain: --settle {settle} must be from 0 to 86400 seconds");
        }
        if self.concurrency == Some(0) {
            return invalid!("drain: --concurrency must be positive");
        }
        if let Some(Err(e)) = self.marker.as_deref().map(check_marker) {
            return invalid!("drain: {e}");
        }
        let creds = crate::s3::resolve_credentials(None).await?;
        let region = crate::s3::resolve_region(o.region.clone()).await;
        let s3 = S3::new(&crate::coordinator::s3_spec(&bucket, &prefix, &o, creds, region));
        match s3.check_bucket().await {
            Ok(()) => {}
            // A store down for now is the drainer's to wait for, as for any upload; a refused
            // bucket or credential is the caller's to fix now.
            Err(e) if e.unreachable => {
                warn!(error = %e, "the drain starts with its store unreachable; it waits for it")
            }
            Err(e) => return Err(e.into()),
        }
        let quarter = |v: f64| if v > 0.0 { v / 4.0 } else { 0.0 };
        Ok(DrainStart {
            src,
            dst: StageEndpoint::S3(s3.spec.clone()),
            uid: ctx.uid,
            gid: ctx.gid,
            groups: ctx.groups.clone(),
            settle_ms: (settle * 1000.0) as u64,
            keep: self.keep,
            limits: odfs_proto::stage::StageLimits {
                concurrency: self.concurrency.unwrap_or(2),
                requests_per_sec: quarter(o.max_requests_per_sec),
                bytes_per_sec: self.max_bandwidth.unwrap_or(o.max_bandwidth / 4),
                share: self.share.unwrap_or(DEFAULT_SHARE),
            },
            split_threshold: o.split_threshold,
            part_size: o.part_size,
            delete_after_upload: self.delete_after_upload,
            marker: self.marker.clone(),
        })
    }
}

/// A `--marker` name: one file name in a checkpoint directory.
pub fn check_marker(name: &str) -> Result<(), String> {
    if name.is_empty() || name == "." || name == ".." || name.contains('/') || name.contains('\0') {
        return Err(format!(
            "--marker {name:?} is not a file name (a name in each checkpoint directory, e.g. COMPLETE)"
        ));
    }
    Ok(())
}

/// The address of node 0's stage agent, where a job's drains run.
async fn node0_agent(client: &Client) -> crate::error::Result<std::net::SocketAddr> {
    let agents = crate::coordinator::agents(client).await?;
    match agents.iter().find(|(node, _)| *node == 0) {
        Some((_, addr)) => Ok(*addr),
        None => crate::error::invalid!("the stage agent of node 0 is not running: drains run there"),
    }
}

/// Starts a drain on node 0's agent.
pub async fn start(client: &Client, ctx: &Ctx, r: &DrainRequest) -> crate::error::Result<DrainStart> {
    use crate::error::During;
    let req = r.resolve(ctx).await?;
    let addr = node0_agent(client).await?;
    client.call(ctx, addr, &req).await.during(|| format!("cannot start the drain of odfs:{}", req.src))?;
    Ok(req)
}

/// Stops the drain of `src` (every drain if None) after its pass in flight, and waits until
/// each has ended (its last manifest written); their last states. Bounded by the caller.
pub async fn stop(client: &Client, ctx: &Ctx, src: Option<String>) -> crate::error::Result<Vec<DrainState>> {
    use crate::error::During;
    let addr = node0_agent(client).await?;
    let asked = client.call(ctx, addr, &DrainStop { src }).await.during(|| "cannot stop the drains".into())?;
    let names: Vec<String> = asked.iter().map(|s| s.src.clone()).collect();
    loop {
        let now = list(client, ctx).await?;
        let mine: Vec<DrainState> = now.into_iter().filter(|s| names.contains(&s.src)).collect();
        if mine.iter().all(|s| !s.running) {
            return Ok(mine);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The drains running (or ended) on node 0's agent.
pub async fn list(client: &Client, ctx: &Ctx) -> crate::error::Result<Vec<DrainState>> {
    use crate::error::During;
    let addr = node0_agent(client).await?;
    client.call(ctx, addr, &DrainList {}).await.during(|| "cannot ask node 0's agent for its drains".into())
}

/// One drain's state in one line.
pub fn describe(s: &DrainState) -> String {
    let mut line = format!(
        "odfs:{} -> {}: {}, {} pending, {} in flight, {} uploaded ({}), {} uploaded again after a change, {} failed",
        s.src,
        s.dst,
        if s.running { "running" } else { "stopped" },
        s.pending,
        s.in_flight,
        s.uploaded,
        odfs_proto::units::bytes(s.uploaded_bytes),
        s.reuploaded,
        s.failed
    );
    if s.retired > 0 {
        line += &format!(", {} checkpoints ({} files) retired by --keep", s.retired_checkpoints, s.retired);
    }
    if s.deleted + s.delete_waiting > 0 {
        line += &format!(", {} deleted after upload ({} open, waiting)", s.deleted, s.delete_waiting);
    }
    if let Some(e) = &s.last_error {
        line += &format!("; last error: {e}");
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(size: u64, mtime: i64, ctime: i64) -> Identity {
        Identity {
            ino: InodeId(5),
            size,
            mtime: Timespec { sec: mtime, nsec: 0 },
            ctime: Timespec { sec: ctime, nsec: 0 },
        }
    }

    /// A manifest of `steps` checkpoints `step_N/` of 4 shards and a COMPLETE, step N's files
    /// modified at time N, all drained, present in SRC.
    fn checkpoints(steps: u32) -> (BTreeMap<String, FileEntry>, BTreeSet<String>) {
        let mut files = BTreeMap::new();
        for n in 1..=steps {
            for f in ["rank0", "rank1", "rank2", "rank3", "COMPLETE"] {
                let e = FileEntry { mtime: n as i64, drained: Some(n as i64), ..FileEntry::default() };
                files.insert(format!("step_{n}/{f}"), e);
            }
        }
        let present = files.keys().cloned().collect();
        (files, present)
    }

    fn tops(plan: &[(String, Vec<String>)]) -> Vec<(&str, usize)> {
        plan.iter().map(|(c, f)| (c.as_str(), f.len())).collect()
    }

    #[test]
    fn keep_retires_whole_checkpoints_older_than_the_last_k_whole_ones() {
        let none = BTreeSet::new();
        let (mut files, mut present) = checkpoints(5);
        // Whole directories go, every file of each.
        let plan = to_retire(&files, &present, &none, None, 2);
        assert_eq!(tops(&plan), [("step_3", 5), ("step_2", 5), ("step_1", 5)]);
        // A newer checkpoint still pending (rank 3 not drained yet) is not counted: the last two
        // whole ones stay.
        let six = FileEntry { mtime: 6, drained: Some(6), ..FileEntry::default() };
        for f in ["rank0", "rank1", "rank2"] {
            files.insert(format!("step_6/{f}"), six.clone());
            present.insert(format!("step_6/{f}"));
        }
        let pending: BTreeSet<String> = ["step_6/rank3".to_string()].into();
        present.insert("step_6/rank3".into());
        assert_eq!(
            tops(&to_retire(&files, &present, &pending, None, 2)),
            [("step_3", 5), ("step_2", 5), ("step_1", 5)]
        );
        // Without a pending file but with --marker, step_6 is still not whole (no COMPLETE).
        present.remove("step_6/rank3");
        assert_eq!(tops(&to_retire(&files, &present, &none, Some("COMPLETE"), 2)).len(), 3);
        // Without --marker it is whole: it counts, and step_4 goes too.
        assert_eq!(tops(&to_retire(&files, &present, &none, None, 2))[0], ("step_4", 5));
        // An old checkpoint part retired (a deletion cut short) is finished; a newer one does
        // not count toward K (DST does not hold it whole).
        let (mut files, present) = checkpoints(5);
        files.get_mut("step_2/rank0").unwrap().retired = true;
        assert_eq!(tops(&to_retire(&files, &present, &none, None, 2)), [("step_3", 5), ("step_2", 4), ("step_1", 5)]);
        let (mut files, present) = checkpoints(5);
        files.get_mut("step_5/rank0").unwrap().retired = true;
        assert_eq!(tops(&to_retire(&files, &present, &none, None, 2)), [("step_2", 5), ("step_1", 5)]);
        // An old checkpoint not whole (a file changed since its upload) is never touched.
        let (files, present) = checkpoints(5);
        let pending: BTreeSet<String> = ["step_1/rank2".to_string()].into();
        assert_eq!(tops(&to_retire(&files, &present, &pending, None, 2)), [("step_3", 5), ("step_2", 5)]);
        // Files at the top are checkpoints of their own, as before; files gone from SRC count not.
        let mut files = BTreeMap::new();
        for n in 1..=4 {
            files.insert(format!("ckpt-{n}.pt"), FileEntry { mtime: n, drained: Some(n), ..FileEntry::default() });
        }
        let present: BTreeSet<String> = ["ckpt-2.pt", "ckpt-3.pt", "ckpt-4.pt"].map(String::from).into();
        assert_eq!(tops(&to_retire(&files, &present, &none, Some("COMPLETE"), 2)), [("ckpt-2.pt", 1)]);
    }

    #[test]
    fn a_marker_waits_for_the_rest_of_its_checkpoint() {
        let pending: BTreeSet<String> = ["s1/COMPLETE", "s1/rank0", "s2/COMPLETE", "COMPLETE"].map(String::from).into();
        assert!(held_marker("s1/COMPLETE", "COMPLETE", &pending), "rank0 is not drained yet");
        assert!(!held_marker("s2/COMPLETE", "COMPLETE", &pending), "all else of s2 is drained");
        assert!(!held_marker("COMPLETE", "COMPLETE", &pending), "a file at the top is its own checkpoint");
        assert!(!held_marker("s1/rank0", "COMPLETE", &pending));
        for bad in ["", ".", "..", "a/b"] {
            assert!(check_marker(bad).unwrap_err().contains("is not a file name"), "{bad:?}");
        }
    }

    #[test]
    fn a_share_is_a_percentage_from_1_to_100() {
        assert_eq!(parse_share("20"), Ok(0.2));
        assert_eq!(parse_share("20%"), Ok(0.2));
        assert_eq!(parse_share("100"), Ok(1.0), "100: no gate");
        for bad in ["0", "0.5", "101", "-5", "most", ""] {
            let e = parse_share(bad).unwrap_err();
            assert!(e.contains("is not a percentage from 1 to 100"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn a_file_settles_only_after_its_attributes_stay_put_for_the_settle_time() {
        let settle = Duration::from_secs(3);
        let t0 = Instant::now();
        let wall = Timespec { sec: 1000, nsec: 0 };
        // Seen just now, changed long ago: not yet (the drainer has not watched it long enough).
        let w = Watch { id: id(10, 900, 900), since: t0 };
        assert!(!settled(&w, t0 + Duration::from_secs(2), wall, settle));
        assert!(settled(&w, t0 + Duration::from_secs(3), wall, settle));
        // Watched long enough, but changed a second ago (a close just published it): not yet.
        let w = Watch { id: id(10, 999, 999), since: t0 };
        assert!(!settled(&w, t0 + Duration::from_secs(10), wall, settle));
        // A chmod a second ago moves only ctime: not yet either.
        let w = Watch { id: id(10, 900, 999), since: t0 };
        assert!(!settled(&w, t0 + Duration::from_secs(10), wall, settle));
        // A clock that puts the change in the future counts as just now.
        let w = Watch { id: id(10, 1005, 1005), since: t0 };
        assert!(!settled(&w, t0 + Duration::from_secs(10), wall, settle));
    }
}
