//! `odfs start` / `odfs stop` / `odfs recover` / `odfs cleanup` outside Slurm, with explicit
//! flags, once per node as separate processes — the way pdsh or clush runs them (kit/launch.rs).
//! Every node is an address of the loopback network with its own directories.
//!
//! Needs root and /dev/fuse.

use odfs_tests::launch::{all_ok, Launch, PORT_SLOTS};
use odfs_tests::*;
use std::fs;
use std::path::Path;

/// Total bytes of the regular files below `dir`.
fn bytes_below(dir: &Path) -> u64 {
    walk_files(dir).iter().map(|f| fs::metadata(f).map(|m| m.len()).unwrap_or(0)).sum()
}

#[test]
fn explicit_flags_start_stage_in_run_stage_out_and_wipe_four_nodes() {
    let l = Launch::new(4, "");
    let src = l.dir.path().join("dataset");
    let dst = l.dir.path().join("results-store");
    fs::create_dir_all(src.join("sub")).unwrap();
    let mut want = Vec::new();
    for i in 0..20 {
        let rel = if i % 4 == 0 { format!("sub/d{i}") } else { format!("d{i}") };
        let data = pattern(5000 + i * 40_000, i as u64);
        fs::write(src.join(&rel), &data).unwrap();
        want.push((rel, data));
    }
    let script = l.dir.path().join("job.sh");
    fs::write(
        &script,
        format!(
            "#!/bin/sh\n#ODFS stage-in {} /data\n#ODFS stage-out /results {}\n#ODFS chunk-size 256K\nrun\n",
            src.display(),
            dst.display()
        ),
    )
    .unwrap();
    // A BeeOND-style node file.
    let nodefile = l.dir.path().join("nodes");
    fs::write(&nodefile, format!("# the job's nodes\n{}\n", l.nodes.join("\n"))).unwrap();
    let (nf, sc) = (nodefile.display().to_string(), script.display().to_string());
    let outs = all_ok(&l.all(&["start", "--job-id", "run1", "--nodefile", &nf, "--script", &sc]), "odfs start");
    assert!(outs[0].contains("ready on 127.0.0.1 (node 0 of 4)"), "{}", outs[0]);

    // Every node's mount holds the whole dataset.
    for k in 0..4 {
        for (rel, data) in &want {
            let got = fs::read(l.mount(k, "run1").join("data").join(rel)).unwrap();
            assert_bytes(&got, data, &format!("node {k}: data/{rel}"));
        }
    }
    // Written on one node, read on another (close-to-open).
    let out = pattern(3 << 20, 99);
    fs::create_dir_all(l.mount(2, "run1").join("results")).unwrap();
    fs::write(l.mount(2, "run1").join("results/model.bin"), &out).unwrap();
    assert_bytes(&fs::read(l.mount(3, "run1").join("results/model.bin")).unwrap(), &out, "node 3 reads node 2's file");

    all_ok(&l.all(&["stop", "--job-id", "run1", "--nodefile", &nf]), "odfs stop");
    assert_bytes(&fs::read(dst.join("model.bin")).unwrap(), &out, "staged out");
    assert!(dst.join(".odfs-stage-out.complete").exists());
    l.assert_clean();
}

#[test]
fn jobs_share_a_node_and_a_port_clash_is_named() {
    let l = Launch::new(1, "");
    let n = l.node_list();
    all_ok(&[l.on(0, &["start", "--job-id", "7", "--nodes", &n])], "job 7");
    all_ok(&[l.on(0, &["start", "--job-id", "8", "--nodes", &n])], "job 8 beside job 7");
    fs::write(l.mount(0, "7").join("f"), b"seven").unwrap();
    fs::write(l.mount(0, "8").join("f"), b"eight").unwrap();
    // Job ids port_slots apart share a port range.
    let clash = (7 + PORT_SLOTS).to_string();
    let out = l.on(0, &["start", "--job-id", &clash, "--nodes", &n]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a clashing job must not start");
    assert!(
        err.contains("port") && err.contains("is not free") && err.contains(&format!("modulo {PORT_SLOTS}")),
        "{err}"
    );
    assert_eq!(l.records(0), ["7", "8"], "the clashing start rolled back: {err}");
    assert_eq!(fs::read(l.mount(0, "7").join("f")).unwrap(), b"seven", "the running jobs are untouched");
    assert_eq!(fs::read(l.mount(0, "8").join("f")).unwrap(), b"eight");
    for j in ["7", "8"] {
        all_ok(&[l.on(0, &["stop", "--job-id", j, "--nodes", &n])], "stop");
    }
    l.assert_clean();
}

#[test]
fn the_next_start_cleans_what_a_dead_node_left() {
    let l = Launch::new(1, "");
    let n = l.node_list();
    all_ok(&[l.on(0, &["start", "--job-id", "dead", "--nodes", &n])], "start");
    fs::write(l.mount(0, "dead").join("f"), pattern(1 << 20, 1)).unwrap();
    // The node dies: every process of the job is killed; a dead mount, the data and the record
    // stay behind.
    for pid in l.processes() {
        kill9_gone(pid);
    }
    assert_eq!(l.records(0), ["dead"]);
    all_ok(&[l.on(0, &["start", "--job-id", "next", "--nodes", &n])], "the next start");
    assert!(l.event_log(0).contains("job next: cleanup: job dead: cleaned up"), "{}", l.event_log(0));
    assert_eq!(l.records(0), ["next"]);
    assert_eq!(entries(&l.nvme(0)), ["odfs.next"]);
    all_ok(&[l.on(0, &["stop", "--job-id", "next", "--nodes", &n])], "stop");
    l.assert_clean();
}

#[test]
fn the_ram_variant_puts_a_pool_on_tmpfs_and_unknown_pools_are_refused() {
    let l = Launch::new(2, "");
    let n = l.node_list();
    let script = l.dir.path().join("ram.sh");
    fs::write(&script, "#!/bin/sh\n#ODFS pool ram\n#ODFS stripe-count -1\n#ODFS chunk-size 64K\n").unwrap();
    let sc = script.display().to_string();
    // Without the feature there is no RAM pool: refused by node 0, rolled back everywhere.
    let outs = l.all(&["start", "--job-id", "r0", "--nodes", &n, "--script", &sc]);
    let err = String::from_utf8_lossy(&outs[0].stderr);
    assert!(!outs[0].status.success() && err.contains("pool ram: this job has no RAM pool"), "{err}");
    assert!(l.records(1).is_empty() && entries(&l.nvme(1)).is_empty(), "node 1 rolled back");

    all_ok(&l.all(&["start", "--job-id", "r1", "--nodes", &n, "--script", &sc, "--features", "odfs_ram"]), "start");
    let data = pattern(3 << 20, 5);
    fs::write(l.mount(0, "r1").join("f"), &data).unwrap();
    assert_bytes(&fs::read(l.mount(1, "r1").join("f")).unwrap(), &data, "read back on node 1");
    for k in 0..2 {
        let ram = l.state(k).join("r1/ram");
        let mounts = fs::read_to_string("/proc/self/mountinfo").unwrap();
        assert!(
            mounts.lines().any(|m| m.contains(&format!(" {} ", ram.display())) && m.contains(" tmpfs ")),
            "no tmpfs at {}",
            ram.display()
        );
        // The file's bytes are on the RAM targets, none on the NVMe target.
        assert!(bytes_below(&ram) >= (3 << 20) / 2, "node {k}: {} bytes on its RAM target", bytes_below(&ram));
        let target = l.nvme(k).join("odfs.r1").join(format!("target{}", 2 * k + 1));
        assert_eq!(bytes_below(&target.join("chunks")), 0, "node {k}: chunks on the NVMe target");
    }
    all_ok(&l.all(&["stop", "--job-id", "r1", "--nodes", &n]), "stop");
    l.assert_clean();
}

#[test]
fn an_unverified_stage_out_is_kept_and_recovered() {
    let l = Launch::new(2, "");
    let n = l.node_list();
    let dst = l.dir.path().join("store/out");
    // The store's directory cannot be made yet: its parent is a file.
    fs::write(l.dir.path().join("store"), b"not a directory").unwrap();
    let script = l.dir.path().join("so.sh");
    fs::write(&script, format!("#!/bin/sh\n#ODFS stage-out /out {}\n", dst.display())).unwrap();
    let sc = script.display().to_string();
    all_ok(&l.all(&["start", "--job-id", "k1", "--nodes", &n, "--script", &sc]), "start");
    let data = pattern((2 << 20) + 3, 8);
    fs::create_dir_all(l.mount(1, "k1").join("out")).unwrap();
    fs::write(l.mount(1, "k1").join("out/result"), &data).unwrap();

    let outs = l.all(&["stop", "--job-id", "k1", "--nodes", &n]);
    for (k, o) in outs.iter().enumerate() {
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            !o.status.success() && err.contains("outputs not verified") && err.contains("odfs recover --job k1"),
            "node {k}: {err}"
        );
        assert_eq!(l.records(k), ["k1"], "node {k} keeps its record");
        assert!(!entries(&l.nvme(k)).is_empty(), "node {k} keeps its data");
    }
    assert!(l.processes().is_empty(), "services are stopped while the data is kept");
    // Starting a job of the same id now is refused: its data is kept.
    let again = l.on(0, &["start", "--job-id", "k1", "--nodes", &n]);
    assert!(String::from_utf8_lossy(&again.stderr).contains("has data kept on this node"));

    fs::remove_file(l.dir.path().join("store")).unwrap();
    let l = &l;
    let outs = each(l.nodes.len(), |k| l.plain(&["recover", "--job", "k1", "--node", &l.nodes[k]]));
    all_ok(&outs, "odfs recover");
    assert_bytes(&fs::read(dst.join("result")).unwrap(), &data, "recovered output");
    assert!(dst.join(".odfs-stage-out.complete").exists());
    l.assert_clean();
}

#[test]
fn stages_use_the_job_users_own_s3_credentials_never_roots() {
    let l = Launch::new(1, "");
    let n = l.node_list();
    let s3 = S3Server::s3s(&l.dir.path().join("s3"), &["lab"]);
    let data = pattern(300_000, 3);
    fs::create_dir_all(s3.object_path("lab", "ds")).unwrap();
    fs::write(s3.object_path("lab", "ds/x"), &data).unwrap();
    // The site gives an endpoint but no staging account.
    l.site_append(&format!("[stage]\nendpoint_url = \"{}\"\npath_style = true\nregion = \"us-east-1\"\n", s3.url()));
    let script = l.dir.path().join("in.sh");
    fs::write(&script, "#!/bin/sh\n#ODFS stage-in s3://lab/ds /data\n").unwrap();
    let sc = script.display().to_string();
    // A root-only credentials file with working keys, as a site might keep for itself.
    let roots = l.dir.path().join("root-credentials");
    fs::write(&roots, credentials_file_text()).unwrap();
    fs::set_permissions(&roots, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();

    let user = TestUser::create("cr");
    let home = l.dir.path().join("home");
    let aws = home.join(".aws");
    fs::create_dir_all(&aws).unwrap();
    let run = |cmd: &str, args: &[&str]| {
        let o = std::process::Command::new(cmd).args(args).output().unwrap();
        assert!(o.status.success(), "{cmd} {args:?}: {}", String::from_utf8_lossy(&o.stderr));
    };
    run("usermod", &["-d", &home.display().to_string(), &user.name]);
    // The user points ~/.aws/credentials at root's file: reading it as the user fails, so the
    // stage is refused instead of borrowing root's keys.
    std::os::unix::fs::symlink(&roots, aws.join("credentials")).unwrap();
    run("chown", &["-R", &format!("{}:{}", user.uid, user.gid), &home.display().to_string()]);
    let out = l.on(0, &["start", "--job-id", "c1", "--nodes", &n, "--user", &user.name, "--script", &sc]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("credentials as") && err.contains("Permission denied"), "{err}");
    // As after any failed start, the launcher runs the stop (Slurm runs the epilog).
    all_ok(&[l.on(0, &["stop", "--job-id", "c1", "--nodes", &n])], "stop after the failed start");

    // With keys of their own, the user's stage-in works, and the data is theirs.
    fs::remove_file(aws.join("credentials")).unwrap();
    fs::write(aws.join("credentials"), credentials_file_text()).unwrap();
    run("chown", &["-R", &format!("{}:{}", user.uid, user.gid), &home.display().to_string()]);
    all_ok(&[l.on(0, &["start", "--job-id", "c2", "--nodes", &n, "--user", &user.name, "--script", &sc])], "start");
    let p = l.mount(0, "c2").join("data/x");
    assert_bytes(&fs::read(&p).unwrap(), &data, "staged with the user's keys");
    assert_eq!(
        std::os::unix::fs::MetadataExt::uid(&fs::metadata(&p).unwrap()),
        user.uid,
        "the user owns the staged file"
    );
    assert!(l.event_log(0).contains(&format!("S3 credentials: {}'s own", user.name)), "{}", l.event_log(0));
    all_ok(&[l.on(0, &["stop", "--job-id", "c2", "--nodes", &n])], "stop");
    l.assert_clean();
}

#[test]
fn a_metadata_service_on_every_node_serves_striped_directories() {
    let l = Launch::new(4, "");
    let n = l.node_list();
    all_ok(&l.all(&["start", "--job-id", "m1", "--nodes", &n, "--meta", "0"]), "start");
    let metads: Vec<u32> = l
        .processes()
        .into_iter()
        .filter(|&p| fs::read_to_string(format!("/proc/{p}/cmdline")).unwrap_or_default().contains("metad.toml"))
        .collect();
    assert_eq!(metads.len(), 4, "one metad per node");
    // A striped directory through node 2's mount, filled through node 3's, read through node 0's.
    let d = l.mount(2, "m1").join("wide");
    let out = std::process::Command::new(bin_dir().join("odfs")).args(["mkdir", "-c", "-1"]).arg(&d).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for i in 0..100 {
        fs::write(l.mount(3, "m1").join(format!("wide/f{i}")), format!("{i}")).unwrap();
    }
    let mut names: Vec<String> = fs::read_dir(l.mount(0, "m1").join("wide"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names.len(), 100);
    assert_eq!(fs::read_to_string(l.mount(0, "m1").join("wide/f42")).unwrap(), "42");
    let layout = getfattr(&d, "odfs.dir_layout");
    assert!(layout.starts_with("stripe_count=4 shards="), "{layout}");
    all_ok(&l.all(&["stop", "--job-id", "m1", "--nodes", &n]), "stop");
    l.assert_clean();
}

#[test]
fn the_jobs_user_sets_layouts_unless_the_site_leaves_them_to_root() {
    let l = Launch::new(2, "");
    let n = l.node_list();
    let user = TestUser::create("ul");
    let odfs_bin = bin_dir().join("odfs").display().to_string();
    let setstripe_as_user =
        |d: &Path, count: &str| user.run(&odfs_bin, &[Path::new("setstripe"), Path::new("-c"), Path::new(count), d]);
    let stripe_count = |d: &Path| {
        let o = std::process::Command::new(&odfs_bin).args(["getstripe", "-d", "-c"]).arg(d).output().unwrap();
        assert!(o.status.success(), "getstripe: {}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    };
    // By default the job's user lays out their own filesystem.
    all_ok(&l.all(&["start", "--job-id", "u1", "--nodes", &n, "--user", &user.name]), "start");
    let d = l.mount(0, "u1").join("d");
    assert!(user.run("mkdir", &[&d]).status.success());
    let o = setstripe_as_user(&d, "2");
    assert!(o.status.success(), "the owner may: {}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(stripe_count(&d), "2");
    all_ok(&l.all(&["stop", "--job-id", "u1", "--nodes", &n]), "stop");

    // user_layouts = false: only root changes layouts; the user's attempts are refused and change nothing.
    l.site_append("user_layouts = false\n");
    all_ok(&l.all(&["start", "--job-id", "u2", "--nodes", &n, "--user", &user.name]), "start");
    let d = l.mount(0, "u2").join("d");
    assert!(user.run("mkdir", &[&d]).status.success());
    let before = stripe_count(&d);
    assert_ne!(before, "1");
    let o = setstripe_as_user(&d, "1");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("not permitted"), "setstripe as the user: {err}");
    let o = user.run(
        "setfattr",
        &[Path::new("-n"), Path::new("odfs.layout"), Path::new("-v"), Path::new("stripe_count=1"), &d],
    );
    assert!(!o.status.success(), "setfattr as the user must be refused");
    assert!(String::from_utf8_lossy(&o.stderr).contains("Operation not permitted"));
    assert_eq!(stripe_count(&d), before, "nothing changed");
    // Root still may.
    all_ok(&[std::process::Command::new(&odfs_bin).args(["setstripe", "-c", "1"]).arg(&d).output().unwrap()], "root");
    assert_eq!(stripe_count(&d), "1");
    all_ok(&l.all(&["stop", "--job-id", "u2", "--nodes", &n]), "stop");
    l.assert_clean();
}
