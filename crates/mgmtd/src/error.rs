//! `MgmtdError`: why mgmtd could not start or serve.

use odfs_rpc::RpcError;

#[derive(Debug, thiserror::Error)]
pub enum MgmtdError {
    /// The config breaks a rule (named in the message).
    #[error("{0}")]
    Config(String),
    /// The credential, the endpoint or the network.
    #[error(transparent)]
    Rpc(#[from] RpcError),
    /// A local file (the address file).
    #[error("{0}")]
    Io(#[from] std::io::Error),
}
