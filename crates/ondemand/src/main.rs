//! `odfs`: the command line. Parses arguments and runs each command through one `run()`; the
//! work is in the libraries (`odfs_job` for the job life cycle and local filesystems,
//! `odfs_stage` for staging, `odfs_ondemand` for everything else the CLI does).

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use odfs_job::local;
use odfs_ondemand::{copy, demo, find, fsref, lfs, stage, status};
use odfs_rpc::{SiteKey, Transport};
use odfs_stage::{Direction, StageRequest};
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Parser)]
#[command(name = "odfs", about = "odfs: an on-demand, job-private parallel filesystem", version)]
struct Cli {
    /// Client config of the filesystem to use (written by `odfs local up` as ROOT/odfs.toml).
    #[arg(long, global = true, env = "ODFS_FS")]
    fs: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run a whole multi-node filesystem on this machine.
    #[command(subcommand)]
    Local(LocalCmd),
    /// Show the filesystem state, nodes, services and targets.
    Status,
    /// Copy files or trees in and out of odfs (`odfs:/path` names a path inside odfs); modes and
    /// times are kept. Into an existing directory the source keeps its name; `SRC/.` copies
    /// what is in SRC, as cp(1) does.
    Cp(CpArgs),
    /// Copy a dataset into odfs from S3 or a POSIX directory, every node moving its share, verified.
    StageIn(StageRequest),
    /// Copy outputs from odfs to S3 or a POSIX directory, every node moving its share, verified;
    /// a completion marker is written last. Nothing is ever deleted.
    StageOut(StageRequest),
    /// Continuous drain: upload a directory's files to S3 as they settle while the job runs,
    /// verified and recorded in the stage-out manifest (`#ODFS drain` in a Slurm job).
    #[command(subcommand)]
    Drain(DrainCmd),
    /// Create a site key (root-only file from which every job's credential is derived).
    Keygen(KeygenArgs),
    /// The main job on one machine: local filesystem mounted through FUSE, a dataset copied into
    /// the mount and back out, a short benchmark through the mount (needs fio).
    Demo(DemoArgs),
    /// Benchmark odfs against a plain directory on the same disk.
    Bench(BenchArgs),
    /// Start this node's part of a job's filesystem (the Slurm prolog; or run it on every node
    /// with pdsh, clush or srun). Node 0 returns once every node is up and the stage-in is done.
    Start(NodeArgs),
    /// Stop this node's part of a job's filesystem (the Slurm epilog): node 0 stages out and
    /// verifies; every node wipes its data, or keeps it if the outputs were not verified.
    Stop(NodeArgs),
    /// Restart a job whose outputs were not verified from its kept data, finish its stage-out,
    /// then wipe. Run it on every node of the job.
    Recover(RecoverArgs),
    /// Remove what jobs that no longer run left on this node (processes, mounts, data).
    Cleanup(CleanupArgs),
    /// Set the layout of a directory (the default for new files and subdirectories) or of a new
    /// or empty file, like lfs setstripe. PATH is in a mount, or odfs:/PATH with --fs.
    Setstripe(SetstripeArgs),
    /// Show layouts like lfs getstripe: a file's stripes and targets, a directory's default
    /// and its files'.
    Getstripe(GetstripeArgs),
    /// Space or inodes per target, per pool and in all, like lfs df.
    #[command(disable_help_flag = true)]
    Df(DfArgs),
    /// Make a directory; with -c N its entries are spread over N metadata shards (-1 = all),
    /// like lfs mkdir -c. PATH is in a mount, or odfs:/PATH with --fs.
    Mkdir(MkdirArgs),
    /// Find files like find(1), in parallel: odfs find PATH [-name GLOB] [-type f|d|l]
    /// [-size [+-]N[ckMG]] [-newer FILE] [--stripe-count N] [--pool P].
    Find(FindArgs),
    /// Seal a tree read-only: every change under PATH is refused (EROFS) until `odfs unseal`,
    /// and every node caches the tree for as long as it is sealed. PATH is in a mount, or
    /// odfs:/PATH with --fs.
    Seal(PathArg),
    /// Make a sealed tree writable again (every node's caches of it are recalled first).
    Unseal(PathArg),
    /// Storage pools: list them; create, fill, empty or destroy one (with --fs).
    #[command(subcommand)]
    Pool(PoolCmd),
    /// Check the site config and print it with every default filled in (`--defaults`: the
    /// defaults alone).
    SiteConfig(SiteConfigArgs),
    /// Check the `#ODFS` lines of batch scripts before submitting them (`-` reads standard
    /// input): every error is named with its line, and the command fails. slurm/job_submit.lua
    /// runs it at sbatch time.
    CheckScript(CheckScriptArgs),
    /// Print `export` lines for the job's tasks (Slurm TaskProlog): ODFS_MOUNT, ODFS_JOB.
    TaskEnv(SiteArg),
    /// What every service has served since it started: requests by kind with rates, latency
    /// percentiles, errors and bytes, and by client (with --fs, or in the mount's job).
    Stats(StatsArgs),
    /// Serve a FUSE minimum of `odfs bench --mount` until standard input ends (the benchmark
    /// runs it in a session of its own, as FUSE daemons run).
    #[command(hide = true)]
    FuseMinimum(odfs_bench::minimum::MinimumSpec),
}

impl Cmd {
    fn run(self, fs: Option<&Path>) -> Result<()> {
        match self {
            Cmd::Local(c) => c.run(),
            Cmd::Status => run_status(fs),
            Cmd::Cp(a) => a.run(fs),
            Cmd::StageIn(r) => runtime()?.block_on(stage::run(fs, &r, Direction::In)),
            Cmd::StageOut(r) => runtime()?.block_on(stage::run(fs, &r, Direction::Out)),
            Cmd::Drain(c) => c.run(fs),
            Cmd::Keygen(a) => a.run(),
            Cmd::Demo(a) => a.run(),
            Cmd::Bench(a) => a.run(),
            Cmd::Start(a) => a.start(),
            Cmd::Stop(a) => a.stop(),
            Cmd::Recover(a) => a.run(),
            Cmd::Cleanup(a) => a.run(),
            Cmd::Setstripe(a) => a.run(fs),
            Cmd::Getstripe(a) => a.run(fs),
            Cmd::Df(a) => a.run(fs),
            Cmd::Mkdir(a) => a.run(fs),
            Cmd::Find(a) => a.run(fs),
            Cmd::Seal(a) => a.seal(fs, true),
            Cmd::Unseal(a) => a.seal(fs, false),
            Cmd::Pool(c) => c.run(fs),
            Cmd::SiteConfig(a) => a.run(),
            Cmd::CheckScript(a) => a.run(),
            Cmd::TaskEnv(a) => a.task_env(),
            Cmd::Stats(a) => a.run(fs),
            Cmd::FuseMinimum(spec) => odfs_bench::minimum::serve(&spec),
        }
    }
}

#[derive(Subcommand)]
enum DrainCmd {
    /// Start draining SRC (odfs:/PATH or a path in the mount) to s3://BUCKET/PREFIX; it runs
    /// on node 0's stage agent until `odfs drain stop` or the job's stop.
    Start(odfs_stage::drain::DrainRequest),
    /// Show every drain: pending, in flight, uploaded, failed.
    Status {
        #[arg(long)]
        json: bool,
    },
    /// Stop a drain (every drain without SRC) after its pass in flight; prints its last state.
    Stop {
        src: Option<String>,
        #[arg(long)]
        json: bool,
    },
}

impl DrainCmd {
    fn run(self, fs: Option<&Path>) -> Result<()> {
        match self {
            DrainCmd::Start(r) => runtime()?.block_on(stage::drain_start(fs, &r)),
            DrainCmd::Status { json } => runtime()?.block_on(stage::drain_status(fs, json)),
            DrainCmd::Stop { src, json } => runtime()?.block_on(stage::drain_stop(fs, src.as_deref(), json)),
        }
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?)
}

fn main() {
    let cli = Cli::parse();
    // The S3 SDK warns about files it cannot find on its own; odfs's errors name them when
    // they matter (no credentials found), so those warnings would only say it twice.
    odfs_service::init_logging("warn,aws_runtime=error,aws_config=error");
    let result = cli.cmd.run(cli.fs.as_deref());
    // A signal's teardown (`odfs_job::interrupt`) under way ends the process itself.
    odfs_job::interrupt::disarm();
    if let Err(e) = result {
        let e = format!("{e:#}");
        eprintln!("{}", if e.starts_with("odfs: ") { e } else { format!("odfs: {e}") });
        std::process::exit(1);
    }
}

// ---- a filesystem through the client library ----

fn run_status(fs: Option<&Path>) -> Result<()> {
    let view: odfs_proto::mgmt::ClusterView = match fsref::source(fs)? {
        fsref::Source::Config(_) => runtime()?.block_on(async {
            let client = fsref::connect(fs).await?;
            anyhow::Ok((*client.cluster().refresh().await?).clone())
        })?,
        fsref::Source::Mount(m) => {
            let text = mount_attr(&m, odfs_client::vxattr::CLUSTER)?;
            serde_json::from_str(&text).with_context(|| format!("the cluster view of {}", m.display()))?
        }
    };
    print!("{}", status::render(&view)?);
    Ok(())
}

/// A virtual attribute of the mount at `m` (`odfs_client::vxattr`), as text.
fn mount_attr(m: &Path, name: &[u8]) -> Result<String> {
    let v = lfs::get_xattr(m, name)
        .with_context(|| format!("cannot read {} of the odfs mount {}", String::from_utf8_lossy(name), m.display()))?;
    Ok(String::from_utf8_lossy(&v).into_owned())
}

/// Why the statistics could not be read through the mount `m`, the likely cause first.
fn stats_unreadable(m: &Path, e: std::io::Error) -> anyhow::Error {
    let m = m.display();
    match e.raw_os_error() {
        Some(libc::EACCES | libc::EPERM) => anyhow::anyhow!(
            "permission denied: the odfs mount {m} serves only its job's user (and root); \
             run odfs stats as that user, or as root with --fs CONFIG"
        ),
        Some(libc::ERANGE | libc::E2BIG) => anyhow::anyhow!(
            "the statistics of {m} do not fit in an extended attribute (a job with very many \
             services): run odfs stats --fs CONFIG on one of its nodes as root"
        ),
        _ => anyhow::anyhow!("cannot read the statistics of the odfs mount {m}: {e}"),
    }
}

#[derive(Args)]
struct CpArgs {
    #[arg(short = 'r', long)]
    recursive: bool,
    /// Files copied at once.
    #[arg(long, default_value_t = 16)]
    parallel: usize,
    src: String,
    dst: String,
}

impl CpArgs {
    fn run(self, fs: Option<&Path>) -> Result<()> {
        let o = copy::CopyOptions {
            recursive: self.recursive,
            parallel: self.parallel,
            progress: std::io::IsTerminal::is_terminal(&std::io::stderr()),
        };
        let s = runtime()?.block_on(async {
            let client = fsref::connect(fs).await?;
            copy::copy(&client, &self.src, &self.dst, &o).await
        })?;
        println!("copied {} files, {} links, {} directories, {} bytes", s.files, s.links, s.dirs, s.bytes);
        if s.special > 0 {
            println!("skipped {} FIFOs, sockets or device nodes (they hold no data to copy)", s.special);
        }
        Ok(())
    }
}

#[derive(Args)]
struct SetstripeArgs {
    /// Stripe count (-1 = every target of the pool).
    #[arg(short = 'c', long = "stripe-count", allow_hyphen_values = true)]
    count: Option<i32>,
    /// Stripe (chunk) size: a power of two from 64K to 1G (K/M/G suffix).
    #[arg(short = 'S', long = "stripe-size", value_parser = odfs_proto::units::parse_size)]
    size: Option<u64>,
    /// Pool.
    #[arg(short = 'p', long)]
    pool: Option<String>,
    /// First target (-1 = any).
    #[arg(short = 'i', long = "stripe-index", allow_hyphen_values = true)]
    index: Option<i64>,
    /// Local placement: a new file's first stripe on a target of the node that creates it
    /// (with -c 1, the whole file on the writer's own disk; for checkpoints).
    #[arg(long, conflicts_with = "rotate")]
    local: bool,
    /// Usual placement: new files' stripes rotate over the pool's targets (turns --local off).
    #[arg(long)]
    rotate: bool,
    path: String,
}

impl SetstripeArgs {
    fn run(self, fs: Option<&Path>) -> Result<()> {
        let local = match (self.local, self.rotate) {
            (true, _) => Some(true),
            (_, true) => Some(false),
            _ => None,
        };
        let a = lfs::StripeArgs { count: self.count, size: self.size, pool: self.pool, start: self.index, local };
        runtime()?.block_on(async { lfs::setstripe(&lfs::Place::open(&self.path, fs).await?, &a).await })
    }
}

#[derive(Args)]
struct PathArg {
    path: String,
}

impl PathArg {
    fn seal(self, fs: Option<&Path>, sealed: bool) -> Result<()> {
        runtime()?.block_on(async { lfs::seal(&lfs::Place::open(&self.path, fs).await?, sealed).await })
    }
}

#[derive(Args)]
struct GetstripeArgs {
    #[arg(short = 'v', long)]
    verbose: bool,
    #[arg(short = 'y', long)]
    yaml: bool,
    /// Only the stripe count.
    #[arg(short = 'c', long = "stripe-count")]
    count: bool,
    /// Only the stripe size.
    #[arg(short = 'S', long = "stripe-size")]
    size: bool,
    /// Only the pool.
    #[arg(short = 'p', long)]
    pool: bool,
    /// A directory itself, not its files.
    #[arg(short = 'd', long)]
    directory: bool,
    /// Into subdirectories.
    #[arg(short = 'r', long)]
    recursive: bool,
    path: String,
}

impl GetstripeArgs {
    fn run(self, fs: Option<&Path>) -> Result<()> {
        let a = lfs::GetStripeArgs {
            verbose: self.verbose,
            yaml: self.yaml,
            count: self.count,
            size: self.size,
            pool: self.pool,
            dir_only: self.directory,
            recursive: self.recursive,
        };
        let out = runtime()?.block_on(async { lfs::getstripe(&lfs::Place::open(&self.path, fs).await?, &a).await })?;
        print!("{out}");
        Ok(())
    }
}

#[derive(Args)]
struct StatsArgs {
    /// Print the numbers as JSON (every service's counters and histograms, and the clients).
    #[arg(long)]
    json: bool,
    /// Refresh every SECS seconds (default 1), like top: rates over the last interval, busiest
    /// first. Ctrl-C ends it.
    #[arg(short = 'w', long = "watch", value_name = "SECS", num_args = 0..=1, default_missing_value = "1")]
    watch: Option<f64>,
}

impl StatsArgs {
    fn run(self, fs: Option<&Path>) -> Result<()> {
        let rt = runtime()?;
        // Where the numbers come from: the library with the job's credential, or the mount.
        let from = match fsref::source(fs)? {
            fsref::Source::Config(_) => Ok(rt.block_on(fsref::connect(fs))?),
            fsref::Source::Mount(m) => Err(m),
        };
        let fetch = || -> Result<odfs_proto::stats::FsStats> {
            match &from {
                Ok(client) => Ok(rt.block_on(client.fs_stats())?),
                Err(m) => {
                    let text = lfs::get_xattr(m, odfs_client::vxattr::STATS).map_err(|e| stats_unreadable(m, e))?;
                    serde_json::from_slice(&text).with_context(|| format!("the statistics of {}", m.display()))
                }
            }
        };
        let Some(every) = self.watch else {
            let now = fetch()?;
            if self.json {
                println!("{}", serde_json::to_string_pretty(&now)?);
            } else {
                print!("{}", odfs_ondemand::stats::render(&now, None));
            }
            return Ok(());
        };
        anyhow::ensure!(every > 0.0 && every.is_finite(), "-w takes a positive number of seconds, not {every}");
        let mut before = fetch()?;
        let mut at = std::time::Instant::now();
        // Clearing the screen is for a terminal; into a pipe or a file each screen follows the
        // one before, after a blank line, and starts with its `odfs stats at` line.
        let terminal = std::io::IsTerminal::is_terminal(&std::io::stdout());
        loop {
            std::thread::sleep(Duration::from_secs_f64(every));
            let now = fetch()?;
            let secs = match (before.taken_unix_ms, now.taken_unix_ms) {
                (b, n) if b > 0 && n > b => (n - b) as f64 / 1000.0,
                _ => at.elapsed().as_secs_f64(),
            };
            at = std::time::Instant::now();
            if self.json {
                println!("{}", serde_json::to_string(&now)?);
            } else {
                // On a terminal, clear the screen and home the cursor first, as top does.
                print!(
                    "{}{}\n\n{}",
                    if terminal { "\x1b[2J\x1b[H" } else { "\n" },
                    odfs_ondemand::stats::watch_header(&now, secs),
                    odfs_ondemand::stats::render(&now, Some((&before, secs)))
                );
            }
            before = now;
        }
    }
}

#[derive(Args)]
struct DfArgs {
    /// Sizes for people (K, M, G).
    #[arg(short = 'h', long = "human-readable")]
    human: bool,
    #[arg(short = 'i', long)]
    inodes: bool,
    #[arg(long)]
    pool: Option<String>,
    /// A path in the mount, or odfs:/ with --fs [default: $ODFS_MOUNT, else odfs:/].
    path: Option<String>,
    #[arg(long, action = clap::ArgAction::Help)]
    help: Option<bool>,
}

impl DfArgs {
    fn run(self, fs: Option<&Path>) -> Result<()> {
        let a = lfs::DfArgs { human: self.human, inodes: self.inodes, pool: self.pool };
        let place = default_place(self.path);
        let out = runtime()?.block_on(async { lfs::df(&lfs::Place::open(&place, fs).await?, &a).await })?;
        print!("{out}");
        Ok(())
    }
}

#[derive(Args)]
struct MkdirArgs {
    /// Metadata shards to spread the entries over (-1 = every shard).
    #[arg(short = 'c', long = "mdt-count", allow_hyphen_values = true)]
    count: Option<i32>,
    /// Make missing parents too.
    #[arg(short = 'p', long)]
    parents: bool,
    path: String,
}

impl MkdirArgs {
    fn run(self, fs: Option<&Path>) -> Result<()> {
        runtime()?.block_on(async {
            let place = lfs::Place::open(&self.path, fs).await?;
            lfs::mkdir(&place, self.parents, self.count).await
        })
    }
}

#[derive(Args)]
struct FindArgs {
    path: String,
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    tests: Vec<String>,
}

impl FindArgs {
    fn run(self, fs: Option<&Path>) -> Result<()> {
        runtime()?.block_on(async {
            let t = find::parse_tests(&self.tests, fs).await?;
            let mut out = std::io::BufWriter::new(std::io::stdout());
            find::find(&self.path, fs, &t, &mut out).await?;
            std::io::Write::flush(&mut out)?;
            anyhow::Ok(())
        })
    }
}

#[derive(Subcommand)]
enum PoolCmd {
    /// Every pool and its targets.
    List {
        /// A path in the mount, or odfs:/ with --fs [default: $ODFS_MOUNT, else odfs:/].
        path: Option<String>,
    },
    /// A new, empty pool.
    Create { name: String },
    /// Move targets into a pool.
    Add { name: String, targets: Vec<u32> },
    /// Move targets of a pool back to the pool they were configured with.
    Remove { name: String, targets: Vec<u32> },
    /// Forget an empty pool.
    Destroy { name: String },
}

impl PoolCmd {
    fn run(self, fs: Option<&Path>) -> Result<()> {
        use odfs_proto::mgmt::PoolChange;
        let (name, change) = match self {
            PoolCmd::List { path } => {
                let place = default_place(path);
                let out = runtime()?.block_on(async { lfs::pool_list(&lfs::Place::open(&place, fs).await?).await })?;
                print!("{out}");
                return Ok(());
            }
            PoolCmd::Create { name } => (name, PoolChange::Create),
            PoolCmd::Add { name, targets } => (name, PoolChange::Add(targets)),
            PoolCmd::Remove { name, targets } => (name, PoolChange::Remove(targets)),
            PoolCmd::Destroy { name } => (name, PoolChange::Destroy),
        };
        runtime()?.block_on(async {
            let client = fsref::connect(fs).await?;
            let r = client.change_pool(&odfs_client::Ctx::current(), &name, change).await;
            client.close().await;
            r.map_err(lfs::why)
        })
    }
}

/// A command's path: the one given, else the job's mount (`fsref::job_mount`), else odfs:/
/// (with --fs).
fn default_place(path: Option<String>) -> String {
    path.or_else(|| fsref::job_mount().map(|m| m.display().to_string())).unwrap_or_else(|| "odfs:/".into())
}

// ---- keys, demo, benchmarks ----

#[derive(Args)]
struct KeygenArgs {
    #[arg(long, default_value = "/etc/odfs/site.key")]
    out: PathBuf,
}

impl KeygenArgs {
    fn run(self) -> Result<()> {
        if let Some(d) = self.out.parent() {
            std::fs::create_dir_all(d).with_context(|| format!("cannot create {}", d.display()))?;
        }
        SiteKey::generate().write_new(&self.out)?;
        println!("wrote site key {} (mode 0600); copy it to every node of the site", self.out.display());
        Ok(())
    }
}

#[derive(Args)]
struct DemoArgs {
    /// Where the demo works (removed at its end unless --keep) [default: $TMPDIR/odfs-demo-USER,
    /// or /var/tmp/odfs-demo-USER without TMPDIR].
    #[arg(long)]
    root: Option<PathBuf>,
    #[arg(long, default_value_t = 4)]
    nodes: u32,
    #[arg(long, default_value_t = 256)]
    dataset_mib: u64,
    /// Keep the work directory afterwards.
    #[arg(long)]
    keep: bool,
    /// Skip the benchmark (`odfs bench --mount --scale small`).
    #[arg(long)]
    no_bench: bool,
    /// Longest any step of the demo or phase of its benchmark may run before the demo gives up
    /// (and removes what it made).
    #[arg(long, value_name = "SECS", default_value_t = odfs_bench::phase::DEFAULT_BOUND_SECS)]
    phase_timeout: u64,
}

impl DemoArgs {
    fn run(self) -> Result<()> {
        odfs_bench::phase::bound(Duration::from_secs(self.phase_timeout), "odfs demo")?;
        let o = demo::DemoOptions {
            root: self.root.unwrap_or_else(|| demo::default_root("demo")),
            nodes: self.nodes,
            dataset_mib: self.dataset_mib,
            keep: self.keep,
            bench: !self.no_bench,
        };
        odfs_job::interrupt::stop_started_on_signals()?;
        demo::run(&o)
    }
}

/// Preset sizes of `odfs bench`; single flags override them.
#[derive(Clone, Copy, ValueEnum)]
enum Scale {
    /// The published shapes (4 x 1 GiB, 4 x 20,000 files, 50,000 small files).
    Full,
    /// The same phases scaled down to a run of under a minute.
    Small,
}

#[derive(Args)]
struct BenchArgs {
    /// Where the benchmark works [default: $TMPDIR/odfs-bench-USER, or /var/tmp/odfs-bench-USER
    /// without TMPDIR].
    #[arg(long)]
    root: Option<PathBuf>,
    #[arg(long, default_value_t = 4)]
    nodes: u32,
    /// Run through the FUSE mount: fio sequential and 4 KiB random I/O, mdtest-style metadata,
    /// one shared directory, cold small-file reads (needs fio).
    #[arg(long)]
    mount: bool,
    /// Stage-in from an S3 server on loopback (s3s-fs) beside a plain parallel GET client and
    /// `aws s3 cp --recursive` (needs s3s-fs; awscli optional).
    #[arg(long, conflicts_with = "mount")]
    stage: bool,
    /// A job's start (prolog) and stop (epilog) on --nodes loopback nodes, staging excluded,
    /// --rounds times (needs root).
    #[arg(long, conflicts_with_all = ["mount", "stage"])]
    startup: bool,
    /// Creates in one shared directory from --clients clients with one metadata service and
    /// one per node (striped), then odfs find beside GNU find over them (--files, needs root).
    #[arg(long, conflicts_with_all = ["mount", "stage", "startup"])]
    shards: bool,
    /// Files of --shards [default 200000].
    #[arg(long, requires = "shards")]
    files: Option<usize>,
    /// Rounds of --startup.
    #[arg(long, default_value_t = 10, requires = "startup")]
    rounds: u32,
    #[arg(long, value_enum, default_value = "full")]
    scale: Scale,
    /// Sequential clients (with --mount: fio jobs), one file each [default 4].
    #[arg(long)]
    clients: Option<usize>,
    /// MiB per client file [full 1024, small 64].
    #[arg(long)]
    file_mib: Option<u64>,
    /// Metadata threads [default 4].
    #[arg(long)]
    threads: Option<usize>,
    /// Files per metadata thread [full 20000, small 2000].
    #[arg(long)]
    files_per_thread: Option<usize>,
    /// Seconds of 4 KiB random reads [full 15, small 5].
    #[arg(long, requires = "mount")]
    randread_secs: Option<u64>,
    /// Files per thread in the shared directory [full 20000, small 1000].
    #[arg(long, requires = "mount")]
    shared_files_per_thread: Option<usize>,
    /// Small files written and read back cold [full 50000, small 5000].
    #[arg(long, requires = "mount")]
    small_files: Option<usize>,
    /// KiB per small file [default 50].
    #[arg(long, requires = "mount")]
    small_kib: Option<usize>,
    /// Threads writing and reading the small files [default 8].
    #[arg(long, requires = "mount")]
    small_threads: Option<usize>,
    /// Transport for chunk data: tcp or quic.
    #[arg(long, default_value = "tcp")]
    transport: Transport,
    /// Transport for metadata requests (with --mount): tcp or quic [default: the client's].
    #[arg(long, requires = "mount")]
    meta_transport: Option<Transport>,
    #[arg(long)]
    skip_plain: bool,
    #[arg(long)]
    keep: bool,
    /// Longest any phase may run before the benchmark gives up (and stops what it started).
    #[arg(long, value_name = "SECS", default_value_t = odfs_bench::phase::DEFAULT_BOUND_SECS)]
    phase_timeout: u64,
}

impl BenchArgs {
    fn run(self) -> Result<()> {
        odfs_job::interrupt::stop_started_on_signals()?;
        odfs_bench::phase::bound(Duration::from_secs(self.phase_timeout), "odfs bench")?;
        if self.startup {
            self.startup()
        } else if self.shards {
            self.shards()
        } else if self.stage {
            self.stage()
        } else if self.mount {
            self.through_mount()
        } else {
            self.library()
        }
    }

    fn small(&self) -> bool {
        matches!(self.scale, Scale::Small)
    }

    fn work_root(&self) -> PathBuf {
        self.root.clone().unwrap_or_else(|| demo::default_root("bench"))
    }

    fn startup(self) -> Result<()> {
        let o = odfs_bench::startup::StartupBenchOptions {
            root: self.work_root(),
            nodes: self.nodes,
            rounds: self.rounds,
            keep: self.keep,
        };
        let rounds = odfs_bench::startup::run(&o)?;
        print!("{}", odfs_bench::startup::render(o.nodes, &rounds));
        Ok(())
    }

    fn shards(self) -> Result<()> {
        let d = odfs_bench::shards::ShardBenchOptions::default();
        let o = odfs_bench::shards::ShardBenchOptions {
            files: self.files.unwrap_or(if self.small() { 20_000 } else { d.files }),
            root: self.work_root(),
            nodes: self.nodes,
            clients: self.clients.unwrap_or(d.clients),
            keep: self.keep,
        };
        print!("{}", odfs_bench::shards::render(&odfs_bench::shards::run(&o)?));
        Ok(())
    }

    fn stage(self) -> Result<()> {
        let d = if self.small() { odfs_bench::stage::StageBenchOptions::small() } else { Default::default() };
        let o =
            odfs_bench::stage::StageBenchOptions { root: self.work_root(), nodes: self.nodes, keep: self.keep, ..d };
        print!("{}", odfs_bench::stage::render(&odfs_bench::stage::run(&o)?));
        Ok(())
    }

    fn through_mount(self) -> Result<()> {
        let d = if self.small() { odfs_bench::mount::MountBenchOptions::small() } else { Default::default() };
        let o = odfs_bench::mount::MountBenchOptions {
            root: self.work_root(),
            nodes: self.nodes,
            transport: self.transport,
            meta_transport: self.meta_transport.unwrap_or(d.meta_transport),
            jobs: self.clients.unwrap_or(d.jobs),
            job_size: self.file_mib.map_or(d.job_size, |m| m << 20),
            randread_secs: self.randread_secs.unwrap_or(d.randread_secs),
            threads: self.threads.unwrap_or(d.threads),
            files_per_thread: self.files_per_thread.unwrap_or(d.files_per_thread),
            shared_files_per_thread: self.shared_files_per_thread.unwrap_or(d.shared_files_per_thread),
            small_files: self.small_files.unwrap_or(d.small_files),
            small_file_size: self.small_kib.map_or(d.small_file_size, |k| k << 10),
            small_threads: self.small_threads.unwrap_or(d.small_threads),
            skip_plain: self.skip_plain,
            keep: self.keep,
            ..d
        };
        print!("{}", o.describe());
        let (phases, dropped, notes) = odfs_bench::mount::run(&o)?;
        print_table(&odfs_bench::mount::render(&phases), dropped);
        for n in notes {
            println!("{n}");
        }
        Ok(())
    }

    fn library(self) -> Result<()> {
        let d = if self.small() { odfs_bench::BenchOptions::small() } else { Default::default() };
        let o = odfs_bench::BenchOptions {
            root: self.work_root(),
            nodes: self.nodes,
            clients: self.clients.unwrap_or(d.clients),
            file_size: self.file_mib.map_or(d.file_size, |m| m << 20),
            threads: self.threads.unwrap_or(d.threads),
            files_per_thread: self.files_per_thread.unwrap_or(d.files_per_thread),
            transport: self.transport,
            skip_plain: self.skip_plain,
            keep: self.keep,
            ..d
        };
        let (phases, dropped) = odfs_bench::run(&o)?;
        print_table(&odfs_bench::render(&phases), dropped);
        Ok(())
    }
}

/// A benchmark's table, and a note when its cold reads may not have been cold.
fn print_table(table: &str, dropped: bool) {
    print!("{table}");
    if !dropped {
        println!("(page cache could not be dropped: run as root for cold reads)");
    }
}

// ---- a filesystem on this machine ----

#[derive(Subcommand)]
enum LocalCmd {
    /// Start mgmtd, metad and N stored as separate processes on loopback.
    Up(LocalUpArgs),
    /// Stop everything `up` started on ROOT. Its data (chunks, metadata, logs, configs) stays
    /// under ROOT unless --wipe; the last line says what was left.
    Down {
        #[arg(long)]
        root: PathBuf,
        /// Also remove what `up` made under ROOT (its data, logs, configs and site key), then
        /// ROOT itself if nothing else is in it.
        #[arg(long)]
        wipe: bool,
    },
    /// Restart one daemon (e.g. after a crash).
    Restart {
        #[arg(long)]
        root: PathBuf,
        /// mgmtd, metad or stored.
        #[arg(long)]
        service: String,
        #[arg(long, default_value_t = 0)]
        node: u32,
    },
}

#[derive(Args)]
struct LocalUpArgs {
    #[arg(long)]
    root: PathBuf,
    /// Nodes, each its own daemons on this machine (at most 64).
    #[arg(long, default_value_t = 4)]
    nodes: u32,
    /// Do not mount the filesystem.
    #[arg(long, conflicts_with = "mount")]
    no_mount: bool,
    /// Mount point (default ROOT/mnt).
    #[arg(long)]
    mount: Option<PathBuf>,
    #[arg(long, default_value_t = 1)]
    targets_per_node: u32,
    /// Default stripe count (-1 = every target); at most the pool's targets [default: 4, or
    /// every target when there are fewer].
    #[arg(long, allow_hyphen_values = true)]
    stripe_count: Option<i32>,
    /// Default chunk size in bytes (power of two, >= 65536).
    #[arg(long, default_value_t = 1 << 20)]
    chunk_size: u32,
    #[arg(long, default_value = "default")]
    pool: String,
    /// Transport for chunk data: tcp or quic.
    #[arg(long, default_value = "tcp")]
    bulk: Transport,
    /// Transport for metadata requests: tcp or quic [default: the client's].
    #[arg(long)]
    meta_transport: Option<Transport>,
    #[arg(long)]
    job_id: Option<String>,
    /// Site key file (default: ROOT/site.key, created if missing).
    #[arg(long)]
    site_key: Option<PathBuf>,
    /// Seconds to wait for the filesystem to become ready.
    #[arg(long, default_value_t = 30)]
    timeout: u64,
    /// Storage I/O engine: auto, uring or syscall.
    #[arg(long, default_value = "auto")]
    io_backend: String,
    /// Empty chunk files each target keeps ready for new files, made while the node's CPU and disks are idle (0: off).
    #[arg(long, default_value_t = local::DEFAULT_PRECREATE_CHUNK_FILES)]
    precreate_chunk_files: usize,
    /// Chunk writes of at least this many bytes (4 KiB-aligned) go to the disk past the page
    /// cache (O_DIRECT); 0 writes everything through it.
    #[arg(long, default_value_t = local::DEFAULT_DIRECT_WRITE_MIN_BYTES)]
    direct_write_min_bytes: usize,
    /// Address every daemon listens on and advertises (another address of this machine
    /// makes the filesystem reachable from network namespaces or other hosts).
    #[arg(long, default_value = "127.0.0.1")]
    bind: std::net::IpAddr,
    /// Also give every node a RAM target of this size (a tmpfs, e.g. 256M) in pool "ram"
    /// (needs root).
    #[arg(long)]
    ram_pool: Option<String>,
    /// Metadata services (shards) on the first N nodes; 0 = every node.
    #[arg(long, default_value_t = 1)]
    meta: u32,
    /// Serve the filesystem's Prometheus metrics at http://BIND:PORT/metrics.
    #[arg(long, value_name = "PORT")]
    metrics_port: Option<u16>,
}

impl LocalCmd {
    fn run(self) -> Result<()> {
        match self {
            LocalCmd::Up(a) => a.run(),
            LocalCmd::Down { root, wipe } => local_down(&root, wipe),
            LocalCmd::Restart { root, service, node } => {
                let pid = local::restart(&root, &service, node)?;
                println!("restarted {service} on node {node} (pid {pid})");
                Ok(())
            }
        }
    }
}

impl LocalUpArgs {
    fn run(self) -> Result<()> {
        // A count the pool cannot give is a mistake: files would silently get fewer stripes.
        let targets = self.nodes.saturating_mul(self.targets_per_node);
        if let Some(n) = self.stripe_count.filter(|&n| n > 0 && n as u32 > targets) {
            bail!(
                "--stripe-count {n} is more than the {targets} targets of pool {} ({} nodes x {} per node); \
                 -1 stripes over every target",
                self.pool,
                self.nodes,
                self.targets_per_node
            );
        }
        let mount = if self.no_mount { None } else { Some(self.mount.unwrap_or_else(|| self.root.join("mnt"))) };
        let opts = local::UpOptions {
            root: self.root.clone(),
            nodes: self.nodes,
            targets_per_node: self.targets_per_node,
            pool: self.pool,
            chunk_size: self.chunk_size,
            stripe_count: self.stripe_count.unwrap_or(odfs_proto::layout::DEFAULT_STRIPE_COUNT),
            bulk: self.bulk,
            meta_transport: self.meta_transport.unwrap_or(local::UpOptions::default().meta_transport),
            job_id: self.job_id,
            site_key: self.site_key,
            timeout: Duration::from_secs(self.timeout),
            io_backend: self.io_backend,
            precreate_chunk_files: self.precreate_chunk_files,
            direct_write_min_bytes: self.direct_write_min_bytes,
            bind: self.bind,
            ram_pool: self.ram_pool,
            meta: self.meta,
            metrics_port: self.metrics_port,
            mount,
        };
        // Interrupted, `up` leaves nothing; once it has returned, what it started is the
        // user's until `odfs local down`.
        odfs_job::interrupt::stop_started_on_signals()?;
        let st = local::up(&opts)?;
        odfs_job::interrupt::disarm();
        for m in &st.mounts {
            println!("mounted at {}", m.display());
        }
        println!(
            "odfs job {} ready: {} nodes, {} processes; client config {}",
            st.job_id,
            st.nodes,
            st.procs.len(),
            local::client_config_path(&self.root.canonicalize()?).display()
        );
        Ok(())
    }
}

/// `odfs local down`: its last line says what is left under ROOT.
fn local_down(root: &Path, wipe: bool) -> Result<()> {
    use odfs_proto::units::bytes;
    if wipe && !root.exists() {
        println!("odfs local down: {} does not exist: nothing left", root.display());
        return Ok(());
    }
    let r = local::down(root)?;
    for step in &r.unmount_steps {
        println!("odfs local down: {step}");
    }
    if r.killed.is_empty() {
        println!("odfs local down: stopped {} processes", r.stopped);
    } else {
        println!("odfs local down: stopped {} processes; killed {:?} after they ignored SIGTERM", r.stopped, r.killed);
    }
    if !wipe {
        println!(
            "odfs local down: left {} under {} (data, logs, configs); `odfs local down --root {} --wipe` removes it",
            bytes(local::disk_usage(root)),
            root.display(),
            root.display()
        );
        return Ok(());
    }
    let w = local::wipe(root)?;
    if w.kept.is_empty() {
        println!("odfs local down: wiped {} ({}): nothing left", root.display(), bytes(w.bytes));
    } else {
        println!(
            "odfs local down: wiped what odfs made under {} ({}); left only what it did not make: {}",
            root.display(),
            bytes(w.bytes),
            w.kept.join(", ")
        );
    }
    Ok(())
}

// ---- a job on real nodes (the Slurm hooks) ----

/// The job a node-local command serves; unset flags come from Slurm's prolog/epilog environment.
#[derive(Args)]
struct NodeArgs {
    /// Job id [default: SLURM_JOB_ID].
    #[arg(long)]
    job_id: Option<String>,
    /// Nodes of the job, comma separated or a Slurm host list (n[1-4]) [default: SLURM_NODELIST].
    #[arg(long, conflicts_with = "nodefile")]
    nodes: Option<String>,
    /// File with one node name per line.
    #[arg(long)]
    nodefile: Option<PathBuf>,
    /// This node's index in the node list [default: the position of SLURMD_NODENAME or the hostname].
    #[arg(long)]
    node_index: Option<u32>,
    /// The job's user [default: SLURM_JOB_UID, else the caller].
    #[arg(long)]
    user: Option<String>,
    /// Features of the job, comma separated (e.g. odfs_ram) [default: from SLURM_JOB_CONSTRAINTS].
    #[arg(long)]
    features: Option<String>,
    /// A batch script (or any file) whose #ODFS lines apply [default in Slurm: the job's script].
    #[arg(long)]
    script: Option<PathBuf>,
    /// Metadata services on the first N nodes; 0 = every node [default: the site's meta, or
    /// every node for a job with the odfs_meta feature].
    #[arg(long)]
    meta: Option<u32>,
    /// Site config [default: /etc/odfs/site.toml].
    #[arg(long, env = "ODFS_SITE_CONFIG")]
    site_config: Option<PathBuf>,
}

impl NodeArgs {
    fn resolve(self) -> Result<(odfs_job::JobSpec, odfs_job::NodeContext)> {
        let (site, site_path) = odfs_job::SiteConfig::load(self.site_config.as_deref())?;
        let spec = odfs_job::spec::resolve(&odfs_job::SpecArgs {
            job_id: self.job_id,
            nodes: self.nodes,
            nodefile: self.nodefile,
            node_index: self.node_index,
            user: self.user,
            features: self.features,
        })?;
        Ok((spec, odfs_job::NodeContext { site, site_path, script: self.script, meta: self.meta }))
    }

    fn start(self) -> Result<()> {
        let (spec, ctx) = self.resolve()?;
        let job = &spec.job_id;
        match odfs_job::start(&spec, &ctx)? {
            odfs_job::StartOutcome::NotAsked => {}
            odfs_job::StartOutcome::Ready { secs, stage_secs, mount } => println!(
                "odfs: job {job} ready on {} in {secs:.2} s (stage-in {stage_secs:.1} s), mounted at {}",
                spec.where_(),
                mount.display()
            ),
            odfs_job::StartOutcome::Aborted { reason } => {
                println!("odfs: job {job}: rolled back on {}: {reason}", spec.node_name())
            }
            odfs_job::StartOutcome::Cancelled => println!("odfs: job {job}: cancelled during stage-in"),
        }
        Ok(())
    }

    fn stop(self) -> Result<()> {
        let (spec, ctx) = self.resolve()?;
        if let odfs_job::StopOutcome::Wiped { secs, stage_secs } = odfs_job::stop(&spec, &ctx)? {
            println!(
                "odfs: job {} stopped on {} in {secs:.2} s (stage-out {stage_secs:.1} s); data wiped",
                spec.job_id,
                spec.where_()
            );
        }
        Ok(())
    }
}

/// The site config a node-local command reads.
#[derive(Args)]
struct SiteArg {
    #[arg(long, env = "ODFS_SITE_CONFIG")]
    site_config: Option<PathBuf>,
}

impl SiteArg {
    fn load(&self) -> Result<(odfs_job::SiteConfig, PathBuf)> {
        odfs_job::SiteConfig::load(self.site_config.as_deref())
    }

    fn task_env(self) -> Result<()> {
        let (site, _) = self.load()?;
        let var = |k: &str| std::env::var(k).unwrap_or_default();
        for l in odfs_job::task_env(&site, &var("SLURM_JOB_ID"), &var("SLURM_JOB_USER"), &node_name(None)) {
            println!("{l}");
        }
        Ok(())
    }
}

#[derive(Args)]
struct RecoverArgs {
    #[arg(long)]
    job: String,
    /// This node's name as the job knew it [default: SLURMD_NODENAME or the hostname].
    #[arg(long)]
    node: Option<String>,
    #[command(flatten)]
    site: SiteArg,
}

impl RecoverArgs {
    fn run(self) -> Result<()> {
        let (site, site_path) = self.site.load()?;
        let ctx = odfs_job::NodeContext { site, site_path, script: None, meta: None };
        odfs_job::recover(&self.job, &node_name(self.node), &ctx)?;
        println!("odfs: job {} recovered on this node: outputs verified, data wiped", self.job);
        Ok(())
    }
}

#[derive(Args)]
struct CleanupArgs {
    /// Only this job (its processes are stopped even if alive).
    #[arg(long)]
    job: Option<String>,
    /// With --job: also drop data kept for `odfs recover`.
    #[arg(long, requires = "job")]
    discard: bool,
    #[arg(long)]
    node: Option<String>,
    #[command(flatten)]
    site: SiteArg,
}

impl CleanupArgs {
    fn run(self) -> Result<()> {
        let (site, _) = self.site.load()?;
        let node = node_name(self.node);
        let state = odfs_job::record::StateDir::new(&site.ondemand.state_dir, &node);
        for l in odfs_job::cleanup::cleanup(&state, &node, self.job.as_deref(), self.discard)? {
            println!("odfs cleanup: {l}");
        }
        Ok(())
    }
}

#[derive(Args)]
struct SiteConfigArgs {
    /// Print every default instead of checking a file.
    #[arg(long)]
    defaults: bool,
    /// The node to check for (`%n` in paths); default this node.
    #[arg(long)]
    node: Option<String>,
    /// Do not connect to the S3 endpoint (it is still resolved).
    #[arg(long)]
    offline: bool,
    #[command(flatten)]
    site: SiteArg,
}

impl SiteConfigArgs {
    /// Prints the config with every default filled in, after checking that it can work on this
    /// node: a problem fails the command, listed one per line.
    fn run(self) -> Result<()> {
        if self.defaults {
            print!("{}", toml::to_string_pretty(&odfs_job::SiteConfig::default())?);
            return Ok(());
        }
        let (cfg, path) = self.site.load()?;
        let node = node_name(self.node);
        let problems = odfs_job::site_check::check_node(&cfg, &node, !self.offline);
        if !problems.is_empty() {
            bail!("{}: {} problem(s) on node {node}:\n  {}", path.display(), problems.len(), problems.join("\n  "));
        }
        println!(
            "# {} (checked on node {node}: syntax, site key, directories, stage files and endpoint)",
            path.display()
        );
        print!("{}", toml::to_string_pretty(&cfg)?);
        Ok(())
    }
}

#[derive(Args)]
struct CheckScriptArgs {
    /// Batch scripts to check; `-` is standard input.
    #[arg(required = true)]
    scripts: Vec<PathBuf>,
    /// The name to report a script under instead of its path (e.g. "batch script").
    #[arg(long)]
    name: Option<String>,
}

impl CheckScriptArgs {
    /// Parses each script's `#ODFS` lines as the prolog will; prints one line per script.
    fn run(self) -> Result<()> {
        let user = std::env::var("USER").unwrap_or_else(|_| "user".into());
        let mut bad = 0;
        for p in &self.scripts {
            let name = self.name.clone().unwrap_or_else(|| p.display().to_string());
            let text = if p.as_os_str() == "-" {
                std::io::read_to_string(std::io::stdin()).context("cannot read standard input")?
            } else {
                std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()))?
            };
            // A job id and the user stand in for %j and %u: only their syntax is checked here.
            match odfs_job::directives::parse_all(&text, "0", &user) {
                Ok(d) => println!("{name}: ok ({})", d.summary()),
                Err(errors) => {
                    for e in errors {
                        eprintln!("{name}: {e}");
                    }
                    bad += 1;
                }
            }
        }
        if bad > 0 {
            bail!("{bad} script(s) with invalid #ODFS lines: the job would be refused when it starts");
        }
        Ok(())
    }
}

/// This node's name: the flag, else SLURMD_NODENAME, else the short hostname.
fn node_name(flag: Option<String>) -> String {
    flag.or_else(|| std::env::var("SLURMD_NODENAME").ok().filter(|v| !v.is_empty())).unwrap_or_else(|| {
        let h = odfs_service::hostname();
        h.split('.').next().unwrap_or(&h).to_string()
    })
}
