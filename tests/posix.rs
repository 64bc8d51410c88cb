//! POSIX through the mount: special files, open-but-unlinked files, access decided at open,
//! renames across metadata shards, and a table of errno cases for every file type, run as root
//! and as a user the test creates, on a plain directory (so the table is Linux's own) and on
//! odfs with one metadata shard and with four (a directory striped over them, so names and
//! their inodes sit on different shards).

use odfs_tests::fuse::{as_user, errno, FuseMount};
use odfs_tests::user::TestUser;
use odfs_tests::{pattern, LocalFs};
use serde_json::{json, Value};
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const PROBE: &str = env!("CARGO_BIN_EXE_odfs-posix-probe");

/// Runs the probe's operations as root; one result line each.
fn probe(ops: &[Value]) -> Vec<String> {
    let out = Command::new(PROBE).arg(Value::Array(ops.to_vec()).to_string()).output().expect("run the probe");
    lines(out, ops.len())
}

/// The same as `user`.
fn probe_as(user: &TestUser, ops: &[Value]) -> Vec<String> {
    let script = PathBuf::from(Value::Array(ops.to_vec()).to_string());
    let out = as_user(user.uid, user.gid, &[user.gid, user.extra_gid], PROBE, &[&script]);
    lines(out, ops.len())
}

fn lines(out: std::process::Output, n: usize) -> Vec<String> {
    assert!(out.status.success(), "probe failed: {}", String::from_utf8_lossy(&out.stderr));
    let v: Vec<String> = String::from_utf8_lossy(&out.stdout).lines().map(str::to_string).collect();
    assert_eq!(v.len(), n, "one result line per operation");
    v
}

/// Opens a directory tree for others (a test's temporary directories are root's, 0700).
fn open_up(mut p: &Path) {
    while let Some(parent) = p.parent() {
        if p.as_os_str().len() > 1 {
            let _ = fs::set_permissions(p, fs::Permissions::from_mode(0o755));
        }
        if parent == Path::new("/") || parent == Path::new("/tmp") {
            break;
        }
        p = parent;
    }
}

// ---- the conformance table ----

/// Who runs a row's operation.
#[derive(Clone, Copy, PartialEq)]
enum Who {
    Root,
    User,
}

/// What a row expects: an errno (0 for success), then optionally `lstat` of a path, written
/// `kind mode uid gid nlink` with `U`/`G` for the test user's ids.
struct Row {
    name: String,
    setup: Vec<Value>,
    who: Who,
    op: Value,
    want: i32,
    then: Option<(PathBuf, String)>,
}

const KINDS: [char; 7] = ['f', 'd', 'l', 'p', 's', 'c', 'b'];

fn kind_name(k: char) -> &'static str {
    match k {
        'f' => "file",
        'd' => "directory",
        'l' => "symlink",
        'p' => "FIFO",
        's' => "socket",
        'c' => "char device",
        _ => "block device",
    }
}

/// Setup operations making a node of kind `k` at `p` (as root), owned by `who`.
fn make(k: char, p: &Path, who: Who, user: &TestUser) -> Vec<Value> {
    let mut v = vec![match k {
        'f' => json!({"op": "write", "path": p, "data": "0123456789"}),
        'd' => json!({"op": "mkdir", "path": p, "mode": 0o755}),
        'l' => json!({"op": "symlink", "target": "no-such-target", "path": p}),
        _ => json!({"op": "mknod", "path": p, "kind": k, "mode": 0o644, "major": 1, "minor": 7}),
    }];
    if who == Who::User {
        v.push(json!({"op": "chown", "path": p, "uid": user.uid, "gid": user.gid}));
    }
    v
}

/// A permission row of one file type: (what, whose node, who acts, the operation without its
/// path, errno, lstat afterwards).
type PermRow = (&'static str, Who, Who, Value, i32, Option<String>);

/// A call on a name too long (the first path), given an existing file (the second).
type TooLongOp = fn(&Path, &Path) -> Value;

/// Builds the table under `base`: rows for every file type, and permission rows.
struct Table<'a> {
    base: &'a Path,
    user: &'a TestUser,
    rows: Vec<Row>,
}

impl Table<'_> {
    /// A fresh name for the next row.
    fn p(&self, tag: &str) -> PathBuf {
        self.base.join(format!("r{}.{tag}", self.rows.len()))
    }

    fn row(
        &mut self,
        name: String,
        setup: Vec<Value>,
        who: Who,
        op: Value,
        want: i32,
        then: Option<(PathBuf, String)>,
    ) {
        self.rows.push(Row { name, setup, who, op, want, then });
    }

    /// The rows every file type gets, as `who` (the nodes are `who`'s).
    fn per_kind(&mut self, k: char, who: Who) {
        let kn = kind_name(k);
        let u = self.user;
        let w = if who == Who::Root { "root" } else { "user" };
        let (o, g) = if who == Who::Root { ("0", "0") } else { ("U", "G") };
        let a = self.p("a");
        self.row(
            format!("{w}: creat over a {kn}"),
            make(k, &a, who, u),
            who,
            json!({"op": "creat", "path": a, "mode": 0o644}),
            libc::EEXIST,
            None,
        );
        if !matches!(k, 'c' | 'b') {
            // Devices are left out: a nodev mount refuses to open them, a plain directory does not.
            let (dir, nofollow, wronly) = match k {
                'f' => (libc::ENOTDIR, 0, 0),
                'd' => (0, 0, libc::EISDIR),
                'l' => (libc::ENOENT, libc::ELOOP, libc::ENOENT),
                'p' => (libc::ENOTDIR, 0, libc::ENXIO),
                _ => (libc::ENOTDIR, libc::ENXIO, libc::ENXIO),
            };
            let nb = libc::O_NONBLOCK;
            for (what, flags, want) in [
                ("O_DIRECTORY", libc::O_RDONLY | libc::O_DIRECTORY | nb, dir),
                ("O_NOFOLLOW", libc::O_RDONLY | libc::O_NOFOLLOW | nb, nofollow),
                ("O_WRONLY", libc::O_WRONLY | nb, wronly),
            ] {
                let a = self.p("a");
                let op = json!({"op": "open", "path": a, "flags": flags});
                self.row(format!("{w}: open a {kn} with {what}"), make(k, &a, who, u), who, op, want, None);
            }
        }
        let a = self.p("a");
        self.row(
            format!("{w}: mkdir over a {kn}"),
            make(k, &a, who, u),
            who,
            json!({"op": "mkdir", "path": a, "mode": 0o755}),
            libc::EEXIST,
            None,
        );
        let a = self.p("a");
        let op = json!({"op": "mknod", "path": a, "kind": 'p', "mode": 0o644, "major": 0, "minor": 0});
        self.row(format!("{w}: mknod over a {kn}"), make(k, &a, who, u), who, op, libc::EEXIST, None);
        let a = self.p("a");
        self.row(
            format!("{w}: symlink over a {kn}"),
            make(k, &a, who, u),
            who,
            json!({"op": "symlink", "target": "x", "path": a}),
            libc::EEXIST,
            None,
        );
        let (a, b) = (self.p("a"), self.p("b"));
        let (want, then) = match k {
            'd' => (libc::EPERM, None),
            _ => (0, Some((b.clone(), format!("{k} {} {o} {g} 2", if k == 'l' { "777" } else { "644" })))),
        };
        self.row(
            format!("{w}: link to a {kn}"),
            make(k, &a, who, u),
            who,
            json!({"op": "link", "from": a, "to": b}),
            want,
            then,
        );
        let (a, b) = (self.p("a"), self.p("b"));
        let mut setup = make('f', &a, who, u);
        setup.extend(make(k, &b, who, u));
        self.row(
            format!("{w}: link onto an existing {kn}"),
            setup,
            who,
            json!({"op": "link", "from": a, "to": b}),
            libc::EEXIST,
            None,
        );
        let a = self.p("a");
        let want = if k == 'd' { libc::EISDIR } else { 0 };
        self.row(
            format!("{w}: unlink a {kn}"),
            make(k, &a, who, u),
            who,
            json!({"op": "unlink", "path": a}),
            want,
            None,
        );
        let a = self.p("a");
        let want = if k == 'd' { 0 } else { libc::ENOTDIR };
        self.row(format!("{w}: rmdir a {kn}"), make(k, &a, who, u), who, json!({"op": "rmdir", "path": a}), want, None);
        let (a, b) = (self.p("a"), self.p("b"));
        let mode = match k {
            'd' => "755",
            'l' => "777",
            _ => "644",
        };
        let nlink = if k == 'd' { 2 } else { 1 };
        let then = Some((b.clone(), format!("{k} {mode} {o} {g} {nlink}")));
        self.row(
            format!("{w}: rename a {kn} to a new name"),
            make(k, &a, who, u),
            who,
            json!({"op": "rename", "from": a, "to": b, "flags": 0}),
            0,
            then,
        );
        let a = self.p("a");
        self.row(
            format!("{w}: rename a {kn} onto itself"),
            make(k, &a, who, u),
            who,
            json!({"op": "rename", "from": a, "to": a, "flags": 0}),
            0,
            Some((a.clone(), format!("{k} {mode} {o} {g} {nlink}"))),
        );
        for t in KINDS {
            let (a, b) = (self.p("a"), self.p("b"));
            let mut setup = make(k, &a, who, u);
            setup.extend(make(t, &b, who, u));
            let want = match (k == 'd', t == 'd') {
                (true, true) | (false, false) => 0,
                (true, false) => libc::ENOTDIR,
                (false, true) => libc::EISDIR,
            };
            let then = (want == 0).then(|| (b.clone(), format!("{k} {mode} {o} {g} {nlink}")));
            let op = json!({"op": "rename", "from": a, "to": b, "flags": 0});
            self.row(format!("{w}: rename a {kn} over a {}", kind_name(t)), setup, who, op, want, then);
        }
        let (a, b) = (self.p("a"), self.p("b"));
        let mut setup = make(k, &a, who, u);
        setup.extend(make('f', &b, who, u));
        let op = json!({"op": "rename", "from": a, "to": b, "flags": libc::RENAME_NOREPLACE});
        self.row(format!("{w}: rename a {kn} with RENAME_NOREPLACE onto a file"), setup, who, op, libc::EEXIST, None);
        let (a, b) = (self.p("a"), self.p("b"));
        let mut setup = make(k, &a, who, u);
        setup.extend(make('f', &b, who, u));
        let op = json!({"op": "rename", "from": a, "to": b, "flags": libc::RENAME_EXCHANGE});
        let then = Some((b.clone(), format!("{k} {mode} {o} {g} {nlink}")));
        self.row(format!("{w}: exchange a {kn} and a file"), setup, who, op, 0, then);
        let a = self.p("a");
        let want = match k {
            'f' => 0,
            'd' => libc::EISDIR,
            'l' => libc::ENOENT,
            _ => libc::EINVAL,
        };
        self.row(
            format!("{w}: truncate a {kn}"),
            make(k, &a, who, u),
            who,
            json!({"op": "truncate", "path": a, "len": 3}),
            want,
            None,
        );
        let a = self.p("a");
        let then = Some((a.clone(), format!("{k} {mode} {o} {g} {nlink}")));
        let op = json!({"op": "utimens", "path": a, "atime": "1000", "mtime": "2000"});
        self.row(format!("{w}: set times of a {kn} it owns"), make(k, &a, who, u), who, op, 0, then);
        if k != 'l' {
            let a = self.p("a");
            let then = Some((a.clone(), format!("{k} 600 {o} {g} {nlink}")));
            self.row(
                format!("{w}: chmod a {kn} it owns"),
                make(k, &a, who, u),
                who,
                json!({"op": "chmod", "path": a, "mode": 0o600}),
                0,
                then,
            );
        }
    }

    /// Directory moves: into a non-empty directory, into itself.
    fn directory_moves(&mut self, who: Who) {
        let u = self.user;
        let w = if who == Who::Root { "root" } else { "user" };
        let (a, b) = (self.p("a"), self.p("b"));
        let mut setup = make('d', &a, who, u);
        setup.extend(make('d', &b, who, u));
        setup.extend(make('f', &b.join("in"), who, u));
        let op = json!({"op": "rename", "from": a, "to": b, "flags": 0});
        self.row(format!("{w}: rename a directory over a non-empty one"), setup, who, op, libc::ENOTEMPTY, None);
        let a = self.p("a");
        let mut setup = make('d', &a, who, u);
        setup.extend(make('d', &a.join("sub"), who, u));
        let op = json!({"op": "rename", "from": a, "to": a.join("sub/x"), "flags": 0});
        self.row(format!("{w}: rename a directory into itself"), setup, who, op, libc::EINVAL, None);
        let (a, b) = (self.p("a"), self.p("b"));
        let mut setup = make('d', &a, who, u);
        setup.extend(make('d', &b, who, u));
        setup.extend(make('f', &a.join("f"), who, u));
        let op = json!({"op": "rename", "from": a, "to": b.join("moved"), "flags": 0});
        let then = Some((
            b.join("moved/f"),
            format!(
                "f 644 {} {} 1",
                if who == Who::Root { "0" } else { "U" },
                if who == Who::Root { "0" } else { "G" }
            ),
        ));
        self.row(format!("{w}: move a directory into another"), setup, who, op, 0, then);
    }

    /// A name of `len` bytes in `dir` for the next row.
    fn long(&self, dir: &Path, len: usize) -> PathBuf {
        let mut name = format!("r{}.", self.rows.len());
        name.extend(std::iter::repeat_n('x', len - name.len()));
        dir.join(name)
    }

    /// Names of NAME_MAX bytes work; one byte more is ENAMETOOLONG for every call, also in a
    /// directory made through the mount, whose every name it knows (the kernel leaves the
    /// limit to FUSE). The rows that add names from elsewhere (links, renames) come last: after
    /// them the mount no longer knows every name.
    fn long_names(&mut self) {
        let dir = self.p("d");
        let a = self.long(&dir, 255);
        let then = Some((a.clone(), "f 644 0 0 1".to_string()));
        let setup = make('d', &dir, Who::Root, self.user);
        let op = json!({"op": "creat", "path": a, "mode": 0o644});
        self.row("root: creat a name of 255 bytes".into(), setup, Who::Root, op, 0, then);
        let too_long: [(&str, TooLongOp); 11] = [
            ("stat", |p, _| json!({"op": "stat", "path": p})),
            ("open", |p, _| json!({"op": "open", "path": p, "flags": libc::O_RDONLY})),
            ("creat", |p, _| json!({"op": "creat", "path": p, "mode": 0o644})),
            ("mkdir", |p, _| json!({"op": "mkdir", "path": p, "mode": 0o755})),
            ("chmod", |p, _| json!({"op": "chmod", "path": p, "mode": 0o600})),
            ("truncate", |p, _| json!({"op": "truncate", "path": p, "len": 1})),
            ("unlink", |p, _| json!({"op": "unlink", "path": p})),
            ("symlink", |p, _| json!({"op": "symlink", "target": "x", "path": p})),
            ("link from", |p, f| json!({"op": "link", "from": p, "to": f.with_extension("l")})),
            ("link to", |p, f| json!({"op": "link", "from": f, "to": p})),
            ("rename to", |p, f| json!({"op": "rename", "from": f, "to": p, "flags": 0})),
        ];
        for (what, op) in too_long {
            let (p, f) = (self.long(&dir, 256), dir.join(format!("r{}.f", self.rows.len())));
            let setup = make('f', &f, Who::Root, self.user);
            self.row(
                format!("root: {what} a name of 256 bytes"),
                setup,
                Who::Root,
                op(&p, &f),
                libc::ENAMETOOLONG,
                None,
            );
        }
    }

    /// Ownership, modes, times and the sticky bit, as the owner and as others.
    fn permissions(&mut self) {
        let u = self.user;
        for k in ['f', 'd', 'p', 's', 'c'] {
            let kn = kind_name(k);
            let (mode, nlink) = if k == 'd' { ("755", 2) } else { ("644", 1) };
            let rows: [PermRow; 7] = [
                (
                    "user: chmod a {} of root's",
                    Who::Root,
                    Who::User,
                    json!({"op": "chmod", "mode": 0o777}),
                    libc::EPERM,
                    None,
                ),
                (
                    "root: chown a {}",
                    Who::Root,
                    Who::Root,
                    json!({"op": "chown", "uid": u.uid, "gid": -1}),
                    0,
                    Some(format!("{k} {mode} U 0 {nlink}")),
                ),
                (
                    "user: chown a {} of its own to root",
                    Who::User,
                    Who::User,
                    json!({"op": "chown", "uid": 0, "gid": -1}),
                    libc::EPERM,
                    None,
                ),
                (
                    "user: chgrp a {} of its own to its group",
                    Who::User,
                    Who::User,
                    json!({"op": "chown", "uid": -1, "gid": u.extra_gid}),
                    0,
                    Some(format!("{k} {mode} U {} {nlink}", u.extra_gid)),
                ),
                (
                    "user: set explicit times of a {} of root's",
                    Who::Root,
                    Who::User,
                    json!({"op": "utimens", "atime": "5", "mtime": "5"}),
                    libc::EPERM,
                    None,
                ),
                (
                    "user: set times to now on a {} of root's it may not write",
                    Who::Root,
                    Who::User,
                    json!({"op": "utimens", "atime": "now", "mtime": "now"}),
                    libc::EACCES,
                    None,
                ),
                (
                    "user: omit both times of a {} of root's",
                    Who::Root,
                    Who::User,
                    json!({"op": "utimens", "atime": "omit", "mtime": "omit"}),
                    0,
                    None,
                ),
            ];
            for (what, owner, who, mut op, want, then) in rows {
                let a = self.p("a");
                op["path"] = json!(a);
                let then = then.map(|t| (a.clone(), t));
                self.row(what.replace("{}", kn), make(k, &a, owner, u), who, op, want, then);
            }
        }
        // Set-user-id and set-group-id go with a change of owner (Linux: for every caller).
        let a = self.p("a");
        let mut setup = make('f', &a, Who::User, u);
        setup.push(json!({"op": "chmod", "path": a, "mode": 0o6755}));
        let then = Some((a.clone(), format!("f 755 U {} 1", u.extra_gid)));
        self.row(
            "user: chgrp clears set-user-id and set-group-id".into(),
            setup,
            Who::User,
            json!({"op": "chown", "path": a, "uid": -1, "gid": u.extra_gid}),
            0,
            then,
        );
        let a = self.p("a");
        let mut setup = make('f', &a, Who::Root, u);
        setup.push(json!({"op": "chmod", "path": a, "mode": 0o6755}));
        let then = Some((a.clone(), "f 755 U 0 1".to_string()));
        self.row(
            "root: chown clears set-user-id and set-group-id".into(),
            setup,
            Who::Root,
            json!({"op": "chown", "path": a, "uid": u.uid, "gid": -1}),
            0,
            then,
        );
        // A write or truncate by a caller without CAP_FSETID drops set-user-id, and
        // set-group-id when group-executable or the caller is not in the file's group; root's
        // keep them. A chown of anything but a directory drops them too.
        let setid_rows: [(&str, char, u32, Who, &str, &str); 6] = [
            (
                "user: write to root's set-id file clears set-user-id and set-group-id",
                'f',
                0o6777,
                Who::User,
                "write",
                "f 777 0 0 1",
            ),
            (
                "user: write clears set-group-id without group-execute outside the group",
                'f',
                0o2767,
                Who::User,
                "write",
                "f 767 0 0 1",
            ),
            (
                "user: truncate of root's set-id file clears set-user-id and set-group-id",
                'f',
                0o6777,
                Who::User,
                "truncate",
                "f 777 0 0 1",
            ),
            ("root: write keeps set-user-id and set-group-id", 'f', 0o6777, Who::Root, "write", "f 6777 0 0 1"),
            ("root: truncate keeps set-user-id and set-group-id", 'f', 0o6777, Who::Root, "truncate", "f 6777 0 0 1"),
            (
                "root: chown of a FIFO clears set-user-id and set-group-id",
                'p',
                0o6755,
                Who::Root,
                "chown",
                "p 755 U 0 1",
            ),
        ];
        for (what, k, mode, who, op, then) in setid_rows {
            let a = self.p("a");
            let mut setup = make(k, &a, Who::Root, u);
            setup.push(json!({"op": "chmod", "path": a, "mode": mode}));
            let op = match op {
                "write" => json!({"op": "rewrite", "path": a, "data": "x"}),
                "truncate" => json!({"op": "truncate", "path": a, "len": 3}),
                _ => json!({"op": "chown", "path": a, "uid": u.uid, "gid": -1}),
            };
            self.row(what.into(), setup, who, op, 0, Some((a.clone(), then.to_string())));
        }
        // Times to now on a file the user may write.
        let a = self.p("a");
        let mut setup = make('f', &a, Who::Root, u);
        setup.push(json!({"op": "chmod", "path": a, "mode": 0o666}));
        let op = json!({"op": "utimens", "path": a, "atime": "now", "mtime": "now"});
        self.row("user: set times to now on a writable file of root's".into(), setup, Who::User, op, 0, None);
        // A sticky directory: only owners remove and rename.
        let d = self.p("sticky");
        let mut setup = vec![
            json!({"op": "mkdir", "path": d, "mode": 0o1777}),
            json!({"op": "write", "path": d.join("f"), "data": "x"}),
        ];
        setup.push(json!({"op": "chmod", "path": d.join("f"), "mode": 0o666}));
        self.row(
            "user: unlink root's file in a sticky directory".into(),
            setup.clone(),
            Who::User,
            json!({"op": "unlink", "path": d.join("f")}),
            libc::EPERM,
            None,
        );
        let d2 = self.p("sticky");
        let setup2: Vec<Value> = setup
            .iter()
            .map(|v| {
                serde_json::from_str(&v.to_string().replace(&d.display().to_string(), &d2.display().to_string()))
                    .unwrap()
            })
            .collect();
        self.row(
            "user: rename root's file in a sticky directory".into(),
            setup2,
            Who::User,
            json!({"op": "rename", "from": d2.join("f"), "to": d2.join("g"), "flags": 0}),
            libc::EPERM,
            None,
        );
        // Creating in a directory the user may not write.
        let d = self.p("ro");
        let setup = vec![json!({"op": "mkdir", "path": d, "mode": 0o755})];
        self.row(
            "user: creat in root's 0755 directory".into(),
            setup,
            Who::User,
            json!({"op": "creat", "path": d.join("x"), "mode": 0o644}),
            libc::EACCES,
            None,
        );
        // Access is decided at open: a file created with mode 0 for writing stays writable.
        let a = self.p("a");
        let op = json!({"op": "ftruncate", "path": a, "flags": libc::O_CREAT | libc::O_EXCL | libc::O_RDWR, "mode": 0, "len": 7});
        self.row(
            "user: write and ftruncate a mode-0 file it opened for writing".into(),
            Vec::new(),
            Who::User,
            op,
            0,
            Some((a.clone(), "f 0 U G 1".into())),
        );
        let a = self.p("a");
        let mut setup = make('f', &a, Who::User, u);
        setup.push(json!({"op": "chmod", "path": a, "mode": 0o444}));
        self.row(
            "user: truncate(2) of its own read-only file".into(),
            setup,
            Who::User,
            json!({"op": "truncate", "path": a, "len": 1}),
            libc::EACCES,
            None,
        );
    }
}

/// Every row for a base directory.
fn table(base: &Path, user: &TestUser) -> Vec<Row> {
    let mut t = Table { base, user, rows: Vec::new() };
    for who in [Who::Root, Who::User] {
        for k in KINDS {
            // Only root makes device nodes; the user's rows use FIFOs and sockets.
            if who == Who::User && (k == 'c' || k == 'b') {
                continue;
            }
            t.per_kind(k, who);
        }
        t.directory_moves(who);
    }
    t.permissions();
    t.long_names();
    assert!(t.rows.len() > 300, "the table has {} rows", t.rows.len());
    t.rows
}

/// Runs the table under `base`; returns the rows that did not give what they expect.
fn run_table(base: &Path, user: &TestUser) -> Vec<String> {
    let rows = table(base, user);
    let setup: Vec<Value> = rows.iter().flat_map(|r| r.setup.clone()).collect();
    for (op, r) in setup.iter().zip(probe(&setup)) {
        assert_eq!(r, "0", "setup {op} failed");
    }
    let run = |who: Who| {
        let idx: Vec<usize> = (0..rows.len()).filter(|&i| rows[i].who == who).collect();
        let ops: Vec<Value> = idx.iter().map(|&i| rows[i].op.clone()).collect();
        let out = if who == Who::Root { probe(&ops) } else { probe_as(user, &ops) };
        idx.into_iter().zip(out).collect::<Vec<_>>()
    };
    let mut results: Vec<(usize, String)> = run(Who::Root);
    results.extend(run(Who::User));
    results.sort();
    let checks: Vec<(usize, Value)> = rows
        .iter()
        .enumerate()
        .filter_map(|(i, r)| r.then.as_ref().map(|(p, _)| (i, json!({"op": "stat", "path": p}))))
        .collect();
    let stats: Vec<String> = probe(&checks.iter().map(|(_, v)| v.clone()).collect::<Vec<_>>());
    let stat_of: std::collections::HashMap<usize, String> = checks.iter().map(|(i, _)| *i).zip(stats).collect();
    let mut bad = Vec::new();
    for (i, got) in results {
        let r = &rows[i];
        if got != r.want.to_string() {
            bad.push(format!("{}: errno {got}, expected {}", r.name, r.want));
            continue;
        }
        if let Some((_, want)) = &r.then {
            let want = want.replace(" U ", &format!(" {} ", user.uid)).replace(" G ", &format!(" {} ", user.gid));
            let got = &stat_of[&i];
            // kind mode uid gid nlink (size and rdev are not compared).
            let fields: Vec<&str> = got.split(' ').skip(1).take(5).collect();
            if fields.join(" ") != want {
                bad.push(format!("{}: stat {got:?}, expected {want:?}", r.name));
            }
        }
    }
    bad
}

fn assert_table(what: &str, base: &Path, user: &TestUser) {
    let bad = run_table(base, user);
    assert!(bad.is_empty(), "{what}: {} rows differ:\n{}", bad.len(), bad.join("\n"));
}

#[test]
fn the_conformance_table_holds_on_a_plain_directory_and_on_odfs_with_one_and_four_shards() {
    let user = TestUser::create("px");
    // A plain directory of the local disk: the table is what Linux does.
    let plain = tempfile::tempdir().unwrap();
    open_up(plain.path());
    let base = plain.path().join("base");
    fs::create_dir(&base).unwrap();
    fs::set_permissions(&base, fs::Permissions::from_mode(0o777)).unwrap();
    assert_table("plain directory", &base, &user);

    let fs1 = LocalFs::up(2, &[]);
    open_up(fs1.root());
    let m1 = FuseMount::start_with(&fs1, &["--allow-other"]);
    let base = m1.p("base");
    fs::create_dir(&base).unwrap();
    fs::set_permissions(&base, fs::Permissions::from_mode(0o777)).unwrap();
    assert_table("odfs, one metadata shard", &base, &user);

    let fs4 = LocalFs::up(4, &["--meta", "4"]);
    open_up(fs4.root());
    let m4 = FuseMount::start_with(&fs4, &["--allow-other"]);
    fs4.cli_ok(&["mkdir", "-c", "4", "odfs:/base"]);
    let base = m4.p("base");
    fs::set_permissions(&base, fs::Permissions::from_mode(0o777)).unwrap();
    assert_table("odfs, a directory striped over four metadata shards", &base, &user);
}

// ---- special files ----

#[test]
fn fifos_sockets_and_devices_are_inodes_that_survive_renames_links_and_a_metad_restart() {
    let fs = LocalFs::up(2, &[]);
    let m = FuseMount::start(&fs);
    // A FIFO: a writer and a reader on this node exchange data through it.
    assert_eq!(
        probe(&[json!({"op": "mknod", "path": m.p("fifo"), "kind": 'p', "mode": 0o640, "major": 0, "minor": 0})]),
        ["0"]
    );
    let writer = {
        let p = m.p("fifo");
        std::thread::spawn(move || {
            let mut f = OpenOptions::new().write(true).open(p).unwrap();
            f.write_all(b"through the fifo").unwrap();
        })
    };
    let mut got = String::new();
    File::open(m.p("fifo")).unwrap().read_to_string(&mut got).unwrap();
    writer.join().unwrap();
    assert_eq!(got, "through the fifo");
    // A Unix socket bound in the mount accepts a connection.
    let l = std::os::unix::net::UnixListener::bind(m.p("sock")).unwrap();
    let mut c = std::os::unix::net::UnixStream::connect(m.p("sock")).unwrap();
    let (mut s, _) = l.accept().unwrap();
    c.write_all(b"ping").unwrap();
    let mut b = [0u8; 4];
    s.read_exact(&mut b).unwrap();
    assert_eq!(&b, b"ping");
    drop((l, c, s));
    // Device nodes, made by root, stat as what they are (the mount is nodev: never opened).
    let mk = |name: &str, kind: char, major: u32, minor: u32| json!({"op": "mknod", "path": m.p(name), "kind": kind, "mode": 0o600, "major": major, "minor": minor});
    assert_eq!(probe(&[mk("null", 'c', 1, 3), mk("loop", 'b', 7, 1)]), ["0", "0"]);
    let check = |name: &str, what: fn(&fs::FileType) -> bool, rdev: u64| {
        let md = fs::symlink_metadata(m.p(name)).unwrap();
        assert!(what(&md.file_type()), "{name}: {:?}", md.file_type());
        assert_eq!(md.rdev(), rdev, "{name}: rdev");
    };
    check("fifo", fs::FileType::is_fifo, 0);
    check("sock", fs::FileType::is_socket, 0);
    check("null", fs::FileType::is_char_device, libc::makedev(1, 3));
    check("loop", fs::FileType::is_block_device, libc::makedev(7, 1));
    assert_eq!(errno(File::open(m.p("null"))), libc::EACCES, "a nodev mount does not open devices");
    // Rename, link, chmod, chown, unlink, like any inode.
    fs::rename(m.p("fifo"), m.p("fifo2")).unwrap();
    fs::hard_link(m.p("null"), m.p("null2")).unwrap();
    assert_eq!(fs::metadata(m.p("null")).unwrap().nlink(), 2);
    fs::set_permissions(m.p("sock"), fs::Permissions::from_mode(0o600)).unwrap();
    std::os::unix::fs::lchown(m.p("loop"), Some(1234), Some(5678)).unwrap();
    fs::remove_file(m.p("null2")).unwrap();
    // A metad killed and restarted replays them from its log.
    fs.kill9("metad", 0);
    fs.restart("metad", 0);
    let after = |name: &str| fs::symlink_metadata(m.p(name));
    odfs_tests::wait_for("the mount answers after the restart", Duration::from_secs(20), || {
        let ok = after("fifo2").is_ok();
        (ok, ok)
    });
    assert!(after("fifo2").unwrap().file_type().is_fifo());
    assert_eq!(errno(after("fifo")), libc::ENOENT);
    let null = after("null").unwrap();
    assert!(null.file_type().is_char_device());
    assert_eq!((null.nlink(), null.rdev()), (1, libc::makedev(1, 3)));
    assert_eq!(after("sock").unwrap().mode() & 0o7777, 0o600);
    let lp = after("loop").unwrap();
    assert_eq!((lp.uid(), lp.gid(), lp.rdev()), (1234, 5678, libc::makedev(7, 1)));
    for n in ["fifo2", "sock", "null", "loop"] {
        fs::remove_file(m.p(n)).unwrap();
    }
    assert!(odfs_tests::entries(&m.path).is_empty());
}

// ---- open files ----

#[test]
fn an_open_unlinked_file_keeps_every_operation() {
    let fs = LocalFs::up(2, &["--chunk-size", "65536"]);
    let m = FuseMount::start(&fs);
    // Python's own TemporaryFile (unlinked at creation): write, truncate, seek, read back.
    let script = "import tempfile\n\
        f = tempfile.TemporaryFile(dir='.')\n\
        f.write(b'0123456789' * 10); f.truncate(20); f.seek(0)\n\
        assert f.read() == b'01234567890123456789', 'read back'\n\
        print('ok')";
    let out = Command::new("python3").arg("-c").arg(script).current_dir(&m.path).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "ok", "{}", String::from_utf8_lossy(&out.stderr));

    let mut f = OpenOptions::new().read(true).write(true).create_new(true).open(m.p("scratch")).unwrap();
    f.write_all(&pattern(300_000, 1)).unwrap();
    fs::remove_file(m.p("scratch")).unwrap();
    let fd = f.as_raw_fd();
    // SAFETY (below): plain libc calls on a descriptor this test owns.
    assert_eq!(unsafe { libc::ftruncate(fd, 100_000) }, 0, "ftruncate: {}", std::io::Error::last_os_error());
    assert_eq!(f.metadata().unwrap().len(), 100_000, "fstat after ftruncate");
    assert_eq!(unsafe { libc::fallocate(fd, 0, 0, 250_000) }, 0, "fallocate: {}", std::io::Error::last_os_error());
    assert_eq!(f.metadata().unwrap().len(), 250_000, "fstat after fallocate");
    let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    assert_eq!(unsafe { libc::fallocate(fd, punch, 10, 1000) }, 0, "punch: {}", std::io::Error::last_os_error());
    assert_eq!(unsafe { libc::fchmod(fd, 0o600) }, 0, "fchmod: {}", std::io::Error::last_os_error());
    assert_eq!(unsafe { libc::fchown(fd, 4321, 8765) }, 0, "fchown: {}", std::io::Error::last_os_error());
    let t = [libc::timespec { tv_sec: 111, tv_nsec: 0 }, libc::timespec { tv_sec: 222, tv_nsec: 0 }];
    assert_eq!(unsafe { libc::futimens(fd, t.as_ptr()) }, 0, "futimens: {}", std::io::Error::last_os_error());
    let (k, v) = (c"user.tag", b"kept");
    let r = unsafe { libc::fsetxattr(fd, k.as_ptr(), v.as_ptr().cast(), v.len(), 0) };
    assert_eq!(r, 0, "fsetxattr: {}", std::io::Error::last_os_error());
    let mut buf = [0u8; 16];
    let n = unsafe { libc::fgetxattr(fd, k.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    assert_eq!(&buf[..n.max(0) as usize], b"kept", "fgetxattr");
    f.sync_all().unwrap();
    let st = f.metadata().unwrap();
    // FIOQSIZE is the kernel's: the bytes the inode uses, as fstat's blocks say.
    let mut qsize: libc::loff_t = 0;
    assert_eq!(
        unsafe { libc::ioctl(fd, libc::FIOQSIZE, &mut qsize) },
        0,
        "FIOQSIZE: {}",
        std::io::Error::last_os_error()
    );
    assert_eq!(qsize as u64, st.blocks() * 512, "FIOQSIZE against fstat");
    assert_eq!((st.mode() & 0o7777, st.uid(), st.gid(), st.nlink()), (0o600, 4321, 8765, 0));
    assert_eq!((st.mtime(), st.len()), (222, 250_000));
    let mut data = Vec::new();
    f.seek(SeekFrom::Start(0)).unwrap();
    f.read_to_end(&mut data).unwrap();
    let mut want = pattern(300_000, 1)[..100_000].to_vec();
    want.resize(250_000, 0);
    want[10..1010].fill(0);
    assert!(data == want, "the bytes of the unlinked file after truncate, fallocate and a punched hole");

    // `stat` of an open descriptor after writes shows the written size.
    let mut g = OpenOptions::new().write(true).create_new(true).open(m.p("growing")).unwrap();
    g.write_all(&[7u8; 12_345]).unwrap();
    assert_eq!(g.metadata().unwrap().len(), 12_345);
    assert_eq!(fs::metadata(m.p("growing")).unwrap().len(), 12_345);

    // A file replaced by a rename while open keeps working through its descriptor.
    fs::write(m.p("old"), b"the old contents").unwrap();
    let mut o = OpenOptions::new().read(true).write(true).open(m.p("old")).unwrap();
    fs::write(m.p("new"), b"replacement").unwrap();
    fs::rename(m.p("new"), m.p("old")).unwrap();
    o.write_all(b"THE").unwrap();
    let fd = o.as_raw_fd();
    assert_eq!(unsafe { libc::ftruncate(fd, 8) }, 0);
    let mut s = String::new();
    o.seek(SeekFrom::Start(0)).unwrap();
    o.read_to_string(&mut s).unwrap();
    assert_eq!(s, "THE old ");
    assert_eq!(fs::read(m.p("old")).unwrap(), b"replacement");
}

#[test]
fn temporary_files_of_several_processes_stay_usable_while_others_unlink_and_rename() {
    // Two processes make, write and read back Python's TemporaryFile (a file unlinked as soon
    // as it is made), while two others write, rename and unlink files in directories of their
    // own, all at once on one mount. An unlink or rename first registers this client's open
    // files with metad so that they stay orphans; one that found its open file marked by
    // another's registration once went out before that registration arrived, and metad removed
    // the file outright: fstat or close then failed with ENOENT, for 2-4% of the temporary files.
    let fs = LocalFs::up(2, &["--chunk-size", "65536"]);
    let m = FuseMount::start(&fs);
    fs::create_dir(m.p("tmp")).unwrap();
    let script = r#"
import multiprocessing as mp, os, random, sys, tempfile
d = sys.argv[1]
def temporary(k):
    failed = []
    for i in range(600):
        data = os.urandom(random.randint(1, 9000))
        try:
            with tempfile.TemporaryFile(dir=d) as f:
                f.write(data); f.seek(0)
                assert os.fstat(f.fileno()).st_nlink == 0
                assert f.read() == data, 'read back other bytes'
        except OSError as e:
            failed.append(repr(e))
    return failed
def churn(k):
    own = tempfile.mkdtemp(dir=d)
    for i in range(600):
        p = os.path.join(own, f'c{i}')
        with open(p, 'w') as f: f.write('y' * 100)
        if i % 3 == 0:
            os.rename(p, p + '.r'); p += '.r'
        os.unlink(p)
    os.rmdir(own)
    return []
def run(k): return temporary(k) if k < 2 else churn(k)
if __name__ == '__main__':
    with mp.Pool(4) as p: failed = sum(p.map(run, range(4)), [])
    print(len(failed), failed[:5])
"#;
    let out = Command::new("python3").arg("-c").arg(script).arg(m.p("tmp")).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.starts_with("0 []"), "temporary files failed (count, first ones): {stdout}");
    assert!(fs::read_dir(m.p("tmp")).unwrap().next().is_none(), "an unlinked file's name came back");
}

#[test]
fn a_file_unlinked_on_one_client_stays_readable_where_it_is_open() {
    let fs = LocalFs::up(2, &[]);
    let m = FuseMount::start(&fs);
    let data = pattern(500_000, 9);
    fs::write(m.p("shared"), &data).unwrap();
    let mut f = File::open(m.p("shared")).unwrap();
    // Another client (another node's mount, or a job's CLI) removes the name.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let c = fs.client().await;
        c.unlink(&odfs_client::Ctx::root(), odfs_proto::InodeId::ROOT, b"shared").await.unwrap();
    });
    let mut got = Vec::new();
    f.read_to_end(&mut got).unwrap();
    assert!(got == data, "the open descriptor reads the file its name no longer reaches");
    drop(f);
}

// ---- renames across metadata shards ----

const WRITER: &str = r#"
import os, random, string, sys, zlib
w, d = int(sys.argv[1]), sys.argv[2]
for n in range(int(sys.argv[3])):
    tmp = os.path.join(d, ''.join(random.choice(string.ascii_letters + string.digits) for _ in range(10)))
    body = b'W%d-%d:' % (w, n) + os.urandom(3000)
    with open(tmp, 'wb') as f:
        f.write(body + b'%08x' % zlib.crc32(body))
    os.replace(tmp, os.path.join(d, 'final%d' % random.randrange(50)))
print('done')
"#;

const READER: &str = r#"
import os, sys, zlib
d, stop = sys.argv[1], sys.argv[2]
reads = 0
while not os.path.exists(stop):
    for k in range(50):
        with open(os.path.join(d, 'final%d' % k), 'rb') as f:
            data = f.read()
        body, crc = data[:-8], data[-8:]
        assert b'%08x' % zlib.crc32(body) == crc, 'final%d holds a torn write (%d bytes)' % (k, len(data))
        reads += 1
print(reads)
"#;

/// Used inodes of the filesystem behind a mount (statvfs).
fn used_inodes(p: &Path) -> u64 {
    // SAFETY: statvfs fills the struct it is given.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    let c = odfs_tests::fuse::cpath(p);
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut st) }, 0);
    st.f_files - st.f_ffree
}

#[test]
fn replacing_temporary_files_across_shards_is_atomic_and_survives_a_metad_crash() {
    let fs = LocalFs::up(4, &["--meta", "4"]);
    let m = FuseMount::start(&fs);
    fs.cli_ok(&["mkdir", "-c", "4", "odfs:/ckpt"]);
    let dir = m.p("ckpt");
    for k in 0..50 {
        let body = format!("initial {k}").into_bytes();
        let mut data = body.clone();
        data.extend(format!("{:08x}", crc32(&body)).into_bytes());
        fs::write(dir.join(format!("final{k}")), data).unwrap();
    }
    let stop = fs.root().join("stop-reading");
    let spawn = |args: &[&str]| {
        Command::new("python3")
            .args(args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let d = dir.display().to_string();
    let reader = spawn(&["-c", READER, &d, &stop.display().to_string()]);
    let writers: Vec<_> = (0..4).map(|w| spawn(&["-c", WRITER, &w.to_string(), &d, "1000"])).collect();
    // A metadata service killed mid-run, and restarted.
    std::thread::sleep(Duration::from_secs(4));
    fs.kill9("metad", 2);
    fs.restart("metad", 2);
    for w in writers {
        let out = w.wait_with_output().unwrap();
        assert!(out.status.success(), "a writer failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    fs::write(&stop, b"").unwrap();
    let out = reader.wait_with_output().unwrap();
    assert!(out.status.success(), "the reader failed: {}", String::from_utf8_lossy(&out.stderr));
    let reads: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    assert!(reads >= 50, "the reader read {reads} files");
    // Every name resolves, none is doubled or lost, none is left of the temporary names.
    let names = odfs_tests::entries(&dir);
    let want: Vec<String> = {
        let mut v: Vec<String> = (0..50).map(|k| format!("final{k}")).collect();
        v.sort();
        v
    };
    assert_eq!(names, want);
    let listed: Vec<_> = fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(listed.len(), 50, "readdir lists each name once");
    for k in 0..50 {
        let p = dir.join(format!("final{k}"));
        let data = fs::read(&p).unwrap();
        let (body, crc) = data.split_at(data.len() - 8);
        assert_eq!(format!("{:08x}", crc32(body)).as_bytes(), crc, "final{k} holds one complete write");
        assert_eq!(fs::metadata(&p).unwrap().nlink(), 1, "final{k}: link count");
    }
    // The replaced files are gone (orphans of readers included): the root, the directory and
    // the 50 files are all that is left.
    odfs_tests::wait_for("replaced files removed", Duration::from_secs(30), || {
        let n = used_inodes(&m.path);
        (n == 52, n)
    });
}

fn crc32(data: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in data {
        c ^= b as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 { (c >> 1) ^ 0xEDB8_8320 } else { c >> 1 };
        }
    }
    !c
}

/// pwrite(2) of `data` at `offset`: the bytes written, or the errno.
fn pwrite(f: &File, data: &[u8], offset: u64) -> Result<usize, i32> {
    // SAFETY: a live buffer of data.len() bytes and an open descriptor.
    let n = unsafe { libc::pwrite(f.as_raw_fd(), data.as_ptr().cast(), data.len(), offset as libc::off_t) };
    if n < 0 {
        Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
    } else {
        Ok(n as usize)
    }
}

/// Writes and truncates past odfs's largest file (16 TiB) fail with EFBIG before anything
/// changes, through the mount and the library; a write that crosses it is cut short at it, as
/// a local filesystem cuts one at its own limit.
#[test]
fn writes_and_truncates_past_the_largest_file_fail_with_efbig_and_change_nothing() {
    const MAX: u64 = odfs_proto::layout::MAX_FILE_SIZE;
    let fs = LocalFs::up(2, &[]);
    let m = FuseMount::start(&fs);
    let p = m.p("big");
    let f = OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&p).unwrap();
    for at in [1u64 << 62, (1u64 << 63) - 2, MAX] {
        assert_eq!(pwrite(&f, b"X", at), Err(libc::EFBIG), "a write at {at}");
    }
    assert_eq!(f.metadata().unwrap().len(), 0, "a refused write changed the size");
    f.sync_all().unwrap();
    assert_eq!(fs::metadata(&p).unwrap().len(), 0);
    // Crossing the limit: the bytes below it are written.
    assert_eq!(pwrite(&f, b"ABCD", MAX - 2), Ok(2));
    f.sync_all().unwrap();
    assert_eq!(fs::metadata(&p).unwrap().len(), MAX);
    let mut tail = [0u8; 8];
    // SAFETY: a live buffer and an open descriptor.
    let n = unsafe { libc::pread(f.as_raw_fd(), tail.as_mut_ptr().cast(), 8, (MAX - 2) as libc::off_t) };
    assert_eq!((n, &tail[..2]), (2, &b"AB"[..]));
    // Truncates past it: ftruncate, truncate(2) by path, fallocate.
    assert_eq!(f.set_len(MAX + 1).map_err(|e| e.raw_os_error()), Err(Some(libc::EFBIG)));
    let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::truncate(c.as_ptr(), i64::MAX) }, -1);
    assert_eq!(std::io::Error::last_os_error().raw_os_error(), Some(libc::EFBIG));
    assert_eq!(unsafe { libc::fallocate(f.as_raw_fd(), 0, (MAX - 1) as i64, 2) }, -1);
    assert_eq!(std::io::Error::last_os_error().raw_os_error(), Some(libc::EFBIG));
    drop(f);
    assert_eq!(fs::metadata(&p).unwrap().len(), MAX, "a refused truncate changed the size");
    // Through the library: the same refusal, with its reason.
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let c = fs.node_client(1).await;
        let ctx = odfs_client::Ctx::root();
        let (_, h) = c.create_open(&ctx, odfs_proto::InodeId::ROOT, b"lib", 0o644, false, None).await.unwrap();
        let e = h.write(1 << 62, b"X").await.unwrap_err();
        assert_eq!(e.errno(), libc::EFBIG, "{e}");
        assert!(e.to_string().contains("largest file size"), "{e}");
        assert_eq!(h.size().await, 0);
        h.close().await.unwrap();
    });
}
