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
use odfs_proto::{ErrorCode, InodeId};

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

    /// The top of the sealed tree that holds `path` — or, when `path` does not exist yet, the
    /// directory it would be made in — as a path from the root (`/ds`); None when that is not
    /// sealed. The top is the highest directory on the way down from which every inode is
    /// sealed: what `odfs unseal` takes to make `path` writable again. For commands that name
    /// the tree when they refuse (metad's refusal names an inode).
    pub async fn sealed_tree(&self, ctx: &Ctx, path: &str) -> Result<Option<String>> {
        let names = crate::path::components(path)?;
        let mut cur = self.getattr(ctx, InodeId::ROOT).await?;
        // Components from the root to the top of the run of sealed inodes ending at `cur`.
        let mut top = cur.sealed.then_some(0);
        for (i, name) in names.iter().enumerate() {
            if cur.kind != FileKind::Dir {
                break;
            }
            cur = match self.lookup(ctx, cur.ino, name).await {
                Ok(a) => a,
                Err(e) if e.code() == ErrorCode::NotFound => break,
                Err(e) => return Err(e),
            };
            top = if cur.sealed { top.or(Some(i + 1)) } else { None };
        }
        Ok(top.map(|n| {
            let parts: Vec<String> = names[..n].iter().map(|c| String::from_utf8_lossy(c).into_owned()).collect();
            format!("/{}", parts.join("/"))
        }))
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
