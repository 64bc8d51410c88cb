//! odfs under a real Slurm: slurmctld and four slurmd, each node in its own network and mount
//! namespace, running the project's prolog, epilog and TaskProlog (kit/slurm.rs). Jobs are
//! submitted with sbatch by ordinary users the tests create; S3 is s3s-fs on the cluster's
//! bridge.
//!
//! Needs root, /dev/fuse, munge, Slurm, iproute2 and s3s-fs (scripts/test installs them).

use odfs_tests::slurm::{Cluster, ClusterOptions, BUCKET};
use odfs_tests::*;
use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const LONG: Duration = Duration::from_secs(180);

/// Objects under `s3://odfs/PREFIX/`: written as s3s-fs's files. Returns (relative key, sha256).
fn dataset(c: &Cluster, prefix: &str, sizes: &[usize]) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (i, &n) in sizes.iter().enumerate() {
        let rel = if i % 3 == 0 { format!("sub/f{i:03}") } else { format!("f{i:03}") };
        let p = c.s3.object_path(BUCKET, &format!("{prefix}/{rel}"));
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        let data = pattern(n, i as u64 + 7);
        fs::write(&p, &data).unwrap();
        out.push((rel, sha256(&data)));
    }
    out.sort();
    out
}

/// `sha256sum` output ("HASH  ./rel" lines) as sorted (rel, hash) pairs, without the stage-in
/// manifest odfs writes beside the data.
fn parse_sums(text: &str) -> Vec<(String, String)> {
    let mut v: Vec<(String, String)> = text
        .lines()
        .filter_map(|l| l.split_once("  ./"))
        .filter(|(_, rel)| *rel != ".odfs-stage-in.json")
        .map(|(h, rel)| (rel.to_string(), h.to_string()))
        .collect();
    v.sort();
    v
}

fn assert_all_clean(c: &Cluster) {
    for k in 0..c.nodes.len() {
        c.assert_clean(k);
    }
}

#[test]
fn a_four_node_job_gets_its_dataset_everywhere_and_its_outputs_back_in_s3() {
    let c = Cluster::new(ClusterOptions::default());
    let user = TestUser::create("sj");
    let mut sizes: Vec<usize> = (0..40).map(|i| 1000 + i * 7919).collect();
    sizes.push((80 << 20) + 12345); // split over every node's agent
    let files = dataset(&c, "ds", &sizes);
    let out = c.dir.path().join("out");
    let script = format!(
        "#!/bin/sh\n#SBATCH -N 4\n#SBATCH -C odfs\n\
         #ODFS stage-in s3://{BUCKET}/ds /data\n#ODFS stage-out /results s3://{BUCKET}/run-%j\n#ODFS stripe-count -1\n\
         set -e\necho \"mount=$ODFS_MOUNT job=$ODFS_JOB\"\nstat -c 'owner=%U mode=%a' \"$ODFS_MOUNT\"\n\
         {odfs} status > {out}/status.txt\n{odfs} df > {out}/df.txt\n{odfs} stats > {out}/stats.txt\n\
         mkdir \"$ODFS_MOUNT/results\"\n\
         srun -N 4 --ntasks-per-node=1 sh -c 'set -e; cd \"$ODFS_MOUNT/data\"; \
           find . -type f | sort | xargs sha256sum > {out}/sums.$SLURMD_NODENAME; \
           head -c $((3*1048576+SLURM_NODEID)) /dev/urandom > {out}/expected.$SLURMD_NODENAME; \
           cp {out}/expected.$SLURMD_NODENAME \"$ODFS_MOUNT/results/$SLURMD_NODENAME.bin\"'\n",
        out = out.display(),
        odfs = bin_dir().join("odfs").display()
    );
    let job = c.sbatch(&user.name, "train", &script, &[]);
    let info = c.wait_ended(&job, LONG);
    let log = c.output(&job);
    assert_eq!((info.state.as_str(), info.exit_code.as_str()), ("COMPLETED", "0:0"), "{log}\n{}", c.logs());

    // The job saw its filesystem, owned by its user, at the per-job mount point.
    let mnt = c.dir.path().join("n1/mnt").join(&job);
    assert!(log.contains(&format!("mount={} job={job}", mnt.display())), "{log}");
    assert!(log.contains(&format!("owner={} mode=700", user.name)), "{log}");
    // The client commands work for the job's user, from the mount (no config, no credential).
    let status = fs::read_to_string(out.join("status.txt")).unwrap_or_default();
    assert!(status.contains(&format!("job {job}")) && status.contains("storage services 4/4"), "{status}\n{log}");
    let df = fs::read_to_string(out.join("df.txt")).unwrap_or_default();
    assert!(df.contains("filesystem_summary:") && df.matches("odfs-T").count() >= 4, "{df}");
    let stats = fs::read_to_string(out.join("stats.txt")).unwrap_or_default();
    assert!(
        stats.starts_with("SERVICE") && stats.lines().any(|l| l.starts_with("metad shard 0") && l.contains(" Lookup ")),
        "{stats}"
    );
    assert!(stats.contains("CLIENT") && stats.contains(" pid "), "the mount asked is a named client: {stats}");
    // Every node saw the same, complete dataset.
    for n in &c.nodes {
        let got = fs::read_to_string(out.join(format!("sums.{n}"))).unwrap_or_else(|e| panic!("{n}: {e}\n{log}"));
        assert_eq!(parse_sums(&got), files, "{n} sees a different dataset");
    }
    // Every node's output is in S3, byte for byte, with the manifest and the marker written last.
    for n in &c.nodes {
        let want = fs::read(out.join(format!("expected.{n}"))).unwrap();
        let got = fs::read(c.s3.object_path(BUCKET, &format!("run-{job}/{n}.bin"))).unwrap_or_default();
        assert_bytes(&got, &want, &format!("s3://{BUCKET}/run-{job}/{n}.bin"));
    }
    let marker = c.s3.object_path(BUCKET, &format!("run-{job}/.odfs-stage-out.complete"));
    assert!(marker.exists(), "no completion marker\n{}", c.logs());
    // Every node's event log has its own start: node 0 waits for all, the others for node 0.
    for k in 0..c.nodes.len() {
        let events = c.event_log(k);
        let started = if k == 0 {
            format!("job {job}: filesystem ready on 4 nodes in ")
        } else {
            format!("job {job}: {} (node {k} of 4): filesystem ready in ", c.nodes[k])
        };
        assert!(events.contains(&started), "{}: no {started:?} in its odfs.log:\n{events}", c.nodes[k]);
    }
    // Afterwards nothing is left on any node: no process, no mount, no data, no record.
    assert_all_clean(&c);
    for n in &c.nodes {
        assert_eq!(c.node_state(n).0, "IDLE", "{n} must be back in service");
    }
}

/// Seconds of "stopped and wiped on ... in S s" in an event log.
fn epilog_secs(events: &str, job: &str) -> Option<f64> {
    let l = events.lines().find(|l| l.contains(&format!("job {job}: stopped and wiped on ")))?;
    l.rsplit(" in ").next()?.trim_end_matches(" s").parse().ok()
}

#[test]
fn epilogs_with_a_stage_out_wait_for_no_lease_even_after_a_mount_died() {
    let c = Cluster::new(ClusterOptions::default());
    let user = TestUser::create("sl");
    let files = dataset(&c, "dl", &[4096, 70_000, 1 << 20]);
    let out = c.dir.path().join("out");
    // Every node writes its output and lists and reads every other's (so every mount holds
    // leases on what the stage-out then seals), then waits to be let go.
    let body = format!(
        "mkdir -p \"$ODFS_MOUNT/results\"\n\
         srun -N 4 --ntasks-per-node=1 sh -c 'set -e; cd \"$ODFS_MOUNT\"; \
           (cd data && find . -type f | sort | xargs sha256sum) > {out}/sums.$SLURMD_NODENAME; \
           echo \"out of $SLURMD_NODENAME\" > results/$SLURMD_NODENAME.txt; \
           while [ $(ls results | wc -l) -lt 4 ]; do sleep 0.1; done; cat results/* > /dev/null'",
        out = out.display()
    );
    let directives = format!(
        "#SBATCH -N 4\n#SBATCH -C odfs\n#ODFS stage-in s3://{BUCKET}/dl /data\n\
         #ODFS stage-out /results s3://{BUCKET}/lease-%j\n"
    );
    let job = c.sbatch(&user.name, "lease", &waiting_script(&c, &directives, &body), &[]);
    wait_ready(&c, &job);
    // metad's log goes with the job's data: a copy is followed from node 0 until the end.
    let metad_log = c.dir.path().join(&c.nodes[0]).join("state").join(&job).join("metad.log");
    assert!(metad_log.exists(), "no {}", metad_log.display());
    let copy = out.join("metad.copy");
    c.node_ok(0, &format!("(tail -n +1 -F {} > {} 2>/dev/null &) ", metad_log.display(), copy.display()));
    // Node 2's odfs-fuse dies without a word (its node lives on): its sessions must not make
    // the stage-out wait out their leases.
    let fuse = c.odfs_processes(2).into_iter().find(|(_, comm)| comm == "odfs-fuse").expect("node 2's odfs-fuse").0;
    kill9_gone(fuse);
    go(&c, &job);
    let info = c.wait_ended(&job, LONG);
    let log = c.output(&job);
    assert_eq!((info.state.as_str(), info.exit_code.as_str()), ("COMPLETED", "0:0"), "{log}\n{}", c.logs());
    for n in &c.nodes {
        let got = fs::read_to_string(out.join(format!("sums.{n}"))).unwrap_or_else(|e| panic!("{n}: {e}\n{log}"));
        assert_eq!(parse_sums(&got), files, "{n} sees a different dataset");
        let obj = fs::read(c.s3.object_path(BUCKET, &format!("lease-{job}/{n}.txt"))).unwrap_or_default();
        assert_eq!(String::from_utf8_lossy(&obj), format!("out of {n}\n"), "{n}'s output in S3\n{}", c.logs());
    }
    for k in 0..c.nodes.len() {
        c.wait_no_odfs(k, LONG);
    }
    let _ = c.node_sh(0, &format!("pkill -f 'tail -n +1 -F {}'", metad_log.display()));
    let metad = fs::read_to_string(&copy).unwrap_or_default();
    assert!(metad.contains("a client's session ended by itself"), "the mounts said goodbye:\n{metad}");
    assert!(
        metad.contains("a client's session ended by its node"),
        "node 2's stop said it for its dead mount:\n{metad}"
    );
    assert!(!metad.contains("did not answer a recall within the lease"), "a change waited out a lease:\n{metad}");
    let events2 = c.event_log(2);
    assert!(events2.contains("ended the metadata sessions of odfs-fuse"), "{events2}");
    for k in 0..c.nodes.len() {
        let events = c.event_log(k);
        let secs = epilog_secs(&events, &job).unwrap_or_else(|| panic!("{}: no stop line:\n{events}", c.nodes[k]));
        eprintln!("{}: epilog {secs:.2} s", c.nodes[k]);
    }
    assert_all_clean(&c);
}

#[test]
fn a_job_without_the_feature_starts_nothing() {
    let c = Cluster::new(ClusterOptions { nodes: 2, ..Default::default() });
    let user = TestUser::create("sn");
    let script = "#!/bin/sh\n#ODFS stage-in s3://nowhere/x /data\necho \"mount=[$ODFS_MOUNT]\"\nsrun -N 2 true\n";
    let job = c.sbatch(&user.name, "plain", script, &["-N", "2"]);
    let info = c.wait_ended(&job, LONG);
    assert_eq!(info.state, "COMPLETED", "{}", c.output(&job));
    assert!(c.output(&job).contains("mount=[]"), "no odfs variables for a plain job: {}", c.output(&job));
    for k in 0..2 {
        // The prolog returned before odfs ran: no state directory, no event log at all.
        assert!(!c.dir.path().join(&c.nodes[k]).join("state").exists(), "odfs ran on {}", c.nodes[k]);
        c.assert_clean(k);
    }
}

/// A batch script that marks itself running, then waits (bounded) for the test's go-ahead.
fn waiting_script(c: &Cluster, directives: &str, body: &str) -> String {
    let d = c.dir.path().display();
    format!(
        "#!/bin/sh\n{directives}set -e\n{body}\ntouch {d}/out/ready.$SLURM_JOB_ID\n\
         i=0; while [ ! -e {d}/jobs/go.$SLURM_JOB_ID ] && [ $i -lt 1200 ]; do sleep 0.1; i=$((i+1)); done\n"
    )
}

fn wait_ready(c: &Cluster, job: &str) {
    let f = c.dir.path().join("out").join(format!("ready.{job}"));
    wait_for(&format!("job {job} running"), LONG, || (f.exists(), c.job(job)));
}

fn go(c: &Cluster, job: &str) {
    fs::write(c.dir.path().join("jobs").join(format!("go.{job}")), b"").unwrap();
}

/// Value of `key = ...` in a TOML file, as written.
fn toml_line<'a>(text: &'a str, key: &str) -> &'a str {
    text.lines().find(|l| l.starts_with(&format!("{key} ="))).unwrap_or_else(|| panic!("no {key} in {text}"))
}

#[test]
fn two_jobs_sharing_nodes_each_see_only_their_own_filesystem() {
    let c = Cluster::new(ClusterOptions { nodes: 2, ..Default::default() });
    let (ua, ub) = (TestUser::create("sa"), TestUser::create("sb"));
    let args = ["-N", "2", "-w", "n1,n2", "--ntasks-per-node=1", "-c", "1", "-C", "odfs"];
    let body = |tag: &str| format!("echo {tag} > \"$ODFS_MOUNT/secret\"");
    let ja = c.sbatch(&ua.name, "a", &waiting_script(&c, "", &body("alpha")), &args);
    let jb = c.sbatch(&ub.name, "b", &waiting_script(&c, "", &body("bravo")), &args);
    wait_ready(&c, &ja);
    wait_ready(&c, &jb);
    let mnt = |k: usize, job: &str| c.dir.path().join(&c.nodes[k]).join("mnt").join(job).display().to_string();
    for k in 0..2 {
        assert_eq!(
            c.odfs_mounts(k).iter().filter(|l| l.contains("fuse.odfs")).count(),
            2,
            "{}: two mounts",
            c.nodes[k]
        );
        for (job, user, tag) in [(&ja, &ua, "alpha"), (&jb, &ub, "bravo")] {
            let m = mnt(k, job);
            assert_eq!(c.node_ok(k, &format!("stat -c '%u %a' {m}")).trim(), format!("{} 700", user.uid));
            // Each job sees its own files only, on every node.
            assert_eq!(c.node_ok(k, &format!("runuser -u {} -- ls -A {m}", user.name)).trim(), "secret");
            assert_eq!(c.node_ok(k, &format!("runuser -u {} -- cat {m}/secret", user.name)).trim(), tag);
        }
        // The other job's user is refused at the mount.
        for (job, other) in [(&ja, &ub), (&jb, &ua)] {
            let out = c.node_sh(k, &format!("runuser -u {} -- ls {}", other.name, mnt(k, job)));
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(
                !out.status.success() && err.contains("Permission denied"),
                "{} entered job {job}'s mount: {err}",
                other.name
            );
        }
    }
    // A client holding job b's credential is refused by job a's daemons, and so is a client with
    // job a's id derived from another site key; job a's own client is served.
    let state = |job: &str| c.dir.path().join("n1/state").join(job).join("odfs.toml");
    let (ta, tb) = (fs::read_to_string(state(&ja)).unwrap(), fs::read_to_string(state(&jb)).unwrap());
    let tmp = c.dir.path().join("jobs");
    let b_at_a = tmp.join("b-at-a.toml");
    fs::write(
        &b_at_a,
        tb.replace(toml_line(&tb, "mgmtd"), toml_line(&ta, "mgmtd"))
            .replace(toml_line(&tb, "retry_secs"), "retry_secs = 2"),
    )
    .unwrap();
    let other_key = tmp.join("other.key");
    odfs_rpc::SiteKey::generate().write_new(&other_key).unwrap();
    let forged = tmp.join("forged.toml");
    fs::write(
        &forged,
        ta.replace(toml_line(&ta, "site_key"), &format!("site_key = \"{}\"", other_key.display()))
            .replace(toml_line(&ta, "retry_secs"), "retry_secs = 2"),
    )
    .unwrap();
    let odfs = bin_dir().join("odfs");
    let status = |cfg: &Path| c.node_sh(0, &format!("{} status --fs {}", odfs.display(), cfg.display()));
    let own = status(&state(&ja));
    assert!(own.status.success(), "job a's own client: {}", String::from_utf8_lossy(&own.stderr));
    for cfg in [&b_at_a, &forged] {
        let out = status(cfg);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains("mgmtd"), "{} must be refused: {err}", cfg.display());
    }
    go(&c, &ja);
    go(&c, &jb);
    for j in [&ja, &jb] {
        assert_eq!(c.wait_ended(j, LONG).state, "COMPLETED", "{}", c.output(j));
    }
    assert_all_clean(&c);
}

#[test]
fn a_prolog_failure_on_one_node_rolls_every_node_back() {
    let c = Cluster::new(ClusterOptions::default());
    let user = TestUser::create("sf");
    // n3's NVMe turns read-only.
    let nvme = c.nvme(2).display().to_string();
    c.node_ok(2, &format!("mount --bind {nvme} {nvme} && mount -o remount,bind,ro {nvme}"));
    let job = c.sbatch(&user.name, "f", "#!/bin/sh\n#SBATCH -N 4\n#SBATCH -C odfs\necho ran\n", &[]);
    let info = wait_for("the job requeued and held", LONG, || {
        let j = c.job(&job);
        (j.state == "PENDING" && j.reason.contains("held") && j.restarts >= 1, j)
    });
    // The broken node is drained, with odfs's one-line cause as the reason.
    let (state, reason) = wait_for("n3 drained", LONG, || {
        let s = c.node_state("n3");
        (s.0.contains("DRAIN") && !s.0.contains("COMPLETING"), s)
    });
    assert!(reason.contains("n3") && reason.contains("not writable"), "n3 reason: {reason} ({state}, {info:?})");
    // The others are back in service (the batch host's prolog had to fail too; its epilog
    // returns it), and every node rolled back.
    c.wait_nodes_idle(&["n1".into(), "n2".into(), "n4".into()], LONG);
    let out = c.output(&job);
    assert!(out.contains("could not start: n3") && out.contains("not writable") && !out.contains("ran"), "{out}");
    c.node_ok(2, &format!("umount {nvme}"));
    assert_all_clean(&c);
}

#[test]
fn a_node_whose_prolog_never_starts_odfs_is_named_and_only_it_stays_drained() {
    let c = Cluster::new(ClusterOptions::default());
    let user = TestUser::create("sp");
    // n3's prolog is not odfs's (as on a node whose slurm.conf lacks the Prolog line): it
    // returns at once and starts nothing.
    let noop = c.dir.path().join("jobs/other-prolog.sh");
    fs::write(&noop, "#!/bin/sh\nexit 0\n").unwrap();
    fs::set_permissions(&noop, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    c.node_ok(2, &format!("mount --bind {} /etc/odfs/prolog.sh", noop.display()));
    let job = c.sbatch(&user.name, "np", "#!/bin/sh\n#SBATCH -N 4\n#SBATCH -C odfs\necho ran\n", &[]);
    // Slurm requeues the job: held after the failed prolog, or (its batch host silent past
    // BatchStartTimeout while the start waited) requeued before it.
    let info = wait_for("the job requeued", LONG, || {
        let j = c.job(&job);
        let ok = j.state == "PENDING" && j.restarts >= 1;
        (ok, format!("{j:?}\n{}\n{}", c.output(&job), c.logs()))
    });
    // The silent node is drained, its reason naming it and what did not happen there.
    let (state, reason) = wait_for("n3 drained", LONG, || {
        let s = c.node_state("n3");
        (s.0.contains("DRAIN") && !s.0.contains("COMPLETING"), s)
    });
    let named = "n3 (node 2 of 4) never reported";
    assert!(
        reason.contains(named) && reason.contains("its prolog did not start odfs"),
        "n3: {state} {reason} ({info:?})\n{}",
        c.logs()
    );
    // Every node that did start is back in service.
    c.wait_nodes_idle(&["n1".into(), "n2".into(), "n4".into()], LONG);
    // The user's output names the silent node, not the mounts that waited for it.
    let out = c.output(&job);
    assert!(out.contains(&format!("could not start: {named}")) && !out.contains("ran"), "{out}");
    assert!(!out.contains("was not mounted in time"), "{out}");
    // So does each waiting node's own log: node 0 gave up on n3, the others rolled back for it.
    assert!(c.event_log(0).contains(&format!("could not start: {named}")), "{}", c.event_log(0));
    for k in [1, 3] {
        let log = c.event_log(k);
        assert!(log.contains(&format!("rolled back: {named}")), "{}: {log}", c.nodes[k]);
    }
    c.node_ok(2, "umount /etc/odfs/prolog.sh");
    c.slurm_ok("scancel", &[&job]);
    c.slurm_ok("scontrol", &["update", "nodename=n3", "state=resume"]);
    assert_all_clean(&c);
}

#[test]
fn a_stage_in_from_a_missing_bucket_says_how_to_release_or_cancel_the_job() {
    let c = Cluster::new(ClusterOptions { nodes: 2, ..Default::default() });
    let user = TestUser::create("mb");
    let script = "#!/bin/sh\n#SBATCH -N 2 -C odfs\n#ODFS stage-in s3://later/ds /data\ncat \"$ODFS_MOUNT/data/f\"\n";
    let job = c.sbatch(&user.name, "mb", script, &[]);
    wait_for("the job requeued and held", LONG, || {
        let j = c.job(&job);
        (j.state == "PENDING" && j.reason.contains("held") && j.restarts >= 1, j)
    });
    let out = wait_for("the message in the job's output", LONG, || {
        let o = c.output(&job);
        (o.contains("could not start"), o)
    });
    assert!(out.contains("stage-in s3://later/ds") && out.contains("bucket \"later\" does not exist"), "{out}");
    assert!(out.contains("The job is requeued and held"), "{out}");
    assert!(out.contains(&format!("release the job: `scontrol release {job}`")), "{out}");
    assert!(out.contains(&format!("cancel the job (`scancel {job}`), fix the line")), "{out}");
    // The job's mistake drains no node for long, and leaves nothing behind.
    c.wait_nodes_idle(&c.nodes.clone(), LONG);
    assert_all_clean(&c);
    let release = || {
        let out = Command::new("runuser")
            .args(["-u", &user.name, "--", "scontrol", "release", &job])
            .env("SLURM_CONF", c.dir.path().join("slurm.conf"))
            .output()
            .unwrap();
        assert!(out.status.success(), "the user's scontrol release: {}", String::from_utf8_lossy(&out.stderr));
    };
    // The bucket made but the dataset not yet in it: a job does not start on an empty dataset.
    let obj = c.s3.object_path("later", "ds/f");
    fs::create_dir_all(obj.parent().unwrap().parent().unwrap()).unwrap();
    release();
    let out = wait_for("the empty dataset named in the job's output", LONG, || {
        let o = c.output(&job);
        (o.contains("holds no files"), o)
    });
    assert!(
        out.contains("stage-in s3://later/ds -> odfs:/data: s3://later/ds/ holds no files: nothing was staged")
            && out.contains("an #ODFS stage-in of no files is refused"),
        "{out}"
    );
    wait_for("the job requeued and held again", LONG, || {
        let j = c.job(&job);
        (j.state == "PENDING" && j.reason.contains("held") && j.restarts >= 2, j)
    });
    c.wait_nodes_idle(&c.nodes.clone(), LONG);
    // Doing what it says: the data is put there, the user releases the job, and it runs.
    fs::create_dir_all(obj.parent().unwrap()).unwrap();
    fs::write(&obj, b"arrived\n").unwrap();
    release();
    let info = c.wait_ended(&job, LONG);
    assert_eq!(info.state, "COMPLETED", "{}\n{}", c.output(&job), c.logs());
    assert!(c.output(&job).contains("arrived"), "{}", c.output(&job));
    c.wait_nodes_idle(&c.nodes.clone(), LONG);
    assert_all_clean(&c);
}

#[test]
fn node_names_that_do_not_resolve_are_reported_like_any_start_failure() {
    // A site config whose resolve_suffix names hosts nobody knows.
    let c = Cluster::new(ClusterOptions {
        nodes: 2,
        ondemand: "resolve_suffix = \"-nowhere\"\n".into(),
        ..Default::default()
    });
    let user = TestUser::create("nr");
    let job = c.sbatch(&user.name, "nr", "#!/bin/sh\n#SBATCH -N 2\n#SBATCH -C odfs\necho ran\n", &[]);
    wait_for("the job requeued and held", LONG, || {
        let j = c.job(&job);
        (j.state == "PENDING" && j.reason.contains("held") && j.restarts >= 1, j)
    });
    // The drain reason is odfs's cause, not Slurm's generic "Prolog error".
    for n in &c.nodes {
        let (state, reason) = wait_for(&format!("{n} drained"), LONG, || {
            let s = c.node_state(n);
            (s.0.contains("DRAIN") && !s.0.contains("COMPLETING"), s)
        });
        assert!(reason.contains("cannot resolve node name"), "{n}: {state} {reason}");
    }
    // The user is told why, with what to fix.
    let out = c.output(&job);
    assert!(
        out.contains("could not start") && out.contains("cannot resolve node name n1-nowhere") && !out.contains("ran"),
        "{out}"
    );
    assert!(out.contains("resolve_suffix"), "{out}");
    // Nothing is left behind: no record, no lock, no process, no mount.
    for k in 0..c.nodes.len() {
        let state = c.dir.path().join(&c.nodes[k]).join("state");
        let locks: Vec<_> = fs::read_dir(&state)
            .map(|rd| rd.flatten().map(|e| e.file_name()).filter(|n| n.to_string_lossy().ends_with(".lock")).collect())
            .unwrap_or_default();
        assert!(locks.is_empty(), "{}: {locks:?} left in {}", c.nodes[k], state.display());
        assert!(c.state_entries(k).is_empty(), "{}: {:?}", c.nodes[k], c.state_entries(k));
        assert!(c.odfs_processes(k).is_empty() && c.odfs_mounts(k).is_empty(), "{}", c.nodes[k]);
        assert!(c.event_log(k).contains("cannot resolve node name"), "{}: {}", c.nodes[k], c.event_log(k));
    }
    c.slurm_ok("scancel", &[&job]);
}

#[test]
fn an_invalid_directive_fails_the_start_naming_its_line() {
    let c = Cluster::new(ClusterOptions { nodes: 2, ..Default::default() });
    let user = TestUser::create("sd");
    let script =
        "#!/bin/sh\n#SBATCH -N 2 -C odfs\n#ODFS stage-in s3://odfs/ds /data\n#ODFS stripe-count four\necho ran\n";
    let job = c.sbatch(&user.name, "d", script, &[]);
    // Without job_submit.lua the script is checked when the job starts: the job then fails
    // (cancelled), rather than wait, held, for a release that would fail the same way.
    let info = c.wait_ended(&job, LONG);
    assert_eq!(info.state, "CANCELLED", "{info:?}\n{}", c.logs());
    let out = wait_for("the message in the job's output", LONG, || {
        let o = c.output(&job);
        (o.contains("line 4"), o)
    });
    assert!(out.contains("`#ODFS stripe-count four`") && out.contains("is not a number"), "{out}");
    assert!(out.contains("the job is cancelled") && out.contains("odfs check-script") && !out.contains("ran"), "{out}");
    // The job's mistake drains no node for long: both are back in service, nothing is left.
    c.wait_nodes_idle(&c.nodes.clone(), LONG);
    assert_all_clean(&c);
}

/// Runs `odfs recover --job JOB` on every node at once (as an admin would with pdsh).
#[test]
fn job_submit_lua_refuses_an_invalid_script_at_sbatch() {
    let c = Cluster::new(ClusterOptions { nodes: 2, job_submit: true, ..Default::default() });
    let user = TestUser::create("js");
    let bad = "#!/bin/sh\n#SBATCH -N 2 -C odfs\n#ODFS stage-in s3://odfs/ds /data\n#ODFS stripe-count four\necho ran\n";
    let o = c.sbatch_output(&user.name, "bad", bad, &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "sbatch must refuse it: {err}");
    assert!(err.contains("batch script: line 4") && err.contains("is not a number"), "{err}");
    assert!(c.slurm_ok("squeue", &["-h", "-u", &user.name]).trim().is_empty(), "no job was made");
    // The same check by hand, before submitting.
    let path = c.dir.path().join("jobs/bad.sh");
    let o = Command::new(bin_dir().join("odfs")).arg("check-script").arg(&path).output().unwrap();
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("line 4"), "{o:?}");
    // A valid script goes through and runs.
    let good = "#!/bin/sh\n#SBATCH -N 2 -C odfs\n#ODFS stripe-count 2\necho ran\n";
    let job = c.sbatch(&user.name, "good", good, &[]);
    let info = c.wait_ended(&job, LONG);
    assert_eq!(info.state, "COMPLETED", "{}\n{}", c.output(&job), c.logs());
    assert!(c.output(&job).contains("ran"));
    c.wait_nodes_idle(&c.nodes.clone(), LONG);
    assert_all_clean(&c);
}

fn recover_everywhere(c: &Cluster, job: &str) -> Vec<std::process::Output> {
    let odfs = bin_dir().join("odfs");
    // As on a real node, Slurm's commands find the cluster's slurm.conf.
    let conf = c.dir.path().join("slurm.conf");
    each(c.nodes.len(), |k| {
        c.node_sh(
            k,
            &format!("SLURM_CONF={} {} recover --job {job} --node {}", conf.display(), odfs.display(), c.nodes[k]),
        )
    })
}

/// The reason a node's record of `job` gives for keeping its data.
fn kept_reason(c: &Cluster, k: usize, job: &str) -> String {
    let p = c.dir.path().join(&c.nodes[k]).join("state").join(job).join("record.toml");
    let rec: toml::Value =
        toml::from_str(&fs::read_to_string(&p).unwrap_or_default()).unwrap_or_else(|e| panic!("{e}"));
    rec.get("reason").and_then(|r| r.as_str()).unwrap_or_default().to_string()
}

#[test]
fn a_failed_stage_out_keeps_the_data_until_odfs_recover_finishes_it() {
    let mut c = Cluster::new(ClusterOptions::default());
    let user = TestUser::create("so");
    let out = c.dir.path().join("out");
    let body = format!(
        "mkdir \"$ODFS_MOUNT/results\"\nsrun -N 4 --ntasks-per-node=1 sh -c 'head -c $((2*1048576+SLURM_NODEID)) /dev/urandom | \
         tee {o}/expected.$SLURMD_NODENAME > \"$ODFS_MOUNT/results/$SLURMD_NODENAME.bin\"'",
        o = out.display()
    );
    let directives = format!("#SBATCH -N 4 -C odfs\n#ODFS stage-out /results s3://{BUCKET}/run-%j\n");
    let job = c.sbatch(&user.name, "so", &waiting_script(&c, &directives, &body), &[]);
    wait_ready(&c, &job);
    // S3 goes away before the job ends, for longer than the epilog waits for it.
    c.site_config_set_stage("unreachable_secs = 2\n");
    c.s3.kill();
    go(&c, &job);
    let info = c.wait_ended(&job, LONG);
    assert_eq!(info.state, "COMPLETED", "the job itself succeeded: {}", c.output(&job));
    for (k, n) in c.nodes.clone().iter().enumerate() {
        let (state, reason) = wait_for(&format!("{n} drained after its epilog"), LONG, || {
            let s = c.node_state(n);
            (s.0.contains("DRAIN") && !s.0.contains("COMPLETING"), s)
        });
        // The action first, whole, however long the cause and the paths.
        assert!(
            reason.contains("not verified") && reason.contains(&format!("odfs recover --job {job}")),
            "{n}: {state} {reason}"
        );
        // Kept: the data and the record; gone: processes and mounts.
        assert!(!c.data_entries(k).is_empty(), "{n}: data must be kept\n{}", c.logs());
        assert_eq!(c.state_entries(k), std::slice::from_ref(&job), "{n}: its record says the data is kept");
        assert!(c.odfs_processes(k).is_empty(), "{n}: {:?}", c.odfs_processes(k));
        assert!(c.odfs_mounts(k).is_empty(), "{n}: {:?}", c.odfs_mounts(k));
    }
    let msg = c.output(&job);
    assert!(msg.contains("outputs not verified") && msg.contains(&format!("odfs recover --job {job}")), "{msg}");
    assert!(!c.s3.object_path(BUCKET, &format!("run-{job}/.odfs-stage-out.complete")).exists());

    // A recovery while S3 is still down fails too: every node keeps the first cause and adds
    // the recovery's, in its record and its drain reason.
    let first: Vec<String> = (0..c.nodes.len()).map(|k| kept_reason(&c, k, &job)).collect();
    for (k, o) in recover_everywhere(&c, &job).iter().enumerate() {
        assert!(!o.status.success(), "{}: odfs recover succeeded with S3 down\n{}", c.nodes[k], c.logs());
    }
    for (k, n) in c.nodes.iter().enumerate() {
        assert!(!first[k].is_empty(), "{n}: no kept reason");
        let now = kept_reason(&c, k, &job);
        let kept = format!("{}; then `odfs recover` failed: ", first[k]);
        assert!(now.starts_with(&kept) && now.len() > kept.len(), "{n}: {now}\n(first: {})", first[k]);
        let (state, reason) = c.node_state(n);
        assert!(
            reason.contains("outputs not verified, data kept, `odfs recover` failed too")
                && reason.contains(&format!("odfs recover --job {job}")),
            "{n}: {state} {reason}"
        );
        assert!(!c.data_entries(k).is_empty(), "{n}: data must still be kept");
    }

    // S3 is back: odfs recover on every node restarts the filesystem from the kept data,
    // finishes the stage-out, verifies it, then wipes.
    c.s3.start();
    for (k, o) in recover_everywhere(&c, &job).iter().enumerate() {
        assert!(
            o.status.success(),
            "{}: odfs recover: {}\n{}",
            c.nodes[k],
            String::from_utf8_lossy(&o.stderr),
            c.logs()
        );
    }
    for n in &c.nodes {
        let want = fs::read(out.join(format!("expected.{n}"))).unwrap();
        let got = fs::read(c.s3.object_path(BUCKET, &format!("run-{job}/{n}.bin"))).unwrap_or_default();
        assert_bytes(&got, &want, &format!("run-{job}/{n}.bin after recovery"));
    }
    assert!(c.s3.object_path(BUCKET, &format!("run-{job}/.odfs-stage-out.complete")).exists());
    assert!(c.output(&job).contains("recovered"), "{}", c.output(&job));
    assert_all_clean(&c);
}

#[test]
fn a_missing_stage_out_source_is_the_jobs_outcome_and_no_node_drains() {
    let c = Cluster::new(ClusterOptions::default());
    let user = TestUser::create("ms");
    // The job writes its logs but exits before it makes /results.
    let script = format!(
        "#!/bin/sh\n#SBATCH -N 4\n#SBATCH -C odfs\n\
         #ODFS stage-out /results s3://{BUCKET}/res-%j\n#ODFS stage-out /logs s3://{BUCKET}/logs-%j\n\
         mkdir \"$ODFS_MOUNT/logs\" && echo trained > \"$ODFS_MOUNT/logs/train.log\"\n"
    );
    let job = c.sbatch(&user.name, "ms", &script, &[]);
    let info = c.wait_ended(&job, LONG);
    let log = c.output(&job);
    assert_eq!((info.state.as_str(), info.exit_code.as_str()), ("COMPLETED", "0:0"), "{log}\n{}", c.logs());
    // The epilog is done once every node is back: none drains, nothing is kept.
    c.wait_nodes_idle(&c.nodes, LONG);
    for n in &c.nodes {
        let (state, reason) = c.node_state(n);
        assert_eq!(state, "IDLE", "{n}: {reason}");
    }
    assert_all_clean(&c);
    // The user is told, and what did exist was staged out, verified, with the marker.
    let log = c.output(&job);
    assert!(log.contains("stage-out odfs:/results") && log.contains("does not exist in the job's filesystem"), "{log}");
    let got = fs::read(c.s3.object_path(BUCKET, &format!("logs-{job}/train.log"))).unwrap_or_default();
    assert_eq!(got, b"trained\n", "{log}\n{}", c.logs());
    assert!(c.s3.object_path(BUCKET, &format!("logs-{job}/.odfs-stage-out.complete")).exists());
    assert!(!c.s3.object_path(BUCKET, &format!("res-{job}")).exists());
}

#[test]
fn a_store_down_for_a_moment_during_the_epilog_is_waited_out() {
    let mut c = Cluster::new(ClusterOptions::default());
    let user = TestUser::create("sd");
    let out = c.dir.path().join("out");
    let body = format!(
        "mkdir \"$ODFS_MOUNT/results\"\nhead -c 3000000 /dev/urandom | tee {o}/expected > \"$ODFS_MOUNT/results/r.bin\"",
        o = out.display()
    );
    let directives = format!("#SBATCH -N 4 -C odfs\n#ODFS stage-out /results s3://{BUCKET}/run-%j\n");
    let job = c.sbatch(&user.name, "sd", &waiting_script(&c, &directives, &body), &[]);
    wait_ready(&c, &job);
    // The store is down when the job ends (connection refused) and back 3 s later, well
    // within unreachable_secs (default 60 s): the epilog waits for it.
    c.s3.kill();
    go(&c, &job);
    std::thread::sleep(Duration::from_secs(3));
    c.s3.start();
    let info = c.wait_ended(&job, LONG);
    assert_eq!(info.state, "COMPLETED", "{}", c.output(&job));
    c.wait_nodes_idle(&c.nodes, LONG);
    for n in &c.nodes {
        let (state, reason) = c.node_state(n);
        assert_eq!(state, "IDLE", "{n}: {reason}\n{}", c.logs());
    }
    let want = fs::read(out.join("expected")).unwrap();
    let got = fs::read(c.s3.object_path(BUCKET, &format!("run-{job}/r.bin"))).unwrap_or_default();
    assert_bytes(&got, &want, &format!("run-{job}/r.bin"));
    assert!(c.s3.object_path(BUCKET, &format!("run-{job}/.odfs-stage-out.complete")).exists(), "{}", c.logs());
    assert_all_clean(&c);
}

#[test]
fn scancel_during_the_stage_in_tears_everything_down() {
    let c = Cluster::new(ClusterOptions::default());
    let user = TestUser::create("sc");
    dataset(&c, "big", &[8 << 20; 8]);
    // 64 MiB at 2 MiB/s: the stage-in is still running when the job is cancelled.
    let script = format!(
        "#!/bin/sh\n#SBATCH -N 4 -C odfs\n#ODFS stage-in s3://{BUCKET}/big /data\n#ODFS max-bandwidth 2M\necho ran\n"
    );
    let job = c.sbatch(&user.name, "c", &script, &[]);
    wait_for("the stage-in to begin", LONG, || (c.event_log(0).contains("filesystem ready"), c.job(&job)));
    c.slurm_ok("scancel", &[&job]);
    let info = c.wait_ended(&job, LONG);
    assert_eq!(info.state, "CANCELLED");
    c.wait_nodes_idle(&c.nodes.clone(), LONG);
    assert!(c.event_log(0).contains("cancelled during the stage-in"), "{}", c.logs());
    assert!(!c.output(&job).contains("ran"));
    assert_all_clean(&c);
}

#[test]
fn a_node_killed_mid_job_is_cleaned_by_its_next_prolog() {
    let mut c = Cluster::new(ClusterOptions::default());
    let user = TestUser::create("sk");
    let job =
        c.sbatch(&user.name, "k", &waiting_script(&c, "#SBATCH -N 4 -C odfs\n", "echo up > \"$ODFS_MOUNT/f\""), &[]);
    wait_ready(&c, &job);
    c.kill_node(2);
    // Slurm notices, requeues the job; the surviving nodes' epilogs tear their part down.
    wait_for("the job requeued", LONG, || {
        let j = c.job(&job);
        (j.restarts >= 1 && j.state == "PENDING", j)
    });
    c.slurm_ok("scontrol", &["hold", &job]);
    for k in [0, 1, 3] {
        let n = c.nodes[k].clone();
        wait_for(&format!("{n} cleaned by its epilog"), LONG, || {
            let (procs, data) = (c.odfs_processes(k), c.data_entries(k));
            (procs.is_empty() && data.is_empty() && c.state_entries(k).is_empty(), (procs, data))
        });
        c.assert_clean(k);
    }
    // The dead node still holds the job's data and record.
    assert!(!c.data_entries(2).is_empty() && c.state_entries(2) == [job.clone()], "n3 must have leftovers");
    // n3 comes back. Slurm may run the dead job's epilog there (it finds node 0 gone and the job
    // requeued; the job stages nothing out, so n3's part is wiped); the next odfs job's prolog
    // on n3 cleans whatever is still left. Either way nothing of the job survives, and n3 is
    // not drained for it.
    c.restart_node(2);
    c.wait_nodes_idle(&["n3".into()], LONG);
    c.wait_no_odfs(2, LONG);
    let next = c.sbatch(&user.name, "next", "#!/bin/sh\n#SBATCH -N 1 -w n3 -C odfs\nls \"$ODFS_MOUNT\"\n", &[]);
    assert_eq!(c.wait_ended(&next, LONG).state, "COMPLETED", "{}", c.output(&next));
    // Slurm may start the dead job's epilog on n3 only now (after the wait above); the prolog
    // then leaves the job to it, and it finishes on its own.
    let outcomes = [
        format!("job {job}: cleanup: job {job}: cleaned up"),
        format!("job {next}: cleanup: job {job}: cleaned up"),
        format!("job {job}: wiped"),
    ];
    assert!(
        wait_until(LONG, || {
            let log = c.event_log(2);
            outcomes.iter().any(|l| log.contains(l))
        }),
        "n3's leftovers of job {job} were not removed by an epilog or the next prolog:\n{}",
        c.logs()
    );
    // The epilog's last lines come just before it exits.
    c.wait_nodes_idle(&["n3".into()], LONG);
    c.wait_no_odfs(2, LONG);
    c.assert_clean(2);
    c.slurm_ok("scancel", &[&job]);
}

/// A script body that writes `n` checkpoints of 20 MiB into `$ODFS_MOUNT/ckpt`, 2 s apart, each
/// kept in `out` too, with the time (ms since the epoch) its writer closed it.
fn checkpoints_body(out: &Path, n: u32) -> String {
    format!(
        "mkdir \"$ODFS_MOUNT/ckpt\"\nfor k in $(seq 1 {n}); do head -c 20971520 /dev/urandom > {o}/ckpt-$k.pt; \
         cp {o}/ckpt-$k.pt \"$ODFS_MOUNT/ckpt/ckpt-$k.pt\"; date +%s%3N > {o}/closed-$k; sleep 2; done",
        o = out.display()
    )
}

/// Waits until checkpoint k of `job` is in S3 byte for byte and recorded as drained in the
/// destination's manifest (written after the upload is verified).
fn wait_drained(c: &Cluster, out: &Path, job: &str, k: u32) {
    let want = fs::read(out.join(format!("ckpt-{k}.pt"))).unwrap();
    let p = c.s3.object_path(BUCKET, &format!("run-{job}/ckpt/ckpt-{k}.pt"));
    wait_for(&format!("checkpoint {k} drained"), LONG, || {
        (fs::read(&p).unwrap_or_default() == want && drained_at(c, job, k).is_some(), c.job(job))
    });
}

/// The drain's record of checkpoint k in the destination's manifest: when it was drained.
fn drained_at(c: &Cluster, job: &str, k: u32) -> Option<i64> {
    let m = c.s3.object_path(BUCKET, &format!("run-{job}/ckpt/.odfs-stage-out.json"));
    let m: serde_json::Value = serde_json::from_slice(&fs::read(m).unwrap_or_default()).unwrap_or_default();
    m["files"][format!("ckpt-{k}.pt")]["drained"].as_i64()
}

#[test]
fn checkpoints_are_drained_to_s3_while_the_job_runs_and_the_epilog_sends_none_again() {
    let c = Cluster::new(ClusterOptions::default());
    let user = TestUser::create("dr");
    let out = c.dir.path().join("out");
    let directives = format!("#SBATCH -N 4 -C odfs\n#ODFS drain /ckpt s3://{BUCKET}/run-%j/ckpt --settle 2\n");
    let job = c.sbatch(&user.name, "dr", &waiting_script(&c, &directives, &checkpoints_body(&out, 5)), &[]);
    wait_ready(&c, &job);
    // Every checkpoint reaches S3, verified and recorded, while the job still runs.
    for k in 1..=5 {
        wait_drained(&c, &out, &job, k);
        let closed: i64 = fs::read_to_string(out.join(format!("closed-{k}"))).unwrap().trim().parse().unwrap();
        let at = drained_at(&c, &job, k).unwrap();
        assert!(at > closed, "ckpt-{k} recorded as drained ({at}) before its writer closed it ({closed})");
        eprintln!("ckpt-{k}: in S3 {} ms after its close (settle 2 s)", at - closed);
    }
    assert_eq!(c.job(&job).state, "RUNNING");
    go(&c, &job);
    let info = c.wait_ended(&job, LONG);
    assert_eq!(info.state, "COMPLETED", "{}\n{}", c.output(&job), c.logs());
    c.wait_nodes_idle(&c.nodes, LONG);
    // The epilog stopped the drain and sent nothing it had drained; its verdict counts them.
    let log = c.event_log(0);
    assert!(log.contains("drain stopped: odfs:/ckpt") && log.contains("5 uploaded"), "{log}");
    assert!(log.contains("stage-out: 0 files"), "the epilog uploads nothing already drained:\n{log}");
    assert!(log.contains("drained while the job ran, unchanged since: 5 files not sent again"), "{log}");
    assert!(c.s3.object_path(BUCKET, &format!("run-{job}/ckpt/.odfs-stage-out.complete")).exists(), "{log}");
    for k in 1..=5 {
        let want = fs::read(out.join(format!("ckpt-{k}.pt"))).unwrap();
        let got = fs::read(c.s3.object_path(BUCKET, &format!("run-{job}/ckpt/ckpt-{k}.pt"))).unwrap_or_default();
        assert_bytes(&got, &want, &format!("ckpt-{k}"));
    }
    assert_all_clean(&c);
}

#[test]
fn a_node_lost_after_three_drained_checkpoints_loses_none_of_them() {
    let mut c = Cluster::new(ClusterOptions::default());
    let user = TestUser::create("dk");
    let out = c.dir.path().join("out");
    // Striped over every node: each checkpoint has chunks on the node that dies.
    let directives = format!(
        "#SBATCH -N 4 -C odfs\n#ODFS stripe-count -1\n#ODFS drain /ckpt s3://{BUCKET}/run-%j/ckpt --settle 2\n"
    );
    let job = c.sbatch(&user.name, "dk", &waiting_script(&c, &directives, &checkpoints_body(&out, 3)), &[]);
    wait_ready(&c, &job);
    for k in 1..=3 {
        wait_drained(&c, &out, &job, k);
    }
    c.kill_node(2);
    // Slurm notices and requeues the job; node 0's epilog stops the drain and stages out: the
    // three drained checkpoints need nothing from the dead node.
    wait_for("the job requeued", LONG, || {
        let j = c.job(&job);
        (j.restarts >= 1 && j.state == "PENDING", j)
    });
    c.slurm_ok("scontrol", &["hold", &job]);
    wait_for("node 0's epilog over", LONG, || {
        let log = c.event_log(0);
        (log.contains("stopped and wiped") || log.contains("outputs not verified"), ())
    });
    let log = c.event_log(0);
    assert!(log.contains("drained while the job ran, unchanged since: 3 files not sent again"), "{log}");
    for k in 1..=3 {
        let want = fs::read(out.join(format!("ckpt-{k}.pt"))).unwrap();
        let got = fs::read(c.s3.object_path(BUCKET, &format!("run-{job}/ckpt/ckpt-{k}.pt"))).unwrap_or_default();
        assert_bytes(&got, &want, &format!("ckpt-{k} after n3 died"));
        assert!(drained_at(&c, &job, k).is_some(), "ckpt-{k} is recorded as drained");
    }
    assert!(c.s3.object_path(BUCKET, &format!("run-{job}/ckpt/.odfs-stage-out.complete")).exists(), "{log}");
    c.slurm_ok("scancel", &[&job]);
}

#[test]
fn a_store_outage_during_the_job_delays_drains_and_loses_nothing() {
    let mut c = Cluster::new(ClusterOptions::default());
    let user = TestUser::create("do");
    let out = c.dir.path().join("out");
    let directives = format!("#SBATCH -N 4 -C odfs\n#ODFS drain /ckpt s3://{BUCKET}/run-%j/ckpt --settle 1\n");
    // The script (run once the prolog, which starts the drain, is over) says it started, then
    // waits for the go-ahead before it writes checkpoints.
    let body = format!(
        "touch {o}/started\nwhile [ ! -e {o}/write ]; do sleep 0.1; done\n{}",
        checkpoints_body(&out, 4),
        o = out.display()
    );
    let job = c.sbatch(&user.name, "do", &waiting_script(&c, &directives, &body), &[]);
    wait_for("the batch script running", LONG, || (out.join("started").exists(), c.job(&job)));
    // The store is down (connection refused) while the checkpoints are written and settle, and
    // comes back after the last one is closed.
    c.s3.kill();
    fs::write(out.join("write"), b"").unwrap();
    wait_ready(&c, &job);
    for k in 1..=4 {
        assert!(!c.s3.object_path(BUCKET, &format!("run-{job}/ckpt/ckpt-{k}.pt")).exists());
    }
    c.s3.start();
    for k in 1..=4 {
        wait_drained(&c, &out, &job, k);
    }
    assert_eq!(c.job(&job).state, "RUNNING", "drained while the job runs");
    go(&c, &job);
    assert_eq!(c.wait_ended(&job, LONG).state, "COMPLETED", "{}", c.logs());
    c.wait_nodes_idle(&c.nodes, LONG);
    let log = c.event_log(0);
    assert!(log.contains("drained while the job ran, unchanged since: 4 files not sent again"), "{log}");
    assert!(c.s3.object_path(BUCKET, &format!("run-{job}/ckpt/.odfs-stage-out.complete")).exists(), "{log}");
    assert_all_clean(&c);
}
