//! The `odfs` command-line tool.
//!
//! Owns: user-facing commands — running a whole filesystem on one machine (`local`), status,
//! parallel copy in and out, stage-in and stage-out, benchmarks, the demo, site keys. It drives daemons as separate
//! processes and talks to the filesystem only through the client library.

pub mod bench;
pub mod copy;
pub mod demo;
pub mod find;
pub mod fsref;
pub mod job;
pub mod lfs;
pub mod local;
pub mod lock;
pub mod mount;
pub mod procs;
pub mod stage;
pub mod status;
