//! `odfs demo`: the main job on one machine — a 4-node local filesystem, a generated dataset
//! copied in and back out and compared byte for byte, a short benchmark, teardown.

use crate::bench::{self, fill_pattern, BenchOptions};
use crate::copy::{self, CopyOptions};
use crate::local::{self, UpOptions};
use anyhow::{bail, Context, Result};
use odfs_client::{Client, ClientConfig};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Debug, Clone)]
pub struct DemoOptions {
    pub root: PathBuf,
    pub nodes: u32,
    /// Megabytes of generated data.
    pub dataset_mib: u64,
    pub keep: bool,
    pub bench: bool,
}

/// Writes a dataset of small, medium and large files in nested directories; returns bytes.
pub fn generate_dataset(dir: &Path, total_mib: u64) -> Result<u64> {
    let mut total = 0u64;
    let budget = total_mib << 20;
    let mut i = 0u64;
    while total < budget {
        let size = match i % 10 {
            0 => 16 << 20,
            1..=3 => (1 << 20) + i * 4099,
            _ => 1 + (i * 7919) % (256 << 10),
        }
        .min(budget - total);
        let sub = dir.join(format!("shard{:02}/part{}", i % 8, i % 3));
        std::fs::create_dir_all(&sub)?;
        let mut buf = vec![0u8; size as usize];
        fill_pattern(&mut buf, 1000 + i);
        std::fs::write(sub.join(format!("sample{i:05}.bin")), &buf)?;
        total += size;
        i += 1;
    }
    std::fs::create_dir_all(dir.join("empty-dir"))?;
    std::os::unix::fs::symlink("shard00/part0", dir.join("latest"))?;
    Ok(total)
}

/// sha256 of every regular file under `dir`, by relative path.
pub fn checksums(dir: &Path) -> Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d)? {
            let e = e?;
            let ft = e.file_type()?;
            if ft.is_dir() {
                stack.push(e.path());
            } else if ft.is_file() {
                let data = std::fs::read(e.path())?;
                let rel = e.path().strip_prefix(dir)?.to_string_lossy().into_owned();
                out.insert(rel, hex::encode(Sha256::digest(&data)));
            }
        }
    }
    Ok(out)
}

pub fn run(o: &DemoOptions) -> Result<()> {
    std::fs::create_dir_all(&o.root)?;
    let root = o.root.canonicalize()?;
    let fsroot = root.join("fs");
    let _ = local::down(&fsroot);
    let _ = std::fs::remove_dir_all(&fsroot);
    let src = root.join("dataset");
    let out = root.join("dataset-out");
    let _ = std::fs::remove_dir_all(&src);
    let _ = std::fs::remove_dir_all(&out);

    println!("1/5 starting a {}-node odfs on this machine under {}", o.nodes, fsroot.display());
    let t = Instant::now();
    let state = local::up(&UpOptions { root: fsroot.clone(), nodes: o.nodes, ..UpOptions::default() })?;
    println!(
        "    ready in {:.2} s: mgmtd + metad on node 0, stored on {} nodes ({} processes)",
        t.elapsed().as_secs_f64(),
        o.nodes,
        state.procs.len()
    );

    let result = (|| -> Result<()> {
        println!("2/5 generating a {} MiB dataset in {}", o.dataset_mib, src.display());
        let bytes = generate_dataset(&src, o.dataset_mib)?;
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
        let cfg = ClientConfig::load(&local::client_config_path(&fsroot))?;
        let opts = CopyOptions { recursive: true, parallel: 16, progress: false };
        rt.block_on(async {
            let client = Client::connect(cfg).await?;
            println!("3/5 copying it in: odfs cp -r {} odfs:/dataset", src.display());
            let t = Instant::now();
            let s = copy::copy(&client, src.to_str().context("path")?, "odfs:/dataset", &opts).await?;
            let secs = t.elapsed().as_secs_f64();
            println!(
                "    {} files, {} dirs, {:.1} MiB in {:.2} s ({:.0} MiB/s)",
                s.files,
                s.dirs,
                s.bytes as f64 / 1048576.0,
                secs,
                s.bytes as f64 / 1048576.0 / secs
            );
            println!("4/5 copying it back out and comparing sha256 of every file");
            let t = Instant::now();
            let s = copy::copy(&client, "odfs:/dataset", out.to_str().context("path")?, &opts).await?;
            let secs = t.elapsed().as_secs_f64();
            println!(
                "    {} files, {:.1} MiB in {:.2} s ({:.0} MiB/s)",
                s.files,
                s.bytes as f64 / 1048576.0,
                secs,
                s.bytes as f64 / 1048576.0 / secs
            );
            anyhow::Ok(())
        })?;
        let a = checksums(&src)?;
        let b = checksums(&out)?;
        if a != b {
            let diff: Vec<_> = a.iter().filter(|(k, v)| b.get(*k) != Some(v)).map(|(k, _)| k.clone()).take(5).collect();
            bail!("dataset differs after the round trip: {diff:?}");
        }
        anyhow::ensure!(out.join("empty-dir").is_dir(), "empty directory was not copied");
        anyhow::ensure!(
            std::fs::read_link(out.join("latest"))? == Path::new("shard00/part0"),
            "symlink was not copied"
        );
        println!("    all {} files identical ({} bytes)", a.len(), bytes);
        Ok(())
    })();
    let _ = local::down(&fsroot);
    result?;
    if o.bench {
        println!("5/5 short benchmark (odfs vs a plain directory on the same disk)");
        let bo = BenchOptions {
            root: root.join("bench"),
            nodes: o.nodes,
            file_size: 256 << 20,
            files_per_thread: 5000,
            ..BenchOptions::default()
        };
        let (phases, dropped) = bench::run(&bo)?;
        print!("{}", bench::render(&phases));
        if !dropped {
            println!("    (page cache could not be dropped: reads may be served from memory)");
        }
    } else {
        println!("5/5 benchmark skipped (--no-bench)");
    }
    if !o.keep {
        let _ = std::fs::remove_dir_all(&root);
    }
    println!("demo finished: filesystem stopped, no process left");
    Ok(())
}
