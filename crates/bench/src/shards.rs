//! `odfs bench --shards`: creates in one shared directory from several clients, with one
//! metadata service and with one per node (the directory striped over all of them), beside
//! the same creates in a plain directory of the local disk; then `odfs find` beside GNU find
//! over the files created, through the mount, page cache dropped before each walk.

use super::drop_caches;
use anyhow::{Context, Result};
use odfs_client::{Client, ClientConfig, Ctx};
use odfs_job::local::{self, UpOptions};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

#[derive(Debug, Clone)]
pub struct ShardBenchOptions {
    pub root: PathBuf,
    pub nodes: u32,
    /// Creating clients (each its own connections, as separate nodes).
    pub clients: usize,
    /// Files in the shared directory.
    pub files: usize,
    pub keep: bool,
}

impl Default for ShardBenchOptions {
    fn default() -> Self {
        ShardBenchOptions { root: PathBuf::from("odfs-bench"), nodes: 4, clients: 4, files: 200_000, keep: false }
    }
}

/// One row of the result: what, how many, seconds.
#[derive(Debug, Clone)]
pub struct Row {
    pub name: String,
    pub ops: u64,
    pub secs: f64,
}

impl Row {
    pub fn rate(&self) -> f64 {
        self.ops as f64 / self.secs.max(1e-9)
    }
}

/// Creates `files` empty files in `/dir` from `clients` clients; seconds.
fn lib_creates(cfg: &ClientConfig, dir: &str, clients: usize, files: usize) -> Result<f64> {
    let per = files / clients;
    let t = Instant::now();
    std::thread::scope(|s| -> Result<()> {
        let hs: Vec<_> = (0..clients)
            .map(|c| {
                let cfg = cfg.clone();
                s.spawn(move || -> Result<()> {
                    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
                    rt.block_on(async {
                        let client = Client::connect(cfg).await?;
                        let ctx = Ctx::current();
                        let d = client.resolve(&ctx, dir, true).await?;
                        let names: Vec<String> = (0..per).map(|i| format!("c{c}.f{i:07}")).collect();
                        for batch in names.chunks(64) {
                            let futs =
                                batch.iter().map(|n| client.create(&ctx, d.ino, n.as_bytes(), 0o644, true, None));
                            for r in futures::future::join_all(futs).await {
                                r?;
                            }
                        }
                        client.close().await;
                        anyhow::Ok(())
                    })
                })
            })
            .collect();
        for h in hs {
            h.join().map_err(|_| anyhow::anyhow!("a client thread panicked"))??;
        }
        Ok(())
    })?;
    Ok(t.elapsed().as_secs_f64())
}

/// The same creates in a plain directory, one thread per client; seconds.
fn plain_creates(dir: &Path, clients: usize, files: usize) -> Result<f64> {
    std::fs::create_dir_all(dir)?;
    let per = files / clients;
    let t = Instant::now();
    std::thread::scope(|s| {
        for c in 0..clients {
            s.spawn(move || {
                for i in 0..per {
                    let _ = std::fs::File::create(dir.join(format!("c{c}.f{i:07}")));
                }
            });
        }
    });
    Ok(t.elapsed().as_secs_f64())
}

/// Runs a command over a tree, page cache dropped first: (seconds, lines printed).
fn timed_walk(cmd: &mut Command) -> Result<(f64, u64)> {
    drop_caches();
    let t = Instant::now();
    let out = cmd.output().context("run the walk")?;
    anyhow::ensure!(out.status.success(), "{cmd:?}: {}", String::from_utf8_lossy(&out.stderr));
    Ok((t.elapsed().as_secs_f64(), out.stdout.iter().filter(|&&b| b == b'\n').count() as u64))
}

pub fn run(o: &ShardBenchOptions) -> Result<Vec<Row>> {
    let root = o.root.join("shards");
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root)?;
    let root = root.canonicalize()?;
    let mut rows = Vec::new();
    let files = (o.files / o.clients) * o.clients;
    let secs = plain_creates(&root.join("plain/d"), o.clients, files)?;
    rows.push(Row { name: format!("plain directory, {} threads", o.clients), ops: files as u64, secs });
    for meta in [1, o.nodes] {
        let fsroot = root.join(format!("fs{meta}"));
        let opts = UpOptions {
            root: fsroot.clone(),
            nodes: o.nodes,
            meta,
            mount: Some(fsroot.join("mnt")),
            ..UpOptions::default()
        };
        local::up(&opts)?;
        let run = (|| -> Result<()> {
            let cfg = ClientConfig::load(&local::client_config_path(&fsroot))?;
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
            rt.block_on(async {
                let c = Client::connect(cfg.clone()).await?;
                let ctx = Ctx::current();
                let d = c.mkdir(&ctx, odfs_proto::InodeId::ROOT, b"d", 0o755).await?;
                if meta > 1 {
                    c.stripe_dir(&ctx, d.ino, -1).await?;
                }
                c.close().await;
                anyhow::Ok(())
            })?;
            let secs = lib_creates(&cfg, "/d", o.clients, files)?;
            let what = if meta > 1 { format!("directory striped over {meta}") } else { "one directory".to_string() };
            rows.push(Row {
                name: format!("odfs, {meta} metad, {what}, {} clients", o.clients),
                ops: files as u64,
                secs,
            });
            if meta > 1 {
                let d = fsroot.join("mnt/d");
                let odfs = std::env::current_exe()?;
                let fsarg = local::client_config_path(&fsroot);
                let (s, n) =
                    timed_walk(Command::new(&odfs).arg("--fs").arg(&fsarg).arg("find").arg(&d).args(["-name", "*7"]))?;
                rows.push(Row { name: format!("odfs find -name (found {n})"), ops: files as u64, secs: s });
                let (s, n) = timed_walk(Command::new("find").arg(&d).args(["-name", "*7"]))?;
                rows.push(Row { name: format!("GNU find -name on the mount (found {n})"), ops: files as u64, secs: s });
                let (s, n) = timed_walk(Command::new("find").arg(root.join("plain/d")).args(["-name", "*7"]))?;
                rows.push(Row {
                    name: format!("GNU find -name on the plain directory (found {n})"),
                    ops: files as u64,
                    secs: s,
                });
            }
            Ok(())
        })();
        local::down(&fsroot)?;
        run?;
    }
    if !o.keep {
        let _ = std::fs::remove_dir_all(&root);
    }
    Ok(rows)
}

pub fn render(rows: &[Row]) -> String {
    let mut s = String::from("| phase | entries | seconds | entries/s |\n|---|---|---|---|\n");
    for r in rows {
        s += &format!("| {} | {} | {:.2} | {:.0} |\n", r.name, r.ops, r.secs, r.rate());
    }
    s
}
