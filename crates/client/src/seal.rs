//! Sealed trees: sealing and unsealing a whole tree, inode by inode from its top, for
//! `odfs seal`/`unseal`, the `odfs.sealed` virtual attribute and stage-in's `--seal`.
//!
//! Top-down is what makes a seal whole: a directory is sealed before it is listed, so no name
//! can be added behind the walk. A striped directory is sealed on each shard holding a part of
//! it (each part takes its own creates). The rule itself — a sealed inode refuses every change
//! with EROFS — is metad's.

use crate::{Client, Ctx, Result};
use futures::{stream, StreamExt, TryStreamExt};
use odfs_proto::meta::{Attr, FileKind, SetSealed};
use odfs_proto::InodeId;

/// Inodes sealed at once while walking a directory.
const SEAL_CONCURRENCY: usize = 64;

impl Client {
    /// Seals (or unseals) one inode, and every part of a striped directory.
    pub async fn set_sealed(&self, ctx: &Ctx, ino: InodeId, sealed: bool) -> Result<Attr> {
        let a = self.change_attr(ctx, ino.shard(), ino, &SetSealed { ino, sealed }).await?;
        for &s in a.dir_stripes.iter().filter(|&&s| s != ino.shard()) {
            self.meta(ctx, s, &SetSealed { ino, sealed }).await?;
        }
        Ok(a)
    }

    /// Seals (or unseals) the tree at `path` (`odfs seal odfs:/PATH`, stage-in's `--seal`).
    pub async fn seal_path(&self, ctx: &Ctx, path: &str, sealed: bool) -> Result<u64> {
        let top = self.resolve(ctx, path, false).await?;
        self.seal_tree(ctx, top.ino, sealed).await
    }

    /// Seals (or unseals) `top` and everything below it; returns the inodes it set.
    pub async fn seal_tree(&self, ctx: &Ctx, top: InodeId, sealed: bool) -> Result<u64> {
        let a = self.set_sealed(ctx, top, sealed).await?;
        let mut count = 1;
        let mut dirs = if a.kind == FileKind::Dir { vec![top] } else { Vec::new() };
        while let Some(dir) = dirs.pop() {
            let entries = self.readdir_all(ctx, dir, false).await?;
            let set: Vec<Attr> = stream::iter(entries)
                .map(|e| self.set_sealed(ctx, e.ino, sealed))
                .buffer_unordered(SEAL_CONCURRENCY)
                .try_collect()
                .await?;
            count += set.len() as u64;
            dirs.extend(set.iter().filter(|a| a.kind == FileKind::Dir).map(|a| a.ino));
        }
        Ok(count)
    }
}
