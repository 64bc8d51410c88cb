//! Local users made for a test (useradd/groupadd), removed on drop.

use crate::as_user;
use std::path::Path;
use std::process::Command;

/// A local user and group made for one test with useradd/groupadd, removed on drop.
pub struct TestUser {
    pub name: String,
    pub group: String,
    pub uid: u32,
    pub gid: u32,
    pub extra_gid: u32,
}

impl TestUser {
    pub fn create(tag: &str) -> TestUser {
        let name = format!("odfs{tag}{}", std::process::id() % 100_000);
        let group = format!("{name}x");
        let run = |cmd: &str, args: &[&str]| {
            let out =
                Command::new(cmd).args(args).output().unwrap_or_else(|e| panic!("run {cmd} (passwd package): {e}"));
            assert!(out.status.success(), "{cmd} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
            String::from_utf8_lossy(&out.stdout).trim().to_string()
        };
        let _ = Command::new("userdel").arg(&name).output();
        let _ = Command::new("groupdel").arg(&group).output();
        run("groupadd", &[&group]);
        run("useradd", &["--no-create-home", "--user-group", "--groups", &group, "--shell", "/bin/sh", &name]);
        let id = |flag: &str| run("id", &[flag, &name]).parse::<u32>().expect("numeric id");
        let extra_gid = run("getent", &["group", &group]).split(':').nth(2).unwrap().parse().unwrap();
        TestUser { uid: id("-u"), gid: id("-g"), extra_gid, name, group }
    }

    /// Runs `cmd args` as this user (primary group and the extra group).
    pub fn run(&self, cmd: &str, args: &[&Path]) -> std::process::Output {
        as_user(self.uid, self.gid, &[self.gid, self.extra_gid], cmd, args)
    }
}

impl Drop for TestUser {
    fn drop(&mut self) {
        let _ = Command::new("userdel").arg(&self.name).output();
        let _ = Command::new("groupdel").arg(&self.group).output();
    }
}
