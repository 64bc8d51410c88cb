//! Scaffolding shared by the odfs daemons (mgmtd, metad, stored).
//!
//! Owns: the `[job]` config section and credential loading, config file loading with clear
//! errors, logging set-up, the shutdown signal, the address file a launcher waits for, and the
//! registration + heartbeat link to mgmtd. It holds no filesystem logic.

pub mod config;
pub mod daemon;
pub mod mgmt_link;
pub mod runtime;

pub use config::{load_config, JobSection};
pub use daemon::daemon_main;
pub use mgmt_link::MgmtLink;
pub use runtime::{hostname, init_logging, shutdown_channel, until_shutdown, write_addr_file};
