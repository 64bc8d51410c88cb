//! Turning S3 keys (and POSIX relative paths) into safe relative paths under a destination.
//!
//! Owns the rule that nothing is ever written outside the destination: a key is accepted only
//! if every component is a plain name. Must not touch any filesystem.

use thiserror::Error;

/// Why a key cannot become a path.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum UnsafeKey {
    #[error("empty")]
    Empty,
    #[error("absolute (starts with '/')")]
    Absolute,
    #[error("contains an empty component ('//')")]
    EmptyComponent,
    #[error("contains a '.' or '..' component")]
    DotComponent,
    #[error("contains a NUL byte")]
    Nul,
    #[error("has a component of {0} bytes (at most 255)")]
    TooLong(usize),
}

/// The longest name a component may have (NAME_MAX).
pub const NAME_MAX: usize = 255;

/// Checks that `rel` (a key with the source prefix removed) is a safe relative path: plain
/// components separated by single '/'. A trailing '/' (a directory marker) is allowed.
pub fn check_relative(rel: &str) -> Result<(), UnsafeKey> {
    let body = rel.strip_suffix('/').unwrap_or(rel);
    if body.is_empty() {
        return Err(UnsafeKey::Empty);
    }
    if body.starts_with('/') {
        return Err(UnsafeKey::Absolute);
    }
    if body.contains('\0') {
        return Err(UnsafeKey::Nul);
    }
    for c in body.split('/') {
        match c {
            "" => return Err(UnsafeKey::EmptyComponent),
            "." | ".." => return Err(UnsafeKey::DotComponent),
            c if c.len() > NAME_MAX => return Err(UnsafeKey::TooLong(c.len())),
            _ => {}
        }
    }
    Ok(())
}

/// Every parent directory of `rel` ("a/b/c" → ["a", "a/b"]).
pub fn parents(rel: &str) -> impl Iterator<Item = &str> {
    rel.match_indices('/').map(move |(i, _)| &rel[..i])
}

/// Joins a root ("/data" or "/data/") and a relative path.
pub fn join(root: &str, rel: &str) -> String {
    if rel.is_empty() {
        return root.to_string();
    }
    format!("{}/{rel}", root.trim_end_matches('/'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_plain_paths_and_refuses_escapes() {
        assert_eq!(check_relative("a/b/c.bin"), Ok(()));
        assert_eq!(check_relative("dir/"), Ok(()));
        assert_eq!(check_relative("..."), Ok(()), "three dots is a name");
        assert_eq!(check_relative("../etc/passwd"), Err(UnsafeKey::DotComponent));
        assert_eq!(check_relative("a/../../b"), Err(UnsafeKey::DotComponent));
        assert_eq!(check_relative("a/./b"), Err(UnsafeKey::DotComponent));
        assert_eq!(check_relative("/abs"), Err(UnsafeKey::Absolute));
        assert_eq!(check_relative("a//b"), Err(UnsafeKey::EmptyComponent));
        assert_eq!(check_relative("a\0b"), Err(UnsafeKey::Nul));
        assert_eq!(check_relative(""), Err(UnsafeKey::Empty));
        assert_eq!(check_relative(&"x".repeat(255)), Ok(()));
        assert_eq!(check_relative(&format!("d/{}", "x".repeat(256))), Err(UnsafeKey::TooLong(256)));
    }

    #[test]
    fn parents_and_join() {
        assert_eq!(parents("a/b/c").collect::<Vec<_>>(), ["a", "a/b"]);
        assert_eq!(parents("f").count(), 0);
        assert_eq!(join("/data/", "a/b"), "/data/a/b");
        assert_eq!(join("/", "a"), "/a");
        assert_eq!(join("/d", ""), "/d");
    }
}
