//! Stage-in and stage-out against a real S3-compatible server on loopback (s3s-fs, or
//! moto_server where keys a filesystem cannot hold are needed) and from a POSIX tree, through
//! the `odfs` command and the stage agents of a 4-node local filesystem.

use odfs_client::Ctx;
use odfs_tests::*;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// `odfs ARGS` against `fs` with the server's credentials in the environment.
fn odfs_command(fs: &LocalFs, env: &[(&'static str, String)], args: &[&str]) -> Command {
    let mut c = Command::new(bin_dir().join("odfs"));
    c.args(args)
        .env("ODFS_FS", fs.config_path())
        .env("ODFS_BIN_DIR", bin_dir())
        .env_remove("AWS_PROFILE")
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())));
    c
}

/// Runs `odfs ARGS` against `fs` with the server's credentials in the environment.
fn odfs_stage(fs: &LocalFs, env: &[(&'static str, String)], args: &[&str]) -> Output {
    odfs_command(fs, env, args).output().expect("run odfs")
}

/// Starts `odfs ARGS` in the background, its output collected.
fn odfs_spawn(fs: &LocalFs, env: &[(&'static str, String)], args: &[&str]) -> std::process::Child {
    odfs_command(fs, env, args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start odfs")
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn ok(o: Output) -> String {
    assert!(o.status.success(), "odfs failed ({}):\n{}", o.status, text(&o));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// Percentages of the per-node lines of a stage report ("node k: ... (NN%)").
fn shares(report: &str) -> Vec<f64> {
    report
        .lines()
        .filter(|l| l.trim_start().starts_with("node "))
        .filter_map(|l| l.split('(').nth(1)?.split('%').next()?.parse().ok())
        .collect()
}

/// A source tree: `small` files of 1–60 KiB in 10 directories plus the large files given.
fn make_tree(root: &Path, small: usize, large: &[usize]) -> BTreeMap<String, String> {
    let mut sums = BTreeMap::new();
    for i in 0..small {
        let rel = format!("d{}/f{i:04}.bin", i % 10);
        let data = pattern(1024 + (i * 7919) % (60 << 10), i as u64);
        std::fs::create_dir_all(root.join(format!("d{}", i % 10))).unwrap();
        std::fs::write(root.join(&rel), &data).unwrap();
        sums.insert(rel, sha256(&data));
    }
    for (k, &len) in large.iter().enumerate() {
        let rel = format!("large/big{k}.bin");
        let data = pattern(len, 1000 + k as u64);
        std::fs::create_dir_all(root.join("large")).unwrap();
        std::fs::write(root.join(&rel), &data).unwrap();
        sums.insert(rel, sha256(&data));
    }
    sums
}

/// Every file of `sums` at `dir` in odfs has exactly those bytes.
fn assert_odfs_tree(fs: &LocalFs, dir: &str, sums: &BTreeMap<String, String>) {
    let rt = runtime();
    let c = rt.block_on(fs.client());
    for (rel, want) in sums {
        let got = sha256(&rt.block_on(lib_read(&c, &format!("{dir}/{rel}"))));
        assert_eq!(&got, want, "odfs:{dir}/{rel} differs from the source");
    }
}

#[test]
fn stage_in_from_s3_is_byte_identical_and_every_agent_moves_its_share() {
    let tmp = tempfile::tempdir().unwrap();
    let s3 = S3Server::s3s(&tmp.path().join("s3"), &["data"]);
    let sums = make_tree(&s3.object_path("data", "set"), 1000, &[200 << 20, (200 << 20) + 12345, 210 << 20]);
    let fs = LocalFs::up(4, &[]);
    let url = s3.url();
    let args = ["stage-in", "s3://data/set", "odfs:/in", "--endpoint-url", &url, "--path-style"];
    let out = ok(odfs_stage(&fs, &s3.env(), &args));
    assert!(out.contains("1003 files"), "{out}");
    // Their ETags are MD5s of the whole object: checking them needs the split files read back.
    assert!(out.contains("split files: 0 verified as written (stored's CRC32C), 3 read back"), "{out}");
    let sh = shares(&out);
    assert_eq!(sh.len(), 4, "one line per agent:\n{out}");
    // Each agent starts with its share of the 16 MiB ranges (nine, eight, eight, eight: 20.0% to
    // 22.5% of the 640 MiB); the small files, the three short ranges and four 16 MiB ranges
    // (the smallest quarter of the work, each item weighed at its bytes + 64 KiB) wait in the
    // pool for the agents that run low. So no agent moves less than 20% (19.99%) nor more than
    // its start and the whole pool (40.0%).
    for s in &sh {
        assert!((19.0..=41.0).contains(s), "each agent moves its share of the bytes: {sh:?}\n{out}");
    }
    assert_odfs_tree(&fs, "/in", &sums);

    // The manifest names every file, its ETag and how it was verified.
    let rt = runtime();
    let c = rt.block_on(fs.client());
    let m: serde_json::Value = serde_json::from_slice(&rt.block_on(lib_read(&c, "/in/.odfs-stage-in.json"))).unwrap();
    let files = m["files"].as_object().unwrap();
    assert_eq!(files.len(), 1003);
    assert_eq!(files["large/big1.bin"]["size"], (200 << 20) + 12345);
    assert!(files["d3/f0003.bin"]["verified"].as_str().unwrap().contains("md5"), "{}", files["d3/f0003.bin"]);
    assert!(files["large/big0.bin"]["verified"].as_str().unwrap().contains("crc32c"));

    // A re-run finds everything complete.
    let again = ok(odfs_stage(&fs, &s3.env(), &args));
    assert!(again.contains("0 files") && again.contains("1003 already complete"), "{again}");

    // One object rewritten with the same size and mtime: only its ETag (which this server
    // leaves out of listings, so it is asked for) tells, and only it is copied again.
    let path = s3.object_path("data", "set/d3/f0003.bin");
    let mtime = std::fs::metadata(&path).unwrap().modified().unwrap();
    let mut data = std::fs::read(&path).unwrap();
    data[0] ^= 0xff;
    std::fs::write(&path, &data).unwrap();
    std::fs::File::options().write(true).open(&path).unwrap().set_modified(mtime).unwrap();
    let changed = ok(odfs_stage(&fs, &s3.env(), &args));
    assert!(changed.contains(" 1 files") && changed.contains("1002 already complete"), "{changed}");
    assert_eq!(rt.block_on(lib_read(&c, "/in/d3/f0003.bin")), data);
}

#[test]
fn stage_out_to_s3_is_verified_with_a_manifest_and_the_marker_last() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let sums = make_tree(&src, 200, &[80 << 20, (40 << 20) + 7]);
    let s3 = S3Server::s3s(&tmp.path().join("s3"), &["out"]);
    let fs = LocalFs::up(4, &[]);
    let out = ok(odfs_stage(&fs, &[], &["stage-in", src.to_str().unwrap(), "odfs:/results"]));
    // The 80 MiB file is split (above 64 MiB); a POSIX source has no digest of its own, so the
    // CRC32C stored returned for each write is the check and nothing is read back.
    assert!(out.contains("split files: 1 verified as written (stored's CRC32C), 0 read back"), "{out}");
    let url = s3.url();
    let out = ok(odfs_stage(
        &fs,
        &s3.env(),
        &["stage-out", "odfs:/results", "s3://out/run1", "--endpoint-url", &url, "--path-style", "--part-size", "8M"],
    ));
    assert!(out.contains("202 files"), "{out}");
    let mut newest_object = std::time::UNIX_EPOCH;
    for (rel, want) in &sums {
        let p = s3.object_path("out", &format!("run1/{rel}"));
        assert_eq!(&sha256(&std::fs::read(&p).unwrap()), want, "s3://out/run1/{rel} differs");
        newest_object = newest_object.max(std::fs::metadata(&p).unwrap().modified().unwrap());
    }
    let marker = s3.object_path("out", "run1/.odfs-stage-out.complete");
    let manifest = s3.object_path("out", "run1/.odfs-stage-out.json");
    let marker_time = std::fs::metadata(&marker).expect("completion marker").modified().unwrap();
    assert!(marker_time >= newest_object, "the marker is written after every object");
    assert!(marker_time >= std::fs::metadata(&manifest).unwrap().modified().unwrap(), "and after the manifest");
    let m: serde_json::Value = serde_json::from_slice(&std::fs::read(&manifest).unwrap()).unwrap();
    let files = m["files"].as_object().unwrap();
    assert_eq!(files.len(), sums.len());
    for rel in sums.keys() {
        let e = &files[rel.as_str()];
        assert_eq!(e["size"].as_u64().unwrap(), std::fs::metadata(src.join(rel)).unwrap().len(), "{rel}");
        assert!(e["etag"].as_str().is_some_and(|t| !t.is_empty()), "{rel}: {e}");
    }
    // Split into 8 MiB parts: the 80 MiB file is a 10-part multipart object.
    assert!(files["large/big0.bin"]["etag"].as_str().unwrap().ends_with("-10"), "{}", files["large/big0.bin"]);

    // Nothing changed: a re-run uploads nothing.
    let again = ok(odfs_stage(
        &fs,
        &s3.env(),
        &["stage-out", "odfs:/results", "s3://out/run1", "--endpoint-url", &url, "--path-style", "--part-size", "8M"],
    ));
    assert!(again.contains("0 files") && again.contains("202 already complete"), "{again}");

    // Back in from S3: the multipart object's ETag is no MD5 of its bytes, so the split file is
    // verified by stored's CRC32C of what it wrote, byte-identical without being read back.
    let back = ok(odfs_stage(
        &fs,
        &s3.env(),
        &["stage-in", "s3://out/run1", "odfs:/back", "--endpoint-url", &url, "--path-style"],
    ));
    assert!(back.contains("split files: 1 verified as written (stored's CRC32C), 0 read back"), "{back}");
    // Checked last: a client of this test that ends keeps its leases until they lapse, and a
    // change under them would wait for that.
    assert_odfs_tree(&fs, "/results", &sums);
    assert_odfs_tree(&fs, "/back", &sums);
    let rt = runtime();
    let c = rt.block_on(fs.client());
    let m: serde_json::Value = serde_json::from_slice(&rt.block_on(lib_read(&c, "/back/.odfs-stage-in.json"))).unwrap();
    assert_eq!(m["files"]["large/big0.bin"]["verified"], "crc32c", "{}", m["files"]["large/big0.bin"]);
    // Stage-out sent every object's CRC32C and the server keeps it: a whole object is checked
    // against it (no MD5 computed), the ETag's MD5 then adds nothing.
    assert_eq!(m["files"]["d3/f0003.bin"]["verified"], "crc32c", "{}", m["files"]["d3/f0003.bin"]);
}

/// What metad logs when a change waited a whole lease for a client that never answered.
const LEASE_WAITED: &str = "did not answer a recall within the lease";

#[test]
fn mounts_that_ended_leave_no_lease_for_the_stage_out_to_wait_for() {
    let tmp = tempfile::tempdir().unwrap();
    let s3 = S3Server::s3s(&tmp.path().join("s3"), &["out"]);
    let fs = LocalFs::up(4, &[]);
    // Two mounts (two nodes' clients): one writes, both list and read, so both hold leases on
    // the files and on /res, which the stage-out then seals.
    let (mut a, mut b) = (FuseMount::start(&fs), FuseMount::start_at(&fs, "mnt2", &[]));
    std::fs::create_dir(a.p("res")).unwrap();
    let data: Vec<Vec<u8>> = (0..2).map(|i| pattern((4 << 20) + i * 4099, i as u64)).collect();
    for (i, d) in data.iter().enumerate() {
        std::fs::write(a.p(&format!("res/f{i}")), d).unwrap();
    }
    for m in [&a, &b] {
        assert_eq!(entries(&m.p("res")), ["f0", "f1"]);
        for (i, d) in data.iter().enumerate() {
            assert_bytes(&std::fs::read(m.p(&format!("res/f{i}"))).unwrap(), d, "read through a mount");
        }
    }
    for m in [&mut a, &mut b] {
        let st = Command::new("fusermount3").arg("-u").arg(&m.path).status().unwrap();
        assert!(st.success(), "fusermount3 -u {}", m.path.display());
        assert!(m.wait_exit(Duration::from_secs(10)).is_some_and(|s| s.success()), "odfs-fuse ends:\n{}", m.log_text());
    }
    let url = s3.url();
    let t = Instant::now();
    let out = ok(odfs_stage(
        &fs,
        &s3.env(),
        &["stage-out", "odfs:/res", "s3://out/res", "--endpoint-url", &url, "--path-style"],
    ));
    eprintln!("stage-out after the unmounts: {:.2} s", t.elapsed().as_secs_f64());
    assert!(out.contains("2 files"), "{out}");
    for (i, d) in data.iter().enumerate() {
        assert_bytes(&std::fs::read(s3.object_path("out", &format!("res/f{i}"))).unwrap(), d, "the object");
    }
    let metad = std::fs::read_to_string(fs.node_dir(0).join("metad.log")).unwrap();
    assert!(!metad.contains(LEASE_WAITED), "a change waited out a lease:\n{metad}");
    let byes = metad.matches("a client's session ended by itself").count();
    assert!(byes >= 2, "both mounts said goodbye ({byes}):\n{metad}");
    // odfs local down after the write and the stage-out: the stage agents say goodbye too,
    // and nothing waits a lease.
    let t = Instant::now();
    fs.down();
    eprintln!("odfs local down after the stage-out: {:.2} s", t.elapsed().as_secs_f64());
    let metad = std::fs::read_to_string(fs.node_dir(0).join("metad.log")).unwrap();
    assert!(!metad.contains(LEASE_WAITED), "a change waited out a lease:\n{metad}");
}

#[test]
fn a_killed_mount_s_sessions_are_ended_for_it_by_local_down() {
    // `odfs local up` with its own mount (node 0's odfs-fuse keeps its session file).
    let dir = tempfile::Builder::new().prefix("odfs-test-").tempdir().unwrap();
    odfs_ok(&["local", "up", "--root", dir.path().to_str().unwrap(), "--nodes", "2"]);
    let fs = LocalFs { dir, nodes: 2 };
    let mnt = fs.root().join("mnt");
    std::fs::write(mnt.join("f"), b"kept").unwrap();
    assert_eq!(std::fs::read(mnt.join("f")).unwrap(), b"kept");
    let session = fs.node_dir(0).join("fuse.session");
    let id = std::fs::read_to_string(&session).expect("the mount's session file");
    assert!(u64::from_str_radix(id.trim(), 16).is_ok(), "a client id in hex: {id:?}");
    fs.kill9("fuse", 0);
    let down = fs.down();
    assert!(down.contains("ended the metadata sessions of odfs-fuse"), "{down}");
    assert!(!session.exists(), "the file goes with the sessions");
    let metad = std::fs::read_to_string(fs.node_dir(0).join("metad.log")).unwrap();
    assert!(metad.contains("a client's session ended by its node"), "{metad}");
    assert!(!metad.contains(LEASE_WAITED), "{metad}");
}

#[test]
fn s3_killed_during_stage_out_fails_clearly_and_a_rerun_uploads_only_the_rest() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let sums = make_tree(&src, 300, &[]);
    let mut s3 = S3Server::s3s(&tmp.path().join("s3"), &["out"]);
    let fs = LocalFs::up(4, &[]);
    ok(odfs_stage(&fs, &[], &["stage-in", src.to_str().unwrap(), "odfs:/results"]));
    let url = s3.url();
    let args = [
        "stage-out",
        "odfs:/results",
        "s3://out/run",
        "--endpoint-url",
        &url,
        "--path-style",
        // Slow enough to be cut in the middle, and few attempts so the failure comes quickly.
        "--max-bandwidth",
        "2M",
        "--max-attempts",
        "2",
        "--concurrency",
        "2",
        // The server stays down: give up on it after a moment instead of the default minute.
        "--unreachable-secs",
        "1",
    ];
    let child = odfs_spawn(&fs, &s3.env(), &args);
    let bucket_dir = s3.object_path("out", "run");
    let t = Instant::now();
    while walk_count(&bucket_dir) < 40 {
        assert!(t.elapsed() < Duration::from_secs(60), "stage-out made no progress");
        std::thread::sleep(Duration::from_millis(20));
    }
    s3.kill();
    let out = child.wait_with_output().unwrap();
    let all = text(&out);
    assert!(!out.status.success(), "stage-out with the server gone must fail:\n{all}");
    assert!(all.contains("FAILED") && all.contains("cannot reach the S3 endpoint"), "names what failed:\n{all}");
    assert!(!s3.object_path("out", "run/.odfs-stage-out.complete").exists(), "no completion marker after a failure");
    assert_odfs_tree(&fs, "/results", &sums);
    let uploaded = walk_count(&bucket_dir);

    s3.start();
    let out = ok(odfs_stage(&fs, &s3.env(), &args[..6]));
    let skipped: usize = out.split(" already complete").next().unwrap().rsplit(' ').next().unwrap().parse().unwrap();
    let copied: usize = out.split(" files (").next().unwrap().rsplit(' ').next().unwrap().parse().unwrap();
    assert!(skipped > 0 && skipped + copied == sums.len(), "only what was missing: {out}");
    assert!(
        skipped >= uploaded.saturating_sub(8),
        "objects complete before the kill are kept: {uploaded} there, {out}"
    );
    for (rel, want) in &sums {
        assert_eq!(&sha256(&std::fs::read(s3.object_path("out", &format!("run/{rel}"))).unwrap()), want, "{rel}");
    }
    assert!(s3.object_path("out", "run/.odfs-stage-out.complete").exists());
}

/// Regular files below `dir` (0 when it does not exist yet).
#[test]
fn a_store_down_for_a_moment_is_waited_out() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    let sums = make_tree(&src, 50, &[]);
    let mut s3 = S3Server::s3s(&tmp.path().join("s3"), &["out"]);
    let fs = LocalFs::up(4, &[]);
    ok(odfs_stage(&fs, &[], &["stage-in", src.to_str().unwrap(), "odfs:/results"]));
    let url = s3.url();
    // The store is down when the stage-out starts (connection refused) and back a moment later.
    s3.kill();
    // One attempt per request: the SDK's own retries must not be what waits the outage out.
    let args =
        ["stage-out", "odfs:/results", "s3://out/run", "--endpoint-url", &url, "--path-style", "--max-attempts", "1"];
    let child = odfs_spawn(&fs, &s3.env(), &args);
    std::thread::sleep(Duration::from_secs(3));
    s3.start();
    let out = child.wait_with_output().unwrap();
    let all = text(&out);
    assert!(out.status.success(), "the stage-out must wait for the store:\n{all}");
    assert!(all.contains("unreachable"), "it says what it waits for:\n{all}");
    for (rel, want) in &sums {
        let got = std::fs::read(s3.object_path("out", &format!("run/{rel}"))).unwrap_or_default();
        assert_eq!(&sha256(&got), want, "s3://out/run/{rel}");
    }
    assert!(s3.object_path("out", "run/.odfs-stage-out.complete").exists(), "{all}");
}

fn walk_count(dir: &Path) -> usize {
    if dir.exists() {
        walk_files(dir).len()
    } else {
        0
    }
}

#[test]
fn throttled_s3_completes_with_retries() {
    let tmp = tempfile::tempdir().unwrap();
    let s3 = S3Server::s3s(&tmp.path().join("s3"), &["data", "out"]);
    let sums = make_tree(&s3.object_path("data", "set"), 150, &[70 << 20]);
    let proxy = ThrottleProxy::start(s3.port, 20);
    let fs = LocalFs::up(4, &[]);
    let url = proxy.url();
    let out = ok(odfs_stage(
        &fs,
        &s3.env(),
        &["stage-in", "s3://data/set", "odfs:/in", "--endpoint-url", &url, "--path-style"],
    ));
    assert!(out.contains("151 files"), "{out}");
    assert_odfs_tree(&fs, "/in", &sums);
    let out = ok(odfs_stage(
        &fs,
        &s3.env(),
        &["stage-out", "odfs:/in", "s3://out/copy", "--endpoint-url", &url, "--path-style"],
    ));
    assert!(out.contains("151 files"), "{out}");
    for (rel, want) in &sums {
        assert_eq!(&sha256(&std::fs::read(s3.object_path("out", &format!("copy/{rel}"))).unwrap()), want, "{rel}");
    }
    let throttled = proxy.throttled.load(std::sync::atomic::Ordering::Relaxed);
    assert!(throttled > 50, "the proxy answered {throttled} requests with 503 SlowDown");
}

#[test]
fn unsafe_keys_are_refused_and_listed_and_nothing_lands_outside() {
    let tmp = tempfile::tempdir().unwrap();
    let s3 = S3Server::moto(tmp.path());
    let long = "x".repeat(256);
    let keys = ["ds/ok/a.txt", "ds/../escape", "ds/a/../../b", "ds//abs", "ds/a//b", "ds/./dot", &format!("ds/{long}")];
    let script = format!(
        "import boto3,sys\ns3=boto3.client('s3',endpoint_url='{}',region_name='us-east-1')\n\
         s3.create_bucket(Bucket='keys')\nfor k in sys.argv[1:]:\n    s3.put_object(Bucket='keys',Key=k,Body=b'data of '+k.encode())\n\
         s3.create_bucket(Bucket='evil')\nfor k in ['ds/a\\x00b', 'ds/ok']:\n    s3.put_object(Bucket='evil',Key=k,Body=b'x')\n",
        s3.url()
    );
    let out =
        Command::new("python3").arg("-c").arg(script).args(keys).envs(s3.env()).output().expect("python3 with boto3");
    assert!(out.status.success(), "seeding moto: {}", String::from_utf8_lossy(&out.stderr));
    let fs = LocalFs::up(2, &[]);
    let url = s3.url();
    let o =
        odfs_stage(&fs, &s3.env(), &["stage-in", "s3://keys/ds", "odfs:/ds", "--endpoint-url", &url, "--path-style"]);
    let all = text(&o);
    assert!(!o.status.success(), "refused keys make the stage fail:\n{all}");
    for k in &keys[1..] {
        assert!(all.contains(&format!("refused {k:?}")), "{k} not listed as refused:\n{all}");
    }
    assert!(all.contains("6 source names refused"), "{all}");
    // A key with a NUL byte is sent raw in the listing's XML, which no XML reader takes: the
    // stage fails naming the key, escaped.
    let o =
        odfs_stage(&fs, &s3.env(), &["stage-in", "s3://evil/ds", "odfs:/evil", "--endpoint-url", &url, "--path-style"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("the listing holds the key ds/a\\u{0}b which has a character an S3 listing cannot carry")
            && !err.contains('\0')
            && err.trim_end().lines().count() == 1,
        "{err:?}"
    );
    let rt = runtime();
    let c = rt.block_on(fs.client());
    assert_eq!(rt.block_on(lib_read(&c, "/ds/ok/a.txt")), b"data of ds/ok/a.txt");
    let root: Vec<Vec<u8>> = rt
        .block_on(c.readdir_all(&Ctx::root(), odfs_proto::InodeId::ROOT, false))
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(root, vec![b"ds".to_vec()], "nothing outside the destination");
    let ds: Vec<String> = rt
        .block_on(c.readdir_all(&Ctx::root(), rt.block_on(c.resolve(&Ctx::root(), "/ds", true)).unwrap().ino, false))
        .unwrap()
        .into_iter()
        .map(|e| String::from_utf8(e.name).unwrap())
        .collect();
    let mut ds = ds;
    ds.sort();
    assert_eq!(ds, [".odfs-stage-in.json", "ok"]);
}

#[test]
fn bad_urls_credentials_buckets_and_endpoints_are_one_line_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let s3 = S3Server::s3s(&tmp.path().join("s3"), &["data"]);
    let fs = LocalFs::up(1, &[]);
    let url = s3.url();
    let one_line = |env: &[(&'static str, String)], args: &[&str], want: &str| {
        let o = odfs_stage(&fs, env, args);
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: one line: {err}");
        assert!(err.contains(want), "{args:?}: expected {want:?} in: {err}");
    };
    let e = "--endpoint-url";
    one_line(&s3.env(), &["stage-in", "s3://", "odfs:/x"], "no bucket");
    one_line(&s3.env(), &["stage-in", "s3://Bad_Name/x", "odfs:/x"], "not a valid S3 bucket");
    one_line(&s3.env(), &["stage-in", "gs://b/x", "odfs:/x"], "unknown scheme");
    // A URL that is almost s3:// is named as malformed, not taken for a local path.
    one_line(
        &s3.env(),
        &["stage-in", "s3:/data/ds", "odfs:/x"],
        "s3:/data/ds: malformed S3 URL: write s3://BUCKET/PREFIX",
    );
    // Endpoints that cannot be one are refused at once, not retried as unreachable.
    for (bad, why) in [
        ("http//127.0.0.1:45123", "no scheme"),
        ("ftp://127.0.0.1:45123", "the scheme is \"ftp\""),
        ("http://", "no host"),
        ("http://127.0.0.1:99999", "the port \"99999\" is not a number"),
    ] {
        let args = ["stage-in", "s3://data/x", "odfs:/x", e, bad, "--path-style"];
        one_line(&s3.env(), &args, &format!("--endpoint-url {bad:?} is not an S3 endpoint URL: {why}"));
    }
    one_line(
        &s3.env(),
        &["stage-in", "s3://nosuch/x", "odfs:/x", e, &url, "--path-style"],
        "bucket \"nosuch\" does not exist",
    );
    let mut wrong = s3.env();
    wrong[1].1 = "not-the-secret".into();
    one_line(&wrong, &["stage-in", "s3://data/x", "odfs:/x", e, &url, "--path-style"], "check the credentials");
    let none: Vec<(&'static str, String)> =
        vec![("AWS_CONFIG_FILE", "/nonexistent".into()), ("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent".into())];
    let o = Command::new(bin_dir().join("odfs"))
        .args(["stage-in", "s3://data/x", "odfs:/x", e, &url, "--path-style"])
        .env("ODFS_FS", fs.config_path())
        .env_remove("AWS_ACCESS_KEY_ID")
        .env_remove("AWS_SECRET_ACCESS_KEY")
        .envs(none)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("no S3 credentials found"), "{err}");
    // Where they were looked for, the missing file named; no debug dump of the provider chain.
    assert!(err.contains("/nonexistent (which does not exist)"), "{err}");
    assert!(!err.contains('{') && !err.contains("ProviderChainError") && err.trim().lines().count() == 1, "{err}");
    one_line(
        &s3.env(),
        &[
            "stage-in",
            "s3://data/x",
            "odfs:/x",
            e,
            "http://127.0.0.1:1",
            "--path-style",
            "--max-attempts",
            "1",
            "--unreachable-secs",
            "0",
        ],
        "cannot reach the S3 endpoint http://127.0.0.1:1",
    );
    // A web server that is not S3 is named so, not taken for a missing bucket.
    let web = http_answering("404 Not Found", "<html><body>no such page</body></html>");
    one_line(
        &s3.env(),
        &["stage-in", "s3://data/x", "odfs:/x", e, &web, "--path-style"],
        &format!("the endpoint {web} did not answer as S3 does (HTTP 404 without an S3 error)"),
    );
    // A prefix with no objects is staged (nothing) with a warning that names it.
    let o = odfs_stage(&fs, &s3.env(), &["stage-in", "s3://data/none", "odfs:/empty", e, &url, "--path-style"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        err.contains(
            "odfs: warning: s3://data/none/ holds no files: nothing was staged; check the bucket and the prefix"
        ),
        "{err}"
    );
    // A POSIX source with a path longer than a program can open: refused by name, the rest staged.
    let src = tmp.path().join("deep");
    std::fs::create_dir(&src).unwrap();
    std::fs::write(src.join("ok"), b"fine").unwrap();
    let name = "d".repeat(250);
    let made = Command::new("python3")
        .arg("-c")
        .arg(format!(
            "import os\nos.chdir({:?})\nfor i in range(20):\n    os.mkdir('{name}')\n    os.chdir('{name}')\nopen('f','w').write('x')\n",
            src.display().to_string()
        ))
        .status()
        .unwrap();
    assert!(made.success(), "a 5,000-byte path made by relative steps");
    let o = odfs_stage(&fs, &[], &["stage-in", &src.display().to_string(), "odfs:/deep"]);
    let all = text(&o);
    assert_eq!(o.status.code(), Some(1), "{all}");
    // The first directory whose path reaches PATH_MAX (4,096 with its NUL) is refused.
    let root_len = src.as_os_str().len();
    let depth = (1..=20).find(|k| root_len + k * (name.len() + 1) >= 4096).unwrap();
    let refused = vec![name.as_str(); depth].join("/");
    assert!(
        all.contains(&format!("refused {refused:?}: its path is {} bytes long", root_len + 1 + refused.len()))
            && all.contains("more than the 4095 bytes a program can open"),
        "{}",
        &all[..all.len().min(2000)]
    );
    let rt = runtime();
    let c = rt.block_on(fs.client());
    assert_eq!(rt.block_on(lib_read(&c, "/deep/ok")), b"fine");
}

/// `http://ADDR` of a server that answers every request with `status` and an HTML `body`.
fn http_answering(status: &'static str, body: &'static str) -> String {
    use std::io::{BufRead, BufReader, Write};
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    std::thread::spawn(move || {
        for c in l.incoming().flatten() {
            let mut r = BufReader::new(c);
            let mut line = String::new();
            while r.read_line(&mut line).map(|n| n > 0).unwrap_or(false) && line != "\r\n" {
                line.clear();
            }
            let reply = format!(
                "HTTP/1.1 {status}\r\nContent-Type: text/html\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = r.get_mut().write_all(reply.as_bytes());
        }
    });
    url
}

/// An endpoint that takes connections and never answers is announced within seconds — what is
/// waited for and until when — and the stage fails at `--unreachable-secs`, not after the SDK's
/// read timeout times its attempts (485 s once).
#[test]
fn a_silent_endpoint_is_announced_at_once_and_given_up_at_its_bound() {
    use std::io::BufRead;
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", silent.local_addr().unwrap());
    // Takes every connection and keeps it, reading nothing, answering nothing.
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for c in silent.incoming() {
            held.push(c);
        }
    });
    let fs = LocalFs::up(1, &[]);
    let env = [("AWS_ACCESS_KEY_ID", "k".to_string()), ("AWS_SECRET_ACCESS_KEY", "s".to_string())];
    let args =
        ["stage-in", "s3://data/ds", "odfs:/x", "--endpoint-url", &url, "--path-style", "--unreachable-secs", "15"];
    let t = Instant::now();
    let mut child = odfs_spawn(&fs, &env, &args);
    let stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut lines = Vec::new();
    let mut told = None;
    for line in stderr.lines() {
        let line = line.unwrap();
        if told.is_none() && line.contains("has not answered") {
            told = Some(t.elapsed());
        }
        lines.push(line);
    }
    let status = child.wait().unwrap();
    let took = t.elapsed();
    let all = lines.join("\n");
    let told = told.unwrap_or_else(|| panic!("no line about the silent endpoint: {all}"));
    eprintln!("announced after {told:?}, failed after {took:?}");
    assert!(
        all.contains(&format!("the S3 endpoint {url} has not answered a request for bucket \"data\" for 3 s"))
            && all.contains("waiting for it until ")
            && all.contains(" UTC (15 s in all, --unreachable-secs)"),
        "{all}"
    );
    assert_eq!(status.code(), Some(1), "{all}");
    let gave_up = format!("the S3 endpoint {url} did not answer a request for bucket \"data\" within 15 s");
    assert!(all.contains(&gave_up) && all.contains("is it up, and is it an S3 server?"), "{all}");
    assert!(told < Duration::from_secs(5), "the silence was announced only after {told:?}: {all}");
    assert!(took < Duration::from_secs(40), "a 15 s bound took {took:?}: {all}");
}

#[test]
fn stage_in_from_a_posix_tree_keeps_modes_and_times_and_resumes() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("pfs");
    let sums = make_tree(&src, 300, &[100 << 20]);
    std::fs::create_dir_all(src.join("empty/dir")).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(src.join("d1/f0001.bin"), std::fs::Permissions::from_mode(0o600)).unwrap();
    let when = std::time::UNIX_EPOCH + Duration::from_secs(1_500_000_000);
    std::fs::File::options().write(true).open(src.join("d2/f0002.bin")).unwrap().set_modified(when).unwrap();
    let fs = LocalFs::up(4, &[]);
    let out = ok(odfs_stage(&fs, &[], &["stage-in", src.to_str().unwrap(), "odfs:/pfs"]));
    assert!(out.contains("301 files"), "{out}");
    // The 100 MiB file is split into six 16 MiB ranges and one of 4 MiB. The 16 MiB ranges are
    // spread first (largest first onto the least-loaded agent: two, two, one, one); the small
    // files and the 4 MiB range wait in the pool (the smallest quarter of the work, each item
    // weighed at its bytes + 64 KiB) and go to whichever agents run low. So every agent fills
    // at least one 16 MiB range (14.7% of the 109 MiB) and none more than two and the whole
    // pool (41.3%).
    for s in shares(&out) {
        assert!((14.0..=42.0).contains(&s), "the large file is spread over every agent:\n{out}");
    }
    assert_odfs_tree(&fs, "/pfs", &sums);
    let rt = runtime();
    let c = rt.block_on(fs.client());
    let ctx = Ctx::root();
    let a = rt.block_on(c.resolve(&ctx, "/pfs/d1/f0001.bin", true)).unwrap();
    assert_eq!(a.mode & 0o7777, 0o600);
    let a = rt.block_on(c.resolve(&ctx, "/pfs/d2/f0002.bin", true)).unwrap();
    assert_eq!(a.mtime.sec, 1_500_000_000);
    let a = rt.block_on(c.resolve(&ctx, "/pfs/empty/dir", true)).unwrap();
    assert_eq!(a.kind, odfs_proto::meta::FileKind::Dir);

    // One file changed at the source: only it is copied again.
    std::fs::write(src.join("d5/f0005.bin"), b"changed").unwrap();
    let again = ok(odfs_stage(&fs, &[], &["stage-in", src.to_str().unwrap(), "odfs:/pfs"]));
    assert!(again.contains(" 1 files") && again.contains("300 already complete"), "{again}");
    assert_eq!(rt.block_on(lib_read(&c, "/pfs/d5/f0005.bin")), b"changed");

    // --seal: the verified tree is sealed; every file and directory of it refuses changes.
    let sealed = ok(odfs_stage(&fs, &[], &["stage-in", src.to_str().unwrap(), "odfs:/ro", "--seal"]));
    assert!(sealed.contains("sealed read-only: "), "{sealed}");
    for p in ["/ro", "/ro/d1", "/ro/d1/f0001.bin", "/ro/empty/dir"] {
        assert!(rt.block_on(c.resolve(&ctx, p, true)).unwrap().sealed, "{p} is not sealed");
    }
    let top = rt.block_on(c.resolve(&ctx, "/ro/d1", true)).unwrap();
    let e = rt.block_on(c.create(&ctx, top.ino, b"new", 0o644, true, None)).unwrap_err();
    assert_eq!(e.errno(), libc::EROFS, "{e}");
    let e = rt.block_on(c.unlink(&ctx, top.ino, b"f0001.bin")).unwrap_err();
    assert_eq!(e.errno(), libc::EROFS, "{e}");
    let o = odfs_stage(&fs, &[], &["stage-out", "odfs:/ro", tmp.path().join("o").to_str().unwrap(), "--seal"]);
    assert!(!o.status.success() && text(&o).contains("--seal seals a stage-in's destination"), "{}", text(&o));
}

/// The files a stage-in's manifest in odfs records, and whether it says it is in progress
/// (None while there is none).
fn stage_in_record(c: &odfs_client::Client, rt: &tokio::runtime::Runtime, path: &str) -> Option<(usize, bool)> {
    let data = rt.block_on(async {
        let a = c.resolve(&Ctx::root(), path, true).await.ok()?;
        let h = c.open(&Ctx::root(), a.ino, true, false, false).await.ok()?;
        let mut d = Vec::new();
        while let Ok(more) = h.read(d.len() as u64, 4 << 20).await {
            if more.is_empty() {
                break;
            }
            d.extend_from_slice(&more);
        }
        h.close().await.ok()?;
        Some(d)
    })?;
    let m: serde_json::Value = serde_json::from_slice(&data).ok()?;
    Some((m["files"].as_object()?.len(), m["in_progress"].as_bool().unwrap_or(false)))
}

/// A stage-in interrupted (Ctrl-C), or killed outright, has recorded what it verified as it
/// went: the next run copies only the rest, and the tree ends byte-identical.
#[test]
fn an_interrupted_or_killed_stage_in_records_its_progress_and_a_rerun_copies_only_the_rest() {
    const FILES: usize = 2000;
    let tmp = tempfile::tempdir().unwrap();
    let s3 = S3Server::s3s(&tmp.path().join("s3"), &["data"]);
    let sums = make_tree(&s3.object_path("data", "set"), FILES, &[]);
    let fs = LocalFs::up(4, &[]);
    let url = s3.url();
    let args = ["stage-in", "s3://data/set", "odfs:/ds", "--endpoint-url", &url, "--path-style"];
    // About 80 files a second: long enough to be stopped midway.
    let slow: Vec<&str> = args.iter().copied().chain(["--max-requests-per-sec", "80"]).collect();
    let rt = runtime();
    let c = rt.block_on(fs.client());
    let record = || stage_in_record(&c, &rt, "/ds/.odfs-stage-in.json");
    let grown_past = |n: usize| {
        wait_for(&format!("the running stage-in's record holds more than {n} files"), Duration::from_secs(60), || {
            let r = record();
            (r.is_some_and(|(files, going)| going && files > n), r)
        })
    };

    // Ctrl-C: the record is written at once, the command says what it holds, exit 130.
    let child = odfs_spawn(&fs, &s3.env(), &slow);
    grown_past(100);
    // SAFETY: kill(2) with the pid of a child this test started.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    let o = child.wait_with_output().unwrap();
    let said = text(&o);
    assert_eq!(o.status.code(), Some(130), "{said}");
    let (held, going) = record().expect("a record after the interruption");
    assert!(going && held > 100 && held < FILES, "{held} files recorded, in progress {going}:\n{said}");
    let want = format!(
        "{held} of {FILES} files are verified and recorded in odfs:/ds/.odfs-stage-in.json; the same command again copies only the rest"
    );
    assert!(said.contains("stage-in interrupted after ") && said.contains(&want), "{said}");
    assert_eq!(said.trim_end().lines().last().map(|l| l.contains(&want)), Some(true), "{said}");

    // Killed outright (kill -9, no chance to write): the record written last still counts.
    let mut child = odfs_spawn(&fs, &s3.env(), &slow);
    let before_kill = grown_past(held + 100).unwrap().0;
    child.kill().unwrap();
    child.wait().unwrap();
    let at_kill = record().unwrap().0;
    assert!(at_kill >= before_kill, "the record shrank: {at_kill} < {before_kill}");

    // The next run copies only what no run recorded as verified, and ends complete.
    let out = ok(odfs_stage(&fs, &s3.env(), &args));
    let skipped = out.split(" already complete").next().and_then(|h| h.rsplit(' ').next()).and_then(|n| n.parse().ok());
    let skipped: usize = skipped.unwrap_or_else(|| panic!("no count of files already complete: {out}"));
    assert!(skipped >= at_kill, "{skipped} skipped, {at_kill} recorded: {out}");
    assert!(out.contains(&format!("stage-in: {} files", FILES - skipped)), "{out}");
    assert_odfs_tree(&fs, "/ds", &sums);
    assert_eq!(record(), Some((FILES, false)), "the finished stage-in's manifest");
}

#[test]
fn the_site_config_supplies_the_endpoint_and_settings() {
    let tmp = tempfile::tempdir().unwrap();
    let s3 = S3Server::s3s(&tmp.path().join("s3"), &["data"]);
    let sums = make_tree(&s3.object_path("data", "set"), 20, &[]);
    let site = tmp.path().join("site.toml");
    std::fs::write(
        &site,
        format!(
            "[stage]\nendpoint_url = \"{}\"\npath_style = true\nconcurrency = 4\n\n[other]\nignored = 1\n",
            s3.url()
        ),
    )
    .unwrap();
    let fs = LocalFs::up(2, &[]);
    let mut env = s3.env();
    env.push(("ODFS_SITE_CONFIG", site.to_str().unwrap().to_string()));
    // No endpoint or addressing flags: the site config's are used.
    let out = ok(odfs_stage(&fs, &env, &["stage-in", "s3://data/set", "odfs:/in"]));
    assert!(out.contains("20 files"), "{out}");
    assert_odfs_tree(&fs, "/in", &sums);
    // A bad key in the site config is named.
    std::fs::write(&site, "[stage]\nendpoint = \"x\"\n").unwrap();
    let o = odfs_stage(&fs, &env, &["stage-in", "s3://data/set", "odfs:/in2"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("site.toml") && err.contains("unknown field"), "{err}");
}

/// The `odfs drain status --json` entry of the drain of `src`.
fn drain_state(fs: &LocalFs, src: &str) -> serde_json::Value {
    let out = ok(odfs_stage(fs, &[], &["drain", "status", "--json"]));
    let all: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    all.into_iter().find(|d| d["src"] == src).unwrap_or_else(|| panic!("no drain of {src}: {out}"))
}

/// Waits until the object at `key` holds exactly `want`.
fn wait_object(s3: &S3Server, key: &str, want: &[u8]) {
    let p = s3.object_path("out", key);
    wait_for(&format!("s3://out/{key} drained"), Duration::from_secs(90), || {
        let got = std::fs::read(&p).unwrap_or_default();
        (got == want, got.len())
    });
}

#[test]
fn a_drain_uploads_settled_files_while_running_and_the_stage_out_sends_only_what_changed() {
    let tmp = tempfile::tempdir().unwrap();
    let mut s3 = S3Server::s3s(&tmp.path().join("s3"), &["out"]);
    let fs = LocalFs::up(4, &[]);
    let url = s3.url();
    let s3_args = ["--endpoint-url", url.as_str(), "--path-style"];
    let mut start = vec!["drain", "start", "odfs:/ckpt", "s3://out/run", "--settle", "1", "--keep", "2"];
    start.extend(s3_args);
    // The directory does not exist yet: the drain waits for it.
    let said = ok(odfs_stage(&fs, &s3.env(), &start));
    assert!(said.contains("drain started: odfs:/ckpt -> s3://out/run (settle 1.0 s, keeping the last 2)"), "{said}");
    fs.cli_ok(&["mkdir", "odfs:/ckpt"]);
    let put = |name: &str, data: &[u8]| {
        let local = tmp.path().join(name);
        std::fs::write(&local, data).unwrap();
        fs.cli_ok(&["cp", local.to_str().unwrap(), &format!("odfs:/ckpt/{name}")]);
    };
    let ckpt = |k: u64| pattern(20 << 20, k);
    for k in 1..=3 {
        put(&format!("ckpt-{k}.pt"), &ckpt(k));
        wait_object(&s3, &format!("run/ckpt-{k}.pt"), &ckpt(k));
    }
    // --keep 2: the oldest drained checkpoint's object goes once a third is drained.
    wait_for("ckpt-1 retired", Duration::from_secs(30), || {
        let gone = !s3.object_path("out", "run/ckpt-1.pt").exists();
        (gone, drain_state(&fs, "/ckpt"))
    });
    // A file rewritten after its upload is uploaded again.
    put("ckpt-3.pt", &ckpt(33));
    wait_object(&s3, "run/ckpt-3.pt", &ckpt(33));
    // The object is there before the drainer has checked it and recorded the upload.
    wait_for("the re-upload recorded", Duration::from_secs(30), || {
        let st = drain_state(&fs, "/ckpt");
        let counts = (st["uploaded"].as_u64(), st["reuploaded"].as_u64(), st["retired"].as_u64());
        (counts == (Some(4), Some(1), Some(1)), st)
    });

    // The store goes down: a file that settles meanwhile waits, and is drained when it is back.
    s3.kill();
    put("ckpt-4.pt", &ckpt(4));
    wait_for("ckpt-4 pending while the store is down", Duration::from_secs(30), || {
        let st = drain_state(&fs, "/ckpt");
        (st["pending"].as_u64() == Some(1) || st["in_flight"].as_u64() == Some(1), st)
    });
    std::thread::sleep(Duration::from_secs(3));
    assert!(!s3.object_path("out", "run/ckpt-4.pt").exists());
    s3.start();
    wait_object(&s3, "run/ckpt-4.pt", &ckpt(4));
    // ckpt-2 is now the third most recent: retired too.
    wait_for("ckpt-2 retired", Duration::from_secs(30), || (!s3.object_path("out", "run/ckpt-2.pt").exists(), ()));

    // A file written just before the end is not drained; the stage-out sends it and only it.
    put("late.txt", b"written at the end\n");
    let stopped = ok(odfs_stage(&fs, &[], &["drain", "stop", "odfs:/ckpt"]));
    assert!(stopped.contains("stopped") && stopped.contains("5 uploaded"), "{stopped}");
    let mut out_args = vec!["stage-out", "odfs:/ckpt", "s3://out/run"];
    out_args.extend(s3_args);
    let out = ok(odfs_stage(&fs, &s3.env(), &out_args));
    assert!(out.contains("stage-out: 1 files"), "only late.txt is sent: {out}");
    assert!(
        out.contains("drained while the job ran, unchanged since: 2 files not sent again, 2 retired by --keep"),
        "{out}"
    );
    assert_eq!(std::fs::read(s3.object_path("out", "run/late.txt")).unwrap(), b"written at the end\n");
    for k in [3, 4] {
        let want = if k == 3 { ckpt(33) } else { ckpt(4) };
        assert_eq!(sha256(&std::fs::read(s3.object_path("out", &format!("run/ckpt-{k}.pt"))).unwrap()), sha256(&want));
    }
    assert!(!s3.object_path("out", "run/ckpt-1.pt").exists(), "a retired file is not uploaded again");
    assert!(s3.object_path("out", "run/.odfs-stage-out.complete").exists(), "{out}");
    let m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(s3.object_path("out", "run/.odfs-stage-out.json")).unwrap()).unwrap();
    let files = m["files"].as_object().unwrap();
    assert_eq!(files.len(), 5, "{m}");
    for k in 1..=4 {
        let e = &files[&format!("ckpt-{k}.pt")];
        assert!(e["drained"].as_i64().is_some(), "ckpt-{k}: {e}");
        assert_eq!(e["retired"].as_bool().unwrap_or(false), k <= 2, "ckpt-{k}: {e}");
    }
    assert!(files["late.txt"].get("drained").is_none());
    // The completion marker counts what the destination holds (ckpt-3, ckpt-4, late.txt), and
    // the retired files apart.
    let marker: serde_json::Value =
        serde_json::from_slice(&std::fs::read(s3.object_path("out", "run/.odfs-stage-out.complete")).unwrap()).unwrap();
    let held_bytes = 2 * (20u64 << 20) + b"written at the end\n".len() as u64;
    assert_eq!(
        (marker["files"].as_u64(), marker["bytes"].as_u64(), marker["retired"].as_u64()),
        (Some(3), Some(held_bytes), Some(2)),
        "{marker}"
    );
    // Bad requests are one-line errors.
    let e = text(&odfs_stage(&fs, &s3.env(), &["drain", "start", "odfs:/ckpt", "/pfs/out"]));
    assert!(e.contains("a drain uploads to S3"), "{e}");
    let mut bad = vec!["drain", "start", "odfs:/ckpt", "s3://nobucket/run"];
    bad.extend(s3_args);
    let o = odfs_stage(&fs, &s3.env(), &bad);
    assert!(!o.status.success() && text(&o).contains("bucket \"nobucket\" does not exist"), "{}", text(&o));
    let e = text(&odfs_stage(&fs, &[], &["drain", "stop", "odfs:/nothing"]));
    assert!(e.contains("no drain of odfs:/nothing is running"), "{e}");
}

/// The objects under `s3://out/PREFIX/`, by their key below it (the stage-out's own files left
/// out), each as the SHA-256 of its bytes.
fn objects_below(s3: &S3Server, prefix: &str) -> BTreeMap<String, String> {
    let root = s3.object_path("out", prefix);
    let mut out = BTreeMap::new();
    let mut dirs = vec![root.clone()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            let rel = p.strip_prefix(&root).unwrap().to_string_lossy().into_owned();
            if p.is_dir() {
                dirs.push(p);
            } else if !rel.starts_with(".odfs-stage-out") && !rel.contains(".s3s") {
                out.insert(rel, sha256(&std::fs::read(&p).unwrap()));
            }
        }
    }
    out
}

/// Four ranks each write one shard per step into `step_N/` and rank 0 a `COMPLETE` marker, as a
/// sharded training job checkpoints. `--keep 2` keeps the last two checkpoints whole — every
/// shard and the marker — and retires older ones whole; with `--marker COMPLETE` the marker is
/// uploaded only after its shards. The stage-out's completion marker is written only when every
/// checkpoint in the bucket is whole: one part retired (a shard of an old checkpoint rewritten
/// after its retirement) is made whole again by sending its retired files.
#[test]
fn a_drain_keeps_the_last_k_checkpoints_whole_and_the_stage_out_vouches_only_for_whole_ones() {
    let tmp = tempfile::tempdir().unwrap();
    let s3 = S3Server::s3s(&tmp.path().join("s3"), &["out"]);
    let fs = LocalFs::up(4, &[]);
    let m = FuseMount::start(&fs);
    let url = s3.url();
    let s3_args = ["--endpoint-url", url.as_str(), "--path-style"];
    for (src, dst, marker) in [("plain", "run/plain", None), ("marked", "run/marked", Some("COMPLETE"))] {
        std::fs::create_dir(m.p(src)).unwrap();
        let src = format!("odfs:/{src}");
        let dst = format!("s3://out/{dst}");
        let mut start = vec!["drain", "start", &src, &dst, "--settle", "1", "--keep", "2"];
        if let Some(name) = marker {
            start.extend(["--marker", name]);
        }
        start.extend(s3_args);
        ok(odfs_stage(&fs, &s3.env(), &start));
    }
    let shard = |step: u64, rank: u64| pattern(256 << 10, step * 10 + rank);
    let marker_of = |step: u64| format!("step {step} complete\n").into_bytes();
    let want = |steps: std::ops::RangeInclusive<u64>| -> BTreeMap<String, String> {
        let mut w = BTreeMap::new();
        for step in steps {
            for rank in 0..4 {
                w.insert(format!("step_{step:06}/model-rank{rank}"), sha256(&shard(step, rank)));
            }
            w.insert(format!("step_{step:06}/COMPLETE"), sha256(&marker_of(step)));
        }
        w
    };
    for step in 1..=5u64 {
        for dir in ["plain", "marked"] {
            let d = m.p(&format!("{dir}/step_{step:06}"));
            std::fs::create_dir(&d).unwrap();
            for rank in 0..4 {
                std::fs::write(d.join(format!("model-rank{rank}")), shard(step, rank)).unwrap();
            }
            std::fs::write(d.join("COMPLETE"), marker_of(step)).unwrap();
        }
        // With --marker, a marker in the bucket means its whole checkpoint is there.
        wait_object(&s3, &format!("run/marked/step_{step:06}/COMPLETE"), &marker_of(step));
        let held = objects_below(&s3, "run/marked");
        for (k, sum) in want(step..=step) {
            assert_eq!(held.get(&k), Some(&sum), "step {step}'s marker is in the bucket before {k}: {held:?}");
        }
        wait_object(&s3, &format!("run/plain/step_{step:06}/COMPLETE"), &marker_of(step));
    }
    // Exactly the last two checkpoints, whole, in both buckets.
    for dir in ["plain", "marked"] {
        wait_for(&format!("{dir}: steps 1-3 retired"), Duration::from_secs(60), || {
            let held = objects_below(&s3, &format!("run/{dir}"));
            (held == want(4..=5), held.into_keys().collect::<Vec<_>>())
        });
        let st = drain_state(&fs, &format!("/{dir}"));
        assert_eq!((st["retired"].as_u64(), st["retired_checkpoints"].as_u64()), (Some(15), Some(3)), "{st}");
    }
    let said = ok(odfs_stage(&fs, &[], &["drain", "status"]));
    assert!(said.contains("3 checkpoints (15 files) retired by --keep"), "{said}");

    // A shard of retired step 1 rewritten: drained again, its checkpoint is now part retired.
    let again = pattern(256 << 10, 99);
    std::fs::write(m.p("plain/step_000001/model-rank0"), &again).unwrap();
    wait_object(&s3, "run/plain/step_000001/model-rank0", &again);
    let stopped = ok(odfs_stage(&fs, &[], &["drain", "stop"]));
    assert!(stopped.contains("stopped"), "{stopped}");
    for (dir, expect) in [("plain", 4), ("marked", 0)] {
        let mut args = vec!["stage-out".to_string(), format!("odfs:/{dir}"), format!("s3://out/run/{dir}")];
        args.extend(s3_args.iter().map(|a| a.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = ok(odfs_stage(&fs, &s3.env(), &args));
        assert!(out.contains(&format!("stage-out: {expect} files")), "{dir}: {out}");
        let held = objects_below(&s3, &format!("run/{dir}"));
        let mut w = want(4..=5);
        if dir == "plain" {
            // step 1 whole again: its 4 retired files sent, its rewritten shard as it is now;
            // nothing of steps 2 and 3.
            w.extend(want(1..=1));
            w.insert("step_000001/model-rank0".into(), sha256(&again));
        }
        assert_eq!(held, w, "{dir}: {out}");
        let marker: serde_json::Value = serde_json::from_slice(
            &std::fs::read(s3.object_path("out", &format!("run/{dir}/.odfs-stage-out.complete"))).unwrap(),
        )
        .unwrap();
        let (files, retired) = if dir == "plain" { (15, 10) } else { (10, 15) };
        assert_eq!((marker["files"].as_u64(), marker["retired"].as_u64()), (Some(files), Some(retired)), "{marker}");
    }
}

#[test]
fn a_drain_deletes_after_upload_only_files_that_nobody_holds_open() {
    use std::io::Write;
    let tmp = tempfile::tempdir().unwrap();
    let s3 = S3Server::s3s(&tmp.path().join("s3"), &["out"]);
    let fs = LocalFs::up(2, &[]);
    let m = FuseMount::start(&fs);
    std::fs::create_dir(m.p("ckpt")).unwrap();
    let url = s3.url();
    let start = [
        "drain",
        "start",
        "odfs:/ckpt",
        "s3://out/del",
        "--settle",
        "1",
        "--delete-after-upload",
        "--endpoint-url",
        &url,
        "--path-style",
    ];
    ok(odfs_stage(&fs, &s3.env(), &start));
    // A closed checkpoint: uploaded, verified, then deleted from odfs (seen through the mount).
    let a = pattern(5 << 20, 1);
    std::fs::write(m.p("ckpt/a.pt"), &a).unwrap();
    wait_object(&s3, "del/a.pt", &a);
    wait_for("a.pt deleted after its upload", Duration::from_secs(30), || (!m.p("ckpt/a.pt").exists(), ()));

    // A file held open for writing: metad knows nothing of its writes until the close, so what
    // it shows settles and is uploaded, but the file is open on a node and is not deleted.
    let (b1, b2) = (pattern(1 << 20, 2), pattern(3 << 20, 3));
    let mut f = std::fs::File::create(m.p("ckpt/b.pt")).unwrap();
    f.write_all(&b1).unwrap();
    wait_for("b.pt waiting to be deleted", Duration::from_secs(30), || {
        let st = drain_state(&fs, "/ckpt");
        (st["delete_waiting"].as_u64() == Some(1), st)
    });
    std::thread::sleep(Duration::from_secs(3));
    assert!(m.p("ckpt/b.pt").exists(), "a file open for writing was deleted");
    f.write_all(&b2).unwrap();
    drop(f);
    let whole = [b1, b2].concat();
    // Its close changed it: the whole file is uploaded again, then deleted.
    wait_object(&s3, "del/b.pt", &whole);
    wait_for("b.pt deleted after its close and upload", Duration::from_secs(30), || (!m.p("ckpt/b.pt").exists(), ()));
    let st = drain_state(&fs, "/ckpt");
    assert_eq!((st["deleted"].as_u64(), st["delete_waiting"].as_u64()), (Some(2), Some(0)), "{st}");

    // The stage-out's manifest keeps both: their objects are the only copies.
    ok(odfs_stage(&fs, &[], &["drain", "stop"]));
    let out = ok(odfs_stage(
        &fs,
        &s3.env(),
        &["stage-out", "odfs:/ckpt", "s3://out/del", "--endpoint-url", &url, "--path-style"],
    ));
    assert!(out.contains("stage-out: 0 files") && out.contains("2 files not sent again"), "{out}");
    let mpath = s3.object_path("out", "del/.odfs-stage-out.json");
    let man: serde_json::Value = serde_json::from_slice(&std::fs::read(mpath).unwrap()).unwrap();
    for f in ["a.pt", "b.pt"] {
        assert_eq!(man["files"][f]["deleted_local"], true, "{man}");
    }
    assert_eq!(std::fs::read(s3.object_path("out", "del/b.pt")).unwrap(), whole);
    assert!(s3.object_path("out", "del/.odfs-stage-out.complete").exists());
}

#[test]
fn a_name_that_is_not_utf8_is_left_out_of_a_drain_and_refused_by_the_stage_out() {
    use std::os::unix::ffi::OsStrExt;
    let tmp = tempfile::tempdir().unwrap();
    let s3 = S3Server::s3s(&tmp.path().join("s3"), &["out"]);
    let fs = LocalFs::up(2, &[]);
    let m = FuseMount::start(&fs);
    std::fs::create_dir(m.p("ckpt")).unwrap();
    // No S3 key can name this file; the drain goes on with the others and says why.
    let bad = m.p("ckpt").join(std::ffi::OsStr::from_bytes(b"bad-\xff.pt"));
    std::fs::write(&bad, b"kept in odfs\n").unwrap();
    let url = s3.url();
    let drain = ["drain", "start", "odfs:/ckpt", "s3://out/u", "--settle", "1", "--endpoint-url", &url, "--path-style"];
    ok(odfs_stage(&fs, &s3.env(), &drain));
    let good = pattern(1 << 20, 7);
    std::fs::write(m.p("ckpt/good.pt"), &good).unwrap();
    wait_object(&s3, "u/good.pt", &good);
    // The object is whole in S3 a moment before the agent has verified and recorded it.
    let st = wait_for("the good file recorded as uploaded", Duration::from_secs(30), || {
        let st = drain_state(&fs, "/ckpt");
        (st["uploaded"].as_u64() == Some(1), st)
    });
    let why = st["last_error"].as_str().unwrap_or_default().to_string();
    assert!(why.contains("odfs:/ckpt/bad-\u{fffd}.pt: a name that is not UTF-8 cannot be an S3 key"), "{st}");
    assert_eq!(st["uploaded"].as_u64(), Some(1), "{st}");
    ok(odfs_stage(&fs, &[], &["drain", "stop", "odfs:/ckpt"]));
    // The stage-out refuses the tree, naming the file, and keeps it.
    let out =
        odfs_stage(&fs, &s3.env(), &["stage-out", "odfs:/ckpt", "s3://out/u", "--endpoint-url", &url, "--path-style"]);
    assert!(!out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("bad-\u{fffd}.pt: a name that is not UTF-8 (an S3 key must be)"), "{}", text(&out));
    assert_eq!(std::fs::read(&bad).unwrap(), b"kept in odfs\n");
}

/// Progress off a terminal (the log of a prolog, a batch job's output): the listing says it is
/// complete, with its totals, before any transfer line; transfer lines carry the item total
/// of the whole run from the start, a rate over the recent seconds and an ETA.
#[test]
fn stage_in_progress_lines_off_a_terminal_say_the_listing_is_complete_a_recent_rate_and_an_eta() {
    let tmp = tempfile::tempdir().unwrap();
    let s3 = S3Server::s3s(&tmp.path().join("s3"), &["data"]);
    make_tree(&s3.object_path("data", "set"), 40, &[6 << 20, 6 << 20]);
    let fs = LocalFs::up(2, &[]);
    let url = s3.url();
    // 2 MiB/s over about 12 MiB: the run lasts several of the 5 s progress intervals.
    let args =
        ["stage-in", "s3://data/set", "odfs:/in", "--endpoint-url", &url, "--path-style", "--max-bandwidth", "2M"];
    let out = odfs_stage(&fs, &s3.env(), &args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{}", text(&out));
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("odfs stage-in: ")).collect();
    let complete = lines.iter().position(|l| l.starts_with("odfs stage-in: listing complete: 42 files, "));
    let complete = complete.unwrap_or_else(|| panic!("no complete listing line:\n{err}"));
    let transfers: Vec<&&str> = lines.iter().filter(|l| l.contains(" items")).collect();
    assert!(!transfers.is_empty(), "no transfer line in a run of several seconds:\n{err}");
    assert!(lines.iter().position(|l| l.contains(" items")).unwrap() > complete, "listing first:\n{err}");
    for l in &transfers {
        // The run's whole item count, from the first line on.
        assert!(l.contains("/42 items"), "{l}\n{err}");
    }
    let timed: Vec<&&&str> = transfers.iter().filter(|l| l.contains("MiB/s over the last ")).collect();
    assert!(!timed.is_empty(), "no recent rate:\n{err}");
    assert!(timed.iter().all(|l| l.contains(", ETA ")), "a rate without an ETA:\n{err}");
    assert!(!err.contains('\x1b'), "terminal escapes off a terminal:\n{err:?}");
}
