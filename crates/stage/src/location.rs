//! The two sides of a stage as users write them: `s3://bucket/prefix`, `odfs:/path`, a path
//! inside an odfs mount, or a POSIX path (the global PFS).
//!
//! Owns parsing and the errors for bad arguments; must not do I/O beyond reading
//! /proc/self/mountinfo to recognise a path inside an odfs mount.

use crate::error::{invalid, Result};
use std::path::{Component, PathBuf};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// Bucket and key prefix (empty, or ending in '/').
    S3 { bucket: String, prefix: String },
    /// A path inside odfs, absolute ("/data").
    Odfs(String),
    /// A POSIX path outside odfs, absolute.
    Posix(PathBuf),
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Location::S3 { bucket, prefix } => write!(f, "s3://{bucket}/{prefix}"),
            Location::Odfs(p) => write!(f, "odfs:{p}"),
            Location::Posix(p) => write!(f, "{}", p.display()),
        }
    }
}

/// Bucket names as S3 allows them: 3–63 of [a-z0-9.-], starting and ending alphanumeric.
fn valid_bucket(b: &str) -> bool {
    (3..=63).contains(&b.len())
        && b.bytes().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'.' || c == b'-')
        && b.as_bytes()[0].is_ascii_alphanumeric()
        && b.as_bytes()[b.len() - 1].is_ascii_alphanumeric()
}

/// Normalises an odfs path: absolute, no '.', '..' or empty components.
fn odfs_path(p: &str) -> Result<String> {
    let mut out = Vec::new();
    for c in p.split('/') {
        match c {
            "" | "." => {}
            ".." => return invalid!("odfs:{p}: '..' is not allowed in an odfs path"),
            c => out.push(c),
        }
    }
    Ok(format!("/{}", out.join("/")))
}

/// Parses one side of a stage. `mounts` are the odfs mount points of this node (a path inside
/// one of them names odfs itself).
pub fn parse(s: &str, mounts: &[PathBuf]) -> Result<Location> {
    if let Some(rest) = s.strip_prefix("s3://") {
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            return invalid!("{s}: no bucket name (expected s3://BUCKET/PREFIX)");
        }
        if !valid_bucket(bucket) {
            return invalid!("{s}: {bucket:?} is not a valid S3 bucket name (3-63 characters: a-z, 0-9, '.', '-')");
        }
        let mut prefix = prefix.to_string();
        if !prefix.is_empty() && !prefix.ends_with('/') {
            prefix.push('/');
        }
        if prefix.contains("//") {
            return invalid!("{s}: empty path component ('//') in the key prefix");
        }
        return Ok(Location::S3 { bucket: bucket.to_string(), prefix });
    }
    if s.contains("://") {
        return invalid!("{s}: unknown scheme (use s3://BUCKET/PREFIX, odfs:/PATH or a local path)");
    }
    if s.len() > 3 && s[..3].eq_ignore_ascii_case("s3:") {
        return invalid!(
            "{s}: malformed S3 URL: write s3://BUCKET/PREFIX, with two slashes (a local path of that name: ./{s})"
        );
    }
    if let Some(p) = s.strip_prefix("odfs:") {
        return Ok(Location::Odfs(odfs_path(p)?));
    }
    if s.is_empty() {
        return invalid!("empty path");
    }
    let abs = std::path::absolute(s).map_err(|e| crate::StageError::Invalid(format!("{s}: {e}")))?;
    let clean: PathBuf = abs.components().filter(|c| !matches!(c, Component::CurDir)).collect();
    if clean.components().any(|c| c == Component::ParentDir) {
        return invalid!("{s}: use a path without '..'");
    }
    // The longest mount point containing the path names odfs.
    let inside = mounts.iter().filter(|m| clean.starts_with(m)).max_by_key(|m| m.as_os_str().len());
    if let Some(m) = inside {
        let rel = clean.strip_prefix(m).expect("starts with it");
        return Ok(Location::Odfs(odfs_path(&rel.to_string_lossy())?));
    }
    Ok(Location::Posix(clean))
}

/// Mount points of odfs filesystems (type fuse.odfs) on this node.
pub fn odfs_mounts() -> Vec<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            let mp = left.split(' ').nth(4)?;
            right.starts_with("fuse.odfs ").then(|| PathBuf::from(mp.replace("\\040", " ")))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_kind_and_names_the_problem() {
        let none: &[PathBuf] = &[];
        assert_eq!(
            parse("s3://bkt/data/set", none).unwrap(),
            Location::S3 { bucket: "bkt".into(), prefix: "data/set/".into() }
        );
        assert_eq!(parse("s3://bkt", none).unwrap(), Location::S3 { bucket: "bkt".into(), prefix: "".into() });
        assert_eq!(parse("odfs:/a//b/./c", none).unwrap(), Location::Odfs("/a/b/c".into()));
        assert_eq!(parse("odfs:data", none).unwrap(), Location::Odfs("/data".into()));
        assert_eq!(parse("/pfs/x/", none).unwrap(), Location::Posix("/pfs/x".into()));
        let mounts = [PathBuf::from("/mnt/odfs")];
        assert_eq!(parse("/mnt/odfs/in/x", &mounts).unwrap(), Location::Odfs("/in/x".into()));
        assert_eq!(parse("/mnt/odfs", &mounts).unwrap(), Location::Odfs("/".into()));
        for (bad, msg) in [
            ("s3://", "no bucket"),
            ("s3:///x", "no bucket"),
            ("s3://Bad_Bucket/x", "not a valid S3 bucket"),
            ("s3://bkt/a//b", "empty path component"),
            ("gs://bkt/x", "unknown scheme"),
            ("odfs:/a/../b", "'..'"),
            ("/pfs/../etc", "'..'"),
        ] {
            let e = parse(bad, none).unwrap_err().to_string();
            assert!(e.contains(msg), "{bad}: {e}");
        }
    }
}
