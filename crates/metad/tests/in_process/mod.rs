//! A filesystem of one process: mgmtd's registry, one stored over a chunk store in a temporary
//! directory and one metad shard, each a router of this process served through
//! `odfs_rpc::Local`, and clients of the client library connected through the same seam. The
//! client's caches, leases, recalls and delegations run as in a mount; no daemon, socket or
//! FUSE is involved.

use odfs_client::{Client, ClientConfig};
use odfs_metad::service::router;
use odfs_metad::{MetaStore, StoreOptions};
use odfs_proto::mgmt::{GetCluster, Register, ServiceKind, TargetOffer};
use odfs_proto::RequestHeader;
use odfs_rpc::{Local, Pool, PoolConfig, SiteKey, Transport};
use odfs_service::announce;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const MGMTD: &str = "127.0.0.1:17700";
const STORED: &str = "127.0.0.1:17701";
const METAD: &str = "127.0.0.1:17702";

pub struct InProcess {
    pub local: Arc<Local>,
    pub job: odfs_service::JobSection,
    pub mgmtd: SocketAddr,
}

impl InProcess {
    /// Starts the services over `dir` (chunks, metadata, the site key); the root directory is
    /// made with `root_mode`.
    pub async fn start(dir: &Path, root_mode: u32) -> InProcess {
        let key = dir.join("site.key");
        SiteKey::generate().write_new(&key).unwrap();
        let job = odfs_service::JobSection { id: "model".into(), site_key: key };
        let local = Arc::new(Local::default());
        let (mgmtd, stored, metad): (SocketAddr, SocketAddr, SocketAddr) =
            (MGMTD.parse().unwrap(), STORED.parse().unwrap(), METAD.parse().unwrap());
        // No heartbeats are sent here: a service is never taken for dead within a test.
        let mcfg = odfs_mgmtd::MgmtdConfig { heartbeat_ms: 3_600_000, ..odfs_mgmtd::MgmtdConfig::default() };
        local.serve(mgmtd, odfs_mgmtd::service::router(Arc::new(odfs_mgmtd::registry::Registry::new(&mcfg))));
        let pool = Arc::new(pool(&job, &local));
        let h = RequestHeader::default();

        std::fs::create_dir_all(dir.join("chunks")).unwrap();
        let targets = [odfs_stored::TargetConfig { id: 1, path: dir.join("chunks") }];
        let chunks = odfs_stored::ChunkStore::open(&targets, odfs_stored::IoBackend::Syscall).unwrap();
        let offer = TargetOffer { id: 1, pool: "default".into(), space: chunks.space(1).unwrap(), path: None };
        local.serve(stored, odfs_stored::service::router(chunks));
        let reg =
            Register { bulk_addr: Some(stored), targets: vec![offer], ..announce(ServiceKind::Storage, 0, stored) };
        pool.call(mgmtd, Transport::Quic, &h, &reg).await.unwrap();

        let view = pool.call(mgmtd, Transport::Quic, &h, &GetCluster {}).await.unwrap();
        let opts = StoreOptions { lease: Duration::from_secs(30), ..StoreOptions::default() };
        let mut store = MetaStore::open(&dir.join("meta"), opts, view.default_layout.clone()).unwrap();
        store.set_root_owner(0, 0, root_mode).unwrap();
        let store = Arc::new(Mutex::new(store));
        let coord = odfs_metad::Coordinator::new(pool.clone(), mgmtd, store.clone());
        local.serve(metad, router(store, coord.clone()));
        let reg = Register { shard: Some(0), bulk_addr: Some(metad), ..announce(ServiceKind::Meta, 0, metad) };
        pool.call(mgmtd, Transport::Quic, &h, &reg).await.unwrap();
        coord.refresh().await.unwrap();
        InProcess { local, job, mgmtd }
    }

    /// A client with caches on (leases, recalls and create delegations as a mount has them).
    pub async fn client(&self) -> Client {
        let cfg = ClientConfig {
            job: self.job.clone(),
            mgmtd: self.mgmtd,
            local_reads: false,
            splice_reads: false,
            ..ClientConfig::default()
        };
        assert!(cfg.attr_cache_ms > 0, "the default client caches");
        Client::connect_over(cfg, Arc::new(pool(&self.job, &self.local))).await.unwrap()
    }
}

fn pool(job: &odfs_service::JobSection, local: &Arc<Local>) -> Pool {
    let cfg =
        PoolConfig { call_timeout: Duration::from_secs(30), retry_deadline: Duration::from_secs(5), conns_per_peer: 1 };
    Pool::new(job.credential().unwrap(), cfg).unwrap().with_local(local.clone())
}
