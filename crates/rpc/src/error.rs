//! Errors of the transport.

use odfs_proto::{ErrorCode, ProtoError, RemoteError};
use std::net::SocketAddr;

#[derive(Debug, thiserror::Error)]
pub enum RpcError {
    /// The peer answered with an error.
    #[error(transparent)]
    Remote(#[from] RemoteError),
    #[error("cannot connect to {addr}: {reason}")]
    Connect { addr: SocketAddr, reason: String },
    #[error("connection to {0} closed")]
    Closed(String),
    #[error("request {method} to {addr} timed out after {secs} s")]
    Timeout { method: &'static str, addr: String, secs: u64 },
    #[error("protocol error: {0}")]
    Proto(#[from] ProtoError),
    #[error("credential: {0}")]
    Credential(String),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
}

impl RpcError {
    /// True when retrying the same request (same request id) may succeed: the transport failed,
    /// not the operation.
    pub fn retryable(&self) -> bool {
        match self {
            RpcError::Remote(e) => matches!(e.code, ErrorCode::Busy | ErrorCode::Unavailable),
            RpcError::Connect { .. } | RpcError::Closed(_) | RpcError::Timeout { .. } | RpcError::Io(_) => true,
            RpcError::Proto(_) | RpcError::Credential(_) => false,
        }
    }

    /// The error as a wire error code and message, for callers that speak errno.
    pub fn to_remote(&self) -> RemoteError {
        match self {
            RpcError::Remote(e) => e.clone(),
            RpcError::Timeout { .. } => RemoteError::new(ErrorCode::TimedOut, self.to_string()),
            RpcError::Credential(_) => RemoteError::new(ErrorCode::AuthFailed, self.to_string()),
            RpcError::Proto(_) => RemoteError::new(ErrorCode::BadMessage, self.to_string()),
            _ => RemoteError::new(ErrorCode::Unavailable, self.to_string()),
        }
    }
}

impl From<RpcError> for RemoteError {
    fn from(e: RpcError) -> Self {
        e.to_remote()
    }
}
