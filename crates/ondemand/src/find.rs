//! `odfs find`: a parallel walk that prints the paths matching a few find(1) tests. Through
//! the client library (`odfs:/PATH`, or a path in a mount when the filesystem's client config
//! is at hand) it lists many directories at once with readdirplus, so every entry's attributes
//! come with its name and nothing is asked twice — the IO500 find phase. Without the library
//! (a user who only has the mount) it walks the mount with several threads instead.
//!
//! Tests: `-name GLOB` (the last component, shell pattern), `-type f|d|l`, `-size [+-]N[ckMG]`
//! (as find: rounded up to the unit; 512-byte blocks without a unit), `-newer FILE`, and odfs's
//! own `--stripe-count N` and `--pool P` (regular files by their layout). All tests must hold.

use crate::lfs::mount_of;
use anyhow::{bail, Context, Result};
use futures::stream::{FuturesUnordered, StreamExt};
use odfs_client::{Client, Ctx};
use odfs_proto::meta::{Attr, DirEntry, FileKind};
use odfs_proto::{InodeId, Timespec};
use std::collections::VecDeque;
use std::io::Write;
use std::path::Path;

/// Directories listed at once.
const PARALLEL: usize = 32;

/// `-name` as find(1) matches: `*` also matches a leading dot.
const NAME_MATCH: glob::MatchOptions =
    glob::MatchOptions { case_sensitive: true, require_literal_separator: true, require_literal_leading_dot: false };

/// `-size`: compare the size, rounded up to `unit`, with `n`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SizeTest {
    pub cmp: std::cmp::Ordering,
    pub n: u64,
    pub unit: u64,
}

impl SizeTest {
    /// `+1M`, `-10k`, `100c`, `8` (512-byte blocks).
    pub fn parse(s: &str) -> Result<SizeTest, String> {
        let (cmp, rest) = match s.as_bytes().first() {
            Some(b'+') => (std::cmp::Ordering::Greater, &s[1..]),
            Some(b'-') => (std::cmp::Ordering::Less, &s[1..]),
            _ => (std::cmp::Ordering::Equal, s),
        };
        let (num, unit) = match rest.chars().last() {
            Some('c') => (&rest[..rest.len() - 1], 1),
            Some('w') => (&rest[..rest.len() - 1], 2),
            Some('b') => (&rest[..rest.len() - 1], 512),
            Some('k') => (&rest[..rest.len() - 1], 1 << 10),
            Some('M') => (&rest[..rest.len() - 1], 1 << 20),
            Some('G') => (&rest[..rest.len() - 1], 1 << 30),
            _ => (rest, 512),
        };
        let n = num.parse().map_err(|_| format!("-size {s:?}: expected [+-]N[ckMG]"))?;
        Ok(SizeTest { cmp, n, unit })
    }

    pub fn matches(&self, size: u64) -> bool {
        size.div_ceil(self.unit).cmp(&self.n) == self.cmp
    }
}

/// The tests of one `odfs find`.
#[derive(Debug, Clone, Default)]
pub struct Tests {
    pub name: Option<glob::Pattern>,
    pub kind: Option<FileKind>,
    pub size: Option<SizeTest>,
    /// Modified after this time.
    pub newer: Option<Timespec>,
    pub stripe_count: Option<usize>,
    pub pool: Option<String>,
}

impl Tests {
    /// Parses the command line's values.
    pub fn new(
        name: Option<&str>,
        kind: Option<&str>,
        size: Option<&str>,
        newer: Option<Timespec>,
        stripe_count: Option<usize>,
        pool: Option<String>,
    ) -> Result<Tests> {
        let name = name.map(|n| glob::Pattern::new(n).map_err(|e| anyhow::anyhow!("-name {n:?}: {e}"))).transpose()?;
        let kind = match kind {
            None => None,
            Some("f") => Some(FileKind::File),
            Some("d") => Some(FileKind::Dir),
            Some("l") => Some(FileKind::Symlink),
            Some("p") => Some(FileKind::Fifo),
            Some("s") => Some(FileKind::Socket),
            Some("c") => Some(FileKind::CharDev),
            Some("b") => Some(FileKind::BlockDev),
            Some(o) => bail!("-type {o}: use f, d, l, p, s, c or b"),
        };
        let size = size.map(SizeTest::parse).transpose().map_err(anyhow::Error::msg)?;
        Ok(Tests { name, kind, size, newer, stripe_count, pool })
    }

    /// Whether the layout tests need a file's layout.
    fn wants_layout(&self) -> bool {
        self.stripe_count.is_some() || self.pool.is_some()
    }

    /// Whether any test needs more than an entry's name and type (readdir without attributes
    /// is enough otherwise, as it is for GNU find).
    fn wants_attrs(&self) -> bool {
        self.size.is_some() || self.newer.is_some() || self.wants_layout()
    }

    /// The tests that need only a name and a type.
    fn matches_name(&self, name: &str, kind: FileKind) -> bool {
        self.name.as_ref().is_none_or(|p| p.matches_with(name, NAME_MATCH)) && self.kind.is_none_or(|k| k == kind)
    }

    fn matches(&self, name: &str, a: &Attr) -> bool {
        if !self.matches_name(name, a.kind) {
            return false;
        }
        if self.size.is_some_and(|s| !s.matches(a.size)) {
            return false;
        }
        if self.newer.is_some_and(|t| (a.mtime.sec, a.mtime.nsec) <= (t.sec, t.nsec)) {
            return false;
        }
        if self.wants_layout() {
            let Some(l) = a.layout.as_ref().filter(|_| a.kind == FileKind::File) else { return false };
            if self.stripe_count.is_some_and(|n| n != l.targets.len())
                || self.pool.as_ref().is_some_and(|p| *p != l.pool)
            {
                return false;
            }
        }
        true
    }
}

/// Walks `top` (an odfs path; `show` is how paths are printed) through the library, writing
/// matches to `out`. Returns the number of entries seen.
pub async fn walk_lib(client: &Client, top: &str, show: &str, t: &Tests, out: &mut dyn Write) -> Result<u64> {
    let ctx = Ctx::current();
    let root = client.resolve(&ctx, top, true).await.map_err(|e| anyhow::anyhow!("{show}: {e}"))?;
    let mut seen = 1;
    let base = show.trim_end_matches('/').to_string();
    let top_name = base.rsplit('/').next().unwrap_or("").to_string();
    if t.matches(&top_name, &root) {
        writeln!(out, "{show}")?;
    }
    if root.kind != FileKind::Dir {
        return Ok(seen);
    }
    let mut queue: VecDeque<(String, InodeId)> = VecDeque::from([(base, root.ino)]);
    let mut pending = FuturesUnordered::new();
    loop {
        while pending.len() < PARALLEL {
            let Some((path, ino)) = queue.pop_front() else { break };
            let ctx = ctx.clone();
            let plus = t.wants_attrs();
            pending.push(async move {
                let r = list_with_attrs(client, &ctx, &path, ino, plus).await;
                (path, r)
            });
        }
        let Some((path, r)) = pending.next().await else { break };
        let entries = r?;
        for e in entries {
            if e.name == b"." || e.name == b".." {
                continue;
            }
            seen += 1;
            let name = String::from_utf8_lossy(&e.name);
            let p = format!("{path}/{name}");
            let hit = if t.wants_attrs() {
                e.attr.as_ref().is_some_and(|a| t.matches(&name, a))
            } else {
                t.matches_name(&name, e.kind)
            };
            if hit {
                writeln!(out, "{p}")?;
            }
            if e.kind == FileKind::Dir {
                queue.push_back((p, e.ino));
            }
        }
    }
    Ok(seen)
}

/// The entries of directory `ino` (at `path`), each with its attributes when `plus`. The
/// attributes a listing lacks are asked for here, inside the listing's own future, not
/// awaited while other listings wait unpolled (see "Connections are made in tasks of their
/// own" in docs/architecture.md).
async fn list_with_attrs(client: &Client, ctx: &Ctx, path: &str, ino: InodeId, plus: bool) -> Result<Vec<DirEntry>> {
    let mut entries = client.list_dir(ctx, ino, plus).await.map_err(|e| anyhow::anyhow!("{path}: {e}"))?;
    if plus {
        for e in entries.iter_mut().filter(|e| e.attr.is_none() && e.name != b"." && e.name != b"..") {
            let name = String::from_utf8_lossy(&e.name).into_owned();
            e.attr = Some(client.getattr(ctx, e.ino).await.map_err(|err| anyhow::anyhow!("{path}/{name}: {err}"))?);
        }
    }
    Ok(entries)
}

/// The attributes a walk through the mount gives the tests.
fn attr_of(p: &Path, m: &std::fs::Metadata, t: &Tests) -> Attr {
    use std::os::unix::fs::MetadataExt;
    let kind = crate::fsref::local_kind(m.file_type());
    let layout = (t.wants_layout() && kind == FileKind::File)
        .then(|| crate::lfs::get_xattr(p, odfs_client::vxattr::LAYOUT).ok())
        .flatten()
        .and_then(|text| {
            let f = crate::lfs::kv(&String::from_utf8_lossy(&text));
            let value = |k: &str| Some(crate::lfs::field(&f, k)).filter(|v| !v.is_empty());
            let targets = value("targets")?.split(',').filter_map(|x| x.parse().ok()).collect();
            Some(odfs_proto::Layout {
                chunk_size: value("stripe_size")?.parse().ok()?,
                pool: value("pool")?.to_string(),
                targets,
            })
        });
    Attr {
        ino: InodeId(m.ino()),
        kind,
        mode: m.mode() & 0o7777,
        nlink: m.nlink() as u32,
        uid: m.uid(),
        gid: m.gid(),
        size: m.size(),
        atime: Timespec { sec: m.atime(), nsec: m.atime_nsec() as u32 },
        mtime: Timespec { sec: m.mtime(), nsec: m.mtime_nsec() as u32 },
        ctime: Timespec { sec: m.ctime(), nsec: m.ctime_nsec() as u32 },
        layout,
        dir_stripes: Vec::new(),
        rdev: m.rdev() as u32,
        sealed: false,
    }
}

/// Walks a directory of a mount with several threads (for users without the library).
pub fn walk_mount(top: &Path, t: &Tests, out: &mut dyn Write) -> Result<u64> {
    use std::sync::{Arc, Condvar, Mutex};
    let m = std::fs::symlink_metadata(top).with_context(|| format!("{}", top.display()))?;
    let top_name = top.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    if t.matches(&top_name, &attr_of(top, &m, t)) {
        writeln!(out, "{}", top.display())?;
    }
    if !m.is_dir() {
        return Ok(1);
    }
    // (queue, directories being listed); the walk ends when both are empty.
    let state = Arc::new((Mutex::new((VecDeque::from([top.to_path_buf()]), 0usize)), Condvar::new()));
    let found = Arc::new(Mutex::new((Vec::<String>::new(), 1u64, None::<String>)));
    std::thread::scope(|s| {
        for _ in 0..PARALLEL.min(16) {
            let (state, found) = (state.clone(), found.clone());
            s.spawn(move || loop {
                let dir = {
                    let (lock, cv) = &*state;
                    let mut g = lock.lock().expect("walk lock");
                    loop {
                        if let Some(d) = g.0.pop_front() {
                            g.1 += 1;
                            break d;
                        }
                        if g.1 == 0 {
                            cv.notify_all();
                            return;
                        }
                        g = cv.wait(g).expect("walk lock");
                    }
                };
                let mut hits = Vec::new();
                let mut subdirs = Vec::new();
                let mut n = 0;
                let r = std::fs::read_dir(&dir).map(|rd| {
                    for e in rd.flatten() {
                        n += 1;
                        let p = e.path();
                        let name = e.file_name().to_string_lossy().into_owned();
                        // The type comes with the entry; attributes (an lstat, perhaps the
                        // layout) only for a name that passed and a test that needs them.
                        let Ok(ft) = e.file_type() else { continue };
                        let kind = crate::fsref::local_kind(ft);
                        let hit = t.matches_name(&name, kind)
                            && (!t.wants_attrs() || e.metadata().is_ok_and(|m| t.matches(&name, &attr_of(&p, &m, t))));
                        if hit {
                            hits.push(p.display().to_string());
                        }
                        if ft.is_dir() {
                            subdirs.push(p);
                        }
                    }
                });
                {
                    let mut f = found.lock().expect("found lock");
                    f.0.extend(hits);
                    f.1 += n;
                    if let Err(e) = r {
                        f.2.get_or_insert(format!("{}: {e}", dir.display()));
                    }
                }
                let (lock, cv) = &*state;
                let mut g = lock.lock().expect("walk lock");
                g.0.extend(subdirs);
                g.1 -= 1;
                cv.notify_all();
            });
        }
    });
    let (hits, seen, err) = std::mem::take(&mut *found.lock().expect("found lock"));
    if let Some(e) = err {
        bail!(e);
    }
    for h in hits {
        writeln!(out, "{h}")?;
    }
    Ok(seen)
}

/// `odfs find PATH`: through the library when it can (`odfs:/PATH`; or a mount path and a
/// client config), else through the mount.
pub async fn find(path: &str, fs: Option<&Path>, t: &Tests, out: &mut dyn Write) -> Result<u64> {
    let p = match crate::fsref::Location::parse(path) {
        crate::fsref::Location::Odfs(top) => {
            let client = crate::fsref::connect(fs).await?;
            let r = walk_lib(&client, &top, path, t, out).await;
            client.close().await;
            return r;
        }
        crate::fsref::Location::Local(p) => p,
    };
    let mount =
        mount_of(&p).with_context(|| format!("{path} is not in an odfs mount (or name odfs:/PATH with --fs)"))?;
    let has_config = fs.is_some() || std::env::var_os("ODFS_FS").is_some();
    if has_config {
        if let Ok(client) = crate::fsref::connect(fs).await {
            let abs = std::path::absolute(&p)?;
            let rel = abs.strip_prefix(&mount).unwrap_or(Path::new(""));
            let top = format!("/{}", rel.display());
            let r = walk_lib(&client, &top, path, t, out).await;
            client.close().await;
            return r;
        }
    }
    walk_mount(&p, t, out)
}

/// `odfs find`'s command line after its PATH, find(1)-style: `-name GLOB`, `-type f|d|l`,
/// `-size [+-]N[ckMG]`, `-newer FILE`, `--stripe-count N`, `--pool P`.
pub async fn parse_tests(args: &[String], fs: Option<&Path>) -> Result<Tests> {
    let mut it = args.iter();
    let (mut name, mut kind, mut size, mut newer, mut count, mut pool) = (None, None, None, None, None, None);
    while let Some(a) = it.next() {
        let mut value = || it.next().cloned().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "-name" => name = Some(value()?),
            "-type" => kind = Some(value()?),
            "-size" => size = Some(value()?),
            "-newer" => {
                let f = value()?;
                let t = if let Some(p) = f.strip_prefix("odfs:") {
                    let client = crate::fsref::connect(fs).await?;
                    let a = client.resolve(&Ctx::current(), p, true).await.map_err(|e| anyhow::anyhow!("-newer {f}: {e}"))?;
                    client.close().await;
                    a.mtime
                } else {
                    use std::os::unix::fs::MetadataExt;
                    let m = std::fs::metadata(&f).with_context(|| format!("-newer {f}"))?;
                    Timespec { sec: m.mtime(), nsec: m.mtime_nsec() as u32 }
                };
                newer = Some(t);
            }
            "--stripe-count" | "-stripe-count" | "--stripe_count" => {
                let v = value()?;
                count = Some(v.parse().with_context(|| format!("--stripe-count {v:?} is not a number"))?);
            }
            "--pool" | "-pool" => pool = Some(value()?),
            other => bail!("unknown test {other:?} (odfs find PATH [-name GLOB] [-type f|d|l] [-size [+-]N[ckMG]] [-newer FILE] [--stripe-count N] [--pool P])"),
        }
    }
    Tests::new(name.as_deref(), kind.as_deref(), size.as_deref(), newer, count, pool)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_tests_round_up_like_find() {
        let t = SizeTest::parse("+1M").unwrap();
        assert!(!t.matches(1 << 20) && t.matches((1 << 20) + 1));
        let t = SizeTest::parse("-1k").unwrap();
        assert!(t.matches(0) && !t.matches(1), "find -size -1k matches only empty files");
        let t = SizeTest::parse("100c").unwrap();
        assert!(t.matches(100) && !t.matches(101));
        let t = SizeTest::parse("2").unwrap();
        assert!(t.matches(1000) && !t.matches(1025), "512-byte blocks by default");
        assert!(SizeTest::parse("+x").is_err());
    }
}
