//! Stage-in: S3 or a POSIX tree into odfs, in named steps: list the source → make the
//! directories → skip what a previous run completed → plan (large files created at full size
//! and split into ranges) → transfer on every agent → verify the ranged files (the CRC32C stored
//! returned for every write, or read back where an MD5 ETag needs it; the ranges' CRC32C
//! combined) → write the manifest.

use super::{
    agents, make_dirs, read_odfs_file, run_pass, run_pass_noting, s3_for, write_odfs_file, ListingProgress, Pass,
    Progress, SrcFile, StageOptions, StageReport,
};
use crate::error::{invalid, During, Result, StageError};
use crate::keys::{check_relative, join, parents};
use crate::location::Location;
use crate::manifest::{self, FileEntry, Manifest};
use crate::{posix, s3};
use odfs_client::{Client, Ctx};
use odfs_proto::meta::{FileKind, SetAttr, SetTime};
use odfs_proto::stage::{ItemResult, StageEndpoint, WorkItem};
use odfs_proto::Timespec;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};
use tracing::warn;

/// What the source holds, as the agents will be told to read it.
struct Listing {
    files: Vec<SrcFile>,
    dirs: BTreeSet<String>,
    endpoint: StageEndpoint,
    /// The source as the manifest names it.
    name: String,
    /// The S3 source, to ask for the ETags its listing left out.
    s3: Option<s3::S3>,
}

impl Listing {
    /// Asks the source for the ETags its listing left out (some S3-compatible servers list
    /// without them), a HEAD each, of the files `needs` names only: those whose ETag decides
    /// something (a skip, a split file's verification). A HEAD of every object would cost a
    /// request per file before the first byte moves; a whole file's GET returns its ETag.
    async fn fill_etags(&mut self, needs: impl Fn(&SrcFile) -> bool) -> Result<()> {
        let Some(s3) = &self.s3 else { return Ok(()) };
        let missing: Vec<usize> =
            (0..self.files.len()).filter(|&i| self.files[i].etag.is_none() && needs(&self.files[i])).collect();
        let mut objs: Vec<s3::Object> = missing
            .iter()
            .map(|&i| {
                let f = &self.files[i];
                s3::Object { key: s3.key(&f.rel), size: f.size, etag: String::new(), mtime: f.mtime }
            })
            .collect();
        s3.fill_etags(&mut objs).await?;
        for (i, obj) in missing.into_iter().zip(objs) {
            self.files[i].etag = Some(obj.etag);
        }
        Ok(())
    }
}

/// The work of one run: whole files, and the ranges of each split file by index into `items`.
struct Plan {
    items: Vec<WorkItem>,
    ranged: BTreeMap<String, Vec<usize>>,
}

/// One stage-in between its listing and its manifest.
struct StageIn<'a> {
    client: &'a Client,
    ctx: &'a Ctx,
    dst_root: &'a str,
    report: StageReport,
    /// The manifest's entries: files done before and files verified now.
    entries: BTreeMap<String, FileEntry>,
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
    refuse_sealed(client, ctx, dst_root).await?;
    let agents = agents(client).await?;
    let mut report = StageReport { kind: "stage-in", ..StageReport::default() };
    let mut listing = list_source(ctx, src, o, &mut report).await?;
    if listing.files.is_empty() && report.refused.is_empty() {
        report.empty_source = Some(listing.name.clone());
    }
    let manifest_path = join(dst_root, manifest::STAGE_IN_MANIFEST);
    report.manifest = format!("odfs:{manifest_path}");
    make_dirs(client, ctx, dst_root, &listing.dirs).await?;
    let done = done_before(client, ctx, dst_root, &manifest_path, &mut listing).await?;
    report.skipped = done.len() as u64;
    let mut run = StageIn { client, ctx, dst_root, report, entries: done };
    listing.fill_etags(|f| is_split(f, o)).await?;
    let todo: Vec<&SrcFile> = listing.files.iter().filter(|f| !run.entries.contains_key(&f.rel)).collect();
    let plan = run.plan(&todo, o).await?;

    let total: u64 = plan.items.iter().map(|i| i.bytes()).sum();
    let mut progress = Progress::new("stage-in", total, o.log_every);
    let dst_ep = StageEndpoint::Odfs(dst_root.to_string());
    let limits = super::limits(o, agents.len());
    let balanced = HashMap::new();
    let pass = Pass { client, ctx, agents: &agents, src: &listing.endpoint, dst: &dst_ep, limits, node_of: &balanced };
    let skeleton = Manifest {
        version: 1,
        kind: "stage-in".into(),
        source: listing.name.clone(),
        destination: format!("odfs:{dst_root}"),
        directories: listing.dirs.iter().cloned().collect(),
        refused: run.report.refused.clone(),
        in_progress: true,
        ..Manifest::default()
    };
    let record = Recorder::new(client, ctx, &manifest_path, skeleton, &run.entries);
    let mut note = |i: usize, r: &ItemResult| record.note(&plan.items[i], r);
    let work = run_pass_noting(&pass, plan.items.clone(), &mut progress, &mut note, o.interrupted.clone());
    let (results, per_agent) = match record.alongside(work).await {
        Err(StageError::Interrupted(_)) => {
            progress.finish();
            return Err(record.interrupted(listing.files.len()).await);
        }
        r => r?,
    };
    run.report.agents = per_agent;
    run.record_whole(&plan, &results);
    let by_rel: HashMap<&str, &SrcFile> = todo.iter().map(|f| (f.rel.as_str(), *f)).collect();
    run.verify_ranged(&pass, &plan, &results, &by_rel, &mut progress).await?;
    progress.finish();

    run.report.directories = listing.dirs.len() as u64;
    let m = Manifest {
        version: 1,
        kind: "stage-in".into(),
        source: listing.name,
        destination: format!("odfs:{dst_root}"),
        written: Timespec::now().sec,
        files: run.entries,
        directories: listing.dirs.into_iter().collect(),
        refused: run.report.refused.clone(),
        in_progress: false,
    };
    write_odfs_file(client, ctx, &manifest_path, &m.to_json()).await.during(|| "cannot write the manifest".into())?;
    run.report.elapsed = start.elapsed();
    Ok(run.report)
}

/// Refuses a destination in a sealed tree before anything is listed or copied: every file,
/// directory and the manifest would be refused there (EROFS). Names the tree, as
/// `odfs unseal` takes it.
async fn refuse_sealed(client: &Client, ctx: &Ctx, dst_root: &str) -> Result<()> {
    let top = client.sealed_tree(ctx, dst_root).await.during(|| format!("cannot look at odfs:{dst_root}"))?;
    let Some(top) = top else { return Ok(()) };
    let what = if dst_root.trim_end_matches('/') == top {
        format!("odfs:{top} is a sealed tree")
    } else {
        format!("odfs:{dst_root} is in the sealed tree odfs:{top}")
    };
    invalid!(
        "{what}, which is read-only: nothing was copied; stage into another directory, or make it \
         writable with `odfs unseal odfs:{top}`"
    )
}

/// Lists the source; unsafe names go to the report's refused list.
async fn list_source(ctx: &Ctx, src: &Location, o: &StageOptions, report: &mut StageReport) -> Result<Listing> {
    let mut dirs: BTreeSet<String> = BTreeSet::new();
    let mut files: Vec<SrcFile> = Vec::new();
    let mut source_s3 = None;
    let endpoint = match src {
        Location::S3 { bucket, prefix } => {
            let s3 = s3_for(bucket, prefix, o).await?;
            let progress = std::sync::Mutex::new(ListingProgress::new("stage-in", o.log_every));
            let listed = s3.list_paging(prefix, &|n, b| progress.lock().expect("progress lock").page(n, b)).await?;
            let bytes = listed.iter().map(|x| x.size).sum();
            progress.into_inner().expect("progress lock").complete(listed.len() as u64, bytes);
            for obj in listed {
                let rel = &obj.key[prefix.len()..];
                if rel.is_empty() {
                    continue;
                }
                if let Err(e) = check_relative(rel) {
                    report.refused.insert(obj.key.clone(), e.to_string());
                } else if let Some(d) = rel.strip_suffix('/') {
                    dirs.insert(d.to_string());
                } else {
                    let (size, mtime) = (obj.size, obj.mtime);
                    let etag = (!obj.etag.is_empty()).then_some(obj.etag);
                    files.push(SrcFile { rel: rel.to_string(), size, mtime, mode: None, etag });
                }
            }
            let ep = StageEndpoint::S3(s3.spec.clone());
            source_s3 = Some(s3);
            ep
        }
        Location::Posix(root) => {
            let (entries, skipped) =
                posix::walk(ctx, root).await.map_err(|e| StageError::Posix(format!("cannot read {e}")))?;
            report.refused.extend(skipped);
            for e in entries {
                if let Err(why) = check_relative(&e.rel) {
                    report.refused.insert(e.rel.clone(), why.to_string());
                } else if e.dir {
                    dirs.insert(e.rel);
                } else {
                    files.push(SrcFile { rel: e.rel, size: e.size, mtime: e.mtime, mode: Some(e.mode), etag: None });
                }
            }
            StageEndpoint::Posix(root.to_string_lossy().into_owned())
        }
        Location::Odfs(_) => {
            return invalid!("stage-in copies into odfs from S3 or a POSIX path; the source is odfs itself")
        }
    };
    files.retain(|f| !manifest::reserved(&f.rel));
    for f in &files {
        for p in parents(&f.rel) {
            dirs.insert(p.to_string());
        }
    }
    Ok(Listing { files, dirs, endpoint, name: src.to_string(), s3: source_s3 })
}

/// Whether `f` is staged in ranges by every agent (its ETag is then needed to verify it)
/// rather than whole by one.
fn is_split(f: &SrcFile, o: &StageOptions) -> bool {
    f.size >= o.split_threshold
}

/// What a previous run of the same source completed: same ETag (where the source has ETags),
/// size and mtime in its manifest, and the file present in odfs with that size.
async fn done_before(
    client: &Client,
    ctx: &Ctx,
    dst_root: &str,
    manifest_path: &str,
    listing: &mut Listing,
) -> Result<BTreeMap<String, FileEntry>> {
    let previous = read_odfs_file(client, ctx, manifest_path).await?.and_then(|d| Manifest::parse(&d));
    let mut done = BTreeMap::new();
    let Some(prev) = previous.filter(|m| m.source == listing.name) else { return Ok(done) };
    // Only what the manifest holds at the same size and mtime may be skipped: its ETag decides.
    listing.fill_etags(|f| prev.files.get(&f.rel).is_some_and(|e| e.size == f.size && e.mtime == f.mtime.sec)).await?;
    for f in &listing.files {
        let Some(e) = prev.files.get(&f.rel) else { continue };
        let same = e.size == f.size && (f.etag.is_none() || e.etag == f.etag) && e.mtime == f.mtime.sec;
        if !same {
            continue;
        }
        if let Ok(a) = client.resolve(ctx, &join(dst_root, &f.rel), true).await {
            if a.kind == FileKind::File && a.size == f.size {
                done.insert(f.rel.clone(), e.clone());
            }
        }
    }
    Ok(done)
}

impl StageIn<'_> {
    /// Whole files as one item each; a large file is created here at full size, then split into
    /// ranges every agent fills.
    async fn plan(&self, todo: &[&SrcFile], o: &StageOptions) -> Result<Plan> {
        let mut plan = Plan { items: Vec::new(), ranged: BTreeMap::new() };
        for f in todo {
            if !is_split(f, o) {
                plan.items.push(WorkItem::Whole { rel: f.rel.clone(), size: f.size, mtime: f.mtime, mode: f.mode });
                continue;
            }
            self.create_full_size(f).await?;
            let mut off = 0;
            while off < f.size {
                let len = o.part_size.min(f.size - off);
                plan.ranged.entry(f.rel.clone()).or_default().push(plan.items.len());
                plan.items.push(WorkItem::Range { rel: f.rel.clone(), offset: off, len });
                off += len;
            }
        }
        Ok(plan)
    }

    /// Creates (or empties) a split file's odfs copy and gives it its final size.
    async fn create_full_size(&self, f: &SrcFile) -> Result<()> {
        let path = join(self.dst_root, &f.rel);
        let (parent, name) = self.client.resolve_parent(self.ctx, &path).await?;
        let mode = f.mode.unwrap_or(0o644) & 0o7777;
        let (r, h) = self.client.create_open(self.ctx, parent.ino, &name, mode, false, None).await?;
        // An earlier copy's bytes must not survive as this one's: empty it first.
        if !r.created && r.attr.size > 0 {
            h.truncate(0).await?;
        }
        h.truncate(f.size).await?;
        h.close().await?;
        Ok(())
    }

    /// Whole files: verified by their agent (or failed).
    fn record_whole(&mut self, plan: &Plan, results: &[ItemResult]) {
        for (it, r) in plan.items.iter().zip(results) {
            let WorkItem::Whole { rel, size, mtime, .. } = it else { continue };
            if let Some(e) = &r.error {
                self.report.failed.insert(rel.clone(), e.clone());
                continue;
            }
            self.report.files += 1;
            self.report.bytes += size;
            self.entries.insert(rel.clone(), whole_entry(*size, *mtime, r));
        }
    }

    /// Ranged files: every range must have landed. A file whose every range stored
    /// acknowledged with the CRC32C of the bytes received is verified as written (the ranges'
    /// combined CRC32C) unless its ETag is an MD5: an MD5 of the whole file, like a range's
    /// unchecked write, needs one agent to read the file back, and its digests must match the
    /// ranges' combined CRC32C (and the ETag).
    async fn verify_ranged(
        &mut self,
        pass: &Pass<'_>,
        plan: &Plan,
        results: &[ItemResult],
        by_rel: &HashMap<&str, &SrcFile>,
        progress: &mut Progress,
    ) -> Result<()> {
        let mut digest_items = Vec::new();
        let mut digest_want: Vec<(String, u32)> = Vec::new();
        for (rel, idx) in &plan.ranged {
            if let Some(e) = idx.iter().find_map(|&i| results[i].error.clone()) {
                self.report.failed.insert(rel.clone(), e);
                continue;
            }
            let crc = idx.iter().fold(0u32, |crc, &i| {
                odfs_proto::crc::combine(crc, results[i].crc32c.unwrap_or(0), plan.items[i].bytes())
            });
            let f = by_rel[rel.as_str()];
            let md5_etag = f.etag.as_deref().is_some_and(s3::is_md5_etag);
            if !md5_etag && idx.iter().all(|&i| results[i].written_checked) {
                let written = ItemResult { crc32c: Some(crc), ..ItemResult::default() };
                self.accept_ranged(f, crc, &written, "crc32c").await?;
                self.report.split_verified_as_written += 1;
                continue;
            }
            self.report.split_read_back += 1;
            digest_items.push(WorkItem::Digest { rel: rel.clone(), size: f.size });
            digest_want.push((rel.clone(), crc));
        }
        if digest_items.is_empty() {
            return Ok(());
        }
        let (dres, per_agent) = run_pass(pass, digest_items, progress).await?;
        super::add_counters(&mut self.report.agents, &per_agent);
        for ((rel, want_crc), r) in digest_want.iter().zip(dres) {
            let f = by_rel[rel.as_str()];
            match read_back_verdict(f, *want_crc, &r) {
                Err(e) => {
                    self.report.failed.insert(rel.clone(), e);
                }
                Ok(how) => self.accept_ranged(f, *want_crc, &r, how).await?,
            }
        }
        Ok(())
    }

    /// A verified split file gets the source's mtime and its manifest entry.
    async fn accept_ranged(&mut self, f: &SrcFile, crc: u32, r: &ItemResult, how: &str) -> Result<()> {
        let a = self.client.resolve(self.ctx, &join(self.dst_root, &f.rel), true).await?;
        let set = SetAttr { ino: a.ino, mtime: Some(SetTime::At(f.mtime)), ..SetAttr::default() };
        self.client.setattr(self.ctx, set).await?;
        self.report.files += 1;
        self.report.bytes += f.size;
        let entry = FileEntry {
            size: f.size,
            etag: f.etag.clone(),
            md5: r.md5.map(hex::encode),
            crc32c: Some(format!("{crc:08x}")),
            mtime: f.mtime.sec,
            verified: how.into(),
            ..FileEntry::default()
        };
        self.entries.insert(f.rel.clone(), entry);
        Ok(())
    }
}

/// The manifest entry of a whole file its agent copied and verified.
fn whole_entry(size: u64, mtime: Timespec, r: &ItemResult) -> FileEntry {
    FileEntry {
        size,
        etag: r.etag.clone(),
        md5: r.md5.map(hex::encode),
        crc32c: r.crc32c.map(|c| format!("{c:08x}")),
        mtime: mtime.sec,
        verified: r.verified.clone().unwrap_or_else(|| "size".into()),
        ..FileEntry::default()
    }
}

/// Seconds between two writes of a running stage-in's manifest, at least; and at least this
/// many times as long as the last write took (a manifest of millions of files is large).
const RECORD_EVERY: Duration = Duration::from_secs(5);
const RECORD_SPACING: u32 = 10;

/// A running stage-in's record: the files verified so far, written to its manifest (marked
/// `in_progress`) every few seconds and when it is interrupted, so that a run of the same
/// stage-in — after a Ctrl-C, a kill, a requeued job's prolog — copies only the rest. What a
/// share's agent reports before the share ends is provisional (`run_pass_noting`); a later
/// run still checks each recorded file in odfs before it skips it (`done_before`).
struct Recorder<'a> {
    client: &'a Client,
    ctx: &'a Ctx,
    path: &'a str,
    state: std::sync::Mutex<Recorded>,
    stop: tokio::sync::Notify,
}

struct Recorded {
    manifest: Manifest,
    /// Files verified by this run.
    new: usize,
    changed: bool,
}

impl<'a> Recorder<'a> {
    fn new(
        client: &'a Client,
        ctx: &'a Ctx,
        path: &'a str,
        mut manifest: Manifest,
        done: &BTreeMap<String, FileEntry>,
    ) -> Recorder<'a> {
        manifest.files = done.clone();
        let state = std::sync::Mutex::new(Recorded { manifest, new: 0, changed: false });
        Recorder { client, ctx, path, state, stop: tokio::sync::Notify::new() }
    }

    /// An item's result, as its agent reported it.
    fn note(&self, item: &WorkItem, r: &ItemResult) {
        let WorkItem::Whole { rel, size, mtime, .. } = item else { return };
        let mut st = self.state.lock().expect("stage-in record lock");
        let had = st.manifest.files.contains_key(rel);
        match &r.error {
            None if !had => {
                st.manifest.files.insert(rel.clone(), whole_entry(*size, *mtime, r));
                st.new += 1;
            }
            Some(_) if had => {
                st.manifest.files.remove(rel);
                st.new -= 1;
            }
            _ => return,
        }
        st.changed = true;
    }

    /// Runs `work` while writing the record every few seconds; the last write ends before
    /// this returns (a write is never cut short).
    async fn alongside<T>(&self, work: impl std::future::Future<Output = T>) -> T {
        let work = async {
            let r = work.await;
            self.stop.notify_one();
            r
        };
        let writes = async {
            let mut spacing = RECORD_EVERY;
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(spacing) => {}
                    _ = self.stop.notified() => return,
                }
                let began = Instant::now();
                if let Err(e) = self.write().await {
                    warn!(error = %e, manifest = self.path, "cannot record the stage-in's progress; tried again later");
                }
                spacing = RECORD_EVERY.max(began.elapsed() * RECORD_SPACING);
            }
        };
        tokio::join!(work, writes).0
    }

    /// Writes the record if it changed since it was last written.
    async fn write(&self) -> Result<()> {
        let data = {
            let mut st = self.state.lock().expect("stage-in record lock");
            if !std::mem::take(&mut st.changed) {
                return Ok(());
            }
            st.manifest.written = Timespec::now().sec;
            st.manifest.to_json()
        };
        write_odfs_file(self.client, self.ctx, self.path, &data).await
    }

    /// The stage was interrupted: the record is written now, and the error says what it holds.
    async fn interrupted(&self, listed: usize) -> StageError {
        let (held, new) = {
            let mut st = self.state.lock().expect("stage-in record lock");
            st.changed = true;
            (st.manifest.files.len(), st.new)
        };
        let recorded = match self.write().await {
            Ok(()) => format!("{held} of {listed} files are verified and recorded in odfs:{}", self.path),
            Err(e) => format!("its record could not be written ({e}): the next run copies again what this one did"),
        };
        StageError::Interrupted(format!(
            "stage-in interrupted after {new} files copied and verified: {recorded}; the same command \
             again copies only the rest"
        ))
    }
}

/// How a split file read back compares with what its ranges received and the source's ETag:
/// Ok(how it was verified) or Err(why not).
fn read_back_verdict(f: &SrcFile, want_crc: u32, r: &ItemResult) -> Result<&'static str, String> {
    match (&r.error, r.crc32c, r.md5) {
        (Some(e), _, _) => Err(e.clone()),
        (None, Some(crc), _) if crc != want_crc => {
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
    }
}
