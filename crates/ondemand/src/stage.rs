//! `odfs stage-in SRC DST` and `odfs stage-out SRC DST`: a stage request from the command line,
//! run as the caller over the filesystem's client, its report printed; the exit status says
//! whether every file was copied and verified. The work is `odfs_stage`'s.

use crate::fsref;
use anyhow::Result;
use odfs_client::Ctx;
use odfs_stage::{request, Direction, StageRequest};

/// Runs a stage; prints the report; fails (non-zero exit) when any file failed or any source
/// name was refused.
pub async fn run(fs: Option<&std::path::Path>, r: &StageRequest, way: Direction) -> Result<()> {
    let client = fsref::connect(fs).await?;
    let report = request::run(&client, &Ctx::current(), r, way).await;
    client.shutdown();
    let report = report?;
    println!("{}", report.summary());
    Ok(request::check(&report)?)
}
