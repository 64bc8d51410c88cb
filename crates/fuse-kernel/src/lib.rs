//! The FUSE kernel protocol, for any FUSE file system (docs/architecture.md, "fuse-kernel"):
//! `abi` decodes requests and encodes replies, `reply` answers each request the one way the
//! protocol allows (and sends notifications and backing-file ioctls), `session` mounts, runs
//! the INIT handshake and dispatches each request to a [`session::Filesystem`], and `ring`
//! is its second transport, FUSE over io_uring.
//!
//! Owns the protocol's rules, not a file system's: odfs's adapter (`odfs-client-fuse`) and the
//! benchmarks' FUSE minima (`odfs-bench`) are file systems on it. fuser's plain types
//! (attributes, flags, inode numbers, errno) are used; fuser's session is not.

pub mod abi;
pub mod reply;
pub mod ring;
pub mod session;

pub use session::{Filesystem, KernelConfig, MountOptions, Request, Session};
