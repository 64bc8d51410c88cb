//! The coordinator of one stage-in or stage-out: lists the source, refuses unsafe names, skips
//! what a previous run completed, plans the work over every node's agent (whole files
//! balanced by bytes, large files split into ranges or multipart parts), drives the agents,
//! verifies what they report against the source, and writes the manifest (and, for
//! stage-out, the completion marker, last).
//!
//! Owns planning, cross-agent verification and manifests. Must not move file data itself:
//! the agents do, on their nodes.

use crate::keys::{check_relative, join, parents};
use crate::location::Location;
use crate::manifest::{self, FileEntry, Manifest};
use crate::posix;
use crate::s3::{self, multipart_etag, S3};
use anyhow::{anyhow, bail, Context, Result};
use odfs_client::{Client, Ctx};
use odfs_proto::meta::{FileKind, SetAttr, SetTime};
use odfs_proto::mgmt::ServiceKind;
use odfs_proto::stage::{
    ItemResult, S3Spec, StageCounters, StageEndpoint, StageLimits, StagePoll, StageStart, WorkItem,
};
use odfs_proto::{units, InodeId, Timespec};
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
    /// Files at least this large are split over agents (ranges in, multipart parts out).
    pub split_threshold: u64,
    /// Size of one range (stage-in) or multipart part (stage-out).
    pub part_size: u64,
    /// Report progress as plain lines (no terminal), every this often.
    pub log_every: Duration,
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
            split_threshold: 64 << 20,
            part_size: 16 << 20,
            log_every: Duration::from_secs(5),
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
    pub directories: u64,
    /// Counters per agent: (node, counters).
    pub agents: Vec<(u32, StageCounters)>,
    /// Files that could not be copied or verified, with the reason.
    pub failed: BTreeMap<String, String>,
    /// Source names refused as unsafe paths, with the reason.
    pub refused: BTreeMap<String, String>,
    pub manifest: String,
    pub elapsed: Duration,
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
struct SrcFile {
    rel: String,
    size: u64,
    mtime: Timespec,
    mode: Option<u32>,
    etag: Option<String>,
}

/// The stage agents of the filesystem, by node.
async fn agents(client: &Client) -> Result<Vec<(u32, SocketAddr)>> {
    let view = client.cluster().refresh().await?;
    let mut a: Vec<(u32, SocketAddr)> = view
        .services
        .iter()
        .filter(|s| s.kind == ServiceKind::Agent && s.online)
        .filter_map(|s| Some((s.node, s.addr?)))
        .collect();
    a.sort();
    if a.is_empty() {
        bail!("no stage agent is running in this filesystem (every node starts one with its daemons)");
    }
    Ok(a)
}

/// Splits items over `n` agents, largest first onto the least-loaded agent (by bytes, then
/// by count), so every agent moves about the same share.
fn assign(items: &[WorkItem], n: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..items.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(items[i].bytes()));
    let mut load = vec![(0u64, 0usize); n];
    let mut out = vec![Vec::new(); n];
    for i in order {
        let a = (0..n).min_by_key(|&a| load[a]).expect("at least one agent");
        load[a].0 += items[i].bytes();
        load[a].1 += 1;
        out[a].push(i);
    }
    out
}

struct Progress {
    bar: Option<indicatif::ProgressBar>,
    kind: &'static str,
    total: u64,
    last_log: Instant,
    every: Duration,
    start: Instant,
}

impl Progress {
    fn new(kind: &'static str, total: u64, every: Duration) -> Progress {
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

    fn update(&mut self, per_agent: &[(u32, StageCounters)]) {
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

    fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}

/// Everything one pass of work needs.
struct Pass<'a> {
    client: &'a Client,
    ctx: &'a Ctx,
    agents: &'a [(u32, SocketAddr)],
    src: &'a StageEndpoint,
    dst: &'a StageEndpoint,
    limits: StageLimits,
}

/// Runs `items` on the agents and returns each item's result (in order) and the counters of
/// every agent.
async fn run_pass(
    p: &Pass<'_>,
    items: Vec<WorkItem>,
    progress: &mut Progress,
) -> Result<(Vec<ItemResult>, Vec<(u32, StageCounters)>)> {
    let n = p.agents.len();
    let plan = assign(&items, n);
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
            .with_context(|| format!("cannot hand work to the stage agent of node {node} ({addr})"))?;
        started.push(a);
    }
    let mut results: Vec<ItemResult> = vec![ItemResult::default(); items.len()];
    let mut counters: HashMap<usize, StageCounters> = HashMap::new();
    let mut finished: BTreeSet<usize> = BTreeSet::new();
    let mut silent_since: HashMap<usize, Instant> = HashMap::new();
    while finished.len() < started.len() {
        tokio::time::sleep(Duration::from_millis(200)).await;
        for &a in &started {
            if finished.contains(&a) {
                continue;
            }
            let (node, addr) = p.agents[a];
            match p.client.call(p.ctx, addr, &StagePoll { run }).await {
                Ok(st) => {
                    silent_since.remove(&a);
                    counters.insert(a, st.counters);
                    if st.finished {
                        for r in st.results {
                            let global = plan[a][r.index as usize];
                            results[global] = ItemResult { index: global as u32, ..r };
                        }
                        finished.insert(a);
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
    }
    let per_agent = p
        .agents
        .iter()
        .enumerate()
        .map(|(a, (node, _))| (*node, counters.get(&a).copied().unwrap_or_default()))
        .collect();
    Ok((results, per_agent))
}

fn add_counters(into: &mut Vec<(u32, StageCounters)>, more: &[(u32, StageCounters)]) {
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

fn s3_spec(
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
    }
}

async fn s3_for(bucket: &str, prefix: &str, o: &StageOptions) -> Result<S3> {
    let creds = s3::resolve_credentials(None).await?;
    let region = s3::resolve_region(o.region.clone()).await;
    let s3 = S3::new(&s3_spec(bucket, prefix, o, creds, region));
    s3.check_bucket().await?;
    Ok(s3)
}

fn limits(o: &StageOptions, agents: usize) -> StageLimits {
    StageLimits {
        concurrency: o.concurrency,
        requests_per_sec: o.max_requests_per_sec / agents as f64,
        bytes_per_sec: o.max_bandwidth / agents as u64,
    }
}

/// Reads a whole small odfs file, if it exists.
async fn read_odfs_file(client: &Client, ctx: &Ctx, path: &str) -> Result<Option<Vec<u8>>> {
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

async fn write_odfs_file(client: &Client, ctx: &Ctx, path: &str, data: &[u8]) -> Result<()> {
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
async fn make_dirs(client: &Client, ctx: &Ctx, root: &str, dirs: &BTreeSet<String>) -> Result<()> {
    let top = client.mkdir_all(ctx, root, 0o755).await.with_context(|| format!("cannot create odfs:{root}"))?;
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
            client.mkdir_all(ctx, &path, 0o755).await.with_context(|| format!("cannot create odfs:{path}"))
        }))
        .await;
        for r in results {
            r?;
        }
    }
    Ok(())
}

/// Stage-in: S3 or a POSIX tree into odfs.
pub async fn stage_in(
    client: &Client,
    ctx: &Ctx,
    src: &Location,
    dst_root: &str,
    o: &StageOptions,
) -> Result<StageReport> {
    let start = Instant::now();
    let agents = agents(client).await?;
    let mut report = StageReport { kind: "stage-in", ..StageReport::default() };
    let mut dirs: BTreeSet<String> = BTreeSet::new();
    let mut files: Vec<SrcFile> = Vec::new();
    let (src_ep, src_name) = match src {
        Location::S3 { bucket, prefix } => {
            let s3 = s3_for(bucket, prefix, o).await?;
            let mut listed = s3.list(prefix).await?;
            s3.fill_etags(&mut listed).await?;
            for obj in listed {
                let rel = &obj.key[prefix.len()..];
                if rel.is_empty() {
                    continue;
                }
                if let Err(e) = check_relative(rel) {
                    report.refused.insert(obj.key.clone(), e.to_string());
                    continue;
                }
                if let Some(d) = rel.strip_suffix('/') {
                    dirs.insert(d.to_string());
                    continue;
                }
                files.push(SrcFile {
                    rel: rel.to_string(),
                    size: obj.size,
                    mtime: obj.mtime,
                    mode: None,
                    etag: Some(obj.etag),
                });
            }
            (StageEndpoint::S3(s3.spec.clone()), src.to_string())
        }
        Location::Posix(root) => {
            let (entries, skipped) = posix::walk(ctx, root).await.map_err(|e| anyhow!("cannot read {e}"))?;
            for s in skipped {
                report
                    .refused
                    .insert(s, "not a regular file or directory (symlinks and devices are not staged)".into());
            }
            for e in entries {
                if let Err(why) = check_relative(&e.rel) {
                    report.refused.insert(e.rel.clone(), why.to_string());
                } else if e.dir {
                    dirs.insert(e.rel);
                } else {
                    files.push(SrcFile { rel: e.rel, size: e.size, mtime: e.mtime, mode: Some(e.mode), etag: None });
                }
            }
            (StageEndpoint::Posix(root.to_string_lossy().into_owned()), src.to_string())
        }
        Location::Odfs(_) => bail!("stage-in copies into odfs from S3 or a POSIX path; the source is odfs itself"),
    };
    files.retain(|f| !manifest::reserved(&f.rel));
    for f in &files {
        for p in parents(&f.rel) {
            dirs.insert(p.to_string());
        }
    }
    let manifest_path = join(dst_root, manifest::STAGE_IN_MANIFEST);
    report.manifest = format!("odfs:{manifest_path}");

    // What a previous run completed: same source ETag or mtime, same size, file present.
    make_dirs(client, ctx, dst_root, &dirs).await?;
    let previous = read_odfs_file(client, ctx, &manifest_path).await?.and_then(|d| Manifest::parse(&d));
    let mut done: BTreeMap<String, FileEntry> = BTreeMap::new();
    if let Some(prev) = previous.filter(|m| m.source == src_name) {
        for f in &files {
            if let Some(e) = prev.files.get(&f.rel) {
                let same = e.size == f.size && (f.etag.is_none() || e.etag == f.etag) && e.mtime == f.mtime.sec;
                if same {
                    if let Ok(a) = client.resolve(ctx, &join(dst_root, &f.rel), true).await {
                        if a.kind == FileKind::File && a.size == f.size {
                            done.insert(f.rel.clone(), e.clone());
                        }
                    }
                }
            }
        }
    }
    report.skipped = done.len() as u64;
    let todo: Vec<&SrcFile> = files.iter().filter(|f| !done.contains_key(&f.rel)).collect();

    // Large files are created at full size here, then filled in ranges by every agent.
    let mut items = Vec::new();
    let mut ranged: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for f in &todo {
        if f.size >= o.split_threshold {
            let path = join(dst_root, &f.rel);
            let (parent, name) = client.resolve_parent(ctx, &path).await?;
            let (r, h) =
                client.create_open(ctx, parent.ino, &name, f.mode.unwrap_or(0o644) & 0o7777, false, None).await?;
            // An earlier copy's bytes must not survive as this one's: empty it first.
            if !r.created && r.attr.size > 0 {
                h.truncate(0).await?;
            }
            h.truncate(f.size).await?;
            h.close().await?;
            let mut off = 0;
            while off < f.size {
                let len = o.part_size.min(f.size - off);
                ranged.entry(f.rel.clone()).or_default().push(items.len());
                items.push(WorkItem::Range { rel: f.rel.clone(), offset: off, len });
                off += len;
            }
        } else {
            items.push(WorkItem::Whole { rel: f.rel.clone(), size: f.size, mtime: f.mtime, mode: f.mode });
        }
    }
    let total: u64 = items.iter().map(|i| i.bytes()).sum();
    let mut progress = Progress::new("stage-in", total, o.log_every);
    let dst_ep = StageEndpoint::Odfs(dst_root.to_string());
    let pass = Pass { client, ctx, agents: &agents, src: &src_ep, dst: &dst_ep, limits: limits(o, agents.len()) };
    let (results, per_agent) = run_pass(&pass, items.clone(), &mut progress).await?;
    report.agents = per_agent;

    let by_rel: HashMap<&str, &SrcFile> = todo.iter().map(|f| (f.rel.as_str(), *f)).collect();
    let mut entries: BTreeMap<String, FileEntry> = done;
    for (it, r) in items.iter().zip(&results) {
        if let (WorkItem::Whole { rel, size, mtime, .. }, _) = (it, r) {
            match &r.error {
                Some(e) => {
                    report.failed.insert(rel.clone(), e.clone());
                }
                None => {
                    report.files += 1;
                    report.bytes += size;
                    entries.insert(
                        rel.clone(),
                        FileEntry {
                            size: *size,
                            etag: r.etag.clone(),
                            md5: r.md5.map(hex::encode),
                            crc32c: r.crc32c.map(|c| format!("{c:08x}")),
                            mtime: mtime.sec,
                            verified: r.verified.clone().unwrap_or_else(|| "size".into()),
                        },
                    );
                }
            }
        }
    }

    // Ranged files: every range must have landed; then one agent reads each file back and its
    // digests must match the ranges' combined CRC32C (and the ETag when it is an MD5).
    let mut digest_items = Vec::new();
    let mut digest_want: Vec<(String, u32)> = Vec::new();
    for (rel, idx) in &ranged {
        if let Some(e) = idx.iter().find_map(|&i| results[i].error.clone()) {
            report.failed.insert(rel.clone(), e);
            continue;
        }
        let mut crc = 0u32;
        for &i in idx {
            let len = items[i].bytes() as usize;
            crc = crc32c::crc32c_combine(crc, results[i].crc32c.unwrap_or(0), len);
        }
        digest_items.push(WorkItem::Digest { rel: rel.clone(), size: by_rel[rel.as_str()].size });
        digest_want.push((rel.clone(), crc));
    }
    if !digest_items.is_empty() {
        let (dres, per_agent) = run_pass(&pass, digest_items, &mut progress).await?;
        add_counters(&mut report.agents, &per_agent);
        for ((rel, want_crc), r) in digest_want.iter().zip(dres) {
            let f = by_rel[rel.as_str()];
            let verdict = match (&r.error, r.crc32c, r.md5) {
                (Some(e), _, _) => Err(e.clone()),
                (None, Some(crc), _) if crc != *want_crc => {
                    Err(format!("read back CRC32C {crc:08x}, but the ranges received have {want_crc:08x}"))
                }
                (None, _, Some(md5)) => match &f.etag {
                    Some(etag) if s3::is_md5_etag(etag) && !etag.eq_ignore_ascii_case(&hex::encode(md5)) => {
                        Err(format!("MD5 {} does not match the ETag {etag}", hex::encode(md5)))
                    }
                    Some(etag) if s3::is_md5_etag(etag) => Ok("crc32c+md5"),
                    _ => Ok("crc32c"),
                },
                (None, _, None) => Err("no digest reported".into()),
            };
            match verdict {
                Err(e) => {
                    report.failed.insert(rel.clone(), e);
                }
                Ok(how) => {
                    let path = join(dst_root, rel);
                    let a = client.resolve(ctx, &path, true).await?;
                    let set = SetAttr { ino: a.ino, mtime: Some(SetTime::At(f.mtime)), ..SetAttr::default() };
                    client.setattr(ctx, set).await?;
                    report.files += 1;
                    report.bytes += f.size;
                    entries.insert(
                        rel.clone(),
                        FileEntry {
                            size: f.size,
                            etag: f.etag.clone(),
                            md5: r.md5.map(hex::encode),
                            crc32c: Some(format!("{want_crc:08x}")),
                            mtime: f.mtime.sec,
                            verified: how.into(),
                        },
                    );
                }
            }
        }
    }
    progress.finish();
    report.directories = dirs.len() as u64;
    let m = Manifest {
        version: 1,
        kind: "stage-in".into(),
        source: src_name,
        destination: format!("odfs:{dst_root}"),
        written: Timespec::now().sec,
        files: entries,
        directories: dirs.into_iter().collect(),
        refused: report.refused.clone(),
    };
    write_odfs_file(client, ctx, &manifest_path, &m.to_json()).await.context("cannot write the manifest")?;
    report.elapsed = start.elapsed();
    Ok(report)
}

/// Every file and directory below `root` in odfs.
async fn walk_odfs(client: &Client, ctx: &Ctx, root: &str) -> Result<(Vec<SrcFile>, BTreeSet<String>)> {
    let top = client.resolve(ctx, root, true).await.with_context(|| format!("odfs:{root}"))?;
    anyhow::ensure!(top.kind == FileKind::Dir, "odfs:{root} is not a directory");
    let mut files = Vec::new();
    let mut dirs = BTreeSet::new();
    let mut stack: Vec<(InodeId, String)> = vec![(top.ino, String::new())];
    while let Some((ino, rel)) = stack.pop() {
        for e in client.readdir_all(ctx, ino, true).await? {
            let name = String::from_utf8(e.name.clone())
                .map_err(|_| anyhow!("odfs:{root}/{rel}: a name that is not UTF-8"))?;
            let child = if rel.is_empty() { name } else { format!("{rel}/{name}") };
            let a = match e.attr {
                Some(a) => a,
                None => client.getattr(ctx, e.ino).await?,
            };
            match a.kind {
                FileKind::Dir => {
                    dirs.insert(child.clone());
                    stack.push((e.ino, child));
                }
                FileKind::File => files.push(SrcFile {
                    rel: child,
                    size: a.size,
                    mtime: a.mtime,
                    mode: Some(a.mode & 0o7777),
                    etag: None,
                }),
                _ => {}
            }
        }
    }
    Ok((files, dirs))
}

/// Stage-out: an odfs tree to S3 or a POSIX directory. Nothing is deleted anywhere.
pub async fn stage_out(
    client: &Client,
    ctx: &Ctx,
    src_root: &str,
    dst: &Location,
    o: &StageOptions,
) -> Result<StageReport> {
    let start = Instant::now();
    let agents = agents(client).await?;
    let mut report = StageReport { kind: "stage-out", ..StageReport::default() };
    let (mut files, dirs) = walk_odfs(client, ctx, src_root).await?;
    // A stage-in manifest at the top is the record of an earlier stage, not output.
    files.retain(|f| !manifest::reserved(&f.rel));
    report.directories = dirs.len() as u64;
    let src_ep = StageEndpoint::Odfs(src_root.to_string());
    match dst {
        Location::S3 { bucket, prefix } => {
            stage_out_s3(client, ctx, &agents, src_ep, files, dirs, bucket, prefix, o, report, start).await
        }
        Location::Posix(root) => {
            let dst_ep = StageEndpoint::Posix(root.to_string_lossy().into_owned());
            let items: Vec<WorkItem> = files
                .iter()
                .map(|f| WorkItem::Whole { rel: f.rel.clone(), size: f.size, mtime: f.mtime, mode: f.mode })
                .collect();
            for d in &dirs {
                let p = root.join(d);
                posix::as_user(ctx, move || std::fs::create_dir_all(&p))
                    .await
                    .with_context(|| format!("cannot create {}", root.join(d).display()))?;
            }
            let total = items.iter().map(|i| i.bytes()).sum();
            let mut progress = Progress::new("stage-out", total, o.log_every);
            let pass =
                Pass { client, ctx, agents: &agents, src: &src_ep, dst: &dst_ep, limits: limits(o, agents.len()) };
            let (results, per_agent) = run_pass(&pass, items, &mut progress).await?;
            progress.finish();
            report.agents = per_agent;
            let mut m = Manifest {
                version: 1,
                kind: "stage-out".into(),
                source: format!("odfs:{src_root}"),
                destination: dst.to_string(),
                ..Manifest::default()
            };
            for (f, r) in files.iter().zip(results) {
                match r.error {
                    Some(e) => {
                        report.failed.insert(f.rel.clone(), e);
                    }
                    None => {
                        report.files += 1;
                        report.bytes += f.size;
                        m.files.insert(
                            f.rel.clone(),
                            FileEntry {
                                size: f.size,
                                etag: None,
                                md5: r.md5.map(hex::encode),
                                crc32c: r.crc32c.map(|c| format!("{c:08x}")),
                                mtime: f.mtime.sec,
                                verified: "size".into(),
                            },
                        );
                    }
                }
            }
            m.directories = dirs.into_iter().collect();
            m.written = Timespec::now().sec;
            let mpath = root.join(manifest::STAGE_OUT_MANIFEST);
            report.manifest = mpath.display().to_string();
            let data = m.to_json();
            posix::as_user(ctx, move || std::fs::write(&mpath, data)).await.context("cannot write the manifest")?;
            if report.failed.is_empty() {
                let marker = root.join(manifest::STAGE_OUT_MARKER);
                posix::as_user(ctx, move || std::fs::write(&marker, b"complete\n"))
                    .await
                    .context("cannot write the completion marker")?;
            }
            report.elapsed = start.elapsed();
            Ok(report)
        }
        Location::Odfs(_) => bail!("stage-out copies from odfs to S3 or a POSIX path; the destination is odfs itself"),
    }
}

#[allow(clippy::too_many_arguments)]
async fn stage_out_s3(
    client: &Client,
    ctx: &Ctx,
    agents: &[(u32, SocketAddr)],
    src_ep: StageEndpoint,
    files: Vec<SrcFile>,
    dirs: BTreeSet<String>,
    bucket: &str,
    prefix: &str,
    o: &StageOptions,
    mut report: StageReport,
    start: Instant,
) -> Result<StageReport> {
    let s3 = s3_for(bucket, prefix, o).await?;
    let dst_ep = StageEndpoint::S3(s3.spec.clone());
    let pass = Pass { client, ctx, agents, src: &src_ep, dst: &dst_ep, limits: limits(o, agents.len()) };
    let part_of = |size: u64| if size >= o.split_threshold { o.part_size } else { 0 };
    report.manifest = format!("s3://{bucket}/{prefix}{}", manifest::STAGE_OUT_MANIFEST);
    let mut progress = Progress::new("stage-out", files.iter().map(|f| f.size).sum(), o.log_every);

    // A re-run skips objects whose size and ETag already match the local file.
    let mut listed = s3.list(prefix).await?;
    s3.fill_etags(&mut listed).await?;
    let existing: HashMap<String, s3::Object> =
        listed.into_iter().map(|obj| (obj.key[prefix.len()..].to_string(), obj)).collect();
    let candidates: Vec<&SrcFile> =
        files.iter().filter(|f| existing.get(&f.rel).is_some_and(|e| e.size == f.size)).collect();
    let mut skip: BTreeMap<String, (String, ItemResult)> = BTreeMap::new();
    if !candidates.is_empty() {
        let items = candidates
            .iter()
            .map(|f| WorkItem::SourceDigest { rel: f.rel.clone(), size: f.size, part_size: part_of(f.size) })
            .collect();
        let (res, per_agent) = run_pass(&pass, items, &mut progress).await?;
        add_counters(&mut report.agents, &per_agent);
        for (f, r) in candidates.iter().zip(res) {
            let want = if part_of(f.size) > 0 { r.multipart_etag.clone() } else { r.md5.map(hex::encode) };
            if want.is_some() && want.as_deref() == Some(existing[&f.rel].etag.as_str()) {
                skip.insert(f.rel.clone(), (existing[&f.rel].etag.clone(), r));
            }
        }
    }
    report.skipped = skip.len() as u64;

    let mut items = Vec::new();
    let mut uploads: BTreeMap<String, (String, Vec<usize>)> = BTreeMap::new();
    let mut whole: Vec<(usize, &SrcFile)> = Vec::new();
    for f in files.iter().filter(|f| !skip.contains_key(&f.rel)) {
        let ps = part_of(f.size);
        if ps > 0 {
            let key = s3.key(&f.rel);
            let id = s3.create_multipart(&key).await?;
            let mut idx = Vec::new();
            let (mut off, mut part) = (0, 1);
            while off < f.size {
                let len = ps.min(f.size - off);
                idx.push(items.len());
                items.push(WorkItem::Part { rel: f.rel.clone(), upload_id: id.clone(), part, offset: off, len });
                off += len;
                part += 1;
            }
            uploads.insert(f.rel.clone(), (id, idx));
        } else {
            whole.push((items.len(), f));
            items.push(WorkItem::Whole { rel: f.rel.clone(), size: f.size, mtime: f.mtime, mode: f.mode });
        }
    }
    let (results, per_agent) = run_pass(&pass, items.clone(), &mut progress).await?;
    add_counters(&mut report.agents, &per_agent);
    progress.finish();

    // Expected ETag of every object this run wrote, checked against a listing afterwards.
    let mut expect: BTreeMap<String, (String, ItemResult)> = BTreeMap::new();
    for (i, f) in &whole {
        let r = &results[*i];
        match &r.error {
            Some(e) => {
                report.failed.insert(f.rel.clone(), e.clone());
            }
            None => {
                expect.insert(f.rel.clone(), (r.md5.map(hex::encode).unwrap_or_default(), r.clone()));
            }
        }
    }
    for (rel, (id, idx)) in &uploads {
        let key = s3.key(rel);
        if let Some(e) = idx.iter().find_map(|&i| results[i].error.clone()) {
            s3.abort_multipart(&key, id).await;
            report.failed.insert(rel.clone(), e);
            continue;
        }
        let parts: Vec<(i32, String)> = idx
            .iter()
            .map(|&i| match &items[i] {
                WorkItem::Part { part, .. } => (*part, results[i].etag.clone().unwrap_or_default()),
                _ => unreachable!("only parts are recorded for an upload"),
            })
            .collect();
        let md5s: Vec<[u8; 16]> = idx.iter().map(|&i| results[i].md5.unwrap_or_default()).collect();
        match s3.complete_multipart(&key, id, &parts).await {
            Ok(_) => {
                let crc = idx.iter().fold(0u32, |c, &i| {
                    crc32c::crc32c_combine(c, results[i].crc32c.unwrap_or(0), items[i].bytes() as usize)
                });
                expect.insert(
                    rel.clone(),
                    (multipart_etag(&md5s), ItemResult { crc32c: Some(crc), ..ItemResult::default() }),
                );
            }
            Err(e) => {
                s3.abort_multipart(&key, id).await;
                report.failed.insert(rel.clone(), e.to_string());
            }
        }
    }
    // Empty directories as zero-byte "dir/" markers.
    let nonempty: BTreeSet<&str> = files.iter().flat_map(|f| parents(&f.rel)).collect();
    for d in
        dirs.iter().filter(|d| !nonempty.contains(d.as_str()) && !dirs.iter().any(|x| x.starts_with(&format!("{d}/"))))
    {
        if let Err(e) = s3.put(&s3.key(&format!("{d}/")), Vec::new(), &md5_of(b""), 0).await {
            report.failed.insert(format!("{d}/"), e.to_string());
        }
    }

    // Check each object as the server has it now.
    let listed = match s3.list(prefix).await {
        Ok(mut l) => s3.fill_etags(&mut l).await.map(|()| l),
        Err(e) => Err(e),
    };
    let now: HashMap<String, s3::Object> = match listed {
        Ok(l) => l.into_iter().map(|obj| (obj.key[prefix.len()..].to_string(), obj)).collect(),
        Err(e) => {
            for rel in expect.keys() {
                report.failed.entry(rel.clone()).or_insert_with(|| format!("not verified: {e}"));
            }
            HashMap::new()
        }
    };
    let by_rel: HashMap<&str, &SrcFile> = files.iter().map(|f| (f.rel.as_str(), f)).collect();
    let mut m = Manifest {
        version: 1,
        kind: "stage-out".into(),
        source: format!(
            "odfs:{}",
            match &src_ep {
                StageEndpoint::Odfs(p) => p.as_str(),
                _ => "",
            }
        ),
        destination: format!("s3://{bucket}/{prefix}"),
        ..Manifest::default()
    };
    for (rel, (etag, r)) in skip {
        let f = by_rel[rel.as_str()];
        m.files.insert(rel, uploaded(f, etag, &r));
    }
    for (rel, (want, r)) in expect {
        if report.failed.contains_key(&rel) {
            continue;
        }
        let f = by_rel[rel.as_str()];
        let verdict = match now.get(&rel) {
            None => Err("missing from the bucket after upload".to_string()),
            Some(obj) if obj.size != f.size => {
                Err(format!("the bucket holds {} bytes, {} were sent", obj.size, f.size))
            }
            Some(obj)
                if (s3::is_md5_etag(&obj.etag) || obj.etag.contains('-')) && !obj.etag.eq_ignore_ascii_case(&want) =>
            {
                Err(format!("ETag {} in the bucket, {want} expected", obj.etag))
            }
            Some(obj) => Ok(obj.etag.clone()),
        };
        match verdict {
            Err(e) => {
                report.failed.insert(rel, e);
            }
            Ok(etag) => {
                report.files += 1;
                report.bytes += f.size;
                m.files.insert(rel, uploaded(f, etag, &r));
            }
        }
    }
    m.directories = dirs.into_iter().collect();
    m.refused = report.refused.clone();
    m.written = Timespec::now().sec;
    let data = m.to_json();
    let key = s3.key(manifest::STAGE_OUT_MANIFEST);
    let (md5, crc) = digests(&data);
    if let Err(e) = s3.put(&key, data, &md5, crc).await {
        report.failed.insert(manifest::STAGE_OUT_MANIFEST.into(), format!("cannot upload the manifest: {e}"));
    }
    if report.failed.is_empty() {
        let body = format!(
            "{{\"files\": {}, \"bytes\": {}, \"manifest\": \"{}\"}}\n",
            m.files.len(),
            m.files.values().map(|e| e.size).sum::<u64>(),
            manifest::STAGE_OUT_MANIFEST
        )
        .into_bytes();
        let (md5, crc) = digests(&body);
        s3.put(&s3.key(manifest::STAGE_OUT_MARKER), body, &md5, crc)
            .await
            .context("cannot upload the completion marker")?;
    } else {
        warn!(failed = report.failed.len(), "stage-out incomplete: no completion marker written");
    }
    report.elapsed = start.elapsed();
    Ok(report)
}

/// The manifest entry of an object whose ETag in the bucket matched what was sent.
fn uploaded(f: &SrcFile, etag: String, r: &ItemResult) -> FileEntry {
    FileEntry {
        size: f.size,
        etag: Some(etag),
        md5: r.md5.map(hex::encode),
        crc32c: r.crc32c.map(|c| format!("{c:08x}")),
        mtime: f.mtime.sec,
        verified: "etag".into(),
    }
}

fn digests(data: &[u8]) -> ([u8; 16], u32) {
    let mut d = crate::digest::Digests::default();
    d.update(data);
    d.finish()
}

fn md5_of(data: &[u8]) -> [u8; 16] {
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
        let plan = assign(&items, 4);
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
