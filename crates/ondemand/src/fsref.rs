//! Finding the filesystem a client command talks to (`--fs FILE` or `ODFS_FS`), and telling
//! `odfs:/path` arguments from local paths.

use anyhow::{Context, Result};
use odfs_client::{Client, ClientConfig};
use std::path::{Path, PathBuf};

/// Path of the client config: `--fs`, else `ODFS_FS`, else `./odfs.toml` if present.
pub fn config_path(fs: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = fs {
        return Ok(p.to_path_buf());
    }
    if let Some(p) = std::env::var_os("ODFS_FS") {
        return Ok(PathBuf::from(p));
    }
    let p = PathBuf::from("odfs.toml");
    anyhow::ensure!(
        p.exists(),
        "which filesystem? pass --fs FILE or set ODFS_FS (e.g. ROOT/odfs.toml written by `odfs local up`), \
         or run it in a job (ODFS_MOUNT) or inside an odfs mount"
    );
    Ok(p)
}

/// Where a command that names no path finds its filesystem.
pub enum Source {
    /// A client config (`--fs`, `ODFS_FS`, `./odfs.toml`): the library, with the job's
    /// credential (root).
    Config(PathBuf),
    /// A mount (the job's `$ODFS_MOUNT`, or the one holding the current directory): its
    /// virtual attributes, readable by the job's user, hold what the command shows.
    Mount(PathBuf),
}

/// The client config if one is named or present, else the job's mount.
pub fn source(fs: Option<&Path>) -> Result<Source> {
    let named = fs.is_some() || std::env::var_os("ODFS_FS").is_some() || Path::new("odfs.toml").exists();
    if !named {
        if let Some(m) = job_mount() {
            return Ok(Source::Mount(m));
        }
    }
    config_path(fs).map(Source::Config)
}

/// The mount a command in a job works on: `$ODFS_MOUNT`, else the odfs mount holding the
/// current directory.
pub fn job_mount() -> Option<PathBuf> {
    std::env::var_os("ODFS_MOUNT")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| crate::lfs::mount_of(&std::env::current_dir().ok()?))
}

pub async fn connect(fs: Option<&Path>) -> Result<Client> {
    let p = config_path(fs)?;
    let cfg = ClientConfig::load(&p).with_context(|| format!("cannot load {}", p.display()))?.one_shot();
    Client::connect(cfg).await.with_context(|| format!("cannot reach the filesystem of {}", p.display()))
}

/// The odfs kind of a local file type (from `symlink_metadata` or a directory entry).
pub fn local_kind(t: std::fs::FileType) -> odfs_proto::meta::FileKind {
    use odfs_proto::meta::FileKind;
    use std::os::unix::fs::FileTypeExt;
    if t.is_dir() {
        FileKind::Dir
    } else if t.is_symlink() {
        FileKind::Symlink
    } else if t.is_fifo() {
        FileKind::Fifo
    } else if t.is_socket() {
        FileKind::Socket
    } else if t.is_char_device() {
        FileKind::CharDev
    } else if t.is_block_device() {
        FileKind::BlockDev
    } else {
        FileKind::File
    }
}

/// A path inside odfs (`odfs:/a/b`) or on the local machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    Odfs(String),
    Local(PathBuf),
}

impl Location {
    pub fn parse(s: &str) -> Location {
        match s.strip_prefix("odfs:") {
            Some(p) if p.starts_with('/') => Location::Odfs(p.to_string()),
            Some(p) => Location::Odfs(format!("/{p}")),
            None => Location::Local(PathBuf::from(s)),
        }
    }
}

/// As the user wrote it: `odfs:/a/b`, or the local path.
impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Location::Odfs(p) => write!(f, "odfs:{p}"),
            Location::Local(p) => write!(f, "{}", p.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_locations() {
        assert_eq!(Location::parse("odfs:/a/b"), Location::Odfs("/a/b".into()));
        assert_eq!(Location::parse("odfs:a"), Location::Odfs("/a".into()));
        assert_eq!(Location::parse("/tmp/x"), Location::Local("/tmp/x".into()));
        assert_eq!(Location::parse("odfs:a").to_string(), "odfs:/a");
        assert_eq!(Location::parse("/tmp/x").to_string(), "/tmp/x");
    }
}
