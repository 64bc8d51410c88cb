//! FUSE passthrough on a real 4-node filesystem and its mount: a file whole on this node's own
//! target (local placement, stripe count 1) is read and written by the kernel straight from its
//! chunk file — shown by odfs-fuse's and stored's I/O counters (`/proc/PID/io`) staying flat
//! while tens of MiB go through — and keeps every rule of the normal path: other nodes read the
//! same bytes through stored, sizes are published at close, O_APPEND from two processes, mmap,
//! unlink while open, a full target's ENOSPC with the earlier bytes intact, and the data after
//! kill -9 of odfs-fuse. Without CAP_SYS_ADMIN (odfs-fuse as root of a user namespace) the
//! kernel refuses backing files and the same files take the normal path, said once in the log.
//! A kernel without passthrough (before 6.9) does not offer it at FUSE's INIT, so odfs-fuse
//! does not take it; a mount told not to ask (`fuse_passthrough = false`) takes that same path
//! from INIT on, and is tested here: the same bytes, through odfs-fuse, said once in the log.
//!
//! Needs root (FUSE passthrough registers backing files with CAP_SYS_ADMIN; tmpfs) and a
//! kernel with FUSE passthrough (6.9 or later).

use odfs_tests::*;
use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

const MIB: usize = 1 << 20;

/// A 4-node filesystem (with a 48 MiB RAM target per node) mounted on node 0, failing with what
/// is missing when the kernel offers no passthrough.
fn up() -> (LocalFs, FuseMount) {
    let fs = LocalFs::up(4, &["--ram-pool", "48M"]);
    let m = FuseMount::start(&fs);
    // The first request waits for FUSE's init, where odfs-fuse logs a kernel without it.
    fs::metadata(&m.path).unwrap();
    let release = fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    assert!(
        !m.log_text().contains("does not offer FUSE passthrough"),
        "this kernel ({}) offers no FUSE passthrough: these tests need Linux 6.9 or later",
        release.trim()
    );
    (fs, m)
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

/// odfs-fuse's and node 0's stored's bytes moved, together.
fn daemon_io(fs: &LocalFs, m: &FuseMount) -> u64 {
    io_bytes(m.child.id()) + fs.pids("stored", Some(0)).into_iter().map(io_bytes).sum::<u64>()
}

/// Reads `name` (a path in the filesystem) through a fresh one-shot client of `node`: through
/// stored, never through this node's mount.
fn read_remote(fs: &LocalFs, node: u32, name: &str) -> Vec<u8> {
    tokio::runtime::Runtime::new().unwrap().block_on(async { lib_read(&fs.node_client(node).await, name).await })
}

/// Writes `data` in 1 MiB writes, then fsync and close.
fn write_file(p: &Path, data: &[u8]) {
    let mut f = fs::File::create(p).unwrap();
    for piece in data.chunks(MIB) {
        f.write_all(piece).unwrap();
    }
    f.sync_all().unwrap();
}

#[test]
fn a_local_file_is_passed_through_and_keeps_the_rules() {
    let (fs, m) = up();
    let ck = m.p("ck");
    fs::create_dir(&ck).unwrap();
    fs.cli_ok(&["setstripe", "--local", "-c", "1", &s(&ck)]);
    let striped = m.p("striped");
    fs::create_dir(&striped).unwrap();

    // 32 MiB written and read back: neither odfs-fuse nor stored moves the bytes.
    let data = pattern(32 * MIB + 4321, 7);
    let before = daemon_io(&fs, &m);
    write_file(&ck.join("model.pt"), &data);
    assert_eq!(fs::read(ck.join("model.pt")).unwrap(), data, "read back through the mount");
    let moved = daemon_io(&fs, &m) - before;
    assert!(moved < 2 * MIB as u64, "the daemons moved {moved} bytes for 64 MiB of I/O: not passed through");
    // The same through a striped file does go through them (the measure can fail).
    let before = daemon_io(&fs, &m);
    write_file(&striped.join("model.pt"), &data[..8 * MIB]);
    assert!(daemon_io(&fs, &m) - before > 8 * MIB as u64, "a striped file's bytes must go through odfs-fuse");

    // Published at close: another node reads the same bytes through stored.
    assert_eq!(fs::metadata(ck.join("model.pt")).unwrap().len(), data.len() as u64);
    assert_eq!(sha256(&read_remote(&fs, 2, "/ck/model.pt")), sha256(&data), "node 2 reads other bytes");

    // A stat while the file is open for writing sees the kernel's writes; close publishes them.
    let grow = ck.join("grow");
    let mut f = fs::File::create(&grow).unwrap();
    f.write_all(&pattern(12_345, 1)).unwrap();
    assert_eq!(fs::metadata(&grow).unwrap().len(), 12_345, "stat of a file being written");
    drop(f);
    assert_eq!(read_remote(&fs, 1, "/ck/grow"), pattern(12_345, 1));

    // O_APPEND from two processes: every line whole, none lost.
    let log = ck.join("log");
    let writers: Vec<_> = (0..2)
        .map(|k| {
            Command::new("sh")
                .arg("-c")
                .arg(format!("for i in $(seq 1000 1299); do echo w{k}-$i >> '{}'; done", log.display()))
                .spawn()
                .unwrap()
        })
        .collect();
    for mut w in writers {
        assert!(w.wait().unwrap().success());
    }
    let text = fs::read_to_string(&log).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 600, "appended lines");
    let torn: Vec<&&str> = lines.iter().filter(|l| l.len() != 7 || !l.starts_with('w')).collect();
    assert!(torn.is_empty(), "torn lines: {torn:?}");
    lines.sort();
    lines.dedup();
    assert_eq!(lines.len(), 600, "a line was overwritten");
    assert_eq!(String::from_utf8(read_remote(&fs, 3, "/ck/log")).unwrap(), text);

    // mmap: a shared mapping's store reaches the file, and other nodes after msync and close.
    let mm = ck.join("mm");
    fs::write(&mm, vec![0u8; MIB]).unwrap();
    {
        let f = fs::OpenOptions::new().read(true).write(true).open(&mm).unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
        // SAFETY: a fresh shared mapping of MIB bytes of an open file, unmapped below.
        unsafe {
            let p = libc::mmap(std::ptr::null_mut(), MIB, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0);
            assert_ne!(p, libc::MAP_FAILED, "mmap: {}", std::io::Error::last_os_error());
            std::ptr::copy_nonoverlapping(b"mapped!".as_ptr(), (p as *mut u8).add(4096), 7);
            assert_eq!(libc::msync(p, MIB, libc::MS_SYNC), 0);
            assert_eq!(libc::munmap(p, MIB), 0);
        }
    }
    assert_eq!(&fs::read(&mm).unwrap()[4096..4103], b"mapped!");
    assert_eq!(&read_remote(&fs, 1, "/ck/mm")[4096..4103], b"mapped!");

    // Unlinked while open: still read and written, gone at the last close.
    let ul = ck.join("unlinked");
    let mut f = fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&ul).unwrap();
    f.write_all(&pattern(100_000, 3)).unwrap();
    let ino = std::os::unix::fs::MetadataExt::ino(&f.metadata().unwrap());
    let layout = getfattr(&ul, "odfs.layout");
    let target = layout.split_whitespace().find_map(|kv| kv.strip_prefix("targets=")).unwrap().to_string();
    let chunk =
        odfs_proto::layout::chunk_path(&fs.node_dir(0).join(format!("target{target}")), odfs_proto::InodeId(ino));
    assert!(chunk.exists(), "{} missing while the file is open", chunk.display());
    fs::remove_file(&ul).unwrap();
    f.write_all(b"tail").unwrap();
    f.seek(SeekFrom::Start(0)).unwrap();
    let mut back = Vec::new();
    f.read_to_end(&mut back).unwrap();
    let mut want = pattern(100_000, 3);
    want.extend_from_slice(b"tail");
    assert_eq!(back, want, "an unlinked open file reads what was written");
    drop(f);
    let t = Instant::now();
    while chunk.exists() {
        assert!(t.elapsed() < Duration::from_secs(20), "{} left after the last close", chunk.display());
        std::thread::sleep(Duration::from_millis(100));
    }

    // fallocate on a passed-through writer: an allocation inside the file leaves its size (the
    // kernel's writes count, not the size the library last saw), a punched hole reads as zeros.
    let fa = ck.join("fallocated");
    let mut f = fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&fa).unwrap();
    let mut want = pattern(256 * 1024, 6);
    f.write_all(&want).unwrap();
    let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
    // SAFETY: fallocate on an open descriptor; plain integer arguments.
    assert_eq!(unsafe { libc::fallocate(fd, 0, 0x1000, 0x2000) }, 0, "{}", std::io::Error::last_os_error());
    assert_eq!(f.metadata().unwrap().len(), want.len() as u64, "an interior allocation changed the size");
    let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    // SAFETY: as above.
    assert_eq!(unsafe { libc::fallocate(fd, punch, 0x10000, 0x10000) }, 0, "{}", std::io::Error::last_os_error());
    want[0x10000..0x20000].fill(0);
    drop(f);
    assert_eq!(fs::read(&fa).unwrap(), want, "after an allocation and a punched hole");
    assert_eq!(read_remote(&fs, 2, "/ck/fallocated"), want, "node 2 reads other bytes");

    // kill -9 of odfs-fuse: what was written, synced and closed is all there.
    let last = pattern(5 * MIB, 9);
    write_file(&ck.join("last.pt"), &last);
    let pid = m.child.id();
    kill9_gone(pid);
    assert_eq!(sha256(&read_remote(&fs, 1, "/ck/last.pt")), sha256(&last));
    assert_eq!(sha256(&read_remote(&fs, 0, "/ck/model.pt")), sha256(&data));
}

#[test]
fn a_full_local_target_gives_enospc_and_keeps_the_bytes_before() {
    let (fs, m) = up();
    let ck = m.p("ram");
    fs::create_dir(&ck).unwrap();
    fs.cli_ok(&["setstripe", "--local", "-c", "1", "-p", "ram", &s(&ck)]);
    let p = ck.join("big");
    let mut f = fs::File::create_new(&p).unwrap();
    let mut want = Vec::new();
    let err = loop {
        let piece = pattern(MIB, want.len() as u64);
        match f.write(&piece) {
            Ok(n) => want.extend_from_slice(&piece[..n]),
            Err(e) => break e,
        }
        assert!(want.len() < 200 * MIB, "a 48 MiB target took {} bytes", want.len());
    };
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
    drop(f);
    // Every byte before the failure is there, through the mount and from another node.
    let got = fs::read(&p).unwrap();
    assert_eq!(got.len(), want.len(), "size after ENOSPC");
    assert!(got == want, "bytes before ENOSPC changed");
    assert_eq!(sha256(&read_remote(&fs, 2, "/ram/big")), sha256(&want));
    fs::remove_file(&p).unwrap();
}

/// odfs-fuse without CAP_SYS_ADMIN (root of a user namespace of its own, with a mount namespace
/// it may mount FUSE in): the kernel refuses to register backing files, odfs-fuse says so once
/// and every file takes the normal path, local ones included, with the same bytes.
#[test]
fn without_cap_sys_admin_local_files_take_the_normal_path() {
    let fs = LocalFs::up(2, &[]);
    let mnt = fs.root().join("m-userns");
    fs::create_dir(&mnt).unwrap();
    let log = fs.root().join("fuse-userns.log");
    let src = fs.root().join("src");
    fs::write(&src, pattern(3 * MIB + 17, 5)).unwrap();
    let script = format!(
        r#"set -u
"{fuse}" --fs "{cfg}" --mountpoint "{mnt}" > "{log}" 2>&1 &
for i in $(seq 100); do grep -q " {mnt} fuse.odfs " /proc/self/mounts && break; sleep 0.1; done
grep -q " {mnt} fuse.odfs " /proc/self/mounts || {{ echo NOT-MOUNTED; exit 1; }}
mkdir "{mnt}/ck" && "{odfs}" setstripe --local -c 1 "{mnt}/ck" || exit 1
cp "{src}" "{mnt}/ck/f" && cmp "{src}" "{mnt}/ck/f" && echo SAME-THROUGH-THE-MOUNT
umount "{mnt}"; wait"#,
        fuse = odfs_fuse_bin().display(),
        odfs = bin_dir().join("odfs").display(),
        cfg = fs.config_path().display(),
        mnt = mnt.display(),
        log = log.display(),
        src = src.display(),
    );
    let out = Command::new("unshare")
        .args(["--user", "--map-root-user", "--mount", "--propagation", "private", "bash", "-c", &script])
        .output()
        .expect("run unshare (util-linux)");
    let text = String::from_utf8_lossy(&out.stdout);
    let fuse_log = fs::read_to_string(&log).unwrap_or_default();
    assert!(text.contains("SAME-THROUGH-THE-MOUNT"), "{text}\n{}\n{fuse_log}", String::from_utf8_lossy(&out.stderr));
    let off: Vec<&str> = fuse_log.lines().filter(|l| l.contains("FUSE passthrough off")).collect();
    assert_eq!(off.len(), 1, "said once why passthrough is off:\n{fuse_log}");
    assert!(off[0].contains("CAP_SYS_ADMIN"), "{}", off[0]);
    // Placed locally all the same, and whole for every other node.
    assert_eq!(sha256(&read_remote(&fs, 1, "/ck/f")), sha256(&pattern(3 * MIB + 17, 5)));
}

/// A mount that does not negotiate passthrough at INIT (`fuse_passthrough = false`; a kernel
/// before 6.9 does not offer it, which leaves odfs-fuse in the same state): a local file takes
/// the normal path through odfs-fuse and stored, with the same bytes for this node and others,
/// and the log says once why.
#[test]
fn without_passthrough_at_init_local_files_take_the_normal_path() {
    let fs = LocalFs::up(2, &[]);
    let mut cfg = fs.config();
    cfg.fuse_passthrough = false;
    fs::write(fs.config_path(), toml::to_string(&cfg).unwrap()).unwrap();
    let m = FuseMount::start(&fs);
    let ck = m.p("ck");
    fs::create_dir(&ck).unwrap();
    fs.cli_ok(&["setstripe", "--local", "-c", "1", &s(&ck)]);
    let data = pattern(8 * MIB + 99, 4);
    let before = daemon_io(&fs, &m);
    write_file(&ck.join("f"), &data);
    assert_eq!(fs::read(ck.join("f")).unwrap(), data, "read back through the mount");
    let moved = daemon_io(&fs, &m) - before;
    assert!(moved > 8 * MIB as u64, "the daemons moved {moved} bytes for 16 MiB of I/O: passed through after all");
    // Placed on this node all the same, and whole for the other node.
    let ino = std::os::unix::fs::MetadataExt::ino(&fs::metadata(ck.join("f")).unwrap());
    let chunk = odfs_proto::layout::chunk_path(&fs.node_dir(0).join("target1"), odfs_proto::InodeId(ino));
    assert_eq!(fs::read(&chunk).unwrap_or_default(), data, "node 0's chunk file {}", chunk.display());
    assert_eq!(sha256(&read_remote(&fs, 1, "/ck/f")), sha256(&data));
    let log = m.log_text();
    let off: Vec<&str> = log.lines().filter(|l| l.contains("passthrough off")).collect();
    assert_eq!(off.len(), 1, "said once why passthrough is off:\n{log}");
    assert!(off[0].contains("fuse_passthrough = false"), "{}", off[0]);
}
