//! `odfs`: thin binary over the ondemand library.

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use odfs_ondemand::{bench, copy, demo, fsref, local, status};
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
    /// Copy files or trees in and out of odfs (`odfs:/path` names a path inside odfs).
    Cp {
        #[arg(short = 'r', long)]
        recursive: bool,
        /// Files copied at once.
        #[arg(long, default_value_t = 16)]
        parallel: usize,
        src: String,
        dst: String,
    },
    /// Create a site key (root-only file from which every job's credential is derived).
    Keygen {
        #[arg(long, default_value = "/etc/odfs/site.key")]
        out: PathBuf,
    },
    /// The main job on one machine: local filesystem, dataset in and out, short benchmark.
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
        #[arg(long)]
        no_bench: bool,
    },
    /// Benchmark odfs against a plain directory on the same disk.
    Bench(BenchArgs),
}

#[derive(Args)]
struct BenchArgs {
    #[arg(long, default_value = "odfs-bench")]
    root: PathBuf,
    #[arg(long, default_value_t = 4)]
    nodes: u32,
    /// Sequential clients, one file each.
    #[arg(long, default_value_t = 4)]
    clients: usize,
    /// MiB per client file.
    #[arg(long, default_value_t = 1024)]
    file_mib: u64,
    /// Metadata threads.
    #[arg(long, default_value_t = 4)]
    threads: usize,
    #[arg(long, default_value_t = 20_000)]
    files_per_thread: usize,
    /// Transport for chunk data: tcp or quic.
    #[arg(long, default_value = "tcp")]
    transport: Transport,
    #[arg(long)]
    skip_plain: bool,
    #[arg(long)]
    keep: bool,
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
        eprintln!("odfs: {e:#}");
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
            println!("copied {} files, {} directories, {} bytes", s.files, s.dirs, s.bytes);
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
        Cmd::Bench(a) => {
            let o = bench::BenchOptions {
                root: a.root,
                nodes: a.nodes,
                clients: a.clients,
                file_size: a.file_mib << 20,
                threads: a.threads,
                files_per_thread: a.files_per_thread,
                transport: a.transport,
                skip_plain: a.skip_plain,
                keep: a.keep,
                ..bench::BenchOptions::default()
            };
            let (phases, dropped) = bench::run(&o)?;
            print!("{}", bench::render(&phases));
            if !dropped {
                println!("(page cache could not be dropped: run as root for cold reads)");
            }
        }
    }
    Ok(())
}
