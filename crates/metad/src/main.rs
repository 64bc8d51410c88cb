//! `odfs-metad`: thin binary over the metad library.

use clap::Parser;
use std::path::PathBuf;

#[derive(Parser)]
#[command(name = "odfs-metad", about = "odfs metadata daemon", version)]
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
        print!("{}", toml::to_string_pretty(&odfs_metad::config::MetadConfig::default())?);
        return Ok(());
    }
    let cfg: odfs_metad::config::MetadConfig = odfs_service::load_config(args.config.as_deref())?;
    odfs_service::init_logging("info");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async {
        let (_tx, rx) = odfs_service::shutdown_channel();
        odfs_metad::service::run(cfg, rx).await
    })
}
