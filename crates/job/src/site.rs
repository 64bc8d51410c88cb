//! The site config's `[ondemand]` table: how `odfs start` lays a job's filesystem out on a node
//! (data paths, mount point, ports, timeouts, the Slurm features). Every key has a documented
//! default here; `odfs site-config --defaults` prints them. The same file's `[stage]` table
//! belongs to staging (`odfs_stage::SiteStage`).

use anyhow::{bail, Context, Result};
use odfs_proto::DirLayout;
use odfs_rpc::Transport;
use odfs_stage::SiteStage;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Where the site config lives unless `--site-config` or `ODFS_SITE_CONFIG` names another file.
pub use odfs_stage::config::SITE_CONFIG;

/// Ports one job uses on a node: mgmtd, metad, stored (QUIC), stored (TCP bulk), stage agent,
/// and three spare.
pub const PORTS_PER_JOB: u16 = 8;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct SiteOndemand {
    /// The site key every job credential is derived from (root-only; `odfs keygen`). The same
    /// file must be on every node.
    pub site_key: PathBuf,
    /// The Slurm feature that asks for odfs (`#SBATCH --constraint=odfs`).
    pub feature: String,
    /// The feature that adds a RAM-backed pool (a tmpfs on every node) to the job's filesystem.
    pub ram_feature: String,
    /// The feature that runs a metadata service on every node of the job.
    pub meta_feature: String,
    /// Metadata services of a job: on its first N nodes (0 = every node).
    pub meta: u32,
    /// Directories on local NVMe, one storage target each. A job's data lives in
    /// `PATH/odfs.JOBID/`. `%n` is replaced by the node name.
    pub data_paths: Vec<String>,
    /// Pool of the `data_paths` targets.
    pub pool: String,
    /// Pool of the RAM targets.
    pub ram_pool: String,
    /// Size of each node's RAM target: tmpfs `size=` syntax (`8G`, `25%`).
    pub ram_size: String,
    /// Per-job records, daemon configs and logs: `DIR/JOBID/`. Keep it on a disk that survives
    /// a reboot, so the leftovers of a node that died are found and cleaned. `%n` = node name.
    pub state_dir: String,
    /// Mount point: `%j` job id, `%u` user, `%n` node name. Owned by the job's user, mode 0700.
    pub mount: String,
    /// First port of the per-job range. A job uses `PORTS_PER_JOB` ports at
    /// `port_base + (job id mod port_slots) * 8`; keep the range below the kernel's ephemeral
    /// ports (`net.ipv4.ip_local_port_range`, 32768 by default).
    pub port_base: u16,
    /// Jobs that can share a node without their ports colliding (job ids modulo this).
    pub port_slots: u16,
    /// Appended to each node name before it is resolved (e.g. `-ib` to run over InfiniBand).
    pub resolve_suffix: String,
    /// Default layout of a job's filesystem; `#ODFS stripe-count`, `chunk-size` and `pool` win.
    pub stripe_count: i32,
    pub chunk_size: u32,
    /// The job's user may set layouts in their filesystem (`odfs setstripe`, the `odfs.layout`
    /// attribute); false keeps layouts to root.
    pub user_layouts: bool,
    /// Chunk data transport: tcp or quic.
    pub bulk: Transport,
    /// Storage I/O engine: auto, uring or syscall.
    pub io_backend: String,
    /// Empty chunk files each target keeps ready for new files, made while the node's CPU and disks are idle (0: off).
    pub precreate_chunk_files: usize,
    /// Chunk writes of at least this many bytes (4 KiB-aligned) go to the disk with
    /// `O_DIRECT`, past the node's page cache (0: every write through the page cache).
    pub direct_write_min_bytes: usize,
    /// stored (and the client, for its node's own chunks) drops from the node's page cache what
    /// a single sequential reader has read of a chunk file, once sent (the reader's own node
    /// caches it); false keeps every page.
    pub drop_behind_reads: bool,
    /// Port on the job's first node where its mgmtd serves Prometheus metrics (`GET /metrics`,
    /// plain HTTP, every address of the node); none by default. One job per node at a time
    /// can have it (a second one runs without metrics, logged in its mgmtd.log).
    pub metrics_port: Option<u16>,
    /// Seconds node 0 waits for every node's services and mount (and every node for node 0's
    /// word) before the start is rolled back.
    pub ready_timeout_secs: u64,
    /// Seconds a stage-in or stage-out may take before it counts as failed. Slurm's
    /// `PrologEpilogTimeout` must be longer than `ready_timeout_secs + stage_timeout_secs`.
    pub stage_timeout_secs: u64,
    /// Seconds node 0's epilog waits for the other nodes to unmount, and they for its verdict
    /// beyond `stage_timeout_secs`.
    pub stop_grace_secs: u64,
    /// Set the drain reason of a node whose prolog or epilog fails to odfs's one-line cause
    /// (`scontrol update`), and return the batch host to service from its epilog when the
    /// failure was another node's or the job's own (the batch host's prolog must fail so the
    /// batch script does not run, and Slurm drains it for that).
    pub slurm_drain_reason: bool,
}

impl Default for SiteOndemand {
    fn default() -> Self {
        SiteOndemand {
            site_key: PathBuf::from("/etc/odfs/site.key"),
            feature: "odfs".into(),
            ram_feature: "odfs_ram".into(),
            meta_feature: "odfs_meta".into(),
            meta: 1,
            data_paths: vec!["/var/lib/odfs/data".into()],
            pool: "nvme".into(),
            ram_pool: "ram".into(),
            ram_size: "25%".into(),
            state_dir: "/var/lib/odfs/jobs".into(),
            mount: "/mnt/odfs/%j".into(),
            port_base: 10000,
            port_slots: 2500,
            resolve_suffix: String::new(),
            stripe_count: odfs_proto::layout::DEFAULT_STRIPE_COUNT,
            chunk_size: odfs_proto::layout::DEFAULT_CHUNK_SIZE,
            user_layouts: true,
            bulk: Transport::Tcp,
            io_backend: "auto".into(),
            precreate_chunk_files: odfs_stored::config::DEFAULT_PRECREATE_CHUNK_FILES,
            direct_write_min_bytes: odfs_stored::config::DEFAULT_DIRECT_WRITE_MIN_BYTES,
            drop_behind_reads: true,
            metrics_port: None,
            ready_timeout_secs: 60,
            stage_timeout_secs: 3000,
            stop_grace_secs: 60,
            slurm_drain_reason: true,
        }
    }
}

/// The whole site config file.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(default, deny_unknown_fields)]
pub struct SiteConfig {
    pub ondemand: SiteOndemand,
    pub stage: SiteStage,
}

/// `%j`, `%u`, `%n` and `%%` in a configured path.
pub fn expand(pattern: &str, job: &str, user: &str, node: &str) -> String {
    let mut out = String::new();
    let mut it = pattern.chars();
    while let Some(c) = it.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match it.next() {
            Some('j') => out.push_str(job),
            Some('u') => out.push_str(user),
            Some('n') => out.push_str(node),
            Some('%') => out.push('%'),
            Some(o) => {
                out.push('%');
                out.push(o);
            }
            None => out.push('%'),
        }
    }
    out
}

impl SiteConfig {
    /// Reads the site config: `path`, else `ODFS_SITE_CONFIG`, else `/etc/odfs/site.toml`; a
    /// missing default file means every default. Unknown keys are errors naming the file.
    pub fn load(path: Option<&Path>) -> Result<(SiteConfig, PathBuf)> {
        let named = path.map(Path::to_path_buf).or_else(|| std::env::var_os("ODFS_SITE_CONFIG").map(PathBuf::from));
        let p = named.clone().unwrap_or_else(|| PathBuf::from(SITE_CONFIG));
        let text = match std::fs::read_to_string(&p) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && named.is_none() => {
                return Ok((SiteConfig::default(), p));
            }
            Err(e) => bail!("cannot read the site config {}: {e}", p.display()),
        };
        let cfg: SiteConfig =
            toml::from_str(&text).map_err(|e| anyhow::anyhow!("site config {}: {}", p.display(), e.message()))?;
        cfg.ondemand.validate().with_context(|| format!("site config {}", p.display()))?;
        Ok((cfg, p))
    }
}

impl SiteOndemand {
    pub fn validate(&self) -> Result<()> {
        anyhow::ensure!(!self.data_paths.is_empty(), "[ondemand] data_paths names no directory");
        for p in &self.data_paths {
            anyhow::ensure!(p.starts_with('/'), "[ondemand] data_paths: {p:?} is not an absolute path");
        }
        anyhow::ensure!(self.state_dir.starts_with('/'), "[ondemand] state_dir must be an absolute path");
        anyhow::ensure!(
            !self.state_dir.contains("%j") && !self.state_dir.contains("%u"),
            "[ondemand] state_dir may use %n only (it holds every job of the node)"
        );
        anyhow::ensure!(self.mount.starts_with('/'), "[ondemand] mount must be an absolute path");
        anyhow::ensure!(self.mount.contains("%j"), "[ondemand] mount must contain %j (jobs can share a node)");
        anyhow::ensure!(self.port_slots >= 1, "[ondemand] port_slots must be at least 1");
        let top = self.port_base as u32 + self.port_slots as u32 * PORTS_PER_JOB as u32;
        anyhow::ensure!(
            self.port_base >= 1024 && top <= 65536,
            "[ondemand] ports {}..{top} do not fit between 1024 and 65535",
            self.port_base
        );
        anyhow::ensure!(
            !self.ram_size.is_empty()
                && self
                    .ram_size
                    .trim_end_matches(['k', 'K', 'm', 'M', 'g', 'G', '%'])
                    .bytes()
                    .all(|b| b.is_ascii_digit()),
            "[ondemand] ram_size {:?} is not a tmpfs size (e.g. 8G or 25%)",
            self.ram_size
        );
        for (k, v) in [("feature", &self.feature), ("pool", &self.pool), ("ram_pool", &self.ram_pool)] {
            anyhow::ensure!(!v.is_empty(), "[ondemand] {k} is empty");
        }
        anyhow::ensure!(self.pool != self.ram_pool, "[ondemand] pool and ram_pool must differ");
        anyhow::ensure!(self.ready_timeout_secs >= 1, "[ondemand] ready_timeout_secs must be at least 1");
        odfs_stored::service::backend(&self.io_backend).context("[ondemand] io_backend")?;
        self.layout().validate().map_err(|e| anyhow::anyhow!("[ondemand] default layout: {e}"))?;
        Ok(())
    }

    /// The default layout of a new filesystem.
    pub fn layout(&self) -> DirLayout {
        DirLayout {
            chunk_size: self.chunk_size,
            stripe_count: self.stripe_count,
            pool: self.pool.clone(),
            start_target: None,
            local: false,
        }
    }

    /// True when the job asked for odfs (the base feature or a variant).
    pub fn wanted(&self, features: &[String]) -> bool {
        features.iter().any(|f| *f == self.feature || *f == self.ram_feature || *f == self.meta_feature)
    }

    /// First port of a job's range on every node.
    pub fn first_port(&self, job_id: &str) -> u16 {
        let n: u64 = job_id.parse().unwrap_or_else(|_| {
            // Non-numeric ids (outside Slurm): FNV-1a, stable across nodes and releases.
            job_id.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
        });
        self.port_base + (n % self.port_slots as u64) as u16 * PORTS_PER_JOB
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_print_parse_back_and_validate() {
        let text = toml::to_string_pretty(&SiteConfig::default()).unwrap();
        let back: SiteConfig = toml::from_str(&text).unwrap();
        assert_eq!(back, SiteConfig::default());
        back.ondemand.validate().unwrap();
    }

    #[test]
    fn the_shipped_example_parses_and_validates() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("site.toml");
        std::fs::write(&p, include_str!("../../../slurm/site.toml")).unwrap();
        let (cfg, _) = SiteConfig::load(Some(&p)).unwrap();
        assert_eq!(cfg.ondemand.data_paths.len(), 2);
        assert_eq!(cfg.ondemand.direct_write_min_bytes, 1 << 20, "the example states the default");
        assert!(cfg.ondemand.drop_behind_reads, "the example states the default");
        // Users' own credentials: the example turns on no shared staging account.
        assert_eq!((cfg.stage.credentials_file.as_deref(), cfg.stage.profile.as_deref()), (None, None));
    }

    #[test]
    fn bad_settings_are_named() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("site.toml");
        for (text, want) in [
            ("[ondemand]\ndata_path = [\"/x\"]\n", "unknown field"),
            ("[ondemand]\ndata_paths = [\"rel\"]\n", "not an absolute path"),
            ("[ondemand]\nmount = \"/mnt/odfs\"\n", "%j"),
            ("[ondemand]\nport_base = 60000\nport_slots = 1000\n", "do not fit"),
            ("[ondemand]\nchunk_size = 1000\n", "default layout"),
            ("[ondemand]\nram_size = \"lots\"\n", "ram_size"),
            ("[odfs]\n", "unknown field"),
        ] {
            std::fs::write(&p, text).unwrap();
            let e = format!("{:#}", SiteConfig::load(Some(&p)).unwrap_err());
            assert!(e.contains(want) && e.contains("site.toml"), "{text}: {e}");
        }
        assert!(format!("{:#}", SiteConfig::load(Some(&d.path().join("no.toml"))).unwrap_err()).contains("cannot read"));
    }

    #[test]
    fn ports_and_paths_are_per_job() {
        let s = SiteOndemand::default();
        assert_eq!(s.first_port("0"), 10000);
        assert_eq!(s.first_port("3"), 10024);
        assert_eq!(s.first_port("2503"), 10024, "ids port_slots apart share a range");
        assert_eq!(s.first_port("x"), s.first_port("x"));
        assert!(s.first_port("some-name") < 30000);
        assert_eq!(expand("/mnt/%u/%j-%n%%", "7", "ana", "n1"), "/mnt/ana/7-n1%");
    }
}
