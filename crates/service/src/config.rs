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

/// A service address in a config file (`mgmtd = "..."`): `IP:PORT`, or `HOST:PORT` with a host
/// name resolved when the file is read (its first IPv4 address, else its first). For
/// `#[serde(deserialize_with = "odfs_service::config::address")]`.
pub fn address<'de, D: serde::Deserializer<'de>>(d: D) -> Result<std::net::SocketAddr, D::Error> {
    let text = <String as serde::Deserialize>::deserialize(d)?;
    resolve_address(&text).map_err(serde::de::Error::custom)
}

/// [`address`] for a string; the error says what is wrong with it.
pub fn resolve_address(text: &str) -> Result<std::net::SocketAddr, String> {
    use std::net::ToSocketAddrs;
    if let Ok(a) = text.parse() {
        return Ok(a);
    }
    let Some((host, port)) = text.rsplit_once(':').filter(|(h, _)| !h.is_empty()) else {
        return Err(format!("{text:?} is not an address: write IP:PORT or HOST:PORT (e.g. node0:7700)"));
    };
    if port.parse::<u16>().is_err() {
        return Err(format!("{text:?}: the port {port:?} is not a number from 0 to 65535"));
    }
    let found =
        text.to_socket_addrs().map_err(|e| format!("{text:?}: the host name {host:?} does not resolve ({e})"))?;
    preferred(found).ok_or_else(|| format!("{text:?}: the host name {host:?} has no address"))
}

/// The address a name that resolves to several is used by: its first IPv4 address, else its
/// first (the job's daemons listen on IPv4 unless a node has none).
pub fn preferred(found: impl IntoIterator<Item = std::net::SocketAddr>) -> Option<std::net::SocketAddr> {
    let found: Vec<std::net::SocketAddr> = found.into_iter().collect();
    found.iter().find(|a| a.is_ipv4()).or(found.first()).copied()
}
