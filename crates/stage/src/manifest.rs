//! Manifests: what a stage moved and how each file was verified, written beside the data
//! (`DST/.odfs-stage-in.json` in odfs; `PREFIX.odfs-stage-out.json` in S3, followed by the
//! completion marker `PREFIX.odfs-stage-out.complete`). A re-run reads the previous manifest
//! to skip what is already complete and correct.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// File name of the stage-in manifest in the destination directory.
pub const STAGE_IN_MANIFEST: &str = ".odfs-stage-in.json";
/// Object names (under the destination prefix) of the stage-out manifest and marker.
pub const STAGE_OUT_MANIFEST: &str = ".odfs-stage-out.json";
pub const STAGE_OUT_MARKER: &str = ".odfs-stage-out.complete";

/// Names a stage writes itself; a source file of the same name at the top is not copied.
pub fn reserved(rel: &str) -> bool {
    [STAGE_IN_MANIFEST, STAGE_OUT_MANIFEST, STAGE_OUT_MARKER]
        .iter()
        .any(|m| rel == *m || rel.as_bytes() == writing_name(m.as_bytes()).as_slice())
}

/// The name a stage writes a file of its own under before renaming it to `name`.
pub fn writing_name(name: &[u8]) -> Vec<u8> {
    [name, b".writing"].concat()
}

/// The checkpoint a file of a drained (or staged-out) tree belongs to, for `--keep`: the entry
/// at the top of the tree that holds it — its first path component.
pub fn checkpoint_of(rel: &str) -> &str {
    rel.split_once('/').map_or(rel, |(top, _)| top)
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct FileEntry {
    pub size: u64,
    /// Source ETag (stage-in from S3) or the uploaded object's ETag (stage-out).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etag: Option<String>,
    /// MD5 (hex) of the bytes, when one digest covers the whole file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub md5: Option<String>,
    /// CRC32C of the whole file (hex).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crc32c: Option<String>,
    /// Modification time, seconds since the epoch, and its nanoseconds.
    pub mtime: i64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub mtime_nsec: u32,
    /// How the copy was checked: "md5", "crc32c", "crc32c+md5", "size", "etag".
    pub verified: String,
    /// Stage-out: uploaded and verified by a drain while the job ran, at this time
    /// (milliseconds since the epoch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drained: Option<i64>,
    /// Stage-out: a drained file whose object a drain's `--keep` deleted from the destination.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub retired: bool,
    /// Stage-out: a drained file its drain deleted from odfs after the upload
    /// (`--delete-after-upload`); its object is the only copy.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub deleted_local: bool,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl FileEntry {
    /// Whether this entry describes a file of this size and modification time.
    pub fn same_file(&self, size: u64, mtime: odfs_proto::Timespec) -> bool {
        self.size == size && self.mtime == mtime.sec && self.mtime_nsec == mtime.nsec
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Manifest {
    pub version: u32,
    /// "stage-in" or "stage-out".
    pub kind: String,
    pub source: String,
    pub destination: String,
    /// Seconds since the epoch when written.
    pub written: i64,
    pub files: BTreeMap<String, FileEntry>,
    pub directories: Vec<String>,
    /// Source keys refused as unsafe paths, with the reason.
    #[serde(default)]
    pub refused: BTreeMap<String, String>,
    /// A stage-in's record while it runs, or after it was interrupted: `files` holds what is
    /// verified so far, and a run of the same stage-in copies only the rest.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub in_progress: bool,
}

impl Manifest {
    pub fn to_json(&self) -> Vec<u8> {
        let mut v = serde_json::to_vec_pretty(self).expect("manifest serialises");
        v.push(b'\n');
        v
    }

    /// Parses a manifest; an unreadable one counts as none (everything is copied again).
    pub fn parse(data: &[u8]) -> Option<Manifest> {
        serde_json::from_slice(data).ok().filter(|m: &Manifest| m.version == 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_refuses_garbage() {
        let mut m = Manifest { version: 1, kind: "stage-in".into(), ..Manifest::default() };
        m.files.insert(
            "a/b".into(),
            FileEntry {
                size: 3,
                etag: Some("x".into()),
                md5: None,
                crc32c: None,
                mtime: 5,
                mtime_nsec: 7,
                verified: "md5".into(),
                drained: Some(9),
                retired: false,
                deleted_local: true,
            },
        );
        assert_eq!(Manifest::parse(&m.to_json()), Some(m));
        assert_eq!(Manifest::parse(b"not json"), None);
        assert!(reserved(".odfs-stage-in.json") && !reserved("data/.odfs-stage-in.json"));
    }
}
