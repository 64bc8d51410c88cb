//! `odfs bench --stage`: stage-in throughput from an S3 server on loopback (s3s-fs, started
//! here over a generated dataset), beside the same server's throughput to a plain parallel GET
//! client at the same total concurrency (objects discarded), and `aws s3 cp --recursive` to a
//! local directory, all in one run. The page cache is dropped before each phase.

use crate::{drop_caches, fill_pattern};
use anyhow::{bail, Context, Result};
use futures::StreamExt;
use odfs_client::{Client, ClientConfig, Ctx};
use odfs_job::local::{self, UpOptions};
use odfs_proto::stage::S3Spec;
use odfs_stage::s3::S3;
use odfs_stage::{Location, StageOptions};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct StageBenchOptions {
    /// Work directory: the S3 server's data in `ROOT/s3`, the filesystem in `ROOT/fs`.
    pub root: PathBuf,
    pub nodes: u32,
    pub small_files: usize,
    pub small_size: usize,
    pub large_files: usize,
    pub large_size: usize,
    /// Transfers in flight per agent; the plain client runs `nodes ×` this many.
    pub concurrency: u32,
    pub keep: bool,
}

impl Default for StageBenchOptions {
    fn default() -> Self {
        StageBenchOptions {
            root: PathBuf::from("odfs-bench-stage"),
            nodes: 4,
            small_files: 2000,
            small_size: 256 << 10,
            large_files: 4,
            large_size: 256 << 20,
            concurrency: 16,
            keep: false,
        }
    }
}

impl StageBenchOptions {
    pub fn small() -> Self {
        StageBenchOptions { small_files: 200, large_files: 2, large_size: 64 << 20, ..Self::default() }
    }

    fn total_bytes(&self) -> u64 {
        (self.small_files * self.small_size + self.large_files * self.large_size) as u64
    }
}

/// One row of the result.
pub struct Row {
    pub name: String,
    pub secs: f64,
    pub bytes: u64,
    pub files: u64,
}

impl Row {
    fn mib_s(&self) -> f64 {
        self.bytes as f64 / (1 << 20) as f64 / self.secs
    }
}

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        odfs_job::interrupt::child_ended(self.0.id());
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn generate(dir: &Path, o: &StageBenchOptions) -> Result<()> {
    let mut buf = vec![0u8; o.small_size.max(1 << 20)];
    for i in 0..o.small_files {
        let d = dir.join(format!("shard{:02}", i % 50));
        std::fs::create_dir_all(&d)?;
        fill_pattern(&mut buf[..o.small_size], i as u64);
        std::fs::write(d.join(format!("sample{i:06}.bin")), &buf[..o.small_size])?;
    }
    std::fs::create_dir_all(dir.join("large"))?;
    for k in 0..o.large_files {
        use std::io::Write;
        let mut f = std::io::BufWriter::new(std::fs::File::create(dir.join(format!("large/part{k}.bin")))?);
        let mut left = o.large_size;
        let mut seed = 1_000_000 + k as u64 * 10_000;
        while left > 0 {
            let n = left.min(1 << 20);
            fill_pattern(&mut buf[..n], seed);
            f.write_all(&buf[..n])?;
            left -= n;
            seed += 1;
        }
        f.flush()?;
    }
    Ok(())
}

fn start_server(data: &Path, port: u16, key: &str, secret: &str, log: &Path) -> Result<Server> {
    let out = std::fs::File::create(log)?;
    let child = Command::new("s3s-fs")
        .args(["--host", "127.0.0.1", "--port", &port.to_string(), "--access-key", key, "--secret-key", secret])
        .arg(data)
        .stdout(out.try_clone()?)
        .stderr(out)
        .stdin(Stdio::null())
        .spawn()
        .context("cannot start s3s-fs (cargo install s3s-fs --features binary; scripts/test installs it)")?;
    odfs_job::interrupt::child_started(child.id());
    let server = Server(child);
    let t = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if t.elapsed() > Duration::from_secs(20) {
            bail!("s3s-fs did not listen on port {port} within 20 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(server)
}

/// Uploads every file below `dir` to the spec's prefix: PUT below `split`, multipart above.
async fn upload(s3: &S3, dir: &Path, split: u64, part: u64) -> Result<()> {
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d)? {
            let e = e?;
            if e.file_type()?.is_dir() {
                stack.push(e.path());
            } else {
                files.push(e.path());
            }
        }
    }
    let digests = |data: &[u8]| {
        let mut d = odfs_stage::digest::Digests::default();
        d.update(data);
        d.finish()
    };
    let results: Vec<Result<()>> = futures::stream::iter(files)
        .map(|p| async move {
            let key = s3.key(&p.strip_prefix(dir)?.to_string_lossy());
            let size = std::fs::metadata(&p)?.len();
            if size < split {
                let data = std::fs::read(&p)?;
                let (md5, crc) = digests(&data);
                s3.put(&key, data, &md5, crc).await?;
            } else {
                use std::os::unix::fs::FileExt;
                let f = std::fs::File::open(&p)?;
                let id = s3.create_multipart(&key).await?;
                let mut parts = Vec::new();
                let (mut off, mut n) = (0u64, 1);
                while off < size {
                    let mut buf = vec![0u8; part.min(size - off) as usize];
                    f.read_exact_at(&mut buf, off)?;
                    let (md5, _) = digests(&buf);
                    off += buf.len() as u64;
                    parts.push((n, s3.upload_part(&key, &id, n, buf, &md5).await?));
                    n += 1;
                }
                s3.complete_multipart(&key, &id, &parts).await?;
            }
            Ok(())
        })
        .buffer_unordered(16)
        .collect()
        .await;
    results.into_iter().collect()
}

/// The plain client: every object GET in parallel (large ones in the same ranges the stage
/// uses), bytes counted and dropped.
async fn plain_get(s3: &S3, parallel: usize, split: u64, part: u64) -> Result<(u64, u64)> {
    let objs = s3.list(&s3.spec.prefix).await?;
    let mut ranges = Vec::new();
    for o in &objs {
        if o.size >= split {
            let mut off = 0;
            while off < o.size {
                ranges.push((o.key.clone(), Some((off, part.min(o.size - off)))));
                off += part;
            }
        } else {
            ranges.push((o.key.clone(), None));
        }
    }
    let results: Vec<Result<u64>> = futures::stream::iter(ranges)
        .map(|(key, range)| async move {
            let (mut body, _, _) = s3.get(&key, range).await?;
            let mut n = 0u64;
            while let Some(c) = body.next().await {
                n += c.context("body")?.len() as u64;
            }
            Ok(n)
        })
        .buffer_unordered(parallel)
        .collect()
        .await;
    let mut bytes = 0;
    for r in results {
        bytes += r?;
    }
    Ok((bytes, objs.len() as u64))
}

/// One run's S3 server, dataset and filesystem.
struct Bench {
    rt: tokio::runtime::Runtime,
    root: PathBuf,
    fsroot: PathBuf,
    url: String,
    key: &'static str,
    secret: String,
    spec: S3Spec,
    stage: StageOptions,
}

pub fn run(o: &StageBenchOptions) -> Result<Vec<Row>> {
    std::fs::create_dir_all(&o.root)?;
    let root = o.root.canonicalize()?;
    let s3dir = root.join("s3");
    let _ = std::fs::remove_dir_all(&s3dir);
    std::fs::create_dir_all(s3dir.join("bench"))?;
    let gen = root.join("generated");
    let _ = std::fs::remove_dir_all(&gen);
    println!("generating {} files ({} MiB) ...", o.small_files + o.large_files, o.total_bytes() >> 20);
    generate(&gen, o)?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let (key, secret) = ("odfsbench", format!("secret{:016x}", rand::random::<u64>()));
    let _server = start_server(&s3dir, port, key, &secret, &root.join("s3s-fs.log"))?;
    let b = Bench::new(o, root, port, key, secret)?;
    let state = local::up(&UpOptions { root: b.fsroot.clone(), nodes: o.nodes, ..UpOptions::default() })?;

    // Uploaded through the S3 API, so the server keeps each object's ETag as a real store does.
    println!("uploading the dataset to s3://bench/ds/ ...");
    b.rt.block_on(upload(&S3::new(&b.spec), &gen, b.stage.split_threshold, b.stage.part_size))?;
    std::fs::remove_dir_all(&gen)?;

    let mut rows = vec![b.plain_get(o)?, b.stage_in(o)?];
    rows.extend(b.awscli(o)?);
    local::down(&b.fsroot)?;
    drop(state);
    if !o.keep {
        let _ = std::fs::remove_dir_all(&b.root);
    }
    Ok(rows)
}

impl Bench {
    fn new(o: &StageBenchOptions, root: PathBuf, port: u16, key: &'static str, secret: String) -> Result<Bench> {
        let url = format!("http://127.0.0.1:{port}");
        let fsroot = root.join("fs");
        let _ = local::down(&fsroot);
        let _ = std::fs::remove_dir_all(&fsroot);
        let creds = odfs_proto::stage::S3Credentials {
            access_key_id: key.into(),
            secret_access_key: secret.clone(),
            session_token: None,
        };
        let spec = S3Spec {
            bucket: "bench".into(),
            prefix: "ds/".into(),
            endpoint_url: Some(url.clone()),
            region: "us-east-1".into(),
            path_style: true,
            credentials: Some(creds),
            max_attempts: 8,
            unreachable_secs: 0,
        };
        let stage = StageOptions {
            endpoint_url: Some(url.clone()),
            region: Some("us-east-1".into()),
            path_style: true,
            concurrency: o.concurrency,
            ..StageOptions::default()
        };
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
        Ok(Bench { rt, root, fsroot, url, key, secret, spec, stage })
    }

    /// The plain parallel GET client: as many requests in flight as all agents together.
    fn plain_get(&self, o: &StageBenchOptions) -> Result<Row> {
        let parallel = (o.nodes * o.concurrency) as usize;
        drop_caches();
        let t = Instant::now();
        let (ps, pt) = (self.stage.split_threshold, self.stage.part_size);
        let (bytes, files) = self.rt.block_on(plain_get(&S3::new(&self.spec), parallel, ps, pt))?;
        let name = format!("plain parallel GET ({parallel} in flight, discarded)");
        Ok(Row { name, secs: t.elapsed().as_secs_f64(), bytes, files })
    }

    fn stage_in(&self, o: &StageBenchOptions) -> Result<Row> {
        drop_caches();
        // The coordinator resolves credentials from the environment, as `odfs stage-in` does.
        std::env::set_var("AWS_ACCESS_KEY_ID", self.key);
        std::env::set_var("AWS_SECRET_ACCESS_KEY", &self.secret);
        let cfg = ClientConfig::load(&local::client_config_path(&self.fsroot))?;
        let t = Instant::now();
        let report = self.rt.block_on(async {
            let client = Client::connect(cfg).await?;
            let src = Location::S3 { bucket: "bench".into(), prefix: "ds/".into() };
            let r = odfs_stage::stage_in(&client, &Ctx::current(), &src, "/ds", &self.stage).await;
            client.close().await;
            anyhow::Ok(r?)
        })?;
        let secs = t.elapsed().as_secs_f64();
        if !report.failed.is_empty() {
            bail!("stage-in failed:\n{}", report.summary());
        }
        println!("{}", report.summary());
        let name = format!("odfs stage-in ({} agents x {})", o.nodes, o.concurrency);
        Ok(Row { name, secs, bytes: report.bytes, files: report.files })
    }

    /// `aws s3 cp --recursive` to a local directory, when awscli is installed.
    fn awscli(&self, o: &StageBenchOptions) -> Result<Option<Row>> {
        let dst = self.root.join("awscli");
        let _ = std::fs::remove_dir_all(&dst);
        drop_caches();
        let t = Instant::now();
        let st = Command::new("aws")
            .args(["s3", "cp", "--recursive", "--only-show-errors", "s3://bench/ds"])
            .arg(&dst)
            .args(["--endpoint-url", &self.url])
            .env("AWS_ACCESS_KEY_ID", self.key)
            .env("AWS_SECRET_ACCESS_KEY", &self.secret)
            .env("AWS_REGION", "us-east-1")
            .env("AWS_EC2_METADATA_DISABLED", "true")
            .status();
        match st {
            Ok(s) if s.success() => {
                let (secs, files) = (t.elapsed().as_secs_f64(), walk_count(&dst));
                let name = "aws s3 cp --recursive (to local disk)".into();
                Ok(Some(Row { name, secs, bytes: o.total_bytes(), files }))
            }
            Ok(s) => bail!("aws s3 cp failed ({s})"),
            Err(e) => {
                println!("aws CLI not run ({e}); pip install awscli to compare");
                Ok(None)
            }
        }
    }
}

fn walk_count(dir: &Path) -> u64 {
    let mut n = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                stack.push(e.path());
            } else {
                n += 1;
            }
        }
    }
    n
}

pub fn render(rows: &[Row]) -> String {
    let odfs = rows.get(1).map(|r| r.mib_s()).unwrap_or(0.0);
    let mut s =
        String::from("| client | files | MiB | seconds | MiB/s | odfs stage-in vs this |\n|---|---|---|---|---|---|\n");
    for r in rows {
        let vs = if r.mib_s() > 0.0 { format!("{:.2}x", odfs / r.mib_s()) } else { "-".into() };
        s += &format!("| {} | {} | {} | {:.1} | {:.0} | {vs} |\n", r.name, r.files, r.bytes >> 20, r.secs, r.mib_s());
    }
    s
}
