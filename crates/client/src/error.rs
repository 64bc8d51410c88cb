//! The client's error type; `errno()` is what a POSIX caller sees.

use odfs_proto::{ErrorCode, RemoteError};
use odfs_rpc::RpcError;

#[derive(Debug, Clone, thiserror::Error)]
pub enum ClientError {
    /// A service refused or failed the operation.
    #[error("{}", if .0.message.is_empty() { .0.code.to_string() } else { .0.message.clone() })]
    Remote(RemoteError),
    /// The filesystem is not reachable or not ready.
    #[error("filesystem unavailable: {0}")]
    Unavailable(String),
    #[error("config: {0}")]
    Config(String),
}

impl ClientError {
    pub fn code(&self) -> ErrorCode {
        match self {
            ClientError::Remote(e) => e.code,
            ClientError::Unavailable(_) => ErrorCode::Unavailable,
            ClientError::Config(_) => ErrorCode::Invalid,
        }
    }

    pub fn errno(&self) -> i32 {
        self.code().errno()
    }

    pub fn new(code: ErrorCode, msg: impl Into<String>) -> ClientError {
        ClientError::Remote(RemoteError::new(code, msg))
    }
}

impl From<RemoteError> for ClientError {
    fn from(e: RemoteError) -> Self {
        ClientError::Remote(e)
    }
}

impl From<ErrorCode> for ClientError {
    fn from(c: ErrorCode) -> Self {
        ClientError::Remote(c.into())
    }
}

impl From<RpcError> for ClientError {
    fn from(e: RpcError) -> Self {
        match e {
            RpcError::Remote(r) => ClientError::Remote(r),
            other => ClientError::Remote(other.to_remote()),
        }
    }
}
