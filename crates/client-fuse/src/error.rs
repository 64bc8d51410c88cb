//! The crate's one error type: why a mount could not start or ended badly, and why one FUSE
//! request failed (with the errno the caller sees).

use odfs_client::ClientError;
use std::net::SocketAddr;
use std::path::PathBuf;

/// Errors of the FUSE adapter. Startup variants print as one line for the `odfs-fuse` binary;
/// request variants carry an errno for the kernel.
#[derive(Debug, thiserror::Error)]
pub enum FuseError {
    /// The client config could not be read or parsed (the message names the file).
    #[error("{0}")]
    Config(String),
    /// The mount point does not exist.
    #[error("mount point {0} does not exist")]
    MountPointMissing(PathBuf),
    /// The mount point exists but is not a directory.
    #[error("mount point {0} is not a directory")]
    MountPointNotDir(PathBuf),
    /// The mount point cannot be examined (for example a dead FUSE mount left there).
    #[error("mount point {path}: {source}")]
    MountPoint { path: PathBuf, source: std::io::Error },
    /// The kernel offers no FUSE device.
    #[error("/dev/fuse is missing: load the fuse kernel module (modprobe fuse) or give this container the device")]
    NoDevFuse,
    /// The filesystem could not be reached or is not ready.
    #[error("cannot connect to the filesystem at {addr}: {source}")]
    Connect { addr: SocketAddr, source: ClientError },
    /// mgmtd refused or did not answer the client registration.
    #[error("cannot register with mgmtd: {0}")]
    Register(ClientError),
    /// The tokio runtime or a signal handler could not be set up.
    #[error("cannot start the runtime: {0}")]
    Runtime(std::io::Error),
    /// The kernel (or fusermount3) refused the mount.
    #[error("mounting {path} was refused: {source}")]
    Mount { path: PathBuf, source: std::io::Error },
    /// The FUSE session ended with an error.
    #[error("the FUSE session failed: {0}")]
    Session(std::io::Error),
    /// A request failed in the client library.
    #[error(transparent)]
    Client(#[from] ClientError),
    /// A request the adapter itself refuses, with the errno to return.
    #[error("{}", std::io::Error::from_raw_os_error(*.0))]
    Errno(i32),
    /// A local file operation of the adapter's own (a passthrough chunk file) failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

impl FuseError {
    /// The errno a FUSE caller sees for this error.
    pub fn errno(&self) -> i32 {
        match self {
            FuseError::Client(e) => e.errno(),
            FuseError::Errno(n) => *n,
            FuseError::Io(e) => e.raw_os_error().unwrap_or(libc::EIO),
            _ => libc::EIO,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use odfs_proto::ErrorCode;

    #[test]
    fn startup_errors_read_as_one_line_and_requests_carry_errnos() {
        let refused =
            FuseError::Mount { path: "/mnt/x".into(), source: std::io::Error::from_raw_os_error(libc::EPERM) };
        assert_eq!(refused.to_string(), "mounting /mnt/x was refused: Operation not permitted (os error 1)");
        assert!(FuseError::NoDevFuse.to_string().starts_with("/dev/fuse is missing"));
        for e in [refused, FuseError::NoDevFuse, FuseError::MountPointMissing("/m".into())] {
            assert!(!e.to_string().contains('\n'));
            assert_eq!(e.errno(), libc::EIO);
        }
        assert_eq!(FuseError::Client(ErrorCode::NotEmpty.into()).errno(), libc::ENOTEMPTY);
        assert_eq!(FuseError::Errno(libc::ESTALE).errno(), libc::ESTALE);
    }
}
