//! The odfs wire protocol, shared by every daemon and client.
//!
//! This crate owns every type that crosses the network: the common request header, the frozen
//! numeric method ids, error codes, the messages of each service, file layouts and the striping
//! arithmetic, the POSIX rules of file lock tables, and the frame codec. It performs no I/O; transports live in `odfs-rpc`.
//! Daemons never define wire types of their own.

pub mod codec;
pub mod crc;
pub mod error;
pub mod header;
pub mod ids;
pub mod layout;
pub mod locks;
pub mod meta;
pub mod method;
pub mod mgmt;
pub mod stage;
pub mod stats;
pub mod storage;
pub mod time;
pub mod units;

pub use error::{ErrorCode, ProtoError, RemoteError};
pub use header::RequestHeader;
pub use ids::{InodeId, NodeIndex, ServiceId, TargetId};
pub use layout::{DirLayout, Layout};
pub use method::Rpc;
pub use time::Timespec;

/// Longest name of one directory entry, in bytes (as on Linux).
pub const NAME_MAX: usize = 255;
/// Longest value of one extended attribute, in bytes.
pub const XATTR_VALUE_MAX: usize = 64 * 1024;
/// Protocol version carried in the QUIC ALPN and the bulk handshake.
pub const PROTOCOL_VERSION: u32 = 1;
