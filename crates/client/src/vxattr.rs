//! Virtual extended attributes, computed and never stored (as CephFS exposes its layouts), so
//! that layouts can be read and set through a mount with `getfattr`/`setfattr` — and by
//! `odfs getstripe/setstripe/df` for users who only have the mount:
//!
//! - `odfs.layout`: a file's layout (`stripe_count=2 stripe_size=262144 pool=nvme
//!   stripe_offset=3 targets=3,4`), settable while the file is empty; a directory's default
//!   layout for new files and subdirectories, settable by its owner. Keys left out of a value
//!   keep their current setting.
//! - `odfs.dir_layout`: how a directory's entries are spread over metadata shards
//!   (`stripe_count=N shards=0,1,... entries=…`, the entries each shard holds); setting
//!   `stripe_count=N` on an empty directory spreads it over N shards (-1 = all).
//! - `odfs.targets`: every storage target (`target=3 node=1 pool=nvme online=1 capacity=…
//!   free=… used=… inodes=… inodes_free=…`, bytes as `df` counts them: free is what
//!   unprivileged writers may use, used excludes the blocks reserved for root), every pool (`pool=nvme`) and every metadata shard
//!   (`meta=0 node=0 online=1`), one per line; read-only.
//!
//! - `odfs.sealed`: `1` for an inode of a sealed tree, `0` otherwise; setting `1` (or `0`) on
//!   a directory seals (unseals) the whole tree below it, as `odfs seal` (`unseal`) does.
//!
//! Names under `odfs.` are reserved: unknown ones have no data and cannot be set. None is
//! listed by listxattr.

use crate::{Client, ClientError, Ctx, Result};
use odfs_proto::layout::{dir_layout_text, file_layout_text, parse_layout_text};
use odfs_proto::meta::{Attr, FileKind, SetFileLayout};
use odfs_proto::mgmt::ClusterView;
use odfs_proto::{DirLayout, ErrorCode, InodeId};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

pub const PREFIX: &[u8] = b"odfs.";
pub const LAYOUT: &[u8] = b"odfs.layout";
pub const DIR_LAYOUT: &[u8] = b"odfs.dir_layout";
pub const TARGETS: &[u8] = b"odfs.targets";
pub const SEALED: &[u8] = b"odfs.sealed";
/// The cluster view (JSON: TOML has no integers above i64): what `odfs status` shows,
/// readable by the job's user through the mount; it holds no secret (names, addresses,
/// states, space).
pub const CLUSTER: &[u8] = b"odfs.cluster";
/// What every service has served, by kind of request and by client, with latencies
/// (`odfs_proto::stats::FsStats` as JSON): what `odfs stats` shows, readable by the job's user.
pub const STATS: &[u8] = b"odfs.stats";

/// What a size probe (getxattr with no buffer) answers for a value of `len` bytes named
/// `name`. The statistics, the cluster view, the targets' space and a directory's entries per
/// shard change between two calls — the caller's own probe is counted in the statistics — and
/// a caller such as `getfattr` asks with exactly the probed size next: a value grown by a few
/// digits would fail with ERANGE. Those get headroom (a value may come back shorter than
/// probed, as getxattr(2) allows); every other attribute its exact size.
pub fn probe_size(name: &[u8], len: usize) -> usize {
    match name {
        STATS | CLUSTER | TARGETS | DIR_LAYOUT => {
            (len + (len / 2).max(16 << 10)).min(odfs_proto::XATTR_VALUE_MAX).max(len)
        }
        _ => len,
    }
}

/// `odfs.stats` as JSON, within what an extended attribute can hold: on a large job the
/// clients' counts by kind of request go first (their totals stay).
fn stats_json(mut st: odfs_proto::stats::FsStats) -> Result<Vec<u8>> {
    let json = |st: &odfs_proto::stats::FsStats| {
        serde_json::to_vec(st).map_err(|e| ClientError::new(ErrorCode::Io, format!("statistics: {e}")))
    };
    let full = json(&st)?;
    if full.len() <= odfs_proto::XATTR_VALUE_MAX {
        return Ok(full);
    }
    for c in st.services.iter_mut().filter_map(|s| s.stats.as_mut()).flat_map(|s| &mut s.clients) {
        c.methods.clear();
    }
    let short = json(&st)?;
    if short.len() <= odfs_proto::XATTR_VALUE_MAX {
        return Ok(short);
    }
    Err(ClientError::new(
        ErrorCode::Range,
        format!(
            "the statistics of {} services ({} bytes) do not fit an extended attribute: run odfs stats --fs CONFIG on a node",
            st.services.len(),
            short.len()
        ),
    ))
}

/// A target as `odfs.targets` describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetRow {
    pub id: u32,
    pub node: u32,
    pub pool: String,
    pub online: bool,
    pub capacity: u64,
    /// Bytes free to unprivileged writers (`df`'s Available).
    pub free: u64,
    /// Bytes in use (`df`'s Used): capacity less used less free is reserved for root.
    pub used: u64,
    pub inodes: u64,
    pub inodes_free: u64,
    /// The filesystem it lives on (0: unknown); targets on one device share its space.
    pub device: u64,
}

/// One line of `odfs.targets`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetsLine {
    Target(TargetRow),
    Pool(String),
    /// A metadata shard: (shard, node, online).
    Meta(u16, u32, bool),
}

/// The `odfs.targets` text of a cluster view.
pub fn targets_text(v: &ClusterView) -> String {
    let mut s = String::new();
    let mut targets: Vec<_> = v.targets.iter().collect();
    targets.sort_by_key(|t| t.id);
    for t in targets {
        s += &format!(
            "target={} node={} pool={} online={} capacity={} free={} used={} inodes={} inodes_free={} device={:x}\n",
            t.id,
            t.node,
            t.pool,
            u8::from(t.online),
            t.space.capacity,
            t.space.free,
            t.space.used,
            t.space.inodes_total,
            t.space.inodes_free,
            t.space.device
        );
    }
    for p in &v.pools {
        s += &format!("pool={p}\n");
    }
    for shard in 0..v.meta_shards() {
        if let Some(m) = v.meta_for_shard(shard) {
            s += &format!("meta={shard} node={} online={}\n", m.node, u8::from(m.online));
        }
    }
    s
}

/// Reads `odfs.targets` text back.
pub fn parse_targets(text: &str) -> std::result::Result<Vec<TargetsLine>, String> {
    let mut out = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let kv: Vec<(&str, &str)> = line.split_whitespace().filter_map(|i| i.split_once('=')).collect();
        let get = |k: &str| kv.iter().find(|(a, _)| *a == k).map(|(_, v)| *v);
        let num = |k: &str| -> std::result::Result<u64, String> {
            get(k).and_then(|v| v.parse().ok()).ok_or_else(|| format!("odfs.targets line {line:?}: no number {k}"))
        };
        if let Some(p) = get("pool").filter(|_| get("target").is_none()) {
            out.push(TargetsLine::Pool(p.to_string()));
            continue;
        }
        if get("meta").is_some() {
            out.push(TargetsLine::Meta(num("meta")? as u16, num("node")? as u32, get("online") == Some("1")));
            continue;
        }
        let (capacity, free) = (num("capacity")?, num("free")?);
        out.push(TargetsLine::Target(TargetRow {
            id: num("target")? as u32,
            node: num("node")? as u32,
            pool: get("pool").unwrap_or("").to_string(),
            online: get("online") == Some("1"),
            capacity,
            free,
            // An older odfs leaves it out: everything not free was counted as used.
            used: num("used").unwrap_or(capacity.saturating_sub(free)),
            inodes: num("inodes")?,
            inodes_free: num("inodes_free")?,
            device: get("device").and_then(|d| u64::from_str_radix(d, 16).ok()).unwrap_or(0),
        }));
    }
    Ok(out)
}

/// A file layout as the default it would be made from (for keys a `setstripe` leaves out).
fn as_dir_layout(a: &Attr) -> DirLayout {
    match &a.layout {
        Some(l) => DirLayout {
            chunk_size: l.chunk_size,
            stripe_count: l.targets.len().max(1) as i32,
            pool: l.pool.clone(),
            start_target: None,
            local: false,
        },
        None => DirLayout::default(),
    }
}

impl Client {
    /// Gives an empty regular file a new layout.
    pub async fn set_file_layout(&self, ctx: &Ctx, ino: InodeId, layout: DirLayout) -> Result<Attr> {
        self.change_attr(ctx, ino.shard(), ino, &SetFileLayout { ino, layout, node: Some(self.node()) }).await
    }

    /// The value of a virtual attribute (`name` starts with `odfs.`).
    pub(crate) async fn get_virtual(&self, ctx: &Ctx, ino: InodeId, name: &[u8]) -> Result<Vec<u8>> {
        match name {
            LAYOUT => {
                let a = self.getattr(ctx, ino).await?;
                match a.kind {
                    FileKind::Dir => Ok(dir_layout_text(&self.get_dir_layout(ctx, ino).await?).into_bytes()),
                    FileKind::File => match &a.layout {
                        Some(l) => Ok(file_layout_text(l).into_bytes()),
                        None => Err(ClientError::new(ErrorCode::NoData, "the file has no layout")),
                    },
                    _ => Err(ClientError::new(ErrorCode::NoData, "only files and directories have layouts")),
                }
            }
            DIR_LAYOUT => {
                let a = self.getattr(ctx, ino).await?;
                if a.kind != FileKind::Dir {
                    return Err(ClientError::new(ErrorCode::NoData, "only directories have a metadata layout"));
                }
                let parts = self.dir_parts(ctx, ino).await?;
                let list = |f: &dyn Fn(&(u16, u64)) -> String| parts.iter().map(f).collect::<Vec<_>>().join(",");
                Ok(format!(
                    "stripe_count={} shards={} entries={}",
                    parts.len(),
                    list(&|p| p.0.to_string()),
                    list(&|p| p.1.to_string())
                )
                .into_bytes())
            }
            TARGETS => Ok(targets_text(&*self.cluster().refresh().await?).into_bytes()),
            SEALED => Ok(if self.getattr(ctx, ino).await?.sealed { b"1".to_vec() } else { b"0".to_vec() }),
            CLUSTER => serde_json::to_string(&*self.cluster().refresh().await?)
                .map(String::into_bytes)
                .map_err(|e| ClientError::new(ErrorCode::Io, format!("cluster view: {e}"))),
            STATS => stats_json(self.fs_stats().await?),
            _ => Err(ClientError::new(ErrorCode::NoData, format!("no attribute {}", String::from_utf8_lossy(name)))),
        }
    }

    /// Sets a virtual attribute: `odfs.layout`, `odfs.dir_layout` of an empty directory
    /// (`stripe_count=N`: spread its entries over N metadata shards; -1 = all), `odfs.sealed`.
    pub(crate) async fn set_virtual(&self, ctx: &Ctx, ino: InodeId, name: &[u8], value: &[u8]) -> Result<()> {
        if name == SEALED {
            let sealed = match value.strip_suffix(b"\0").unwrap_or(value) {
                b"1" => true,
                b"0" => false,
                _ => return Err(ClientError::new(ErrorCode::Invalid, "odfs.sealed takes 1 (seal) or 0 (unseal)")),
            };
            return self.seal_tree(ctx, ino, sealed).await.map(drop);
        }
        if name == DIR_LAYOUT {
            let text =
                std::str::from_utf8(value).map_err(|_| ClientError::new(ErrorCode::Invalid, "a layout is text"))?;
            let text = text.trim_end_matches('\0');
            let mut count = None;
            for item in text.split_whitespace() {
                match item.split_once('=') {
                    Some(("stripe_count", v)) => {
                        count = Some(v.parse::<i32>().map_err(|_| {
                            ClientError::new(ErrorCode::Invalid, format!("stripe_count {v:?} is not a number"))
                        })?)
                    }
                    Some(("shards" | "entries", _)) => {}
                    _ => {
                        return Err(ClientError::new(
                            ErrorCode::Invalid,
                            format!("{item:?}: odfs.dir_layout takes stripe_count=N"),
                        ))
                    }
                }
            }
            let count =
                count.ok_or_else(|| ClientError::new(ErrorCode::Invalid, "odfs.dir_layout takes stripe_count=N"))?;
            return self.stripe_dir(ctx, ino, count).await.map(drop);
        }
        if name != LAYOUT {
            let what = String::from_utf8_lossy(name);
            return Err(ClientError::new(ErrorCode::Perm, format!("{what} is read-only")));
        }
        let text = std::str::from_utf8(value).map_err(|_| ClientError::new(ErrorCode::Invalid, "a layout is text"))?;
        let a = self.getattr(ctx, ino).await?;
        match a.kind {
            FileKind::Dir => {
                let base = self.get_dir_layout(ctx, ino).await?;
                let dl = parse_layout_text(text, &base).map_err(|m| ClientError::new(ErrorCode::Invalid, m))?;
                self.set_dir_layout(ctx, ino, dl).await
            }
            FileKind::File => {
                let dl =
                    parse_layout_text(text, &as_dir_layout(&a)).map_err(|m| ClientError::new(ErrorCode::Invalid, m))?;
                self.set_file_layout(ctx, ino, dl).await.map(drop)
            }
            _ => Err(ClientError::new(ErrorCode::Invalid, "only files and directories have layouts")),
        }
    }
}

// Through a mount: the attributes by path, as getfattr(1) and setfattr(1) read and set them.

/// getxattr(2) on a mount path, growing the buffer as needed.
pub fn get_xattr(p: &Path, name: &[u8]) -> std::io::Result<Vec<u8>> {
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    let n = std::ffi::CString::new(name).map_err(std::io::Error::other)?;
    let mut buf = vec![0u8; 4096];
    loop {
        // SAFETY: valid NUL-terminated strings and a buffer of the given length.
        let r = unsafe { libc::getxattr(c.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        if r >= 0 {
            buf.truncate(r as usize);
            return Ok(buf);
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::ERANGE) || buf.len() >= 16 << 20 {
            return Err(e);
        }
        buf.resize(buf.len() * 4, 0);
    }
}

/// setxattr(2) on a mount path.
pub fn set_xattr(p: &Path, name: &[u8], value: &[u8]) -> std::io::Result<()> {
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    let n = std::ffi::CString::new(name).map_err(std::io::Error::other)?;
    // SAFETY: valid NUL-terminated strings and a value of the given length.
    let r = unsafe { libc::setxattr(c.as_ptr(), n.as_ptr(), value.as_ptr().cast(), value.len(), 0) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_text_round_trips() {
        let text = "target=3 node=1 pool=nvme online=1 capacity=100 free=40 used=55 inodes=10 inodes_free=7\n\
                    pool=nvme\npool=ram\n";
        let v = parse_targets(text).unwrap();
        assert_eq!(v.len(), 3);
        assert_eq!(
            v[0],
            TargetsLine::Target(TargetRow {
                id: 3,
                node: 1,
                pool: "nvme".into(),
                online: true,
                capacity: 100,
                free: 40,
                used: 55,
                inodes: 10,
                inodes_free: 7,
                device: 0
            })
        );
        assert_eq!(v[2], TargetsLine::Pool("ram".into()));
        assert!(parse_targets("target=x node=1").is_err());
        // Without used= (an older odfs): all but the free bytes.
        match &parse_targets("target=3 node=1 pool=a online=1 capacity=100 free=40 inodes=1 inodes_free=1").unwrap()[0]
        {
            TargetsLine::Target(t) => assert_eq!(t.used, 60),
            other => panic!("{other:?}"),
        }
    }
}
