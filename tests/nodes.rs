//! Across nodes: every node a network namespace and a mount namespace of its own, all mounting
//! the same filesystem. The daemons run in a "server" namespace behind a bridge; each node
//! reaches them over its own veth link, mounts with `odfs-fuse` in a private mount namespace
//! (invisible to the test and to the other node), and is driven with `nsenter`.
//!
//! Checks close-to-open across nodes: data written and closed on one node reads byte-identical
//! on the other, also when the reader had the old contents cached; and coherent caching: a
//! change on one node is seen by the very next call on the other, which meanwhile answers
//! repeated stats, lookups and reads from its caches (metad's request counters stay flat),
//! and a frozen node delays a change by at most the lease time.
//! And local placement: a file the kernel wrote through FUSE passthrough into its node's own
//! chunk file reads byte-identical on another node, and that node's change on the first.
//!
//! Needs root, /dev/fuse and iproute2 (`ip netns`), util-linux (`unshare`, `nsenter`).

use odfs_tests::*;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const SUBNET: &str = "10.213.7";

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip (iproute2 package)");
    assert!(out.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// Network namespaces made for one test: a server namespace with a bridge, and one namespace
/// per node linked to it by a veth pair. Removed on drop.
struct Net {
    server: String,
    nodes: Vec<String>,
}

impl Net {
    fn new(nodes: usize) -> Net {
        assert!(
            unsafe { libc::geteuid() } == 0,
            "this test creates network namespaces and mounts FUSE filesystems: run it as root"
        );
        let tag = std::process::id();
        let net = Net { server: format!("odfs{tag}s"), nodes: (0..nodes).map(|k| format!("odfs{tag}n{k}")).collect() };
        net.remove();
        let s = net.server.as_str();
        ip(&["netns", "add", s]);
        ip(&["-n", s, "link", "set", "lo", "up"]);
        ip(&["-n", s, "link", "add", "br0", "type", "bridge"]);
        ip(&["-n", s, "addr", "add", &format!("{SUBNET}.1/24"), "dev", "br0"]);
        ip(&["-n", s, "link", "set", "br0", "up"]);
        for (k, n) in net.nodes.iter().enumerate() {
            let peer = format!("v{k}");
            ip(&["netns", "add", n]);
            ip(&["-n", n, "link", "set", "lo", "up"]);
            ip(&["-n", n, "link", "add", "eth0", "type", "veth", "peer", "name", &peer, "netns", s]);
            ip(&["-n", s, "link", "set", &peer, "master", "br0", "up"]);
            ip(&["-n", n, "addr", "add", &format!("{SUBNET}.{}/24", k + 2), "dev", "eth0"]);
            ip(&["-n", n, "link", "set", "eth0", "up"]);
        }
        net
    }

    fn remove(&self) {
        for n in self.nodes.iter().chain([&self.server]) {
            let _ = Command::new("ip").args(["netns", "del", n]).output();
        }
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        self.remove();
    }
}

/// One node: `odfs-fuse` in the node's network namespace and a private mount namespace.
struct Node {
    name: String,
    child: Child,
    mnt: PathBuf,
    log: PathBuf,
}

impl Node {
    fn mount(netns: &str, name: &str, fs: &LocalFs) -> Node {
        Node::mount_with(netns, name, fs, &fs.config_path())
    }

    /// Like `mount`, as the node the client config `config` names.
    fn mount_with(netns: &str, name: &str, fs: &LocalFs, config: &Path) -> Node {
        assert!(Path::new("/dev/fuse").exists(), "/dev/fuse is missing: this test needs FUSE (modprobe fuse)");
        let mnt = fs.root().join("mnt");
        fs::create_dir_all(&mnt).unwrap();
        let log = fs.root().join(format!("fuse-{name}.log"));
        let out = fs::File::create(&log).unwrap();
        // ip and unshare exec their command, so the child is odfs-fuse itself.
        let child = Command::new("ip")
            .args(["netns", "exec", netns, "unshare", "--mount", "--propagation", "private"])
            .arg(odfs_fuse_bin())
            .arg("--fs")
            .arg(config)
            .arg("--mountpoint")
            .arg(&mnt)
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .expect("start odfs-fuse in the node's namespaces");
        let mut node = Node { name: name.into(), child, mnt, log };
        let t = Instant::now();
        loop {
            let info = fs::read_to_string(format!("/proc/{}/mountinfo", node.child.id())).unwrap_or_default();
            let want = format!(" {} ", node.mnt.display());
            if info.lines().any(|l| l.contains(&want) && l.contains(" - fuse.odfs ")) {
                return node;
            }
            if let Ok(Some(st)) = node.child.try_wait() {
                panic!("node {name}: odfs-fuse exited ({st}):\n{}", fs::read_to_string(&node.log).unwrap_or_default());
            }
            assert!(t.elapsed() < Duration::from_secs(15), "node {name}: not mounted within 15 s");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Runs a shell command in the node's mount and network namespaces.
    fn sh(&self, cmd: &str) -> Output {
        Command::new("nsenter")
            .args(["-t", &self.child.id().to_string(), "-m", "-n", "--", "sh", "-c", cmd])
            .output()
            .expect("run nsenter")
    }

    /// Like `sh`, failing the test unless the command succeeds; returns stdout.
    fn ok(&self, cmd: &str) -> String {
        let out = self.sh(cmd);
        assert!(
            out.status.success(),
            "node {}: `{cmd}` failed: {}{}",
            self.name,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn sha256_of(&self, rel: &str) -> String {
        self.ok(&format!("sha256sum {}/{rel}", self.mnt.display())).split(' ').next().unwrap().to_string()
    }

    /// Waits (bounded) until `cond` holds on this node.
    fn eventually(&self, what: &str, cond: &str) {
        let t = Instant::now();
        while !self.sh(cond).status.success() {
            assert!(t.elapsed() < Duration::from_secs(5), "node {}: {what} not seen within 5 s", self.name);
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        // SIGTERM: odfs-fuse flushes and unmounts; its mount namespace goes with it.
        // SAFETY: plain kill(2) of our child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(5) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `odfs local up` inside the server namespace, daemons bound to the bridge's address.
fn up_in_server(net: &Net, nodes: u32) -> LocalFs {
    let dir = tempfile::Builder::new().prefix("odfs-nodes-").tempdir().unwrap();
    let out = Command::new("ip")
        .args(["netns", "exec", &net.server])
        .arg(bin_dir().join("odfs"))
        .args(["local", "up", "--no-mount", "--bind", &format!("{SUBNET}.1"), "--nodes", &nodes.to_string()])
        .args(["--chunk-size", "65536", "--stripe-count", "-1", "--root"])
        .arg(dir.path())
        .env("ODFS_BIN_DIR", bin_dir())
        .output()
        .expect("run odfs local up in the server namespace");
    let fs = LocalFs { dir, nodes };
    assert!(
        out.status.success(),
        "odfs local up --bind {SUBNET}.1 failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    fs
}

/// A 4-node filesystem served from the server namespace, mounted on two nodes, A and B, each in
/// its own network and mount namespaces. Bound in this order, they drop in reverse: the mounts
/// go before the filesystem, the filesystem before the namespaces.
fn two_nodes() -> (Net, LocalFs, Node, Node) {
    let net = Net::new(2);
    let fs = up_in_server(&net, 4);
    let a = Node::mount(&net.nodes[0], "A", &fs);
    let b = Node::mount(&net.nodes[1], "B", &fs);
    (net, fs, a, b)
}

#[test]
fn nodes_in_their_own_namespaces_share_one_filesystem_close_to_open() {
    let (_net, fs, a, b) = two_nodes();
    let mnt = a.mnt.display().to_string();
    assert!(mount_line(&a.mnt).is_none(), "the nodes' mounts must not show in the test's own mount namespace");
    // The nodes reach only the server's address: loopback in a node is its own.
    assert!(fs.config().mgmtd.ip().to_string() == format!("{SUBNET}.1"));

    // Written and closed on A: byte-identical on B.
    let scratch = tempfile::tempdir().unwrap();
    let (v1, v2) = (pattern((5 << 20) + 777, 1), pattern((3 << 20) + 5, 2));
    let (p1, p2) = (scratch.path().join("v1"), scratch.path().join("v2"));
    fs::write(&p1, &v1).unwrap();
    fs::write(&p2, &v2).unwrap();
    a.ok(&format!("cp {} {mnt}/f", p1.display()));
    assert_eq!(b.sha256_of("f"), sha256(&v1), "B reads what A wrote and closed");
    b.ok(&format!("cmp {} {mnt}/f", p1.display()));

    // B has the old contents cached; A overwrites (shorter) and closes; B's next open sees it.
    a.ok(&format!("cp {} {mnt}/f", p2.display()));
    assert_eq!(b.sha256_of("f"), sha256(&v2), "B's open revalidates: new contents, not its cached pages");
    assert_eq!(b.ok(&format!("stat -c %s {mnt}/f")).trim(), v2.len().to_string());

    // The other direction, in a directory made on B.
    b.ok(&format!("mkdir {mnt}/fromb && for i in $(seq 1 100); do echo $i > {mnt}/fromb/$i; done"));
    let listing = a.ok(&format!("ls {mnt}/fromb | sort -n | tr '\\n' ' '"));
    assert_eq!(listing.trim(), (1..=100).map(|i| i.to_string()).collect::<Vec<_>>().join(" "));
    assert_eq!(a.ok(&format!("cat {mnt}/fromb/42")), "42\n");

    // Rename on A, seen on B: the new name with the same bytes, the old name gone.
    b.ok(&format!("test -e {mnt}/f"));
    a.ok(&format!("mv {mnt}/f {mnt}/g"));
    b.eventually("rename f -> g", &format!("test -e {mnt}/g && ! test -e {mnt}/f"));
    assert_eq!(b.sha256_of("g"), sha256(&v2));
    // A directory rename too.
    a.ok(&format!("mv {mnt}/fromb {mnt}/renamed"));
    b.eventually("directory rename", &format!("test -d {mnt}/renamed && ! test -e {mnt}/fromb"));
    assert_eq!(b.ok(&format!("cat {mnt}/renamed/7")), "7\n");

    // Unlink on A, seen on B.
    a.ok(&format!("rm {mnt}/g"));
    b.eventually("unlink of g", &format!("! test -e {mnt}/g"));
    let out = b.sh(&format!("cat {mnt}/g"));
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("No such file"));
}

/// The filesystem's client config as node `node`'s, written beside it; its path.
fn node_config(fs: &LocalFs, node: u32) -> PathBuf {
    let mut cfg = fs.config();
    cfg.node = node;
    let path = fs.root().join(format!("odfs-node{node}.toml"));
    fs::write(&path, toml::to_string(&cfg).expect("client config as TOML")).unwrap();
    path
}

/// Local placement across nodes, each in its own namespaces: A, node 1's mount, writes a
/// checkpoint (4 MiB writes, fsync, close) into a local-placement directory; it lands whole in
/// one chunk file on node 1's target, and the kernel wrote it there itself (FUSE passthrough:
/// A's odfs-fuse counts no WRITE or READ request for it, nor for reading it back). B, node 2's
/// mount, reads it byte-identical through node 1's stored. B then appends to it (the normal
/// path: B's writes go to node 1's stored) and A's next open, passed through again, reads
/// exactly what B wrote.
#[test]
fn a_file_written_through_passthrough_on_one_node_reads_the_same_on_another() {
    let net = Net::new(2);
    let fs = up_in_server(&net, 4);
    let a = Node::mount_with(&net.nodes[0], "A", &fs, &node_config(&fs, 1));
    let b = Node::mount_with(&net.nodes[1], "B", &fs, &node_config(&fs, 2));
    let mnt = a.mnt.display().to_string();
    let odfs = bin_dir().join("odfs");
    a.ok(&format!("mkdir {mnt}/ck && {} setstripe --local -c 1 {mnt}/ck", odfs.display()));

    let scratch = tempfile::tempdir().unwrap();
    let (data, tail) = (pattern(24 * (1 << 20) + 333, 9), pattern(70_001, 10));
    let (src, more) = (scratch.path().join("model.pt"), scratch.path().join("tail"));
    fs::write(&src, &data).unwrap();
    fs::write(&more, &tail).unwrap();
    let io = |n: &Node| {
        let c = mount_counts(n);
        (c.get("write").copied().unwrap_or(0), c.get("read").copied().unwrap_or(0))
    };
    let before = io(&a);
    a.ok(&format!("dd if={} of={mnt}/ck/model.pt bs=4M conv=fsync status=none", src.display()));
    assert_eq!(a.sha256_of("ck/model.pt"), sha256(&data), "A reads back what it wrote");
    assert_eq!(io(&a), before, "A's odfs-fuse served WRITE or READ requests: not passed through");

    let ino: u64 = a.ok(&format!("stat -c %i {mnt}/ck/model.pt")).trim().parse().unwrap();
    let files = chunk_files(&fs, ino);
    assert_eq!(files.len(), 1, "one chunk file: {files:?}");
    assert!(files[0].starts_with(fs.node_dir(1)), "on node 1's target: {}", files[0].display());
    assert_eq!(fs::read(&files[0]).unwrap(), data, "the chunk file holds the file's bytes");

    assert_eq!(b.sha256_of("ck/model.pt"), sha256(&data), "B reads what A wrote and closed");
    b.ok(&format!("cat {} >> {mnt}/ck/model.pt", more.display()));
    let whole = [data.as_slice(), tail.as_slice()].concat();
    let before = io(&a);
    assert_eq!(a.sha256_of("ck/model.pt"), sha256(&whole), "A's next open reads B's append");
    assert_eq!(a.ok(&format!("stat -c %s {mnt}/ck/model.pt")).trim(), whole.len().to_string());
    assert_eq!(io(&a), before, "A's read after B's append was not passed through");
}

/// Bytes of `rel` in the node's page cache (`fincore`, which opens the file but reads nothing).
fn resident(node: &Node, rel: &str) -> u64 {
    let out = node.ok(&format!("fincore --bytes --noheadings --output RES {}/{rel}", node.mnt.display()));
    out.trim().parse().unwrap_or_else(|_| panic!("fincore printed {out:?}"))
}

#[test]
fn small_files_are_in_the_page_cache_from_their_open_and_filled_again_after_a_change() {
    let (_net, _fs, a, b) = two_nodes();
    let mnt = a.mnt.display().to_string();
    let pages = |n: usize| n.div_ceil(4096) as u64 * 4096;
    let scratch = tempfile::tempdir().unwrap();
    let (small, changed, big) = (pattern(100_000, 11), pattern(60_001, 12), pattern((3 << 20) + 1, 13));
    for (name, data) in [("small", &small), ("changed", &changed), ("big", &big)] {
        fs::write(scratch.path().join(name), data).unwrap();
    }
    let src = scratch.path().display().to_string();
    b.ok(&format!("cp {src}/small {mnt}/s && cp {src}/big {mnt}/big"));
    // A small file's open hands its bytes to the kernel before any read; a file above
    // fill_at_open_bytes (1 MiB) is read on demand.
    assert_eq!(resident(&a, "s"), pages(small.len()), "the open of a small file fills the page cache");
    assert_eq!(resident(&a, "big"), 0, "a large file is not fetched at open");
    assert_eq!(a.sha256_of("s"), sha256(&small));
    assert_eq!(a.sha256_of("big"), sha256(&big));
    // Rewritten (shorter) on B: A's pages were recalled; its next open fills the new bytes.
    b.ok(&format!("cp {src}/changed {mnt}/s"));
    assert_eq!(resident(&a, "s"), pages(changed.len()), "the open after a change fills the new contents");
    assert_eq!(a.sha256_of("s"), sha256(&changed), "A reads B's new bytes, not its old pages");
    a.ok(&format!("cmp {src}/changed {mnt}/s"));
}

/// What a node's own mount counted, by kind (`odfs stats` through the mount, as the job's
/// user runs it).
fn mount_counts(node: &Node) -> std::collections::BTreeMap<String, u64> {
    let odfs = bin_dir().join("odfs");
    let out = node.ok(&format!("cd / && ODFS_MOUNT={} {} stats --json", node.mnt.display(), odfs.display()));
    let st: odfs_proto::stats::FsStats = serde_json::from_str(&out).expect("odfs stats --json through the mount");
    let mounts = st.services.iter().filter(|s| s.kind == Some(odfs_proto::mgmt::ServiceKind::Client));
    mounts.filter_map(|s| s.stats.as_ref()).flat_map(|s| &s.methods).map(|m| (m.name.clone(), m.count)).collect()
}

#[test]
fn a_directory_s_small_files_are_read_ahead_at_a_first_open_and_a_change_is_never_served_stale() {
    const FILES: usize = 120;
    let (_net, _fs, a, b) = two_nodes();
    let mnt = a.mnt.display().to_string();
    // Small files of many sizes (this filesystem's chunks are 64 KiB: each file is one chunk
    // file), written on B.
    let scratch = tempfile::tempdir().unwrap();
    let src = scratch.path().display().to_string();
    let size = |i: usize| 1 + (i * 7_919) % 60_000;
    let mut want = std::collections::BTreeMap::new();
    for i in 0..FILES {
        let data = pattern(size(i), 100 + i as u64);
        fs::write(scratch.path().join(format!("f{i}")), &data).unwrap();
        want.insert(format!("f{i}"), sha256(&data));
    }
    b.ok(&format!("mkdir {mnt}/d && cp {src}/f* {mnt}/d/"));
    // A lists the directory, as a loader building its file list does: names and attributes
    // cached under leases, no file read yet.
    a.ok(&format!("ls -l {mnt}/d > /dev/null"));
    let read_ahead = |n: &std::collections::BTreeMap<String, u64>| n.get("prefetch (files read ahead)").copied();
    assert_eq!(read_ahead(&mount_counts(&a)), None, "nothing is read ahead before a file is opened");
    // The first open of one of them reads the others ahead.
    assert_eq!(a.sha256_of("d/f0"), want["f0"]);
    let t = Instant::now();
    while read_ahead(&mount_counts(&a)).unwrap_or(0) < FILES as u64 - 1 {
        assert!(t.elapsed() < Duration::from_secs(10), "read ahead: {:?}", mount_counts(&a));
        std::thread::sleep(Duration::from_millis(50));
    }
    // B changes two of them after A read them ahead: one rewritten with other bytes of the
    // same size, one cut short. A must read what B wrote, never what it holds.
    let (same_size, shorter) = (pattern(size(7), 7_777), pattern(size(8) / 2, 8_888));
    fs::write(scratch.path().join("c7"), &same_size).unwrap();
    fs::write(scratch.path().join("c8"), &shorter).unwrap();
    b.ok(&format!("cp {src}/c7 {mnt}/d/f7 && cp {src}/c8 {mnt}/d/f8"));
    want.insert("f7".into(), sha256(&same_size));
    want.insert("f8".into(), sha256(&shorter));
    let used_before = mount_counts(&a).get("prefetch (files used)").copied().unwrap_or(0);
    let out = a.ok(&format!("cd {mnt}/d && sha256sum f*"));
    let got: std::collections::BTreeMap<String, String> = out
        .lines()
        .map(|l| {
            let (sum, name) = l.split_once("  ").expect("sha256sum line");
            (name.to_string(), sum.to_string())
        })
        .collect();
    assert_eq!(got.len(), FILES);
    for (name, sum) in &want {
        assert_eq!(&got[name], sum, "{name} read on A: not the bytes B wrote last");
    }
    // Every file but the first (filled at its open) and the two changed came from what was
    // read ahead, and B's bytes match on B too.
    let used = mount_counts(&a).get("prefetch (files used)").copied().unwrap_or(0) - used_before;
    assert_eq!(used, FILES as u64 - 3, "opens served from the read-ahead: {:?}", mount_counts(&a));
    assert_eq!(b.sha256_of("d/f7"), want["f7"]);
}

/// The chunk files of inode `ino` on every target of `fs`.
fn chunk_files(fs: &LocalFs, ino: u64) -> Vec<PathBuf> {
    let name = Path::new(&format!("{:02x}", ino & 0xff)).join(format!("{ino:016x}"));
    (0..fs.nodes)
        .flat_map(|k| fs::read_dir(fs.node_dir(k)).into_iter().flatten().flatten())
        .map(|e| e.path().join("chunks").join(&name))
        .filter(|p| p.exists())
        .collect()
}

/// Requests the metadata services have served by kind (every shard), less session
/// keep-alives and the counting itself, read from inside the server namespace.
fn meta_requests(net: &Net, fs: &LocalFs) -> std::collections::BTreeMap<String, u64> {
    let out = Command::new("ip")
        .args(["netns", "exec", &net.server])
        .arg(bin_dir().join("odfs"))
        .arg("--fs")
        .arg(fs.config_path())
        .args(["stats", "--json"])
        .output()
        .expect("run odfs stats");
    assert!(out.status.success(), "odfs stats: {}", String::from_utf8_lossy(&out.stderr));
    let st: odfs_proto::stats::FsStats = serde_json::from_slice(&out.stdout).expect("odfs stats --json");
    let mut m = std::collections::BTreeMap::new();
    let metads = st.services.iter().filter(|s| s.kind == Some(odfs_proto::mgmt::ServiceKind::Meta));
    for method in metads.map(|s| s.stats.as_ref().expect("every metad answers")).flat_map(|s| &s.methods) {
        if !["SessionPoll", "GetStats"].contains(&method.name.as_str()) {
            *m.entry(method.name.clone()).or_default() += method.count;
        }
    }
    m
}

/// Signals a node's odfs-fuse (SIGSTOP freezes it: it answers neither the kernel nor recalls).
fn signal(node: &Node, sig: i32) {
    // SAFETY: plain kill(2) of our child.
    assert_eq!(unsafe { libc::kill(node.child.id() as i32, sig) }, 0);
}

#[test]
fn a_change_on_one_node_is_seen_by_the_very_next_call_on_the_other() {
    let (net, fs, a, b) = two_nodes();
    let mnt = a.mnt.display().to_string();
    a.ok(&format!("mkdir {mnt}/d && printf v1 > {mnt}/d/f && printf keep > {mnt}/d/other"));

    // A caches names, missing names, attributes, data, extended attributes (a missing one
    // too) and listings: repeated stats, lookups, reads, getxattrs and listings reach no metad.
    let warm = format!(
        "stat {mnt}/d/f {mnt}/d/other >/dev/null && cat {mnt}/d/f {mnt}/d/other >/dev/null && \
         ! test -e {mnt}/d/new && ! getfattr -n user.k {mnt}/d/f 2>/dev/null && ls {mnt}/d >/dev/null"
    );
    a.ok(&format!("ls -l {mnt}/d >/dev/null"));
    a.ok(&warm);
    a.ok(&warm);
    let before = meta_requests(&net, &fs);
    for _ in 0..20 {
        a.ok(&warm);
    }
    assert_eq!(
        meta_requests(&net, &fs),
        before,
        "cached stats, lookups, misses, reads and getxattrs asked metad (by kind)"
    );

    // Each change on B is seen by A's very next call, with no wait in between.
    let f = format!("{mnt}/d/f");
    b.ok(&format!("chmod 640 {f}"));
    assert_eq!(a.ok(&format!("stat -c %a {f}")).trim(), "640", "chmod");
    b.ok(&format!("chown 1234:5678 {f}"));
    assert_eq!(a.ok(&format!("stat -c %u:%g {f}")).trim(), "1234:5678", "chown");
    b.ok(&format!("printf 'v2, longer' > {f}"));
    assert_eq!(a.ok(&format!("cat {f}")), "v2, longer", "write and close: A's cached pages are dropped");
    assert_eq!(a.ok(&format!("stat -c %s {f}")).trim(), "10");
    b.ok(&format!("truncate -s 3 {f}"));
    assert_eq!(a.ok(&format!("stat -c %s {f}")).trim(), "3", "truncate");
    assert_eq!(a.ok(&format!("cat {f}")), "v2,");
    b.ok(&format!("setfattr -n user.k -v val {f}"));
    assert!(a.ok(&format!("getfattr -n user.k {f}")).contains("user.k=\"val\""), "setxattr");
    b.ok(&format!("mv {f} {mnt}/d/g"));
    assert_eq!(a.ok(&format!("ls {mnt}/d | tr '\\n' ' '")), "g other ", "rename: A's cached listing");
    a.ok(&format!("test -e {mnt}/d/g && ! test -e {f}"));
    assert_eq!(a.ok(&format!("cat {mnt}/d/g")), "v2,", "rename");
    b.ok(&format!("rm {mnt}/d/g"));
    a.ok(&format!("! test -e {mnt}/d/g && ! cat {mnt}/d/g 2>/dev/null"));
    // A looked `new` up and cached its absence; B creates it.
    b.ok(&format!("printf fresh > {mnt}/d/new"));
    assert_eq!(a.ok(&format!("ls {mnt}/d | tr '\\n' ' '")), "new other ", "create: A's cached listing");
    assert_eq!(a.ok(&format!("cat {mnt}/d/new")), "fresh", "create of a name A knew to be missing");
    b.ok(&format!("mkdir {mnt}/d/sub && chmod 700 {mnt}/d"));
    assert_eq!(a.ok(&format!("stat -c %a {mnt}/d")).trim(), "700", "chmod of the directory");
    a.ok(&format!("test -d {mnt}/d/sub"));
    assert_eq!(a.ok(&format!("cat {mnt}/d/other")), "keep", "what did not change stays readable");

    // B frozen with A's entries cached: a change on A waits for B at most the lease, then
    // goes through; nothing is lost, and B, thawed, sees it.
    b.ok(&format!("stat {mnt}/d/new >/dev/null && cat {mnt}/d/new >/dev/null"));
    signal(&b, libc::SIGSTOP);
    let t = Instant::now();
    a.ok(&format!("chmod 600 {mnt}/d/new && printf again > {mnt}/d/new"));
    let waited = t.elapsed();
    signal(&b, libc::SIGCONT);
    // Liveness, not speed: the lease is 30 s; a change that waited for ever would hang here.
    assert!(waited < Duration::from_secs(90), "a frozen node held a change for {waited:?}");
    assert_eq!(b.ok(&format!("stat -c %a {mnt}/d/new")).trim(), "600");
    assert_eq!(b.ok(&format!("cat {mnt}/d/new")), "again");
    assert_eq!(a.ok(&format!("cat {mnt}/d/new")), "again");
}

#[test]
fn a_sealed_tree_refuses_every_change_is_served_from_caches_and_unseals_everywhere() {
    let (net, fs, a, b) = two_nodes();
    let mnt = a.mnt.display().to_string();
    let odfs = bin_dir().join("odfs").display().to_string();
    b.ok(&format!(
        "mkdir -p {mnt}/d/sub && printf data > {mnt}/d/f && printf s > {mnt}/d/sub/g && ln -s f {mnt}/d/l && \
         mkfifo {mnt}/d/p && setfattr -n user.k -v v {mnt}/d/f"
    ));
    // A reads the tree before the seal: the seal recalls what A cached.
    a.ok(&format!("ls -lR {mnt}/d >/dev/null && cat {mnt}/d/f >/dev/null"));
    b.ok(&format!("{odfs} seal {mnt}/d"));
    assert_eq!(a.ok(&format!("getfattr --only-values -n odfs.sealed {mnt}/d/sub/g")), "1");

    // Every change, on the other node, is refused with EROFS and changes nothing.
    let d = format!("{mnt}/d");
    for change in [
        format!("printf x > {d}/new"),
        format!("mkdir {d}/new"),
        format!("mkfifo {d}/new"),
        format!("ln -s f {d}/new"),
        format!("ln {d}/f {d}/new"),
        format!("ln {d}/f {mnt}/outside"),
        format!("rm {d}/f"),
        format!("rm {d}/l"),
        format!("rmdir {d}/sub"),
        format!("mv {d}/f {d}/f2"),
        format!("mv {d}/f {mnt}/f2"),
        format!("mv {d}/sub {d}/sub2"),
        format!("mv {d} {mnt}/d2"),
        format!("chmod 600 {d}/f"),
        format!("chmod 700 {d}"),
        format!("chown 1:1 {d}/f"),
        format!("touch {d}/f"),
        format!("touch -h {d}/l"),
        format!("truncate -s 0 {d}/f"),
        format!("printf x >> {d}/f"),
        format!("printf x > {d}/sub/g"),
        format!("setfattr -n user.k -v w {d}/f"),
        format!("setfattr -x user.k {d}/f"),
        format!("setfattr -n user.k -v w {d}/sub"),
    ] {
        let out = a.sh(&change);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains("Read-only file system"), "`{change}` on a sealed tree: {err}");
    }
    assert_eq!(a.ok(&format!("cat {d}/f {d}/sub/g")), "datas", "a refused change changed nothing");
    assert_eq!(a.ok(&format!("ls {d} | tr '\\n' ' '")), "f l p sub ");
    assert!(!a.sh(&format!("test -e {mnt}/outside || test -e {mnt}/f2 || test -e {mnt}/d2")).status.success());

    // Repeated opens, reads, stats and listings of the sealed tree reach no metad.
    let warm = format!("ls -lR {d} >/dev/null && cat {d}/f {d}/sub/g >/dev/null && stat {d}/l {d}/p >/dev/null");
    a.ok(&warm);
    a.ok(&warm);
    let before = meta_requests(&net, &fs);
    for _ in 0..20 {
        a.ok(&warm);
    }
    assert_eq!(meta_requests(&net, &fs), before, "a sealed tree's opens, reads and listings asked metad (by kind)");

    // Unsealed on B: changes work again, and each node sees the other's at once.
    b.ok(&format!("{odfs} unseal {mnt}/d"));
    a.ok(&format!("chmod 600 {d}/f && printf new > {d}/new && mkdir {d}/sub/more"));
    assert_eq!(b.ok(&format!("stat -c %a {d}/f")).trim(), "600");
    assert_eq!(b.ok(&format!("cat {d}/new")), "new");
    assert_eq!(b.ok(&format!("ls {d}/sub | tr '\\n' ' '")), "g more ");
    b.ok(&format!("rm {d}/l && printf again > {d}/f"));
    assert_eq!(a.ok(&format!("ls {d} | tr '\\n' ' '")), "f new p sub ", "A's cached listing of the sealed tree");
    assert_eq!(a.ok(&format!("cat {d}/f")), "again");
    assert_eq!(a.ok(&format!("getfattr --only-values -n odfs.sealed {d}")), "0");
}

#[test]
fn creates_a_node_answers_itself_are_seen_by_the_very_next_call_on_the_other() {
    let (net, fs, a, b) = two_nodes();
    let mnt = a.mnt.display().to_string();
    let scratch = tempfile::tempdir().unwrap();

    // A made the directory and is alone in it: it answers creates there itself (a create
    // delegation) and sends them to metad in batches, where each counts as the create it is.
    let d = format!("{mnt}/made");
    a.ok(&format!("mkdir {d}"));
    let before = meta_requests(&net, &fs);
    a.ok(&format!("for i in $(seq 1 100); do : > {d}/e$i; done; printf 'small file' > {d}/w"));
    let after = meta_requests(&net, &fs);
    let delta = |k: &str| after.get(k).copied().unwrap_or(0) - before.get(k).copied().unwrap_or(0);
    assert_eq!(delta("DelegateCreates"), 1, "{after:?}");
    assert!(delta("CreateBatch") >= 1, "no batch of deferred creates reached metad: {after:?}");
    assert_eq!(delta("Create"), 101, "each create counted once at metad, batched or not: {after:?}");
    // B's very first look sees all of them, with the size published at close.
    assert_eq!(b.ok(&format!("ls {d} | wc -l")).trim(), "101");
    assert_eq!(b.ok(&format!("cat {d}/w")), "small file");
    assert_eq!(b.ok(&format!("stat -c %s {d}/e77 {d}/w | tr '\\n' ' '")), "0 10 ");

    // A creating while B looks: every create A has returned from is there for B's next lookup.
    let d2 = format!("{mnt}/made2");
    let progress = scratch.path().join("progress");
    a.ok(&format!("mkdir {d2} && echo 0 > {p}", p = progress.display()));
    a.ok(&format!(
        "(for i in $(seq 1 1500); do : > {d2}/f$i; echo $i > {p}.new; mv {p}.new {p}; done) >/dev/null 2>&1 &",
        p = progress.display()
    ));
    let (mut seen, t) = (0, Instant::now());
    while seen < 1500 {
        assert!(t.elapsed() < Duration::from_secs(300), "A's creates stopped at {seen}");
        let n: u32 = fs::read_to_string(&progress).unwrap().trim().parse().unwrap();
        if n > 0 {
            b.ok(&format!("test -e {d2}/f{n}"));
        }
        seen = n;
    }
    assert_eq!(b.ok(&format!("ls {d2} | wc -l")).trim(), "1500");

    // Names still in A's log unlinked, renamed and changed: metad gets them in order.
    let d3 = format!("{mnt}/made3");
    a.ok(&format!(
        "mkdir {d3} && : > {d3}/u && rm {d3}/u && : > {d3}/r && mv {d3}/r {d3}/r2 && printf x > {d3}/s && \
         chmod 600 {d3}/s"
    ));
    // A file made under the delegation, linked while open into a directory B uses (so B's
    // look there recalls nothing of A's): its size at close is published, not left in A's log.
    b.ok(&format!("mkdir {mnt}/bdir && ls {mnt}/bdir"));
    a.ok(&format!("exec 3>{d3}/h && ln {d3}/h {mnt}/bdir/linked && printf abc >&3 && exec 3>&-"));
    assert_eq!(b.ok(&format!("cat {mnt}/bdir/linked")), "abc");
    assert_eq!(b.ok(&format!("ls {d3} | tr '\\n' ' '")), "h r2 s ");
    assert_eq!(b.ok(&format!("stat -c %a {d3}/s")).trim(), "600");

    // Unlinks A answers itself too, of files it made there and holds open nowhere: each
    // counts at metad as the unlink it is, B's next look finds them gone, and their chunk files
    // go. One that A holds open goes through metad and stays readable through A's descriptor.
    let d5 = format!("{mnt}/made5");
    a.ok(&format!("mkdir {d5} && for i in $(seq 1 30); do printf data$i > {d5}/g$i; done && sync {d5}"));
    let inos: Vec<u64> = a
        .ok(&format!("stat -c %i {d5}/g1 {d5}/g2 {d5}/g20 {d5}/g21"))
        .lines()
        .map(|l| l.trim().parse().unwrap())
        .collect();
    assert!(inos.iter().all(|&i| !chunk_files(&fs, i).is_empty()), "a written file has no chunk file");
    let before = meta_requests(&net, &fs);
    a.ok(&format!("for i in $(seq 1 20); do rm {d5}/g$i; done"));
    a.ok(&format!("exec 3<{d5}/g21 && rm {d5}/g21 && test \"$(cat <&3)\" = data21"));
    assert_eq!(b.ok(&format!("ls {d5} | wc -l")).trim(), "9");
    b.ok(&format!(
        "! test -e {d5}/g1 && ! test -e {d5}/g20 && ! test -e {d5}/g21 && test \"$(cat {d5}/g22)\" = data22"
    ));
    let after = meta_requests(&net, &fs);
    let delta = |k: &str| after.get(k).copied().unwrap_or(0) - before.get(k).copied().unwrap_or(0);
    assert_eq!(delta("Unlink"), 21, "each unlink counted once at metad, batched or not: {after:?}");
    // The creates were applied before (sync): a batch now carried unlinks A had answered.
    assert!(delta("CreateBatch") >= 1, "no unlink went in a batch: {after:?}");
    assert!(
        wait_until(Duration::from_secs(30), || inos.iter().all(|&i| chunk_files(&fs, i).is_empty())),
        "the chunk files of files A unlinked are still there (g21's once its descriptor closed)"
    );
    // The same names made again, on A: new files.
    a.ok(&format!("printf new > {d5}/g1"));
    assert_eq!(b.ok(&format!("cat {d5}/g1")), "new");
    // A file A made under a delegation (in a directory B has not seen) and then sealed through
    // its own mount: its unlink is metad's to refuse, and the caller sees EROFS, not a success
    // undone later.
    let d6 = format!("{mnt}/made6");
    // (The pause lets the kernel's RELEASE of printf's descriptor, sent after close returns,
    // arrive: a file still open here is unlinked through metad in any case.)
    a.ok(&format!("mkdir {d6} && printf x > {d6}/sealed && sleep 1 && setfattr -n odfs.sealed -v 1 {d6}/sealed"));
    let out = a.sh(&format!("rm {d6}/sealed"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("Read-only file system"), "rm of a sealed file: {err}");
    b.ok(&format!("test -e {d6}/sealed"));

    // An fsync of the directory sends A's log; frozen, A still holds the delegation: B's look
    // waits for it at most the lease, then sees what A had sent, and A, thawed, goes on.
    let d4 = format!("{mnt}/made4");
    a.ok(&format!("mkdir {d4} && : > {d4}/held && sync {d4}"));
    signal(&a, libc::SIGSTOP);
    let t = Instant::now();
    let listing = b.ok(&format!("ls {d4}"));
    let waited = t.elapsed();
    signal(&a, libc::SIGCONT);
    assert_eq!(listing, "held\n");
    // Liveness, not speed: the lease is 30 s; a look that waited for ever would hang here.
    assert!(waited < Duration::from_secs(90), "a frozen holder held B's listing for {waited:?}");
    a.ok(&format!(": > {d4}/after"));
    b.ok(&format!("test -e {d4}/after && test -e {d4}/held"));
}

/// Waits (bounded, liveness only) until `path` exists on the test's side.
fn wait_for_file(path: &Path, what: &str, limit: Duration) {
    let t = Instant::now();
    while !path.exists() {
        assert!(t.elapsed() < limit, "{what}: not done within {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A lock holder on a node: takes an exclusive `flock` on the whole file or an `fcntl` write
/// lock on bytes 10..20 (F_SETLKW), writes its pid to `pidfile`, and sleeps until killed.
const HOLDER: &str = "import fcntl,os,sys,time\n\
    path,kind,pidfile=sys.argv[1:4]\n\
    fd=os.open(path,os.O_RDWR)\n\
    fcntl.flock(fd,fcntl.LOCK_EX) if kind=='flock' else fcntl.lockf(fd,fcntl.LOCK_EX,10,10)\n\
    open(pidfile+'.tmp','w').write(str(os.getpid()))\n\
    os.rename(pidfile+'.tmp',pidfile)\n\
    time.sleep(600)\n";

/// What another process sees of the locks on `path`: an exclusive `flock` (LOCK_NB), F_GETLK
/// of a write lock on bytes 0..100 (type, start, length, pid), and F_SETLK on bytes 10..20
/// and 20..30.
const PROBE: &str = "import fcntl,os,struct,sys\n\
    fd=os.open(sys.argv[1],os.O_RDWR)\n\
    def try_(f):\n\
    \x20   try:\n\
    \x20       f(); return 'got'\n\
    \x20   except BlockingIOError: return 'busy'\n\
    q=struct.pack('hhqqi4x',fcntl.F_WRLCK,0,0,100,0)\n\
    t,w,s,l,pid=struct.unpack('hhqqi4x',fcntl.fcntl(fd,fcntl.F_GETLK,q))\n\
    held='none' if t==fcntl.F_UNLCK else '%s:%d+%d:pid%d'%('w' if t==fcntl.F_WRLCK else 'r',s,l,pid)\n\
    r10=try_(lambda: fcntl.lockf(fd,fcntl.LOCK_EX|fcntl.LOCK_NB,10,10))\n\
    r20=try_(lambda: fcntl.lockf(fd,fcntl.LOCK_EX|fcntl.LOCK_NB,10,20))\n\
    os.close(fd)\n\
    fd=os.open(sys.argv[1],os.O_RDONLY)\n\
    print(try_(lambda: fcntl.flock(fd,fcntl.LOCK_EX|fcntl.LOCK_NB)),held,r10,r20)\n";

/// Every node adds 1 to a counter file 40 times under a lock, `flock` or `fcntl` (F_SETLKW on
/// byte 0), reading it after taking the lock and writing it before dropping it; then writes
/// "ok" (or what went wrong: without the lock a read may find the other node's write half
/// done) to `done-KIND-TAG`.
const COUNT: &str = "import fcntl,os,sys\n\
    mnt,kind,tag=sys.argv[1:4]\n\
    fd=os.open(mnt+'/lock-'+kind,os.O_RDWR)\n\
    result='ok'\n\
    try:\n\
    \x20   for i in range(40):\n\
    \x20       fcntl.flock(fd,fcntl.LOCK_EX) if kind=='flock' else fcntl.lockf(fd,fcntl.LOCK_EX,1,0)\n\
    \x20       n=int(open(mnt+'/counter-'+kind).read())\n\
    \x20       with open(mnt+'/counter-'+kind,'w') as f: f.write(str(n+1))\n\
    \x20       fcntl.flock(fd,fcntl.LOCK_UN) if kind=='flock' else fcntl.lockf(fd,fcntl.LOCK_UN,1,0)\n\
    except Exception as e:\n\
    \x20   result=repr(e)\n\
    open(mnt+'/done-'+kind+'-'+tag,'w').write(result)\n";

#[test]
fn flock_and_fcntl_locks_hold_across_nodes_and_go_with_their_holder() {
    let (_net, _fs, a, b) = two_nodes();
    let mnt = a.mnt.display().to_string();
    let scratch = tempfile::tempdir().unwrap();
    let script = |name: &str, text: &str| {
        let p = scratch.path().join(name);
        fs::write(&p, text).unwrap();
        p.display().to_string()
    };
    let (holder, probe, count) = (script("holder.py", HOLDER), script("probe.py", PROBE), script("count.py", COUNT));
    a.ok(&format!(
        "for k in flock fcntl; do : > {mnt}/lock-$k; echo 0 > {mnt}/counter-$k; done; : > {mnt}/lf; : > {mnt}/lr"
    ));

    // Mutual exclusion across nodes, and the data written under a lock seen by its next holder:
    // two nodes counting at once lose no increment.
    for kind in ["flock", "fcntl"] {
        a.ok(&format!("python3 {count} {mnt} {kind} a >/dev/null 2>&1 &"));
        b.ok(&format!("python3 {count} {mnt} {kind} b >/dev/null 2>&1 &"));
        for tag in ["a", "b"] {
            let t = Instant::now();
            while !b.sh(&format!("test -e {mnt}/done-{kind}-{tag}")).status.success() {
                assert!(t.elapsed() < Duration::from_secs(120), "{kind}: node {tag} did not finish counting");
                std::thread::sleep(Duration::from_millis(100));
            }
            b.eventually("the counter's result", &format!("test -s {mnt}/done-{kind}-{tag}"));
            assert_eq!(b.ok(&format!("cat {mnt}/done-{kind}-{tag}")), "ok", "{kind}: node {tag} failed counting");
        }
        assert_eq!(b.ok(&format!("cat {mnt}/counter-{kind}")), "80", "{kind}: an increment was lost");
    }

    // A holds an exclusive flock on lf and a write lock on bytes 10..20 of lr: B sees both.
    let (pf, pr) = (scratch.path().join("pf"), scratch.path().join("pr"));
    a.ok(&format!("python3 {holder} {mnt}/lf flock {} >/dev/null 2>&1 &", pf.display()));
    a.ok(&format!("python3 {holder} {mnt}/lr fcntl {} >/dev/null 2>&1 &", pr.display()));
    wait_for_file(&pf, "A's flock", Duration::from_secs(30));
    wait_for_file(&pr, "A's fcntl lock", Duration::from_secs(30));
    assert_eq!(b.ok(&format!("python3 {probe} {mnt}/lf")).trim(), "busy w:0+0:pid0 busy busy", "A's flock on lf");
    assert_eq!(
        b.ok(&format!("python3 {probe} {mnt}/lr")).trim(),
        "busy w:10+10:pid0 busy got",
        "A's fcntl lock on bytes 10..20 of lr (another node's pid reads 0; a flock conflicts with it, as on NFS)"
    );
    let code = b.sh(&format!("flock -n -E 75 {mnt}/lf true")).status.code();
    assert_eq!(code, Some(75), "flock(1) -n on B while A holds lf");

    // A's holders are killed: their exit closes the files, and the locks go with them.
    for p in [&pf, &pr] {
        let pid: i32 = fs::read_to_string(p).unwrap().trim().parse().unwrap();
        // SAFETY: plain kill(2) of a holder this test started.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    }
    b.eventually("lf free after its holder was killed", &format!("flock -n {mnt}/lf true"));
    b.eventually(
        "lr free after its holder was killed",
        &format!("python3 {probe} {mnt}/lr | grep -q '^got none got got$'"),
    );

    // A's odfs-fuse dies while a process of A holds lf: B's waiting flock gets it once A's
    // session has ended (at most about a lease), and nothing else of A's stays locked.
    fs::remove_file(&pf).unwrap();
    a.ok(&format!("python3 {holder} {mnt}/lf flock {} >/dev/null 2>&1 &", pf.display()));
    wait_for_file(&pf, "A's second flock", Duration::from_secs(30));
    let holder_pid: i32 = fs::read_to_string(&pf).unwrap().trim().parse().unwrap();
    signal(&a, libc::SIGKILL);
    let t = Instant::now();
    b.ok(&format!("flock -x {mnt}/lf true"));
    let waited = t.elapsed();
    // SAFETY: plain kill(2) of the holder this test started (its mount is gone).
    unsafe { libc::kill(holder_pid, libc::SIGKILL) };
    // Liveness, not speed: the lease is 30 s; a lock kept for ever would hang here.
    assert!(waited < Duration::from_secs(90), "a dead node's lock held B for {waited:?}");
}
