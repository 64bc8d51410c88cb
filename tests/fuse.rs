//! End-to-end tests of the FUSE mount: a real filesystem (`odfs local up --no-mount`), the
//! `odfs-fuse` binary mounted on a temporary directory, and plain std::fs / libc calls on the
//! mount. Where it matters, what went in through the mount is read back through the client
//! library (another "node") and the other way round, so bytes are checked at odfs, not only in
//! the kernel's page cache.
//!
//! Needs root and /dev/fuse; without the device the tests fail and say so.

use odfs_client::{Client, Ctx};
use odfs_proto::InodeId;
use odfs_tests::*;
use std::collections::HashSet;
use std::ffi::{CStr, CString};
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::IntoRawFd;
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const CHUNK: usize = 65536;

/// Every (name, inode) of a directory, read with getdents64(2) and a buffer of `bufsize` bytes.
fn getdents(dir: &Path, bufsize: usize) -> Vec<(String, u64)> {
    let file = File::open(dir).expect("open directory");
    let fd = std::os::fd::AsRawFd::as_raw_fd(&file);
    let mut buf = vec![0u8; bufsize];
    let mut out = Vec::new();
    loop {
        // SAFETY: a valid descriptor and a buffer of `bufsize` bytes.
        let n = unsafe { libc::syscall(libc::SYS_getdents64, fd, buf.as_mut_ptr(), bufsize) };
        assert!(n >= 0, "getdents64: {}", std::io::Error::last_os_error());
        if n == 0 {
            return out;
        }
        let mut at = 0;
        while at < n as usize {
            // struct linux_dirent64: u64 ino, i64 off, u16 reclen, u8 type, NUL-terminated name.
            let ino = u64::from_ne_bytes(buf[at..at + 8].try_into().unwrap());
            let reclen = u16::from_ne_bytes(buf[at + 16..at + 18].try_into().unwrap()) as usize;
            let name = CStr::from_bytes_until_nul(&buf[at + 19..at + reclen]).expect("NUL-terminated name");
            out.push((name.to_string_lossy().into_owned(), ino));
            at += reclen;
        }
    }
}

/// The fusectl directory of the FUSE connection of the mount with device minor `minor`;
/// fusectl is mounted at /sys/fs/fuse/connections first if it is not.
fn fuse_connection(minor: u32) -> std::path::PathBuf {
    let top = Path::new("/sys/fs/fuse/connections");
    if mount_line(top).is_none() {
        let out = std::process::Command::new("mount").args(["-t", "fusectl", "fusectl"]).arg(top).output().unwrap();
        assert!(
            out.status.success(),
            "cannot mount fusectl at {}: {}",
            top.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    top.join(minor.to_string())
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime")
}

async fn lib_write(c: &Client, name: &str, data: &[u8]) {
    let (_, h) = c.create_open(&Ctx::root(), InodeId::ROOT, name.as_bytes(), 0o644, false, None).await.expect("create");
    h.truncate(0).await.expect("truncate");
    h.write(0, data).await.expect("write");
    h.close().await.expect("close");
}

#[test]
fn mount_shows_as_fuse_odfs_and_data_round_trips() {
    let fs = LocalFs::up(2, &["--chunk-size", "65536", "--stripe-count", "2"]);
    let m = FuseMount::start(&fs);
    let rt = runtime();
    let c = rt.block_on(fs.client());

    // The mount as the system sees it.
    let line = mount_line(&m.path).expect("mounted");
    assert_eq!(line.fstype, "fuse.odfs");
    assert!(line.source.starts_with("odfs:"), "source {}", line.source);
    assert!(line.options.contains("default_permissions"), "options {}", line.options);
    assert!(!line.options.contains("allow_other"), "allow_other without --allow-other: {}", line.options);
    let ra = fs::read_to_string(format!("/sys/class/bdi/0:{}/read_ahead_kb", line.minor)).expect("bdi read-ahead");
    assert_eq!(ra.trim(), "1024");
    // Background requests in flight (async direct I/O, read-ahead): the connection's settings
    // in fusectl (mounted here if the machine has not).
    let conn = fuse_connection(line.minor);
    for (file, want) in [("max_background", "64"), ("congestion_threshold", "48")] {
        let got = fs::read_to_string(conn.join(file)).unwrap_or_else(|e| panic!("{}: {e}", conn.join(file).display()));
        assert_eq!(got.trim(), want, "{file}");
    }

    // 8 MiB across 128 chunks of 64 KiB, in and back out, and at odfs through the library.
    let big = pattern(8 << 20, 1);
    fs::write(m.p("big"), &big).unwrap();
    assert_bytes(&fs::read(m.p("big")).unwrap(), &big, "8 MiB through the mount");
    let st = fs::metadata(m.p("big")).unwrap();
    assert_eq!((st.len(), st.blocks(), st.blksize()), (8 << 20, (8 << 20) / 512, CHUNK as u64));
    assert_bytes(&rt.block_on(lib_read(&c, "/big")), &big, "8 MiB read by another client");

    // Written by another client, read through the mount (close-to-open) -- also after the
    // kernel cached the old size: the open makes it ask again.
    let v1 = pattern(100_000, 2);
    rt.block_on(lib_write(&c, "other", &v1));
    assert_bytes(&fs::read(m.p("other")).unwrap(), &v1, "written elsewhere, read through the mount");
    assert_eq!(fs::metadata(m.p("other")).unwrap().len(), 100_000);
    let v2 = pattern(300_000, 3);
    rt.block_on(lib_write(&c, "other", &v2));
    assert_bytes(&fs::read(m.p("other")).unwrap(), &v2, "rewritten elsewhere within the attribute TTL");
    // Replaced elsewhere (new file renamed over the name) while the kernel still trusts the
    // name: the open finds the old inode gone and the kernel looks the name up again.
    let old_ino = fs::metadata(m.p("other")).unwrap().ino();
    let v3 = pattern(5000, 8);
    rt.block_on(async {
        lib_write(&c, "other.tmp", &v3).await;
        c.rename(&Ctx::root(), InodeId::ROOT, b"other.tmp", InodeId::ROOT, b"other", 0).await.unwrap();
    });
    assert_bytes(&fs::read(m.p("other")).unwrap(), &v3, "replaced elsewhere within the entry TTL");
    assert_ne!(fs::metadata(m.p("other")).unwrap().ino(), old_ino);

    // Odd offsets across chunk boundaries (pwrite/pread), holes between them read as zeros.
    let f = OpenOptions::new().read(true).write(true).create(true).truncate(true).open(m.p("odd")).unwrap();
    let a = pattern(3, 4);
    let b = pattern(70_001, 5);
    f.write_all_at(&a, CHUNK as u64 - 1).unwrap();
    f.write_all_at(&b, 2 * CHUNK as u64 - 7).unwrap();
    let end = 2 * CHUNK - 7 + b.len();
    let mut want = vec![0u8; end];
    want[CHUNK - 1..CHUNK + 2].copy_from_slice(&a);
    want[2 * CHUNK - 7..].copy_from_slice(&b);
    let mut got = vec![0u8; end];
    f.read_exact_at(&mut got, 0).unwrap();
    assert_bytes(&got, &want, "pread of the whole odd-offset file");
    let mut mid = vec![0u8; 12_345];
    f.read_exact_at(&mut mid, 2 * CHUNK as u64 - 1001).unwrap();
    assert_bytes(&mid, &want[2 * CHUNK - 1001..2 * CHUNK - 1001 + 12_345], "pread at an odd offset");
    let mut past = [7u8; 10];
    assert_eq!(f.read_at(&mut past, end as u64).unwrap(), 0, "read at end of file");
    drop(f);
    assert_bytes(&rt.block_on(lib_read(&c, "/odd")), &want, "odd offsets at odfs");

    // Sparse: seek far past the end and write; everything before reads as zeros.
    let mut f = File::create(m.p("sparse")).unwrap();
    let far = 10 * CHUNK as u64 + 123;
    f.seek(SeekFrom::Start(far)).unwrap();
    f.write_all(b"end").unwrap();
    drop(f);
    let s = fs::read(m.p("sparse")).unwrap();
    assert_eq!(s.len() as u64, far + 3);
    assert!(s[..far as usize].iter().all(|&x| x == 0), "hole must read as zeros");
    assert_eq!(&s[far as usize..], b"end");

    // Truncate down and up (path and descriptor).
    let t = pattern(5000, 6);
    fs::write(m.p("trunc"), &t).unwrap();
    let f = OpenOptions::new().write(true).open(m.p("trunc")).unwrap();
    f.set_len(1000).unwrap();
    assert_eq!(f.metadata().unwrap().len(), 1000);
    f.set_len(3 * CHUNK as u64).unwrap();
    drop(f);
    let got = fs::read(m.p("trunc")).unwrap();
    assert_eq!(got.len(), 3 * CHUNK);
    assert_bytes(&got[..1000], &t[..1000], "kept prefix after truncate down");
    assert!(got[1000..].iter().all(|&x| x == 0), "truncate up must read as zeros");
    // SAFETY: a valid path.
    assert_eq!(unsafe { libc::truncate(cpath(&m.p("trunc")).as_ptr(), 10) }, 0);
    assert_bytes(&fs::read(m.p("trunc")).unwrap(), &t[..10], "path truncate");

    // fallocate mode 0 extends; a punched hole reads as zeros and keeps the size; collapsing a
    // range is refused.
    let f = OpenOptions::new().read(true).write(true).open(m.p("trunc")).unwrap();
    // SAFETY: a valid descriptor.
    assert_eq!(unsafe { libc::fallocate(std::os::fd::AsRawFd::as_raw_fd(&f), 0, 0, 200_000) }, 0);
    assert_eq!(f.metadata().unwrap().len(), 200_000);
    // SAFETY: a valid descriptor.
    let r = unsafe { libc::fallocate(std::os::fd::AsRawFd::as_raw_fd(&f), libc::FALLOC_FL_PUNCH_HOLE | 1, 0, 10) };
    assert_eq!(r, 0, "punch a hole: {}", std::io::Error::last_os_error());
    assert_eq!(f.metadata().unwrap().len(), 200_000);
    assert_bytes(&fs::read(m.p("trunc")).unwrap()[..10], &[0u8; 10], "a punched hole");
    // SAFETY: a valid descriptor.
    let r = unsafe { libc::fallocate(std::os::fd::AsRawFd::as_raw_fd(&f), libc::FALLOC_FL_COLLAPSE_RANGE, 0, 65536) };
    assert_eq!(r, -1);
    assert_eq!(std::io::Error::last_os_error().raw_os_error(), Some(libc::EOPNOTSUPP));
    drop(f);

    // fsync publishes data and size while the file stays open.
    let mut f = File::create(m.p("synced")).unwrap();
    let d = pattern(3 * CHUNK + 17, 7);
    f.write_all(&d).unwrap();
    f.sync_all().unwrap();
    assert_bytes(&rt.block_on(lib_read(&c, "/synced")), &d, "fsynced data seen by another client before close");
    f.write_all(b"more").unwrap();
    f.sync_data().unwrap();
    assert_eq!(rt.block_on(lib_read(&c, "/synced")).len(), d.len() + 4);
    drop(f);
}

#[test]
fn reads_right_after_writes_see_them() {
    // Pages the kernel holds (fully written ones) split one pread(2) into several reads sent in
    // parallel; each must see every write acknowledged before it, not only the first read to
    // wait for the writes still in flight.
    let fs = LocalFs::up(2, &["--chunk-size", "65536", "--stripe-count", "2"]);
    let m = FuseMount::start(&fs);
    for round in 0..100u64 {
        let f = OpenOptions::new().read(true).write(true).create(true).truncate(true).open(m.p("rw")).unwrap();
        let a = pattern(3, round);
        let b = pattern(70_001 + round as usize, round + 1000);
        let at_a = CHUNK - 1 + (round as usize % 3) * CHUNK;
        let at_b = at_a + CHUNK - 6;
        f.write_all_at(&a, at_a as u64).unwrap();
        f.write_all_at(&b, at_b as u64).unwrap();
        let mut want = vec![0u8; at_b + b.len()];
        want[at_a..at_a + 3].copy_from_slice(&a);
        want[at_b..].copy_from_slice(&b);
        let mut got = vec![0u8; want.len()];
        f.read_exact_at(&mut got, 0).unwrap();
        assert_bytes(&got, &want, &format!("round {round}"));
    }
}

#[test]
fn open_flags_and_open_unlinked_files() {
    let fs = LocalFs::up(1, &["--chunk-size", "65536"]);
    let m = FuseMount::start(&fs);

    // O_CREAT|O_EXCL on an existing name.
    fs::write(m.p("x"), b"first").unwrap();
    assert_eq!(errno(OpenOptions::new().write(true).create_new(true).open(m.p("x"))), libc::EEXIST);
    let mut f = OpenOptions::new().write(true).create_new(true).open(m.p("fresh")).unwrap();
    f.write_all(b"new").unwrap();
    drop(f);
    assert_eq!(fs::read(m.p("fresh")).unwrap(), b"new");

    // O_TRUNC empties the file before writing.
    fs::write(m.p("t"), pattern(100_000, 1)).unwrap();
    let mut f = OpenOptions::new().write(true).truncate(true).open(m.p("t")).unwrap();
    assert_eq!(f.metadata().unwrap().len(), 0);
    f.write_all(b"abc").unwrap();
    drop(f);
    assert_eq!(fs::read(m.p("t")).unwrap(), b"abc");

    // O_APPEND from two descriptors: every write lands at the end, none overwrites another.
    fs::write(m.p("log"), b"start;").unwrap();
    let mut a = OpenOptions::new().append(true).open(m.p("log")).unwrap();
    let mut b = OpenOptions::new().append(true).open(m.p("log")).unwrap();
    a.write_all(b"a1;").unwrap();
    b.write_all(b"b1;").unwrap();
    a.write_all(b"a2;").unwrap();
    b.write_all(&[b'b'; 70_000]).unwrap();
    a.write_all(b";a3").unwrap();
    drop((a, b));
    let mut want = b"start;a1;b1;a2;".to_vec();
    want.extend_from_slice(&[b'b'; 70_000]);
    want.extend_from_slice(b";a3");
    assert_bytes(&fs::read(m.p("log")).unwrap(), &want, "appends from two descriptors");
    // Appended to by another client while the kernel still holds the old size: an O_APPEND
    // write still lands at the real end of the file.
    let rt = runtime();
    let c = rt.block_on(fs.client());
    assert_eq!(fs::metadata(m.p("log")).unwrap().len(), want.len() as u64);
    rt.block_on(async {
        let a = c.resolve(&Ctx::root(), "/log", true).await.unwrap();
        let h = c.open(&Ctx::root(), a.ino, false, true, false).await.unwrap();
        h.write(a.size, b";elsewhere").await.unwrap();
        h.close().await.unwrap();
    });
    let mut a = OpenOptions::new().append(true).open(m.p("log")).unwrap();
    a.write_all(b";here").unwrap();
    drop(a);
    want.extend_from_slice(b";elsewhere;here");
    assert_bytes(&rt.block_on(lib_read(&c, "/log")), &want, "append after another client appended");

    // Unlinked while open: the name is gone, the open descriptor still reads and stats.
    let data = pattern(200_000, 2);
    fs::write(m.p("gone"), &data).unwrap();
    let mut f = File::open(m.p("gone")).unwrap();
    fs::remove_file(m.p("gone")).unwrap();
    assert_eq!(errno(fs::metadata(m.p("gone"))), libc::ENOENT);
    // Past the kernel's attribute TTL, so reads and fstat go back to the daemon.
    std::thread::sleep(Duration::from_millis(2100));
    let st = f.metadata().unwrap();
    assert_eq!((st.len(), st.nlink()), (200_000, 0));
    let mut got = Vec::new();
    f.read_to_end(&mut got).unwrap();
    assert_bytes(&got, &data, "read through a descriptor of an unlinked file");
    drop(f);
    assert_eq!(errno(File::open(m.p("gone"))), libc::ENOENT);

    // The temporary-file pattern: create, unlink, then write, fsync, read back and close, all
    // without error (Python's tempfile.TemporaryFile does this on filesystems without O_TMPFILE).
    let mut f = OpenOptions::new().read(true).write(true).create_new(true).open(m.p("tmp")).unwrap();
    let chunk_name = format!("{:016x}", f.metadata().unwrap().ino());
    fs::remove_file(m.p("tmp")).unwrap();
    let scratch = pattern(3 * CHUNK + 5, 3);
    f.write_all(&scratch).unwrap();
    f.sync_all().unwrap();
    let mut got = vec![0u8; scratch.len()];
    f.read_exact_at(&mut got, 0).unwrap();
    assert_bytes(&got, &scratch, "read back from an unlinked scratch file");
    let fd = f.into_raw_fd();
    // SAFETY: closing the descriptor we own, to see close(2)'s own result.
    assert_eq!(unsafe { libc::close(fd) }, 0, "close of an unlinked written file: {}", std::io::Error::last_os_error());
    // Its chunks went with the last close: nothing of it is left on the targets.
    let start = Instant::now();
    while let Some(p) = walk_files(&fs.node_dir(0)).into_iter().find(|p| p.ends_with(&chunk_name)) {
        assert!(start.elapsed() < Duration::from_secs(5), "chunk file {p} left behind after the last close");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn namespace_operations_through_the_mount() {
    let fs = LocalFs::up(1, &[]);
    let m = FuseMount::start(&fs);

    // mkdir / rmdir and their errors.
    fs::create_dir(m.p("d")).unwrap();
    assert_eq!(errno(fs::create_dir(m.p("d"))), libc::EEXIST);
    fs::write(m.p("d/f"), b"in d").unwrap();
    assert_eq!(errno(fs::remove_dir(m.p("d"))), libc::ENOTEMPTY);
    assert_eq!(errno(fs::remove_dir(m.p("d/f"))), libc::ENOTDIR);
    assert_eq!(errno(fs::remove_file(m.p("d"))), libc::EISDIR);
    assert_eq!(errno(fs::remove_dir(m.p("nothing"))), libc::ENOENT);
    assert_eq!(errno(fs::create_dir(m.p("d/f/sub"))), libc::ENOTDIR);
    fs::create_dir(m.p("empty")).unwrap();
    fs::remove_dir(m.p("empty")).unwrap();
    assert_eq!(errno(fs::metadata(m.p("empty"))), libc::ENOENT);

    // mknod: regular files, and FIFOs (tests/posix.rs covers the other special files).
    // SAFETY: valid paths; plain mknod(2).
    assert_eq!(unsafe { libc::mknod(cpath(&m.p("fifo")).as_ptr(), libc::S_IFIFO | 0o644, 0) }, 0);
    assert!(fs::symlink_metadata(m.p("fifo")).unwrap().file_type().is_fifo());
    // SAFETY: as above.
    assert_eq!(unsafe { libc::mknod(cpath(&m.p("node")).as_ptr(), libc::S_IFREG | 0o600, 0) }, 0);
    let st = fs::metadata(m.p("node")).unwrap();
    assert_eq!((st.mode() & libc::S_IFMT, st.mode() & 0o7777, st.len()), (libc::S_IFREG, 0o600, 0));

    // rename: replace a file, across directories, a whole directory, and the flags.
    fs::write(m.p("src"), b"source").unwrap();
    fs::write(m.p("dst"), b"old destination").unwrap();
    let src_ino = fs::metadata(m.p("src")).unwrap().ino();
    fs::rename(m.p("src"), m.p("dst")).unwrap();
    assert_eq!(fs::read(m.p("dst")).unwrap(), b"source");
    assert_eq!(fs::metadata(m.p("dst")).unwrap().ino(), src_ino);
    assert_eq!(errno(fs::metadata(m.p("src"))), libc::ENOENT);
    fs::create_dir(m.p("e")).unwrap();
    fs::rename(m.p("dst"), m.p("e/moved")).unwrap();
    assert_eq!(fs::read(m.p("e/moved")).unwrap(), b"source");
    fs::rename(m.p("d"), m.p("e/d2")).unwrap();
    assert_eq!(fs::read(m.p("e/d2/f")).unwrap(), b"in d");
    assert_eq!(errno(fs::metadata(m.p("d"))), libc::ENOENT);
    fs::create_dir(m.p("full")).unwrap();
    fs::write(m.p("full/x"), b"x").unwrap();
    assert_eq!(errno(fs::rename(m.p("e/d2"), m.p("full"))), libc::ENOTEMPTY);
    fs::write(m.p("p"), b"P").unwrap();
    fs::write(m.p("q"), b"Q").unwrap();
    let renameat2 = |a: &str, b: &str, flags: u32| {
        // SAFETY: valid paths; plain renameat2(2).
        let r = unsafe {
            libc::renameat2(libc::AT_FDCWD, cpath(&m.p(a)).as_ptr(), libc::AT_FDCWD, cpath(&m.p(b)).as_ptr(), flags)
        };
        if r == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    };
    assert_eq!(errno(renameat2("p", "q", libc::RENAME_NOREPLACE)), libc::EEXIST);
    renameat2("p", "q", libc::RENAME_EXCHANGE).unwrap();
    assert_eq!((fs::read(m.p("p")).unwrap(), fs::read(m.p("q")).unwrap()), (b"Q".to_vec(), b"P".to_vec()));
    renameat2("p", "r", libc::RENAME_NOREPLACE).unwrap();
    assert_eq!(fs::read(m.p("r")).unwrap(), b"Q");

    // Hard links: counts on every name, data shared, survives the first name.
    fs::write(m.p("h1"), b"linked").unwrap();
    fs::hard_link(m.p("h1"), m.p("e/h2")).unwrap();
    let (a, b) = (fs::metadata(m.p("h1")).unwrap(), fs::metadata(m.p("e/h2")).unwrap());
    assert_eq!((a.nlink(), b.nlink(), a.ino()), (2, 2, b.ino()));
    fs::hard_link(m.p("h1"), m.p("h3")).unwrap();
    assert_eq!(fs::metadata(m.p("e/h2")).unwrap().nlink(), 3);
    fs::remove_file(m.p("h1")).unwrap();
    assert_eq!(fs::metadata(m.p("h3")).unwrap().nlink(), 2);
    assert_eq!(fs::read(m.p("e/h2")).unwrap(), b"linked");
    assert_eq!(errno(fs::hard_link(m.p("e"), m.p("elink"))), libc::EPERM);
    assert_eq!(errno(fs::hard_link(m.p("h3"), m.p("e/h2"))), libc::EEXIST);

    // Symbolic links: target kept verbatim, followed on open, dangling ones fail.
    std::os::unix::fs::symlink("e/h2", m.p("sym")).unwrap();
    assert_eq!(fs::read_link(m.p("sym")).unwrap(), Path::new("e/h2"));
    assert!(fs::symlink_metadata(m.p("sym")).unwrap().file_type().is_symlink());
    assert_eq!(fs::symlink_metadata(m.p("sym")).unwrap().len(), 4);
    assert_eq!(fs::read(m.p("sym")).unwrap(), b"linked");
    std::os::unix::fs::symlink("/absolutely/nowhere", m.p("dangling")).unwrap();
    assert_eq!(errno(fs::read(m.p("dangling"))), libc::ENOENT);
    assert_eq!(errno(std::os::unix::fs::symlink("x", m.p("sym"))), libc::EEXIST);

    // Names: 255 bytes fine, 256 too long for every kind of call.
    let ok = "n".repeat(255);
    fs::write(m.p(&ok), b"long name").unwrap();
    assert_eq!(fs::read(m.p(&ok)).unwrap(), b"long name");
    assert!(fs::read_dir(&m.path).unwrap().any(|e| e.unwrap().file_name().len() == 255));
    let long = "n".repeat(256);
    assert_eq!(errno(fs::write(m.p(&long), b"x")), libc::ENAMETOOLONG);
    assert_eq!(errno(fs::create_dir(m.p(&long))), libc::ENAMETOOLONG);
    assert_eq!(errno(fs::metadata(m.p(&long))), libc::ENAMETOOLONG);

    // chmod.
    fs::set_permissions(m.p("r"), fs::Permissions::from_mode(0o640)).unwrap();
    assert_eq!(fs::metadata(m.p("r")).unwrap().mode() & 0o7777, 0o640);
    fs::set_permissions(m.p("e"), fs::Permissions::from_mode(0o1750)).unwrap();
    let st = fs::metadata(m.p("e")).unwrap();
    assert_eq!((st.mode() & 0o7777, st.mode() & libc::S_IFMT), (0o1750, libc::S_IFDIR));
    // chown (as root).
    // SAFETY: a valid path.
    assert_eq!(unsafe { libc::chown(cpath(&m.p("r")).as_ptr(), 1234, 5678) }, 0);
    let st = fs::metadata(m.p("r")).unwrap();
    assert_eq!((st.uid(), st.gid()), (1234, 5678));

    // utimens: exact times, then "now".
    let times = [
        libc::timespec { tv_sec: 1_000_000_000, tv_nsec: 123_456_789 },
        libc::timespec { tv_sec: 1_200_000_000, tv_nsec: 987_654_321 },
    ];
    // SAFETY: a valid path and two timespecs.
    assert_eq!(unsafe { libc::utimensat(libc::AT_FDCWD, cpath(&m.p("r")).as_ptr(), times.as_ptr(), 0) }, 0);
    let st = fs::metadata(m.p("r")).unwrap();
    assert_eq!((st.atime(), st.atime_nsec()), (1_000_000_000, 123_456_789));
    assert_eq!((st.mtime(), st.mtime_nsec()), (1_200_000_000, 987_654_321));
    // Before 1970 (tar archives carry such times): a second and a fraction before, and 5 ns before.
    let before =
        [libc::timespec { tv_sec: -2, tv_nsec: 250_000_000 }, libc::timespec { tv_sec: -1, tv_nsec: 999_999_995 }];
    // SAFETY: as above.
    assert_eq!(unsafe { libc::utimensat(libc::AT_FDCWD, cpath(&m.p("r")).as_ptr(), before.as_ptr(), 0) }, 0);
    let st = fs::metadata(m.p("r")).unwrap();
    assert_eq!((st.atime(), st.atime_nsec()), (-2, 250_000_000), "a time before 1970");
    assert_eq!((st.mtime(), st.mtime_nsec()), (-1, 999_999_995), "a time before 1970");
    // SAFETY: as above.
    assert_eq!(unsafe { libc::utimensat(libc::AT_FDCWD, cpath(&m.p("r")).as_ptr(), times.as_ptr(), 0) }, 0);
    let now = [
        libc::timespec { tv_sec: 0, tv_nsec: libc::UTIME_OMIT },
        libc::timespec { tv_sec: 0, tv_nsec: libc::UTIME_NOW },
    ];
    // SAFETY: as above.
    assert_eq!(unsafe { libc::utimensat(libc::AT_FDCWD, cpath(&m.p("r")).as_ptr(), now.as_ptr(), 0) }, 0);
    let st = fs::metadata(m.p("r")).unwrap();
    let wall = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
    assert!((st.mtime() - wall).abs() <= 5, "mtime {} is not now ({wall})", st.mtime());
    assert_eq!((st.atime(), st.atime_nsec()), (1_000_000_000, 123_456_789), "UTIME_OMIT kept atime");
}

fn setxattr(p: &Path, name: &str, value: &[u8], flags: i32) -> std::io::Result<()> {
    let n = CString::new(name).unwrap();
    // SAFETY: valid path, name and value buffer.
    let r = unsafe { libc::setxattr(cpath(p).as_ptr(), n.as_ptr(), value.as_ptr().cast(), value.len(), flags) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// getxattr with a buffer of `size` bytes (0 = size probe): the returned length and bytes.
fn getxattr(p: &Path, name: &str, size: usize) -> std::io::Result<(usize, Vec<u8>)> {
    let n = CString::new(name).unwrap();
    let mut buf = vec![0u8; size];
    // SAFETY: valid path and name; the buffer holds `size` bytes.
    let r = unsafe { libc::getxattr(cpath(p).as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), size) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    buf.truncate(if size == 0 { 0 } else { r as usize });
    Ok((r as usize, buf))
}

fn listxattr(p: &Path, size: usize) -> std::io::Result<(usize, Vec<u8>)> {
    let mut buf = vec![0u8; size];
    // SAFETY: a valid path; the buffer holds `size` bytes.
    let r = unsafe { libc::listxattr(cpath(p).as_ptr(), buf.as_mut_ptr().cast(), size) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    buf.truncate(if size == 0 { 0 } else { r as usize });
    Ok((r as usize, buf))
}

#[test]
fn xattrs_statfs_and_df() {
    let fs = LocalFs::up(2, &[]);
    let m = FuseMount::start(&fs);
    let f = m.p("file");
    fs::write(&f, b"x").unwrap();

    setxattr(&f, "user.color", b"blue", 0).unwrap();
    setxattr(&f, "user.empty", b"", 0).unwrap();
    assert_eq!(getxattr(&f, "user.color", 0).unwrap().0, 4, "size probe");
    assert_eq!(errno(getxattr(&f, "user.color", 3)), libc::ERANGE);
    assert_eq!(getxattr(&f, "user.color", 64).unwrap(), (4, b"blue".to_vec()));
    assert_eq!(getxattr(&f, "user.empty", 8).unwrap(), (0, Vec::new()));
    assert_eq!(errno(getxattr(&f, "user.none", 8)), libc::ENODATA);
    // A name in no namespace Linux knows: refused, as Linux's own filesystems refuse it.
    assert_eq!(errno(setxattr(&f, "foo.bar", b"1", 0)), libc::EOPNOTSUPP);
    assert_eq!(errno(getxattr(&f, "foo.bar", 8)), libc::EOPNOTSUPP);
    assert_eq!(errno(setxattr(&f, "user.color", b"red", libc::XATTR_CREATE)), libc::EEXIST);
    assert_eq!(errno(setxattr(&f, "user.none", b"red", libc::XATTR_REPLACE)), libc::ENODATA);
    setxattr(&f, "user.color", b"green", libc::XATTR_REPLACE).unwrap();
    assert_eq!(getxattr(&f, "user.color", 64).unwrap().1, b"green");
    let (len, _) = listxattr(&f, 0).unwrap();
    assert_eq!(errno(listxattr(&f, len - 1)), libc::ERANGE);
    let (_, names) = listxattr(&f, len).unwrap();
    let mut names: Vec<&[u8]> = names.split(|&b| b == 0).filter(|n| !n.is_empty()).collect();
    names.sort();
    assert_eq!(names, vec![&b"user.color"[..], b"user.empty"]);
    let n = CString::new("user.color").unwrap();
    // SAFETY: valid path and name.
    assert_eq!(unsafe { libc::removexattr(cpath(&f).as_ptr(), n.as_ptr()) }, 0);
    assert_eq!(errno(getxattr(&f, "user.color", 64)), libc::ENODATA);
    // File capabilities: refused (inert on this nosuid mount), and never there.
    // (A well-formed vfs_cap_data revision 2, CAP_NET_BIND_SERVICE permitted: the kernel checks
    // the format before asking the filesystem.)
    let caps = [0, 0, 0, 2, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    assert_eq!(errno(setxattr(&f, "security.capability", &caps, 0)), libc::EOPNOTSUPP);
    assert_eq!(errno(getxattr(&f, "security.capability", 64)), libc::ENODATA);
    // On a directory too.
    fs::create_dir(m.p("dir")).unwrap();
    setxattr(&m.p("dir"), "user.d", b"1", 0).unwrap();
    assert_eq!(getxattr(&m.p("dir"), "user.d", 8).unwrap().1, b"1");

    // statvfs: real numbers from the targets and metad.
    // SAFETY: statvfs is plain old data; all zeros is a valid value.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid path and an out-parameter of the right type.
    assert_eq!(unsafe { libc::statvfs(cpath(&m.path).as_ptr(), &mut st) }, 0);
    assert_eq!((st.f_bsize, st.f_frsize, st.f_namemax), (4096, 4096, 255));
    assert!(
        st.f_blocks > 0 && st.f_bfree > 0 && st.f_bavail > 0,
        "blocks {st_blocks:?}",
        st_blocks = (st.f_blocks, st.f_bfree)
    );
    assert!(st.f_bfree <= st.f_blocks);
    assert!(st.f_files > 0 && st.f_ffree > 0 && st.f_ffree < st.f_files, "inodes {} free {}", st.f_files, st.f_ffree);

    // df(1) on the mount.
    let out = Command::new("df").arg("-P").arg(&m.path).output().expect("run df");
    assert!(out.status.success(), "df failed: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let row: Vec<&str> = text.lines().nth(1).expect("df row").split_whitespace().collect();
    assert!(row[0].starts_with("odfs:"), "df source: {text}");
    let kblocks: u64 = row[1].parse().expect("df size");
    assert_eq!(kblocks, st.f_blocks * 4, "df size in KiB");
    assert_eq!(Path::new(row[5]), m.path.as_path());
}

#[test]
fn a_hundred_thousand_entries_are_listed_exactly_once() {
    let fs = LocalFs::up(1, &[]);
    let m = FuseMount::start(&fs);
    let rt = runtime();
    let c = rt.block_on(fs.client());
    fs::create_dir(m.p("many")).unwrap();
    let n = 100_000;
    // Created through another client, in parallel (fast); listed through the mount.
    rt.block_on(async {
        let ctx = Ctx::root();
        let dir = c.resolve(&ctx, "/many", true).await.unwrap();
        let mut tasks = Vec::new();
        for t in 0..16 {
            let (c, ctx) = (c.clone(), ctx.clone());
            tasks.push(tokio::spawn(async move {
                for i in (t..n).step_by(16) {
                    c.create(&ctx, dir.ino, format!("entry-{i:06}").as_bytes(), 0o644, true, None).await.unwrap();
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
    });

    // getdents64 with a small (4 KiB) buffer, so most batches do not fit and the listing
    // resumes from offsets over and over: ".", ".." and every entry exactly once.
    let listing = getdents(&m.p("many"), 4096);
    let names: Vec<String> = listing.iter().map(|(n, _)| n.clone()).collect();
    let inos: std::collections::HashMap<String, u64> = listing.into_iter().collect();
    assert_eq!(names.len(), n + 2, "entries returned by readdir");
    let set: HashSet<&String> = names.iter().collect();
    assert_eq!(set.len(), names.len(), "some entry was listed twice");
    assert!(set.contains(&".".to_string()) && set.contains(&"..".to_string()));
    for i in 0..n {
        assert!(set.contains(&format!("entry-{i:06}")), "entry-{i:06} missing");
    }
    assert_eq!(inos["."], fs::metadata(m.p("many")).unwrap().ino());
    assert_eq!(inos[".."], fs::metadata(&m.path).unwrap().ino(), "\"..\" of /many is the root");
    assert_eq!(inos["entry-042424"], fs::metadata(m.p("many/entry-042424")).unwrap().ino());

    // std's read_dir (a second listing, after the kernel has the entries) agrees.
    let listed: HashSet<String> =
        fs::read_dir(m.p("many")).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert_eq!(listed.len(), n);
}

#[test]
fn sigterm_flushes_open_files_and_unmounts() {
    let fs = LocalFs::up(1, &[]);
    let mut m = FuseMount::start(&fs);
    let rt = runtime();
    let c = rt.block_on(fs.client());
    let data = pattern(5 * CHUNK + 3, 9);
    let mut f = File::create(m.p("open-at-term")).unwrap();
    f.write_all(&data).unwrap();
    // SAFETY: plain kill(2) of our child.
    assert_eq!(unsafe { libc::kill(m.child.id() as i32, libc::SIGTERM) }, 0);
    // The open file keeps the mount busy: it is flushed (another client sees the data while
    // the file is still open here) and the mount is detached.
    let start = Instant::now();
    loop {
        let seen = rt.block_on(async {
            let ctx = Ctx::root();
            match c.resolve(&ctx, "/open-at-term", true).await {
                Ok(a) if a.size == data.len() as u64 => Some(lib_read(&c, "/open-at-term").await),
                _ => None,
            }
        });
        if let Some(got) = seen {
            assert_bytes(&got, &data, "data flushed at SIGTERM");
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "data not published after SIGTERM:\n{}", m.log_text());
        std::thread::sleep(Duration::from_millis(50));
    }
    let start = Instant::now();
    while mount_line(&m.path).is_some_and(|l| l.fstype == "fuse.odfs") {
        assert!(start.elapsed() < Duration::from_secs(10), "mount still attached after SIGTERM:\n{}", m.log_text());
        std::thread::sleep(Duration::from_millis(20));
    }
    // The last user lets go: the daemon serves the close, then exits cleanly.
    f.write_all(b"tail").unwrap();
    drop(f);
    let st =
        m.wait_exit(Duration::from_secs(10)).unwrap_or_else(|| panic!("odfs-fuse still running:\n{}", m.log_text()));
    assert!(st.success(), "odfs-fuse exit status {st}:\n{}", m.log_text());
    let mut want = data.clone();
    want.extend_from_slice(b"tail");
    assert_bytes(&rt.block_on(lib_read(&c, "/open-at-term")), &want, "written after detaching, closed");

    // Unmounted from outside (fusermount3 -u): the daemon exits cleanly too.
    let mut m2 = FuseMount::start(&fs);
    assert_eq!(fs::read(m2.p("open-at-term")).unwrap().len(), want.len());
    let st = Command::new("fusermount3").arg("-u").arg(&m2.path).status().expect("run fusermount3");
    assert!(st.success(), "fusermount3 -u failed");
    let st = m2.wait_exit(Duration::from_secs(10)).expect("odfs-fuse exits after fusermount3 -u");
    assert!(st.success(), "exit status {st}:\n{}", m2.log_text());
}

#[test]
fn startup_errors_are_one_line_and_exit_1() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("odfs.toml");
    fs::write(&cfg, "mgmtd = \"127.0.0.1:1\"\n").unwrap();
    let file = dir.path().join("plain-file");
    fs::write(&file, b"").unwrap();
    let run = |fs_toml: &Path, mp: &Path| {
        let out = Command::new(odfs_fuse_bin()).arg("--fs").arg(fs_toml).arg("--mountpoint").arg(mp).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(err.lines().count(), 1, "one line on stderr: {err}");
        (out.status.code(), err.trim_end().to_string())
    };
    let (code, msg) = run(&dir.path().join("missing.toml"), dir.path());
    assert_eq!(code, Some(1));
    assert!(msg.starts_with("odfs-fuse: cannot read config") && msg.contains("missing.toml"), "{msg}");
    let (code, msg) = run(&cfg, &dir.path().join("nowhere"));
    assert_eq!(code, Some(1));
    assert!(msg.contains("mount point") && msg.contains("does not exist"), "{msg}");
    let (code, msg) = run(&cfg, &file);
    assert_eq!(code, Some(1));
    assert!(msg.contains("is not a directory"), "{msg}");
}

#[test]
fn allow_other_serves_other_users_with_their_own_identity() {
    let fs = LocalFs::up(1, &[]);
    let m = FuseMount::start_with(&fs, &["--allow-other"]);
    assert!(mount_line(&m.path).unwrap().options.contains("allow_other"));

    // As root: a home for uid 1000, a file for group 5000 only, a file for root only.
    fs::create_dir(m.p("home")).unwrap();
    // SAFETY: valid paths.
    assert_eq!(unsafe { libc::chown(cpath(&m.p("home")).as_ptr(), 1000, 1000) }, 0);
    fs::write(m.p("group-file"), b"for group 5000").unwrap();
    // SAFETY: as above.
    assert_eq!(unsafe { libc::chown(cpath(&m.p("group-file")).as_ptr(), 0, 5000) }, 0);
    fs::set_permissions(m.p("group-file"), fs::Permissions::from_mode(0o640)).unwrap();
    fs::write(m.p("root-only"), b"secret").unwrap();
    fs::set_permissions(m.p("root-only"), fs::Permissions::from_mode(0o600)).unwrap();

    // A supplementary group grants access (the kernel checks, and metad checks again with the
    // groups read from /proc/<pid>/status).
    let out = as_user(1000, 1000, &[5000], "cat", &[&m.p("group-file")]);
    assert!(out.status.success(), "cat as 1000 in group 5000: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.stdout, b"for group 5000");
    let out = as_user(1000, 1000, &[6000], "cat", &[&m.p("group-file")]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("Permission denied"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = as_user(1000, 1000, &[], "cat", &[&m.p("root-only")]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("Permission denied"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // New files belong to their creator; the root directory (0755, root's) refuses them.
    let out = as_user(1000, 1000, &[], "touch", &[&m.p("home/mine")]);
    assert!(out.status.success(), "touch in own home: {}", String::from_utf8_lossy(&out.stderr));
    let st = fs::metadata(m.p("home/mine")).unwrap();
    assert_eq!((st.uid(), st.gid()), (1000, 1000));
    let out = as_user(1000, 1000, &[], "touch", &[&m.p("not-mine")]);
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("Permission denied"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(errno(fs::metadata(m.p("not-mine"))), libc::ENOENT);
}

#[test]
fn mmap_shared_writes_are_read_by_other_processes_and_nodes_after_msync() {
    let fs = LocalFs::up(2, &["--chunk-size", "65536", "--stripe-count", "2"]);
    let m = FuseMount::start(&fs);
    let rt = runtime();
    let c = rt.block_on(fs.client());
    let len = 3 * CHUNK + 1234;
    let data = pattern(len, 77);
    let path = m.p("mapped");
    let f = OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
    f.set_len(len as u64).unwrap();
    let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
    // SAFETY: a mapping of `len` bytes of an open file of that size, unmapped below.
    unsafe {
        let p = libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0);
        assert_ne!(p, libc::MAP_FAILED, "mmap MAP_SHARED: {}", std::io::Error::last_os_error());
        std::ptr::copy_nonoverlapping(data.as_ptr(), p as *mut u8, len);
        assert_eq!(libc::msync(p, len, libc::MS_SYNC), 0, "msync: {}", std::io::Error::last_os_error());

        // Another process on this node.
        let out = Command::new("sha256sum").arg(&path).output().expect("run sha256sum");
        assert!(out.status.success());
        assert_eq!(String::from_utf8_lossy(&out.stdout).split(' ').next().unwrap(), sha256(&data));
        // Another node: msync made the data durable at stored, with the size at metad.
        assert_bytes(&rt.block_on(lib_read(&c, "/mapped")), &data, "mapped writes seen by another client");

        // A second shared mapping in a child process sees a change made through write(2).
        f.write_at(b"PATCHED", 5).unwrap();
        let out = Command::new("python3")
            .arg("-c")
            .arg("import mmap,sys\nf=open(sys.argv[1],'r+b')\nm=mmap.mmap(f.fileno(),0,mmap.MAP_SHARED)\nsys.stdout.write(m[5:12].decode())")
            .arg(&path)
            .output()
            .expect("run python3");
        assert!(out.status.success(), "python3 mmap: {}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(out.stdout, b"PATCHED");
        assert_eq!(libc::munmap(p, len), 0);
    }
}

/// Runs a Python snippet with `path` as argv[1]; returns its stdout.
fn python(code: &str, path: &Path) -> String {
    let out =
        Command::new("python3").arg("-c").arg(code).arg(path).output().expect("run python3 (apt install python3)");
    assert!(out.status.success(), "python3 failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn flock_and_fcntl_locks_hold_between_processes_of_one_node() {
    let fs = LocalFs::up(1, &[]);
    let m = FuseMount::start(&fs);
    let path = m.p("locked");
    fs::write(&path, vec![0u8; 4096]).unwrap();
    let f = OpenOptions::new().read(true).write(true).open(&path).unwrap();
    let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
    // flock(1) -n exits with -E's code when the lock is held elsewhere.
    let flock_cmd = |mode: &str| {
        Command::new("flock").args([mode, "-n", "-E", "75"]).arg(&path).arg("true").status().expect("run flock").code()
    };

    // SAFETY: flock(2) on an open descriptor.
    assert_eq!(unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) }, 0);
    assert_eq!(flock_cmd("-x"), Some(75), "exclusive flock held here, another process must not get it");
    assert_eq!(flock_cmd("-s"), Some(75));
    // SAFETY: as above.
    assert_eq!(unsafe { libc::flock(fd, libc::LOCK_SH) }, 0);
    assert_eq!(flock_cmd("-s"), Some(0), "shared flocks coexist");
    assert_eq!(flock_cmd("-x"), Some(75));
    // SAFETY: as above.
    assert_eq!(unsafe { libc::flock(fd, libc::LOCK_UN) }, 0);
    assert_eq!(flock_cmd("-x"), Some(0), "released");

    // POSIX byte-range locks: this process write-locks bytes 0..100.
    // SAFETY: an all-zero struct flock is valid; fields set below.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = libc::F_WRLCK as i16;
    fl.l_whence = libc::SEEK_SET as i16;
    fl.l_start = 0;
    fl.l_len = 100;
    // SAFETY: fcntl(2) with a valid struct flock.
    assert_eq!(unsafe { libc::fcntl(fd, libc::F_SETLK, &fl) }, 0, "F_SETLK: {}", std::io::Error::last_os_error());
    let probe = "import fcntl,os,struct,sys\n\
        fd=os.open(sys.argv[1],os.O_RDWR)\n\
        def try_lock(start):\n\
        \x20   try:\n\
        \x20       fcntl.lockf(fd,fcntl.LOCK_EX|fcntl.LOCK_NB,100,start); return 'locked'\n\
        \x20   except OSError as e: return 'busy'\n\
        q=struct.pack('hhqqi4x',fcntl.F_WRLCK,0,0,100,0)\n\
        t,w,s,l,pid=struct.unpack('hhqqi4x',fcntl.fcntl(fd,fcntl.F_GETLK,q))\n\
        print(try_lock(0),try_lock(200),pid if t!=fcntl.F_UNLCK else 0)";
    let got = python(probe, &path);
    assert_eq!(got.trim(), format!("busy locked {}", std::process::id()), "range 0..100 held by this process");
    fl.l_type = libc::F_UNLCK as i16;
    // SAFETY: as above.
    assert_eq!(unsafe { libc::fcntl(fd, libc::F_SETLK, &fl) }, 0);
    assert_eq!(python(probe, &path).trim(), "locked locked 0", "after F_UNLCK");
}

/// A file on the mount, open for reading and writing and held with `flock(LOCK_EX)`.
fn flocked(m: &FuseMount, name: &str) -> (std::path::PathBuf, File) {
    let path = m.p(name);
    fs::write(&path, b"x").unwrap();
    let f = OpenOptions::new().read(true).write(true).open(&path).unwrap();
    // SAFETY: flock(2) on an open descriptor.
    assert_eq!(unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&f), libc::LOCK_EX) }, 0);
    (path, f)
}

/// The exit code of `child` once it has exited; fails saying `what` if it still runs after
/// `limit`.
fn exit_code_within(child: &mut KillOnDrop, limit: Duration, what: &str) -> Option<i32> {
    let t = Instant::now();
    loop {
        if let Some(st) = child.0.try_wait().unwrap() {
            return st.code();
        }
        assert!(t.elapsed() < limit, "{what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A descriptor of the mount passed to a process of another user (a daemon that drops its
/// privileges after opening its files) works as it does on a local disk: its locks, its
/// fallocate and its close (FLUSH) are served, though that user could not open the file
/// through a mount without `allow_other`.
#[test]
fn a_descriptor_handed_to_another_user_locks_allocates_and_closes() {
    let fs = LocalFs::up(1, &[]);
    let m = FuseMount::start(&fs);
    let path = m.p("handed");
    fs::write(&path, b"x").unwrap();
    let code = "import fcntl,os\n\
        fcntl.lockf(3,fcntl.LOCK_EX|fcntl.LOCK_NB,10,0)\n\
        os.posix_fallocate(3,0,8192)\n\
        fcntl.lockf(3,fcntl.LOCK_UN,10,0)\n\
        fcntl.flock(3,fcntl.LOCK_EX|fcntl.LOCK_NB)\n\
        os.close(3)\n\
        print('ok',os.getuid())";
    let out = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "exec 3<>'{}' && exec setpriv --reuid 65534 --regid 65534 --clear-groups python3 -c \"$0\"",
            path.display()
        ))
        .arg(code)
        .output()
        .expect("run bash, setpriv (util-linux) and python3");
    assert!(out.status.success(), "as uid 65534: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "ok 65534");
    assert_eq!(fs::metadata(&path).unwrap().len(), 8192, "fallocate through the handed descriptor");
    // The same user cannot open the file itself: the mount is the job user's only.
    let out = Command::new("setpriv")
        .args(["--reuid", "65534", "--regid", "65534", "--clear-groups", "cat"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("Permission denied"));
}

/// A process waiting for a lock (`flock` without LOCK_NB) dies when killed, and the lock it
/// waited for is not left to it: the kernel keeps a killed waiter until its request is
/// answered, so the mount must notice the kill. Liveness only: the waits are bounds.
#[test]
fn a_killed_lock_waiter_dies_and_takes_no_lock() {
    let fs = LocalFs::up(1, &[]);
    let m = FuseMount::start(&fs);
    let (path, f) = flocked(&m, "contended");
    let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
    let mut waiter =
        KillOnDrop(Command::new("flock").arg("-x").arg(&path).args(["sleep", "600"]).spawn().expect("run flock"));
    // Blocked in its lock request, waiting for the mount's answer.
    let t = Instant::now();
    loop {
        let wchan = fs::read_to_string(format!("/proc/{}/wchan", waiter.0.id())).unwrap_or_default();
        if wchan == "request_wait_answer" {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "the waiter never blocked in its request: {wchan:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    waiter.0.kill().unwrap();
    exit_code_within(&mut waiter, Duration::from_secs(10), "a killed lock waiter did not die");
    // SAFETY: flock(2) on an open descriptor.
    assert_eq!(unsafe { libc::flock(fd, libc::LOCK_UN) }, 0);
    let free = || Command::new("flock").args(["-n", "-E", "75"]).arg(&path).arg("true").status().unwrap().code();
    let t = Instant::now();
    while free() != Some(0) {
        assert!(t.elapsed() < Duration::from_secs(10), "the lock was left to the killed waiter");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A lock wait ends at a signal the waiter handles, as on a local disk: `flock -w` times out
/// (util-linux arms a timer whose handler ends the wait) and an F_SETLKW of a process's main
/// thread, with other threads running, is interrupted by a handled SIGALRM, neither taking
/// the lock. Without it they would wait until the lock goes. Liveness only: the waits are
/// bounds.
#[test]
fn a_handled_signal_ends_a_lock_wait() {
    let fs = LocalFs::up(1, &[]);
    let m = FuseMount::start(&fs);
    let (path, f) = flocked(&m, "contended");
    let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
    let wait_exit = |what: &str, mut child: KillOnDrop| {
        exit_code_within(&mut child, Duration::from_secs(20), &format!("{what}: the signal did not end the wait"))
    };
    let timed = Command::new("flock").args(["-w", "1", "-E", "75"]).arg(&path).arg("true").spawn().expect("run flock");
    assert_eq!(wait_exit("flock -w 1", KillOnDrop(timed)), Some(75), "flock -w 1 times out (exit 75 by -E)");

    // SAFETY: flock(2) on an open descriptor.
    assert_eq!(unsafe { libc::flock(fd, libc::LOCK_UN) }, 0);
    // SAFETY: struct flock is plain old data; all zeros is a valid value.
    let mut lk: libc::flock = unsafe { std::mem::zeroed() };
    lk.l_type = libc::F_WRLCK as i16;
    lk.l_whence = libc::SEEK_SET as i16;
    // SAFETY: fcntl(2) on an open descriptor with a valid struct flock.
    assert_eq!(unsafe { libc::fcntl(fd, libc::F_SETLK, &lk) }, 0);
    let script = r#"
import fcntl, signal, sys, threading, time
f = open(sys.argv[1], "r+")
# A process of several threads, as a training script with its loaders: the main thread waits.
threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
# The handler raises (SystemExit): Python retries a call that failed with EINTR otherwise.
signal.signal(signal.SIGALRM, lambda *a: sys.exit(4))
signal.alarm(1)
fcntl.lockf(f, fcntl.LOCK_EX)
sys.exit(3)
"#;
    let alarmed = Command::new("python3").arg("-c").arg(script).arg(&path).spawn().expect("run python3");
    assert_eq!(
        wait_exit("F_SETLKW with alarm()", KillOnDrop(alarmed)),
        Some(4),
        "the alarm's handler ran during the wait (3: it took the lock; 1: an error)"
    );
    // Neither waiter holds the lock: it is ours until we drop it, then free.
    lk.l_type = libc::F_UNLCK as i16;
    // SAFETY: as above.
    assert_eq!(unsafe { libc::fcntl(fd, libc::F_SETLK, &lk) }, 0);
    let free = Command::new("flock").args(["-n", "-E", "75"]).arg(&path).arg("true").status().unwrap();
    assert_eq!(free.code(), Some(0), "the file is left unlocked");
}

fn denied(out: &std::process::Output, what: &str, msg: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains(msg), "{what}: expected \"{msg}\", got {:?}: {err}", out.status);
}

#[test]
fn chmod_and_chown_are_enforced_for_an_ordinary_user() {
    let user = TestUser::create("u");
    let fs = LocalFs::up(1, &[]);
    let m = FuseMount::start_with(&fs, &["--allow-other"]);
    let rt = runtime();
    let c = rt.block_on(fs.client());
    let home = m.p("home");
    fs::create_dir(&home).unwrap();
    // SAFETY: valid path.
    assert_eq!(unsafe { libc::chown(cpath(&home).as_ptr(), user.uid, user.gid) }, 0);
    let mine = home.join("mine");
    let out = user.run("touch", &[&mine]);
    assert!(out.status.success(), "touch: {}", String::from_utf8_lossy(&out.stderr));
    let st = fs::metadata(&mine).unwrap();
    assert_eq!((st.uid(), st.gid()), (user.uid, user.gid), "a new file belongs to its creator");

    // The owner changes the mode and the group to one they belong to.
    assert!(user.run("chmod", &[Path::new("640"), &mine]).status.success());
    let extra = user.extra_gid.to_string();
    let out = user.run("chgrp", &[Path::new(&extra), &mine]);
    assert!(out.status.success(), "chgrp to own group: {}", String::from_utf8_lossy(&out.stderr));
    // ...but may not give the file away or pick a group they are not in.
    denied(&user.run("chown", &[Path::new("0"), &mine]), "chown to root", "Operation not permitted");
    denied(&user.run("chgrp", &[Path::new("0"), &mine]), "chgrp to root's group", "Operation not permitted");
    // Another client (node) sees what metad holds.
    let a = rt.block_on(c.resolve(&Ctx::root(), "/home/mine", true)).unwrap();
    assert_eq!((a.uid, a.gid, a.mode & 0o7777), (user.uid, user.extra_gid, 0o640));

    // Root's file: the user may neither change its mode nor write it.
    let rootfile = m.p("rootfile");
    fs::write(&rootfile, b"root's").unwrap();
    fs::set_permissions(&rootfile, fs::Permissions::from_mode(0o644)).unwrap();
    denied(&user.run("chmod", &[Path::new("666"), &rootfile]), "chmod of root's file", "Operation not permitted");
    denied(&user.run("truncate", &[Path::new("-s0"), &rootfile]), "write root's 0644 file", "Permission denied");
    denied(&user.run("touch", &[&m.p("in-root-dir")]), "create in root's 0755 dir", "Permission denied");
    assert_eq!(fs::read(&rootfile).unwrap(), b"root's");
    assert_eq!(fs::metadata(&rootfile).unwrap().mode() & 0o7777, 0o644);

    // Root gives it away; now the user may change its mode and write it.
    // SAFETY: valid path.
    assert_eq!(unsafe { libc::chown(cpath(&rootfile).as_ptr(), user.uid, user.gid) }, 0);
    assert!(user.run("chmod", &[Path::new("600"), &rootfile]).status.success());
    assert!(user.run("truncate", &[Path::new("-s2"), &rootfile]).status.success());
    assert_eq!(fs::read(&rootfile).unwrap(), b"ro");

    // A descriptor keeps the access it was opened with: a file created read-only (as git
    // creates its objects) is written and closed by its creator.
    let ro = home.join("read-only");
    let out = user.run(
        "python3",
        &[
            Path::new("-c"),
            Path::new("import os,sys\nfd=os.open(sys.argv[1],os.O_CREAT|os.O_EXCL|os.O_WRONLY,0o444)\nos.write(fd,b'kept')\nos.close(fd)"),
            &ro,
        ],
    );
    assert!(out.status.success(), "write and close a new 0444 file: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(fs::read(&ro).unwrap(), b"kept");
    assert_eq!(fs::metadata(&ro).unwrap().mode() & 0o777, 0o444);

    // Mode bits bind the owner too: 000 refuses the user's own read; root still reads.
    assert!(user.run("chmod", &[Path::new("000"), &mine]).status.success());
    denied(&user.run("cat", &[&mine]), "read own 000 file", "Permission denied");
    assert_eq!(fs::read(&mine).unwrap(), b"");
    // A directory the user cannot search hides its entries from them.
    assert!(user.run("chmod", &[Path::new("600"), &home]).status.success());
    denied(&user.run("stat", &[&mine]), "stat below a 0600 directory", "Permission denied");
}

#[test]
fn posix_acls_are_refused_so_tools_fall_back_to_the_mode() {
    let fs = LocalFs::up(1, &[]);
    let m = FuseMount::start(&fs);
    let f = m.p("acl");
    fs::write(&f, b"x").unwrap();
    // A minimal access ACL: version 2, then (tag, perm, id) for user::rwx, group::r-x, other::--x.
    let mut acl = 2u32.to_le_bytes().to_vec();
    for (tag, perm) in [(0x01u16, 7u16), (0x04, 5), (0x20, 1)] {
        acl.extend(tag.to_le_bytes().into_iter().chain(perm.to_le_bytes()).chain(u32::MAX.to_le_bytes()));
    }
    assert_eq!(errno(setxattr(&f, "system.posix_acl_access", &acl, 0)), libc::EOPNOTSUPP);
    assert_eq!(errno(getxattr(&f, "system.posix_acl_access", 256)), libc::ENODATA);
    // So cp -a keeps modes with chmod: a 0751 file copies as 0751.
    let src = tempfile::tempdir().unwrap();
    fs::write(src.path().join("x"), b"data").unwrap();
    fs::set_permissions(src.path().join("x"), fs::Permissions::from_mode(0o751)).unwrap();
    let st = Command::new("cp").arg("-a").arg(src.path().join("x")).arg(m.p("x")).status().unwrap();
    assert!(st.success());
    assert_eq!(fs::metadata(m.p("x")).unwrap().mode() & 0o7777, 0o751);
}

/// `odfs stats` counts every kind of request at every service, by client, with latencies: a
/// metadata storm through the mount and an odfs command's own creates are told apart, and the
/// job's user reads the same through the mount.
#[test]
fn stats_count_requests_by_kind_and_client() {
    use odfs_proto::stats::FsStats;
    const STORM: u64 = 400;
    const COPIED: u64 = 25;
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port().to_string()
    };
    let fs = LocalFs::up(2, &["--metrics-port", &port]);
    let m = FuseMount::start(&fs);
    let cfg = fs.config_path().display().to_string();

    fs::create_dir(m.p("storm")).unwrap();
    for i in 0..STORM {
        File::create(m.p(&format!("storm/f{i}"))).unwrap();
    }
    let src = tempfile::tempdir().unwrap();
    for i in 0..COPIED {
        fs::write(src.path().join(format!("c{i}")), vec![7u8; 10_000]).unwrap();
    }
    odfs_ok(&["--fs", &cfg, "cp", "-r", &src.path().display().to_string(), "odfs:/copied"]);

    let st: FsStats = serde_json::from_str(&odfs_ok(&["--fs", &cfg, "stats", "--json"])).expect("stats JSON");
    let metads: Vec<_> = st
        .services
        .iter()
        .filter(|s| s.kind == Some(odfs_proto::mgmt::ServiceKind::Meta))
        .map(|s| s.stats.as_ref().unwrap_or_else(|| panic!("{} not asked: {:?}", s.name, s.error)))
        .collect();
    assert!(!metads.is_empty(), "no metad in {st:?}");
    let near = |got: u64, want: u64| got.abs_diff(want) * 20 <= want;
    let creates: u64 = metads.iter().flat_map(|s| &s.methods).filter(|m| m.name == "Create").map(|m| m.count).sum();
    assert!(near(creates, STORM + COPIED), "metad counted {creates} creates, the workload made {}", STORM + COPIED);

    // By client: the mount (registered, so named by its pid) and the command (unregistered).
    let mount = st.clients.iter().find(|c| c.pid == m.child.id()).expect("the mount is a registered client");
    let creates_of = |id: u64| -> u64 {
        metads
            .iter()
            .flat_map(|s| &s.clients)
            .filter(|c| c.client_id == id)
            .flat_map(|c| &c.methods)
            .filter(|(k, _)| k == "Create")
            .map(|(_, n)| n)
            .sum()
    };
    assert!(near(creates_of(mount.client_id), STORM), "the mount's creates: {}", creates_of(mount.client_id));
    let others: Vec<u64> = metads
        .iter()
        .flat_map(|s| &s.clients)
        .map(|c| c.client_id)
        .filter(|id| *id != mount.client_id && creates_of(*id) > 0)
        .collect();
    assert_eq!(others.len(), 1, "one other client created files: {others:?}");
    assert!(near(creates_of(others[0]), COPIED), "the command's creates: {}", creates_of(others[0]));

    // Latencies, and the chunk bytes written at the storage services.
    let create = metads.iter().flat_map(|s| &s.methods).find(|m| m.name == "Create").unwrap();
    let (p50, p99) = (create.percentile_us(0.5), create.percentile_us(0.99));
    assert!(p50 > 0 && p50 <= p99, "Create latency p50 {p50} us, p99 {p99} us");
    let written: u64 = st
        .services
        .iter()
        .filter(|s| s.kind == Some(odfs_proto::mgmt::ServiceKind::Storage))
        .filter_map(|s| s.stats.as_ref())
        .flat_map(|s| &s.methods)
        .map(|m| m.bytes_in)
        .sum();
    assert!(written >= COPIED * 10_000, "stored received {written} bytes of chunk data");
    // Per target: every byte a stored received is counted at one of its targets, and the
    // copied files went to more than one.
    let targets: Vec<_> = st.services.iter().filter_map(|s| s.stats.as_ref()).flat_map(|s| &s.targets).collect();
    assert_eq!(targets.iter().map(|t| t.bytes_in).sum::<u64>(), written, "targets' bytes: {targets:?}");
    assert!(targets.iter().filter(|t| t.bytes_in > 0).count() >= 2, "written to one target only: {targets:?}");
    assert!(st.services.iter().any(|s| s.name == "mgmtd" && s.stats.is_some()), "mgmtd answers too");

    // The Prometheus endpoint: the same counts, and whole histograms.
    let text = scrape(&format!("127.0.0.1:{port}"), "/metrics");
    assert!(text.starts_with("HTTP/1.1 200 OK"), "{text}");
    let sample = |line_start: &str| -> u64 {
        let l =
            text.lines().find(|l| l.starts_with(line_start)).unwrap_or_else(|| panic!("no {line_start} in\n{text}"));
        l.rsplit(' ').next().unwrap().parse().unwrap()
    };
    let shard0 = metads[0].methods.iter().find(|m| m.name == "Create").map_or(0, |m| m.count);
    let scraped = sample("odfs_requests_total{service=\"metad shard 0\",request=\"Create\"}");
    assert!(
        scraped >= shard0 && near(scraped, shard0),
        "scraped {scraped} creates at shard 0, odfs stats said {shard0}"
    );
    let buckets: Vec<u64> = text
        .lines()
        .filter(|l| l.starts_with("odfs_request_duration_seconds_bucket{service=\"metad shard 0\",request=\"Create\""))
        .map(|l| l.rsplit(' ').next().unwrap().parse().unwrap())
        .collect();
    assert!(buckets.windows(2).all(|w| w[0] <= w[1]), "cumulative buckets: {buckets:?}");
    assert_eq!(buckets.last().copied(), Some(scraped), "the +Inf bucket is the count");
    assert_eq!(sample("odfs_service_up{service=\"mgmtd\"}"), 1);
    assert!(scrape(&format!("127.0.0.1:{port}"), "/other").starts_with("HTTP/1.1 404"));
    let scraped_in: u64 = text
        .lines()
        .filter(|l| l.starts_with("odfs_target_bytes_in_total{"))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
        .sum();
    assert!(scraped_in >= written, "scraped target bytes {scraped_in}, odfs stats said {written}");
    // A second filesystem asking for the same port starts anyway, without metrics, and says so.
    let other = LocalFs::up(1, &["--metrics-port", &port]);
    let log = fs::read_to_string(other.root().join("node0/mgmtd.log")).unwrap_or_default();
    assert!(log.contains("cannot serve Prometheus metrics there"), "{log}");
    drop(other);
    assert!(scrape(&format!("127.0.0.1:{port}"), "/metrics").starts_with("HTTP/1.1 200 OK"), "the first still serves");

    // The table names the mount's client and the kinds.
    let text = odfs_ok(&["--fs", &cfg, "stats"]);
    assert!(text.contains(&format!("pid {}", m.child.id())), "{text}");
    assert!(text.lines().any(|l| l.contains("metad shard 0") && l.contains(" Create ")), "{text}");

    // The job's user reads the same through the mount (no config, no credential).
    let out = std::process::Command::new(bin_dir().join("odfs"))
        .args(["stats", "--json"])
        .env_remove("ODFS_FS")
        .env("ODFS_MOUNT", &m.path)
        .current_dir(src.path())
        .output()
        .expect("run odfs stats");
    let via_mount: FsStats = serde_json::from_slice(&stdout_ok(&out, "odfs stats through the mount").into_bytes())
        .expect("stats JSON through the mount");
    let again: u64 = via_mount
        .services
        .iter()
        .filter_map(|s| s.stats.as_ref())
        .flat_map(|s| &s.methods)
        .filter(|m| m.name == "Create")
        .map(|m| m.count)
        .sum();
    assert!(again >= creates, "through the mount: {again} creates, before {creates}");
    // Another user is refused by the mount, and told so first.
    let other = TestUser::create("st");
    let odfs = bin_dir().join("odfs");
    let mount_env = format!("ODFS_MOUNT={}", m.path.display());
    let out =
        other.run("env", &[Path::new("-u"), Path::new("ODFS_FS"), Path::new(&mount_env), &odfs, Path::new("stats")]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "another user read the statistics: {err}");
    assert!(
        err.starts_with(&format!(
            "odfs: permission denied: the odfs mount {} serves only its job's user",
            m.path.display()
        )),
        "{err}"
    );
    // And what the mount itself answered, by FUSE request: each create of the storm was one
    // CREATE sent on to metad, and one FLUSH and one RELEASE answered without a request.
    let me = via_mount
        .services
        .iter()
        .find(|s| s.kind == Some(odfs_proto::mgmt::ServiceKind::Client))
        .unwrap_or_else(|| panic!("no mount's own counts in {:?}", via_mount.services));
    assert!(me.name.contains(&format!("pid {}", m.child.id())), "{}", me.name);
    let ops = me.stats.as_ref().expect("the mount's counts");
    let op = |name: &str| ops.methods.iter().find(|o| o.name == name).unwrap_or_else(|| panic!("no {name} in {ops:?}"));
    assert!(near(op("create").count, STORM), "the mount answered {} creates", op("create").count);
    assert!(op("create").percentile_us(0.5) > 0, "create latencies: {:?}", op("create").latency_us);
    for quick in ["flush (no request)", "release (no request)"] {
        assert!(op(quick).count >= STORM && op(quick).errors == 0, "{quick}: {:?}", op(quick));
    }
    // A command's numbers hold only the services' (it counted no operations of its own).
    assert!(st.services.iter().all(|s| s.kind != Some(odfs_proto::mgmt::ServiceKind::Client)), "{st:?}");

    // getfattr's two calls: a size probe, then a read with exactly the probed size. The
    // statistics grow in between (here by kinds of request not made before), and still fit.
    let (probe, _) = getxattr(&m.path, "odfs.stats", 0).expect("size probe of odfs.stats");
    fs::create_dir(m.p("after-probe")).unwrap();
    std::os::unix::fs::symlink("storm", m.p("after-probe/link")).unwrap();
    fs::rename(m.p("after-probe/link"), m.p("after-probe/moved")).unwrap();
    let (n, bytes) = getxattr(&m.path, "odfs.stats", probe).expect("odfs.stats read with the probed size");
    assert!(n > 0 && n <= probe, "read {n} bytes after a probe of {probe}");
    let grown: FsStats = serde_json::from_slice(&bytes).expect("stats JSON after the probe");
    let kinds = |st: &FsStats, name: &str| {
        st.services.iter().filter_map(|s| s.stats.as_ref()).flat_map(|s| &s.methods).filter(|m| m.name == name).count()
    };
    assert!(kinds(&via_mount, "Symlink") == 0 && kinds(&grown, "Symlink") > 0, "the statistics did not grow");
}

/// One plain HTTP GET of `path` at `addr`: the whole response, head and body.
fn scrape(addr: &str, path: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).expect("connect to the metrics endpoint");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read the metrics response");
    out
}

/// `odfs stats -w` during an mdtest-like run: in every screen whose interval lies inside the
/// run, the create rate it shows at metad agrees within 5% with the workload's own count over
/// that interval (each screen names its time and interval; the workload notes when each create
/// returned), and the busiest client it names is the mount doing them.
#[test]
fn stats_watch_rates_agree_with_a_running_workload() {
    const RATE: f64 = 200.0;
    const SECS: f64 = 18.0;
    const EVERY: f64 = 4.0;
    let unix_ms = || SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64;
    let fs = LocalFs::up(2, &[]);
    let m = FuseMount::start(&fs);
    fs::create_dir(m.p("md")).unwrap();
    let watch = Command::new(bin_dir().join("odfs"))
        .args(["--fs", &fs.config_path().display().to_string(), "stats", "-w", &EVERY.to_string()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Give the watch its first snapshot, then run the workload.
    std::thread::sleep(Duration::from_millis(500));
    let (t0, start_ms) = (Instant::now(), unix_ms());
    let mut done_ms = Vec::new();
    while t0.elapsed().as_secs_f64() < SECS {
        let due = (t0.elapsed().as_secs_f64() * RATE) as usize;
        while done_ms.len() < due {
            File::create(m.p(&format!("md/f{}", done_ms.len()))).unwrap();
            done_ms.push(unix_ms());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let end_ms = unix_ms();
    // Kill the watch once it has printed a screen after the run.
    std::thread::sleep(Duration::from_secs_f64(EVERY + 1.0));
    let mut watch = watch;
    watch.kill().unwrap();
    let out = watch.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    // Into a pipe, each screen starts with its `odfs stats at` line (no terminal escapes).
    assert!(!text.contains('\x1b'), "terminal escapes written into a pipe:\n{text:?}");
    let screens: Vec<String> = text.split("\nodfs stats at ").skip(1).map(|s| format!("odfs stats at {s}")).collect();
    let create_rate = |screen: &str| -> f64 {
        let l = screen
            .lines()
            .find(|l| l.starts_with("metad shard 0") && l.split_whitespace().nth(3) == Some("Create"))
            .unwrap_or_else(|| panic!("no Create row at metad in\n{screen}"));
        l.split_whitespace().nth(5).unwrap().parse().unwrap()
    };
    // A screen's interval from its first line, "odfs stats at HH:MM:SS.mmm UTC, rates over the
    // last S s", as Unix milliseconds (the day taken from the run's start).
    let interval = |screen: &str| -> (u64, u64) {
        let head = screen.lines().next().unwrap();
        let f: Vec<&str> = head.split_whitespace().collect();
        assert!(head.starts_with("odfs stats at ") && f.len() == 11, "unexpected first line: {head}");
        let t: Vec<f64> = f[3].split(':').map(|x| x.parse().unwrap()).collect();
        let of_day = ((t[0] * 3600.0 + t[1] * 60.0 + t[2]) * 1000.0).round() as u64;
        let mut end = start_ms - start_ms % 86_400_000 + of_day;
        if end + 43_200_000 < start_ms {
            end += 86_400_000; // the run crossed midnight
        }
        let secs: f64 = f[9].parse().unwrap();
        (end - (secs * 1000.0).round() as u64, end)
    };
    let inside: Vec<(&str, u64, u64)> = screens
        .iter()
        .map(|s| {
            let (from, to) = interval(s);
            (s.as_str(), from, to)
        })
        .filter(|(_, from, to)| *from >= start_ms && *to <= end_ms)
        .collect();
    assert!(inside.len() >= 2, "too few screens inside the run: {}\n{text}", inside.len());
    for (s, from, to) in inside {
        let own = done_ms.iter().filter(|t| (from..to).contains(t)).count() as f64;
        let own_rate = own * 1000.0 / (to - from) as f64;
        let r = create_rate(s);
        eprintln!("odfs stats -w: {r:.0} creates/s at metad; the workload's own rate {own_rate:.1}/s");
        assert!(
            (r - own_rate).abs() <= 0.05 * own_rate,
            "odfs stats -w shows {r:.0} creates/s at metad, the workload made {own_rate:.0}/s:\n{s}"
        );
        // The clients table: the busiest client is the mount, named by its pid, at least as busy
        // as its creates.
        let clients = s.split("CLIENT").nth(1).unwrap_or_else(|| panic!("no clients table in\n{s}"));
        let top = clients.lines().nth(1).unwrap();
        assert!(top.contains(&format!("pid {}", m.child.id())), "busiest client is not the mount: {top}\n{s}");
        // After the name (which ends in the pid): REQUESTS, then RATE/s.
        let after = top.split(&format!("pid {}", m.child.id())).nth(1).unwrap();
        let rate: f64 = after.split_whitespace().nth(1).unwrap().parse().unwrap();
        assert!(rate >= 0.95 * own_rate, "the mount's requests/s {rate} below its creates/s {own_rate:.0}: {top}");
    }
}

/// What `odfs stats` shows at a first look: names looked up that do not exist and attributes
/// asked for that are not there are answers, not ERRORS (a refusal still is one); the many
/// commands a job runs are one row of the clients table; `-w` into a pipe writes screens one
/// after the other, without terminal escapes.
#[test]
fn stats_count_missing_names_as_answers_fold_commands_and_watch_plainly_into_a_pipe() {
    const N: u64 = 25;
    let fs = LocalFs::up(2, &[]);
    let m = FuseMount::start(&fs);
    let cfg = fs.config_path().display().to_string();
    fs::create_dir(m.p("d")).unwrap();
    fs::write(m.p("d/f"), b"x").unwrap();
    for i in 0..N {
        let e = fs::metadata(m.p(&format!("missing{i}"))).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOENT), "{e}");
        let e = getxattr(&m.p("d/f"), &format!("user.absent{i}"), 64).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENODATA), "{e}");
    }
    // A refusal is an error: a directory that is not empty.
    assert_eq!(fs::remove_dir(m.p("d")).unwrap_err().raw_os_error(), Some(libc::ENOTEMPTY));
    // Commands, each a client of its own: N that find their file, one that does not.
    for _ in 0..N {
        odfs_ok(&["--fs", &cfg, "getstripe", "odfs:/d/f"]);
    }
    assert!(!odfs(&["--fs", &cfg, "getstripe", "odfs:/nothing-here"]).status.success());

    let st: odfs_proto::stats::FsStats =
        serde_json::from_str(&odfs_ok(&["--fs", &cfg, "stats", "--json"])).expect("stats JSON");
    let kind = |service: &str, name: &str| -> (u64, u64) {
        st.services
            .iter()
            .filter(|s| s.name.starts_with(service))
            .filter_map(|s| s.stats.as_ref())
            .flat_map(|s| &s.methods)
            .filter(|m| m.name == name)
            .fold((0, 0), |(c, e), m| (c + m.count, e + m.errors))
    };
    let (lookups, errors) = kind("metad", "Lookup");
    assert!(lookups >= N && errors == 0, "metad's lookups: {lookups}, {errors} errors");
    let (getxattrs, errors) = kind("metad", "GetXattr");
    assert!(getxattrs >= N && errors == 0, "metad's getxattrs: {getxattrs}, {errors} errors");
    assert!(kind("metad", "Rmdir").1 >= 1, "the refused rmdir is an error at metad");
    // The mount's own counts, read through it.
    let text = getfattr(&m.path, "odfs.stats");
    let via_mount: odfs_proto::stats::FsStats = serde_json::from_str(&text).expect("odfs.stats JSON");
    let mount = via_mount
        .services
        .iter()
        .find(|s| s.kind == Some(odfs_proto::mgmt::ServiceKind::Client))
        .and_then(|s| s.stats.as_ref())
        .expect("the mount's own counts");
    let op = |name: &str| {
        mount
            .methods
            .iter()
            .filter(|o| o.name.split(' ').next() == Some(name))
            .fold((0, 0), |(c, e), o| (c + o.count, e + o.errors))
    };
    let (n, errors) = op("lookup");
    assert!(n >= N && errors == 0, "the mount's lookups: {n}, {errors} errors: {:?}", mount.methods);
    let (n, errors) = op("getxattr");
    assert!(n >= N && errors == 0, "the mount's getxattrs: {n}, {errors} errors: {:?}", mount.methods);
    assert!(op("rmdir").1 >= 1, "the refused rmdir is an error at the mount: {:?}", mount.methods);

    // The clients table: the mount, and every command in one row.
    let table = odfs_ok(&["--fs", &cfg, "stats"]);
    let clients: Vec<&str> = table.split("CLIENT").nth(1).expect("a clients table").lines().skip(1).collect();
    let commands: Vec<&&str> = clients.iter().filter(|l| l.starts_with("odfs commands (")).collect();
    assert_eq!(commands.len(), 1, "{table}");
    let ids: u64 = commands[0].trim_start_matches("odfs commands (").split(' ').next().unwrap().parse().unwrap();
    assert!(ids > N, "{} commands ran: {}", N + 1, commands[0]);
    assert!(!table.contains("unregistered: a command"), "{table}");
    assert!(clients.iter().any(|l| l.contains(&format!("pid {}", m.child.id()))), "the mount is named: {table}");

    // -w into a pipe: screens, each after a blank line, no escapes.
    let watch = Command::new(bin_dir().join("odfs"))
        .args(["--fs", &cfg, "stats", "-w", "0.5"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut watch = KillOnDrop(watch);
    std::thread::sleep(Duration::from_secs(3));
    watch.0.kill().unwrap();
    let mut out = String::new();
    watch.0.stdout.take().unwrap().read_to_string(&mut out).unwrap();
    assert!(!out.contains('\x1b'), "terminal escapes written into a pipe: {out:?}");
    assert!(out.contains("\nodfs stats at ") && out.contains("SERVICE"), "{out}");
}

/// The creating FUSE minimum of `odfs bench --mount` (the bound it sets creates) makes what
/// an mdtest-style create asks for, each a new inode, from workers making their directories at
/// once; it remembers directories, not files; and refuses creates when not asked to make them.
#[test]
fn the_creating_fuse_minimum_makes_directories_and_files() {
    use odfs_bench::minimum_fs::MinimumFs;
    assert!(Path::new("/dev/fuse").exists(), "/dev/fuse is missing: this test mounts a FUSE filesystem");
    let dir = tempfile::tempdir().unwrap();
    let at = dir.path().join("mnt");
    fs::create_dir_all(&at).unwrap();
    let session = MinimumFs::new(0, 0, Vec::new(), false).with_creates().mount(&at).unwrap();
    // As the benchmark's workers do: each makes its own directory under a common one, at once.
    let inos: Vec<Vec<u64>> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..4)
            .map(|t| {
                let d = at.join(format!("md/t{t}"));
                s.spawn(move || {
                    fs::create_dir_all(&d).unwrap();
                    (0..50)
                        .map(|i| {
                            let p = d.join(format!("f{t}.{i}"));
                            drop(OpenOptions::new().write(true).create_new(true).open(&p).unwrap());
                            let m = fs::metadata(&p).unwrap();
                            assert!(m.is_file() && m.len() == 0, "{}: {m:?}", p.display());
                            assert_eq!(fs::read(&p).unwrap(), Vec::<u8>::new());
                            m.ino()
                        })
                        .collect()
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).collect()
    });
    let all: HashSet<u64> = inos.iter().flatten().copied().collect();
    assert_eq!(all.len(), 200, "every create got an inode of its own");
    // Directories are remembered by name; files are not, and a listing has none.
    for t in 0..4 {
        assert!(fs::metadata(at.join(format!("md/t{t}"))).unwrap().is_dir());
    }
    assert_eq!(fs::read_dir(at.join("md/t0")).unwrap().count(), 0);
    session.unmount().unwrap();

    // The read-only minimum refuses a create (the kernel's EROFS for a read-only mount).
    let session = MinimumFs::new(0, 0, Vec::new(), false).mount(&at).unwrap();
    let err = fs::create_dir(at.join("x")).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS));
    session.unmount().unwrap();
}

/// The networked FUSE minimum of `odfs bench --mount` (the bound it sets odfs's default-stripe
/// reads) serves its files' real bytes: each READ fetched over loopback TCP with sendfile.
#[test]
fn the_networked_fuse_minimum_reads_its_files_bytes() {
    use odfs_bench::minimum_fs::{FileServer, MinimumFs};
    assert!(Path::new("/dev/fuse").exists(), "/dev/fuse is missing: this test mounts a FUSE filesystem");
    let dir = tempfile::tempdir().unwrap();
    // Two files of the same size (the minimum's large files all have one size), not a whole
    // number of pages, so the last READ is short.
    let size = (3 << 20) + 12_345;
    let data: Vec<Vec<u8>> = (0..2).map(|k| pattern(size, 40 + k)).collect();
    let files: Vec<_> = (0..2).map(|k| dir.path().join(format!("f{k}"))).collect();
    for (f, d) in files.iter().zip(&data) {
        fs::write(f, d).unwrap();
    }
    let server = FileServer::start(&files).unwrap();
    let at = dir.path().join("mnt");
    fs::create_dir_all(&at).unwrap();
    let session = MinimumFs::new(0, 0, Vec::new(), false).with_remote_large(&server, size as u64).mount(&at).unwrap();
    for (k, d) in data.iter().enumerate() {
        let p = at.join(format!("seq.{k}.0"));
        assert_bytes(&fs::read(&p).unwrap(), d, "whole file through the minimum");
        let f = File::open(&p).unwrap();
        let mut buf = vec![0u8; 70_000];
        let n = f.read_at(&mut buf, size as u64 - 50_000).unwrap();
        assert_bytes(&buf[..n], &d[size - 50_000..], "a read across the end");
    }
    session.unmount().unwrap();
}

/// The striped FUSE minimum (the bound `odfs bench --mount` sets the default stripe's 4 KiB
/// random reads) stripes as the default layout does, seen from one of four nodes: the first
/// chunk of every four is read from the disk files, the other three fetched over TCP. Given
/// files of different bytes on each side, every chunk must read as its side's.
#[test]
fn the_striped_fuse_minimum_reads_one_chunk_in_four_from_disk_and_the_rest_over_tcp() {
    use odfs_bench::minimum_fs::{FileServer, MinimumFs, STRIPE_UNIT};
    assert!(Path::new("/dev/fuse").exists(), "/dev/fuse is missing: this test mounts a FUSE filesystem");
    let dir = tempfile::tempdir().unwrap();
    let unit = STRIPE_UNIT as usize;
    let size = 9 * unit;
    let (remote, disk) = (pattern(size, 60), pattern(size, 61));
    let (rf, df) = (dir.path().join("remote"), dir.path().join("disk"));
    fs::write(&rf, &remote).unwrap();
    fs::write(&df, &disk).unwrap();
    let server = FileServer::start(std::slice::from_ref(&rf)).unwrap();
    let at = dir.path().join("mnt");
    fs::create_dir_all(&at).unwrap();
    let session = MinimumFs::new(0, 0, Vec::new(), false)
        .with_remote_large(&server, size as u64)
        .with_disk_large(std::slice::from_ref(&df), size as u64)
        .unwrap()
        .with_threads(3)
        .mount(&at)
        .unwrap();
    let p = at.join("seq.0.0");
    for chunk in 0..9 {
        // Each read one READ of its own (O_DIRECT), from inside the chunk.
        let offset = chunk * unit + 8192;
        let got = read_direct(&p, offset as u64, 4096);
        let want = if chunk % 4 == 0 { &disk } else { &remote };
        assert_bytes(&got, &want[offset..offset + 4096], &format!("chunk {chunk}"));
    }
    session.unmount().unwrap();
}

/// The striped FUSE minimum over the kernel's io_uring transport for FUSE (the bound
/// `odfs bench --mount` sets the default stripe's 4 KiB random reads with the cheapest FUSE
/// transport there is) stripes as the `/dev/fuse` one does, answers through its rings, and
/// serves every byte right: each chunk from its side, the file's short last page, reads at
/// offsets `O_DIRECT` cannot take, and a missing name as ENOENT.
#[test]
fn the_io_uring_fuse_minimum_reads_one_chunk_in_four_from_disk_and_the_rest_over_tcp() {
    use odfs_bench::minimum_fs::{FileServer, MinimumFs, STRIPE_UNIT};
    use odfs_bench::uring_minimum::{self, TransportAllowed};
    use std::os::unix::fs::OpenOptionsExt;
    assert!(Path::new("/dev/fuse").exists(), "/dev/fuse is missing: this test mounts a FUSE filesystem");
    let _allowed = TransportAllowed::new().expect("this test needs the kernel's FUSE io_uring transport (6.14+, root)");
    let dir = tempfile::tempdir().unwrap();
    let unit = STRIPE_UNIT as usize;
    let size = 9 * unit + 12_345;
    let (remote, disk) = (pattern(size, 62), pattern(size, 63));
    let (rf, df) = (dir.path().join("remote"), dir.path().join("disk"));
    fs::write(&rf, &remote).unwrap();
    fs::write(&df, &disk).unwrap();
    let at = dir.path().join("mnt");
    fs::create_dir_all(&at).unwrap();
    let server = FileServer::start(std::slice::from_ref(&rf)).unwrap();
    let striped = MinimumFs::new(0, 0, Vec::new(), false)
        .with_remote_large(&server, size as u64)
        .with_disk_large(std::slice::from_ref(&df), size as u64)
        .unwrap();
    let mounted = uring_minimum::mount(striped, &at, 4).unwrap();
    let want: Vec<u8> = (0..size).map(|i| if (i / unit).is_multiple_of(4) { disk[i] } else { remote[i] }).collect();
    let p = at.join("seq.0.0");
    for chunk in 0..9 {
        let offset = chunk * unit + 8192;
        assert_bytes(&read_direct(&p, offset as u64, 4096), &want[offset..offset + 4096], &format!("chunk {chunk}"));
    }
    assert_bytes(&fs::read(&p).unwrap(), &want, "whole file, buffered");
    let end = 9 * unit;
    assert_bytes(&read_direct(&p, end as u64, 16_384), &want[end..], "the short last page, O_DIRECT");
    // FUSE passes an O_DIRECT read at any offset; one inside a local chunk is read buffered.
    let f = OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(&p).unwrap();
    let mut buf = vec![0u8; 1000];
    assert_eq!(f.read_at(&mut buf, 100).unwrap(), 1000);
    assert_bytes(&buf, &want[100..1100], "an unaligned O_DIRECT read of a local chunk");
    drop(f);
    assert_eq!(fs::metadata(at.join("seq.1.0")).unwrap_err().raw_os_error(), Some(libc::ENOENT));
    let answered = mounted.unmount().unwrap().requests;
    assert!(answered >= 9, "only {answered} requests were answered through the rings");
}

/// odfs-fuse over the kernel's io_uring transport (`fuse_io_uring`, with `enable_uring` on):
/// the requests POSIX tools make (creates, large and small writes and reads, appends, renames,
/// links, symlinks, xattrs, chmod, truncate, listings, removals, and the errors of each) are
/// answered through the rings with the results they have through `/dev/fuse`, a second mount
/// reads the same bytes, and the queues' own counts show they served.
#[test]
fn the_mount_answers_through_io_uring_when_the_kernel_offers_it() {
    use odfs_bench::uring_minimum::TransportAllowed;
    assert!(Path::new("/dev/fuse").exists(), "/dev/fuse is missing: this test mounts a FUSE filesystem");
    let _allowed = TransportAllowed::new().expect("this test needs the kernel's FUSE io_uring transport (6.14+, root)");
    let fs = LocalFs::up(2, &[]);
    let mut cfg = fs.config();
    cfg.fuse_io_uring = true;
    fs::write(fs.config_path(), toml::to_string(&cfg).unwrap()).unwrap();
    let mut m = FuseMount::start(&fs);
    let d = m.p("d");
    fs::create_dir(&d).unwrap();
    let big = pattern(3 * (1 << 20) + 17, 9);
    fs::write(d.join("big"), &big).unwrap();
    assert_bytes(&fs::read(d.join("big")).unwrap(), &big, "a 3 MiB file read back");
    let mut f = OpenOptions::new().create(true).append(true).open(d.join("log")).unwrap();
    f.write_all(b"one\n").unwrap();
    f.write_all(b"two\n").unwrap();
    drop(f);
    assert_eq!(fs::read(d.join("log")).unwrap(), b"one\ntwo\n");
    fs::rename(d.join("log"), d.join("log2")).unwrap();
    std::os::unix::fs::symlink("log2", d.join("sym")).unwrap();
    assert_eq!(fs::read_link(d.join("sym")).unwrap(), Path::new("log2"));
    fs::hard_link(d.join("log2"), d.join("hard")).unwrap();
    assert_eq!(fs::metadata(d.join("hard")).unwrap().nlink(), 2);
    let x = CString::new(d.join("log2").to_str().unwrap()).unwrap();
    // SAFETY: NUL-terminated path and name; value buffer of the given length.
    let set = unsafe { libc::setxattr(x.as_ptr(), c"user.k".as_ptr(), b"val".as_ptr().cast(), 3, 0) };
    assert_eq!(set, 0, "setxattr: {}", std::io::Error::last_os_error());
    let mut v = [0u8; 16];
    // SAFETY: as above, into a buffer of 16 bytes.
    let n = unsafe { libc::getxattr(x.as_ptr(), c"user.k".as_ptr(), v.as_mut_ptr().cast(), v.len()) };
    assert_eq!(&v[..n.max(0) as usize], b"val");
    fs::set_permissions(d.join("big"), fs::Permissions::from_mode(0o600)).unwrap();
    assert_eq!(fs::metadata(d.join("big")).unwrap().mode() & 0o777, 0o600);
    OpenOptions::new().write(true).open(d.join("big")).unwrap().set_len(1000).unwrap();
    assert_eq!(fs::metadata(d.join("big")).unwrap().len(), 1000);
    let mut names: Vec<String> =
        fs::read_dir(&d).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    assert_eq!(names, ["big", "hard", "log2", "sym"]);
    assert_eq!(fs::read(d.join("nope")).unwrap_err().raw_os_error(), Some(libc::ENOENT));
    let again = OpenOptions::new().write(true).create_new(true).open(d.join("big"));
    assert_eq!(again.unwrap_err().raw_os_error(), Some(libc::EEXIST));
    assert_eq!(fs::remove_dir(&d).unwrap_err().raw_os_error(), Some(libc::ENOTEMPTY));

    // Another mount of the filesystem sees it all.
    let m2 = FuseMount::start_at(&fs, "mnt2", &[]);
    assert_bytes(&fs::read(m2.p("d/big")).unwrap(), &big[..1000], "the truncated file from the second mount");
    assert_eq!(fs::read(m2.p("d/hard")).unwrap(), b"one\ntwo\n");
    drop(m2);

    for n in ["big", "hard", "log2", "sym"] {
        fs::remove_file(d.join(n)).unwrap();
    }
    fs::remove_dir(&d).unwrap();
    let st = Command::new("fusermount3").arg("-u").arg(&m.path).status().expect("run fusermount3");
    assert!(st.success(), "fusermount3 -u failed");
    assert!(m.wait_exit(Duration::from_secs(20)).is_some(), "odfs-fuse exits after the unmount");
    let log = m.log_text();
    assert!(log.contains("FUSE requests come by io_uring"), "{log}");
    let served: u64 = log
        .lines()
        .filter(|l| l.contains("io_uring queue ended"))
        .filter_map(|l| l.split("requests=").nth(1)?.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    assert!(served >= 40, "the rings answered {served} requests:\n{log}");
}

/// The mount's own count of FUSE requests of kind `kind` (`odfs stats --json` through it).
fn mount_count(m: &FuseMount, kind: &str) -> u64 {
    let out = Command::new(bin_dir().join("odfs"))
        .args(["stats", "--json"])
        .env_remove("ODFS_FS")
        .env("ODFS_MOUNT", &m.path)
        .current_dir("/")
        .output()
        .expect("run odfs stats");
    let st: odfs_proto::stats::FsStats =
        serde_json::from_str(&stdout_ok(&out, "odfs stats through the mount")).expect("stats JSON");
    let me = st.services.iter().find(|s| s.kind == Some(odfs_proto::mgmt::ServiceKind::Client)).expect("the mount");
    me.stats.as_ref().expect("its counts").methods.iter().filter(|o| o.name == kind).map(|o| o.count).sum()
}

/// Makes sure odfs-fuse can have the 2 MiB pipes spliced reads need: root with
/// `CAP_SYS_RESOURCE` has them; a root without it (some containers) needs `fs.pipe-max-size`.
fn allow_splice_pipes() {
    let path = "/proc/sys/fs/pipe-max-size";
    let now: usize = fs::read_to_string(path).expect(path).trim().parse().expect("a number");
    if now < 2 << 20 {
        fs::write(path, (2usize << 20).to_string())
            .unwrap_or_else(|e| panic!("spliced reads need pipes of 2 MiB: raising {path} failed: {e}"));
    }
}

/// `len` bytes at `offset` of `path`, read with `O_DIRECT` (each read one FUSE READ of its own).
fn read_direct(path: &Path, offset: u64, len: usize) -> Vec<u8> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path).expect("open O_DIRECT");
    let layout = std::alloc::Layout::from_size_align(len.max(4096), 4096).unwrap();
    // SAFETY: a fresh allocation of `layout`, freed below; read into as plain bytes.
    let buf = unsafe { std::slice::from_raw_parts_mut(std::alloc::alloc_zeroed(layout), len) };
    let mut got = 0;
    while got < len {
        match f.read_at(&mut buf[got..], offset + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) => panic!("O_DIRECT read of {len} at {offset}: {e}"),
        }
    }
    let out = buf[..got].to_vec();
    // SAFETY: allocated above with this layout.
    unsafe { std::alloc::dealloc(buf.as_mut_ptr(), layout) };
    out
}

#[test]
fn large_reads_are_spliced_into_the_kernel_and_read_what_copied_reads_read() {
    allow_splice_pipes();
    // Four nodes, default stripe: a file's chunks are on this node's target (read from the
    // chunk file) and on three others (asked of their stored).
    let fs = LocalFs::up(4, &[]);
    // Splicing needs /dev/fuse: this mount keeps to it even while another test has the io_uring
    // transport switched on.
    let mut cfg = fs.config();
    cfg.fuse_io_uring = false;
    fs::write(fs.config_path(), toml::to_string(&cfg).unwrap()).unwrap();
    let data = pattern(5 << 20, 11);
    let end = (9 << 20) + 4321;
    let tail = pattern(4321, 12);
    let mut want = data.clone();
    want.resize(9 << 20, 0); // a hole of 4 MiB
    want.extend_from_slice(&tail);
    {
        let m = FuseMount::start(&fs);
        let mut f = File::create(m.p("ckpt")).unwrap();
        f.write_all(&data).unwrap();
        f.write_all_at(&tail, 9 << 20).unwrap();
        f.sync_all().unwrap();
    }
    // Mounted afresh (nothing of the file in the kernel's page cache): reads reach odfs-fuse.
    let m = FuseMount::start(&fs);
    assert!(m.log_text().contains("are spliced into /dev/fuse"), "{}", m.log_text());
    assert_eq!(fs::metadata(m.p("ckpt")).unwrap().len(), end as u64);
    assert_bytes(&fs::read(m.p("ckpt")).unwrap(), &want, "a sequential read of the whole file");
    let spliced = mount_count(&m, "read (spliced)");
    assert!(spliced >= 8, "the sequential read's 1 MiB READs were spliced: {spliced}");
    // READs of any offset and length, across chunks and targets, into the hole, over the end.
    for (offset, len) in [(0u64, 1 << 20), (12_345, 300_001), ((5 << 20) - 4096, 1 << 20), ((9 << 20) - 100, 1 << 20)] {
        let got = read_direct(&m.p("ckpt"), offset, len);
        let to = (offset as usize + len).min(end);
        assert_bytes(&got, &want[offset as usize..to], &format!("{len} bytes at {offset}"));
    }
    assert!(read_direct(&m.p("ckpt"), end as u64, 1 << 20).is_empty(), "a read at the end reads nothing");
    // (The read over the end is cut by the kernel to what the file holds: one page, copied.)
    assert!(mount_count(&m, "read (spliced)") >= spliced + 3, "the large direct reads were spliced too");
    // Writes are seen by the next spliced read (the mount drains its own first).
    let fresh = pattern(1 << 20, 13);
    OpenOptions::new().write(true).open(m.p("ckpt")).unwrap().write_all_at(&fresh, 2 << 20).unwrap();
    want[2 << 20..3 << 20].copy_from_slice(&fresh);
    assert_bytes(&read_direct(&m.p("ckpt"), 2 << 20, 1 << 20), &fresh, "a spliced read after a write");
    drop(m);

    // The same through a mount that copies (`splice_reads = false`): the same bytes.
    let cfg = fs.root().join("copy.toml");
    let text = fs::read_to_string(fs.config_path()).unwrap();
    assert!(text.contains("splice_reads = true"), "{text}");
    fs::write(&cfg, text.replace("splice_reads = true", "splice_reads = false")).unwrap();
    let copy_root = tempfile::tempdir().unwrap();
    let mnt = copy_root.path().join("mnt");
    fs::create_dir(&mnt).unwrap();
    let mut child = Command::new(odfs_fuse_bin())
        .args(["--fs".as_ref(), cfg.as_os_str(), "--mountpoint".as_ref(), mnt.as_os_str()])
        .stdout(File::create(copy_root.path().join("log")).unwrap())
        .stderr(File::create(copy_root.path().join("err")).unwrap())
        .spawn()
        .unwrap();
    let log = || fs::read_to_string(copy_root.path().join("err")).unwrap_or_default();
    let t = Instant::now();
    while mount_line(&mnt).is_none_or(|l| l.fstype != "fuse.odfs") {
        assert!(t.elapsed() < Duration::from_secs(10), "the copying mount did not come up: {}", log());
        std::thread::sleep(Duration::from_millis(20));
    }
    let copied = fs::read(mnt.join("ckpt"));
    let direct = read_direct(&mnt.join("ckpt"), 12_345, 300_001);
    assert!(log().contains("reads are not spliced: splice_reads is off"), "{}", log());
    let _ = Command::new("fusermount3").arg("-u").arg(&mnt).status();
    let _ = child.wait();
    assert_bytes(&copied.unwrap(), &want, "the whole file through the copying mount");
    assert_bytes(&direct, &want[12_345..312_346], "an O_DIRECT read through the copying mount");
}
