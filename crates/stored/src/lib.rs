//! odfs storage daemon library: chunk files on local targets.
//!
//! A file has one chunk file per target of its layout; this crate stores those chunk files and
//! serves reads, writes, truncation, sync, removal and space reports on them. [`ChunkStore`] is
//! the whole engine: data goes through io_uring (one ring per target, driven by the runtime's
//! own worker threads, no ring thread: see `uring`) with a plain pread/pwrite fallback where
//! io_uring cannot be set up. The RPC service, configuration and the binary sit on top of this
//! API and live in their own modules.

pub mod chunk_store;
pub mod config;
pub mod error;
mod fd_cache;
mod precreate;
mod recycle;
pub mod service;
mod syscall;
mod uring;

pub use chunk_store::{ChunkStore, IoBackend, StoreOptions, TargetConfig, MAX_OP_BYTES};
pub use error::StoreError;
