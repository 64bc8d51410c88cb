//! The odfs transport.
//!
//! Owns: the per-job credential (derived from the site key and the job id), QUIC endpoints with
//! mutual TLS that refuse any peer without the job's credential, TCP bulk streams authenticated
//! with the same credential, a connection that multiplexes many typed requests over one stream,
//! the server-side router and its per-request statistics, file spans sent by sendfile, chunk
//! replies spliced into a pipe, large request payloads read into recycled aligned buffers, and
//! the client-side connection pool with retries.
//! It knows nothing of what requests mean; services register handlers.

pub mod conn;
pub mod credential;
pub mod error;
pub mod local;
pub mod pool;
pub mod quic;
mod recycle;
pub mod router;
pub mod spans;
pub mod splice;
pub mod stats;
pub mod tcp;

pub use conn::{Conn, PAYLOAD_ALIGN};
pub use credential::{JobCredential, SiteKey};
pub use error::RpcError;
pub use local::Local;
pub use pool::{own_lane, Pool, PoolConfig, Transport};
pub use router::Router;

/// A process-wide shutdown signal: every accept loop and background task watches it.
pub type Shutdown = tokio::sync::watch::Receiver<bool>;
