//! `odfs`: thin binary over the ondemand library.

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use odfs_ondemand::{bench, copy, demo, fsref, job, lfs, local, stage, status};
use odfs_rpc::{SiteKey, Transport};
use std::path::PathBuf;
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
    Cp {
        #[arg(short = 'r', long)]
        recursive: bool,
        /// Files copied at once.
        #[arg(long, default_value_t = 16)]
        parallel: usize,
        src: String,
        dst: String,
    },
    /// Copy a dataset into odfs from S3 or a POSIX directory, every node moving its share, verified.
    StageIn(stage::StageArgs),
    /// Copy outputs from odfs to S3 or a POSIX directory, every node moving its share, verified;
    /// a completion marker is written last. Nothing is ever deleted.
    StageOut(stage::StageArgs),
    /// Create a site key (root-only file from which every job's credential is derived).
    Keygen {
        #[arg(long, default_value = "/etc/odfs/site.key")]
        out: PathBuf,
    },
    /// The main job on one machine: local filesystem mounted through FUSE, a dataset copied into
    /// the mount and back out, a short benchmark through the mount (needs fio).
    Demo {
        #[arg(long, default_value = "odfs-demo")]
        root: PathBuf,
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
    },
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
    Recover {
        #[arg(long)]
        job: String,
        /// This node's name as the job knew it [default: SLURMD_NODENAME or the hostname].
        #[arg(long)]
        node: Option<String>,
        #[arg(long, env = "ODFS_SITE_CONFIG")]
        site_config: Option<PathBuf>,
    },
    /// Remove what jobs that no longer run left on this node (processes, mounts, data).
    Cleanup {
        /// Only this job (its processes are stopped even if alive).
        #[arg(long)]
        job: Option<String>,
        /// With --job: also drop data kept for `odfs recover`.
        #[arg(long, requires = "job")]
        discard: bool,
        #[arg(long)]
        node: Option<String>,
        #[arg(long, env = "ODFS_SITE_CONFIG")]
        site_config: Option<PathBuf>,
    },
    /// Set the layout of a directory (the default for new files and subdirectories) or of a new
    /// or empty file, like lfs setstripe. PATH is in a mount, or odfs:/PATH with --fs.
    Setstripe {
        /// Stripe count (-1 = every target of the pool).
        #[arg(short = 'c', long = "stripe-count", allow_hyphen_values = true)]
        count: Option<i32>,
        /// Stripe (chunk) size: a power of two from 64K to 1G (K/M/G suffix).
        #[arg(short = 'S', long = "stripe-size", value_parser = stage::parse_size)]
        size: Option<u64>,
        /// Pool.
        #[arg(short = 'p', long)]
        pool: Option<String>,
        /// First target (-1 = any).
        #[arg(short = 'i', long = "stripe-index", allow_hyphen_values = true)]
        index: Option<i64>,
        path: String,
    },
    /// Show layouts like lfs getstripe: a file's stripes and targets, a directory's default
    /// and its files'.
    Getstripe {
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
    },
    /// Space or inodes per target, per pool and in all, like lfs df.
    #[command(disable_help_flag = true)]
    Df {
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
    },
    /// Make a directory; with -c N its entries are spread over N metadata shards (-1 = all),
    /// like lfs mkdir -c. PATH is in a mount, or odfs:/PATH with --fs.
    Mkdir {
        /// Metadata shards to spread the entries over (-1 = every shard).
        #[arg(short = 'c', long = "mdt-count", allow_hyphen_values = true)]
        count: Option<i32>,
        /// Make missing parents too.
        #[arg(short = 'p', long)]
        parents: bool,
        path: String,
    },
    /// Find files like find(1), in parallel: odfs find PATH [-name GLOB] [-type f|d|l]
    /// [-size [+-]N[ckMG]] [-newer FILE] [--stripe-count N] [--pool P].
    Find {
        path: String,
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        tests: Vec<String>,
    },
    /// Storage pools: list them; create, fill, empty or destroy one (with --fs).
    #[command(subcommand)]
    Pool(PoolCmd),
    /// Check the site config and print it with every default filled in (`--defaults`: the
    /// defaults alone).
    SiteConfig {
        #[arg(long)]
        defaults: bool,
        #[arg(long, env = "ODFS_SITE_CONFIG")]
        site_config: Option<PathBuf>,
    },
    /// Print `export` lines for the job's tasks (Slurm TaskProlog): ODFS_MOUNT, ODFS_JOB.
    TaskEnv {
        #[arg(long, env = "ODFS_SITE_CONFIG")]
        site_config: Option<PathBuf>,
    },
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

/// A command's place when it names none: the job's mount, else the library's root.
fn default_place(path: Option<String>) -> String {
    path.or_else(|| std::env::var("ODFS_MOUNT").ok().filter(|v| !v.is_empty())).unwrap_or_else(|| "odfs:/".into())
}

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
    fn resolve(&self) -> Result<(job::JobSpec, job::NodeContext)> {
        let (site, site_path) = job::SiteConfig::load(self.site_config.as_deref())?;
        let spec = job::spec::resolve(&job::SpecArgs {
            job_id: self.job_id.clone(),
            nodes: self.nodes.clone(),
            nodefile: self.nodefile.clone(),
            node_index: self.node_index,
            user: self.user.clone(),
            features: self.features.clone(),
        })?;
        Ok((spec, job::NodeContext { site, site_path, script: self.script.clone(), meta: self.meta }))
    }
}

/// This node's name: the flag, else SLURMD_NODENAME, else the short hostname.
fn node_name(flag: Option<String>) -> String {
    flag.or_else(|| std::env::var("SLURMD_NODENAME").ok().filter(|v| !v.is_empty())).unwrap_or_else(|| {
        let h = odfs_service::hostname();
        h.split('.').next().unwrap_or(&h).to_string()
    })
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
    #[arg(long, default_value = "odfs-bench")]
    root: PathBuf,
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
    #[arg(long)]
    skip_plain: bool,
    #[arg(long)]
    keep: bool,
}

impl BenchArgs {
    fn run(self) -> Result<()> {
        let small = matches!(self.scale, Scale::Small);
        if self.startup {
            let o = bench::startup::StartupBenchOptions {
                root: self.root,
                nodes: self.nodes,
                rounds: self.rounds,
                keep: self.keep,
            };
            let rounds = bench::startup::run(&o)?;
            print!("{}", bench::startup::render(o.nodes, &rounds));
            return Ok(());
        }
        if self.shards {
            let d = bench::shards::ShardBenchOptions::default();
            let o = bench::shards::ShardBenchOptions {
                root: self.root,
                nodes: self.nodes,
                clients: self.clients.unwrap_or(d.clients),
                files: self.files.unwrap_or(if small { 20_000 } else { d.files }),
                keep: self.keep,
            };
            print!("{}", bench::shards::render(&bench::shards::run(&o)?));
            return Ok(());
        }
        if self.stage {
            let d = if small { bench::stage::StageBenchOptions::small() } else { Default::default() };
            let o = bench::stage::StageBenchOptions { root: self.root, nodes: self.nodes, keep: self.keep, ..d };
            let rows = bench::stage::run(&o)?;
            print!("{}", bench::stage::render(&rows));
            return Ok(());
        }
        let (table, dropped) = if self.mount {
            let d = if small { bench::mount::MountBenchOptions::small() } else { Default::default() };
            let o = bench::mount::MountBenchOptions {
                root: self.root,
                nodes: self.nodes,
                transport: self.transport,
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
            let (phases, dropped) = bench::mount::run(&o)?;
            (bench::mount::render(&phases), dropped)
        } else {
            let d = if small { bench::BenchOptions::small() } else { Default::default() };
            let o = bench::BenchOptions {
                root: self.root,
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
            let (phases, dropped) = bench::run(&o)?;
            (bench::render(&phases), dropped)
        };
        print!("{table}");
        if !dropped {
            println!("(page cache could not be dropped: run as root for cold reads)");
        }
        Ok(())
    }
}

#[derive(Subcommand)]
enum LocalCmd {
    /// Start mgmtd, metad and N stored as separate processes on loopback.
    Up {
        #[arg(long)]
        root: PathBuf,
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
        /// Default stripe count (-1 = every target).
        #[arg(long, default_value_t = 4, allow_hyphen_values = true)]
        stripe_count: i32,
        /// Default chunk size in bytes (power of two, >= 65536).
        #[arg(long, default_value_t = 1 << 20)]
        chunk_size: u32,
        #[arg(long, default_value = "default")]
        pool: String,
        /// Transport for chunk data: tcp or quic.
        #[arg(long, default_value = "tcp")]
        bulk: Transport,
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
    },
    /// Stop everything `up` started on ROOT.
    Down {
        #[arg(long)]
        root: PathBuf,
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

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?)
}

fn main() {
    if let Err(e) = real_main() {
        let e = format!("{e:#}");
        eprintln!("{}", if e.starts_with("odfs: ") { e } else { format!("odfs: {e}") });
        std::process::exit(1);
    }
}

fn real_main() -> Result<()> {
    let cli = Cli::parse();
    odfs_service::init_logging("warn");
    match cli.cmd {
        Cmd::Local(LocalCmd::Up {
            root,
            nodes,
            no_mount,
            mount,
            targets_per_node,
            stripe_count,
            chunk_size,
            pool,
            bulk,
            job_id,
            site_key,
            timeout,
            io_backend,
            bind,
            ram_pool,
            meta,
        }) => {
            let opts = local::UpOptions {
                root: root.clone(),
                nodes,
                targets_per_node,
                pool,
                chunk_size,
                stripe_count,
                bulk,
                job_id,
                site_key,
                timeout: Duration::from_secs(timeout),
                io_backend,
                bind,
                ram_pool,
                meta,
                mount: if no_mount { None } else { Some(mount.unwrap_or_else(|| root.join("mnt"))) },
            };
            let st = local::up(&opts)?;
            for m in &st.mounts {
                println!("mounted at {}", m.display());
            }
            println!(
                "odfs job {} ready: {} nodes, {} processes; client config {}",
                st.job_id,
                st.nodes,
                st.procs.len(),
                local::client_config_path(&root.canonicalize()?).display()
            );
        }
        Cmd::Local(LocalCmd::Down { root }) => {
            let r = local::down(&root)?;
            for step in &r.unmount_steps {
                println!("odfs local down: {step}");
            }
            if r.killed.is_empty() {
                println!("odfs local down: stopped {} processes", r.stopped);
            } else {
                println!(
                    "odfs local down: stopped {} processes; killed {:?} after they ignored SIGTERM",
                    r.stopped, r.killed
                );
            }
        }
        Cmd::Local(LocalCmd::Restart { root, service, node }) => {
            let pid = local::restart(&root, &service, node)?;
            println!("restarted {service} on node {node} (pid {pid})");
        }
        Cmd::StageIn(a) => runtime()?.block_on(stage::run(cli.fs.as_deref(), &a, true))?,
        Cmd::StageOut(a) => runtime()?.block_on(stage::run(cli.fs.as_deref(), &a, false))?,
        Cmd::Status => {
            let rt = runtime()?;
            let view = rt.block_on(async {
                let client = fsref::connect(cli.fs.as_deref()).await?;
                anyhow::Ok(client.cluster().refresh().await?)
            })?;
            print!("{}", status::render(&view)?);
        }
        Cmd::Cp { recursive, parallel, src, dst } => {
            let rt = runtime()?;
            let s = rt.block_on(async {
                let client = fsref::connect(cli.fs.as_deref()).await?;
                copy::copy(
                    &client,
                    &src,
                    &dst,
                    &copy::CopyOptions {
                        recursive,
                        parallel,
                        progress: std::io::IsTerminal::is_terminal(&std::io::stderr()),
                    },
                )
                .await
            })?;
            println!("copied {} files, {} links, {} directories, {} bytes", s.files, s.links, s.dirs, s.bytes);
        }
        Cmd::Keygen { out } => {
            if let Some(d) = out.parent() {
                std::fs::create_dir_all(d).with_context(|| format!("cannot create {}", d.display()))?;
            }
            SiteKey::generate().write_new(&out)?;
            println!("wrote site key {} (mode 0600); copy it to every node of the site", out.display());
        }
        Cmd::Demo { root, nodes, dataset_mib, keep, no_bench } => {
            demo::run(&demo::DemoOptions { root, nodes, dataset_mib, keep, bench: !no_bench })?;
        }
        Cmd::Bench(a) => a.run()?,
        Cmd::Start(a) => {
            let (spec, ctx) = a.resolve()?;
            match job::start(&spec, &ctx)? {
                job::StartOutcome::NotAsked => {}
                job::StartOutcome::Ready { secs, stage_secs, mount } => println!(
                    "odfs: job {} ready on {} in {secs:.2} s (stage-in {stage_secs:.1} s), mounted at {}",
                    spec.job_id,
                    spec.where_(),
                    mount.display()
                ),
                job::StartOutcome::Aborted { reason } => {
                    println!("odfs: job {}: rolled back on {}: {reason}", spec.job_id, spec.node_name())
                }
                job::StartOutcome::Cancelled => println!("odfs: job {}: cancelled during stage-in", spec.job_id),
            }
        }
        Cmd::Stop(a) => {
            let (spec, ctx) = a.resolve()?;
            if let job::StopOutcome::Wiped { secs, stage_secs } = job::stop(&spec, &ctx)? {
                println!(
                    "odfs: job {} stopped on {} in {secs:.2} s (stage-out {stage_secs:.1} s); data wiped",
                    spec.job_id,
                    spec.where_()
                );
            }
        }
        Cmd::Recover { job: id, node, site_config } => {
            let (site, site_path) = job::SiteConfig::load(site_config.as_deref())?;
            let ctx = job::NodeContext { site, site_path, script: None, meta: None };
            job::recover(&id, &node_name(node), &ctx)?;
            println!("odfs: job {id} recovered on this node: outputs verified, data wiped");
        }
        Cmd::Cleanup { job: id, discard, node, site_config } => {
            let (site, _) = job::SiteConfig::load(site_config.as_deref())?;
            let node = node_name(node);
            let state = job::record::StateDir::new(&site.ondemand.state_dir, &node);
            for l in job::cleanup::cleanup(&state, &node, id.as_deref(), discard)? {
                println!("odfs cleanup: {l}");
            }
        }
        Cmd::Setstripe { count, size, pool, index, path } => {
            let rt = runtime()?;
            rt.block_on(async {
                let place = lfs::Place::open(&path, cli.fs.as_deref()).await?;
                lfs::setstripe(&place, &lfs::StripeArgs { count, size, pool, start: index }).await
            })?;
        }
        Cmd::Getstripe { verbose, yaml, count, size, pool, directory, recursive, path } => {
            let rt = runtime()?;
            let a = lfs::GetStripeArgs { verbose, yaml, count, size, pool, dir_only: directory, recursive };
            let out = rt.block_on(async {
                let place = lfs::Place::open(&path, cli.fs.as_deref()).await?;
                lfs::getstripe(&place, &a).await
            })?;
            print!("{out}");
        }
        Cmd::Df { human, inodes, pool, path, help: _ } => {
            let rt = runtime()?;
            let out = rt.block_on(async {
                let place = lfs::Place::open(&default_place(path), cli.fs.as_deref()).await?;
                lfs::df(&place, &lfs::DfArgs { human, inodes, pool }).await
            })?;
            print!("{out}");
        }
        Cmd::Find { path, tests } => {
            let rt = runtime()?;
            rt.block_on(async {
                let t = odfs_ondemand::find::parse_tests(&tests, cli.fs.as_deref()).await?;
                let mut out = std::io::BufWriter::new(std::io::stdout());
                odfs_ondemand::find::find(&path, cli.fs.as_deref(), &t, &mut out).await?;
                std::io::Write::flush(&mut out)?;
                anyhow::Ok(())
            })?;
        }
        Cmd::Mkdir { count, parents, path } => {
            let rt = runtime()?;
            rt.block_on(async {
                let place = lfs::Place::open(&path, cli.fs.as_deref()).await?;
                lfs::mkdir(&place, parents, count).await
            })?;
        }
        Cmd::Pool(cmd) => {
            use odfs_proto::mgmt::PoolChange;
            let rt = runtime()?;
            let (name, change) = match cmd {
                PoolCmd::List { path } => {
                    let out = rt.block_on(async {
                        let place = lfs::Place::open(&default_place(path), cli.fs.as_deref()).await?;
                        lfs::pool_list(&place).await
                    })?;
                    print!("{out}");
                    return Ok(());
                }
                PoolCmd::Create { name } => (name, PoolChange::Create),
                PoolCmd::Add { name, targets } => (name, PoolChange::Add(targets)),
                PoolCmd::Remove { name, targets } => (name, PoolChange::Remove(targets)),
                PoolCmd::Destroy { name } => (name, PoolChange::Destroy),
            };
            rt.block_on(async {
                let client = fsref::connect(cli.fs.as_deref()).await?;
                let r = client.change_pool(&odfs_client::Ctx::current(), &name, change).await;
                client.shutdown();
                r.map_err(lfs::why)
            })?;
        }
        Cmd::SiteConfig { defaults, site_config } => {
            let cfg = if defaults {
                job::SiteConfig::default()
            } else {
                let (cfg, path) = job::SiteConfig::load(site_config.as_deref())?;
                println!("# {} (checked)", path.display());
                cfg
            };
            print!("{}", toml::to_string_pretty(&cfg)?);
        }
        Cmd::TaskEnv { site_config } => {
            let (site, _) = job::SiteConfig::load(site_config.as_deref())?;
            let var = |k: &str| std::env::var(k).unwrap_or_default();
            for l in job::task_env(&site, &var("SLURM_JOB_ID"), &var("SLURM_JOB_USER"), &node_name(None)) {
                println!("{l}");
            }
        }
    }
    Ok(())
}
