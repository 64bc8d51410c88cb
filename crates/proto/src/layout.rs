//! File layouts (RAID-0 striping with lfs semantics) and the arithmetic that maps file offsets to
//! chunk files on targets.
//!
//! Offset `o` lives in chunk `k = o / chunk_size`, on target `targets[k % stripe_count]`, at
//! offset `(k / stripe_count) * chunk_size + o % chunk_size` of that target's chunk file.

use crate::units::parse_size;
use crate::TargetId;
use serde::{Deserialize, Serialize};

/// Smallest chunk size allowed (as Lustre and BeeGFS).
pub const MIN_CHUNK_SIZE: u32 = 64 * 1024;
/// Largest chunk size allowed.
pub const MAX_CHUNK_SIZE: u32 = 1 << 30;
/// Default chunk size.
pub const DEFAULT_CHUNK_SIZE: u32 = 1 << 20;
/// Default stripe count.
pub const DEFAULT_STRIPE_COUNT: i32 = 4;
/// The largest file odfs holds: 16 TiB, as ext4 with 4 KiB blocks (a file of stripe count 1
/// is one chunk file of its size on a target's disk). A write or truncate past it fails with
/// EFBIG before anything changes; a write that crosses it is cut short at it.
pub const MAX_FILE_SIZE: u64 = 1 << 44;

/// EFBIG's reason for a size or write end past [`MAX_FILE_SIZE`], or Ok.
pub fn check_file_size(end: u64) -> Result<(), String> {
    if end > MAX_FILE_SIZE {
        return Err(format!("{end} bytes is past odfs's largest file size, {MAX_FILE_SIZE} bytes (16 TiB)"));
    }
    Ok(())
}
/// Name of the pool holding every target unless configured otherwise.
pub const DEFAULT_POOL: &str = "default";

/// The layout of one file: fixed at create.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Layout {
    pub chunk_size: u32,
    pub pool: String,
    /// Ordered targets; their count is the stripe count.
    pub targets: Vec<TargetId>,
}

/// The default layout a directory gives new children.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DirLayout {
    pub chunk_size: u32,
    /// Number of targets per file; -1 means every target of the pool.
    pub stripe_count: i32,
    pub pool: String,
    /// First target to use, or none for a rotating start.
    pub start_target: Option<TargetId>,
    /// Local placement: a new file's first target is one of the creating node's own (see
    /// docs/architecture.md, "Local placement"); `start_target` then does not apply.
    #[serde(default)]
    pub local: bool,
}

impl Default for DirLayout {
    fn default() -> Self {
        DirLayout {
            chunk_size: DEFAULT_CHUNK_SIZE,
            stripe_count: DEFAULT_STRIPE_COUNT,
            pool: DEFAULT_POOL.to_string(),
            start_target: None,
            local: false,
        }
    }
}

impl DirLayout {
    /// Checks the rules every layout must follow, naming the first broken one.
    pub fn validate(&self) -> Result<(), String> {
        validate_chunk_size(self.chunk_size)?;
        if self.stripe_count == 0 || self.stripe_count < -1 {
            return Err(format!(
                "stripe count {} is invalid: use a positive count or -1 for every target",
                self.stripe_count
            ));
        }
        if self.pool.is_empty() {
            return Err("pool name is empty".into());
        }
        Ok(())
    }
}

pub fn validate_chunk_size(chunk_size: u32) -> Result<(), String> {
    if !chunk_size.is_power_of_two() || !(MIN_CHUNK_SIZE..=MAX_CHUNK_SIZE).contains(&chunk_size) {
        return Err(format!("chunk size {chunk_size} is invalid: it must be a power of two between 64 KiB and 1 GiB"));
    }
    Ok(())
}

/// Subdirectory of a target holding its chunk files.
pub const CHUNKS_DIR: &str = "chunks";

/// Name of the file in a target's directory recording which target the directory belongs to.
pub const TARGET_ID_FILE: &str = "target.id";

/// Where a target keeps the chunk file of `ino`: `<target dir>/chunks/<low byte of ino, 2 hex
/// digits>/<ino, 16 hex digits>`. stored owns these files; a client on the target's node opens
/// them itself only to read them (short-circuit reads) and for FUSE passthrough.
pub fn chunk_path(target_dir: &std::path::Path, ino: crate::InodeId) -> std::path::PathBuf {
    target_dir.join(CHUNKS_DIR).join(format!("{:02x}", ino.0 & 0xff)).join(format!("{:016x}", ino.0))
}

/// Local placement (`local`, true) or the usual rotation (`rotate`, false), as the layout text
/// and the `#ODFS placement` directive name them.
pub fn parse_placement(v: &str) -> Result<bool, String> {
    match v {
        "local" => Ok(true),
        "rotate" => Ok(false),
        _ => Err(format!("placement {v:?} is invalid: use local or rotate")),
    }
}

/// The text form of layouts, as the `odfs.layout` extended attribute and `odfs getstripe`
/// show them: `stripe_count=2 stripe_size=262144 pool=nvme stripe_offset=-1`, followed by
/// `placement=local` for local placement, and for a file also `targets=3,4` (its stripe count
/// is the number of targets). A directory's layout is the default its new files and
/// subdirectories get.
pub fn dir_layout_text(dl: &DirLayout) -> String {
    format!(
        "stripe_count={} stripe_size={} pool={} stripe_offset={}{}",
        dl.stripe_count,
        dl.chunk_size,
        dl.pool,
        dl.start_target.map_or(-1, |t| t as i64),
        if dl.local { " placement=local" } else { "" }
    )
}

/// See [`dir_layout_text`].
pub fn file_layout_text(l: &Layout) -> String {
    let targets: Vec<String> = l.targets.iter().map(|t| t.to_string()).collect();
    format!(
        "stripe_count={} stripe_size={} pool={} stripe_offset={} targets={}",
        l.targets.len(),
        l.chunk_size,
        l.pool,
        l.targets.first().map_or(-1, |&t| t as i64),
        targets.join(",")
    )
}

/// Reads the text form, starting from `base` for the keys it leaves out (`stripe_count`,
/// `stripe_size` (or `chunk_size`), `pool`, `stripe_offset`, `placement` = `local` or `rotate`; `targets` is
/// ignored: it is chosen, not set).
/// Sizes take K/M/G suffixes. Errors name the key and the problem; the result is validated.
pub fn parse_layout_text(text: &str, base: &DirLayout) -> Result<DirLayout, String> {
    let mut dl = base.clone();
    let text = text.trim_end_matches('\0');
    for item in text.split_whitespace() {
        let (k, v) = item.split_once('=').ok_or_else(|| format!("{item:?} is not key=value"))?;
        match k {
            "stripe_count" | "count" => {
                dl.stripe_count = v.parse().map_err(|_| format!("stripe_count {v:?} is not a number"))?;
            }
            "stripe_size" | "size" | "chunk_size" => {
                let n = parse_size(v).map_err(|_| format!("stripe_size {v:?} is not a size (e.g. 1M)"))?;
                dl.chunk_size = u32::try_from(n).map_err(|_| format!("stripe_size {v} is too large"))?;
            }
            "pool" => dl.pool = v.to_string(),
            "stripe_offset" | "offset" => {
                let n: i64 = v.parse().map_err(|_| format!("stripe_offset {v:?} is not a number"))?;
                dl.start_target = match n {
                    -1 => None,
                    n if n >= 0 && n <= u32::MAX as i64 => Some(n as u32),
                    _ => return Err(format!("stripe_offset {v} is invalid: a target id, or -1 for any")),
                };
            }
            "placement" => dl.local = parse_placement(v)?,
            "targets" => {}
            other => {
                return Err(format!(
                    "unknown layout key {other:?} (stripe_count, stripe_size, pool, stripe_offset, placement)"
                ))
            }
        }
    }
    dl.validate()?;
    Ok(dl)
}

/// One contiguous piece of a file range that lives in a single chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Index into `Layout::targets`.
    pub stripe_index: usize,
    pub target: TargetId,
    /// Chunk number within the file.
    pub chunk: u64,
    /// Offset within the target's chunk file.
    pub local_offset: u64,
    /// Offset within the file.
    pub file_offset: u64,
    pub len: u64,
}

impl Layout {
    pub fn stripe_count(&self) -> usize {
        self.targets.len()
    }

    /// Splits the file range `[offset, offset + len)` into per-chunk segments, in file order.
    pub fn segments(&self, offset: u64, len: u64) -> impl Iterator<Item = Segment> + '_ {
        let cs = self.chunk_size as u64;
        let sc = self.targets.len() as u64;
        let end = offset.saturating_add(len);
        let mut pos = offset;
        std::iter::from_fn(move || {
            if pos >= end || sc == 0 {
                return None;
            }
            let chunk = pos / cs;
            let within = pos % cs;
            let n = (cs - within).min(end - pos);
            let stripe_index = (chunk % sc) as usize;
            let seg = Segment {
                stripe_index,
                target: self.targets[stripe_index],
                chunk,
                local_offset: (chunk / sc) * cs + within,
                file_offset: pos,
                len: n,
            };
            pos += n;
            Some(seg)
        })
    }

    /// Length of the chunk file on stripe `index` when the file is `file_size` bytes long.
    pub fn local_len(&self, index: usize, file_size: u64) -> u64 {
        let cs = self.chunk_size as u64;
        let sc = self.targets.len() as u64;
        let i = index as u64;
        let nchunks = file_size.div_ceil(cs);
        if nchunks == 0 || i >= nchunks {
            return 0;
        }
        let last = i + ((nchunks - 1 - i) / sc) * sc;
        (last / sc) * cs + (file_size - last * cs).min(cs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn layout(cs: u32, n: u32) -> Layout {
        Layout { chunk_size: cs, pool: "p".into(), targets: (1..=n).collect() }
    }

    #[test]
    fn layout_text_round_trips_and_names_bad_keys() {
        let dl =
            DirLayout { chunk_size: 262144, stripe_count: 2, pool: "nvme".into(), start_target: Some(3), local: false };
        let t = dir_layout_text(&dl);
        assert_eq!(t, "stripe_count=2 stripe_size=262144 pool=nvme stripe_offset=3");
        assert_eq!(parse_layout_text(&t, &DirLayout::default()).unwrap(), dl);
        let l = Layout { chunk_size: 65536, pool: "p".into(), targets: vec![4, 1] };
        assert_eq!(file_layout_text(&l), "stripe_count=2 stripe_size=65536 pool=p stripe_offset=4 targets=4,1");
        let base = DirLayout::default();
        let d = parse_layout_text("stripe_size=4M stripe_count=-1", &base).unwrap();
        assert_eq!((d.chunk_size, d.stripe_count, d.pool.as_str()), (4 << 20, -1, DEFAULT_POOL));
        let local = DirLayout { stripe_count: 1, local: true, ..DirLayout::default() };
        let t = dir_layout_text(&local);
        assert!(t.ends_with(" placement=local"), "{t}");
        assert_eq!(parse_layout_text(&t, &base).unwrap(), local);
        assert!(!parse_layout_text("placement=rotate", &local).unwrap().local);
        assert!(parse_layout_text("placement=near", &base).unwrap_err().contains("use local or rotate"));
        for (bad, want) in [
            ("stripe_size=1000", "power of two"),
            ("stripe_count=0", "stripe count 0"),
            ("stripe_count=x", "not a number"),
            ("colour=red", "unknown layout key"),
            ("pool", "not key=value"),
            ("stripe_offset=-5", "invalid"),
        ] {
            let e = parse_layout_text(bad, &base).unwrap_err();
            assert!(e.contains(want), "{bad}: {e}");
        }
    }

    #[test]
    fn segments_follow_design_formula() {
        let l = layout(65536, 4);
        let segs: Vec<_> = l.segments(65536 * 5 + 10, 65536).collect();
        assert_eq!(segs.len(), 2);
        assert_eq!(segs[0].target, 2);
        assert_eq!(segs[0].local_offset, 65536 + 10);
        assert_eq!(segs[0].len, 65536 - 10);
        assert_eq!(segs[1].target, 3);
        assert_eq!(segs[1].local_offset, 65536);
        assert_eq!(segs[1].len, 10);
    }

    proptest! {
        #[test]
        fn segments_cover_range_exactly(off in 0u64..10_000_000, len in 0u64..5_000_000, n in 1u32..6) {
            let l = layout(65536, n);
            let mut pos = off;
            for s in l.segments(off, len) {
                prop_assert_eq!(s.file_offset, pos);
                prop_assert!(s.len > 0);
                pos += s.len;
            }
            prop_assert_eq!(pos, off + len);
        }

        #[test]
        fn local_len_matches_segments(size in 0u64..3_000_000, n in 1u32..6) {
            let l = layout(65536, n);
            let mut expect = vec![0u64; n as usize];
            for s in l.segments(0, size) {
                let e = &mut expect[s.stripe_index];
                *e = (*e).max(s.local_offset + s.len);
            }
            for (i, e) in expect.iter().enumerate() {
                prop_assert_eq!(l.local_len(i, size), *e);
            }
        }
    }
}
