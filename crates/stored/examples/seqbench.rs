//! Ad-hoc sequential throughput of the chunk store: writes then reads one chunk file in 1 MiB
//! operations on each backend and prints MiB/s. Not a test; run by hand:
//!
//! ```text
//! cargo run -p odfs-stored --example seqbench -- DIR [GIB] [QUEUE_DEPTH] [both|syscall-first|uring|syscall]
//! ```
//!
//! The write figure includes a final fdatasync. "warm" reads come from the page cache; "cold"
//! reads follow `posix_fadvise(DONTNEED)` on the chunk file, so they come from the disk.

use odfs_proto::InodeId;
use odfs_stored::{ChunkStore, IoBackend, TargetConfig};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

const OP: usize = 1 << 20;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), BoxErr> {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(args.next().ok_or("usage: seqbench DIR [GIB] [QUEUE_DEPTH]")?);
    let gib: u64 = args.next().map(|s| s.parse()).transpose()?.unwrap_or(1);
    let qd: u64 = args.next().map(|s| s.parse()).transpose()?.unwrap_or(1);
    let ops = gib * 1024;
    let backends = match args.next().as_deref() {
        None | Some("both") => vec![IoBackend::Uring, IoBackend::Syscall],
        Some("syscall-first") => vec![IoBackend::Syscall, IoBackend::Uring],
        Some("uring") => vec![IoBackend::Uring],
        Some("syscall") => vec![IoBackend::Syscall],
        Some(o) => return Err(format!("unknown backend choice {o:?}").into()),
    };
    for backend in backends {
        let path = dir.join(format!("bench-{backend:?}"));
        let store = ChunkStore::open(&[TargetConfig { id: 1, path: path.clone() }], backend)?;
        let ino = InodeId(1);

        let t = Instant::now();
        run(&store, qd, ops, true).await?;
        store.sync(1, ino).await?;
        let write = mib_s(ops, t);

        let t = Instant::now();
        run(&store, qd, ops, false).await?;
        let warm = mib_s(ops, t);

        let f = std::fs::File::open(store.chunk_path(1, ino).ok_or("no chunk path")?)?;
        // SAFETY: plain advice on a descriptor we own.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        let t = Instant::now();
        run(&store, qd, ops, false).await?;
        let cold = mib_s(ops, t);

        println!(
            "{:>8} qd={qd}: write+fdatasync {write:7.0} MiB/s, read warm {warm:7.0} MiB/s, \
             read cold {cold:7.0} MiB/s ({gib} GiB, 1 MiB ops)",
            store.backend_name()
        );
        store.remove(1, ino).await?;
        drop(store);
        std::fs::remove_dir_all(&path)?;
    }
    Ok(())
}

type BoxErr = Box<dyn std::error::Error + Send + Sync>;

/// Writes or reads `ops` 1 MiB operations on inode 1 of target 1, `qd` at a time; workers claim
/// the next index in turn, so the file is covered front to back.
async fn run(store: &ChunkStore, qd: u64, ops: u64, write: bool) -> Result<(), BoxErr> {
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..qd {
        let (s, next) = (store.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= ops {
                    return Ok::<(), BoxErr>(());
                }
                let off = i * OP as u64;
                if write {
                    s.write(1, InodeId(1), off, vec![0xa5u8; OP], false).await?;
                } else {
                    let got = s.read(1, InodeId(1), off, OP as u32).await?;
                    if got.len() != OP {
                        return Err(format!("short read at {off}: {}", got.len()).into());
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(())
}

fn mib_s(ops: u64, t: Instant) -> f64 {
    ops as f64 * (OP as f64 / (1 << 20) as f64) / t.elapsed().as_secs_f64()
}
