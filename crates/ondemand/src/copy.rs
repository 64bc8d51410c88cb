//! `odfs cp`: parallel copy of files and trees into, out of and within odfs through the client
//! library (no mount needed). Directories are made first, files then copied by many tasks at
//! once; modes and modification times are kept. `SRC/.` copies what SRC holds into DST, as
//! cp(1) does.

use crate::fsref::Location;
use anyhow::{bail, Context, Result};
use odfs_client::{Client, Ctx};
use odfs_proto::meta::{FileKind, SetAttr, SetTime};
use odfs_proto::{ErrorCode, InodeId, Timespec};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Bytes moved per read/write call.
const PIECE: usize = 4 << 20;

#[derive(Debug, Clone)]
pub struct CopyOptions {
    pub recursive: bool,
    /// Files copied at once.
    pub parallel: usize,
    /// Show a progress bar (on a terminal).
    pub progress: bool,
}

#[derive(Debug, Default, Clone, Copy)]
pub struct CopyStats {
    pub files: u64,
    pub links: u64,
    pub dirs: u64,
    pub bytes: u64,
    /// FIFOs, sockets and device nodes: not copied (their I/O is not data).
    pub special: u64,
}

#[derive(Debug, Clone)]
struct Item {
    src: Location,
    dst: Location,
    kind: FileKind,
    mode: u32,
    mtime: Timespec,
    size: u64,
}

fn join(loc: &Location, name: &str) -> Location {
    match loc {
        Location::Odfs(p) => Location::Odfs(format!("{}/{}", p.trim_end_matches('/'), name)),
        Location::Local(p) => Location::Local(p.join(name)),
    }
}

fn base_name(loc: &Location) -> Option<String> {
    match loc {
        Location::Odfs(p) => p.trim_end_matches('/').rsplit('/').next().filter(|s| !s.is_empty()).map(String::from),
        Location::Local(p) => p.file_name().map(|n| n.to_string_lossy().into_owned()),
    }
}

struct Stat {
    kind: FileKind,
    mode: u32,
    mtime: Timespec,
    size: u64,
}

async fn stat(client: &Client, ctx: &Ctx, loc: &Location) -> Result<Option<Stat>> {
    match loc {
        Location::Odfs(p) => match client.resolve(ctx, p, true).await {
            Ok(a) => Ok(Some(Stat { kind: a.kind, mode: a.mode, mtime: a.mtime, size: a.size })),
            Err(e) if e.code() == ErrorCode::NotFound => Ok(None),
            Err(e) => Err(e).with_context(|| format!("odfs:{p}")),
        },
        Location::Local(p) => match std::fs::symlink_metadata(p) {
            Ok(m) => {
                let kind = crate::fsref::local_kind(m.file_type());
                let mtime = Timespec { sec: m.mtime(), nsec: m.mtime_nsec() as u32 };
                Ok(Some(Stat { kind, mode: m.permissions().mode() & 0o7777, mtime, size: m.len() }))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).with_context(|| format!("{}", p.display())),
        },
    }
}

async fn list(client: &Client, ctx: &Ctx, loc: &Location) -> Result<Vec<(String, Stat)>> {
    match loc {
        Location::Odfs(p) => {
            let dir = client.resolve(ctx, p, true).await?;
            let entries = client.readdir_all(ctx, dir.ino, true).await?;
            Ok(entries
                .into_iter()
                .filter_map(|e| {
                    let a = e.attr?;
                    Some((
                        String::from_utf8_lossy(&e.name).into_owned(),
                        Stat { kind: a.kind, mode: a.mode, mtime: a.mtime, size: a.size },
                    ))
                })
                .collect())
        }
        Location::Local(p) => {
            let mut out = Vec::new();
            for e in std::fs::read_dir(p).with_context(|| format!("cannot list {}", p.display()))? {
                let e = e?;
                let name = e.file_name().to_string_lossy().into_owned();
                if let Some(s) = stat(client, ctx, &Location::Local(e.path())).await? {
                    out.push((name, s));
                }
            }
            Ok(out)
        }
    }
}

/// Copies `src` to `dst` (either may be `odfs:`; at least one must be).
pub async fn copy(client: &Client, src: &str, dst: &str, opts: &CopyOptions) -> Result<CopyStats> {
    let ctx = Ctx::current();
    let top = resolve_pair(client, &ctx, src, dst, opts).await?;
    let (dirs, mut files) = walk(client, &ctx, top).await?;
    let mut stats = CopyStats::default();
    let before = files.len();
    files.retain(|f| !f.kind.is_special());
    stats.special = (before - files.len()) as u64;
    for d in &dirs {
        make_dir(client, &ctx, &d.dst, d.mode).await?;
        stats.dirs += 1;
    }
    // Largest first so a big file does not start last.
    files.sort_by_key(|f| std::cmp::Reverse(f.size));
    copy_files(client, &ctx, files, opts, &mut stats).await?;
    // Directory times last: creating entries changed them.
    for d in dirs.iter().rev() {
        set_times(client, &ctx, &d.dst, d.mode, d.mtime).await?;
    }
    Ok(stats)
}

/// The top item: the source, and the destination it lands at (inside an existing directory
/// the source keeps its name; `SRC/.` copies what is in SRC into DST itself, as cp(1) does).
async fn resolve_pair(client: &Client, ctx: &Ctx, src: &str, dst: &str, opts: &CopyOptions) -> Result<Item> {
    let contents_only = src == "." || src.ends_with("/.");
    let src = Location::parse(src);
    let mut dst = Location::parse(dst);
    if matches!((&src, &dst), (Location::Local(_), Location::Local(_))) {
        bail!("one side of odfs cp must be inside odfs (odfs:/path)");
    }
    let Some(top) = stat(client, ctx, &src).await? else { bail!("{src}: no such file or directory") };
    if top.kind == FileKind::Dir && !opts.recursive {
        bail!("{src} is a directory (use -r)");
    }
    if let Some(d) = stat(client, ctx, &dst).await? {
        if d.kind == FileKind::Dir && !(contents_only && top.kind == FileKind::Dir) {
            let name = base_name(&src).context("source has no name")?;
            dst = join(&dst, &name);
        }
    }
    Ok(Item { src, dst, kind: top.kind, mode: top.mode, mtime: top.mtime, size: top.size })
}

/// Walks the source: directories in creation order, and files (and links).
async fn walk(client: &Client, ctx: &Ctx, top: Item) -> Result<(Vec<Item>, Vec<Item>)> {
    let mut dirs = Vec::new();
    let mut files = Vec::new();
    let mut queue = vec![top];
    while let Some(it) = queue.pop() {
        if it.kind != FileKind::Dir {
            files.push(it);
            continue;
        }
        for (name, s) in list(client, ctx, &it.src).await? {
            queue.push(Item {
                src: join(&it.src, &name),
                dst: join(&it.dst, &name),
                kind: s.kind,
                mode: s.mode,
                mtime: s.mtime,
                size: s.size,
            });
        }
        dirs.push(it);
    }
    Ok((dirs, files))
}

/// A progress bar for `total` bytes, or a hidden one.
fn progress_bar(total: u64, shown: bool) -> indicatif::ProgressBar {
    if !shown {
        return indicatif::ProgressBar::hidden();
    }
    let b = indicatif::ProgressBar::new(total);
    b.set_style(
        indicatif::ProgressStyle::with_template(
            "{bytes}/{total_bytes} {wide_bar} {binary_bytes_per_sec} eta {eta} {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    b
}

/// Copies the files, `opts.parallel` at once; the first error is returned after the others
/// have finished.
async fn copy_files(
    client: &Client,
    ctx: &Ctx,
    files: Vec<Item>,
    opts: &CopyOptions,
    stats: &mut CopyStats,
) -> Result<()> {
    let bar = progress_bar(files.iter().map(|f| f.size).sum(), opts.progress);
    let nfiles = files.len();
    let sem = Arc::new(tokio::sync::Semaphore::new(opts.parallel.max(1)));
    let mut tasks = tokio::task::JoinSet::new();
    for f in files {
        let permit = sem.clone().acquire_owned().await.expect("semaphore never closes");
        let (client, ctx) = (client.clone(), ctx.clone());
        tasks.spawn(async move {
            let r = copy_item(&client, &ctx, &f).await.with_context(|| format!("{} -> {}", f.src, f.dst));
            drop(permit);
            r.map(|n| (f.kind, n))
        });
    }
    let mut first_err = None;
    while let Some(r) = tasks.join_next().await {
        match r? {
            Ok((kind, n)) => {
                if kind == FileKind::Symlink {
                    stats.links += 1;
                } else {
                    stats.files += 1;
                }
                stats.bytes += n;
                bar.inc(n);
                bar.set_message(format!("{}/{nfiles} files", stats.files + stats.links));
            }
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    bar.finish_and_clear();
    first_err.map_or(Ok(()), Err)
}

async fn make_dir(client: &Client, ctx: &Ctx, loc: &Location, mode: u32) -> Result<()> {
    match loc {
        Location::Odfs(p) => {
            client.mkdir_all(ctx, p, mode | 0o700).await?;
        }
        Location::Local(p) => std::fs::create_dir_all(p).with_context(|| format!("cannot create {}", p.display()))?,
    }
    Ok(())
}

async fn set_times(client: &Client, ctx: &Ctx, loc: &Location, mode: u32, mtime: Timespec) -> Result<()> {
    match loc {
        Location::Odfs(p) => {
            let a = client.resolve(ctx, p, false).await?;
            set_inode_times(client, ctx, a.ino, mode, mtime).await?;
        }
        Location::Local(p) => set_local_times(p, mode, mtime)?,
    }
    Ok(())
}

async fn set_inode_times(client: &Client, ctx: &Ctx, ino: InodeId, mode: u32, mtime: Timespec) -> Result<()> {
    let set = SetAttr { ino, mode: Some(mode), mtime: Some(SetTime::At(mtime)), ..Default::default() };
    client.setattr(ctx, set).await?;
    Ok(())
}

fn set_local_times(p: &Path, mode: u32, mtime: Timespec) -> Result<()> {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode))?;
    let ts = nix::sys::time::TimeSpec::new(mtime.sec, mtime.nsec as i64);
    nix::sys::stat::utimensat(None, p, &ts, &ts, nix::sys::stat::UtimensatFlags::NoFollowSymlink)?;
    Ok(())
}

async fn copy_item(client: &Client, ctx: &Ctx, it: &Item) -> Result<u64> {
    if it.kind == FileKind::Symlink {
        let target: Vec<u8> = match &it.src {
            Location::Odfs(p) => {
                let a = client.resolve(ctx, p, false).await?;
                client.readlink(ctx, a.ino).await?
            }
            Location::Local(p) => std::fs::read_link(p)?.as_os_str().as_bytes().to_vec(),
        };
        match &it.dst {
            Location::Odfs(p) => {
                let (parent, name) = client.resolve_parent(ctx, p).await?;
                client.symlink(ctx, parent.ino, &name, &target).await?;
            }
            Location::Local(p) => {
                std::os::unix::fs::symlink(std::ffi::OsStr::from_bytes(&target), p)?;
            }
        }
        return Ok(0);
    }
    let mut off = 0u64;
    match (&it.src, &it.dst) {
        (Location::Local(_), Location::Local(_)) => bail!("one side must be inside odfs"),
        (Location::Local(s), dst) => {
            let mut f = tokio::fs::File::open(s).await?;
            let mut sink = Sink::open(client, ctx, dst, it.mode).await?;
            // Sized to the file: a tree of small files must not zero 4 MiB for each.
            let mut buf = vec![0u8; (it.size as usize).saturating_add(1).min(PIECE)];
            loop {
                let n = read_full(&mut f, &mut buf).await?;
                if n == 0 {
                    break;
                }
                sink.write(off, &buf[..n]).await?;
                off += n as u64;
            }
            sink.finish(client, ctx, it.mode, it.mtime).await?;
        }
        (Location::Odfs(s), dst) => {
            let a = client.resolve(ctx, s, true).await?;
            let h = client.open(ctx, a.ino, true, false, false).await?;
            let mut sink = Sink::open(client, ctx, dst, it.mode).await?;
            loop {
                let data = h.read(off, PIECE as u32).await?;
                if data.is_empty() {
                    break;
                }
                sink.write(off, &data).await?;
                off += data.len() as u64;
            }
            h.close().await?;
            sink.finish(client, ctx, it.mode, it.mtime).await?;
        }
    }
    Ok(off)
}

async fn read_full(f: &mut tokio::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        let m = f.read(&mut buf[n..]).await?;
        if m == 0 {
            break;
        }
        n += m;
    }
    Ok(n)
}

/// Where a copied file's bytes go; `finish` gives it the source's mode and modification time.
enum Sink {
    Local(tokio::fs::File, PathBuf),
    /// The open file and its inode (known from the create: its times need no lookup by path).
    Odfs(odfs_client::FileHandle, InodeId),
}

impl Sink {
    async fn open(client: &Client, ctx: &Ctx, dst: &Location, mode: u32) -> Result<Sink> {
        Ok(match dst {
            Location::Local(p) => Sink::Local(
                tokio::fs::File::create(p).await.with_context(|| format!("cannot create {}", p.display()))?,
                p.clone(),
            ),
            Location::Odfs(p) => {
                let (parent, name) = client.resolve_parent(ctx, p).await?;
                let (made, h) = client.create_open(ctx, parent.ino, &name, mode | 0o200, false, None).await?;
                if !made.created {
                    h.truncate(0).await?;
                }
                Sink::Odfs(h, made.attr.ino)
            }
        })
    }

    async fn write(&mut self, off: u64, data: &[u8]) -> Result<()> {
        match self {
            Sink::Local(f, _) => f.write_all(data).await?,
            Sink::Odfs(h, _) => {
                h.write(off, data).await?;
            }
        }
        Ok(())
    }

    async fn finish(self, client: &Client, ctx: &Ctx, mode: u32, mtime: Timespec) -> Result<()> {
        match self {
            Sink::Local(mut f, p) => {
                f.flush().await.with_context(|| format!("cannot write {}", p.display()))?;
                drop(f);
                set_local_times(&p, mode, mtime)?;
            }
            Sink::Odfs(h, ino) => {
                h.close().await?;
                set_inode_times(client, ctx, ino, mode, mtime).await?;
            }
        }
        Ok(())
    }
}
