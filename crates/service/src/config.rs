//! The `[job]` section every daemon config has, and config loading.

use odfs_rpc::{JobCredential, RpcError, SiteKey};
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Which job this daemon serves and how it proves it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct JobSection {
    /// The job id; with the site key it derives the job's credential.
    pub id: String,
    /// The site key file (root-only; made by `odfs keygen`).
    pub site_key: PathBuf,
}

impl Default for JobSection {
    fn default() -> Self {
        JobSection { id: "local".into(), site_key: PathBuf::from("/etc/odfs/site.key") }
    }
}

impl JobSection {
    pub fn credential(&self) -> Result<JobCredential, RpcError> {
        let key = SiteKey::load(&self.site_key)?;
        JobCredential::derive(&key, &self.id)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("config {path}: {message}")]
    Parse { path: PathBuf, message: String },
}

/// Loads a TOML config; a missing path means all defaults. Unknown keys are errors.
pub fn load_config<T: DeserializeOwned + Default>(path: Option<&Path>) -> Result<T, ConfigError> {
    let Some(path) = path else {
        return Ok(T::default());
    };
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.into(), source })?;
    toml::from_str(&text)
        .map_err(|e| ConfigError::Parse { path: path.into(), message: e.to_string().trim().replace('\n', " ") })
}
