//! `odfs bench --mount`: one workload through the FUSE mount of a local odfs and on a plain
//! directory of the same disk, in one run, with ratios and CPU time.
//!
//! Owns the mount-mode phases: fio sequential write and read and 4 KiB random reads (fio's JSON
//! report gives the rates), a checkpoint storm (every writer a large file at once, read back cold
//! by the others; on odfs with local placement and with the default stripe), mdtest-easy style
//! metadata (each worker its own directory), many workers in one shared directory, cold reads of
//! many small files in random order, and two more epochs of those reads with the caches kept (a
//! training job's dataset). The metadata and small-file phases are plain file-system calls from
//! worker threads, so on odfs they go through the kernel and FUSE like any application's; the
//! sequential write and read also run on odfs with `O_DIRECT` (odfs's own part, without the mount's
//! page cache). Every phase also runs on a plain FUSE passthrough of the same disk (bindfs, when
//! installed): the FUSE floor; the sequential read also runs with only loopback TCP between the
//! disk and the reader (the network minimum), and on the FUSE minimum fed over loopback TCP (the
//! FUSE + network minimum; the minima also read in the checkpoint read's shape, 4 MiB reads of
//! another reader's file), the 4 KiB random read on one striped as the default layout is (the
//! FUSE + striped minimum, at several reader thread counts, over `/dev/fuse` and over the
//! kernel's io_uring transport for FUSE), the sequential write on the FUSE
//! minimum and on one that sends every WRITE over loopback TCP to the plain directory's disk
//! (the FUSE + network minimum for writes);
//! the read minimum, the creates and the small reads also run on the FUSE minimum, served from this
//! process and from a process of its own session (`super::minimum`). The requests that reach metad
//! during each odfs phase are counted (metad's `GetStats`), so what the caches answer shows. The
//! filesystem is started and stopped through [`odfs_job::local`].

use super::minimum::{self, Minimum, MinimumSpec};
use super::transport;
use super::{close, drop_caches, fill_pattern, parallel, CpuMeter, Phase};
use crate::minimum_fs::MinimumFs;
use anyhow::{bail, Context, Result};
use odfs_job::launch::mount;
use odfs_job::local::{self, UpOptions};
use odfs_rpc::Transport;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Requests that keep a session alive or read the counters themselves: not the workload's.
const UNCOUNTED: [&str; 2] = ["SessionPoll", "GetStats"];

/// Reads metad's request counters of every shard, through a client of the filesystem.
struct MetaCounter {
    rt: tokio::runtime::Runtime,
    client: odfs_client::Client,
}

impl MetaCounter {
    fn connect(fsroot: &Path) -> Result<MetaCounter> {
        let cfg = odfs_client::ClientConfig::load(&local::client_config_path(fsroot))?;
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
        let client = rt.block_on(odfs_client::Client::connect(cfg))?;
        Ok(MetaCounter { rt, client })
    }

    fn shards(&self) -> u16 {
        self.client.cluster().view().meta_shards().max(1)
    }

    /// Requests served by every shard so far, less the uncounted kinds.
    fn total(&self) -> Result<u64> {
        let counts = self.rt.block_on(self.client.meta_request_counts())?;
        Ok(counts.iter().filter(|(_, k, _)| !UNCOUNTED.contains(&k.as_str())).map(|(_, _, n)| n).sum())
    }
}

/// Options of `odfs bench --mount`; `Default` is the published shape, [`Self::small`] a quick run.
#[derive(Debug, Clone)]
pub struct MountBenchOptions {
    /// Working directory: the local filesystem lives in `ROOT/fs` (mounted at `ROOT/fs/mnt`),
    /// the plain directory is `ROOT/plain`.
    pub root: PathBuf,
    pub nodes: u32,
    pub transport: Transport,
    /// Transport of metadata requests.
    pub meta_transport: Transport,
    /// fio jobs, one file each, for the sequential and random-read phases.
    pub jobs: usize,
    /// Bytes of each fio job's file.
    pub job_size: u64,
    /// Length of the time-bounded 4 KiB random-read phase.
    pub randread_secs: u64,
    pub iodepth: u32,
    /// Metadata workers: each in its own directory, then all in one shared directory.
    pub threads: usize,
    pub files_per_thread: usize,
    pub shared_files_per_thread: usize,
    /// Bytes of each file in the shared directory.
    pub shared_file_size: usize,
    pub small_files: usize,
    pub small_file_size: usize,
    pub small_dirs: usize,
    /// Workers writing and then reading the small files.
    pub small_threads: usize,
    pub skip_plain: bool,
    /// Pause after each unlink phase (see `settle_deletes`); none at the small scale.
    pub settle: Duration,
    /// Skip the FUSE floor (bindfs) column.
    pub skip_floor: bool,
    pub keep: bool,
}

impl Default for MountBenchOptions {
    fn default() -> Self {
        MountBenchOptions {
            root: PathBuf::from("odfs-bench"),
            nodes: 4,
            transport: Transport::Tcp,
            meta_transport: odfs_client::ClientConfig::default().meta_transport,
            jobs: 4,
            job_size: 1 << 30,
            randread_secs: 15,
            iodepth: 16,
            threads: 4,
            files_per_thread: 20_000,
            shared_files_per_thread: 20_000,
            shared_file_size: 3901,
            small_files: 50_000,
            small_file_size: 50 << 10,
            small_dirs: 100,
            small_threads: 8,
            skip_plain: false,
            settle: SETTLE,
            skip_floor: false,
            keep: false,
        }
    }
}

impl MountBenchOptions {
    /// The same phases at sizes that finish in under a minute.
    pub fn small() -> Self {
        MountBenchOptions {
            job_size: 64 << 20,
            randread_secs: 5,
            files_per_thread: 2_000,
            // Creates and unlinks of files with data cost several round trips each on odfs.
            shared_files_per_thread: 1_000,
            small_files: 5_000,
            settle: Duration::ZERO,
            ..MountBenchOptions::default()
        }
    }

    /// One line per phase group saying what was measured.
    pub fn describe(&self) -> String {
        format!(
            "seq: fio {} jobs x {} MiB, 1 MiB blocks, end_fsync, page cache dropped before reads\n\
             rand read: fio 4 KiB, O_DIRECT, libaio, iodepth {}, {} jobs, {} s over the seq files\n\
             ckpt: {} writers x {} MiB at once (4 MiB writes, fsync, close), read back cold by {} readers, each\n\
             another writer's file, then fio 4 KiB random reads over them as above; on odfs once with local\n\
             placement (stripe count 1, FUSE passthrough where the kernel offers it), once with the default stripe\n\
             md: {} workers x {} empty files, each worker its own directory; {} s pause after each unlink phase\n\
             shared: {} workers x {} files of {} bytes in one directory\n\
             small: {} files of {} KiB in {} directories, {} workers; read cold in random order, then\n\
             twice more in other random orders with caches kept (epochs 2 and 3)\n\
             FUSE floor: the same phases on bindfs (libfuse passthrough, default caching) of the same disk\n\
             CPU-s: the tool's (fio's, or this process's workers) and the side's own processes: every odfs\n\
             daemon and odfs-fuse for odfs, bindfs for the floor, none for the plain directory\n\
             odfs: chunk data over {:?}, metadata over {:?}\n",
            self.jobs,
            self.job_size >> 20,
            self.iodepth,
            self.jobs,
            self.randread_secs,
            self.jobs,
            self.job_size >> 20,
            self.jobs,
            self.threads,
            self.files_per_thread,
            self.settle.as_secs(),
            self.threads,
            self.shared_files_per_thread,
            self.shared_file_size,
            self.small_files,
            self.small_file_size >> 10,
            self.small_dirs,
            self.small_threads,
            self.transport,
            self.meta_transport
        )
    }
}

/// One side's result of one phase.
#[derive(Debug, Clone, Copy)]
struct Sample {
    secs: f64,
    cpu: f64,
    /// Rate reported by the tool itself (fio), else amount / secs is used.
    rate: Option<f64>,
}

/// One phase measured on every side.
struct Sampled {
    odfs: Sample,
    plain: Option<Sample>,
    floor: Option<Sample>,
    /// Requests that reached metad during the odfs run.
    meta: Option<u64>,
}

/// The sides of one run: the odfs mount (whose CPU includes every odfs process), the plain
/// directory and the FUSE floor (bindfs over a directory of the same disk).
struct Sides {
    mnt: PathBuf,
    plain: Option<PathBuf>,
    floor: Option<PathBuf>,
    counter: Option<MetaCounter>,
    /// Daemons and odfs-fuse.
    pids: Vec<u32>,
    /// The FUSE floor's daemon (bindfs), whose CPU counts for the floor as odfs's for odfs.
    floor_pids: Vec<u32>,
    phases: Vec<Phase>,
    dropped: bool,
    /// Lines printed under the table.
    notes: Vec<String>,
}

impl Sides {
    /// Where the FUSE minimum is mounted: beside the odfs filesystem's directory.
    fn minimum_dir(&self) -> PathBuf {
        self.mnt.parent().and_then(Path::parent).unwrap_or(Path::new("/tmp")).join("minimum")
    }

    /// Runs `f(dir, side)` on the mount, then on the plain directory and the FUSE floor, each
    /// started as `start` says.
    fn run(&mut self, start: Start, f: impl Fn(&Path, &str) -> Result<Option<f64>>) -> Result<Sampled> {
        let mut s = self.run_series(&[start], |dir, side, _| f(dir, side))?;
        Ok(s.remove(0))
    }

    /// Runs the steps `f(dir, side, i)` one after the other on each side in turn (the mount,
    /// the plain directory, the FUSE floor), step i started as `starts[i]` says: a side's later
    /// steps find what its earlier ones cached, untouched by the other sides. One result per
    /// step.
    fn run_series(
        &mut self,
        starts: &[Start],
        f: impl Fn(&Path, &str, usize) -> Result<Option<f64>>,
    ) -> Result<Vec<Sampled>> {
        let mut dropped = true;
        let mut one = |dir: &Path, side: &str, pids: &[u32], i: usize| -> Result<Sample> {
            let _waiting = crate::phase::waiting(format!("the {side} side's work in {}", dir.display()));
            match starts[i] {
                Start::Cold => dropped &= drop_caches(),
                Start::Settled => {
                    dropped &= drop_caches();
                    std::thread::sleep(MEMORY_SETTLE);
                }
                // Each step starts with no dirty data left by the one before (often another
                // side's): writeback owed by a previous step would throttle this one's writes.
                // SAFETY: sync has no preconditions.
                Start::Warm => {
                    let _waiting = crate::phase::waiting("sync(2), which waits for every mounted filesystem");
                    unsafe { libc::sync() }
                }
            }
            let cpu = CpuMeter::start(pids);
            let t = Instant::now();
            let rate = f(dir, side, i).with_context(|| format!("{side} ({})", dir.display()))?;
            Ok(Sample { secs: t.elapsed().as_secs_f64(), cpu: cpu.stop(), rate })
        };
        // The counter's own requests (one per shard) are not the workload's.
        let shards = self.counter.as_ref().map_or(0, |c| c.shards() as u64);
        let mut odfs = Vec::new();
        for i in 0..starts.len() {
            let before = self.counter.as_ref().map(|c| c.total()).transpose()?;
            let o = one(&self.mnt, "odfs", &self.pids, i)?;
            let after = self.counter.as_ref().map(|c| c.total()).transpose()?;
            odfs.push((o, before.zip(after).map(|(b, a)| a.saturating_sub(b).saturating_sub(shards))));
        }
        let mut side = |dir: &Option<PathBuf>, name: &str, pids: &[u32]| -> Result<Vec<Option<Sample>>> {
            (0..starts.len()).map(|i| dir.as_ref().map(|d| one(d, name, pids, i)).transpose()).collect()
        };
        let plain = side(&self.plain, "plain", &[])?;
        let floor = side(&self.floor, "floor", &self.floor_pids)?;
        self.dropped &= dropped;
        let secs = |s: &Option<Sample>| s.map(|s| format!("{:.1} s", s.secs)).unwrap_or_else(|| "-".into());
        let mut out = Vec::new();
        for (((o, meta), p), fl) in odfs.into_iter().zip(plain).zip(floor) {
            eprintln!(
                "       odfs {:.1} s ({} metad requests), plain {}, FUSE floor {}",
                o.secs,
                meta.map(|m| m.to_string()).unwrap_or_else(|| "?".into()),
                secs(&p),
                secs(&fl)
            );
            out.push(Sampled { odfs: o, plain: p, floor: fl, meta });
        }
        Ok(out)
    }

    /// Adds a row: the tool's rate if it gave one, else `amount` per second.
    fn push(&mut self, name: &'static str, unit: &'static str, amount: f64, s: &Sampled) {
        let value = |x: &Sample| x.rate.unwrap_or(amount / x.secs);
        self.phases.push(Phase {
            name,
            unit,
            odfs: value(&s.odfs),
            plain: s.plain.as_ref().map(value),
            odfs_cpu: s.odfs.cpu,
            plain_cpu: s.plain.map(|x| x.cpu),
            floor: s.floor.as_ref().map(value),
            // Without bindfs's own process the floor's CPU would be the tool's alone.
            floor_cpu: s.floor.filter(|_| !self.floor_pids.is_empty()).map(|x| x.cpu),
            meta_requests: s.meta,
        });
    }
}

/// How a step of [`Sides::run_series`] starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Start {
    /// After a `sync`, with what earlier steps cached.
    Warm,
    /// With the page cache dropped (every side reads from the disk).
    Cold,
    /// With the page cache dropped and [`MEMORY_SETTLE`] waited: for large writes, so that every side
    /// writes into memory in the same state. Without the wait, a side writing right after
    /// another side's files were removed reuses the pages just freed, while the side before
    /// it wrote into memory the virtual machine had taken back and faults each page in again
    /// (bench/history/, mount run 66: 2.6 GB/s against 0.5 GB/s for the same plain-directory write).
    Settled,
}

/// How long freed memory takes to go back to the host (free page reporting waits 2 s, then
/// reports in batches).
const MEMORY_SETTLE: Duration = Duration::from_secs(8);

/// Runs every phase, printing progress to stderr; the local filesystem is stopped at the end
/// and the data removed unless `keep`. Returns the rows and whether the page cache was dropped.
pub fn run(o: &MountBenchOptions) -> Result<(Vec<Phase>, bool, Vec<String>)> {
    anyhow::ensure!(o.jobs >= 1 && o.threads >= 1 && o.small_threads >= 1 && o.small_dirs >= 1, "counts must be >= 1");
    let fio = fio()?;
    std::fs::create_dir_all(&o.root).with_context(|| format!("cannot create {}", o.root.display()))?;
    let root = o.root.canonicalize()?;
    let fsroot = root.join("fs");
    let mnt = fsroot.join("mnt");
    let plain = root.join("plain");
    let reports = root.join("reports");
    let (floor, floor_src) = (root.join("floor"), root.join("floor-src"));
    let minimum = root.join("minimum");
    mount::unmount(&floor)?;
    mount::unmount(&minimum)?;
    clean(&fsroot, &mnt, &[&plain, &reports, &floor, &floor_src, &minimum])?;
    if !o.keep {
        // Ctrl-C, or a phase past its bound, removes them too.
        for d in [&fsroot, &plain, &reports, &floor, &floor_src, &minimum] {
            odfs_job::interrupt::removing(d);
        }
    }
    std::fs::create_dir_all(&reports)?;
    if !o.skip_plain {
        std::fs::create_dir_all(&plain)?;
    }

    // The mount takes its requests by io_uring where the kernel allows it (as docs/admin.md
    // recommends); the switch is put back after the run.
    let uring = crate::uring_minimum::TransportAllowed::new();
    crate::phase::say("bench", format!("starting a {}-node odfs mounted at {}", o.nodes, mnt.display()));
    let up = UpOptions {
        root: fsroot.clone(),
        nodes: o.nodes,
        bulk: o.transport,
        meta_transport: o.meta_transport,
        mount: Some(mnt.clone()),
        ..UpOptions::default()
    };
    let state = local::up(&up)?;
    let result = (|| {
        anyhow::ensure!(state.procs.iter().any(|p| p.service == "fuse"), "odfs local up started no odfs-fuse process");
        let floor = if o.skip_floor { None } else { mount_floor(&floor_src, &floor)? };
        let mut sides = Sides {
            mnt: mnt.clone(),
            plain: (!o.skip_plain).then(|| plain.clone()),
            floor_pids: floor.as_deref().map(floor_daemon).unwrap_or_default(),
            floor,
            counter: Some(MetaCounter::connect(&fsroot)?),
            pids: state.procs.iter().map(|p| p.pid).collect(),
            phases: Vec::new(),
            dropped: true,
            notes: memory_note().into_iter().chain(splice_note(&fsroot)).collect(),
        };
        run_phases(o, &fio, &reports, &mut sides)?;
        // Read once the mount has served: its transport is logged as it starts serving.
        if let Some(n) = transport_note(&fsroot, uring.as_ref().err()) {
            sides.notes.insert(0, n);
        }
        Ok((sides.phases, sides.dropped, sides.notes))
    })();
    crate::phase::say("bench", format!("stopping the {}-node odfs and the FUSE floor", o.nodes));
    unmount_floor(&floor);
    let down = local::down(&fsroot);
    crate::phase::end();
    if !o.keep {
        let _ = clean(&fsroot, &mnt, &[&plain, &reports, &floor, &floor_src, &minimum]);
        // ROOT too, when the run left nothing else in it.
        let _ = std::fs::remove_dir(&root);
    }
    let out = result?;
    down.context("stopping the local filesystem")?;
    Ok(out)
}

/// A note when this machine is a virtual machine that hands freed memory back to its host (free
/// page reporting): the next use of such a page costs a host page fault, which on the machine
/// of BENCHMARKS.md made filling 4 GiB of page cache cost 4-5 CPU-s instead of 0.9. Phases fill
/// the page cache at different moments, so their sides are not measured alike.
fn memory_note() -> Option<String> {
    let dir = Path::new("/sys/module/page_reporting/parameters");
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).ok()?.trim().parse::<u64>().ok();
    let (order, kib) = (read("page_reporting_order")?, read("reported_kib")?);
    // Blocks above the largest page order are never reported: reporting is then off.
    (kib > 0 && order <= 10).then(|| {
        format!(
            "machine: freed memory goes back to the hypervisor (free page reporting, {} GiB so far); \
             phases that fill the page cache pay host page faults unevenly, see BENCHMARKS.md",
            kib >> 20
        )
    })
}

/// Whether the mount splices its large reads, or why not, as its log (node 0's) says.
/// How the mount takes its requests: by io_uring (the run switched the kernel's
/// `enable_uring` on), or by `/dev/fuse` and why.
fn transport_note(fsroot: &Path, refused: Option<&std::io::Error>) -> Option<String> {
    let log = std::fs::read_to_string(local::node_dir(fsroot, 0).join("fuse.log")).ok()?;
    Some(match log.lines().find(|l| l.contains("FUSE requests come by io_uring")) {
        Some(_) => "odfs mount: FUSE requests come by io_uring (the kernel's enable_uring set for the run)".into(),
        None => match refused {
            Some(e) => format!("odfs mount: FUSE requests come by /dev/fuse ({e})"),
            None => "odfs mount: FUSE requests come by /dev/fuse".into(),
        },
    })
}

fn splice_note(fsroot: &Path) -> Option<String> {
    let log = std::fs::read_to_string(local::node_dir(fsroot, 0).join("fuse.log")).ok()?;
    let line = log.lines().find(|l| l.contains("are spliced into /dev/fuse") || l.contains("reads are not spliced"))?;
    let said = line.split_once("odfs_client_fuse::").map_or(line, |(_, rest)| rest);
    Some(format!("odfs mount: {}", said.split_once(": ").map_or(said, |(_, what)| what)))
}

/// Mounts the FUSE floor: bindfs (a plain libfuse passthrough, default caching) of `src` at
/// `at`. `None`, with a note, when bindfs is not installed.
fn mount_floor(src: &Path, at: &Path) -> Result<Option<PathBuf>> {
    std::fs::create_dir_all(src)?;
    std::fs::create_dir_all(at)?;
    odfs_job::interrupt::mounting(at)?;
    let out = match Command::new("bindfs").arg(src).arg(at).output() {
        Ok(out) => out,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            eprintln!("bench: bindfs not installed (apt-get install -y bindfs): no FUSE floor column");
            return Ok(None);
        }
        Err(e) => return Err(e).context("cannot run bindfs"),
    };
    anyhow::ensure!(
        out.status.success(),
        "bindfs {} {} failed: {}",
        src.display(),
        at.display(),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    eprintln!("bench: FUSE floor: bindfs {} at {}", src.display(), at.display());
    Ok(Some(at.to_path_buf()))
}

/// The bindfs process serving the floor at `at` (it forks away from the bench when it mounts),
/// found by its command line; none, with a note, when it cannot be found.
fn floor_daemon(at: &Path) -> Vec<u32> {
    let pids = bindfs_serving(at);
    if pids.is_empty() {
        eprintln!("bench: bindfs's process for {} not found: the FUSE floor's CPU is not shown", at.display());
    }
    pids
}

/// Longest wait for bindfs to end after the floor's unmount, before it is killed.
const FLOOR_END: Duration = Duration::from_secs(5);

/// Takes the FUSE floor down: its unmount (which aborts a connection that a copy of the mount
/// elsewhere keeps), then bindfs, which no record of this process holds, waited for and
/// killed if it outlives [`FLOOR_END`].
fn unmount_floor(at: &Path) {
    if let Ok(steps) = mount::unmount(at) {
        steps.iter().filter(|s| !s.starts_with("unmounted ")).for_each(|s| eprintln!("bench: {s}"));
    }
    let t = Instant::now();
    while !bindfs_serving(at).is_empty() && t.elapsed() < FLOOR_END {
        std::thread::sleep(Duration::from_millis(50));
    }
    for pid in bindfs_serving(at) {
        eprintln!("bench: bindfs (pid {pid}) still serves {} after its unmount: killed", at.display());
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::SIGKILL);
    }
}

/// The bindfs processes whose command line serves `at`.
fn bindfs_serving(at: &Path) -> Vec<u32> {
    let serves = |cmdline: &[u8]| {
        let mut args = cmdline.split(|&b| b == 0).filter(|a| !a.is_empty());
        let is_bindfs = args.next().is_some_and(|a| a.rsplit(|&b| b == b'/').next() == Some(&b"bindfs"[..]));
        is_bindfs && args.any(|a| Path::new(std::ffi::OsStr::from_bytes(a)) == at)
    };
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| serves(&c)))
        .collect()
}

/// Removes what a previous run left, never descending into a live mount.
fn clean(fsroot: &Path, mnt: &Path, dirs: &[&Path]) -> Result<()> {
    if fsroot.is_dir() {
        let _ = local::down(fsroot);
    }
    mount::unmount(mnt)?;
    for d in std::iter::once(fsroot).chain(dirs.iter().copied()) {
        match std::fs::remove_dir_all(d) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(e).with_context(|| format!("cannot remove {}", d.display()))
            }
            _ => {}
        }
    }
    Ok(())
}

/// The fio binary on PATH.
pub fn fio() -> Result<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("fio"))
        .find(|p| p.is_file())
        .context("fio not found on PATH: the benchmark needs it (apt-get install -y fio)")
}

const MIB: f64 = (1 << 20) as f64;

/// `reports`: where fio's JSON reports go, outside both measured directories.
fn run_phases(o: &MountBenchOptions, fio: &Path, reports: &Path, sides: &mut Sides) -> Result<()> {
    fio_phases(o, fio, reports, sides)?;
    checkpoint_phases(o, fio, reports, sides)?;
    md_phases(o, sides)?;
    small_phases(o, sides)
}

/// fio's `filename_format` of the sequential phases' files (fio's default for job "seq").
const SEQ_FILES: &str = "seq.$jobnum.0";
/// The directory of those files, under each side's root.
const SEQ_DIR: &str = "fio";

/// fio's arguments of the sequential write, on every side and on the FUSE minimum.
const SEQ_WRITE: [&str; 3] = ["--rw=write", "--bs=1M", "--end_fsync=1"];

/// fio's arguments of the sequential read, likewise.
const SEQ_READ: [&str; 2] = ["--rw=read", "--bs=1M"];

/// Sequential write and read, 4 KiB random reads.
fn fio_phases(o: &MountBenchOptions, fio: &Path, reports: &Path, sides: &mut Sides) -> Result<()> {
    let seq_bytes = o.jobs as u64 * o.job_size;
    let fio_common = |dir: &Path| fio_files("seq", &dir.join(SEQ_DIR), SEQ_FILES, o);

    crate::phase::say("bench", format!("fio sequential write, {} jobs x {} MiB", o.jobs, o.job_size >> 20));
    let s = sides.run(Start::Settled, |dir, side| {
        std::fs::create_dir_all(dir.join(SEQ_DIR))?;
        let mut args = fio_common(dir);
        args.extend(SEQ_WRITE.map(String::from));
        let r = run_fio(fio, &args, &reports.join(format!("{side}-seq-write.json")))?;
        r.expect_bytes("write", seq_bytes)?;
        Ok(Some(r.bw_bytes("write")? / MIB))
    })?;
    sides.push("seq write", "MiB/s", 0.0, &s);

    crate::phase::say("bench", "fio sequential read (page cache dropped)".to_string());
    let s = sides.run(Start::Cold, |dir, side| {
        let mut args = fio_common(dir);
        args.extend(SEQ_READ.map(String::from));
        let r = run_fio(fio, &args, &reports.join(format!("{side}-seq-read.json")))?;
        r.expect_bytes("read", seq_bytes)?;
        Ok(Some(r.bw_bytes("read")? / MIB))
    })?;
    sides.push("seq read", "MiB/s", 0.0, &s);
    // Right after the buffered reads: see `odfs_past_page_cache`.
    let note = odfs_past_page_cache(o, fio, reports, sides)?;
    sides.notes.push(note);

    crate::phase::say("bench", format!("fio 4 KiB random read, O_DIRECT, {} s", o.randread_secs));
    let s = sides.run(Start::Cold, |dir, side| {
        probe_direct(&dir.join("fio/seq.0.0"))?;
        randread_iops(fio, fio_common(dir), &reports.join(format!("{side}-randread.json")), o).map(Some)
    })?;
    sides.push("rand read 4k", "IOPS", 0.0, &s);
    let fs = MinimumFs::new(0, 0, Vec::new(), false).with_large(o.jobs as u64, o.job_size);
    let (at, name) = (sides.minimum_dir(), "FUSE minimum");
    let note = match minimum::mount_here(fs, &at, name)? {
        Ok(session) => {
            let m = Minimum::Here(session, Default::default());
            fuse_minimum_large(o, fio, reports, &at, m, "bytes from memory", name)?.0
        }
        Err(skipped) => skipped,
    };
    sides.notes.push(note);
    let at = sides.minimum_dir();
    let spec = MinimumSpec { at: at.clone(), creates: true, ..MinimumSpec::default() };
    sides.notes.push(fuse_minimum_write(o, fio, reports, &spec, "FUSE minimum, large files written (bytes dropped)")?);
    let notes = match &sides.plain {
        Some(plain) => {
            let files = seq_files(o, &plain.join(SEQ_DIR));
            let (disk, disk_cpu) = fuse_disk_minimum(o, fio, reports, &files, &at)?;
            let tcp = tcp_minimum(o)?;
            let mut notes = vec![disk, network_minimum(o, &files)?];
            notes.extend(tcp.as_ref().map(|(line, _)| line.clone()));
            notes.extend(read_bound(sides, disk_cpu, tcp.map(|(_, cpu)| cpu)));
            notes.extend(fuse_network_minimum(o, fio, reports, &files, &at)?);
            notes.extend(fuse_striped_minimum(o, fio, reports, sides, &files, &at)?);
            notes.push(fuse_network_minimum_write(o, fio, reports, plain, &at)?);
            notes
        }
        None => vec!["FUSE + disk, network and FUSE + network minima not measured: they use the plain \
                      directory's disk"
            .into()],
    };
    sides.notes.extend(notes);
    Ok(())
}

/// The sequential read and write above on the mount again, with `O_DIRECT`: the same chunk
/// path, disks and network, without the mount's page cache. A buffered FUSE read or write
/// copies every byte once more than a plain directory's, between the reader's or writer's
/// buffer and the mount's page cache (docs/architecture.md, "What a buffered read through the
/// mount costs"); this line shows what odfs's own part costs, against the plain directory's
/// buffered phases of the table. The read is of the sequential phases' files, run right after
/// those phases' reads so that it fills the page cache (stored's) as they did, from pages the
/// last side's read just gave back: pages the VM handed to its host long before cost host page
/// faults to fill (see BENCHMARKS.md). The write makes new files beside them, removed after.
/// One line.
fn odfs_past_page_cache(o: &MountBenchOptions, fio: &Path, reports: &Path, sides: &Sides) -> Result<String> {
    crate::phase::say("bench", "odfs with O_DIRECT: sequential read (page cache dropped), then write".to_string());
    let seq_bytes = o.jobs as u64 * o.job_size;
    let phase = |dir: &Path, write: bool| -> Result<(f64, f64)> {
        let mut args = fio_files("seq", dir, SEQ_FILES, o);
        if write {
            args.extend(SEQ_WRITE.map(String::from));
        } else {
            args.extend(SEQ_READ.map(String::from));
        }
        args.push("--direct=1".into());
        drop_caches();
        let cpu = CpuMeter::start(&sides.pids);
        let (what, report) =
            if write { ("write", "odfs-direct-seq-write.json") } else { ("read", "odfs-direct-seq-read.json") };
        let r = run_fio(fio, &args, &reports.join(report))?;
        let cpu = cpu.stop();
        r.expect_bytes(what, seq_bytes)?;
        Ok((r.bw_bytes(what)? / MIB, cpu))
    };
    let (r, r_cpu) = phase(&sides.mnt.join(SEQ_DIR), false).context("odfs with O_DIRECT: read")?;
    let dir = sides.mnt.join("fio-direct");
    let written = std::fs::create_dir_all(&dir).map_err(anyhow::Error::from).and_then(|()| phase(&dir, true));
    let removed = std::fs::remove_dir_all(&dir);
    let (w, w_cpu) = written.context("odfs with O_DIRECT: write")?;
    removed.with_context(|| format!("removing {}", dir.display()))?;
    // Against the plain directory's CPU in the buffered phases of this run, where it ran.
    let plain_cpu = |name: &str| sides.phases.iter().find(|p| p.name == name).and_then(|p| p.plain_cpu);
    let vs = |cpu: f64, name: &str| match plain_cpu(name) {
        Some(p) if p > 0.0 => format!("{cpu:.1} CPU-s, {:.2}x the plain directory's {name}", cpu / p),
        _ => format!("{cpu:.1} CPU-s"),
    };
    Ok(format!(
        "odfs past the mount's page cache (O_DIRECT, as the seq phases): seq read {r:.0} MiB/s ({}), \
         seq write {w:.0} MiB/s ({})",
        vs(r_cpu, "seq read"),
        vs(w_cpu, "seq write")
    ))
}

/// The sequential files fio wrote in `dir`.
fn seq_files(o: &MountBenchOptions, dir: &Path) -> Vec<PathBuf> {
    (0..o.jobs).map(|k| dir.join(SEQ_FILES.replace("$jobnum", &k.to_string()))).collect()
}

/// The sequential and 4 KiB random reads on the FUSE minimum whose every READ is fetched over
/// loopback TCP from the plain directory's `files` (`FileServer`, `sendfile`): the CPU that any
/// filesystem moving a file's bytes between processes over TCP and serving them through its
/// FUSE daemon must spend on this machine (odfs's default-stripe reads are such reads), and
/// the rate it gets from these files as they lie, one disk stream each (a striped file's chunk
/// files give the disk more streams, so odfs may read faster). Once served from this process
/// (the readers' scheduling group), once from a process of its own session as every FUSE daemon
/// runs (`super::minimum`). One line each, or why it was skipped.
fn fuse_network_minimum(
    o: &MountBenchOptions,
    fio: &Path,
    reports: &Path,
    files: &[PathBuf],
    at: &Path,
) -> Result<Vec<String>> {
    let spec = MinimumSpec {
        at: at.to_path_buf(),
        remote_large: files.to_vec(),
        large_size: o.job_size,
        ..Default::default()
    };
    let what = "each READ fetched over loopback TCP, sendfile from the plain directory's files";
    let mut notes = Vec::new();
    for (apart, name) in [(false, "FUSE + network minimum"), (true, "FUSE + network minimum in its own session")] {
        notes.push(match Minimum::mount(&spec, apart, name)? {
            Ok(m) => fuse_minimum_large(o, fio, reports, at, m, what, name)?.0,
            Err(skipped) => skipped,
        });
    }
    Ok(notes)
}

/// Reader threads the FUSE + striped minimum is measured with: its threads wait out their
/// READs, so its rate rises with them until the cores are busy, then falls as they crowd.
const STRIPED_MINIMUM_THREADS: [usize; 3] = [8, 16, 32];

/// Ring entries per CPU queue the FUSE io_uring + striped minimum is measured with: requests
/// each queue holds at once (fio keeps 64 in flight over the two queues).
const URING_MINIMUM_ENTRIES: [usize; 3] = [16, 32, 64];

/// The 4 KiB random read above on the FUSE minimum whose files are striped as the default
/// layout stripes them over four nodes, seen from one (`MinimumSpec` with both remote and disk
/// files): one READ in four an `O_DIRECT` read of the plain directory's files, three fetched
/// over loopback TCP. Served from a process of its own session, as odfs-fuse is, with several
/// reader thread counts over `/dev/fuse` (as odfs-fuse's), then over the
/// kernel's io_uring transport for FUSE with several ring sizes (`uring_minimum`, the
/// cheapest transport this kernel has); the best rate of each is the most any FUSE
/// filesystem serving default-striped files over a network reached here with it, and its CPU
/// per READ says how many READs the machine's cores could do at most, were every one busy
/// with nothing else. Two lines, with odfs's rate of this run against each best.
fn fuse_striped_minimum(
    o: &MountBenchOptions,
    fio: &Path,
    reports: &Path,
    sides: &Sides,
    files: &[PathBuf],
    at: &Path,
) -> Result<Vec<String>> {
    let odfs = sides.phases.iter().find(|p| p.name == "rand read 4k").map(|p| p.odfs);
    let spec = MinimumSpec {
        at: at.to_path_buf(),
        remote_large: files.to_vec(),
        disk_large: files.to_vec(),
        large_size: o.job_size,
        ..Default::default()
    };
    let dev =
        Sweep { name: "FUSE + striped minimum in its own session", counts: &STRIPED_MINIMUM_THREADS, what: "threads" };
    let mut notes = vec![striped_runs(o, fio, reports, &spec, &dev, odfs)?];
    let uring = Sweep {
        name: "FUSE io_uring + striped minimum in its own session",
        counts: &URING_MINIMUM_ENTRIES,
        what: "ring entries per queue",
    };
    match crate::uring_minimum::TransportAllowed::new() {
        Ok(_allowed) => {
            notes.push(striped_runs(o, fio, reports, &MinimumSpec { uring: true, ..spec }, &uring, odfs)?);
        }
        Err(e) => notes.push(format!("{} not measured: {e}", uring.name)),
    }
    Ok(notes)
}

/// The random-read phase's fio run on the large files of `minimum`, mounted at `at`, with the
/// page cache dropped first; then the minimum unmounted. Its IOPS and the CPU-s of `pids`.
fn minimum_randread(
    o: &MountBenchOptions,
    fio: &Path,
    minimum: Minimum,
    pids: &[u32],
    at: &Path,
    report: &Path,
    name: &str,
) -> Result<(f64, f64)> {
    let measured = (|| -> Result<(f64, f64)> {
        drop_caches();
        let cpu = CpuMeter::start(pids);
        let iops = randread_iops(fio, minimum_fio_files(o, at), report, o)?;
        Ok((iops, cpu.stop()))
    })();
    let unmounted = minimum.unmount(at).with_context(|| format!("unmounting the {name}"));
    let measured = measured.with_context(|| format!("reading the {name}'s large files"))?;
    unmounted?;
    Ok(measured)
}

/// One minimum measured at several sizes: its name, the sizes (reader threads or ring entries)
/// and what they count.
struct Sweep<'a> {
    name: &'a str,
    counts: &'a [usize],
    what: &'a str,
}

/// The striped minimum `spec` mounted at each of the sweep's sizes and read with 4 KiB random
/// reads. One line, with odfs's rate `odfs` against the best, or why it was not measured.
fn striped_runs(
    o: &MountBenchOptions,
    fio: &Path,
    reports: &Path,
    spec: &MinimumSpec,
    sweep: &Sweep,
    odfs: Option<f64>,
) -> Result<String> {
    let Sweep { name, counts, what } = *sweep;
    let mut runs = Vec::new();
    let (mut best, mut least_cpu) = (0.0f64, f64::INFINITY);
    for &n in counts {
        let spec = MinimumSpec { threads: Some(n), ..spec.clone() };
        let minimum = match Minimum::mount(&spec, true, name)? {
            Ok(m) => m,
            Err(skipped) => return Ok(skipped),
        };
        crate::phase::say("bench", format!("{name}, {n} {what}: 4 KiB random read"));
        let pids: Vec<u32> = minimum.pid().into_iter().collect();
        let tag = if spec.uring { "uring" } else { "striped" };
        let report = reports.join(format!("FUSE-{tag}-minimum-{n}-randread.json"));
        let (iops, cpu) = minimum_randread(o, fio, minimum, &pids, &spec.at, &report, name)?;
        let per_read = cpu / (iops * o.randread_secs as f64).max(1.0);
        best = best.max(iops);
        least_cpu = least_cpu.min(per_read);
        runs.push(format!("{n} {what} {iops:.0} IOPS ({:.0} us CPU per read)", per_read * 1e6));
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    Ok(format!(
        "{name}, large files (1 READ in 4 an O_DIRECT read of the plain directory's files, 3 fetched over \
         loopback TCP, sendfile from them), rand read 4k: {}; best {best:.0} IOPS, at most {:.0} with all {cores} \
         cores busy at its least CPU per read; odfs's default stripe {}",
        runs.join(", "),
        cores / least_cpu,
        odfs.map_or("not measured".into(), |v| format!("{v:.0} IOPS ({:.2}x the best)", v / best)),
    ))
}

/// The sequential and 4 KiB random reads on the FUSE minimum whose every READ is an `O_DIRECT`
/// read of the plain directory's `files` into the buffer its reply is written from: the disk
/// fills that buffer, and the only copy of each byte before the reader's is the kernel's into
/// the mount's page cache, so this is the least CPU a buffered read through any FUSE mount of
/// data on a disk costs on this machine (odfs's reads, which also cross the network or a chunk
/// file's page cache, cost more by design). Served from this process: the least of all. The
/// line (or why it was skipped) and its sequential read's CPU-s.
fn fuse_disk_minimum(
    o: &MountBenchOptions,
    fio: &Path,
    reports: &Path,
    files: &[PathBuf],
    at: &Path,
) -> Result<(String, Option<f64>)> {
    let spec =
        MinimumSpec { at: at.to_path_buf(), disk_large: files.to_vec(), large_size: o.job_size, ..Default::default() };
    let what = "each READ an O_DIRECT read of the plain directory's files";
    let name = "FUSE + disk minimum";
    Ok(match Minimum::mount(&spec, false, name)? {
        Ok(m) => {
            let (line, seq_cpu) = fuse_minimum_large(o, fio, reports, at, m, what, name)?;
            (line, Some(seq_cpu))
        }
        Err(skipped) => (skipped, None),
    })
}

/// Runs of the TCP minimum per way of sending: short, so several.
const TCP_MINIMUM_RUNS: usize = 3;

/// The share of a default-stripe file's bytes on other nodes than the reader's: one chunk in
/// `stripe` is on the reader's own target (each local node has one).
fn remote_share(o: &MountBenchOptions) -> (u64, u64) {
    let stripe = (odfs_proto::layout::DEFAULT_STRIPE_COUNT.max(1) as u64).min(o.nodes.max(1) as u64);
    (stripe - 1, stripe)
}

/// What the sequential read's bytes on other nodes cost to move between processes over
/// loopback TCP, the cheapest ways there are (`super::transport`): one stream per fio job at
/// once, each way of sending run several times. One line with every run, and the least CPU-s
/// of them; `None` when no byte is on another node.
fn tcp_minimum(o: &MountBenchOptions) -> Result<Option<(String, f64)>> {
    let (remote, stripe) = remote_share(o);
    let bytes = o.jobs as u64 * o.job_size / stripe * remote;
    if bytes == 0 {
        return Ok(None);
    }
    crate::phase::say(
        "bench",
        format!("TCP minimum: {} MiB through loopback TCP, no disk, no copy on receipt", bytes >> 20),
    );
    let (mut runs, mut least) = (Vec::new(), f64::INFINITY);
    for how in transport::SendBy::ALL {
        let mut cpus = Vec::new();
        for _ in 0..TCP_MINIMUM_RUNS {
            let cpu = CpuMeter::start(&[]);
            let moved = transport::move_bytes(o.jobs, bytes, how)?;
            let cpu = cpu.stop();
            anyhow::ensure!(moved == bytes, "the TCP minimum moved {moved} of {bytes} bytes");
            least = least.min(cpu);
            cpus.push(format!("{cpu:.2}"));
        }
        runs.push(format!("sent by {} {} CPU-s", how.name(), cpus.join(" / ")));
    }
    let line = format!(
        "TCP minimum ({remote}/{stripe} of the seq read's bytes, the default stripe's share on other nodes, \
         {} MiB over {} loopback connections, from a buffer, spliced out of the socket without a copy): {}",
        bytes >> 20,
        o.jobs,
        runs.join(", ")
    );
    Ok(Some((line, least)))
}

/// The least CPU any buffered read of the sequential files striped the default way can cost:
/// all their bytes served from the disk through FUSE (`disk`, the FUSE + disk minimum's
/// sequential read) and the share on other nodes moved over TCP besides (`tcp`, the least TCP
/// minimum), against the plain directory's and odfs's sequential read of this run. One line,
/// or `None` where a part is missing.
fn read_bound(sides: &Sides, disk: Option<f64>, tcp: Option<f64>) -> Option<String> {
    let (disk, tcp) = (disk?, tcp?);
    let phase = sides.phases.iter().find(|p| p.name == "seq read")?;
    let plain = phase.plain_cpu.filter(|p| *p > 0.0)?;
    let bound = disk + tcp;
    Some(format!(
        "default-stripe read bound: FUSE + disk minimum {disk:.1} + TCP minimum {tcp:.1} = {bound:.1} CPU-s, \
         {:.2}x the plain directory's seq read ({plain:.1} CPU-s); odfs {:.1} CPU-s ({:.2}x)",
        bound / plain,
        phase.odfs_cpu,
        phase.odfs_cpu / plain
    ))
}

/// Runs of the network minimum: it is short and its spread wide, so every run is printed.
const NETWORK_MINIMUM_RUNS: usize = 3;

/// The sequential read above with nothing between the disk and the reader but one loopback TCP
/// connection per file: a sender thread reads its file cold in 1 MiB blocks and writes them to
/// the connection, a receiver thread reads them into a buffer. No FUSE, no protocol, no
/// daemon: the CPU that moving file data between processes over TCP costs on this machine, and
/// the rate of these files read so (one disk stream each, as the FUSE + network minimum). One
/// line with every run, or why it was skipped.
fn network_minimum(o: &MountBenchOptions, files: &[PathBuf]) -> Result<String> {
    crate::phase::say("bench", format!("network minimum: {} files read cold through loopback TCP", files.len()));
    let mut runs = Vec::new();
    for _ in 0..NETWORK_MINIMUM_RUNS {
        drop_caches();
        let cpu = CpuMeter::start(&[]);
        let t = Instant::now();
        let bytes = send_through_tcp(files)?;
        let (secs, cpu) = (t.elapsed().as_secs_f64(), cpu.stop());
        anyhow::ensure!(bytes == o.jobs as u64 * o.job_size, "network minimum moved {bytes} bytes");
        runs.push(format!("{:.0} MiB/s ({cpu:.1} CPU-s)", bytes as f64 / MIB / secs));
    }
    Ok(format!("network minimum (seq files read cold and sent through loopback TCP, no FUSE): {}", runs.join(", ")))
}

/// Sends every file through a loopback TCP connection of its own at once; bytes received.
fn send_through_tcp(files: &[PathBuf]) -> Result<u64> {
    const BLOCK: usize = 1 << 20;
    transport::over_loopback(
        files.len(),
        |k, mut conn| {
            let f = &files[k];
            let mut file = std::fs::File::open(f).with_context(|| format!("cannot open {}", f.display()))?;
            let mut buf = vec![0u8; BLOCK];
            loop {
                match file.read(&mut buf)? {
                    0 => return Ok(()),
                    n => conn.write_all(&buf[..n])?,
                }
            }
        },
        |mut conn| {
            let (mut buf, mut total) = (vec![0u8; BLOCK], 0u64);
            loop {
                match conn.read(&mut buf)? {
                    0 => return Ok(total),
                    n => total += n as u64,
                }
            }
        },
    )
}

/// The sequential and 4 KiB random reads above and the checkpoint read's shape, on the FUSE
/// minimum's large files (bytes replied from memory on the reader thread, or as `minimum`
/// serves them): what FUSE alone allows these reads on this machine, for any filesystem that
/// serves them through its daemon. One line, and its sequential read's CPU-s.
fn fuse_minimum_large(
    o: &MountBenchOptions,
    fio: &Path,
    reports: &Path,
    at: &Path,
    minimum: Minimum,
    what: &str,
    name: &str,
) -> Result<(String, f64)> {
    crate::phase::say("bench", format!("{name}, large files: sequential read, then 4 KiB random read"));
    let report = name.replace([' ', '+'], "-");
    let files = minimum_fio_files(o, at);
    // CPU-s as for every phase: fio's and this process's, where a minimum served here runs,
    // and the serving process's.
    let pids: Vec<u32> = minimum.pid().into_iter().collect();
    let rates = (|| -> Result<[(f64, f64); 3]> {
        drop_caches();
        let mut args = files.clone();
        args.extend(SEQ_READ.map(String::from));
        let cpu = CpuMeter::start(&pids);
        let r = run_fio(fio, &args, &reports.join(format!("{report}-seq-read.json")))?;
        let seq_cpu = cpu.stop();
        r.expect_bytes("read", o.jobs as u64 * o.job_size)?;
        let seq = r.bw_bytes("read")? / MIB;
        drop_caches();
        let cpu = CpuMeter::start(&pids);
        let iops = randread_iops(fio, files.clone(), &reports.join(format!("{report}-randread.json")), o)?;
        let rand_cpu = cpu.stop();
        // The checkpoint read's shape (4 MiB reads, reader k the file of k+1) over the same
        // files: its bound, which the sequential read's need not be.
        drop_caches();
        let cpu = CpuMeter::start(&pids);
        let t = Instant::now();
        read_as_ckpt(o, &seq_files(o, at), false)?;
        let ckpt = (o.jobs as u64 * o.job_size) as f64 / MIB / t.elapsed().as_secs_f64();
        Ok([(seq, seq_cpu), (iops, rand_cpu), (ckpt, cpu.stop())])
    })();
    let unmounted = minimum.unmount(at).with_context(|| format!("unmounting the {name}"));
    let [(seq, seq_cpu), (iops, rand_cpu), (ckpt, ckpt_cpu)] =
        rates.with_context(|| format!("reading the {name}'s large files"))?;
    unmounted?;
    let line = format!(
        "{name}, large files ({what}): seq read {seq:.0} MiB/s ({seq_cpu:.1} CPU-s), \
         rand read 4k {iops:.0} IOPS ({rand_cpu:.1} CPU-s), ckpt-shaped read {ckpt:.0} MiB/s ({ckpt_cpu:.1} CPU-s)"
    );
    Ok((line, seq_cpu))
}

/// The sequential write above on the FUSE minimum whose every WRITE is sent over loopback TCP
/// to a server that writes it into files on the plain directory's disk (`O_DIRECT`, as stored
/// writes chunk data): what any filesystem that sends written bytes from its FUSE daemon to a
/// disk over TCP can write at on this machine, and the CPU it must spend (odfs's writes of
/// default-stripe files are such writes). Served from a process of its own session, as
/// odfs-fuse runs; the files it wrote are removed after. One line, or why it was skipped.
fn fuse_network_minimum_write(
    o: &MountBenchOptions,
    fio: &Path,
    reports: &Path,
    plain: &Path,
    at: &Path,
) -> Result<String> {
    let sink = plain.join("fuse-network-minimum");
    let spec =
        MinimumSpec { at: at.to_path_buf(), creates: true, remote_writes: Some(sink.clone()), ..Default::default() };
    let name = "FUSE + network minimum in its own session, large files written (each WRITE sent over loopback TCP, \
                written O_DIRECT on the plain directory's disk)";
    let note = fuse_minimum_write(o, fio, reports, &spec, name);
    let _ = std::fs::remove_dir_all(&sink);
    note
}

/// The sequential write above on the FUSE minimum `spec` (one that makes files; by default it
/// answers every WRITE at once and drops its bytes), served from a process of its own session
/// as FUSE daemons are: what FUSE alone costs these writes here, in time and CPU (fio's and the
/// serving process's), for any filesystem whose daemon receives the bytes. One line, or why
/// it was skipped.
fn fuse_minimum_write(
    o: &MountBenchOptions,
    fio: &Path,
    reports: &Path,
    spec: &MinimumSpec,
    name: &str,
) -> Result<String> {
    let minimum = match Minimum::mount(spec, true, name)? {
        Ok(m) => m,
        Err(skipped) => return Ok(skipped),
    };
    crate::phase::say("bench", format!("{name}: sequential write, {} jobs x {} MiB", o.jobs, o.job_size >> 20));
    let dir = spec.at.join(SEQ_DIR);
    let written = (|| -> Result<(f64, f64)> {
        std::fs::create_dir_all(&dir)?;
        let mut args = fio_files("seq", &dir, SEQ_FILES, o);
        args.extend(SEQ_WRITE.map(String::from));
        drop_caches();
        let cpu = CpuMeter::start(&minimum.pid().into_iter().collect::<Vec<_>>());
        let report = format!("{}-seq-write.json", name.split(',').next().unwrap_or(name).replace([' ', '+'], "-"));
        let r = run_fio(fio, &args, &reports.join(report))?;
        let cpu = cpu.stop();
        r.expect_bytes("write", o.jobs as u64 * o.job_size)?;
        Ok((r.bw_bytes("write")? / MIB, cpu))
    })();
    let unmounted = minimum.unmount(&spec.at);
    let (rate, cpu) = written.context("writing to the FUSE minimum")?;
    unmounted?;
    Ok(format!("{name}: seq write {rate:.0} MiB/s ({cpu:.1} CPU-s)"))
}

/// Bytes of each checkpoint write and read, as `torch.save` and a loader issue them.
const CKPT_IO: usize = 4 << 20;

/// A checkpoint storm: `o.jobs` writers each write an `o.job_size` file at once (sequential 4 MiB
/// writes, then fsync and close, as `torch.save` of a rank's shard), then as many readers read
/// them back with the page cache dropped, reader k the file of writer k+1. On odfs once in a
/// directory with local placement and stripe count 1 (each file on its writer's node) and once
/// with the filesystem's default stripe; the plain directory and the FUSE floor run the same
/// steps each time. The files are removed after each round to keep the disk's space.
fn checkpoint_phases(o: &MountBenchOptions, fio: &Path, reports: &Path, sides: &mut Sides) -> Result<()> {
    let mib = (o.jobs as u64 * o.job_size) as f64 / MIB;
    for (sub, local, names) in [
        ("ckpt-local", true, ["ckpt write, local", "ckpt read, local", "ckpt rand read 4k, local"]),
        ("ckpt-stripe", false, ["ckpt write, striped", "ckpt read, striped", "ckpt rand read 4k, striped"]),
    ] {
        eprintln!(
            "bench: checkpoint, {} writers x {} MiB, {}",
            o.jobs,
            o.job_size >> 20,
            if local { "local placement, stripe count 1" } else { "default stripe" }
        );
        let s = sides.run_series(&[Start::Settled, Start::Cold, Start::Cold], |dir, side, step| {
            let d = dir.join(sub);
            match step {
                0 => {
                    std::fs::create_dir_all(&d)?;
                    if local && side == "odfs" {
                        let layout = b"stripe_count=1 placement=local";
                        odfs_client::vxattr::set_xattr(&d, odfs_client::vxattr::LAYOUT, layout)
                            .with_context(|| format!("setting the layout of {}", d.display()))?;
                    }
                    ckpt_write(&d, o)?;
                    Ok(None)
                }
                1 => ckpt_read(&d, o).map(|()| None),
                _ => {
                    let iops = ckpt_randread(fio, &reports.join(format!("{side}-{sub}-randread.json")), &d, o);
                    std::fs::remove_dir_all(&d)?;
                    iops.map(Some)
                }
            }
        })?;
        sides.push(names[0], "MiB/s", mib, &s[0]);
        sides.push(names[1], "MiB/s", mib, &s[1]);
        sides.push(names[2], "IOPS", 0.0, &s[2]);
    }
    Ok(())
}

fn ckpt_path(dir: &Path, k: usize) -> PathBuf {
    dir.join(format!("rank{k}.pt"))
}

/// Every writer its file at once: 4 MiB writes, fsync, close.
fn ckpt_write(dir: &Path, o: &MountBenchOptions) -> Result<()> {
    let ranks: Vec<usize> = (0..o.jobs).collect();
    parallel(o.jobs, &ranks, |k| {
        let p = ckpt_path(dir, k);
        let mut buf = vec![0u8; CKPT_IO];
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).open(&p)?;
        let mut off = 0u64;
        while off < o.job_size {
            let n = (o.job_size - off).min(CKPT_IO as u64) as usize;
            // Each piece names its file and offset, so a misplaced read is caught.
            buf[..8].copy_from_slice(&(k as u64).to_le_bytes());
            buf[8..16].copy_from_slice(&off.to_le_bytes());
            f.write_all(&buf[..n]).with_context(|| format!("{}", p.display()))?;
            off += n as u64;
        }
        f.sync_all().with_context(|| format!("fsync {}", p.display()))?;
        close(f).with_context(|| format!("{}", p.display()))
    })
}

/// Reader k reads writer k+1's file whole, in 4 MiB reads, checking each piece's label.
fn ckpt_read(dir: &Path, o: &MountBenchOptions) -> Result<()> {
    let files: Vec<PathBuf> = (0..o.jobs).map(|k| ckpt_path(dir, k)).collect();
    read_as_ckpt(o, &files, true)
}

/// The checkpoint read over `files` (`o.jobs` of them, `o.job_size` bytes each): reader k
/// reads file k+1 whole in 4 MiB reads, all at once; with `labelled`, each piece must carry its
/// file's number and offset as [`ckpt_write`] wrote them.
fn read_as_ckpt(o: &MountBenchOptions, files: &[PathBuf], labelled: bool) -> Result<()> {
    let ranks: Vec<usize> = (0..files.len()).collect();
    parallel(files.len(), &ranks, |k| {
        let w = (k + 1) % files.len();
        let p = &files[w];
        let mut f = std::fs::File::open(p).with_context(|| format!("{}", p.display()))?;
        let mut buf = Vec::with_capacity(CKPT_IO);
        let mut off = 0u64;
        loop {
            buf.clear();
            let n = (&mut f).take(CKPT_IO as u64).read_to_end(&mut buf).with_context(|| format!("{}", p.display()))?;
            if n == 0 {
                break;
            }
            anyhow::ensure!(
                !labelled || (n >= 16 && buf[..8] == (w as u64).to_le_bytes() && buf[8..16] == off.to_le_bytes()),
                "{}: wrong bytes at offset {off}",
                p.display()
            );
            off += n as u64;
        }
        anyhow::ensure!(off == o.job_size, "{}: read {off} bytes, expected {}", p.display(), o.job_size);
        Ok(())
    })
}

/// fio's 4 KiB random reads (O_DIRECT, libaio) over the checkpoint files, job k on rank k's
/// file, for the random-read phase's time; returns IOPS.
fn ckpt_randread(fio: &Path, report: &Path, dir: &Path, o: &MountBenchOptions) -> Result<f64> {
    probe_direct(&ckpt_path(dir, 0))?;
    randread_iops(fio, fio_files("ckpt", dir, "rank$jobnum.pt", o), report, o)
}

/// fio's arguments naming a FUSE minimum's large files at `at`, opened read-only (the minimum
/// is mounted read-only).
fn minimum_fio_files(o: &MountBenchOptions, at: &Path) -> Vec<String> {
    let mut files = fio_files("seq", at, SEQ_FILES, o);
    files.push("--readonly".into());
    files
}

/// fio's arguments naming one file per job in `dir` (`format`, fio's `filename_format`), each
/// of the options' job size, reported as one group.
fn fio_files(name: &str, dir: &Path, format: &str, o: &MountBenchOptions) -> Vec<String> {
    vec![
        format!("--name={name}"),
        format!("--directory={}", dir.display()),
        format!("--filename_format={format}"),
        format!("--size={}", o.job_size),
        format!("--numjobs={}", o.jobs),
        "--group_reporting".into(),
    ]
}

/// fio's 4 KiB random reads (O_DIRECT, libaio, the options' depth and time) over the files
/// `files` names; returns IOPS.
fn randread_iops(fio: &Path, mut args: Vec<String>, report: &Path, o: &MountBenchOptions) -> Result<f64> {
    args.extend([
        "--rw=randread".into(),
        "--bs=4k".into(),
        "--direct=1".into(),
        "--ioengine=libaio".into(),
        format!("--iodepth={}", o.iodepth),
        "--time_based".into(),
        format!("--runtime={}", o.randread_secs),
    ]);
    let r = run_fio(fio, &args, report)?;
    anyhow::ensure!(r.field("read", "io_bytes")? > 0.0, "fio read nothing");
    r.field("read", "iops")
}

/// mdtest-easy (own directories, empty files) and mdtest-hard style (one shared directory,
/// 3,901-byte files).
fn md_phases(o: &MountBenchOptions, sides: &mut Sides) -> Result<()> {
    let md_ops = (o.threads * o.files_per_thread) as f64;
    for (name, op) in
        [("md create", Md::Create), ("md stat", Md::Stat), ("md read", Md::Read), ("md unlink", Md::Unlink)]
    {
        crate::phase::say(
            "bench",
            format!("{name}, {} workers x {} files, own directories", o.threads, o.files_per_thread),
        );
        let s = sides.run(Start::Warm, |dir, _| {
            md(&dir.join("md"), MdShape { threads: o.threads, files: o.files_per_thread, size: 0, shared: false }, op)
                .map(|()| None)
        })?;
        sides.push(name, "ops/s", md_ops, &s);
        if let Md::Create = op {
            let shape = MdShape { threads: o.threads, files: o.files_per_thread, size: 0, shared: false };
            let notes = fuse_minimum_creates(&sides.minimum_dir(), "md create", shape)?;
            sides.notes.extend(notes);
        }
        if let Md::Unlink = op {
            settle_deletes(o.settle);
        }
    }

    let shared_ops = (o.threads * o.shared_files_per_thread) as f64;
    let shape =
        MdShape { threads: o.threads, files: o.shared_files_per_thread, size: o.shared_file_size, shared: true };
    for (name, op) in [
        ("shared create", Md::Create),
        ("shared stat", Md::Stat),
        ("shared read", Md::Read),
        ("shared unlink", Md::Unlink),
    ] {
        eprintln!(
            "bench: {name}, {} workers x {} files of {} bytes, one directory",
            o.threads, o.shared_files_per_thread, o.shared_file_size
        );
        let s = sides.run(Start::Warm, |dir, _| md(&dir.join("shared"), shape, op).map(|()| None))?;
        sides.push(name, "ops/s", shared_ops, &s);
        if let Md::Create = op {
            let notes = fuse_minimum_creates(&sides.minimum_dir(), "shared create", shape)?;
            sides.notes.extend(notes);
        }
        if let Md::Unlink = op {
            settle_deletes(o.settle);
        }
    }
    Ok(())
}

/// The creates of `shape` on the FUSE minimum that makes files (`MinimumFs::with_creates`:
/// each request answered at once, nothing kept): what FUSE's own requests for them cost here,
/// the bound under any FUSE filesystem's creates. Once served from this process (the workers'
/// scheduling group), once from a process of its own session as every FUSE daemon runs
/// (`super::minimum`). One line each, or why it was skipped.
fn fuse_minimum_creates(at: &Path, phase: &str, shape: MdShape) -> Result<Vec<String>> {
    let spec = MinimumSpec { at: at.to_path_buf(), creates: true, ..MinimumSpec::default() };
    let mut notes = Vec::new();
    for (apart, name) in [
        (false, "FUSE minimum, creates (answered at once, nothing kept)"),
        (true, "FUSE minimum in its own session, creates (answered at once, nothing kept)"),
    ] {
        let minimum = match Minimum::mount(&spec, apart, name)? {
            Ok(m) => m,
            Err(skipped) => {
                notes.push(skipped);
                continue;
            }
        };
        crate::phase::say("bench", format!("{name}, {phase}: {} workers x {} files", shape.threads, shape.files));
        // CPU-s: this process's, where the workers run, and the serving process's.
        let cpu = CpuMeter::start(&minimum.pid().into_iter().collect::<Vec<_>>());
        let t = Instant::now();
        let made = md(&at.join(phase.replace(' ', "-")), shape, Md::Create);
        let (secs, cpu) = (t.elapsed().as_secs_f64(), cpu.stop());
        let unmounted = minimum.unmount(at);
        made.context("creating files on the FUSE minimum")?;
        unmounted?;
        let rate = (shape.threads * shape.files) as f64 / secs;
        notes.push(format!("{name}: {phase} {rate:.0} ops/s ({cpu:.1} CPU-s)"));
    }
    Ok(notes)
}

/// Waits, after an unlink phase, until the disk's file system has stopped avoiding the inodes it
/// freed. ext4 without a journal skips, one buffer lookup each, every inode deleted in the last
/// minute whose inode table block is still cached (six minutes while that block is dirty: hence
/// the sync), so the creates that follow — of whichever side comes first — would pay for the
/// deletes of every side measured before them.
fn settle_deletes(pause: Duration) {
    if pause.is_zero() {
        return;
    }
    crate::phase::say(
        "bench",
        format!("pausing {} s so freed inodes are reusable again before the next creates", pause.as_secs()),
    );
    // SAFETY: sync has no preconditions.
    unsafe { libc::sync() };
    std::thread::sleep(pause);
}

/// ext4's window for recently deleted inodes (`RECENTCY_MIN`, 60 s), and a second.
const SETTLE: Duration = Duration::from_secs(61);

/// Small files written, then read cold in random order.
fn small_phases(o: &MountBenchOptions, sides: &mut Sides) -> Result<()> {
    let n = o.small_files as f64;
    let mib = (o.small_files * o.small_file_size) as f64 / MIB;
    eprintln!(
        "bench: small write, {} files of {} KiB in {} directories, {} workers",
        o.small_files,
        o.small_file_size >> 10,
        o.small_dirs,
        o.small_threads
    );
    let s = sides.run(Start::Warm, |dir, _| small_write(&dir.join("small"), o).map(|()| None))?;
    sides.push("small write", "files/s", n, &s);
    // A training job's epochs: cold first, then twice more in other random orders with the
    // caches kept (each side runs its three epochs in a row).
    crate::phase::say(
        "bench",
        format!("small read, cold, then epochs 2 and 3 (caches kept), random order, {} workers", o.small_threads),
    );
    let s = sides.run_series(&[Start::Cold, Start::Warm, Start::Warm], |dir, _, epoch| {
        small_read(&dir.join("small"), o, epoch as u64).map(|()| None)
    })?;
    sides.push("small read cold", "files/s", n, &s[0]);
    sides.push("small read cold", "MiB/s", mib, &s[0]);
    sides.push("small read epoch 2", "files/s", n, &s[1]);
    sides.push("small read epoch 3", "files/s", n, &s[2]);
    let notes = fuse_minimum(o, &sides.minimum_dir(), &mut sides.dropped)?;
    sides.notes.extend(notes);
    Ok(())
}

/// The same three reads on the FUSE minimum (`crate::minimum_fs`): a synthetic
/// filesystem answering every request on its reader thread, with no I/O and the longest
/// caching FUSE allows — what FUSE alone costs here — as any FUSE filesystem with opens must
/// run, served from this process and from a process of its own session (as every FUSE daemon
/// runs: `super::minimum`), and in FUSE's no-open mode. One line each, or why it was skipped;
/// `dropped` is cleared when the page cache could not be dropped before a cold read.
fn fuse_minimum(o: &MountBenchOptions, at: &Path, dropped: &mut bool) -> Result<Vec<String>> {
    let tree = MinimumSpec {
        at: at.to_path_buf(),
        small_files: o.small_files as u64,
        small_dirs: o.small_dirs as u64,
        small_size: o.small_file_size,
        ..MinimumSpec::default()
    };
    let mut notes = Vec::new();
    for (no_open, apart, what) in [
        (false, false, "FUSE minimum, with opens"),
        (false, true, "FUSE minimum in its own session, with opens"),
        (true, false, "FUSE minimum, no-open mode (no OPEN or RELEASE)"),
    ] {
        let spec = MinimumSpec { no_open, ..tree.clone() };
        let minimum = match Minimum::mount(&spec, apart, what)? {
            Ok(m) => m,
            Err(skipped) => {
                notes.push(skipped);
                continue;
            }
        };
        crate::phase::say("bench", format!("{what}: small read cold, then epochs 2 and 3"));
        let mut rates = Vec::new();
        for epoch in 0..3u64 {
            if epoch == 0 {
                *dropped &= drop_caches();
            }
            let t = Instant::now();
            let r = small_read(at, o, epoch);
            if let Err(e) = r {
                let _ = minimum.unmount(at);
                return Err(e.context("reading the FUSE minimum"));
            }
            rates.push(o.small_files as f64 / t.elapsed().as_secs_f64());
        }
        minimum.unmount(at)?;
        notes.push(format!(
            "{what}: small read cold {:.0} files/s, epoch 2 {:.0}, epoch 3 {:.0}",
            rates[0], rates[1], rates[2]
        ));
    }
    Ok(notes)
}

/// fio's JSON report of one run (`--group_reporting`: one entry for all jobs).
struct FioReport {
    job: serde_json::Value,
}

impl FioReport {
    fn field(&self, dir: &str, key: &str) -> Result<f64> {
        self.job[dir][key].as_f64().with_context(|| format!("fio report has no {dir}.{key}"))
    }
    fn bw_bytes(&self, dir: &str) -> Result<f64> {
        self.field(dir, "bw_bytes")
    }
    fn expect_bytes(&self, dir: &str, want: u64) -> Result<()> {
        let got = self.field(dir, "io_bytes")? as u64;
        anyhow::ensure!(got == want, "fio {dir} moved {got} bytes, expected {want}");
        Ok(())
    }
}

/// Runs fio with `args`, JSON report to `out`; fails on a non-zero exit or a job error.
fn run_fio(fio: &Path, args: &[String], out: &Path) -> Result<FioReport> {
    let child = Command::new(fio)
        .args(args)
        .arg("--output-format=json")
        .arg(format!("--output={}", out.display()))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot run {}", fio.display()))?;
    let _waiting = crate::phase::waiting(format!("fio (pid {}) {}", child.id(), args.join(" ")));
    let res = child.wait_with_output().with_context(|| format!("waiting for {}", fio.display()))?;
    let text = std::fs::read_to_string(out).unwrap_or_default();
    if !res.status.success() {
        bail!(
            "fio {} failed ({}): {}{}",
            args.join(" "),
            res.status,
            String::from_utf8_lossy(&res.stderr).trim(),
            String::from_utf8_lossy(&res.stdout).trim()
        );
    }
    // fio may put notes before the JSON document.
    let json =
        text.find('{').map(|i| &text[i..]).with_context(|| format!("fio wrote no report to {}", out.display()))?;
    let v: serde_json::Value = serde_json::from_str(json).with_context(|| format!("fio report {}", out.display()))?;
    let jobs = v["jobs"].as_array().context("fio report has no jobs")?;
    anyhow::ensure!(jobs.len() == 1, "fio report has {} job entries, expected one (group_reporting)", jobs.len());
    let job = jobs[0].clone();
    let err = job["error"].as_i64().unwrap_or(-1);
    anyhow::ensure!(err == 0, "fio job reported error {err} ({})", std::io::Error::from_raw_os_error(err as i32));
    Ok(FioReport { job })
}

/// Fails with the errno if `path` cannot be opened with O_DIRECT and read at an aligned offset,
/// rather than letting the random-read phase silently measure something else.
fn probe_direct(path: &Path) -> Result<()> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .with_context(|| format!("O_DIRECT open of {} refused", path.display()))?;
    let mut buf = vec![0u8; 8192];
    let off = buf.as_ptr().align_offset(4096);
    let n = std::os::unix::fs::FileExt::read_at(&f, &mut buf[off..off + 4096], 0)
        .with_context(|| format!("O_DIRECT read of {} refused", path.display()))?;
    anyhow::ensure!(n == 4096, "O_DIRECT read of {} returned {n} bytes, expected 4096", path.display());
    Ok(())
}

#[derive(Clone, Copy)]
enum Md {
    Create,
    Stat,
    Read,
    Unlink,
}

#[derive(Clone, Copy)]
struct MdShape {
    threads: usize,
    files: usize,
    /// Bytes written at create and checked by stat and read.
    size: usize,
    /// All workers in `dir` rather than each in `dir/t<k>`.
    shared: bool,
}

/// One metadata phase: every worker does `op` on each of its files.
fn md(dir: &Path, shape: MdShape, op: Md) -> Result<()> {
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..shape.threads)
            .map(|t| {
                let d = if shape.shared { dir.to_path_buf() } else { dir.join(format!("t{t}")) };
                s.spawn(move || -> Result<()> {
                    if let Md::Create = op {
                        std::fs::create_dir_all(&d)?;
                    }
                    let mut data = vec![0u8; shape.size];
                    fill_pattern(&mut data, t as u64);
                    let mut buf = Vec::with_capacity(shape.size + 1);
                    for i in 0..shape.files {
                        let p = d.join(format!("f{t}.{i}"));
                        let ctx = || format!("{}", p.display());
                        match op {
                            Md::Create => {
                                let mut f = std::fs::OpenOptions::new()
                                    .write(true)
                                    .create_new(true)
                                    .open(&p)
                                    .with_context(ctx)?;
                                if !data.is_empty() {
                                    f.write_all(&data).with_context(ctx)?;
                                }
                                close(f).with_context(ctx)?;
                            }
                            Md::Stat => {
                                let m = std::fs::metadata(&p).with_context(ctx)?;
                                anyhow::ensure!(
                                    m.is_file() && m.len() == shape.size as u64,
                                    "{}: size {}, expected {}",
                                    p.display(),
                                    m.len(),
                                    shape.size
                                );
                            }
                            Md::Read => {
                                buf.clear();
                                std::fs::File::open(&p).and_then(|mut f| f.read_to_end(&mut buf)).with_context(ctx)?;
                                anyhow::ensure!(buf == data, "{}: read back different content", p.display());
                            }
                            Md::Unlink => std::fs::remove_file(&p).with_context(ctx)?,
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        hs.into_iter().try_for_each(|h| h.join().expect("metadata worker"))
    })
}

fn small_path(dir: &Path, o: &MountBenchOptions, i: usize) -> PathBuf {
    dir.join(format!("d{}", i % o.small_dirs)).join(format!("s{i}"))
}

/// Writes the small files; each starts with its own index so a misdirected read is caught.
fn small_write(dir: &Path, o: &MountBenchOptions) -> Result<()> {
    anyhow::ensure!(o.small_file_size >= 8, "small files must hold at least 8 bytes");
    for k in 0..o.small_dirs {
        std::fs::create_dir_all(dir.join(format!("d{k}")))?;
    }
    let mut data = vec![0u8; o.small_file_size];
    fill_pattern(&mut data, 5);
    let order: Vec<usize> = (0..o.small_files).collect();
    parallel(o.small_threads, &order, |i| {
        let p = small_path(dir, o, i);
        // One write per file, as an application writing a whole file would.
        let mut buf = data.clone();
        buf[..8].copy_from_slice(&(i as u64).to_le_bytes());
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).open(&p)?;
        f.write_all(&buf)?;
        close(f).with_context(|| format!("{}", p.display()))
    })
}

/// Reads every small file once in a random order fixed for each `epoch` and checks size and
/// index.
fn small_read(dir: &Path, o: &MountBenchOptions, epoch: u64) -> Result<()> {
    let mut order: Vec<usize> = (0..o.small_files).collect();
    order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(0x0DF5 + epoch));
    let total = AtomicU64::new(0);
    parallel(o.small_threads, &order, |i| {
        let p = small_path(dir, o, i);
        let mut buf = Vec::with_capacity(o.small_file_size + 1);
        std::fs::File::open(&p)
            .and_then(|mut f| f.read_to_end(&mut buf))
            .with_context(|| format!("{}", p.display()))?;
        anyhow::ensure!(buf.len() == o.small_file_size, "{}: read {} bytes", p.display(), buf.len());
        anyhow::ensure!(buf[..8] == (i as u64).to_le_bytes(), "{}: holds another file's data", p.display());
        total.fetch_add(buf.len() as u64, Ordering::Relaxed);
        Ok(())
    })?;
    let want = (o.small_files * o.small_file_size) as u64;
    let got = total.into_inner();
    anyhow::ensure!(got == want, "read {got} bytes of small files, expected {want}");
    Ok(())
}

/// Renders results as a Markdown table with a unit column.
pub fn render(phases: &[Phase]) -> String {
    let mut s = String::from(
        "| phase | unit | odfs | plain | ratio | FUSE floor | vs floor | metad requests | odfs CPU-s | plain CPU-s | floor CPU-s |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    let opt = |v: Option<String>| v.unwrap_or_else(|| "-".into());
    for p in phases {
        s.push_str(&format!(
            "| {} | {} | {:.0} | {} | {} | {} | {} | {} | {:.1} | {} | {} |\n",
            p.name,
            p.unit,
            p.odfs,
            opt(p.plain.map(|v| format!("{v:.0}"))),
            opt(p.ratio().map(|r| format!("{r:.2}x"))),
            opt(p.floor.map(|v| format!("{v:.0}"))),
            opt(p.floor_ratio().map(|r| format!("{r:.2}x"))),
            opt(p.meta_requests.map(|v| v.to_string())),
            p.odfs_cpu,
            opt(p.plain_cpu.map(|v| format!("{v:.1}"))),
            opt(p.floor_cpu.map(|v| format!("{v:.1}"))),
        ));
    }
    s
}
