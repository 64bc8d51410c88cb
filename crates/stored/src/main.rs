//! `odfs-stored`: thin binary over the stored library.

use clap::Parser;
use std::path::PathBuf;

#[derive(Parser)]
#[command(name = "odfs-stored", about = "odfs storage daemon", version)]
struct Args {
    /// TOML config file (defaults apply to anything it leaves out).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Print the default config and exit.
    #[arg(long)]
    print_default_config: bool,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.print_default_config {
        print!("{}", toml::to_string_pretty(&odfs_stored::config::StoredConfig::default())?);
        return Ok(());
    }
    let cfg: odfs_stored::config::StoredConfig = odfs_service::load_config(args.config.as_deref())?;
    odfs_service::init_logging("info");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async {
        let (_tx, rx) = odfs_service::shutdown_channel();
        odfs_stored::service::run(cfg, rx).await
    })
}
