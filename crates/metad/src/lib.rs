//! metad: the metadata service of one namespace shard.
//!
//! Owns: every inode of its shard (attributes, directory entries, symlink targets, extended
//! attributes, file layouts), the POSIX rules that govern changing them, the choice of storage
//! targets for new files (`placement`), and durability. Every successful mutation is appended to a
//! write-ahead log before it is acknowledged, snapshots bound replay time, and a table of recent
//! replies makes retried requests idempotent, so a `kill -9` loses nothing that was answered.
//!
//! [`MetaStore`] is the whole API: reads take `&self`, every mutation goes through
//! [`MetaStore::mutate`]. It does no networking and no locking of its own; the RPC service
//! wraps it.
//!
//! - `service`: the wire adapter (decode and route) and the process's life; `requests`: what a
//!   request does beyond one store call (local or spanning, target refresh, leases, waits for
//!   recalls); `shards` and `spanning`: the coordinator of work that spans shards and of
//!   mgmtd's view.
//! - `store`: durability (`wal`, `snapshot`) and idempotency around the `namespace`;
//!   `placement`: the targets of new files.
//! - `namespace`: reads, dispatch and the checks operations share; `ops/`: one file per
//!   mutation; `inode`: the shapes kept; `permission`: who may do what.

pub mod config;
pub mod error;
mod inode;
pub mod namespace;
mod ops;
pub mod permission;
mod placement;
mod requests;
pub mod service;
mod sessions;
mod shards;
pub mod snapshot;
mod spanning;
pub mod store;
pub mod wal;

pub use error::MetaError;
pub use namespace::{Found, MetaOp, MetaReply, Mutation};
pub use shards::Coordinator;
pub use store::{MetaStore, StoreOptions, TargetChoice};
