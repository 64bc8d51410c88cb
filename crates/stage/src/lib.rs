//! odfs staging: moving a job's dataset between the shared store (S3, or the site's global
//! PFS) and the job's odfs, spread over every node.
//!
//! - `agent`: the per-node stage agent (binary `odfs-agent`), which moves its share through the
//!   client library straight to the storage targets.
//! - `coordinator`: `odfs stage-in` / `odfs stage-out`: lists, plans, verifies, writes
//!   manifests.
//! - `s3`, `posix`: the two kinds of shared store; `keys`: safe relative paths; `location`:
//!   parsing `s3://`, `odfs:` and POSIX arguments; `limit`: request and bandwidth limits;
//!   `manifest`, `digest`.
//! - `drain`: continuous drain, files uploaded to S3 as they settle while the job runs (a task
//!   of node 0's agent).
//! - `error`: why a stage could not run or finish.
//! - `request`: a stage as a caller asks for it (flags or directives, site defaults), run and
//!   checked; the API of `odfs stage-in/out` and of a job's start and stop.

pub mod agent;
pub mod config;
pub mod coordinator;
pub mod digest;
pub mod drain;
pub mod error;
pub mod keys;
pub mod limit;
pub mod location;
pub mod manifest;
pub mod posix;
pub mod request;
pub mod s3;

pub use config::{AgentConfig, SiteStage};
pub use coordinator::{stage_in, stage_out, StageOptions, StageReport};
pub use error::StageError;
pub use location::Location;
pub use request::{Direction, StageRequest};
