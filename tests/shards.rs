//! Several metadata services (`--meta 4`: shard k on node k) and directories striped over
//! them (`odfs mkdir -c N`), on a real 4-node filesystem and its mount; `odfs find` against
//! GNU find on the same tree.
//!
//! Needs root and /dev/fuse; the attr package (getfattr).

use odfs_client::Ctx;
use odfs_tests::*;
use std::collections::HashSet;
use std::fs;
use std::path::Path;
use std::process::{Command, Output};

fn dir_layout(p: &Path) -> String {
    getfattr(p, "odfs.dir_layout")
}

fn entries_per_shard(layout: &str) -> Vec<u64> {
    let v = layout.split_whitespace().find_map(|i| i.strip_prefix("entries=")).unwrap_or("");
    v.split(',').filter_map(|x| x.parse().ok()).collect()
}

/// Sorted lines of a command's output.
fn lines(o: &Output) -> Vec<String> {
    sorted_lines(o, "the command")
}

#[test]
fn two_hundred_thousand_entries_from_four_clients_spread_evenly_and_list_once() {
    const CLIENTS: usize = 4;
    const PER: usize = 50_000;
    let fs = LocalFs::up(4, &["--meta", "4"]);
    let m = FuseMount::start(&fs);
    fs.cli_ok(&["mkdir", "-c", "4", &m.p("wide").display().to_string()]);
    assert!(dir_layout(&m.p("wide")).starts_with("stripe_count=4 shards=0,1,2,3"));
    // Four clients, separate processes with their own connections as four nodes would be:
    // each `odfs cp -r` copies a local directory of 50,000 empty files into the striped one.
    let src = tempfile::tempdir().unwrap();
    let copies: Vec<std::process::Child> = (0..CLIENTS)
        .map(|c| {
            let d = src.path().join(format!("c{c}"));
            fs::create_dir(&d).unwrap();
            for i in 0..PER {
                fs::File::create(d.join(format!("c{c}-{i:06}"))).unwrap();
            }
            Command::new(bin_dir().join("odfs"))
                .arg("--fs")
                .arg(fs.config_path())
                .args(["cp", "-r", "--parallel", "64"])
                .arg(format!("{}/.", d.display()))
                .arg("odfs:/wide")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("run odfs cp")
        })
        .collect();
    for (c, child) in copies.into_iter().enumerate() {
        let o = child.wait_with_output().unwrap();
        assert!(o.status.success(), "odfs cp of client {c}: {}", String::from_utf8_lossy(&o.stderr));
    }
    let total = (CLIENTS * PER) as u64;
    // Each shard holds a quarter, within 5 points.
    let per = entries_per_shard(&dir_layout(&m.p("wide")));
    assert_eq!(per.len(), 4);
    assert_eq!(per.iter().sum::<u64>(), total, "{per:?}");
    for (shard, n) in per.iter().enumerate() {
        let share = *n as f64 / total as f64;
        assert!((0.20..=0.30).contains(&share), "shard {shard} holds {n} of {total} ({:.1}%)", share * 100.0);
    }
    // readdir (through the library, and through the mount) lists every name exactly once.
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let listed = rt.block_on(async {
        let c = fs.client().await;
        let d = c.resolve(&Ctx::root(), "/wide", true).await.unwrap();
        c.readdir_all(&Ctx::root(), d.ino, false).await.unwrap()
    });
    let names: HashSet<Vec<u8>> = listed.iter().map(|e| e.name.clone()).collect();
    assert_eq!((listed.len(), names.len()), (total as usize, total as usize), "library readdir: each name once");
    let through_mount: Vec<String> =
        fs::read_dir(m.p("wide")).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    let unique: HashSet<&String> = through_mount.iter().collect();
    assert_eq!((through_mount.len(), unique.len()), (total as usize, total as usize), "readdir through the mount");
    assert!(unique.contains(&"c3-049999".to_string()) && unique.contains(&"c0-000000".to_string()));

    // odfs find returns what GNU find on the mount returns: every entry, and a -name subset.
    let mnt = m.path.display().to_string();
    let all = Command::new("find").arg(format!("{mnt}/wide")).output().unwrap();
    let ours = lines(&fs.cli(&["find", &format!("{mnt}/wide")]));
    assert_eq!(ours, lines(&all), "odfs find vs find: every entry");
    assert_eq!(ours.len(), total as usize + 1);
    let gnu = Command::new("find").args([&format!("{mnt}/wide"), "-name", "c2-*7"]).output().unwrap();
    let ours = lines(&fs.cli(&["find", &format!("{mnt}/wide"), "-name", "c2-*7"]));
    assert_eq!(ours, lines(&gnu));
    assert_eq!(ours.len(), PER / 10);
}

#[test]
fn striping_rules_renames_removal_permissions_and_restarts() {
    let fs = LocalFs::up(4, &["--meta", "4"]);
    let m = FuseMount::start_with(&fs, &["--allow-other"]);
    let d = m.p("d");
    let ds = d.display().to_string();
    fs.cli_ok(&["mkdir", "-c", "-1", &ds]);
    // Only an empty directory is striped; not beyond the shards there are.
    fs::create_dir(m.p("full")).unwrap();
    fs::write(m.p("full/x"), b"x").unwrap();
    let o = Command::new("setfattr")
        .args(["-n", "odfs.dir_layout", "-v", "stripe_count=2"])
        .arg(m.p("full"))
        .output()
        .unwrap();
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("Directory not empty"), "{o:?}");
    let o = fs.cli(&["mkdir", "-c", "5", &m.p("five").display().to_string()]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("4 metadata shards"));
    assert!(!m.p("five").exists(), "a refused striped mkdir leaves nothing behind");
    let o = fs.cli(&["mkdir", "-p", "-c", "0", &m.p("zero/sub").display().to_string()]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("-c 0"), "{o:?}");
    assert!(!m.p("zero").exists(), "a refused striped mkdir -p makes no parents");

    // Files land on every shard; each reads back; subdirectories work on their shard.
    for i in 0..64 {
        fs::write(d.join(format!("f{i}")), format!("file {i}")).unwrap();
    }
    let per = entries_per_shard(&dir_layout(&d));
    assert!(per.iter().all(|&n| n > 0), "{per:?}");
    for i in 0..64 {
        assert_eq!(fs::read_to_string(d.join(format!("f{i}"))).unwrap(), format!("file {i}"));
    }
    fs::create_dir_all(d.join("sub/deeper")).unwrap();
    fs::write(d.join("sub/deeper/z"), b"z").unwrap();
    assert_eq!(fs::read(d.join("sub/deeper/z")).unwrap(), b"z");

    // rename(2) works within one shard and between shards alike (never EXDEV).
    for i in 0..64 {
        let (a, b) = (d.join(format!("f{i}")), d.join(format!("r{i}")));
        fs::rename(&a, &b).unwrap_or_else(|e| panic!("rename f{i}: {e}"));
        assert!(b.exists() && !a.exists(), "f{i} renamed to r{i}");
    }
    let st = Command::new("mv").arg(d.join("f1")).arg(d.join("moved")).status().unwrap();
    assert!(st.success() || !d.join("f1").exists());
    // Write-then-rename stays within one shard: a temporary name is placed as its final name.
    for i in 0..64 {
        let fin = d.join(format!("w{i}"));
        for tmp in [format!("w{i}.tmp"), format!(".w{i}.Xa9qZ2"), format!("w{i}.tmp.{}", 1000 + i), format!("w{i}~")] {
            fs::write(d.join(&tmp), format!("v {i} {tmp}")).unwrap();
            fs::rename(d.join(&tmp), &fin).unwrap_or_else(|e| panic!("rename {tmp} -> w{i}: {e}"));
            assert_eq!(fs::read_to_string(&fin).unwrap(), format!("v {i} {tmp}"));
        }
    }
    // rsync writes each file as .NAME.XXXXXX and renames it: a tree lands whole.
    let src = tempfile::tempdir().unwrap();
    for i in 0..300 {
        fs::write(src.path().join(format!("s{i}.bin")), pattern(1000 + i, i as u64)).unwrap();
    }
    let r = m.p("synced");
    fs.cli_ok(&["mkdir", "-c", "-1", &r.display().to_string()]);
    let o = Command::new("rsync").arg("-a").arg(format!("{}/", src.path().display())).arg(&r).output().unwrap();
    assert!(o.status.success(), "rsync into a striped directory: {}", String::from_utf8_lossy(&o.stderr));
    let o = Command::new("diff").arg("-r").arg(src.path()).arg(&r).output().unwrap();
    assert!(o.status.success(), "diff -r: {}", String::from_utf8_lossy(&o.stdout));
    assert!(entries_per_shard(&dir_layout(&r)).iter().all(|&n| n > 40), "{}", dir_layout(&r));
    // rmdir: refused while any part has entries, and the directory stays usable; then removed.
    let e = fs::remove_dir(&d).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ENOTEMPTY));
    fs::write(d.join("after"), b"still usable").unwrap();
    assert_eq!(fs::read(d.join("after")).unwrap(), b"still usable");

    // A permission change reaches every part: another user writes in every shard's part once
    // the directory is opened to everyone, and in none before.
    let u = TestUser::create("sh");
    let e = m.p("e");
    fs.cli_ok(&["mkdir", "-c", "-1", &e.display().to_string()]);
    fs::set_permissions(&m.path, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let touch = |name: &str| u.run("touch", &[&e.join(name)]);
    assert!(!touch("no").status.success(), "a 0755 root-owned directory refuses another user");
    fs::set_permissions(&e, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    for i in 0..32 {
        let o = touch(&format!("u{i}"));
        assert!(o.status.success(), "u{i}: {}", String::from_utf8_lossy(&o.stderr));
    }
    assert!(entries_per_shard(&dir_layout(&e)).iter().all(|&n| n > 0));

    // kill -9 of a metadata service: its parts and entries are back after a restart.
    let before = lines(&Command::new("find").arg(&m.path).output().unwrap());
    fs.kill9("metad", 2);
    fs.restart("metad", 2);
    wait_for("the tree to come back after a metad restart", std::time::Duration::from_secs(30), || {
        let now = Command::new("find").arg(&m.path).output().unwrap();
        (now.status.success() && lines(&now) == before, now.status)
    });
    // Empty the striped directory; now it goes, with every part.
    for entry in fs::read_dir(&d).unwrap() {
        let p = entry.unwrap().path();
        if p.is_dir() {
            fs::remove_dir_all(&p).unwrap();
        } else {
            fs::remove_file(&p).unwrap();
        }
    }
    fs::remove_dir(&d).unwrap();
    assert!(!d.exists());
    fs::create_dir(&d).unwrap();
    assert!(dir_layout(&d).starts_with("stripe_count=1"), "a new directory of that name is a plain one");
}

#[test]
fn a_stage_in_target_is_striped_over_every_shard() {
    let fs = LocalFs::up(4, &["--meta", "4"]);
    let m = FuseMount::start(&fs);
    let src = fs.root().join("src");
    fs::create_dir_all(src.join("sub")).unwrap();
    for i in 0..40 {
        fs::write(src.join(format!("s{i}")), pattern(1000 + i * 10, i as u64)).unwrap();
    }
    fs::write(src.join("sub/t"), b"t").unwrap();
    fs.cli_ok(&["stage-in", &src.display().to_string(), "odfs:/data"]);
    let l = dir_layout(&m.p("data"));
    assert!(l.starts_with("stripe_count=4"), "{l}");
    assert!(entries_per_shard(&l).iter().filter(|&&n| n > 0).count() >= 3, "{l}");
    for i in 0..40 {
        assert_bytes(&fs::read(m.p(&format!("data/s{i}"))).unwrap(), &pattern(1000 + i * 10, i as u64), "staged");
    }
    assert_eq!(fs::read(m.p("data/sub/t")).unwrap(), b"t");
}

#[test]
fn a_striped_tree_seals_and_unseals_on_every_shard_through_the_library() {
    let fs = LocalFs::up(4, &["--meta", "4"]);
    let m = FuseMount::start(&fs);
    let d = m.p("ds");
    fs.cli_ok(&["mkdir", "-c", "-1", &d.display().to_string()]);
    fs::create_dir(d.join("sub")).unwrap();
    for i in 0..32 {
        fs::write(d.join(format!("f{i}")), format!("file {i}")).unwrap();
        fs::write(d.join("sub").join(format!("g{i}")), format!("sub {i}")).unwrap();
    }
    // Through the library (odfs:/PATH with --fs), as a job's stage-in would.
    fs.cli_ok(&["seal", "odfs:/ds"]);
    let per = entries_per_shard(&dir_layout(&d));
    assert!(per.iter().all(|&n| n > 0), "names on every shard: {per:?}");
    for i in 0..32 {
        // New names hash to every shard: each part refuses them.
        let e = fs::write(d.join(format!("new{i}")), b"x").unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EROFS), "new{i}: {e}");
        let e = fs::rename(d.join(format!("f{i}")), d.join(format!("moved{i}"))).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EROFS), "rename of f{i} across the parts: {e}");
        let e = fs::remove_file(d.join("sub").join(format!("g{i}"))).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EROFS), "sub/g{i}: {e}");
        assert_eq!(fs::read_to_string(d.join(format!("f{i}"))).unwrap(), format!("file {i}"));
    }
    assert_eq!(getfattr(&d.join("sub/g3"), "odfs.sealed"), "1");
    // A stage-out of a sealed tree, or a find, reads it as usual.
    assert_eq!(fs.cli_ok(&["find", "odfs:/ds", "-type", "f"]).lines().count(), 64);

    fs.cli_ok(&["unseal", "odfs:/ds"]);
    for i in 0..32 {
        fs::write(d.join(format!("new{i}")), b"x").unwrap();
        fs::rename(d.join(format!("f{i}")), d.join(format!("moved{i}"))).unwrap();
    }
    assert_eq!(fs::read_dir(&d).unwrap().count(), 65);
    assert_eq!(getfattr(&d, "odfs.sealed"), "0");
}
