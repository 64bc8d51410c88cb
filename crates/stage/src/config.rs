//! Agent configuration; `Default` is the single source of defaults.

use odfs_service::JobSection;
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct AgentConfig {
    pub job: JobSection,
    /// QUIC address to serve on (the coordinator hands work here).
    pub listen: SocketAddr,
    /// mgmtd's address.
    #[serde(deserialize_with = "odfs_service::config::address")]
    pub mgmtd: SocketAddr,
    /// Index of this node in the job's node list.
    pub node: u32,
    /// Transfers in flight at once when the coordinator does not say.
    pub concurrency: u32,
    /// Seconds to keep trying to reach mgmtd at start.
    pub register_timeout_secs: u64,
    /// Async runtime worker threads (default 2; see docs/architecture.md for what was measured).
    pub worker_threads: usize,
    /// Finished runs kept for polling.
    pub keep_runs: usize,
}

impl odfs_service::DaemonConfig for AgentConfig {
    fn worker_threads(&self) -> usize {
        self.worker_threads
    }
}

/// Transfers in flight per agent when neither the stage nor the agent's config says.
pub const DEFAULT_CONCURRENCY: u32 = 16;

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            job: JobSection::default(),
            listen: "0.0.0.0:7704".parse().expect("valid address"),
            mgmtd: "127.0.0.1:7700".parse().expect("valid address"),
            node: 0,
            concurrency: DEFAULT_CONCURRENCY,
            register_timeout_secs: 30,
            worker_threads: odfs_service::DEFAULT_WORKER_THREADS,
            keep_runs: 16,
        }
    }
}

/// The site's staging settings (the `[stage]` table of the site config, e.g.
/// `/etc/odfs/site.toml`): what a stage uses when the command line does not say. Every key is
/// optional; command-line flags win.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(default, deny_unknown_fields)]
pub struct SiteStage {
    /// S3 endpoint (MinIO, Ceph RGW, ...).
    pub endpoint_url: Option<String>,
    pub region: Option<String>,
    /// Path-style addressing.
    pub path_style: Option<bool>,
    /// AWS profile to take credentials from (as AWS_PROFILE).
    pub profile: Option<String>,
    /// AWS shared credentials file (as AWS_SHARED_CREDENTIALS_FILE), e.g. a root-only file
    /// for the stages the Slurm prolog and epilog run.
    pub credentials_file: Option<std::path::PathBuf>,
    /// AWS config file (as AWS_CONFIG_FILE).
    pub config_file: Option<std::path::PathBuf>,
    /// Transfers in flight per node.
    pub concurrency: Option<u32>,
    /// Job-wide limits toward the shared store.
    pub max_requests_per_sec: Option<f64>,
    /// Bytes per second, job-wide.
    pub max_bandwidth: Option<u64>,
    pub max_attempts: Option<u32>,
    /// Seconds an unreachable S3 endpoint is tried again before a stage fails (default 60).
    pub unreachable_secs: Option<u32>,
    pub split_threshold: Option<u64>,
    pub part_size: Option<u64>,
}

/// The site config file as far as staging reads it: other tables belong to other commands.
#[derive(Debug, Clone, Deserialize, Default)]
struct SiteFile {
    #[serde(default)]
    stage: SiteStage,
}

/// Where the site config lives unless `ODFS_SITE_CONFIG` names another file.
pub const SITE_CONFIG: &str = "/etc/odfs/site.toml";

impl SiteStage {
    /// The site's AWS files this node cannot open (`credentials_file`, `config_file`): each
    /// with its key and why.
    pub fn unreadable_files(&self) -> Vec<(&'static str, &std::path::Path, std::io::Error)> {
        [("credentials_file", &self.credentials_file), ("config_file", &self.config_file)]
            .into_iter()
            .filter_map(|(key, f)| {
                let f = f.as_deref()?;
                std::fs::File::open(f).err().map(|e| (key, f, e))
            })
            .collect()
    }

    /// Reads the `[stage]` table of `path`; a missing default file means no site settings, a
    /// missing named file or a bad one is an error naming the file and the problem.
    pub fn load(path: Option<&std::path::Path>) -> Result<SiteStage, String> {
        let (p, named) = match path {
            Some(p) => (p.to_path_buf(), true),
            None => (std::path::PathBuf::from(SITE_CONFIG), false),
        };
        let text = match std::fs::read_to_string(&p) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && !named => return Ok(SiteStage::default()),
            Err(e) => return Err(format!("cannot read the site config {}: {e}", p.display())),
        };
        toml::from_str::<SiteFile>(&text)
            .map(|f| f.stage)
            .map_err(|e| format!("site config {}: {}", p.display(), e.message()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn printed_defaults_parse_back() {
        let text = toml::to_string_pretty(&AgentConfig::default()).unwrap();
        assert_eq!(toml::from_str::<AgentConfig>(&text).unwrap(), AgentConfig::default());
        assert!(toml::from_str::<AgentConfig>("concurrency = \"x\"").is_err());
        assert!(toml::from_str::<AgentConfig>("unknown = 1").is_err());
    }

    #[test]
    fn site_stage_settings_load_and_name_bad_keys() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("site.toml");
        std::fs::write(
            &p,
            "[stage]\nendpoint_url = \"http://s3:9000\"\npath_style = true\nconcurrency = 8\n[slurm]\nx = 1\n",
        )
        .unwrap();
        let s = SiteStage::load(Some(&p)).unwrap();
        assert_eq!(s.endpoint_url.as_deref(), Some("http://s3:9000"));
        assert_eq!((s.path_style, s.concurrency, s.region), (Some(true), Some(8), None));
        std::fs::write(&p, "[stage]\nendpoint = \"x\"\n").unwrap();
        let e = SiteStage::load(Some(&p)).unwrap_err();
        assert!(e.contains("site.toml") && e.contains("unknown field"), "{e}");
        assert!(SiteStage::load(Some(&d.path().join("none.toml"))).unwrap_err().contains("cannot read"));
    }
}
