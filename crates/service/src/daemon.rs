//! The body every daemon binary shares: `--config FILE` / `--print-default-config`, logging, a
//! runtime of the config's `worker_threads`, and a run function that ends on SIGTERM or SIGINT.

use clap::Parser;
use serde::{de::DeserializeOwned, Serialize};
use std::future::Future;
use std::path::PathBuf;

/// Runtime worker threads of a daemon unless its config says otherwise.
pub const DEFAULT_WORKER_THREADS: usize = 2;

/// What the shared daemon body needs of a daemon's config.
pub trait DaemonConfig: Default + Serialize + DeserializeOwned {
    /// Async runtime worker threads.
    fn worker_threads(&self) -> usize;
}

#[derive(Parser)]
struct DaemonArgs {
    /// TOML config file (defaults apply to anything it leaves out).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Print the default config and exit.
    #[arg(long)]
    print_default_config: bool,
}

/// Runs a daemon: parses the common flags for `name`, loads its config `C` and calls `run`
/// until shutdown. Any error is printed as one line (with its causes) and exits with status 1.
pub fn daemon_main<C, F, Fut, E>(name: &'static str, about: &'static str, run: F)
where
    C: DaemonConfig,
    F: FnOnce(C, odfs_rpc::Shutdown) -> Fut,
    Fut: Future<Output = Result<(), E>>,
    E: std::fmt::Display,
{
    let cmd =
        <DaemonArgs as clap::CommandFactory>::command().name(name).about(about).version(env!("CARGO_PKG_VERSION"));
    let args = match <DaemonArgs as clap::FromArgMatches>::from_arg_matches(&cmd.get_matches()) {
        Ok(a) => a,
        Err(e) => e.exit(),
    };
    let fail = |msg: String| -> ! {
        eprintln!("{name}: {msg}");
        std::process::exit(1)
    };
    if args.print_default_config {
        match toml::to_string_pretty(&C::default()) {
            Ok(t) => print!("{t}"),
            Err(e) => fail(e.to_string()),
        }
        return;
    }
    let cfg: C = crate::load_config(args.config.as_deref()).unwrap_or_else(|e| fail(e.to_string()));
    crate::init_logging("info");
    if cfg.worker_threads() == 0 {
        fail("worker_threads = 0 in the config: a daemon needs at least one runtime thread".into());
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cfg.worker_threads())
        .enable_all()
        .build()
        .unwrap_or_else(|e| fail(format!("cannot start the async runtime: {e}")));
    let result = rt.block_on(async {
        let (_tx, rx) = crate::shutdown_channel();
        run(cfg, rx).await
    });
    if let Err(e) = result {
        tracing::error!(error = %format!("{e:#}"), "exiting");
        fail(format!("{e:#}"));
    }
}
