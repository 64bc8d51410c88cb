//! The `odfs` command-line tool: what the binary's commands do beyond the job life cycle
//! (`odfs_job`) and staging (`odfs_stage`), which it calls through their APIs.
//!
//! Owns: `status`, `stats`, parallel copy in and out (`copy`), the lfs-style layout commands (`lfs`:
//! setstripe, getstripe, df, mkdir, pool), `find`, the stage commands' printing (`stage`),
//! the demo, and naming a filesystem or a path in it (`fsref`); `odfs bench` is `odfs_bench`'s. It talks
//! to the filesystem only through the client library and starts daemons only through
//! `odfs_job::local`.

pub mod copy;
pub mod demo;
pub mod find;
pub mod fsref;
pub mod lfs;
pub mod stage;
pub mod stats;
pub mod status;
