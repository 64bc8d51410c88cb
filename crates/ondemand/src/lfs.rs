//! The lfs-style layout commands: `odfs setstripe`, `getstripe`, `df` and `pool`.
//!
//! Every command takes a path in a mount — and then works through the mount's virtual
//! extended attributes (`odfs.layout`, `odfs.targets`), so any user who may use the mount may
//! use it — or `odfs:/PATH`, which goes through the client library (it needs the filesystem's
//! client config, `--fs`, and so its root-only site key). Both ways end in the same metad
//! checks.
//!
//! Owns the command-line forms and their output. Layout rules and their errors are metad's.

use crate::fsref;
use anyhow::{bail, Context, Result};
use odfs_client::vxattr::{self, TargetRow, TargetsLine};
use odfs_client::{Client, Ctx};
use odfs_proto::layout::parse_layout_text;
use odfs_proto::meta::FileKind;
use odfs_proto::DirLayout;
use std::fmt::Write;
use std::path::{Path, PathBuf};

/// Where a command acts.
#[derive(Clone)]
pub enum Place {
    /// Inside odfs through the client library.
    Lib { client: Client, path: String },
    /// A path in an odfs mount, through extended attributes.
    Mount(PathBuf),
}

pub use odfs_client::vxattr::{get_xattr, set_xattr};

/// The odfs mount holding `p` (its mount point), if any.
pub fn mount_of(p: &Path) -> Option<PathBuf> {
    let abs = std::path::absolute(p).ok()?;
    odfs_stage::location::odfs_mounts().into_iter().filter(|m| abs.starts_with(m)).max_by_key(|m| m.as_os_str().len())
}

/// The server's message of a client error, without the code prefix.
pub fn why(e: odfs_client::ClientError) -> anyhow::Error {
    match e {
        odfs_client::ClientError::Remote(r) => anyhow::anyhow!(r.message),
        other => anyhow::anyhow!(other),
    }
}

impl Place {
    /// `odfs:/PATH` (library, `--fs`) or a path in a mount.
    pub async fn open(arg: &str, fs: Option<&Path>) -> Result<Place> {
        let p = match fsref::Location::parse(arg) {
            fsref::Location::Odfs(path) => return Ok(Place::Lib { client: fsref::connect(fs).await?, path }),
            fsref::Location::Local(p) => p,
        };
        if mount_of(&p).is_none() {
            bail!("{arg} is not in an odfs mount (name a path in the mount, or odfs:/PATH with --fs FILE)");
        }
        Ok(Place::Mount(p))
    }

    pub fn show(&self) -> String {
        match self {
            Place::Lib { path, .. } => format!("odfs:{path}"),
            Place::Mount(p) => p.display().to_string(),
        }
    }

    fn child(&self, name: &str) -> Place {
        match self {
            Place::Lib { client, path } => {
                Place::Lib { client: client.clone(), path: format!("{}/{name}", path.trim_end_matches('/')) }
            }
            Place::Mount(p) => Place::Mount(p.join(name)),
        }
    }

    /// None when the path does not exist.
    pub async fn kind(&self) -> Result<Option<FileKind>> {
        match self {
            Place::Lib { client, path } => match client.resolve(&Ctx::current(), path, false).await {
                Ok(a) => Ok(Some(a.kind)),
                Err(e) if e.errno() == libc::ENOENT => Ok(None),
                Err(e) => Err(why(e)),
            },
            Place::Mount(p) => match std::fs::symlink_metadata(p) {
                Ok(m) => Ok(Some(crate::fsref::local_kind(m.file_type()))),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(e).with_context(|| format!("cannot stat {}", p.display())),
            },
        }
    }

    pub async fn get(&self, name: &[u8]) -> Result<String> {
        let v = match self {
            Place::Lib { client, path } => {
                let ctx = Ctx::current();
                let a = client.resolve(&ctx, path, true).await.map_err(why)?;
                client.getxattr(&ctx, a.ino, name).await.map_err(why)?
            }
            Place::Mount(p) => get_xattr(p, name).with_context(|| format!("{}", p.display()))?,
        };
        Ok(String::from_utf8_lossy(&v).into_owned())
    }

    pub async fn set(&self, name: &[u8], value: &str) -> Result<()> {
        match self {
            Place::Lib { client, path } => {
                let ctx = Ctx::current();
                let a = client.resolve(&ctx, path, true).await.map_err(why)?;
                client.setxattr(&ctx, a.ino, name, value.as_bytes(), 0).await.map_err(why)
            }
            Place::Mount(p) => set_xattr(p, name, value.as_bytes()).map_err(|e| match e.raw_os_error() {
                Some(libc::EINVAL) => anyhow::anyhow!("{}: the layout was refused (invalid)", p.display()),
                Some(libc::EPERM) => anyhow::anyhow!(
                    "{}: {e}: only the owner or root may change a layout, and a site may leave layouts \
                     to root (user_layouts = false)",
                    p.display()
                ),
                _ => anyhow::anyhow!("{}: {e}", p.display()),
            }),
        }
    }

    /// The sealed tree this place is in — or, when it does not exist, the directory it would
    /// be made in — named as the user names places (`odfs:/ds`, or its path in the mount);
    /// None when not sealed. metad's refusal names only an inode, and a mount's only says
    /// "Read-only file system".
    pub async fn sealed_tree(&self) -> Result<Option<String>> {
        match self {
            Place::Lib { client, path } => {
                let top = client.sealed_tree(&Ctx::current(), path).await.map_err(why)?;
                Ok(top.map(|t| format!("odfs:{t}")))
            }
            Place::Mount(p) => {
                let Some(root) = mount_of(p) else { return Ok(None) };
                let sealed = |d: &Path| get_xattr(d, vxattr::SEALED).is_ok_and(|v| v == b"1");
                let abs = std::path::absolute(p)?;
                // The nearest existing place, then up while the directory above is sealed too.
                let mut at = abs.as_path();
                while std::fs::symlink_metadata(at).is_err() {
                    match at.parent() {
                        Some(up) if up.starts_with(&root) => at = up,
                        _ => return Ok(None),
                    }
                }
                if !sealed(at) {
                    return Ok(None);
                }
                while let Some(up) = at.parent().filter(|up| up.starts_with(&root) && sealed(up)) {
                    at = up;
                }
                Ok(Some(at.display().to_string()))
            }
        }
    }

    /// Creates an empty regular file (for `setstripe` of a new file).
    async fn create_empty(&self) -> Result<()> {
        match self {
            Place::Lib { client, path } => {
                let ctx = Ctx::current();
                let (parent, name) = client.resolve_parent(&ctx, path).await.map_err(why)?;
                client.create(&ctx, parent.ino, &name, 0o644, true, None).await.map_err(why)?;
                Ok(())
            }
            Place::Mount(p) => {
                std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(p)
                    .with_context(|| format!("cannot create {}", p.display()))?;
                Ok(())
            }
        }
    }

    /// Names in a directory, sorted.
    async fn list(&self) -> Result<Vec<String>> {
        let mut v: Vec<String> = match self {
            Place::Lib { client, path } => {
                let ctx = Ctx::current();
                let a = client.resolve(&ctx, path, true).await.map_err(why)?;
                client
                    .readdir_all(&ctx, a.ino, false)
                    .await
                    .map_err(why)?
                    .into_iter()
                    .map(|e| String::from_utf8_lossy(&e.name).into_owned())
                    .filter(|n| n != "." && n != "..")
                    .collect()
            }
            Place::Mount(p) => std::fs::read_dir(p)
                .with_context(|| format!("cannot list {}", p.display()))?
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect(),
        };
        v.sort();
        Ok(v)
    }

    /// The filesystem's root (where the filesystem-wide attributes are read: the place itself
    /// may not exist yet).
    fn root(&self) -> Place {
        match self {
            Place::Lib { client, .. } => Place::Lib { client: client.clone(), path: "/".into() },
            Place::Mount(p) => Place::Mount(mount_of(p).unwrap_or_else(|| p.clone())),
        }
    }

    /// The filesystem's inode totals as statfs gives them (what `df -i` on the mount shows):
    /// (total, free). They count metadata inodes: one per file, directory or link.
    pub async fn statfs_inodes(&self) -> Result<(u64, u64)> {
        match self.root() {
            Place::Lib { client, .. } => {
                let st = client.statfs(&Ctx::current()).await.map_err(why)?;
                Ok((st.total_inodes, st.free_inodes))
            }
            Place::Mount(p) => {
                let st = nix::sys::statvfs::statvfs(&p).with_context(|| format!("statfs {}", p.display()))?;
                Ok((st.files() as u64, st.files_free() as u64))
            }
        }
    }

    /// The filesystem's targets and pools (`odfs.targets`).
    pub async fn targets(&self) -> Result<Vec<TargetsLine>> {
        vxattr::parse_targets(&self.root().get(vxattr::TARGETS).await?).map_err(anyhow::Error::msg)
    }
}

/// What `odfs setstripe` asks for; unset fields keep the current setting.
#[derive(Debug, Clone, Default)]
pub struct StripeArgs {
    pub count: Option<i32>,
    pub size: Option<u64>,
    pub pool: Option<String>,
    pub start: Option<i64>,
    /// Local placement on (`--local`) or off (`--rotate`).
    pub local: Option<bool>,
}

impl StripeArgs {
    /// The `odfs.layout` value: only the keys given.
    pub fn text(&self) -> Result<String> {
        let mut v = Vec::new();
        if let Some(c) = self.count {
            v.push(format!("stripe_count={c}"));
        }
        if let Some(s) = self.size {
            v.push(format!("stripe_size={s}"));
        }
        if let Some(p) = &self.pool {
            v.push(format!("pool={p}"));
        }
        if let Some(i) = self.start {
            v.push(format!("stripe_offset={i}"));
        }
        if let Some(local) = self.local {
            v.push(format!("placement={}", if local { "local" } else { "rotate" }));
        }
        if v.is_empty() {
            bail!("setstripe needs at least one of -c COUNT, -S SIZE, -p POOL, -i START_TARGET, --local, --rotate");
        }
        let text = v.join(" ");
        // The same rules metad applies, checked here first for a message without a round trip.
        parse_layout_text(&text, &DirLayout::default()).map_err(anyhow::Error::msg)?;
        Ok(text)
    }
}

/// The checks metad makes, made here first: through a mount only the errno of a refusal comes
/// back, and the user deserves its reason.
async fn precheck(place: &Place, a: &StripeArgs, kind: Option<FileKind>) -> Result<()> {
    let lines = place.targets().await?;
    let members = |pool: &str| -> Vec<u32> {
        lines
            .iter()
            .filter_map(|l| match l {
                TargetsLine::Target(t) if t.pool == pool => Some(t.id),
                _ => None,
            })
            .collect()
    };
    let current = match kind {
        Some(_) => kv(&place.get(vxattr::LAYOUT).await?),
        // A new file starts from its directory's default.
        None => match place {
            Place::Mount(p) => match p.parent() {
                Some(d) => kv(&Place::Mount(d.to_path_buf()).get(vxattr::LAYOUT).await?),
                None => Vec::new(),
            },
            Place::Lib { .. } => Vec::new(),
        },
    };
    let pool = a.pool.clone().unwrap_or_else(|| field(&current, "pool").to_string());
    let ids = members(&pool);
    if !pool.is_empty() && ids.is_empty() {
        let mut have: Vec<String> = lines
            .iter()
            .filter_map(|l| match l {
                TargetsLine::Target(t) => Some(t.pool.clone()),
                _ => None,
            })
            .collect();
        have.sort();
        have.dedup();
        bail!("pool {pool} does not exist or has no targets (pools with targets: {})", have.join(", "));
    }
    if let Some(c) = a.count.filter(|&c| c > ids.len() as i32 && !ids.is_empty()) {
        bail!("stripe count {c} is more than the {} targets of pool {pool}", ids.len());
    }
    if let Some(i) = a.start.filter(|&i| i >= 0) {
        if !ids.contains(&(i as u32)) {
            bail!("start target {i} is not in pool {pool} (targets {ids:?})");
        }
    }
    if kind == Some(FileKind::File) {
        if let Place::Mount(p) = place {
            let len = std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
            if len > 0 {
                bail!("{} has {len} bytes: a layout can only be set while a file is empty", p.display());
            }
        }
    }
    Ok(())
}

/// `odfs setstripe`: a directory's default layout, or a new (or empty) file's layout.
pub async fn setstripe(place: &Place, a: &StripeArgs) -> Result<()> {
    let text = a.text()?;
    let kind = place.kind().await?;
    if kind == Some(FileKind::Symlink) {
        bail!("{} is a symbolic link; name what it points to", place.show());
    }
    refuse_sealed(place, "set a layout").await?;
    precheck(place, a, kind).await?;
    let created = match kind {
        Some(_) => false,
        None => {
            place.create_empty().await?;
            true
        }
    };
    let r = place.set(vxattr::LAYOUT, &text).await;
    if r.is_err() && created {
        // A refused layout leaves nothing behind.
        if let Place::Mount(p) = place {
            let _ = std::fs::remove_file(p);
        }
        if let Place::Lib { client, path } = place {
            let ctx = Ctx::current();
            if let Ok((parent, name)) = client.resolve_parent(&ctx, path).await {
                let _ = client.unlink(&ctx, parent.ino, &name).await;
            }
        }
    }
    r
}

/// Refuses to `what` (a change) at `place` in a sealed tree, naming the tree, before
/// anything is made.
async fn refuse_sealed(place: &Place, what: &str) -> Result<()> {
    let Some(top) = place.sealed_tree().await? else { return Ok(()) };
    let shown = place.show();
    let at = if shown.trim_end_matches('/') == top {
        format!("{top} is a sealed tree")
    } else {
        format!("{shown} is in the sealed tree {top}")
    };
    bail!("cannot {what}: {at}, which is read-only until `odfs unseal {top}`")
}

/// `odfs seal PATH` (`sealed`) / `odfs unseal PATH`: the whole tree under PATH, through the
/// `odfs.sealed` virtual attribute in a mount (one request; the library walks the tree).
pub async fn seal(place: &Place, sealed: bool) -> Result<()> {
    let value: &[u8] = if sealed { b"1" } else { b"0" };
    match place {
        Place::Lib { client, path } => client.seal_path(&Ctx::current(), path, sealed).await.map(drop).map_err(why),
        Place::Mount(p) => set_xattr(p, vxattr::SEALED, value).map_err(|e| match e.raw_os_error() {
            Some(libc::EPERM) => anyhow::anyhow!(
                "{}: {e}: only root or the owner of every file and directory below it may seal or unseal a tree",
                p.display()
            ),
            _ => anyhow::anyhow!("{}: {e}", p.display()),
        }),
    }
}

/// `odfs mkdir [-p] [-c N]`: a directory, spread over N metadata shards when asked.
pub async fn mkdir(place: &Place, parents: bool, count: Option<i32>) -> Result<()> {
    // A count the filesystem cannot give is refused before anything (parents included) is made.
    if let Some(n) = count {
        let shards = place.targets().await?.iter().filter(|l| matches!(l, TargetsLine::Meta(..))).count() as i32;
        if n == 0 || n < -1 || n > shards {
            bail!("-c {n}: this filesystem has {shards} metadata shards (-1 = all)");
        }
    }
    match place {
        Place::Lib { client, path } => {
            let ctx = Ctx::current();
            if parents {
                client.mkdir_all(&ctx, path, 0o755).await.map_err(why)?;
            } else {
                let (parent, name) = client.resolve_parent(&ctx, path).await.map_err(why)?;
                client.mkdir(&ctx, parent.ino, &name, 0o755).await.map_err(why)?;
            }
        }
        Place::Mount(p) => {
            let r = if parents { std::fs::create_dir_all(p) } else { std::fs::create_dir(p) };
            r.with_context(|| format!("cannot create {}", p.display()))?;
        }
    }
    let Some(n) = count else { return Ok(()) };
    let r = place.set(vxattr::DIR_LAYOUT, &format!("stripe_count={n}")).await;
    if r.is_err() {
        // A directory that cannot be spread as asked is not left behind half made.
        match place {
            Place::Mount(p) => {
                let _ = std::fs::remove_dir(p);
            }
            Place::Lib { client, path } => {
                let ctx = Ctx::current();
                if let Ok((parent, name)) = client.resolve_parent(&ctx, path).await {
                    let _ = client.rmdir(&ctx, parent.ino, &name).await;
                }
            }
        }
    }
    r
}

/// What `odfs getstripe` shows.
#[derive(Debug, Clone, Default)]
pub struct GetStripeArgs {
    pub verbose: bool,
    pub yaml: bool,
    pub count: bool,
    pub size: bool,
    pub pool: bool,
    /// A directory only, not its files.
    pub dir_only: bool,
    pub recursive: bool,
}

pub(crate) fn kv(text: &str) -> Vec<(String, String)> {
    text.split_whitespace().filter_map(|i| i.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

/// A directory layout's placement: "local", or "rotate" where the text names none.
fn placement(f: &[(String, String)]) -> &str {
    match field(f, "placement") {
        "" => "rotate",
        p => p,
    }
}

pub(crate) fn field<'a>(f: &'a [(String, String)], k: &str) -> &'a str {
    f.iter().find(|(a, _)| a == k).map_or("", |(_, v)| v.as_str())
}

/// One entry's layout, lfs-style.
fn render_one(out: &mut String, name: &str, kind: FileKind, text: &str, nodes: &[(u32, u32)], a: &GetStripeArgs) {
    let f = kv(text);
    let only: Vec<&str> = [("stripe_count", a.count), ("stripe_size", a.size), ("pool", a.pool)]
        .into_iter()
        .filter(|(_, on)| *on)
        .map(|(k, _)| field(&f, k))
        .collect();
    if !only.is_empty() {
        let _ = writeln!(out, "{}", only.join(" "));
        return;
    }
    let targets: Vec<u32> = field(&f, "targets").split(',').filter_map(|t| t.parse().ok()).collect();
    let node_of = |t: u32| nodes.iter().find(|(id, _)| *id == t).map_or("-".to_string(), |(_, n)| n.to_string());
    if a.yaml {
        let _ = writeln!(out, "{name}:");
        for k in ["stripe_count", "stripe_size", "pool", "stripe_offset"] {
            let _ = writeln!(out, "  {k}: {}", field(&f, k));
        }
        if kind == FileKind::Dir {
            let _ = writeln!(out, "  placement: {}", placement(&f));
        }
        if kind == FileKind::File {
            let _ = writeln!(out, "  targets:");
            for t in &targets {
                let _ = writeln!(out, "    - {{ target: {t}, node: {} }}", node_of(*t));
            }
        }
        return;
    }
    let _ = writeln!(out, "{name}");
    if kind == FileKind::Dir {
        let _ = writeln!(
            out,
            "stripe_count:  {} stripe_size:   {} pattern:       raid0 stripe_offset: {} pool:          {} \
             placement:     {}",
            field(&f, "stripe_count"),
            field(&f, "stripe_size"),
            field(&f, "stripe_offset"),
            field(&f, "pool"),
            placement(&f)
        );
        return;
    }
    let _ = writeln!(out, "lmm_stripe_count:  {}", field(&f, "stripe_count"));
    let _ = writeln!(out, "lmm_stripe_size:   {}", field(&f, "stripe_size"));
    let _ = writeln!(out, "lmm_pattern:       raid0");
    if a.verbose {
        let _ = writeln!(out, "lmm_layout_gen:    0");
    }
    let _ = writeln!(out, "lmm_stripe_offset: {}", field(&f, "stripe_offset"));
    let _ = writeln!(out, "lmm_pool:          {}", field(&f, "pool"));
    let _ = writeln!(out, "\tobdidx\t\t node");
    for t in targets {
        let _ = writeln!(out, "\t{t:>6}\t\t{:>5}", node_of(t));
    }
}

/// `odfs getstripe`: the layout of a file, or a directory's default and (unless `-d`) its files'.
pub async fn getstripe(place: &Place, a: &GetStripeArgs) -> Result<String> {
    let nodes: Vec<(u32, u32)> = place
        .targets()
        .await?
        .into_iter()
        .filter_map(|l| match l {
            TargetsLine::Target(t) => Some((t.id, t.node)),
            _ => None,
        })
        .collect();
    let mut out = String::new();
    let mut todo = vec![(place.show(), place.clone())];
    let mut first = true;
    while let Some((name, p)) = todo.pop() {
        let kind = p.kind().await?.with_context(|| format!("{name}: no such file or directory"))?;
        if kind == FileKind::Symlink {
            continue;
        }
        let text = p.get(vxattr::LAYOUT).await.with_context(|| name.clone())?;
        render_one(&mut out, &name, kind, &text, &nodes, a);
        if kind == FileKind::Dir && !a.dir_only && (first || a.recursive) {
            let mut kids = p.list().await?;
            kids.reverse();
            for k in kids {
                let show = format!("{}/{k}", name.trim_end_matches('/'));
                todo.push((show, p.child(&k)));
            }
        }
        first = false;
    }
    Ok(out)
}

/// What `odfs df` shows.
#[derive(Debug, Clone, Default)]
pub struct DfArgs {
    pub human: bool,
    pub inodes: bool,
    pub pool: Option<String>,
}

/// One row of `odfs df`: (size, used, available) as `df` counts them, the blocks reserved for
/// root in neither used nor available; Use% is used of used plus available, rounded up, as
/// `df` has it.
fn df_row(out: &mut String, label: &str, (total, used, avail): (u64, u64, u64), a: &DfArgs, tail: &str) {
    let pct = match used.saturating_add(avail) {
        0 => "-".into(),
        of => format!("{}%", (u128::from(used) * 100).div_ceil(u128::from(of))),
    };
    let n = |v: u64| if a.human && !a.inodes { odfs_proto::units::bytes_short(v) } else { v.to_string() };
    let _ = writeln!(out, "{label:<24} {:>16} {:>16} {:>16} {pct:>5} {tail}", n(total), n(used), n(avail));
}

/// `odfs df`: space (or, with -i, inodes) per target, per pool and in all; bytes in 1K
/// blocks unless -h, counted as `df` counts them on the targets' disks. The byte summary is the sum over the online targets, as `df` on the mount
/// shows it; the inode summary is the filesystem's metadata inodes, as `df -i` shows them.
/// Targets on one device (one disk holding several data paths) count its space once.
pub async fn df(place: &Place, a: &DfArgs) -> Result<String> {
    let lines = place.targets().await?;
    let mut targets: Vec<TargetRow> = Vec::new();
    let mut pools: Vec<String> = Vec::new();
    for l in lines {
        match l {
            TargetsLine::Target(t) => targets.push(t),
            TargetsLine::Pool(p) => pools.push(p),
            TargetsLine::Meta(..) => {}
        }
    }
    if let Some(p) = &a.pool {
        if !pools.contains(p) {
            bail!("no pool {p} (pools: {})", pools.join(", "));
        }
    }
    // A filesystem's inodes are its metadata inodes (each file one, however many targets hold
    // its chunks): the totals `df -i` shows on the mount.
    let meta_inodes = if a.inodes && a.pool.is_none() { Some(place.statfs_inodes().await?) } else { None };
    Ok(df_table(&targets, &pools, a, meta_inodes))
}

/// The `odfs df` table of `targets`; `meta_inodes` (total, free) is the -i summary.
fn df_table(targets: &[TargetRow], pools: &[String], a: &DfArgs, meta_inodes: Option<(u64, u64)>) -> String {
    let scale = |b: u64| if a.human || a.inodes { b } else { b / 1024 };
    let (h1, h2, h3) = if a.inodes {
        ("Inodes", "IUsed", "IFree")
    } else if a.human {
        ("Size", "Used", "Avail")
    } else {
        ("1K-blocks", "Used", "Available")
    };
    let mut out = format!("{:<24} {h1:>16} {h2:>16} {h3:>16} {:>5} {}\n", "TARGET", "Use%", "Node Pool");
    // (size, used, available).
    let pick = |t: &TargetRow| -> (u64, u64, u64) {
        if a.inodes {
            (t.inodes, t.inodes.saturating_sub(t.inodes_free), t.inodes_free)
        } else {
            (scale(t.capacity), scale(t.used), scale(t.free))
        }
    };
    let add = |into: &mut (u64, u64, u64), (total, used, free): (u64, u64, u64)| {
        into.0 += total;
        into.1 += used;
        into.2 += free;
    };
    let mut sums: std::collections::BTreeMap<String, (u64, u64, u64)> = Default::default();
    let mut all = (0u64, 0u64, 0u64);
    // The first online target seen on each device, which carries the device's space.
    let mut first: std::collections::BTreeMap<u64, u32> = Default::default();
    let mut shared = 0;
    for t in targets {
        if a.pool.as_ref().is_some_and(|p| *p != t.pool) {
            continue;
        }
        let space = pick(t);
        let mut tail = format!("{:>4} {}", t.node, t.pool);
        if !t.online {
            tail += " OFFLINE";
        } else if let Some(f) = first.get(&t.device).filter(|_| t.device != 0) {
            tail += &format!(" (same device as odfs-T{f:04}: counted once)");
            shared += 1;
        } else {
            first.insert(t.device, t.id);
            add(sums.entry(t.pool.clone()).or_default(), space);
            add(&mut all, space);
        }
        df_row(&mut out, &format!("odfs-T{:04}", t.id), space, a, &tail);
    }
    out.push('\n');
    for p in pools {
        if a.pool.as_ref().is_some_and(|x| x != p) {
            continue;
        }
        df_row(&mut out, &format!("pool {p}"), sums.get(p).copied().unwrap_or_default(), a, "");
    }
    if a.pool.is_none() {
        out.push('\n');
        match meta_inodes {
            Some((total, free)) => {
                df_row(&mut out, "filesystem_summary:", (total, total.saturating_sub(free), free), a, "(metadata)")
            }
            None => df_row(&mut out, "filesystem_summary:", all, a, ""),
        }
    }
    if shared > 0 {
        let _ = writeln!(
            out,
            "\n{shared} target(s) share a device with another target: its space is counted once in the totals"
        );
    }
    out
}

/// `odfs pool list`: each pool and its targets.
pub async fn pool_list(place: &Place) -> Result<String> {
    let lines = place.targets().await?;
    let mut out = String::new();
    let pools: Vec<String> = lines
        .iter()
        .filter_map(|l| match l {
            TargetsLine::Pool(p) => Some(p.clone()),
            _ => None,
        })
        .collect();
    for p in pools {
        let ids: Vec<String> = lines
            .iter()
            .filter_map(|l| match l {
                TargetsLine::Target(t) if t.pool == p => Some(t.id.to_string()),
                _ => None,
            })
            .collect();
        let _ = writeln!(out, "{p}: {}", if ids.is_empty() { "(no targets)".into() } else { ids.join(" ") });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(id: u32, node: u32, device: u64) -> TargetRow {
        TargetRow {
            id,
            node,
            pool: "nvme".into(),
            online: true,
            capacity: 1000 << 30,
            free: 400 << 30,
            used: 550 << 30,
            inodes: 100,
            inodes_free: 40,
            device,
        }
    }

    /// The numbers of the row whose first word is `label`.
    fn row(table: &str, label: &str) -> Vec<u64> {
        let line = table.lines().find(|l| l.starts_with(label)).unwrap_or_else(|| panic!("no {label} in\n{table}"));
        line.split_whitespace().filter_map(|w| w.parse().ok()).collect()
    }

    #[test]
    fn df_counts_a_shared_device_once() {
        let a = DfArgs { human: false, inodes: false, pool: None };
        let pools = vec!["nvme".to_string()];
        // Four targets on one disk (one machine's data paths), then each on its own.
        let one_disk: Vec<TargetRow> = (1..=4).map(|i| target(i, i - 1, 0xabc)).collect();
        let t = df_table(&one_disk, &pools, &a, None);
        assert_eq!(row(&t, "pool nvme")[..3], [1000 << 20, 550 << 20, 400 << 20], "{t}");
        assert_eq!(row(&t, "filesystem_summary:")[..3], [1000 << 20, 550 << 20, 400 << 20], "{t}");
        assert!(t.contains("odfs-T0002") && t.contains("same device as odfs-T0001"), "{t}");
        assert!(t.contains("3 target(s) share a device"), "{t}");
        let own: Vec<TargetRow> = (1..=4).map(|i| target(i, i - 1, 0x100 + i as u64)).collect();
        let t = df_table(&own, &pools, &a, None);
        assert_eq!(row(&t, "filesystem_summary:")[0], 4000 << 20, "{t}");
        assert!(!t.contains("share a device"), "{t}");
        // Used of used plus available, rounded up: 550 of 950 is 57.9 %.
        assert!(t.lines().any(|l| l.starts_with("odfs-T0001") && l.contains(" 58% ")), "{t}");
        // Unknown devices (0) are never merged.
        let unknown: Vec<TargetRow> = (1..=2).map(|i| target(i, 0, 0)).collect();
        assert_eq!(row(&df_table(&unknown, &pools, &a, None), "filesystem_summary:")[0], 2000 << 20);
    }

    #[test]
    fn df_leaves_the_blocks_reserved_for_root_out_of_used_as_df_does() {
        // A 250 GiB disk with 21 GiB used and 70 GiB available to users: the rest is reserved
        // for root (or counted by the filesystem itself), used by no one.
        let t = TargetRow { capacity: 250 << 30, used: 21 << 30, free: 70 << 30, ..target(1, 0, 7) };
        let a = DfArgs { human: true, inodes: false, pool: None };
        let text = df_table(&[t], &["nvme".to_string()], &a, None);
        let summary: Vec<&str> =
            text.lines().find(|l| l.starts_with("filesystem_summary:")).unwrap().split_whitespace().collect();
        assert_eq!(summary[1..5], ["250G", "21G", "70G", "24%"], "{text}");
        // Inodes: used is all but the free ones.
        let a = DfArgs { human: false, inodes: true, pool: None };
        let text = df_table(&[target(1, 0, 7)], &["nvme".to_string()], &a, None);
        assert_eq!(row(&text, "odfs-T0001")[..3], [100, 60, 40], "{text}");
        assert!(text.contains(" 60% "), "{text}");
    }
}
