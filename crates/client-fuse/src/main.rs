//! `odfs-fuse`: mounts an odfs filesystem with FUSE and serves it until it is unmounted or the
//! process gets SIGTERM. Thin binary over `odfs_client_fuse::run`.

use clap::Parser;
use odfs_client_fuse::{run, MountArgs};
use std::path::PathBuf;

#[derive(Parser)]
#[command(name = "odfs-fuse", about = "Mount an odfs filesystem with FUSE", version)]
struct Cli {
    /// Client config of the filesystem (written by `odfs local up` as ROOT/odfs.toml).
    #[arg(long, env = "ODFS_FS", value_name = "FS_TOML")]
    fs: PathBuf,
    /// Existing directory to mount on.
    #[arg(long, value_name = "PATH")]
    mountpoint: PathBuf,
    /// Let users other than the mounting one use the mount (needs `user_allow_other` in
    /// /etc/fuse.conf unless run as root).
    #[arg(long)]
    allow_other: bool,
    /// Accepted and ignored: odfs-fuse always stays in the foreground (its launcher runs it in
    /// the background and keeps its log).
    #[arg(long)]
    foreground: bool,
    /// Keep this mount's client id in FILE while its metadata sessions last (removed after its
    /// goodbye at unmount), so that a teardown can end them for it if it dies first.
    #[arg(long, value_name = "FILE")]
    session_file: Option<PathBuf>,
}

fn main() {
    odfs_service::init_logging("info");
    let cli = Cli::parse();
    let _ = cli.foreground;
    let args = MountArgs {
        fs: cli.fs,
        mountpoint: cli.mountpoint,
        allow_other: cli.allow_other,
        session_file: cli.session_file,
    };
    if let Err(e) = run(&args) {
        eprintln!("odfs-fuse: {e}");
        std::process::exit(1);
    }
}
