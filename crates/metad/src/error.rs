//! `MetaError`: failures of the store itself — opening, recovering, writing its files.
//!
//! Namespace outcomes (a missing name, a refused permission) are not `MetaError`s: they are
//! `RemoteError`s returned to the client as they are; the common ones are built here.

use odfs_proto::error::{ErrorCode, RemoteError};
use std::path::PathBuf;

/// A failure to open, recover or persist the store.
#[derive(Debug, thiserror::Error)]
pub enum MetaError {
    /// A file of the store could not be read, written, synced or renamed.
    #[error("cannot {what} {}: {source}", .path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The snapshot exists but is damaged; the log alone cannot rebuild the state.
    #[error("snapshot {} is corrupt: {reason}", .path.display())]
    CorruptSnapshot { path: PathBuf, reason: String },
    /// The log has a damaged record that is not a torn tail (it has a valid checksum but cannot
    /// be decoded, or its sequence number is out of order).
    #[error("write-ahead log {} is corrupt at byte {offset}: {reason}", .path.display())]
    CorruptLog { path: PathBuf, offset: u64, reason: String },
    /// A logged mutation failed when re-applied: the log does not match the snapshot.
    #[error("replaying record {seq} of {} failed: {reason}", .path.display())]
    Replay { path: PathBuf, seq: u64, reason: String },
    /// The directory holds another shard's namespace.
    #[error("{} holds the namespace of shard {found}, not of shard {expected}", .path.display())]
    ShardMismatch { path: PathBuf, found: u16, expected: u16 },
    /// The default layout given for the root directory breaks a layout rule.
    #[error("the root directory's default layout is invalid: {0}")]
    InvalidRootLayout(String),
    /// State could not be encoded (a bug, or out of memory).
    #[error("cannot encode {what}: {reason}")]
    Encode { what: &'static str, reason: String },
    /// An earlier failure to write the log left the store unable to accept mutations.
    #[error("the store refuses changes after an earlier failure: {0}")]
    Failed(String),
    /// The service could not start: its credential, endpoint or mgmtd.
    #[error(transparent)]
    Rpc(#[from] odfs_rpc::RpcError),
    /// A namespace change the service makes itself was refused (the root's owner).
    #[error("{what}: {err}")]
    Refused { what: &'static str, err: RemoteError },
}

impl MetaError {
    pub(crate) fn io(what: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        MetaError::Io { what, path: path.into(), source }
    }
}

// ---- namespace outcomes ----

pub(crate) fn internal(msg: &str) -> RemoteError {
    RemoteError::new(ErrorCode::Internal, msg)
}

pub(crate) fn show(name: &[u8]) -> String {
    String::from_utf8_lossy(name).into_owned()
}

pub(crate) fn not_found(name: &[u8]) -> RemoteError {
    RemoteError::new(ErrorCode::NotFound, format!("\"{}\" does not exist", show(name)))
}

pub(crate) fn exists(name: &[u8]) -> RemoteError {
    RemoteError::new(ErrorCode::Exists, format!("\"{}\" already exists", show(name)))
}
