//! Errors of the chunk store and their mapping to wire error codes.
//!
//! Owns `StoreError` and `From<StoreError> for RemoteError`. Performs no I/O and does not log:
//! callers decide what is worth a log line.

use odfs_proto::{ErrorCode, RemoteError, TargetId};
use std::io;
use std::path::PathBuf;

/// Why a chunk store call failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The request names a target this store does not serve.
    #[error("unknown target {0}")]
    UnknownTarget(TargetId),
    /// A system call failed; `op` names what was being done to `path`.
    #[error("{op} {}: {source}", path.display())]
    Io { op: &'static str, path: PathBuf, source: io::Error },
    /// The target's file system is full (ENOSPC or EDQUOT). Data acknowledged earlier is intact.
    #[error("no space left on device writing {}", path.display())]
    NoSpace { path: PathBuf },
    /// The store cannot be opened as configured (bad target directory, io_uring unavailable
    /// when it was required, duplicate targets).
    #[error("{0}")]
    Config(String),
    /// One request asked to move more bytes than a single operation may carry.
    #[error("{what} of {len} bytes exceeds the per-request limit of {max} bytes")]
    TooLarge { what: &'static str, len: u64, max: u64 },
    /// The request's arguments cannot be served (an offset past the largest file offset).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The service could not start or serve: its credential, endpoints or mgmtd.
    #[error(transparent)]
    Rpc(#[from] odfs_rpc::RpcError),
}

impl StoreError {
    /// Wraps an OS error met while doing `op` on `path`, singling out a full file system.
    pub(crate) fn io(op: &'static str, path: PathBuf, source: io::Error) -> StoreError {
        match source.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => StoreError::NoSpace { path },
            _ => StoreError::Io { op, path, source },
        }
    }

    /// The wire code this error travels as.
    pub fn code(&self) -> ErrorCode {
        match self {
            // A target this daemon does not serve is a misrouted request, not a missing file:
            // ENOENT at the FUSE edge would tell the user their existing file is gone.
            StoreError::UnknownTarget(_) => ErrorCode::Invalid,
            StoreError::NoSpace { .. } => ErrorCode::NoSpace,
            StoreError::Io { source, .. } => errno_code(source),
            StoreError::Config(_) => ErrorCode::Invalid,
            StoreError::TooLarge { .. } => ErrorCode::Range,
            StoreError::Invalid(_) => ErrorCode::Invalid,
            StoreError::Rpc(e) => e.to_remote().code,
        }
    }
}

/// The code for an OS error: the few errnos a caller can act on keep their meaning, everything
/// else (EIO, EBADF, ...) is an I/O error.
fn errno_code(e: &io::Error) -> ErrorCode {
    match e.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => ErrorCode::NoSpace,
        Some(libc::EFBIG) => ErrorCode::FileTooBig,
        Some(libc::EROFS) => ErrorCode::ReadOnly,
        Some(libc::EACCES) => ErrorCode::Access,
        Some(libc::EPERM) => ErrorCode::Perm,
        Some(libc::EINVAL) => ErrorCode::Invalid,
        _ => ErrorCode::Io,
    }
}

impl From<StoreError> for RemoteError {
    fn from(e: StoreError) -> Self {
        RemoteError::new(e.code(), e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(errno: i32) -> io::Error {
        io::Error::from_raw_os_error(errno)
    }

    #[test]
    fn full_disk_becomes_no_space() {
        for errno in [libc::ENOSPC, libc::EDQUOT] {
            let e = StoreError::io("write", "/t/chunks/01/0000000000000001".into(), os(errno));
            assert!(matches!(e, StoreError::NoSpace { .. }), "{e:?}");
            let r = RemoteError::from(e);
            assert_eq!(r.code, ErrorCode::NoSpace);
            assert!(r.message.contains("/t/chunks/01/0000000000000001"), "{}", r.message);
        }
    }

    #[test]
    fn os_errors_map_to_codes_and_keep_the_message() {
        let cases = [
            (libc::EIO, ErrorCode::Io),
            (libc::EBADF, ErrorCode::Io),
            (libc::EFBIG, ErrorCode::FileTooBig),
            (libc::EROFS, ErrorCode::ReadOnly),
            (libc::EACCES, ErrorCode::Access),
        ];
        for (errno, code) in cases {
            let r = RemoteError::from(StoreError::io("read", "/t/x".into(), os(errno)));
            assert_eq!(r.code, code, "errno {errno}");
            assert!(r.message.starts_with("read /t/x: "), "{}", r.message);
        }
    }

    #[test]
    fn request_errors_map_to_codes() {
        let r = RemoteError::from(StoreError::UnknownTarget(7));
        assert_eq!(r.code, ErrorCode::Invalid);
        assert_eq!(r.message, "unknown target 7");
        let r = RemoteError::from(StoreError::TooLarge { what: "read", len: 1 << 30, max: 16 << 20 });
        assert_eq!(r.code, ErrorCode::Range);
    }
}
