//! Path-based helpers over the inode API, for the CLI and stage agents.

use crate::{Client, ClientError, Ctx, Result};
use odfs_proto::meta::{Attr, FileKind};
use odfs_proto::{ErrorCode, InodeId};

/// Longest chain of symbolic links followed in one path walk (as Linux).
const MAX_SYMLINKS: usize = 40;

/// The components of an absolute path inside the filesystem; "." dropped, ".." resolved
/// lexically (odfs paths given to the CLI are not mounted paths).
pub fn components(path: &str) -> Result<Vec<Vec<u8>>> {
    let mut out: Vec<Vec<u8>> = Vec::new();
    for c in path.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                out.pop();
            }
            c => out.push(c.as_bytes().to_vec()),
        }
    }
    Ok(out)
}

impl Client {
    /// Resolves a path to its attributes; symbolic links in the middle are followed, the last
    /// component only with `follow`.
    pub async fn resolve(&self, ctx: &Ctx, path: &str, follow: bool) -> Result<Attr> {
        let mut todo: Vec<Vec<u8>> = components(path)?;
        todo.reverse();
        let mut stack: Vec<Attr> = vec![self.getattr(ctx, InodeId::ROOT).await?];
        let mut links = 0;
        while let Some(name) = todo.pop() {
            let cur = stack.last().expect("root stays").clone();
            if cur.kind != FileKind::Dir {
                return Err(ErrorCode::NotDir.into());
            }
            let next = self.lookup(ctx, cur.ino, &name).await?;
            let last = todo.is_empty();
            if next.kind == FileKind::Symlink && (!last || follow) {
                links += 1;
                if links > MAX_SYMLINKS {
                    return Err(ClientError::new(ErrorCode::Invalid, "too many levels of symbolic links"));
                }
                let target = String::from_utf8_lossy(&self.readlink(ctx, next.ino).await?).into_owned();
                if target.starts_with('/') {
                    stack.truncate(1);
                }
                let mut more = components(&target)?;
                // ".." inside a link target climbs from the link's directory.
                more.reverse();
                for m in more {
                    todo.push(m);
                }
                continue;
            }
            stack.push(next);
        }
        Ok(stack.pop().expect("non-empty"))
    }

    /// The parent directory of `path` and the last component's name.
    pub async fn resolve_parent(&self, ctx: &Ctx, path: &str) -> Result<(Attr, Vec<u8>)> {
        let mut comps = components(path)?;
        let name = comps.pop().ok_or_else(|| ClientError::new(ErrorCode::Invalid, "the root has no parent"))?;
        let parent_path = String::from_utf8_lossy(&comps.join(&b'/')).into_owned();
        let parent = self.resolve(ctx, &format!("/{parent_path}"), true).await?;
        if parent.kind != FileKind::Dir {
            return Err(ErrorCode::NotDir.into());
        }
        Ok((parent, name))
    }

    /// Creates a directory and any missing parents; existing directories are fine.
    pub async fn mkdir_all(&self, ctx: &Ctx, path: &str, mode: u32) -> Result<Attr> {
        let mut cur = self.getattr(ctx, InodeId::ROOT).await?;
        for c in components(path)? {
            cur = match self.lookup(ctx, cur.ino, &c).await {
                Ok(a) if a.kind == FileKind::Dir => a,
                Ok(_) => return Err(ErrorCode::NotDir.into()),
                Err(e) if e.code() == ErrorCode::NotFound => match self.mkdir(ctx, cur.ino, &c, mode).await {
                    Ok(a) => a,
                    Err(e) if e.code() == ErrorCode::Exists => self.lookup(ctx, cur.ino, &c).await?,
                    Err(e) => return Err(e),
                },
                Err(e) => return Err(e),
            };
        }
        Ok(cur)
    }
}
