//! A stage as a caller asks for it: source and destination as written on a command line or in
//! an `#ODFS` directive, and the settings, each from the request, else the site config's
//! `[stage]` table, else the defaults. `run` checks the pair of places and runs the stage;
//! `check` turns an incomplete report into an error. Used by `odfs stage-in/out` and by a
//! job's start and stop alike.

use crate::coordinator::{stage_in, stage_out, StageOptions, StageReport};
use crate::error::{invalid, Result, StageError};
use crate::location::{self, Location};
use crate::SiteStage;
use clap::Args;
use odfs_client::{Client, Ctx};
use odfs_proto::units::parse_size;

/// Which way a stage moves data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// From S3 or a POSIX tree into odfs.
    In,
    /// From odfs to S3 or a POSIX tree.
    Out,
}

/// Where the shared store is, and the site config whose `[stage]` table fills in what is not
/// given: the same for stages and drains.
#[derive(Args, Debug, Clone, Default)]
pub struct StoreArgs {
    /// S3 endpoint (MinIO, Ceph RGW, ...); default: AWS (or AWS_ENDPOINT_URL).
    #[arg(long, env = "AWS_ENDPOINT_URL")]
    pub endpoint_url: Option<String>,
    /// S3 region; default: AWS_REGION, the profile's region, else us-east-1.
    #[arg(long)]
    pub region: Option<String>,
    /// Path-style S3 addressing (http://host/bucket/key), as most S3-compatible stores need.
    #[arg(long)]
    pub path_style: bool,
    /// Site config whose `[stage]` table gives defaults for the settings above (and an AWS
    /// profile) [default /etc/odfs/site.toml if present].
    #[arg(long, env = "ODFS_SITE_CONFIG")]
    pub site_config: Option<std::path::PathBuf>,
}

#[derive(Args, Debug, Clone, Default)]
pub struct StageRequest {
    /// Source: s3://BUCKET/PREFIX, a POSIX directory, or (stage-out) odfs:/PATH or a path in the mount.
    pub src: String,
    /// Destination: odfs:/PATH or a path in the mount (stage-in), s3://BUCKET/PREFIX or a POSIX directory (stage-out).
    pub dst: String,
    #[command(flatten)]
    pub store: StoreArgs,
    /// Transfers in flight per node [default 16].
    #[arg(long)]
    pub concurrency: Option<u32>,
    /// Job-wide limit on requests per second to S3 or the PFS [default 0 = none].
    #[arg(long)]
    pub max_requests_per_sec: Option<f64>,
    /// Job-wide limit on bandwidth to or from S3 or the PFS, bytes per second with an optional
    /// K/M/G suffix (powers of 1024) [default 0 = none].
    #[arg(long, value_parser = parse_size)]
    pub max_bandwidth: Option<u64>,
    /// Attempts per S3 request, exponential backoff with jitter between them [default 8].
    #[arg(long)]
    pub max_attempts: Option<u32>,
    /// Seconds an S3 endpoint that cannot be reached at all (connection refused, timed out)
    /// is tried again, with the same backoff, before the stage fails: a restart or a short
    /// outage of the store is waited out [default 60].
    #[arg(long)]
    pub unreachable_secs: Option<u32>,
    /// Files at least this large are split over every node, K/M/G suffix [default 64M].
    #[arg(long, value_parser = parse_size)]
    pub split_threshold: Option<u64>,
    /// Range (stage-in) or multipart part (stage-out) size of split files, K/M/G suffix, at
    /// least 5M for S3 [default 16M].
    #[arg(long, value_parser = parse_size)]
    pub part_size: Option<u64>,
    /// Stage-in: once every file is copied and verified, seal the destination tree read-only
    /// (`odfs seal`): every node then caches it for good, and changes get EROFS until
    /// `odfs unseal`. Not the default: a job writing next to its dataset would be refused.
    #[arg(long)]
    pub seal: bool,
    /// Turns true when the stage is to stop (`StageOptions::interrupted`).
    #[arg(skip)]
    pub interrupted: Option<tokio::sync::watch::Receiver<bool>>,
}

impl StageRequest {
    /// The settings of this stage: the request's, else the site config's `[stage]` table, else
    /// defaults. The site's AWS profile and files apply where the environment names none.
    pub fn options(&self) -> Result<StageOptions> {
        let site = SiteStage::load(self.store.site_config.as_deref()).map_err(StageError::Invalid)?;
        let unset = |k: &str| std::env::var_os(k).is_none();
        if let Some(p) = site.profile.as_ref().filter(|_| unset("AWS_PROFILE")) {
            std::env::set_var("AWS_PROFILE", p);
        }
        if let Some(p) = site.credentials_file.as_ref().filter(|_| unset("AWS_SHARED_CREDENTIALS_FILE")) {
            std::env::set_var("AWS_SHARED_CREDENTIALS_FILE", p);
        }
        if let Some(p) = site.config_file.as_ref().filter(|_| unset("AWS_CONFIG_FILE")) {
            std::env::set_var("AWS_CONFIG_FILE", p);
        }
        let d = StageOptions::default();
        let part_size = self.part_size.or(site.part_size).unwrap_or(d.part_size);
        let o = StageOptions {
            endpoint_url: self.store.endpoint_url.clone().or(site.endpoint_url),
            region: self.store.region.clone().or(site.region),
            path_style: self.store.path_style || site.path_style.unwrap_or(false),
            concurrency: self.concurrency.or(site.concurrency).unwrap_or(d.concurrency),
            max_requests_per_sec: self.max_requests_per_sec.or(site.max_requests_per_sec).unwrap_or(0.0),
            max_bandwidth: self.max_bandwidth.or(site.max_bandwidth).unwrap_or(0),
            max_attempts: self.max_attempts.or(site.max_attempts).unwrap_or(d.max_attempts),
            unreachable_secs: self.unreachable_secs.or(site.unreachable_secs).unwrap_or(d.unreachable_secs),
            split_threshold: self.split_threshold.or(site.split_threshold).unwrap_or(d.split_threshold).max(part_size),
            part_size,
            interrupted: self.interrupted.clone(),
            ..d
        };
        if let Some(url) = &o.endpoint_url {
            crate::s3::check_endpoint_url(url).map_err(StageError::Invalid)?;
        }
        if o.part_size < 5 << 20 && (self.src.starts_with("s3://") || self.dst.starts_with("s3://")) {
            return invalid!("--part-size must be at least 5M for S3 (its smallest multipart part)");
        }
        if o.part_size == 0 || o.concurrency == 0 || o.max_attempts == 0 {
            return invalid!("--part-size, --concurrency and --max-attempts must be positive");
        }
        Ok(o)
    }
}

/// Runs a stage as `ctx` over a connected client and returns its report.
pub async fn run(client: &Client, ctx: &Ctx, r: &StageRequest, way: Direction) -> Result<StageReport> {
    let opts = r.options()?;
    let mounts = location::odfs_mounts();
    let src = location::parse(&r.src, &mounts)?;
    let dst = location::parse(&r.dst, &mounts)?;
    Ok(match (way, &src, &dst) {
        (Direction::In, Location::S3 { .. } | Location::Posix(_), Location::Odfs(d)) => {
            let mut report = stage_in(client, ctx, &src, d, &opts).await?;
            if r.seal && check(&report).is_ok() {
                report.sealed = Some(seal(client, ctx, d).await?);
            }
            report
        }
        (Direction::Out, _, _) if r.seal => return invalid!("--seal seals a stage-in's destination"),
        (Direction::In, _, _) => {
            return invalid!(
                "stage-in copies from s3://... or a POSIX directory into odfs:/PATH (or a path in the mount)"
            )
        }
        (Direction::Out, Location::Odfs(s), Location::S3 { .. } | Location::Posix(_)) => {
            stage_out(client, ctx, s, &dst, &opts).await?
        }
        (Direction::Out, _, _) => {
            return invalid!(
                "stage-out copies from odfs:/PATH (or a path in the mount) to s3://... or a POSIX directory"
            )
        }
    })
}

/// Seals a stage-in's destination tree; the inodes sealed.
async fn seal(client: &Client, ctx: &Ctx, dst: &str) -> Result<u64> {
    client.seal_path(ctx, dst, true).await.map_err(|e| StageError::Invalid(format!("cannot seal odfs:{dst}: {e}")))
}

/// An error unless every file was copied and verified and no source name was refused.
pub fn check(report: &StageReport) -> Result<()> {
    if report.failed.is_empty() && report.refused.is_empty() {
        return Ok(());
    }
    let first = report.failed.iter().chain(&report.refused).next().map(|(k, why)| format!("; first: {k:?}: {why}"));
    Err(StageError::Incomplete(format!(
        "{} incomplete: {} files failed, {} source names refused{}; nothing was deleted",
        report.kind,
        report.failed.len(),
        report.refused.len(),
        first.unwrap_or_default()
    )))
}
