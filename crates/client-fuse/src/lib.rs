//! The odfs FUSE mount: the adapter from the kernel's requests, as `odfs-fuse-kernel` decodes
//! and dispatches them, to the odfs client library (`odfs-client`).
//!
//! Owns: translating FUSE requests and replies (inode numbers are odfs inode ids, generation
//! 0), the table of open file handles, reply TTLs, the kernel settings negotiated at mount, the
//! mount options, spliced READ replies (`splice`), passthrough's backing files (`passthrough`)
//! and the life of one mount (connect, mount, serve, flush and unmount on SIGTERM). It must not
//! implement filesystem behaviour: permissions, caching, striping, write-behind and consistency
//! belong to the client library and metad; nor the FUSE protocol, which is `odfs-fuse-kernel`'s.
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

pub mod attr;
pub mod callers;
pub mod counts;
pub mod error;
pub mod fill;
pub mod fs;
pub mod handles;
pub mod mount;
pub mod passthrough;
mod reader;
pub mod splice;

pub use error::FuseError;
pub use fs::OdfsFuse;
pub use mount::{run, MountArgs};
