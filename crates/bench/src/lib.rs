//! `odfs bench`: the same workload on odfs (through the client library) and on a plain
//! directory of the same local disk, in one run, with ratios and CPU time.
//!
//! Phases: sequential write (each client one file, fsync at the end), sequential read after
//! dropping the page cache, then metadata (mdtest-easy style: each thread its own directory;
//! create, stat, unlink of empty files).
//!
//! `odfs bench --mount` ([`mount`]) runs a wider workload through the FUSE mount instead. Shared
//! here: the result rows, CPU accounting, the data pattern, dropping the page cache and the
//! small file-I/O helpers the demo uses too.

pub mod minimum;
pub mod minimum_fs;
pub mod mount;
pub mod phase;
pub mod shards;
pub mod stage;
pub mod startup;
mod transport;
pub mod uring_minimum;

use anyhow::{Context, Result};
use odfs_client::{Client, ClientConfig, Ctx};
use odfs_job::launch::procs;
use odfs_job::local::{self, UpOptions};
use odfs_proto::InodeId;
use odfs_rpc::Transport;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Working directory: the local filesystem lives in `ROOT/fs`, the plain directory in `ROOT/plain`.
    pub root: PathBuf,
    pub nodes: u32,
    pub clients: usize,
    pub file_size: u64,
    pub io_size: usize,
    pub threads: usize,
    pub files_per_thread: usize,
    pub transport: Transport,
    pub skip_plain: bool,
    pub keep: bool,
}

impl BenchOptions {
    /// The same phases at sizes that finish in well under a minute.
    pub fn small() -> Self {
        BenchOptions { file_size: 64 << 20, files_per_thread: 2_000, ..BenchOptions::default() }
    }
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            root: PathBuf::from("odfs-bench"),
            nodes: 4,
            clients: 4,
            file_size: 1 << 30,
            io_size: 1 << 20,
            threads: 4,
            files_per_thread: 20_000,
            transport: Transport::Tcp,
            skip_plain: false,
            keep: false,
        }
    }
}

/// One measured phase.
#[derive(Debug, Clone)]
pub struct Phase {
    pub name: &'static str,
    /// "MiB/s", "ops/s", "IOPS" or "files/s".
    pub unit: &'static str,
    pub odfs: f64,
    pub plain: Option<f64>,
    pub odfs_cpu: f64,
    pub plain_cpu: Option<f64>,
    /// The same phase on a plain FUSE passthrough of the same disk (bindfs), where measured.
    pub floor: Option<f64>,
    /// CPU seconds of that phase on the FUSE floor: the tool's and bindfs's own.
    pub floor_cpu: Option<f64>,
    /// Requests that reached metad (every shard) during the odfs run, where counted.
    pub meta_requests: Option<u64>,
}

impl Phase {
    pub fn ratio(&self) -> Option<f64> {
        self.plain.filter(|p| *p > 0.0).map(|p| self.odfs / p)
    }

    /// A phase measured on odfs alone so far (the other sides are filled in when measured).
    pub fn odfs_only(name: &'static str, unit: &'static str, odfs: f64, cpu: f64) -> Phase {
        Phase {
            name,
            unit,
            odfs,
            plain: None,
            odfs_cpu: cpu,
            plain_cpu: None,
            floor: None,
            floor_cpu: None,
            meta_requests: None,
        }
    }

    /// odfs against the FUSE floor.
    pub fn floor_ratio(&self) -> Option<f64> {
        self.floor.filter(|p| *p > 0.0).map(|p| self.odfs / p)
    }
}

/// Fills `buf` with cheap pseudo-random bytes (xorshift), different per seed.
pub fn fill_pattern(buf: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}

/// Drops the page cache so reads come from disk; returns false without root.
pub fn drop_caches() -> bool {
    let _waiting =
        crate::phase::waiting("sync(2), which waits for every mounted filesystem (each FUSE daemon must answer)");
    // SAFETY: sync has no preconditions.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok()
}

/// Closes `f` and returns close(2)'s error: odfs reports a failed background write there.
pub fn close(f: std::fs::File) -> std::io::Result<()> {
    use std::os::fd::IntoRawFd;
    // SAFETY: the fd is owned by `f`, which gives it up here.
    if unsafe { libc::close(f.into_raw_fd()) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Runs `work(i)` for every item of `order` on `threads` workers taking the next item as they go.
pub fn parallel(threads: usize, order: &[usize], work: impl Fn(usize) -> Result<()> + Sync) -> Result<()> {
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| -> Result<()> {
                    loop {
                        let k = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&i) = order.get(k) else { return Ok(()) };
                        work(i)?;
                    }
                })
            })
            .collect();
        hs.into_iter().try_for_each(|h| h.join().expect("worker thread"))
    })
}

/// CPU seconds (user + system) of this process's children that have exited and been waited
/// for — a benchmark tool such as fio run to completion during a phase.
fn children_cpu_seconds() -> f64 {
    // SAFETY: getrusage only writes the struct it is given.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru) } != 0 {
        return 0.0;
    }
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    secs(ru.ru_utime) + secs(ru.ru_stime)
}

/// CPU time of a phase: this process, the children it waited for (fio), and `pids` (daemons).
/// The daemons this tool started are children too, but they exit only at teardown.
pub(crate) struct CpuMeter {
    pids: Vec<u32>,
    start: f64,
}

impl CpuMeter {
    pub(crate) fn start(pids: &[u32]) -> CpuMeter {
        let pids = pids.to_vec();
        let start = Self::total(&pids);
        CpuMeter { pids, start }
    }
    fn total(pids: &[u32]) -> f64 {
        procs::self_cpu_seconds() + children_cpu_seconds() + pids.iter().map(|&p| procs::cpu_seconds(p)).sum::<f64>()
    }
    pub(crate) fn stop(&self) -> f64 {
        Self::total(&self.pids) - self.start
    }
}

/// Runs `work(client, ctx, c)` for every client index `c`, each with its own connection, and
/// waits for all of them.
async fn per_client<F, Fut>(cfg: &ClientConfig, clients: usize, work: F) -> Result<()>
where
    F: Fn(Client, Ctx, usize) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<()>> + Send + 'static,
{
    let mut tasks = Vec::new();
    for c in 0..clients {
        let (cfg, work) = (cfg.clone(), work.clone());
        tasks.push(tokio::spawn(async move { work(Client::connect(cfg).await?, Ctx::current(), c).await }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(())
}

async fn odfs_seq_write(cfg: &ClientConfig, o: &BenchOptions) -> Result<()> {
    let client = Client::connect(cfg.clone()).await?;
    let dir = client.mkdir_all(&Ctx::current(), "/bench/seq", 0o755).await?;
    drop(client);
    let (size, io) = (o.file_size, o.io_size);
    per_client(cfg, o.clients, move |client, ctx, c| async move {
        let (_, h) = client.create_open(&ctx, dir.ino, format!("c{c}").as_bytes(), 0o644, false, None).await?;
        let mut buf = vec![0u8; io];
        fill_pattern(&mut buf, c as u64);
        let mut off = 0;
        while off < size {
            let n = (size - off).min(io as u64) as usize;
            h.write(off, &buf[..n]).await?;
            off += n as u64;
        }
        h.fsync().await?;
        h.close().await?;
        Ok(())
    })
    .await
}

async fn odfs_seq_read(cfg: &ClientConfig, o: &BenchOptions) -> Result<()> {
    let (size, io) = (o.file_size, o.io_size);
    per_client(cfg, o.clients, move |client, ctx, c| async move {
        let a = client.resolve(&ctx, &format!("/bench/seq/c{c}"), true).await?;
        let h = client.open(&ctx, a.ino, true, false, false).await?;
        let mut off = 0;
        loop {
            let d = h.read(off, io as u32).await?;
            if d.is_empty() {
                break;
            }
            off += d.len() as u64;
        }
        h.close().await?;
        anyhow::ensure!(off == size, "client {c} read {off} bytes of {size}");
        Ok(())
    })
    .await
}

#[derive(Clone, Copy)]
enum MdOp {
    Create,
    Stat,
    Unlink,
}

async fn odfs_md(cfg: &ClientConfig, o: &BenchOptions, op: MdOp, dirs: &[InodeId]) -> Result<()> {
    let ctx = Ctx::current();
    let client = Client::connect(cfg.clone()).await?;
    let mut tasks = Vec::new();
    for (t, &dir) in dirs.iter().enumerate().take(o.threads) {
        let client = client.clone();
        let ctx = ctx.clone();
        let n = o.files_per_thread;
        tasks.push(tokio::spawn(async move {
            for i in 0..n {
                let name = format!("f{t}.{i}");
                match op {
                    MdOp::Create => {
                        client.create(&ctx, dir, name.as_bytes(), 0o644, true, None).await?;
                    }
                    MdOp::Stat => {
                        client.lookup(&ctx, dir, name.as_bytes()).await?;
                    }
                    MdOp::Unlink => client.unlink(&ctx, dir, name.as_bytes()).await?,
                }
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(())
}

fn plain_seq_write(dir: &Path, o: &BenchOptions) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..o.clients)
            .map(|c| {
                let p = dir.join(format!("c{c}"));
                s.spawn(move || -> Result<()> {
                    let mut f = std::fs::File::create(&p)?;
                    let mut buf = vec![0u8; o.io_size];
                    fill_pattern(&mut buf, c as u64);
                    let mut off = 0;
                    while off < o.file_size {
                        let n = (o.file_size - off).min(o.io_size as u64) as usize;
                        f.write_all(&buf[..n])?;
                        off += n as u64;
                    }
                    f.sync_all()?;
                    Ok(())
                })
            })
            .collect();
        hs.into_iter().try_for_each(|h| h.join().expect("writer thread"))
    })
}

fn plain_seq_read(dir: &Path, o: &BenchOptions) -> Result<()> {
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..o.clients)
            .map(|c| {
                let p = dir.join(format!("c{c}"));
                s.spawn(move || -> Result<()> {
                    let mut f = std::fs::File::open(&p)?;
                    let mut buf = vec![0u8; o.io_size];
                    let mut total = 0u64;
                    loop {
                        let n = f.read(&mut buf)?;
                        if n == 0 {
                            break;
                        }
                        total += n as u64;
                    }
                    anyhow::ensure!(total == o.file_size, "read {total} of {}", o.file_size);
                    Ok(())
                })
            })
            .collect();
        hs.into_iter().try_for_each(|h| h.join().expect("reader thread"))
    })
}

fn plain_md(dir: &Path, o: &BenchOptions, op: MdOp) -> Result<()> {
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..o.threads)
            .map(|t| {
                let d = dir.join(format!("t{t}"));
                s.spawn(move || -> Result<()> {
                    std::fs::create_dir_all(&d)?;
                    for i in 0..o.files_per_thread {
                        let p = d.join(format!("f{t}.{i}"));
                        match op {
                            MdOp::Create => {
                                std::fs::OpenOptions::new().write(true).create_new(true).open(&p)?;
                            }
                            MdOp::Stat => {
                                std::fs::metadata(&p)?;
                            }
                            MdOp::Unlink => std::fs::remove_file(&p)?,
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        hs.into_iter().try_for_each(|h| h.join().expect("md thread"))
    })
}

fn time<T>(pids: &[u32], f: impl FnOnce() -> Result<T>) -> Result<(f64, f64)> {
    let cpu = CpuMeter::start(pids);
    let t = Instant::now();
    f()?;
    Ok((t.elapsed().as_secs_f64(), cpu.stop()))
}

/// Runs every phase; prints progress to stderr. The local filesystem is stopped at the end.
pub fn run(o: &BenchOptions) -> Result<(Vec<Phase>, bool)> {
    std::fs::create_dir_all(&o.root).with_context(|| format!("cannot create {}", o.root.display()))?;
    let root = o.root.canonicalize()?;
    let fsroot = root.join("fs");
    let plain = root.join("plain");
    let _ = local::down(&fsroot);
    let _ = std::fs::remove_dir_all(&fsroot);
    let _ = std::fs::remove_dir_all(&plain);
    let up = UpOptions { root: fsroot.clone(), nodes: o.nodes, bulk: o.transport, ..UpOptions::default() };
    let state = local::up(&up)?;
    let pids: Vec<u32> = state.procs.iter().map(|p| p.pid).collect();
    let result = run_phases(o, &fsroot, &plain, &pids);
    let _ = local::down(&fsroot);
    if !o.keep {
        let _ = std::fs::remove_dir_all(&fsroot);
        let _ = std::fs::remove_dir_all(&plain);
    }
    result
}

fn run_phases(o: &BenchOptions, fsroot: &Path, plain: &Path, pids: &[u32]) -> Result<(Vec<Phase>, bool)> {
    let cfg = ClientConfig::load(&local::client_config_path(fsroot))?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let mib = (o.clients as u64 * o.file_size) as f64 / (1 << 20) as f64;
    let ops = (o.threads * o.files_per_thread) as f64;
    let mut phases = Vec::new();
    let mut dropped = true;

    crate::phase::say("bench", format!("sequential write, {} clients x {} MiB", o.clients, o.file_size >> 20));
    let (t, c) = time(pids, || rt.block_on(odfs_seq_write(&cfg, o)))?;
    let mut p = Phase::odfs_only("seq write", "MiB/s", mib / t, c);
    if !o.skip_plain {
        let (t, c) = time(&[], || plain_seq_write(&plain.join("seq"), o))?;
        p.plain = Some(mib / t);
        p.plain_cpu = Some(c);
    }
    phases.push(p);

    crate::phase::say("bench", "sequential read (page cache dropped)".to_string());
    dropped &= drop_caches();
    let (t, c) = time(pids, || rt.block_on(odfs_seq_read(&cfg, o)))?;
    let mut p = Phase::odfs_only("seq read", "MiB/s", mib / t, c);
    if !o.skip_plain {
        dropped &= drop_caches();
        let (t, c) = time(&[], || plain_seq_read(&plain.join("seq"), o))?;
        p.plain = Some(mib / t);
        p.plain_cpu = Some(c);
    }
    phases.push(p);

    let dirs: Vec<InodeId> = rt.block_on(async {
        let client = Client::connect(cfg.clone()).await?;
        let ctx = Ctx::current();
        let mut v = Vec::new();
        for t in 0..o.threads {
            v.push(client.mkdir_all(&ctx, &format!("/bench/md/t{t}"), 0o755).await?.ino);
        }
        anyhow::Ok(v)
    })?;
    for (name, op) in [("create", MdOp::Create), ("stat", MdOp::Stat), ("unlink", MdOp::Unlink)] {
        crate::phase::say("bench", format!("{name}, {} threads x {} files", o.threads, o.files_per_thread));
        let (t, c) = time(pids, || rt.block_on(odfs_md(&cfg, o, op, &dirs)))?;
        let mut p = Phase::odfs_only(name, "ops/s", ops / t, c);
        if !o.skip_plain {
            let (t, c) = time(&[], || plain_md(&plain.join("md"), o, op))?;
            p.plain = Some(ops / t);
            p.plain_cpu = Some(c);
        }
        phases.push(p);
    }
    rt.shutdown_timeout(Duration::from_secs(1));
    Ok((phases, dropped))
}

/// Renders results as a Markdown table.
pub fn render(phases: &[Phase]) -> String {
    let mut s =
        String::from("| phase | odfs | plain dir | ratio | odfs CPU-s | plain CPU-s |\n|---|---|---|---|---|---|\n");
    for p in phases {
        let plain = p.plain.map(|v| format!("{v:.0} {}", p.unit)).unwrap_or_else(|| "-".into());
        let ratio = p.ratio().map(|r| format!("{r:.2}x")).unwrap_or_else(|| "-".into());
        let pc = p.plain_cpu.map(|v| format!("{v:.1}")).unwrap_or_else(|| "-".into());
        s.push_str(&format!(
            "| {} | {:.0} {} | {plain} | {ratio} | {:.1} | {pc} |\n",
            p.name, p.odfs, p.unit, p.odfs_cpu
        ));
    }
    s
}
