//! lfs-style layout control on a real 4-node filesystem and its FUSE mount: `odfs setstripe`,
//! `getstripe`, `df`, `pool`, and the `odfs.*` virtual extended attributes read and set with
//! getfattr/setfattr. Bytes are checked where they land: in the chunk files on the targets'
//! disks. Every node has an NVMe target (pool `nvme`) and a RAM target (pool `ram`, a tmpfs).
//!
//! Needs root (tmpfs, FUSE) and the attr package (getfattr, setfattr).

use odfs_client::{Client, Ctx};
use odfs_proto::{InodeId, Layout};
use odfs_tests::*;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const KIB: u64 = 1024;

fn up() -> (LocalFs, FuseMount) {
    let fs = LocalFs::up(4, &["--pool", "nvme", "--ram-pool", "64M"]);
    let m = FuseMount::start(&fs);
    (fs, m)
}

fn s(p: &Path) -> String {
    p.display().to_string()
}

/// `key=value` of a layout text.
fn key(text: &str, k: &str) -> String {
    text.split_whitespace().find_map(|i| i.strip_prefix(&format!("{k}="))).unwrap_or("").to_string()
}

/// Every target: id → (directory, pool), from `odfs.targets` and the local layout of ROOT.
fn target_dirs(fs: &LocalFs, m: &FuseMount) -> Vec<(u32, PathBuf, String)> {
    let text = getfattr(&m.path, "odfs.targets");
    let mut v = Vec::new();
    for l in text.lines().filter(|l| l.starts_with("target=")) {
        let id: u32 = key(l, "target").parse().unwrap();
        let node: u32 = key(l, "node").parse().unwrap();
        let pool = key(l, "pool");
        // odfs local: node k's targets are ROOT/node<k>/target<id>, its RAM target ROOT/node<k>/ram.
        let nd = fs.node_dir(node);
        let dir = if nd.join(format!("target{id}")).is_dir() { nd.join(format!("target{id}")) } else { nd.join("ram") };
        v.push((id, dir, pool));
    }
    v
}

/// The chunk file of inode `ino` in a target directory, if any.
fn chunk_file(dir: &Path, ino: u64) -> Option<PathBuf> {
    let p = dir.join("chunks").join(format!("{:02x}", ino & 0xff)).join(format!("{ino:016x}"));
    p.exists().then_some(p)
}

#[test]
fn a_striped_directory_puts_each_files_bytes_on_exactly_its_targets() {
    let (fs, m) = up();
    let dir = m.p("ckpt");
    fs::create_dir(&dir).unwrap();
    fs.cli_ok(&["setstripe", "-c", "2", "-S", "256K", "-p", "nvme", &s(&dir)]);
    let data = pattern((5 << 20) + 12_345, 11);
    let f = dir.join("model.bin");
    fs::write(&f, &data).unwrap();

    // getstripe names the targets; the layout attribute says the same.
    let out = fs.cli_ok(&["getstripe", &s(&f)]);
    assert!(out.contains("lmm_stripe_count:  2") && out.contains("lmm_stripe_size:   262144"), "{out}");
    assert!(out.contains("lmm_pool:          nvme"), "{out}");
    let text = getfattr(&f, "odfs.layout");
    let named: Vec<u32> = key(&text, "targets").split(',').map(|t| t.parse().unwrap()).collect();
    assert_eq!(named.len(), 2, "{text}");
    for t in &named {
        assert!(
            out.lines().any(|l| l.split_whitespace().next() == Some(&t.to_string())),
            "getstripe lists target {t}:\n{out}"
        );
    }

    // On the disks: chunk files only on those two targets, both in pool nvme, and the file
    // reassembled from them in 256 KiB chunks is the file.
    let ino = fs::metadata(&f).map(|m| std::os::unix::fs::MetadataExt::ino(&m)).unwrap();
    let layout = Layout { chunk_size: 256 * KIB as u32, pool: "nvme".into(), targets: named.clone() };
    let mut rebuilt = vec![0u8; data.len()];
    for (id, tdir, pool) in target_dirs(&fs, &m) {
        match chunk_file(&tdir, ino) {
            Some(p) => {
                assert!(named.contains(&id), "target {id} holds a chunk file of the file but is not in its layout");
                assert_eq!(pool, "nvme", "target {id}");
                let bytes = fs::read(&p).unwrap();
                let i = named.iter().position(|t| *t == id).unwrap();
                assert_eq!(
                    bytes.len() as u64,
                    layout.local_len(i, data.len() as u64),
                    "target {id}: chunk file length"
                );
                for seg in layout.segments(0, data.len() as u64).filter(|g| g.stripe_index == i) {
                    let (lo, fo, n) = (seg.local_offset as usize, seg.file_offset as usize, seg.len as usize);
                    rebuilt[fo..fo + n].copy_from_slice(&bytes[lo..lo + n]);
                }
            }
            None => assert!(!named.contains(&id), "target {id} is named but holds nothing"),
        }
    }
    assert_bytes(&rebuilt, &data, "the file rebuilt from its chunk files in 256 KiB chunks");
}

#[test]
fn layouts_are_inherited_survive_rename_and_minus_one_takes_every_target() {
    let (fs, m) = up();
    let top = m.p("top");
    fs::create_dir(&top).unwrap();
    fs.cli_ok(&["setstripe", "-c", "2", "-S", "128K", "-p", "ram", &s(&top)]);
    // A subdirectory made afterwards inherits the default, and so do its files.
    fs::create_dir_all(top.join("a/b")).unwrap();
    assert_eq!(fs.cli_ok(&["getstripe", "-d", "-S", &s(&top.join("a/b"))]).trim(), "131072");
    assert_eq!(fs.cli_ok(&["getstripe", "-d", "-p", &s(&top.join("a/b"))]).trim(), "ram");
    fs::write(top.join("a/b/f"), pattern(1 << 20, 1)).unwrap();
    let before = getfattr(&top.join("a/b/f"), "odfs.layout");
    assert_eq!((key(&before, "stripe_count"), key(&before, "pool")), ("2".into(), "ram".into()));
    // Renames keep both the directory defaults and the files' layouts.
    fs::rename(top.join("a"), m.p("moved")).unwrap();
    assert_eq!(getfattr(&m.p("moved/b/f"), "odfs.layout"), before);
    assert_eq!(fs.cli_ok(&["getstripe", "-d", "-c", &s(&m.p("moved/b"))]).trim(), "2");
    fs::write(m.p("moved/b/g"), b"x").unwrap();
    assert_eq!(key(&getfattr(&m.p("moved/b/g"), "odfs.layout"), "pool"), "ram");
    // -c -1: every target of the pool.
    let all = m.p("all");
    fs::create_dir(&all).unwrap();
    fs.cli_ok(&["setstripe", "-c", "-1", "-p", "nvme", &s(&all)]);
    fs::write(all.join("f"), pattern(8 << 20, 2)).unwrap();
    let t = getfattr(&all.join("f"), "odfs.layout");
    let mut ids: Vec<u32> = key(&t, "targets").split(',').map(|x| x.parse().unwrap()).collect();
    ids.sort();
    let nvme: Vec<u32> = target_dirs(&fs, &m).into_iter().filter(|(_, _, p)| p == "nvme").map(|(i, _, _)| i).collect();
    assert_eq!(ids, nvme, "-c -1 uses every target of pool nvme");
    // setstripe on a new file, and setfattr on an empty one.
    fs.cli_ok(&["setstripe", "-c", "3", "-S", "64K", &s(&m.p("new"))]);
    assert_eq!(key(&getfattr(&m.p("new"), "odfs.layout"), "stripe_count"), "3");
    let st = Command::new("setfattr")
        .args(["-n", "odfs.layout", "-v", "stripe_count=1 pool=ram"])
        .arg(m.p("new"))
        .status()
        .unwrap();
    assert!(st.success());
    let t = getfattr(&m.p("new"), "odfs.layout");
    assert_eq!(
        (key(&t, "stripe_count"), key(&t, "pool"), key(&t, "stripe_size")),
        ("1".into(), "ram".into(), "65536".into())
    );
    // The library path sees the same.
    assert!(fs.cli_ok(&["getstripe", "odfs:/new"]).contains("lmm_pool:          ram"));
}

#[test]
fn invalid_layouts_are_refused_with_their_reason_and_change_nothing() {
    let (fs, m) = up();
    let d = m.p("d");
    fs::create_dir(&d).unwrap();
    fs.cli_ok(&["setstripe", "-c", "2", "-S", "256K", "-p", "nvme", &s(&d)]);
    fs::write(d.join("full"), b"data").unwrap();
    let before_dir = getfattr(&d, "odfs.layout");
    let before_file = getfattr(&d.join("full"), "odfs.layout");
    for (args, want) in [
        (vec!["-S", "1000"], "power of two"),
        (vec!["-S", "96K"], "power of two"),
        (vec!["-S", "32K"], "between 64 KiB"),
        (vec!["-c", "5", "-p", "nvme"], "more than the 4 targets of pool nvme"),
        (vec!["-c", "0"], "stripe count 0"),
        (vec!["-p", "gold"], "pool gold does not exist"),
        (vec!["-i", "99"], "start target 99 is not in pool nvme"),
    ] {
        for path in [s(&d), "odfs:/d".to_string()] {
            let mut a = vec!["setstripe"];
            a.extend(args.iter().copied());
            a.push(&path);
            let e = fs.cli_err(&a);
            assert!(e.contains(want), "setstripe {args:?} {path}: {e}");
        }
    }
    let e = fs.cli_err(&["setstripe", "-c", "1", &s(&d.join("full"))]);
    assert!(e.contains("has 4 bytes") && e.contains("only be set while a file is empty"), "{e}");
    let e = fs.cli_err(&["setstripe", "-c", "1", "odfs:/d/full"]);
    assert!(e.contains("has 4 bytes"), "{e}");
    // Through setfattr the refusal is EINVAL; nothing changed anywhere.
    let o = Command::new("setfattr").args(["-n", "odfs.layout", "-v", "stripe_count=99"]).arg(&d).output().unwrap();
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("Invalid argument"));
    // The errno is all setfattr can show; the mount's log gives the reason, as the CLI does.
    for (value, want) in [
        ("stripe_count=2 bogus=1", "unknown layout key \"bogus\""),
        ("chunk_size=12345", "chunk size 12345 is invalid: it must be a power of two"),
        ("stripe_count=99", "stripe count 99 is more than the 4 targets of pool"),
    ] {
        let o = Command::new("setfattr").args(["-n", "odfs.layout", "-v", value]).arg(&d).output().unwrap();
        assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("Invalid argument"), "{value}");
        let log = m.log_text();
        assert!(
            log.lines().any(|l| l.contains(&format!("setting odfs.layout refused: {want}"))),
            "{value}: the reason ({want}) is not in the mount's log:\n{log}"
        );
    }
    let o = Command::new("setfattr").args(["-n", "odfs.targets", "-v", "x"]).arg(&d).output().unwrap();
    assert!(!o.status.success(), "odfs.targets is read-only");
    assert_eq!(getfattr(&d, "odfs.layout"), before_dir);
    assert_eq!(getfattr(&d.join("full"), "odfs.layout"), before_file);
    // A refused layout for a new file leaves no file behind.
    let e = fs.cli_err(&["setstripe", "-c", "9", &s(&d.join("nope"))]);
    assert!(e.contains("more than"), "{e}");
    assert!(!d.join("nope").exists());
    // Only the owner (or root) sets a directory's layout.
    let u = TestUser::create("ly");
    fs::set_permissions(&m.path, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let o = Command::new("setfattr").args(["-n", "odfs.layout", "-v", "stripe_count=1"]).arg(&d).output().unwrap();
    assert!(o.status.success(), "root may");
    let out = u.run(
        "setfattr",
        &[Path::new("-n"), Path::new("odfs.layout"), Path::new("-v"), Path::new("stripe_count=2"), &d],
    );
    assert!(!out.status.success(), "another user must not change root's directory");
}

/// `df -B1 PATH` → (size, used, avail) in bytes; `df -i` → (inodes, used, free).
fn sys_df(p: &Path, inodes: bool) -> (u64, u64, u64) {
    let flag = if inodes { "-i" } else { "-B1" };
    let o = Command::new("df").arg(flag).arg(p).output().unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    let f: Vec<u64> =
        text.lines().nth(1).unwrap().split_whitespace().skip(1).take(3).map(|x| x.parse().unwrap()).collect();
    (f[0], f[1], f[2])
}

#[test]
fn df_totals_are_the_sum_of_the_targets_and_match_df_on_the_mount() {
    let (fs, m) = up();
    fs::write(m.p("f"), pattern(3 << 20, 3)).unwrap();
    let out = fs.cli_ok(&["df", &s(&m.path)]);
    let rows: Vec<Vec<&str>> = out.lines().map(|l| l.split_whitespace().collect()).collect();
    let target_rows: Vec<&Vec<&str>> =
        rows.iter().filter(|r| r.first().is_some_and(|c| c.starts_with("odfs-T"))).collect();
    assert_eq!(target_rows.len(), 8, "4 nodes x (nvme + ram):\n{out}");
    // The four nvme targets are directories of one disk: its space counts once.
    let once: Vec<&&Vec<&str>> = target_rows.iter().filter(|r| r.join(" ").ends_with("counted once)")).collect();
    assert!(once.len() >= 3 && once.iter().filter(|r| r[6] == "nvme").count() == 3, "{out}");
    assert!(out.contains("share a device with another target"), "{out}");
    let counted: Vec<&&Vec<&str>> = target_rows.iter().filter(|r| !r.join(" ").ends_with("counted once)")).collect();
    let col = |r: &[&str], i: usize| -> u64 { r[i].parse().unwrap() };
    let sum = |i: usize| -> u64 { counted.iter().map(|r| col(r, i)).sum() };
    let summary = rows.iter().find(|r| r.first() == Some(&"filesystem_summary:")).expect("summary");
    assert_eq!(col(summary, 1), sum(1), "total = sum over the targets of distinct devices:\n{out}");
    assert_eq!(col(summary, 3), sum(3), "available = sum over the targets of distinct devices:\n{out}");
    for p in ["nvme", "ram"] {
        let pr = rows.iter().find(|r| r.len() > 1 && r[0] == "pool" && r[1] == p).expect("pool row");
        let want: u64 = counted.iter().filter(|r| r[6] == p).map(|r| col(r, 1)).sum();
        assert_eq!(pr[2].parse::<u64>().unwrap(), want, "pool {p} total");
    }
    // The same totals as df on the mount (1K blocks); free space moves with the machine's own
    // writes between the two reads, so it agrees within 1%.
    let (size, _, avail) = sys_df(&m.path, false);
    assert_eq!(col(summary, 1), size / 1024, "odfs df total vs df:\n{out}");
    let ours = col(summary, 3);
    assert!(ours.abs_diff(avail / 1024) * 100 <= ours.max(1), "available: odfs df {ours} KiB, df {} KiB", avail / 1024);
    // Inodes: the summary is the metadata's, as df -i shows.
    let out = fs.cli_ok(&["df", "-i", "odfs:/"]);
    let summary: Vec<&str> =
        out.lines().find(|l| l.starts_with("filesystem_summary:")).unwrap().split_whitespace().collect();
    let (inodes, used, _) = sys_df(&m.path, true);
    assert_eq!((summary[1].parse::<u64>().unwrap(), summary[2].parse::<u64>().unwrap()), (inodes, used), "{out}");
    // One pool only, and an unknown pool named.
    let out = fs.cli_ok(&["df", "--pool", "ram", &s(&m.path)]);
    assert_eq!(out.lines().filter(|l| l.starts_with("odfs-T")).count(), 4, "{out}");
    assert!(fs.cli_err(&["df", "--pool", "gold", &s(&m.path)]).contains("no pool gold"));
}

/// statvfs(2) of `p`: (size, used, available) in bytes as `df` counts them (used = blocks less
/// free blocks, available = the blocks free to unprivileged users).
fn statvfs_df(p: &Path) -> (u64, u64, u64) {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a NUL-terminated path and a zeroed struct for the kernel to fill.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut st) }, 0, "statvfs {}", p.display());
    let f = st.f_frsize;
    (st.f_blocks * f, (st.f_blocks - st.f_bfree) * f, st.f_bavail * f)
}

#[test]
fn df_counts_used_and_available_as_df_does_on_the_targets_disk() {
    // Two nodes whose targets are directories of the test's own disk: odfs df's summary is
    // that disk, counted as df counts it, however many blocks it reserves for root.
    let fs = LocalFs::up(2, &[]);
    let out = fs.cli_ok(&["df", "odfs:/"]);
    let disk = statvfs_df(fs.root());
    let summary: Vec<&str> =
        out.lines().find(|l| l.starts_with("filesystem_summary:")).expect("summary").split_whitespace().collect();
    let kib = |i: usize| -> u64 { summary[i].parse::<u64>().unwrap() * 1024 };
    let (size, used, avail) = (kib(1), kib(2), kib(3));
    assert_eq!(size, disk.0 / 1024 * 1024, "size: odfs df {out}\nstatvfs {disk:?}");
    // The machine writes between the two looks: within 1 % of the disk (and 64 MiB).
    let near = |a: u64, b: u64| a.abs_diff(b) <= (disk.0 / 100).max(64 << 20);
    assert!(near(used, disk.1), "used: odfs df {used}, statvfs {} (blocks - bfree)\n{out}", disk.1);
    assert!(near(avail, disk.2), "available: odfs df {avail}, statvfs {} (bavail)\n{out}", disk.2);
    // Use% is used of used plus available, rounded up, from the row's own numbers.
    let want = (used / 1024 * 100).div_ceil(used / 1024 + avail / 1024);
    assert_eq!(summary[4], format!("{want}%"), "{out}");
    // The blocks reserved for root are neither used nor available (when the disk has any, the
    // old count, size less available, is far off).
    let reserved = disk.0 - disk.1 - disk.2;
    if reserved > disk.0 / 50 {
        assert!(used + reserved / 2 < size - avail, "reserved blocks counted as used:\n{out}");
    }
}

#[test]
fn pools_are_listed_created_filled_emptied_and_destroyed() {
    let (fs, m) = up();
    let list = fs.cli_ok(&["pool", "list", &s(&m.path)]);
    assert!(list.contains("nvme: 1 3 5 7") && list.contains("ram: 2 4 6 8"), "{list}");
    fs.cli_ok(&["pool", "create", "fast"]);
    assert!(fs.cli_ok(&["pool", "list", "odfs:/"]).contains("fast: (no targets)"));
    assert!(fs.cli_err(&["pool", "create", "fast"]).contains("exists already"));
    assert!(fs.cli_err(&["pool", "add", "fast", "42"]).contains("no target 42"));
    assert!(fs.cli_err(&["pool", "add", "nope", "1"]).contains("no pool nope"));
    fs.cli_ok(&["pool", "add", "fast", "1", "3"]);
    let list = fs.cli_ok(&["pool", "list", &s(&m.path)]);
    assert!(list.contains("fast: 1 3") && list.contains("nvme: 5 7"), "{list}");
    // New files can land in the new pool at once.
    let d = m.p("d");
    fs::create_dir(&d).unwrap();
    fs.cli_ok(&["setstripe", "-c", "-1", "-p", "fast", &s(&d)]);
    fs::write(d.join("f"), pattern(3 << 20, 4)).unwrap();
    let mut ids: Vec<String> =
        key(&getfattr(&d.join("f"), "odfs.layout"), "targets").split(',').map(String::from).collect();
    ids.sort();
    assert_eq!(ids, ["1", "3"]);
    assert!(fs.cli_err(&["pool", "destroy", "fast"]).contains("still has targets"));
    assert!(fs.cli_err(&["pool", "remove", "nvme", "5"]).contains("by its configuration"));
    fs.cli_ok(&["pool", "remove", "fast", "1", "3"]);
    fs.cli_ok(&["pool", "destroy", "fast"]);
    let list = fs.cli_ok(&["pool", "list", &s(&m.path)]);
    assert!(!list.contains("fast") && list.contains("nvme: 1 3 5 7"), "{list}");
}

/// Sorted output lines of a successful command, with `from` at the start of a line replaced by `to`.
fn listed(o: &std::process::Output, what: &str, from: &str, to: &str) -> Vec<String> {
    let mut v: Vec<String> = stdout_ok(o, what)
        .lines()
        .map(|l| l.strip_prefix(from).map_or_else(|| l.to_string(), |r| format!("{to}{r}")))
        .collect();
    v.sort();
    v
}

#[test]
fn find_tests_agree_with_gnu_find_and_with_the_files_layouts() {
    let (fs, m) = up();
    let t = m.p("t");
    fs::create_dir_all(t.join("a/b")).unwrap();
    for (d, args) in [("r", ["-c", "2", "-p", "ram"]), ("w", ["-c", "4", "-p", "nvme"])] {
        fs::create_dir(t.join(d)).unwrap();
        let mut a = vec!["setstripe"];
        a.extend(args);
        let p = s(&t.join(d));
        a.push(&p);
        fs.cli_ok(&a);
    }
    let dirs = [t.clone(), t.join("a"), t.join("a/b"), t.join("r"), t.join("w")];
    // Sizes on both sides of find's rounding to 512-byte blocks, KiB and MiB.
    let sizes = [0usize, 1, 100, 512, 513, 1024, 1025, 5000, 1 << 20, (1 << 20) + 1, 3 << 20, 700];
    for (i, &n) in sizes.iter().enumerate() {
        let ext = if i % 2 == 0 { "bin" } else { "txt" };
        fs::write(dirs[i % dirs.len()].join(format!("f{i}.{ext}")), pattern(n, i as u64)).unwrap();
    }
    std::os::unix::fs::symlink("f0.bin", t.join("link")).unwrap();
    // -newer: a reference file, three files older than it, the rest newer.
    let reference = t.join("a/ref");
    fs::write(&reference, b"r").unwrap();
    let touch = |p: &Path, at: &str| {
        let st = Command::new("touch").args(["-m", "-d", at]).arg(p).status().unwrap();
        assert!(st.success(), "touch {}", p.display());
    };
    touch(&reference, "@1700000000");
    for f in ["f0.bin", "a/f1.txt", "w/f4.bin"] {
        touch(&t.join(f), "@1600000000");
    }
    let ts = s(&t);
    let rs = s(&reference);
    let cases: Vec<Vec<&str>> = vec![
        vec![],
        vec!["-name", "*.bin"],
        vec!["-name", "f1*"],
        vec!["-type", "f"],
        vec!["-type", "d"],
        vec!["-type", "l"],
        vec!["-size", "+1k"],
        vec!["-size", "-1k"],
        vec!["-size", "100c"],
        vec!["-size", "2"],
        vec!["-size", "+1M"],
        vec!["-size", "1M"],
        vec!["-newer", &rs],
        vec!["-type", "f", "-name", "f1*", "-size", "-2M", "-newer", &rs],
    ];
    let mnt = s(&m.path);
    // A user with only the mount (no client config): odfs find walks the mount.
    let mount_walk = |args: &[&str]| {
        let o = Command::new(bin_dir().join("odfs"))
            .env_remove("ODFS_FS")
            .current_dir(fs.root())
            .args(args)
            .output()
            .unwrap();
        listed(&o, "odfs find (mount walk)", "", "")
    };
    for c in &cases {
        let gnu = Command::new("find").arg(&ts).args(c).output().unwrap();
        let want = listed(&gnu, "find", "", "");
        assert!(!want.is_empty(), "find {c:?} matches something");
        // Through the library, named by the mount path or as odfs:/t.
        let lib = listed(&fs.cli(&[&["find", &ts][..], c].concat()), "odfs find (library)", "", "");
        assert_eq!(lib, want, "odfs find {c:?} through the library");
        let url = listed(&fs.cli(&[&["find", "odfs:/t"][..], c].concat()), "odfs find odfs:/t", "odfs:", &mnt);
        assert_eq!(url, want, "odfs find odfs:/t {c:?}");
        assert_eq!(mount_walk(&[&["find", &ts][..], c].concat()), want, "odfs find {c:?} through the mount");
    }
    // The layout tests take regular files whose layout says so (odfs.layout on the mount).
    let files = listed(&Command::new("find").args([&ts, "-type", "f"]).output().unwrap(), "find", "", "");
    for (flag, value, k) in
        [("--pool", "ram", "pool"), ("--stripe-count", "4", "stripe_count"), ("--pool", "nvme", "pool")]
    {
        let want: Vec<String> =
            files.iter().filter(|f| key(&getfattr(Path::new(f), "odfs.layout"), k) == value).cloned().collect();
        assert!(!want.is_empty() && want.len() < files.len(), "{flag} {value}: {want:?} of {files:?}");
        assert_eq!(listed(&fs.cli(&["find", &ts, flag, value]), "odfs find", "", ""), want, "{flag} {value}");
        assert_eq!(mount_walk(&["find", &ts, flag, value]), want, "{flag} {value} through the mount");
    }
    assert!(fs.cli_ok(&["find", &ts, "--pool", "gold"]).is_empty(), "no file is in an unknown pool");
    // Bad tests are named; nothing is printed.
    for (args, want) in [
        (vec!["-size", "+x"], "-size \"+x\""),
        (vec!["-type", "q"], "-type q"),
        (vec!["-name"], "-name needs a value"),
        (vec!["-depth", "1"], "unknown test \"-depth\""),
        (vec!["--stripe-count", "two"], "--stripe-count \"two\" is not a number"),
        (vec!["-newer", "/nonexistent/ref"], "-newer /nonexistent/ref"),
    ] {
        let e = fs.cli_err(&[&["find", &ts][..], &args].concat());
        assert!(e.contains(want), "odfs find {args:?}: {e}");
    }
    let e = fs.cli_err(&["find", "odfs:/missing"]);
    assert!(e.contains("odfs:/missing"), "{e}");
}

/// Node of every target, from `odfs.targets`.
fn target_nodes(m: &FuseMount) -> Vec<(u32, u32)> {
    getfattr(&m.path, "odfs.targets")
        .lines()
        .filter(|l| l.starts_with("target="))
        .map(|l| (key(l, "target").parse().unwrap(), key(l, "node").parse().unwrap()))
        .collect()
}

#[test]
fn local_placement_puts_each_new_file_on_its_writers_node() {
    let (fs, m) = up();
    let dir = m.p("ckpt");
    fs::create_dir(&dir).unwrap();
    fs.cli_ok(&["setstripe", "--local", "-c", "1", "-p", "nvme", &s(&dir)]);
    assert!(getfattr(&dir, "odfs.layout").ends_with("placement=local"), "{}", getfattr(&dir, "odfs.layout"));
    assert!(fs.cli_ok(&["getstripe", "-d", &s(&dir)]).contains("placement:     local"));
    let nodes = target_nodes(&m);
    let dirs = target_dirs(&fs, &m);
    let nvme_of = |node: u32| -> u32 {
        let own: Vec<u32> = dirs
            .iter()
            .filter(|(id, _, pool)| pool == "nvme" && nodes.contains(&(*id, node)))
            .map(|(id, _, _)| *id)
            .collect();
        assert_eq!(own.len(), 1, "node {node} has one nvme target: {dirs:?}");
        own[0]
    };
    // Where a file's bytes are: its one target, and that target's chunk file holds them.
    let placed = |name: &str, data: &[u8]| -> u32 {
        let f = dir.join(name);
        let targets: Vec<u32> =
            key(&getfattr(&f, "odfs.layout"), "targets").split(',').map(|t| t.parse().unwrap()).collect();
        assert_eq!(targets.len(), 1, "{name}: {targets:?}");
        let (_, tdir, _) = dirs.iter().find(|(id, _, _)| *id == targets[0]).unwrap();
        let ino = fs::metadata(&f).map(|md| std::os::unix::fs::MetadataExt::ino(&md)).unwrap();
        let chunk = chunk_file(tdir, ino).unwrap_or_else(|| panic!("{name}: no chunk file on target {}", targets[0]));
        assert_eq!(fs::read(chunk).unwrap(), data, "{name}: chunk file bytes");
        assert_eq!(fs::read(&f).unwrap(), data, "{name}: read back");
        targets[0]
    };
    // Through the mount (node 0): every file on node 0's disk, however many are made.
    for i in 0..6 {
        let data = pattern(300 * KIB as usize + i, i as u64);
        fs::write(dir.join(format!("m{i}")), &data).unwrap();
        assert_eq!(placed(&format!("m{i}"), &data), nvme_of(0), "m{i}");
    }
    // Clients of the other nodes: each file on its writer's node.
    let rt = tokio::runtime::Runtime::new().unwrap();
    for node in 1..4u32 {
        let data = pattern(200 * KIB as usize, 100 + node as u64);
        rt.block_on(async {
            let c = fs.node_client(node).await;
            let ctx = odfs_client::Ctx::current();
            let parent = c.resolve(&ctx, "/ckpt", true).await.unwrap();
            let name = format!("n{node}");
            let (_, h) = c.create_open(&ctx, parent.ino, name.as_bytes(), 0o644, true, None).await.unwrap();
            h.write(0, &data).await.unwrap();
            h.close().await.unwrap();
        });
        assert_eq!(placed(&format!("n{node}"), &data), nvme_of(node), "n{node}");
    }
    // --rotate turns it off again: new files spread over the pool.
    fs.cli_ok(&["setstripe", "--rotate", &s(&dir)]);
    assert!(!getfattr(&dir, "odfs.layout").contains("placement"), "{}", getfattr(&dir, "odfs.layout"));
    let mut seen = std::collections::HashSet::new();
    for i in 0..12 {
        let data = pattern(70 * KIB as usize, 200 + i as u64);
        fs::write(dir.join(format!("r{i}")), &data).unwrap();
        seen.insert(placed(&format!("r{i}"), &data));
    }
    assert!(seen.len() > 1, "rotation placed every file on {seen:?}");
    // Both flags at once are refused by the command line.
    assert!(fs.cli_err(&["setstripe", "--local", "--rotate", &s(&dir)]).contains("cannot be used with"));
}

#[test]
fn a_removed_files_chunk_files_are_emptied_and_become_the_next_files() {
    use std::os::unix::fs::MetadataExt;
    // Recycling alone: no empty files made ahead next to the recycled ones.
    let fs = LocalFs::up(4, &["--pool", "nvme", "--ram-pool", "64M", "--precreate-chunk-files", "0"]);
    let m = FuseMount::start(&fs);
    let dir = m.p("scratch");
    fs::create_dir(&dir).unwrap();
    fs.cli_ok(&["setstripe", "-c", "-1", "-S", "64K", "-p", "nvme", &s(&dir)]);
    let nvme: Vec<(u32, PathBuf)> =
        target_dirs(&fs, &m).into_iter().filter(|(_, _, p)| p == "nvme").map(|(id, d, _)| (id, d)).collect();
    let free_files = |d: &Path| -> Vec<(u64, u64)> {
        fs::read_dir(d.join("free"))
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap())
            .map(|m| (m.ino(), m.len()))
            .collect()
    };

    // A file with a chunk file on every nvme target, removed.
    let old = dir.join("old.bin");
    fs::write(&old, pattern(64 * KIB as usize * nvme.len(), 3)).unwrap();
    let ino = fs::metadata(&old).unwrap().ino();
    let held: Vec<(u32, PathBuf, u64)> = nvme
        .iter()
        .map(|(id, d)| {
            let p = chunk_file(d, ino).unwrap_or_else(|| panic!("target {id} holds no chunk file of old.bin"));
            (*id, d.clone(), fs::metadata(&p).unwrap().ino())
        })
        .collect();
    fs::remove_file(&old).unwrap();
    assert!(
        wait_until(Duration::from_secs(30), || held.iter().all(|(_, d, _)| chunk_file(d, ino).is_none())),
        "the removed file's chunk files are still there"
    );
    // Each one now waits in its target's pool, emptied: its blocks are free again.
    for (id, d, local) in &held {
        assert_eq!(free_files(d), vec![(*local, 0)], "target {id}: the pool holds the emptied chunk file");
    }

    // A new, shorter file takes pooled files for its chunks and holds exactly its own bytes.
    let new = dir.join("new.bin");
    let data = pattern(100 * KIB as usize, 4);
    fs::write(&new, &data).unwrap();
    assert_bytes(&fs::read(&new).unwrap(), &data, "the new file through the mount");
    let new_ino = fs::metadata(&new).unwrap().ino();
    let mut reused = 0;
    for (id, d, local) in &held {
        if let Some(p) = chunk_file(d, new_ino) {
            assert_eq!(fs::metadata(&p).unwrap().ino(), *local, "target {id}: the chunk file is the pooled one");
            assert!(free_files(d).is_empty(), "target {id}: the pooled file left the pool");
            assert!(fs::metadata(&p).unwrap().len() <= 64 * KIB, "target {id}: nothing of the old file is left");
            reused += 1;
        }
    }
    assert_eq!(reused, 2, "100 KiB in 64 KiB chunks takes two targets");
}

/// Bytes node `node`'s stored has moved so far (what it sent of chunks included).
fn stored_io(fs: &LocalFs, node: u32) -> u64 {
    fs.pids("stored", Some(node)).into_iter().map(io_bytes).sum()
}

/// What each node's stored moved while `f` ran.
fn stored_moved(fs: &LocalFs, f: impl FnOnce()) -> Vec<u64> {
    let before: Vec<u64> = (0..4).map(|k| stored_io(fs, k)).collect();
    f();
    (0..4).map(|k| stored_io(fs, k) - before[k as usize]).collect()
}

#[test]
fn a_node_reads_its_own_chunks_from_their_files_and_the_others_through_stored() {
    const MIB: usize = 1 << 20;
    let (fs, m) = up();
    let rt = tokio::runtime::Runtime::new().unwrap();
    // Written by node 1, so node 0's mount has none of it cached. 16 chunks of 1 MiB over the
    // pool's 4 targets (one per node): 4 MiB on each. `sparse` has bytes in its first chunk
    // only: its other chunks are holes or missing chunk files, which read as zeros.
    let data = pattern(16 * MIB, 23);
    let mut sparse = data[..MIB].to_vec();
    sparse.resize(8 * MIB, 0);
    // And 128 small files of 64 KiB in a directory, each whole on one target: those read
    // through the mount are fetched whole at open, or with their directory's others in batches
    // per target ahead of their opens.
    let small: Vec<Vec<u8>> = (0..128).map(|i| pattern(64 << 10, 100 + i)).collect();
    rt.block_on(async {
        let c = fs.node_client(1).await;
        let ctx = Ctx::root();
        for (name, bytes, size) in [("f", &data[..], data.len()), ("sparse", &data[..MIB], sparse.len())] {
            let (_, h) = c.create_open(&ctx, InodeId::ROOT, name.as_bytes(), 0o644, false, None).await.unwrap();
            h.write(0, bytes).await.unwrap();
            h.truncate(size as u64).await.unwrap();
            h.close().await.unwrap();
        }
        let dir = c.mkdir(&ctx, InodeId::ROOT, b"small", 0o755).await.unwrap();
        for (i, bytes) in small.iter().enumerate() {
            let name = format!("s{i}");
            let (_, h) = c.create_open(&ctx, dir.ino, name.as_bytes(), 0o644, false, None).await.unwrap();
            h.write(0, bytes).await.unwrap();
            h.close().await.unwrap();
        }
    });

    // Through node 0's mount: node 0's stored sends nothing, its quarter is read from the
    // chunk files; every other stored sends its own.
    let moved = stored_moved(&fs, || {
        assert_bytes(&fs::read(m.p("f")).unwrap(), &data, "f through node 0's mount");
        assert_bytes(&fs::read(m.p("sparse")).unwrap(), &sparse, "sparse through node 0's mount");
        assert_eq!(entries(&m.p("small")).len(), small.len());
        for (i, bytes) in small.iter().enumerate() {
            assert_bytes(
                &fs::read(m.p(&format!("small/s{i}"))).unwrap(),
                bytes,
                &format!("small/s{i} through node 0's mount"),
            );
        }
    });
    assert!(moved[0] < MIB as u64, "node 0's stored moved {} bytes for node 0's reads", moved[0]);
    assert!(moved[1..].iter().all(|&b| b >= 4 * MIB as u64), "the other storeds moved {moved:?}");

    // A library client of node 2 likewise reads node 2's chunks itself, node 0's through stored.
    let read_as = |node: u32, local_reads: bool| {
        stored_moved(&fs, || {
            rt.block_on(async {
                let mut cfg = fs.config().one_shot();
                (cfg.node, cfg.local_reads) = (node, local_reads);
                let c = Client::connect(cfg).await.unwrap();
                assert_bytes(&lib_read(&c, "/f").await, &data, &format!("f read by node {node}"));
                assert_bytes(&lib_read(&c, "/sparse").await, &sparse, &format!("sparse read by node {node}"));
            })
        })
    };
    let moved = read_as(2, true);
    assert!(moved[2] < MIB as u64 && moved[0] >= 4 * MIB as u64, "reading as node 2, the storeds moved {moved:?}");
    // Turned off in the client config, every chunk comes through stored.
    let moved = read_as(0, false);
    assert!(moved.iter().all(|&b| b >= 4 * MIB as u64), "with local_reads off, the storeds moved {moved:?}");

    // A client that cannot find its target's id in the target's directory (a directory it sees
    // is not the one stored sees) reads that target through stored, and reads the same bytes.
    let (id, dir) = node0_nvme_target(&fs, &m);
    let (claim, moved_claim) = (dir.join("target.id"), dir.join("target.id.moved"));
    fs::rename(&claim, &moved_claim).unwrap();
    let moved = read_as(0, true);
    fs::rename(&moved_claim, &claim).unwrap();
    assert!(moved[0] >= 4 * MIB as u64, "without target.id in target {id}'s directory, the storeds moved {moved:?}");
}

#[test]
fn a_node_answers_small_reads_of_its_own_chunks_from_the_page_cache_and_asks_stored_for_cold_ones() {
    const MIB: usize = 1 << 20;
    const READ: usize = 4096;
    let (fs, m) = up();
    let rt = tokio::runtime::Runtime::new().unwrap();
    // 16 MiB in 1 MiB chunks over the pool's 4 targets, written by node 1.
    let data = pattern(16 * MIB, 57);
    let ino = rt.block_on(async {
        let c = fs.node_client(1).await;
        let (a, h) = c.create_open(&Ctx::root(), InodeId::ROOT, b"small-reads", 0o644, false, None).await.unwrap();
        h.write(0, &data).await.unwrap();
        h.close().await.unwrap();
        a.attr.ino
    });
    // Which 1 MiB chunk of the file is the first in node 0's chunk file: its first bytes say.
    let (_, dir) = node0_nvme_target(&fs, &m);
    let chunk = chunk_file(&dir, ino.0).expect("node 0's target holds a chunk file of small-reads");
    let mut head = vec![0u8; READ];
    std::os::unix::fs::FileExt::read_exact_at(&fs::File::open(&chunk).unwrap(), &mut head, 0).unwrap();
    let k = (0..16).find(|k| data[k * MIB..k * MIB + READ] == head[..]).expect("the chunk file starts a chunk");
    // 4 KiB reads inside that chunk, apart (no read-ahead follows them).
    let offsets: Vec<usize> = (0..7).map(|i| k * MIB + 8192 + i * 131_072).collect();
    let mut cfg = fs.config().one_shot();
    (cfg.node, cfg.local_reads) = (0, true);
    let c = rt.block_on(Client::connect(cfg)).unwrap();
    let read_all = |what: &str| {
        rt.block_on(async {
            let h = c.open(&Ctx::root(), ino, true, false, false).await.unwrap();
            for &o in &offsets {
                let got = h.read(o as u64, READ as u32).await.unwrap();
                assert_bytes(&got, &data[o..o + READ], &format!("{what}: 4 KiB at {o}"));
            }
            h.close().await.unwrap();
        })
    };

    // Cold: the page cache holds none of them, so node 0's stored reads them (its io_uring
    // waits for the disk, no thread of the client's does) and sends them. The client's look
    // into the page cache (`RWF_NOWAIT`) starts the kernel's read of a missing page without
    // waiting for it, and on a loaded machine that read can end before the look does: then
    // the page cache answers that read. So a few cold passes are allowed; one must have been
    // answered wholly by stored.
    let mut passes = Vec::new();
    while passes.len() < 5 {
        evict(&chunk);
        assert_eq!(resident(&chunk), 0, "node 0's chunk file is still in the page cache after its eviction");
        let before = chunk_bytes_sent(&fs, 0);
        read_all("cold");
        passes.push(chunk_bytes_sent(&fs, 0) - before);
        if passes.last() == Some(&((offsets.len() * READ) as u64)) {
            break;
        }
    }
    assert_eq!(
        passes.last(),
        Some(&((offsets.len() * READ) as u64)),
        "cold small local reads: node 0's stored sent {passes:?} bytes in each pass"
    );
    // Now cached: the client reads them from the chunk file's pages, with no request to stored.
    let before = chunk_bytes_sent(&fs, 0);
    read_all("cached");
    let sent = chunk_bytes_sent(&fs, 0) - before;
    assert_eq!(sent, 0, "cached small local reads: node 0's stored sent {sent} bytes");
}

/// Chunk bytes node `node`'s stored has sent in replies so far, as `odfs stats` counts them.
fn chunk_bytes_sent(fs: &LocalFs, node: u32) -> u64 {
    let st: odfs_proto::stats::FsStats = serde_json::from_str(&fs.cli_ok(&["stats", "--json"])).expect("stats JSON");
    let stored = st
        .services
        .iter()
        .find(|s| s.kind == Some(odfs_proto::mgmt::ServiceKind::Storage) && s.node == node)
        .unwrap_or_else(|| panic!("no stored of node {node} in {st:?}"));
    let stats = stored.stats.as_ref().unwrap_or_else(|| panic!("{} not asked: {:?}", stored.name, stored.error));
    stats.methods.iter().map(|m| m.bytes_out).sum()
}

/// Node 0's target in pool nvme: its id and directory.
fn node0_nvme_target(fs: &LocalFs, m: &FuseMount) -> (u32, PathBuf) {
    let nodes = target_nodes(m);
    target_dirs(fs, m)
        .into_iter()
        .find(|(id, _, pool)| pool == "nvme" && nodes.contains(&(*id, 0)))
        .map(|(id, dir, _)| (id, dir))
        .expect("node 0 has a target in pool nvme")
}

/// Bytes of `path` in the page cache (`fincore`, which reads nothing of it).
fn resident(path: &Path) -> u64 {
    let out = Command::new("fincore").args(["--bytes", "--noheadings", "--output", "RES"]).arg(path).output();
    let out = out.expect("fincore (util-linux) runs");
    let text = String::from_utf8_lossy(&out.stdout);
    text.trim().parse().unwrap_or_else(|_| panic!("fincore {} printed {text:?}", path.display()))
}

/// Drops `path`'s pages from the page cache, written back first (a dirty page stays).
fn evict(path: &Path) {
    use std::os::fd::AsRawFd;
    let f = fs::File::open(path).unwrap();
    f.sync_all().unwrap();
    // SAFETY: posix_fadvise takes no memory; the descriptor is open for the call.
    assert_eq!(unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) }, 0);
}

#[test]
fn a_node_reading_its_own_chunks_once_from_start_to_end_leaves_no_copy_behind() {
    const MIB: u64 = 1 << 20;
    let (fs, m) = up();
    let rt = tokio::runtime::Runtime::new().unwrap();
    // 128 MiB in 1 MiB chunks over the pool's 4 targets, written by node 1: node 0's chunk file
    // holds 32 MiB of it, and node 0's mount has none of it cached.
    let data = pattern(128 * MIB as usize, 41);
    let ino = rt.block_on(async {
        let c = fs.node_client(1).await;
        let (a, h) = c.create_open(&Ctx::root(), InodeId::ROOT, b"big", 0o644, false, None).await.unwrap();
        h.write(0, &data).await.unwrap();
        h.close().await.unwrap();
        a.attr.ino.0
    });
    let (_, dir) = node0_nvme_target(&fs, &m);
    let chunk = chunk_file(&dir, ino).expect("node 0's target holds a chunk file of big");
    assert_eq!(fs::metadata(&chunk).unwrap().len(), 32 * MIB);

    let node0 = |drop_behind: bool| {
        let mut cfg = fs.config().one_shot();
        (cfg.node, cfg.drop_behind_reads) = (0, drop_behind);
        rt.block_on(Client::connect(cfg)).unwrap()
    };
    let read = |c: &Client, what: &str| rt.block_on(async { assert_bytes(&lib_read(c, "/big").await, &data, what) });

    // Read once by a client of node 0, start to end: node 0's chunks come from the chunk file
    // (its stored sends none of them), and the pages the reader left behind are dropped; the
    // last 16 MiB it read stay (they may still be in flight). (Through node 0's mount, the
    // kernel may move the pages spliced from the chunk file into the mount's own cache, gone
    // from the chunk file's with or without drops: a library client's copied reads show them.)
    evict(&chunk);
    let c = node0(true);
    let moved = stored_moved(&fs, || read(&c, "big, read once by node 0"));
    assert!(moved[0] < MIB, "node 0's stored moved {} bytes for node 0's reads", moved[0]);
    assert!(
        wait_until(Duration::from_secs(10), || resident(&chunk) <= 20 * MIB),
        "after one read, {} bytes of node 0's 32 MiB chunk file are still cached",
        resident(&chunk)
    );
    // A second read by the same client marks the file shared: from then on the client drops
    // none of its pages. (A piece its look into the page cache missed is asked of stored, whose
    // own drop-behind may drop it, as below.)
    let moved = stored_moved(&fs, || read(&c, "big, read again by node 0"));
    assert!(
        wait_until(Duration::from_secs(10), || resident(&chunk) + moved[0] >= 32 * MIB),
        "read twice, node 0's chunk file keeps only {} of its 32 MiB cached, {} bytes sent by node 0's stored",
        resident(&chunk),
        moved[0]
    );
    // With drop_behind_reads off in the client config, a single read keeps every page it read
    // itself. A piece the client's look into the page cache missed is asked of stored, whose own
    // drop-behind may drop it (on a loaded machine a few are): those bytes are not the client's.
    evict(&chunk);
    let c = node0(false);
    let moved = stored_moved(&fs, || read(&c, "big, read once by node 0 with drop_behind_reads off"));
    let kept = resident(&chunk);
    assert!(
        kept + moved[0] >= 32 * MIB,
        "drop_behind_reads = false keeps what was read: {kept} of 32 MiB cached, {} bytes sent by node 0's stored",
        moved[0]
    );
}

/// The CLI's own refusals in a sealed tree name the tree by its path (metad's name an inode,
/// a mount's say only "Read-only file system"), and a stage-in into one is refused before it
/// lists or copies anything.
#[test]
fn refusals_in_a_sealed_tree_name_it_and_a_stage_in_into_one_copies_nothing() {
    let fs = LocalFs::up(2, &[]);
    let m = FuseMount::start(&fs);
    fs::create_dir_all(m.p("ds/sub")).unwrap();
    fs::write(m.p("ds/sub/a"), b"data").unwrap();
    fs.cli_ok(&["seal", "odfs:/ds"]);
    let named = |e: &str, want: &str| {
        assert!(e.contains(want), "expected {want:?} in: {e}");
        assert!(e.contains("odfs unseal") && !e.contains("inode") && e.trim_end().lines().count() == 1, "{e}");
    };
    // setstripe, through the mount and the library, on a directory below the top, a new file
    // (which is not made) and the top itself.
    let top = s(&m.p("ds"));
    named(&fs.cli_err(&["setstripe", "-c", "1", &s(&m.p("ds/sub"))]), &format!("is in the sealed tree {top},"));
    named(&fs.cli_err(&["setstripe", "-c", "1", &s(&m.p("ds/sub/new"))]), &format!("the sealed tree {top},"));
    assert!(!m.p("ds/sub/new").exists(), "a refused setstripe made its file");
    named(&fs.cli_err(&["setstripe", "-c", "1", "odfs:/ds/sub"]), "odfs:/ds/sub is in the sealed tree odfs:/ds,");
    named(&fs.cli_err(&["setstripe", "-c", "1", "odfs:/ds"]), "odfs:/ds is a sealed tree,");
    // A tree next to it is not sealed: setstripe works there.
    fs::create_dir(m.p("free")).unwrap();
    fs.cli_ok(&["setstripe", "-c", "1", &s(&m.p("free"))]);

    // A stage-in into the sealed tree, from a POSIX tree: refused before its listing, and
    // nothing lands in odfs.
    let src = tempfile::tempdir().unwrap();
    for i in 0..3 {
        fs::write(src.path().join(format!("f{i}")), pattern(1 << 20, i)).unwrap();
    }
    let err = fs.cli_err(&["stage-in", &s(src.path()), "odfs:/ds/sub/in"]);
    named(&err, "odfs:/ds/sub/in is in the sealed tree odfs:/ds, which is read-only: nothing was copied");
    assert!(!err.contains("listing"), "refused before the listing: {err}");
    assert_eq!(entries(&m.p("ds/sub")), ["a"], "nothing was made in the sealed tree");
    let err = fs.cli_err(&["stage-in", &s(src.path()), &s(&m.p("ds"))]);
    named(&err, "odfs:/ds is a sealed tree, which is read-only: nothing was copied");
    // Unsealed, the same stage-in copies.
    fs.cli_ok(&["unseal", "odfs:/ds"]);
    fs.cli_ok(&["stage-in", &s(src.path()), "odfs:/ds/sub/in"]);
    assert_eq!(entries(&m.p("ds/sub/in")).iter().filter(|e| e.starts_with('f')).count(), 3);
}

/// A tagged 1 MiB block: block `i` of round `r`.
fn tagged_block(r: usize, i: usize) -> Vec<u8> {
    let tag = format!("round {r:02} block {i:06}|");
    tag.as_bytes().iter().copied().cycle().take(1 << 20).collect()
}

/// What one round of filling a full pool saw.
#[derive(Debug)]
struct FillRound {
    /// Bytes every write acknowledged, and those covered by a successful fsync.
    acked: usize,
    synced: usize,
    /// The errno of the first call that failed (write, fsync or close), and which call.
    first_failure: Option<(&'static str, i32)>,
}

/// Writes tagged 1 MiB blocks into `path` until a write fails, with an fsync after every 4
/// blocks, then fsyncs and closes; every call's result is noted.
fn fill_until_full(path: &Path, r: usize) -> FillRound {
    use std::io::Write;
    let mut f = fs::File::create(path).unwrap();
    let mut round = FillRound { acked: 0, synced: 0, first_failure: None };
    let fail = |round: &mut FillRound, call: &'static str, e: std::io::Error| {
        round.first_failure.get_or_insert((call, e.raw_os_error().unwrap_or(0)));
    };
    'writing: for i in 0.. {
        let block = tagged_block(r, i);
        let mut at = 0;
        while at < block.len() {
            match f.write(&block[at..]) {
                Ok(n) => {
                    at += n;
                    round.acked += n;
                }
                Err(e) => {
                    fail(&mut round, "write", e);
                    break 'writing;
                }
            }
        }
        if i % 4 == 3 {
            match f.sync_all() {
                Ok(()) => round.synced = round.acked,
                Err(e) => {
                    fail(&mut round, "fsync", e);
                    break;
                }
            }
        }
    }
    // An fsync that succeeds vouches for every byte a write acknowledged before it, a failed
    // write in between or not — unless an fsync already reported a failure (as on a local
    // filesystem, a write-back error is reported once per open file).
    let sync_failed = matches!(round.first_failure, Some(("fsync", _)));
    match f.sync_all() {
        Ok(()) if !sync_failed => round.synced = round.acked,
        Ok(()) => {}
        Err(e) => fail(&mut round, "fsync", e),
    }
    // close(2)'s own result (a File's drop ignores it).
    let fd = std::os::fd::IntoRawFd::into_raw_fd(f);
    if unsafe { libc::close(fd) } != 0 {
        fail(&mut round, "close", std::io::Error::last_os_error());
    }
    round
}

/// A full pool never loses acknowledged bytes silently: in 20 rounds of tagged 1 MiB writes
/// (an fsync every 4 blocks) through the mount into a directory striped over every node's
/// 64 MiB RAM target until a write fails, the first call to fail (write, fsync or close) fails
/// with ENOSPC, and every byte a successful fsync covered reads back as written — through the
/// mount and through a fresh client of another node.
#[test]
fn a_full_pool_fails_the_write_fsync_or_close_with_enospc_and_loses_nothing_fsync_acknowledged() {
    let (fs, m) = up();
    let dir = m.p("ram");
    fs::create_dir(&dir).unwrap();
    fs.cli_ok(&["setstripe", "-p", "ram", "-c", "-1", &s(&dir)]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut full = 0;
    for r in 0..20 {
        let path = dir.join(format!("fill{r:02}"));
        let round = fill_until_full(&path, r);
        let (call, errno) =
            round.first_failure.unwrap_or_else(|| panic!("round {r}: the pool never filled: {round:?}"));
        assert_eq!(errno, libc::ENOSPC, "round {r}: the first failure ({call}) must be ENOSPC: {round:?}");
        full += usize::from(round.acked >= 200 << 20);
        let through_mount = fs::read(&path).unwrap();
        let through_library = rt.block_on(async {
            let c = fs.node_client(3).await;
            lib_read(&c, &format!("/ram/fill{r:02}")).await
        });
        for (what, got) in [("the mount", &through_mount), ("node 3's client", &through_library)] {
            assert!(
                got.len() >= round.synced,
                "round {r}: {what} reads {} of {} synced bytes",
                got.len(),
                round.synced
            );
            for i in 0..round.synced >> 20 {
                let want = tagged_block(r, i);
                let page = got[i << 20..(i + 1) << 20].chunks(4096).zip(want.chunks(4096)).position(|(a, b)| a != b);
                assert!(
                    page.is_none(),
                    "round {r}: block {i}, acknowledged by fsync, differs through {what} at page {page:?}: {round:?}"
                );
            }
        }
        // The next round's create follows at once: the space this unlink frees counts for it
        // (the chunks go now and the create waits for the next space report), not ENOSPC.
        fs::remove_file(&path).unwrap();
    }
    // The pool was really full in most rounds (four 64 MiB targets), not refused early.
    assert!(full >= 10, "only {full} of 20 rounds filled the pool");
}

/// Space one client's unlink frees counts at once for another client's create and writes: in 5
/// rounds, one mount fills a directory striped over every 64 MiB RAM target until ENOSPC and
/// unlinks the file; a second mount (another client, its own caches) then creates a file there
/// at once and writes 32 MiB into it, fsync'd, without ENOSPC, and reads it back intact.
#[test]
fn space_another_client_frees_counts_at_once_for_the_next_create_and_write() {
    use std::io::Write;
    let (fs, a) = up();
    let b = FuseMount::start_at(&fs, "mnt2", &[]);
    let dir = a.p("ram");
    fs::create_dir(&dir).unwrap();
    fs.cli_ok(&["setstripe", "-p", "ram", "-c", "-1", &s(&dir)]);
    for r in 0..5 {
        let fill = dir.join(format!("fill{r}"));
        let round = fill_until_full(&fill, r);
        assert!(
            matches!(round.first_failure, Some((_, libc::ENOSPC))) && round.acked >= 200 << 20,
            "round {r}: the pool did not fill: {round:?}"
        );
        fs::remove_file(&fill).unwrap();
        let next = b.p(&format!("ram/next{r}"));
        let mut f = fs::File::create(&next).unwrap_or_else(|e| panic!("round {r}: create after the unlink: {e}"));
        let data: Vec<u8> = (0..32usize << 20).map(|i| (i / 4096 + r) as u8).collect();
        f.write_all(&data).unwrap_or_else(|e| panic!("round {r}: write after the unlink: {e}"));
        f.sync_all().unwrap_or_else(|e| panic!("round {r}: fsync after the unlink: {e}"));
        drop(f);
        assert!(fs::read(&next).unwrap() == data, "round {r}: the new file reads back different");
        assert!(
            fs::read(a.p(&format!("ram/next{r}"))).unwrap() == data,
            "round {r}: different through the first mount"
        );
        fs::remove_file(&next).unwrap();
    }
}
