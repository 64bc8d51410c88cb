//! The odfs FUSE mount: its own FUSE protocol layer (`abi`, `session`, `reply`, `ring` for
//! FUSE over io_uring, `splice`, `passthrough`) and the adapter from the kernel's requests to
//! the odfs client library (`odfs-client`).
//!
//! Owns: translating FUSE requests and replies (inode numbers are odfs inode ids, generation
//! 0), the table of open file handles, reply TTLs, the kernel settings negotiated at mount, the
//! mount options, and the life of one mount (connect, mount, serve, flush and unmount on
//! SIGTERM). It must not implement filesystem behaviour: permissions, caching, striping,
//! write-behind and consistency belong to the client library and metad.
//!
//! Consistency through the mount is the library's: the kernel keeps names, missing names,
//! attributes and pages for as long as the client's leases last (each reply's TTL ends no later
//! than the client's trust in its lease), and every recall metad sends the client becomes a
//! kernel invalidation (`inval_inode`, `inval_entry`). What a lease covers is answered on the
//! session's reader thread (lookup, getattr, read-only open) without a task. There is no writeback
//! cache: every write(2) reaches the client library before it returns, so the library's
//! write-behind and error reporting stay the only buffering — except for files passed through
//! (`passthrough`): whole on this node's own target, the kernel reads and writes their chunk
//! file itself, and the adapter publishes what it wrote at close and fsync.
//!
//! The FUSE protocol is odfs-fuse's own (`abi`, `session`, `reply`, and `ring` for the io_uring
//! transport: docs/architecture.md, "client-fuse"); fuser's plain types (attributes,
//! flags, inode numbers) are still used.
//!
//! Also here, for benchmarks only: `minimum`, a synthetic FUSE filesystem that measures what
//! FUSE itself costs, and `uring_minimum`, its striped large files over the kernel's io_uring
//! transport for FUSE.

pub mod abi;
pub mod attr;
pub mod callers;
pub mod counts;
pub mod error;
pub mod fill;
pub mod fs;
pub mod handles;
pub mod minimum;
pub mod mount;
pub mod passthrough;
mod reader;
pub mod reply;
mod ring;
pub mod session;
pub mod splice;
pub mod uring_minimum;

pub use error::FuseError;
pub use fs::OdfsFuse;
pub use mount::{run, MountArgs};
