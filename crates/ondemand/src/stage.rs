//! `odfs stage-in SRC DST` and `odfs stage-out SRC DST`: the command-line side of staging
//! (arguments, sizes, the exit status); the work is `odfs_stage`'s coordinator and agents.

use crate::fsref;
use anyhow::{bail, Result};
use clap::Args;
use odfs_client::Ctx;
use odfs_stage::{Location, StageOptions};

#[derive(Args, Debug, Clone)]
pub struct StageArgs {
    /// Source: s3://BUCKET/PREFIX, a POSIX directory, or (stage-out) odfs:/PATH or a path in the mount.
    pub src: String,
    /// Destination: odfs:/PATH or a path in the mount (stage-in), s3://BUCKET/PREFIX or a POSIX directory (stage-out).
    pub dst: String,
    /// S3 endpoint (MinIO, Ceph RGW, ...); default: AWS (or AWS_ENDPOINT_URL).
    #[arg(long, env = "AWS_ENDPOINT_URL")]
    pub endpoint_url: Option<String>,
    /// S3 region; default: AWS_REGION, the profile's region, else us-east-1.
    #[arg(long)]
    pub region: Option<String>,
    /// Path-style S3 addressing (http://host/bucket/key), as most S3-compatible stores need.
    #[arg(long)]
    pub path_style: bool,
    /// Transfers in flight per node.
    #[arg(long, default_value_t = StageOptions::default().concurrency)]
    pub concurrency: u32,
    /// Job-wide limit on requests per second to S3 or the PFS (0 = none).
    #[arg(long, default_value_t = 0.0)]
    pub max_requests_per_sec: f64,
    /// Job-wide limit on bandwidth to or from S3 or the PFS, bytes per second with an optional
    /// K/M/G suffix (powers of 1024); 0 = none.
    #[arg(long, default_value = "0", value_parser = parse_size)]
    pub max_bandwidth: u64,
    /// Attempts per S3 request (exponential backoff with jitter between them).
    #[arg(long, default_value_t = StageOptions::default().max_attempts)]
    pub max_attempts: u32,
    /// Files at least this large are split over every node (K/M/G suffix).
    #[arg(long, default_value = "64M", value_parser = parse_size)]
    pub split_threshold: u64,
    /// Range (stage-in) or multipart part (stage-out) size of split files (K/M/G suffix, >= 5M for S3).
    #[arg(long, default_value = "16M", value_parser = parse_size)]
    pub part_size: u64,
}

/// "100", "64K", "16M", "2G" → bytes (powers of 1024).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, mult) = match t.chars().last() {
        Some('k' | 'K') => (&t[..t.len() - 1], 1u64 << 10),
        Some('m' | 'M') => (&t[..t.len() - 1], 1 << 20),
        Some('g' | 'G') => (&t[..t.len() - 1], 1 << 30),
        Some('t' | 'T') => (&t[..t.len() - 1], 1 << 40),
        _ => (t, 1),
    };
    let n: u64 = num.parse().map_err(|_| format!("{s:?} is not a size (e.g. 512K, 16M, 1G)"))?;
    n.checked_mul(mult).ok_or_else(|| format!("{s:?} is too large"))
}

impl StageArgs {
    fn options(&self) -> Result<StageOptions> {
        if self.part_size < 5 << 20 && (self.src.starts_with("s3://") || self.dst.starts_with("s3://")) {
            bail!("--part-size must be at least 5M for S3 (its smallest multipart part)");
        }
        if self.part_size == 0 || self.concurrency == 0 || self.max_attempts == 0 {
            bail!("--part-size, --concurrency and --max-attempts must be positive");
        }
        Ok(StageOptions {
            endpoint_url: self.endpoint_url.clone(),
            region: self.region.clone(),
            path_style: self.path_style,
            concurrency: self.concurrency,
            max_requests_per_sec: self.max_requests_per_sec,
            max_bandwidth: self.max_bandwidth,
            max_attempts: self.max_attempts,
            split_threshold: self.split_threshold.max(self.part_size),
            part_size: self.part_size,
            ..StageOptions::default()
        })
    }
}

/// Runs a stage; `inward` for stage-in. Prints the report; fails (non-zero exit) when any file
/// failed or any source name was refused.
pub async fn run(fs: Option<&std::path::Path>, a: &StageArgs, inward: bool) -> Result<()> {
    let opts = a.options()?;
    let mounts = odfs_stage::location::odfs_mounts();
    let src = odfs_stage::location::parse(&a.src, &mounts)?;
    let dst = odfs_stage::location::parse(&a.dst, &mounts)?;
    let client = fsref::connect(fs).await?;
    let ctx = Ctx::current();
    let report = match (inward, &src, &dst) {
        (true, Location::S3 { .. } | Location::Posix(_), Location::Odfs(d)) => {
            odfs_stage::stage_in(&client, &ctx, &src, d, &opts).await?
        }
        (true, _, _) => {
            bail!("stage-in copies from s3://... or a POSIX directory into odfs:/PATH (or a path in the mount)")
        }
        (false, Location::Odfs(s), Location::S3 { .. } | Location::Posix(_)) => {
            odfs_stage::stage_out(&client, &ctx, s, &dst, &opts).await?
        }
        (false, _, _) => {
            bail!("stage-out copies from odfs:/PATH (or a path in the mount) to s3://... or a POSIX directory")
        }
    };
    println!("{}", report.summary());
    client.shutdown();
    if !report.failed.is_empty() || !report.refused.is_empty() {
        bail!(
            "{} incomplete: {} files failed, {} source names refused (listed above); nothing was deleted",
            report.kind,
            report.failed.len(),
            report.refused.len()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("0"), Ok(0));
        assert_eq!(parse_size("64K"), Ok(65536));
        assert_eq!(parse_size("16M"), Ok(16 << 20));
        assert_eq!(parse_size("2g"), Ok(2 << 30));
        assert!(parse_size("ten").unwrap_err().contains("not a size"));
        assert!(parse_size("99999999999T").unwrap_err().contains("too large"));
    }
}
