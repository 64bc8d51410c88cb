//! Real tools on a real mount: fio with data verification, tar of a real source tree, git,
//! `cp -a` + `diff -r`, a Python script using `os` and `shutil`, a training job's file formats
//! (NumPy, safetensors, HDF5, tar shards) across two clients, and CPython's own test suite for
//! files and the OS. Each checks outcomes the tool itself verifies (checksums, object
//! hashes, exit status, the suite's verdict) and the bytes on the mount.
//!
//! Needs root, /dev/fuse and the tools (scripts/test installs fio, git, python3 and its test
//! suite, numpy, h5py and safetensors, tar, diffutils).

use odfs_tests::*;
use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Runs a command, failing the test with its output unless it succeeds; returns stdout.
fn run(cmd: &mut Command) -> String {
    let out =
        cmd.output().unwrap_or_else(|e| panic!("cannot run {cmd:?} (is it installed? scripts/test installs it): {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The workspace's source tree (a real tree: Rust sources, TOML, Markdown, scripts).
fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf()
}

/// sha256 of every regular file below `dir`, by path relative to `dir`.
fn tree_digests(dir: &Path) -> BTreeMap<String, String> {
    walk_files(dir)
        .into_iter()
        .filter(|p| fs::symlink_metadata(p).unwrap().is_file())
        .map(|p| {
            let rel = Path::new(&p).strip_prefix(dir).unwrap().to_string_lossy().into_owned();
            (rel, sha256(&fs::read(&p).unwrap()))
        })
        .collect()
}

fn drop_caches() {
    // SAFETY: sync(2) has no preconditions.
    unsafe { libc::sync() };
    fs::write("/proc/sys/vm/drop_caches", "3").expect("drop caches (needs root)");
}

#[test]
fn fio_sequential_and_random_writes_verify_with_crc32c() {
    let fs = LocalFs::up(4, &["--chunk-size", "65536", "--stripe-count", "4"]);
    let m = FuseMount::start(&fs);
    let dir = m.p("fio");
    fs::create_dir(&dir).unwrap();
    let jobs: [(&str, &[&str]); 3] = [
        ("seq", &["--rw=write", "--bs=1M", "--size=64M", "--numjobs=2"]),
        // Blocks that are not a divisor of the chunk size straddle chunk boundaries.
        ("seqodd", &["--rw=write", "--bs=100k", "--size=24M", "--numjobs=1"]),
        ("rand", &["--rw=randwrite", "--bs=4k", "--size=16M", "--numjobs=2"]),
    ];
    for (name, args) in jobs {
        let fio = |extra: &[&str]| {
            let mut c = Command::new("fio");
            c.arg(format!("--name={name}"))
                .arg(format!("--directory={}", dir.display()))
                .args(args)
                .args([
                    "--ioengine=psync",
                    "--verify=crc32c",
                    "--verify_fatal=1",
                    "--verify_state_save=0",
                    "--group_reporting",
                ])
                .args(extra);
            run(&mut c)
        };
        // Write, then read back and verify every block's checksum and header.
        let out = fio(&["--do_verify=1"]);
        assert!(out.contains("err= 0"), "fio {name} reported an error:\n{out}");
        // Verify again from odfs itself, not the page cache.
        drop_caches();
        let out = fio(&["--verify_only"]);
        assert!(out.contains("err= 0"), "fio {name} verify-only pass reported an error:\n{out}");
    }
}

#[test]
fn a_source_tree_extracted_with_tar_matches_file_by_file() {
    let fs = LocalFs::up(2, &["--chunk-size", "65536", "--stripe-count", "2"]);
    let m = FuseMount::start(&fs);
    let scratch = tempfile::tempdir().unwrap();
    let tarball = scratch.path().join("src.tar");
    // Two real trees: this workspace's sources and the kernel's UAPI headers.
    let ws = workspace();
    run(Command::new("tar")
        .arg("-cf")
        .arg(&tarball)
        .args(["--exclude=./target", "--exclude=./.git", "-C"])
        .arg(&ws)
        .arg(".")
        .args(["-C", "/usr", "include/linux"]));
    let dst = m.p("src");
    fs::create_dir(&dst).unwrap();
    run(Command::new("tar").arg("-xf").arg(&tarball).arg("-C").arg(&dst));

    // The reference: the same tarball extracted on the local disk.
    let reference = scratch.path().join("reference");
    fs::create_dir(&reference).unwrap();
    run(Command::new("tar").arg("-xf").arg(&tarball).arg("-C").arg(&reference));
    let want = tree_digests(&reference);
    drop_caches();
    let got = tree_digests(&dst);
    assert!(want.len() > 500, "a real tree: {} files", want.len());
    assert_eq!(got.len(), want.len(), "number of files extracted");
    for (p, d) in &want {
        assert_eq!(got.get(p), Some(d), "{p} differs after extraction");
    }
    // tar itself agrees: compare mode checks contents, sizes, modes and mtimes.
    let out = Command::new("tar").arg("--compare").arg("-f").arg(&tarball).arg("-C").arg(&dst).output().unwrap();
    assert!(
        out.status.success(),
        "tar --compare: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn git_init_add_commit_log_gc_and_clone() {
    let fs = LocalFs::up(2, &[]);
    let m = FuseMount::start(&fs);
    let home = tempfile::tempdir().unwrap();
    let git = |dir: &Path, args: &[&str]| {
        run(Command::new("git")
            .args(["-c", "user.name=odfs test", "-c", "user.email=test@odfs.invalid", "-c", "init.defaultBranch=main"])
            .args(args)
            .current_dir(dir)
            .env("HOME", home.path())
            .env("GIT_CONFIG_NOSYSTEM", "1"))
    };
    let repo = m.p("repo");
    fs::create_dir(&repo).unwrap();
    git(&repo, &["init", "-q"]);
    run(Command::new("cp").arg("-r").arg(workspace().join("crates")).arg(&repo));
    git(&repo, &["add", "-A"]);
    git(&repo, &["commit", "-q", "-m", "first: the crates"]);
    fs::write(repo.join("NOTES"), "a second commit\n").unwrap();
    fs::remove_dir_all(repo.join("crates/proto")).unwrap();
    git(&repo, &["add", "-A"]);
    git(&repo, &["commit", "-q", "-m", "second: notes, no proto"]);

    let log = git(&repo, &["log", "--format=%s"]);
    assert_eq!(log.lines().collect::<Vec<_>>(), ["second: notes, no proto", "first: the crates"]);
    assert_eq!(git(&repo, &["status", "--porcelain"]), "", "work tree clean after commit");
    git(&repo, &["fsck", "--full", "--strict"]);
    // gc packs loose objects (renames, unlinks, many small files) and the repository stays whole.
    git(&repo, &["gc", "-q", "--aggressive"]);
    git(&repo, &["fsck", "--full", "--strict"]);
    let files = git(&repo, &["ls-files"]);
    assert!(files.lines().any(|l| l == "NOTES") && !files.contains("crates/proto/"));

    // A clone on the mount checks out the same tree; the first commit's tree still has proto.
    git(&m.path, &["clone", "-q", "repo", "clone"]);
    assert_eq!(tree_digests(&m.p("clone/crates")), tree_digests(&repo.join("crates")));
    git(&m.p("clone"), &["checkout", "-q", "HEAD~1"]);
    assert_eq!(
        fs::read(m.p("clone/crates/proto/Cargo.toml")).unwrap(),
        fs::read(workspace().join("crates/proto/Cargo.toml")).unwrap()
    );
}

#[test]
fn cp_a_preserves_the_tree_and_diff_r_finds_no_difference() {
    let fs = LocalFs::up(2, &["--chunk-size", "65536", "--stripe-count", "2"]);
    let m = FuseMount::start(&fs);
    let src = tempfile::tempdir().unwrap();
    // A tree with what cp -a must carry: modes, mtimes, symlinks, hard links, an empty dir.
    run(Command::new("cp").arg("-r").arg(workspace().join("crates")).arg(src.path()));
    let s = src.path().join("crates");
    fs::write(s.join("big.bin"), pattern(3 << 20 | 12345, 5)).unwrap();
    fs::set_permissions(s.join("big.bin"), fs::Permissions::from_mode(0o751)).unwrap();
    std::os::unix::fs::symlink("big.bin", s.join("link-to-big")).unwrap();
    fs::hard_link(s.join("big.bin"), s.join("big-hardlink")).unwrap();
    fs::create_dir(s.join("empty")).unwrap();

    let dst = m.p("copy");
    run(Command::new("cp").arg("-a").arg(&s).arg(&dst));
    drop_caches();
    let out = run(Command::new("diff").arg("-r").arg("--no-dereference").arg(&s).arg(&dst));
    assert_eq!(out, "", "diff -r found differences");

    for p in walk_files(&s) {
        let rel = Path::new(&p).strip_prefix(&s).unwrap();
        let (a, b) = (fs::symlink_metadata(&p).unwrap(), fs::symlink_metadata(dst.join(rel)).unwrap());
        assert_eq!(a.mode(), b.mode(), "mode of {}", rel.display());
        assert_eq!((a.mtime(), a.mtime_nsec()), (b.mtime(), b.mtime_nsec()), "mtime of {}", rel.display());
        assert_eq!(a.len(), b.len(), "size of {}", rel.display());
    }
    assert_eq!(fs::read_link(dst.join("link-to-big")).unwrap(), Path::new("big.bin"));
    let (a, b) = (fs::metadata(dst.join("big.bin")).unwrap(), fs::metadata(dst.join("big-hardlink")).unwrap());
    assert_eq!((a.ino(), a.nlink()), (b.ino(), 2), "cp -a keeps hard links as links");
    assert!(fs::read_dir(dst.join("empty")).unwrap().next().is_none());
}

/// A Python program doing everyday `os` and `shutil` work, checking each result itself.
const PY_OS_SHUTIL: &str = r#"
import hashlib, os, shutil, stat, sys, tempfile
root = os.path.join(sys.argv[1], "py")
src = os.path.join(root, "src")
os.makedirs(os.path.join(src, "a", "b", "c"))
os.makedirs(os.path.join(src, "a"), exist_ok=True)
digests = {}
for i in range(60):
    data = hashlib.sha256(str(i).encode()).digest() * (i * 37 + 1)
    p = os.path.join(src, "a", "b", "f%02d.bin" % i)
    with open(p, "wb") as f:
        f.write(data)
    digests[p] = hashlib.sha256(data).hexdigest()
text = os.path.join(src, "text.txt")
with open(text, "w") as f:
    f.write("hello odfs\n" * 5000)
os.symlink("text.txt", os.path.join(src, "link"))
os.link(text, os.path.join(src, "hard"))
assert os.stat(text).st_nlink == 2
os.chmod(text, 0o640)
os.utime(text, ns=(1_000_000_000_000_000_000, 1_234_567_890_123_456_789))
st = os.stat(text)
assert stat.S_IMODE(st.st_mode) == 0o640, oct(st.st_mode)
assert st.st_mtime_ns == 1_234_567_890_123_456_789, st.st_mtime_ns
assert sorted(os.listdir(os.path.join(src, "a", "b"))) == ["c"] + ["f%02d.bin" % i for i in range(60)]
assert sorted(e.name for e in os.scandir(src)) == ["a", "hard", "link", "text.txt"]

dst = os.path.join(root, "copy")
shutil.copytree(src, dst, symlinks=True)
for p, d in digests.items():
    q = p.replace(src, dst, 1)
    with open(q, "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == d, q
assert os.readlink(os.path.join(dst, "link")) == "text.txt"
assert os.stat(os.path.join(dst, "text.txt")).st_mtime_ns == st.st_mtime_ns
assert stat.S_IMODE(os.stat(os.path.join(dst, "text.txt")).st_mode) == 0o640

moved = os.path.join(root, "moved")
shutil.move(os.path.join(dst, "a"), moved)
assert not os.path.exists(os.path.join(dst, "a")) and os.path.isdir(os.path.join(moved, "b", "c"))
os.rename(os.path.join(moved, "b", "f01.bin"), os.path.join(moved, "f01.bin"))
tmp = os.path.join(moved, "b", "f02.bin.tmp")
with open(tmp, "wb") as f:
    f.write(b"replacement")
    f.flush()
    os.fsync(f.fileno())
os.replace(tmp, os.path.join(moved, "b", "f02.bin"))
with open(os.path.join(moved, "b", "f02.bin"), "rb") as f:
    assert f.read() == b"replacement"
p = os.path.join(moved, "b", "f03.bin")
with open(p, "ab") as f:
    f.write(b"tail")
os.truncate(p, 10)
assert os.path.getsize(p) == 10
with tempfile.NamedTemporaryFile(dir=moved) as t:
    t.write(b"x" * 100000)
    t.flush()
    assert os.path.getsize(t.name) == 100000
shutil.copy2(text, os.path.join(moved, "t2"))
shutil.copyfileobj(open(text, "rb"), open(os.path.join(moved, "t3"), "wb"))
assert open(os.path.join(moved, "t2"), "rb").read() == open(os.path.join(moved, "t3"), "rb").read()
walked = sum(len(files) for _, _, files in os.walk(root))
assert walked == 63 + 3 + 62, walked  # src; copy without a/; moved with t2, t3
du = shutil.disk_usage(sys.argv[1])
assert du.total > 0 and du.free > 0 and du.used >= 0
shutil.rmtree(root)
assert not os.path.exists(root)
print("ok")
"#;

#[test]
fn python_os_and_shutil_operations() {
    let fs = LocalFs::up(2, &["--chunk-size", "65536", "--stripe-count", "2"]);
    let m = FuseMount::start(&fs);
    let out = run(Command::new("python3").arg("-c").arg(PY_OS_SHUTIL).arg(&m.path));
    assert_eq!(out.trim(), "ok");
    assert!(fs::read_dir(&m.path).unwrap().next().is_none(), "rmtree left entries behind");
}

/// Fails the test, naming `what`, unless `python3 -c {import}` succeeds.
fn require_python(import: &str, what: &str) {
    let found = Command::new("python3").args(["-c", import]).output().expect("run python3");
    assert!(found.status.success(), "{what} is missing: {}", String::from_utf8_lossy(&found.stderr));
}

/// The file formats of a training job, each written through one client and read back through
/// another (argv[1] and argv[2]: one directory through two mounts): a checkpoint storm of four
/// processes at once (`np.save` and safetensors, then fsync), read back whole and mapped; HDF5
/// with its default file locking, gzip-compressed chunks and SWMR appends; a NumPy memmap
/// written through the mapping; WebDataset-style tar shards streamed. Every value is compared.
const PY_ML_FORMATS: &str = r#"
import hashlib, io, multiprocessing, os, sys, tarfile
import h5py, numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file, save_file
A, B = sys.argv[1], sys.argv[2]

def tensors(rank):
    rng = np.random.default_rng(rank)
    return {f"layer{i}.weight": rng.standard_normal((512, 512 + i), dtype=np.float32) for i in range(8)}

def save_rank(rank):
    arr = np.random.default_rng(100 + rank).integers(0, 1 << 62, size=4 << 20)
    np.save(os.path.join(A, f"ckpt/rank{rank}.npy"), arr)
    p = os.path.join(A, f"ckpt/rank{rank}.safetensors")
    save_file(tensors(rank), p)
    for q in (p, os.path.join(A, f"ckpt/rank{rank}.npy")):
        with open(q, "rb+") as f:
            os.fsync(f.fileno())

def checkpoints():
    os.makedirs(os.path.join(A, "ckpt"))
    with multiprocessing.Pool(4) as pool:
        pool.map(save_rank, range(4))
    for rank in range(4):
        want = np.random.default_rng(100 + rank).integers(0, 1 << 62, size=4 << 20)
        for mode in (None, "r"):
            assert np.array_equal(np.load(os.path.join(B, f"ckpt/rank{rank}.npy"), mmap_mode=mode), want), rank
        p, ref = os.path.join(B, f"ckpt/rank{rank}.safetensors"), tensors(rank)
        got = load_file(p)
        assert got.keys() == ref.keys() and all(np.array_equal(got[k], ref[k]) for k in ref), rank
        with safe_open(p, framework="numpy") as f:
            assert np.array_equal(f.get_slice("layer3.weight")[7:9], ref["layer3.weight"][7:9])

def hdf5():
    p = os.path.join(A, "d.h5")
    x = np.random.default_rng(1).standard_normal((2000, 512)).astype(np.float32)
    with h5py.File(p, "w", libver="latest") as f:
        f.create_dataset("x", data=x, chunks=(100, 512), compression="gzip")
        f.attrs["n"] = 2000
    with h5py.File(os.path.join(B, "d.h5"), "r") as f:
        assert np.array_equal(f["x"][:], x) and f.attrs["n"] == 2000
    with h5py.File(p, "a", libver="latest") as f:
        d = f.create_dataset("y", shape=(0,), maxshape=(None,), dtype="i8", chunks=(1024,))
        f.swmr_mode = True
        for k in range(5):
            d.resize(((k + 1) * 1000,))
            d[k * 1000:] = np.arange(k * 1000, (k + 1) * 1000)
            d.flush()
    with h5py.File(os.path.join(B, "d.h5"), "r", swmr=True) as f:
        assert np.array_equal(f["y"][:], np.arange(5000)) and np.array_equal(f["x"][:], x)

def memmap():
    m = np.lib.format.open_memmap(os.path.join(A, "mm.npy"), mode="w+", dtype=np.float64, shape=(2_000_000,))
    m[:] = np.arange(2_000_000)
    m.flush()
    del m
    assert np.array_equal(np.load(os.path.join(B, "mm.npy"), mmap_mode="r"), np.arange(2_000_000))

def shards():
    want = {}
    for s in range(4):
        with tarfile.open(os.path.join(A, f"shard-{s:04d}.tar"), "w") as t:
            for k in range(300):
                b = os.urandom(1000 + (k * 37) % 20000)
                name = f"{s:04d}{k:05d}.jpg"
                want[name] = hashlib.sha256(b).hexdigest()
                info = tarfile.TarInfo(name)
                info.size = len(b)
                t.addfile(info, io.BytesIO(b))
    got = {}
    for s in range(4):
        with tarfile.open(os.path.join(B, f"shard-{s:04d}.tar"), "r|") as t:
            for m in t:
                got[m.name] = hashlib.sha256(t.extractfile(m).read()).hexdigest()
    assert got == want

if __name__ == "__main__":
    for step in (checkpoints, hdf5, memmap, shards):
        step()
    print("ok")
"#;

/// A training job's file formats, with the libraries that write them (NumPy, safetensors, h5py
/// with its bundled HDF5; scripts/test installs them): written through one client and read
/// through another, in a default-striped directory and in a local-placement one (passed through
/// on the writer's node).
#[test]
fn training_file_formats_written_through_one_client_read_back_through_another() {
    require_python(
        "import numpy, h5py, safetensors",
        "numpy, h5py or safetensors (scripts/test installs them into its virtualenv)",
    );
    let fs = LocalFs::up(4, &[]);
    let a = FuseMount::start(&fs);
    let b = FuseMount::start_at(&fs, "mnt2", &[]);
    fs::create_dir(a.p("striped")).unwrap();
    fs::create_dir(a.p("local")).unwrap();
    fs.cli_ok(&["setstripe", "--local", "-c", "1", &a.p("local").to_string_lossy()]);
    for dir in ["striped", "local"] {
        let out = run(Command::new("python3").arg("-c").arg(PY_ML_FORMATS).arg(a.p(dir)).arg(b.p(dir)));
        assert_eq!(out.trim(), "ok", "{dir}");
    }
}

/// Modules of CPython's own test suite that work files and directories hard: `os`, `posix`,
/// `shutil`, `tempfile`, raw and buffered I/O, `mmap`, `fcntl` locks, archives, `mailbox`'s
/// locking and renames, `logging`'s rotation, `dbm.dumb`, byte-compiling, large files. All pass
/// on a local disk here. Left out: `test_selectors`, which expects epoll to refuse a regular
/// file (every FUSE file can be polled, see the README), and `test_compileall`, which fails on a
/// local disk here too.
const CPYTHON_TESTS: &[&str] = &[
    "test_os",
    "test_posix",
    "test_shutil",
    "test_tempfile",
    "test_fileio",
    "test_io",
    "test_mmap",
    "test_fcntl",
    "test_glob",
    "test_pathlib",
    "test_stat",
    "test_genericpath",
    "test_posixpath",
    "test_filecmp",
    "test_fileinput",
    "test_largefile",
    "test_zipfile",
    "test_tarfile",
    "test_gzip",
    "test_zipimport",
    "test_mailbox",
    "test_logging",
    "test_dbm_dumb",
    "test_shelve",
    "test_py_compile",
    "test_linecache",
];

#[test]
fn cpythons_own_file_and_os_tests_pass_on_the_mount_as_an_ordinary_user() {
    require_python("import test.support", "CPython's test suite (scripts/test installs libpython3.11-testsuite)");
    // An ordinary user, as the job's user is: the suite's permission checks run (as root most
    // are skipped).
    let user = TestUser::create("py");
    let fs = LocalFs::up(2, &["--chunk-size", "65536", "--stripe-count", "2"]);
    let m = FuseMount::start_with(&fs, &["--allow-other"]);
    let home = m.p("home");
    fs::create_dir(&home).unwrap();
    // SAFETY: valid path.
    assert_eq!(unsafe { libc::chown(cpath(&home).as_ptr(), user.uid, user.gid) }, 0);
    // regrtest makes each worker's directory in TMPDIR and the tests work in it: all on the mount.
    let script = format!(
        "cd '{h}' && TMPDIR='{h}' HOME='{h}' exec python3 -m test -j2 {}",
        CPYTHON_TESTS.join(" "),
        h = home.display()
    );
    let out = user.run("sh", &[Path::new("-c"), Path::new(&script)]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("Tests result: SUCCESS"),
        "CPython's tests failed on the mount ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains(&format!("All {} tests OK.", CPYTHON_TESTS.len())), "not every module ran:\n{stdout}");
}

/// The shell lines of the first ```sh block under `heading` in a Markdown file.
fn doc_block(doc: &str, heading: &str) -> Vec<String> {
    let after = doc.split_once(heading).unwrap_or_else(|| panic!("no {heading:?} in the document")).1;
    let block = after.split_once("```sh\n").expect("a sh block").1.split_once("```").expect("closed").0;
    block.lines().map(|l| l.split(" #").next().unwrap_or("").trim().to_string()).filter(|l| !l.is_empty()).collect()
}

#[test]
fn the_admin_guides_install_steps_work_as_written() {
    // docs/admin.md's "## Install" block, run line by line with its absolute paths moved under
    // a scratch root (and this build's binaries for target/release): if the guide drifts from
    // the product (a file renamed, a command changed), this fails.
    let doc = fs::read_to_string(workspace().join("docs/admin.md")).unwrap();
    let lines = doc_block(&doc, "## Install");
    let root = tempfile::tempdir().unwrap();
    let (etc, bin) = (root.path().join("etc/odfs"), root.path().join("usr/local/bin"));
    fs::create_dir_all(&bin).unwrap();
    let mut ran = 0;
    for line in &lines {
        if line.starts_with("cargo build") {
            continue; // the test runs this build's binaries
        }
        if let Some(pkgs) = line.strip_prefix("apt-get install ") {
            for p in pkgs.split_whitespace() {
                run(Command::new("dpkg").args(["-s", p]));
            }
            continue;
        }
        let line = line
            .replace("target/release/", &format!("{}/", bin_dir().display()))
            .replace("/usr/local/bin/", &format!("{}/", bin.display()))
            .replace("/etc/odfs", &etc.display().to_string())
            .replacen("odfs keygen", &format!("{} keygen", bin_dir().join("odfs").display()), 1);
        run(Command::new("bash").args(["-ec", &line]).current_dir(workspace()));
        ran += 1;
    }
    assert!(ran >= 4, "the guide's install block ran {ran} commands: {lines:?}");
    for f in ["odfs", "odfs-mgmtd", "odfs-metad", "odfs-stored", "odfs-agent", "odfs-fuse"] {
        assert!(bin.join(f).is_file(), "{f} installed");
    }
    for f in ["prolog.sh", "epilog.sh", "task_prolog.sh", "site.toml", "site.key"] {
        assert!(etc.join(f).is_file(), "/etc/odfs/{f} installed");
    }
    assert_eq!(fs::metadata(etc.join("site.key")).unwrap().mode() & 0o077, 0, "the key is root-only");

    // "then edit it": the example as shipped names an endpoint that does not exist, which the
    // check finds; with this machine's values it passes.
    let site = etc.join("site.toml");
    let text = fs::read_to_string(&site).unwrap();
    let check = |site: &Path| {
        Command::new(bin.join("odfs")).args(["site-config", "--offline", "--site-config"]).arg(site).output().unwrap()
    };
    let o = check(&site);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("[stage] endpoint_url http://s3.example.org:9000"), "{err}");
    let edited = text
        .replace("/etc/odfs/site.key", &etc.join("site.key").display().to_string())
        .replace("/local/nvme", &root.path().join("local/nvme").display().to_string())
        .replace("/var/lib/odfs", &root.path().join("var/lib/odfs").display().to_string())
        .replace("/mnt/odfs", &root.path().join("mnt/odfs").display().to_string())
        .replace("http://s3.example.org:9000", "http://127.0.0.1:9000");
    fs::write(&site, edited).unwrap();
    let o = check(&site);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("(checked on node"));
}
