//! `StageError`: why a stage could not run or could not finish. Failures of single files are
//! not errors of the stage: they are listed in its report (`StageReport::failed`) and the
//! stage goes on with the others.

use crate::keys::UnsafeKey;
use crate::s3::S3Error;
use odfs_client::ClientError;

#[derive(Debug, thiserror::Error)]
pub enum StageError {
    /// The request cannot work as given: a place, a setting or a pair of places.
    #[error("{0}")]
    Invalid(String),
    /// The shared store (S3) refused a request or could not be reached.
    #[error(transparent)]
    S3(#[from] S3Error),
    /// odfs refused a request or could not be reached.
    #[error(transparent)]
    Odfs(#[from] ClientError),
    /// A POSIX tree could not be read or written.
    #[error("{0}")]
    Posix(String),
    /// A name that cannot become a path under the destination.
    #[error(transparent)]
    UnsafeKey(#[from] UnsafeKey),
    /// The stage ran, but some files were not copied and verified, or some source names were
    /// refused (the report lists them).
    #[error("{0}")]
    Incomplete(String),
    /// The agent could not start or serve: its credential, endpoint or mgmtd.
    #[error(transparent)]
    Rpc(#[from] odfs_rpc::RpcError),
    /// The stage was told to stop (a signal); what it verified is recorded.
    #[error("{0}")]
    Interrupted(String),
    /// What a step was doing when the error below happened.
    #[error("{what}: {inner}")]
    During { what: String, inner: Box<StageError> },
}

impl From<std::io::Error> for StageError {
    fn from(e: std::io::Error) -> StageError {
        StageError::Posix(e.to_string())
    }
}

pub type Result<T, E = StageError> = std::result::Result<T, E>;

/// Names the step an error happened in ("cannot create odfs:/data: ...").
pub trait During<T> {
    fn during(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T, E: Into<StageError>> During<T> for std::result::Result<T, E> {
    fn during(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| StageError::During { what: what(), inner: Box::new(e.into()) })
    }
}

/// `Err(StageError::Invalid)` with a formatted message.
macro_rules! invalid {
    ($($t:tt)*) => { Err($crate::error::StageError::Invalid(format!($($t)*))) };
}
pub(crate) use invalid;
