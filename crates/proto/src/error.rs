//! Error codes that cross the wire, and this crate's own error type.
//!
//! Codes are stable numbers: never renumber or reuse one. Each maps to one errno, applied once at
//! the FUSE edge and by the CLI.

use serde::{Deserialize, Serialize};
use std::fmt;

macro_rules! error_codes {
    ($( $(#[$doc:meta])* $name:ident = $num:expr => $errno:expr ),* $(,)?) => {
        /// A stable error code carried in replies.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
        #[serde(into = "u16", try_from = "u16")]
        pub enum ErrorCode {
            $( $(#[$doc])* $name = $num, )*
        }

        impl ErrorCode {
            /// The errno a POSIX caller sees for this code.
            pub fn errno(self) -> i32 {
                match self { $( ErrorCode::$name => $errno, )* }
            }
        }

        impl From<ErrorCode> for u16 {
            fn from(c: ErrorCode) -> u16 { c as u16 }
        }

        impl TryFrom<u16> for ErrorCode {
            type Error = String;
            fn try_from(v: u16) -> Result<Self, String> {
                match v {
                    $( $num => Ok(ErrorCode::$name), )*
                    other => Err(format!("unknown error code {other}")),
                }
            }
        }
    };
}

error_codes! {
    /// No such file or directory.
    NotFound = 1 => libc::ENOENT,
    /// The name exists already.
    Exists = 2 => libc::EEXIST,
    NotDir = 3 => libc::ENOTDIR,
    IsDir = 4 => libc::EISDIR,
    NotEmpty = 5 => libc::ENOTEMPTY,
    /// Permission denied by mode bits.
    Access = 6 => libc::EACCES,
    /// Operation not permitted (ownership, sticky bit).
    Perm = 7 => libc::EPERM,
    NameTooLong = 8 => libc::ENAMETOOLONG,
    Invalid = 9 => libc::EINVAL,
    NoSpace = 10 => libc::ENOSPC,
    Io = 11 => libc::EIO,
    /// No such extended attribute.
    NoData = 12 => libc::ENODATA,
    TooManyLinks = 13 => libc::EMLINK,
    /// Value does not fit the caller's buffer or a protocol limit.
    Range = 14 => libc::ERANGE,
    /// A service needed for the request is not reachable or not ready.
    Unavailable = 15 => libc::EIO,
    /// The request did not name a known method.
    BadMethod = 16 => libc::ENOSYS,
    /// The request could not be decoded.
    BadMessage = 17 => libc::EBADMSG,
    /// Not supported by this filesystem.
    Unsupported = 18 => libc::EOPNOTSUPP,
    /// The service is shutting down or not yet ready.
    Busy = 19 => libc::EBUSY,
    /// A file too large for its layout.
    FileTooBig = 20 => libc::EFBIG,
    /// A cross-device link (never needed inside one filesystem; kept for completeness).
    CrossDevice = 21 => libc::EXDEV,
    /// The request took too long.
    TimedOut = 22 => libc::ETIMEDOUT,
    /// A bug in the service.
    Internal = 23 => libc::EIO,
    /// The peer's credential was refused.
    AuthFailed = 24 => libc::EACCES,
    /// Read-only (retained) filesystem.
    ReadOnly = 25 => libc::EROFS,
    /// The entry belongs to another shard of a striped directory: the client asks again there
    /// (after learning the directory's stripes anew).
    WrongShard = 26 => libc::EIO,
    /// Between metad's parts only: the operation touches an inode of another shard and runs as
    /// an operation that spans shards. Never a client's answer.
    SpansShards = 27 => libc::EIO,
    /// The file is in use (open on a node) or changed: the asked-for removal is not done now.
    /// Unlike `Busy`, not a reason to send the same request again at once.
    InUse = 28 => libc::EBUSY,
    /// No more locks can be taken on the file (its lock table is full).
    NoLocks = 29 => libc::ENOLCK,
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The system's words for the errno ("Not a directory"), without Rust's names.
        let s = std::io::Error::from_raw_os_error(self.errno()).to_string();
        write!(f, "{}", s.split(" (os error").next().unwrap_or(&s))
    }
}

/// An error returned by a remote service: a code and a human-readable message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{}", if message.is_empty() { code.to_string() } else { message.clone() })]
pub struct RemoteError {
    pub code: ErrorCode,
    pub message: String,
}

impl RemoteError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        RemoteError { code, message: message.into() }
    }
}

impl From<ErrorCode> for RemoteError {
    fn from(code: ErrorCode) -> Self {
        RemoteError { code, message: String::new() }
    }
}

/// Errors of encoding and decoding frames.
#[derive(Debug, thiserror::Error)]
pub enum ProtoError {
    #[error("frame of {0} bytes exceeds the limit of {1} bytes")]
    FrameTooLarge(usize, usize),
    #[error("truncated frame")]
    Truncated,
    #[error("malformed message: {0}")]
    Decode(#[from] postcard::Error),
    #[error("unknown frame kind {0}")]
    BadKind(u8),
    #[error("a {0} frame carries a payload, which it has no place for")]
    UnexpectedPayload(&'static str),
}

impl From<ProtoError> for RemoteError {
    fn from(e: ProtoError) -> Self {
        RemoteError::new(ErrorCode::BadMessage, e.to_string())
    }
}

/// Shorthand for replies.
pub type RpcResult<T> = Result<T, RemoteError>;
