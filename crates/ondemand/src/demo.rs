//! `odfs demo`: the main job on one machine — a 4-node local filesystem mounted through FUSE, a
//! generated dataset staged in by every node's agent, the job's work through the mount with
//! ordinary file I/O (read the dataset cold, write outputs), the outputs staged out and
//! compared by checksum with the dataset, teardown, a short benchmark through the mount.

use anyhow::{bail, Context, Result};
use odfs_bench::mount::{self as mount_bench, MountBenchOptions};
use odfs_bench::{close, drop_caches, fill_pattern, parallel};
use odfs_client::{Client, ClientConfig, Ctx};
use odfs_job::launch::{mount, procs};
use odfs_job::local::{self, UpOptions};
use odfs_stage::{Location, StageOptions};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

#[derive(Debug, Clone)]
pub struct DemoOptions {
    pub root: PathBuf,
    pub nodes: u32,
    /// Megabytes of generated data.
    pub dataset_mib: u64,
    pub keep: bool,
    pub bench: bool,
}

/// Writes a dataset of small, medium and large files in nested directories; returns bytes.
pub fn generate_dataset(dir: &Path, total_mib: u64) -> Result<u64> {
    let mut total = 0u64;
    let budget = total_mib << 20;
    let mut i = 0u64;
    while total < budget {
        let size = match i % 10 {
            0 => 16 << 20,
            1..=3 => (1 << 20) + i * 4099,
            _ => 1 + (i * 7919) % (256 << 10),
        }
        .min(budget - total);
        let sub = dir.join(format!("shard{:02}/part{}", i % 8, i % 3));
        std::fs::create_dir_all(&sub)?;
        let mut buf = vec![0u8; size as usize];
        fill_pattern(&mut buf, 1000 + i);
        std::fs::write(sub.join(format!("sample{i:05}.bin")), &buf)?;
        total += size;
        i += 1;
    }
    std::fs::create_dir_all(dir.join("empty-dir"))?;
    Ok(total)
}

/// sha256 of every regular file under `dir`, by relative path.
pub fn checksums(dir: &Path) -> Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d)? {
            let e = e?;
            let ft = e.file_type()?;
            if ft.is_dir() {
                stack.push(e.path());
            } else if ft.is_file() {
                let data = std::fs::read(e.path())?;
                let rel = e.path().strip_prefix(dir)?.to_string_lossy().into_owned();
                out.insert(rel, hex::encode(Sha256::digest(&data)));
            }
        }
    }
    Ok(out)
}

/// What [`copy_tree`] copied.
#[derive(Debug, Default, Clone, Copy)]
pub struct TreeCopy {
    pub files: u64,
    pub dirs: u64,
    pub symlinks: u64,
    pub bytes: u64,
}

/// Copies the tree `src` to `dst` (which must not exist) with plain read/write calls, files on
/// `threads` workers: what an application does, so on a mount it goes through the kernel and
/// FUSE. (No `std::fs::copy`: it may take copy_file_range or sendfile shortcuts.)
pub fn copy_tree(src: &Path, dst: &Path, threads: usize) -> Result<TreeCopy> {
    let mut stats = TreeCopy::default();
    let mut files = Vec::new();
    let mut stack = vec![(src.to_path_buf(), dst.to_path_buf())];
    while let Some((s, d)) = stack.pop() {
        std::fs::create_dir(&d).with_context(|| format!("cannot create {}", d.display()))?;
        stats.dirs += 1;
        for e in std::fs::read_dir(&s).with_context(|| format!("cannot list {}", s.display()))? {
            let e = e?;
            let (from, to) = (e.path(), d.join(e.file_name()));
            let ft = e.file_type()?;
            if ft.is_dir() {
                stack.push((from, to));
            } else if ft.is_symlink() {
                std::os::unix::fs::symlink(std::fs::read_link(&from)?, &to)
                    .with_context(|| format!("cannot create symlink {}", to.display()))?;
                stats.symlinks += 1;
            } else if ft.is_file() {
                files.push((from, to));
            }
        }
    }
    let bytes = AtomicU64::new(0);
    let order: Vec<usize> = (0..files.len()).collect();
    parallel(threads, &order, |i| {
        let (from, to) = &files[i];
        let n = copy_file(from, to).with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
        bytes.fetch_add(n, Ordering::Relaxed);
        Ok(())
    })?;
    stats.files = files.len() as u64;
    stats.bytes = bytes.into_inner();
    Ok(stats)
}

/// Copies one file in 1 MiB reads and writes; returns the bytes copied.
fn copy_file(from: &Path, to: &Path) -> Result<u64> {
    let mut r = std::fs::File::open(from)?;
    let mut w = std::fs::OpenOptions::new().write(true).create_new(true).open(to)?;
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = r.read(&mut buf)?;
        if n == 0 {
            break;
        }
        w.write_all(&buf[..n])?;
        total += n as u64;
    }
    // close(2) reports a write odfs could not complete in the background.
    close(w)?;
    Ok(total)
}

/// Workers copying files in and out of the mount.
const COPY_THREADS: usize = 8;

fn print_copy(s: &TreeCopy, secs: f64) {
    let mib = s.bytes as f64 / 1048576.0;
    println!(
        "    {} files, {} dirs, {} symlinks, {mib:.1} MiB in {secs:.2} s ({:.0} MiB/s)",
        s.files,
        s.dirs,
        s.symlinks,
        mib / secs
    );
}

/// Where the demo works: the filesystem's root, its mount, the dataset and the staged-out copy.
struct Places {
    root: PathBuf,
    fsroot: PathBuf,
    mnt: PathBuf,
    src: PathBuf,
    out: PathBuf,
}

/// Where `odfs demo` (`what` = "demo") or `odfs bench` works unless told (`--root`): a
/// directory of its own under `$TMPDIR`, else `/var/tmp` (a disk, where `/tmp` may be memory)
/// — never the directory it is run from, which may be a checkout.
pub fn default_root(what: &str) -> PathBuf {
    let base =
        std::env::var_os("TMPDIR").filter(|t| !t.is_empty()).map_or_else(|| PathBuf::from("/var/tmp"), PathBuf::from);
    let user = nix::unistd::User::from_uid(nix::unistd::getuid())
        .ok()
        .flatten()
        .map_or_else(|| nix::unistd::getuid().to_string(), |u| u.name);
    base.join(format!("odfs-{what}-{user}"))
}

pub fn run(o: &DemoOptions) -> Result<()> {
    // The benchmark needs fio; without it the demo still runs the job.
    let bench = match (o.bench, mount_bench::fio()) {
        (true, Err(e)) => {
            println!("(the closing benchmark is skipped: {e:#})");
            false
        }
        (b, _) => b,
    };
    let p = prepare(&o.root)?;
    if !o.keep {
        // Ctrl-C, or a phase past its bound, removes it too.
        odfs_job::interrupt::removing(&p.root);
    }
    let result = run_steps(o, &p, bench);
    odfs_bench::phase::end();
    let left = leave_root(o, &p.root);
    result?;
    left?;
    println!("demo finished: filesystem stopped, no process or mount left");
    Ok(())
}

/// The demo's steps, each a bounded phase.
fn run_steps(o: &DemoOptions, p: &Places, bench: bool) -> Result<()> {
    let state = start_filesystem(o, p)?;
    let result = run_job(o, p);
    odfs_bench::phase::begin("stopping the demo filesystem");
    let down = local::down(&p.fsroot);
    result?;
    check_teardown(p, &state, down)?;
    if bench {
        run_bench(o, &p.root)?;
    } else {
        println!("6/6 benchmark skipped");
    }
    Ok(())
}

/// What the demo leaves when it ends, whether it worked or not: nothing (its root removed),
/// or with `--keep` everything, and the last line says which.
fn leave_root(o: &DemoOptions, root: &Path) -> Result<()> {
    if o.keep {
        println!(
            "kept {} (--keep): its data, logs and configs; remove it with `rm -r {}`",
            root.display(),
            root.display()
        );
        return Ok(());
    }
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    if let Some(m) = mount::parse_mountinfo(&text).into_iter().find(|m| m.mount_point.starts_with(root)) {
        bail!(
            "left {}: {} is still mounted; unmount it, then remove {}",
            root.display(),
            m.mount_point.display(),
            root.display()
        );
    }
    let bytes = local::disk_usage(root);
    std::fs::remove_dir_all(root).with_context(|| format!("cannot remove {}", root.display()))?;
    odfs_job::interrupt::removed(root);
    println!("removed {} ({}; --keep keeps it)", root.display(), odfs_proto::units::bytes(bytes));
    Ok(())
}

/// Clears what an earlier demo under `root` left (its filesystem, mount and copies).
fn prepare(root: &Path) -> Result<Places> {
    std::fs::create_dir_all(root)?;
    let root = root.canonicalize()?;
    let fsroot = root.join("fs");
    let p = Places { mnt: fsroot.join("mnt"), src: root.join("dataset"), out: root.join("dataset-out"), fsroot, root };
    if p.fsroot.is_dir() {
        let _ = local::down(&p.fsroot);
    }
    mount::unmount(&p.mnt)?;
    for d in [&p.fsroot, &p.src, &p.out] {
        let _ = std::fs::remove_dir_all(d);
    }
    Ok(p)
}

fn start_filesystem(o: &DemoOptions, p: &Places) -> Result<local::LocalState> {
    println!(
        "1/6 starting a {}-node odfs on this machine under {}, mounted at {}",
        o.nodes,
        p.fsroot.display(),
        p.mnt.display()
    );
    odfs_bench::phase::begin(format!("1/6 starting a {}-node odfs", o.nodes));
    let t = Instant::now();
    let up = UpOptions { root: p.fsroot.clone(), nodes: o.nodes, mount: Some(p.mnt.clone()), ..UpOptions::default() };
    let state = local::up(&up)?;
    println!(
        "    ready in {:.2} s: mgmtd + metad on node 0, stored and a stage agent on each of {} nodes, odfs-fuse ({} processes)",
        t.elapsed().as_secs_f64(),
        o.nodes,
        state.procs.len()
    );
    Ok(state)
}

/// The job: a dataset staged in, worked on through the mount, staged out and compared.
fn run_job(o: &DemoOptions, p: &Places) -> Result<()> {
    println!("2/6 generating a {} MiB dataset in {}", o.dataset_mib, p.src.display());
    odfs_bench::phase::begin("2/6 generating the dataset");
    let bytes = generate_dataset(&p.src, o.dataset_mib)?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let client = rt.block_on(Client::connect(ClientConfig::load(&local::client_config_path(&p.fsroot))?))?;
    let stage = StageOptions::default();

    println!("3/6 stage-in {} -> odfs:/dataset (every node's agent moves its share, verified)", p.src.display());
    odfs_bench::phase::begin("3/6 stage-in");
    let src = Location::Posix(p.src.clone());
    let r = rt.block_on(odfs_stage::stage_in(&client, &Ctx::current(), &src, "/dataset", &stage))?;
    println!("    {}", r.summary().replace('\n', "\n    "));
    anyhow::ensure!(r.failed.is_empty() && r.refused.is_empty() && r.bytes == bytes, "stage-in incomplete");

    // The job: read the dataset through the mount (cold) and write its outputs there.
    let cold = if drop_caches() { "page cache dropped" } else { "page cache not dropped: not root" };
    let mnt = p.mnt.display();
    println!("4/6 the job, through the mount: {mnt}/dataset -> {mnt}/out ({COPY_THREADS} workers, {cold})");
    odfs_bench::phase::begin("4/6 the job, through the mount");
    let t = Instant::now();
    let s = copy_tree(&p.mnt.join("dataset"), &p.mnt.join("out"), COPY_THREADS)?;
    print_copy(&s, t.elapsed().as_secs_f64());

    println!("5/6 stage-out odfs:/out -> {} and comparing sha256 of every file with the dataset", p.out.display());
    odfs_bench::phase::begin("5/6 stage-out and compare");
    let dst = Location::Posix(p.out.clone());
    let r = rt.block_on(odfs_stage::stage_out(&client, &Ctx::current(), "/out", &dst, &stage))?;
    println!("    {}", r.summary().replace('\n', "\n    "));
    anyhow::ensure!(r.failed.is_empty(), "stage-out incomplete");
    rt.block_on(client.close());
    let n = compare_outputs(&p.src, &p.out)?;
    println!("    all {n} files identical ({bytes} bytes), completion marker written");
    Ok(())
}

/// The staged-out outputs must be the dataset, file by file (sha256); returns the file count.
fn compare_outputs(src: &Path, out: &Path) -> Result<usize> {
    let mut a = checksums(src)?;
    let mut b = checksums(out)?;
    // The stage records (manifests, marker) are not part of the data.
    for m in [&mut a, &mut b] {
        m.retain(|k, _| !odfs_stage::manifest::reserved(k));
    }
    if a != b {
        let missing_in_a = b.keys().filter(|k| !a.contains_key(*k));
        let diff: Vec<_> = a.keys().chain(missing_in_a).filter(|k| a.get(*k) != b.get(*k)).take(5).collect();
        bail!("outputs differ from the dataset after stage-in, the job and stage-out: {diff:?}");
    }
    anyhow::ensure!(out.join("empty-dir").is_dir(), "the empty directory did not come back");
    anyhow::ensure!(out.join(odfs_stage::manifest::STAGE_OUT_MARKER).is_file(), "no completion marker");
    Ok(a.len())
}

/// After `local down`: no mount and no process of the demo left.
fn check_teardown(p: &Places, state: &local::LocalState, down: Result<local::DownReport>) -> Result<()> {
    let down = down.context("stopping the demo filesystem")?;
    for step in &down.unmount_steps {
        println!("    {step}");
    }
    anyhow::ensure!(mount::mount_at(&p.mnt).is_none(), "{} is still mounted after teardown", p.mnt.display());
    let left: Vec<u32> = state.procs.iter().filter(|p| procs::runs(p.pid, &p.config)).map(|p| p.pid).collect();
    anyhow::ensure!(left.is_empty(), "processes {left:?} still run after teardown");
    println!("    filesystem stopped: all {} processes ended, mount removed", state.procs.len());
    Ok(())
}

fn run_bench(o: &DemoOptions, root: &Path) -> Result<()> {
    println!("6/6 short benchmark through the mount (odfs vs a plain directory on the same disk)");
    let bo = MountBenchOptions { root: root.join("bench"), nodes: o.nodes, ..MountBenchOptions::small() };
    print!("{}", bo.describe());
    let (phases, dropped, notes) = mount_bench::run(&bo)?;
    print!("{}", mount_bench::render(&phases));
    for n in notes {
        println!("{n}");
    }
    if !dropped {
        println!("    (page cache could not be dropped: reads may be served from memory)");
    }
    Ok(())
}
