//! Stage-out: an odfs tree to S3 or a POSIX directory. Nothing is deleted anywhere. In named
//! steps: walk odfs → (to S3: skip objects whose ETag already matches the local file) →
//! transfer on every agent → complete multipart uploads → put empty directories' markers →
//! verify every object as the bucket lists it → manifest → completion marker, last and only
//! if everything verified.

use super::{
    add_counters, agents, digests, md5_of, run_pass, s3_for, Pass, Progress, SrcFile, StageOptions, StageReport,
};
use crate::error::{invalid, During, Result};
use crate::keys::parents;
use crate::location::Location;
use crate::manifest::{self, checkpoint_of, FileEntry, Manifest};
use crate::posix;
use crate::s3::{self, multipart_etag, S3};
use odfs_client::{Client, Ctx};
use odfs_proto::meta::{Attr, FileKind};
use odfs_proto::stage::{ItemResult, StageEndpoint, WorkItem};
use odfs_proto::{InodeId, Timespec};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::path::Path;
use std::time::Instant;
use tracing::warn;

/// S3's most parts in one multipart upload.
const MAX_PARTS: u64 = 10_000;

/// The multipart part size of a `size`-byte file (0: one PUT): `part`, or larger where the file
/// would otherwise need more than S3's 10,000 parts, in whole MiB (the agents read and hash
/// parts in 1 MiB blocks).
fn part_size(part: u64, split_threshold: u64, size: u64) -> u64 {
    if size >= split_threshold {
        part.max(size.div_ceil(MAX_PARTS).next_multiple_of(1 << 20))
    } else {
        0
    }
}

/// What one stage-out moves: the odfs tree and where it goes.
struct Outputs<'a> {
    client: &'a Client,
    ctx: &'a Ctx,
    agents: Vec<(u32, SocketAddr)>,
    src_root: &'a str,
    src_ep: StageEndpoint,
    files: Vec<SrcFile>,
    dirs: BTreeSet<String>,
    o: &'a StageOptions,
    report: StageReport,
    start: Instant,
    /// Files a drain uploaded while the job ran and that have not changed since (or whose
    /// objects its `--keep` retired): taken as they are, not read again.
    kept: BTreeMap<String, FileEntry>,
    /// Which node's agent sends a file (a drain: the node holding its first chunk); the
    /// others are balanced over every agent.
    node_of: HashMap<String, u32>,
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
    let out = Outputs {
        client,
        ctx,
        agents,
        src_root,
        src_ep,
        files,
        dirs,
        o,
        report,
        start,
        kept: BTreeMap::new(),
        node_of: HashMap::new(),
    };
    match dst {
        Location::S3 { bucket, prefix } => out.into_s3(bucket, prefix).await,
        Location::Posix(root) => out.into_posix(root).await,
        Location::Odfs(_) => {
            invalid!("stage-out copies from odfs to S3 or a POSIX path; the destination is odfs itself")
        }
    }
}

/// Every file and directory below `root` in odfs.
async fn walk_odfs(client: &Client, ctx: &Ctx, root: &str) -> Result<(Vec<SrcFile>, BTreeSet<String>)> {
    let w = walk_odfs_attrs(client, ctx, root).await?;
    if let Some(bad) = w.not_utf8.first() {
        return invalid!("odfs:{root}/{bad}: a name that is not UTF-8 (an S3 key must be)");
    }
    Ok((w.files.iter().map(|(rel, a)| src_file(rel, a)).collect(), w.dirs))
}

/// A file of odfs as a stage-out sends it.
pub(crate) fn src_file(rel: &str, a: &Attr) -> SrcFile {
    SrcFile { rel: rel.to_string(), size: a.size, mtime: a.mtime, mode: Some(a.mode & 0o7777), etag: None }
}

/// What a walk of an odfs tree found.
pub(crate) struct Walk {
    /// Every file, with its attributes, by its path under the root.
    pub files: Vec<(String, Attr)>,
    pub dirs: BTreeSet<String>,
    /// Entries whose names are not UTF-8 (shown lossily), not walked: no S3 key can name them.
    pub not_utf8: Vec<String>,
}

/// Every file (with its attributes) and directory below `root` in odfs.
pub(crate) async fn walk_odfs_attrs(client: &Client, ctx: &Ctx, root: &str) -> Result<Walk> {
    let top = client.resolve(ctx, root, true).await.during(|| format!("odfs:{root}"))?;
    if top.kind != FileKind::Dir {
        return invalid!("odfs:{root} is not a directory");
    }
    let mut w = Walk { files: Vec::new(), dirs: BTreeSet::new(), not_utf8: Vec::new() };
    let mut stack: Vec<(InodeId, String)> = vec![(top.ino, String::new())];
    while let Some((ino, rel)) = stack.pop() {
        for e in client.readdir_all(ctx, ino, true).await? {
            let join = |name: &str| if rel.is_empty() { name.to_string() } else { format!("{rel}/{name}") };
            let Ok(name) = String::from_utf8(e.name.clone()) else {
                w.not_utf8.push(join(&String::from_utf8_lossy(&e.name)));
                continue;
            };
            let child = join(&name);
            let a = match e.attr {
                Some(a) => a,
                None => client.getattr(ctx, e.ino).await?,
            };
            match a.kind {
                FileKind::Dir => {
                    w.dirs.insert(child.clone());
                    stack.push((e.ino, child));
                }
                FileKind::File => w.files.push((child, a)),
                _ => {}
            }
        }
    }
    Ok(w)
}

/// The manifest entry of an object whose ETag in the bucket matched what was sent.
fn uploaded(f: &SrcFile, etag: String, r: &ItemResult) -> FileEntry {
    FileEntry {
        size: f.size,
        etag: Some(etag),
        md5: r.md5.map(hex::encode),
        crc32c: r.crc32c.map(|c| format!("{c:08x}")),
        mtime: f.mtime.sec,
        mtime_nsec: f.mtime.nsec,
        verified: "etag".into(),
        ..FileEntry::default()
    }
}

/// The multipart uploads of one run: for each file, its upload id and its parts' indices in
/// the run's items.
type Uploads = BTreeMap<String, (String, Vec<usize>)>;
/// Per file: the ETag its object must have, and what its agent reported.
type Expected = BTreeMap<String, (String, ItemResult)>;

impl Outputs<'_> {
    fn pass<'p>(&'p self, dst: &'p StageEndpoint) -> Pass<'p> {
        let limits = super::limits(self.o, self.agents.len());
        Pass {
            client: self.client,
            ctx: self.ctx,
            agents: &self.agents,
            src: &self.src_ep,
            dst,
            limits,
            node_of: &self.node_of,
        }
    }

    fn manifest(&self, destination: String) -> Manifest {
        Manifest {
            version: 1,
            kind: "stage-out".into(),
            source: format!("odfs:{}", self.src_root),
            destination,
            ..Manifest::default()
        }
    }

    /// To a POSIX directory, as the requesting user; the agents verify what they wrote.
    async fn into_posix(mut self, root: &Path) -> Result<StageReport> {
        let dst_ep = StageEndpoint::Posix(root.to_string_lossy().into_owned());
        for d in &self.dirs {
            let p = root.join(d);
            posix::as_user(self.ctx, move || std::fs::create_dir_all(&p))
                .await
                .during(|| format!("cannot create {}", root.join(d).display()))?;
        }
        let items: Vec<WorkItem> = self
            .files
            .iter()
            .map(|f| WorkItem::Whole { rel: f.rel.clone(), size: f.size, mtime: f.mtime, mode: f.mode })
            .collect();
        let mut progress = Progress::new("stage-out", items.iter().map(|i| i.bytes()).sum(), self.o.log_every);
        let (results, per_agent) = run_pass(&self.pass(&dst_ep), items, &mut progress).await?;
        progress.finish();
        self.report.agents = per_agent;
        let mut m = self.manifest(root.display().to_string());
        for (f, r) in self.files.iter().zip(results) {
            if let Some(e) = r.error {
                self.report.failed.insert(f.rel.clone(), e);
                continue;
            }
            self.report.files += 1;
            self.report.bytes += f.size;
            let entry = FileEntry {
                size: f.size,
                etag: None,
                md5: r.md5.map(hex::encode),
                crc32c: r.crc32c.map(|c| format!("{c:08x}")),
                mtime: f.mtime.sec,
                mtime_nsec: f.mtime.nsec,
                verified: "size".into(),
                ..FileEntry::default()
            };
            m.files.insert(f.rel.clone(), entry);
        }
        m.directories = self.dirs.iter().cloned().collect();
        m.written = Timespec::now().sec;
        let mpath = root.join(manifest::STAGE_OUT_MANIFEST);
        self.report.manifest = mpath.display().to_string();
        let data = m.to_json();
        posix::as_user(self.ctx, move || std::fs::write(&mpath, data))
            .await
            .during(|| "cannot write the manifest".into())?;
        if self.report.failed.is_empty() {
            let marker = root.join(manifest::STAGE_OUT_MARKER);
            posix::as_user(self.ctx, move || std::fs::write(&marker, b"complete\n"))
                .await
                .during(|| "cannot write the completion marker".into())?;
        }
        self.report.elapsed = self.start.elapsed();
        Ok(self.report)
    }

    /// To S3.
    async fn into_s3(mut self, bucket: &str, prefix: &str) -> Result<StageReport> {
        let s3 = s3_for(bucket, prefix, self.o).await?;
        let dst_ep = StageEndpoint::S3(s3.spec.clone());
        self.report.manifest = format!("s3://{bucket}/{prefix}{}", manifest::STAGE_OUT_MANIFEST);
        let total = self.files.iter().map(|f| f.size).sum();
        let mut progress = Progress::new("stage-out", total, self.o.log_every);
        let drained = drained_entries(&s3).await?;
        let skip = self.unchanged_objects(&s3, prefix, &dst_ep, &mut progress, &drained).await?;
        self.report.skipped = skip.len() as u64;
        let (items, uploads, whole) = self.plan_uploads(&s3, &skip).await?;
        let (results, per_agent) = run_pass(&self.pass(&dst_ep), items.clone(), &mut progress).await?;
        add_counters(&mut self.report.agents, &per_agent);
        progress.finish();
        let mut expect = self.expect_whole(&whole, &results);
        self.complete_uploads(&s3, &items, &results, &uploads, &mut expect).await;
        self.put_dir_markers(&s3).await;
        let m = self.verify_in_bucket(&s3, bucket, prefix, skip, expect).await;
        self.write_manifest_and_marker(&s3, m).await?;
        self.report.elapsed = self.start.elapsed();
        Ok(self.report)
    }

    /// A file's multipart part size (0: one PUT).
    fn part_of(&self, size: u64) -> u64 {
        part_size(self.o.part_size, self.o.split_threshold, size)
    }

    /// A re-run skips objects whose size and ETag already match the local file (the agents
    /// compute the local files' digests). Files a drain sent and that have not changed since
    /// are kept as the drain verified them, without reading them (`kept`).
    async fn unchanged_objects(
        &mut self,
        s3: &S3,
        prefix: &str,
        dst_ep: &StageEndpoint,
        progress: &mut Progress,
        drained: &BTreeMap<String, FileEntry>,
    ) -> Result<Expected> {
        let mut listed = s3.list(prefix).await?;
        s3.fill_etags(&mut listed).await?;
        let existing: HashMap<String, s3::Object> =
            listed.into_iter().map(|obj| (obj.key[prefix.len()..].to_string(), obj)).collect();
        self.keep_drained(drained, &existing);
        let candidates: Vec<&SrcFile> = self
            .files
            .iter()
            .filter(|f| !self.kept.contains_key(&f.rel) && existing.get(&f.rel).is_some_and(|e| e.size == f.size))
            .collect();
        let mut skip = Expected::new();
        if candidates.is_empty() {
            return Ok(skip);
        }
        let items = candidates
            .iter()
            .map(|f| WorkItem::SourceDigest { rel: f.rel.clone(), size: f.size, part_size: self.part_of(f.size) })
            .collect();
        let (res, per_agent) = run_pass(&self.pass(dst_ep), items, progress).await?;
        add_counters(&mut self.report.agents, &per_agent);
        for (f, r) in candidates.iter().zip(res) {
            let want = if self.part_of(f.size) > 0 { r.multipart_etag.clone() } else { r.md5.map(hex::encode) };
            if want.is_some() && want.as_deref() == Some(existing[&f.rel].etag.as_str()) {
                skip.insert(f.rel.clone(), (existing[&f.rel].etag.clone(), r));
            }
        }
        Ok(skip)
    }

    /// Files a drain uploaded that are unchanged since (same size and mtime) and whose objects
    /// still have the ETag it verified; and those its `--keep` retired, unchanged since.
    /// A retired file whose checkpoint DST also holds other files of is sent again, so that
    /// no checkpoint is left part retired (docs/architecture.md, "stage").
    fn keep_drained(&mut self, drained: &BTreeMap<String, FileEntry>, existing: &HashMap<String, s3::Object>) {
        let unchanged =
            |f: &SrcFile| drained.get(&f.rel).filter(|e| e.drained.is_some() && e.same_file(f.size, f.mtime));
        let here: BTreeSet<&str> = self.files.iter().map(|f| f.rel.as_str()).collect();
        let held: BTreeSet<&str> = self
            .files
            .iter()
            .filter(|f| !unchanged(f).is_some_and(|e| e.retired))
            .map(|f| checkpoint_of(&f.rel))
            .chain(
                drained
                    .iter()
                    .filter(|(rel, e)| e.deleted_local && !e.retired && !here.contains(rel.as_str()))
                    .map(|(rel, _)| checkpoint_of(rel)),
            )
            .collect();
        for f in &self.files {
            let Some(e) = unchanged(f) else {
                continue;
            };
            let in_bucket = existing.get(&f.rel).is_some_and(|o| Some(&o.etag) == e.etag.as_ref());
            if e.retired && held.contains(checkpoint_of(&f.rel)) {
                continue;
            } else if e.retired {
                self.report.retired += 1;
            } else if in_bucket {
                self.report.drained += 1;
            } else {
                continue;
            }
            self.kept.insert(f.rel.clone(), e.clone());
        }
        // Files a drain deleted from odfs after uploading them: their objects are the outputs.
        for (rel, e) in drained.iter().filter(|(rel, e)| e.deleted_local && !here.contains(rel.as_str())) {
            if e.retired || existing.get(rel).is_some_and(|o| Some(&o.etag) == e.etag.as_ref()) {
                self.report.drained += !e.retired as u64;
                self.report.retired += e.retired as u64;
                self.kept.insert(rel.clone(), e.clone());
            }
        }
    }

    /// The run's items: large files as multipart uploads (started here), the others whole.
    /// Returns (items, uploads, (item index, file index) of whole files).
    async fn plan_uploads(&self, s3: &S3, skip: &Expected) -> Result<(Vec<WorkItem>, Uploads, Vec<(usize, usize)>)> {
        let mut items = Vec::new();
        let mut uploads = Uploads::new();
        let mut whole = Vec::new();
        let todo = |f: &&SrcFile| !skip.contains_key(&f.rel) && !self.kept.contains_key(&f.rel);
        for (fi, f) in self.files.iter().enumerate().filter(|(_, f)| todo(f)) {
            let ps = self.part_of(f.size);
            if ps == 0 {
                whole.push((items.len(), fi));
                items.push(WorkItem::Whole { rel: f.rel.clone(), size: f.size, mtime: f.mtime, mode: f.mode });
                continue;
            }
            let id = s3.create_multipart(&s3.key(&f.rel)).await?;
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
        }
        Ok((items, uploads, whole))
    }

    /// The ETag each whole file's object must have (its MD5), or its failure.
    fn expect_whole(&mut self, whole: &[(usize, usize)], results: &[ItemResult]) -> Expected {
        let mut expect = Expected::new();
        for &(i, fi) in whole {
            let (r, f) = (&results[i], &self.files[fi]);
            match &r.error {
                Some(e) => {
                    self.report.failed.insert(f.rel.clone(), e.clone());
                }
                None => {
                    expect.insert(f.rel.clone(), (r.md5.map(hex::encode).unwrap_or_default(), r.clone()));
                }
            }
        }
        expect
    }

    /// Completes each multipart upload whose parts all arrived (aborts the others); its object
    /// must then have the multipart ETag of the parts' MD5s.
    async fn complete_uploads(
        &mut self,
        s3: &S3,
        items: &[WorkItem],
        results: &[ItemResult],
        uploads: &Uploads,
        expect: &mut Expected,
    ) {
        for (rel, (id, idx)) in uploads {
            let key = s3.key(rel);
            if let Some(e) = idx.iter().find_map(|&i| results[i].error.clone()) {
                s3.abort_multipart(&key, id).await;
                self.report.failed.insert(rel.clone(), e);
                continue;
            }
            let parts: Vec<(i32, String)> = idx
                .iter()
                .filter_map(|&i| match &items[i] {
                    WorkItem::Part { part, .. } => Some((*part, results[i].etag.clone().unwrap_or_default())),
                    _ => None,
                })
                .collect();
            let md5s: Vec<[u8; 16]> = idx.iter().map(|&i| results[i].md5.unwrap_or_default()).collect();
            if let Err(e) = s3.complete_multipart(&key, id, &parts).await {
                s3.abort_multipart(&key, id).await;
                self.report.failed.insert(rel.clone(), e.to_string());
                continue;
            }
            let crc = idx
                .iter()
                .fold(0u32, |c, &i| odfs_proto::crc::combine(c, results[i].crc32c.unwrap_or(0), items[i].bytes()));
            let r = ItemResult { crc32c: Some(crc), ..ItemResult::default() };
            expect.insert(rel.clone(), (multipart_etag(&md5s), r));
        }
    }

    /// Empty directories as zero-byte "dir/" markers.
    async fn put_dir_markers(&mut self, s3: &S3) {
        let nonempty: BTreeSet<&str> = self.files.iter().flat_map(|f| parents(&f.rel)).collect();
        let leaves = self
            .dirs
            .iter()
            .filter(|d| !nonempty.contains(d.as_str()) && !self.dirs.iter().any(|x| x.starts_with(&format!("{d}/"))));
        for d in leaves {
            if let Err(e) = s3.put(&s3.key(&format!("{d}/")), Vec::new(), &md5_of(b""), 0).await {
                self.report.failed.insert(format!("{d}/"), e.to_string());
            }
        }
    }

    /// Checks each object as the bucket lists it now; the manifest holds the skipped and the
    /// verified files.
    async fn verify_in_bucket(
        &mut self,
        s3: &S3,
        bucket: &str,
        prefix: &str,
        skip: Expected,
        expect: Expected,
    ) -> Manifest {
        let listed = match s3.list(prefix).await {
            Ok(mut l) => s3.fill_etags(&mut l).await.map(|()| l),
            Err(e) => Err(e),
        };
        let now: HashMap<String, s3::Object> = match listed {
            Ok(l) => l.into_iter().map(|obj| (obj.key[prefix.len()..].to_string(), obj)).collect(),
            Err(e) => {
                for rel in expect.keys() {
                    self.report.failed.entry(rel.clone()).or_insert_with(|| format!("not verified: {e}"));
                }
                HashMap::new()
            }
        };
        let by_rel: HashMap<&str, &SrcFile> = self.files.iter().map(|f| (f.rel.as_str(), f)).collect();
        let mut m = self.manifest(format!("s3://{bucket}/{prefix}"));
        for (rel, (etag, r)) in skip {
            m.files.insert(rel.clone(), uploaded(by_rel[rel.as_str()], etag, &r));
        }
        m.files.extend(self.kept.clone());
        for (rel, (want, r)) in expect {
            if self.report.failed.contains_key(&rel) {
                continue;
            }
            let f = by_rel[rel.as_str()];
            match object_verdict(now.get(&rel), f, &want) {
                Err(e) => {
                    self.report.failed.insert(rel, e);
                }
                Ok(etag) => {
                    self.report.files += 1;
                    self.report.bytes += f.size;
                    m.files.insert(rel, uploaded(f, etag, &r));
                }
            }
        }
        m.directories = self.dirs.iter().cloned().collect();
        m.refused = self.report.refused.clone();
        m.written = Timespec::now().sec;
        m
    }

    /// The manifest, then the completion marker, last and only if every file verified.
    async fn write_manifest_and_marker(&mut self, s3: &S3, m: Manifest) -> Result<()> {
        let data = m.to_json();
        let (md5, crc) = digests(&data);
        if let Err(e) = s3.put(&s3.key(manifest::STAGE_OUT_MANIFEST), data, &md5, crc).await {
            let why = format!("cannot upload the manifest: {e}");
            self.report.failed.insert(manifest::STAGE_OUT_MANIFEST.into(), why);
        }
        if !self.report.failed.is_empty() {
            warn!(failed = self.report.failed.len(), "stage-out incomplete: no completion marker written");
            return Ok(());
        }
        let body = marker_body(&m).into_bytes();
        let (md5, crc) = digests(&body);
        s3.put(&s3.key(manifest::STAGE_OUT_MARKER), body, &md5, crc)
            .await
            .during(|| "cannot upload the completion marker".into())?;
        Ok(())
    }
}

/// The completion marker's JSON: `files` and `bytes` count the objects the destination holds
/// (the manifest also lists, as `retired`, drained files whose objects a drain's `--keep`
/// deleted; `retired` counts them).
fn marker_body(m: &Manifest) -> String {
    let (held, retired): (Vec<&FileEntry>, Vec<&FileEntry>) = m.files.values().partition(|e| !e.retired);
    format!(
        "{{\"files\": {}, \"bytes\": {}, \"retired\": {}, \"manifest\": \"{}\"}}\n",
        held.len(),
        held.iter().map(|e| e.size).sum::<u64>(),
        retired.len(),
        manifest::STAGE_OUT_MANIFEST
    )
}

/// An object as the bucket lists it against the file sent: Ok(its ETag) or Err(why not).
fn object_verdict(obj: Option<&s3::Object>, f: &SrcFile, want: &str) -> Result<String, String> {
    match obj {
        None => Err("missing from the bucket after upload".to_string()),
        Some(obj) if obj.size != f.size => Err(format!("the bucket holds {} bytes, {} were sent", obj.size, f.size)),
        Some(obj) if (s3::is_md5_etag(&obj.etag) || obj.etag.contains('-')) && !obj.etag.eq_ignore_ascii_case(want) => {
            Err(format!("ETag {} in the bucket, {want} expected", obj.etag))
        }
        Some(obj) => Ok(obj.etag.clone()),
    }
}

/// The entries of the stage-out manifest in the destination (a drain's, or an earlier
/// stage-out's); none when there is none. An error when it exists but cannot be read or
/// parsed: it may be the only record of files a drain deleted after uploading them, so it is
/// neither ignored nor overwritten.
pub(crate) async fn drained_entries(s3: &S3) -> Result<BTreeMap<String, FileEntry>> {
    let key = s3.key(manifest::STAGE_OUT_MANIFEST);
    let listed = s3.list(&key).await.during(|| "cannot list the stage-out manifest".into())?;
    if !listed.iter().any(|o| o.key == key) {
        return Ok(BTreeMap::new());
    }
    let data = s3.get_all(&key).await.during(|| "cannot read the stage-out manifest".into())?;
    match Manifest::parse(&data) {
        Some(m) => Ok(m.files),
        None => invalid!(
            "s3://{}/{key} is not a manifest odfs can read: move it away if it is not odfs's own",
            s3.spec.bucket
        ),
    }
}

/// Uploads a manifest (a drain's record, rewritten after each pass).
pub(crate) async fn put_manifest(s3: &S3, m: &Manifest) -> Result<()> {
    let data = m.to_json();
    let (md5, crc) = digests(&data);
    s3.put(&s3.key(manifest::STAGE_OUT_MANIFEST), data, &md5, crc)
        .await
        .during(|| "cannot upload the manifest".into())?;
    Ok(())
}

/// What one pass of a drain achieved: entries verified in the bucket, and failures.
pub(crate) struct DrainPass {
    pub verified: BTreeMap<String, FileEntry>,
    pub failed: BTreeMap<String, String>,
}

/// One pass of a drain: uploads `files` of `src_root` to the bucket of `s3`, each from the
/// agent of the node `node_of` names, and verifies each object as stage-out does (size, and
/// its ETag against the MD5 of what was read). Nothing else is touched: no listing of the
/// tree, no directory markers, no manifest.
pub(crate) async fn drain_pass(
    client: &Client,
    ctx: &Ctx,
    src_root: &str,
    s3: &S3,
    files: Vec<SrcFile>,
    node_of: HashMap<String, u32>,
    o: &StageOptions,
) -> Result<DrainPass> {
    let agents = agents(client).await?;
    let mut out = Outputs {
        client,
        ctx,
        agents,
        src_root,
        src_ep: StageEndpoint::Odfs(src_root.to_string()),
        files,
        dirs: BTreeSet::new(),
        o,
        report: StageReport { kind: "drain", ..StageReport::default() },
        start: Instant::now(),
        kept: BTreeMap::new(),
        node_of,
    };
    let dst_ep = StageEndpoint::S3(s3.spec.clone());
    let (items, uploads, whole) = out.plan_uploads(s3, &Expected::new()).await?;
    let mut progress = Progress::new("drain", 0, std::time::Duration::from_secs(u64::MAX / 4));
    let (results, _) = match run_pass(&out.pass(&dst_ep), items.clone(), &mut progress).await {
        Ok(r) => r,
        Err(e) => {
            // The pass never ran to its end: no upload it started is left open in the bucket.
            for (rel, (id, _)) in &uploads {
                s3.abort_multipart(&s3.key(rel), id).await;
            }
            return Err(e);
        }
    };
    let mut expect = out.expect_whole(&whole, &results);
    out.complete_uploads(s3, &items, &results, &uploads, &mut expect).await;
    let by_rel: HashMap<String, SrcFile> = out.files.iter().map(|f| (f.rel.clone(), f.clone())).collect();
    let mut verified = BTreeMap::new();
    for (rel, (want, r)) in expect {
        if out.report.failed.contains_key(&rel) {
            continue;
        }
        let f = &by_rel[&rel];
        let obj = s3.head(&s3.key(&rel)).await.map(|h| s3::Object {
            key: rel.clone(),
            size: h.size,
            etag: h.etag,
            mtime: Timespec::default(),
        });
        let verdict = match &obj {
            Ok(obj) => object_verdict(Some(obj), f, &want),
            Err(e) => Err(format!("not verified: {e}")),
        };
        match verdict {
            Ok(etag) => {
                verified.insert(rel, uploaded(f, etag, &r));
            }
            Err(e) => {
                out.report.failed.insert(rel, e);
            }
        }
    }
    Ok(DrainPass { verified, failed: out.report.failed })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_never_needs_more_than_ten_thousand_parts() {
        const MIB: u64 = 1 << 20;
        assert_eq!(part_size(16 * MIB, 64 * MIB, 63 * MIB), 0, "under the threshold: one PUT");
        assert_eq!(part_size(16 * MIB, 64 * MIB, 64 * MIB), 16 * MIB);
        assert_eq!(part_size(8 * MIB, 8 * MIB, 80_000 * MIB), 8 * MIB, "exactly 10,000 parts");
        let huge = 200 << 30; // 200 GiB
        let p = part_size(8 * MIB, 8 * MIB, huge);
        assert!(huge.div_ceil(p) <= MAX_PARTS && p.is_multiple_of(MIB) && p > 8 * MIB, "{p}");
    }

    #[test]
    fn the_marker_counts_the_objects_the_destination_holds() {
        let mut m = Manifest { version: 1, kind: "stage-out".into(), ..Manifest::default() };
        for (rel, size, retired) in [("a", 10, true), ("b", 20, true), ("c", 30, false), ("d", 40, false)] {
            m.files.insert(rel.into(), FileEntry { size, retired, ..FileEntry::default() });
        }
        let v: serde_json::Value = serde_json::from_str(&marker_body(&m)).unwrap();
        assert_eq!(v, serde_json::json!({"files": 2, "bytes": 70, "retired": 2, "manifest": ".odfs-stage-out.json"}));
    }
}
