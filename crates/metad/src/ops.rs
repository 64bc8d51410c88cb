//! One file per namespace mutation, each an `impl Namespace` block: validate → resolve → check
//! permission → change the state. [`crate::namespace::Namespace::apply`] dispatches to them;
//! the checks several of them share live in `namespace`.
//!
//! - `create`, `mkdir`, `mknod`, `symlink`, `link`: new entries.
//! - `unlink`, `rmdir`, `rename`: entries removed or moved.
//! - `setattr`: modes, owners, sizes, times; the size a writer publishes; the root's owner.
//! - `xattr`: extended attributes.
//! - `layout`: a directory's default layout, an empty file's layout.
//! - `seal`: sealed trees, and the one check that keeps them unchanged.
//! - `stripe`: the parts of a directory striped over metadata shards.
//! - `steps`: one shard's steps of an operation spanning shards, and the coordinator's intents.

mod create;
mod layout;
mod link;
mod mkdir;
mod mknod;
mod rename;
mod rmdir;
mod seal;
mod setattr;
mod steps;
mod stripe;
mod symlink;
mod unlink;
mod xattr;
