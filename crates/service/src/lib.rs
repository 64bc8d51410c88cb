//! What every odfs daemon shares (mgmtd, metad, stored, the stage agent, the FUSE client).
//!
//! Owns: the `[job]` config section and credential loading, config file loading with clear
//! errors, logging set-up, the shutdown signal (`odfs_rpc::Shutdown`, fired on SIGTERM/SIGINT),
//! the address file a launcher waits for, the registration + heartbeat link to mgmtd, and the
//! life cycle of a registered daemon (`lifecycle`: own client pool, servers, registration,
//! teardown order), and how busy the node's CPUs and disks are (`load`, for background work
//! that must stay out of the job's way), the reads of local files that never stall a runtime
//! (`fileio`, stored's and the client's) and which pages of them a sequential reader has left
//! behind (`drop_behind`). It holds no filesystem logic.

pub mod config;
pub mod daemon;
pub mod drop_behind;
pub mod fileio;
pub mod lifecycle;
pub mod load;
pub mod mgmt_link;
pub mod runtime;

pub use config::{load_config, JobSection};
pub use daemon::{daemon_main, DaemonConfig, DEFAULT_WORKER_THREADS};
pub use lifecycle::{announce, Daemon};
pub use mgmt_link::MgmtLink;
pub use odfs_rpc::Shutdown;
pub use runtime::{hostname, init_logging, shutdown_channel, until_shutdown, write_addr_file};
