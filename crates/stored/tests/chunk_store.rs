//! Behaviour of the chunk store through its public API, on both I/O backends.
//!
//! Tests that need a full disk or a read-only file system mount a small tmpfs (they run as root);
//! a failed mount fails the test with what is missing, never skips it.

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use odfs_proto::codec::FileSpan;
use odfs_proto::{ErrorCode, InodeId, RemoteError};
use odfs_stored::{ChunkStore, IoBackend, StoreError, StoreOptions, TargetConfig};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use tempfile::TempDir;

const T: u32 = 1;

/// Deterministic bytes, different for every seed.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// The bytes of `spans` as a transport sends them, back to back.
fn span_bytes(spans: &[FileSpan]) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let mut out = Vec::new();
    for s in spans {
        let mut b = vec![0u8; s.len as usize];
        s.file.read_exact_at(&mut b, s.offset).expect("a span's bytes are in its file");
        out.extend_from_slice(&b);
    }
    out
}

fn open_at(path: PathBuf, backend: IoBackend) -> ChunkStore {
    let store = ChunkStore::open(&[TargetConfig { id: T, path }], backend).expect("open store");
    let want = match backend {
        IoBackend::Syscall => "syscall",
        _ => "io_uring",
    };
    assert_eq!(store.backend_name(), want);
    store
}

fn open(dir: &TempDir, backend: IoBackend) -> ChunkStore {
    open_at(dir.path().join("t1"), backend)
}

/// Writes into `model` as the store should.
fn apply(model: &mut Vec<u8>, offset: usize, data: &[u8]) {
    if model.len() < offset + data.len() {
        model.resize(offset + data.len(), 0);
    }
    model[offset..offset + data.len()].copy_from_slice(data);
}

/// The whole chunk file, read in pieces no larger than a request may be.
async fn read_all(store: &ChunkStore, ino: InodeId) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let piece = store.read(T, ino, out.len() as u64, 4 << 20).await.expect("read");
        if piece.is_empty() {
            return out;
        }
        out.extend_from_slice(&piece);
    }
}

/// Runs an async test body once per backend.
macro_rules! both_backends {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            use super::*;
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn uring() {
                super::$name(IoBackend::Uring).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn syscall() {
                super::$name(IoBackend::Syscall).await
            }
        }
    )*};
}

both_backends!(
    round_trip_odd_offsets,
    concurrent_writers_one_chunk,
    concurrent_writers_many_chunks,
    holes_read_as_zeros_or_short,
    truncate_up_and_down,
    remove_is_idempotent_and_closes,
    sync_and_sync_writes,
    unknown_target_is_refused,
    small_fd_cache_keeps_data_right,
    abandoned_requests_do_not_disturb,
    full_disk_keeps_acknowledged_data,
    reads_partly_in_the_page_cache_are_whole,
    new_chunks_take_precreated_files,
    concurrent_first_writes_to_a_pooled_chunk_all_land,
    many_ranges_read_at_once,
    large_aligned_writes_go_past_the_page_cache,
    a_single_sequential_reader_leaves_no_copy_behind,
);

async fn round_trip_odd_offsets(backend: IoBackend) {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir, backend);
    let ino = InodeId::new(3, 0x1234);
    let mut model = Vec::new();
    let writes: &[(usize, usize)] = &[
        (0, 1),
        (4095, 3),
        (1, 1),
        ((1 << 20) + 7, 4 << 20), // large, unaligned
        (12_345, 1),
        (65_535, 70_001),
        ((5 << 20) + 11, 2),
    ];
    for (i, &(off, len)) in writes.iter().enumerate() {
        let data = pattern(i as u64, len);
        let n = store.write(T, ino, off as u64, data.clone(), false).await.expect("write");
        assert_eq!(n as usize, len, "write {i} reports every byte");
        apply(&mut model, off, &data);
    }
    assert_eq!(store.stat_chunk(T, ino).await.unwrap(), Some(model.len() as u64));
    assert!(read_all(&store, ino).await == model, "whole chunk matches");
    // Reads at odd offsets and lengths, including one running past the end.
    for &(off, len) in &[(1usize, 1u32), (4094, 5), ((1 << 20) + 6, 3 << 20), (model.len() - 3, 100)] {
        let got = store.read(T, ino, off as u64, len).await.expect("read");
        let end = (off + len as usize).min(model.len());
        assert!(got == model[off..end], "read at {off} len {len}");
    }
    // The bytes really are in the file the store names.
    let on_disk = std::fs::read(store.chunk_path(T, ino).unwrap()).unwrap();
    assert!(on_disk == model);
}

async fn concurrent_writers_one_chunk(backend: IoBackend) {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir, backend);
    let ino = InodeId(77);
    const REGION: usize = 1 << 20;
    const PIECE: usize = 64 << 10;
    let mut tasks = Vec::new();
    for w in 0..16usize {
        let s = store.clone();
        tasks.push(tokio::spawn(async move {
            // Each writer fills its own region piece by piece, so pieces of all writers
            // interleave in time.
            for p in 0..REGION / PIECE {
                let off = w * REGION + p * PIECE;
                let n = s.write(T, ino, off as u64, pattern((w * 1000 + p) as u64, PIECE), false).await.expect("write");
                assert_eq!(n as usize, PIECE);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let mut model = Vec::new();
    for w in 0..16usize {
        for p in 0..REGION / PIECE {
            apply(&mut model, w * REGION + p * PIECE, &pattern((w * 1000 + p) as u64, PIECE));
        }
    }
    assert!(read_all(&store, ino).await == model);
}

async fn concurrent_writers_many_chunks(backend: IoBackend) {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir, backend);
    const CHUNKS: u64 = 40;
    const LEN: usize = 24_001;
    let mut tasks = Vec::new();
    for w in 0..16u64 {
        let s = store.clone();
        tasks.push(tokio::spawn(async move {
            for c in 0..CHUNKS {
                let off = w * LEN as u64;
                s.write(T, InodeId(1000 + c), off, pattern(w * 100 + c, LEN), w % 5 == 0).await.expect("write");
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    for c in 0..CHUNKS {
        let mut model = Vec::new();
        for w in 0..16u64 {
            apply(&mut model, w as usize * LEN, &pattern(w * 100 + c, LEN));
        }
        assert!(read_all(&store, InodeId(1000 + c)).await == model, "chunk {c}");
    }
}

async fn holes_read_as_zeros_or_short(backend: IoBackend) {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir, backend);
    let ino = InodeId(5);
    // A missing chunk file is a hole: empty, not an error.
    assert_eq!(store.read(T, ino, 0, 4096).await.unwrap(), Vec::<u8>::new());
    assert_eq!(store.stat_chunk(T, ino).await.unwrap(), None);
    assert!(!store.chunk_path(T, ino).unwrap().exists(), "reads create nothing");

    let off = 1u64 << 20;
    store.write(T, ino, off, b"0123456789".to_vec(), false).await.unwrap();
    assert_eq!(store.stat_chunk(T, ino).await.unwrap(), Some(off + 10));
    assert_eq!(store.read(T, ino, 0, 100).await.unwrap(), vec![0u8; 100]);
    assert_eq!(store.read(T, ino, off - 3, 6).await.unwrap(), [&[0u8; 3][..], b"012"].concat());
    assert_eq!(store.read(T, ino, off + 5, 100).await.unwrap(), b"56789".to_vec());
    assert_eq!(store.read(T, ino, off + 10, 100).await.unwrap(), Vec::<u8>::new());
    assert_eq!(store.read(T, ino, off * 4, 100).await.unwrap(), Vec::<u8>::new());
    assert_eq!(store.read(T, ino, 0, 0).await.unwrap(), Vec::<u8>::new());
    // The same ranges as spans of the chunk file, sent from it by the transport.
    let span = |offset: u64, len: u32| {
        let store = store.clone();
        async move { store.read_span(T, ino, offset, len).await.unwrap() }
    };
    assert_eq!(span_bytes(&[span(0, 100).await.unwrap()]), vec![0u8; 100]);
    assert_eq!(span_bytes(&[span(off - 3, 6).await.unwrap()]), [&[0u8; 3][..], b"012"].concat());
    assert_eq!(span_bytes(&[span(off + 5, 100).await.unwrap()]), b"56789".to_vec(), "short at the end");
    assert_eq!(span(off + 10, 100).await, None, "nothing past the end");
    assert_eq!(span(0, 0).await, None);
    assert_eq!(store.read_span(T, InodeId(6), 0, 4096).await.unwrap(), None, "a missing file has none");
    assert!(!store.chunk_path(T, InodeId(6)).unwrap().exists(), "reads create nothing");
    // The hole takes no space on disk.
    let meta = std::fs::metadata(store.chunk_path(T, ino).unwrap()).unwrap();
    assert!(meta.blocks() * 512 < 64 << 10, "sparse: {} blocks", meta.blocks());
}

async fn many_ranges_read_at_once(backend: IoBackend) {
    use odfs_proto::storage::{ChunkRange, READ_MANY_BYTES, READ_MANY_ITEMS};
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir, backend);
    // Files of many sizes, one read through a cached descriptor (written just now), one
    // missing, one shorter than asked, one read from an offset.
    let files: Vec<(InodeId, Vec<u8>)> =
        (1..=40u64).map(|i| (InodeId(i), pattern(i, (i as usize * 1_337) % 70_000))).collect();
    for (ino, data) in &files {
        store.write(T, *ino, 0, data.clone(), false).await.unwrap();
    }
    let mut items: Vec<ChunkRange> =
        files.iter().map(|(ino, d)| ChunkRange { ino: *ino, offset: 0, len: d.len() as u32 }).collect();
    items.push(ChunkRange { ino: InodeId(999), offset: 0, len: 4096 });
    items.push(ChunkRange { ino: InodeId(7), offset: 0, len: 1 << 20 });
    items.push(ChunkRange { ino: InodeId(9), offset: 100, len: 50 });
    let (lens, spans) = store.read_many(T, items.clone()).await.unwrap();
    assert_eq!(lens.len(), items.len());
    assert_eq!(spans.len(), items.len() - 1, "one span per range with bytes");
    let data = span_bytes(&spans);
    let mut want = Vec::new();
    for (_, d) in &files {
        want.extend_from_slice(d);
    }
    want.extend_from_slice(&files[6].1);
    want.extend_from_slice(&files[8].1[100..150]);
    let mut want_lens: Vec<Option<u32>> = files.iter().map(|(_, d)| Some(d.len() as u32)).collect();
    want_lens.extend([Some(0), Some(files[6].1.len() as u32), Some(50)]);
    assert_eq!(lens, want_lens);
    assert!(data == want, "the ranges' bytes back to back");
    assert!(!store.chunk_path(T, InodeId(999)).unwrap().exists(), "reads create nothing");
    // Too many ranges, or too many bytes, are refused as a whole with what is wrong.
    let many = vec![ChunkRange { ino: InodeId(1), offset: 0, len: 1 }; READ_MANY_ITEMS + 1];
    let e = store.read_many(T, many).await.unwrap_err();
    assert!(e.to_string().contains("ranges"), "{e}");
    let big = vec![ChunkRange { ino: InodeId(1), offset: 0, len: (READ_MANY_BYTES / 2) as u32 + 1 }; 2];
    assert!(matches!(store.read_many(T, big).await, Err(StoreError::TooLarge { .. })));
    assert!(matches!(store.read_many(99, vec![]).await, Err(StoreError::UnknownTarget(99))));
}

async fn truncate_up_and_down(backend: IoBackend) {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir, backend);
    let ino = InodeId(9);
    let data = pattern(9, 100_000);
    store.write(T, ino, 0, data.clone(), false).await.unwrap();

    store.truncate(T, ino, 10_000).await.unwrap();
    assert_eq!(store.stat_chunk(T, ino).await.unwrap(), Some(10_000));
    assert!(read_all(&store, ino).await == data[..10_000]);

    store.truncate(T, ino, 1 << 20).await.unwrap();
    assert_eq!(store.stat_chunk(T, ino).await.unwrap(), Some(1 << 20));
    let all = read_all(&store, ino).await;
    assert_eq!(all.len(), 1 << 20);
    assert!(all[..10_000] == data[..10_000]);
    assert!(all[10_000..].iter().all(|&b| b == 0), "grown part is a hole");

    // Missing file: length 0 leaves it missing, a length creates it sparse.
    let other = InodeId(10);
    store.truncate(T, other, 0).await.unwrap();
    assert_eq!(store.stat_chunk(T, other).await.unwrap(), None);
    store.truncate(T, other, 5000).await.unwrap();
    assert_eq!(store.stat_chunk(T, other).await.unwrap(), Some(5000));
    assert_eq!(store.read(T, other, 0, 8000).await.unwrap(), vec![0u8; 5000]);
    store.truncate(T, other, 0).await.unwrap();
    assert_eq!(store.stat_chunk(T, other).await.unwrap(), Some(0));
}

/// Descriptors of this process that point at `path` after it was unlinked.
fn open_deleted(path: &Path) -> usize {
    let want = format!("{} (deleted)", path.display());
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|l| l.to_string_lossy() == want)
        .count()
}

async fn remove_is_idempotent_and_closes(backend: IoBackend) {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir, backend);
    let ino = InodeId(11);
    let path = store.chunk_path(T, ino).unwrap();
    store.write(T, ino, 0, pattern(1, 5000), true).await.unwrap();
    assert_eq!(store.read(T, ino, 0, 10).await.unwrap().len(), 10);

    store.remove(T, ino).await.unwrap();
    assert!(!path.exists());
    assert_eq!(open_deleted(&path), 0, "the cached descriptor was closed");
    assert_eq!(store.stat_chunk(T, ino).await.unwrap(), None);
    assert_eq!(store.read(T, ino, 0, 10).await.unwrap(), Vec::<u8>::new());
    store.remove(T, ino).await.unwrap();
    store.remove(T, InodeId(12)).await.unwrap();

    // A later write starts a new, empty chunk file.
    store.write(T, ino, 100, vec![7; 10], false).await.unwrap();
    let mut want = vec![0u8; 100];
    want.extend_from_slice(&[7; 10]);
    assert_eq!(read_all(&store, ino).await, want);
}

async fn sync_and_sync_writes(backend: IoBackend) {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir, backend);
    let ino = InodeId(13);
    store.sync(T, ino).await.expect("sync of a missing chunk is fine");
    assert_eq!(store.stat_chunk(T, ino).await.unwrap(), None);
    store.write(T, ino, 3, pattern(13, 300_000), true).await.unwrap();
    store.write(T, ino, 0, Vec::new(), true).await.unwrap();
    store.sync(T, ino).await.unwrap();
    let mut model = Vec::new();
    apply(&mut model, 3, &pattern(13, 300_000));
    assert!(read_all(&store, ino).await == model);
}

async fn unknown_target_is_refused(backend: IoBackend) {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir, backend);
    let ino = InodeId(1);
    let e = store.write(99, ino, 0, vec![1], false).await.unwrap_err();
    assert!(matches!(e, StoreError::UnknownTarget(99)), "{e:?}");
    assert!(matches!(store.read(99, ino, 0, 1).await, Err(StoreError::UnknownTarget(99))));
    assert!(matches!(store.truncate(99, ino, 0).await, Err(StoreError::UnknownTarget(99))));
    assert!(matches!(store.sync(99, ino).await, Err(StoreError::UnknownTarget(99))));
    assert!(matches!(store.remove(99, ino).await, Err(StoreError::UnknownTarget(99))));
    assert!(matches!(store.stat_chunk(99, ino).await, Err(StoreError::UnknownTarget(99))));
    assert!(matches!(store.space(99), Err(StoreError::UnknownTarget(99))));
    assert_eq!(store.chunk_path(99, ino), None);
    let r = RemoteError::from(e);
    assert_eq!(r.code, ErrorCode::Invalid);
    // Oversized and out-of-range requests are refused before any I/O.
    let e = store.read(T, ino, 0, u32::MAX).await.unwrap_err();
    assert_eq!(RemoteError::from(e).code, ErrorCode::Range);
    let e = store.write(T, ino, u64::MAX - 1, vec![1; 4], false).await.unwrap_err();
    assert!(matches!(e, StoreError::Invalid(_)), "{e:?}");
    assert_eq!(store.stat_chunk(T, ino).await.unwrap(), None);
}

async fn small_fd_cache_keeps_data_right(backend: IoBackend) {
    let dir = tempfile::tempdir().unwrap();
    let store = ChunkStore::open_with(
        &[TargetConfig { id: T, path: dir.path().join("t1") }],
        StoreOptions { backend, fd_cache: 3, ring_max_ops: 4, ring_max_bytes: 256 << 10, ..StoreOptions::default() },
    )
    .unwrap();
    // Many more chunks than cached descriptors, touched in turn by concurrent tasks, so files
    // are evicted while other operations on them are in flight.
    let mut tasks = Vec::new();
    for w in 0..8u64 {
        let s = store.clone();
        tasks.push(tokio::spawn(async move {
            for round in 0..4u64 {
                for c in 0..20u64 {
                    let off = (round * 8 + w) * 1000;
                    s.write(T, InodeId(c), off, pattern(c * 7919 + round * 8 + w, 1000), false).await.unwrap();
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    for c in 0..20u64 {
        let mut model = Vec::new();
        for slot in 0..32u64 {
            apply(&mut model, slot as usize * 1000, &pattern(c * 7919 + slot, 1000));
        }
        assert!(read_all(&store, InodeId(c)).await == model, "chunk {c}");
    }
}

/// Pages of `[offset, offset + len)` of `path` in the page cache.
fn resident(path: &Path, offset: usize, len: usize) -> usize {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path).unwrap();
    // SAFETY: the mapping is read only, `len` bytes of an open file, unmapped before return;
    // `vec` has one byte per page of it.
    unsafe {
        let map =
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, f.as_raw_fd(), offset as i64);
        assert_ne!(map, libc::MAP_FAILED);
        let mut vec = vec![0u8; len.div_ceil(4096)];
        assert_eq!(libc::mincore(map, len, vec.as_mut_ptr()), 0);
        libc::munmap(map, len);
        vec.iter().filter(|&&b| b & 1 == 1).count()
    }
}

/// Drops the whole (clean) file from the page cache, then reads `[offset, offset + len)` back
/// into it without read-ahead, so exactly that range is cached.
fn cache_only(path: &Path, offset: usize, len: usize) {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(path).unwrap();
    // SAFETY: advice calls on an open descriptor.
    unsafe {
        assert_eq!(libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED), 0);
        assert_eq!(libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM), 0);
    }
    let mut buf = vec![0u8; len];
    f.read_exact_at(&mut buf, offset as u64).unwrap();
}

async fn reads_partly_in_the_page_cache_are_whole(backend: IoBackend) {
    // A read is first served from what the page cache holds without waiting; the rest must
    // follow from the disk, in order, whatever part of the range is cached.
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir, backend);
    let ino = InodeId(77);
    const MIB: usize = 1 << 20;
    let data = pattern(77, 3 * MIB + 123);
    store.write(T, ino, 0, data.clone(), true).await.unwrap();
    let path = store.chunk_path(T, ino).unwrap();
    // (cached range, read range), each as (offset, length)
    type Range = (usize, usize);
    let cases: &[(Range, Range)] = &[
        ((0, MIB / 2), (0, MIB)),               // cached, then not
        ((MIB, MIB), (MIB / 2, MIB)),           // not cached, then cached
        ((0, 4096), (3 * MIB - 10, MIB)),       // not cached, past the end of the file
        ((0, data.len()), (3 * MIB - 10, MIB)), // cached, past the end of the file
        ((0, data.len()), (MIB - 5, MIB + 10)), // longer than a read tried at once
        ((MIB, 4096), (MIB - 4096, 3 * 4096)),  // one cached page amid others
    ];
    for &((c_off, c_len), (off, len)) in cases {
        cache_only(&path, c_off, c_len);
        let end = (off + len).min(data.len());
        // Exactly the pages asked for are cached: the case is what it says.
        let first = off & !4095;
        let (lo, hi) = (c_off.max(first), (c_off + c_len).min(end));
        let want = if lo < hi { (hi.div_ceil(4096) * 4096 - (lo & !4095)) / 4096 } else { 0 };
        assert_eq!(resident(&path, first, end - first), want, "pages of [{off}, {end}) cached");
        let got = store.read(T, ino, off as u64, len as u32).await.unwrap();
        assert!(got == data[off..end], "read of {len} bytes at {off}: {} bytes back", got.len());
    }
}

/// Inode numbers of the files in the target's pool.
fn pooled(target: &Path) -> std::collections::HashSet<u64> {
    std::fs::read_dir(target.join("free")).unwrap().map(|e| e.unwrap().metadata().unwrap().ino()).collect()
}

async fn new_chunks_take_precreated_files(backend: IoBackend) {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("t1");
    // Whatever else runs on this machine meanwhile (other tests): the node counts as idle.
    let opts = StoreOptions { backend, precreate: 40, precreate_min_idle: 0.0, ..StoreOptions::default() };
    let store = ChunkStore::open_with(&[TargetConfig { id: T, path: target.clone() }], opts).unwrap();
    // The pool fills in the background, on idle CPU; wait for it (no timing is asserted).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while pooled(&target).len() < 40 {
        assert!(std::time::Instant::now() < deadline, "the pool holds {} of 40 files", pooled(&target).len());
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let made = pooled(&target);
    assert_eq!(made.len(), 40, "no more than asked for");
    // New chunk files are those files, moved into place, and hold what was written.
    for i in 0..10u64 {
        let data = pattern(i, 3901);
        store.write(T, InodeId(1000 + i), 0, data.clone(), false).await.unwrap();
        let path = store.chunk_path(T, InodeId(1000 + i)).unwrap();
        assert!(made.contains(&std::fs::metadata(&path).unwrap().ino()), "chunk {i} is a precreated file");
        assert!(store.read(T, InodeId(1000 + i), 0, 4096).await.unwrap() == data);
    }
    // Refilled once creates pause, never past what was asked for.
    let left = pooled(&target);
    assert!(left.len() <= 40 && made.iter().filter(|i| left.contains(i)).count() == 30, "{} pooled", left.len());
    // The precreating thread ends with the store (each test runs in a process of its own).
    drop(store);
    let threads = || {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            // A thread that ends between the listing and the read has no comm left: not ours.
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .filter(|comm| comm.trim() == "precreate")
            .count()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while threads() > 0 {
        assert!(std::time::Instant::now() < deadline, "the precreate thread outlives its store");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

async fn concurrent_first_writes_to_a_pooled_chunk_all_land(backend: IoBackend) {
    // A new chunk file is a pooled one moved into place. Requests for the same new chunk
    // arriving together (a client's write-behind sends a chunk file's pieces at once) race to
    // create it: each one's bytes must be there afterwards, none emptied by another's take.
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir, backend);
    for round in 0..20u64 {
        for c in 0..8u64 {
            store.write(T, InodeId(c), 0, vec![9; 100], false).await.unwrap();
        }
        for c in 0..8u64 {
            store.remove(T, InodeId(c)).await.unwrap();
        }
        let ino = InodeId(1000 + round);
        let tasks: Vec<_> = (0..8u64)
            .map(|k| {
                let s = store.clone();
                tokio::spawn(async move { s.write(T, ino, k * 4096, pattern(round * 8 + k, 4096), false).await })
            })
            .collect();
        let mut model = Vec::new();
        for (k, t) in tasks.into_iter().enumerate() {
            t.await.unwrap().unwrap();
            apply(&mut model, k * 4096, &pattern(round * 8 + k as u64, 4096));
        }
        assert!(read_all(&store, ino).await == model, "round {round}: an acknowledged write is missing");
    }
}

async fn abandoned_requests_do_not_disturb(backend: IoBackend) {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir, backend);
    // Callers that stop waiting (a timed-out RPC) must not free buffers under the kernel or
    // wedge the store.
    let mut tasks = Vec::new();
    for i in 0..24u64 {
        let s = store.clone();
        tasks.push(tokio::spawn(async move {
            let _ = s.write(T, InodeId(50 + i % 3), i << 22, vec![i as u8; 4 << 20], i % 4 == 0).await;
            let _ = s.read(T, InodeId(50 + i % 3), 0, 4 << 20).await;
        }));
    }
    tokio::task::yield_now().await;
    for t in &tasks {
        t.abort();
    }
    for t in tasks {
        let _ = t.await;
    }
    let ino = InodeId(60);
    let data = pattern(60, 3 << 20);
    store.write(T, ino, 1, data.clone(), true).await.unwrap();
    let mut model = Vec::new();
    apply(&mut model, 1, &data);
    assert!(read_all(&store, ino).await == model);
}

/// A tmpfs mounted for one test; unmounted on drop.
struct Tmpfs {
    dir: TempDir,
}

impl Tmpfs {
    fn mount(opts: &str) -> Tmpfs {
        let dir = tempfile::tempdir().unwrap();
        if let Err(e) = mount(Some("tmpfs"), dir.path(), Some("tmpfs"), MsFlags::empty(), Some(opts)) {
            panic!(
                "mounting a tmpfs ({opts}) at {} failed: {e}. This test needs root \
                 (CAP_SYS_ADMIN) and tmpfs support to make a small or read-only file system",
                dir.path().display()
            );
        }
        Tmpfs { dir }
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn remount_read_only(&self) {
        mount(None::<&str>, self.path(), None::<&str>, MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY, None::<&str>)
            .expect("remount read-only");
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        if umount2(self.path(), MntFlags::empty()).is_err() {
            let _ = umount2(self.path(), MntFlags::MNT_DETACH);
        }
    }
}

async fn full_disk_keeps_acknowledged_data(backend: IoBackend) {
    let fs = Tmpfs::mount("size=2m");
    let store = open_at(fs.path().join("t1"), backend);
    let space = store.space(T).unwrap();
    assert!(space.capacity <= 2 << 20 && space.free > 0, "{space:?}");

    // Several chunks grow in turn, some writes synced, until the file system is full.
    let mut acked: Vec<(InodeId, u64, Vec<u8>)> = Vec::new();
    let mut ends = [0u64; 4];
    let mut full = None;
    for i in 0..1000u64 {
        let c = (i % 4) as usize;
        let ino = InodeId(200 + c as u64);
        let len = 50_000 + (i as usize * 997) % 30_000;
        let off = ends[c] + (i % 3); // odd offsets, tiny holes
        let data = pattern(i, len);
        match store.write(T, ino, off, data.clone(), i % 5 == 0).await {
            Ok(n) => {
                assert_eq!(n as usize, len);
                acked.push((ino, off, data));
                ends[c] = off + len as u64;
            }
            Err(e) => {
                full = Some(e);
                break;
            }
        }
    }
    let e = full.expect("a 2 MiB tmpfs never filled up");
    let path = match &e {
        StoreError::NoSpace { path } => path.clone(),
        other => panic!("expected NoSpace, got {other:?}"),
    };
    assert!(path.starts_with(fs.path()), "{path:?}");
    assert_eq!(RemoteError::from(e).code, ErrorCode::NoSpace);
    assert!(acked.len() >= 10, "only {} writes fit", acked.len());

    // More failing writes: into a new chunk, and into existing chunks past their end.
    for c in 0..4u64 {
        let e = store.write(T, InodeId(200 + c), ends[c as usize], pattern(c, 200_000), true).await.unwrap_err();
        assert!(matches!(e, StoreError::NoSpace { .. }), "{e:?}");
    }
    assert!(matches!(
        store.write(T, InodeId(300), 0, pattern(9, 200_000), false).await,
        Err(StoreError::NoSpace { .. })
    ));

    // Every acknowledged write reads back intact.
    for (ino, off, data) in &acked {
        let got = store.read(T, *ino, *off, data.len() as u32).await.unwrap();
        assert!(got == *data, "acknowledged write at {off} of {ino} changed");
    }

    // Freeing space makes the target usable again.
    store.remove(T, InodeId(200)).await.unwrap();
    store.remove(T, InodeId(300)).await.unwrap();
    store.write(T, InodeId(301), 0, pattern(301, 100_000), true).await.unwrap();
    assert!(store.read(T, InodeId(301), 0, 100_000).await.unwrap() == pattern(301, 100_000));
    drop(store);
}

#[test]
fn missing_parent_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("no/such/parent/t1");
    let e = ChunkStore::open(&[TargetConfig { id: T, path: path.clone() }], IoBackend::Syscall).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, StoreError::Config(_)), "{e:?}");
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    assert!(!path.exists() && !dir.path().join("no").exists(), "nothing created");
}

#[test]
fn target_path_that_is_a_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t1");
    std::fs::write(&path, b"x").unwrap();
    let e = ChunkStore::open(&[TargetConfig { id: T, path: path.clone() }], IoBackend::Syscall).unwrap_err();
    assert!(e.to_string().contains(&path.display().to_string()), "{e}");
}

#[test]
fn read_only_file_system_is_a_clear_error() {
    // A new target directory on a read-only file system.
    let ro = Tmpfs::mount("size=1m,ro");
    let path = ro.path().join("t1");
    let e = ChunkStore::open(&[TargetConfig { id: T, path: path.clone() }], IoBackend::Syscall).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    assert!(msg.contains("Read-only"), "{msg}");

    // An existing, already claimed target directory whose file system became read-only.
    let fs = Tmpfs::mount("size=1m");
    let path = fs.path().join("t1");
    drop(open_at(path.clone(), IoBackend::Syscall));
    fs.remount_read_only();
    let e = ChunkStore::open(&[TargetConfig { id: T, path: path.clone() }], IoBackend::Syscall).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    assert!(msg.contains("not writable"), "{msg}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn target_id_is_claimed_and_checked() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t1");
    let store = open_at(path.clone(), IoBackend::Uring);
    store.write(T, InodeId(1), 0, b"kept".to_vec(), true).await.unwrap();
    drop(store);
    assert_eq!(std::fs::read_to_string(path.join("target.id")).unwrap().trim(), "1");

    let e = ChunkStore::open(&[TargetConfig { id: 2, path: path.clone() }], IoBackend::Uring).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, StoreError::Config(_)), "{e:?}");
    assert!(msg.contains("belongs to target 1") && msg.contains("not to target 2"), "{msg}");
    assert!(msg.contains(&path.display().to_string()), "{msg}");

    // The rightful target reopens it with its data.
    let store = open_at(path, IoBackend::Syscall);
    assert_eq!(store.read(T, InodeId(1), 0, 100).await.unwrap(), b"kept".to_vec());
}

#[test]
fn duplicate_targets_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let a = TargetConfig { id: 1, path: dir.path().join("a") };
    let b = TargetConfig { id: 1, path: dir.path().join("b") };
    let e = ChunkStore::open(&[a.clone(), b], IoBackend::Syscall).unwrap_err();
    assert!(e.to_string().contains("listed twice"), "{e}");
    let c = TargetConfig { id: 2, path: dir.path().join("a") };
    let e = ChunkStore::open(&[a, c], IoBackend::Syscall).unwrap_err();
    assert!(e.to_string().contains("share the directory"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_targets_are_separate() {
    let dir = tempfile::tempdir().unwrap();
    let targets: Vec<TargetConfig> =
        (1..=3).map(|id| TargetConfig { id, path: dir.path().join(format!("t{id}")) }).collect();
    let store = ChunkStore::open(&targets, IoBackend::Auto).unwrap();
    // io_uring works on this kind of machine, so Auto must pick it.
    assert_eq!(store.backend_name(), "io_uring");
    assert_eq!(store.targets(), vec![1, 2, 3]);
    let ino = InodeId(42);
    for id in 1..=3u32 {
        store.write(id, ino, 0, vec![id as u8; 10], false).await.unwrap();
    }
    for id in 1..=3u32 {
        assert_eq!(store.read(id, ino, 0, 100).await.unwrap(), vec![id as u8; 10]);
        let p = store.chunk_path(id, ino).unwrap();
        assert_eq!(p, dir.path().join(format!("t{id}/chunks/2a/000000000000002a")));
        assert!(p.exists());
    }
    store.remove(2, ino).await.unwrap();
    assert_eq!(store.stat_chunk(1, ino).await.unwrap(), Some(10));
    assert_eq!(store.stat_chunk(2, ino).await.unwrap(), None);
}

#[test]
fn space_is_plausible() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir, IoBackend::Syscall);
    let s = store.space(T).unwrap();
    assert!(s.capacity >= s.free && s.free > 0, "{s:?}");
    assert!(s.inodes_total >= s.inodes_free, "{s:?}");

    let fs = Tmpfs::mount("size=3m,nr_inodes=500");
    let store = open_at(fs.path().join("t1"), IoBackend::Syscall);
    let s = store.space(T).unwrap();
    assert_eq!(s.capacity, 3 << 20, "{s:?}");
    assert!(s.free > 2 << 20 && s.free <= s.capacity, "{s:?}");
    assert_eq!(s.inodes_total, 500, "{s:?}");
    // The target's own directories use some inodes.
    assert!(s.inodes_free < 500 - 256, "{s:?}");
}

mod model {
    //! Random operation sequences against an in-memory model of one chunk file.
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Write { off: u64, len: usize, seed: u64, sync: bool },
        Read { off: u64, len: u32 },
        Truncate { len: u64 },
        Remove,
        Sync,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u64..300_000, 0usize..70_000, any::<u64>(), any::<bool>())
                .prop_map(|(off, len, seed, sync)| Op::Write { off, len, seed, sync }),
            3 => (0u64..400_000, 0u32..100_000).prop_map(|(off, len)| Op::Read { off, len }),
            1 => (0u64..350_000).prop_map(|len| Op::Truncate { len }),
            1 => Just(Op::Remove),
            1 => Just(Op::Sync),
        ]
    }

    async fn run(backend: IoBackend, ops: Vec<Op>) -> Result<(), TestCaseError> {
        let dir = tempfile::tempdir().unwrap();
        let store = open(&dir, backend);
        let ino = InodeId(1);
        let mut model: Option<Vec<u8>> = None;
        for op in ops {
            match op {
                Op::Write { off, len, seed, sync } => {
                    let data = pattern(seed, len);
                    store.write(T, ino, off, data.clone(), sync).await.unwrap();
                    apply(model.get_or_insert_with(Vec::new), off as usize, &data);
                }
                Op::Read { off, len } => {
                    let got = store.read(T, ino, off, len).await.unwrap();
                    let m = model.as_deref().unwrap_or(&[]);
                    let s = (off as usize).min(m.len());
                    let e = (off as usize + len as usize).min(m.len());
                    prop_assert!(got == m[s..e], "read {off}+{len}");
                }
                Op::Truncate { len } => {
                    store.truncate(T, ino, len).await.unwrap();
                    if len > 0 || model.is_some() {
                        model.get_or_insert_with(Vec::new).resize(len as usize, 0);
                    }
                }
                Op::Remove => {
                    store.remove(T, ino).await.unwrap();
                    model = None;
                }
                Op::Sync => store.sync(T, ino).await.unwrap(),
            }
            let len = store.stat_chunk(T, ino).await.unwrap();
            prop_assert_eq!(len, model.as_ref().map(|m| m.len() as u64));
        }
        Ok(())
    }

    fn check(backend: IoBackend, ops: Vec<Op>) -> Result<(), TestCaseError> {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
            .block_on(run(backend, ops))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        #[test]
        fn uring_matches_model(ops in proptest::collection::vec(op(), 1..24)) {
            check(IoBackend::Uring, ops)?;
        }
        #[test]
        fn syscall_matches_model(ops in proptest::collection::vec(op(), 1..24)) {
            check(IoBackend::Syscall, ops)?;
        }
    }
}

/// Pages of `path` in `[offset, offset + len)` that are in the page cache (`mincore`).
fn cached_pages(path: &Path, offset: usize, len: usize) -> usize {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path).unwrap();
    let size = f.metadata().unwrap().len() as usize;
    // SAFETY: a read-only shared mapping of the whole file, unmapped below; mincore writes one
    // byte per page into `vec`, which has exactly that many.
    unsafe {
        let map = libc::mmap(std::ptr::null_mut(), size, libc::PROT_READ, libc::MAP_SHARED, f.as_raw_fd(), 0);
        assert_ne!(map, libc::MAP_FAILED, "mmap {}", path.display());
        let pages = len.div_ceil(4096);
        let mut vec = vec![0u8; pages];
        let r = libc::mincore(map.cast::<u8>().add(offset).cast(), len, vec.as_mut_ptr());
        libc::munmap(map, size);
        assert_eq!(r, 0, "mincore");
        vec.iter().filter(|b| **b & 1 == 1).count()
    }
}

/// Chunk writes of at least `direct_write_min` bytes at aligned offsets go to the disk past the
/// page cache and read back whole, mixed with buffered writes over the same bytes; with the
/// setting at 0 the same write stays in the page cache (the measure can fail).
async fn large_aligned_writes_go_past_the_page_cache(backend: IoBackend) {
    const MIB: usize = 1 << 20;
    let dir = tempfile::tempdir().unwrap();
    let opts = |min| StoreOptions { backend, direct_write_min: min, ..StoreOptions::default() };
    let store = ChunkStore::open_with(&[TargetConfig { id: T, path: dir.path().join("t1") }], opts(MIB)).unwrap();
    let ino = InodeId::new(3, 0x77);
    let mut model = Vec::new();
    // The first write opens the file; the next large aligned ones go direct; a small write in
    // between rewrites bytes of a direct one; the last extends the file.
    for (i, &(off, len)) in [(0, 2 * MIB), (MIB, MIB), (MIB + 100, 100), (3 * MIB, MIB)].iter().enumerate() {
        let data = pattern(40 + i as u64, len);
        store.write(T, ino, off as u64, data.clone(), false).await.expect("write");
        apply(&mut model, off, &data);
    }
    let path = store.chunk_path(T, ino).unwrap();
    // On a filesystem whose files live in memory (tmpfs) every page is "cached": nothing to see.
    let in_memory = nix::sys::statfs::statfs(&path).unwrap().filesystem_type() == nix::sys::statfs::TMPFS_MAGIC;
    if !in_memory {
        assert_eq!(cached_pages(&path, 3 * MIB, MIB), 0, "the last write's pages are cached");
    }
    assert!(read_all(&store, ino).await == model, "the chunk reads back as written");
    assert!(std::fs::read(&path).unwrap() == model, "the chunk file holds the bytes");

    // Off: the same write leaves its pages in the page cache.
    let dir = tempfile::tempdir().unwrap();
    let store = ChunkStore::open_with(&[TargetConfig { id: T, path: dir.path().join("t1") }], opts(0)).unwrap();
    store.write(T, ino, 0, pattern(50, MIB), false).await.unwrap();
    store.write(T, ino, MIB as u64, pattern(51, MIB), false).await.unwrap();
    let path = store.chunk_path(T, ino).unwrap();
    assert!(cached_pages(&path, MIB, MIB) > 0, "a buffered write's pages are not cached");
}

/// Waits (up to 20 s: the drops run on the blocking pool, not waited for by the read) until
/// `done` holds; false if it never did.
fn eventually(mut done: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while std::time::Instant::now() < deadline {
        if done() {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    done()
}

/// Reads the whole chunk file of `ino` as spans, 1 MiB at a time from the start, as a
/// sequential reader's requests come; the bytes sent.
async fn read_spans_forward(store: &ChunkStore, ino: InodeId, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    for off in (0..len).step_by(1 << 20) {
        let span = store.read_span(T, ino, off as u64, 1 << 20).await.expect("read_span").expect("bytes");
        out.extend_from_slice(&span_bytes(&[span]));
    }
    out
}

/// What a single sequential reader has read of a chunk file is dropped from stored's page cache
/// (well behind where it reads: its front stays cached); a second reader of the file keeps its
/// pages from then on; `drop_behind: false` keeps every page.
async fn a_single_sequential_reader_leaves_no_copy_behind(backend: IoBackend) {
    const MIB: usize = 1 << 20;
    const LEN: usize = 48 * MIB;
    let data = pattern(61, LEN);
    let dir = tempfile::tempdir().unwrap();
    let open = |name: &str, drop_behind| {
        let opts = StoreOptions { backend, direct_write_min: 0, drop_behind, ..StoreOptions::default() };
        ChunkStore::open_with(&[TargetConfig { id: T, path: dir.path().join(name) }], opts).unwrap()
    };
    // Written through the page cache and synced: every page cached and clean.
    let write = |store: ChunkStore, ino: InodeId| {
        let data = data.clone();
        async move {
            for off in (0..LEN).step_by(MIB) {
                store.write(T, ino, off as u64, data[off..off + MIB].to_vec(), false).await.unwrap();
            }
            let path = store.chunk_path(T, ino).unwrap();
            std::fs::File::open(&path).unwrap().sync_all().unwrap();
            path
        }
    };
    let store = open("t1", true);
    let ino = InodeId::new(5, 1);
    let path = write(store.clone(), ino).await;
    // Pages of a file in memory (tmpfs) cannot be dropped: only the bytes can be checked there.
    let in_memory = nix::sys::statfs::statfs(&path).unwrap().filesystem_type() == nix::sys::statfs::TMPFS_MAGIC;
    assert_eq!(cached_pages(&path, 0, LEN), LEN / 4096, "the written file is cached before it is read");

    assert!(read_spans_forward(&store, ino, LEN).await == data, "the sequential read sends the file's bytes");
    if !in_memory {
        assert!(
            eventually(|| cached_pages(&path, 0, 24 * MIB) == 0),
            "the first half stays cached after the reader passed it: {} pages",
            cached_pages(&path, 0, 24 * MIB)
        );
        assert!(cached_pages(&path, LEN - 8 * MIB, 8 * MIB) > 0, "the reader's front was dropped too");
    }

    // A second reader from the start: the file is shared, its pages stay.
    assert!(read_spans_forward(&store, ino, LEN).await == data, "the second read sends the file's bytes");
    // Give any drop a chance to run before the check below (none may be asked).
    let ino2 = InodeId::new(5, 2);
    write(store.clone(), ino2).await;
    assert!(read_spans_forward(&store, ino2, LEN).await == data);
    assert!(eventually(|| in_memory || cached_pages(&store.chunk_path(T, ino2).unwrap(), 0, 24 * MIB) == 0));
    assert_eq!(cached_pages(&path, 0, LEN), LEN / 4096, "a file read twice lost pages to drop-behind");

    // Off: a single sequential reader leaves every page cached.
    let store = open("t2", false);
    let path = write(store.clone(), ino).await;
    assert!(read_spans_forward(&store, ino, LEN).await == data);
    assert_eq!(cached_pages(&path, 0, LEN), LEN / 4096, "pages dropped with drop_behind off");
}
